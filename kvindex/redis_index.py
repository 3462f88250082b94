"""The shared KV block index in Redis: :class:`RedisKVBlockIndex`.

Several router replicas (separate processes) keep one index in one Redis
server.  Same interface (:class:`kvindex.contract.KVIndex`) and event
semantics as the pure-Python reference :class:`kvindex.reference.KVBlockIndex`
(which mirror vllm/distributed/kv_events.py, vLLM 0.32): two levels, tiers,
DP ranks, models, orphans, an LRU capacity bound, speculative entries with a
TTL, router-held entries.  Needs the ``redis`` package (``kvindex[redis]``);
imported only when this backend is used.

Data layout
-----------
Every key starts with ``key_prefix`` (default ``kvindex:{default}:``; the
braces are a hash tag, so on a Redis Cluster all keys share one slot and the
scripts stay valid there).  ``<rk>`` / ``<ek>`` are request / engine keys in
binary (:func:`kvindex.redis_batch.k8`: 8 bytes, 10 for a few), ``<mid>`` a
model id (0 = no model; names in ``mids`` / ``mnames``), ``<mask>`` a tier bit
mask (:mod:`kvindex.tiers`).  Layout version 3, marked by the key ``layout``;
another version under the prefix raises :class:`LayoutMismatch` (see
docs/operations.md, "Layout versions", for every key).

=========================  =====  ==========================================
key                        type   content
=========================  =====  ==========================================
``b:<rk>``                 hash   level 1: ``r:<rank>:<pod>`` ->
                                  ``<mask>:<mid>:<ek>``; ``p:<pod>`` -> the
                                  pod's mask (OR over its DP ranks)
``e:<mid>:<n>``, ``ec``    hash   level 2: ``<ek>`` -> ``<rk>:<holders>``;
                                  model -> its engine keys
``s:<mid>:<rank>:<pod>``   hash   one publisher stream: ``<ek>`` -> ``<rk>``
``ps:<pod>``, ``pk``       set,   the pod's non-empty streams; pod -> its
                           hash   request keys
``l:<n>``, ``ltop``,       zset,  the LRU (``capacity``) in buckets; a lower
``llog``                   list   bound of each one's oldest use; matched
                                  keys waiting to be refreshed
``x:<pod>``, ``h:<pod>``,  zset,  speculative entries by expiry; held
``hc:<pod>``               hash   entries (mask, reference counts)
``n``, ``l2order``         hash,  sizes; models' level-2 maps in order
                           zset
``gs:``, ``gr:``, ...             KV-cache groups (:mod:`kvindex.redis_groups`)
=========================  =====  ==========================================

Round trips: every operation is ONE server-side Lua script (EVALSHA; see
:mod:`kvindex.redis_lua`), run atomically: a prefix match over N request keys
for every candidate pod (per key, one HMGET of the ``p:<pod>`` fields of
``b:<rk>`` for the pods still matching, until each has missed once; then
the longest match appended to the LRU's touch log), a removal, a clear, a lookup.  A decoded
batch (:meth:`apply_events`, the write path's call) is one script per run of
up to 1,024 blocks (:mod:`kvindex.redis_batch`): the request keys are chained
in Python from the parent's, known here when the parent is the stream's last
stored block or stored earlier in the run, and the script applies a store
only if the stream still resolves its parent to that key; otherwise the
store goes alone and costs two (resolving the parent's request key, then the
store).

Idempotent writes: a script applied twice leaves the same state (every
counter it keeps changes only on a transition it observes), so replicas that
all ingest the same events (each with its own pool and sequencer) converge
to one state.

Time: expiries use the Redis server's clock (``TIME`` inside the scripts),
one clock for every replica; a ``clock`` given to the constructor (tests)
replaces it.  Speculative sets also carry a key TTL (server-side expiry)
when the server clock is used.

Stated differences from the reference:

- Orphans (stores waiting for an unknown parent) stay in the process that
  ingested them, bounded by ``max_orphan_blocks``: with every replica
  ingesting (or one), each sees every parent; a parent stored only by
  another replica does not release them.
- Counters in :meth:`stats` (evictions, stored blocks, ...) are this
  process's; sizes (keys, entries, engine keys, pods, speculative) are the
  shared index's.
- Held entries (the connector's decode-retained tier) are reference counted
  as in the reference; with ``held_ttl`` a pod's held entries also expire
  ``held_ttl`` seconds after its last add, so a replica that dies leaves
  none behind for long.
- At most 31 tiers (masks are 31-bit in Lua).
- KV-cache groups (:class:`kvindex.contract.GroupAware`, as the reference):
  specs, tables and the report window are shared in Redis; own-hash stores
  of a non-primary group waiting for their parent stay in the process (as
  orphans), and the hybrid streams :meth:`grouped_ranks` answers from are
  read at most once a second (:mod:`kvindex.redis_groups`).

Outage: reads (prefix_match, lookup, best_dp_rank, pods, ...) that cannot
reach Redis, or that it answers with an error (BUSY, OOM, READONLY, a failed
script), answer as an empty index (no prefix information: the picker
chooses by load alone) and count ``redis_errors``; they never raise.  Writes
raise :class:`kvindex.contract.IndexUnavailable` (counted in
``redis_errors`` and ``dropped_writes``), which the write path turns into an
incomplete stream that is rebuilt from the engine's replay buffer once
:meth:`writable` answers True.  After an error, calls fail fast for
``retry_interval`` seconds (no connect timeout per call during an outage).
An outage is logged once when it starts (with the server's URL) and once when
it ends (:class:`kvindex.redis_conn.RedisLink`); ``redis_errors`` is exported
as ``kvindex_index_redis_errors_total``.
"""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Callable, Collection, Iterable, Sequence
from typing import TYPE_CHECKING, Any

