"""Adversarial tests: hostile engines, lifecycle abuse, concurrent readers, bounds and API misuse.

Each test is a minimal reproduction of something a hostile or broken
environment does; the library must count it, refuse it clearly, or carry on.

Everything runs on loopback with plain pyzmq sockets or the simulated engines
of examples/simfleet; every wait is bounded.
"""

from __future__ import annotations

import gc
import random
import threading
import time
import tracemalloc
from collections.abc import Callable

import msgspec
import numpy as np
import pytest
import zmq
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from examples.simfleet import SimEngine
from kvindex.facade import Config, Indexer
from kvevents.pool import EventPool, RawMessage, Source
from kvevents.subscriber import EngineEndpoint, Subscriber
from kvindex.reference import KVBlockIndex
from kvindex.keys import TokenProcessor
from scorer.load import LoadSnapshot
from tests.oracle import batch_payload, cleared_event, removed_event, seq_frame, stored_event

BS = 4
END = b"\xff" * 8
LOOPBACK = "tcp://127.0.0.1:*"


# ------------------------------------------------------------------ helpers


def wait_until(pred: Callable[[], bool], timeout: float = 60.0) -> bool:
    deadline = time.monotonic() + timeout
    while not pred():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.005)
    return True


def tp() -> TokenProcessor:
    return TokenProcessor(block_size=BS)


def toks(i: int, n_blocks: int = 1) -> list[int]:
    return [i * 1000 + j for j in range(BS * n_blocks)]


def stored(hashes, parent, tokens, **kw):
    return stored_event(hashes, parent, tokens, BS, **kw)


def msg(pod: str, seq: int | bytes, payload: bytes, source: Source | None = None, topic: bytes | None = None):
    s = seq if isinstance(seq, bytes) else seq_frame(seq)
    return RawMessage(source or Source(pod=pod), topic if topic is not None else f"kv@{pod}@m".encode(), s, payload)


class Pool:
    """An EventPool on a fresh index, started; closes itself."""

    def __init__(self, **kw) -> None:
        self.index = KVBlockIndex(tp(), capacity=kw.pop("capacity", 1_000_000),
                                  max_orphan_blocks=kw.pop("max_orphan_blocks", 100_000))
        kw.setdefault("replay_timeout", 0.5)
        self.pool = EventPool(self.index, **kw)

    def __enter__(self) -> Pool:
        self.pool.start()
        return self

    def __exit__(self, *exc) -> None:
        self.pool.stop(2.0)


class ReplayServer:
    """A replay ROUTER on loopback with a configurable (possibly hostile) behaviour.

    ``reply(ident, start_seq)`` is called per request in the server thread and
    returns the frame lists to send (without the identity frame); ``forever``
    streams the same reply until closed.
    """

    def __init__(self, reply: Callable[[int], list[list[bytes]]] | None, *, forever: bool = False) -> None:
        self.sock = zmq.Context.instance().socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        port = self.sock.bind_to_random_port("tcp://127.0.0.1")
        self.endpoint = f"tcp://127.0.0.1:{port}"
        self.reply = reply
        self.forever = forever
        self.requests = 0
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True)
        self._t.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            if not self.sock.poll(20):
                continue
            frames = self.sock.recv_multipart()
            self.requests += 1
            if self.reply is None:  # never answers
                continue
            start = int.from_bytes(frames[-1], "big") if len(frames[-1]) == 8 else 0
            while True:
                for f in self.reply(start):
                    self.sock.send_multipart([frames[0], *f])
                if not self.forever or self._stop.wait(0.001):
                    break

    def close(self) -> None:
        self._stop.set()
        self._t.join(5)
        self.sock.close(linger=0)


def end_marker(topic: bytes = b"kv@a@m") -> list[bytes]:
    return [b"", topic, END, b""]


# ============================================================ 1. bad input from engines

GOOD_BLOCK = stored([11], None, toks(1))


