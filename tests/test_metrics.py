"""Library metrics: the Prometheus text exposition after real ZMQ traffic equals Indexer.stats().

Two simulated vLLM engines publish over real ZMQ (one loses messages, so the
indexer replays them; one offloads blocks to CPU; one restarts), a third
endpoint is a bare PUB socket sending garbage; then the registry the router
would serve is rendered with prometheus_client's exposition, parsed back with
prometheus_client.parser, and every value is checked against the library's
own counters (stats(), stream counters, completeness, the index's tier walk).
"""

from __future__ import annotations

import re
import time
from pathlib import Path

import pytest
import zmq
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from examples.simfleet import SimEngine
from kvindex.facade import Config, Indexer
from kvindex.facade.metrics import METRICS, KVIndexMetrics

BS = 16
ROOT = Path(__file__).resolve().parents[1]


def scrape(registry: CollectorRegistry) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """(sample name, sorted labels) -> value of the registry's text exposition."""
    text = generate_latest(registry).decode()
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def wait_until(pred, what: str, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.01)


def prompt(i: int, blocks: int) -> list[int]:
    return [(i * 7919 + j * 13) % 30_000 + 1 for j in range(blocks * BS)]


@pytest.mark.parametrize("backend", ["native", "python"])
def test_exposition_equals_stats_after_real_traffic(backend: str) -> None:
    ctx = zmq.Context.instance()
    a = SimEngine(pod="pod-a", model="m", endpoint="tcp://127.0.0.1:*", replay_endpoint="tcp://127.0.0.1:*",
                  capacity_blocks=40, block_size=BS)
    b = SimEngine(pod="pod-b", model="m", endpoint="tcp://127.0.0.1:*", replay_endpoint="tcp://127.0.0.1:*",
                  capacity_blocks=40, block_size=BS, dp_rank=1)
    junk = ctx.socket(zmq.PUB)
    junk.setsockopt(zmq.LINGER, 0)
    port = junk.bind_to_random_port("tcp://127.0.0.1")
    cfg = Config.from_dict({
        "model_name": "m",
        "token_processor_config": {"block_size": BS},
        "kv_block_index_config": {"backend": backend, "in_memory_config": {"size": 5000, "max_orphan_blocks": 77}},
        "kv_events_config": {"concurrency": 2, "engines": [
            {"pod": "pod-a", "endpoint": a.endpoint, "replay_endpoint": a.replay_endpoint},
            {"pod": "pod-b", "endpoint": b.endpoint, "replay_endpoint": b.replay_endpoint, "dp_rank": 1},
            {"pod": "pod-x", "endpoint": f"tcp://127.0.0.1:{port}"},
        ]},
    })
    registry = CollectorRegistry()
    ix = Indexer(cfg)
    ix.register_metrics(registry)
    try:
        ix.start()
        # slow joiner: publish until both subscriptions deliver
        wait_until(lambda: (a.reset_prefix_cache(), b.reset_prefix_cache(), junk.send_multipart([b"x", b"y", b"z"]),
                            ix.stats().received_messages >= 3)[-1], "subscriptions", 20)
        ix.flush()
        for i in range(12):
            a.serve(prompt(i, 2 + i % 3))
            b.serve(prompt(i + 100, 3))
        a.offload(4)
        a.drop_next(2)  # lost on the wire: the next message reveals the gap, a replay fills it
        for i in range(12, 16):
            a.serve(prompt(i, 2))
        for frames in ([b"kv@pod-x@m", b"\x00" * 8, b"\xc1garbage"], [b"only-one"], [b"a", b"b", b"c", b"d"]):
            junk.send_multipart(frames)
        b.restart()
        b.serve(prompt(999, 2))
        wait_until(lambda: ix.stats().events.decode_errors >= 3 and ix.stats().events.gaps >= 1, "errors and the gap")
        wait_until(lambda: ix.index.pods() >= {"pod-a", "pod-b"} and ix.stats().events.restarts >= 1, "the restart")
        assert ix.flush()
        for i in range(5):
            ix.score(prompt(i, 3), pods=["pod-a", "pod-b"])
        ix.score([1, 2, 3], pods=["pod-a"])  # shorter than a block: timed, no coverage

        got = scrape(registry)
        st = ix.stats()
        ev, idx = st.events, st.index

        def val(name: str, **labels: str) -> float:
            return got[(name, tuple(sorted(labels.items())))]

        assert ev.gaps >= 1 and ev.replay_requests >= 1 and ev.decode_errors >= 3
        for name, want in [
            ("kvindex_event_messages_received_total", st.received_messages),
            ("kvindex_event_messages_total", ev.messages),
            ("kvindex_event_batches_total", ev.batches),
            ("kvindex_events_total", ev.events),
            ("kvindex_blocks_stored_total", ev.blocks_stored),
            ("kvindex_blocks_removed_total", ev.blocks_removed),
            ("kvindex_event_clears_total", ev.clears),
            ("kvindex_event_gaps_total", ev.gaps),
            ("kvindex_event_gaps_unrecovered_total", ev.gaps_unrecovered),
            ("kvindex_event_replay_requests_total", ev.replay_requests),
            ("kvindex_event_replayed_batches_total", ev.replayed_batches),
            ("kvindex_event_replay_failures_total", ev.replay_failures),
            ("kvindex_event_replay_holes_total", ev.replay_holes),
            ("kvindex_event_replay_retries_total", ev.replay_retries),
            ("kvindex_event_deferred_total", ev.deferred),
            ("kvindex_event_replay_cuts_total", ev.replay_cuts),
            ("kvindex_event_duplicates_total", ev.duplicates),
            ("kvindex_event_stale_total", ev.stale),
            ("kvindex_event_unconfirmed_total", ev.unconfirmed),
            ("kvindex_event_restarts_total", ev.restarts),
            ("kvindex_event_dropped_messages_total", ev.dropped_messages),
            ("kvindex_event_resyncs_total", ev.resyncs),
            ("kvindex_event_index_unavailable_total", ev.index_unavailable),
            ("kvindex_event_rebuilds_total", ev.rebuilds),
            ("kvindex_event_queue_messages", ev.queued),
            ("kvindex_event_queue_capacity_messages", 2 * cfg.kv_events_config.queue_size),
            ("kvindex_streams_incomplete", ev.incomplete_streams),
            ("kvindex_index_keys", idx.keys),
            ("kvindex_index_entries", idx.entries),
            ("kvindex_index_engine_keys", idx.engine_keys),
            ("kvindex_index_pods", idx.pods),
            ("kvindex_index_capacity_keys", 5000),
            ("kvindex_index_evictions_total", idx.evictions),
            ("kvindex_index_orphan_blocks", idx.orphan_blocks),
            ("kvindex_index_orphan_blocks_limit", 77),
            ("kvindex_index_orphans_total", idx.orphans),
            ("kvindex_index_orphans_attached_total", idx.orphans_attached),
            ("kvindex_index_orphans_dropped_total", idx.orphans_dropped),
            ("kvindex_index_unknown_removals_total", idx.unknown_removals),
            ("kvindex_index_speculative_entries", idx.speculative),
            ("kvindex_index_clears_total", idx.clears),
        ]:
            assert val(name) == want, name
        # errors by kind, summing to decode_errors
        kinds = {dict(k[1])["kind"]: v for k, v in got.items() if k[0] == "kvindex_event_errors_total"}
        assert kinds == ev.errors_by_kind and sum(kinds.values()) == ev.decode_errors
        assert kinds.get("frames") == 2  # one frame and four frames, through the real SUB socket

        # per stream: what each engine published, through the pool's stream counters
        streams = {(s.pod, s.model, s.dp_rank): s for s in ix.pool.stream_counters()}
        assert set(streams) == {("pod-a", "m", 0), ("pod-b", "m", 1)}
        for (pod, model, rank), s in streams.items():
            lab = {"pod": pod, "model": model, "dp_rank": str(rank)}
            assert val("kvindex_stream_messages_total", **lab) == s.messages
            assert val("kvindex_stream_batches_total", **lab) == s.batches
            assert val("kvindex_stream_events_total", **lab) == s.events
            assert val("kvindex_stream_clears_total", **lab) == s.clears
            for tier, n in s.blocks_stored.items():
                assert val("kvindex_stream_blocks_stored_total", tier=tier, **lab) == n
            for tier, n in s.blocks_removed.items():
                assert val("kvindex_stream_blocks_removed_total", tier=tier, **lab) == n
        assert sum(s.batches for s in streams.values()) == ev.batches
        assert sum(sum(s.blocks_stored.values()) for s in streams.values()) == ev.blocks_stored
        assert sum(sum(s.blocks_removed.values()) for s in streams.values()) == ev.blocks_removed
        sa, ea = streams[("pod-a", "m", 0)], a.stats()  # pod-a never restarted: its engine counts it all
        assert sa.blocks_stored == {"gpu": ea.blocks_stored, "cpu": ea.blocks_offloaded} and ea.blocks_offloaded == 4
        assert sa.blocks_removed.get("gpu", 0) == ea.blocks_removed > 0
        assert sa.batches == ea.batches_published
        for c in ix.completeness():
            assert val("kvindex_stream_complete", pod=c.pod, model=c.model or "", dp_rank=str(c.dp_rank)) == float(
                c.complete)

        # per tier: the index's walk, and an independent count from the engines' caches
        tiers = ix.index.tier_stats()
        for tier, (k, e) in tiers.items():
            assert val("kvindex_index_tier_keys", tier=tier) == k
            assert val("kvindex_index_tier_entries", tier=tier) == e
        want_entries = {"gpu": 0, "cpu": 0}
        for eng in (a, b):
            for _h, ts in eng.cached_blocks().items():
                for t in ts:
                    want_entries[t] += 1
        assert {t: e for t, (_k, e) in tiers.items()} == {t: n for t, n in want_entries.items() if n}

        # read path histograms
        assert val("kvindex_score_duration_seconds_count") == 6
        assert val("kvindex_score_chosen_coverage_count") == 5
        assert val("kvindex_score_duration_seconds_sum") > 0
        assert val("kvindex_score_chosen_coverage_bucket", le="+Inf") == 5
    finally:
        ix.stop()
        junk.close(linger=0)
        a.close()
        b.close()


