"""One publisher's decoded batch as ops of the Redis backend's ``batch`` script.

:class:`kvindex.redis_index.RedisKVBlockIndex` applies a run of events in
one script call (one round trip) instead of one or two per event.  The
request keys of a store are chained here, before the call, from its parent's
request key: a parent stored earlier in the run, or the stream's last stored
block of an earlier call.  The script checks on the server that the stream
still resolves the parent to that key before it applies the store, so the
result is the per-event one (:func:`kvindex.side_tables.apply_each`); an
event prepared otherwise (an unknown parent, a malformed event) ends the run
and is applied by the per-event method.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from typing import Any, Protocol

from kvindex.contract import ApplyResult
from kvindex.hybrid import GroupSpec, held_at_hit_end, spec_from_store
from kvindex.keys import TokenProcessor
from kvindex.side_tables import _Orphan, checked_store
from kvindex.tiers import tier_bit

__all__ = [
    "BatchOps", "MAX_BATCH_BLOCKS", "bit_of", "from_k8", "k8", "k8s", "check_group_tokens", "group_head", "is_sparse", "prepare",
    "removal_args", "store_op", "tally",
]

#: blocks per script call at most (a script blocks the server while it runs)
MAX_BATCH_BLOCKS = 1024
_MAX_BIT = 1 << 30


def bit_of(tier: str) -> int:
    """The tier's bit (:func:`kvindex.tiers.tier_bit`); ValueError beyond the 31 tiers Lua masks hold."""
    b = tier_bit(tier)
    if b > _MAX_BIT:
        raise ValueError(f"the Redis backend holds at most 31 tiers; {tier!r} is beyond")
    return b


def group_head(spec: GroupSpec) -> tuple[Any, ...]:
    """The first words of a group store's op: 'G', group, 'kind|block size|window', full (1/0), keep (-1: all).

    ``keep``: the blocks of a re-announce-shaped store believed during a report
    window (:func:`kvindex.hybrid.held_at_hit_end`).
    """
    keep = held_at_hit_end(spec)
    window = "" if spec.window is None else spec.window
    return ("G", spec.group_idx, f"{spec.kind}|{spec.block_size}|{window}", int(spec.rule == "full"),
            -1 if keep is None else keep)


def check_group_tokens(index_block_size: int, n_blocks: int, n_tokens: int, block_size: int | None) -> None:
    """Engine-hash mode, a non-full group's store: whole blocks, at least one per hash (sparse ones too).

    Raises ValueError otherwise (as the reference's group tables).
    """
    size = block_size if block_size is not None else index_block_size
    if size % index_block_size or n_tokens % size or n_tokens < size * n_blocks:
        raise ValueError(f"{n_tokens} token ids for {n_blocks} blocks of {size} (index block size {index_block_size})")


def is_sparse(index_block_size: int, n_blocks: int, n_tokens: int) -> bool:
    """Own-hash mode: more whole blocks of tokens than hashes (vLLM #44451): which chunk each hash is, unknown."""
    return n_tokens > index_block_size * n_blocks and not n_tokens % index_block_size


class _Index(Protocol):
    """What the preparation reads of :class:`kvindex.redis_index.RedisKVBlockIndex`."""

    _compat: bool
    _tails: dict[tuple[str, int, str | None], tuple[int, int]]
    block_size: int
    token_processor: TokenProcessor


_K8 = struct.Struct(">Q")
_ESC = 0xFF << 56
_M64 = (1 << 64) - 1


def k8(key: int) -> bytes:
    """A request or engine key as the scripts take and keep it (binary; docs/design.md, Redis layout).

    A key in [0, 255 * 2**56): 8 bytes, big-endian; one in [255 * 2**56, 2**64) or [-2**63, 0) (negative
    int64 hashes of old engines): byte 255, ``+`` or ``-``, the 8 bytes of ``key mod 2**64``.
    ValueError outside [-2**63, 2**64).
    """
    if 0 <= key < _ESC:
        return _K8.pack(key)
    if -(1 << 63) <= key <= _M64:
        return (b"\xff-" if key < 0 else b"\xff+") + _K8.pack(key & _M64)
    raise ValueError(f"a key must be in [-2**63, 2**64), got {key!r}")


