"""The two-level KV block index in pure Python: the reference (the oracle the other backends are tested against).

Level 1: request key -> the pods holding that block, per pod the DP ranks and
the tiers (bit mask, see :mod:`kvindex.tiers`) each rank holds it in.
Level 2: engine key (the engine's block hash from KV events) -> request key
(ours, from tokens; see :mod:`kvindex.keys`).  A reverse map per (pod, DP rank)
engine key -> request key makes clearing a pod cost O(that pod's keys).

Write path (the kvevents pool, one writer per pod at a time): ``block_stored``,
``block_removed``, ``clear``, ``add_speculative``; router-held entries (the
connector's decode-retained tier): ``add_held``, ``remove_held``. Read path
(any thread): ``prefix_match``, ``lookup``.

The event semantics (vllm/distributed/kv_events.py, vLLM 0.32): docs/design.md, "The index".

Thread safety: every public method holds one re-entrant lock; the read path
also refreshes recency (least-recently-used eviction counts reads as use).
"""

from __future__ import annotations

import time
from collections import OrderedDict, deque
from collections.abc import Callable, Collection, Iterable, Sequence
from itertools import takewhile

from kvindex.contract import ALL_MODELS, IndexStats, PodEntry, RequestKeys, _AllModels
from kvindex.groups import MAIN, GroupsMixin, GroupTables
from kvindex.hybrid import GroupSpec
from kvindex.locks import WriteLock
from kvindex.keys import TokenProcessor
from kvindex.side_tables import SideTables, _Orphan, checked_store
from kvindex.tiers import GPU, tier_bit, tier_names

__all__ = ["KVBlockIndex"]

_GPU_BIT = tier_bit(GPU)


class _PodBlock:
    """A pod's copy of one block: per DP rank [tier mask, engine key, model]; mask = OR."""

    __slots__ = ("mask", "ranks")

    def __init__(self, mask: int = 0, ranks: dict[int, list[int]] | None = None) -> None:
        self.mask = mask
        self.ranks: dict[int, list[int]] = {} if ranks is None else ranks

    def refresh(self) -> None:
        m = 0
        for r in self.ranks.values():
            m |= r[0]
        self.mask = m


_Stream = tuple[str, int, "str | None"]  # (pod, DP rank, model): one publisher