def bad_payloads() -> dict[str, bytes]:
    enc = msgspec.msgpack.encode
    nested = b"\x91" * 100_000 + b"\xc0"
    return {
        "empty": b"",
        "truncated": batch_payload([GOOD_BLOCK])[:-3],
        "not_array": enc({"ts": 1.0}),
        "deep_top": b"\x93" + enc(1.0) + nested + b"\x00",
        "short_tokens": batch_payload([stored([12], None, toks(2)[:-1])]),
        "long_tokens": batch_payload([stored([12], None, toks(2) + [1])]),
        "zero_block_size": batch_payload([stored_event([12], None, [], 0)]),
        "empty_digest": batch_payload([stored([b""], None, toks(2))]),
        "float_hash": batch_payload([stored([1.5], None, toks(2))]),
        "str_hash": batch_payload([stored(["x"], None, toks(2))]),
        "negative_token": batch_payload([stored([12], None, [-1] * BS)]),
        "nan_ts": batch_payload([GOOD_BLOCK], ts=float("nan")),
        "inf_ts": batch_payload([GOOD_BLOCK], ts=float("inf")),
        "negative_rank": batch_payload([GOOD_BLOCK], dp_rank=-1),
        "map_in_extra_keys": batch_payload([stored([12], None, toks(2), extra_keys=[{"a": 1}])]),
        "extra_keys_wrong_len": batch_payload([stored([12], None, toks(2), extra_keys=[None, None])]),
        "wrong_block_size": batch_payload([stored_event([12], None, list(range(8)), 8)]),
        "garbage_50mb": b"\xc1" + b"\x00" * (50 * 1024 * 1024),
    }


def deep_extra_keys_payload(depth: int) -> bytes:
    enc = msgspec.msgpack.encode
    ev = enc({"type": "BlockStored", "block_hashes": [1], "parent_block_hash": None, "token_ids": toks(2),
              "block_size": BS})
    n = ev[0] & 0x0F
    ev = bytes([0x80 | (n + 1)]) + ev[1:] + enc("extra_keys") + b"\x91" + b"\x91" * depth + b"\xc0"
    return b"\x93" + enc(1.0) + b"\x91" + ev + b"\x00"


def test_bad_payloads_are_counted_index_unchanged_and_pool_keeps_working():
    payloads = bad_payloads()
    payloads["deep_extra"] = deep_extra_keys_payload(100_000)
    payloads["deep_extra_500"] = deep_extra_keys_payload(500)
    with Pool(concurrency=2) as p:
        p.pool.submit(msg("a", 0, batch_payload([GOOD_BLOCK])))
        assert p.pool.flush(60)
        before = p.index.stats()
        for seq, (_name, payload) in enumerate(payloads.items(), start=1):
            p.pool.submit(msg("a", seq, payload))
        # wrong seq frames: too short, too long, empty
        for bad_seq in (b"\x00", b"\x00" * 9, b""):
            p.pool.submit(msg("a", bad_seq, batch_payload([stored([99], None, toks(9))])))
        assert p.pool.flush(30)
        s = p.pool.stats()
        after = p.index.stats()
        assert after.keys == before.keys and after.entries == before.entries
        assert s.decode_errors >= len(payloads) + 3 - 1, s.errors_by_kind
        assert {"seq", "depth", "token_ids", "hash", "ts", "msgpack"} <= set(s.errors_by_kind), s.errors_by_kind
        # the pool still applies good messages on every stream afterwards
        p.pool.submit(msg("a", len(payloads) + 1, batch_payload([stored([13], 11, toks(3))])))
        # no replay endpoint: the jump over unreadable messages is applied once the next message confirms it
        p.pool.submit(msg("a", len(payloads) + 2, batch_payload([])))
        p.pool.submit(msg("b", 0, batch_payload([stored([21], None, toks(4))])))
        assert p.pool.flush(60)
        assert len(p.index.prefix_match(list(p.index.token_processor.request_keys(toks(1) + toks(3), model="m")), ["a"])["a"]) == 2
        assert "b" in p.index.pods()


@settings(max_examples=25, deadline=None, suppress_health_check=list(HealthCheck))
@given(st.binary(max_size=200), st.binary(max_size=10), st.binary(max_size=40))
def test_fuzz_random_frames_never_raise(payload: bytes, seq: bytes, topic: bytes):
    with Pool(concurrency=1) as p:
        p.pool.submit(RawMessage(Source(pod="a"), topic, seq, payload))
        p.pool.submit(msg("z", 0, batch_payload([GOOD_BLOCK])))
        assert p.pool.flush(60)
        assert "z" in p.index.pods()
        assert p.pool.stats().errors_by_kind.get("internal", 0) == 0


def test_huge_event_lists_respect_capacity_and_do_not_raise():
    with Pool(concurrency=1, capacity=1000) as p:
        n = 50_000
        hashes = list(range(1, n + 1))
        p.pool.submit(msg("a", 0, batch_payload([stored(hashes, None, list(range(n * BS)))])))
        # 10**6 hashes in a BlockRemoved and in a token-less (offload) BlockStored
        big = list(range(10**6))
        p.pool.submit(msg("a", 1, batch_payload([removed_event(big)])))
        p.pool.submit(msg("a", 2, batch_payload([stored_event(big, None, [], BS, tier="cpu")])))
        assert p.pool.flush(60)
        s = p.index.stats()
        assert s.keys <= 1000
        assert p.pool.stats().errors_by_kind.get("internal", 0) == 0