def k8s(keys: Sequence[int]) -> bytes:
    """Keys as one string (:func:`k8` each, concatenated)."""
    try:
        out = struct.pack(f">{len(keys)}Q", *keys)
        if not keys or max(keys) < _ESC:
            return out
    except struct.error:
        pass
    return b"".join(map(k8, keys))


def from_k8(b: bytes) -> int:
    """The key of its binary form (:func:`k8`)."""
    if len(b) == 8:
        return int.from_bytes(b, "big")
    v = int.from_bytes(b[2:], "big")
    return v - (1 << 64) if b[1:2] == b"-" else v


_words = k8s


class BatchOps:
    """The script's op arguments for a run of events, and which event each op is."""

    __slots__ = ("args", "events", "blocks", "tokens", "local", "tails", "grouped", "unmapped", "clears")

    def __init__(self) -> None:
        self.args: list[Any] = []
        self.events: list[int] = []  # index in the batch of each op's event
        self.blocks = 0
        self.tokens = False  # a store with token ids among the ops
        self.local: dict[int, int] = {}  # engine key -> request key stored by an earlier op of the run
        self.tails: list[tuple[int, int] | None] = []  # per op: (engine key, request key) of a store's last block
        self.grouped: list[int] = []  # the ops ('G', 'Q') of a KV-cache group, in order
        self.unmapped: list[int] = []  # per op: blocks of a sparse group store not mapped (own-hash mode)
        self.clears = False  # a clear among the ops

    def add(
        self, event: int, args: Sequence[Any], blocks: int, tail: tuple[int, int] | None = None, *,
        grouped: bool = False, unmapped: int = 0,
    ) -> None:
        if grouped:
            self.grouped.append(len(self.events))
        self.args.extend(args)
        self.events.append(event)
        self.blocks += blocks
        self.tails.append(tail)
        self.unmapped.append(unmapped)


def _chained_op(
    ix: _Index, ops: BatchOps, i: int, eks: list[int], toks: Sequence[int], bit: int,
    extras: list | None, lora: str | None, model: str | None, parent: int | None, tail: tuple[int, int] | None,
    group: tuple[Any, ...] | None = None,
) -> bool:
    """Add the op of a checked store with token ids; False when its parent's request key is not known here.

    ``group``: the head of a KV-cache group's op (:func:`kvindex.redis_groups.group_head`), else None.
    """
    pek: Any
    prk: Any
    if ix._compat or not eks:
        rks, pek, prk = eks, "", ""
        if group is not None and parent is not None:  # the parent decides the report-window trim only
            pek, prk = k8(parent), "*"
    else:
        prk_int: int | None = None
        if parent is not None:
            prk_int = ops.local.get(parent)
            if prk_int is None and tail is not None and tail[0] == parent:
                prk_int = tail[1]
            if prk_int is None:
                return False
        rks = ix.token_processor.chain(prk_int, toks, model=model, lora=lora, block_extra_keys=extras).tolist()
        pek, prk = ("", "") if parent is None else (k8(parent), k8(prk_int))  # type: ignore[arg-type]
        ops.local.update(zip(eks, rks))
    tail_ = (eks[-1], rks[-1]) if eks else None
    if group is None:
        ops.tokens = True
        ops.add(i, ("S", bit, pek, prk, _words(eks), _words(rks)), len(eks), tail_)
    else:
        ops.tokens = ops.tokens or group[3] == 1  # a full-attention group: the main tables, likely
        ops.add(i, (*group, "S", bit, pek, prk, _words(eks), _words(rks)), len(eks), tail_, grouped=True)
    return True


def removal_args(group_idx: int | None, bit: int, eks: Sequence[int]) -> tuple[Any, ...]:
    """The op of a BlockRemoved: of one KV-cache group ('Q') or, without a group, of the main tables ('R')."""
    if group_idx is None:
        return ("R", bit, _words(eks))
    return ("Q", group_idx, bit, _words(eks))


