"""The fast decoding of vLLM KV-event payloads: no Python object per token or per hash.

msgspec parses and validates the message as :mod:`kvevents.wire` does, into
structs of the plain shape only (a store with tokens, a removal, a clear; no
LoRA, extra keys, lookahead tokens, locality or ownership; group 0 of a
the full_attention kind or no group at all; unknown keys refused) whose
``block_hashes`` and ``token_ids`` stay ``msgspec.Raw``; the compiled core
(``kvindex._native.read_raw_batch``) reads those msgpack integer arrays with
bounds and type checks into one :class:`FastBatch`, which the compiled index
applies in one call (:class:`kvindex.contract.RawApply`).

Anything else (another shape, a value the reader declines, a payload the
reference decoder would reject or keep only in part) gives None: the caller
decodes it with :func:`kvevents.wire.decode_vllm_batch`.  So a payload
decoded here is one the reference decoder takes whole, into the same events;
tests/test_fastwire_fuzz.py holds the two to that.  The design notes are in
docs/design.md (the write path's fast decoding).
"""

from __future__ import annotations

import math
from typing import Annotated, Any, Literal, Union

import msgspec

from kvevents.events import Event, EventBatch
from kvevents.wire import decode_vllm_batch
from kvindex.tiers import TIERS, tier_from_medium

try:
    from kvindex._native import decode_raw_payload, read_raw_batch
except ImportError:  # no compiled core: nothing is decoded here
    decode_raw_payload = read_raw_batch = None

__all__ = ["FastBatch", "decode_fast"]

_Rank = Annotated[int, msgspec.Meta(ge=0)]
_Full = Literal["full_attention"]  # the kind a plain model's stores name (others: the reference way)


class _StoredFields(msgspec.Struct, gc=False, forbid_unknown_fields=True):
    # the positional order of vLLM's BlockStored (kvevents.wire._VllmStoredFields)
    block_hashes: msgspec.Raw
    parent_block_hash: int | None
    token_ids: msgspec.Raw
    block_size: int
    lora_id: None = None
    medium: str | None = None
    lora_name: None = None
    extra_keys: None = None
    group_idx: Literal[0] | None = None
    kv_cache_spec_kind: _Full | None = None
    kv_cache_spec_sliding_window: None = None
    locality: None = None
    ownership: None = None
    session_id: str | None = None


class _RemovedFields(msgspec.Struct, gc=False, forbid_unknown_fields=True):
    block_hashes: msgspec.Raw
    medium: str | None = None
    group_idx: Literal[0] | None = None
    locality: None = None
    ownership: None = None


class _MapStored(_StoredFields, tag_field="type", tag="BlockStored"):
    lookahead_token_ids: None = None


class _MapRemoved(_RemovedFields, tag_field="type", tag="BlockRemoved"):
    pass


class _MapCleared(msgspec.Struct, tag_field="type", tag="AllBlocksCleared", gc=False, forbid_unknown_fields=True):
    pass


class _ArrStored(_StoredFields, array_like=True, tag="BlockStored"):
    pass


class _ArrRemoved(_RemovedFields, array_like=True, tag="BlockRemoved"):
    pass


class _ArrCleared(msgspec.Struct, array_like=True, tag="AllBlocksCleared", gc=False, forbid_unknown_fields=True):
    pass


def _batch(name: str, ev: Any) -> msgspec.msgpack.Decoder:
    # the reference's batch: [ts, events, rank], trailing elements ignored
    t = msgspec.defstruct(
        name, [("ts", float), ("events", list[ev]), ("rank", Union[_Rank, None], None)], array_like=True, gc=False
    )
    return msgspec.msgpack.Decoder(t)


_FORMS = (
    (_batch("_FastMapBatch", Union[_MapStored, _MapRemoved, _MapCleared]), (_MapStored, _MapRemoved, _MapCleared)),
    (_batch("_FastArrBatch", Union[_ArrStored, _ArrRemoved, _ArrCleared]), (_ArrStored, _ArrRemoved, _ArrCleared)),
)

#: medium -> tier bit, for the mediums whose tier is registered (the core's read of a decoded event
#: looks the tier up in TIERS the same way; any other medium is decoded the reference way)
_MEDIUM_BITS: dict[str | None, int] = {
    m: TIERS._bits[tier_from_medium(m)]
    for m in (None, "GPU", "CPU", "STORAGE", "gpu", "cpu", "storage")
    if tier_from_medium(m) in TIERS._bits
}


class FastBatch:
    """One payload decoded by :func:`decode_fast`: the pool's view of it, and the raw batch.

    ts, dp_rank: as :class:`~kvevents.events.EventBatch`; raw: the
    ``kvindex._native.RawBatch`` (``len(raw)`` events, ``raw.resets`` when it
    holds an AllBlocksCleared); :attr:`events`: the reference decoding of the
    same payload, made on first use (the events a backend does not take
    natively, the misconfiguration check, observers).
    """

    __slots__ = ("ts", "dp_rank", "raw", "payload", "_slow")
    skipped_events = 0
    bad_events: tuple[str, ...] = ()

    def __init__(self, ts: float, dp_rank: int | None, raw: Any, payload: bytes) -> None:
        self.ts = ts
        self.dp_rank = dp_rank
        self.raw = raw
        self.payload = payload
        self._slow: EventBatch | None = None

    def slow(self) -> EventBatch:
        """The reference decoding of the payload (the same events, none left out)."""
        b = self._slow
        if b is None:
            b = self._slow = decode_vllm_batch(self.payload)
        return b

    @property
    def events(self) -> tuple[Event, ...]:
        return self.slow().events

    def slow_events(self) -> tuple[Event, ...]:
        return self.slow().events


def decode_fast(payload: bytes) -> FastBatch | None:
    """Decode a vLLM payload of the plain shape without Python objects per token; None otherwise.

    None means only "not here": :func:`kvevents.wire.decode_vllm_batch`
    decides what the payload is (events, a partly malformed batch, or a
    :class:`~kvevents.wire.PayloadError`).  Never raises.
    """
    if read_raw_batch is None:
        return None
    if type(payload) is bytes:
        # the usual shapes in one pass over the bytes; the rest (None) through msgspec below
        got = decode_raw_payload(payload, _MEDIUM_BITS)
        if got is not None:
            return FastBatch(got[0], got[1], got[2], payload)
    for dec, (st, rm, cl) in _FORMS:
        try:
            b = dec.decode(payload)
        except Exception:  # not this form (or not a batch at all: the reference says what)
            continue
        if not math.isfinite(b.ts):
            return None
        raw = read_raw_batch(b.events, st, rm, cl, _MEDIUM_BITS)
        if raw is None:
            return None
        return FastBatch(b.ts, b.rank, raw, payload)
    return None
