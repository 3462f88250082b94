"""Misconfiguration shows: bad endpoints fail at Config, mismatched engines show unhealthy."""

from __future__ import annotations

import pytest

from kvevents.subscriber import EngineEndpoint
from kvindex.facade import Config
from kvindex.facade.config import KVEventsConfig


def _engines(endpoint: str, **kw: object) -> dict:
    return {"kv_events_config": {"engines": [{"pod": "a", "endpoint": "tcp://h:1"}, {"pod": "b", "endpoint": endpoint, **kw}]}}


@pytest.mark.parametrize(("endpoint", "says"), [
    ("10.0.0.5:5557", "no scheme (e.g. tcp://10.0.0.5:5557)"),
    ("tcp://10.0.0.5", "needs host:port"),
    ("tcp://10.0.0.5:0", "not in 1..65535"),
    ("tcp://10.0.0.5:65536", "not in 1..65535"),
    ("tcp://10.0.0.5:x", "not in 1..65535"),
    ("udp://10.0.0.5:5557", "unknown scheme 'udp'"),
    ("tcp://*:5557", "wildcard host can only be bound"),
    ("tcp://::1:5557", "IPv6 host in brackets"),
])
def test_bad_engine_endpoint_is_refused_naming_the_field(endpoint: str, says: str) -> None:
    with pytest.raises(ValueError, match="kv_events_config.engines\\[1\\].endpoint") as err:
        Config.from_dict(_engines(endpoint))
    assert says in str(err.value)
    # built in Python, not from a mapping: the same error at construction
    with pytest.raises(ValueError, match="kv_events_config.engines\\[0\\].endpoint"):
        KVEventsConfig(engines=[EngineEndpoint(endpoint=endpoint, pod="a")])


def test_other_endpoint_fields_are_checked() -> None:
    with pytest.raises(ValueError, match="kv_events_config.engines\\[1\\].replay_endpoint"):
        Config.from_dict(_engines("tcp://h:2", replay_endpoint="h:3"))
    with pytest.raises(ValueError, match="kv_events_config.zmq_endpoint"):
        Config.from_dict({"kv_events_config": {"zmq_endpoint": "*:5557"}})
    with pytest.raises(ValueError, match="kv_events_config.bind_replay\\['p'\\]"):
        Config.from_dict({"kv_events_config": {"zmq_endpoint": "tcp://*:5557", "bind_replay": {"p": "tcp://*:1"}}})
    with pytest.raises(ValueError, match="dp_size > 1 needs a tcp endpoint"):
        Config.from_dict(_engines("ipc:///tmp/e", dp_size=2))


@pytest.mark.parametrize("endpoint", [
    "tcp://10.0.0.5:5557", "tcp://engine-0.svc:1", "tcp://[::1]:65535", "ipc:///tmp/kv.sock", "inproc://kv",
])
def test_good_endpoints_are_accepted(endpoint: str) -> None:
    assert Config.from_dict(_engines(endpoint)).kv_events_config.engines[1].endpoint == endpoint
    assert Config.from_dict({"kv_events_config": {"zmq_endpoint": "tcp://*:5557"}}).kv_events_config.zmq_endpoint


def test_add_engine_checks_the_endpoint() -> None:
    from kvindex.facade import Indexer

    ix = Indexer(Config())
    with pytest.raises(ValueError, match="engine.endpoint"):
        ix.add_engine(EngineEndpoint(endpoint="10.0.0.5:5557", pod="x"))
    with pytest.raises(TypeError):
        ix.add_engine({"pod": "x", "endpoint": "tcp://h:1"})  # type: ignore[arg-type]


# -- every configured engine is a candidate of route()/score(pods=None)

def _wait(pred, what: str, timeout: float = 60.0) -> None:
    import time

    deadline = time.monotonic() + timeout
    while not pred():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.01)


def _sim(pod: str, **kw: object):
    from examples.simfleet import SimEngine

    return SimEngine(pod=pod, model="m", endpoint="tcp://127.0.0.1:*", replay_endpoint="tcp://127.0.0.1:*",
                     capacity_blocks=64, **kw)


def _engine_cfg(e, **extra: object) -> dict:
    return {"pod": e.pod, "endpoint": e.endpoint, "replay_endpoint": e.replay_endpoint, **extra}


