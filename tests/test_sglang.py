"""SGLang adapter: payloads built by a test-side encoder that follows SGLang's
layout (python/sglang/srt/disaggregation/kv_events.py: positional events
tagged by their first element, ``[ts, events, attn_dp_rank]`` batches,
``StorageMedium`` values, ``BlockStoredWithMetadata`` with a trailing
``{"cache_salt": ...}`` map, signed int64 block hashes, one page per
BlockStored) decode to the expected domain events.
"""

from __future__ import annotations

import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvevents.events import AllBlocksCleared, BlockRemoved, BlockStored, EventBatch
from kvevents.sglang import decode_sglang_batch, split_sglang_topic
from kvevents.wire import PayloadError

enc = msgspec.msgpack.encode
U64 = 2**64
TIERS = {None: "gpu", "GPU": "gpu", "CPU_PINNED": "cpu", "DISK": "storage", "EXTERNAL": "external"}

int64 = st.integers(-(2**63), 2**63 - 1)


def u64(h: int) -> int:
    return h % U64


@st.composite
def sgl_stored(draw):
    page = draw(st.integers(1, 64))
    n_tok = draw(st.integers(1, page))  # the last page of a node may be short
    toks = draw(st.lists(st.integers(0, 2**31), min_size=n_tok, max_size=n_tok))
    h = draw(int64)
    parent = draw(st.none() | int64)
    medium = draw(st.sampled_from([None, "GPU", "CPU_PINNED", "DISK", "EXTERNAL"]))
    salt = draw(st.none() | st.text(max_size=8))
    lora_id = draw(st.none() | st.integers(0, 100))
    bigram = draw(st.booleans())
    wire_toks = [[t, t + 1] for t in toks] if bigram else toks
    # SGLang layout: [tag, block_hashes, parent, token_ids, block_size, lora_id, medium, metadata?]
    layout = draw(st.sampled_from(["no_medium", "medium", "full"]))
    ev = ["BlockStored", [h], parent, wire_toks, n_tok, lora_id]
    if layout != "no_medium" or medium is not None or salt is not None:
        ev.append(medium)
    if salt is not None:
        ev.append({"cache_salt": salt})
    expected = BlockStored(
        (u64(h),), None if parent is None else u64(parent), tuple(toks), n_tok,
        TIERS[medium], lora_id=lora_id, cache_salt=salt,
    )
    return ev, expected


@st.composite
def sgl_removed(draw):
    h = draw(int64)
    medium = draw(st.sampled_from([None, "GPU", "CPU_PINNED", "DISK", "EXTERNAL"]))
    ev = ["BlockRemoved", [h]]
    if medium is not None or draw(st.booleans()):
        ev.append(medium)
    return ev, BlockRemoved((u64(h),), TIERS[medium])


sgl_event = st.one_of(sgl_stored(), sgl_removed(), st.just((["AllBlocksCleared"], AllBlocksCleared())))


@settings(max_examples=200, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(sgl_event, max_size=8), st.floats(0, 2e9), st.none() | st.integers(0, 64), st.booleans())
def test_sglang_layout_decodes(evs, ts, rank, omit_rank):
    items = [e for e, _ in evs]
    payload = enc([ts, items] if (rank is None and omit_rank) else [ts, items, rank])
    assert decode_sglang_batch(payload) == EventBatch(ts, tuple(x for _, x in evs), rank)


@settings(max_examples=100)
@given(st.lists(sgl_event, max_size=6))
def test_sglang_map_form_decodes_the_same(evs):
    # A SGLang publishing tagged maps (vLLM-style) must give the same events.
    items = []
    for ev, _ in evs:
        names = ["block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium"]
        if ev[0] == "BlockRemoved":
            names = ["block_hashes", "medium"]
        m = {"type": ev[0], **dict(zip(names, ev[1:]))}
        if ev[0] == "BlockStored" and len(ev) > 7:
            m["cache_salt"] = ev[7]["cache_salt"]
        items.append(m)
    arr = decode_sglang_batch(enc([1.0, [e for e, _ in evs], 0]))
    assert decode_sglang_batch(enc([1.0, items, 0])) == arr
    assert arr.events == tuple(x for _, x in evs)


