"""Prometheus metrics of the library: write path, index and read path.

:class:`KVIndexMetrics` is one ``prometheus_client`` Collector per
:class:`~kvindex.facade.indexer.Indexer`.  Counters and gauges are read at scrape time from
what the library already counts (:meth:`Indexer.stats`,
:meth:`kvevents.EventPool.stream_counters`, :meth:`Indexer.completeness`,
the index's ``tier_stats()``), so the write path pays nothing for them; two
histograms are observed on the read path by :meth:`Indexer.score`: the call
appends its two values to a queue (well under a microsecond) and the queue is
folded into prometheus_client's Histograms when they are collected (or a few
values per score while more than :data:`PENDING_MAX` wait, so the queue stays
bounded without a scrape and no score pays for many).

Mount it in the registry your router serves::

    registry = prometheus_client.CollectorRegistry()
    indexer.register_metrics(registry)           # or registry.register(indexer.metrics)
    text = prometheus_client.generate_latest(registry)

Several indexers in one process: give each its own namespace
(``Indexer(cfg, metrics_namespace="a")``: names ``a_kvindex_...``), since a
registry refuses two collectors with the same family names.

Names follow the Prometheus conventions (``kvindex_`` prefix, counters end in
``_total``, base units such as seconds); docs/operations.md's "Metrics" section is the
reference table (name, type, labels, meaning), kept equal to :data:`METRICS`
by a test.  Labels: ``pod``, ``model`` (empty when the topic names none),
``dp_rank``, ``tier`` (gpu, cpu, storage, ...), ``kind`` (error kind).
"""

from __future__ import annotations

import re
from collections import deque
from collections.abc import Iterator
from typing import Any, Protocol

from prometheus_client import Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector, CollectorRegistry

from kvevents.pool import EventPool
from kvindex.contract import KVIndex, TierStatsSource



class MetricsSource(Protocol):
    """What the metrics read (an :class:`~kvindex.facade.indexer.Indexer`)."""

    index: KVIndex
    pool: EventPool

    def stats(self) -> Any: ...

    def completeness(self) -> Any: ...

    def prediction_truth(self) -> Any: ...


__all__ = ["KVIndexMetrics", "MetricsSource", "METRICS", "SCORE_SECONDS_BUCKETS", "COVERAGE_BUCKETS", "PENDING_MAX"]

PENDING_MAX = 4096
"""Score observations queued for the histograms beyond which each score folds a few of them."""

SCORE_SECONDS_BUCKETS = (
    25e-6, 50e-6, 100e-6, 250e-6, 500e-6, 1e-3, 2.5e-3, 5e-3, 10e-3, 25e-3, 50e-3, 100e-3, 250e-3, 1.0,
)
"""Buckets of ``kvindex_score_duration_seconds`` (25 us .. 1 s)."""

COVERAGE_BUCKETS = (0.0, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 0.95, 0.99, 1.0)
"""Buckets of ``kvindex_score_chosen_coverage`` (a ratio; the 0.0 bucket counts misses)."""

STREAM_LABELS = ("pod", "model", "dp_rank")
_NAME = re.compile(r"[a-zA-Z_:][a-zA-Z0-9_:]*")

