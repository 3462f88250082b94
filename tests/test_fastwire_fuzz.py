"""The fast decoder (kvevents.fastwire) held to the reference decoder (kvevents.wire).

For any payload, real-shaped, perturbed or hostile: either the fast decoder
declines it (the pool then decodes it the reference way), or the reference
decoder takes it whole (no event left out or skipped) into the same events:
same hashes, parents, tokens, block sizes and tiers; and applying the fast
batch to the compiled index leaves the same state and counters, with the same
ApplyResult, as applying the reference events.  A pool with the fast path and
one without end in the same index state, counters and stream states.
"""

from __future__ import annotations

import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

pytest.importorskip("kvindex._native")

from kvevents.events import AllBlocksCleared, BlockRemoved, BlockStored  # noqa: E402
from kvevents.fastwire import decode_fast  # noqa: E402
from kvevents.pool import EventPool, RawMessage, Source  # noqa: E402
from kvevents.wire import PayloadError, decode_vllm_batch  # noqa: E402
from kvindex.keys import TokenProcessor  # noqa: E402
from kvindex.native import NativeKVBlockIndex  # noqa: E402
from kvindex.tiers import TIERS  # noqa: E402

enc = msgspec.msgpack.encode
U64 = 2**64
BS = 4
KINDS = (BlockStored, BlockRemoved, AllBlocksCleared)
FUZZ = settings(max_examples=400, suppress_health_check=[HealthCheck.too_slow], deadline=None)

# A few hashes, so that parents resolve and removals hit.
HASHES = [1, 2, 3, 2**63, U64 - 1, 77, 12345678901]


# ------------------------------------------------------------ encodings ---
# msgspec writes every integer in its shortest form; engines' encoders need not.  These build
# the other legal forms (and a few illegal ones) of an integer array, as msgspec.Raw values.


def wide_int(v: int, width: int) -> bytes:
    """msgpack int ``v`` written with a fixed width (1, 2, 4, 8 bytes; signed if v < 0)."""
    if v < 0:
        return bytes([{1: 0xD0, 2: 0xD1, 4: 0xD2, 8: 0xD3}[width]]) + v.to_bytes(width, "big", signed=True)
    return bytes([{1: 0xCC, 2: 0xCD, 4: 0xCE, 8: 0xCF}[width]]) + v.to_bytes(width, "big")


@st.composite
def int_item(draw, v: int) -> bytes:
    widths = [w for w in (1, 2, 4, 8) if (-(2 ** (8 * w - 1)) <= v < 2 ** (8 * w - 1) if v < 0 else v < 2 ** (8 * w))]
    if draw(st.booleans()):
        return enc(v)
    return wide_int(v, draw(st.sampled_from(widths)))


@st.composite
def int_array(draw, values: list) -> msgspec.Raw:
    """An array of ``values`` (ints, bytes) in a random legal header and item widths."""
    items = [draw(int_item(v)) if isinstance(v, int) else enc(v) for v in values]
    n = len(items)
    header = draw(st.sampled_from(
        ([bytes([0x90 | n])] if n < 16 else []) + [b"\xdc" + n.to_bytes(2, "big"), b"\xdd" + n.to_bytes(4, "big")]
    ))
    return msgspec.Raw(header + b"".join(items))


# ------------------------------------------------------------- events ---

hash_value = st.one_of(
    st.sampled_from(HASHES), st.integers(-(2**63), U64 - 1), st.binary(min_size=1, max_size=40),
)
token = st.integers(0, 2**17) | st.integers(0, U64 - 1)
odd_value = st.one_of(st.none(), st.integers(-3, 3), st.text(max_size=4), st.binary(max_size=3), st.floats(),
                      st.lists(st.integers(-1, 3), max_size=2))


