"""Per-KV-cache-group state of the reference and compiled indexes (hybrid models).

vLLM publishes one BlockStored per KV-cache group with the same block hashes
and a different ``group_idx`` (vllm/v1/core/block_pool.py; its prefix cache
keys blocks by hash + group id), and a BlockRemoved names the group of the
block it drops.  Per publisher (pod, DP rank, model) the reference keeps:

- the spec of each group, learned from its stores (BlockRemoved has no kind);
- the *primary* group: the first full-attention group seen (a store with no
  kind counts as full attention).  Its blocks live in the index's main tables
  (what ``prefix_match`` walks; the compiled core for the compiled index), so
  a plain model (one group, ``group_idx`` absent or 0) costs nothing more per
  block;
- every other group's blocks in a table of its own (engine key -> request
  key and tier mask), so a removal or store of one group never touches
  another group's entries;
- a report window (:meth:`GroupsMixin.distrust_reports`, set by the healing
  policy while it asks for ``kv_cache_report_mode: "full"``): during it a
  parent-nil store of a non-primary group, the shape of a re-announce, is
  kept only for the blocks the group surely holds at its end
  (:func:`kvindex.hybrid.held_at_hit_end`).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from kvindex.hybrid import GroupSpec, held_at_hit_end
from kvindex.side_tables import checked_store

__all__ = ["GroupTables", "GroupsMixin", "MAIN", "SIDE", "UNKNOWN"]

Stream = tuple[str, int, "str | None"]  # (pod, DP rank, model): one publisher

#: Non-primary stores held per publisher while their parent is unknown (own-hash mode).
MAX_WAITING = 64

#: Where a group's blocks live: the main tables, a group table, or nowhere known.
MAIN, SIDE, UNKNOWN = "main", "side", "unknown"


class _Table:
    """One non-primary group's blocks: engine key -> [request key, tier mask]; request key -> tier mask."""

    __slots__ = ("by_ek", "by_rk")

    def __init__(self) -> None:
        self.by_ek: dict[int, list[int]] = {}
        self.by_rk: dict[int, int] = {}

    def put(self, ek: int, rk: int, bit: int) -> None:
        entry = self.by_ek.get(ek)
        if entry is not None and entry[0] != rk:  # the engine reused the hash for other content
            self.drop(ek, -1)
            entry = None
        if entry is None:
            self.by_ek[ek] = [rk, bit]
        else:
            entry[1] |= bit
        self.by_rk[rk] = self.by_rk.get(rk, 0) | bit

    def drop(self, ek: int, bit: int) -> bool:
        """Clear ``bit`` (-1 = all) of the block ``ek``; True if it held that tier."""
        entry = self.by_ek.get(ek)
        if entry is None or not entry[1] & bit:
            return False
        entry[1] &= ~bit
        rk = entry[0]
        if entry[1]:
            self.by_rk[rk] = entry[1]
        else:
            del self.by_ek[ek]
            del self.by_rk[rk]
        return True


