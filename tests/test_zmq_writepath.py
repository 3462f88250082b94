"""The write path over real ZMQ on loopback: simulated vLLM engines -> Subscriber -> EventPool -> index.

The oracle is each engine's own cache state (``SimEngine.cached_blocks`` and
``SimEngine.lookup``).  Two key modes:

- engine-compatible (``vllm_sha256`` with the engines' seed): request keys are
  the engine keys, so the index is compared with ``cached_blocks`` directly;
- ``xxh3_chain`` (the default): request keys are chained from token ids, so
  engine hashes are mapped to request keys through the prompts served, and
  every prompt's prefix match is compared with the engine's own prefix hit.

Every wait is a poll loop with a deadline (:func:`wait_until`).  ZMQ's slow
joiner is handled by publishing state-neutral warm-up batches (a prefix-cache
reset of an empty engine) until the pool has seen the stream, or by the
bootstrap replay from seq 0.
"""

from __future__ import annotations

import random
import socket
import threading
import time
from collections.abc import Callable, Iterator, Sequence, Set
from typing import Any

import pytest

from examples.simfleet import SimEngine, block_digests, digest_to_uint64
from kvevents.pool import EventPool, PoolStats, RawMessage, Source
from kvevents.subscriber import EngineEndpoint, Subscriber
from kvindex.reference import KVBlockIndex
from kvindex.keys import TokenProcessor
from kvindex.tiers import tier_bit
from tests.oracle import batch_payload, seq_frame, stored_event

BS = 16
MODEL = "sim-model"
SEED = "vllm-none-hash"  # the engines' NONE_HASH seed: vLLM's default, so compat keys match
GPU_BIT = tier_bit("gpu")
LOOPBACK = "tcp://127.0.0.1:*"
MODES = ["compat", "chain"]

View = dict[int, frozenset[str]]


def make_tp(mode: str) -> TokenProcessor:
    if mode == "compat":
        return TokenProcessor(block_size=BS, algorithm="vllm_sha256")
    return TokenProcessor(block_size=BS, hash_seed=7)