@pytest.mark.parametrize("backend", ["native", "python"])
def test_route_sends_unrelated_prompts_to_the_idle_configured_pod(backend: str) -> None:
    from kvindex.facade import Indexer

    warm, idle = _sim("pod-warm", block_size=4), _sim("pod-idle", block_size=4)
    cfg = Config.from_dict({
        "model_name": "m", "token_processor_config": {"block_size": 4},
        "kv_block_index_config": {"backend": backend},
        "kv_events_config": {"engines": [_engine_cfg(warm), _engine_cfg(idle)]},
    })
    try:
        with Indexer(cfg) as ix:
            warm.serve(list(range(1, 33)))
            _wait(lambda: ix.index.pods() == {"pod-warm"}, "the warm pod's blocks")
            assert ix.loads() == {}  # no load reported by anyone
            chosen = [ix.route([1000 * (i + 1) + t for t in range(16)]).pod for i in range(6)]
            # the idle pod holds nothing and reports nothing, yet it is a candidate and gets work
            assert chosen[0] == "pod-idle"
            assert chosen.count("pod-idle") >= 3 and chosen.count("pod-warm") >= 1
            r = ix.score(list(range(1, 33)))
            assert set(r.prefix) == {"pod-warm", "pod-idle"} and r.prefix["pod-idle"].matched_blocks == 0
            ix.remove_engine("pod-idle")
            _wait(lambda: "pod-idle" not in ix.index.pods(), "the removal")  # its speculative entries go too
            assert set(ix.score(list(range(1, 33))).prefix) == {"pod-warm"}
    finally:
        warm.close()
        idle.close()


# -- engines configured unlike the indexer: unhealthy stream, one log line, a metric

def _scrape(registry) -> dict:
    from prometheus_client import generate_latest
    from prometheus_client.parser import text_string_to_metric_families

    out = {}
    for fam in text_string_to_metric_families(generate_latest(registry).decode()):
        for s in fam.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def _run_misconfigured(caplog, cfg: dict, engine_kw: dict, prompts: int = 4):
    """Start an indexer on one simulated engine, serve ``prompts`` prompts; (indexer stats, state, scrape, log lines)."""
    import logging

    from prometheus_client import CollectorRegistry

    from kvindex.facade import Indexer

    eng = _sim("pod-a", **engine_kw)
    registry = CollectorRegistry()
    caplog.set_level(logging.WARNING, logger="kvevents")
    try:
        cfg = {"model_name": "m", **cfg, "kv_events_config": {"engines": [_engine_cfg(eng)]}}
        with Indexer(Config.from_dict(cfg), metrics_registry=registry) as ix:
            bs = eng.block_size
            for i in range(prompts):
                eng.serve([1 + i * 1000 + t for t in range(3 * bs)])
            _wait(lambda: sum(s.batches for s in ix.pool.stream_counters()) >= prompts, "every batch")
            assert ix.flush()
            stats, states, got = ix.stats(), ix.completeness(), _scrape(registry)
            index_keys = stats.index.keys
    finally:
        eng.close()
    lines = [r.getMessage() for r in caplog.records if "misconfigured" in r.getMessage()]
    return stats, states, got, lines, index_keys


LV = (("dp_rank", "0"), ("model", "m"), ("pod", "pod-a"))


@pytest.mark.parametrize("backend", ["native", "python"])
def test_block_size_mismatch_shows(caplog, backend: str) -> None:
    stats, states, got, lines, keys = _run_misconfigured(
        caplog, {"token_processor_config": {"block_size": 16}, "kv_block_index_config": {"backend": backend}},
        {"block_size": 32},
    )
    [st] = states
    assert st.misconfigured == ("block_size",) and not st.complete
    assert "engine block size 32, config 16: set token_processor_config.block_size: 32" in st.why
    assert stats.misconfigured == (st,) and stats.events.misconfigured_streams == 1
    assert stats.events.errors_by_kind.get("misconfigured", 0) >= 4 and "apply" not in stats.events.errors_by_kind
    assert keys == 0  # nothing could be stored
    assert got[("kvindex_stream_misconfigured", LV + (("reason", "block_size"),))] == 1
    assert got[("kvindex_stream_complete", LV)] == 0
    assert got[("kvindex_streams_misconfigured", ())] == 1
    assert got[("kvindex_event_errors_total", (("kind", "misconfigured"),))] >= 4
    # one line for the stream, however many batches were refused
    assert lines == ["kvevents: misconfigured: pod-a: engine block size 32, config 16: set "
                     "token_processor_config.block_size: 32 (every BlockStored is refused until then)"]