def test_sglang_chain_of_pages_and_session_id():
    # Two pages of one radix node: the second page's parent is the first's hash.
    h1, h2 = -123, 2**62
    p = enc([10.0, [
        ["BlockStored", [h1], None, [1, 2, 3, 4], 4, None, "GPU"],
        ["BlockStored", [h2], h1, [5, 6], 2, None, "GPU"],
        {"type": "BlockStored", "block_hashes": [7], "parent_block_hash": h2, "token_ids": [9],
         "block_size": 1, "lora_id": None, "session_id": "s", "cache_salt": "c", "x-future": 1},
        ["BlockRemoved", [h1], "CPU_PINNED"],
    ], 2])
    b = decode_sglang_batch(p)
    assert b.dp_rank == 2
    assert b.events == (
        BlockStored((U64 - 123,), None, (1, 2, 3, 4), 4, "gpu"),
        BlockStored((2**62,), U64 - 123, (5, 6), 2, "gpu"),
        BlockStored((7,), 2**62, (9,), 1, "gpu", session_id="s", cache_salt="c"),
        BlockRemoved((U64 - 123,), "cpu"),
    )


def test_sglang_oldest_layout_without_rank_or_medium():
    p = enc([1.5, [["BlockStored", [5], None, [1, 2], 2, None], ["BlockRemoved", [5]]]])
    assert decode_sglang_batch(p) == EventBatch(
        1.5, (BlockStored((5,), None, (1, 2), 2, "gpu"), BlockRemoved((5,), "gpu")), None
    )


@pytest.mark.parametrize(
    ("event", "kind"),
    [
        (["BlockStored", [1], None, [1, 2, 3], 2, None, "GPU"], "token_ids"),
        (["BlockStored", [1], None, [[1, 2, 3]], 1, None, "GPU"], "token_ids"),
        (["BlockStored", [1], None, [[1]], 1, None, "GPU"], "token_ids"),
        (["BlockStored", [1], None, [1], 0, None, "GPU"], "block_size"),
        (["BlockStored", [1], None, [1], 1, None, "GPU", "salt-not-a-map"], "schema"),
        (["BlockStored", [1], None, [1], 1, None, "GPU", {"cache_salt": 3}], "schema"),
        (["BlockStored", [1], None, [-1], 1, None, "GPU"], "schema"),
        (["BlockRemoved", [b""]], "hash"),
        (["BlockRemoved", [1], 3], "schema"),
    ],
)
def test_sglang_invalid_events(event, kind):
    """A malformed event is left out and listed by kind; the valid events beside it are kept in order."""
    b = decode_sglang_batch(enc([1.0, [["AllBlocksCleared"], event, ["AllBlocksCleared"]], 0]))
    assert b.bad_events == (kind,)
    assert b.events == (AllBlocksCleared(), AllBlocksCleared())


def test_sglang_unknown_event_type_is_skipped():
    b = decode_sglang_batch(enc([1.0, [["KVSnapshotMarker", 1], ["AllBlocksCleared"]], 0]))
    assert b.events == (AllBlocksCleared(),)
    assert b.skipped_events == 1


@pytest.mark.parametrize(
    ("topic", "expected"),
    [
        (b"kv@p@m", (b"kv@p@m", None)),
        (b"kv@p@m\x00sgl-kv-epoch=e1", (b"kv@p@m", "e1")),
        (b"kv@p@m\x00sgl-kv-epoch=e1\x00sgl-kv-snapshot=b7", (b"kv@p@m", "e1")),
        (b"kv@p@m\x00sgl-kv-epoch=", (b"kv@p@m", None)),
        (b"kv@p@m\x00sgl-kv-epoch=\xff", (b"kv@p@m", None)),
        (b"kv@p@m\x00other", (b"kv@p@m", None)),
        (b"", (b"", None)),
    ],
)
def test_split_sglang_topic(topic, expected):
    assert split_sglang_topic(topic) == expected
