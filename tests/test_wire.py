"""vLLM wire decoding: map and array encodings decode to the same domain events.

Hypothesis draws domain-level events with every hash form (uint64 incl.
>= 2**63, negative int64, raw digests), encodes each batch with
``msgspec.msgpack.encode`` of plain dicts (current vLLM: tagged maps, default
fields omitted) and of plain lists (older vLLM: positional arrays, truncated
old layouts, unknown trailing fields), and checks both decode to the expected
EventBatch.  The oracle normalises hashes with vLLM's own formula
(``int.from_bytes(digest, "big") & (2**64 - 1)``) and Python's modulo.
"""

from __future__ import annotations

import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvevents.events import AllBlocksCleared, BlockRemoved, BlockStored, EventBatch
from kvevents.wire import (
    REPLAY_END_SEQ,
    PayloadError,
    decode_seq,
    decode_vllm_batch,
    normalize_block_hash,
    parse_topic,
)

enc = msgspec.msgpack.encode
U64 = 2**64

# ---------------------------------------------------------------- oracle ---

MEDIUM_ORACLE = {None: "gpu", "GPU": "gpu", "CPU": "cpu", "STORAGE": "storage"}


def oracle_hash(h: int | bytes) -> int:
    if isinstance(h, bytes):
        return int.from_bytes(h, "big") & (U64 - 1)
    return h % U64


def oracle_tier(medium: str | None) -> str:
    return MEDIUM_ORACLE.get(medium, medium.lower() if medium else "gpu")


def freeze(v):
    return tuple(freeze(x) for x in v) if isinstance(v, list) else v


# ------------------------------------------------------------ strategies ---

wire_hashes = st.one_of(
    st.integers(0, U64 - 1),
    st.integers(2**63, U64 - 1),
    st.integers(-(2**63), -1),
    st.binary(min_size=32, max_size=32),
    st.binary(min_size=1, max_size=40),
)
opt_int = st.none() | st.integers(0, 2**31)
opt_str = st.none() | st.text(max_size=8)
media = st.sampled_from([None, "GPU", "CPU", "STORAGE", "NVMe"])
extra_atom = st.one_of(st.text(max_size=6), st.integers(-(2**40), 2**40), st.binary(max_size=8))
extra_entry = st.none() | st.lists(extra_atom | st.lists(extra_atom, max_size=3), max_size=4)

STORED_FIELDS = [
    "block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium",
    "lora_name", "extra_keys", "group_idx", "kv_cache_spec_kind",
    "kv_cache_spec_sliding_window", "locality", "ownership", "session_id",
]
REMOVED_FIELDS = ["block_hashes", "medium", "group_idx", "locality", "ownership"]


@st.composite
def stored(draw):
    n = draw(st.integers(0, 5))
    bs = draw(st.integers(1, 16))
    hashes = draw(st.lists(wire_hashes, min_size=n, max_size=n))
    tokenless = draw(st.booleans())
    toks = [] if tokenless else draw(st.lists(st.integers(0, 2**32), min_size=n * bs, max_size=n * bs))
    ek = draw(st.none() | st.lists(extra_entry, min_size=n, max_size=n)) if n else None
    fields = {
        "block_hashes": hashes,
        "parent_block_hash": draw(st.none() | wire_hashes),
        "token_ids": toks,
        "block_size": bs,
        "lora_id": draw(opt_int),
        "medium": draw(media),
        "lora_name": draw(opt_str),
        "extra_keys": ek,
        "group_idx": draw(opt_int),
        "kv_cache_spec_kind": draw(st.none() | st.sampled_from(["full_attention", "sliding_window"])),
        "kv_cache_spec_sliding_window": draw(opt_int),
        "locality": draw(st.none() | st.sampled_from(["LOCAL", "REMOTE"])),
        "ownership": draw(opt_str),
        "session_id": draw(opt_str),
    }
    p = fields["parent_block_hash"]
    expected = BlockStored(
        block_hashes=tuple(oracle_hash(h) for h in hashes),
        parent_block_hash=None if p is None else oracle_hash(p),
        token_ids=tuple(toks),
        block_size=bs,
        tier=oracle_tier(fields["medium"]),
        lora_id=fields["lora_id"],
        lora_name=fields["lora_name"],
        extra_keys=None if ek is None else tuple(freeze(e) for e in ek),
        group_idx=fields["group_idx"],
        kv_cache_spec_kind=fields["kv_cache_spec_kind"],
        kv_cache_spec_sliding_window=fields["kv_cache_spec_sliding_window"],
        locality=fields["locality"],
        ownership=fields["ownership"],
        session_id=fields["session_id"],
    )
    return "BlockStored", fields, expected