def wait_until(pred: Callable[[], bool], what: str, timeout: float = 60.0) -> None:
    """Poll ``pred`` until it holds; fail (never hang) after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while not pred():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(0.005)


def engine_hashes(tokens: Sequence[int]) -> list[int]:
    """The uint64 block hashes every engine of these tests computes for ``tokens``."""
    return [digest_to_uint64(d) for d in block_digests(tokens, BS, SEED, "sha256")]


class Prompts:
    """Deterministic prompts that share prefixes (whole blocks) and end in a partial block."""

    def __init__(self, seed: int) -> None:
        self.rnd = random.Random(seed)
        self.prefixes = [self.tokens(self.rnd.randint(1, 3) * BS) for _ in range(3)]

    def tokens(self, n: int) -> list[int]:
        return [self.rnd.randrange(1, 50_000) for _ in range(n)]

    def next(self, max_tail_blocks: int = 3) -> list[int]:
        head = self.rnd.choice(self.prefixes)
        tail = self.tokens(self.rnd.randint(1, max_tail_blocks) * BS + self.rnd.randrange(BS))
        return head + tail


class Rig:
    """Engines in this process, plus the consumer: Subscriber -> EventPool -> KVBlockIndex."""

    def __init__(self, mode: str, *, concurrency: int = 2) -> None:
        self.mode = mode
        self.tp = make_tp(mode)
        self.index = KVBlockIndex(self.tp, capacity=1_000_000)
        self.pool = EventPool(self.index, concurrency=concurrency, replay_timeout=2.0)
        self.pool.start()
        self.sub: Subscriber | None = None
        self.engines: list[SimEngine] = []
        self.served: dict[str, list[list[int]]] = {}  # pod -> prompts served there

    # -- set-up

    def engine(self, pod: str, *, replay: bool = True, capacity: int = 24, **kw: Any) -> SimEngine:
        e = SimEngine(
            pod=pod, endpoint=LOOPBACK, capacity_blocks=capacity, replay_endpoint=LOOPBACK if replay else None,
            block_size=BS, hash_seed=SEED, hash_algo="sha256", model=MODEL, **kw,
        )
        self.engines.append(e)
        return e

    @staticmethod
    def endpoint_of(e: SimEngine) -> EngineEndpoint:
        return EngineEndpoint(
            endpoint=e.endpoint, pod=e.pod, replay_endpoint=e.replay_endpoint,
            dp_rank=e.dp_rank or 0, model=MODEL,
        )

    def subscribe(self, engines: Sequence[SimEngine] = (), **kw: Any) -> Subscriber:
        self.sub = Subscriber(self.pool, [self.endpoint_of(e) for e in engines], **kw)
        self.sub.start()
        return self.sub

    def close(self) -> None:
        if self.sub is not None:
            self.sub.stop()
        self.pool.stop()
        for e in self.engines:
            e.close()

    # -- driving

    def serve(self, e: SimEngine, tokens: list[int]) -> int:
        self.served.setdefault(e.pod, []).append(tokens)
        return e.serve(tokens)

    def last_seq(self, pod: str, rank: int = 0) -> int | None:
        for p, r, last in self.pool.streams():
            if p == pod and r == rank:
                return last
        return None

    def join(self, e: SimEngine) -> None:
        """Beat the slow joiner: publish state-neutral batches until the pool has seen one.

        The engine's cache must be empty (a reset of an empty cache changes nothing).
        """
        assert e.stats().gpu_blocks == 0
        deadline = time.monotonic() + 15.0
        rank = e.dp_rank or 0
        while self.last_seq(e.pod, rank) is None:
            assert time.monotonic() < deadline, f"pod {e.pod} rank {rank}: no message arrived"
            e.reset_prefix_cache()
            inner = time.monotonic() + 0.2
            while self.last_seq(e.pod, rank) is None and time.monotonic() < inner:
                time.sleep(0.005)

    def sync(self, *engines: SimEngine) -> None:
        """Wait until the pool applied every batch each engine published, then flush."""
        for e in engines:
            n = e.stats().next_seq
            if n:
                rank = e.dp_rank or 0
                wait_until(lambda: self.last_seq(e.pod, rank) == n - 1, f"pod {e.pod} rank {rank} at seq {n - 1}")
        assert self.pool.flush(10)

    # -- views

    def rks(self, tokens: Sequence[int]) -> list[int]:
        return [int(k) for k in self.tp.request_keys(tokens, model=MODEL)]

    def index_view(self, pod: str, rank: int | None = None) -> View:
        """Request key -> tiers the index says ``pod`` (rank ``rank``) holds."""
        keys = sorted(self.index.pod_keys(pod, rank))
        out: View = {}
        for k, entries in zip(keys, self.index.lookup(keys)):
            tiers = frozenset(
                e.tier for e in entries if e.pod == pod and (rank is None or e.dp_rank == rank) and not e.speculative
            )
            if tiers:
                out[k] = tiers
        return out

    def engine_view(self, e: SimEngine, exclude: Set[int] = frozenset()) -> View:
        """The engine's cached blocks keyed by request key (engine hashes in ``exclude`` left out)."""
        cached = {h: t for h, t in e.cached_blocks().items() if h not in exclude}
        if self.tp.engine_compatible:
            return cached
        rk_of: dict[int, int] = {}
        for toks in self.served.get(e.pod, []):
            rk_of.update(zip(engine_hashes(toks), self.rks(toks)))
        return {rk_of[h]: t for h, t in cached.items()}

    def check(self, e: SimEngine, exclude: Set[int] = frozenset()) -> None:
        """The index holds exactly the engine's cache for its pod, and every prompt matches like the engine."""
        assert self.index_view(e.pod) == self.engine_view(e, exclude)
        if exclude:
            return
        for toks in self.served.get(e.pod, []):
            masks = self.index.prefix_match(self.rks(toks), pods=[e.pod]).get(e.pod, [])
            gpu = 0
            while gpu < len(masks) and masks[gpu] & GPU_BIT:
                gpu += 1
            assert gpu == e.lookup(toks) // BS


@pytest.fixture
def make_rig() -> Iterator[Callable[..., Rig]]:
    rigs: list[Rig] = []

    def make(mode: str, **kw: Any) -> Rig:
        r = Rig(mode, **kw)
        rigs.append(r)
        return r

    yield make
    for r in rigs:
        r.close()


def delta(after: PoolStats, before: PoolStats, name: str) -> int:
    return int(getattr(after, name)) - int(getattr(before, name))


