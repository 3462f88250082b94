"""A rig for fuzzing the write path end to end: model engines, real ZMQ, the real Subscriber and EventPool.

Used by tests/test_fuzz_writepath.py (hypothesis draws the bad messages) and
bench/fuzz_writepath.py (a plain seeded generator, at volume).

Each :class:`~tests.engine_model.ModelEngine` publishes on its own PUB socket
(bound on loopback) and serves replays on a real ROUTER socket
(:class:`~tests.engine_model.ReplayServer`); the library's
:class:`~kvevents.subscriber.Subscriber` connects to them as to vLLM engines
and feeds an :class:`~kvevents.pool.EventPool` over a real index.  Between
the engines' valid batches the rig sends bad messages, each of one class:

- ``undecodable``: a payload the decoder rejects (random bytes, msgpack of a
  wrong shape, a truncated batch, an array header claiming 2**32 items), or a
  sequence frame that is not 8 bytes, sent with any seq.  Expected: one error
  of the decoder's kind; the stream's sequence does not move.
- ``frames``: a message with 1, 2, 4, 5 or 6 frames.  Expected: one
  ``frames`` error.
- ``bad_events``: a decodable batch, the engine's real next batch (it is in
  the replay buffer), whose every event is malformed (hash values of every
  type, huge arrays, wrong token counts) or of an unknown type.  Expected:
  one error per malformed event (its kind from the decoder), one
  ``unknown_event`` per unknown event; the index unchanged.
- ``jump``: a valid-looking batch that would store blocks, with a seq ahead of
  the engine's (by 1 to 2**64 - 2).  Expected: counted ``unconfirmed`` (the
  engine's buffer does not know it), never applied.
- ``repeat``: an earlier seq of the engine, carrying either the engine's own
  batch again or other blocks.  Expected: counted ``unconfirmed``,
  ``duplicates`` or ``stale``, never applied.

The oracle is the model engines themselves: they apply only their valid
batches, and at the end every stream of the index must hold exactly the
engine's (engine key, tier) copies.  Every bad message must be counted: the
errors by kind equal the expected ones, and unconfirmed + duplicates + stale
equal the number of jumps and repeats.  No exception may escape: no
``internal`` error, every worker and the subscriber alive.
"""

from __future__ import annotations

import random
import time
from collections import Counter
from collections.abc import Callable, Iterable
from typing import NamedTuple

import msgspec
import zmq

from kvevents.pool import EventPool, PoolStats
from kvevents.subscriber import EngineEndpoint, Subscriber
from kvevents.wire import PayloadError, decode_seq, decode_vllm_batch
from kvindex.reference import KVBlockIndex
from kvindex.keys import TokenProcessor
from kvindex.contract import KVIndex
from kvindex.factory import make_index
from tests.engine_model import ModelEngine, Paths, ReplayServer
from tests.oracle import batch_payload, seq_frame, stored_event

BS = 4
U64 = 2**64


class Bad(NamedTuple):
    """One bad message to send: its class and what to send (see the module doc)."""

    cls: str  # undecodable | frames | bad_events | jump | repeat
    payload: bytes = b""  # undecodable: the payload
    seq: bytes | None = None  # undecodable: the seq frame (None: the engine's next seq)
    frames: tuple[bytes, ...] = ()  # frames: every frame
    events: tuple = ()  # bad_events: the raw events of the batch
    offset: int = 1  # jump: seq = engine's next + offset (capped at 2**64 - 2); repeat: seq = next - offset
    same: bool = True  # repeat: resend the engine's own batch (else other blocks)


def decoded_verdict(payload: bytes) -> tuple[str, Counter[str]] | None:
    """What the library's decoder makes of ``payload``: ("error", {kind: 1}), ("bad", kinds of a
    batch with no good event), or None for a batch that has good events (not a bad message)."""
    try:
        b = decode_vllm_batch(payload)
    except PayloadError as exc:
        return "error", Counter({exc.kind: 1})
    if b.events:
        return None
    kinds = Counter(b.bad_events)
    if b.skipped_events:
        kinds["unknown_event"] += b.skipped_events
    return "bad", kinds