class KVBlockIndex(SideTables, GroupsMixin):
    """In-memory two-level index of which pod holds which KV block.

    Args:
        token_processor: turns token ids into request keys; its block size is
            the block size the index expects in events.  Defaults to
            ``TokenProcessor()`` (block size 16, ``xxh3_chain``).
        capacity: bound on request keys held; beyond it the least recently
            used key (stored or matched) is evicted and counted.  >= 1.
        max_orphan_blocks: bound on blocks waiting for an unknown parent; the
            oldest waiting group is dropped (counted) beyond it.  >= 0.
        clock: monotonic seconds, for speculative-entry expiry.

    Raises:
        ValueError: capacity < 1 or max_orphan_blocks < 0.
    """

    def __init__(
        self,
        token_processor: TokenProcessor | None = None,
        *,
        capacity: int = 1_000_000,
        max_orphan_blocks: int = 100_000,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1, got {capacity}")
        if max_orphan_blocks < 0:
            raise ValueError(f"max_orphan_blocks must be >= 0, got {max_orphan_blocks}")
        self.token_processor = token_processor or TokenProcessor()
        self.block_size = self.token_processor.block_size
        self.capacity = capacity
        self.max_orphan_blocks = max_orphan_blocks
        self._compat = bool(self.token_processor.engine_compatible)
        self._clock = clock
        self._lock = WriteLock()  # kvindex.locks
        # level 1: request key -> pod -> _PodBlock
        self._blocks: OrderedDict[int, dict[str, _PodBlock]] = OrderedDict()
        # the same masks by pod: pod -> request key -> tier mask (OR over ranks), for the read path
        self._pod_masks: dict[str, dict[int, int]] = {}
        # pod -> one bit (assigned while the pod holds a key, freed for reuse when
        # it holds none); request key -> OR of the bits of the pods holding it;
        # pod -> its keys held in anything but gpu alone (0: every mask of that
        # pod is the gpu bit)
        self._pod_bits: dict[str, int] = {}
        self._free_bits: list[int] = []
        self._holders: dict[int, int] = {}
        self._mixed: dict[str, int] = {}
        # level 2, per model (engines do not put the model in their hashes):
        # model -> engine key -> [request key, number of (pod, rank) holders]
        self._engine: dict[str | None, dict[int, list[int]]] = {}
        # reverse: (pod, rank, model) -> engine key -> request key
        self._streams: dict[_Stream, dict[int, int]] = {}
        self._models: set[str | None] = set()  # models named by stored events (key scopes)
        self._maybe_empty: set[_Stream] = set()  # stream maps that may have emptied
        self._init_side_tables()  # orphans, speculative and held entries
        self._groups = GroupTables(capacity)  # KV-cache groups other than the primary one (hybrid models)
        self._c = dict.fromkeys((
            "evictions", "stored_blocks", "removed_blocks", "unknown_removals", "unknown_offloads", "orphans",
            "orphans_attached", "orphans_dropped", "speculative_confirmed", "speculative_expired", "clears",
        ), 0)

    # ------------------------------------------------------------------ write

    def block_stored(
        self,
        pod: str,
        dp_rank: int,
        engine_keys: Sequence[int],
        parent_engine_key: int | None,
        token_ids: Sequence[int] | None,
        tier: str,
        *,
        block_size: int | None = None,
        extra_keys: Sequence[Sequence | None] | None = None,
        lora_name: str | None = None,
        model: str | None = None,
        group: GroupSpec | None = None,
    ) -> int:
        """Apply one BlockStored event; returns the number of blocks attached now.

        Mirrors vllm/distributed/kv_events.py BlockStored (vLLM 0.32).

        Args:
            pod, dp_rank: the publisher (pod id from the topic; rank from the batch).
            engine_keys, parent_engine_key: the event's block hashes (uint64) and
                the hash of the block before the first one (None at a sequence start).
            token_ids: ``block_size * len(engine_keys)`` token ids, or empty /
                None for a token-less store (adds ``tier`` to known blocks).
            tier: tier name of the copy (``gpu``, ``cpu``, ...).
            block_size: the event's; must equal the token processor's when tokens are given.
            extra_keys: per block, the untagged extra keys of the event (a LoRA
                name first is stripped: the LoRA name scopes the chain root).
            lora_name, model: scope the keys (model from the topic).
            group: the event's KV-cache group (:func:`kvindex.hybrid.spec_from_store`);
                None for a plain store.  See :mod:`kvindex.groups`.

        Returns:
            Blocks attached now (orphans released included); 0 when they wait
            for an unknown parent.

        Raises:
            ValueError: see :func:`kvindex.side_tables.checked_store`.
        """
        bit = tier_bit(tier)
        with self._lock:
            if group is not None and self._groups.learn((pod, dp_rank, model), group) != MAIN:
                return self._store_in_group((pod, dp_rank, model), group, engine_keys, parent_engine_key,
                                            token_ids, bit, block_size, extra_keys, lora_name)
            if not token_ids:
                n = self._store_tokenless(pod, dp_rank, engine_keys, bit, model)
                if self._maybe_empty:
                    self._prune_streams()
                return n
            extras, lora_name = checked_store(
                self.block_size, len(engine_keys), token_ids, block_size, extra_keys, lora_name)
            if model not in self._models:
                self._models.add(model)
            if self._compat:
                stream = self._stream(pod, dp_rank, model)
                for ek in engine_keys:
                    self._put(pod, dp_rank, ek, ek, bit, model, stream)
                n = len(engine_keys)
            else:
                item = _Orphan(pod, dp_rank, tuple(engine_keys), token_ids, bit, extras, lora_name, model, set())
                parent_rk = None if parent_engine_key is None else self._resolve(pod, dp_rank, parent_engine_key, model)
                if parent_engine_key is not None and parent_rk is None:
                    self._add_orphan(parent_engine_key, item)
                    n = 0
                else:
                    n = self._attach(item, parent_rk)
                if self._groups.waiting:
                    self._release_waiting((pod, dp_rank, model))
            if self._maybe_empty:
                self._prune_streams()
            return n

    def block_removed(
        self, pod: str, dp_rank: int, engine_keys: Iterable[int], tier: str, *, model: str | None = None,
        group_idx: int | None = None,
    ) -> int:
        """Apply one BlockRemoved: drop ``tier`` from the copies of publisher (pod, rank, model).

        ``group_idx``: the event's KV-cache group; only that group's entries go.

        Mirrors vllm/distributed/kv_events.py BlockRemoved (vLLM 0.32).
        Unknown engine keys are counted (``unknown_removals``) and skipped.
        A block still waiting for its parent is removed from every waiting
        store of that publisher that holds it (it is never attached later).
        Returns the number of tier copies removed.
        """
        bit = tier_bit(tier)
        removed = 0
        with self._lock:
            if self._groups.route((pod, dp_rank, model), group_idx) != MAIN:
                return self._remove_in_group((pod, dp_rank, model), group_idx, engine_keys, bit)
            stream = self._streams.get((pod, dp_rank, model))
            for ek in engine_keys:
                rk = stream.get(ek) if stream is not None else None
                hit = rk is not None and self._drop_copy(pod, dp_rank, ek, rk, bit)
                # the same block may also wait in a store whose parent is unknown (e.g. its cpu copy
                # was attached through another pod's key while its gpu store waits): drop it there too
                waiting = self._orphan_by_ek.get((pod, dp_rank, model, ek)) if self._orphan_by_ek else None
                for w in waiting or ():
                    if w.tier & bit and ek not in w.removed:
                        w.removed.add(ek)  # never attach a block the engine dropped meanwhile
                        hit = True
                if hit:
                    removed += 1
                else:
                    self._c["unknown_removals"] += 1
            self._c["removed_blocks"] += removed
            if self._maybe_empty:
                self._prune_streams()
        return removed

    def clear(self, pod: str, dp_rank: int | None = None, *, model: str | None | _AllModels = ALL_MODELS) -> int:
        """Forget everything ``pod`` holds (only DP rank ``dp_rank`` if given, only ``model``'s if given).

        Used for AllBlocksCleared, engine restart (sequence back to 0) and pod
        removal; a publisher is (pod, rank, model), so an engine serving one
        model never clears another model's blocks on the same pod.  Costs
        O(keys of that pod).  Also drops the pod's orphans and, when
        ``dp_rank`` is None and ``model`` is ALL_MODELS, its speculative
        entries.  Returns the number of (request key, rank) entries removed.
        """
        n = 0
        every = model is ALL_MODELS
        with self._lock:
            streams = [
                s for s in self._streams
                if s[0] == pod and (dp_rank is None or s[1] == dp_rank) and (every or s[2] == model)
            ]
            for stream in streams:
                emap = self._streams.pop(stream)
                self._maybe_empty.discard(stream)
                for ek, rk in emap.items():
                    self._unref_engine(ek, stream[2])
                    pods = self._blocks.get(rk)
                    pb = pods.get(pod) if pods is not None else None
                    if pb is None or pb.ranks.pop(stream[1], None) is None:
                        continue
                    n += 1
                    if pb.ranks:
                        pb.refresh()
                        self._set_pod_mask(pod, rk, pb.mask)
                    else:
                        del pods[pod]
                        self._drop_pod_mask(pod, rk)
                        if not pods:
                            del self._blocks[rk]
            n += self._groups.clear(
                lambda s: s[0] == pod and (dp_rank is None or s[1] == dp_rank) and (every or s[2] == model))
            self._drop_orphans_of(pod, dp_rank, model)
            if dp_rank is None and every:
                held = self._held.pop(pod, None)
                self._held_mask.pop(pod, None)
                n += len(held or ())
                for rk in self._spec_by_pod.pop(pod, ()):
                    holders = self._spec.get(rk)
                    expiry = holders.pop(pod, None) if holders is not None else None
                    if expiry is not None:
                        self._spec_order.discard((expiry, rk, pod))
                        n += 1
                        if not holders:
                            del self._spec[rk]
            if n:
                self._c["clears"] += 1
        return n

    def add_speculative(
        self, request_keys: Iterable[int], pod: str, ttl: float, dp_rank: int = 0
    ) -> None:
        """Count ``pod`` as holding ``request_keys`` (tier gpu) for ``ttl`` seconds.

        For a router that has just sent a request to ``pod``: its blocks will
        be stored there before the engine's events arrive.  An entry ends when
        a BlockStored confirms it or when it expires (monotonic clock).
        Keys the pod already holds for real are skipped.

        Raises:
            ValueError: ttl <= 0.
        """
        if not 0 < ttl < 86_400:
            raise ValueError(f"ttl must be in (0, 86400) seconds, got {ttl}")
        expiry = self._clock() + ttl
        with self._lock:
            self._expire(expiry - ttl)
            mine = self._spec_by_pod.setdefault(pod, set())
            for rk in request_keys:
                rk = int(rk)
                pods = self._blocks.get(rk)
                if pods is not None and pod in pods:
                    continue
                holders = self._spec.setdefault(rk, {})
                old = holders.get(pod)
                if old is not None:  # re-marked: its old expiry entry goes
                    self._spec_order.discard((old, rk, pod))
                holders[pod] = expiry
                mine.add(rk)
                self._spec_order.add((expiry, rk, pod))

    # ------------------------------------------------------------------- read

    def prefix_match(
        self, request_keys: RequestKeys, pods: Collection[str] | None = None
    ) -> dict[str, list[int]]:
        """Longest consecutive prefix each pod holds, as tier masks per block.

        Args:
            request_keys: the request's keys in block order (ints or a uint64
                numpy array).
            pods: candidate pods; None = every pod the index knows.

        Returns:
            pod -> list of tier bit masks (see :mod:`kvindex.tiers`), one per
            block of that pod's prefix from block 0 (a pod holds a block when
            any of its DP ranks does; speculative entries count as gpu).  Pods
            matching no block are absent.  Each pod's walk stops at its first
            missing block.  The keys of the longest match count as used for
            the LRU bound.
        """
        out: dict[str, list[int]] = {}
        if len(request_keys) == 0:
            return out
        keys = request_keys.tolist() if hasattr(request_keys, "tolist") else list(request_keys)
        with self._lock:
            if self._spec_order:
                self._expire(self._clock())
            candidates = (
                self._pod_masks.keys() | self._spec_by_pod.keys() | self._held.keys() if pods is None else pods
            )
            longest = 0
            speculative = False
            walk: list[str] = []
            for pod in candidates:
                if self._spec_by_pod.get(pod) or pod in self._held:
                    speculative = True
                    masks = self._walk_with_speculative(pod, self._pod_masks.get(pod) or {}, keys)
                    if masks:
                        out[pod] = masks
                        longest = max(longest, len(masks))
                elif pod in self._pod_masks:
                    walk.append(pod)
            if len(walk) > 2:
                for pod, n in self._walk_holders(walk, keys).items():
                    pm = self._pod_masks[pod]
                    out[pod] = [_GPU_BIT] * n if not self._mixed[pod] else list(map(pm.get, keys[:n]))
                    longest = max(longest, n)
            else:
                for pod in walk:
                    # C-speed walk: dict lookups until the first missing key
                    masks = list(takewhile(bool, map(self._pod_masks[pod].get, keys)))
                    if masks:
                        out[pod] = masks
                        longest = max(longest, len(masks))
            if longest:
                blocks = self._blocks
                if speculative:
                    for rk in keys[:longest]:
                        if rk in blocks:
                            blocks.move_to_end(rk)
                else:  # every matched key is in level 1: touch them at C speed
                    deque(map(blocks.move_to_end, keys[:longest]), maxlen=0)
        return out

    def _walk_holders(self, pods: list[str], keys: list[int]) -> dict[str, int]:
        """Prefix length per pod in one pass: each key's holder bits, ANDed with the pods still matching."""
        bits = self._pod_bits
        alive = 0
        for pod in pods:
            alive |= bits[pod]
        pos = 0
        ended: dict[int, int] = {}
        get = self._holders.get
        for rk in keys:
            h = get(rk, 0) & alive
            if h != alive:
                gone = alive ^ h
                while gone:
                    low = gone & -gone
                    ended[low] = pos
                    gone ^= low
                alive = h
                if not alive:
                    break
            pos += 1
        while alive:
            low = alive & -alive
            ended[low] = pos
            alive ^= low
        return {pod: ended[bits[pod]] for pod in pods if ended.get(bits[pod])}

    def _walk_with_speculative(self, pod: str, pm: dict[int, int], keys: list[int]) -> list[int]:
        spec = self._spec
        held = self._held_mask.get(pod)
        masks: list[int] = []
        for rk in keys:
            m = pm.get(rk)
            if held is not None and rk in held:
                m = (m or 0) | held[rk]
            if m is None:
                holders = spec.get(rk)
                if holders is None or pod not in holders:
                    break
                m = _GPU_BIT
            masks.append(m)
        return masks

    def lookup(self, request_keys: Iterable[int]) -> list[tuple[PodEntry, ...]]:
        """Every holder of each key: one tuple of :class:`PodEntry` per key.

        Entries are sorted (pod, tier, dp_rank); speculative entries last.
        Does not refresh recency.
        """
        out: list[tuple[PodEntry, ...]] = []
        with self._lock:
            if self._spec_order:
                self._expire(self._clock())
            for rk in request_keys:
                rk = int(rk)
                entries: list[PodEntry] = []
                for pod, pb in (self._blocks.get(rk) or {}).items():
                    for rank, (mask, _ek, _m) in pb.ranks.items():
                        entries.extend(PodEntry(pod, t, rank) for t in tier_names(mask))
                for pod, hm in self._held_mask.items():
                    if rk in hm:
                        entries.extend(PodEntry(pod, t, 0) for t in tier_names(hm[rk]))
                entries.sort()
                spec = sorted(PodEntry(p, GPU, 0, True) for p in (self._spec.get(rk) or {}))
                out.append(tuple(entries + spec))
        return out

    def best_dp_rank(self, pod: str, request_keys: Sequence[int]) -> int | None:
        """The DP rank of ``pod`` holding the longest consecutive prefix of ``request_keys``.

        For routing inside a data-parallel pod (vLLM takes the rank in an
        ``X-data-parallel-rank`` header).  Ties go to the lower rank; None when
        no rank holds the first block.  Costs one walk over the pod's prefix.
        """
        keys = request_keys.tolist() if hasattr(request_keys, "tolist") else list(request_keys)
        with self._lock:
            alive: set[int] | None = None
            best: int | None = None
            for rk in keys:
                pods = self._blocks.get(rk)
                pb = pods.get(pod) if pods is not None else None
                ranks = set(pb.ranks) if pb is not None else set()
                alive = ranks if alive is None else alive & ranks
                if not alive:
                    break
                best = min(alive)
            return best

    def request_key_of(self, engine_key: int, model: str | None | _AllModels = ALL_MODELS) -> int | None:
        """Level 2: the request key an engine key maps to under ``model`` (None if unknown).

        Level 2 is scoped by model (engines do not hash the model name, so
        two models' same tokens have the same engine key); with ALL_MODELS
        (the default) the first model knowing the key answers.
        """
        with self._lock:
            if self._compat:
                return engine_key if any(
                    engine_key in m for s, m in self._streams.items() if model is ALL_MODELS or s[2] == model
                ) else None
            for m, emap in self._engine.items():
                if model is ALL_MODELS or m == model:
                    v = emap.get(engine_key)
                    if v is not None:
                        return v[0]
            return None

    def pods(self) -> frozenset[str]:
        """Pods holding at least one block (real or speculative)."""
        with self._lock:
            return frozenset(
                self._pod_masks.keys() | self._held.keys() | {p for p, keys in self._spec_by_pod.items() if keys}
            )

    def pod_keys(self, pod: str, dp_rank: int | None = None) -> set[int]:
        """Request keys ``pod`` holds (on ``dp_rank`` if given), any tier."""
        with self._lock:
            out: set[int] = set()
            for (p, r, _m), emap in self._streams.items():
                if p == pod and (dp_rank is None or r == dp_rank):
                    out.update(emap.values())
            return out

    def models(self) -> frozenset[str | None]:
        """Models whose blocks events have stored (their keys are scoped by them)."""
        with self._lock:
            return frozenset(self._models)

    def __len__(self) -> int:
        return len(self._blocks)

    def stats(self) -> IndexStats:
        """A snapshot of sizes and counters (see :class:`IndexStats`)."""
        with self._lock:
            return IndexStats(
                keys=len(self._blocks),
                entries=sum(len(m) for m in self._streams.values()),
                engine_keys=(
                    sum(len(m) for m in self._engine.values()) if not self._compat
                    else sum(len(m) for m in self._streams.values())
                ),
                pods=len({s[0] for s, m in self._streams.items() if m}),
                orphan_blocks=self._orphan_blocks,
                speculative=sum(len(h) for h in self._spec.values()),
                group_entries=self._groups.entries(),
                group_unmapped=self._groups.unmapped,
                group_trimmed=self._groups.trimmed,
                group_evictions=self._groups.evictions,
                **self._c,
            )

    def tier_stats(self) -> dict[str, tuple[int, int]]:
        """tier -> (request keys held in that tier by any pod, (key, pod, DP rank) entries holding it).

        Counts the blocks events stored (not speculative or router-held
        entries); a block held in two tiers counts in both, so the sums over
        tiers can exceed ``stats().keys`` / ``stats().entries``.  Tiers with no
        block are left out.  O(entries): for metrics scrapes, not the hot path.
        """
        keys: dict[int, int] = {}
        entries: dict[int, int] = {}
        with self._lock:
            for pods in self._blocks.values():
                union = 0
                for pb in pods.values():
                    for r in pb.ranks.values():
                        m = r[0]
                        union |= m
                        while m:
                            low = m & -m
                            entries[low] = entries.get(low, 0) + 1
                            m ^= low
                while union:
                    low = union & -union
                    keys[low] = keys.get(low, 0) + 1
                    union ^= low
        return {tier_names(bit)[0]: (keys[bit], entries[bit]) for bit in keys}

    # -------------------------------------------------------------- internals

    def _resolve(self, pod: str, dp_rank: int, engine_key: int, model: str | None) -> int | None:
        stream = self._streams.get((pod, dp_rank, model))
        if stream is not None:
            rk = stream.get(engine_key)
            if rk is not None:
                return rk
        emap = self._engine.get(model)
        v = emap.get(engine_key) if emap is not None else None
        return v[0] if v is not None else None

    def _main_masks(self, pod: str, dp_rank: int, model: str | None, keys: list[int]) -> list[int]:
        """Tier mask per request key of publisher (pod, rank, model) in the main tables (0 = absent)."""
        out = []
        for rk in keys:
            pb = (self._blocks.get(rk) or {}).get(pod)
            entry = pb.ranks.get(dp_rank) if pb is not None else None
            out.append(entry[0] if entry is not None and entry[2] == model else 0)
        return out

    def _attach(self, item: _Orphan, parent_rk: int | None) -> int:
        """Store ``item`` under ``parent_rk``, then every orphan it releases."""
        attached = 0
        work: list[tuple[_Orphan, int | None]] = [(item, parent_rk)]
        while work:
            it, prk = work.pop()
            rks = self.token_processor.chain(
                prk, it.token_ids, model=it.model, lora=it.lora_name, block_extra_keys=it.extra_keys
            )
            stream = self._stream(it.pod, it.dp_rank, it.model)
            for ek, rk in zip(it.engine_keys, rks.tolist()):
                if ek not in it.removed:
                    self._put(it.pod, it.dp_rank, ek, rk, it.tier, it.model, stream)
                    attached += 1
                waiting = self._orphans.pop((it.model, ek), None) if self._orphans else None
                if waiting:
                    for w in waiting:
                        self._forget_orphan(w)
                        self._c["orphans_attached"] += len(w.engine_keys) - len(w.removed)
                        work.append((w, rk))
        return attached

    def _stream(self, pod: str, dp_rank: int, model: str | None) -> dict[int, int]:
        key = (pod, dp_rank, model)
        stream = self._streams.get(key)
        if stream is None:
            stream = self._streams[key] = {}
        else:
            self._maybe_empty.discard(key)
        return stream

    def _prune_streams(self) -> None:
        """Drop stream maps left empty (a pod that comes and goes leaves nothing behind)."""
        for key in self._maybe_empty:
            m = self._streams.get(key)
            if m is not None and not m:
                del self._streams[key]
        self._maybe_empty.clear()

    def _put(
        self, pod: str, dp_rank: int, ek: int, rk: int, bit: int, model: str | None, stream: dict[int, int]
    ) -> None:
        """Record that (pod, rank, model) holds request key ``rk`` as engine key ``ek`` in tier ``bit``.

        ``stream``: the (pod, rank, model) engine-key map.
        """
        old_rk = stream.get(ek)
        if old_rk is None and rk not in self._blocks:
            self._put_new(pod, dp_rank, ek, rk, bit, model, stream)
            return
        if old_rk is not None and old_rk != rk:
            # the engine reused this hash for other content: forget the old mapping
            self._drop_copy(pod, dp_rank, ek, old_rk, -1)
        pods = self._blocks.get(rk)
        if pods is None:
            pods = self._blocks[rk] = {}
            if len(self._blocks) > self.capacity:
                self._evict_one()
        else:
            self._blocks.move_to_end(rk)
        pb = pods.get(pod)
        if pb is None:
            pb = pods[pod] = _PodBlock()
        entry = pb.ranks.get(dp_rank)
        if entry is None:
            pb.ranks[dp_rank] = [bit, ek, model]
        else:
            entry[0] |= bit
            if entry[1] != ek:
                if stream.get(entry[1]) == rk:
                    del stream[entry[1]]
                    self._unref_engine(entry[1], model)
                entry[1] = ek
        pb.mask |= bit
        self._set_pod_mask(pod, rk, pb.mask)
        self._link(pod, stream, ek, rk, model)

    def _put_new(
        self, pod: str, dp_rank: int, ek: int, rk: int, bit: int, model: str | None, stream: dict[int, int]
    ) -> None:
        """:meth:`_put` for a request key nobody holds yet (the common case), with less lookup."""
        blocks = self._blocks
        blocks[rk] = {pod: _PodBlock(bit, {dp_rank: [bit, ek, model]})}
        if len(blocks) > self.capacity:
            self._evict_one()
        self._set_pod_mask(pod, rk, bit)
        self._link(pod, stream, ek, rk, model)

    def _link(self, pod: str, stream: dict[int, int], ek: int, rk: int, model: str | None) -> None:
        """Map engine key ``ek`` to ``rk`` for the stream (and level 2); count the store."""
        if stream.get(ek) != rk:
            stream[ek] = rk
            if not self._compat:
                emap = self._engine.get(model)
                if emap is None:
                    emap = self._engine[model] = {}
                v = emap.get(ek)
                if v is None:
                    emap[ek] = [rk, 1]
                else:
                    v[0] = rk
                    v[1] += 1
        self._c["stored_blocks"] += 1
        if self._spec and rk in self._spec:
            self._confirm_speculative(pod, rk)

    def _store_tokenless(
        self, pod: str, dp_rank: int, engine_keys: Iterable[int], bit: int, model: str | None
    ) -> int:
        n = 0
        stream = self._stream(pod, dp_rank, model)
        self._maybe_empty.add((pod, dp_rank, model))
        for ek in engine_keys:
            if self._compat:
                rk: int | None = ek
            else:
                rk = self._resolve(pod, dp_rank, ek, model)
            if rk is None:
                self._c["unknown_offloads"] += 1
                continue
            self._put(pod, dp_rank, ek, rk, bit, model, stream)
            n += 1
        return n

    def _drop_copy(self, pod: str, dp_rank: int, ek: int, rk: int, bit: int) -> bool:
        """Clear ``bit`` (-1 = all) of (pod, rank)'s copy of ``rk``; True if it held that tier."""
        pods = self._blocks.get(rk)
        pb = pods.get(pod) if pods is not None else None
        entry = pb.ranks.get(dp_rank) if pb is not None else None
        if entry is None or not entry[0] & bit:
            return False
        entry[0] &= ~bit
        if entry[0] == 0:
            del pb.ranks[dp_rank]
            skey = (pod, dp_rank, entry[2])
            stream = self._streams.get(skey)
            if stream is not None and stream.get(ek) == rk:
                del stream[ek]
                self._unref_engine(ek, entry[2])
                if not stream:
                    self._maybe_empty.add(skey)
            if not pb.ranks:
                del pods[pod]
                self._drop_pod_mask(pod, rk)
                if not pods:
                    del self._blocks[rk]
                return True
        pb.refresh()
        self._set_pod_mask(pod, rk, pb.mask)
        return True

    def _set_pod_mask(self, pod: str, rk: int, mask: int) -> None:
        """Read-path mirrors of (pod, rk)'s tier mask: per-pod masks, holder bits, non-gpu counts."""
        pm = self._pod_masks.get(pod)
        if pm is None:
            pm = self._pod_masks[pod] = {}
            self._mixed[pod] = 0
        old = pm.get(rk)
        pm[rk] = mask
        if old is None:
            bit = self._pod_bits.get(pod)
            if bit is None:
                free = self._free_bits
                bit = self._pod_bits[pod] = free.pop() if free else 1 << len(self._pod_bits)
            self._holders[rk] = self._holders.get(rk, 0) | bit
            self._mixed[pod] += mask != _GPU_BIT
        elif (old != _GPU_BIT) != (mask != _GPU_BIT):
            self._mixed[pod] += 1 if mask != _GPU_BIT else -1

    def _drop_pod_mask(self, pod: str, rk: int) -> None:
        pm = self._pod_masks.get(pod)
        if pm is None:
            return
        old = pm.pop(rk, None)
        if old is None:
            return
        h = self._holders[rk] & ~self._pod_bits[pod]
        if h:
            self._holders[rk] = h
        else:
            del self._holders[rk]
        if not pm:
            # the pod holds nothing now: its tables go and its bit is reused
            del self._pod_masks[pod]
            del self._mixed[pod]
            self._free_bits.append(self._pod_bits.pop(pod))
        else:
            self._mixed[pod] -= old != _GPU_BIT

    def _unref_engine(self, ek: int, model: str | None) -> None:
        if self._compat:
            return
        emap = self._engine.get(model)
        v = emap.get(ek) if emap is not None else None
        if v is not None:
            v[1] -= 1
            if v[1] <= 0:
                del emap[ek]
                if not emap:
                    del self._engine[model]

    def _evict_one(self) -> None:
        rk, pods = self._blocks.popitem(last=False)
        for pod, pb in pods.items():
            self._drop_pod_mask(pod, rk)
            for rank, (_mask, ek, model) in pb.ranks.items():
                skey = (pod, rank, model)
                stream = self._streams.get(skey)
                if stream is not None and stream.get(ek) == rk:
                    del stream[ek]
                    self._unref_engine(ek, model)
                    if not stream:
                        self._maybe_empty.add(skey)
        self._c["evictions"] += 1


