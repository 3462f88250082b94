"""The simulated vLLM engine and fleet, checked from the outside with plain pyzmq sockets.

Every message is read with a SUB or DEALER socket on loopback and decoded with
msgspec.msgpack.decode into plain Python, so these tests check the wire format
the library's subscriber will meet, independently of the library's decoders.
"""

from __future__ import annotations

import itertools
import random
from collections.abc import Iterator
from typing import Any

import msgspec
import pytest
import zmq

from examples.simfleet import (
    END_SEQ,
    EngineConfig,
    SimEngine,
    SimFleet,
    block_digests,
    free_tcp_port,
    wire_hash,
)
from examples.simfleet.engine import digest_to_uint64, validate_engine_args

LOOPBACK = "tcp://127.0.0.1:*"
WAIT_MS = 5000  # upper bound of any single wait for a message

MAP_STORED_KEYS = {
    "type",
    "block_hashes",
    "parent_block_hash",
    "token_ids",
    "block_size",
    "lora_id",
    "medium",
    "lora_name",
}


@pytest.fixture
def ctx() -> Iterator[zmq.Context]:
    context = zmq.Context()
    yield context
    context.destroy(linger=0)


def make_engine(**kwargs: Any) -> SimEngine:
    args: dict[str, Any] = {"pod": "pod-a", "endpoint": LOOPBACK, "capacity_blocks": 64}
    args.update(kwargs)
    return SimEngine(**args)


def decode(payload: bytes) -> Any:
    return msgspec.msgpack.decode(payload)


def recv(sock: zmq.Socket) -> list[bytes]:
    assert sock.poll(WAIT_MS), "no message within the bound"
    frames: list[bytes] = sock.recv_multipart()
    return frames


def subscribe(ctx: zmq.Context, engine: SimEngine) -> tuple[zmq.Socket, int]:
    """Connect a SUB to a bound engine and wait until it receives (slow joiner).

    Warm-up messages are AllBlocksCleared on an empty cache, which changes no
    cache state.  Returns the socket, drained, and the seq the next batch gets.
    """
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.LINGER, 0)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(engine.endpoint)
    wait_for_sub(sub, engine.reset_prefix_cache)
    return sub, engine.stats().next_seq


def wait_for_sub(sub: zmq.Socket, warm_up: Any) -> list[list[bytes]]:
    """Call warm_up until the SUB receives something (bounded), then drain it."""
    got: list[list[bytes]] = []
    for _ in range(200):
        warm_up()
        if sub.poll(25):
            break
    else:
        pytest.fail("subscriber never received a warm-up message")
    while sub.poll(100):
        got.append(sub.recv_multipart())
    return got


def replay(ctx: zmq.Context, endpoint: str, start: int) -> list[list[bytes]]:
    """Ask a replay ROUTER from a DEALER; return the replies up to and including the end marker."""
    dealer = ctx.socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    dealer.connect(endpoint)
    dealer.send_multipart([b"", start.to_bytes(8, "big")])
    replies: list[list[bytes]] = []
    try:
        for _ in range(100_000):
            frames = recv(dealer)
            replies.append(frames)
            if END_SEQ in frames[1:3]:
                return replies
        pytest.fail("no end marker")
    finally:
        dealer.close(linger=0)
    return replies


def tokens(base: int, n: int) -> list[int]:
    return list(range(base, base + n))


# ---------------------------------------------------------------- hashes


def test_hashes_equal_vllm_recorded_values() -> None:
    # Recorded from vLLM 0.32 hash_block_tokens with NONE_HASH seed "vllm-none-hash",
    # tokens 0..31, block size 16, published as uint64 (maybe_convert_block_hash).
    sha = block_digests(range(32), 16, "vllm-none-hash", "sha256")
    cbor = block_digests(range(32), 16, "vllm-none-hash", "sha256_cbor")
    assert [digest_to_uint64(d) for d in sha] == [3262291359910021016, 7142137847444424233]
    assert [digest_to_uint64(d) for d in cbor] == [2233398808101521225, 17911472383915781900]
    assert sha[1].hex().startswith("8be7aaa33831156d")
    assert block_digests(range(31), 16) == block_digests(range(16), 16)  # partial block: no hash


