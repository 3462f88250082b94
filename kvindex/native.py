"""The compiled KV block index: :class:`NativeKVBlockIndex`.

Same public API and event semantics as the pure-Python reference
:class:`kvindex.reference.KVBlockIndex` (see that module for the semantics, which
mirror vllm/distributed/kv_events.py, vLLM 0.32); both satisfy
:class:`kvindex.contract.KVIndex`, and the stateful tests drive both with the
same steps and compare every read.

Where the work happens:

- In C++ (``kvindex._native.IndexCore``, native/native.cpp), with the GIL
  released: level 1 (request key -> holders: pod slot, DP rank, tier mask,
  engine key) as an open-addressing table of 4-byte block indices over
  27-byte block records with an intrusive LRU list by block index; level 2
  (engine key -> request key, reference counted) as a table of block indices
  keyed through the holders; the per-(pod, DP rank, model) engine key ->
  request key maps, whose entries the holders carry (found through level 2)
  and whose records a per-stream set of record indices lists, so that a
  clear costs O(the pod's keys) (see the layout notes at the top of
  native/native.cpp); pod slots, reused when a pod holds nothing; the chaining of
  an event's request keys (``xxh3_chain``, bit-identical to
  :mod:`kvindex.keys`) and the storing of all its blocks, in one call; whole
  runs of a decoded batch's events (:meth:`apply_events`, the pool's call), in
  one call; the
  prefix match of every candidate pod in one walk (:meth:`prefix_match`, and
  :meth:`prefix_summary` that returns what the scorer needs without a list per
  block).
- In Python, here: argument checks, the scope roots and per-block extras of
  the key chain (blocks with extra keys are chained by
  :meth:`TokenProcessor.chain` and stored with their keys in one call), the
  orphan table (blocks waiting for an unknown parent: rare), speculative
  entries (a router's guesses, with a TTL), the models seen, and the counters
  those own.

Locking: the core has one shared mutex (readers share it, a writer holds it
alone; the recency refresh of a match is logged by the reader and applied by
the next exclusive section, before it changes anything, so evictions happen
in the reference's order), and every call into it releases the GIL.  Writers
and the reads that involve Python-side tables (speculative and held entries)
hold one Python lock for the whole method, as the reference does.  The plain
reads of the read path (:meth:`match_tokens`, :meth:`prefix_summary`,
:meth:`prefix_match`, :meth:`best_dp_rank` while no speculative or held entry
exists) do not take it, so a score never waits for a writer's whole batch,
only for the core's exclusive sections.  A reader still never sees half of
an event: an event applied in several core calls (a store that releases
orphans) is marked in the core (``begin_multi``/``end_multi``) and in
``_wgen``; a read that meets the mark waits for the event on the Python lock
and reads again (the core answers a guarded touching read with None before
it touches anything).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Collection, Iterable, Sequence

import numpy as np

from kvindex import _native
from kvindex.contract import ALL_MODELS, ApplyResult, IndexStats, PodEntry
from kvindex.groups import MAIN, GroupsMixin, GroupTables, Stream
from kvindex.hybrid import GroupSpec
from kvindex.locks import WriteLock
from kvindex.side_tables import SideTables, _Orphan, apply_each, checked_store
from kvindex.keys import TokenProcessor, _tokens_to_u64
from kvindex.tiers import GPU, TIERS, tier_bit, tier_names

__all__ = ["NativeKVBlockIndex"]

_GPU_BIT = tier_bit(GPU)


def _add_by_bit(by_tier: dict[str, int], counts: list[int]) -> None:
    """Add per-tier-bit block counts (index = bit position, :data:`TIERS` order) to ``by_tier``."""
    names = TIERS._names  # append-only: bit b's name is names[b]
    for b, k in enumerate(counts):
        if k:
            name = names[b]
            by_tier[name] = by_tier.get(name, 0) + k


def _rank(dp_rank: int) -> int:
    r = int(dp_rank)
    if not -(2**31) <= r < 2**31:
        raise ValueError(f"dp_rank out of range: {dp_rank}")
    return r


class NativeKVBlockIndex(SideTables, GroupsMixin):
    """The two-level KV block index with its data in compiled code.

    Args and errors: as :class:`kvindex.reference.KVBlockIndex` (token_processor,
    capacity >= 1, max_orphan_blocks >= 0, clock).  Holds at most 16,381 pods
    with blocks at once and 2**27 - 2 request keys (capacity is capped there).

    KV-cache groups (hybrid models) as the reference keeps them
    (:mod:`kvindex.groups`): the primary group's blocks in the compiled core,
    the other groups' in Python tables beside it.
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
        self._core = _native.IndexCore(min(capacity, 2**27 - 2), self._compat)
        self._lock = WriteLock()  # writers, orphans, speculative entries (kvindex.locks)
        self._wgen = 0  # odd while a writer applies one event in several core calls (see Locking)
        # compat mode chains nothing: the core takes the block size from a K of that length
        self._ones_k = np.ones(self.block_size, dtype=np.uint64)
        self._k_bytes = self._ones_k.tobytes()  # apply_raw's K (replaced below in xxh3_chain mode)
        if not self._compat:
            tp = self.token_processor
            self._K = np.ascontiguousarray(tp._K, dtype=np.uint64)
            self._k_bytes = self._K.tobytes()
            self._A = tp._A
        self._raw_a = 0 if self._compat else self._A  # apply_raw's A
        self._models: set[str | None] = set()
        # model name -> the core's 16-bit model id (0 = None); never reused
        self._model_ids: dict[str | None, int] = {None: 0}
        self._wscope: dict[str | None, tuple[int, int]] = {}  # model -> (model id, scope root), for apply_events
        self._init_side_tables()  # orphans, speculative and held entries, as the reference
        self._groups = GroupTables(capacity)  # KV-cache groups other than the primary one (hybrid models)
        # counters kept here (the groups' included); the core keeps evictions, stored/removed blocks,
        # unknown removals/offloads of its tables
        self._c = dict.fromkeys(
            (
                "stored_blocks",
                "unknown_offloads",
                "removed_blocks",
                "unknown_removals",
                "orphans",
                "orphans_attached",
                "orphans_dropped",
                "speculative_confirmed",
                "speculative_expired",
                "clears",
            ),
            0,
        )

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
        """Apply one BlockStored event (as :meth:`kvindex.reference.KVBlockIndex.block_stored`).

        ``group``: the event's KV-cache group; a store of a group other than
        the publisher's primary one goes to that group's table only.
        """
        bit = tier_bit(tier)
        rank = _rank(dp_rank)
        with self._lock:
            if group is not None and self._groups.learn((pod, rank, model), group) != MAIN:
                return self._store_in_group((pod, rank, model), group, engine_keys, parent_engine_key,
                                            token_ids, bit, block_size, extra_keys, lora_name)
            mid = self._mid(model)
            if token_ids is None or len(token_ids) == 0:
                done = _u64(self._core.store_tokenless(pod, rank, mid, engine_keys, bit))
                if self._spec:
                    self._confirm_many(pod, done)
                return len(done)
            extras, lora_name = checked_store(
                self.block_size, len(engine_keys), token_ids, block_size, extra_keys, lora_name)
            if model not in self._models:
                self._models.add(model)
            if self._compat:
                n = self._core.store_keys(pod, rank, mid, engine_keys, engine_keys, bit)
                if self._spec:
                    self._confirm_many(pod, engine_keys)
                return n
            item = _Orphan(pod, rank, tuple(engine_keys), token_ids, bit, extras, lora_name, model, set())
            parent_rk = None if parent_engine_key is None else self._core.resolve(pod, rank, mid, parent_engine_key)
            if parent_engine_key is not None and parent_rk is None:
                self._add_orphan(parent_engine_key, item)
                n = 0
            else:
                n = self._attach(item, parent_rk)
            if self._groups.waiting:  # other groups' stores waiting for a parent this one may bring
                self._release_waiting((pod, rank, model))
            return n

    def apply_events(
        self, pod: str, dp_rank: int, events, *, model: str | None = None, kinds: tuple[type, type, type]
    ) -> ApplyResult:
        """Apply one publisher's decoded batch (as :meth:`kvindex.reference.KVBlockIndex.apply_events`).

        Runs of plain events (stores with tokens and without extra keys or
        LoRA, removals, clears) go to the core in one call each, with no
        Python work per block or per event; the core stops before an event it
        does not take (extra keys, a token-less store, an unknown tier or
        parent, a malformed event), which is applied here by the per-event
        method, and the next run goes back to the core.  While orphans or
        speculative entries exist (they live in Python), events are applied
        one by one.  KV-cache groups: the core takes the primary group's
        events (and those without group_idx) only; another group's event, a
        store that teaches a group, and a clear of a publisher that has
        learned groups are applied here (see :meth:`_gate`).
        """
        rank = dp_rank if type(dp_rank) is int and -(2**31) <= dp_rank < 2**31 else _rank(dp_rank)
        r = ApplyResult()
        n = len(events)
        i = 0
        with self._lock:
            mid, root = self._write_scope(model)
            K = self._ones_k if self._compat else self._K
            A = 0 if self._compat else self._A
            stored_t, removed_t, cleared_t = kinds
            core = self._core
            stream = (pod, rank, model)
            groups = self._groups
            waiting = groups.waiting
            while i < n:
                if self._orphans or self._spec:
                    return apply_each(self, pod, rank, events, model, kinds, i, r)
                if waiting and stream in waiting:  # each primary store may release them: one by one
                    apply_each(self, pod, rank, events[i : i + 1], model, kinds, 0, r)
                    i += 1
                    continue
                gate = self._gate(stream) if groups.specs else ()  # no stream has learned a group yet
                nxt = self._tally(r, model, core.apply_events(
                    pod, rank, mid, events, i, stored_t, removed_t, cleared_t, TIERS._bits, root, K, A, gate))
                if nxt >= n:
                    break
                apply_each(self, pod, rank, events[nxt : nxt + 1], model, kinds, 0, r)
                i = nxt + 1
        return r

    def apply_raw(
        self, pod: str, dp_rank: int, raw, events: Callable[[], Sequence], *, model: str | None = None,
        kinds: tuple[type, type, type],
    ) -> ApplyResult:
        """:meth:`apply_events` of a ``kvindex._native.RawBatch`` (see :class:`kvindex.contract.RawApply`).

        The core decodes nothing here: ``raw`` holds the batch's integers
        already; the events the core does not take (an orphan, another block
        size) and every event while orphans or speculative entries exist are
        applied from ``events()``, the reference decoding of the same batch.
        """
        rank = dp_rank if type(dp_rank) is int and -2147483648 <= dp_rank < 2147483648 else _rank(dp_rank)
        r = ApplyResult()
        n = len(raw)
        i = 0
        with self._lock:
            w = self._wscope.get(model) or self._write_scope(model)
            core = self._core
            waiting = self._groups.waiting
            while i < n:
                if self._orphans or self._spec or (waiting and (pod, rank, model) in waiting):
                    return apply_each(self, pod, rank, events(), model, kinds, i, r)
                nxt = self._tally(r, model, core.apply_raw(pod, rank, w[0], raw, i, w[1], self._k_bytes, self._raw_a))
                if nxt >= n:
                    break
                apply_each(self, pod, rank, events()[nxt : nxt + 1], model, kinds, 0, r)
                i = nxt + 1
        return r

    def _write_scope(self, model: str | None) -> tuple[int, int]:
        """(model id, scope root) of ``model``'s writes: both fixed once assigned."""
        w = self._wscope.get(model)
        if w is None:
            w = self._wscope[model] = (self._mid(model), 0 if self._compat else self.token_processor._root(model, None))
        return w

    def _tally(self, r: ApplyResult, model: str | None, out: tuple) -> int:
        """Add one core batch call's counts to ``r`` and the index counters; returns its next event."""
        (nxt, st_ev, st_blocks, _rm_ev, rm_blocks, hits, misses, clears, clears_n, st_bits, rm_bits) = out
        if st_bits:
            if len(st_bits) == 1:  # GPU only (bit 0), the usual case
                by = r.stored_by_tier
                by[GPU] = by.get(GPU, 0) + st_bits[0]
            else:
                _add_by_bit(r.stored_by_tier, st_bits)
        if st_ev:
            r.stored_blocks += st_blocks
            if model not in self._models:
                self._models.add(model)
        if rm_blocks or _rm_ev:
            if rm_bits:
                _add_by_bit(r.removed_by_tier, rm_bits)
            r.removed_blocks += rm_blocks
            c = self._c
            c["removed_blocks"] += hits
            c["unknown_removals"] += misses
        if clears:
            r.clears += clears
            self._c["clears"] += clears_n
        return nxt

    def _gate(self, stream: Stream) -> tuple[()] | tuple[int, str | None, int | None, bool]:
        """What the core's batch apply may take of the stream's events (native/index_core.h apply_events).

        () while the stream has learned no group; else (primary group_idx,
        its kind, its window, whether a store without a kind is its spec), the
        group_idx -1 while no primary spec the core can take as it is exists.
        """
        specs = self._groups.specs.get(stream)
        if not specs:
            return ()
        g = self._groups.primary.get(stream)
        spec = specs.get(g) if g is not None else None
        if spec is None or spec.block_size != self.block_size or spec.eagle:
            return (-1, None, None, False)
        return (spec.group_idx, spec.kind, spec.window, spec.kind == "full_attention")

    def block_removed(
        self, pod: str, dp_rank: int, engine_keys: Iterable[int], tier: str, *, model: str | None = None,
        group_idx: int | None = None,
    ) -> int:
        """Apply one BlockRemoved of publisher (pod, rank, model) (as the reference).

        ``group_idx``: the event's KV-cache group; only that group's entries go.
        """
        bit = tier_bit(tier)
        rank = _rank(dp_rank)
        keys = engine_keys if isinstance(engine_keys, (list, tuple, np.ndarray)) else list(engine_keys)
        with self._lock:
            if self._groups.route((pod, rank, model), group_idx) != MAIN:
                return self._remove_in_group((pod, rank, model), group_idx, keys, bit)
            mid = self._model_ids.get(model)
            hits = self._core.remove(pod, rank, mid, keys, bit) if mid is not None else [False] * len(keys)
            removed = 0
            by_ek = self._orphan_by_ek
            for ek, hit in zip(keys, hits):
                # the same block may also wait in a store whose parent is unknown: drop it there too
                waiting = by_ek.get((pod, rank, model, int(ek))) if by_ek else None
                for w in waiting or ():
                    if w.tier & bit and ek not in w.removed:
                        w.removed.add(ek)  # never attach a block the engine dropped meanwhile
                        hit = True
                if hit:
                    removed += 1
                else:
                    self._c["unknown_removals"] += 1
            self._c["removed_blocks"] += removed
        return removed

    def clear(self, pod: str, dp_rank: int | None = None, *, model=ALL_MODELS) -> int:
        """Forget what ``pod`` holds (rank ``dp_rank``, ``model`` only if given); O(the pod's keys).

        As :meth:`kvindex.reference.KVBlockIndex.clear`: drops the pod's orphans and,
        without a rank or model, its speculative and held entries; returns the
        entries removed.
        """
        rank = None if dp_rank is None else _rank(dp_rank)
        every = model is ALL_MODELS
        with self._lock:
            mid = -1 if every else self._model_ids.get(model)
            n = self._core.clear(pod, rank, mid) if mid is not None else 0
            n += self._groups.clear(
                lambda s: s[0] == pod and (rank is None or s[1] == rank) and (every or s[2] == model))
            self._drop_orphans_of(pod, rank, model)
            if rank is None and every:
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

    def add_speculative(self, request_keys: Iterable[int], pod: str, ttl: float, dp_rank: int = 0) -> None:
        """Count ``pod`` as holding ``request_keys`` for ``ttl`` seconds (as the reference).

        Raises:
            ValueError: ttl not in (0, 86400).
        """
        if not 0 < ttl < 86_400:
            raise ValueError(f"ttl must be in (0, 86400) seconds, got {ttl}")
        expiry = self._clock() + ttl
        keys = [int(k) for k in request_keys]
        with self._lock:
            self._expire(expiry - ttl)
            held = self._core.pod_holds_many(pod, keys) if keys else []
            mine = self._spec_by_pod.setdefault(pod, set())
            for rk, has in zip(keys, held):
                if has:
                    continue
                holders = self._spec.setdefault(rk, {})
                old = holders.get(pod)
                if old is not None:
                    self._spec_order.discard((old, rk, pod))
                holders[pod] = expiry
                mine.add(rk)
                self._spec_order.add((expiry, rk, pod))

    # ------------------------------------------------------------------- read

    def prefix_match(
        self, request_keys: Sequence[int] | np.ndarray, pods: Collection[str] | None = None
    ) -> dict[str, list[int]]:
        """Longest consecutive prefix each pod holds, as tier masks per block.

        As :meth:`kvindex.reference.KVBlockIndex.prefix_match` (speculative entries
        count as gpu; the longest match is refreshed for the LRU bound).
        """
        if len(request_keys) == 0:
            return {}
        keys = _as_keys(request_keys)
        cands = None if pods is None else list(pods)
        if not (self._spec_order or self._spec_by_pod or self._held):
            out = self._core.prefix_match(keys, cands, True, True)
            if out is not None:
                return _lists(out)
        with self._lock:
            if self._spec_order:
                self._expire(self._clock())
            # pods with speculative or held entries: walked here, the others in the core
            spec_pods = {p for p, ks in self._spec_by_pod.items() if ks} | self._held.keys()
            if not spec_pods:
                return _lists(self._core.prefix_match(keys, None if pods is None else list(pods), True))
            cands = list(dict.fromkeys(self._core.pods() + sorted(spec_pods) if pods is None else pods))
            plain = [p for p in cands if p not in spec_pods]
            out = _lists(self._core.prefix_match(keys, plain, False)) if plain else {}
            longest = max((len(m) for m in out.values()), default=0)
            mine = [p for p in cands if p in spec_pods]
            rows = self._core.pod_masks(keys, mine)
            klist = keys.tolist()
            for pod in mine:
                row = _u64(rows[pod]).tolist()
                held = self._held_mask.get(pod)
                masks: list[int] = []
                for rk, m in zip(klist, row):
                    if held is not None and rk in held:
                        m |= held[rk]
                    if not m:
                        holders = self._spec.get(rk)
                        if holders is None or pod not in holders:
                            break
                        m = _GPU_BIT
                    masks.append(m)
                if masks:
                    out[pod] = masks
                    longest = max(longest, len(masks))
            if longest:
                self._core.touch(keys[:longest])
            return out

    def prefix_summary(
        self, request_keys: Sequence[int] | np.ndarray, pods: Collection[str] | None, weights: Sequence[float],
        *, dp_ranks: dict[str, int] | None = None,
    ) -> dict[str, tuple[int, float, int]]:
        """Per pod with a match: (matched blocks, weighted blocks, OR of the tier masks).

        ``weights[b]`` is the weight of tier bit ``b`` (:data:`kvindex.tiers.TIERS`
        order); a block weighs its best tier.  Same match and recency refresh
        as :meth:`prefix_match`, without a list per block.  ``dp_ranks``: as
        :meth:`match_tokens`'s.
        """
        if len(request_keys) == 0:
            return {}
        keys = _as_keys(request_keys)
        cands = None if pods is None else list(pods)
        w = list(weights)
        ranks = dp_ranks is not None and not (self._spec_by_pod or self._held)
        res = None
        if not (self._spec_by_pod or self._held):
            res = self._core.prefix_summary(keys, cands, w, True, True, ranks)
        if res is None:
            with self._lock:
                if self._spec_by_pod or self._held:
                    return _summarise(self.prefix_match(keys, pods), w)
                res = self._core.prefix_summary(keys, cands, w, True, False, ranks)
        if ranks and res[2]:
            dp_ranks.update(res[2])  # type: ignore[union-attr]
        return res[0]

    def match_tokens(
        self,
        tokens: Sequence[int] | np.ndarray,
        pods: Collection[str] | None,
        weights: Sequence[float],
        *,
        model: str | None = None,
        lora: str | tuple[str, str] | None = None,
        dp_ranks: dict[str, int] | None = None,
    ) -> tuple[np.ndarray, dict[str, tuple[int, float, int]]]:
        """The read path in one compiled call: request keys of ``tokens`` and their prefix summary.

        Returns (``token_processor.request_keys(tokens, model=, lora=)``,
        :meth:`prefix_summary` of those keys).  Only for ``xxh3_chain`` keys
        without extra keys (others: compute the keys, then :meth:`prefix_summary`).
        ``dp_ranks``, if given, receives pod -> DP rank for the matched pods
        whose matched blocks one DP rank holds (then that rank is
        :meth:`best_dp_rank` of the pod's match); ask :meth:`best_dp_rank`
        for the others.  Raises as :meth:`TokenProcessor.request_keys`.
        """
        tp = self.token_processor
        if self._compat:
            keys = tp.request_keys(tokens, model=model, lora=lora)
            return keys, self.prefix_summary(keys, pods, weights)
        tp._check_scope(model, lora)
        if not isinstance(tokens, (list, tuple)):
            tokens = np.ascontiguousarray(_tokens_to_u64(tokens))
        state = tp._root(model, lora)
        cands = None if pods is None else list(pods)
        if self._spec_by_pod or self._held:
            keys = tp.request_keys(tokens, model=model, lora=lora)
            return keys, self.prefix_summary(keys, cands, weights)
        w = list(weights)
        core, K, A = self._core, self._K, self._A
        ranks = dp_ranks is not None
        try:
            res = core.match_tokens(state, tokens, K, A, cands, w, True, True, ranks)
        except (TypeError, ValueError):
            if isinstance(tokens, np.ndarray):
                raise
            # the reference's checks and errors (it also takes bools and other int-likes)
            tokens = np.ascontiguousarray(_tokens_to_u64(tokens))
            res = core.match_tokens(state, tokens, K, A, cands, w, True, True, ranks)
        if res is None:  # a writer is half-way through an event: wait for it
            with self._lock:
                res = core.match_tokens(state, tokens, K, A, cands, w, True, False, ranks)
        if ranks and res[3]:
            dp_ranks.update(res[3])
        return _u64(res[0]), res[1]

    def lookup(self, request_keys: Iterable[int]) -> list[tuple[PodEntry, ...]]:
        """Every holder of each key (as :meth:`kvindex.reference.KVBlockIndex.lookup`)."""
        keys = [int(k) for k in request_keys]
        with self._lock:
            if self._spec_order:
                self._expire(self._clock())
            rows = self._core.lookup(keys) if keys else []
            out: list[tuple[PodEntry, ...]] = []
            for rk, row in zip(keys, rows):
                entries = [PodEntry(pod, t, rank) for pod, mask, rank in row for t in tier_names(mask)]
                for pod, hm in self._held_mask.items():
                    if rk in hm:
                        entries.extend(PodEntry(pod, t, 0) for t in tier_names(hm[rk]))
                entries.sort()
                spec = sorted(PodEntry(p, GPU, 0, True) for p in (self._spec.get(rk) or {}))
                out.append(tuple(entries + spec))
            return out

    def best_dp_rank(self, pod: str, request_keys: Sequence[int]) -> int | None:
        """The DP rank of ``pod`` holding the longest consecutive prefix (ties: lower rank)."""
        keys = _as_keys(request_keys)
        if len(keys) == 0:
            return None
        g = self._wgen
        if not g & 1:
            rank = self._core.best_dp_rank(pod, keys)
            if self._wgen == g:  # no multi-call event began meanwhile (see Locking)
                return rank
        with self._lock:
            return self._core.best_dp_rank(pod, keys)

    def request_key_of(self, engine_key: int, model=ALL_MODELS) -> int | None:
        """Level 2: the request key an engine key maps to under ``model`` (None if unknown).

        With ALL_MODELS (the default) the first model knowing the key answers.
        """
        with self._lock:
            if model is ALL_MODELS:
                return self._core.request_key_of(int(engine_key), -1)
            mid = self._model_ids.get(model)
            return None if mid is None else self._core.request_key_of(int(engine_key), mid)

    def pods(self) -> frozenset[str]:
        """Pods holding at least one block (real or speculative)."""
        with self._lock:
            real = self._core.pods()
            return frozenset(real).union(self._held.keys(), (p for p, keys in self._spec_by_pod.items() if keys))

    def pod_keys(self, pod: str, dp_rank: int | None = None) -> set[int]:
        """Request keys ``pod`` holds (on ``dp_rank`` if given), any tier."""
        with self._lock:
            return set(self._core.pod_keys(pod, None if dp_rank is None else _rank(dp_rank)))

    def models(self) -> frozenset[str | None]:
        """Models whose blocks events have stored."""
        with self._lock:
            return frozenset(self._models)

    def __len__(self) -> int:
        return len(self._core)

    def stats(self) -> IndexStats:
        """A snapshot of sizes and counters (see :class:`kvindex.contract.IndexStats`)."""
        with self._lock:
            s = self._core.stats()
            c = self._c
            return IndexStats(
                keys=s["keys"],
                entries=s["entries"],
                engine_keys=s["engine_keys"],
                pods=s["pods"],
                evictions=s["evictions"],
                stored_blocks=s["stored_blocks"] + c["stored_blocks"],
                removed_blocks=s["removed_blocks"] + c["removed_blocks"],
                unknown_removals=s["unknown_removals"] + c["unknown_removals"],
                unknown_offloads=s["unknown_offloads"] + c["unknown_offloads"],
                orphan_blocks=self._orphan_blocks,
                orphans=c["orphans"],
                orphans_attached=c["orphans_attached"],
                orphans_dropped=c["orphans_dropped"],
                speculative=sum(len(h) for h in self._spec.values()),
                speculative_confirmed=c["speculative_confirmed"],
                speculative_expired=c["speculative_expired"],
                clears=c["clears"],
                group_entries=self._groups.entries(),
                group_unmapped=self._groups.unmapped,
                group_trimmed=self._groups.trimmed,
                group_evictions=self._groups.evictions,
            )

    def tier_stats(self) -> dict[str, tuple[int, int]]:
        """tier -> (request keys held in that tier by any pod, (key, pod, DP rank) entries holding it).

        As :meth:`kvindex.reference.KVBlockIndex.tier_stats`: blocks events
        stored, one walk of level 1 in the compiled core (O(keys)).
        """
        with self._lock:
            counts = self._core.tier_counts()
        return {tier_names(1 << b)[0]: (k, e) for b, (k, e) in enumerate(counts) if k}

    def memory_bytes(self) -> int:
        """Bytes held by the compiled structures (capacities; no allocator overhead)."""
        return self._core.memory_bytes()

    def check(self) -> None:
        """Verify the compiled structures' invariants (for tests); raises RuntimeError."""
        self._core.check()

    # -------------------------------------------------------------- internals

    def _attach(self, item: _Orphan, parent_rk: int | None) -> int:
        """Store ``item`` under ``parent_rk``, then every orphan it releases."""
        if self._orphans:  # it may release orphans: one event in several core calls
            self._wgen += 1
            self._core.begin_multi()
            try:
                return self._attach_all(item, parent_rk)
            finally:
                self._core.end_multi()
                self._wgen += 1
        return self._attach_all(item, parent_rk)

    def _attach_all(self, item: _Orphan, parent_rk: int | None) -> int:
        attached = 0
        work: list[tuple[_Orphan, int | None]] = [(item, parent_rk)]
        tp = self.token_processor
        while work:
            it, prk = work.pop()
            if it.removed:
                rks = tp.chain(prk, it.token_ids, model=it.model, lora=it.lora_name, block_extra_keys=it.extra_keys)
                keep = [i for i, ek in enumerate(it.engine_keys) if ek not in it.removed]
                self._core.store_keys(
                    it.pod, it.dp_rank, self._mid(it.model), [it.engine_keys[i] for i in keep],
                    rks[keep] if keep else [], it.tier,
                )
                stored_rks = rks[keep]
                attached += len(keep)
            elif it.extra_keys is not None:
                rks = tp.chain(prk, it.token_ids, model=it.model, lora=it.lora_name, block_extra_keys=it.extra_keys)
                self._core.store_keys(it.pod, it.dp_rank, self._mid(it.model), it.engine_keys, rks, it.tier)
                stored_rks = rks
                attached += len(rks)
            else:
                state = tp._root(it.model, it.lora_name) if prk is None else int(prk)
                rks = _u64(self._core.store_chain(
                    it.pod, it.dp_rank, self._mid(it.model), it.engine_keys, state, it.token_ids, self._K, self._A,
                    it.tier,
                ))
                stored_rks = rks
                attached += len(rks)
            if self._spec:
                self._confirm_many(it.pod, stored_rks)
            if self._orphans:
                for ek, rk in zip(it.engine_keys, rks.tolist()):
                    waiting = self._orphans.pop((it.model, ek), None)
                    if waiting:
                        for w in waiting:
                            self._forget_orphan(w)
                            self._c["orphans_attached"] += len(w.engine_keys) - len(w.removed)
                            work.append((w, rk))
        return attached

    def _resolve(self, pod: str, dp_rank: int, engine_key: int, model: str | None) -> int | None:
        """The request key of ``engine_key`` in the main tables (the stream's, else the model's level 2)."""
        mid = self._model_ids.get(model)
        return None if mid is None else self._core.resolve(pod, dp_rank, mid, int(engine_key))

    def _main_masks(self, pod: str, dp_rank: int, model: str | None, keys: list[int]) -> list[int]:
        """Tier mask per request key of publisher (pod, rank, model) in the main tables (0 = absent)."""
        mid = self._model_ids.get(model)
        if mid is None or not keys:
            return [0] * len(keys)
        return _u64(self._core.stream_masks(pod, _rank(dp_rank), mid, _as_keys(keys))).tolist()

    def _confirm_many(self, pod: str, rks: Iterable[int]) -> None:
        spec = self._spec
        for rk in (rks.tolist() if hasattr(rks, "tolist") else rks):
            if rk in spec:
                self._confirm_speculative(pod, rk)

    def _mid(self, model: str | None) -> int:
        """The core's id of ``model`` (assigned on first use)."""
        mid = self._model_ids.get(model)
        if mid is None:
            if len(self._model_ids) >= 0xFFFF:
                raise ValueError("more than 65,535 models")
            mid = self._model_ids[model] = len(self._model_ids)
        return mid