class FuzzRig:
    """Model engines on real ZMQ sockets, the real Subscriber, pool and index (see the module doc).

    Args:
        seed: seeds the engines' paths and the valid traffic.
        n_engines: publishers (pods ``f0`` .. ``f{n-1}``, model ``m``, DP rank 0).
        backend: index implementation (``native`` or ``python``).
        concurrency, queue_size: the pool's.
    """

    def __init__(self, seed: int = 1, n_engines: int = 3, backend: str = "native", concurrency: int = 2,
                 queue_size: int = 10_000) -> None:
        self.rnd = random.Random(seed)
        self.ctx = zmq.Context.instance()
        paths = Paths.make(seed, block_size=BS, n_paths=12, n_blocks=6)
        self.tp = TokenProcessor(block_size=BS, hash_seed=seed)
        self.rk2ek = paths.rk_to_ek(self.tp, "m")
        self.engines = [ModelEngine(f"f{i}", "m", 0, paths, buffer_steps=10_000, capacity=24)
                        for i in range(n_engines)]
        for e in self.engines:
            e.clear_p = 0.01
        self.replay = ReplayServer(self.engines, self.ctx)
        self.pubs: list[zmq.Socket] = []
        eps = []
        for e in self.engines:
            s = self.ctx.socket(zmq.PUB)
            s.setsockopt(zmq.LINGER, 0)
            s.setsockopt(zmq.SNDHWM, 0)  # never drop: the rig paces itself
            port = s.bind_to_random_port("tcp://127.0.0.1")
            self.pubs.append(s)
            eps.append(EngineEndpoint(endpoint=f"tcp://127.0.0.1:{port}", pod=e.pod,
                                      replay_endpoint=self.replay.endpoint(e)))
        self.index: KVIndex = make_index(backend, self.tp)
        self.pool = EventPool(self.index, concurrency=concurrency, queue_size=queue_size, replay_timeout=5.0)
        self.sub = Subscriber(self.pool, eps)
        self.sent = 0
        self.expected_errors: Counter[str] = Counter()
        self.expected_skips = 0  # jumps and repeats: unconfirmed + duplicates + stale
        self.sent_by_class: Counter[str] = Counter()
        self.valid_batches = 0
        self.pool.start()
        self.sub.start()
        self._join()

    # -- plumbing

    def _send(self, i: int, frames: Iterable[bytes]) -> None:
        self.pubs[i].send_multipart(list(frames))
        self.sent += 1

    def _join(self, timeout: float = 30.0) -> None:
        """Publish valid empty batches until every subscription delivers (ZMQ's slow joiner)."""
        deadline = time.monotonic() + timeout
        for i, e in enumerate(self.engines):
            while True:
                before = self.sub.received
                self._send(i, e.publish([]))
                self.valid_batches += 1
                t = time.monotonic() + 0.2
                while self.sub.received == before and time.monotonic() < t:
                    time.sleep(0.005)
                if self.sub.received > before:
                    break
                assert time.monotonic() < deadline, f"{e.pod}: the subscription never delivered"
        # batches published before a subscription was up are lost on the wire (the pool replays
        # them); once nothing more arrives, count only what was received as sent
        last = -1
        while self.sub.received != last:
            last = self.sub.received
            time.sleep(0.3)
        self.sent = self.sub.received
        self.settle()

    def settle(self, timeout: float = 120.0) -> None:
        """Wait until the subscriber received every message sent and the pool applied them."""
        deadline = time.monotonic() + timeout
        while self.sub.received < self.sent:
            if time.monotonic() > deadline:
                raise TimeoutError(f"subscriber received {self.sub.received} of {self.sent}")
            time.sleep(0.002)
        if not self.pool.flush(max(1.0, deadline - time.monotonic())):
            raise TimeoutError("pool did not drain")

    def close(self) -> None:
        self.sub.stop()
        self.pool.stop()
        self.replay.close()
        for s in self.pubs:
            s.close(linger=0)

    # -- traffic

    def valid(self, i: int | None = None) -> None:
        """One valid batch of random cache operations from engine ``i`` (random if None)."""
        i = self.rnd.randrange(len(self.engines)) if i is None else i
        e = self.engines[i]
        self._send(i, e.publish(e.random_events(self.rnd, self.rnd.randint(1, 3))))
        self.valid_batches += 1

    def bad(self, b: Bad, i: int | None = None) -> bool:
        """Send one bad message from engine ``i``'s socket; False if ``b`` turned out not to be bad (not sent)."""
        i = self.rnd.randrange(len(self.engines)) if i is None else i
        e = self.engines[i]
        if b.cls == "frames":
            assert len(b.frames) != 3
            self._send(i, b.frames)
            self.expected_errors["frames"] += 1
        elif b.cls == "undecodable":
            if b.seq is not None:
                try:
                    decode_seq(b.seq)
                except PayloadError as exc:
                    self._send(i, (e.topic, b.seq, b.payload))
                    self.expected_errors[exc.kind] += 1
                    self.sent_by_class[b.cls] += 1
                    return True
            v = decoded_verdict(b.payload)
            if v is None or v[0] != "error":
                return False
            seq = b.seq if b.seq is not None else seq_frame(e.next_seq)
            self._send(i, (e.topic, seq, b.payload))
            self.expected_errors.update(v[1])
        elif b.cls == "bad_events":
            probe = batch_payload(list(b.events), dp_rank=e.dp_rank, ts=e.clock + 0.001)
            v = decoded_verdict(probe)
            if v is None or v[0] != "bad" or not v[1]:
                return False
            self._send(i, e.publish([], extra_raw=[(k, ev) for k, ev in enumerate(b.events)]))
            self.valid_batches += 1
            self.expected_errors.update(v[1])
        elif b.cls == "jump":
            # settled before and after: the replay it triggers finds exactly what the pool has seen
            # (a replay reading batches published but not yet received would skip their live copies)
            self.settle()
            seq = min(e.next_seq + max(1, b.offset), U64 - 2)
            self._send(i, (e.topic, seq_frame(seq), self._fake_batch(e)))
            self.expected_skips += 1
            self.settle()
        elif b.cls == "repeat":
            if e.next_seq == 0:
                return False
            seq = max(0, e.next_seq - max(1, b.offset))
            own = [p for t, s, p in e.buffered(seq) if decode_seq(s) == seq]
            if not own:
                return False
            payload = own[0] if b.same else self._fake_batch(e)
            self.settle()  # as for a jump
            self._send(i, (e.topic, seq_frame(seq), payload))
            self.expected_skips += 1
            self.settle()
        else:
            raise ValueError(b.cls)
        self.sent_by_class[b.cls] += 1
        return True

    def _fake_batch(self, e: ModelEngine) -> bytes:
        """A well-formed batch storing blocks the engine may not hold (it must never be applied)."""
        P = e.paths
        p = self.rnd.randrange(len(P.paths))
        n = P.n_blocks(p)
        return batch_payload([stored_event([P.ek(p, k) for k in range(n)], None, P.tokens(p, 0, n), BS)],
                             dp_rank=e.dp_rank, ts=e.clock + self.rnd.choice([0.0005, -5.0, 5.0]))

    # -- the verdict

    def view(self, e: ModelEngine) -> set[tuple[int, str]]:
        keys = list(self.rk2ek)
        out = set()
        for rk, entries in zip(keys, self.index.lookup(keys)):
            for x in entries:
                if x.pod == e.pod and x.dp_rank == e.dp_rank and not x.speculative:
                    out.add((self.rk2ek[rk], x.tier))
        return out

    def finish(self) -> None:
        """One more valid batch per engine (so a last lost one would show), then wait for everything."""
        for i in range(len(self.engines)):
            self.valid(i)
        self.settle()

    def check(self, base: PoolStats | None = None) -> PoolStats:
        """Assert the verdict (module doc) for everything sent since ``base`` (a stats() snapshot
        taken when the rig's expectations were reset); returns the stats now."""
        st = self.pool.stats()
        errs = Counter(st.errors_by_kind)
        skips = st.unconfirmed + st.duplicates + st.stale
        if base is not None:
            errs.subtract(base.errors_by_kind)
            skips -= base.unconfirmed + base.duplicates + base.stale
        errs = +errs
        assert "internal" not in errs, errs
        assert errs == self.expected_errors, (dict(errs), dict(self.expected_errors))
        assert skips == self.expected_skips, (skips, self.expected_skips)
        assert st.restarts == 0 and st.gaps_unrecovered == 0 and st.dropped_messages == 0, st
        assert all(s.thread is not None and s.thread.is_alive() for s in self.pool._shards)
        assert self.sub._thread is not None and self.sub._thread.is_alive()
        for e in self.engines:
            got, want = self.view(e), e.view()
            assert got == want, (e.pod, len(got - want), len(want - got))
        return st

    def reset_expectations(self) -> PoolStats:
        """Start counting afresh (returns the baseline to pass to :meth:`check`)."""
        self.settle()  # what an earlier, interrupted run sent is counted before the baseline
        self.expected_errors = Counter()
        self.expected_skips = 0
        return self.pool.stats()