def test_wire_hash_forms() -> None:
    digest = bytes(24) + b"\xff" * 7 + b"\xfe"
    assert wire_hash(digest, "uint64") == 2**64 - 2
    assert wire_hash(digest, "int64") == -2
    assert wire_hash(digest, "bytes") == digest
    small = bytes(31) + b"\x05"
    assert wire_hash(small, "int64") == wire_hash(small, "uint64") == 5


def test_bad_arguments_raise_value_error() -> None:
    for bad in (
        {"encoding": "json"},
        {"hash_form": "hex"},
        {"block_size": 0},
        {"capacity_blocks": 0},
        {"buffer_steps": 0},
        {"dp_rank": -1},
        {"pod": ""},
    ):
        args: dict[str, Any] = {"pod": "p", "capacity_blocks": 4}
        args.update(bad)
        with pytest.raises(ValueError):
            validate_engine_args(**args)
        with pytest.raises(ValueError):
            SimEngine(endpoint=LOOPBACK, **args)


# ------------------------------------------------------- frames, batches


def test_frames_batch_layout_and_map_events(ctx: zmq.Context) -> None:
    with make_engine(pod="node-1:8000", model="m-7b", block_size=4) as engine:
        sub, seq0 = subscribe(ctx, engine)
        prompt = tokens(1, 10)  # two full blocks and a partial one
        assert engine.serve(prompt) == 0
        frames = recv(sub)
        assert len(frames) == 3
        topic, seq, payload = frames
        assert topic == b"kv@node-1:8000@m-7b"
        assert len(seq) == 8 and int.from_bytes(seq, "big") == seq0
        batch = decode(payload)
        assert isinstance(batch, list) and len(batch) == 3
        ts, events, rank = batch
        assert isinstance(ts, float) and ts > 0
        assert rank == 0
        assert len(events) == 1
        ev = events[0]
        assert isinstance(ev, dict) and set(ev) == MAP_STORED_KEYS
        assert ev["type"] == "BlockStored"
        assert ev["block_hashes"] == engine.hashes(prompt)
        assert len(ev["block_hashes"]) == 2
        assert ev["parent_block_hash"] is None
        assert ev["token_ids"] == prompt[:8]
        assert ev["block_size"] == 4
        assert ev["medium"] == "GPU"
        assert ev["lora_id"] is None and ev["lora_name"] is None

        engine.reset_prefix_cache()
        cleared = decode(recv(sub)[2])[1]
        assert cleared == [{"type": "AllBlocksCleared"}]
        assert engine.cached_blocks() == {}


def test_array_encoding_is_positional(ctx: zmq.Context) -> None:
    with make_engine(encoding="array", block_size=2, capacity_blocks=2) as engine:
        sub, _ = subscribe(ctx, engine)
        first = [1, 2, 3, 4]
        engine.serve(first)
        stored = decode(recv(sub)[2])[1]
        assert stored == [["BlockStored", engine.hashes(first), None, first, 2, None, "GPU", None]]
        engine.serve([9, 9, 8, 8])  # full cache: both blocks of `first` go
        removed, stored2 = decode(recv(sub)[2])[1]
        assert removed[0] == "BlockRemoved" and removed[2] == "GPU" and len(removed) == 3
        assert sorted(removed[1]) == sorted(engine.hashes(first))
        assert stored2[0] == "BlockStored" and stored2[3] == [9, 9, 8, 8]
        engine.reset_prefix_cache()
        assert decode(recv(sub)[2])[1] == [["AllBlocksCleared"]]