# ---------------------------------------------------------------- 1. steady state


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("rotation", [0, 1])
def test_steady_state_index_equals_engine_caches(make_rig: Callable[..., Rig], mode: str, rotation: int) -> None:
    rig = make_rig(mode)
    forms = [("map", "uint64"), ("array", "int64"), ("map", "bytes"), ("array", "bytes")]
    forms = forms[rotation:] + forms[:rotation]
    engines = [
        rig.engine("pod-a", capacity=10, encoding=forms[0][0], hash_form=forms[0][1]),
        rig.engine("10.0.0.2:8000", replay=False, capacity=12, encoding=forms[1][0], hash_form=forms[1][1]),
        rig.engine("pod-c", capacity=14, encoding=forms[2][0], hash_form=forms[2][1], replay_with_topic=False),
    ]
    rig.subscribe(engines)
    for e in engines:
        rig.join(e)
    prompts = Prompts(100 + rotation)
    for i in range(24):
        e = engines[i % 3]
        rig.serve(e, prompts.next())
    rig.sync(*engines)
    assert sum(e.stats().blocks_removed for e in engines) > 0, "the workload must make the engines evict"
    assert any(e.stats().prefix_cache_hits_total > 0 for e in engines), "the workload must share prefixes"
    for e in engines:
        rig.check(e)
    s = rig.pool.stats()
    assert s.decode_errors == 0 and s.gaps == 0 and s.restarts == 0
    assert s.blocks_removed == sum(e.stats().blocks_removed for e in engines)
    assert rig.index.stats().orphan_blocks == 0


# ---------------------------------------------------------------- 2. gaps


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("with_topic", [True, False])
def test_gap_is_filled_by_replay(make_rig: Callable[..., Rig], mode: str, with_topic: bool) -> None:
    rig = make_rig(mode)
    e = rig.engine("pod-a", capacity=12, replay_with_topic=with_topic)
    other = rig.engine("pod-b", capacity=12)
    rig.subscribe([e, other])
    rig.join(e)
    rig.join(other)
    prompts = Prompts(200)
    for _ in range(3):
        rig.serve(e, prompts.next())
        rig.serve(other, prompts.next())
    rig.sync(e, other)
    before = rig.pool.stats()
    e.drop_next(3)
    for _ in range(6):  # the first three are lost on the wire, the next ones reveal the gap
        rig.serve(e, prompts.next())
    rig.sync(e, other)
    s = rig.pool.stats()
    assert e.stats().batches_dropped == 3
    assert delta(s, before, "gaps") == 1
    assert delta(s, before, "replay_requests") == 1
    assert delta(s, before, "replayed_batches") >= 3
    assert s.gaps_unrecovered == 0
    assert s.decode_errors == 0
    # the replay applies the lost batches before the message that revealed the gap: no block waited
    assert rig.index.stats().orphans == 0
    rig.check(e)
    rig.check(other)


def test_gap_beyond_the_engines_replay_buffer_is_unrecovered(make_rig: Callable[..., Rig]) -> None:
    rig = make_rig("compat")
    e = rig.engine("pod-a", capacity=200, buffer_steps=3)
    rig.subscribe([e])
    rig.join(e)
    prompts = Prompts(250)
    first = prompts.tokens(2 * BS)
    rig.serve(e, first)
    rig.sync(e)
    assert [x.complete for x in rig.pool.completeness("pod-a")] == [True]
    before = rig.pool.stats()
    e.drop_next(4)
    batch = [prompts.tokens(2 * BS) for _ in range(5)]  # unrelated prompts: one batch each
    for toks in batch:
        rig.serve(e, toks)
    rig.sync(e)
    s = rig.pool.stats()
    # the 3-batch buffer holds batch[2..4]: batch[0] and batch[1] are lost for good, and with
    # them whatever they removed, so the stream is cleared and rebuilt from the buffer
    assert s.gaps == 1 and s.gaps_unrecovered == 1 and s.restarts == 0
    assert delta(s, before, "replay_requests") == 1 and delta(s, before, "replayed_batches") == 3
    lost = set(engine_hashes(batch[0])) | set(engine_hashes(batch[1])) | set(engine_hashes(first))
    assert rig.index_view("pod-a") == rig.engine_view(e, exclude=lost)
    assert [x.complete for x in rig.pool.completeness("pod-a")] == [False]


