"""SGLang KV-event adapter: SGLang's msgpack payloads -> domain events.

Mirrors python/sglang/srt/disaggregation/kv_events.py and
python/sglang/srt/mem_cache/events.py of SGLang main (the 0.5.x line, with
``StorageMedium``, ``BlockStoredWithMetadata`` and ``attn_dp_rank``; read
against sgl-project/sglang at commit 612d579090db24ec7c47cc5ca6b83e0c649b8c28
for the batch and event structs, and the later ``StorageMedium`` /
``BlockStoredWithMetadata`` revision of the same file).  Layout:

* payload: msgpack array ``[ts, events, attn_dp_rank]``; the rank is missing
  in SGLang before it had attention-DP (``[ts, events]``) and may be nil.
* each event: a positional array tagged by its first element (``array_like``,
  ``tag=True``):

  - ``["BlockStored", block_hashes, parent_block_hash, token_ids, block_size,
    lora_id, medium, metadata?]``; ``medium`` is missing in older SGLang;
    ``metadata`` (``BlockStoredWithMetadata``, only when the request had a
    cache salt) is a map ``{"cache_salt": str}``.
  - ``["BlockRemoved", block_hashes, medium?]``
  - ``["AllBlocksCleared"]``

  Tagged maps (``{"type": "BlockStored", ...}``, the vLLM >= PR #42892 style,
  with ``cache_salt`` and ``session_id`` as top-level keys) decode too, so a
  SGLang that switches its event encoding keeps working.  Unknown trailing
  elements / keys are ignored; events of an unknown type are skipped and
  counted.

* block hashes: signed int64 (SGLang's ``hash_str_to_int64``: the first 8
  bytes of the page's sha256/xxhash digest read as a signed big-endian int;
  older SGLang used Python's ``hash(tuple(tokens))``), normalised to uint64 by
  two's complement.  Digest bytes are accepted as well (last 8 bytes).
* one hash per BlockStored: SGLang publishes one event per page, with
  ``block_size = len(page tokens)``, so the last page of a radix node may be
  shorter than the page size.
* ``token_ids`` may hold ``[token, next_token]`` pairs (EAGLE bigram keys);
  the first element of each pair is the page's token at that position and is
  what the domain event carries.
* medium (``StorageMedium``) -> tier: ``"GPU"`` -> gpu, ``"CPU_PINNED"`` ->
  cpu, ``"DISK"`` -> storage, ``"EXTERNAL"`` (a shared pool such as Mooncake)
  -> ``"external"`` (weight 0 unless configured), nil -> gpu; any other string
  via :func:`kvindex.tiers.tier_from_medium`.

Replay differs from vLLM only in the reply frames (no topic frame:
``[b"", seq, payload]``, handled by the subscriber); the sequence frame and the
end marker are the same, see :func:`kvevents.wire.decode_seq`.
"""

from __future__ import annotations

from typing import Annotated, Any, Union

import msgspec

from kvevents.events import BlockRemoved, BlockStored, EventBatch
from kvevents.wire import (
    PayloadError,
    _check_tokens,
    _cleared,
    _EventCodec,
    _hashes,
    _parent,
)
from kvindex.tiers import tier_from_medium

__all__ = ["SGLANG_MEDIUM_TIERS", "decode_sglang_batch", "split_sglang_topic"]

#: SGLang ``StorageMedium`` value -> tier.
SGLANG_MEDIUM_TIERS: dict[str, str] = {
    "GPU": "gpu",
    "CPU_PINNED": "cpu",
    "CPU": "cpu",
    "DISK": "storage",
    "EXTERNAL": "external",
}

_EPOCH_MARKER = b"\x00sgl-kv-epoch="
_SNAPSHOT_MARKER = b"\x00sgl-kv-snapshot="


def _tier(medium: str | None) -> str:
    if medium is None:
        return "gpu"
    t = SGLANG_MEDIUM_TIERS.get(medium)
    return t if t is not None else tier_from_medium(medium)


_Hash = Union[int, bytes]
_Token = Annotated[int, msgspec.Meta(ge=0)]
# A token id, or an EAGLE bigram pair [token, next_token].
_TokenOrPair = Union[_Token, list[_Token]]


class _SglMetadata(msgspec.Struct, gc=False):
    # BlockStoredMetadata: a map (not array_like); unknown keys ignored.
    cache_salt: str | None = None


class _SglStoredFields(msgspec.Struct, gc=False):
    block_hashes: list[_Hash]
    parent_block_hash: _Hash | None
    token_ids: list[_TokenOrPair]
    block_size: int
    lora_id: int | None = None
    medium: str | None = None
    metadata: _SglMetadata | None = None


