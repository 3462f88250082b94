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