def test_hash_algorithm_mismatch_shows_and_names_the_fix(caplog) -> None:
    stats, states, got, lines, keys = _run_misconfigured(
        caplog, {"token_processor_config": {"block_size": 4, "algorithm": "vllm_sha256_cbor"}},
        {"block_size": 4, "hash_algo": "sha256", "hash_seed": "vllm-none-hash"},
    )
    [st] = states
    assert st.misconfigured == ("hash_algorithm",) and not st.complete
    assert "set token_processor_config algorithm: vllm_sha256, engine_hash_seed: None" in st.why
    assert keys > 0  # stored under the engine's keys, which no prompt of ours produces
    assert got[("kvindex_stream_misconfigured", LV + (("reason", "hash_algorithm"),))] == 1
    assert got[("kvindex_stream_complete", LV)] == 0
    assert len(lines) == 1 and "engine block hashes differ" in lines[0]


def test_matching_engine_hashes_are_healthy(caplog) -> None:
    stats, states, got, lines, keys = _run_misconfigured(
        caplog, {"token_processor_config": {"block_size": 4, "algorithm": "vllm_sha256_cbor"}},
        {"block_size": 4, "hash_algo": "sha256_cbor", "hash_seed": "vllm-none-hash"},
    )
    [st] = states
    assert st.complete and st.misconfigured == () and stats.misconfigured == () and lines == []
    assert got[("kvindex_stream_complete", LV)] == 1 and got[("kvindex_streams_misconfigured", ())] == 0
    assert not any(k[0] == "kvindex_stream_misconfigured" for k in got)


def test_model_name_mismatch_shows(caplog) -> None:
    stats, states, got, lines, keys = _run_misconfigured(
        caplog, {"model_name": "llama", "token_processor_config": {"block_size": 4}}, {"block_size": 4},
    )
    [st] = states
    assert st.misconfigured == ("model_name",) and not st.complete
    assert "engine publishes model 'm' (topic kv@pod-a@m), config model_name 'llama': set model_name: m" in st.why
    assert got[("kvindex_stream_misconfigured", LV + (("reason", "model_name"),))] == 1
    assert len(lines) == 1 and "set model_name: m" in lines[0]


def test_an_engine_entry_naming_its_model_is_not_a_mismatch(caplog) -> None:
    from kvevents.misconfig import ConfigCheck

    check = ConfigCheck(None, model_name="llama")
    assert check.stream("pod-a", "m", 0, configured_model="m").problems == ()
    assert [p.reason for p in check.stream("pod-a", "x", 0, configured_model="m").problems] == ["model_name"]
    assert check.stream("pod-a", "llama", 0).problems == ()


def test_a_fixed_block_size_clears_the_reason() -> None:
    from kvevents.events import BlockStored
    from kvevents.misconfig import ConfigCheck
    from kvindex.keys import TokenProcessor

    chk = ConfigCheck(TokenProcessor(block_size=4)).stream("pod-a", "m", 0)
    assert chk.watching and chk.problems == ()
    chk.events([BlockStored((1,), None, tuple(range(8)), 8, "gpu")])
    assert [p.reason for p in chk.problems] == ["block_size"] and chk.watching
    chk.events([BlockStored((2,), None, (), 8, "gpu")])  # token-less: tells nothing
    assert [p.reason for p in chk.problems] == ["block_size"]
    chk.events([BlockStored((3,), None, tuple(range(4)), 4, "gpu")])  # the engine restarted with 4
    assert chk.problems == () and not chk.watching
    chk.rearm()
    assert chk.watching