def test_odd_topics_fall_back_to_the_configured_pod_or_are_counted():
    with Pool(concurrency=2) as p:
        cfg = Source(pod="cfg")
        for i, topic in enumerate([b"\xff\xfe", b"kv@", b"kv@@m", b"kv", b"", b"kv@\x00pod@m", b"xx@a@m"]):
            p.pool.submit(RawMessage(cfg, topic, seq_frame(i), batch_payload([stored([100 + i], None, toks(i))])))
        # no configured pod and a topic that names none: counted, not raised
        p.pool.submit(RawMessage(Source(pod=None), b"\xff", seq_frame(0), batch_payload([GOOD_BLOCK])))
        assert p.pool.flush(60)
        assert p.index.pods() == {"cfg"}
        assert p.pool.stats().errors_by_kind.get("topic") == 1


def test_wrong_frame_counts_over_zmq_are_counted_and_later_messages_applied():
    ctx = zmq.Context.instance()
    pub = ctx.socket(zmq.PUB)
    pub.setsockopt(zmq.LINGER, 0)
    port = pub.bind_to_random_port("tcp://127.0.0.1")
    with Pool(concurrency=1) as p:
        sub = Subscriber(p.pool, [EngineEndpoint(endpoint=f"tcp://127.0.0.1:{port}", pod="a")])
        sub.start()
        try:
            # slow joiner: send AllBlocksCleared on an empty pod until one lands
            assert wait_until(lambda: (pub.send_multipart([b"kv@a@m", seq_frame(0), batch_payload([cleared_event()])])
                                       or sub.received > 0), 60)
            seq = 1
            p.pool.flush(5)
            for frames in ([b"kv@a@m"], [b"kv@a@m", seq_frame(1)], [b"kv@a@m", seq_frame(1), b"x", b"y"],
                           [b"kv@a@m", seq_frame(1), b"x", b"y", b"z"]):
                pub.send_multipart(frames)
            pub.send_multipart([b"kv@a@m", seq_frame(seq), batch_payload([GOOD_BLOCK])])
            assert wait_until(lambda: "a" in p.index.pods(), 60)
            assert p.pool.stats().errors_by_kind.get("frames") == 4
        finally:
            sub.stop()
            pub.close(linger=0)


def test_end_marker_seq_in_a_live_message_does_not_wipe_the_pod():
    with Pool(concurrency=1) as p:
        p.pool.submit(msg("a", 0, batch_payload([GOOD_BLOCK])))
        p.pool.submit(msg("a", END, batch_payload([])))
        p.pool.submit(msg("a", 1, batch_payload([stored([12], 11, toks(2))])))
        assert p.pool.flush(60)
        assert p.pool.stats().restarts == 0
        assert p.index.pod_keys("a"), "a hostile seq frame emptied the pod"


# ============================================================ 2. replay endpoints that misbehave


def test_replay_garbage_other_topics_and_silence_are_counted_not_raised():
    def garbage(start: int) -> list[list[bytes]]:
        return [
            [b"x"],  # wrong frame count / no delimiter
            [b"not-empty", b"kv@a@m", seq_frame(0), b"x"],
            [b"", b"kv@a@m", b"\x01", batch_payload([])],  # bad seq frame
            [b"", b"kv@a@m", seq_frame(0), b"\xc1garbage"],  # bad payload
            [b"", b"kv@other@m", seq_frame(0), batch_payload([stored([77], None, toks(7))])],  # another pod
            end_marker(),
        ]

    bad = ReplayServer(garbage)
    silent = ReplayServer(None)
    try:
        # replay_retries=0: a silent endpoint is given up at once (with retries, "s"'s messages wait for
        # them: tests/test_writepath_faults.py), so the fallback to the next message is what is checked here
        with Pool(concurrency=1, replay_timeout=0.3, replay_retries=0) as p:
            # first message with seq > 0: the pool asks the replay endpoint for 0..
            p.pool.submit(msg("a", 5, batch_payload([GOOD_BLOCK]), Source(pod="a", replay=bad.endpoint)))
            p.pool.submit(msg("s", 5, batch_payload([stored([31], None, toks(3))]), Source(pod="s", replay=silent.endpoint)))
            assert p.pool.flush(60)
            s = p.pool.stats()
            assert s.errors_by_kind.get("replay_frames", 0) >= 2
            assert s.errors_by_kind.get("replay_timeout") == 1
            # the silent endpoint could not confirm "s"'s first message; its next message continues it,
            # the endpoint is asked once more, and without an answer that message alone starts the
            # stream (incomplete): the unchecked first one is never applied
            assert p.index.pods() == {"a"}
            unconfirmed = p.pool.stats().unconfirmed
            p.pool.submit(msg("s", 6, batch_payload([stored([32], None, toks(4))]), Source(pod="s", replay=silent.endpoint)))
            assert p.pool.flush(60)
            assert p.index.pods() == {"a", "s"}  # the live message was applied
            assert p.pool.stats().unconfirmed == unconfirmed + 1  # seq 5 was not
            assert not {(c.pod, c.complete) for c in p.pool.completeness()} & {("s", True)}
            assert "other" not in p.index.pods()
    finally:
        bad.close()
        silent.close()