class GroupTables:
    """Learned group specs, the primary group and the other groups' tables, per publisher."""

    def __init__(self, capacity: int = 1_000_000) -> None:
        self.capacity = capacity  # entries over every non-primary table; the oldest go first beyond it
        self.size = 0
        self.evictions = 0
        self.specs: dict[Stream, dict[int, GroupSpec]] = {}
        self.primary: dict[Stream, int] = {}
        self.tables: dict[tuple[Stream, int], _Table] = {}
        self.unmapped = 0  # own-hash mode: non-primary stores not mapped (parent unknown, or sparse)
        self.distrust: dict[Stream, float] = {}  # stream -> end (time.monotonic) of its report window
        self.hybrid: dict[tuple[str, str | None], set[int]] = {}  # (pod, model) -> ranks with a hybrid stream
        #: own-hash mode: non-primary stores waiting for their parent (vLLM publishes group 0 first in a
        #: step, so a sliding-window group 0's parent often arrives with the full-attention store after it)
        self.waiting: dict[Stream, list[tuple[Any, ...]]] = {}
        self.trimmed = 0  # blocks of re-announce-shaped stores not believed (report window)

    # -- write

    def learn(self, stream: Stream, spec: GroupSpec) -> str:
        """Record ``spec`` for the stream; where its blocks go (:data:`MAIN` or :data:`SIDE`)."""
        specs = self.specs.get(stream)
        if specs is None:
            specs = self.specs[stream] = {}
        if specs.get(spec.group_idx) != spec:
            specs[spec.group_idx] = spec
            if len(specs) > 1 or spec.rule != "full":
                self.hybrid.setdefault((stream[0], stream[2]), set()).add(stream[1])
        p = self.primary.get(stream)
        if p is None and spec.rule == "full":
            p = self.primary[stream] = spec.group_idx
        return MAIN if p == spec.group_idx else SIDE

    def route(self, stream: Stream, group_idx: int | None) -> str:
        """Where a BlockRemoved of ``group_idx`` applies (no group learned: the main tables, as before)."""
        specs = self.specs.get(stream)
        if group_idx is None or not specs:
            return MAIN
        if self.primary.get(stream) == group_idx:
            return MAIN
        return SIDE if (stream, group_idx) in self.tables else UNKNOWN

    def put(self, stream: Stream, group_idx: int, pairs: Sequence[tuple[int, int]], bit: int) -> int:
        table = self.tables.get((stream, group_idx))
        if table is None:
            table = self.tables[(stream, group_idx)] = _Table()
        before = len(table.by_ek)
        for ek, rk in pairs:
            table.put(ek, rk, bit)
        self.size += len(table.by_ek) - before
        if self.size > self.capacity:
            self._evict((stream, group_idx))
        return len(pairs)

    def _evict(self, first: tuple[Stream, int]) -> None:
        """Forget the oldest entries (the written table's first) until the tables fit the capacity."""
        for key in [first, *(k for k in self.tables if k != first)]:
            table = self.tables.get(key)
            while table is not None and table.by_ek and self.size > self.capacity:
                table.drop(next(iter(table.by_ek)), -1)
                self.size -= 1
                self.evictions += 1
            if table is not None and not table.by_ek:
                del self.tables[key]
            if self.size <= self.capacity:
                return

    def resolve(self, stream: Stream, group_idx: int, ek: int) -> int | None:
        table = self.tables.get((stream, group_idx))
        entry = table.by_ek.get(ek) if table is not None else None
        return entry[0] if entry is not None else None

    def drop(self, stream: Stream, group_idx: int, ek: int, bit: int) -> bool:
        table = self.tables.get((stream, group_idx))
        before = len(table.by_ek) if table is not None else 0
        if table is None or not table.drop(ek, bit):
            return False
        self.size -= before - len(table.by_ek)
        if not table.by_ek:
            del self.tables[(stream, group_idx)]
        return True

    def clear(self, match: Callable[[Stream], bool]) -> int:
        """Forget the groups of every stream ``match`` accepts; returns the non-primary entries dropped."""
        n = 0
        for key in [k for k in self.tables if match(k[0])]:
            n += len(self.tables.pop(key).by_ek)
        self.size -= n
        for stream in [s for s in self.waiting if match(s)]:
            self.unmapped += sum(len(w[2]) for w in self.waiting.pop(stream))
        for stream in [s for s in self.specs if match(s)]:
            del self.specs[stream]
            self.primary.pop(stream, None)
            ranks = self.hybrid.get((stream[0], stream[2]))
            if ranks is not None:
                ranks.discard(stream[1])
                if not ranks:
                    del self.hybrid[(stream[0], stream[2])]
        return n

    def believed(self, stream: Stream, group: GroupSpec, parent: int | None, n: int) -> int:
        """How many of a store's ``n`` blocks (its last ones) to keep: all, unless it may be a re-announce."""
        if parent is not None or n == 0:
            return n
        until = self.distrust.get(stream)
        if until is None:
            return n
        if time.monotonic() >= until:
            del self.distrust[stream]
            return n
        keep = held_at_hit_end(group)
        if keep is None or keep >= n:
            return n
        self.trimmed += n - keep
        return keep

    # -- read

    def masks(self, stream: Stream, group_idx: int, keys: Sequence[int]) -> list[int]:
        """Tier mask per request key (0 = absent) of a non-primary group."""
        table = self.tables.get((stream, group_idx))
        if table is None:
            return [0] * len(keys)
        get = table.by_rk.get
        return [get(rk, 0) for rk in keys]

    def keys_of(self, stream: Stream) -> set[int]:
        """Request keys the stream's non-primary groups hold."""
        out: set[int] = set()
        for (s, _g), table in self.tables.items():
            if s == stream:
                out.update(table.by_rk)
        return out

    def entries(self) -> int:
        return sum(len(t.by_ek) for t in self.tables.values())


