"""A model of vLLM engines for write-path tests and the soak bench: what each engine holds, what it published.

:class:`ModelEngine` is one publisher (pod, model, DP rank) with the state the
index must converge to: its blocks per tier, its seq counter (from 0 per
process), and a replay buffer of its last ``buffer_steps`` batches, served
over a real ZMQ ROUTER socket by :class:`ReplayServer` exactly as vLLM's
``ZmqEventPublisher`` does (vllm/distributed/kv_events.py, vLLM 0.32):
``[b"", start_seq]`` in, ``[b"", topic, seq, payload]`` per buffered batch out,
then an end marker whose seq frame is eight 0xFF bytes.

Engine keys are a hash of the whole token path and do not depend on the model
(like vLLM's), so two models serving the same tokens on one pod publish the
same engine keys.  Each batch mutates the engine first, then is encoded with
the tests' own encoder (:mod:`tests.oracle`), independently of the library.
"""

from __future__ import annotations

import random
import threading
import zlib
from collections import deque
from dataclasses import dataclass

import zmq

from kvindex.keys import TokenProcessor
from tests.oracle import MEDIUM, batch_payload, cleared_event, engine_hash, removed_event, seq_frame, stored_event

END_SEQ = b"\xff" * 8


@dataclass(frozen=True)
class Paths:
    """Token paths engines cache blocks of; paths share leading blocks, like prompts with a common prefix."""

    block_size: int
    paths: tuple[tuple[int, ...], ...]

    @classmethod
    def make(cls, seed: int, block_size: int = 4, n_paths: int = 6, n_blocks: int = 6) -> Paths:
        rnd = random.Random(seed)
        base = [rnd.randrange(1, 50_000) for _ in range(3 * block_size)]
        out = []
        for p in range(n_paths):
            shared = base[: (p % 3) * block_size]
            out.append(tuple(shared + [rnd.randrange(1, 50_000) for _ in range(n_blocks * block_size - len(shared))]))
        return cls(block_size, tuple(out))

    def n_blocks(self, p: int) -> int:
        return len(self.paths[p]) // self.block_size

    def ek(self, p: int, i: int) -> int:
        return engine_hash(self.paths[p][: (i + 1) * self.block_size])

    def tokens(self, p: int, i: int, j: int) -> tuple[int, ...]:
        return self.paths[p][i * self.block_size : j * self.block_size]

    def rk_to_ek(self, tp: TokenProcessor, model: str | None) -> dict[int, int]:
        """Request key (ours, scoped by ``model``) -> engine key, for every block of every path."""
        out: dict[int, int] = {}
        for p, toks in enumerate(self.paths):
            for i, rk in enumerate(tp.request_keys(list(toks), model=model).tolist()):
                out[int(rk)] = self.ek(p, i)
        return out


