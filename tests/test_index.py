"""KVBlockIndex: the tiny cases that must hold, orphans, speculative entries, capacity."""

from __future__ import annotations

import pytest

from kvindex.contract import PodEntry
from kvindex.reference import KVBlockIndex
from kvindex.keys import TokenProcessor
from kvindex.tiers import CPU, GPU, STORAGE, tier_bit

BS = 4
TOKENS = list(range(100, 132))  # 8 blocks of 4


def tp() -> TokenProcessor:
    return TokenProcessor(block_size=BS, hash_seed=7)


def keys(tokens=TOKENS):
    return [int(k) for k in tp().request_keys(tokens)]


def store_path(ix, pod, rank, blocks, tier=GPU, start=0, ek_base=1000):
    """Store blocks [start, start+blocks) of TOKENS with engine keys ek_base+i."""
    parent = None if start == 0 else ek_base + start - 1
    eks = [ek_base + i for i in range(start, start + blocks)]
    return ix.block_stored(pod, rank, eks, parent, TOKENS[start * BS : (start + blocks) * BS], tier, block_size=BS)


def test_event_keys_equal_request_keys():
    ix = KVBlockIndex(tp())
    assert store_path(ix, "a", 0, 3) == 3
    assert store_path(ix, "a", 0, 2, start=3) == 2
    assert ix.prefix_match(keys()) == {"a": [tier_bit(GPU)] * 5}
    assert [ix.request_key_of(1000 + i) for i in range(5)] == keys()[:5]


def test_two_dp_ranks_same_hash_remove_one():
    # (a) two DP ranks under one pod store the same hash; removing it on rank 1 leaves rank 0's entry
    ix = KVBlockIndex(tp())
    store_path(ix, "p", 0, 2)
    store_path(ix, "p", 1, 2)
    k = keys()[:2]
    assert ix.lookup(k[:1]) == [(PodEntry("p", GPU, 0), PodEntry("p", GPU, 1))]
    assert ix.block_removed("p", 1, [1000], GPU) == 1
    assert ix.lookup(k[:1]) == [(PodEntry("p", GPU, 0),)]
    assert ix.prefix_match(k) == {"p": [tier_bit(GPU)] * 2}
    assert ix.block_removed("p", 0, [1000], GPU) == 1
    assert ix.prefix_match(k) == {}
    assert ix.lookup(k[1:]) == [(PodEntry("p", GPU, 0), PodEntry("p", GPU, 1))]


def test_all_blocks_cleared_leaves_other_pods():
    # (b) AllBlocksCleared on one pod leaves other pods untouched
    ix = KVBlockIndex(tp())
    store_path(ix, "a", 0, 4)
    store_path(ix, "b", 0, 3)
    assert ix.clear("a", 0) == 4
    assert ix.prefix_match(keys()) == {"b": [tier_bit(GPU)] * 3}
    assert ix.pods() == frozenset({"b"})
    assert ix.pod_keys("a") == set()
    assert ix.pod_keys("b") == set(keys()[:3])


def test_tokenless_cpu_store_then_gpu_removed():
    # (c) a token-less CPU BlockStored after a GPU one gives the block both tiers,
    # and a GPU BlockRemoved then leaves the cpu entry
    ix = KVBlockIndex(tp())
    store_path(ix, "a", 0, 2)
    assert ix.block_stored("a", 0, [1000, 1001], None, [], CPU) == 2
    k = keys()[:2]
    both = tier_bit(GPU) | tier_bit(CPU)
    assert ix.prefix_match(k) == {"a": [both, both]}
    ix.block_removed("a", 0, [1000, 1001], GPU)
    assert ix.lookup(k) == [(PodEntry("a", CPU, 0),)] * 2
    assert ix.prefix_match(k) == {"a": [tier_bit(CPU)] * 2}


def test_tokenless_unknown_is_counted():
    ix = KVBlockIndex(tp())
    assert ix.block_stored("a", 0, [5], None, None, CPU) == 0
    assert ix.stats().unknown_offloads == 1
    assert len(ix) == 0


def test_orphans_attach_when_parent_arrives():
    ix = KVBlockIndex(tp())
    # blocks 2..3 arrive before blocks 0..1 (e.g. the first event was lost and replayed later)
    assert store_path(ix, "a", 0, 2, start=2) == 0
    assert ix.stats().orphan_blocks == 2
    assert ix.prefix_match(keys()) == {}
    assert store_path(ix, "a", 0, 2, start=0) == 4
    st = ix.stats()
    assert (st.orphan_blocks, st.orphans, st.orphans_attached) == (0, 2, 2)
    assert ix.prefix_match(keys()) == {"a": [tier_bit(GPU)] * 4}


def test_orphan_parent_from_another_pod():
    # engines with the same hash seed share engine keys: pod b's parent is known from pod a
    ix = KVBlockIndex(tp())
    store_path(ix, "a", 0, 2)
    assert store_path(ix, "b", 0, 2, start=2) == 2
    assert ix.prefix_match(keys(), ["b"]) == {}
    assert ix.lookup(keys()[2:3]) == [(PodEntry("b", GPU, 0),)]


def test_orphan_bound_drops_oldest():
    ix = KVBlockIndex(tp(), max_orphan_blocks=3)
    store_path(ix, "a", 0, 2, start=2)
    store_path(ix, "a", 0, 2, start=5)
    st = ix.stats()
    assert st.orphan_blocks == 2 and st.orphans_dropped == 2
    ix.clear("a")
    assert ix.stats().orphan_blocks == 0