@st.composite
def removed(draw):
    hashes = draw(st.lists(wire_hashes, max_size=6))
    fields = {
        "block_hashes": hashes,
        "medium": draw(media),
        "group_idx": draw(opt_int),
        "locality": draw(st.none() | st.sampled_from(["LOCAL", "REMOTE"])),
        "ownership": draw(opt_str),
    }
    expected = BlockRemoved(
        block_hashes=tuple(oracle_hash(h) for h in hashes),
        tier=oracle_tier(fields["medium"]),
        group_idx=fields["group_idx"],
        locality=fields["locality"],
        ownership=fields["ownership"],
    )
    return "BlockRemoved", fields, expected


cleared = st.just(("AllBlocksCleared", {}, AllBlocksCleared()))
events = st.one_of(stored(), removed(), cleared)
junk = st.one_of(st.none(), st.integers(-5, 5), st.text(max_size=4), st.lists(st.integers(-(2**63), U64 - 1), max_size=2))

# Fields vLLM 0.32 always writes into the map (they have no default).
MAP_REQUIRED = {"block_hashes", "parent_block_hash", "token_ids", "block_size"}
MAP_NO_DEFAULT = {"lora_id", "medium", "lora_name"}


def as_map(draw, tag, fields):
    m = {"type": tag}
    omit_no_default = draw(st.booleans())  # older map encoders may omit them too
    for k, v in fields.items():
        if v is None and k not in MAP_REQUIRED and (k not in MAP_NO_DEFAULT or omit_no_default):
            continue
        m[k] = v
    if draw(st.booleans()):
        m["some_future_field"] = draw(junk)
    return m


def as_array(draw, tag, fields):
    order = STORED_FIELDS if tag == "BlockStored" else REMOVED_FIELDS if tag == "BlockRemoved" else []
    values = [fields[k] for k in order]
    minimum = 4 if tag == "BlockStored" else 1 if tag == "BlockRemoved" else 0
    last = max([i + 1 for i, v in enumerate(values) if v is not None] + [minimum])
    cut = draw(st.integers(last, len(values)))  # old engines stop early
    arr = [tag] + values[:cut]
    if cut == len(values):
        arr += draw(st.lists(junk, max_size=3))  # newer engines append fields
    return arr


@st.composite
def batches(draw):
    evs = draw(st.lists(events, max_size=6))
    ts = draw(st.floats(allow_nan=False, allow_infinity=False) | st.integers(0, 2**40))
    rank = draw(st.none() | st.integers(0, 1024))
    tail_style = draw(st.sampled_from(["omit", "nil", "value"]))
    def wrap(items):
        if rank is None and tail_style == "omit":
            return [ts, items]
        return [ts, items, rank]
    map_payload = enc(wrap([as_map(draw, t, f) for t, f, _ in evs]))
    arr_payload = enc(wrap([as_array(draw, t, f) for t, f, _ in evs]))
    expected = EventBatch(ts=float(ts), events=tuple(e for _, _, e in evs), dp_rank=rank)
    return map_payload, arr_payload, expected


@settings(max_examples=300, suppress_health_check=[HealthCheck.too_slow])
@given(batches())
def test_map_and_array_forms_decode_identically(b):
    map_payload, arr_payload, expected = b
    got_map = decode_vllm_batch(map_payload)
    got_arr = decode_vllm_batch(arr_payload)
    assert got_map == expected
    assert got_arr == expected
    for ev in got_map.events:
        for h in getattr(ev, "block_hashes", ()):
            assert 0 <= h < U64


