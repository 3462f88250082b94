"""vLLM 0.33 / 0.34 KV-event messages decode exactly (lookahead tokens, hybrid groups, removals).

tests/data/vllm033_capture_events.json and vllm034_capture_events.json were
written by bench/record_vllm_captures.py from the released wheels'
vllm/distributed/kv_events.py structs (BlockStored l.56-141 with
``lookahead_token_ids`` l.98), encoded as ``ZmqEventPublisher`` does; their
hashes and per-block fields come from 0.33's hashing code
(tests/data/vllm_lookahead_block_hashes.json).  No vLLM needed here.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import msgspec
import pytest

from kvevents.events import AllBlocksCleared, BlockRemoved, BlockStored
from kvevents.wire import PayloadError, decode_seq, decode_vllm_batch, parse_topic

DATA = Path(__file__).parent / "data"
HASHES = {
    c["name"]: c
    for c in json.loads((DATA / "vllm_lookahead_block_hashes.json").read_text())["cases"]
    if c["algorithm"] == "sha256_cbor" and c["engine_hash_seed"] is None
}
VERSIONS = ("033", "034")


def _messages(ver: str) -> dict[str, dict[str, Any]]:
    doc = json.loads((DATA / f"vllm{ver}_capture_events.json").read_text())
    return {m["name"]: m for m in doc["messages"]}


def _decode(m: dict[str, Any]) -> Any:
    assert parse_topic(m["topic"].encode()) == ("pod-a", "tiny-llama")
    return decode_seq(bytes.fromhex(m["seq_hex"])), decode_vllm_batch(bytes.fromhex(m["payload_hex"]))


def _freeze(x: Any) -> Any:
    return tuple(_freeze(y) for y in x) if isinstance(x, list) else x


def _expected_stored(case: dict[str, Any], **kw: Any) -> BlockStored:
    n, bs = len(case["block_hashes"]), case["block_size"]
    lora = case["lora"]
    ek = case["event_extra_keys"]
    la = case["lookahead_token_ids"]
    return BlockStored(
        block_hashes=tuple(case["block_hashes"]), parent_block_hash=None,
        token_ids=tuple(case["tokens"][: n * bs]), block_size=bs, tier="gpu",
        lora_id=1 if lora else None, lora_name=lora[0] if lora else None,
        extra_keys=None if ek is None else tuple(None if e is None else _freeze(e) for e in ek),
        lookahead_token_ids=None if la is None else tuple(tuple(t) for t in la), **kw,
    )


def test_recorded_messages_cover_the_brief() -> None:
    names = set(_messages("033"))
    assert names == set(_messages("034"))
    assert {"lookahead_lora_mm_salt", "hybrid_groups_lookahead", "removed_and_cleared"} <= names
    # the 0.33 and 0.34 structs encode the same events to the same bytes
    assert [m["payload_hex"] for m in _messages("033").values()] == [m["payload_hex"] for m in _messages("034").values()]


@pytest.mark.parametrize("ver", VERSIONS)
def test_lookahead_store_with_lora_mm_and_salt(ver: str) -> None:
    seq, b = _decode(_messages(ver)["lookahead_lora_mm_salt"])
    assert seq == 0 and b.dp_rank is None and b.skipped_events == 0 and b.bad_events == ()
    case = HASHES["lora_mm_salt_bs16_L1"]
    assert b.events == (_expected_stored(case, group_idx=0),)
    ev = b.events[0]
    # every block's lookahead is the token after it; block 0's extras hold the item starting there
    assert ev.lookahead_token_ids == tuple((case["tokens"][16 * (i + 1)],) for i in range(6))
    assert ev.extra_keys[0] == ("chat", ("img-c0ffee", 16), "org-42")


@pytest.mark.parametrize("ver", VERSIONS)
def test_store_without_lookahead_keeps_none(ver: str) -> None:
    seq, b = _decode(_messages(ver)["plain_no_lookahead"])
    assert seq == 1 and b.dp_rank == 0
    assert b.events == (_expected_stored(HASHES["short_bs16_L0"], group_idx=0, kv_cache_spec_kind="full_attention"),)
    assert b.events[0].lookahead_token_ids is None


@pytest.mark.parametrize("ver", VERSIONS)
def test_hybrid_groups_with_lookahead(ver: str) -> None:
    seq, b = _decode(_messages(ver)["hybrid_groups_lookahead"])
    case = HASHES["medium_bs32_L2"]
    assert seq == 2 and b.dp_rank == 1
    assert b.events == (
        _expected_stored(case, group_idx=0, kv_cache_spec_kind="full_attention", session_id="sess-1"),
        _expected_stored(case, group_idx=1, kv_cache_spec_kind="sliding_window",
                         kv_cache_spec_sliding_window=64, locality="LOCAL"),
    )
    # 100 tokens, blocks of 32, two lookahead tokens: 3 blocks hashed, each with the next 2 tokens
    assert [len(t) for t in b.events[0].lookahead_token_ids] == [2, 2, 2]


@pytest.mark.parametrize("ver", VERSIONS)
def test_removals_per_group_and_clear(ver: str) -> None:
    seq, b = _decode(_messages(ver)["removed_and_cleared"])
    hs = HASHES["medium_bs32_L2"]["block_hashes"]
    assert seq == 3 and b.dp_rank == 1
    assert b.events == (
        BlockRemoved(tuple(hs[1:]), "gpu", group_idx=1),
        BlockRemoved(tuple(hs[:1]), "cpu", group_idx=0, ownership="lmcache"),
        AllBlocksCleared(),
    )


@pytest.mark.parametrize("ver", VERSIONS)
def test_digest_hashes_with_lookahead(ver: str) -> None:
    _, b = _decode(_messages(ver)["digest_hashes_lookahead"])
    case = HASHES["short_bs16_L3"]
    (ev,) = b.events
    assert ev.block_hashes == tuple(case["block_hashes"])  # last 8 bytes of each 32-byte digest
    assert ev.lookahead_token_ids == tuple(tuple(t) for t in case["lookahead_token_ids"])
    assert ev.extra_keys is None and ev.group_idx == 0


class _Stored(msgspec.Struct, tag="BlockStored", omit_defaults=True):
    """A 0.33-shaped BlockStored to exercise malformed lookahead lists."""

    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    lookahead_token_ids: list[list[int]] | None = None


def _batch(la: Any) -> bytes:
    ev = _Stored([1, 2], None, [5, 6, 7, 8], 2, None, "GPU", None, la)
    return msgspec.msgpack.encode([1.0, [ev], None])


def test_lookahead_entries_must_match_blocks() -> None:
    assert decode_vllm_batch(_batch([[9], [10]])).events[0].lookahead_token_ids == ((9,), (10,))
    assert decode_vllm_batch(_batch([])).events[0].lookahead_token_ids is None
    b = decode_vllm_batch(_batch([[9]]))
    assert b.events == () and b.bad_events == ("lookahead",)
    with pytest.raises(PayloadError):
        decode_vllm_batch(b"\x93\xcb")
