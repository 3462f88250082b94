"""The front door under attack: Indexer.flush's guarantee, misconfiguration checks, endpoint checks, start().

Real ZMQ sockets and :class:`kvevents.testing.FakeEngine`.  The oracle of
every flush test is the engine's own cache (``FakeEngine.cached_blocks``):
after ``flush()`` returns True the index must hold exactly those blocks for
the pod, in the same tiers.  Bounds on how long a call may take are generous
(a hang, not a speed, is what they catch).
"""

from __future__ import annotations

import logging
import os
import socket
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Iterator
from typing import Any

import msgspec
import pytest
import zmq
from prometheus_client import CollectorRegistry

from kvevents.subscriber import EngineEndpoint, endpoint_problem
from kvevents.testing import FakeEngine
from kvindex import Config, Indexer

BS = 16
MODEL = "m"


# ----------------------------------------------------------------- helpers


def make_indexer(*engines: FakeEngine, model: str | None = MODEL, entries: list[dict] | None = None,
                 algorithm: str | None = None, block_size: int = BS, backend: str = "auto", **kv: Any) -> Indexer:
    cfg: dict[str, Any] = {
        "kv_events_config": {"engines": (entries or []) + [e.engine_entry() for e in engines], **kv},
        "token_processor_config": {"block_size": block_size},
        "kv_block_index_config": {"backend": backend},
    }
    if algorithm is not None:
        cfg["token_processor_config"]["algorithm"] = algorithm
    if model is not None:
        cfg["model_name"] = model
    return Indexer(Config.from_dict(cfg))


def prompt(i: int, blocks: int = 4) -> list[int]:
    return [i * 100_000 + t for t in range(blocks * BS)]


def index_view(ix: Indexer, engine: FakeEngine, model: str | None = MODEL) -> dict[int, frozenset[str]]:
    """The index's picture of ``engine``'s pod as engine key -> tiers (only keys it can name).

    Raises AssertionError when the pod holds request keys that no cached engine block maps to.
    """
    pod = engine.pod
    cached = engine.cached_blocks()
    rk_of = {h: ix.index.request_key_of(h, model) for h in cached}
    held = ix.index.pod_keys(pod)
    by_rk = {rk: h for h, rk in rk_of.items() if rk is not None}
    extra = held - set(by_rk)
    assert not extra, f"{pod}: index holds {len(extra)} request keys the engine does not cache"
    out: dict[int, frozenset[str]] = {}
    rks = sorted(held)
    for rk, entries in zip(rks, ix.index.lookup(rks)):
        tiers = frozenset(e.tier for e in entries if e.pod == pod and not e.speculative)
        if tiers:
            out[by_rk[rk]] = tiers
    return out


def assert_exact(ix: Indexer, engine: FakeEngine, model: str | None = MODEL) -> None:
    cached = engine.cached_blocks()
    view = index_view(ix, engine, model)
    missing = set(cached) - set(view)
    assert not missing, f"{engine.pod}: {len(missing)} of {len(cached)} cached blocks missing from the index"
    wrong = {h for h in cached if view[h] != cached[h]}
    assert not wrong, f"{engine.pod}: tiers differ for {len(wrong)} blocks"


def call_bounded(fn: Any, bound: float) -> Any:
    """Run ``fn`` in a thread; fail if it has not returned after ``bound`` seconds (a hang)."""
    box: dict[str, Any] = {}

    def run() -> None:
        try:
            box["value"] = fn()
        except BaseException as exc:  # handed to the caller
            box["error"] = exc

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(bound)
    assert not t.is_alive(), f"call still running after {bound} s"
    if "error" in box:
        raise box["error"]
    return box["value"]


def free_port() -> int:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


@pytest.fixture
def ctx() -> Iterator[zmq.Context]:
    context = zmq.Context()
    yield context
    context.destroy(linger=0)


# ------------------------------------------------------------------ flush


def test_flush_after_bursts_with_evictions_and_offloads_is_exact() -> None:
    with FakeEngine(pod="pod-a", model=MODEL, capacity_blocks=24) as engine, make_indexer(engine) as ix:
        for r in range(15):
            for p in range(6):
                engine.serve(prompt((r * 7 + p) % 40, 1 + p % 4))
            if r % 3 == 0:
                engine.offload(5)
            assert ix.flush(30), f"round {r}"
            assert_exact(ix, engine)


def test_flush_right_after_a_restart_that_published_nothing() -> None:
    # the new process holds nothing; a True flush must not leave the old process's blocks
    with FakeEngine(pod="pod-a", model=MODEL) as engine, make_indexer(engine) as ix:
        for i in range(5):
            engine.serve(prompt(i))
        assert ix.flush(30)
        assert_exact(ix, engine)
        engine.restart()
        assert engine.cached_blocks() == {}
        assert ix.flush(30)
        assert_exact(ix, engine)