# name (as exposed, without the _total / _bucket suffixes a family adds) -> (type, labels, help)
METRICS: dict[str, tuple[str, tuple[str, ...], str]] = {
    # write path, per publisher stream
    "kvindex_stream_messages": (
        "counter", STREAM_LABELS, "Live KV-event messages that reached the stream's sequencer (decodable, pod known)."),
    "kvindex_stream_batches": ("counter", STREAM_LABELS, "Event batches applied to the index (live and replayed)."),
    "kvindex_stream_events": ("counter", STREAM_LABELS, "KV events in the applied batches."),
    "kvindex_stream_blocks_stored": (
        "counter", STREAM_LABELS + ("tier",), "Blocks carried by applied BlockStored events."),
    "kvindex_stream_blocks_removed": (
        "counter", STREAM_LABELS + ("tier",), "Blocks carried by applied BlockRemoved events."),
    "kvindex_stream_clears": ("counter", STREAM_LABELS, "AllBlocksCleared events applied."),
    "kvindex_stream_complete": (
        "gauge", STREAM_LABELS, "1 while the index is known to hold exactly the stream's blocks, else 0."),
    "kvindex_streams_incomplete": ("gauge", (), "Publisher streams whose state is not known to be complete."),
    "kvindex_pods_incomplete": ("gauge", (), "Pods with at least one incomplete stream."),
    "kvindex_stream_misconfigured": (
        "gauge", STREAM_LABELS + ("reason",),
        "1 per reason the stream's engine is configured unlike the indexer (block_size, hash_algorithm, "
        "model_name, kv_cache_groups); the stream is then not complete."),
    "kvindex_streams_misconfigured": ("gauge", (), "Publisher streams whose engine is configured unlike the indexer."),
    # write path, totals
    "kvindex_event_messages_received": ("counter", (), "Messages the subscriber took from its ZMQ sockets."),
    "kvindex_event_messages": ("counter", (), "Messages the pool's shards took from their queues."),
    "kvindex_event_batches": ("counter", (), "Event batches applied (live and replayed)."),
    "kvindex_events": ("counter", (), "KV events applied."),
    "kvindex_blocks_stored": ("counter", (), "Blocks carried by applied BlockStored events."),
    "kvindex_blocks_removed": ("counter", (), "Blocks carried by applied BlockRemoved events."),
    "kvindex_event_clears": ("counter", (), "AllBlocksCleared events applied."),
    "kvindex_event_errors": (
        "counter", ("kind",),
        "Bad input by kind: undecodable messages, malformed events, wrong frame counts, replay failures, ..."),
    "kvindex_event_gaps": ("counter", (), "Sequence gaps seen."),
    "kvindex_event_gaps_unrecovered": ("counter", (), "Gaps a replay could not fill."),
    "kvindex_event_replay_requests": ("counter", (), "Replays asked from engines' replay endpoints."),
    "kvindex_event_replayed_batches": ("counter", (), "Batches the replays returned."),
    "kvindex_event_replay_failures": ("counter", (), "Replays or restart checks that timed out or failed."),
    "kvindex_event_replay_holes": (
        "counter", (), "Replays with a batch missing inside them (a reply lost on the way), asked again."),
    "kvindex_event_replay_retries": (
        "counter", (), "Replays asked again (with backoff) after one failed without applying anything."),
    "kvindex_event_deferred": (
        "counter", (), "Live messages left in the engine's buffer while their stream waited for a replay retry."),
    "kvindex_event_replay_cuts": (
        "counter", (), "Replays cut off at replay_max_batches (or their time limit); the rest asked for at once."),
    "kvindex_event_duplicates": ("counter", (), "Batches skipped as already applied."),
    "kvindex_event_stale": ("counter", (), "Live messages skipped because a replay had moved past them."),
    "kvindex_event_unconfirmed": ("counter", (), "Messages skipped because the engine did not confirm their seq."),
    "kvindex_event_restarts": ("counter", (), "Engine restarts confirmed (their streams cleared)."),
    "kvindex_event_dropped_messages": ("counter", (), "Messages dropped by the overflow policy (full shard queue)."),
    "kvindex_event_resyncs": ("counter", (), "Replays started by the overflow policy."),
    "kvindex_event_index_unavailable": (
        "counter", (), "Events not applied because the index's store (Redis) was unreachable."),
    "kvindex_event_rebuilds": ("counter", (), "Streams cleared and rebuilt from their engine's buffer after the index lost writes."),
    "kvindex_event_queue_messages": ("gauge", (), "Messages waiting in the shard queues."),
    "kvindex_event_queue_capacity_messages": ("gauge", (), "Bound of the shard queues, summed over shards."),
    # index
    "kvindex_index_keys": ("gauge", (), "Request keys (blocks) held (level 1)."),
    "kvindex_index_entries": ("gauge", (), "(block, pod, DP rank) entries held."),
    "kvindex_index_tier_keys": ("gauge", ("tier",), "Request keys some pod holds in the tier."),
    "kvindex_index_tier_entries": ("gauge", ("tier",), "(block, pod, DP rank) entries holding the tier."),
    "kvindex_index_engine_keys": ("gauge", (), "Engine keys mapped to request keys (level 2)."),
    "kvindex_index_pods": ("gauge", (), "Pods holding at least one block."),
    "kvindex_index_capacity_keys": ("gauge", (), "The index's bound on request keys (least recently used evicted)."),
    "kvindex_index_evictions": ("counter", (), "Request keys evicted by the capacity bound."),
    "kvindex_index_orphan_blocks": ("gauge", (), "Blocks waiting for an unknown parent now."),
    "kvindex_index_orphan_blocks_limit": ("gauge", (), "Bound on blocks waiting for a parent."),
    "kvindex_index_orphans": ("counter", (), "Blocks that waited for an unknown parent."),
    "kvindex_index_orphans_attached": ("counter", (), "Waiting blocks attached when their parent arrived."),
    "kvindex_index_orphans_dropped": ("counter", (), "Waiting blocks dropped by the bound or a clear."),
    "kvindex_index_unknown_removals": ("counter", (), "BlockRemoved for a block the pod was not known to hold."),
    "kvindex_index_speculative_entries": ("gauge", (), "Live speculative (routed, not yet confirmed) entries."),
    "kvindex_index_clears": ("counter", (), "Stream or pod clears that removed something."),
    "kvindex_index_redis_errors": (
        "counter", (), "Index calls that could not reach the Redis server or that it failed (Redis backend; "
        "reads answered without prefix information)."),
    "kvindex_index_redis_dropped_writes": ("counter", (), "Of those, writes not applied (the stream is rebuilt)."),
    # truth back in: predicted vs engine-confirmed cached tokens (Indexer.report_cached, kvindex.truth)
    "kvindex_prediction_requests": ("counter", ("pod",), "Routed requests whose engine-confirmed cached tokens were reported."),
    "kvindex_prediction_predicted_tokens": ("counter", ("pod",), "Cached prompt tokens predicted for them."),
    "kvindex_prediction_confirmed_tokens": ("counter", ("pod",), "Cached prompt tokens the engine confirmed."),
    "kvindex_prediction_over_tokens": ("counter", ("pod",), "Tokens predicted cached that the engine did not serve from cache."),
    "kvindex_prediction_under_tokens": ("counter", ("pod",), "Tokens the engine served from cache beyond the prediction."),
    "kvindex_prediction_window_precision": (
        "gauge", ("pod",), "Correct / predicted tokens over the pod's last requests (the health window)."),
    "kvindex_prediction_window_recall": (
        "gauge", ("pod",), "Correct / confirmed tokens over the pod's last requests (the health window)."),
    "kvindex_prediction_healthy": (
        "gauge", ("pod",), "0 while the pod's window precision or recall is below its threshold (a sustained mismatch)."),
    # read path
    "kvindex_score_duration_seconds": ("histogram", (), "Time of Indexer.score() (keys, match, picker)."),
    "kvindex_score_chosen_coverage": (
        "histogram", (), "Prefix coverage (tier-weighted matched / request blocks) of the chosen pod, per score."),
}