def test_dp_rank_in_batch_and_left_out_when_none(ctx: zmq.Context) -> None:
    with make_engine(dp_rank=3) as ranked, make_engine(dp_rank=None) as old:
        sub_r, _ = subscribe(ctx, ranked)
        sub_o, _ = subscribe(ctx, old)
        ranked.serve(tokens(0, 16))
        old.serve(tokens(0, 16))
        assert decode(recv(sub_r)[2])[2] == 3
        assert len(decode(recv(sub_o)[2])) == 2


def test_three_hash_forms_in_connect_mode(ctx: zmq.Context) -> None:
    # The subscriber binds and the engines dial in (endpoint without '*').
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.LINGER, 0)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.bind(LOOPBACK)
    address = sub.getsockopt_string(zmq.LAST_ENDPOINT)
    # A prompt whose block hashes include one >= 2**63, so int64 differs from uint64.
    prompt: list[int] = []
    for base in range(0, 64 * 16, 16):
        prompt = tokens(base, 64)
        if any(digest_to_uint64(d) >= 2**63 for d in block_digests(prompt, 16)):
            break
    digests = block_digests(prompt, 16)
    assert any(digest_to_uint64(d) >= 2**63 for d in digests)

    forms = ("uint64", "int64", "bytes")
    engines = [make_engine(pod=f"pod-{f}", endpoint=address, hash_form=f) for f in forms]
    try:
        for engine in engines:
            assert engine.endpoint == address
            wait_for_sub(sub, engine.reset_prefix_cache)
        for engine in engines:
            engine.serve(prompt)
        seen: dict[bytes, list[Any]] = {}
        for _ in forms:
            topic, _seq, payload = recv(sub)
            seen[topic] = decode(payload)[1][0]["block_hashes"]
    finally:
        for engine in engines:
            engine.close()
    u64 = seen[b"kv@pod-uint64@sim-model"]
    i64 = seen[b"kv@pod-int64@sim-model"]
    raw = seen[b"kv@pod-bytes@sim-model"]
    assert u64 == [digest_to_uint64(d) for d in digests]
    assert any(h >= 2**63 for h in u64)
    assert all(0 <= h < 2**64 for h in u64)
    assert any(h < 0 for h in i64)
    assert [h % 2**64 for h in i64] == u64
    assert raw == digests and all(isinstance(h, bytes) and len(h) == 32 for h in raw)
    assert [int.from_bytes(h[-8:], "big") for h in raw] == u64


# -------------------------------------------------------- cache behaviour


def test_seq_increments_and_parent_chains_to_last_hit(ctx: zmq.Context) -> None:
    with make_engine(block_size=4) as engine:
        sub, seq0 = subscribe(ctx, engine)
        base = tokens(100, 8)
        longer = base + tokens(500, 6)  # one more full block and a partial one
        assert engine.serve(base) == 0
        assert engine.serve(longer) == 8
        assert engine.serve(longer) == 12  # everything cached: nothing published
        engine.serve(tokens(900, 4))
        msgs = [recv(sub) for _ in range(3)]
        assert [int.from_bytes(m[1], "big") for m in msgs] == [seq0, seq0 + 1, seq0 + 2]
        second = decode(msgs[1][2])[1][0]
        base_hashes = engine.hashes(base)
        assert second["parent_block_hash"] == base_hashes[-1]
        assert second["block_hashes"] == engine.hashes(longer)[2:]
        assert second["token_ids"] == longer[8:12]
        assert not sub.poll(50)
        assert engine.stats().next_seq == seq0 + 3


def test_lru_eviction_publishes_block_removed(ctx: zmq.Context) -> None:
    with make_engine(block_size=2, capacity_blocks=4) as engine:
        sub, _ = subscribe(ctx, engine)
        a, b = [1, 1, 2, 2, 3, 3], [7, 7, 8, 8, 9, 9]
        ha, hb = engine.hashes(a), engine.hashes(b)
        engine.serve(a)
        recv(sub)
        engine.serve(b)  # needs 3 blocks, 1 free: a's two tail blocks go, tail first
        removed, stored = decode(recv(sub)[2])[1]
        assert removed == {"type": "BlockRemoved", "block_hashes": [ha[2], ha[1]], "medium": "GPU"}
        assert stored["block_hashes"] == hb
        assert set(engine.cached_blocks()) == {ha[0], *hb}
        assert engine.serve(a) == 2  # the head of `a` survived
        stats = engine.stats()
        assert stats.blocks_removed == 2 + 2 and stats.gpu_blocks == 4