def test_replay_endpoint_answering_forever_does_not_starve_the_shard():
    server = ReplayServer(lambda start: [[b"", b"kv@a@m", seq_frame(0), batch_payload([])]], forever=True)
    try:
        with Pool(concurrency=1, replay_timeout=0.5) as p:
            p.pool.submit(msg("a", 5, batch_payload([]), Source(pod="a", replay=server.endpoint)))
            p.pool.submit(msg("b", 0, batch_payload([GOOD_BLOCK])))
            ok = wait_until(lambda: "b" in p.index.pods(), 60)
            server.close()  # let the worker go before the pool stops
            assert ok, "pod b on the same shard was never applied"
    finally:
        server.close()


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")
def test_overflow_resync_error_does_not_kill_the_worker():
    server = ReplayServer(lambda start: [end_marker()])
    try:
        index = KVBlockIndex(tp())
        pool = EventPool(index, concurrency=1, queue_size=2, replay_timeout=0.5)
        src = Source(pod="a", replay=server.endpoint)
        assert pool.submit(msg("a", 2**64 - 3, batch_payload([]), src))
        assert pool.submit(msg("a", 2**64 - 2, batch_payload([]), src))
        assert not pool.submit(msg("a", 2**64 - 1, batch_payload([]), src))  # dropped: pod a marked for resync
        pool.start()
        try:
            wait_until(lambda: pool.stats().resyncs >= 1, 5)  # a pause for the resync, not a check (the pool may retry instead)
            time.sleep(0.2)
            pool.submit(msg("b", 0, batch_payload([GOOD_BLOCK])))
            assert wait_until(lambda: "b" in index.pods(), 30), "the shard worker died"
        finally:
            pool.stop(1.0)
    finally:
        server.close()


class GatedIndex(KVBlockIndex):
    """Writers of pod ``gated_pod`` wait at a gate: holds one shard busy."""

    def __init__(self, *a, gated_pod: str = "a", **kw) -> None:
        super().__init__(*a, **kw)
        self.gate = threading.Event()
        self.gated_pod = gated_pod
        self.entered = threading.Event()

    def block_stored(self, pod, *a, **kw):
        if pod == self.gated_pod:
            self.entered.set()
            self.gate.wait(20)
        return super().block_stored(pod, *a, **kw)


def test_flush_honours_its_timeout_when_a_queue_is_full():
    index = GatedIndex(tp())
    pool = EventPool(index, concurrency=1, queue_size=1)
    pool.start()
    try:
        pool.submit(msg("a", 0, batch_payload([GOOD_BLOCK])))
        assert index.entered.wait(30)
        assert pool.submit(msg("a", 1, batch_payload([])))  # the queue is now full
        result: list[bool] = []
        t = threading.Thread(target=lambda: result.append(pool.flush(0.3)), daemon=True)
        t.start()
        t.join(3)
        returned = not t.is_alive()
        index.gate.set()
        t.join(5)
        assert returned and result == [False]
    finally:
        index.gate.set()
        pool.stop(2.0)


# ============================================================ 3. restarts and lifecycle


def test_indexer_start_stop_start():
    ix = Indexer(Config.from_dict({"model_name": "m"}))
    ix.start()
    ix.stop()
    ix.start()
    try:
        assert ix.flush(60)
    finally:
        ix.stop()