class GroupsMixin:
    """The per-group write and read methods of the reference and compiled indexes (see the module docstring).

    The index provides ``_lock``, ``_groups`` (a :class:`GroupTables`), ``_c``
    (counters ``stored_blocks``, ``removed_blocks``, ``unknown_removals``,
    ``unknown_offloads``), ``_compat``, ``block_size``, ``token_processor``,
    ``_resolve`` (the main tables' engine key -> request key) and
    ``_main_masks`` (the main tables' tier mask per request key of one
    publisher).
    """

    _groups: GroupTables
    _c: dict[str, int]
    _compat: bool
    block_size: int
    token_processor: Any
    _lock: Any
    _resolve: Callable[..., int | None]
    _main_masks: Callable[[str, int, "str | None", list[int]], list[int]]

    def _store_in_group(
        self, stream: Stream, group: GroupSpec, engine_keys: Sequence[int], parent: int | None,
        token_ids: Sequence[int] | None, bit: int, block_size: int | None,
        extra_keys: Sequence[Sequence[Any] | None] | None, lora_name: str | None,
    ) -> int:
        """A BlockStored of a non-primary group: into that group's table only."""
        g, tables = group.group_idx, self._groups
        keys = [int(ek) for ek in engine_keys]
        if not token_ids:  # token-less (an offloading connector): a tier for blocks the group holds
            pairs = [(ek, rk) for ek in keys if (rk := tables.resolve(stream, g, ek)) is not None]
            self._c["unknown_offloads"] += len(keys) - len(pairs)
        elif self._compat:  # request keys are the engine's hashes, at any multiple of the block size
            size = block_size if block_size is not None else self.block_size
            # a sparse store (more whole blocks of tokens than hashes, vLLM #44451) needs no token chunk here
            if size % self.block_size or len(token_ids) % size or len(token_ids) < size * len(keys):
                raise ValueError(f"{len(token_ids)} token ids for {len(keys)} blocks of {size} "
                                 f"(index block size {self.block_size})")
            pairs = [(ek, ek) for ek in keys]
        elif len(token_ids) > self.block_size * len(keys) and not len(token_ids) % self.block_size:
            tables.unmapped += len(keys)  # sparse: which token chunk each hash is, unknown (own-hash mode)
            return 0
        else:
            extras, lora = checked_store(self.block_size, len(keys), token_ids, block_size, extra_keys, lora_name)
            prk = None
            if parent is not None:
                prk = self._group_parent(stream, g, parent)
                if prk is None:
                    self._wait(stream, (group, parent, keys, token_ids, bit, extras, lora, set()))
                    return 0
            rks = self.token_processor.chain(prk, token_ids, model=stream[2], lora=lora, block_extra_keys=extras)
            pairs = list(zip(keys, rks.tolist()))
        keep = tables.believed(stream, group, parent, len(pairs))
        if keep < len(pairs):
            pairs = pairs[len(pairs) - keep:]
        self._c["stored_blocks"] += len(pairs)
        return tables.put(stream, g, pairs, bit)

    def _group_parent(self, stream: Stream, g: int, parent: int) -> int | None:
        """The request key of a non-primary store's parent: in its group, else the main tables."""
        prk = self._groups.resolve(stream, g, parent)
        return prk if prk is not None else self._resolve(stream[0], stream[1], parent, stream[2])

    def _wait(self, stream: Stream, item: tuple[Any, ...]) -> None:
        """Hold a store whose parent is unknown; the oldest beyond :data:`MAX_WAITING` is dropped (unmapped)."""
        waiting = self._groups.waiting.setdefault(stream, [])
        waiting.append(item)
        if len(waiting) > MAX_WAITING:
            self._groups.unmapped += len(waiting.pop(0)[2])

    def _release_waiting(self, stream: Stream) -> None:
        """Map the stream's waiting stores whose parent is now known (after a primary store)."""
        waiting = self._groups.waiting.pop(stream, None)
        if not waiting:
            return
        progress = True
        while waiting and progress:
            progress = False
            for item in list(waiting):
                group, parent, keys, token_ids, bit, extras, lora, gone = item
                prk = self._group_parent(stream, group.group_idx, parent)
                if prk is None:
                    continue
                waiting.remove(item)
                rks = self.token_processor.chain(prk, token_ids, model=stream[2], lora=lora, block_extra_keys=extras)
                pairs = [(ek, rk) for ek, rk in zip(keys, rks.tolist()) if ek not in gone]
                self._c["stored_blocks"] += len(pairs)
                self._groups.put(stream, group.group_idx, pairs, bit)
                progress = True
        if waiting:
            self._groups.waiting[stream] = waiting

    def _remove_in_group(self, stream: Stream, group_idx: int | None, engine_keys: Iterable[int], bit: int) -> int:
        """A BlockRemoved of a non-primary (or unknown) group: only that group's entries."""
        removed = 0
        waiting = self._groups.waiting.get(stream, ())
        for ek in engine_keys:
            ek = int(ek)
            if group_idx is not None and self._groups.drop(stream, group_idx, ek, bit):
                removed += 1
                continue
            held = [w for w in waiting if w[0].group_idx == group_idx and w[4] == bit and ek in w[2]]
            for w in held:  # a waiting store's block is gone: never mapped later
                w[7].add(ek)
            if held:
                removed += 1
            else:
                self._c["unknown_removals"] += 1
        self._c["removed_blocks"] += removed
        return removed

    def distrust_reports(self, pod: str, dp_rank: int = 0, *, model: str | None = None, seconds: float = 30.0) -> None:
        """For ``seconds`` from now, believe a parent-nil store of the stream's non-primary groups
        only for the blocks they surely hold at its end (module doc); 0 ends the window."""
        stream = (pod, dp_rank, model)
        with self._lock:
            if seconds > 0:
                self._groups.distrust[stream] = time.monotonic() + seconds
            else:
                self._groups.distrust.pop(stream, None)

    def any_grouped(self) -> bool:
        """Whether any stream's stores named more than one group or a non-full-attention one (no lock: a hint)."""
        return bool(self._groups.hybrid)

    def grouped_ranks(self, pod: str, *, model: str | None = None) -> list[int]:
        """DP ranks of ``pod`` (under ``model``) whose stores named more than one group or a
        non-full-attention one, sorted; [] for a plain model."""
        ranks = self._groups.hybrid.get((pod, model))
        if not ranks:
            return []
        with self._lock:
            return sorted(ranks)

    def group_specs(self, pod: str, dp_rank: int = 0, *, model: str | None = None) -> dict[int, GroupSpec]:
        """group_idx -> spec learned from the stores of publisher (pod, rank, model); {} before any grouped store."""
        with self._lock:
            return dict(self._groups.specs.get((pod, dp_rank, model), {}))

    def group_match(
        self, request_keys: Sequence[int], pod: str, dp_rank: int = 0, *, model: str | None = None
    ) -> dict[int, list[int]]:
        """group_idx -> tier mask per request key (0: that group does not hold it), for every learned group.

        Unlike ``prefix_match`` the walk does not stop at a missing block:
        sliding-window and Mamba groups hit on blocks after holes (see
        :func:`kvindex.hybrid.predict_hit`).  Does not refresh recency.
        """
        keys = request_keys.tolist() if hasattr(request_keys, "tolist") else [int(k) for k in request_keys]
        stream = (pod, dp_rank, model)
        with self._lock:
            out: dict[int, list[int]] = {}
            primary = self._groups.primary.get(stream)
            for g in self._groups.specs.get(stream, {}):
                out[g] = self._main_masks(pod, dp_rank, model, keys) if g == primary else (
                    self._groups.masks(stream, g, keys))
            return out