def test_request_larger_than_cache_stores_what_fits(ctx: zmq.Context) -> None:
    with make_engine(block_size=2, capacity_blocks=3) as engine:
        sub, _ = subscribe(ctx, engine)
        prompt = tokens(0, 10)  # 5 blocks
        engine.serve(prompt)
        stored = decode(recv(sub)[2])[1][0]
        assert stored["block_hashes"] == engine.hashes(prompt)[:3]
        assert stored["token_ids"] == prompt[:6]
        assert engine.serve(prompt) == 6


def test_hit_counter_equals_longest_cached_prefix() -> None:
    rng = random.Random(7)
    with make_engine(block_size=4, capacity_blocks=24) as engine:
        prefixes = [tokens(1000 * i, 4 * rng.randint(1, 6)) for i in range(5)]
        expected_total = 0
        queried = 0
        for _ in range(60):
            prompt = rng.choice(prefixes) + [rng.randrange(50_000) for _ in range(rng.randint(0, 12))]
            cached = engine.cached_blocks()
            expected = 0
            for h in engine.hashes(prompt):
                if "gpu" not in cached.get(h, frozenset()):
                    break
                expected += 4
            assert engine.lookup(prompt) == expected
            assert engine.serve(prompt) == expected
            expected_total += expected
            queried += len(prompt)
        stats = engine.stats()
        assert expected_total > 0
        assert stats.prefix_cache_hits_total == expected_total
        assert stats.prefix_cache_queries_total == queried
        assert stats.requests == 60 and stats.gpu_blocks <= 24


def test_offload_publishes_tokenless_cpu_store(ctx: zmq.Context) -> None:
    with make_engine(block_size=2, capacity_blocks=3) as engine:
        sub, _ = subscribe(ctx, engine)
        prompt = [5, 5, 6, 6]
        h = engine.hashes(prompt)
        engine.serve(prompt)
        recv(sub)
        offloaded = engine.offload(1)
        assert len(offloaded) == 1 and offloaded[0] in h
        ev = decode(recv(sub)[2])[1]
        assert ev == [
            {
                "type": "BlockStored",
                "block_hashes": offloaded,
                "parent_block_hash": None,
                "token_ids": [],
                "block_size": 2,
                "lora_id": None,
                "medium": "CPU",
                "lora_name": None,
            }
        ]
        assert engine.cached_blocks()[offloaded[0]] == {"gpu", "cpu"}
        engine.serve([1, 1, 2, 2, 3, 3])  # evicts both GPU blocks; the CPU copy stays
        removed = decode(recv(sub)[2])[1][0]
        assert removed["type"] == "BlockRemoved" and offloaded[0] in removed["block_hashes"]
        assert engine.cached_blocks()[offloaded[0]] == {"cpu"}
        assert engine.offload(0) == []
        engine.reset_prefix_cache()
        assert decode(recv(sub)[2])[1] == [{"type": "AllBlocksCleared"}]
        assert engine.cached_blocks() == {}


# ------------------------------------------------------- replay, gaps, restart


