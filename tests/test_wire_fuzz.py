"""Fuzz the payload decoders: garbage in, PayloadError (and nothing else) out.

Inputs: random bytes; valid msgpack of arbitrary shapes and types; valid
batches truncated at every length or with one field replaced by junk; deep
nesting; token_ids of the wrong length; out-of-range hashes.  Whatever a
decoder returns must be a well-formed EventBatch (uint64 hashes, tokens
covering their blocks).
"""

from __future__ import annotations

import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvevents.events import AllBlocksCleared, BlockRemoved, BlockStored, EventBatch
from kvevents.sglang import decode_sglang_batch, split_sglang_topic
from kvevents.wire import PayloadError, decode_seq, decode_vllm_batch, normalize_block_hash, parse_topic

enc = msgspec.msgpack.encode
U64 = 2**64
DECODERS = [decode_vllm_batch, decode_sglang_batch]
FUZZ = settings(max_examples=300, suppress_health_check=[HealthCheck.too_slow], deadline=None)


def check_well_formed(b: EventBatch) -> None:
    assert isinstance(b, EventBatch)
    assert isinstance(b.ts, float)
    assert b.dp_rank is None or (isinstance(b.dp_rank, int) and b.dp_rank >= 0)
    for ev in b.events:
        assert isinstance(ev, (BlockStored, BlockRemoved, AllBlocksCleared))
        if isinstance(ev, AllBlocksCleared):
            continue
        assert isinstance(ev.block_hashes, tuple)
        assert all(type(h) is int and 0 <= h < U64 for h in ev.block_hashes)
        assert isinstance(ev.tier, str) and ev.tier == ev.tier.lower()
        if isinstance(ev, BlockStored):
            assert ev.block_size >= 1
            assert ev.parent_block_hash is None or 0 <= ev.parent_block_hash < U64
            assert ev.token_ids == () or len(ev.token_ids) == ev.block_size * len(ev.block_hashes)
            assert all(type(t) is int and t >= 0 for t in ev.token_ids)
            hash(ev)  # frozen and hashable all the way down


def run(decode, payload) -> str:
    """Decode; return "ok", the PayloadError kind, or the kind of the batch's first malformed event.

    Any other exception fails.
    """
    try:
        b = decode(payload)
    except PayloadError as e:
        assert isinstance(e.kind, str) and e.kind
        return e.kind
    check_well_formed(b)
    if b.bad_events:
        assert all(isinstance(k, str) and k for k in b.bad_events)
        return b.bad_events[0]
    return "ok"


# ------------------------------------------------------------ strategies ---

scalars = st.one_of(
    st.none(), st.booleans(), st.integers(-(2**63), U64 - 1), st.floats(),
    st.text(max_size=12), st.binary(max_size=40),
    st.sampled_from(["BlockStored", "BlockRemoved", "AllBlocksCleared", "type", "GPU", "CPU_PINNED"]),
)
msgpack_values = st.recursive(
    scalars,
    lambda c: st.lists(c, max_size=6) | st.dictionaries(st.text(max_size=8) | st.sampled_from(
        ["type", "block_hashes", "token_ids", "block_size", "parent_block_hash", "medium", "extra_keys"]), c, max_size=6),
    max_leaves=40,
)

# Valid-looking events with random field values (right names, wrong types).
field_value = st.one_of(scalars, st.lists(scalars, max_size=5), st.lists(st.lists(scalars, max_size=3), max_size=3))


@st.composite
def near_valid_event(draw):
    tag = draw(st.sampled_from(["BlockStored", "BlockRemoved", "AllBlocksCleared", "Other"]))
    n = draw(st.integers(0, 10))
    fields = [draw(field_value) for _ in range(n)]
    if draw(st.booleans()):
        return [tag, *fields]
    names = ["block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium",
             "lora_name", "extra_keys", "group_idx", "metadata"]
    return {"type": tag, **dict(zip(names, fields))}


@st.composite
def valid_event(draw):
    kind = draw(st.sampled_from(["stored", "removed", "cleared"]))
    if kind == "cleared":
        return ["AllBlocksCleared"]
    n = draw(st.integers(1, 4))
    hashes = draw(st.lists(st.integers(-(2**63), U64 - 1) | st.binary(min_size=1, max_size=32), min_size=n, max_size=n))
    if kind == "removed":
        return ["BlockRemoved", hashes, draw(st.sampled_from([None, "GPU", "CPU"]))]
    bs = draw(st.integers(1, 8))
    return ["BlockStored", hashes, None, list(range(n * bs)), bs, None, "GPU"]


