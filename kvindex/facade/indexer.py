"""The facade a router embeds: config -> index + pool + subscriber + scorer.

Write path (background threads): engines -> ZMQ -> :class:`kvevents.Subscriber`
-> :class:`kvevents.EventPool` shards -> :class:`kvindex.KVBlockIndex`.
Read path (the caller's thread): tokens -> request keys -> prefix match ->
prefix scores -> picker with load -> :class:`Score` (chosen pod + explanation).

Example::

    from kvindex.facade import Indexer, Config
    cfg = Config.from_dict({"model_name": "m", "kv_events_config": {"engines": [
        {"pod": "a", "endpoint": "tcp://127.0.0.1:5557", "replay_endpoint": "tcp://127.0.0.1:5558"}]}})
    with Indexer(cfg) as ix:
        result = ix.score(token_ids, pods=["a", "b"])
        print(result.pod, result.prefix["a"].matched_tokens)
"""

from __future__ import annotations

import atexit
import logging
import threading
import time
from collections.abc import Collection, Mapping, Sequence
from itertools import repeat

import msgspec
import numpy as np
from prometheus_client import CollectorRegistry

from kvindex.facade.config import Config
from kvindex.facade.flush import FlushReport, flush_engines
from kvindex.facade.metrics import KVIndexMetrics
from kvevents.misconfig import ConfigCheck
from kvevents.pool import EventPool, PoolStats, StreamState
from kvevents.subscriber import EngineEndpoint, Subscriber
from kvindex.contract import GroupAware, IndexStats, KVIndex, TokenMatch
from kvindex.groups import GroupsMixin
from kvindex.factory import make_index
from kvindex.hybrid_score import bound_matches
from kvindex.id_arrays import _check_ids, _keys_to_u64
from kvindex.keys import TokenProcessor
from kvindex.tiers import TIERS, TierWeights
from kvindex.truth import PodTruth, PredictionTruth
from scorer.load import LoadSnapshot
from scorer.picker import Choice, PickerWeights, TTFTPicker, WeightedPicker
from scorer.prefix import PrefixScore, predicted_cached_tokens, prefix_scores_from_matches

__all__ = ["Indexer", "Score", "IndexerStats", "FlushReport"]

log = logging.getLogger("indexer")

#: indexers between start() and stop(), stopped at interpreter exit (see :func:`_stop_running`); held
#: strongly: a started indexer the caller dropped still has running workers, which must be stopped too
_RUNNING: set[Indexer] = set()


@atexit.register
def _stop_running() -> None:
    """Stop every indexer still running when the interpreter exits.

    Their workers are daemon threads: left running, the interpreter freezes
    them with their frames, which keep the index (and the compiled core's
    objects) alive past finalisation, and nanobind reports them as leaked.
    Stopping joins the threads, so everything is freed in order.
    """
    for ix in list(_RUNNING):
        try:
            ix.stop()
        except Exception:  # exiting: nothing left to tell
            log.debug("stopping an indexer at exit failed", exc_info=True)


class Score(msgspec.Struct, frozen=True, kw_only=True):
    """Result of :meth:`Indexer.score`.

    request_blocks: full blocks in the prompt (the trailing partial block has
    no key); prefix: pod -> :class:`PrefixScore` for every candidate; choice:
    the picker's :class:`Choice` (None when there were no candidates);
    pod: shortcut for ``choice.pod``.
    """

    request_blocks: int
    block_size: int
    prefix: dict[str, PrefixScore]
    choice: Choice | None
    pod: str | None
    prompt_tokens: int = 0

    def predicted_cached_tokens(self, pod: str | None = None) -> int:
        """Prefix-cache hit tokens vLLM will report if the prompt runs on ``pod``
        (default: the chosen pod): the matched prefix, capped so the engine still
        computes at least one token (see scorer.prefix.predicted_cached_tokens).
        KeyError for a pod that was not a candidate."""
        pod = self.pod if pod is None else pod
        if pod is None:
            return 0
        return predicted_cached_tokens(self.prefix[pod].matched_blocks, self.prompt_tokens, self.block_size)

    def explain(self) -> str:
        """The picker's table, or a one-line note when nothing could be chosen."""
        if self.choice is None:
            return f"no candidate pods ({self.request_blocks} request blocks)"
        return self.choice.explain()