def test_subscriber_start_stop_start_and_flush_while_stopped():
    ctx = zmq.Context.instance()
    pub = ctx.socket(zmq.PUB)
    pub.setsockopt(zmq.LINGER, 0)
    port = pub.bind_to_random_port("tcp://127.0.0.1")
    index = KVBlockIndex(tp())
    pool = EventPool(index, concurrency=1)
    with pytest.raises(RuntimeError):
        pool.flush(1)  # a clear error, not a hang
    pool.start()
    sub = Subscriber(pool, [EngineEndpoint(endpoint=f"tcp://127.0.0.1:{port}", pod="a")])
    try:
        for _ in range(3):
            sub.start()
            sub.stop()
        sub.start()
        assert wait_until(lambda: (pub.send_multipart([b"kv@a@m", seq_frame(0), batch_payload([GOOD_BLOCK])])
                                   or "a" in index.pods()), 10)
        sub.stop()
    finally:
        sub.stop()
        pool.stop()
        pub.close(linger=0)


def test_subscriber_start_after_a_failed_start():
    ctx = zmq.Context.instance()
    blocker = ctx.socket(zmq.PUB)
    blocker.setsockopt(zmq.LINGER, 0)
    port = blocker.bind_to_random_port("tcp://127.0.0.1")
    pool = EventPool(KVBlockIndex(tp()), concurrency=1)
    pool.start()
    sub = Subscriber(pool, bind=f"tcp://127.0.0.1:{port}")
    try:
        with pytest.raises(zmq.ZMQError):
            sub.start()
        blocker.close(linger=0)
        fresh = Subscriber(pool, bind=f"tcp://127.0.0.1:{port}")
        assert wait_until(lambda: _starts(fresh), 30), "port not free again"
        fresh.stop()
        assert wait_until(lambda: _starts(sub), 30)  # the address is free again (closing is asynchronous)
        sub.stop()
    finally:
        sub.stop()
        pool.stop()


def _starts(sub: Subscriber) -> bool:
    try:
        sub.start()
        return True
    except zmq.ZMQError:
        return False


SEED = "vllm-none-hash"


def sim(pod: str, replay: bool = True, capacity: int = 64) -> SimEngine:
    return SimEngine(pod=pod, endpoint=LOOPBACK, capacity_blocks=capacity,
                     replay_endpoint=LOOPBACK if replay else None, block_size=16, hash_seed=SEED,
                     hash_algo="sha256", model="m")


def compat_indexer(engines: list[SimEngine], **kv) -> Indexer:
    return Indexer(Config.from_dict({
        "model_name": "m",
        "token_processor_config": {"block_size": 16, "algorithm": "vllm_sha256"},
        "kv_events_config": {"concurrency": 2, "replay_timeout": 1.0, **kv, "engines": [
            {"pod": e.pod, "endpoint": e.endpoint, "replay_endpoint": e.replay_endpoint} for e in engines]},
    }))


def synced(ix: Indexer, e: SimEngine, timeout: float = 60.0) -> bool:
    """Wait until the index holds exactly what the engine caches."""
    return wait_until(lambda: ix.index.pod_keys(e.pod) == set(e.cached_blocks()), timeout)


def joined(ix: Indexer, e: SimEngine) -> bool:
    """Beat PUB/SUB's slow joiner: until the subscription reaches the engine, what it publishes is
    lost with nobody knowing; reset its (empty) cache until the pool has its stream."""
    return wait_until(lambda: (e.reset_prefix_cache(), any(s.pod == e.pod for s in ix.completeness()))[1], 60)


def test_engine_restarting_repeatedly_index_follows():
    e = sim("pod-a")
    rnd = random.Random(1)
    try:
        with compat_indexer([e]) as ix:
            assert ix.flush(60) and joined(ix, e)
            for round_ in range(4):
                for _ in range(3):
                    e.serve([rnd.randrange(1, 5000) for _ in range(16 * rnd.randint(1, 4))])
                assert synced(ix, e), f"round {round_}: index != engine"
                restarts = ix.stats().events.restarts
                e.restart()
                # the restarted engine publishes seq 0 again; keep it busy until the index notices
                deadline = time.monotonic() + 60
                while ix.stats().events.restarts == restarts and time.monotonic() < deadline:
                    e.reset_prefix_cache()
                    time.sleep(0.05)
                assert ix.stats().events.restarts > restarts
                assert synced(ix, e)
            assert ix.stats().events.errors_by_kind.get("internal", 0) == 0
    finally:
        e.close()


