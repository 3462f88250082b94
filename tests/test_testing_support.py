"""kvevents.testing.FakeEngine with a real Indexer: flush's guarantee, topic-less streams, the fake's wire.

The oracle is the fake engine's own cache (``FakeEngine.cached_blocks``): after
``Indexer.flush()`` returns True the index must predict exactly the prefix the
engine holds for every prompt it served.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import msgspec
import pytest
import zmq
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvevents.tails import ask_tails
from kvevents.testing import END_SEQ, FakeEngine
from kvindex import Config, Indexer

BS = 16
WAIT_MS = 5000


def indexer(*engines: FakeEngine, model: str | None = "m", **kv: Any) -> Indexer:
    cfg: dict[str, Any] = {"kv_events_config": {"engines": [e.engine_entry() for e in engines], **kv}}
    if model is not None:
        cfg["model_name"] = model
    return Indexer(Config.from_dict(cfg))


def matched(ix: Indexer, pod: str, tokens: list[int], model: str | None = None) -> int:
    return ix.score(tokens, pods=[pod], model=model).prefix[pod].matched_blocks


def engine_prefix(e: FakeEngine, tokens: list[int]) -> int:
    """Blocks of ``tokens``' longest prefix the engine caches in any tier."""
    held = e.cached_blocks()
    n = 0
    for h in e.hashes(tokens):
        if h not in held:
            break
        n += 1
    return n


def prompt(i: int, blocks: int = 4) -> list[int]:
    return [i * 100_000 + t for t in range(blocks * BS)]


@pytest.fixture
def ctx() -> Iterator[zmq.Context]:
    context = zmq.Context()
    yield context
    context.destroy(linger=0)


# --------------------------------------------------------------- flush


def test_flush_returns_only_once_a_burst_published_before_it_is_applied() -> None:
    # the pool's flush alone drained only what the subscriber had queued: 36 and 41 of 60 rounds right
    with FakeEngine(pod="pod-a", model="m") as engine, indexer(engine) as ix:
        assert ix.flush()
        for r in range(60):
            burst = [prompt(r * 10 + p) for p in range(5)]
            for p in burst:
                engine.serve(p)
            assert ix.flush()
            assert [matched(ix, "pod-a", p) for p in burst] == [4] * 5, f"round {r}"


def test_flush_finds_a_last_message_lost_on_the_way() -> None:
    with FakeEngine(pod="pod-a", model="m") as engine, indexer(engine) as ix:
        engine.serve(prompt(1))
        assert ix.flush()
        engine.drop_next(1)  # published (buffered for replay) but never sent: nothing reveals the gap
        engine.serve(prompt(2))
        report = ix.flush_report(30)
        assert report.ok and report.caught_up == ["pod-a/0"]
        assert matched(ix, "pod-a", prompt(2)) == 4


def test_flush_after_a_restart_waits_for_the_new_process() -> None:
    with FakeEngine(pod="pod-a", model="m") as engine, indexer(engine) as ix:
        for i in range(8):
            engine.serve(prompt(i))
        assert ix.flush()
        assert matched(ix, "pod-a", prompt(0)) == 4
        engine.restart()
        engine.serve(prompt(100))  # seq 0 of the new process, below the 7 applied
        assert ix.flush(30)
        assert matched(ix, "pod-a", prompt(100)) == 4
        assert [matched(ix, "pod-a", prompt(i)) for i in range(8)] == [0] * 8


def test_flush_reports_engines_it_cannot_verify(ctx: zmq.Context) -> None:
    silent = ctx.socket(zmq.PUB)  # a publisher with a replay endpoint where nothing answers
    port = silent.bind_to_random_port("tcp://127.0.0.1")
    nobody = ctx.socket(zmq.PUB)
    dead_port = nobody.bind_to_random_port("tcp://127.0.0.1")
    nobody.close(linger=0)
    with FakeEngine(pod="pod-a", model="m", replay_endpoint=None) as plain:
        cfg = Config.from_dict({"model_name": "m", "kv_events_config": {"replay_timeout": 0.3, "engines": [
            plain.engine_entry(),
            {"pod": "pod-x", "endpoint": f"tcp://127.0.0.1:{port}", "replay_endpoint": f"tcp://127.0.0.1:{dead_port}"},
        ]}})
        with Indexer(cfg) as ix:
            report = ix.flush_report(5)
            assert not report.ok and not ix.flush(5)
            assert report.unreachable == ["pod-x/0"] and report.unverified == ["pod-a/0"]
            ix.remove_engine("pod-x")
            assert ix.flush(5)


