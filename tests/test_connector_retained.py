"""Decode-retained store: TTL, LRU bound, use count and index mirroring against a plain oracle with a fake clock."""

from __future__ import annotations

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from connector.params import parse_params
from connector.retained import RetainedStore
from kvindex.reference import KVBlockIndex
from kvindex.keys import TokenProcessor
from kvindex.tiers import DECODE_RETAINED, GPU, TierWeights, tier_bit
from scorer.prefix import score_prefix

BS = 4


def d_params(n_tokens: int, req: str = "r") -> object:
    return parse_params(
        {
            "do_remote_prefill": False,
            "do_remote_decode": True,
            "remote_block_ids": [list(range(-(-n_tokens // BS)))],
            "remote_engine_id": "eng-d",
            "remote_request_id": req,
            "remote_host": "127.0.0.1",
            "remote_port": 5600,
            "remote_num_tokens": n_tokens,
            "remote_blocks_expiry_time": 1.0,
            "transfer_mode": "pull",
        }
    )


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


CIDS = st.sampled_from(["c0", "c1", "c2", "c3", "c4"])
PODS = st.sampled_from(["d0", "d1"])


class StoreMachine(RuleBasedStateMachine):
    """Oracle: a dict cid -> [pod, keys, expiry, uses_left, last_use_counter]; expiry and LRU recomputed by brute force."""

    def __init__(self) -> None:
        super().__init__()
        self.clock = Clock()
        self.tp = TokenProcessor(block_size=BS)
        self.index = KVBlockIndex(self.tp, clock=self.clock)
        self.max_entries = 3
        self.max_uses = 2
        self.ttl = 10.0
        self.store = RetainedStore(
            self.index, ttl=self.ttl, max_entries=self.max_entries, max_uses=self.max_uses, clock=self.clock
        )
        self.model: dict[str, list] = {}
        self.tick = 0

    def _expire(self) -> None:
        for cid in [c for c, e in self.model.items() if e[2] <= self.clock.t]:
            del self.model[cid]

    def _touch(self, cid: str) -> None:
        self.tick += 1
        self.model[cid][4] = self.tick

    @rule(cid=CIDS, pod=PODS, toks=st.lists(st.integers(0, 5), min_size=0, max_size=14))
    def put(self, cid, pod, toks):
        self._expire()
        keys = self.tp.request_keys(toks).tolist()
        self.store.put(cid, pod, d_params(len(toks)), toks, keys)
        self.model.pop(cid, None)
        self.model[cid] = [pod, keys, self.clock.t + self.ttl, self.max_uses, 0]
        self._touch(cid)
        while len(self.model) > self.max_entries:
            oldest = min(self.model, key=lambda c: self.model[c][4])
            del self.model[oldest]

    @rule(cid=CIDS)
    def take(self, cid):
        self._expire()
        got = self.store.take(cid)
        want = self.model.get(cid)
        assert (got is None) == (want is None)
        if want is not None:
            assert got.uses_left == want[3]
            assert list(got.request_keys) == want[1]
            if want[3] <= 1:
                del self.model[cid]
            else:
                want[3] -= 1
                self._touch(cid)

    @rule(cid=CIDS)
    def get(self, cid):
        self._expire()
        got = self.store.get(cid)
        assert (got is None) == (cid not in self.model)
        if got is not None:
            assert got.decode_pod == self.model[cid][0]
            self._touch(cid)

    @rule(cid=CIDS)
    def discard(self, cid):
        self._expire()
        assert self.store.discard(cid) == (cid in self.model)
        self.model.pop(cid, None)

    @rule(dt=st.sampled_from([0.0, 0.5, 3.0, 9.999, 10.0, 25.0]))
    def advance(self, dt):
        self.clock.t += dt

    @invariant()
    def same_entries_and_index_mirror(self):
        self._expire()
        assert sorted(self.store.conversations()) == sorted(self.model)
        assert self.store.conversations() == sorted(self.model, key=lambda c: self.model[c][4])
        # the index holds exactly the live entries' keys under decode_retained, per pod
        rb = tier_bit(DECODE_RETAINED)
        for pod in ("d0", "d1"):
            want: dict[int, int] = {}
            for p, keys, *_ in self.model.values():
                if p == pod:
                    for k in keys:
                        want[k] = want.get(k, 0) + 1
            held = {k for k, m in self.index._held_mask.get(pod, {}).items() if m & rb}
            assert held == set(want)


TestStoreMachine = StoreMachine.TestCase
TestStoreMachine.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)


def test_expired_entry_gone_exactly_at_ttl_and_scored_meanwhile():
    clock = Clock()
    tp = TokenProcessor(block_size=BS)
    index = KVBlockIndex(tp, clock=clock)
    store = RetainedStore(index, ttl=450.0, clock=clock)
    toks = list(range(10))
    keys = tp.request_keys(toks)
    store.put("c", "d0", d_params(10), toks + [99], keys)
    assert store.get("c").tokens == tuple(toks)
    # the scorer sees the retained blocks on d0 with the decode_retained weight
    s = score_prefix(index, keys, ["d0", "p0"], block_size=BS, weights=TierWeights())
    assert s["d0"].matched_blocks == 2 and s["d0"].best_tier == DECODE_RETAINED
    assert s["d0"].weighted_blocks == pytest.approx(2 * TierWeights().weight(DECODE_RETAINED))
    assert s["p0"].matched_blocks == 0
    clock.t += 449.999
    assert "c" in store
    clock.t += 0.001
    assert "c" not in store
    assert store.stats().expired == 1
    assert score_prefix(index, keys, ["d0"], block_size=BS)["d0"].matched_blocks == 0


def test_validation():
    with pytest.raises(ValueError):
        RetainedStore(ttl=0)
    with pytest.raises(ValueError):
        RetainedStore(max_entries=0)
    with pytest.raises(ValueError):
        RetainedStore(max_uses=0)
    s = RetainedStore()
    with pytest.raises(ValueError):
        s.put("c", "d", d_params(10), list(range(5)), [])
    p_answer = parse_params({**d_params(4).to_dict(), "do_remote_prefill": True, "do_remote_decode": False})
    with pytest.raises(ValueError):
        s.put("c", "d", p_answer, list(range(4)), [])


def test_index_held_refcount_and_clear():
    tp = TokenProcessor(block_size=BS)
    index = KVBlockIndex(tp)
    keys = tp.request_keys(list(range(8))).tolist()
    index.add_held("d0", keys, DECODE_RETAINED)
    index.add_held("d0", keys[:1], DECODE_RETAINED)
    assert index.pods() == {"d0"}
    assert index.lookup(keys[:1])[0][0].tier == DECODE_RETAINED
    assert index.remove_held("d0", keys, DECODE_RETAINED) == 1  # keys[0] still held once
    assert index.prefix_match(keys) == {"d0": [tier_bit(DECODE_RETAINED)]}
    # a real gpu copy and a held copy combine in the mask
    index.block_stored("d0", 0, [11, 12], None, list(range(8)), GPU, block_size=BS)
    assert index.prefix_match(keys)["d0"] == [tier_bit(GPU) | tier_bit(DECODE_RETAINED), tier_bit(GPU)]
    index.clear("d0")
    assert index.prefix_match(keys) == {}
    assert index.remove_held("d0", keys, DECODE_RETAINED) == 0