@st.composite
def stored(draw, form: str, odd: bool = True):
    """A BlockStored; ``odd``: now and then a field the fast decoder does not take or a wrong value."""
    n = draw(st.integers(1, 4))
    bs = draw(st.sampled_from([BS, BS, BS, 1, 8]))
    hashes = draw(st.lists(hash_value, min_size=n, max_size=n))
    ntok = n * bs if not odd or draw(st.integers(0, 9)) else draw(st.integers(0, n * bs + 2))
    toks = draw(st.lists(token, min_size=ntok, max_size=ntok))
    if odd and toks and draw(st.integers(0, 19)) == 0:
        toks[draw(st.integers(0, ntok - 1))] = draw(st.integers(-(2**63), -1))  # a negative token id
    fields = {
        "block_hashes": draw(int_array(hashes)),
        "parent_block_hash": draw(st.none() | st.sampled_from(HASHES) | st.integers(-(2**63), -1) | (
            st.binary(min_size=1, max_size=9) if odd else st.none())),
        "token_ids": draw(int_array(toks)),
        "block_size": bs,
        "medium": draw(st.sampled_from([None, "GPU", "GPU", "CPU", "STORAGE", "cpu"] + (["NVMe"] if odd else []))),
    }
    # the optional fields, mostly at their plain values
    for k, plain in (("lora_id", None), ("lora_name", None), ("extra_keys", None), ("group_idx", 0),
                     ("kv_cache_spec_kind", "full_attention"), ("kv_cache_spec_sliding_window", None),
                     ("locality", None), ("ownership", None), ("session_id", "s")):
        r = draw(st.integers(0, 29))
        if r < 8:
            fields[k] = plain if r < 4 else None
        elif r == 8 and odd:
            fields[k] = draw(odd_value | st.sampled_from(["sliding_window", "mamba", "LOCAL", "x"]))
    if odd and form == "map" and draw(st.integers(0, 19)) == 0:
        fields["lookahead_token_ids"] = draw(st.none() | st.just([]) | st.just([[1]] * n))
    return "BlockStored", fields


@st.composite
def removed(draw, form: str, odd: bool = True):
    hashes = draw(st.lists(hash_value, max_size=4))
    fields = {"block_hashes": draw(int_array(hashes)),
              "medium": draw(st.sampled_from([None, "GPU", "CPU"] + (["x"] if odd else [])))}
    if draw(st.integers(0, 4)) == 0:
        fields["group_idx"] = draw(st.sampled_from([0, 1, None] if odd else [0, None]))
    if odd and draw(st.integers(0, 9)) == 0:
        fields["ownership"] = "lmcache"
    return "BlockRemoved", fields


ORDER = {
    "BlockStored": ["block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium",
                    "lora_name", "extra_keys", "group_idx", "kv_cache_spec_kind",
                    "kv_cache_spec_sliding_window", "locality", "ownership", "session_id"],
    "BlockRemoved": ["block_hashes", "medium", "group_idx", "locality", "ownership"],
    "AllBlocksCleared": [],
}


@st.composite
def event(draw, form: str, odd: bool = True):
    tag, fields = draw(st.one_of(stored(form, odd), stored(form, odd), removed(form, odd),
                                 st.just(("AllBlocksCleared", {}))))
    if odd and draw(st.integers(0, 14)) == 0:
        fields["a_future_field"] = 1
    if form == "map":
        return {"type": tag, **fields}
    names = ORDER[tag]
    if any(k not in names for k in fields):
        return [tag, *fields.values()]  # a map-only field: not positional at all
    vals = [fields.get(k) for k in names]
    last = max([i + 1 for i, k in enumerate(names) if fields.get(k) is not None] + [4 if tag == "BlockStored" else 0])
    return [tag, *vals[:last]]


@st.composite
def payloads(draw):
    form = draw(st.sampled_from(["map", "map", "arr"]))
    odd = draw(st.integers(0, 2)) == 0  # else every event of the plain shape (mostly taken by the fast decoder)
    evs = draw(st.lists(event(form, odd), max_size=6))
    if draw(st.integers(0, 14)) == 0 and evs:  # a batch mixing the two forms
        evs[0] = draw(event("arr" if form == "map" else "map"))
    ts = draw(st.floats(allow_nan=False, allow_infinity=False) | st.integers(0, 2**40) | st.sampled_from(
        [float("nan"), float("inf")]))
    rank = draw(st.sampled_from([None, 0, 0, 1, 3, 2**31, -1]))
    tail = draw(st.sampled_from([[], [rank], [rank, "extra"]]))
    return enc([ts, evs, *tail])