@pytest.mark.parametrize("keeps_groups", [False, True])
def test_a_hybrid_engine_on_a_backend_without_groups_shows(keeps_groups: bool) -> None:
    """A sliding-window group's store reaching an index that merges groups names the stream misconfigured."""
    from kvevents.events import BlockStored
    from kvevents.misconfig import ConfigCheck
    from kvindex.keys import TokenProcessor

    chk = ConfigCheck(TokenProcessor(block_size=4), keeps_groups=keeps_groups).stream("pod-a", "m", 0)
    full = BlockStored((1,), None, tuple(range(4)), 4, "gpu", group_idx=1, kv_cache_spec_kind="full_attention")
    chk.events([full])
    assert chk.problems == ()
    swa = BlockStored((), None, tuple(range(4)), 4, "gpu", group_idx=0, kv_cache_spec_kind="sliding_window",
                      kv_cache_spec_sliding_window=8)
    chk.rearm()
    chk.events([swa, full])
    reasons = [p.reason for p in chk.problems]
    assert reasons == ([] if keeps_groups else ["kv_cache_groups"])
    if not keeps_groups:
        assert "backend: native, python or redis" in chk.problems[0].message


def test_the_facade_knows_which_backends_keep_groups(redis_url: str) -> None:
    """Every backend keeps groups: a hybrid engine's stream is not misconfigured on any of them."""
    from kvindex import Config, Indexer

    for backend in ("python", "native", "redis"):
        ix = Indexer(Config.from_dict({"kv_block_index_config": {"backend": backend,
                                                                  "redis_config": {"url": redis_url}}}))
        assert ix.pool.config_check.keeps_groups is True


# -- several indexers, one registry

def test_two_indexers_share_a_registry_with_their_own_namespaces() -> None:
    from prometheus_client import CollectorRegistry

    from kvindex.facade import Indexer

    registry = CollectorRegistry()
    a = Indexer(Config(), metrics_registry=registry, metrics_namespace="a")
    b = Indexer(Config(), metrics_registry=registry, metrics_namespace="b")
    a.score(list(range(64)))
    a.score(list(range(64)))
    b.score(list(range(64)))
    got = _scrape(registry)
    assert got[("a_kvindex_score_duration_seconds_count", ())] == 2
    assert got[("b_kvindex_score_duration_seconds_count", ())] == 1
    assert got[("a_kvindex_streams_misconfigured", ())] == 0 and ("b_kvindex_index_keys", ()) in got
    # the same names twice are refused at once, naming the clash
    with pytest.raises(ValueError, match="Duplicated timeseries"):
        Indexer(Config(), metrics_registry=registry, metrics_namespace="a")
    with pytest.raises(ValueError, match="metrics namespace"):
        Indexer(Config(), metrics_namespace="bad-name")
    with pytest.raises(TypeError):
        Indexer(Config(), metrics_registry={})  # type: ignore[arg-type]


# -- exit without stop()

EXIT_WITHOUT_STOP = """
from kvindex import Config, Indexer
ix = Indexer(Config.from_dict({
    "token_processor_config": {"block_size": 4},
    "kv_block_index_config": {"backend": "native"},
    "kv_events_config": {"engines": [{"pod": "a", "endpoint": "tcp://127.0.0.1:%d"}], "connect_timeout": 0},
}))
ix.start()
ix.index.block_stored("a", 0, [1, 2], None, list(range(8)), "gpu", block_size=4)
assert ix.score(list(range(8))).pod == "a"
print("scored")
"""


def test_exit_without_stop_leaks_nothing() -> None:
    import socket
    import subprocess
    import sys
    from pathlib import Path

    pytest.importorskip("kvindex._native")
    with socket.socket() as s:  # a port nobody listens on: the subscription stays down
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = subprocess.run([sys.executable, "-c", EXIT_WITHOUT_STOP % port], capture_output=True, text=True,
                         timeout=120, cwd=Path(__file__).resolve().parents[1])
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "scored"
    assert "leaked" not in out.stderr, out.stderr


# -- start() does not wait for an engine it cannot reach