def valid_payload(draw_events):
    return enc([1.0, draw_events, 0])


# ----------------------------------------------------------------- tests ---


@pytest.mark.parametrize("decode", DECODERS)
@FUZZ
@given(st.binary(max_size=200))
def test_random_bytes(decode, payload):
    run(decode, payload)


@pytest.mark.parametrize("decode", DECODERS)
@FUZZ
@given(msgpack_values)
def test_valid_msgpack_of_any_shape(decode, value):
    run(decode, enc(value))


@pytest.mark.parametrize("decode", DECODERS)
@FUZZ
@given(st.one_of(scalars, st.integers(0, 2**40)), st.lists(near_valid_event(), max_size=4), msgpack_values)
def test_batches_of_near_valid_events(decode, ts, events, rank):
    run(decode, enc([ts, events, rank]))
    run(decode, enc([ts, events]))


@pytest.mark.parametrize("decode", DECODERS)
@FUZZ
@given(st.lists(valid_event(), min_size=1, max_size=4), st.data())
def test_truncated_valid_payloads(decode, events, data):
    payload = enc([1.0, events, 3])
    assert run(decode, payload) == "ok"
    cut = data.draw(st.integers(0, len(payload) - 1))
    assert run(decode, payload[:cut]) != "ok"  # a strict prefix of one msgpack value is never valid


@pytest.mark.parametrize("decode", DECODERS)
@FUZZ
@given(st.lists(valid_event(), min_size=1, max_size=4), st.data())
def test_one_field_replaced_by_junk(decode, events, data):
    i = data.draw(st.integers(0, len(events) - 1))
    ev = list(events[i])
    j = data.draw(st.integers(0, len(ev)))
    junk = data.draw(msgpack_values)
    if j == len(ev):
        ev.append(junk)
    else:
        ev[j] = junk
    events = [*events[:i], ev, *events[i + 1 :]]
    run(decode, enc([1.0, events, 0]))


@pytest.mark.parametrize("decode", DECODERS)
@FUZZ
@given(st.integers(1, 6), st.integers(1, 16), st.integers(0, 200))
def test_token_ids_length_mismatch(decode, n, bs, n_tokens):
    ev = ["BlockStored", list(range(n)), None, [1] * n_tokens, bs, None, "GPU"]
    kind = run(decode, enc([1.0, [ev], 0]))
    if n_tokens in (0, n * bs):
        assert kind == "ok"
    else:
        assert kind == "token_ids"


@pytest.mark.parametrize("decode", DECODERS)
@pytest.mark.parametrize("depth", [10, 500, 5_000, 100_000])
def test_deep_nesting(decode, depth):
    deep = b"\x91" * depth + b"\x01"
    # as the whole payload, inside an event, inside extra_keys/metadata
    for payload in (
        deep,
        b"\x93\xcb" + enc(1.0)[1:] + b"\x91" + deep + b"\x00",
        enc([1.0, [["BlockStored", [1], None, [], 1, None, None, None]], 0])[:-3] + b"\x91" + deep + b"\x00",
    ):
        run(decode, payload)


@pytest.mark.parametrize("decode", DECODERS)
def test_huge_and_odd_numbers(decode):
    # msgpack cannot carry ints beyond 64 bits; the boundaries decode, NaN/inf ts do not.
    for h in (U64 - 1, -(2**63), 2**63, 0):
        assert run(decode, enc([1.0, [["BlockRemoved", [h]]], 0])) == "ok"
    assert run(decode, enc([float("inf"), [], 0])) == "ts"
    assert run(decode, enc([1.0, [["BlockStored", [1], None, [], 2**63]]])) == "ok"
    assert run(decode, enc([1.0, [["BlockStored", [1], None, [], -(2**63)]]])) == "block_size"
    for h in (U64, -(2**63) - 1, 2**200, -(2**200)):
        with pytest.raises(PayloadError):
            normalize_block_hash(h)


@FUZZ
@given(st.binary(max_size=30) | st.text(max_size=30) | st.none() | st.integers() | st.integers(10**12, 10**18))
def test_frames_never_raise_anything_but_payload_error(frame):
    parse_topic(frame)  # never raises at all
    split_sglang_topic(frame)
    try:
        n = decode_seq(frame)
    except PayloadError as e:
        assert e.kind == "seq"
    else:
        assert 0 <= n < U64