# -- a plain seeded generator of bad messages (the volume run; hypothesis draws them in the tests)

HASH_VALUES: list = [
    1.5, -0.0, float("inf"), "abc", "", None, True, False, [], [1, 2], {}, {"a": 1}, b"", b"\x01",
    b"\x00" * 7, b"\x00" * 9, msgspec.msgpack.Ext(1, b"x"), -(2**63) - 0, -1,
]
"""Block-hash values of every msgpack type; those the decoder accepts (ints, digests) are filtered out."""


def random_msgpack(rnd: random.Random, depth: int = 0) -> object:
    """A random msgpack value of any type (nested up to depth 3)."""
    r = rnd.random()
    if depth < 3 and r < 0.25:
        return [random_msgpack(rnd, depth + 1) for _ in range(rnd.randint(0, 4))]
    if depth < 3 and r < 0.35:
        return {str(rnd.randint(0, 9)): random_msgpack(rnd, depth + 1) for _ in range(rnd.randint(0, 3))}
    return rnd.choice([
        None, True, False, rnd.randint(-(2**63), 2**64 - 1), rnd.random() * 1e6, "x" * rnd.randint(0, 9),
        bytes(rnd.randrange(256) for _ in range(rnd.randint(0, 9))), rnd.choice(["BlockStored", "BlockRemoved"]),
    ])