def test_every_metric_is_documented_and_registered_once() -> None:
    """METRICS lists every family the collector yields; docs/operations.md's table lists every one of them."""
    ix = Indexer(Config())
    reg = CollectorRegistry()
    ix.register_metrics(reg)
    with pytest.raises(ValueError):  # a second collector with the same names is refused
        KVIndexMetrics(ix).register(reg)
    ix.score(list(range(40)))
    names = {f.name for f in reg.collect()}
    assert names - {"kvindex_index_tier_keys", "kvindex_index_tier_entries"} <= set(METRICS)
    assert set(METRICS) <= names | {"kvindex_index_tier_keys", "kvindex_index_tier_entries"}
    for name, (kind, _labels, _doc) in METRICS.items():
        if kind == "counter":
            assert not name.endswith("_total"), name  # the family adds _total
    ops = (ROOT / "docs" / "operations.md").read_text()
    section = ops[ops.index("## Metrics"):]
    section = section[: section.index("\n## ", 4)]
    documented = set(re.findall(r"^\| `(kvindex_[a-z_]+)`", section, re.M))
    exposed = {n + "_total" if k == "counter" else n for n, (k, _l, _d) in METRICS.items()}
    assert exposed <= documented, sorted(exposed - documented)


def test_router_registry_serves_the_library_metrics_and_engine_reported_hits() -> None:
    """The reference router's registry: the embedded indexer's families, and the engines' prefix-cache
    hit counters turned into increases (first refresh = baseline; a counter going down = engine restart)."""
    from examples.router.app import EngineSpec, Router, RouterConfig

    router = Router(RouterConfig(engines=[EngineSpec(pod="p0", url="http://127.0.0.1:9", endpoint="tcp://127.0.0.1:9")]))
    assert not any(k[0].startswith("kvindex_index_") for k in scrape(router.registry))  # no indexer yet
    router.indexer = Indexer(Config())
    router.indexer.score(list(range(64)))
    for hits, queries in [(1000, 5000), (1600, 6000), (1600, 6000), (200, 300), (None, None), (500, 900)]:
        router._count_engine_hits("p0", hits, queries)
    got = scrape(router.registry)
    # baseline 1000; +600; +0; restart: +200; absent: nothing; +300
    assert got[("kvindex_router_engine_cached_tokens_total", (("pod", "p0"),))] == 600 + 200 + 300
    assert got[("kvindex_router_engine_queried_tokens_total", (("pod", "p0"),))] == 1000 + 300 + 600
    assert got[("kvindex_score_duration_seconds_count", ())] == 1
    assert ("kvindex_index_keys", ()) in got and ("kvindex_event_errors_total", ()) not in got


def test_score_observations_are_queued_bounded_and_all_counted():
    """Scores queue their two values; a scrape folds them all; without scrapes the queue stays
    near PENDING_MAX (each score past it folds a few) and nothing is lost."""
    from kvindex.facade.metrics import PENDING_MAX

    ix = Indexer(Config())
    m = ix.metrics
    n = PENDING_MAX + 500
    for i in range(n):
        m.observe_score(1e-4 * (i % 7), None if i % 3 == 0 else (i % 11) / 10)
    assert len(m._pending) <= PENDING_MAX + 1
    registry = CollectorRegistry()
    ix.register_metrics(registry)
    got = scrape(registry)
    assert not m._pending

    def val(name: str, **labels: str) -> float:
        return got[(name, tuple(sorted(labels.items())))]

    assert val("kvindex_score_duration_seconds_count") == n
    assert val("kvindex_score_chosen_coverage_count") == sum(1 for i in range(n) if i % 3)
    assert val("kvindex_score_chosen_coverage_bucket", le="0.0") == sum(1 for i in range(n) if i % 3 and i % 11 == 0)
    assert abs(val("kvindex_score_duration_seconds_sum") - sum(1e-4 * (i % 7) for i in range(n))) < 1e-9