class ModelEngine:
    """One engine process publishing KV events: blocks per tier, seq from 0, a replay buffer.

    Args:
        pod, model, dp_rank: the publisher; its topic is ``kv@<pod>@<model>``.
        paths: the token paths it caches blocks of.
        buffer_steps: batches its replay buffer keeps (vLLM's ``buffer_steps``).
        capacity: gpu blocks it holds at most (the oldest are evicted, with BlockRemoved).

    Thread safety: the replay server reads :meth:`buffered` from its thread;
    everything else is called from one thread.
    """

    def __init__(
        self, pod: str, model: str, dp_rank: int, paths: Paths, *, buffer_steps: int = 10_000, capacity: int = 24
    ) -> None:
        self.pod, self.model, self.dp_rank = pod, model, dp_rank
        self.paths = paths
        self.buffer_steps = buffer_steps
        self.capacity = capacity
        self.topic = f"kv@{pod}@{model}".encode()
        self.held: dict[int, set[str]] = {}  # engine key -> tiers
        self.order: dict[int, None] = {}  # gpu blocks, oldest first
        self.next_seq = 0
        self.generation = 0
        self.clock = 1_000.0 + zlib.crc32(self.topic + bytes([dp_rank % 256])) % 100_000  # engine wall-clock ts
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer_steps)
        self._lock = threading.Lock()
        self.bad_event_batches = 0  # batches with a malformed event since the last restart / clear
        self.clear_p = 0.03  # share of random operations that are a prefix-cache reset (AllBlocksCleared)

    def __repr__(self) -> str:
        return f"ModelEngine({self.pod!r}, {self.model!r}, {self.dp_rank})"

    # -- state

    def view(self) -> set[tuple[int, str]]:
        """(engine key, tier) of every block copy the engine holds."""
        return {(ek, t) for ek, ts in self.held.items() for t in ts}

    def buffered(self, start: int) -> list[tuple[bytes, bytes, bytes]]:
        """(topic, seq frame, payload) of the buffered batches with seq >= start."""
        with self._lock:
            return [(self.topic, seq_frame(s), p) for s, p in self._buffer if s >= start]

    def covers_everything(self) -> bool:
        """The replay buffer still holds every batch this process published."""
        return self.next_seq <= self.buffer_steps

    def restart(self) -> None:
        """A new engine process: an empty cache, seq back to 0, an empty replay buffer."""
        with self._lock:
            self._buffer.clear()
        self.held.clear()
        self.order.clear()
        self.next_seq = 0
        self.generation += 1
        self.clock += 1.0
        self.bad_event_batches = 0

    # -- publishing

    def publish(self, events: list, *, extra_raw: list | None = None) -> tuple[bytes, bytes, bytes]:
        """Encode a batch of events (already applied to the engine) and buffer it; returns its frames."""
        seq = self.next_seq
        self.next_seq += 1
        self.clock += 0.001
        evs = list(events)
        if extra_raw:
            for pos, raw in extra_raw:
                evs.insert(min(pos, len(evs)), raw)
        payload = batch_payload(evs, dp_rank=self.dp_rank, ts=round(self.clock, 6))
        with self._lock:
            self._buffer.append((seq, payload))
        return self.topic, seq_frame(seq), payload

    def random_events(self, rnd: random.Random, n_ops: int = 2) -> list:
        """Mutate the engine as a few random cache operations would; return their events in order."""
        events: list = []
        for _ in range(n_ops):
            r = rnd.random()
            if r < 0.55:
                events += self._store(rnd)
            elif r < 0.8:
                events += self._remove(rnd, "gpu")
            elif r < 0.9:
                events += self._offload(rnd)
            elif r < 1.0 - self.clear_p:
                events += self._remove(rnd, "cpu")
            else:
                self.held.clear()
                self.order.clear()
                self.bad_event_batches = 0
                events.append(cleared_event())
        return events

    def _gpu(self, ek: int) -> bool:
        return "gpu" in self.held.get(ek, ())

    def _store(self, rnd: random.Random) -> list:
        P = self.paths
        p = rnd.randrange(len(P.paths))
        i = 0
        while i < P.n_blocks(p) and self._gpu(P.ek(p, i)):
            i += 1
        if i == P.n_blocks(p):
            return []
        j = i
        while j < min(P.n_blocks(p), i + rnd.randint(1, 3)) and not self._gpu(P.ek(p, j)):
            j += 1
        eks = [P.ek(p, b) for b in range(i, j)]
        out = [stored_event(eks, P.ek(p, i - 1) if i else None, P.tokens(p, i, j), P.block_size, "gpu")]
        for ek in eks:
            self.held.setdefault(ek, set()).add("gpu")
            self.order[ek] = None
        evict = []
        while len(self.order) > self.capacity:
            old = next(iter(self.order))
            evict.append(old)
            self._drop(old, "gpu")
        if evict:
            out.append(removed_event(evict, "gpu"))
        return out

    def _drop(self, ek: int, tier: str) -> None:
        ts = self.held.get(ek)
        if ts is not None:
            ts.discard(tier)
            if not ts:
                del self.held[ek]
        if tier == "gpu":
            self.order.pop(ek, None)

    def _remove(self, rnd: random.Random, tier: str) -> list:
        cands = sorted(ek for ek, ts in self.held.items() if tier in ts)
        if not cands:
            return []
        eks = rnd.sample(cands, min(len(cands), rnd.randint(1, 3)))
        for ek in eks:
            self._drop(ek, tier)
        return [removed_event(eks, tier)]

    def _offload(self, rnd: random.Random) -> list:
        cands = sorted(ek for ek, ts in self.held.items() if "gpu" in ts and "cpu" not in ts)
        if not cands:
            return []
        eks = rnd.sample(cands, min(len(cands), rnd.randint(1, 2)))
        for ek in eks:
            self.held[ek].add("cpu")
        # the offloading connector's form: engine hashes and a medium, no tokens
        return [{"type": "BlockStored", "block_hashes": eks, "parent_block_hash": None, "token_ids": [],
                 "block_size": self.paths.block_size, "medium": MEDIUM["cpu"]}]