def _group_store_op(
    ix: _Index, ops: BatchOps, i: int, ev: Any, bit: int, model: str | None, tail: tuple[int, int] | None
) -> bool:
    """Add the op of a BlockStored of a KV-cache group (as the reference's ``block_stored(group=)``)."""
    spec = spec_from_store(ev.group_idx, ev.kv_cache_spec_kind, ev.block_size, ev.kv_cache_spec_sliding_window)
    head = group_head(spec)
    eks = [int(k) for k in ev.block_hashes]
    toks = ev.token_ids
    if toks is None or len(toks) == 0:
        ops.add(i, (*head, "T", bit, "", "", _words(eks), ""), len(eks), grouped=True)
        return True
    parent = None if ev.parent_block_hash is None else int(ev.parent_block_hash)
    if spec.rule != "full":  # never the primary group: its table's rules (kvindex.groups)
        if ix._compat:
            check_group_tokens(ix.block_size, len(eks), len(toks), ev.block_size)
            return _chained_op(ix, ops, i, eks, toks, bit, None, None, model, parent, tail, head)
        if is_sparse(ix.block_size, len(eks), len(toks)):
            ops.add(i, (*head, "L", bit, "", "", "", ""), 0, grouped=True, unmapped=len(eks))
            return True
    extras, lora = checked_store(ix.block_size, len(eks), toks, ev.block_size, ev.extra_keys, ev.lora_name)
    return _chained_op(ix, ops, i, eks, toks, bit, extras, lora, model, parent, tail, head)


def store_op(ix: _Index, ops: BatchOps, i: int, item: _Orphan, tail: tuple[int, int]) -> bool:
    """Add the op of a checked store (``item``) whose parent is the stream's last stored block ``tail``."""
    return _chained_op(
        ix, ops, i, list(item.engine_keys), item.token_ids, item.tier, item.extra_keys, item.lora_name, item.model,
        tail[0], tail,
    )


def _store_op(
    ix: _Index, ops: BatchOps, i: int, ev: Any, bit: int, model: str | None, tail: tuple[int, int] | None
) -> bool:
    """Add the op of BlockStored ``ev``; False when it needs the per-event method."""
    if ev.group_idx is not None:
        return _group_store_op(ix, ops, i, ev, bit, model, tail)
    eks = [int(k) for k in ev.block_hashes]
    toks = ev.token_ids
    if toks is None or len(toks) == 0:
        ops.add(i, ("T", bit, _words(eks)), len(eks))
        return True
    extras, lora = checked_store(ix.block_size, len(eks), toks, ev.block_size, ev.extra_keys, ev.lora_name)
    parent = ev.parent_block_hash
    return _chained_op(ix, ops, i, eks, toks, bit, extras, lora, model, None if parent is None else int(parent), tail)


def prepare(
    ix: _Index, pod: str, rank: int, events: Sequence[Any], start: int, model: str | None,
    kinds: tuple[type, type, type],
) -> tuple[BatchOps, int, bool]:
    """Ops for ``events[start:stop]``; returns (ops, stop, whether ``events[stop]`` needs the per-event method).

    Events of other types are passed over (as the per-event apply does).
    """
    stored_t, removed_t, cleared_t = kinds
    tail = ix._tails.get((pod, rank, model))
    ops = BatchOps()
    n = len(events)
    i = start
    while i < n and ops.blocks < MAX_BATCH_BLOCKS:
        ev = events[i]
        t = type(ev)
        try:
            if t is stored_t:
                if not _store_op(ix, ops, i, ev, bit_of(ev.tier), model, tail):
                    return ops, i, True
            elif t is removed_t:
                eks = [int(k) for k in ev.block_hashes]
                ops.add(i, removal_args(ev.group_idx, bit_of(ev.tier), eks), len(eks), grouped=ev.group_idx is not None)
                for k in eks:
                    ops.local.pop(k, None)
            elif t is cleared_t:
                ops.add(i, ("C",), 0)
                ops.clears = True
                ops.local.clear()
                tail = None
        except (ValueError, TypeError, NotImplementedError):
            return ops, i, True
        i += 1
    return ops, i, False


def tally(r: ApplyResult, events: Sequence[Any], ops: BatchOps, done: int, kinds: tuple[type, type, type]) -> None:
    """Count the first ``done`` ops' events in ``r`` (as the per-event apply counts them)."""
    stored_t, removed_t, _cleared_t = kinds
    for k in range(done):
        ev = events[ops.events[k]]
        t = type(ev)
        if t is stored_t:
            r.stored_blocks += len(ev.block_hashes)
            r.stored_by_tier[ev.tier] = r.stored_by_tier.get(ev.tier, 0) + len(ev.block_hashes)
        elif t is removed_t:
            r.removed_blocks += len(ev.block_hashes)
            r.removed_by_tier[ev.tier] = r.removed_by_tier.get(ev.tier, 0) + len(ev.block_hashes)
        else:
            r.clears += 1