def bad_event(rnd: random.Random) -> object:
    """One event that decodes as malformed or of an unknown type."""
    k = rnd.randrange(7)
    h = rnd.choice(HASH_VALUES)
    if k == 0:
        return {"type": "BlockStored", "block_hashes": [h], "parent_block_hash": None, "token_ids": [1] * BS,
                "block_size": BS, "medium": "GPU"}
    if k == 1:
        return {"type": "BlockStored", "block_hashes": [7], "parent_block_hash": h, "token_ids": [1] * BS,
                "block_size": BS}
    if k == 2:
        return {"type": "BlockRemoved", "block_hashes": [h, h], "medium": "GPU"}
    if k == 3:  # a huge array of hashes of a wrong type
        return {"type": "BlockStored", "block_hashes": [1.5] * rnd.randint(10_000, 100_000),
                "parent_block_hash": None, "token_ids": [], "block_size": BS}
    if k == 4:  # token count disagrees with blocks x block size
        return {"type": "BlockStored", "block_hashes": [11, 12], "parent_block_hash": None,
                "token_ids": [1] * rnd.randint(0, 3 * BS - 1), "block_size": BS}
    if k == 5:
        return ["BlockStored", [h], None, [1] * BS, BS]  # positional form, bad hash
    return {"type": rnd.choice(["BlockMoved", "Frobnicate", "FutureEvent"]), "x": random_msgpack(rnd)}


def random_bad(rnd: random.Random, valid_payload: Callable[[], bytes]) -> Bad:
    """One bad message of a random class (see the module doc); ``valid_payload`` makes a valid batch to maim."""
    r = rnd.random()
    if r < 0.12:
        return Bad("undecodable", payload=bytes(rnd.randrange(256) for _ in range(rnd.randint(0, 300))))
    if r < 0.24:
        return Bad("undecodable", payload=msgspec.msgpack.encode(random_msgpack(rnd)))
    if r < 0.34:
        p = valid_payload()
        return Bad("undecodable", payload=p[: rnd.randrange(len(p))])
    if r < 0.38:  # an array header claiming 2**32 - 1 items, then a few
        return Bad("undecodable", payload=b"\xdd\xff\xff\xff\xff" + bytes(rnd.randrange(256) for _ in range(8)))
    if r < 0.44:
        n = rnd.choice([0, 1, 7, 9, 16])
        return Bad("undecodable", payload=valid_payload(), seq=bytes(rnd.randrange(256) for _ in range(n)))
    if r < 0.54:
        n = rnd.choice([1, 2, 4, 5, 6])
        return Bad("frames", frames=tuple(bytes(rnd.randrange(256) for _ in range(rnd.randint(0, 12)))
                                          for _ in range(n)))
    if r < 0.74:
        return Bad("bad_events", events=tuple(bad_event(rnd) for _ in range(rnd.randint(1, 3))))
    if r < 0.87:
        return Bad("jump", offset=rnd.choice([1, 2, 3, 100, 2**20, 2**40, 2**63, 2**64]))
    return Bad("repeat", offset=rnd.choice([1, 1, 2, 3, 10, 500]), same=rnd.random() < 0.5)


def valid_payload_of(e: ModelEngine, rnd: random.Random) -> bytes:
    """A well-formed batch payload for ``e`` (not published: material to truncate or pair with a bad seq)."""
    P = e.paths
    p = rnd.randrange(len(P.paths))
    return batch_payload([stored_event([P.ek(p, 0), P.ek(p, 1)], None, P.tokens(p, 0, 2), BS)],
                         dp_rank=e.dp_rank, ts=e.clock)


__all__ = ["Bad", "FuzzRig", "KVBlockIndex", "bad_event", "decoded_verdict", "random_bad", "random_msgpack",
           "valid_payload_of"]