def test_gap_without_replay_is_unrecovered_and_orphans_are_counted(make_rig: Callable[..., Rig]) -> None:
    rig = make_rig("chain")
    e = rig.engine("pod-a", replay=False, capacity=64)
    rig.subscribe([e])
    rig.join(e)
    prompts = Prompts(300)
    early = prompts.tokens(2 * BS)
    rig.serve(e, early)
    rig.sync(e)
    lost = early + prompts.tokens(3 * BS)  # stores 3 blocks after the 2 cached ones
    ext = lost + prompts.tokens(2 * BS)  # stores 2 blocks whose parent is a lost block
    e.drop_next(1)
    rig.serve(e, lost)
    rig.serve(e, ext)
    later = [prompts.next() for _ in range(4)]
    for toks in later:
        rig.serve(e, toks)
    rig.sync(e)

    s = rig.pool.stats()
    assert s.gaps == 1 and s.gaps_unrecovered == 1 and s.replay_requests == 0
    ist = rig.index.stats()
    assert ist.orphans == 2 and ist.orphan_blocks == 2 and ist.orphans_attached == 0
    assert s.orphans == ist.orphans
    # everything the engine caches except the lost batch's blocks and their waiting children
    missing = set(engine_hashes(ext)[2:])
    assert rig.index_view("pod-a") == rig.engine_view(e, exclude=missing)
    for toks in [early, *later]:
        assert len(rig.index.prefix_match(rig.rks(toks), pods=["pod-a"]).get("pod-a", [])) == e.lookup(toks) // BS
    m = rig.index.prefix_match(rig.rks(ext), pods=["pod-a"])["pod-a"]
    assert len(m) == 2 and e.lookup(ext) // BS == 7


@pytest.mark.parametrize("form", ["uint64", "bytes"])
def test_gap_without_replay_compat_keeps_later_blocks(make_rig: Callable[..., Rig], form: str) -> None:
    rig = make_rig("compat")
    e = rig.engine("pod-a", replay=False, capacity=64, hash_form=form)
    rig.subscribe([e])
    rig.join(e)
    prompts = Prompts(301)
    first = prompts.tokens(2 * BS)
    rig.serve(e, first)
    rig.sync(e)
    seq_before = rig.last_seq("pod-a")
    lost = first + prompts.tokens(3 * BS)
    e.drop_next(1)
    rig.serve(e, lost)
    ext = lost + prompts.tokens(2 * BS)
    rig.serve(e, ext)
    # without a replay endpoint a forward jump waits for the stream's next message to confirm it
    wait_until(lambda: rig.pool.stats().gaps == 1, "the gap")
    assert rig.pool.flush(10) and rig.last_seq("pod-a") == seq_before
    more = prompts.tokens(BS)
    rig.serve(e, more)
    rig.sync(e)
    s = rig.pool.stats()
    assert s.gaps == 1 and s.gaps_unrecovered == 1
    assert [x.complete for x in rig.pool.completeness("pod-a")] == [False]
    # engine keys are request keys: the blocks after the gap are held even though their parent was lost
    assert rig.index_view("pod-a") == rig.engine_view(e, exclude=set(engine_hashes(lost)[2:]))
    assert set(engine_hashes(ext)[5:]) <= set(rig.index_view("pod-a"))


# ---------------------------------------------------------------- 3. restart


@pytest.mark.parametrize("mode", MODES)
def test_engine_restart_drops_old_state_of_that_pod_only(make_rig: Callable[..., Rig], mode: str) -> None:
    rig = make_rig(mode)
    a = rig.engine("pod-a", capacity=40)
    b = rig.engine("pod-b", capacity=40)
    rig.subscribe([a, b])
    rig.join(a)
    rig.join(b)
    prompts = Prompts(400)
    for _ in range(8):
        rig.serve(a, prompts.next())
        rig.serve(b, prompts.next())
    rig.sync(a, b)
    rig.check(a)
    rig.check(b)
    old_a = rig.index_view("pod-a")
    b_before = rig.index_view("pod-b")
    assert old_a

    a.restart()
    rig.served["pod-a"] = []
    fresh = Prompts(401)
    deadline = time.monotonic() + 15.0
    while rig.pool.stats().restarts == 0:  # the SUB reconnects to the rebound PUB by itself
        assert time.monotonic() < deadline, "restart not detected"
        rig.serve(a, fresh.tokens(2 * BS))
        inner = time.monotonic() + 0.5  # the SUB reconnects within ~0.1 s; stay well below the old seq
        while rig.pool.stats().restarts == 0 and time.monotonic() < inner:
            time.sleep(0.005)
    for _ in range(4):
        rig.serve(a, fresh.next())
    rig.sync(a, b)
    s = rig.pool.stats()
    assert s.restarts == 1
    rig.check(a)
    assert not set(old_a) & set(rig.index_view("pod-a")), "old blocks of the restarted pod must be gone"
    assert rig.index_view("pod-b") == b_before
    rig.check(b)


