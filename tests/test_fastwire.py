"""When the pool applies a fast-decoded batch as such, and when it goes the reference way.

The fast path is taken only for the compiled index, with nothing looking at
the batch's events (store observers, the configuration check) and, for a
GroupAware index, no KV-cache group but a full-attention one for the stream.
Either way the index ends the same (tests/test_fastwire_fuzz.py).
"""

from __future__ import annotations

import msgspec
import pytest

pytest.importorskip("kvindex._native")

from kvevents.pool import EventPool, RawMessage, Source  # noqa: E402
from kvindex.contract import GroupAware  # noqa: E402
from kvindex.hybrid import GroupSpec  # noqa: E402
from kvindex.keys import TokenProcessor  # noqa: E402
from kvindex.native import NativeKVBlockIndex  # noqa: E402

BS = 4


class Counting(NativeKVBlockIndex):
    """The compiled index, counting the batches it was given each way."""

    def __init__(self) -> None:
        super().__init__(TokenProcessor(block_size=BS))
        self.raw = self.decoded = 0

    def apply_raw(self, *a, **kw):
        self.raw += 1
        return super().apply_raw(*a, **kw)

    def apply_events(self, *a, **kw):
        self.decoded += 1
        return super().apply_events(*a, **kw)


class Grouped(Counting):
    """As if GroupAware (hybrid models): reports ``specs`` for every stream."""

    specs: dict[int, GroupSpec] = {}

    def group_specs(self, pod, dp_rank=0, *, model=None):
        self.asked = getattr(self, "asked", 0) + 1
        return dict(self.specs)

    def distrust_reports(self, pod, dp_rank=0, *, model=None, seconds=30.0):
        pass

    def group_match(self, request_keys, pod, dp_rank=0, *, model=None):
        return {}


def store(seq: int, n: int = 2, **extra) -> RawMessage:
    ev = {"type": "BlockStored", "block_hashes": [seq * 10 + i for i in range(n)],
          "parent_block_hash": seq * 10 - 9 if seq else None, "token_ids": list(range(n * BS)), "block_size": BS,
          **extra}
    payload = msgspec.msgpack.encode([float(seq), [ev], 0])
    return RawMessage(Source(pod="p"), b"kv@p@m", seq.to_bytes(8, "big"), payload)


def run(ix: Counting, msgs: list[RawMessage], **kw) -> EventPool:
    pool = EventPool(ix, concurrency=1, **kw)
    with pool:
        for m in msgs:
            pool.submit(m)
        assert pool.flush(10)
    return pool


def test_plain_batches_are_applied_raw_after_the_configuration_check():
    ix = Counting()
    pool = run(ix, [store(s) for s in range(5)])
    # the first store is looked at by the block-size check (decoded), the others go raw
    assert (ix.decoded, ix.raw) == (1, 4)
    assert pool.stats().blocks_stored == 10 and len(ix) == 10


def test_fast_path_off_and_unplain_batches_go_the_reference_way():
    ix = Counting()
    run(ix, [store(s) for s in range(3)], fast_path=False)
    assert (ix.decoded, ix.raw) == (3, 0)
    ix = Counting()
    run(ix, [store(0)] + [store(s, lora_name="a") for s in range(1, 3)])
    assert ix.raw == 0


def test_a_store_observer_sees_decoded_events():
    ix = Counting()
    seen = []
    pool = EventPool(ix, concurrency=1)
    pool.add_store_observer(lambda pod, rank, model, ev: seen.append(ev.block_hashes))
    with pool:
        for s in range(3):
            pool.submit(store(s))
        assert pool.flush(10)
    assert ix.raw == 0 and seen == [(0, 1), (10, 11), (20, 21)]


@pytest.mark.parametrize("specs, raw", [
    ({}, True),
    ({0: GroupSpec(0, "full_attention", BS)}, True),
    ({0: GroupSpec(0, "full_attention", BS), 1: GroupSpec(1, "sliding_window", BS, 64)}, False),
    ({0: GroupSpec(0, "mamba", BS)}, False),
])
def test_a_group_aware_index_with_hybrid_groups_gets_decoded_events(specs, raw):
    ix = Grouped()
    ix.specs = specs
    assert isinstance(ix, GroupAware)
    run(ix, [store(s) for s in range(5)])
    assert (ix.raw > 0) is raw
    assert ix.asked == 1  # once per stream (nothing cleared it, nothing went the reference way since)
    # a batch carrying group fields goes the reference way on a GroupAware index
    ix = Grouped()
    run(ix, [store(0)] + [store(s, group_idx=0) for s in range(1, 4)])
    assert ix.raw == 0


@pytest.mark.parametrize("specs, raw", [
    ({0: GroupSpec(0, "full_attention", BS)}, True),  # learned: group 0 full attention, as every vLLM 0.32 store says
    ({0: GroupSpec(0, "full_attention", BS), 1: GroupSpec(1, "sliding_window", BS, 64)}, False),
    ({1: GroupSpec(1, "full_attention", BS)}, False),
    ({0: GroupSpec(0, "full_attention", 2 * BS)}, False),
])
def test_a_batch_naming_group_0_goes_raw_once_the_stream_learned_exactly_that(specs, raw):
    ix = Grouped()
    ix.specs = specs
    run(ix, [store(s, group_idx=0, kv_cache_spec_kind="full_attention") for s in range(5)])
    assert (ix.raw > 0) is raw