@pytest.mark.parametrize("with_topic", [True, False])
def test_replay_returns_buffered_batches_and_end_marker(ctx: zmq.Context, with_topic: bool) -> None:
    with make_engine(replay_endpoint=LOOPBACK, replay_with_topic=with_topic, buffer_steps=3) as engine:
        assert engine.replay_endpoint is not None
        payload_tokens = [tokens(16 * i, 16) for i in range(5)]
        for t in payload_tokens:
            engine.serve(t)
        replies = replay(ctx, engine.replay_endpoint, 1)
        *batches, end = replies
        if with_topic:
            assert end == [b"", b"", END_SEQ, b""]
            assert all(len(r) == 4 and r[0] == b"" and r[1] == b"kv@pod-a@sim-model" for r in batches)
            seqs = [int.from_bytes(r[2], "big") for r in batches]
        else:
            assert end == [b"", END_SEQ, b""]
            assert all(len(r) == 3 and r[0] == b"" for r in batches)
            seqs = [int.from_bytes(r[1], "big") for r in batches]
        assert seqs == [2, 3, 4]  # only the last buffer_steps batches are kept
        stored = [decode(r[-1])[1][0]["token_ids"] for r in batches]
        assert stored == payload_tokens[2:]
        only_end = [[b"", b"", END_SEQ, b""]] if with_topic else [[b"", END_SEQ, b""]]
        assert replay(ctx, engine.replay_endpoint, 99) == only_end
        stats = engine.stats()
        assert stats.replay_requests == 2 and stats.replay_invalid == 0


def test_drop_next_makes_a_gap_that_replay_fills(ctx: zmq.Context) -> None:
    with make_engine(replay_endpoint=LOOPBACK) as engine:
        assert engine.replay_endpoint is not None
        sub, seq0 = subscribe(ctx, engine)
        prompts = [tokens(16 * i, 16) for i in range(3)]
        engine.drop_next(2)
        for p in prompts:
            engine.serve(p)
        topic, seq, payload = recv(sub)
        assert int.from_bytes(seq, "big") == seq0 + 2
        assert not sub.poll(50)
        replies = replay(ctx, engine.replay_endpoint, seq0)
        got = {int.from_bytes(r[2], "big"): r[3] for r in replies[:-1]}
        assert sorted(got) == [seq0, seq0 + 1, seq0 + 2]
        assert got[seq0 + 2] == payload  # the replayed batch is byte-identical
        assert [decode(got[seq0 + i])[1][0]["token_ids"] for i in range(3)] == prompts
        assert engine.stats().batches_dropped == 2


def test_restart_starts_seq_at_zero_with_empty_cache(ctx: zmq.Context) -> None:
    with make_engine(replay_endpoint=LOOPBACK) as engine:
        assert engine.replay_endpoint is not None
        sub, _ = subscribe(ctx, engine)
        for i in range(3):
            engine.serve(tokens(16 * i, 32))
        while sub.poll(100):
            sub.recv_multipart()
        endpoint = engine.endpoint
        engine.restart()
        assert engine.endpoint == endpoint
        assert engine.cached_blocks() == {}
        stats = engine.stats()
        assert stats.next_seq == 0 and stats.restarts == 1 and stats.prefix_cache_hits_total == 0
        assert engine.serve(tokens(0, 32)) == 0  # the old cache is gone
        # The SUB reconnects to the new socket by itself.
        fresh = itertools.count(10_000, 16)
        received = wait_for_sub(sub, lambda: engine.serve(tokens(next(fresh), 16)))
        replies = replay(ctx, engine.replay_endpoint, 0)
        replayed = [int.from_bytes(r[2], "big") for r in replies[:-1]]
        assert replayed == list(range(engine.stats().next_seq))
        assert replayed[0] == 0
        assert received and all(int.from_bytes(m[1], "big") in replayed for m in received)


def test_malformed_replay_request_is_ignored(ctx: zmq.Context) -> None:
    with make_engine(replay_endpoint=LOOPBACK) as engine:
        assert engine.replay_endpoint is not None
        engine.serve(tokens(0, 16))
        dealer = ctx.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        dealer.connect(engine.replay_endpoint)
        dealer.send_multipart([b"", b"\x00"])  # seq frame too short
        dealer.send_multipart([b"", (0).to_bytes(8, "big")])
        first = recv(dealer)
        assert int.from_bytes(first[2], "big") == 0
        assert recv(dealer)[2] == END_SEQ
        assert engine.stats().replay_invalid == 1