class KVIndexMetrics(Collector):
    """The library's metrics for one :class:`~kvindex.facade.indexer.Indexer` (a prometheus_client Collector).

    Register it in any ``CollectorRegistry`` (:meth:`register`); one
    collector may be registered in several registries.  Scraping takes the
    indexer's stats (a snapshot; shard counters are read without stopping
    the workers) and walks the index once for the per-tier gauges (O(keys)
    in the compiled core, O(entries) in the Python reference; a whole scrape
    of a 1 M-key compiled index took 31-37 ms on a loaded 2-core machine).

    Args:
        indexer: the indexer to report.
        namespace: prefix of every family name (``<namespace>_kvindex_...``),
            so that several indexers' collectors fit in one registry (a
            registry refuses two collectors with the same family names, so a
            label alone could not tell them apart); None: the plain names.
            ValueError unless it is a Prometheus name (``[a-zA-Z_:][a-zA-Z0-9_:]*``).
    """

    def __init__(self, indexer: MetricsSource, namespace: str | None = None) -> None:
        if namespace is not None and (not isinstance(namespace, str) or not _NAME.fullmatch(namespace)):
            raise ValueError(f"metrics namespace must match [a-zA-Z_:][a-zA-Z0-9_:]*, got {namespace!r}")
        self._ix = indexer
        self.namespace = namespace
        # unregistered: collect() yields their samples with the rest
        self.score_seconds = Histogram(
            self._name("kvindex_score_duration_seconds"), METRICS["kvindex_score_duration_seconds"][2],
            buckets=SCORE_SECONDS_BUCKETS, registry=None,
        )
        self.chosen_coverage = Histogram(
            self._name("kvindex_score_chosen_coverage"), METRICS["kvindex_score_chosen_coverage"][2],
            buckets=COVERAGE_BUCKETS, registry=None,
        )
        # (seconds, coverage or None) per score, folded into the histograms by _fold; a deque is
        # never replaced, and its append and popleft are atomic, so concurrent scores lose nothing
        self._pending: deque[tuple[float, float | None]] = deque()

    def register(self, registry: CollectorRegistry) -> KVIndexMetrics:
        """Register in ``registry``; ValueError if it already holds these names."""
        registry.register(self)
        return self

    def observe_score(self, seconds: float, coverage: float | None) -> None:
        """Record one :meth:`Indexer.score` call: its duration and the chosen pod's coverage (None: no choice).

        Queued; the histograms see it at the next collect (see the module notes).
        """
        pending = self._pending
        pending.append((seconds, coverage))
        if len(pending) > PENDING_MAX:
            self._fold(8)

    def _fold(self, limit: int | None = None) -> None:
        """Observe queued score values in the histograms (at most ``limit``; None: all)."""
        pending, sec, cov = self._pending, self.score_seconds, self.chosen_coverage
        n = len(pending) if limit is None else limit
        for _ in range(n):
            try:
                seconds, coverage = pending.popleft()
            except IndexError:
                return
            sec.observe(seconds)
            if coverage is not None:
                cov.observe(coverage)

    def _name(self, name: str) -> str:
        return name if self.namespace is None else f"{self.namespace}_{name}"

    def _fam(self, name: str) -> CounterMetricFamily | GaugeMetricFamily:
        """An empty family of :data:`METRICS` ``name`` (namespaced)."""
        kind, labels, doc = METRICS[name]
        cls = CounterMetricFamily if kind == "counter" else GaugeMetricFamily
        return cls(self._name(name), doc, labels=labels)

    def _single(self, name: str, value: float) -> CounterMetricFamily | GaugeMetricFamily:
        f = self._fam(name)
        f.add_metric([], value)
        return f

    def describe(self) -> list[Metric]:
        """Families by name (empty samples), so a registry can detect name clashes at register time."""
        out: list[Metric] = [self._fam(name) for name, (kind, _l, _d) in METRICS.items() if kind != "histogram"]
        out.extend(self.score_seconds.describe())
        out.extend(self.chosen_coverage.describe())
        return out

    def collect(self) -> Iterator[Metric]:
        """Every family, with values read now."""
        st = self._ix.stats()
        yield from self._stream_counters()
        yield from self._stream_health()
        yield from self._write_totals(st)
        yield from self._index_families(st.index)
        yield from self._truth_families()
        self._fold()
        yield from self.score_seconds.collect()
        yield from self.chosen_coverage.collect()

    def _stream_counters(self) -> Iterator[Metric]:
        """Per publisher stream: what it carried."""
        per = {n: self._fam(n) for n in (
            "kvindex_stream_messages", "kvindex_stream_batches", "kvindex_stream_events",
            "kvindex_stream_blocks_stored", "kvindex_stream_blocks_removed", "kvindex_stream_clears")}
        for s in self._ix.pool.stream_counters():
            lv = [s.pod, s.model or "", str(s.dp_rank)]
            per["kvindex_stream_messages"].add_metric(lv, s.messages)
            per["kvindex_stream_batches"].add_metric(lv, s.batches)
            per["kvindex_stream_events"].add_metric(lv, s.events)
            per["kvindex_stream_clears"].add_metric(lv, s.clears)
            for tier, n in sorted(s.blocks_stored.items()):
                per["kvindex_stream_blocks_stored"].add_metric(lv + [tier], n)
            for tier, n in sorted(s.blocks_removed.items()):
                per["kvindex_stream_blocks_removed"].add_metric(lv + [tier], n)
        yield from per.values()

    def _stream_health(self) -> Iterator[Metric]:
        """Per publisher stream: complete or not, misconfigured and why; the totals."""
        complete = self._fam("kvindex_stream_complete")
        misconfigured = self._fam("kvindex_stream_misconfigured")
        incomplete_pods: set[str] = set()
        n_incomplete = n_misconfigured = 0
        for c in self._ix.completeness():
            lv = [c.pod, c.model or "", str(c.dp_rank)]
            complete.add_metric(lv, 1.0 if c.complete else 0.0)
            if not c.complete:
                n_incomplete += 1
                incomplete_pods.add(c.pod)
            for reason in c.misconfigured:
                misconfigured.add_metric(lv + [reason], 1.0)
            n_misconfigured += bool(c.misconfigured)
        yield complete
        yield self._single("kvindex_streams_incomplete", n_incomplete)
        yield self._single("kvindex_pods_incomplete", len(incomplete_pods))
        yield misconfigured
        yield self._single("kvindex_streams_misconfigured", n_misconfigured)

    def _write_totals(self, st: Any) -> Iterator[Metric]:
        """Write-path totals (pool counters) and errors by kind."""
        ev = st.events
        pool = self._ix.pool
        yield self._single("kvindex_event_messages_received", st.received_messages)
        for name, value in (
            ("kvindex_event_messages", ev.messages),
            ("kvindex_event_batches", ev.batches),
            ("kvindex_events", ev.events),
            ("kvindex_blocks_stored", ev.blocks_stored),
            ("kvindex_blocks_removed", ev.blocks_removed),
            ("kvindex_event_clears", ev.clears),
            ("kvindex_event_gaps", ev.gaps),
            ("kvindex_event_gaps_unrecovered", ev.gaps_unrecovered),
            ("kvindex_event_replay_requests", ev.replay_requests),
            ("kvindex_event_replayed_batches", ev.replayed_batches),
            ("kvindex_event_replay_failures", ev.replay_failures),
            ("kvindex_event_replay_holes", ev.replay_holes),
            ("kvindex_event_replay_retries", ev.replay_retries),
            ("kvindex_event_deferred", ev.deferred),
            ("kvindex_event_replay_cuts", ev.replay_cuts),
            ("kvindex_event_duplicates", ev.duplicates),
            ("kvindex_event_stale", ev.stale),
            ("kvindex_event_unconfirmed", ev.unconfirmed),
            ("kvindex_event_restarts", ev.restarts),
            ("kvindex_event_dropped_messages", ev.dropped_messages),
            ("kvindex_event_resyncs", ev.resyncs),
            ("kvindex_event_index_unavailable", getattr(ev, "index_unavailable", 0)),
            ("kvindex_event_rebuilds", getattr(ev, "rebuilds", 0)),
            ("kvindex_event_queue_messages", ev.queued),
            ("kvindex_event_queue_capacity_messages", pool.queue_size * pool.concurrency),
        ):
            yield self._single(name, value)
        errors = self._fam("kvindex_event_errors")
        for kind, n in sorted(ev.errors_by_kind.items()):
            errors.add_metric([kind], n)
        yield errors

    def _index_families(self, idx: Any) -> Iterator[Metric]:
        """The index's sizes and counters, and the per-tier walk when the index offers one."""
        index = self._ix.index
        for name, value in (
            ("kvindex_index_keys", idx.keys),
            ("kvindex_index_entries", idx.entries),
            ("kvindex_index_engine_keys", idx.engine_keys),
            ("kvindex_index_pods", idx.pods),
            ("kvindex_index_capacity_keys", getattr(index, "capacity", None)),
            ("kvindex_index_evictions", idx.evictions),
            ("kvindex_index_orphan_blocks", idx.orphan_blocks),
            ("kvindex_index_orphan_blocks_limit", getattr(index, "max_orphan_blocks", None)),
            ("kvindex_index_orphans", idx.orphans),
            ("kvindex_index_orphans_attached", idx.orphans_attached),
            ("kvindex_index_orphans_dropped", idx.orphans_dropped),
            ("kvindex_index_unknown_removals", idx.unknown_removals),
            ("kvindex_index_speculative_entries", idx.speculative),
            ("kvindex_index_clears", idx.clears),
            ("kvindex_index_redis_errors", idx.redis_errors),
            ("kvindex_index_redis_dropped_writes", idx.dropped_writes),
        ):
            if value is not None:
                yield self._single(name, value)
        if isinstance(index, TierStatsSource):
            tk, te = self._fam("kvindex_index_tier_keys"), self._fam("kvindex_index_tier_entries")
            for tier, (k, e) in sorted(index.tier_stats().items()):
                tk.add_metric([tier], k)
                te.add_metric([tier], e)
            yield tk
            yield te

    def _truth_families(self) -> Iterator[Metric]:
        """Per pod: predicted vs engine-confirmed cached tokens and the prediction's health."""
        fams = {n: self._fam(n) for n in METRICS if n.startswith("kvindex_prediction_")}
        for pod, t in self._ix.prediction_truth().items():
            for name, value in (
                ("kvindex_prediction_requests", t.requests), ("kvindex_prediction_predicted_tokens", t.predicted),
                ("kvindex_prediction_confirmed_tokens", t.confirmed), ("kvindex_prediction_over_tokens", t.over),
                ("kvindex_prediction_under_tokens", t.under), ("kvindex_prediction_healthy", float(t.healthy)),
            ):
                fams[name].add_metric([pod], value)
            if t.window_precision is not None:
                fams["kvindex_prediction_window_precision"].add_metric([pod], t.window_precision)
            if t.window_recall is not None:
                fams["kvindex_prediction_window_recall"].add_metric([pod], t.window_recall)
        yield from fams.values()