def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_start_returns_without_an_unreachable_engine_and_covers_the_reachable_ones(caplog) -> None:
    import logging
    import threading

    from examples.simfleet import SimEngine
    from kvindex.facade import Indexer

    up = _sim("pod-up", block_size=4)
    up.serve(list(range(1, 17)))  # buffered before the indexer exists
    late_pub, late_replay = _free_port(), _free_port()
    cfg = Config.from_dict({
        "model_name": "m", "token_processor_config": {"block_size": 4},
        "kv_events_config": {"connect_timeout": 3000, "engines": [
            _engine_cfg(up),
            {"pod": "pod-late", "endpoint": f"tcp://127.0.0.1:{late_pub}",
             "replay_endpoint": f"tcp://127.0.0.1:{late_replay}"},
        ]},
    })
    ix = Indexer(cfg)
    caplog.set_level(logging.WARNING, logger="indexer")
    started = threading.Event()
    threading.Thread(target=lambda: (ix.start(), started.set()), daemon=True).start()
    late = None
    try:
        # refused at once: start() is back long before the 3000 s a connection attempt may take
        assert started.wait(120), "start() waited for an engine that refuses connections"
        assert ix.subscriber.connected() == {("pod-up", 0): True, ("pod-late", 0): False}
        assert any("not reachable yet" in r.getMessage() and "pod-late" in r.getMessage() for r in caplog.records)
        assert ix.flush()  # start(); flush() covers the reachable engine's buffer
        assert ix.index.pods() == {"pod-up"} and ix.score(list(range(1, 17))).prefix["pod-up"].matched_blocks == 4
        late = SimEngine(pod="pod-late", model="m", endpoint=f"tcp://127.0.0.1:{late_pub}", pub_bind=True,
                         replay_endpoint=f"tcp://127.0.0.1:{late_replay}", capacity_blocks=64, block_size=4)
        late.serve(list(range(101, 117)))
        assert ix.wait_connected(120)  # the explicit wait; then flush covers the late engine's buffer too
        assert ix.flush() and ix.score(list(range(101, 117))).prefix["pod-late"].matched_blocks == 4
    finally:
        ix.stop()
        up.close()
        if late is not None:
            late.close()


# -- Redis unavailability: logged once per outage with the URL, counted in a metric

def _redis_lines(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "kvindex.redis"]


def test_redis_outage_is_logged_once_and_counted_for_the_index_and_the_retained_store(caplog) -> None:
    import logging

    from prometheus_client import CollectorRegistry

    from connector.redis_retained import RedisRetainedStore
    from kvindex.contract import IndexUnavailable
    from kvindex.facade import Indexer
    from kvindex.redis_index import RedisKVBlockIndex
    from tests.redis_server import RedisServer

    caplog.set_level(logging.WARNING, logger="kvindex.redis")
    with RedisServer() as server:
        url = server.url
        cfg = Config.from_dict({"token_processor_config": {"block_size": 4}, "kv_block_index_config": {
            "backend": "redis", "redis_config": {"url": url, "retry_interval": 0.05, "socket_timeout": 0.5}}})
        registry = CollectorRegistry()
        ix = Indexer(cfg, metrics_registry=registry)
        store = RedisRetainedStore(url=url, retry_interval=0.05, socket_timeout=0.5)
        registry.register(store.metrics())
        index = ix.index
        assert isinstance(index, RedisKVBlockIndex)
        index.block_stored("a", 0, [1], None, [1, 2, 3, 4], "gpu", block_size=4)
        assert store.get("c") is None and _redis_lines(caplog) == []

        server.stop()
        for _ in range(3):  # an outage: many failed calls, some after the fail-fast interval
            assert ix.score([1, 2, 3, 4]).prefix == {}  # reads answer without prefix information
            with pytest.raises(IndexUnavailable):
                index.block_stored("a", 0, [2], 1, [5, 6, 7, 8], "gpu", block_size=4)
            assert store.get("c") is None and store.take("c") is None
            _wait(lambda: not index.link.down() and not store.link.down(), "the fail-fast interval")
        lines = _redis_lines(caplog)
        assert len(lines) == 2  # exactly one line per store, however many calls failed
        assert lines[0].startswith(f"kvindex index: Redis at {url} unreachable (ConnectionError: ")
        assert lines[1].startswith(f"retained store: Redis at {url} unreachable (ConnectionError: ")
        got = _scrape(registry)  # (a scrape asks the index for its sizes: one more failed call)
        assert 6 <= got[("kvindex_index_redis_errors_total", ())] <= index.link.error_count
        assert got[("kvindex_index_redis_dropped_writes_total", ())] == 3
        assert got[("kvindex_retained_redis_errors_total", ())] == store.link.error_count >= 6
        st = store.stats()  # the same count in the store's stats
        assert st.redis_errors == store.link.error_count

        server.start()
        _wait(index.writable, "the server back")
        _wait(lambda: store.get("c") is None and not store.link._in_outage, "the store's next answer")
        back = _redis_lines(caplog)[2:]
        assert sorted(b.split(":")[0] for b in back) == ["kvindex index", "retained store"]
        assert all(f"Redis at {url} reachable again" in b for b in back)
        # a flapping server: a second outage within log_interval (60 s) is counted, not logged again
        server.stop()
        ix.score([1, 2, 3, 4])
        store.get("c")
        assert index.link.outages == store.link.outages == 2
        assert len([x for x in _redis_lines(caplog) if "unreachable" in x]) == 2