@pytest.mark.parametrize("replay", [True, False])
def test_restart_detected_when_new_seq_passes_the_old_one(make_rig: Callable[..., Rig], replay: bool) -> None:
    """The new process publishes beyond our last seq before we hear from it: the
    disconnect makes the pool check its next message instead of taking it for a gap."""
    rig = make_rig("chain")
    a = rig.engine("pod-a", capacity=200, replay=replay)
    rig.subscribe([a])
    rig.join(a)
    prompts = Prompts(500)
    for _ in range(3):
        rig.serve(a, prompts.next())
    rig.sync(a)
    old_a = rig.index_view("pod-a")
    last = rig.last_seq("pod-a")
    assert old_a and last is not None

    a.restart()
    wait_until(lambda: rig.sub.disconnects >= 1, "disconnect noticed")
    rig.served["pod-a"] = []
    hidden = last + 3
    a.drop_next(hidden)  # lost while reconnecting: the first message we see has seq > last + 1
    fresh = Prompts(501)
    for _ in range(hidden):
        rig.serve(a, fresh.next())
    deadline = time.monotonic() + 15.0
    # the SUB reconnects to the rebound PUB by itself; the reconnect may clear the stream first
    while rig.last_seq("pod-a") in (last, None):
        assert time.monotonic() < deadline, "no message from the restarted engine"
        rig.serve(a, fresh.next())
        inner = time.monotonic() + 0.3
        while rig.last_seq("pod-a") in (last, None) and time.monotonic() < inner:
            time.sleep(0.005)
    rig.sync(a)
    assert rig.pool.stats().restarts == 1
    now = rig.index_view("pod-a")
    assert not set(old_a) & set(now), "old blocks of the restarted pod must be gone"
    if replay:
        rig.check(a)  # everything the new process published, replayed from seq 0
    else:
        assert set(now) <= set(rig.engine_view(a))  # blocks whose parents were lost wait as orphans


@pytest.mark.parametrize("replay", [True, False])
def test_restarted_engine_is_cleared_on_reconnect_before_it_publishes(make_rig: Callable[..., Rig], replay: bool) -> None:
    """The reconnect itself reveals the new process (checked against its replay
    buffer, or assumed without one): no stale blocks while it is silent."""
    rig = make_rig("chain")
    a = rig.engine("pod-a", capacity=200, replay=replay)
    b = rig.engine("pod-b", capacity=200)
    rig.subscribe([a, b])
    rig.join(a)
    rig.join(b)
    prompts = Prompts(600)
    for _ in range(3):
        rig.serve(a, prompts.next())
        rig.serve(b, prompts.next())
    rig.sync(a, b)
    assert rig.index_view("pod-a")
    b_before = rig.index_view("pod-b")

    a.restart()  # the new process publishes nothing
    wait_until(lambda: rig.pool.stats().restarts == 1, "restart noticed on reconnect")
    assert rig.pool.flush(10)
    assert rig.index_view("pod-a") == {}
    assert rig.index_view("pod-b") == b_before

    rig.served["pod-a"] = []
    fresh = Prompts(601)
    rig.serve(a, fresh.next())
    rig.sync(a)
    rig.check(a)


# ---------------------------------------------------------------- 4. late subscriber


@pytest.mark.parametrize("mode", MODES)
def test_subscriber_started_late_rebuilds_from_replay(make_rig: Callable[..., Rig], mode: str) -> None:
    rig = make_rig(mode)
    e = rig.engine("pod-a", capacity=12, encoding="array", hash_form="int64")
    prompts = Prompts(500)
    for _ in range(10):
        rig.serve(e, prompts.next())
    assert e.stats().blocks_removed > 0
    published = e.stats().batches_published
    rig.subscribe([e])  # no warm-up and no new traffic: only the bootstrap replay can rebuild
    rig.sync(e)
    s = rig.pool.stats()
    assert s.messages == 0
    # the bootstrap, plus the looks at the buffer until a live message (none comes): nothing new
    assert 1 <= s.replay_requests <= 1 + rig.pool.rejoin_checks and s.replayed_batches == published
    rig.check(e)


class SlowLink:
    """A loopback TCP relay that holds each new connection ``delay`` seconds before linking it to
    ``upstream``: a subscription whose handshake is slow, as on a loaded machine."""

    def __init__(self, upstream: str, delay: float) -> None:
        host, port = upstream.removeprefix("tcp://").rsplit(":", 1)
        self.upstream = (host, int(port))
        self.delay = delay
        self.server = socket.create_server(("127.0.0.1", 0))
        self.endpoint = f"tcp://127.0.0.1:{self.server.getsockname()[1]}"
        self.closed = False
        self.socks: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while not self.closed:
            try:
                client, _ = self.server.accept()
            except OSError:
                return
            threading.Thread(target=self._link, args=(client,), daemon=True).start()

    def _link(self, client: socket.socket) -> None:
        time.sleep(self.delay)
        try:
            up = socket.create_connection(self.upstream)
        except OSError:
            client.close()
            return
        self.socks += [client, up]
        for a, b in ((client, up), (up, client)):
            threading.Thread(target=self._pipe, args=(a, b), daemon=True).start()

    @staticmethod
    def _pipe(a: socket.socket, b: socket.socket) -> None:
        try:
            while data := a.recv(65536):
                b.sendall(data)
        except OSError:
            pass
        finally:
            for s in (a, b):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def close(self) -> None:
        self.closed = True
        self.server.close()
        for s in self.socks:
            s.close()


