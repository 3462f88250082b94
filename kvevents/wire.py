"""vLLM KV-event wire format: ZMQ frames and msgpack payloads -> domain events.

Write path, first step: the subscriber hands each message's three frames
(topic, sequence number, payload) to :func:`parse_topic`, :func:`decode_seq`
and :func:`decode_vllm_batch`; the pool applies the resulting
:class:`~kvevents.events.EventBatch` to the index.

Mirrors vllm/distributed/kv_events.py of vLLM 0.32 to 0.34 (``KVEventBatch``,
``BlockStored``, ``BlockRemoved``, ``AllBlocksCleared``,
``ZmqEventPublisher``) and the older positional layout:

* payload: msgpack array ``[ts, events, data_parallel_rank]``; the rank may be
  missing or nil; trailing extra elements are ignored.
* each event, current vLLM (since PR #42892): a msgpack map tagged by
  ``"type"`` (``"BlockStored"``, ``"BlockRemoved"``, ``"AllBlocksCleared"``),
  fields holding their default omitted; unknown keys are ignored.
* each event, older vLLM: a positional array ``[type, field1, field2, ...]``;
  old engines stop after ``block_size`` or after ``medium``, newer ones may
  append fields we do not know (ignored).
* BlockStored field order: block_hashes, parent_block_hash, token_ids,
  block_size, lora_id, medium, lora_name, extra_keys, group_idx,
  kv_cache_spec_kind, kv_cache_spec_sliding_window, locality, ownership,
  session_id, lookahead_token_ids (vLLM 0.33 and 0.34, map form only: one
  token list per block, nil without lookahead hashing).  BlockRemoved: block_hashes, medium, group_idx, locality,
  ownership.  AllBlocksCleared: none.

Both encodings decode to identical domain events.  Decoding uses msgspec
structs only: msgspec cannot put array-like and map-like tagged structs in one
union, so a batch is decoded with the map union first, then with the array
union, and only if both fail event by event (``msgspec.Raw``), which also
handles a batch mixing both forms and events of a type this library does not
know (skipped and counted in ``EventBatch.skipped_events``).

Errors: every decoder here raises :class:`PayloadError` and nothing else, for
a payload that is not a batch at all.  One malformed event inside a valid
batch does not fail the batch: it is left out, its error kind is listed in
``EventBatch.bad_events``, and the batch's other events are kept in order (a
valid BlockRemoved beside a broken BlockStored must still apply).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Annotated, Any, Union

import msgspec

from kvevents.events import AllBlocksCleared, BlockRemoved, BlockStored, Event, EventBatch
from kvindex.hybrid import MAMBA_KINDS, SLIDING_KINDS
from kvindex.tiers import tier_from_medium

#: KV-cache spec kinds whose stores may be sparse (vLLM's default retention keeps some of their blocks)
SPARSE_KINDS = SLIDING_KINDS | MAMBA_KINDS

__all__ = [
    "REPLAY_END_SEQ",
    "PayloadError",
    "decode_seq",
    "decode_vllm_batch",
    "normalize_block_hash",
    "parse_topic",
]

#: Sequence number of the replay end marker: 8 bytes of 0xFF (vLLM sends
#: ``(-1).to_bytes(8, "big", signed=True)``), followed by an empty payload.
REPLAY_END_SEQ: int = 2**64 - 1

_MASK64 = (1 << 64) - 1
_INT64_MIN = -(1 << 63)


class PayloadError(ValueError):
    """Raised for any frame or payload that is not a valid message part.

    ``kind`` is a short, stable string meant as a stats/metrics label:

    * ``"type"``: the payload is not bytes-like.
    * ``"msgpack"``: not well-formed msgpack (truncated, bad prefix byte...).
    * ``"depth"``: nesting too deep to decode.
    * ``"schema"``: well-formed msgpack of the wrong shape or types (not an
      array batch, unknown field type, negative token id, missing required
      field...).
    * ``"ts"``: batch timestamp not a finite number.
    * ``"hash"``: a block hash that is neither a 64-bit int nor a non-empty
      digest.
    * ``"block_size"``: block_size < 1.
    * ``"token_ids"``: ``len(token_ids) != block_size * len(block_hashes)``
      for a BlockStored that carries tokens (or a malformed SGLang bigram).
    * ``"extra_keys"``: extra_keys not one entry per block, or holding a map.
    * ``"lookahead"``: lookahead_token_ids not one entry per block.
    * ``"seq"``: a sequence-number frame that is not 8 bytes.
    * ``"internal"``: an unexpected failure inside the decoder (a bug here;
      the message is dropped like any other bad one).

    ``detail`` is a human-readable explanation (may be long; log it rate
    limited, do not use it as a label).
    """

    def __init__(self, kind: str, detail: str = "") -> None:
        super().__init__(f"{kind}: {detail}" if detail else kind)
        self.kind = kind
        self.detail = detail


# --------------------------------------------------------------------------
# block hashes
# --------------------------------------------------------------------------


def normalize_block_hash(h: int | bytes) -> int:
    """Normalise one engine block hash to an unsigned 64-bit int.

    Mirrors vllm/v1/core/kv_cache_utils.py ``maybe_convert_block_hash``
    (vLLM 0.32: ``int.from_bytes(digest, "big") & (2**64 - 1)``) and SGLang's
    signed int64 block ids (python/sglang/srt/mem_cache/utils.py
    ``hash_str_to_int64``).

    * int in ``[0, 2**64)``: returned unchanged (values >= 2**63 occur).
    * int in ``[-2**63, 0)``: two's complement, ``h + 2**64``.
    * bytes/bytearray/memoryview (a raw digest, e.g. 32 bytes of sha256): the
      last 8 bytes read big-endian; a digest shorter than 8 bytes is read
      whole, big-endian (zero-extended on the left), exactly what vLLM's own
      conversion yields for it.

    Raises:
        PayloadError: kind ``"hash"`` for an int outside ``[-2**63, 2**64)``,
            an empty digest, a bool, or any other type.
    """
    if isinstance(h, int) and not isinstance(h, bool):
        if 0 <= h <= _MASK64:
            return int(h)
        if _INT64_MIN <= h < 0:
            return int(h) & _MASK64
        raise PayloadError("hash", f"block hash {h} outside the 64-bit range")
    if isinstance(h, (bytes, bytearray, memoryview)):
        b = bytes(h)
        if not b:
            raise PayloadError("hash", "empty block-hash digest")
        return int.from_bytes(b[-8:], "big")
    raise PayloadError("hash", f"block hash of type {type(h).__name__}")


def _hashes(hs: list[Any] | tuple[Any, ...]) -> tuple[int, ...]:
    """Normalise a decoded hash list or tuple (ints already within msgpack's range)."""
    if type(hs) is tuple:
        # msgspec decoded it as a tuple: kept as is when every hash is a non-negative int
        try:
            if not hs or min(hs) >= 0:
                return hs
        except TypeError:  # digests among them
            return tuple([normalize_block_hash(h) for h in hs])
    try:
        # Fast path: all ints (msgpack ints are within [-2**63, 2**64)).
        return tuple([h & _MASK64 for h in hs])
    except TypeError:
        return tuple([normalize_block_hash(h) for h in hs])


def _parent(h: int | bytes | None) -> int | None:
    return None if h is None else normalize_block_hash(h)


# --------------------------------------------------------------------------
# shared validation helpers (also used by kvevents.sglang)
# --------------------------------------------------------------------------


def _check_tokens(hashes: tuple[int, ...], n_tokens: int, block_size: int, kind: str | None = None) -> None:
    """Token count = one block per hash; or, for a sliding-window / Mamba group (``kind``),
    whole blocks of which the hashes name some (vLLM's sparse retention, #44451)."""
    if block_size < 1:
        raise PayloadError("block_size", f"block_size {block_size} < 1")
    if kind in SPARSE_KINDS and n_tokens % block_size == 0 and n_tokens > block_size * len(hashes):
        return
    if n_tokens and n_tokens != block_size * len(hashes):
        raise PayloadError(
            "token_ids",
            f"{n_tokens} token ids for {len(hashes)} blocks of {block_size} tokens",
        )


def _freeze(v: Any) -> Any:
    if isinstance(v, list):
        return tuple([_freeze(x) for x in v])
    if isinstance(v, dict):
        raise PayloadError("extra_keys", "a map inside extra_keys")
    return v


def _extra_keys(ek: list[Any] | None, n_blocks: int) -> tuple[tuple | None, ...] | None:
    """Untagged per-block extra keys -> tuple of (tuple | None), or None."""
    if ek is None or (not ek and n_blocks):
        return None
    if len(ek) != n_blocks:
        raise PayloadError("extra_keys", f"{len(ek)} extra_keys entries for {n_blocks} blocks")
    out = _freeze(ek)
    try:
        hash(out)
    except TypeError as e:
        raise PayloadError("extra_keys", f"unhashable value in extra_keys: {e}") from None
    return out


# --------------------------------------------------------------------------
# vLLM wire structs
# --------------------------------------------------------------------------

_Hash = Union[int, bytes]
_Token = Annotated[int, msgspec.Meta(ge=0)]
_Rank = Annotated[int, msgspec.Meta(ge=0)]


class _VllmStoredFields(msgspec.Struct, gc=False):
    # Field order is the positional order of vLLM's BlockStored.  Arrays are decoded straight
    # into the tuples the domain events hold (no copy afterwards).
    block_hashes: tuple[_Hash, ...]
    parent_block_hash: _Hash | None
    token_ids: tuple[_Token, ...]
    block_size: int
    lora_id: int | None = None
    medium: str | None = None
    lora_name: str | None = None
    extra_keys: list[list[Any] | None] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    locality: str | None = None
    ownership: str | None = None
    session_id: str | None = None


class _VllmRemovedFields(msgspec.Struct, gc=False):
    block_hashes: tuple[_Hash, ...]
    medium: str | None = None
    group_idx: int | None = None
    locality: str | None = None
    ownership: str | None = None


class _VllmMapStored(_VllmStoredFields, tag_field="type", tag="BlockStored"):
    # vLLM 0.33+ (kv_events.py l.98); map form only: the positional form predates it, and a
    # positional event's trailing fields beyond session_id stay ignored
    lookahead_token_ids: tuple[tuple[_Token, ...] | None, ...] | None = None


class _VllmMapRemoved(_VllmRemovedFields, tag_field="type", tag="BlockRemoved"):
    pass


class _VllmMapCleared(msgspec.Struct, tag_field="type", tag="AllBlocksCleared", gc=False):
    pass


class _VllmArrStored(_VllmStoredFields, array_like=True, tag="BlockStored"):
    pass


class _VllmArrRemoved(_VllmRemovedFields, array_like=True, tag="BlockRemoved"):
    pass


class _VllmArrCleared(msgspec.Struct, array_like=True, tag="AllBlocksCleared", gc=False):
    pass


class _TierOf(dict):
    """medium -> tier_from_medium(medium): the usual mediums looked up without a call, any other
    one through tier_from_medium itself (not kept: a publisher may send any string)."""

    def __missing__(self, medium: str | None) -> str:
        return tier_from_medium(medium)


_TIER_OF = _TierOf({m: tier_from_medium(m) for m in (None, "GPU", "CPU", "STORAGE", "gpu", "cpu")})


def _vllm_stored(ev: _VllmStoredFields) -> BlockStored:
    # the checks of _hashes, _check_tokens, _parent, tier_from_medium and _extra_keys, with their
    # common cases inline (one event per block batch on the ingest path)
    hashes = _hashes(ev.block_hashes)
    toks = ev.token_ids
    bs = ev.block_size
    if bs < 1 or (toks and len(toks) != bs * len(hashes)):
        _check_tokens(hashes, len(toks), bs, ev.kv_cache_spec_kind)
    parent = ev.parent_block_hash
    if parent is not None and (type(parent) is not int or parent < 0):
        parent = normalize_block_hash(parent)
    ek = ev.extra_keys
    la = getattr(ev, "lookahead_token_ids", None)
    if la is not None:
        la = _lookahead(la, len(hashes))
    return BlockStored(
        hashes,
        parent,
        toks,
        bs,
        _TIER_OF[ev.medium],
        ev.lora_id,
        ev.lora_name,
        None if ek is None else _extra_keys(ek, len(hashes)),
        ev.group_idx,
        ev.kv_cache_spec_kind,
        ev.kv_cache_spec_sliding_window,
        ev.locality,
        ev.ownership,
        ev.session_id,
        None,
        la,
    )


def _lookahead(
    la: tuple[tuple[int, ...] | None, ...], n_blocks: int
) -> tuple[tuple[int, ...], ...] | None:
    """vLLM 0.33's per-block lookahead tokens: one entry per block (an empty list is no lookahead)."""
    if not la and n_blocks:
        return None
    if len(la) != n_blocks:
        raise PayloadError("lookahead", f"{len(la)} lookahead_token_ids entries for {n_blocks} blocks")
    return tuple([() if t is None else t for t in la])


def _vllm_removed(ev: _VllmRemovedFields) -> BlockRemoved:
    return BlockRemoved(
        _hashes(ev.block_hashes),
        _TIER_OF[ev.medium],
        ev.group_idx,
        ev.locality,
        ev.ownership,
    )


_CLEARED = AllBlocksCleared()


def _cleared(ev: Any) -> AllBlocksCleared:
    return _CLEARED


# --------------------------------------------------------------------------
# generic batch codec: map form, array form, per-event fallback
# --------------------------------------------------------------------------


class _TypeProbe(msgspec.Struct, gc=False):
    type: str


class _EventCodec:
    """Decodes ``[ts, events, rank]`` payloads whose events are tagged maps or
    positional arrays, converting each wire event with a per-type function.

    ``map_types`` / ``arr_types``: the msgspec structs of each form (same
    tags); ``convert``: wire struct type -> function returning a domain event.
    """

    def __init__(
        self,
        name: str,
        map_types: tuple[type, ...],
        arr_types: tuple[type, ...],
        convert: dict[type, Callable[[Any], Event]],
    ) -> None:
        def batch(suffix: str, ev_type: Any) -> type:
            return msgspec.defstruct(
                f"_{name}{suffix}Batch",
                [("ts", float), ("events", list[ev_type]), ("rank", Union[_Rank, None], None)],
                array_like=True,
                gc=False,
            )

        map_union = Union[map_types]  # type: ignore[valid-type]
        arr_union = Union[arr_types]  # type: ignore[valid-type]
        self._map_batch = msgspec.msgpack.Decoder(batch("Map", map_union))
        self._arr_batch = msgspec.msgpack.Decoder(batch("Arr", arr_union))
        self._raw_batch = msgspec.msgpack.Decoder(batch("Raw", msgspec.Raw))
        self._map_event = msgspec.msgpack.Decoder(map_union)
        self._arr_event = msgspec.msgpack.Decoder(arr_union)
        self._probe_map = msgspec.msgpack.Decoder(_TypeProbe)
        self._probe_arr = msgspec.msgpack.Decoder(list[msgspec.Raw])
        self._probe_str = msgspec.msgpack.Decoder(str)
        self._known = frozenset(t.__struct_config__.tag for t in map_types) | frozenset(
            t.__struct_config__.tag for t in arr_types
        )
        self._convert = convert

    def decode(self, payload: bytes) -> EventBatch:
        try:
            return self._decode(payload)
        except PayloadError:
            raise
        except RecursionError:
            raise PayloadError("depth", "payload nested too deeply") from None
        except Exception as e:  # never let anything else out of a decoder
            raise PayloadError("internal", repr(e)) from None

    def _decode(self, payload: bytes) -> EventBatch:
        if not isinstance(payload, (bytes, bytearray, memoryview)):
            raise PayloadError("type", f"payload of type {type(payload).__name__}")
        try:
            b = self._map_batch.decode(payload)
        except msgspec.ValidationError:
            try:
                b = self._arr_batch.decode(payload)
            except msgspec.ValidationError:
                return self._decode_per_event(payload)
            except msgspec.DecodeError as e:
                raise PayloadError("msgpack", str(e)) from None
        except msgspec.DecodeError as e:
            raise PayloadError("msgpack", str(e)) from None
        return self._build(b.ts, b.events, b.rank, 0)

    def _build(
        self, ts: float, wire_events: list[Any], rank: int | None, skipped: int, bad: list[str] | None = None
    ) -> EventBatch:
        if not math.isfinite(ts):
            raise PayloadError("ts", f"batch timestamp {ts}")
        conv = self._convert
        try:
            events = tuple([conv[type(ev)](ev) for ev in wire_events])
        except PayloadError:
            # one event is malformed: convert one by one, keep the valid ones in order
            kept: list[Event] = []
            bad = list(bad or ())
            for ev in wire_events:
                try:
                    kept.append(conv[type(ev)](ev))
                except PayloadError as e:
                    bad.append(e.kind)
            events = tuple(kept)
        return EventBatch(ts, events, rank, skipped, tuple(bad) if bad else ())

    def _decode_per_event(self, payload: bytes) -> EventBatch:
        try:
            rb = self._raw_batch.decode(payload)
        except msgspec.ValidationError as e:
            raise PayloadError("schema", str(e)) from None
        except msgspec.DecodeError as e:
            raise PayloadError("msgpack", str(e)) from None
        wire: list[Any] = []
        skipped = 0
        bad: list[str] = []
        for raw in rb.events:
            try:
                ev = self._one(raw)
            except PayloadError as e:  # one malformed event: the others still apply
                bad.append(e.kind)
                continue
            if ev is None:
                skipped += 1
            else:
                wire.append(ev)
        return self._build(rb.ts, wire, rb.rank, skipped, bad)

    def _one(self, raw: msgspec.Raw) -> Any:
        """One raw event -> wire struct, or None for an unknown event type."""
        try:
            return self._map_event.decode(raw)
        except msgspec.ValidationError as e:
            map_err = e
        try:
            return self._arr_event.decode(raw)
        except msgspec.ValidationError as e:
            arr_err = e
        tag, is_map = self._tag_of(raw)
        if tag is not None and tag not in self._known:
            return None
        raise PayloadError("schema", f"event: {map_err if is_map else arr_err}")

    def _tag_of(self, raw: msgspec.Raw) -> tuple[str | None, bool]:
        try:
            return self._probe_map.decode(raw).type, True
        except msgspec.ValidationError:
            pass
        try:
            items = self._probe_arr.decode(raw)
        except msgspec.ValidationError:
            return None, False
        if not items:
            return None, False
        try:
            return self._probe_str.decode(items[0]), False
        except msgspec.ValidationError:
            return None, False


_VLLM = _EventCodec(
    "Vllm",
    (_VllmMapStored, _VllmMapRemoved, _VllmMapCleared),
    (_VllmArrStored, _VllmArrRemoved, _VllmArrCleared),
    {
        _VllmMapStored: _vllm_stored,
        _VllmArrStored: _vllm_stored,
        _VllmMapRemoved: _vllm_removed,
        _VllmArrRemoved: _vllm_removed,
        _VllmMapCleared: _cleared,
        _VllmArrCleared: _cleared,
    },
)


def decode_vllm_batch(payload: bytes) -> EventBatch:
    """Decode one vLLM KV-event payload (the third ZMQ frame).

    Mirrors vllm/distributed/kv_events.py ``KVEventBatch`` (vLLM 0.32) and the
    positional event layout of engines before vLLM PR #42892; see the module
    docstring for the layouts.  Block hashes of every form (uint64, negative
    int64, raw digest bytes) become uint64 ints; ``medium`` becomes a tier via
    :func:`kvindex.tiers.tier_from_medium` (nil -> ``"gpu"``); extra_keys
    lists become tuples.

    Args:
        payload: msgpack bytes ``[ts, events, data_parallel_rank]``.

    Returns:
        The batch; ``dp_rank`` None when the engine sent no rank; events of an
        unknown type are skipped and counted in ``skipped_events``.

    Raises:
        PayloadError: for anything that is not a valid batch (see its kinds),
            including a BlockStored whose non-empty token_ids do not hold
            exactly ``block_size`` tokens per block.  Nothing else escapes.
    """
    return _VLLM.decode(payload)


# --------------------------------------------------------------------------
# the other two frames
# --------------------------------------------------------------------------


def parse_topic(topic: bytes) -> tuple[str | None, str | None]:
    """Split a KV-event topic ``kv@<pod>@<model>`` into ``(pod, model)``.

    Mirrors the topic convention of vLLM's ``--kv-events-config`` (``topic``)
    shared by llm-d and SGLang publishers.

    * The pod is everything between the first and the second ``@``: it may
      contain ``:`` (``10.0.0.5:8000``) but not ``@``.  The model is
      everything after the second ``@``, so it may contain ``/`` and ``@``
      (``org/model@rev``).  An empty model gives ``(pod, None)``.
    * Bytes from the first NUL on are publisher metadata, not part of the
      topic (SGLang's snapshot-capable publishers append
      ``"\\x00sgl-kv-epoch=<epoch>"``) and are ignored.
    * Any other topic (no ``kv@`` prefix, no second ``@``, empty pod, bytes
      that are not utf-8, not bytes at all) -> ``(None, None)``: the caller
      uses the pod id configured for that subscription.

    Never raises.
    """
    try:
        if isinstance(topic, str):
            text = topic.split("\x00", 1)[0]
        elif isinstance(topic, (bytes, bytearray, memoryview)):
            raw = bytes(topic)
            nul = raw.find(b"\x00")
            if nul >= 0:
                raw = raw[:nul]
            text = raw.decode("utf-8")
        else:
            return None, None
    except Exception:
        return None, None
    prefix, sep, rest = text.partition("@")
    if prefix != "kv" or not sep:
        return None, None
    pod, sep, model = rest.partition("@")
    if not sep or not pod:
        return None, None
    return pod, (model or None)


def decode_seq(frame: bytes) -> int:
    """Decode a sequence-number frame: exactly 8 bytes, big-endian, unsigned.

    Mirrors ``ZmqEventPublisher`` (vLLM 0.32): ``seq.to_bytes(8, "big")``,
    starting at 0 per publisher process; the replay end marker is
    :data:`REPLAY_END_SEQ` (8 bytes of 0xFF).

    Raises:
        PayloadError: kind ``"seq"`` for anything but 8 bytes.
    """
    if type(frame) is bytes and len(frame) == 8:
        return int.from_bytes(frame, "big")  # the usual frame, read in place
    if not isinstance(frame, (bytes, bytearray, memoryview)):
        raise PayloadError("seq", f"sequence frame of type {type(frame).__name__}")
    b = bytes(frame)
    if len(b) != 8:
        raise PayloadError("seq", f"sequence frame of {len(b)} bytes, expected 8")
    return int.from_bytes(b, "big")