from kvindex.contract import ALL_MODELS, ApplyResult, IndexStats, PodEntry
from kvindex.hybrid import GroupSpec
from kvindex.redis_batch import BatchOps, bit_of as _bit, from_k8, k8, k8s, prepare, store_op, tally
from kvindex.redis_groups import RedisGroupsMixin
from kvindex.side_tables import SideTables, _Orphan, apply_each, checked_store
from kvindex.keys import TokenProcessor
from kvindex.contract import IndexUnavailable
from kvindex.redis_conn import LAYOUT, LayoutMismatch, RedisLink, layout_error
from kvindex.redis_lua import SCRIPTS
from kvindex.tiers import GPU, tier_names

if TYPE_CHECKING:
    import numpy as np

__all__ = ["RedisKVBlockIndex", "DEFAULT_KEY_PREFIX", "LAYOUT", "LayoutMismatch"]

#: Key prefix of the index when none is given.
DEFAULT_KEY_PREFIX = "kvindex:{default}:"


_GPU_BIT = _bit(GPU)


def _ints(values: Iterable[Any]) -> list[int]:
    return values.tolist() if hasattr(values, "tolist") else [int(v) for v in values]


class RedisKVBlockIndex(SideTables, RedisGroupsMixin):
    """The two-level KV block index kept in Redis, shared by router replicas.

    Args:
        token_processor: as :class:`kvindex.reference.KVBlockIndex` (every replica
            sharing the index must use the same block size, seed and algorithm).
        capacity: bound on request keys in the shared index (LRU; >= 1).
        max_orphan_blocks: this process's bound on blocks waiting for an
            unknown parent (>= 0).
        clock: seconds, for speculative expiry; None (default) = the Redis
            server's clock, shared by every replica.
        url: ``redis://host:port/db`` (used when ``client`` is None).
        client: a ``redis.Redis`` client to use (its connection pool is shared).
        key_prefix: prefix of every key (several indexes may share a server).
        held_ttl: seconds after a pod's last :meth:`add_held` its held
            entries expire on the server (None: never).
        socket_timeout: seconds per call before it counts as an error.
        retry_interval: seconds during which calls fail fast after an error.

    Raises:
        ValueError: bad bounds, or neither ``url`` nor ``client``.
        ImportError: the ``redis`` package is not installed.
    """

    def __init__(
        self,
        token_processor: TokenProcessor | None = None,
        *,
        capacity: int = 1_000_000,
        max_orphan_blocks: int = 100_000,
        clock: Callable[[], float] | None = None,
        url: str | None = None,
        client: Any = None,
        key_prefix: str = DEFAULT_KEY_PREFIX,
        held_ttl: float | None = None,
        socket_timeout: float = 2.0,
        retry_interval: float = 0.5,
    ) -> None:
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1, got {capacity}")
        if max_orphan_blocks < 0:
            raise ValueError(f"max_orphan_blocks must be >= 0, got {max_orphan_blocks}")
        if not key_prefix or "\0" in key_prefix:
            raise ValueError("key_prefix must be non-empty and hold no NUL")
        if held_ttl is not None and not 0 < held_ttl < 86_400 * 30:
            raise ValueError(f"held_ttl must be in (0, 30 days), got {held_ttl}")
        self.link = RedisLink(
            "kvindex index", url=url, client=client, socket_timeout=socket_timeout, retry_interval=retry_interval
        )
        self._redis_errors_types = self.link.errors
        self.client = client = self.link.client
        self.token_processor = token_processor or TokenProcessor()
        self.block_size = self.token_processor.block_size
        self.capacity = capacity
        self.max_orphan_blocks = max_orphan_blocks
        self.key_prefix = key_prefix
        self.held_ttl = held_ttl
        self.retry_interval = retry_interval
        self._compat = bool(self.token_processor.engine_compatible)
        self._compat_arg = "1" if self._compat else "0"
        self._clock = clock
        self._lock = threading.RLock()
        self._scripts = {name: client.register_script(src) for name, src in SCRIPTS.items()}
        self._model_ids: dict[str | None, int] = {None: 0}
        self._model_names: dict[int, str | None] = {0: None}
        self._models: set[str | None] = set()
        #: incremented each time this process finds the shared index lost its data (see :meth:`_check_epoch`)
        self.generation = 0
        self._epoch: bytes | None = None
        self._layout_error: LayoutMismatch | None = None
        self._next_epoch_check = 0.0
        self._init_side_tables()
        #: (pod, rank, model) -> (engine key, request key) of the stream's last stored block: the likely
        #: parent of its next store (checked on the server before use)
        self._tails: dict[tuple[str, int, str | None], tuple[int, int]] = {}
        self._c = dict.fromkeys(
            (
                "evictions",
                "stored_blocks",
                "removed_blocks",
                "unknown_removals",
                "unknown_offloads",
                "orphans",
                "orphans_attached",
                "orphans_dropped",
                "speculative_confirmed",
                "speculative_expired",
                "clears",
                "dropped_writes",
                "group_unmapped",
                "group_trimmed",
                "group_evictions",
            ),
            0,
        )
        self._init_groups()

    # ------------------------------------------------------------- plumbing

    def _run(self, name: str, *args: Any, write: bool, model: Any = None) -> Any:
        """Run script ``name`` with ARGV = (prefix, *args).

        With ``model`` (a model name whose id is among ``args``), the script
        runs only if the server still gives that model the id this process
        knows (after the server lost its data, ids are handed out again).

        Raises IndexUnavailable for a write and returns None for a read when
        the server cannot be reached or fails (both counted).
        """
        now = time.monotonic()
        if self._layout_error is not None:
            raise self._layout_error
        if self.link.down():
            return self._failed(write, None)
        try:
            if now >= self._next_epoch_check:
                self._check_epoch()
            prefix = self.key_prefix
            if model is not None and model is not ALL_MODELS:
                mid = self._model_ids.get(model)
                if mid is None:  # forgotten by the epoch check just now: the id in args is the old data's
                    return self._failed(write, IndexUnavailable("the model ids changed (the server lost its data)"))
                prefix = f"{prefix}\0{model}\0{mid}"
            out = self._scripts[name](args=(prefix, *args))
        except self._redis_errors_types as exc:
            self._next_epoch_check = 0.0  # the server may come back empty
            if "STALEMODEL" in str(exc):
                with self._lock:
                    self._forget_models()
            return self._failed(write, exc)
        self.link.succeeded()
        return out

    def _failed(self, write: bool, exc: BaseException | None) -> None:
        """Count a failed call (``exc``: the server failed just now; None: failing fast); a write raises."""
        self.link.failed(exc if isinstance(exc, self._redis_errors_types) else None)
        if write:
            self._c["dropped_writes"] += 1
            raise IndexUnavailable(f"Redis unreachable: {exc or 'in retry interval'}") from exc
        return None

    def _check_epoch(self) -> None:
        """Notice a server that lost the index's data (restarted without persistence, flushed).

        The key ``epoch`` holds a random token, set when absent; a token other
        than the one this process saw (or none) means the data this process
        wrote may be gone: :attr:`generation` is incremented, and the write
        path rebuilds every stream from the engines' replay buffers.  Checked
        at most once per second and after every error (one GET/SET).
        """
        self._next_epoch_check = time.monotonic() + 1.0
        self._layout_error = layout_error(self.client, self.key_prefix, self.link.url)
        if self._layout_error is not None:
            raise self._layout_error
        old = self.client.set(self.key_prefix + "epoch", uuid.uuid4().hex, nx=True, get=True)
        cur = old if old is not None else self.client.get(self.key_prefix + "epoch")
        if self._epoch is not None and cur != self._epoch:
            self.generation += 1
            with self._lock:
                # orphans and the models' ids were the old data's
                self._drop_all_orphans()
                self._forget_models()
                self._forget_groups()
        self._epoch = cur

    def _forget_models(self) -> None:
        self._model_ids = {None: 0}
        self._model_names = {0: None}
        self._models = set()

    def _drop_all_orphans(self) -> None:
        for group in self._orphans.values():
            for g in group:
                self._c["orphans_dropped"] += len(g.engine_keys)
        self._orphans.clear()
        self._orphan_by_ek.clear()
        self._orphan_blocks = 0

    def writable(self) -> bool:
        """True when the server answers a PING now (False during ``retry_interval`` after an error)."""
        if self.link.down():
            return False
        try:
            self.client.ping()
            self._check_epoch()
        except self._redis_errors_types as exc:
            self.link.failed(exc)
            return False
        self.link.succeeded()
        return True

    def _now_args(self) -> str:
        return "" if self._clock is None else repr(float(self._clock()))

    def _mid(self, model: str | None, *, create: bool) -> int | None:
        """The shared id of ``model`` (assigned on first use when ``create``)."""
        mid = self._model_ids.get(model)
        if mid is not None:
            return mid
        if create:
            mid = int(self._run("model_id", model, write=True))
        else:
            v = self._safe(lambda: self.client.hget(self.key_prefix + "mids", model))
            if v is None:
                return None
            mid = int(v)
        self._model_ids[model] = mid
        self._model_names[mid] = model
        return mid

    def _safe(self, fn: Callable[[], Any]) -> Any:
        """A plain read command: its answer, or None (counted) when the server is unreachable."""
        return self.link.call(fn)

    def _store(
        self, pod: str, rank: int, mid: int, bit: int, eks: Sequence[int], rks: Sequence[int], model: str | None
    ) -> int:
        args: list[Any] = [pod, rank, mid, bit, self.capacity, self._compat_arg]
        for ek, rk in zip(eks, rks):
            args.append(k8(int(ek)))
            args.append(k8(int(rk)))
        stored, evictions, confirmed = self._run("store", *args, write=True, model=model)
        self._c["stored_blocks"] += stored
        self._c["evictions"] += evictions
        self._c["speculative_confirmed"] += confirmed
        return stored

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

        ``group``: the event's KV-cache group (:mod:`kvindex.redis_groups`); None for a plain store.

        Raises:
            ValueError: as the reference.
            IndexUnavailable: Redis could not be reached (nothing applied).
        """
        bit = _bit(tier)
        rank = int(dp_rank)
        eks = _ints(engine_keys)
        with self._lock:
            if group is not None:
                parent = None if parent_engine_key is None else int(parent_engine_key)
                return self._store_group(
                    pod, rank, eks, parent, token_ids, bit, block_size, extra_keys, lora_name, model, group)
            if token_ids is None or len(token_ids) == 0:
                mid = self._mid(model, create=True)
                stored, evictions, confirmed, unknown = self._run(
                    "tokenless", pod, rank, mid, bit, self.capacity, self._compat_arg, *map(k8, eks), write=True,
                    model=model,
                )
                self._c["stored_blocks"] += stored
                self._c["evictions"] += evictions
                self._c["speculative_confirmed"] += confirmed
                self._c["unknown_offloads"] += unknown
                return stored
            extras, lora_name = checked_store(self.block_size, len(eks), token_ids, block_size, extra_keys, lora_name)
            mid = self._mid(model, create=True)
            assert mid is not None
            item = _Orphan(pod, rank, tuple(eks), token_ids, bit, extras, lora_name, model, set())
            parent = None if parent_engine_key is None else int(parent_engine_key)
            n = self._store_checked(pod, rank, mid, model, eks, parent, item)
            if self._gwaiting.get((pod, rank, model)) and not self._compat:
                self._release_waiting((pod, rank, model), mid)
            return n

    def _store_checked(
        self, pod: str, rank: int, mid: int, model: str | None, eks: list[int], parent_engine_key: int | None,
        item: _Orphan,
    ) -> int:
        """A checked store with token ids into the main tables (chained here; an orphan while its parent is unknown)."""
        if model not in self._models:
            self._safe(lambda: self.client.sadd(self.key_prefix + "seen", mid))
            self._models.add(model)
        with self._lock:
            if self._compat:
                return self._store(pod, rank, mid, item.tier, eks, eks, model)
            if parent_engine_key is None:
                return self._attach(item, None)
            tail = self._tails.get((pod, rank, model))
            if tail is not None and tail[0] == int(parent_engine_key) and not self._orphans:
                # the stream's last stored block: chained here, the parent checked on the server
                ops = BatchOps()
                if store_op(self, ops, 0, item, tail):
                    done, stored, _h, _r = self._send(pod, rank, mid, model, ops)
                    if done:
                        return stored
            parent = self._run("resolve", pod, rank, mid, k8(int(parent_engine_key)), write=True, model=model)
            if parent is None:
                self._add_orphan(int(parent_engine_key), item)
                return 0
            return self._attach(item, from_k8(parent))

    def _attach(self, item: _Orphan, parent_rk: int | None) -> int:
        """Store ``item`` under ``parent_rk``, then every orphan it releases."""
        attached = 0
        work: list[tuple[_Orphan, int | None]] = [(item, parent_rk)]
        while work:
            it, prk = work.pop()
            rks = self.token_processor.chain(
                prk, it.token_ids, model=it.model, lora=it.lora_name, block_extra_keys=it.extra_keys
            ).tolist()
            keep = [i for i, ek in enumerate(it.engine_keys) if ek not in it.removed]
            if keep:
                mid = self._mid(it.model, create=True)
                attached += self._store(
                    it.pod, it.dp_rank, mid, it.tier, [it.engine_keys[i] for i in keep], [rks[i] for i in keep],
                    it.model,
                )
                self._tails[(it.pod, it.dp_rank, it.model)] = (it.engine_keys[keep[-1]], rks[keep[-1]])
            if self._orphans:
                for ek, rk in zip(it.engine_keys, rks):
                    waiting = self._orphans.pop((it.model, ek), None)
                    if waiting:
                        for w in waiting:
                            self._forget_orphan(w)
                            self._c["orphans_attached"] += len(w.engine_keys) - len(w.removed)
                            work.append((w, rk))
        return attached

    def apply_events(
        self, pod: str, dp_rank: int, events: Sequence[Any], *, model: str | None = None,
        kinds: tuple[type, type, type],
    ) -> ApplyResult:
        """Apply one publisher's decoded batch (as :meth:`kvindex.reference.KVBlockIndex.apply_events`).

        Runs of events go to the server in one script call each
        (:mod:`kvindex.redis_batch`); an event the run cannot take (a parent
        the stream's earlier stores do not name, a malformed event, a model
        without an id yet) is applied by the per-event method.  While orphans
        wait (they live in this process), events are applied one by one.
        """
        rank = int(dp_rank)
        r = ApplyResult()
        n = len(events)
        i = 0
        with self._lock:
            while i < n:
                if self._orphans or self._gwaiting:
                    return apply_each(self, pod, rank, events, model, kinds, i, r)
                mid = self._model_ids.get(model)
                ops, stop, single = prepare(self, pod, rank, events, i, model, kinds) if mid is not None else (
                    BatchOps(), i, True
                )
                if ops.events:
                    try:
                        done, _s, _h, _r = self._send(pod, rank, mid, model, ops)  # type: ignore[arg-type]
                    except IndexUnavailable as exc:
                        r.unavailable, r.left = str(exc), n - i
                        return r
                    tally(r, events, ops, done, kinds)
                    if done < len(ops.events):  # a parent resolved otherwise: that store goes alone
                        stop, single = ops.events[done], True
                if single and stop < n:
                    apply_each(self, pod, rank, events[stop : stop + 1], model, kinds, 0, r)
                    if r.unavailable is not None:
                        r.left = n - stop
                        return r
                    stop += 1
                i = stop
        return r

    def _send(
        self, pod: str, rank: int, mid: int, model: str | None, ops: BatchOps, *, count_removals: bool = True
    ) -> tuple[int, int, list[int], list[int]]:
        """Run the ``batch`` script for ``ops``; returns (ops applied, blocks stored, removal hits, group routes),
        counted here (the removals only with ``count_removals``)."""
        if ops.tokens and model not in self._models:
            self._safe(lambda: self.client.sadd(self.key_prefix + "seen", mid))
            self._models.add(model)
        done, stored, evictions, confirmed, unknown, clears, hits, routes, gevictions, trimmed, hybrid = self._run(
            "batch", pod, rank, mid, self.capacity, self._compat_arg, *ops.args, write=True, model=model
        )
        c = self._c
        c["stored_blocks"] += stored
        c["evictions"] += evictions
        c["speculative_confirmed"] += confirmed
        c["unknown_offloads"] += unknown
        c["clears"] += clears
        c["group_evictions"] += gevictions
        c["group_trimmed"] += trimmed
        c["group_unmapped"] += sum(ops.unmapped[:done])
        if count_removals:
            hit = sum(hits)
            c["removed_blocks"] += hit
            c["unknown_removals"] += len(hits) - hit
        if hybrid or ops.clears:
            self._hybrid = None  # which streams are hybrid: read again
        for k in range(done - 1, -1, -1):
            tail = ops.tails[k]
            if tail is not None:
                self._tails[(pod, rank, model)] = tail
                break
        return int(done), int(stored), hits, routes

    def block_removed(
        self, pod: str, dp_rank: int, engine_keys: Iterable[int], tier: str, *, model: str | None = None,
        group_idx: int | None = None,
    ) -> int:
        """Apply one BlockRemoved of publisher (pod, rank, model) (as the reference).

        ``group_idx``: the event's KV-cache group; only that group's entries go.

        Raises IndexUnavailable when Redis cannot be reached (nothing applied).
        """
        bit = _bit(tier)
        rank = int(dp_rank)
        keys = _ints(engine_keys)
        with self._lock:
            mid = self._model_ids.get(model)
            if mid is None:
                mid = self._mid(model, create=True)
            if group_idx is not None and keys:
                return self._remove_group(pod, rank, mid, model, keys, bit, group_idx)  # type: ignore[arg-type]
            hits = (
                self._run("remove", pod, rank, mid, bit, self._compat_arg, *map(k8, keys), write=True, model=model)
                if keys else []
            )
            removed = 0
            by_ek = self._orphan_by_ek
            for ek, hit in zip(keys, hits):
                hit = bool(hit)
                waiting = by_ek.get((pod, rank, model, ek)) if by_ek else None
                for w in waiting or ():
                    if w.tier & bit and ek not in w.removed:
                        w.removed.add(ek)
                        hit = True
                if hit:
                    removed += 1
                else:
                    self._c["unknown_removals"] += 1
            self._c["removed_blocks"] += removed
        return removed

    def clear(self, pod: str, dp_rank: int | None = None, *, model: Any = ALL_MODELS) -> int:
        """Forget what ``pod`` holds (rank ``dp_rank``, ``model`` only if given); O(the pod's keys).

        As :meth:`kvindex.reference.KVBlockIndex.clear`.  Raises IndexUnavailable
        when Redis cannot be reached (nothing applied).
        """
        every = model is ALL_MODELS
        with self._lock:
            if every:
                mid_arg = ""
            else:
                mid = self._mid(model, create=False)
                mid_arg = "-" if mid is None else str(mid)
            n = int(self._run(
                "clear", pod, "" if dp_rank is None else int(dp_rank), mid_arg, self._compat_arg, write=True,
                model=None if every or mid_arg == "-" else model,
            ))
            self._drop_orphans_of(pod, dp_rank, model)
            for s in [s for s in self._gwaiting if s[0] == pod and dp_rank in (None, s[1])]:
                if every or s[2] == model:
                    self._c["group_unmapped"] += sum(len(w.eks) for w in self._gwaiting.pop(s))
            self._hybrid = None
            if n:
                self._c["clears"] += 1
        return n

    def add_speculative(self, request_keys: Iterable[int], pod: str, ttl: float, dp_rank: int = 0) -> None:
        """Count ``pod`` as holding ``request_keys`` for ``ttl`` seconds (as the reference; shared).

        During an outage the marks are dropped (counted), never raised.

        Raises:
            ValueError: ttl not in (0, 86400).
        """
        if not 0 < ttl < 86_400:
            raise ValueError(f"ttl must be in (0, 86400) seconds, got {ttl}")
        keys = _ints(request_keys)
        if self._clock is None:
            now, expiry, keep = "", "", int(ttl * 1000) + 1000
        else:
            e = self._clock() + ttl
            now, expiry, keep = repr(e - ttl), repr(e), 0
        try:
            expired = self._run("speculative", pod, now, repr(float(ttl)), expiry, keep, *map(k8, keys), write=True)
        except IndexUnavailable:
            return
        self._c["speculative_expired"] += int(expired)

    def add_held(self, pod: str, request_keys: Iterable[int], tier: str) -> None:
        """Count ``pod`` as holding ``request_keys`` in ``tier`` (as the reference; shared).

        Raises IndexUnavailable when Redis cannot be reached.
        """
        keys = _ints(request_keys)
        if not keys:
            return
        keep = 0 if self.held_ttl is None else int(self.held_ttl * 1000)
        self._run("add_held", pod, _bit(tier), keep, *map(k8, keys), write=True)

    def remove_held(self, pod: str, request_keys: Iterable[int], tier: str) -> int:
        """Undo one :meth:`add_held`; returns the entries that ended.

        Raises IndexUnavailable when Redis cannot be reached.
        """
        keys = _ints(request_keys)
        if not keys:
            return 0
        return int(self._run("remove_held", pod, _bit(tier), *map(k8, keys), write=True))

    # ------------------------------------------------------------------- read

    def prefix_match(
        self, request_keys: Sequence[int] | np.ndarray, pods: Collection[str] | None = None
    ) -> dict[str, list[int]]:
        """Longest consecutive prefix each pod holds, as tier masks per block (one script).

        As :meth:`kvindex.reference.KVBlockIndex.prefix_match`.  With Redis
        unreachable: ``{}`` (no prefix information), counted in ``redis_errors``.
        """
        if len(request_keys) == 0:
            return {}
        keys = k8s(_ints(request_keys))
        pod_args: list[str] = [-1] if pods is None else [len(pods), *pods]  # type: ignore[list-item]
        res = self._run("match", self._now_args(), _GPU_BIT, 1, *pod_args, keys, write=False)
        if res is None:
            return {}
        self._c["speculative_expired"] += int(res[0])
        out: dict[str, list[int]] = {}
        for i in range(1, len(res), 2):
            rle = res[i + 1]
            masks: list[int] = []
            for j in range(0, len(rle), 2):
                masks += [rle[j]] * rle[j + 1]
            out[res[i].decode()] = masks
        return out

    def lookup(self, request_keys: Iterable[int]) -> list[tuple[PodEntry, ...]]:
        """Every holder of each key (as the reference; empty tuples when Redis is unreachable)."""
        keys = _ints(request_keys)
        if not keys:
            return []
        res = self._run("lookup", self._now_args(), *map(k8, keys), write=False)
        if res is None:
            return [() for _ in keys]
        self._c["speculative_expired"] += int(res[0])
        out: list[tuple[PodEntry, ...]] = []
        for r, h, x in res[1:]:
            entries: list[PodEntry] = []
            for j in range(0, len(r), 3):
                pod, rank, mask = r[j].decode(), int(r[j + 1]), int(r[j + 2])
                entries.extend(PodEntry(pod, t, rank) for t in tier_names(mask))
            for j in range(0, len(h), 2):
                entries.extend(PodEntry(h[j].decode(), t, 0) for t in tier_names(int(h[j + 1])))
            entries.sort()
            spec = sorted(PodEntry(p.decode(), GPU, 0, True) for p in x)
            out.append(tuple(entries + spec))
        return out

    def best_dp_rank(self, pod: str, request_keys: Sequence[int]) -> int | None:
        """The DP rank of ``pod`` holding the longest consecutive prefix (ties: lower rank); None if none."""
        keys = _ints(request_keys)
        if not keys:
            return None
        res = self._run("best_rank", pod, k8s(keys), write=False)
        return None if res is None else int(res)

    def request_key_of(self, engine_key: int, model: Any = ALL_MODELS) -> int | None:
        """Level 2: the request key an engine key maps to under ``model`` (None if unknown)."""
        if model is ALL_MODELS:
            mid_arg = ""
        else:
            mid = self._mid(model, create=False)
            if mid is None:
                return None
            mid_arg = str(mid)
        res = self._run("request_key_of", mid_arg, self._compat_arg, k8(int(engine_key)), write=False)
        return None if res is None else from_k8(res)

    def pods(self) -> frozenset[str]:
        """Pods holding at least one block (real, held or speculative); empty when Redis is unreachable."""
        res = self._run("pods", write=False)
        if res is None:
            return frozenset()
        return frozenset(p.decode() for part in res for p in part)

    def pod_keys(self, pod: str, dp_rank: int | None = None) -> set[int]:
        """Request keys ``pod`` holds (on ``dp_rank`` if given), any tier."""
        res = self._run("pod_keys", pod, "" if dp_rank is None else int(dp_rank), write=False)
        return set() if res is None else {from_k8(k) for k in res}

    def models(self) -> frozenset[str | None]:
        """Models whose blocks events have stored (by any replica)."""
        mids = self._safe(lambda: self.client.smembers(self.key_prefix + "seen"))
        if mids is None:
            return frozenset(self._models)
        out: set[str | None] = set()
        for m in mids:
            mid = int(m)
            if mid not in self._model_names:
                name = self._safe(lambda: self.client.hget(self.key_prefix + "mnames", mid))
                if name is None:
                    continue
                self._model_names[mid] = name.decode()
                self._model_ids[name.decode()] = mid
            out.add(self._model_names[mid])
        return frozenset(out)

    def __len__(self) -> int:
        n = self._safe(lambda: self.client.hget(self.key_prefix + "n", "keys"))
        return 0 if n is None else int(n)

    def stats(self) -> IndexStats:
        """Sizes of the shared index and this process's counters (see :class:`kvindex.contract.IndexStats`)."""
        res = self._run("stats", write=False) or [0, 0, 0, 0, 0, 0]
        keys, entries, engine_keys, pods, spec, group_entries = (int(v) for v in res)
        with self._lock:
            return IndexStats(
                keys=keys,
                entries=entries,
                engine_keys=entries if self._compat else engine_keys,
                pods=pods,
                orphan_blocks=self._orphan_blocks,
                speculative=spec,
                group_entries=group_entries,
                redis_errors=self.link.error_count,
                **self._c,
            )

    def drop_all(self) -> int:
        """Delete every key of this index's prefix (SCAN + UNLINK); returns how many. For tests and resets."""
        n = 0
        batch: list[bytes] = []
        # SCAN patterns are globs: every special character of the prefix is escaped
        pattern = "".join("\\" + c if c in "\\*?[]^-{}" else c for c in self.key_prefix) + "*"
        for k in self.client.scan_iter(match=pattern, count=1000):
            batch.append(k)
            if len(batch) >= 1000:
                n += self.client.unlink(*batch)
                batch = []
        if batch:
            n += self.client.unlink(*batch)
        with self._lock:
            self._model_ids = {None: 0}
            self._model_names = {0: None}
            self._models = set()
            self._layout_error = None
            self._next_epoch_check = 0.0
        return n