@pytest.mark.parametrize("mode", MODES)
def test_batch_published_while_the_subscription_is_joining_is_indexed(make_rig: Callable[..., Rig], mode: str) -> None:
    """ZMQ's slow joiner: the engine serves a request after the subscriber started but before its
    subscription reached the publisher (the handshake is slowed to 0.5 s), and then stays idle.
    No later message reveals the loss, so the bootstrap replay must be asked once the connection is
    up: one asked on connecting finds the buffer still empty."""
    rig = make_rig(mode)
    e = rig.engine("pod-a", capacity=24)
    link = SlowLink(e.endpoint, delay=0.5)
    try:
        ep = EngineEndpoint(endpoint=link.endpoint, pod=e.pod, replay_endpoint=e.replay_endpoint, model=MODEL)
        rig.sub = sub = Subscriber(rig.pool, [ep])
        sub.start()
        time.sleep(0.1)  # a replay asked on connecting has been answered by now (an empty buffer)
        rig.serve(e, Prompts(700).next())  # lost live: the subscription is not up yet
        assert sub.wait_connected(10.0) and sub.connected() == {(e.pod, 0): True}
        rig.sync(e)  # the engine publishes nothing more: only the bootstrap replay can bring it
        rig.check(e)
        assert rig.index.pod_keys(e.pod), "the request's blocks never reached the index"
    finally:
        link.close()


@pytest.mark.parametrize("old_served", [False, True])
def test_restarted_engine_serving_while_the_subscription_rejoins_is_indexed(
    make_rig: Callable[..., Rig], old_served: bool
) -> None:
    """The engine restarts (a new process on the same address, seq from 0) once our subscription is
    up, serves one request at once, while ZMQ is still reconnecting, and then stays idle.  Whether or
    not the old process had published anything, the index must come to hold exactly the new process's
    blocks: with nothing applied to check against the engine, the reconnect asks for its buffer."""
    for attempt in range(3):
        rig = make_rig("compat")
        e = rig.engine(f"pod-{attempt}")
        prompts = Prompts(800 + attempt)
        if old_served:
            rig.serve(e, prompts.next())
        sub = rig.subscribe([e])
        assert sub.wait_connected(30.0)
        if old_served:
            rig.sync(e)
        e.restart()
        rig.served[e.pod] = []
        rig.serve(e, prompts.next())
        wait_until(lambda: rig.index_view(e.pod) == rig.engine_view(e), f"attempt {attempt}: the new process's blocks")
        assert rig.pool.flush(10)
        rig.check(e)


def test_wait_connected_waits_for_an_added_engine(make_rig: Callable[..., Rig]) -> None:
    rig = make_rig("chain")
    sub = rig.subscribe([])
    assert sub.wait_connected(1.0)  # nothing to wait for
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    sub.add_engine(EngineEndpoint(endpoint=f"tcp://127.0.0.1:{port}", pod="down", model=MODEL))
    assert sub.connected() == {("down", 0): False}  # before the subscriber thread opened it
    assert sub.wait_connected(0.3) is False
    e = rig.engine("pod-a")
    sub.add_engine(rig.endpoint_of(e))
    sub.remove_engine("down")
    assert sub.wait_connected(30.0)
    assert sub.connected() == {("pod-a", 0): True}


def test_wait_connected_is_bounded_when_an_engine_is_not_up(make_rig: Callable[..., Rig]) -> None:
    rig = make_rig("chain")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # nothing listens there once closed
    sub = Subscriber(rig.pool, [EngineEndpoint(endpoint=f"tcp://127.0.0.1:{port}", pod="down", model=MODEL)])
    sub.start()
    try:
        t0 = time.monotonic()
        assert sub.wait_connected(0.3) is False
        assert time.monotonic() - t0 < 5.0
        assert sub.connected() == {("down", 0): False}
    finally:
        sub.stop()


# ---------------------------------------------------------------- 5. orphans