def test_flush_during_a_restart() -> None:
    with FakeEngine(pod="pod-a", model=MODEL) as engine, make_indexer(engine) as ix:
        for i in range(5):
            engine.serve(prompt(i))
        results: list[bool] = []

        def flusher() -> None:
            for _ in range(5):
                results.append(ix.flush(20))

        t = threading.Thread(target=flusher)
        t.start()
        engine.restart()
        engine.serve(prompt(50))
        t.join(200)
        assert not t.is_alive()
        assert ix.flush(30)
        assert_exact(ix, engine)


def test_flush_after_two_quick_restarts() -> None:
    with FakeEngine(pod="pod-a", model=MODEL) as engine, make_indexer(engine) as ix:
        for i in range(6):
            engine.serve(prompt(i))
        assert ix.flush(30)
        engine.restart()
        engine.serve(prompt(20))
        engine.serve(prompt(21))
        engine.restart()
        engine.serve(prompt(30))  # seq 0 again, a third process
        assert ix.flush(30)
        assert_exact(ix, engine)


def test_flush_after_two_quick_restarts_with_the_same_first_prompt() -> None:
    # each process's seq 0 stores the same blocks: only the timestamp tells them apart
    with FakeEngine(pod="pod-a", model=MODEL) as engine, make_indexer(engine) as ix:
        engine.serve(prompt(1))
        engine.serve(prompt(2))
        assert ix.flush(30)
        for _ in range(2):
            engine.restart()
            engine.serve(prompt(1))
        assert ix.flush(30)
        assert_exact(ix, engine)


@pytest.mark.parametrize("dropped", [1, 3, 10])
def test_flush_after_dropped_messages_with_nothing_after(dropped: int) -> None:
    with FakeEngine(pod="pod-a", model=MODEL, capacity_blocks=16) as engine, make_indexer(engine) as ix:
        engine.serve(prompt(0))
        assert ix.flush(30)
        engine.drop_next(dropped)
        for i in range(dropped):
            engine.serve(prompt(1 + i))  # evicts: removals are lost too
        assert ix.flush(30)
        assert_exact(ix, engine)


def test_flush_after_drops_then_a_restart() -> None:
    with FakeEngine(pod="pod-a", model=MODEL) as engine, make_indexer(engine) as ix:
        engine.serve(prompt(0))
        assert ix.flush(30)
        engine.drop_next(2)
        engine.serve(prompt(1))
        engine.serve(prompt(2))
        engine.restart()
        engine.drop_next(1)
        engine.serve(prompt(3))
        assert ix.flush(30)
        assert_exact(ix, engine)


def test_flush_with_a_dead_replay_endpoint_and_a_live_publisher() -> None:
    dead = free_port()
    with FakeEngine(pod="pod-a", model=MODEL) as engine:
        entry = {**engine.engine_entry(), "replay_endpoint": f"tcp://127.0.0.1:{dead}"}
        cfg = Config.from_dict({"model_name": MODEL, "kv_events_config": {"replay_timeout": 0.3, "engines": [entry]}})
        with Indexer(cfg) as ix:
            assert ix.wait_connected(20)
            engine.serve(prompt(0))
            engine.drop_next(1)
            engine.serve(prompt(1))  # lost, and nobody can tell us about it
            report = call_bounded(lambda: ix.flush_report(5), 60)
            assert not report.ok
            assert report.unreachable == ["pod-a/0"]
            held = engine.cached_blocks()
            assert set(index_view(ix, engine)) < set(held)


def test_flush_while_a_long_bootstrap_replay_runs() -> None:
    with FakeEngine(pod="pod-a", model=MODEL, capacity_blocks=100_000) as engine:
        for i in range(3000):
            engine.serve(prompt(i, 2))
        with make_indexer(engine) as ix:
            assert ix.flush(120)  # the replay of 3000 batches may still be running when asked
            assert_exact(ix, engine)
            assert ix.completeness("pod-a")[0].complete


def test_flush_with_twenty_engines() -> None:
    engines = [FakeEngine(pod=f"pod-{k:02d}", model=MODEL, capacity_blocks=20) for k in range(20)]
    try:
        with make_indexer(*engines, concurrency=3) as ix:
            for r in range(3):
                for k, e in enumerate(engines):
                    if (k + r) % 5 == 0:
                        e.drop_next(1)
                    for p in range(4):
                        e.serve(prompt(k * 10 + (p + r) % 7, 1 + p % 3))
                report = ix.flush_report(120)
                assert report.ok, report
                assert len(report.caught_up) == 20
                for e in engines:
                    assert_exact(ix, e)
    finally:
        for e in engines:
            e.close()