@st.composite
def hostile(draw):
    """A real-shaped payload with bytes flipped, cut or inserted."""
    p = bytearray(draw(payloads()))
    for _ in range(draw(st.integers(1, 3))):
        op = draw(st.sampled_from(["flip", "cut", "insert"]))
        i = draw(st.integers(0, max(0, len(p) - 1)))
        if op == "flip" and p:
            p[i] = draw(st.integers(0, 255))
        elif op == "cut":
            del p[i:]
        else:
            p[i:i] = draw(st.binary(min_size=1, max_size=4))
    return bytes(p)


# -------------------------------------------------------------- checks ---


def expected_contents(ev) -> tuple:
    """The reference event as RawBatch.contents() writes it."""
    if type(ev) is AllBlocksCleared:
        return (2, 0, None, 0, [], [])
    bit = TIERS._bits[ev.tier]
    if type(ev) is BlockRemoved:
        return (1, bit, None, 0, list(ev.block_hashes), [])
    return (0, bit, ev.parent_block_hash, ev.block_size, list(ev.block_hashes), list(ev.token_ids))


def same_decoding(payload: bytes):
    """Fast and reference decodings agree; returns the fast batch (or None)."""
    fb = decode_fast(payload)
    if fb is None:
        return None
    ref = decode_vllm_batch(payload)  # must not raise: the fast decoder took it
    assert ref.bad_events == () and ref.skipped_events == 0
    assert (fb.ts, fb.dp_rank) == (ref.ts, ref.dp_rank)
    assert fb.raw.resets == any(type(e) is AllBlocksCleared for e in ref.events)
    assert fb.raw.contents() == [expected_contents(e) for e in ref.events]
    assert fb.events == ref.events
    return fb


def index_state(ix: NativeKVBlockIndex) -> tuple:
    pods = sorted(ix.pods())
    return (ix.stats(), pods, {p: sorted(ix.pod_keys(p)) for p in pods}, ix.tier_stats(),
            {h: ix.request_key_of(h) for h in HASHES}, ix.models())


def new_index() -> NativeKVBlockIndex:
    return NativeKVBlockIndex(TokenProcessor(block_size=BS), capacity=64)


def apply_both(batches: list[bytes]) -> None:
    """Apply each payload the fast way (when taken) and the reference way to two indexes; compare."""
    a, b = new_index(), new_index()
    for payload in batches:
        fb = same_decoding(payload)
        if fb is None:
            continue
        ra = a.apply_raw("p", 0, fb.raw, fb.slow_events, model="m", kinds=KINDS)
        rb = b.apply_events("p", 0, decode_vllm_batch(payload).events, model="m", kinds=KINDS)
        assert ra == rb
        a.check()
        assert index_state(a) == index_state(b)


# ---------------------------------------------------------------- tests ---


@FUZZ
@given(payloads())
def test_real_shapes_decode_as_the_reference(payload):
    same_decoding(payload)


@FUZZ
@given(hostile())
def test_hostile_payloads_decode_as_the_reference_or_not_at_all(payload):
    same_decoding(payload)


@FUZZ
@given(st.binary(max_size=120))
def test_random_bytes_never_raise(payload):
    same_decoding(payload)


@settings(max_examples=150, suppress_health_check=[HealthCheck.too_slow], deadline=None)
@given(st.lists(payloads(), min_size=1, max_size=8))
def test_applied_the_same_state_and_counters(batches):
    apply_both(batches)


