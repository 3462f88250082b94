"""Fuzz: garbage through the pool never escapes a worker, is counted by kind, and leaves the index as it was.

Each example starts a fresh pool over an index holding a few known blocks,
submits a list of bad messages, then a valid one:

- random bytes, well-formed msgpack of the wrong shape (including batch-like
  shapes with wrong field types and huge ints), truncated valid payloads;
- valid payloads with a sequence frame that is not 8 bytes, or a topic naming
  no pod on a subscription that configures none, or an unknown engine format;
- events that decode but cannot be applied (block size differing from the
  index's) and events of an unknown type.

The expected error kind of a bad payload is what the payload decoder raises
(its own fuzz tests live in test_wire_fuzz.py); here the pool must count
exactly those kinds, keep the index unchanged and apply the valid message
that follows.  Wrong frame counts go through a real SUB socket on loopback.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable, Iterator
from typing import Any, NamedTuple

import hypothesis.strategies as st
import msgspec
import pytest
import zmq
from hypothesis import HealthCheck, given, settings

from kvevents.pool import EventPool, RawMessage, Source
from kvevents.sglang import decode_sglang_batch
from kvevents.subscriber import EngineEndpoint, Subscriber
from kvevents.wire import PayloadError, decode_vllm_batch, parse_topic
from kvindex.reference import KVBlockIndex
from kvindex.keys import TokenProcessor
from tests.oracle import batch_payload, engine_hash, removed_event, seq_frame, stored_event

BS = 16
MODEL = "m"
POD = "pod-a"
TOPIC = f"kv@{POD}@{MODEL}".encode()
U64_MAX = 2**64 - 1
HUGE = [2**63, U64_MAX, -(2**63), 2**32, -1, 0]
FUZZ = settings(
    max_examples=60, deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much, HealthCheck.data_too_large],
)
TP = TokenProcessor(block_size=BS, hash_seed=5)
DECODERS: dict[str, Callable[[bytes], Any]] = {"vllm": decode_vllm_batch, "sglang": decode_sglang_batch}


def prompt(base: int, n_blocks: int) -> list[int]:
    return [(base * 7919 + i * 31) % 40_000 + 1 for i in range(n_blocks * BS)]


def stored(tokens: list[int], lo: int, hi: int, form: str = "map", block_size: int = BS) -> object:
    bs = block_size
    hs = [engine_hash(tuple(tokens[: (i + 1) * bs])) for i in range(lo, hi)]
    parent = engine_hash(tuple(tokens[: lo * bs])) if lo else None
    return stored_event(hs, parent, tokens[lo * bs : hi * bs], bs, form=form)


SEEDED = [prompt(1, 3), prompt(2, 2), prompt(4, 1) + prompt(3, 2)]
NEW = prompt(9, 3)  # stored by the valid message after the garbage


def error_kind(payload: bytes, engine: str = "vllm") -> str | None:
    """The kind the decoder reports for ``payload``, or None when it decodes without a bad event."""
    try:
        b = DECODERS[engine](payload)
    except PayloadError as exc:
        return exc.kind
    return b.bad_events[0] if b.bad_events else None


def bad_event_kinds(payload: bytes, engine: str = "vllm") -> tuple[str, ...] | None:
    """The kinds of a decodable batch's malformed events (None when the payload is no batch)."""
    try:
        return DECODERS[engine](payload).bad_events
    except PayloadError:
        return None


class Bad(NamedTuple):
    """One bad message and what the pool must count for it."""

    payload: bytes
    kind: str
    topic: bytes = TOPIC
    seq: bytes | None = None  # None: the stream's next seq
    engine: str = "vllm"
    pod: str | None = None  # configured pod of the subscription
    advances: bool = False  # the batch decodes (its seq is consumed)
    count: int = 1  # errors counted for it


def _decodes_bad(engine: str = "vllm") -> Callable[[bytes], bool]:
    return lambda b: error_kind(b, engine) is not None


# -- payload strategies

leaves = (
    st.none() | st.booleans() | st.integers(-(2**63), U64_MAX) | st.sampled_from(HUGE)
    | st.floats(allow_nan=True, allow_infinity=True) | st.text(max_size=6) | st.binary(max_size=12)
    | st.sampled_from(["BlockStored", "BlockRemoved", "AllBlocksCleared", "GPU", "CPU"])
)
values = st.recursive(
    leaves,
    lambda kids: st.lists(kids, max_size=4)
    | st.dictionaries(
        st.sampled_from(["type", "block_hashes", "parent_block_hash", "token_ids", "block_size", "medium"])
        | st.text(max_size=4),
        kids, max_size=4,
    ),
    max_leaves=12,
)
FIELDS = ["block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium", "lora_name",
          "extra_keys", "group_idx"]


