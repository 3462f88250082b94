"""Fuzz of the whole write path over real ZMQ: bad messages never escape, never change the index, are all counted.

The rig (tests/fuzzrig.py) runs model engines on real PUB and ROUTER
sockets, the library's Subscriber, EventPool and index; hypothesis draws the
bad messages here (the volume run with a seeded generator is
``make fuzz``, bench/fuzz_writepath.py).  After each example: the errors by
kind equal the decoder's verdict on each bad payload, jumps and repeats are
all counted as skipped, no worker raised, and every stream of the index holds
exactly its engine's blocks.  About 10,000 messages in all.
"""

from __future__ import annotations

from collections.abc import Iterator

import hypothesis.strategies as st
import msgspec
import pytest
from hypothesis import HealthCheck, given, settings

from tests.fuzzrig import BS, Bad, FuzzRig, random_bad, valid_payload_of
from tests.oracle import batch_payload, stored_event

U64 = 2**64

msgpack_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**63), U64 - 1) | st.floats() | st.text(max_size=8)
    | st.binary(max_size=40),
    lambda children: st.lists(children, max_size=5) | st.dictionaries(st.text(max_size=4), children, max_size=4),
    max_leaves=20,
)
# block-hash values of every msgpack type (the decoder accepts ints and digests: those examples are skipped)
hash_values = (
    st.floats() | st.text(max_size=6) | st.none() | st.booleans() | st.binary(max_size=40)
    | st.lists(st.integers(0, 9), max_size=3)
    | st.dictionaries(st.text(max_size=2), st.integers(-(2**63), U64 - 1), max_size=2)
    | st.builds(msgspec.msgpack.Ext, st.integers(1, 127), st.binary(max_size=4))
)


def _stored(hashes: list, parent: object = None, n_tokens: int | None = None) -> dict:
    n = len(hashes) * BS if n_tokens is None else n_tokens
    return {"type": "BlockStored", "block_hashes": hashes, "parent_block_hash": parent,
            "token_ids": [1] * n, "block_size": BS, "medium": "GPU"}


bad_events = st.one_of(
    hash_values.map(lambda h: _stored([h])),
    hash_values.map(lambda h: _stored([5], parent=h)),
    hash_values.map(lambda h: {"type": "BlockRemoved", "block_hashes": [h], "medium": "GPU"}),
    hash_values.map(lambda h: ["BlockStored", [h], None, [1] * BS, BS]),
    st.integers(1, 4).flatmap(lambda n: st.integers(0, 4 * BS).filter(lambda t: t != n * BS).map(
        lambda t: _stored(list(range(10, 10 + n)), n_tokens=t))),
    st.integers(20_000, 60_000).map(lambda n: _stored([0.5] * n, n_tokens=0)),  # a huge array of junk hashes
    st.builds(lambda t, v: {"type": t, "v": v}, st.sampled_from(["BlockMoved", "Other"]), msgpack_values),
    msgpack_values.filter(lambda v: not isinstance(v, (dict, list))),
)


@st.composite
def truncated(draw: st.DrawFn) -> Bad:
    n = draw(st.integers(1, 3))
    p = batch_payload([stored_event(list(range(1, n + 1)), None, [2] * (n * BS), BS)], dp_rank=0, ts=1.0)
    return Bad("undecodable", payload=p[: draw(st.integers(0, len(p) - 1))])


valid_frame_payload = batch_payload([stored_event([1], None, [3] * BS, BS)], dp_rank=0, ts=1.0)

bad_messages = st.one_of(
    st.binary(max_size=200).map(lambda b: Bad("undecodable", payload=b)),
    msgpack_values.map(lambda v: Bad("undecodable", payload=msgspec.msgpack.encode(v))),
    truncated(),
    st.binary(min_size=0, max_size=12).map(lambda b: Bad("undecodable", payload=b"\xdd\xff\xff\xff\xff" + b)),
    st.binary(max_size=16).filter(lambda b: len(b) != 8).map(
        lambda s: Bad("undecodable", payload=valid_frame_payload, seq=s)),
    st.integers(1, 6).filter(lambda n: n != 3).flatmap(
        lambda n: st.lists(st.binary(max_size=12), min_size=n, max_size=n)).map(
        lambda fs: Bad("frames", frames=tuple(fs))),
    st.lists(bad_events, min_size=1, max_size=3).map(lambda evs: Bad("bad_events", events=tuple(evs))),
    st.integers(1, U64).map(lambda k: Bad("jump", offset=k)),
    st.builds(lambda k, same: Bad("repeat", offset=k, same=same), st.integers(1, 40), st.booleans()),
)


@pytest.fixture(scope="module")
def rig() -> Iterator[FuzzRig]:
    r = FuzzRig(seed=7, n_engines=3)
    yield r
    print(f'\n[fuzz] {r.sent:,} messages, bad by class {dict(r.sent_by_class)}')
    r.close()


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow,
          HealthCheck.function_scoped_fixture, HealthCheck.data_too_large, HealthCheck.filter_too_much])
@given(plan=st.lists(st.tuples(st.integers(0, 2), st.integers(0, 2), bad_messages), min_size=5, max_size=60))
def test_bad_messages_are_counted_and_change_nothing(rig: FuzzRig, plan: list[tuple[int, int, Bad]]) -> None:
    base = rig.reset_expectations()
    for engine, n_valid, bad in plan:
        for _ in range(n_valid):
            rig.valid(engine)
        rig.bad(bad, engine)
    rig.finish()
    rig.check(base)


def test_seeded_generator_volume(rig: FuzzRig) -> None:
    """The volume run's own generator (bench/fuzz_writepath.py), 4,000 bad messages."""
    base = rig.reset_expectations()
    rnd = rig.rnd
    n = 0
    while n < 4000:
        i = rnd.randrange(len(rig.engines))
        if rnd.random() < 0.33:
            rig.valid(i)
            continue
        e = rig.engines[i]
        if rig.bad(random_bad(rnd, lambda: valid_payload_of(e, rnd)), i):
            n += 1
            if n % 500 == 0:
                rig.settle()
    rig.finish()
    rig.check(base)
    assert set(rig.sent_by_class) == {"undecodable", "frames", "bad_events", "jump", "repeat"}