@pytest.mark.parametrize("backend", ["native", "python"])
def test_a_pod_back_with_the_right_model_is_healthy_again(caplog, backend: str) -> None:
    """An engine started with the wrong model, then restarted on the same ports with the right one:
    the wrong model's stream (its flag and its blocks) is retired, the new one is complete."""
    from examples.simfleet import SimEngine
    from examples.vllm_fleet.fleet import free_port
    from kvindex.facade import Indexer

    ends = {"endpoint": f"tcp://127.0.0.1:{free_port()}", "replay_endpoint": f"tcp://127.0.0.1:{free_port()}"}
    cfg = Config.from_dict({
        "model_name": "m", "token_processor_config": {"block_size": 4}, "kv_block_index_config": {"backend": backend},
        "kv_events_config": {"engines": [{"pod": "pod-a", **ends}]},
    })
    prompt = list(range(1, 17))
    wrong = SimEngine(pod="pod-a", model="other", block_size=4, capacity_blocks=64, pub_bind=True, **ends)
    with Indexer(cfg) as ix:
        try:
            _wait(lambda: (wrong.serve(prompt), ix.stats().misconfigured)[1], "the wrong model flagged")
            assert ix.stats().misconfigured[0].misconfigured == ("model_name",)
        finally:
            wrong.close()
        right = None
        for _ in range(50):  # the old sockets' ports may take a moment to be free again
            try:
                right = SimEngine(pod="pod-a", model="m", block_size=4, capacity_blocks=64, pub_bind=True, **ends)
                break
            except Exception:  # noqa: BLE001 - zmq's "address in use"
                import time

                time.sleep(0.1)
        assert right is not None
        served: list[list[int]] = []

        def serve_next() -> bool:  # a new prompt each time: the engine publishes a batch each time
            served.append([len(served) * 100 + t for t in range(1, 9)])
            right.serve(served[-1])
            return ix.score(served[-1]).prefix["pod-a"].matched_blocks == 2

        try:
            _wait(serve_next, "the right model's blocks")
            _wait(lambda: not ix.stats().misconfigured, "the wrong model's stream retired")
            assert ix.flush()
            states = ix.completeness()
            assert [(s.pod, s.model) for s in states] == [("pod-a", "m")] and states[0].complete
            # the index holds what the new engine holds (its first batches replayed: the live stream was
            # joined late), under the right model, and the wrong model's blocks are gone
            held = right.cached_blocks()
            want = [next((i for i, h in enumerate(right.hashes(p)) if h not in held), 2) for p in served]
            got = [ix.score(p).prefix["pod-a"].matched_blocks for p in served]
            assert got == want and sum(want) > 0
            assert ix.index.stats().keys == len(held)
        finally:
            right.close()


def test_a_vllm_store_shorter_than_our_block_tells_the_block_size_and_an_sglang_page_does_not() -> None:
    """vLLM's block_size is its engine's in every event (a decode step's one 16-token block shows a
    16-token engine to a 32-token index); SGLang's is the page's length (a node's short last page)."""
    from kvevents.events import BlockStored
    from kvevents.misconfig import ConfigCheck
    from kvindex.keys import TokenProcessor

    one_block = [BlockStored((1,), None, tuple(range(16)), 16, "gpu")]
    vllm = ConfigCheck(TokenProcessor(block_size=32)).stream("pod-a", "m", 0)
    vllm.events(one_block)
    assert [p.reason for p in vllm.problems] == ["block_size"]
    sglang = ConfigCheck(TokenProcessor(block_size=32)).stream("pod-a", "m", 0, engine="sglang")
    sglang.events(one_block)
    assert sglang.problems == () and sglang.watching