@st.composite
def batch_like(draw: st.DrawFn) -> bytes:
    """A batch ``[ts, events, rank]`` whose parts are drawn from near-valid and wrong values."""
    ts = draw(st.floats(allow_nan=True) | st.sampled_from(HUGE) | values)
    base = stored(SEEDED[0], 0, 2, form=draw(st.sampled_from(["map", "array"])))
    ev: Any
    if isinstance(base, dict):
        ev = dict(base)
        for f in draw(st.lists(st.sampled_from(FIELDS), min_size=1, max_size=3)):
            ev[f] = draw(values | st.sampled_from(HUGE) | st.lists(st.sampled_from(HUGE), max_size=3))
    else:
        ev = list(base)
        i = draw(st.integers(1, len(ev) - 1))
        ev[i] = draw(values | st.sampled_from(HUGE) | st.lists(st.sampled_from(HUGE), max_size=3))
    events = draw(st.lists(st.just(ev) | values, min_size=1, max_size=3))
    parts: list[Any] = [ts, events]
    if draw(st.booleans()):
        parts.append(draw(st.integers(-(2**63), U64_MAX) | values))
    return msgspec.msgpack.encode(parts)


def valid_payload(draw: st.DrawFn) -> bytes:
    toks = draw(st.sampled_from(SEEDED + [NEW]))
    form = draw(st.sampled_from(["map", "array"]))
    n = len(toks) // BS
    return batch_payload([stored(toks, 0, n, form), removed_event([engine_hash(tuple(toks[:BS]))], form=form)])


@st.composite
def bad_payload(draw: st.DrawFn) -> Bad:
    payload = draw(
        st.binary(max_size=64)
        | st.builds(msgspec.msgpack.encode, values)
        | batch_like()
        # nesting well below the recursion limit: where msgspec gives up on deeper payloads
        # depends on the decoding thread's stack and on the limit hypothesis sets while it runs,
        # so the error kind would differ between this thread and the worker (test_wire_fuzz
        # covers the depth kind in one thread)
        | st.integers(2, 600).map(lambda n: b"\x93\x00" + b"\x91" * n + b"\xc0")
    )
    engine = draw(st.sampled_from(["vllm", "vllm", "sglang"]))
    kind = error_kind(payload, engine)
    if kind is None or bad_event_kinds(payload, engine) is not None:  # a batch after all: not garbage
        payload, engine = b"\xc1", "vllm"  # 0xc1 is never valid msgpack
        kind = error_kind(payload)
    assert kind is not None
    return Bad(payload, kind, engine=engine)


MUTATIONS: list[tuple[str, Any]] = [  # (field, bad value) of a BlockStored map, or "ts"
    ("ts", float("nan")), ("ts", float("inf")), ("ts", "yesterday"), ("ts", None),
    ("block_hashes", [1.5]), ("block_hashes", [b""]), ("block_hashes", [None]), ("block_hashes", "abc"),
    ("block_hashes", [[1]]), ("parent_block_hash", 2.5), ("parent_block_hash", b""),
    ("block_size", 0), ("block_size", -(2**63)), ("block_size", U64_MAX), ("block_size", "16"),
    ("token_ids", [-1] * 2 * BS), ("token_ids", [1] * (2 * BS - 1)), ("token_ids", [U64_MAX] * (2 * BS + 1)),
    ("token_ids", ["a"] * 2 * BS), ("extra_keys", [None]), ("extra_keys", [None, None, None]),
    ("extra_keys", [{"a": 1}, None]), ("medium", 5), ("lora_name", 7),
]


@st.composite
def targeted(draw: st.DrawFn) -> Bad:
    """A valid batch with one field of its BlockStored made invalid (wrong type, huge int, wrong length)."""
    field, value = draw(st.sampled_from(MUTATIONS))
    base = stored(SEEDED[0], 0, 2)
    assert isinstance(base, dict)
    ev = dict(base)
    ts: Any = 1.0
    if field == "ts":
        ts = value
    else:
        ev[field] = value
    payload = msgspec.msgpack.encode([ts, [ev], 0])
    kind = error_kind(payload)
    assert kind is not None, (field, value)
    # a bad field spoils its event only: the batch decodes (empty) and consumes its seq
    return Bad(payload, kind, advances=bad_event_kinds(payload) is not None)


@st.composite
def truncated(draw: st.DrawFn) -> Bad:
    full = valid_payload(draw)
    payload = full[: draw(st.integers(0, len(full) - 1))]
    kind = error_kind(payload)
    assert kind is not None, "a strict prefix of a msgpack array is never a whole one"
    return Bad(payload, kind)


