"""Tables the backends keep in Python, shared by all of them.

Orphans (stores waiting for an unknown parent), speculative entries and
router-held entries by request key are rare next to the blocks engines
report; every backend keeps them in :class:`SideTables`.  :func:`apply_each`
is the reference semantics of a batch apply.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from typing import NamedTuple

from sortedcontainers import SortedList

from kvindex.contract import ALL_MODELS, ApplyResult, GroupAware, IndexUnavailable, _AllModels
from kvindex.hybrid import spec_from_store
from kvindex.keys import extra_keys_from_event, int_lora_scope
from kvindex.tiers import tier_bit

__all__ = ["SideTables", "apply_each", "checked_store"]


def checked_store(
    index_block_size: int,
    n_blocks: int,
    token_ids: Sequence[int],
    block_size: int | None,
    extra_keys: Sequence[Sequence | None] | None,
    lora_name: str | None,
) -> tuple[list | None, str | None]:
    """Check one BlockStored with tokens; returns (per-block extra keys or None, the LoRA scope).

    Raises ValueError: a block size other than the index's, a token count
    other than ``block_size * n_blocks``, extra keys not one entry per block.
    """
    if block_size is not None and block_size != index_block_size:
        raise ValueError(f"event block_size {block_size} != index block_size {index_block_size}")
    if len(token_ids) != index_block_size * n_blocks:
        raise ValueError(f"{len(token_ids)} token ids for {n_blocks} blocks of {index_block_size}")
    extras = extra_keys_from_event(extra_keys, lora_name)
    if lora_name is None and extra_keys:
        lora_name = int_lora_scope(extra_keys)  # an old engine's numeric LoRA id: its own scope
    if extras is not None:
        if len(extras) != n_blocks:
            raise ValueError(f"{len(extras)} extra_keys entries for {n_blocks} blocks")
        if all(e is None for e in extras):
            extras = None
    return extras, lora_name


#: index class -> whether it is :class:`~kvindex.contract.GroupAware` (its methods take groups)
_GROUPED: dict[type, bool] = {}


def apply_each(
    index, pod: str, dp_rank: int, events, model: str | None, kinds: tuple[type, type, type], start: int = 0,
    result: ApplyResult | None = None,
) -> ApplyResult:
    """Apply ``events[start:]`` one call per event (``block_stored`` / ``block_removed`` / ``clear``).

    The reference semantics of :meth:`KVBlockIndex.apply_events`, for any
    index of the :class:`kvindex.contract.KVIndex` shape.  ``kinds`` are the
    (BlockStored, BlockRemoved, AllBlocksCleared) event classes
    (kvevents.events); events of another type are ignored.  An
    :class:`~kvindex.contract.IndexUnavailable` stops the batch there (see
    :attr:`ApplyResult.unavailable`).  Events' KV-cache groups reach a
    :class:`~kvindex.contract.GroupAware` index only.
    """
    stored_t, removed_t, cleared_t = kinds
    grouped = _GROUPED.get(type(index))
    if grouped is None:  # a runtime Protocol check costs microseconds: once per class
        grouped = _GROUPED[type(index)] = isinstance(index, GroupAware)
    r = result if result is not None else ApplyResult()
    for i in range(start, len(events)):
        ev = events[i]
        t = type(ev)
        try:
            if t is stored_t:
                if not grouped and ev.group_idx is not None and ev.sparse:
                    raise ValueError(f"a sparse {ev.kv_cache_spec_kind} store of KV-cache group {ev.group_idx}: "
                                     "this backend keeps no groups (backends native, python and redis do)")
                kw = {"group": spec_from_store(
                    ev.group_idx, ev.kv_cache_spec_kind, ev.block_size, ev.kv_cache_spec_sliding_window,
                )} if grouped and ev.group_idx is not None else {}
                index.block_stored(
                    pod, dp_rank, ev.block_hashes, ev.parent_block_hash, ev.token_ids, ev.tier,
                    block_size=ev.block_size, extra_keys=ev.extra_keys, lora_name=ev.lora_name, model=model, **kw,
                )
                r.stored_blocks += len(ev.block_hashes)
            elif t is removed_t:
                rkw = {"group_idx": ev.group_idx} if grouped and ev.group_idx is not None else {}
                index.block_removed(pod, dp_rank, ev.block_hashes, ev.tier, model=model, **rkw)
                r.removed_blocks += len(ev.block_hashes)
            elif t is cleared_t:
                index.clear(pod, dp_rank, model=model)
                r.clears += 1
        except (ValueError, TypeError) as exc:
            r.errors.append(str(exc))
        except IndexUnavailable as exc:
            r.unavailable, r.left = str(exc), len(events) - i
            break
        if t is stored_t:
            r.stored_by_tier[ev.tier] = r.stored_by_tier.get(ev.tier, 0) + len(ev.block_hashes)
        elif t is removed_t:
            r.removed_by_tier[ev.tier] = r.removed_by_tier.get(ev.tier, 0) + len(ev.block_hashes)
    return r


class _Orphan(NamedTuple):
    pod: str
    dp_rank: int
    engine_keys: tuple[int, ...]
    token_ids: Sequence[int]
    tier: int
    extra_keys: list | None
    lora_name: str | None
    model: str | None
    removed: set[int]  # engine keys a BlockRemoved took away while waiting




class SideTables:
    """The parts of the index both implementations keep in Python, shared by both.

    Orphans (stores waiting for an unknown parent), speculative entries
    (router-marked blocks with an expiry) and router-held entries by request
    key (e.g. the connector's decode-retained tier) are rare next to the
    blocks engines report, so :class:`KVBlockIndex` and
    :class:`kvindex.native.NativeKVBlockIndex` keep them in the same Python
    tables.  A subclass calls :meth:`_init_side_tables` in its constructor and
    provides ``_lock`` (an RLock), ``max_orphan_blocks`` and the counter dict
    ``_c`` (keys ``orphans``, ``orphans_dropped``, ``speculative_expired``).
    """

    _lock: threading.RLock
    _c: dict[str, int]
    max_orphan_blocks: int

    def apply_events(
        self, pod: str, dp_rank: int, events, *, model: str | None = None, kinds: tuple[type, type, type]
    ) -> ApplyResult:
        """Apply one publisher's decoded batch, in order (write path: pool shard -> index).

        Args:
            pod, dp_rank, model: the publisher (as :meth:`block_stored`).
            events: the batch's events (kvevents.events BlockStored /
                BlockRemoved / AllBlocksCleared, as decoded from vLLM's
                ``[ts, events, dp_rank]``).
            kinds: the (BlockStored, BlockRemoved, AllBlocksCleared) classes
                (this floor does not import kvevents).

        Returns:
            :class:`ApplyResult`.  An event the per-event call would refuse
            (ValueError / TypeError) is reported in ``errors`` and skipped; the
            index is left as that call leaves it.

        The reference applies each event with its own call; the compiled
        index applies whole runs of events in one native call.
        """
        return apply_each(self, pod, dp_rank, events, model, kinds)

    def _init_side_tables(self) -> None:
        # orphans: (model, unknown parent engine key) -> waiting stores; keyed by
        # model because engines do not hash the model, so only a parent stored
        # under the same model may release a waiting store
        self._orphans: OrderedDict[tuple[str | None, int], list[_Orphan]] = OrderedDict()
        self._orphan_blocks = 0
        # (pod, rank, model, engine key) -> the waiting stores holding that block
        self._orphan_by_ek: dict[tuple[str, int, str | None, int], list[_Orphan]] = {}
        # speculative: request key -> pod -> expiry; expiry order; pod -> keys
        self._spec: dict[int, dict[str, float]] = {}
        self._spec_order: SortedList = SortedList()
        self._spec_by_pod: dict[str, set[int]] = {}
        # held by request key (no engine key; e.g. decode-retained):
        # pod -> request key -> tier bit -> reference count; pod -> request key -> mask
        self._held: dict[str, dict[int, dict[int, int]]] = {}
        self._held_mask: dict[str, dict[int, int]] = {}

    def add_held(self, pod: str, request_keys: Iterable[int], tier: str) -> None:
        """Count ``pod`` as holding ``request_keys`` in ``tier``, by request key, until removed.

        For KV the router knows about without engine events, e.g. the blocks a
        decode pod retains for a conversation's next turn (tier
        ``decode_retained``, kept by :class:`connector.retained.RetainedStore`).
        Reference-counted per (pod, request key, tier): each add needs one
        :meth:`remove_held`.  No expiry and no LRU eviction of their own (the
        caller owns their lifetime); :meth:`clear` of the whole pod drops them.
        The read path ORs the tier into the pod's mask of each key.
        """
        bit = tier_bit(tier)
        with self._lock:
            held = self._held.setdefault(pod, {})
            masks = self._held_mask.setdefault(pod, {})
            for rk in request_keys:
                rk = int(rk)
                counts = held.setdefault(rk, {})
                counts[bit] = counts.get(bit, 0) + 1
                masks[rk] = masks.get(rk, 0) | bit

    def remove_held(self, pod: str, request_keys: Iterable[int], tier: str) -> int:
        """Undo one :meth:`add_held` of ``request_keys``; returns the entries that ended.

        Keys not held (or already released) are skipped.
        """
        bit = tier_bit(tier)
        ended = 0
        with self._lock:
            held = self._held.get(pod)
            if held is None:
                return 0
            masks = self._held_mask[pod]
            for rk in request_keys:
                rk = int(rk)
                counts = held.get(rk)
                c = counts.get(bit) if counts is not None else None
                if c is None:
                    continue
                if c > 1:
                    counts[bit] = c - 1
                    continue
                del counts[bit]
                ended += 1
                if counts:
                    masks[rk] &= ~bit
                else:
                    del held[rk]
                    del masks[rk]
            if not held:
                del self._held[pod]
                del self._held_mask[pod]
        return ended

    def _add_orphan(self, parent_ek: int, item: _Orphan) -> None:
        n = len(item.engine_keys)
        self._orphans.setdefault((item.model, parent_ek), []).append(item)
        self._orphan_blocks += n
        for ek in item.engine_keys:
            key = (item.pod, item.dp_rank, item.model, ek)
            lst = self._orphan_by_ek.get(key)
            if lst is None:
                self._orphan_by_ek[key] = [item]
            else:
                lst.append(item)  # the same block stored again while waiting (two physical copies)
        self._c["orphans"] += n
        while self._orphan_blocks > self.max_orphan_blocks and self._orphans:
            _k, group = self._orphans.popitem(last=False)
            for g in group:
                self._forget_orphan(g)
                self._c["orphans_dropped"] += len(g.engine_keys)

    def _forget_orphan(self, item: _Orphan) -> None:
        """Account for an orphan leaving the table (attached or dropped)."""
        self._orphan_blocks -= len(item.engine_keys)
        for ek in item.engine_keys:
            key = (item.pod, item.dp_rank, item.model, ek)
            lst = self._orphan_by_ek.get(key)
            if lst is not None:
                lst[:] = [w for w in lst if w is not item]
                if not lst:
                    del self._orphan_by_ek[key]

    def _drop_orphans_of(self, pod: str, dp_rank: int | None, model: str | None | _AllModels = ALL_MODELS) -> None:
        every = model is ALL_MODELS
        for pk in list(self._orphans):
            group = self._orphans[pk]
            keep = [
                g for g in group
                if not (g.pod == pod and (dp_rank is None or g.dp_rank == dp_rank) and (every or g.model == model))
            ]
            if len(keep) != len(group):
                kept = {id(g) for g in keep}
                for g in group:
                    if id(g) not in kept:
                        self._forget_orphan(g)
                        self._c["orphans_dropped"] += len(g.engine_keys)
                if keep:
                    self._orphans[pk] = keep
                else:
                    del self._orphans[pk]

    def _expire(self, now: float) -> None:
        order = self._spec_order
        while order and order[0][0] <= now:
            expiry, rk, pod = order.pop(0)
            holders = self._spec.get(rk)
            if holders is not None and holders.get(pod) == expiry:
                del holders[pod]
                self._unlink_speculative(rk, pod, holders)
                self._c["speculative_expired"] += 1

    def _confirm_speculative(self, pod: str, rk: int) -> None:
        """A BlockStored confirmed ``pod``'s speculative entry of ``rk``, if it has one."""
        holders = self._spec.get(rk)
        expiry = holders.pop(pod, None) if holders is not None else None
        if expiry is not None:
            self._spec_order.discard((expiry, rk, pod))
            self._c["speculative_confirmed"] += 1
            self._unlink_speculative(rk, pod, holders)

    def _unlink_speculative(self, rk: int, pod: str, holders: dict[str, float]) -> None:
        """Drop what is left of ``pod``'s speculative entry of ``rk`` (already taken out of ``holders``)."""
        if not holders:
            del self._spec[rk]
        mine = self._spec_by_pod.get(pod)
        if mine is not None:
            mine.discard(rk)
            if not mine:
                del self._spec_by_pod[pod]