class IndexerStats(msgspec.Struct, frozen=True):
    """Index and write-path counters together (see IndexStats and PoolStats).

    misconfigured: the streams whose engine's configuration does not match
    ours (block size, engine-hash algorithm, model), each with its reasons
    (``StreamState.misconfigured``) and what to set (``why``).
    """

    index: IndexStats
    events: PoolStats
    received_messages: int
    misconfigured: tuple[StreamState, ...] = ()


def _checked_loads(loads: object) -> Mapping[str, LoadSnapshot]:
    """``loads`` as given to :meth:`Indexer.score`; TypeError unless it maps str to LoadSnapshot."""
    if not isinstance(loads, Mapping) or not all(
        isinstance(p, str) and isinstance(v, LoadSnapshot) for p, v in loads.items()
    ):
        raise TypeError("loads must map pod ids (str) to LoadSnapshot")
    return loads


class Indexer:
    """KV-cache-aware pod scoring for one fleet of engines.

    Args:
        config: the configuration (defaults: block size 16, xxh3_chain keys,
            no engines).
        index: use this index (any :class:`kvindex.contract.KVIndex`) instead of
            building the one ``kv_block_index_config.backend`` names.
        metrics_registry: register the library's metrics (:attr:`metrics`)
            there now (as :meth:`register_metrics`); None: not registered.
        metrics_namespace: prefix of this indexer's metric names
            (``<namespace>_kvindex_...``; see
            :class:`~kvindex.facade.metrics.KVIndexMetrics`): give each
            indexer of one process its own to serve them from one registry.

    The write path runs only between :meth:`start` and :meth:`stop`; the read
    path (:meth:`score`) works at any time on whatever the index holds.
    """

    def __init__(
        self,
        config: Config | None = None,
        *,
        index: KVIndex | None = None,
        metrics_registry: CollectorRegistry | None = None,
        metrics_namespace: str | None = None,
    ) -> None:
        if config is not None and not isinstance(config, Config):
            raise TypeError(f"config must be a Config, got {type(config).__name__}")
        if metrics_registry is not None and not isinstance(metrics_registry, CollectorRegistry):
            raise TypeError(f"metrics_registry must be a prometheus_client CollectorRegistry, got {type(metrics_registry).__name__}")
        self.config = cfg = config or Config()
        tpc = cfg.token_processor_config
        self.token_processor = (
            index.token_processor
            if index is not None
            else TokenProcessor(
                block_size=tpc.block_size,
                hash_seed=tpc.hash_seed,
                algorithm=tpc.algorithm,
                engine_hash_seed=tpc.engine_hash_seed,
                lora_paths=tpc.lora_paths,
                hash_lookahead_tokens=tpc.hash_lookahead_tokens,
            )
        )
        self.index: KVIndex = index if index is not None else self._build_index()
        ev = cfg.kv_events_config
        self.pool = EventPool(
            self.index, concurrency=ev.concurrency, queue_size=ev.queue_size, replay_timeout=ev.replay_timeout,
            replay_retries=ev.replay_retries, replay_retry_max_delay=ev.replay_retry_max_delay,
            rejoin_checks=ev.rejoin_checks, config_check=ConfigCheck(
                self.token_processor, cfg.model_name, keeps_groups=isinstance(self.index, GroupAware)),
        )
        # pod -> its entry, the model filled in: blocks of a topic that names no model are filed under it
        self._engines = {e.pod: self._with_model(e) for e in ev.engines}
        self.subscriber = Subscriber(
            self.pool,
            list(self._engines.values()),
            bind=ev.zmq_endpoint,
            bind_replay=ev.bind_replay,
            bind_engine=ev.engine,
            bind_model=cfg.model_name,
            connect_timeout=ev.connect_timeout,
        )
        sc = cfg.scorer_config
        self.tier_weights = TierWeights(sc.tier_weights)
        self.picker: WeightedPicker | TTFTPicker = self._build_picker()
        self.speculative_ttl = sc.speculative_ttl
        self._bit_weight_cache: list[float] = []
        self._best_tier_cache: dict[int, str | None] = {}
        self._loads: dict[str, LoadSnapshot] = {}
        self._in_flight: dict[str, int] = {}
        self._prefill: dict[str, float] = {}  # pod -> router-side prompt tokens still to prefill
        self._tracks_prefill = False
        # pod -> the snapshot loads() hands out (engine load + in-flight + prefill), kept current on
        # every change of one pod, so that a score reads it without building one per pod
        self._merged: dict[str, LoadSnapshot] = {}
        self._empty_prefix: dict[str, PrefixScore] = {}  # pod -> its no-match score (immutable)
        self._lock = threading.Lock()
        # pods of the configured engines (plus add_engine, minus remove_engine): candidates of every score
        self._configured_pods: frozenset[str] = frozenset([e.pod for e in ev.engines] + list(ev.bind_replay))
        self._model_warned: set[str | None] = set()
        self._model_seen: set[str | None] = set()
        # checked once: score() is a hot path; lookahead keys leave out the prompt's tail, which
        # the compiled token match does not know
        self._token_match = isinstance(self.index, TokenMatch) and not getattr(
            self.token_processor, "hash_lookahead_tokens", 0)
        self._grouped = isinstance(self.index, GroupAware)  # hybrid models: matches bounded by the hit rule
        # the shared group tables answer "no hybrid stream at all" in one call (a plain fleet's score skips the rule)
        self._any_grouped = self.index.any_grouped if isinstance(self.index, GroupsMixin) else None
        self.truth = PredictionTruth()  # predicted vs engine-confirmed cached tokens (report_cached)
        self._truth_lock = threading.Lock()
        self.metrics = KVIndexMetrics(self, namespace=metrics_namespace)
        if metrics_registry is not None:
            self.metrics.register(metrics_registry)

    def _build_index(self) -> KVIndex:
        """The index ``kv_block_index_config`` names, on :attr:`token_processor`."""
        ic = self.config.kv_block_index_config
        mem = ic.in_memory_config
        if ic.backend == "redis":
            from kvindex.redis_index import RedisKVBlockIndex

            rc = ic.redis_config
            return RedisKVBlockIndex(
                self.token_processor, capacity=mem.size, max_orphan_blocks=mem.max_orphan_blocks, url=rc.url,
                key_prefix=rc.key_prefix, held_ttl=rc.held_ttl, socket_timeout=rc.socket_timeout,
                retry_interval=rc.retry_interval,
            )
        return make_index(ic.backend, self.token_processor, capacity=mem.size, max_orphan_blocks=mem.max_orphan_blocks)

    def _build_picker(self) -> WeightedPicker | TTFTPicker:
        """The picker ``scorer_config`` names."""
        sc = self.config.scorer_config
        if sc.picker == "ttft":
            return TTFTPicker(kv_pressure=sc.kv_pressure, kv_stall=sc.kv_stall, decode_reserve=sc.decode_reserve)
        return WeightedPicker(
            PickerWeights(prefix=sc.weights.prefix, kv_usage=sc.weights.kv_usage, queue=sc.weights.queue)
        )

    # -- lifecycle

    def start(self) -> Indexer:
        """Start the pool workers and the subscriber (opens the ZMQ sockets).

        Never waits for an engine that cannot be reached: it returns once
        each engine subscription's first connection attempt has ended, up
        (a reachable engine handshakes within milliseconds; its bootstrap
        replay is then queued, so a :meth:`flush` after ``start()`` covers
        what it buffers) or failed (refused, unresolvable: at once; an
        address dropping packets: after ``kv_events_config.connect_timeout``,
        the bound of one TCP attempt).  Engines not up are named in one
        warning and subscribed to in the background; :meth:`wait_connected`
        is the explicit wait for them.  Raises the socket error (e.g.
        zmq.ZMQError for a bind address in use) with nothing left running.
        """
        self.pool.start()
        try:
            self.subscriber.start()
        except BaseException:
            self.pool.stop()  # its workers would keep the index alive past interpreter exit
            raise
        _RUNNING.add(self)
        wait = self.config.kv_events_config.connect_timeout
        if wait > 0:
            self.subscriber.wait_settled(wait + 1.0)  # an attempt ends within connect_timeout
            down = sorted({pod for (pod, _rank), up in self.subscriber.connected().items() if not up})
            if down:
                log.warning("KV-event publishers not reachable yet (subscribing in the background): %s", down)
        return self

    def wait_connected(self, timeout: float = 10.0) -> bool:
        """Block until every engine subscription has been up at least once; False after ``timeout`` s.

        :meth:`start` waits only for engines that answer at once; call this
        (then :meth:`flush`) to wait for engines that were not reachable yet,
        or after :meth:`add_engine` to have a new engine's buffered events
        before scoring on it.  See
        :meth:`kvevents.subscriber.Subscriber.wait_connected`.
        """
        return self.subscriber.wait_connected(timeout)

    def stop(self) -> None:
        """Stop receiving, then stop the workers after what is queued (also done at interpreter exit)."""
        _RUNNING.discard(self)
        self.subscriber.stop()
        self.pool.stop()

    def __enter__(self) -> Indexer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _with_model(self, engine: EngineEndpoint) -> EngineEndpoint:
        """``engine`` with ``model`` defaulting to ``config.model_name`` (for topics that name none)."""
        if engine.model is None and self.config.model_name is not None:
            return msgspec.structs.replace(engine, model=self.config.model_name)
        return engine

    def add_engine(self, engine: EngineEndpoint) -> None:
        """Subscribe to one more engine while running.

        Its ``model`` defaults to ``config.model_name``; its pod is a
        candidate of every score from now.  Raises TypeError / ValueError
        for a bad engine entry.
        """
        if not isinstance(engine, EngineEndpoint):
            raise TypeError(f"add_engine takes an EngineEndpoint, got {type(engine).__name__}")
        engine = self._with_model(engine)
        self.subscriber.add_engine(engine)
        with self._lock:
            self._engines[engine.pod] = engine
            self._configured_pods = self._configured_pods | {engine.pod}

    def remove_engine(self, pod: str) -> None:
        """Unsubscribe from ``pod`` and forget its blocks and load."""
        self.subscriber.remove_engine(pod)
        with self._lock:
            self._engines.pop(pod, None)
            self._configured_pods = self._configured_pods - {pod}
            self._loads.pop(pod, None)
            self._in_flight.pop(pod, None)
            self._merged.pop(pod, None)

    # -- load signals

    def update_load(self, pod: str, load: LoadSnapshot) -> None:
        """Record the latest engine-reported load of ``pod`` (e.g. from scorer.fetch_load).

        Raises TypeError unless ``pod`` is a str and ``load`` a LoadSnapshot.
        """
        if not isinstance(pod, str) or not isinstance(load, LoadSnapshot):
            raise TypeError("update_load(pod: str, load: LoadSnapshot)")
        with self._lock:
            self._loads[pod] = load
            self._merge(pod)

    def request_started(self, pod: str, prefill_tokens: int = 0) -> None:
        """Count one more request the router has in flight on ``pod``.

        ``prefill_tokens``: the prompt tokens the pod will compute for it
        (``Score.prompt_tokens - Score.predicted_cached_tokens(pod)``); the sum
        over requests that have not produced a first token yet is the pod's
        ``LoadSnapshot.prefill_tokens``.  Take it off again with
        :meth:`request_prefilled` at the first token, or else with
        :meth:`request_finished`, passing the same number once.
        """
        with self._lock:
            self._in_flight[pod] = self._in_flight.get(pod, 0) + 1
            if prefill_tokens > 0:
                self._prefill[pod] = self._prefill.get(pod, 0.0) + prefill_tokens
                if not self._tracks_prefill:
                    self._tracks_prefill = True
                    for p in self._merged:
                        self._merge(p)
            self._merge(pod)

    def request_prefilled(self, pod: str, prefill_tokens: int) -> None:
        """The request's first token arrived: its ``prefill_tokens`` are no longer queued on ``pod``."""
        with self._lock:
            self._prefill[pod] = max(0.0, self._prefill.get(pod, 0.0) - prefill_tokens)
            if pod in self._merged:
                self._merge(pod)

    def request_finished(self, pod: str, prefill_tokens: int = 0) -> None:
        """Count one in-flight request on ``pod`` as done (never below 0); ``prefill_tokens``
        as given to :meth:`request_started` unless :meth:`request_prefilled` took them off."""
        with self._lock:
            self._in_flight[pod] = max(0, self._in_flight.get(pod, 0) - 1)
            if prefill_tokens > 0:
                self._prefill[pod] = max(0.0, self._prefill.get(pod, 0.0) - prefill_tokens)
            self._merge(pod)

    def _merge(self, pod: str) -> None:
        """Rebuild ``pod``'s entry of the snapshot table :meth:`loads` copies (caller holds the lock)."""
        self._merged[pod] = msgspec.structs.replace(
            self._loads.get(pod) or LoadSnapshot(),
            in_flight=self._in_flight.get(pod, 0),
            prefill_tokens=self._prefill.get(pod, 0.0) if self._tracks_prefill else None,
        )

    def loads(self) -> dict[str, LoadSnapshot]:
        """Current load per pod: last engine snapshot with the router's in-flight count."""
        with self._lock:
            return dict(self._merged)

    # -- read path

    def request_keys(
        self,
        tokens: Sequence[int] | np.ndarray,
        *,
        model: str | None = None,
        lora: str | None = None,
        block_extra_keys: Sequence[Sequence | None] | None = None,
        cache_salt: str | None = None,
        prefix_keys: Sequence[int] | np.ndarray | None = None,
    ) -> np.ndarray:
        """Request keys (uint64 array, one per full block) of a prompt; model defaults to config.model_name.

        ``prefix_keys``: keys of an earlier prompt that ``tokens`` extends (same
        scope, salt and extras), not hashed again (``TokenProcessor.request_keys``).
        """
        return self.token_processor.request_keys(
            tokens,
            model=model if model is not None else self.config.model_name,
            lora=lora,
            block_extra_keys=block_extra_keys,
            cache_salt=cache_salt,
            prefix_keys=prefix_keys,
        )

    def score(
        self,
        tokens: Sequence[int] | np.ndarray,
        pods: Collection[str] | None = None,
        *,
        model: str | None = None,
        lora: str | None = None,
        block_extra_keys: Sequence[Sequence | None] | None = None,
        cache_salt: str | None = None,
        loads: Mapping[str, LoadSnapshot] | None = None,
        keys: np.ndarray | None = None,
    ) -> Score:
        """Score candidate pods for a prompt and pick one.

        Args:
            tokens: the prompt's token ids (list or 1-D integer array), as the
                engine will see them (chat template applied).
            pods: candidate pods; None = every pod the index, the load table
                or the configuration (engines, ``bind_replay``, :meth:`add_engine`)
                knows, so an idle configured pod holding nothing is a candidate.
            model, lora: key scope (model defaults to ``config.model_name``).
            block_extra_keys, cache_salt: see kvindex.keys.TokenProcessor.
            loads: load per pod; None = the indexer's own table
                (:meth:`update_load` + in-flight counts).
            keys: the prompt's :meth:`request_keys` (same model, lora, extras
                and salt) when the caller has them: not computed again, and
                ``tokens`` only counted. A uint64 array (an int64 one is read
                as the same bits) or a list of ints.

        Returns:
            :class:`Score` with every candidate's prefix score and the choice.
            A prompt shorter than one block gives zero prefix scores.

        Raises:
            TypeError / ValueError: bad tokens, keys or arguments.
        """
        t0 = time.perf_counter()
        known: np.ndarray | None = None
        if keys is not None:
            known = self._checked_keys(keys, tokens)
        fast = self._token_match and (known is not None or (block_extra_keys is None and not cache_salt))
        if known is None and not fast:
            known = self.request_keys(
                tokens, model=model, lora=lora, block_extra_keys=block_extra_keys, cache_salt=cache_salt
            )
        mname = model if model is not None else self.config.model_name
        self._check_model(mname)
        loads = self.loads() if loads is None else _checked_loads(loads)
        candidates = self._candidates(pods, loads)
        ranks: dict[str, int] | None = None
        if fast:
            keys, prefix, ranks = self._match_fast(tokens, candidates, mname, lora, known)
        else:
            assert known is not None
            keys = known
            prefix = self._match(keys, candidates, len(tokens), mname)
        choice = self._choose(prefix, loads, candidates, len(tokens), keys, ranks)
        self.metrics.observe_score(
            time.perf_counter() - t0, prefix[choice.pod].coverage if choice is not None and len(keys) else None
        )
        return Score(
            request_blocks=len(keys),
            block_size=self.token_processor.block_size,
            prefix=prefix,
            choice=choice,
            pod=choice.pod if choice is not None else None,
            prompt_tokens=len(tokens),
        )

    def _candidates(self, pods: Collection[str] | None, loads: Mapping[str, LoadSnapshot]) -> list[str]:
        """The pods to score: as given, or (None) every pod the index, the load table or the
        configuration knows (a configured engine holding nothing and reporting no load included)."""
        if pods is None:
            return sorted(self.index.pods() | set(loads) | self._configured_pods)
        if isinstance(pods, (str, bytes)) or not all(map(isinstance, pods, repeat(str))):
            raise TypeError("pods must be a collection of pod ids (str)")
        return list(dict.fromkeys(pods))

    def _checked_keys(self, keys: np.ndarray, tokens: Sequence[int] | np.ndarray) -> np.ndarray:
        """``keys`` given to :meth:`score` as a uint64 array; ValueError unless one per keyed block of
        ``tokens`` (counted, not read: TypeError unless a sequence or a 1-D array)."""
        _check_ids(tokens, "tokens")
        prompt_tokens = len(tokens)
        arr = _keys_to_u64(keys, "keys")
        tp = self.token_processor
        want = max(prompt_tokens - getattr(tp, "hash_lookahead_tokens", 0), 0) // tp.block_size
        if len(arr) != want:
            raise ValueError(f"keys: {want} request keys expected for {prompt_tokens} tokens, got shape {arr.shape}")
        return arr

    def _match_fast(
        self, tokens: Sequence[int] | np.ndarray, candidates: list[str], model: str | None, lora: str | None,
        keys: np.ndarray | None = None,
    ) -> tuple[np.ndarray, dict[str, PrefixScore], dict[str, int]]:
        """The compiled read path: keys (unless given), every candidate's match and the DP rank of
        each pod whose match one rank holds, in one call."""
        ranks: dict[str, int] = {}
        if keys is None:
            keys, summary = self.index.match_tokens(  # type: ignore[union-attr]
                tokens, candidates, self._bit_weights(), model=model, lora=lora, dp_ranks=ranks)
        else:
            summary = self.index.prefix_summary(  # type: ignore[attr-defined]
                keys, candidates, self._bit_weights(), dp_ranks=ranks) if len(keys) and candidates else {}
        if not len(keys):
            return keys, {p: PrefixScore(pod=p) for p in candidates}, ranks
        prefix = self._prefix_from_summary(summary, len(keys), candidates)
        if self._grouped and summary and (self._any_grouped is None or self._any_grouped()):
            # hybrid pods (their engines publish other KV-cache groups): matched again, bounded by the hit rule
            hybrid = [p for p in summary if self.index.grouped_ranks(p, model=model)]  # type: ignore[attr-defined]
            if hybrid:
                prefix.update(self._match(keys, hybrid, len(tokens), model))
                for p in hybrid:
                    ranks.pop(p, None)  # its DP rank: of the bounded match (_choose asks best_dp_rank)
        return keys, prefix, ranks

    def _match(
        self, keys: np.ndarray, candidates: list[str], prompt_tokens: int, model: str | None
    ) -> dict[str, PrefixScore]:
        """Every candidate's prefix score from the index's per-pod matches of ``keys``.

        An index keeping KV-cache groups has each hybrid pod's match cut to its
        engine's hit (:func:`kvindex.hybrid_score.bound_matches`).
        """
        matches = self.index.prefix_match(keys, candidates) if len(keys) and candidates else {}
        limited: dict[str, int | None] = {}
        if self._grouped and matches and (self._any_grouped is None or self._any_grouped()):
            matches, limited = bound_matches(
                self.index, matches, keys, self.token_processor.block_size, prompt_tokens, model)
        prefix = prefix_scores_from_matches(
            matches, len(keys), self.token_processor.block_size, candidates, self.tier_weights
        )
        for pod, group in limited.items():
            if pod in prefix:
                prefix[pod] = msgspec.structs.replace(prefix[pod], hybrid=True, limited_by_group=group)
        return prefix

    def _choose(
        self, prefix: dict[str, PrefixScore], loads: Mapping[str, LoadSnapshot], candidates: list[str],
        prompt_tokens: int, keys: np.ndarray, ranks: dict[str, int] | None,
    ) -> Choice | None:
        """The picker's choice, with the DP rank that holds the chosen pod's match."""
        if not candidates:
            return None
        choice = self.picker.pick(prefix, loads, candidates, prompt_tokens=prompt_tokens)
        matched = prefix[choice.pod].matched_blocks
        if matched:
            rank = ranks.get(choice.pod) if ranks else None
            if rank is None:
                rank = self.index.best_dp_rank(choice.pod, keys[:matched])
            if rank is not None:
                choice = msgspec.structs.replace(choice, dp_rank=rank)
        return choice

    def _bit_weights(self) -> list[float]:
        """Tier weight per tier bit (registry order), for the compiled read path."""
        n = len(TIERS)
        w = self._bit_weight_cache
        if len(w) != n:
            w = self._bit_weight_cache = [self.tier_weights.best(1 << b) for b in range(n)]
        return w

    def _prefix_from_summary(
        self, summary: Mapping[str, tuple[int, float, int]], request_blocks: int, candidates: Sequence[str]
    ) -> dict[str, PrefixScore]:
        """PrefixScore per candidate from (matched blocks, weighted blocks, tier union) per pod;
        the same values as scorer.prefix.prefix_scores_from_matches on the masks."""
        bs = self.token_processor.block_size
        out: dict[str, PrefixScore] = {}
        get = summary.get
        empty = self._empty_prefix
        best = self._best_tier_cache
        for pod in candidates:
            s = get(pod)
            if s is None:
                ps = empty.get(pod)
                if ps is None:  # frozen, so one per pod serves every score
                    if len(empty) >= 65_536:
                        empty.clear()
                    ps = empty[pod] = PrefixScore(pod=pod)
                out[pod] = ps
                continue
            n, weighted, union = s
            cov = weighted / request_blocks
            tier = best.get(union, "")
            out[pod] = PrefixScore(
                pod=pod,
                matched_blocks=n,
                matched_tokens=n * bs,
                weighted_blocks=weighted,
                coverage=cov if cov < 1.0 else 1.0,
                best_tier=tier if tier != "" else self._best_tier(union),
            )
        return out

    def _best_tier(self, mask: int) -> str | None:
        name = self._best_tier_cache.get(mask, "")
        if name == "":
            name = self._best_tier_cache[mask] = self.tier_weights.best_tier(mask)
        return name

    def _check_model(self, model: str | None) -> None:
        """Warn once when scoring a model no event has stored blocks for: keys are
        scoped by model, so a name that differs from the engines' topics matches nothing."""
        if model in self._model_seen or self.token_processor.engine_compatible or model in self._model_warned:
            return
        seen = self.index.models()
        if model in seen:
            self._model_seen.add(model)  # an index forgets no model: never asked again
        elif seen:
            self._model_warned.add(model)
            log.warning(
                "scoring for model %r, but the engines' events name %s: keys are scoped by model, so "
                "nothing will match (set model_name / pass model= as in the topics kv@<pod>@<model>)",
                model, sorted(map(str, seen)),
            )

    def route(
        self,
        tokens: Sequence[int] | np.ndarray,
        pods: Collection[str] | None = None,
        *,
        model: str | None = None,
        lora: str | None = None,
        block_extra_keys: Sequence[Sequence | None] | None = None,
        cache_salt: str | None = None,
        loads: Mapping[str, LoadSnapshot] | None = None,
        keys: np.ndarray | None = None,
    ) -> Score:
        """:meth:`score`, then count the request in flight on the chosen pod and,
        when ``speculative_ttl`` > 0, mark its blocks as speculatively held there.
        Call :meth:`request_finished` with the pod when the request ends."""
        if keys is not None:
            keys = _keys_to_u64(keys, "keys")
        result = self.score(
            tokens, pods, model=model, lora=lora, block_extra_keys=block_extra_keys, cache_salt=cache_salt, loads=loads,
            keys=keys,
        )
        if result.pod is not None:
            self.request_started(result.pod)
            if self.speculative_ttl > 0 and result.request_blocks:
                if keys is None:
                    keys = self.request_keys(
                        tokens, model=model, lora=lora, block_extra_keys=block_extra_keys, cache_salt=cache_salt
                    )
                self.index.add_speculative(keys, result.pod, self.speculative_ttl)
        return result

    # -- observability

    def register_metrics(self, registry: CollectorRegistry) -> KVIndexMetrics:
        """Register the library's Prometheus metrics (:attr:`metrics`) in ``registry``.

        The router then serves them with the rest of its registry
        (``prometheus_client.generate_latest(registry)``); see
        :mod:`kvindex.facade.metrics` and docs/operations.md's "Metrics" table.  Raises
        ValueError when ``registry`` already holds one of the names (another
        indexer's: construct each with its own ``metrics_namespace``).
        """
        return self.metrics.register(registry)

    def report_cached(self, pod: str, predicted: int, confirmed: int) -> None:
        """Report a routed request's truth: ``predicted`` cached tokens vs what the engine confirmed.

        ``confirmed``: the answer's ``usage.prompt_tokens_details.cached_tokens``
        (vLLM with ``--enable-prompt-tokens-details``) or the request's increase
        of the engine's ``vllm:prefix_cache_hits_total``. Feeds the
        ``kvindex_prediction_*`` metrics and :meth:`prediction_truth`; a pod
        whose prediction is wrong for a sustained window is marked unhealthy
        (:class:`kvindex.truth.PredictionTruth`, replaceable as :attr:`truth`).
        ValueError on negative counts.
        """
        with self._truth_lock:
            self.truth.report(pod, predicted, confirmed)

    def prediction_truth(self) -> dict[str, PodTruth]:
        """Per pod: totals of predicted, confirmed, over- and under-predicted tokens, and health."""
        with self._truth_lock:
            return self.truth.pods()

    def stats(self) -> IndexerStats:
        """Index sizes/counters and write-path counters."""
        return IndexerStats(
            index=self.index.stats(), events=self.pool.stats(), received_messages=self.subscriber.received,
            misconfigured=tuple(s for s in self.pool.completeness() if s.misconfigured),
        )

    def completeness(self, pod: str | None = None) -> list[StreamState]:
        """Per publisher stream (pod, model, DP rank): is the index known to hold exactly its blocks?

        A snapshot, sorted; only ``pod``'s streams when given.  Each
        :class:`~kvevents.pool.StreamState` says ``complete`` (False after an
        unrecoverable gap, a dropped message until a replay caught up, a
        reconnect without replay, a restart or start caught after the
        engine's seq 0 left its buffer, or a malformed event) and ``since``,
        the ``time.monotonic()`` of this process when it last became
        complete.  A stream whose engine is configured unlike us (another
        block size, engine-hash algorithm or model) is not complete, names
        the reasons in ``misconfigured`` and what to set in ``why`` (logged
        once per stream as ``kvevents: misconfigured: ...``).  A pod whose streams are all complete is predicted exactly;
        an incomplete one may miss blocks it holds (never holds more, when it
        has a replay endpoint).  See :meth:`kvevents.pool.EventPool.completeness`.
        """
        return self.pool.completeness(pod)

    def flush(self, timeout: float = 10.0) -> bool:
        """Wait until the index holds what the engines published before this call; False if not within ``timeout`` s.

        Guarantee: for every engine DP rank with a replay endpoint (configured,
        added, or bind mode's ``bind_replay``), the engine is asked for the
        newest seq it has published (vLLM's replay protocol); True means the
        pool has applied that batch or a later one of the same engine process
        (the engine still holds the pool's last applied batch), after
        everything already queued (a stream that stops short, its last
        message lost on the way, is looked up in the engine's buffer).
        Engines without a replay endpoint are covered only as far as the
        subscriber has received their messages; engines whose subscription
        is not up (down, or not reachable yet) are not asked: nothing they
        publish can reach the index until :meth:`wait_connected`.  False on
        timeout, and when a connected engine's replay endpoint does not answer
        within ``kv_events_config.replay_timeout`` (logged as a warning); see
        :meth:`flush_report` for which engine held it up.
        """
        return self.flush_report(timeout).ok

    def flush_report(self, timeout: float = 10.0) -> FlushReport:
        """:meth:`flush`, answering per engine DP rank: caught up, behind, unreachable or unverified.

        Raises RuntimeError when the indexer is not started.
        """
        with self._lock:
            engines = list(self._engines.values())
        down = frozenset(k for k, up in self.subscriber.connected().items() if not up)
        ev = self.config.kv_events_config
        return flush_engines(
            self.pool, engines, bind_replay=ev.bind_replay, bind_engine=ev.engine, default_model=self.config.model_name,
            timeout=timeout, replay_timeout=ev.replay_timeout, down=down,
        )

    def wait_for(self, messages: int, timeout: float = 10.0) -> bool:
        """Wait until the subscriber has received ``messages`` in total and the pool applied them.

        For tests and demos; returns False on timeout.
        """
        deadline = time.monotonic() + timeout
        while self.subscriber.received < messages:
            if time.monotonic() > deadline:
                return False
            time.sleep(0.002)
        return self.pool.flush(max(0.0, deadline - time.monotonic()))