def test_concurrent_flushes_from_several_threads() -> None:
    with FakeEngine(pod="pod-a", model=MODEL) as engine, make_indexer(engine) as ix:
        failures: list[str] = []

        def worker(w: int) -> None:
            for r in range(10):
                p = prompt(w * 1000 + r)
                engine.serve(p)
                if not ix.flush(60):
                    failures.append(f"{w}/{r}: flush False")
                    continue
                got = ix.score(p, pods=["pod-a"]).prefix["pod-a"].matched_blocks
                if got != 4:
                    failures.append(f"{w}/{r}: matched {got} of 4 after a True flush")

        threads = [threading.Thread(target=worker, args=(w,)) for w in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(300)
        assert not any(t.is_alive() for t in threads)
        assert failures == []
        assert ix.flush(30)
        assert_exact(ix, engine)


@pytest.mark.parametrize("timeout", [0, 0.0, -1.0])
def test_flush_with_a_zero_or_negative_timeout_returns(timeout: float) -> None:
    with FakeEngine(pod="pod-a", model=MODEL) as engine, make_indexer(engine) as ix:
        engine.serve(prompt(0))
        ok = call_bounded(lambda: ix.flush(timeout), 30)
        if ok:  # True must still mean it
            assert_exact(ix, engine)
        assert ix.flush(30)
        assert_exact(ix, engine)


def test_flush_with_a_nan_timeout_does_not_hang() -> None:
    with FakeEngine(pod="pod-a", model=MODEL) as engine, make_indexer(engine) as ix:
        engine.drop_next(1)
        engine.serve(prompt(0))
        try:
            call_bounded(lambda: ix.flush(float("nan")), 30)
        except ValueError:
            pass  # refusing it is fine too


def test_flush_before_start_and_after_stop_raise() -> None:
    with FakeEngine(pod="pod-a", model=MODEL) as engine:
        ix = make_indexer(engine)
        with pytest.raises(RuntimeError):
            ix.flush(1)
        with pytest.raises(RuntimeError):
            ix.flush_report(1)
        ix.start()
        assert ix.flush(30)
        ix.stop()
        with pytest.raises(RuntimeError):
            call_bounded(lambda: ix.flush(5), 60)


def test_flush_with_an_engine_never_reachable() -> None:
    dead, dead_replay = free_port(), free_port()
    entry = {"pod": "pod-x", "endpoint": f"tcp://127.0.0.1:{dead}", "replay_endpoint": f"tcp://127.0.0.1:{dead_replay}"}
    with FakeEngine(pod="pod-a", model=MODEL) as engine, make_indexer(engine, entries=[entry]) as ix:
        engine.serve(prompt(0))
        report = call_bounded(lambda: ix.flush_report(10), 60)
        assert report.down == ["pod-x/0"]
        assert report.caught_up == ["pod-a/0"]
        assert report.ok
        assert_exact(ix, engine)
        assert not ix.wait_connected(0.5)


def test_flush_after_a_restart_that_published_past_the_old_seq() -> None:
    with FakeEngine(pod="pod-a", model=MODEL) as engine, make_indexer(engine) as ix:
        for i in range(3):
            engine.serve(prompt(i))
        assert ix.flush(30)
        engine.restart()
        for i in range(8):
            engine.serve(prompt(10 + i))
        assert ix.flush(30)
        assert_exact(ix, engine)


@pytest.mark.parametrize("variant", [
    {"replay_with_topic": False},
    {"dp_rank": None},
    {"hash_form": "int64"},
    {"hash_form": "bytes"},
    {"encoding": "array"},
    {"topic": ""},
])
def test_flush_is_exact_for_older_engine_variants(variant: dict[str, Any]) -> None:
    with FakeEngine(pod="pod-a", model=MODEL, capacity_blocks=10, **variant) as engine, make_indexer(engine) as ix:
        for r in range(4):
            engine.serve(prompt(r))
            engine.drop_next(1)
            engine.serve(prompt(r + 20, 2))
            if r == 2:
                engine.restart()
                engine.serve(prompt(40))
            assert ix.flush(30), (variant, r)
            assert_exact(ix, engine)


# ------------------------------------------------------ misconfiguration


class RawPublisher:
    """A bare publisher (no replay endpoint) for events FakeEngine does not make (LoRA, salts, SGLang)."""

    def __init__(self, ctx: zmq.Context, pod: str, model: str = MODEL) -> None:
        self.pod = pod
        self.topic = f"kv@{pod}@{model}".encode()
        self.sock = ctx.socket(zmq.PUB)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.port = self.sock.bind_to_random_port("tcp://127.0.0.1")
        self.seq = 0

    def entry(self, engine: str = "vllm") -> dict[str, Any]:
        return {"pod": self.pod, "endpoint": f"tcp://127.0.0.1:{self.port}", "engine": engine}

    def join(self, ix: Indexer) -> None:
        """Send empty batches at seq 0 until the subscriber receives one (the subscription is live)."""
        assert ix.wait_connected(20)
        deadline = time.monotonic() + 20
        while ix.subscriber.received == 0:
            assert time.monotonic() < deadline, "subscription never took effect"
            self.sock.send_multipart([self.topic, (0).to_bytes(8, "big"), msgspec.msgpack.encode([time.time(), [], 0])])
            time.sleep(0.05)
        self.seq = 1

    def send(self, events: list[Any], rank: int | None = 0) -> None:
        batch: list[Any] = [time.time(), events] + ([rank] if rank is not None else [])
        self.sock.send_multipart([self.topic, self.seq.to_bytes(8, "big"), msgspec.msgpack.encode(batch)])
        self.seq += 1


def stored(hashes: list[int], parent: int | None, tokens: list[int], **extra: Any) -> dict[str, Any]:
    return {"type": "BlockStored", "block_hashes": hashes, "parent_block_hash": parent, "token_ids": tokens,
            "block_size": extra.pop("block_size", BS), "medium": "GPU", **extra}


def misconfigured(ix: Indexer) -> dict[tuple[str, str | None, int], tuple[str, ...]]:
    return {(s.pod, s.model, s.dp_rank): s.misconfigured for s in ix.stats().misconfigured}


def settled(ix: Indexer, pod: str, timeout: float = 30.0) -> bool:
    """Every stream of ``pod`` is complete within ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while not all(s.complete for s in ix.completeness(pod)):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


def misconfig_lines(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if "misconfigured" in r.getMessage()]


@pytest.mark.parametrize(("algorithm", "engine_algo"), [("vllm_sha256", "sha256"), ("vllm_sha256_cbor", "sha256_cbor")])
def test_a_correct_engine_is_never_flagged(algorithm: str, engine_algo: str, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING)
    with FakeEngine(pod="pod-a", model=MODEL, hash_algo=engine_algo, capacity_blocks=12) as engine, \
            make_indexer(engine, algorithm=algorithm) as ix:
        engine.offload(3)  # nothing cached yet: no event
        for i in range(4):
            engine.serve(prompt(i, 1 + i % 3))
        engine.offload(4)  # token-less CPU stores
        engine.reset_prefix_cache()  # AllBlocksCleared
        engine.serve(prompt(9))
        engine.restart()
        engine.offload(2)
        engine.serve(prompt(10))
        engine.serve(prompt(10, 6), report_mode="full")
        assert ix.flush(30)
        assert misconfigured(ix) == {}
        # the restart's dropped connection is checked once the subscriber reconnects, which may
        # come after the new process's batches were taken from its buffer: settled, not instant
        assert settled(ix, "pod-a"), ix.completeness("pod-a")
        assert_exact(ix, engine)
        # engine-hash mode: a prompt's request keys are the engine's hashes
        assert ix.score(prompt(10, 6), pods=["pod-a"]).prefix["pod-a"].matched_blocks == 6
    assert misconfig_lines(caplog) == []


@pytest.mark.parametrize("hash_form", ["int64", "bytes"])
def test_engine_hash_mode_accepts_every_hash_form(hash_form: str) -> None:
    with FakeEngine(pod="pod-a", model=MODEL, hash_form=hash_form) as engine, \
            make_indexer(engine, algorithm="vllm_sha256") as ix:
        for i in range(6):
            engine.serve(prompt(i))
        assert ix.flush(30)
        assert misconfigured(ix) == {}
        assert ix.score(prompt(3), pods=["pod-a"]).prefix["pod-a"].matched_blocks == 4


def test_lora_salt_and_multimodal_starts_are_not_flagged(ctx: zmq.Context) -> None:
    pub = RawPublisher(ctx, "pod-r")
    with make_indexer(entries=[pub.entry()], algorithm="vllm_sha256") as ix:
        pub.join(ix)
        toks = list(range(2 * BS))
        # hashes the router cannot rebuild from the event alone: they must not count as a wrong algorithm
        pub.send([stored([11, 12], None, toks, lora_name="adapter", extra_keys=[["adapter"], ["adapter"]])])
        pub.send([stored([21, 22], None, toks, extra_keys=[["salt-1"], None])])
        pub.send([stored([31, 32], None, toks, extra_keys=[[["mm-hash", 0]], [["mm-hash", 0]]])])
        pub.send([stored([41], None, [], medium="CPU")])
        # no replay endpoint: flush() covers only what has arrived, so wait for the last seq (4)
        deadline = time.monotonic() + 30
        while not any(s.last_seq == pub.seq - 1 for s in ix.completeness("pod-r")):
            assert time.monotonic() < deadline, ix.completeness("pod-r")
            time.sleep(0.01)
        assert ix.flush(30)
        assert misconfigured(ix) == {}


def test_sglang_short_last_page_is_not_a_block_size_mismatch(ctx: zmq.Context, caplog: pytest.LogCaptureFixture) -> None:
    # SGLang publishes one event per page and the last page of a radix node may be shorter (block_size = its length)
    caplog.set_level(logging.WARNING)
    pub = RawPublisher(ctx, "pod-s")
    with make_indexer(entries=[pub.entry("sglang")]) as ix:
        pub.join(ix)
        toks = list(range(2 * BS + 5))
        pub.send([
            ["BlockStored", [101], None, toks[:BS], BS, None, "GPU"],
            ["BlockStored", [102], 101, toks[BS:2 * BS], BS, None, "GPU"],
            ["BlockStored", [103], 102, toks[2 * BS:], 5, None, "GPU"],
        ])
        pub.send([["BlockStored", [201], None, toks[:BS], BS, None, "GPU"]])
        # no replay endpoint: flush covers only what the subscriber received, so wait for both batches first
        deadline = time.monotonic() + 30
        while ix.stats().received_messages < 3 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert ix.flush(30)
        assert ix.stats().received_messages >= 3
        assert misconfigured(ix) == {}, misconfig_lines(caplog)
        assert ix.score(toks, pods=["pod-s"]).prefix["pod-s"].matched_blocks == 2


def test_a_wrong_hash_algorithm_is_flagged_once_and_clears_when_fixed(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING)
    pub_port, replay_port = free_port(), free_port()
    kw: dict[str, Any] = dict(pod="pod-a", model=MODEL, endpoint=f"tcp://127.0.0.1:{pub_port}", pub_bind=True,
                              replay_endpoint=f"tcp://127.0.0.1:{replay_port}")
    wrong = FakeEngine(hash_algo="sha256_cbor", **kw)
    with make_indexer(wrong, algorithm="vllm_sha256") as ix:
        for i in range(10):
            wrong.serve(prompt(i))
        wrong.restart()  # the same wrong configuration after a restart
        for i in range(5):
            wrong.serve(prompt(i))
        assert ix.flush(30)
        assert misconfigured(ix) == {("pod-a", MODEL, 0): ("hash_algorithm",)}
        lines = misconfig_lines(caplog)
        assert len(lines) == 1, lines
        assert "vllm_sha256_cbor" in lines[0]
        wrong.close()
        with FakeEngine(hash_algo="sha256", **kw) as right:  # the engine comes back configured like us
            right.serve(prompt(50))
            assert call_bounded(lambda: ix.flush(30), 120)
            assert misconfigured(ix) == {}
            assert settled(ix, "pod-a"), ix.completeness("pod-a")
            assert_exact(ix, right)


def test_a_wrong_block_size_is_flagged_once_and_clears_when_fixed(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING)
    pub_port, replay_port = free_port(), free_port()
    kw: dict[str, Any] = dict(pod="pod-a", model=MODEL, endpoint=f"tcp://127.0.0.1:{pub_port}", pub_bind=True,
                              replay_endpoint=f"tcp://127.0.0.1:{replay_port}")
    wrong = FakeEngine(block_size=32, **kw)
    with make_indexer(wrong) as ix:
        for i in range(10):
            wrong.serve(prompt(i))
        wrong.reset_prefix_cache()
        wrong.serve(prompt(3))
        assert ix.flush(30)
        assert misconfigured(ix) == {("pod-a", MODEL, 0): ("block_size",)}
        assert len(misconfig_lines(caplog)) == 1, misconfig_lines(caplog)
        wrong.close()
        with FakeEngine(block_size=BS, **kw) as right:
            right.serve(prompt(50))
            assert call_bounded(lambda: ix.flush(30), 120)
            assert misconfigured(ix) == {}
            assert_exact(ix, right)


def _model_fixed(check: str) -> None:
    pub_port, replay_port = free_port(), free_port()
    kw: dict[str, Any] = dict(pod="pod-a", endpoint=f"tcp://127.0.0.1:{pub_port}", pub_bind=True,
                              replay_endpoint=f"tcp://127.0.0.1:{replay_port}")
    wrong = FakeEngine(model="other", **kw)
    with make_indexer(wrong) as ix:
        for i in range(3):
            wrong.serve(prompt(i))
        assert ix.flush(30)
        assert misconfigured(ix) == {("pod-a", "other", 0): ("model_name",)}
        wrong.close()
        with FakeEngine(model=MODEL, **kw) as right:  # the pod comes back serving the model scored
            right.serve(prompt(50))
            assert call_bounded(lambda: ix.flush(30), 120)
            if check == "blocks":
                # the new process's blocks are filed under the model its topic names
                assert ix.score(prompt(50), pods=["pod-a"]).prefix["pod-a"].matched_blocks == 4
                assert ix.score(prompt(50), pods=["pod-a"], model="other").prefix["pod-a"].matched_blocks == 0
                assert ix.index.pod_keys("pod-a") == {ix.index.request_key_of(h, MODEL) for h in right.cached_blocks()}
            else:
                # the process that published "other" is gone: its flag should not stay
                assert misconfigured(ix) == {}, ix.completeness("pod-a")


def test_an_engine_back_with_another_model_has_its_blocks_filed_under_that_model() -> None:
    _model_fixed("blocks")


def test_misconfigured_ranks_are_logged_once_each(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING)
    engines = [FakeEngine(pod="pod-a", model=MODEL, block_size=32, dp_rank=r) for r in range(2)]
    try:
        entries = [{**e.engine_entry(), "pod": "pod-a", "dp_rank": r} for r, e in enumerate(engines)]
        # one pod, two DP ranks on unrelated ports: two entries cannot share a pod id, so use two pods
        entries[1]["pod"] = "pod-b"
        with make_indexer(entries=entries) as ix:
            for _ in range(3):
                for i in range(5):
                    for e in engines:
                        e.serve(prompt(i))
                assert ix.flush(30)
            assert set(misconfigured(ix).values()) == {("block_size",)}
            assert len(misconfig_lines(caplog)) == len(misconfigured(ix)), misconfig_lines(caplog)
    finally:
        for e in engines:
            e.close()


# ------------------------------------------------------ endpoint checks

GOOD_CONNECT = ["tcp://[::1]:5557", "tcp://127.0.0.1:65535", "tcp://h:1", "tcp://engine-0.svc.cluster.local:5557",
                "ipc:///tmp/kv.sock", "inproc://kv", "tcp://[fe80::1%eth0]:5557"]
BAD_CONNECT = ["tcp://::1:5557", "tcp://[::]:5557", "tcp://*:5557", "tcp://host:0", "tcp://host:65536", "tcp://host:*",
               "tcp://ho st:5557", " tcp://host:5557", "tcp://host:5557 ", "tcp://host:5557\n", "tcp://:1", "tcp://[]:1",
               "TCP://h:1", "tcp://h:1/", "ipc://", "inproc://", "udp://h:1", "h:1", "", "tcp://eth0;h:1",
               # accepted by the check but refused by ZMQ at start() (a late, field-less error)
               "tcp://h:\u0665\u0665\u0665\u0667", "tcp://h:\uff11\uff12", "tcp://h:\u00b2", "tcp://h\u00f4st:5557",
               "tcp://\x00:1", "tcp://h\x00:1", "tcp://user@h:1", "tcp://[[::1]:1", "tcp://[::1]]:1",
               "ipc://" + "a" * 300]


@pytest.mark.parametrize("endpoint", GOOD_CONNECT)
def test_endpoints_zmq_takes_pass_the_check(endpoint: str, ctx: zmq.Context) -> None:
    assert endpoint_problem(endpoint) is None
    s = ctx.socket(zmq.SUB)
    try:
        s.connect(endpoint)  # what the subscriber will do with it
    finally:
        s.close(linger=0)


@pytest.mark.parametrize("endpoint", BAD_CONNECT)
def test_bad_connect_endpoints_are_refused_in_the_config_naming_the_field(endpoint: str) -> None:
    problem = endpoint_problem(endpoint)
    assert isinstance(problem, str) and problem
    with pytest.raises(ValueError, match=r"engines\[0\]\.endpoint"):
        Config.from_dict({"kv_events_config": {"engines": [{"pod": "p", "endpoint": endpoint}]}})
    with pytest.raises(ValueError, match=r"replay_endpoint"):
        Config.from_dict({"kv_events_config": {"engines": [
            {"pod": "p", "endpoint": "tcp://h:1", "replay_endpoint": endpoint}]}})


@pytest.mark.parametrize("endpoint", ["tcp://*:5557", "tcp://[::]:5557", "tcp://0.0.0.0:5557", "ipc:///tmp/kv-bind.sock"])
def test_wildcards_are_fine_where_we_bind(endpoint: str) -> None:
    assert endpoint_problem(endpoint, bind=True) is None
    cfg = Config.from_dict({"kv_events_config": {"zmq_endpoint": endpoint}})
    assert cfg.kv_events_config.zmq_endpoint == endpoint


def test_dp_ranks_past_the_last_port_are_refused() -> None:
    with pytest.raises(ValueError):
        Config.from_dict({"kv_events_config": {"engines": [
            {"pod": "p", "endpoint": "tcp://h:65535", "replay_endpoint": "tcp://h:65000", "dp_size": 2}]}})


@pytest.mark.parametrize("bad", [
    {"endpoint": "tcp://*:1", "pod": "p"},
    {"endpoint": "tcp://h:1", "pod": ""},
    {"endpoint": "tcp://h:1", "pod": "p", "dp_size": 0},
    {"endpoint": "tcp://h:1", "pod": "p", "replay_endpoint": "tcp://h:0"},
    {"endpoint": 5557, "pod": "p"},
    {"endpoint": "tcp://h:\uff11\uff12", "pod": "p"},
])
def test_add_engine_refuses_bad_entries_at_the_call(bad: dict[str, Any]) -> None:
    with make_indexer() as ix:
        with pytest.raises((ValueError, TypeError)):
            ix.add_engine(EngineEndpoint(**bad))
        assert ix.subscriber.connected() == {}
        assert ix.flush(10)
    with make_indexer() as ix:
        with pytest.raises(TypeError):
            ix.add_engine({"endpoint": "tcp://h:1", "pod": "p"})  # type: ignore[arg-type]


def test_start_that_cannot_bind_raises_without_leaving_threads(ctx: zmq.Context) -> None:
    taken = ctx.socket(zmq.PUB)
    port = taken.bind_to_random_port("tcp://127.0.0.1")
    ix = Indexer(Config.from_dict({"kv_events_config": {"zmq_endpoint": f"tcp://127.0.0.1:{port}"}}))
    before = {t.ident for t in threading.enumerate()}
    with pytest.raises(zmq.ZMQError):
        ix.start()
    leftover = [t.name for t in threading.enumerate() if t.ident not in before and t.is_alive()]
    assert leftover == []  # the pool's workers too: left running they keep the index alive past exit
    ix.stop()
    taken.close(linger=0)


# ------------------------------------------------ start() against odd peers


class SilentTCP:
    """A TCP server that accepts connections and never speaks ZMTP (or, with ``close``, hangs up at once)."""

    def __init__(self, close: bool = False, garbage: bool = False) -> None:
        self.srv = socket.socket()
        self.srv.bind(("127.0.0.1", 0))
        self.srv.listen(16)
        self.port = self.srv.getsockname()[1]
        self.conns: list[socket.socket] = []
        self.close_at_once, self.garbage = close, garbage
        self._stop = False
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        self.srv.settimeout(0.1)
        while not self._stop:
            try:
                c, _ = self.srv.accept()
            except OSError:
                continue
            if self.garbage:
                try:
                    c.sendall(b"HTTP/1.1 400 Bad Request\r\n\r\n" * 4)
                except OSError:
                    pass
            if self.close_at_once:
                c.close()
            else:
                self.conns.append(c)

    def close(self) -> None:
        self._stop = True
        self.thread.join(5)
        for c in self.conns:
            c.close()
        self.srv.close()


@pytest.mark.parametrize("peer", ["refused", "silent", "hangs-up", "garbage", "unresolvable"])
def test_start_returns_with_an_engine_that_never_speaks_zmq(peer: str) -> None:
    server = None
    if peer == "refused":
        ep = f"tcp://127.0.0.1:{free_port()}"
    elif peer == "unresolvable":
        ep = "tcp://no-such-engine.invalid:5557"
    else:
        server = SilentTCP(close=peer == "hangs-up", garbage=peer == "garbage")
        ep = f"tcp://127.0.0.1:{server.port}"
    try:
        with FakeEngine(pod="pod-a", model=MODEL) as engine:
            engine.serve(prompt(0))
            entries = [{"pod": "pod-x", "endpoint": ep, "replay_endpoint": ep}]
            ix = make_indexer(engine, entries=entries, connect_timeout=1.0, replay_timeout=0.5)
            call_bounded(ix.start, 60)  # bounded by connect_timeout + 1 s by its documentation
            try:
                assert ix.subscriber.connected()[("pod-x", 0)] is False
                assert ix.subscriber.connected()[("pod-a", 0)] is True
                assert call_bounded(lambda: ix.wait_connected(1.0), 30) is False
                report = call_bounded(lambda: ix.flush_report(10), 60)
                assert report.down == ["pod-x/0"] and report.caught_up == ["pod-a/0"]
                assert_exact(ix, engine)
            finally:
                call_bounded(ix.stop, 60)
    finally:
        if server is not None:
            server.close()


def test_wait_connected_turns_true_when_a_late_engine_comes_up() -> None:
    pub_port, replay_port = free_port(), free_port()
    entry = {"pod": "pod-a", "endpoint": f"tcp://127.0.0.1:{pub_port}", "replay_endpoint": f"tcp://127.0.0.1:{replay_port}"}
    with make_indexer(entries=[entry], connect_timeout=1.0) as ix:
        assert not ix.wait_connected(0.3)
        with FakeEngine(pod="pod-a", model=MODEL, endpoint=entry["endpoint"], pub_bind=True,
                        replay_endpoint=entry["replay_endpoint"]) as engine:
            engine.serve(prompt(0))
            assert ix.wait_connected(60)
            assert ix.flush(30)
            assert_exact(ix, engine)


# ------------------------------------------- two indexers, metrics, exit


def test_two_indexers_share_a_registry_by_namespace() -> None:
    from prometheus_client import generate_latest

    reg = CollectorRegistry()
    with FakeEngine(pod="pod-a", model=MODEL) as ea, FakeEngine(pod="pod-b", model=MODEL) as eb:
        cfg_a = Config.from_dict({"model_name": MODEL, "kv_events_config": {"engines": [ea.engine_entry()]}})
        cfg_b = Config.from_dict({"model_name": MODEL, "kv_events_config": {"engines": [eb.engine_entry()]}})
        with Indexer(cfg_a, metrics_registry=reg, metrics_namespace="a") as ia, \
                Indexer(cfg_b, metrics_registry=reg, metrics_namespace="b") as ib:
            with pytest.raises(ValueError):
                Indexer(cfg_a, metrics_registry=reg, metrics_namespace="a")
            with pytest.raises(ValueError):
                Indexer(cfg_a, metrics_namespace="not a name")
            for i in range(3):
                ea.serve(prompt(i))
            eb.serve(prompt(9))
            assert ia.flush(30) and ib.flush(30)
            stored = {ns: reg.get_sample_value(f"{ns}_kvindex_blocks_stored_total") for ns in ("a", "b")}
            assert stored == {"a": 12.0, "b": 4.0}  # each indexer counts only its own engine
            text = generate_latest(reg).decode()
            a_lines = [ln for ln in text.splitlines() if ln.startswith("a_kvindex_")]
            assert a_lines and not any('pod="pod-b"' in ln for ln in a_lines)


EXIT_SCRIPT = textwrap.dedent('''
    import gc, sys
    from kvevents.testing import FakeEngine
    from kvindex import Config, Indexer
    backend, mode = sys.argv[1], sys.argv[2]
    engine = FakeEngine(pod="pod-a", model="m")
    cfg = Config.from_dict({"model_name": "m", "kv_block_index_config": {"backend": backend},
                            "kv_events_config": {"engines": [engine.engine_entry()]}})
    for i in range(20):
        engine.serve([i * 1000 + t for t in range(64)])
    if mode == "kept":
        ix = Indexer(cfg).start()
        assert ix.flush(30)
        ix.score(list(range(64)))
    elif mode == "dropped":
        Indexer(cfg).start()  # no reference kept, never stopped
        gc.collect()
    elif mode == "two":
        a = Indexer(cfg, metrics_namespace="a").start()
        b = Indexer(cfg, metrics_namespace="b").start()
        assert a.flush(30) and b.flush(30)
    elif mode == "bind-fails":
        import zmq
        taken = zmq.Context().socket(zmq.PUB)
        port = taken.bind_to_random_port("tcp://127.0.0.1")
        bad = Config.from_dict({"kv_block_index_config": {"backend": backend},
                                "kv_events_config": {"zmq_endpoint": f"tcp://127.0.0.1:{port}"}})
        try:
            Indexer(bad).start()
        except zmq.ZMQError:
            pass
    print("done", flush=True)
''')


@pytest.mark.parametrize("backend", ["native", "python", "auto"])
@pytest.mark.parametrize("mode", ["kept", "dropped", "two", "bind-fails"])
def test_interpreter_exit_without_stop_reports_no_leak(backend: str, mode: str) -> None:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([os.getcwd(), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run([sys.executable, "-c", EXIT_SCRIPT, backend, mode], capture_output=True, text=True,
                          timeout=120, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "done" in proc.stdout
    assert "leak" not in proc.stderr.lower(), proc.stderr[-3000:]