@settings(max_examples=100)
@given(st.lists(events, min_size=1, max_size=5), st.data())
def test_batch_mixing_forms_and_unknown_event_types(evs, data):
    items, expected = [], []
    for tag, fields, exp in evs:
        items.append(as_map(data.draw, tag, fields) if data.draw(st.booleans()) else as_array(data.draw, tag, fields))
        expected.append(exp)
        if data.draw(st.booleans()):
            items.append({"type": "KVCacheSpecChanged", "x": 1} if data.draw(st.booleans()) else ["SomeNewEvent", 1, 2])
    n_unknown = len(items) - len(expected)
    got = decode_vllm_batch(enc([1.0, items, 0]))
    assert got.events == tuple(expected)
    assert got.skipped_events == n_unknown


# ---------------------------------------------- recorded vLLM 0.32 payload ---

# Encoded by vLLM 0.32's own KVEventBatch/BlockStored/BlockRemoved/
# AllBlocksCleared classes (vllm/distributed/kv_events.py) with msgspec:
#   BlockStored([2**64-1, 12345], None, range(32), 16, None, "GPU", None)
#   BlockStored([b"\x07"*32], 12345, [], 16, 7, "CPU", "ad",
#               extra_keys=[("ad", ("mm", 3), "salt")], group_idx=1,
#               kv_cache_spec_kind="sliding_window", kv_cache_spec_sliding_window=128,
#               locality="LOCAL", ownership="lmcache", session_id="s1")
#   BlockRemoved([12345, 2**63], "GPU")
#   BlockRemoved([5], None, group_idx=2, locality="REMOTE", ownership="o")
#   AllBlocksCleared()
# in KVEventBatch(ts=1700000000.25, data_parallel_rank=2).
VLLM_032_PAYLOAD = bytes.fromhex(
    "93cb41d954fc401000009588a474797065ab426c6f636b53746f726564ac626c6f636b5f68617368657392cf"
    "ffffffffffffffffcd3039b1706172656e745f626c6f636b5f68617368c0a9746f6b656e5f696473dc0020"
    "000102030405060708090a0b0c0d0e0f101112131415161718191a1b1c1d1e1faa626c6f636b5f73697a65"
    "10a76c6f72615f6964c0a66d656469756da3475055a96c6f72615f6e616d65c08fa474797065ab426c6f63"
    "6b53746f726564ac626c6f636b5f68617368657391c420070707070707070707070707070707070707070707"
    "0707070707070707070707b1706172656e745f626c6f636b5f68617368cd3039a9746f6b656e5f69647390"
    "aa626c6f636b5f73697a6510a76c6f72615f696407a66d656469756da3435055a96c6f72615f6e616d65a2"
    "6164aa65787472615f6b6579739193a2616492a26d6d03a473616c74a967726f75705f69647801b26b765f"
    "63616368655f737065635f6b696e64ae736c6964696e675f77696e646f77bc6b765f63616368655f737065"
    "635f736c6964696e675f77696e646f77cc80a86c6f63616c697479a54c4f43414ca96f776e657273686970"
    "a76c6d6361636865aa73657373696f6e5f6964a2733183a474797065ac426c6f636b52656d6f766564ac62"
    "6c6f636b5f68617368657392cd3039cf8000000000000000a66d656469756da347505586a474797065ac42"
    "6c6f636b52656d6f766564ac626c6f636b5f6861736865739105a66d656469756dc0a967726f75705f6964"
    "7802a86c6f63616c697479a652454d4f5445a96f776e657273686970a16f81a474797065b0416c6c426c6f"
    "636b73436c656172656402"
)


def test_payload_recorded_from_vllm_032():
    got = decode_vllm_batch(VLLM_032_PAYLOAD)
    assert got == EventBatch(
        ts=1700000000.25,
        dp_rank=2,
        events=(
            BlockStored((U64 - 1, 12345), None, tuple(range(32)), 16, "gpu"),
            BlockStored(
                (int.from_bytes(b"\x07" * 8, "big"),), 12345, (), 16, "cpu",
                lora_id=7, lora_name="ad", extra_keys=(("ad", ("mm", 3), "salt"),),
                group_idx=1, kv_cache_spec_kind="sliding_window",
                kv_cache_spec_sliding_window=128, locality="LOCAL",
                ownership="lmcache", session_id="s1",
            ),
            BlockRemoved((12345, 2**63), "gpu"),
            BlockRemoved((5,), "gpu", group_idx=2, locality="REMOTE", ownership="o"),
            AllBlocksCleared(),
        ),
    )