#: a BlockStored whose block_hashes are not hashes: decodes as a malformed event of a valid batch
MALFORMED_EVENT = {"type": "BlockStored", "block_hashes": [1.5], "parent_block_hash": None,
                   "token_ids": [], "block_size": 4}


def index_view(index, e: ModelEngine, rk2ek: dict[int, int]) -> set[tuple[int, str]]:
    """What ``index`` claims engine ``e`` (its pod and DP rank) holds, as (engine key, tier)
    pairs comparable with :meth:`ModelEngine.view`; ``rk2ek`` maps the request keys to look
    up to their engine keys.  Speculative entries are not the engine's."""
    keys = list(rk2ek)
    out = set()
    for rk, entries in zip(keys, index.lookup(keys)):
        for x in entries:
            if x.pod == e.pod and x.dp_rank == e.dp_rank and not x.speculative:
                out.add((rk2ek[rk], x.tier))
    return out


class ReplayServer:
    """vLLM's replay service for a set of model engines, on real ZMQ ROUTER sockets (one per engine).

    ``endpoint(engine)`` is the ``tcp://127.0.0.1:PORT`` a DEALER connects to.
    One thread polls every socket.  :meth:`pause` makes an engine's endpoint
    take requests without answering them (an engine too busy to serve its
    replay socket, or one whose replies are all lost) until :meth:`resume`.
    """

    def __init__(
        self, engines: list[ModelEngine], context: zmq.Context | None = None, sndhwm: int | None = None,
        sndbuf: int | None = None,
    ) -> None:
        self._ctx = context or zmq.Context.instance()
        self._sndhwm = sndhwm  # the ROUTER's send high-water mark (None: ZMQ's default, 1000, as vLLM's)
        self._sndbuf = sndbuf  # the kernel's send buffer of each socket in bytes (None: the system's)
        self._socks: dict[zmq.Socket, ModelEngine] = {}
        self._eps: dict[int, str] = {}
        self._paused: set[int] = set()  # id() of engines whose requests go unanswered
        for e in engines:
            self.add(e)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="replay-server", daemon=True)
        self._lock = threading.Lock()
        self._thread.start()

    def add(self, e: ModelEngine) -> str:
        s = self._ctx.socket(zmq.ROUTER)
        s.setsockopt(zmq.LINGER, 0)
        if self._sndhwm is not None:
            s.setsockopt(zmq.SNDHWM, self._sndhwm)
        if self._sndbuf is not None:
            s.setsockopt(zmq.SNDBUF, self._sndbuf)
        s.bind("tcp://127.0.0.1:*")
        self._socks[s] = e
        self._eps[id(e)] = s.getsockopt_string(zmq.LAST_ENDPOINT)
        return self._eps[id(e)]

    def endpoint(self, e: ModelEngine) -> str:
        return self._eps[id(e)]

    def pause(self, e: ModelEngine) -> None:
        """From now on ``e``'s requests are taken and dropped: the asker times out."""
        self._paused.add(id(e))

    def resume(self, e: ModelEngine) -> None:
        """``e``'s endpoint answers again (requests dropped meanwhile stay unanswered)."""
        self._paused.discard(id(e))

    def paused(self, e: ModelEngine) -> bool:
        return id(e) in self._paused

    def _run(self) -> None:
        poller = zmq.Poller()
        for s in self._socks:
            poller.register(s, zmq.POLLIN)
        while not self._stop.is_set():
            for s, _ev in poller.poll(20):
                frames = s.recv_multipart()
                if len(frames) != 3 or frames[1] != b"" or len(frames[2]) != 8:
                    continue
                ident, start = frames[0], int.from_bytes(frames[2], "big")
                if id(self._socks[s]) in self._paused:
                    continue
                for topic, seq, payload in self._socks[s].buffered(start):
                    s.send_multipart([ident, b"", topic, seq, payload])
                s.send_multipart([ident, b"", self._socks[s].topic, END_SEQ, b""])

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
        for s in self._socks:
            s.close(linger=0)