def test_capacity_evicts_least_recently_used():
    ix = KVBlockIndex(tp(), capacity=4)
    store_path(ix, "a", 0, 4)
    k = keys()
    ix.prefix_match(k[:1])  # touch block 0: it becomes the most recent
    store_path(ix, "a", 0, 1, start=4)
    assert len(ix) == 4
    assert ix.stats().evictions == 1
    assert ix.lookup(k[1:2]) == [()]  # block 1 was the least recently used
    assert ix.lookup(k[:1]) == [(PodEntry("a", GPU, 0),)]
    assert ix.prefix_match(k) == {"a": [tier_bit(GPU)]}
    # the evicted block's engine key is gone from level 2 too
    assert ix.request_key_of(1001) is None
    assert ix.block_removed("a", 0, [1001], GPU) == 0


def test_tier_weights_order_and_storage():
    ix = KVBlockIndex(tp())
    store_path(ix, "a", 0, 1, tier=STORAGE)
    assert ix.lookup(keys()[:1]) == [(PodEntry("a", STORAGE, 0),)]


def test_speculative_counts_until_confirmed_or_expired():
    now = [100.0]
    ix = KVBlockIndex(tp(), clock=lambda: now[0])
    k = keys()[:3]
    ix.add_speculative(k, "a", ttl=2.0)
    assert ix.prefix_match(k) == {"a": [tier_bit(GPU)] * 3}
    assert ix.lookup(k[:1]) == [(PodEntry("a", GPU, 0, True),)]
    store_path(ix, "a", 0, 1)  # confirms block 0
    assert ix.stats().speculative_confirmed == 1
    assert ix.lookup(k[:1]) == [(PodEntry("a", GPU, 0, False),)]
    now[0] = 102.5
    assert ix.prefix_match(k) == {"a": [tier_bit(GPU)]}
    assert ix.stats().speculative_expired == 2
    assert ix.stats().speculative == 0
    with pytest.raises(ValueError):
        ix.add_speculative(k, "a", ttl=0)


def test_prefix_match_candidates_and_gaps():
    ix = KVBlockIndex(tp())
    store_path(ix, "a", 0, 3)
    # pod b holds blocks 0 and 2 but not 1: only block 0 counts
    ix.block_stored("b", 0, [1000], None, TOKENS[:4], GPU, block_size=BS)
    ix.block_stored("b", 0, [1002], 1001, TOKENS[8:12], GPU, block_size=BS)
    k = keys()
    assert ix.prefix_match(k, ["b"]) == {"b": [tier_bit(GPU)]}
    assert ix.prefix_match(k, ["a", "c"]) == {"a": [tier_bit(GPU)] * 3}
    assert ix.prefix_match(k, []) == {}
    assert ix.prefix_match([]) == {}


def test_bad_events_raise_value_error_and_leave_index():
    ix = KVBlockIndex(tp())
    with pytest.raises(ValueError):
        ix.block_stored("a", 0, [1], None, TOKENS[:4], GPU, block_size=8)
    with pytest.raises(ValueError):
        ix.block_stored("a", 0, [1, 2], None, TOKENS[:4], GPU, block_size=BS)
    assert len(ix) == 0 and ix.stats().stored_blocks == 0


def test_engine_compatible_mode_uses_engine_keys():
    ix = KVBlockIndex(TokenProcessor(block_size=BS, algorithm="vllm_sha256_cbor"))
    rk = [int(x) for x in ix.token_processor.request_keys(TOKENS[:8])]
    ix.block_stored("a", 0, rk, None, TOKENS[:8], GPU, block_size=BS)
    assert ix.prefix_match(rk) == {"a": [tier_bit(GPU)] * 2}
    # a token-less store with a parent we never saw is still placed: keys are self-contained
    ix.block_stored("b", 0, rk[1:], rk[0], None, CPU)
    assert ix.lookup(rk[1:]) == [(PodEntry("a", GPU, 0), PodEntry("b", CPU, 0))]
    ix.clear("a")
    assert ix.prefix_match(rk) == {}


def test_block_removed_while_waiting_for_parent_is_not_attached():
    ix = KVBlockIndex(tp())
    store_path(ix, "a", 0, 3, start=2)  # blocks 2..4 wait for block 1
    assert ix.block_removed("a", 0, [1003], GPU) == 1  # the engine evicts block 3 meanwhile
    assert ix.block_removed("a", 0, [1003], GPU) == 0
    assert ix.stats().unknown_removals == 1
    assert store_path(ix, "a", 0, 2) == 4  # blocks 0, 1 and the waiting 2 and 4
    k = keys()
    assert [bool(e) for e in ix.lookup(k[:5])] == [True, True, True, False, True]
    assert ix.prefix_match(k) == {"a": [tier_bit(GPU)] * 3}
    assert ix.stats().orphans_attached == 2


def test_best_dp_rank_is_the_rank_with_the_longest_prefix():
    ix = KVBlockIndex(tp())
    store_path(ix, "p", 0, 2)
    store_path(ix, "p", 1, 4)
    k = keys()
    assert ix.best_dp_rank("p", k) == 1
    assert ix.best_dp_rank("p", k[:2]) == 0  # a tie goes to the lower rank
    assert ix.best_dp_rank("q", k) is None
    ix.block_removed("p", 1, [1000], GPU)  # rank 1 loses block 0: rank 0 has the only prefix
    assert ix.best_dp_rank("p", k) == 0
