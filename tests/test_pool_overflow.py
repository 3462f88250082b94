"""The pool's overflow policy: a full shard queue drops the message, counts it,
and the pod is resynced from the engine's replay buffer once the shard is idle."""

from __future__ import annotations

import threading
import time

import zmq

from examples.simfleet import SimEngine
from kvevents.pool import EventPool, RawMessage, Source
from kvindex.index import KVBlockIndex
from kvindex.keys import TokenProcessor

BS = 16


def capture(sub: zmq.Socket, n: int, timeout: float = 10.0) -> list[list[bytes]]:
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