def test_remove_and_add_engine_while_traffic_flows():
    a, b = sim("pod-a"), sim("pod-b")
    stop = threading.Event()
    errors: list[BaseException] = []
    rnd = random.Random(2)

    def traffic() -> None:
        try:
            while not stop.is_set():
                for e in (a, b):
                    e.serve([rnd.randrange(1, 3000) for _ in range(16 * rnd.randint(1, 3))])
                time.sleep(0.002)
        except BaseException as exc:  # noqa: BLE001
            errors.append(exc)

    try:
        with compat_indexer([a, b]) as ix:
            t = threading.Thread(target=traffic, daemon=True)
            t.start()
            try:
                for _ in range(3):
                    assert wait_until(lambda: "pod-a" in ix.index.pods(), 60)
                    ix.remove_engine("pod-a")
                    assert wait_until(lambda: (ix.flush(5) and "pod-a" not in ix.index.pods()), 60)
                    ix.add_engine(EngineEndpoint(endpoint=a.endpoint, pod="pod-a", replay_endpoint=a.replay_endpoint))
            finally:
                stop.set()
                t.join(10)
            assert not errors
            assert synced(ix, a) and synced(ix, b)
            assert ix.stats().events.errors_by_kind.get("internal", 0) == 0
    finally:
        a.close()
        b.close()


def test_dp_ranks_and_seq_jumps_through_the_pool():
    with Pool(concurrency=2) as p:
        for rank in (0, 1):
            p.pool.submit(msg("a", 0, batch_payload([stored([11], None, toks(1))], dp_rank=rank)))
        # rank 1 restarts (seq back to 0) and stores another block; rank 0 jumps forward (a gap, no replay)
        p.pool.submit(msg("a", 0, batch_payload([stored([12], None, toks(2))], dp_rank=1)))
        p.pool.submit(msg("a", 10**12, batch_payload([stored([13], 11, toks(3))], dp_rank=0)))
        assert p.pool.flush(60)
        # without replay endpoints neither is taken before the stream's next message confirms it
        s = p.pool.stats()
        assert s.restarts == 0 and s.gaps == 1 and s.gaps_unrecovered == 0
        assert p.index.lookup(p.index.token_processor.request_keys(toks(2), model="m"))[0] == ()
        p.pool.submit(msg("a", 1, batch_payload([], dp_rank=1)))
        p.pool.submit(msg("a", 10**12 + 1, batch_payload([], dp_rank=0)))
        assert p.pool.flush(60)
        s = p.pool.stats()
        assert s.restarts == 1 and s.gaps == 1 and s.gaps_unrecovered == 1
        assert p.index.pod_keys("a", 0) and p.index.pod_keys("a", 1)
        rk1 = p.index.token_processor.request_keys(toks(1), model="m")
        entries = p.index.lookup(rk1)[0]
        assert [(e.pod, e.dp_rank) for e in entries] == [("a", 0)]  # rank 1's old copy went with its restart


def test_hundreds_of_engine_ranks_can_be_subscribed():
    cfg = Config.from_dict({"model_name": "m", "kv_events_config": {"engines": [
        {"pod": f"pod-{i}", "endpoint": f"tcp://127.0.0.1:{30000 + i}"} for i in range(400)]}})
    ix = Indexer(cfg)
    try:
        ix.start()
    finally:
        ix.stop()


# ============================================================ 4. concurrency


def test_concurrent_readers_never_see_a_prefix_longer_than_held():
    """One pod's path grows and shrinks while readers match it; pod b holds a fixed 3-block prefix."""
    n_blocks = 12
    path = list(range(n_blocks * BS))
    ehash = list(range(1, n_blocks + 1))
    with Pool(concurrency=2) as p:
        index = p.index
        rk = index.token_processor.request_keys(path, model="m")
        p.pool.submit(msg("b", 0, batch_payload([stored(ehash[:3], None, path[: 3 * BS])])))
        assert p.pool.flush(60)
        stop = threading.Event()
        errors: list[str] = []
        max_a = [0]

        def reader() -> None:
            while not stop.is_set():
                try:
                    m = index.prefix_match(rk)
                    la = len(m.get("a", ()))
                    if la > n_blocks or len(m.get("b", ())) != 3 or set(m) - {"a", "b"}:
                        errors.append(f"bad match {m}")
                    max_a[0] = max(max_a[0], la)
                    for entries in index.lookup(rk[:1]):
                        if {e.pod for e in entries} - {"a", "b"}:
                            errors.append(f"bad lookup {entries}")
                    index.stats()
                    p.pool.stats()
                except Exception as exc:  # noqa: BLE001
                    errors.append(repr(exc))

        readers = [threading.Thread(target=reader, daemon=True) for _ in range(3)]
        for t in readers:
            t.start()
        seq = 0
        rnd = random.Random(3)
        for _ in range(150):
            k = rnd.randint(1, n_blocks)
            p.pool.submit(msg("a", seq, batch_payload([stored(ehash[:k], None, path[: k * BS])])))
            seq += 1
            cut = rnd.randint(0, k)
            p.pool.submit(msg("a", seq, batch_payload([removed_event(ehash[cut:k])])))
            seq += 1
            if rnd.random() < 0.1:
                p.pool.submit(msg("a", seq, batch_payload([cleared_event()])))
                seq += 1
        assert p.pool.flush(60)
        stop.set()
        for t in readers:
            t.join(5)
        assert not errors, errors[:3]
        assert p.pool.stats().decode_errors == 0