def test_old_positional_layouts():
    # Oldest layout: stops after block_size; batch without a rank.
    old = enc([3.0, [["BlockStored", [1, 2], None, [9] * 8, 4], ["BlockRemoved", [1]]]])
    assert decode_vllm_batch(old) == EventBatch(
        3.0, (BlockStored((1, 2), None, (9,) * 8, 4, "gpu"), BlockRemoved((1,), "gpu")), None
    )
    # Stops after medium; rank nil.
    mid = enc([3.0, [["BlockStored", [-1], 7, [1, 2], 2, None, "CPU"], ["BlockRemoved", [-1], "CPU"]], None])
    assert decode_vllm_batch(mid) == EventBatch(
        3.0, (BlockStored((U64 - 1,), 7, (1, 2), 2, "cpu"), BlockRemoved((U64 - 1,), "cpu")), None
    )


# ---------------------------------------------------------- validation ---


def test_token_ids_must_cover_the_blocks():
    for toks in ([1] * 7, [1] * 9, [1]):
        p = enc([0.0, [{"type": "BlockStored", "block_hashes": [1, 2], "parent_block_hash": None,
                        "token_ids": toks, "block_size": 4}]])
        b = decode_vllm_batch(p)
        assert b.events == () and b.bad_events == ("token_ids",)


@pytest.mark.parametrize(
    ("event", "kind"),
    [
        (["BlockStored", [1], None, [], 0], "block_size"),
        (["BlockStored", [1], None, [], -3], "block_size"),
        (["BlockStored", [b""], None, [], 16], "hash"),
        (["BlockStored", [1], b"", [], 16], "hash"),
        (["BlockStored", [1], None, [-1], 1], "schema"),
        (["BlockStored", [1], None, [1.5], 1], "schema"),
        (["BlockStored", [1], None, ["a"], 1], "schema"),
        (["BlockStored", [True], None, [], 1], "schema"),
        (["BlockStored", [1.0], None, [], 1], "schema"),
        (["BlockStored", [1], None, [], 1, None, None, None, [[1], [2]]], "extra_keys"),
        (["BlockStored", [1], None, [], 1, None, None, None, [[{"a": 1}]]], "extra_keys"),
        (["BlockStored", [1], None], "schema"),
        (["BlockRemoved"], "schema"),
        (["BlockRemoved", "x"], "schema"),
        ({"type": "BlockStored", "block_hashes": [1]}, "schema"),
        ({"type": "BlockRemoved", "block_hashes": [1], "medium": 5}, "schema"),
        (7, "schema"),
    ],
)
def test_invalid_events(event, kind):
    """A malformed event is left out and listed by kind; the valid events beside it are kept in order."""
    removed = {"type": "BlockRemoved", "block_hashes": [5], "medium": "GPU"}
    b = decode_vllm_batch(enc([0.0, [removed, event, removed], 0]))
    assert b.bad_events == (kind,)
    assert b.events == (BlockRemoved((5,), "gpu"), BlockRemoved((5,), "gpu"))


@pytest.mark.parametrize(
    ("payload", "kind"),
    [
        (b"", "msgpack"),
        (b"\xc1", "msgpack"),
        (enc([0.0, []])[:-1], "msgpack"),
        (enc({"ts": 0.0, "events": []}), "schema"),
        (enc([]), "schema"),
        (enc(["now", []]), "schema"),
        (enc([0.0, [], -1]), "schema"),
        (enc([0.0, [], "rank"]), "schema"),
        (enc([float("inf"), []]), "ts"),
        (enc([float("nan"), []]), "ts"),
        ("not bytes", "type"),
    ],
)
def test_invalid_batches(payload, kind):
    with pytest.raises(PayloadError) as ei:
        decode_vllm_batch(payload)
    assert ei.value.kind == kind