def test_orphan_attached_when_its_parent_arrives_over_zmq(make_rig: Callable[..., Rig]) -> None:
    """pod-b loses the batch with a prefix; the child blocks wait until pod-a stores the same prefix."""
    rig = make_rig("chain")
    a = rig.engine("pod-a", capacity=64)
    b = rig.engine("pod-b", replay=False, capacity=64)
    rig.subscribe([a, b])
    rig.join(a)
    rig.join(b)
    prompts = Prompts(600)
    head = prompts.tokens(3 * BS)
    child = head + prompts.tokens(2 * BS)
    b.drop_next(1)
    rig.serve(b, head)
    rig.serve(b, child)
    other = prompts.tokens(BS)
    rig.serve(b, other)  # confirms the jump (pod-b has no replay endpoint)
    rig.sync(b)
    assert rig.index.stats().orphan_blocks == 2
    assert rig.index.pod_keys("pod-b") == set(rig.rks(other))

    rig.serve(a, head)  # same engine keys: releases pod-b's waiting blocks
    rig.sync(a)
    ist = rig.index.stats()
    assert ist.orphan_blocks == 0 and ist.orphans_attached == 2
    rk = rig.rks(child)
    held = rig.index.lookup(rk)
    assert [{x.pod for x in h} for h in held] == [{"pod-a"}] * 3 + [{"pod-b"}] * 2
    assert rig.index_view("pod-b") == rig.engine_view(b, exclude=set(engine_hashes(head)))
    assert set(rig.rks(other)) <= set(rig.index_view("pod-b"))
    rig.check(a)


def test_orphans_delivered_out_of_order_through_the_pool(make_rig: Callable[..., Rig]) -> None:
    """Explicit submits: grandchild, then child (other rank), then parent (other pod) -> one chain."""
    rig = make_rig("chain")
    prompts = Prompts(601)
    toks = prompts.tokens(6 * BS)
    hs = engine_hashes(toks)
    src = Source(pod=None)

    def submit(pod: str, rank: int, lo: int, hi: int) -> None:
        ev = stored_event(hs[lo:hi], hs[lo - 1] if lo else None, toks[lo * BS : hi * BS], BS, form="array")
        rig.pool.submit(RawMessage(src, f"kv@{pod}@{MODEL}".encode(), seq_frame(0), batch_payload([ev], dp_rank=rank)))
        assert rig.pool.flush(10)

    submit("pod-x", 0, 4, 6)
    submit("pod-x", 1, 2, 4)
    assert rig.index.stats().orphan_blocks == 4 and len(rig.index) == 0
    submit("pod-y", 0, 0, 2)
    ist = rig.index.stats()
    assert ist.orphan_blocks == 0 and ist.orphans == 4 and ist.orphans_attached == 4
    rk = rig.rks(toks)
    assert [[(e.pod, e.dp_rank) for e in h] for h in rig.index.lookup(rk)] == (
        [[("pod-y", 0)]] * 2 + [[("pod-x", 1)]] * 2 + [[("pod-x", 0)]] * 2
    )
    assert rig.index.pod_keys("pod-x", 0) == set(rk[4:])


# ---------------------------------------------------------------- 6. clear and offload


@pytest.mark.parametrize("mode", MODES)
def test_all_blocks_cleared_on_one_pod_and_offload_tier(make_rig: Callable[..., Rig], mode: str) -> None:
    rig = make_rig(mode)
    a = rig.engine("pod-a", capacity=12)
    b = rig.engine("pod-b", capacity=12, replay=False, encoding="array")
    rig.subscribe([a, b])
    rig.join(a)
    rig.join(b)
    prompts = Prompts(700)
    for _ in range(3):
        rig.serve(a, prompts.next())
        rig.serve(b, prompts.next())
    off_a = a.offload(4)
    off_b = b.offload(3)
    assert len(off_a) == 4 and len(off_b) == 3
    for _ in range(4):  # evicts some offloaded blocks from GPU: their CPU copy stays
        rig.serve(a, prompts.next())
        rig.serve(b, prompts.next())
    assert len(a.offload(2)) == 2 and len(b.offload(2)) == 2  # these stay in GPU as well
    rig.sync(a, b)
    cached_a = a.cached_blocks()
    assert frozenset({"cpu"}) in cached_a.values() and frozenset({"gpu", "cpu"}) in cached_a.values()
    rig.check(a)
    rig.check(b)
    assert rig.index.stats().unknown_offloads == 0

    b_before = rig.index_view("pod-b")
    a.reset_prefix_cache()
    rig.sync(a, b)
    assert rig.index_view("pod-a") == {} and "pod-a" not in rig.index.pods()
    assert rig.index_view("pod-b") == b_before
    rig.check(b)
    rig.serve(a, prompts.next())
    rig.sync(a)
    rig.check(a)