# ============================================================ 5. bounds


def test_orphan_flood_stays_bounded():
    with Pool(concurrency=1, max_orphan_blocks=100) as p:
        for i in range(5000):
            p.pool.submit(msg("a", i, batch_payload([stored([10**6 + i], 5 * 10**6 + i, toks(i % 50))])))
        assert p.pool.flush(30)
        s = p.index.stats()
        assert s.orphan_blocks <= 100 and s.keys == 0
        assert s.orphans == 5000 and s.orphans_dropped >= 4900


def test_unique_key_flood_respects_capacity():
    with Pool(concurrency=1, capacity=500) as p:
        for i in range(3000):
            p.pool.submit(msg("a", i, batch_payload([stored([i + 1], None, toks(i))])))
        assert p.pool.flush(30)
        s = p.index.stats()
        assert s.keys <= 500 and s.evictions >= 2500 and s.engine_keys <= 500


def test_speculative_ttl_edge_cases():
    now = [0.0]
    index = KVBlockIndex(tp(), clock=lambda: now[0])
    for ttl in (0, -1, float("nan")):
        with pytest.raises(ValueError):
            index.add_speculative([1], "a", ttl)
    index.add_speculative(range(10**5), "a", 1e-9)  # huge list, tiny ttl
    now[0] += 1.0
    assert index.prefix_match([0, 1]) == {}
    assert index.stats().speculative == 0


def test_repeated_speculative_marks_of_the_same_keys_stay_bounded():
    index = KVBlockIndex(tp())
    keys = list(range(2000))
    index.add_speculative(keys, "a", 3600.0)
    gc.collect()
    tracemalloc.start()
    try:
        base = tracemalloc.get_traced_memory()[0]
        for _ in range(100):
            index.add_speculative(keys, "a", 3600.0)
        grown = tracemalloc.get_traced_memory()[0] - base
    finally:
        tracemalloc.stop()
    assert index.stats().speculative == 2000
    assert grown < 1_000_000, f"{grown} bytes for re-marking the same 2000 keys"


def test_queue_overflow_is_counted_not_raised():
    index = GatedIndex(tp())
    pool = EventPool(index, concurrency=1, queue_size=5)
    pool.start()
    try:
        pool.submit(msg("a", 0, batch_payload([GOOD_BLOCK])))
        assert index.entered.wait(30)
        results = [pool.submit(msg("a", i, batch_payload([]))) for i in range(1, 100)]
        assert results.count(True) == 5
        assert pool.stats().dropped_messages == 94
    finally:
        index.gate.set()
        pool.stop(2.0)


# ============================================================ 6. API misuse


@pytest.mark.parametrize("tokens", ["abc", b"abcd" * 8, None, 5, [1.5] * 32, [-1] * 32, [2**70] * 32,
                                    np.zeros((2, 16), dtype=np.int64), np.zeros(32), {1: 2}, (i for i in range(32))])
def test_score_rejects_bad_tokens_with_type_or_value_error(tokens):
    ix = Indexer(Config.from_dict({"model_name": "m"}))
    with pytest.raises((TypeError, ValueError)):
        ix.score(tokens)


def test_score_rejects_a_str_pods_argument_and_short_prompts_are_fine():
    ix = Indexer(Config.from_dict({"model_name": "m"}))
    with pytest.raises(TypeError):
        ix.score(list(range(32)), "pod-a")
    r = ix.score([1, 2, 3], ["a"])
    assert r.request_blocks == 0 and r.prefix["a"].matched_blocks == 0


def test_update_load_rejects_a_non_snapshot():
    ix = Indexer(Config.from_dict({"model_name": "m"}))
    with pytest.raises(TypeError):
        ix.update_load("a", 5)  # type: ignore[arg-type]
    ix.update_load("b", LoadSnapshot())
    assert ix.score(list(range(32))).pod is not None


