"""Conditional disaggregation: the planner gives a turn to D alone when D's prefill left is small (no engines)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from connector.decode_alone import DecodeAloneRule, PathTokens, decode_alone_params, decode_alone_verdict
from connector.guard import common_prefix_len
from connector.planner import PDPlanner
from connector.retained import RetainedStore
from kvindex.keys import TokenProcessor
from kvindex.reference import KVBlockIndex
from kvindex.tiers import GPU
from scorer.load import LoadSnapshot
from tests.test_connector_planner import BS, Clock, d_answer

ALONE_PARAMS = {"do_remote_prefill": False, "do_remote_decode": False}


def make(rule: DecodeAloneRule | None = DecodeAloneRule(max_tokens=64), threshold: int = 16) -> PDPlanner:
    clock = Clock()
    tp = TokenProcessor(block_size=BS)
    index = KVBlockIndex(tp, clock=clock)
    return PDPlanner(index, tp, RetainedStore(index, clock=clock), recompute_threshold=threshold, decode_alone=rule)


def answer(planner: PDPlanner, plan, prompt: list[int], output: list[int]) -> None:
    """D answers like vLLM 0.32 (remote_num_tokens = prompt + output - 1), also for a turn it served alone."""
    planner.decode_answered(plan, d_answer(len(prompt) + len(output) - 1, req=f"r{len(prompt)}"), prompt + output)


def test_rule_bounds_are_checked():
    with pytest.raises(ValueError):
        DecodeAloneRule(max_tokens=-1)
    with pytest.raises(ValueError):
        DecodeAloneRule(max_kv_usage=0.0)
    with pytest.raises(ValueError):
        DecodeAloneRule(max_pending_tokens=-5)


def test_verdict_weighs_tokens_then_load():
    rule = DecodeAloneRule(max_tokens=100, max_waiting=1, max_kv_usage=0.8, max_pending_tokens=150)
    short, long_ = PathTokens(100, 300, 900), PathTokens(101, 40, 900)
    assert decode_alone_verdict(rule, short, None)[0]
    ok, why = decode_alone_verdict(rule, long_, None)
    assert not ok and "101 > 100" in why
    assert decode_alone_verdict(rule, short, LoadSnapshot(waiting=1, kv_usage=0.79))[0]
    assert decode_alone_verdict(rule, short, LoadSnapshot(prefill_tokens=50))[0]
    alone_on_idle = DecodeAloneRule(max_tokens=500, max_pending_tokens=100)  # nothing pending: the bound waits
    assert decode_alone_verdict(alone_on_idle, PathTokens(400, 400, 400), LoadSnapshot(prefill_tokens=0))[0]
    for busy, word in ((LoadSnapshot(waiting=2), "waiting"), (LoadSnapshot(kv_usage=0.8), "KV usage"),
                       (LoadSnapshot(prefill_tokens=51), "pending")):
        ok, why = decode_alone_verdict(rule, short, busy)
        assert not ok and word in why


def test_short_turn_goes_to_the_decode_pod_alone_and_a_long_one_through_prefill():
    planner = make()
    prompt1, out1 = list(range(1, 301)), list(range(1000, 1080))
    first = planner.plan("c", prompt1, ["p0"], ["d0"])
    assert first.action == "recompute" and first.paths == PathTokens(300, 300, 300)
    assert "via P: D would prefill 300 > 64" in first.reasons[-2]
    answer(planner, first, prompt1, out1)
    entry = planner.store.get("c")
    # turn 2 adds 20 tokens: D holds 368 of its 400 (whole blocks of prompt + answer - 1)
    prompt2 = prompt1 + out1 + list(range(2000, 2020))
    plan = planner.plan("c", prompt2, ["p0"], ["d0"])
    assert plan.action == "decode_only" and plan.prefill_pod == "" and plan.prefill_params == {}
    assert plan.decode_pod == "d0" and plan.decode_params == ALONE_PARAMS
    assert plan.paths is not None and plan.paths.decode_alone == 400 - 368
    assert plan.paths.pull == 400 - 379 and plan.paths.recompute == 400  # P would pull D's 379 tokens
    assert plan.guard is not None and not plan.guard.clipped and plan.pullable_tokens == 379
    assert "decode_only: D would prefill 32 <= 64" in plan.reasons[-1], plan.explain()
    assert planner.store.get("c") == entry  # not spent: D's answer replaces it
    answer(planner, plan, prompt2, list(range(3000, 3010)))
    assert planner.store.get("c").num_tokens == 409
    # turn 3 adds 200 tokens: through P, which pulls what D retained
    prompt3 = prompt2 + list(range(3000, 3010)) + list(range(4000, 4200))
    plan3 = planner.plan("c", prompt3, ["p0"], ["d0"])
    assert plan3.action == "pull" and plan3.pulled_tokens == 409 and plan3.decode_params is None
    assert "via P: D would prefill" in plan3.reasons[-2]
    s = planner.stats()
    assert (s.turns, s.decode_only, s.decode_alone, s.pulls) == (3, 1, 1, 1)


def test_a_busy_decode_pod_keeps_the_prefill_leg():
    planner = make()
    prompt1, out1 = list(range(1, 301)), list(range(1000, 1080))
    answer(planner, planner.plan("c", prompt1, ["p0"], ["d0"]), prompt1, out1)
    prompt2 = prompt1 + out1 + [7] * 10
    plan = planner.plan("c", prompt2, ["p0"], ["d0"], {"d0": LoadSnapshot(waiting=3)})
    assert plan.action == "pull" and "D is busy" in plan.reasons[-2]
    assert planner.stats().decode_alone == 0


def test_without_a_rule_every_turn_has_a_prefill_leg():
    planner = make(rule=None)
    plan = planner.plan("c", [1, 2, 3], ["p0"], ["d0"])
    assert plan.action == "recompute" and plan.paths is None and plan.decode_params is None


def test_d_alone_counts_the_decode_pods_own_cache():
    """D's KV events (its prefix cache) count for its hit, not only the retained tier."""
    planner = make(rule=DecodeAloneRule(max_tokens=32))
    prompt = list(range(1, 201))
    planner.index.add_held("d0", planner.request_keys(prompt[:176]), GPU)
    plan = planner.plan(None, prompt, ["p0"], ["d0"])
    assert plan.action == "decode_only" and plan.paths.decode_alone == 24, plan.explain()
    assert planner.plan(None, prompt, ["p0"], ["d1"]).action == "recompute"  # another D holds nothing