def test_closed_engine_raises() -> None:
    engine = make_engine()
    engine.close()
    engine.close()
    with pytest.raises(RuntimeError):
        engine.serve([1] * 16)


# ------------------------------------------------------------------ fleet


def test_fleet_runs_engines_in_processes(ctx: zmq.Context) -> None:
    port = free_tcp_port()
    configs: list[EngineConfig | dict[str, Any]] = [
        EngineConfig(pod="pod-a", replay=True, capacity_blocks=8, block_size=4),
        {"pod": "pod-b", "pub_port": port, "encoding": "array", "hash_form": "int64", "block_size": 4},
    ]
    with SimFleet(configs) as fleet:
        assert fleet.names == ["pod-a", "pod-b"]
        assert fleet.endpoint("pod-b") == f"tcp://127.0.0.1:{port}"
        assert fleet.replay_endpoint("pod-b") is None
        replay_a = fleet.replay_endpoint("pod-a")
        assert replay_a is not None
        subs = {}
        for name in fleet.names:
            sub = ctx.socket(zmq.SUB)
            sub.setsockopt(zmq.LINGER, 0)
            sub.setsockopt(zmq.SUBSCRIBE, b"")
            sub.connect(fleet.endpoint(name))
            wait_for_sub(sub, lambda n=name: fleet.reset(n))
            subs[name] = sub

        prompt = tokens(40, 12)
        assert fleet.serve("pod-a", prompt) == 0
        assert fleet.serve("pod-a", prompt) == 12
        assert fleet.lookup("pod-b", prompt) == 0
        fleet.serve("pod-b", prompt)
        ev_a = decode(recv(subs["pod-a"])[2])[1][0]
        ev_b = decode(recv(subs["pod-b"])[2])[1][0]
        hashes = fleet.hashes("pod-a", prompt)
        assert ev_a["block_hashes"] == hashes
        assert ev_b[0] == "BlockStored" and [h % 2**64 for h in ev_b[1]] == hashes
        assert set(fleet.cached("pod-a")) == set(hashes)

        assert fleet.offload("pod-a", 2) == [hashes[2], hashes[1]]  # least recently used first
        assert fleet.cached("pod-a")[hashes[1]] == {"gpu", "cpu"}
        cpu_event = decode(recv(subs["pod-a"])[2])[1][0]
        assert cpu_event["medium"] == "CPU" and cpu_event["token_ids"] == []

        fleet.drop_next("pod-a", 1)
        fleet.serve("pod-a", tokens(900, 8))
        fleet.serve("pod-a", tokens(950, 4))
        seq_after_gap = int.from_bytes(recv(subs["pod-a"])[1], "big")
        stats_a = fleet.stats("pod-a")
        assert seq_after_gap == stats_a.next_seq - 1
        replies = replay(ctx, replay_a, seq_after_gap - 1)
        assert [int.from_bytes(r[2], "big") for r in replies[:-1]] == [seq_after_gap - 1, seq_after_gap]
        assert stats_a.prefix_cache_hits_total == 12 and stats_a.batches_dropped == 1

        fleet.restart("pod-b")
        assert fleet.stats("pod-b").next_seq == 0
        assert fleet.cached("pod-b") == {}
        with pytest.raises(ValueError):
            fleet.drop_next("pod-b", -1)
        with pytest.raises(KeyError):
            fleet.serve("nope", prompt)
        assert fleet.is_alive("pod-a") and fleet.is_alive("pod-b")
    assert not fleet.is_alive("pod-a") and not fleet.is_alive("pod-b")
    with pytest.raises(RuntimeError):
        fleet.stats("pod-a")


def test_fleet_rejects_bad_configs() -> None:
    with pytest.raises(ValueError):
        SimFleet([])
    with pytest.raises(ValueError):
        SimFleet([{"pod": "a"}, {"pod": "a"}])
    with pytest.raises(ValueError):
        SimFleet([{"pod": "a", "colour": "red"}])
    with pytest.raises(ValueError):
        SimFleet([{"pod": "a", "encoding": "xml"}])