@pytest.mark.parametrize("loads", [[1], {"a": 5}])
def test_score_rejects_bad_loads_with_type_error(loads):
    ix = Indexer(Config.from_dict({"model_name": "m"}))
    with pytest.raises(TypeError):
        ix.score(list(range(32)), ["a"], loads=loads)


@pytest.mark.parametrize("pods", [b"ab", [1, 2], [None]])
def test_score_rejects_non_str_pod_ids(pods):
    ix = Indexer(Config.from_dict({"model_name": "m"}))
    with pytest.raises(TypeError):
        ix.score(list(range(32)), pods)


@pytest.mark.parametrize("cfg", [
    {"kv_events_config": {"concurrency": 0}},
    {"kv_events_config": {"queue_size": 0}},
    {"kv_block_index_config": {"in_memory_config": {"size": 0}}},
    {"kv_block_index_config": {"in_memory_config": {"max_orphan_blocks": -1}}},
    {"token_processor_config": {"block_size": 0}},
    {"token_processor_config": {"block_size": True}},
    {"token_processor_config": {"hash_seed": -1}},
    {"scorer_config": {"weights": {"prefix": float("nan")}}},
    {"scorer_config": {"tier_weights": {"gpu": -1.0}}},
    {"kv_events_config": {"engines": [{"pod": "a", "endpoint": "tcp://127.0.0.1:1", "dp_size": 0}]}},
    {"no_such_key": 1},
])
def test_bad_config_raises_value_or_type_error(cfg):
    with pytest.raises((ValueError, TypeError)):
        Indexer(Config.from_dict(cfg))


@pytest.mark.parametrize("cfg", [
    {"kv_events_config": {"engines": [{"pod": "a", "endpoint": "tcp://127.0.0.1:1", "engine": "foo"}]}},
    {"kv_events_config": {"engine": "foo"}},
    {"kv_events_config": {"replay_timeout": float("inf")}},
    {"kv_events_config": {"replay_timeout": -1.0}},
    {"scorer_config": {"speculative_ttl": float("inf")}},
])
def test_bad_config_values_rejected_clearly(cfg):
    with pytest.raises(ValueError, match=r"engine|replay_timeout|speculative_ttl"):
        Indexer(Config.from_dict(cfg))


def test_remove_engine_with_a_full_shard_does_not_stall_other_pods():
    index = GatedIndex(tp(), gated_pod="a")
    pool = EventPool(index, concurrency=2, queue_size=1)
    b_pod = next(f"b{i}" for i in range(100) if pool.shard_of(f"b{i}") != pool.shard_of("a"))
    ctx = zmq.Context.instance()
    pubs = {}
    for pod in ("a", b_pod):
        s = ctx.socket(zmq.PUB)
        s.setsockopt(zmq.LINGER, 0)
        pubs[pod] = (s, s.bind_to_random_port("tcp://127.0.0.1"))
    pool.start()
    sub = Subscriber(pool, [EngineEndpoint(endpoint=f"tcp://127.0.0.1:{port}", pod=pod) for pod, (_, port) in pubs.items()])
    sub.start()
    try:
        for pod, (s, _) in pubs.items():  # slow joiner
            assert wait_until(lambda: (s.send_multipart([f"kv@{pod}@m".encode(), seq_frame(0),
                                                         batch_payload([cleared_event()])])
                                       or any(p == pod for p, _, _ in pool.streams())), 30)
        pa = pubs["a"][0]
        pa.send_multipart([b"kv@a@m", seq_frame(1), batch_payload([stored([1], None, toks(1))])])
        assert index.entered.wait(30)  # the worker holds seq 1 at the gate; seq 2 fills the queue
        for seq in (2, 3):
            pa.send_multipart([b"kv@a@m", seq_frame(seq), batch_payload([stored([seq], None, toks(seq))])])
        assert wait_until(lambda: pool.stats().queued >= 1, 30)
        sub.remove_engine("a")
        time.sleep(0.3)
        pb = pubs[b_pod][0]
        ok = wait_until(lambda: (pb.send_multipart([f"kv@{b_pod}@m".encode(), seq_frame(1),
                                                    batch_payload([GOOD_BLOCK])]) or b_pod in index.pods()), 30)
        assert ok, "the subscriber thread is stuck"
    finally:
        index.gate.set()
        sub.stop()
        pool.stop(2.0)
        for s, _ in pubs.values():
            s.close(linger=0)