def test_flush_before_start_is_a_caller_error() -> None:
    with FakeEngine(pod="pod-a", model="m") as engine:
        with pytest.raises(RuntimeError):
            indexer(engine).flush(1)


@settings(max_examples=20, deadline=None, suppress_health_check=list(HealthCheck))
@given(ops=st.lists(
    st.one_of(
        st.tuples(st.just("serve"), st.integers(0, 11)),
        st.tuples(st.just("drop"), st.integers(1, 2)),
        st.tuples(st.just("offload"), st.integers(1, 4)),
        st.tuples(st.just("reset"), st.just(0)),
        st.tuples(st.just("restart"), st.integers(0, 11)),
    ),
    min_size=1, max_size=12,
))
def test_after_flush_the_index_predicts_the_engine_exactly(ops: list[tuple[str, int]]) -> None:
    with FakeEngine(pod="pod-a", model="m", capacity_blocks=12) as engine, indexer(engine) as ix:
        served: set[int] = set()
        for op, arg in ops:
            if op == "serve":
                engine.serve(prompt(arg % 6, 1 + arg % 4))
                served.add(arg)
            elif op == "drop":
                engine.drop_next(arg)
            elif op == "offload":
                engine.offload(arg)
            elif op == "reset":
                engine.reset_prefix_cache()
            else:
                engine.restart()
                engine.serve(prompt(arg % 6, 1 + arg % 4))  # a restart is published by what follows
                served.add(arg)
        assert ix.flush(30)
        for i in served:
            p = prompt(i % 6, 1 + i % 4)
            assert matched(ix, "pod-a", p) == engine_prefix(engine, p), (i, ops)


# ------------------------------------------------- topics without a model


def test_a_replay_without_topic_frames_is_filed_under_the_configured_model() -> None:
    # an old engine replies [b"", seq, payload]: the stream's model comes from the configuration
    with FakeEngine(pod="pod-a", model="m", replay_with_topic=False) as engine:
        engine.serve(prompt(1))  # before the router starts: it arrives only by the replay
        with indexer(engine) as ix:
            assert ix.flush()
            assert matched(ix, "pod-a", prompt(1)) == 4
            engine.serve(prompt(2))  # live, with the topic kv@pod-a@m: the same stream
            assert ix.flush()
            assert matched(ix, "pod-a", prompt(2)) == 4
            assert [(s.model, s.complete) for s in ix.completeness("pod-a")] == [("m", True)]


@pytest.mark.parametrize("with_topic", [True, False])
def test_a_topic_naming_no_model_files_under_the_engine_entry_model(with_topic: bool) -> None:
    # vLLM's default topic is "": neither live messages nor replays name a model
    with FakeEngine(pod="pod-a", model="ignored", topic="", replay_with_topic=with_topic) as engine:
        engine.serve(prompt(1))
        entry = {**engine.engine_entry(), "model": "m2"}
        cfg = Config.from_dict({"model_name": "m", "kv_events_config": {"engines": [entry]}})
        with Indexer(cfg) as ix:
            assert ix.flush()
            engine.serve(prompt(2))
            assert ix.flush()
            assert [matched(ix, "pod-a", prompt(i), model="m2") for i in (1, 2)] == [4, 4]
            assert {s.model for s in ix.completeness("pod-a")} == {"m2"}


def test_a_topic_naming_no_model_falls_back_to_model_name() -> None:
    with FakeEngine(pod="pod-a", topic="kv@pod-a@", replay_with_topic=False) as engine:
        engine.serve(prompt(1))
        with indexer(engine, model="m") as ix:
            assert ix.flush()
            engine.serve(prompt(2))
            assert ix.flush()
            assert [matched(ix, "pod-a", prompt(i)) for i in (1, 2)] == [4, 4]