# ---------------------------------------------------------------- 7. bind mode and DP ranks


def _free_port_pair() -> int:
    """A port p with p and p + 1 free on loopback a moment ago."""
    for _ in range(50):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            p = s.getsockname()[1]
        if p >= 65535:
            continue
        try:
            with socket.socket() as s2:
                s2.bind(("127.0.0.1", p + 1))
        except OSError:
            continue
        return int(p)
    raise AssertionError("no free port pair")


def test_bind_mode_pods_from_topics_and_dp_ranks(make_rig: Callable[..., Rig]) -> None:
    rig = make_rig("compat")
    port = _free_port_pair()
    sub_ep = f"tcp://127.0.0.1:{port}"
    rport = _free_port_pair()

    def dp_engine(rank: int) -> SimEngine:
        e = SimEngine(
            pod="dp-pod", endpoint=sub_ep, capacity_blocks=10, dp_rank=rank, block_size=BS, hash_seed=SEED,
            model=MODEL, replay_endpoint=f"tcp://127.0.0.1:{rport + rank}", encoding=("map", "array")[rank],
        )
        rig.engines.append(e)
        return e

    r0, r1 = dp_engine(0), dp_engine(1)
    other = SimEngine(pod="10.1.1.1:8000", endpoint=sub_ep, capacity_blocks=10, block_size=BS, hash_seed=SEED, model=MODEL)
    rig.engines.append(other)
    assert r0.endpoint == r1.endpoint == other.endpoint == sub_ep  # engines dial in
    rig.subscribe(bind=sub_ep, bind_replay={"dp-pod": f"tcp://127.0.0.1:{rport}"})
    for e in (r0, r1, other):
        rig.join(e)

    prompts = Prompts(800)
    shared = prompts.next()
    rig.serve(r0, shared)
    rig.serve(r1, shared)
    rig.serve(other, shared)
    rig.sync(r0, r1, other)
    rk = rig.rks(shared)
    assert {(e.pod, e.dp_rank) for e in rig.index.lookup(rk[:1])[0]} == {("dp-pod", 0), ("dp-pod", 1), ("10.1.1.1:8000", 0)}

    # rank 1 evicts the shared blocks (and loses a batch, recovered from its own replay port)
    r1.drop_next(1)
    for _ in range(4):
        rig.serve(r1, prompts.tokens(3 * BS))  # unrelated prompts
    rig.sync(r0, r1, other)
    s = rig.pool.stats()
    assert s.gaps == 1 and s.gaps_unrecovered == 0 and s.replayed_batches >= 1
    assert not set(engine_hashes(shared)) & set(r1.cached_blocks())
    assert {(e.pod, e.dp_rank) for e in rig.index.lookup(rk[:1])[0]} == {("dp-pod", 0), ("10.1.1.1:8000", 0)}
    assert rig.index_view("dp-pod", 0) == r0.cached_blocks()
    assert rig.index_view("dp-pod", 1) == r1.cached_blocks()
    assert rig.index_view("10.1.1.1:8000") == other.cached_blocks()
    assert {(p, r) for p, r, _ in rig.pool.streams()} == {("dp-pod", 0), ("dp-pod", 1), ("10.1.1.1:8000", 0)}


# ---------------------------------------------------------------- 8. remove_engine


@pytest.mark.parametrize("mode", MODES)
def test_remove_engine_removes_the_pod(make_rig: Callable[..., Rig], mode: str) -> None:
    rig = make_rig(mode)
    a = rig.engine("pod-a")
    b = rig.engine("pod-b", replay=False)
    rig.subscribe([a, b])
    rig.join(a)
    rig.join(b)
    prompts = Prompts(900)
    for _ in range(4):
        rig.serve(a, prompts.next())
        rig.serve(b, prompts.next())
    rig.sync(a, b)
    assert "pod-a" in rig.index.pods()
    b_before = rig.index_view("pod-b")
    assert rig.sub is not None
    rig.sub.remove_engine("pod-a")
    wait_until(lambda: "pod-a" not in rig.index.pods(), "pod-a removed from the index")
    assert rig.index.pod_keys("pod-a") == set()
    assert rig.index_view("pod-b") == b_before
    for _ in range(3):  # a's later batches go nowhere
        rig.serve(a, prompts.next())
        rig.serve(b, prompts.next())
    rig.sync(b)
    assert "pod-a" not in rig.index.pods()
    assert all(p != "pod-a" for p, _r, _l in rig.pool.streams())
    rig.check(b)
