"""Overload scenarios of the write path on real ZMQ sockets (used by tests/test_overload.py and bench/overload.py).

- :func:`publisher_burst`: one engine publishes a burst of pre-encoded
  batches faster than the pool applies them.  The pool's overflow policy drops
  what does not fit its queue (counted), marks the stream for resync, and
  once the shard is idle replays the engine's buffer from the last applied
  seq.  Measured: drops, resyncs, and the time from the burst's last message
  until the stream is complete and the index equals the engine's blocks.
- :func:`replay_burst`: an engine already published more batches than the
  replay sockets' high-water marks hold (its ROUTER drops replies it cannot
  queue, as vLLM's does) when the router starts; the start-up replay arrives
  with a hole.  The sequencer notices it and asks again from the hole.
  Measured: holes, replays, time until complete and equal.

Both build the engine from tests/engine_model.py (the oracle: its blocks per
tier) and the library's Subscriber + EventPool + index.
"""

from __future__ import annotations

import random
import time
from typing import NamedTuple

import zmq

from kvevents.pool import EventPool, PoolStats
from kvevents.sequencer import Sequencer
from kvevents.subscriber import EngineEndpoint, Subscriber
from kvindex.keys import TokenProcessor
from kvindex.contract import KVIndex
from kvindex.factory import make_index
from tests.engine_model import ModelEngine, Paths, ReplayServer, index_view


class Outcome(NamedTuple):
    """What one scenario did: counters, timings (seconds) and the final comparison with the engine."""

    messages: int
    stats: PoolStats
    publish_seconds: float
    converge_seconds: float | None  # from the last message until complete and equal; None: never (timeout)
    complete: bool
    extra: int  # block copies the index holds that the engine does not
    missing: int  # block copies the engine holds that the index does not


def _wait_equal(pool: EventPool, index: KVIndex, e: ModelEngine, rk2ek: dict[int, int], timeout: float) -> float | None:
    """Seconds until the stream is complete and the index equals the engine (polling), or None."""
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < timeout:
        c = pool.completeness(e.pod)
        if c and all(s.complete for s in c) and pool.stats().queued == 0 and index_view(index, e, rk2ek) == e.view():
            return time.perf_counter() - t0
        time.sleep(0.005)
    return None


def publisher_burst(n: int, *, queue_size: int = 64, block_size: int = 4, seed: int = 3, timeout: float = 60.0,
                    backend: str = "native") -> Outcome:
    """An engine publishes ``n`` batches as fast as ZMQ sends them into a pool whose shard holds ``queue_size``."""
    rnd = random.Random(seed)
    paths = Paths.make(seed, block_size=block_size, n_paths=30, n_blocks=8)
    tp = TokenProcessor(block_size=block_size, hash_seed=seed)
    rk2ek = paths.rk_to_ek(tp, "m")
    e = ModelEngine("burst", "m", 0, paths, buffer_steps=max(10_000, n + 10), capacity=64)
    e.clear_p = 0.0
    server = ReplayServer([e], sndhwm=0)
    ctx = zmq.Context.instance()
    pub = ctx.socket(zmq.PUB)
    pub.setsockopt(zmq.SNDHWM, 0)
    pub.setsockopt(zmq.LINGER, 0)
    port = pub.bind_to_random_port("tcp://127.0.0.1")
    index = make_index(backend, tp)
    pool = EventPool(index, concurrency=1, queue_size=queue_size, replay_timeout=5.0)
    sub = Subscriber(pool, [EngineEndpoint(endpoint=f"tcp://127.0.0.1:{port}", pod=e.pod,
                                           replay_endpoint=server.endpoint(e))])
    pool.start()
    sub.start()
    try:
        # join: publish until the subscription delivers and the stream is built
        deadline = time.monotonic() + 20
        while sub.received == 0:
            assert time.monotonic() < deadline, "the subscription never delivered"
            pub.send_multipart(e.publish([]))
            time.sleep(0.02)
        assert pool.flush(20)
        frames = [e.publish(e.random_events(rnd, 2)) for _ in range(n)]  # pre-encoded: sending is all that is left
        t0 = time.perf_counter()
        for f in frames:
            pub.send_multipart(f)
        t_pub = time.perf_counter() - t0
        conv = _wait_equal(pool, index, e, rk2ek, timeout)
        st = pool.stats()
        got, want = index_view(index, e, rk2ek), e.view()
        c = pool.completeness(e.pod)
        return Outcome(n, st, t_pub, conv, bool(c) and all(s.complete for s in c), len(got - want), len(want - got))
    finally:
        sub.stop()
        pool.stop()
        server.close()
        pub.close(linger=0)


def replay_burst(n: int, *, block_size: int = 128, sndhwm: int | None = None, sndbuf: int | None = None,
                 hole_retries: int | None = None,
                 seed: int = 4, replay_timeout: float = 1.0, timeout: float = 60.0,
                 backend: str = "native") -> Outcome:
    """The engine buffered ``n`` batches before the router starts; its start-up replay overflows the sockets.

    ``sndhwm``: the engine ROUTER's send high-water mark (None: ZMQ's 1000, as vLLM).  ``hole_retries``
    overrides :attr:`Sequencer.MAX_HOLE_RETRIES` for the run (0: a hole is taken as lost, the peer behaviour).
    """
    rnd = random.Random(seed)
    paths = Paths.make(seed, block_size=block_size, n_paths=40, n_blocks=8)
    tp = TokenProcessor(block_size=block_size, hash_seed=seed)
    rk2ek = paths.rk_to_ek(tp, "m")
    e = ModelEngine("late", "m", 0, paths, buffer_steps=max(n + 10, 10_000), capacity=200)
    e.clear_p = 0.0
    for _ in range(n):
        e.publish(e.random_events(rnd, 2))
    server = ReplayServer([e], sndhwm=sndhwm, sndbuf=sndbuf)
    ctx = zmq.Context.instance()
    pub = ctx.socket(zmq.PUB)
    pub.setsockopt(zmq.LINGER, 0)
    port = pub.bind_to_random_port("tcp://127.0.0.1")
    index = make_index(backend, tp)
    pool = EventPool(index, concurrency=1, replay_timeout=replay_timeout)
    sub = Subscriber(pool, [EngineEndpoint(endpoint=f"tcp://127.0.0.1:{port}", pod=e.pod,
                                           replay_endpoint=server.endpoint(e))])
    saved = Sequencer.MAX_HOLE_RETRIES
    if hole_retries is not None:
        Sequencer.MAX_HOLE_RETRIES = hole_retries
    t0 = time.perf_counter()
    try:
        pool.start()
        sub.start()  # connecting asks the engine's buffer from seq 0
        pool.flush(timeout)
        # one live message after the replay, as an engine keeps publishing
        deadline = time.monotonic() + 20
        before = sub.received
        while sub.received == before:
            assert time.monotonic() < deadline, "the subscription never delivered"
            pub.send_multipart(e.publish(e.random_events(rnd, 1)))
            time.sleep(0.05)
        t_last = time.perf_counter()
        conv = _wait_equal(pool, index, e, rk2ek, 2.0 if hole_retries == 0 else timeout)
        st = pool.stats()
        got, want = index_view(index, e, rk2ek), e.view()
        c = pool.completeness(e.pod)
        return Outcome(n, st, t_last - t0, None if conv is None else conv + (t_last - t0),
                       bool(c) and all(s.complete for s in c), len(got - want), len(want - got))
    finally:
        Sequencer.MAX_HOLE_RETRIES = saved
        sub.stop()
        pool.stop()
        server.close()
        pub.close(linger=0)
