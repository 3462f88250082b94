"""The one-pass payload reader (kvindex._native.decode_raw_payload) held to the msgspec structures.

kvevents.fastwire tries the one-pass reader first and falls back to its
msgspec structures: whatever the reader takes, the msgspec path must take too,
into the same batch (ts, rank, events, flags).  The reference decoder is held
to both by tests/test_fastwire_fuzz.py.
"""

from __future__ import annotations

import math

import msgspec
import pytest
from hypothesis import given
from hypothesis import strategies as st

pytest.importorskip("kvindex._native")

from kvindex._native import decode_raw_payload, read_raw_batch  # noqa: E402
from kvevents import fastwire  # noqa: E402
from tests.test_fastwire_fuzz import FUZZ, hostile, payloads  # noqa: E402

enc = msgspec.msgpack.encode


def msgspec_way(payload: bytes):
    """fastwire's msgspec structures alone: (ts, rank, RawBatch) or None."""
    for dec, (st_, rm, cl) in fastwire._FORMS:
        try:
            b = dec.decode(payload)
        except Exception:
            continue
        if not math.isfinite(b.ts):
            return None
        raw = read_raw_batch(b.events, st_, rm, cl, fastwire._MEDIUM_BITS)
        return None if raw is None else (b.ts, b.rank, raw)
    return None


def same(payload: bytes):
    """The reader takes a payload only when the msgspec way takes it into the same batch."""
    got = decode_raw_payload(payload, fastwire._MEDIUM_BITS)
    if got is None:
        return None
    want = msgspec_way(payload)
    assert want is not None, payload
    assert (got[0], got[1]) == (want[0], want[1])
    assert type(got[1]) is type(want[1])
    a, b = got[2], want[2]
    assert (len(a), a.resets, a.grouped) == (len(b), b.resets, b.grouped)
    assert a.contents() == b.contents()
    return got


@FUZZ
@given(payloads())
def test_real_shapes_read_as_msgspec(payload):
    same(payload)


@FUZZ
@given(hostile())
def test_hostile_payloads_read_as_msgspec_or_not_at_all(payload):
    same(payload)


@FUZZ
@given(st.binary(max_size=120))
def test_random_bytes(payload):
    same(payload)


def stored_map(**kw):
    ev = {"type": "BlockStored", "block_hashes": [5, 6], "parent_block_hash": None,
          "token_ids": list(range(8)), "block_size": 4, "medium": "GPU"}
    ev.update(kw)
    return ev


@pytest.mark.parametrize("payload", [
    enc([1.0, [stored_map()], 0]),
    enc([1.0, [stored_map(group_idx=0, kv_cache_spec_kind="full_attention")]]),
    enc([1.0, [["BlockStored", [5, 6], 7, list(range(8)), 4, None, "CPU"]], None]),
    enc([1.0, [{"type": "BlockRemoved", "block_hashes": [5]}, {"type": "AllBlocksCleared"}], 2]),
    enc([1.0, [["BlockRemoved", [5], "GPU", 0], ["AllBlocksCleared"]], 1]),
    enc([1.0, []]),
])
def test_plain_shapes_are_taken(payload):
    """The shapes engines send are read in one pass (not all left to msgspec)."""
    assert same(payload) is not None


@pytest.mark.parametrize("payload", [
    enc([1, [stored_map()], 0]),  # an int ts: msgspec's to decide
    enc([float("nan"), [stored_map()], 0]),
    enc([1.0, [stored_map()], -1]),
    enc([1.0, [stored_map()], 0, "extra"]),
    enc([1.0, [stored_map(lora_name="a")], 0]),
    enc([1.0, [stored_map(group_idx=1)], 0]),
    enc([1.0, [stored_map(kv_cache_spec_kind="mamba")], 0]),
    enc([1.0, [stored_map(medium="NVMe")], 0]),
    enc([1.0, [stored_map(token_ids=list(range(7)))], 0]),
    enc([1.0, [stored_map(token_ids=[])], 0]),
    enc([1.0, [stored_map(block_size=0)], 0]),
    enc([1.0, [stored_map(future=1)], 0]),
    enc([1.0, [stored_map(), ["AllBlocksCleared"]], 0]),  # two forms in one batch
    enc([1.0, [{"type": "AllBlocksCleared", "medium": None}], 0]),
    enc([1.0, [stored_map()], 0]) + b"\x00",  # trailing bytes
])
def test_other_shapes_are_declined(payload):
    assert decode_raw_payload(payload, fastwire._MEDIUM_BITS) is None


def test_a_repeated_key_is_declined():
    body = enc(stored_map())
    # the same "block_size" key twice: fixmap count + 1, the pair appended
    dup = bytes([body[0] + 1]) + body[1:] + enc("block_size") + enc(4)
    assert decode_raw_payload(b"\x93" + enc(1.0) + b"\x91" + dup + b"\x00", fastwire._MEDIUM_BITS) is None