def test_batch_accepts_memoryview_and_trailing_fields():
    p = enc([5, [["AllBlocksCleared"]], 1, "future", {"x": 1}])
    assert decode_vllm_batch(memoryview(p)) == EventBatch(5.0, (AllBlocksCleared(),), 1)


# ------------------------------------------------------------ hash forms ---


@given(wire_hashes)
@settings(max_examples=200)
def test_normalize_block_hash_matches_vllm_formula(h):
    assert normalize_block_hash(h) == oracle_hash(h)


def test_normalize_block_hash_edges():
    assert normalize_block_hash(0) == 0
    assert normalize_block_hash(U64 - 1) == U64 - 1
    assert normalize_block_hash(-1) == U64 - 1
    assert normalize_block_hash(-(2**63)) == 2**63
    assert normalize_block_hash(b"\x01\x02") == 0x0102  # short digest: zero-extended
    assert normalize_block_hash(bytes(range(32))) == int.from_bytes(bytes(range(24, 32)), "big")
    assert normalize_block_hash(bytearray(b"\xff" * 8)) == U64 - 1
    for bad in (U64, -(2**63) - 1, 2**100, b"", True, 1.0, "ab", None):
        with pytest.raises(PayloadError) as ei:
            normalize_block_hash(bad)  # type: ignore[arg-type]
        assert ei.value.kind == "hash"


# ---------------------------------------------------------------- topics ---


@pytest.mark.parametrize(
    ("topic", "expected"),
    [
        (b"kv@pod-1@meta-llama/Llama-3.1-8B", ("pod-1", "meta-llama/Llama-3.1-8B")),
        (b"kv@10.0.0.5:8000@m", ("10.0.0.5:8000", "m")),
        (b"kv@[fe80::1]:8000@org/m", ("[fe80::1]:8000", "org/m")),
        (b"kv@pod@org/model@rev2", ("pod", "org/model@rev2")),
        (b"kv@pod@", ("pod", None)),
        (b"kv@pod@m\x00sgl-kv-epoch=abc", ("pod", "m")),
        ("kv@p@m".encode(), ("p", "m")),
        ("kv@pöd@m".encode(), ("pöd", "m")),
        (b"kv@@m", (None, None)),
        (b"kv@pod", (None, None)),
        (b"kv", (None, None)),
        (b"", (None, None)),
        (b"KV@pod@m", (None, None)),
        (b"kvx@pod@m", (None, None)),
        (b"events@pod@m", (None, None)),
        (b"kv@\xff\xfe@m", (None, None)),
        (None, (None, None)),
        (12, (None, None)),
    ],
)
def test_parse_topic(topic, expected):
    assert parse_topic(topic) == expected


@given(st.text(alphabet=st.characters(blacklist_characters="@\x00", blacklist_categories=("Cs",)), min_size=1),
       st.text(alphabet=st.characters(blacklist_characters="\x00", blacklist_categories=("Cs",))))
@settings(max_examples=100)
def test_parse_topic_round_trip(pod, model):
    assert parse_topic(f"kv@{pod}@{model}".encode()) == (pod, model or None)


@given(st.binary(max_size=40))
@settings(max_examples=200)
def test_parse_topic_never_raises(b):
    pod, model = parse_topic(b)
    assert pod is None or (pod and b.startswith(b"kv@"))
    assert model is None or pod is not None


# ------------------------------------------------------------ seq frames ---


@given(st.integers(0, U64 - 1))
@settings(max_examples=100)
def test_decode_seq_round_trip(n):
    assert decode_seq(n.to_bytes(8, "big")) == n


def test_decode_seq_edges():
    assert decode_seq(b"\x00" * 8) == 0
    assert decode_seq(b"\xff" * 8) == REPLAY_END_SEQ == 2**64 - 1
    assert decode_seq((-1).to_bytes(8, "big", signed=True)) == REPLAY_END_SEQ
    assert decode_seq(memoryview((258).to_bytes(8, "big"))) == 258
    for bad in (b"", b"\x00" * 7, b"\x00" * 9, "12345678", None, 5):
        with pytest.raises(PayloadError) as ei:
            decode_seq(bad)  # type: ignore[arg-type]
        assert ei.value.kind == "seq"