def test_bind_mode_files_a_topic_without_model_under_model_name(ctx: zmq.Context) -> None:
    probe = ctx.socket(zmq.PUB)
    port = probe.bind_to_random_port("tcp://127.0.0.1")
    probe.close(linger=0)
    bind = f"tcp://127.0.0.1:{port}"
    with FakeEngine(pod="pod-b", topic="kv@pod-b@", endpoint=bind, pub_bind=False) as engine:
        assert engine.replay_endpoint is not None
        cfg = Config.from_dict({"model_name": "m", "kv_events_config": {
            "zmq_endpoint": bind, "bind_replay": {"pod-b": engine.replay_endpoint}}})
        with Indexer(cfg) as ix:
            for i in range(3):
                engine.serve(prompt(i))  # the first may go out before the engine's connection is up
            report = ix.flush_report(30)
            assert report.ok and report.caught_up == ["pod-b/0"]
            assert [matched(ix, "pod-b", prompt(i)) for i in range(3)] == [4, 4, 4]
            assert {s.model for s in ix.completeness("pod-b")} == {"m"}


# ---------------------------------------------------- the fake on the wire


def test_defaults_bind_loopback_with_replay(ctx: zmq.Context) -> None:
    with FakeEngine(pod="pod-a", model="m") as engine:
        assert engine.endpoint.startswith("tcp://127.0.0.1:") and not engine.endpoint.endswith("*")
        assert engine.replay_endpoint is not None and engine.replay_endpoint != engine.endpoint
        assert engine.engine_entry() == {
            "pod": "pod-a", "endpoint": engine.endpoint, "replay_endpoint": engine.replay_endpoint}
        engine.serve(prompt(1))
        engine.serve(prompt(2))
        dealer = ctx.socket(zmq.DEALER)
        dealer.connect(engine.replay_endpoint)
        dealer.send_multipart([b"", (0).to_bytes(8, "big")])
        replies = []
        while True:
            assert dealer.poll(WAIT_MS)
            frames = dealer.recv_multipart()
            replies.append(frames)
            if frames[2] == END_SEQ:
                break
        assert [f[1] for f in replies] == [b"kv@pod-a@m"] * 2 + [b""]
        assert [int.from_bytes(f[2], "big") for f in replies[:2]] == [0, 1]
        ts, events, rank = msgspec.msgpack.decode(replies[0][3])
        assert rank == 0 and events[0]["type"] == "BlockStored" and len(events[0]["block_hashes"]) == 4


@pytest.mark.parametrize("with_topic", [True, False])
def test_ask_tails_reads_first_and_last_seq(ctx: zmq.Context, with_topic: bool) -> None:
    with FakeEngine(pod="pod-a", model="m", replay_with_topic=with_topic) as engine:
        for i in range(5):
            engine.serve(prompt(i))
        tails = ask_tails(ctx, {"all": (engine.replay_endpoint, 0), "end": (engine.replay_endpoint, 3),
                                "past": (engine.replay_endpoint, 9)}, 5.0)
        assert (tails["all"].first, tails["all"].last) == (0, 4)
        assert (tails["end"].first, tails["end"].last) == (3, 4)
        assert (tails["past"].first, tails["past"].last) == (None, None)
        assert tails["all"].topic == (b"kv@pod-a@m" if with_topic else None)
    with pytest.raises(ValueError):
        ask_tails(ctx, {"x": ("tcp://127.0.0.1:1", 2**64 - 1)}, 0.1)


def test_ask_tails_skips_malformed_replies(ctx: zmq.Context) -> None:
    router = ctx.socket(zmq.ROUTER)
    port = router.bind_to_random_port("tcp://127.0.0.1")
    got: dict[str, Any] = {}

    def answer() -> None:
        assert router.poll(WAIT_MS)
        ident = router.recv_multipart()[0]
        for frames in ([b"junk"], [b"", b"short"], [b"", b"t", (7).to_bytes(8, "big"), b"p"], [b"", END_SEQ, b""]):
            router.send_multipart([ident, *frames])

    import threading

    th = threading.Thread(target=answer)
    th.start()
    got = ask_tails(ctx, {"k": (f"tcp://127.0.0.1:{port}", 0)}, 5.0)
    th.join()
    tail = got["k"]
    assert tail is not None and (tail.first, tail.last, tail.malformed) == (7, 7, 2)