@pytest.mark.parametrize("raw, hashes, want", [
    (b"\x90", True, []),
    (b"\x92\x01\xff", True, [1, U64 - 1]),  # negative fixint: two's complement
    (b"\x92\x01\xff", False, None),  # a negative token id
    (b"\x91\xd0\x05", False, [5]),  # a non-negative int8
    (b"\x91\xc4\x00", True, None),  # an empty digest
    (b"\x91\xc4\x02\x01\x02", True, [0x0102]),  # a short digest, zero-extended
    (b"\x91\xc4\x02\x01\x02", False, None),  # a digest among tokens
    (b"\x91\xc0", True, None),  # nil
    (b"\x91\xca\x00\x00\x00\x00", False, None),  # a float
    (b"\x92\x01", True, None),  # truncated
    (b"\x91\x01\x02", True, None),  # bytes left over
    (b"\xdd\xff\xff\xff\xff\x01", True, None),  # a count beyond the bytes
    (b"\x81\x01\x02", True, None),  # a map
])
def test_reader_edges(raw, hashes, want):
    """The integer-array reader on its own: hashes through a BlockRemoved, tokens through a one-block store."""
    if hashes:
        ev = {"type": "BlockRemoved", "block_hashes": msgspec.Raw(raw)}
    else:
        ev = {"type": "BlockStored", "block_hashes": [9], "parent_block_hash": None, "token_ids": msgspec.Raw(raw),
              "block_size": max(1, len(want or [0]))}
    fb = same_decoding(enc([1.0, [ev], 0]))
    if want is None:
        assert fb is None
    else:
        got = fb.raw.contents()[0]
        assert (got[4] if hashes else got[5]) == want


def test_plain_real_shapes_are_taken():
    """The shapes the fast path is for are decoded by it (not all sent the reference way)."""
    toks = list(range(32))
    plain = {"type": "BlockStored", "block_hashes": [1, 2], "parent_block_hash": None, "token_ids": toks,
             "block_size": 16, "lora_id": None, "medium": "GPU", "lora_name": None, "group_idx": 0,
             "kv_cache_spec_kind": "full_attention"}
    for evs in ([plain], [plain, {"type": "BlockRemoved", "block_hashes": [2], "medium": "GPU"}],
                [["BlockStored", [1], None, toks[:16], 16, None, "GPU"], ["AllBlocksCleared"]]):
        assert same_decoding(enc([1.5, evs, 0])) is not None
    # LoRA, extra keys, another group, a sliding window: the reference's
    for k, v in (("lora_name", "a"), ("extra_keys", [None, None]), ("group_idx", 1),
                 ("kv_cache_spec_kind", "sliding_window"), ("locality", "REMOTE")):
        assert decode_fast(enc([1.5, [{**plain, k: v}], 0])) is None


# ------------------------------------------------------------ the pool ---


def run_pool(fast: bool, msgs: list[tuple[int, bytes]]) -> tuple:
    ix = new_index()
    pool = EventPool(ix, concurrency=1, fast_path=fast)
    with pool:
        for seq, payload in msgs:
            pool.submit(RawMessage(Source(pod="p"), b"kv@p@m", seq.to_bytes(8, "big"), payload))
        assert pool.flush(30)
        st = pool.stats()
        counters = pool.stream_counters()
        states = [(s.pod, s.model, s.dp_rank, s.complete, s.last_seq, s.why, s.losses) for s in pool.completeness()]
    return index_state(ix), st, counters, states


@settings(max_examples=60, suppress_health_check=[HealthCheck.too_slow], deadline=None)
@given(st.lists(st.tuples(st.integers(0, 12), payloads() | hostile()), min_size=1, max_size=10))
def test_pool_with_and_without_the_fast_path(msgs):
    """The same messages (with repeated, skipped and backward seqs) through a pool each way."""
    for _, p in msgs:
        same_decoding(p)
    assert run_pool(True, msgs) == run_pool(False, msgs)


def test_decode_fast_never_raises_on_non_bytes():
    for p in (None, 1, "x", [1]):
        assert decode_fast(p) is None
        with pytest.raises(PayloadError):
            decode_vllm_batch(p)
