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

from collections.abc import Iterable, Sequence
from typing import Any, Protocol

from kvindex.contract import ApplyResult
from kvindex.keys import TokenProcessor
from kvindex.side_tables import _Orphan, checked_store
from kvindex.tiers import tier_bit

__all__ = ["BatchOps", "MAX_BATCH_BLOCKS", "bit_of", "prepare", "store_op", "tally"]

#: blocks per script call at most (a script blocks the server while it runs)
MAX_BATCH_BLOCKS = 1024
_MAX_BIT = 1 << 30


def bit_of(tier: str) -> int:
    """The tier's bit (:func:`kvindex.tiers.tier_bit`); ValueError beyond the 31 tiers Lua masks hold."""
    b = tier_bit(tier)
    if b > _MAX_BIT:
        raise ValueError(f"the Redis backend holds at most 31 tiers; {tier!r} is beyond")
    return b


class _Index(Protocol):
    """What the preparation reads of :class:`kvindex.redis_index.RedisKVBlockIndex`."""

    _compat: bool
    _tails: dict[tuple[str, int, str | None], tuple[int, int]]
    block_size: int
    token_processor: TokenProcessor


def _words(keys: Iterable[int]) -> str:
    return " ".join(map(str, keys))


class BatchOps:
    """The script's op arguments for a run of events, and which event each op is."""

    __slots__ = ("args", "events", "blocks", "tokens", "local", "tails")

    def __init__(self) -> None:
        self.args: list[Any] = []
        self.events: list[int] = []  # index in the batch of each op's event
        self.blocks = 0
        self.tokens = False  # a store with token ids among the ops
        self.local: dict[int, int] = {}  # engine key -> request key stored by an earlier op of the run
        self.tails: list[tuple[int, int] | None] = []  # per op: (engine key, request key) of a store's last block

    def add(self, event: int, args: Sequence[Any], blocks: int, tail: tuple[int, int] | None = None) -> None:
        self.args.extend(args)
        self.events.append(event)
        self.blocks += blocks
        self.tails.append(tail)


def _chained_op(
    ix: _Index, ops: BatchOps, i: int, eks: list[int], toks: Sequence[int], bit: int,
    extras: list | None, lora: str | None, model: str | None, parent: int | None, tail: tuple[int, int] | None,
) -> bool:
    """Add the op of a checked store with token ids; False when its parent's request key is not known here."""
    if ix._compat or not eks:
        rks, pek, prk = eks, "", ""
    else:
        prk_int: int | None = None
        if parent is not None:
            prk_int = ops.local.get(parent)
            if prk_int is None and tail is not None and tail[0] == parent:
                prk_int = tail[1]
            if prk_int is None:
                return False
        rks = ix.token_processor.chain(prk_int, toks, model=model, lora=lora, block_extra_keys=extras).tolist()
        pek, prk = ("", "") if parent is None else (parent, prk_int)
        ops.local.update(zip(eks, rks))
    ops.tokens = True
    ops.add(i, ("S", bit, pek, prk, _words(eks), _words(rks)), len(eks), (eks[-1], rks[-1]) if eks else None)
    return True


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
                ops.add(i, ("R", bit_of(ev.tier), _words(eks)), len(eks))
                for k in eks:
                    ops.local.pop(k, None)
            elif t is cleared_t:
                ops.add(i, ("C",), 0)
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
