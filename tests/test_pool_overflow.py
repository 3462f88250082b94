"""The pool's overflow policy: a full shard queue drops the message, counts it,
and the pod is resynced from the engine's replay buffer once the shard is idle."""

from __future__ import annotations

import threading
import time

import zmq

from examples.simfleet import SimEngine
from kvevents.pool import EventPool, RawMessage, Source
from kvindex.reference import KVBlockIndex
from kvindex.keys import TokenProcessor

BS = 16


def capture(sub: zmq.Socket, n: int, timeout: float = 60.0) -> list[list[bytes]]:
    out = []
    deadline = time.monotonic() + timeout
    while len(out) < n:
        assert time.monotonic() < deadline, f"only {len(out)} of {n} messages arrived"
        if sub.poll(100):
            out.append(sub.recv_multipart())
    return out


class GatedIndex(KVBlockIndex):
    """An index whose writers wait at a gate: lets the test hold a shard busy."""

    def __init__(self, *a, **kw) -> None:
        super().__init__(*a, **kw)
        self.gate = threading.Event()
        self.gate.set()

    def block_stored(self, *a, **kw):
        assert self.gate.wait(20)
        return super().block_stored(*a, **kw)


def test_full_queue_drops_counts_and_resyncs_from_replay():
    engine = SimEngine(pod="pod-a", model="m", endpoint="tcp://127.0.0.1:*", replay_endpoint="tcp://127.0.0.1:*",
                       capacity_blocks=64, block_size=BS, hash_seed="vllm-none-hash", hash_algo="sha256")
    ctx = zmq.Context.instance()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(engine.endpoint)
    index = GatedIndex(TokenProcessor(block_size=BS, algorithm="vllm_sha256"))
    pool = EventPool(index, concurrency=1, queue_size=3)
    source = Source(pod="pod-a", replay=engine.replay_endpoint, model="m")
    pool.start()
    try:
        deadline = time.monotonic() + 10
        while not sub.poll(50):  # slow joiner: a reset of the empty cache until one arrives
            assert time.monotonic() < deadline
            engine.reset_prefix_cache()
        for f in capture(sub, 1):
            pool.submit(RawMessage(source, *f))
        assert pool.flush(10)  # the stream is known: later messages are contiguous
        while sub.poll(50):
            pool.submit(RawMessage(source, *sub.recv_multipart()))
        assert pool.flush(10)

        prompts = [[(i * 7919 + j) % 30_000 for j in range(BS * (2 + i % 3))] for i in range(6)]
        for p in prompts:
            engine.serve(p)
        frames = capture(sub, len(prompts))
        index.gate.clear()
        assert pool.submit(RawMessage(source, *frames[0]))
        deadline = time.monotonic() + 10
        while pool.stats().queued:  # the worker took it and waits at the gate
            assert time.monotonic() < deadline
            time.sleep(0.005)
        accepted = [pool.submit(RawMessage(source, *f)) for f in frames[1:]]
        assert accepted == [True, True, True, False, False]  # 3 fill the queue, the last 2 are dropped
        dropped = 2
        assert pool.stats().dropped_messages == dropped
        index.gate.set()
        assert pool.flush(10)
        st = pool.stats()
        assert st.resyncs == 1 and st.replayed_batches >= dropped
        assert st.gaps == 0 and st.gaps_unrecovered == 0
        assert set(index.pod_keys("pod-a")) == set(engine.cached_blocks())
        for p in prompts:
            keys = index.token_processor.request_keys(p)
            assert len(index.prefix_match(keys, ["pod-a"]).get("pod-a", [])) == len(keys)
    finally:
        index.gate.set()
        pool.stop()
        sub.close(linger=0)
        engine.close()


def test_drop_then_next_seq_of_a_restarted_engine_is_checked_before_it_is_applied():
    """An unnoticed restart whose first batches are dropped by a full queue is still caught.

    The engine restarts behind the router's back; its new process's batches
    0..6 are dropped (the shard is busy), and the first one the queue takes
    carries seq 7 = our last applied seq + 1, with a newer engine time, and
    reaches the worker before the shard is ever idle.  A known drop means an
    in-sequence seq proves nothing: the stream must be checked against the
    engine's replay buffer before it is applied, or the old process's blocks
    stay in the index for good (the idle resync would then verify against
    the new process's own batch and pass).
    """
    import random

    from tests.engine_model import ModelEngine, Paths, ReplayServer

    paths = Paths.make(5, block_size=4, n_paths=8, n_blocks=5)
    tp = TokenProcessor(block_size=4, hash_seed=3)
    rk2ek = paths.rk_to_ek(tp, "m")
    old = ModelEngine("pod-a", "m", 0, paths, buffer_steps=100, capacity=64)
    other = ModelEngine("pod-a", "m", 1, paths, buffer_steps=100, capacity=64)
    server = ReplayServer([old, other])
    index = GatedIndex(tp, capacity=10_000)
    entered = threading.Semaphore(0)
    permits = threading.Semaphore(0)
    gating = threading.Event()

    def gate(pod, rank, model, ev):  # the worker waits here for one permit per BlockStored
        if gating.is_set():
            entered.release()
            assert permits.acquire(timeout=20)

    pool = EventPool(index, concurrency=1, queue_size=3)
    pool.add_store_observer(gate)
    pool.start()
    rnd = random.Random(1)

    def store(e: ModelEngine):
        events = e._store(rnd)
        assert events
        return RawMessage(Source(pod="pod-a", replay=server.endpoint(e), model="m"), *e.publish(events))

    def view(rank: int):
        out = set()
        for rk, entries in zip(rk2ek, index.lookup(list(rk2ek))):
            out |= {(rk2ek[rk], x.tier) for x in entries if x.dp_rank == rank and not x.speculative}
        return out

    try:
        for e in [old] * 6 + [other]:  # the old process: seq 0..5, applied
            assert pool.submit(store(e))
            assert pool.flush(10)
        assert view(0) == old.view() and view(0)
        gating.set()
        assert pool.submit(store(old))  # seq 6: the worker takes it and waits in the gate
        assert entered.acquire(timeout=10)
        for _ in range(3):  # the other rank's messages fill the queue
            assert pool.submit(store(other))
        old.restart()  # unnoticed: no disconnect
        assert not any(pool.submit(store(old)) for _ in range(7))  # the new process's seq 0..6: dropped
        permits.release()  # seq 6 of the old process is applied; the worker takes the next message
        assert entered.acquire(timeout=10)
        assert pool.submit(store(old))  # the new process's seq 7: a free slot, queued before any idle moment
        gating.clear()
        for _ in range(8):
            permits.release()
        assert pool.flush(10)
        got, want = view(0), old.view()
        assert got <= want, f"holds blocks the engine does not: {sorted(got - want)}"
        st = {s.dp_rank: s for s in pool.completeness()}[0]
        assert st.complete and got == want, st
        assert pool.stats().restarts >= 1
    finally:
        gating.clear()
        for _ in range(20):
            permits.release()
        pool.stop()
        server.close()