def test_edited_history_served_alone_computes_what_d_lacks():
    """A client that edits the history: D alone loads nothing remote and prefills from the first difference's block."""
    planner = make(rule=DecodeAloneRule(max_tokens=400))
    prompt1, out1 = list(range(1, 301)), list(range(1000, 1080))
    answer(planner, planner.plan("c", prompt1, ["p0"], ["d0"]), prompt1, out1)
    edited = prompt1[:100] + prompt1[120:] + out1 + [5] * 10  # a span stripped at token 100
    plan = planner.plan("c", edited, ["p0"], ["d0"])
    assert plan.action == "decode_only" and plan.decode_params == ALONE_PARAMS
    assert plan.guard is not None and plan.guard.clipped and "token 100" in plan.guard.reason
    assert plan.paths.decode_alone == len(edited) - 96  # 6 whole blocks in common
    assert planner.stats().clipped == 1


@st.composite
def conversations(draw):
    steps = []
    for _ in range(draw(st.integers(1, 6))):
        steps.append((
            draw(st.sampled_from(["extend", "strip", "change", "fresh"])),
            draw(st.integers(0, 10**6)),
            draw(st.lists(st.integers(0, 30), min_size=1, max_size=90)),
            draw(st.lists(st.integers(0, 30), min_size=1, max_size=40)),
        ))
    return draw(st.sampled_from([0, 16, 48, 200])), steps


@given(conversations())
@settings(max_examples=200, deadline=None)
def test_random_conversations_decode_alone_iff_little_is_left_and_no_remote_params_leak(case):
    """Oracle: D's hit = the whole blocks its retained tokens share with the prompt (capped so one token is
    computed); D alone iff prompt - hit <= max_tokens; such a turn sends P nothing and D no remote field."""
    max_tokens, steps = case
    planner = make(rule=DecodeAloneRule(max_tokens=max_tokens))
    history: list[int] = []
    held: list[int] = []
    for edit, r, new, output in steps:
        prompt = list(history)
        if edit == "strip" and prompt:
            del prompt[r % len(prompt): r % len(prompt) + 1 + r % 7]
        elif edit == "change" and prompt:
            prompt[r % len(prompt)] = 31
        elif edit == "fresh":
            prompt = []
        prompt += new
        plan = planner.plan("c", prompt, ["p0"], ["d0"])
        hit_blocks = min(common_prefix_len(held, prompt) // BS, len(held) // BS, (len(prompt) - 1) // BS)
        left = len(prompt) - hit_blocks * BS
        assert plan.paths is not None and plan.paths.decode_alone == left, plan.explain()
        if left <= max_tokens:
            assert plan.action == "decode_only" and plan.prefill_params == {}
            assert plan.decode_params == ALONE_PARAMS
            assert not any(k.startswith("remote_") for k in plan.decode_params)
        else:
            assert plan.action in ("pull", "recompute") and plan.decode_params is None
            if plan.action == "pull":
                m = plan.prefill_params["remote_num_tokens"]
                assert held[:m] == prompt[:m]
        answer(planner, plan, prompt, output)
        held = (prompt + output)[: len(prompt) + len(output) - 1]
        history = prompt + output


def test_decode_alone_params_name_nothing_remote():
    p = decode_alone_params()
    assert p == ALONE_PARAMS and p is not decode_alone_params()