def _u64(buf: bytes) -> np.ndarray:
    """A read-only uint64 array over the compiled core's output bytes."""
    return np.frombuffer(buf, dtype=np.uint64)


def _lists(masks: dict[str, bytes]) -> dict[str, list[int]]:
    """The core's per-pod mask bytes as lists of ints (numpy's tolist is the fast way)."""
    return {pod: np.frombuffer(b, dtype=np.uint64).tolist() for pod, b in masks.items()}


def _as_keys(request_keys: Sequence[int] | np.ndarray) -> np.ndarray:
    """Request keys as a contiguous uint64 array (ValueError/OverflowError out of range)."""
    if isinstance(request_keys, np.ndarray) and request_keys.dtype == np.uint64:
        return np.ascontiguousarray(request_keys)
    return np.array([int(k) for k in request_keys], dtype=np.uint64)


def _summarise(matches: dict[str, list[int]], weights: list[float]) -> dict[str, tuple[int, float, int]]:
    out = {}
    for pod, masks in matches.items():
        union = 0
        for m in masks:
            union |= m
        counts: dict[int, int] = {}
        for m in masks:
            counts[m] = counts.get(m, 0) + 1
        weighted = 0.0
        for m, k in counts.items():
            weighted += _mask_weight(m, weights) * k
        out[pod] = (len(masks), weighted, union)
    return out


def _mask_weight(mask: int, weights: list[float]) -> float:
    best = None
    b = 0
    while mask:
        if mask & 1:
            w = weights[b] if b < len(weights) else 0.0
            best = w if best is None or w > best else best
        mask >>= 1
        b += 1
    return best or 0.0