class _SglRemovedFields(msgspec.Struct, gc=False):
    block_hashes: list[_Hash]
    medium: str | None = None


class _SglArrStored(_SglStoredFields, array_like=True, tag="BlockStored"):
    pass


class _SglArrRemoved(_SglRemovedFields, array_like=True, tag="BlockRemoved"):
    pass


class _SglArrCleared(msgspec.Struct, array_like=True, tag="AllBlocksCleared", gc=False):
    pass


class _SglMapStored(_SglStoredFields, tag_field="type", tag="BlockStored"):
    cache_salt: str | None = None
    session_id: str | None = None


class _SglMapRemoved(_SglRemovedFields, tag_field="type", tag="BlockRemoved"):
    pass


class _SglMapCleared(msgspec.Struct, tag_field="type", tag="AllBlocksCleared", gc=False):
    pass


def _tokens(toks: list[Any]) -> tuple[int, ...]:
    for x in toks:
        if type(x) is list:
            break
    else:
        return tuple(toks)
    out: list[int] = []
    for x in toks:
        if type(x) is list:
            if len(x) != 2:
                raise PayloadError("token_ids", f"bigram token entry of length {len(x)}")
            out.append(x[0])
        else:
            out.append(x)
    return tuple(out)


def _sgl_stored(ev: Any) -> BlockStored:
    hashes = _hashes(ev.block_hashes)
    toks = _tokens(ev.token_ids)
    _check_tokens(hashes, len(toks), ev.block_size)
    salt = getattr(ev, "cache_salt", None)
    if salt is None and ev.metadata is not None:
        salt = ev.metadata.cache_salt
    return BlockStored(
        hashes,
        _parent(ev.parent_block_hash),
        toks,
        ev.block_size,
        _tier(ev.medium),
        lora_id=ev.lora_id,
        session_id=getattr(ev, "session_id", None),
        cache_salt=salt,
    )


def _sgl_removed(ev: Any) -> BlockRemoved:
    return BlockRemoved(_hashes(ev.block_hashes), _tier(ev.medium))


_SGLANG = _EventCodec(
    "Sglang",
    (_SglMapStored, _SglMapRemoved, _SglMapCleared),
    (_SglArrStored, _SglArrRemoved, _SglArrCleared),
    {
        _SglArrStored: _sgl_stored,
        _SglMapStored: _sgl_stored,
        _SglArrRemoved: _sgl_removed,
        _SglMapRemoved: _sgl_removed,
        _SglArrCleared: _cleared,
        _SglMapCleared: _cleared,
    },
)


def decode_sglang_batch(payload: bytes) -> EventBatch:
    """Decode one SGLang KV-event payload (the third ZMQ frame).

    Mirrors SGLang's python/sglang/srt/disaggregation/kv_events.py
    ``KVEventBatch`` / ``BlockStored`` / ``BlockStoredWithMetadata`` /
    ``BlockRemoved`` / ``AllBlocksCleared`` (see the module docstring for the
    layout and the SGLang revision).

    Args:
        payload: msgpack bytes ``[ts, events, attn_dp_rank]``.

    Returns:
        The batch: ``dp_rank`` is SGLang's ``attn_dp_rank`` (None when
        absent); hashes as uint64; tiers from ``StorageMedium``; the cache salt
        of ``BlockStoredWithMetadata`` in ``BlockStored.cache_salt``.

    Raises:
        PayloadError: for anything that is not a valid batch (same kinds as
            :func:`kvevents.wire.decode_vllm_batch`).  Nothing else escapes.
    """
    return _SGLANG.decode(payload)


def split_sglang_topic(topic: bytes) -> tuple[bytes, str | None]:
    """Split an SGLang topic frame into ``(base topic, epoch)``.

    Snapshot-capable SGLang publishers append ``b"\\x00sgl-kv-epoch=" +
    epoch`` (and, on snapshot barriers, ``b"\\x00sgl-kv-snapshot=" + id``) to
    the configured topic; the epoch changes when that DP replica's publisher
    restarts.  Returns the configured topic and the epoch (None when absent or
    not utf-8).  Never raises; a non-bytes argument gives ``(b"", None)``.
    """
    if not isinstance(topic, (bytes, bytearray, memoryview)):
        return b"", None
    raw = bytes(topic)
    i = raw.find(_EPOCH_MARKER)
    if i < 0:
        nul = raw.find(b"\x00")
        return (raw if nul < 0 else raw[:nul]), None
    base = raw[:i]
    rest = raw[i + len(_EPOCH_MARKER) :]
    j = rest.find(_SNAPSHOT_MARKER)
    if j >= 0:
        rest = rest[:j]
    try:
        epoch = rest.decode("utf-8")
    except UnicodeDecodeError:
        epoch = None
    return base, (epoch or None)