@st.composite
def bad_seq(draw: st.DrawFn) -> Bad:
    frame = draw(st.binary(max_size=20).filter(lambda b: len(b) != 8))
    return Bad(valid_payload(draw), "seq", seq=frame)


@st.composite
def bad_topic(draw: st.DrawFn) -> Bad:
    topic = draw(
        st.sampled_from([b"", b"kv@", b"kv@@m", b"kv@pod", b"kvx@pod@m", b"KV@pod@m", b"\xff\xfe@a@b", b"\x00kv@p@m"])
        | st.binary(max_size=16).filter(lambda t: parse_topic(t)[0] is None)
    )
    return Bad(valid_payload(draw), "topic", topic=topic)


@st.composite
def unknown_engine(draw: st.DrawFn) -> Bad:
    return Bad(valid_payload(draw), "engine", engine=draw(st.sampled_from(["tgi", "", "VLLM"])))


@st.composite
def apply_fails(draw: st.DrawFn) -> Bad:
    """Decodes, but its block size is not the index's: the event is counted (as a misconfigured stream's), not applied."""
    bs = draw(st.sampled_from([1, 4, 8, 32]))
    # at least one of the index's blocks of tokens: a shorter event is no evidence of the
    # engine's block size (SGLang's short last page), so it counts as an apply error instead
    n = max(2, BS // bs)
    toks = prompt(draw(st.integers(20, 30)), 4)[: n * bs]
    ev = stored(toks, 0, n, form=draw(st.sampled_from(["map", "array"])), block_size=bs)
    return Bad(batch_payload([ev]), "misconfigured", advances=True)


@st.composite
def unknown_events(draw: st.DrawFn) -> Bad:
    ev = draw(st.sampled_from([{"type": "BlockMoved", "block_hashes": [1]}, ["KVCacheResized", 3], {"type": "X"}]))
    n = draw(st.integers(1, 3))
    return Bad(batch_payload([ev] * n), "unknown_event", advances=True, count=n)


garbage = st.one_of(bad_payload(), targeted(), truncated(), bad_seq(), bad_topic(), unknown_engine(), apply_fails())


# -- the pool under test


def matches(index: KVBlockIndex) -> list[dict[str, list[int]]]:
    return [index.prefix_match(TP.request_keys(t, model=MODEL)) for t in SEEDED + [NEW]]


class Seeded:
    """A started pool over an index that holds SEEDED on two pods (seq 0 of each stream used)."""

    def __init__(self) -> None:
        self.index = KVBlockIndex(TP)
        self.pool = EventPool(self.index, concurrency=2, replay_timeout=0.5)
        self.pool.start()
        for pod, toks in ((POD, SEEDED[0]), ("pod-b", SEEDED[1])):
            self.submit(Source(), f"kv@{pod}@{MODEL}".encode(), seq_frame(0), batch_payload([stored(toks, 0, len(toks) // BS)]))
        self.submit(Source(), TOPIC, seq_frame(1), batch_payload([stored(SEEDED[2], 1, 3, "array")]))
        assert self.pool.flush(10)
        assert self.index.stats().orphan_blocks == 2  # SEEDED[2]'s first block was never stored
        self.next_seq = 2

    def submit(self, source: Source, topic: bytes, seq: bytes, payload: bytes) -> None:
        self.pool.submit(RawMessage(source, topic, seq, payload))

    def send_valid(self) -> None:
        self.submit(Source(), TOPIC, seq_frame(self.next_seq), batch_payload([stored(NEW, 0, 3, "array")]))
        self.next_seq += 1
        assert self.pool.flush(10)

    def close(self) -> None:
        self.pool.stop()


@FUZZ
@given(bad=st.lists(garbage | unknown_events(), min_size=1, max_size=6))
def test_garbage_is_counted_and_leaves_the_index_unchanged(bad: list[Bad]) -> None:
    rig = Seeded()
    try:
        index_before, matches_before, before = rig.index.stats(), matches(rig.index), rig.pool.stats()
        expected: Counter[str] = Counter()
        for item in bad:
            seq = item.seq if item.seq is not None else seq_frame(rig.next_seq)
            rig.submit(Source(pod=item.pod, engine=item.engine), item.topic, seq, item.payload)
            expected[item.kind] += item.count
            if item.advances:
                rig.next_seq += 1
        assert rig.pool.flush(10)
        after = rig.pool.stats()
        assert rig.index.stats() == index_before
        assert matches(rig.index) == matches_before
        got = Counter(after.errors_by_kind)
        got.subtract(before.errors_by_kind)
        assert +got == expected
        assert after.decode_errors - before.decode_errors == sum(expected.values())
        assert after.gaps == after.restarts == after.replay_requests == 0
        assert after.messages - before.messages == len(bad)

        rig.send_valid()  # the workers still run and the stream's seq tracking is intact
        m = rig.index.prefix_match(TP.request_keys(NEW, model=MODEL))
        assert m == {POD: [1, 1, 1]}
        final = rig.pool.stats()
        assert final.gaps == 0 and "internal" not in final.errors_by_kind
    finally:
        rig.close()


def test_bad_topic_with_a_configured_pod_is_not_an_error() -> None:
    rig = Seeded()
    try:
        rig.submit(Source(pod=POD), b"not-a-kv-topic", seq_frame(2), batch_payload([stored(NEW, 0, 3)]))
        assert rig.pool.flush(10)
        assert rig.pool.stats().decode_errors == 0
        assert rig.index.prefix_match(TP.request_keys(NEW, model=None)) == {POD: [1, 1, 1]}
    finally:
        rig.close()


# -- wrong frame counts through a real SUB socket


class SubRig(NamedTuple):
    pub: zmq.Socket
    sub: Subscriber
    pool: EventPool
    index: KVBlockIndex
    seq: list[int]


def _last(pool: EventPool) -> int | None:
    return next((last for p, _r, last in pool.streams() if p == POD), None)


def _send_sentinel(r: SubRig, timeout: float = 60.0) -> None:
    """Publish an empty batch at the next seq and wait (bounded) until the pool applied it."""
    s = r.seq[0]
    r.seq[0] += 1
    r.pub.send_multipart([TOPIC, seq_frame(s), batch_payload([])])
    deadline = time.monotonic() + timeout
    while _last(r.pool) != s:
        assert time.monotonic() < deadline, f"sentinel seq {s} never applied"
        time.sleep(0.005)
    assert r.pool.flush(10)


@pytest.fixture(scope="module")
def sub_rig() -> Iterator[SubRig]:
    ctx = zmq.Context.instance()
    pub = ctx.socket(zmq.PUB)
    pub.setsockopt(zmq.LINGER, 0)
    pub.bind("tcp://127.0.0.1:*")
    endpoint = pub.getsockopt_string(zmq.LAST_ENDPOINT)
    index = KVBlockIndex(TP)
    pool = EventPool(index, concurrency=2)
    pool.start()
    sub = Subscriber(pool, [EngineEndpoint(endpoint=endpoint, pod=POD, model=MODEL)])
    sub.start()
    r = SubRig(pub, sub, pool, index, [0])
    try:
        # slow joiner: publish until one message arrives, then seed the index
        deadline = time.monotonic() + 15.0
        while _last(pool) is None:
            assert time.monotonic() < deadline, "subscriber never received a message"
            pub.send_multipart([TOPIC, seq_frame(r.seq[0]), batch_payload([])])
            inner = time.monotonic() + 0.2
            while _last(pool) is None and time.monotonic() < inner:
                time.sleep(0.005)
        r.seq[0] = (_last(pool) or 0) + 1
        pub.send_multipart([TOPIC, seq_frame(r.seq[0]), batch_payload([stored(SEEDED[0], 0, 3)])])
        r.seq[0] += 1
        _send_sentinel(r)
        assert index.prefix_match(TP.request_keys(SEEDED[0], model=MODEL)) == {POD: [1, 1, 1]}
        yield r
    finally:
        sub.stop()
        pool.stop()
        pub.close(linger=0)


frame = st.binary(max_size=24) | st.just(TOPIC) | st.just(seq_frame(0)) | st.builds(lambda: batch_payload([]))


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(messages=st.lists(st.integers(1, 6).filter(lambda n: n != 3).flatmap(lambda n: st.lists(frame, min_size=n, max_size=n)), min_size=1, max_size=5))
def test_wrong_frame_counts_through_a_sub_socket(sub_rig: SubRig, messages: list[list[bytes]]) -> None:
    r = sub_rig
    index_before, before, received = r.index.stats(), r.pool.stats(), r.sub.received
    for frames in messages:
        r.pub.send_multipart(frames)
    _send_sentinel(r)  # PUB/SUB keeps order on one connection: everything before it was received
    after = r.pool.stats()
    assert r.sub.received - received == len(messages) + 1
    assert after.errors_by_kind.get("frames", 0) - before.errors_by_kind.get("frames", 0) == len(messages)
    assert after.decode_errors - before.decode_errors == len(messages)
    assert after.messages - before.messages == 1
    assert r.index.stats() == index_before
    assert after.gaps == after.restarts == 0
