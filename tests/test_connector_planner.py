"""PDPlanner: choice of P and D, pull or recompute, params per leg, retained-entry refresh (no engines)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from connector.params import parse_params
from connector.planner import PDPlanner, predicted_pull_tokens
from connector.retained import RetainedStore
from kvindex.reference import KVBlockIndex
from kvindex.keys import TokenProcessor
from kvindex.tiers import DECODE_RETAINED, GPU
from scorer.load import LoadSnapshot

BS = 16


class Clock:
    t = 0.0

    def __call__(self) -> float:
        return self.t


def d_answer(n_tokens: int, req: str = "r1", port: int = 5600) -> object:
    return parse_params(
        {
            "do_remote_prefill": False,
            "do_remote_decode": True,
            "remote_block_ids": [list(range(10, 10 + -(-n_tokens // BS)))],
            "remote_engine_id": "eng-d0",
            "remote_request_id": req,
            "remote_host": "127.0.0.1",
            "remote_port": port,
            "tp_size": 1,
            "dcp_size": 1,
            "pp_size": 1,
            "remote_num_tokens": n_tokens,
            "remote_blocks_expiry_time": 1e6,
            "transfer_mode": "pull",
        }
    )


def make(threshold: int = 64, guard: bool = True, ttl: float = 450.0):
    clock = Clock()
    tp = TokenProcessor(block_size=BS)
    index = KVBlockIndex(tp, clock=clock)
    store = RetainedStore(index, ttl=ttl, clock=clock)
    return PDPlanner(index, tp, store, recompute_threshold=threshold, guard=guard), clock


def turn(planner, cid, prompt, output, ps=("p0", "p1"), ds=("d0", "d1"), loads=None):
    """One turn with a D that answers like vLLM 0.32: remote_num_tokens = prompt + output - 1."""
    plan = planner.plan(cid, prompt, list(ps), list(ds), loads)
    held = len(prompt) + len(output) - 1
    planner.decode_answered(plan, d_answer(held, req=f"r{len(prompt)}"), list(prompt) + list(output))
    return plan


def test_first_turn_recomputes_then_second_pulls_once():
    planner, _ = make()
    prompt1 = list(range(200))
    out1 = list(range(1000, 1050))
    p1 = turn(planner, "c", prompt1, out1)
    assert p1.action == "recompute" and p1.prefill_params["do_remote_decode"] is True
    assert p1.prefill_params["remote_block_ids"] is None
    held = prompt1 + out1[:-1]
    # the retained blocks show up in the index on D under decode_retained
    keys = planner.request_keys(held)
    assert all(e[0].tier == DECODE_RETAINED and e[0].pod == p1.decode_pod for e in planner.index.lookup(keys))
    prompt2 = prompt1 + out1 + list(range(2000, 2030))
    plan = planner.plan("c", prompt2, ["p0", "p1"], ["d0", "d1"])
    assert plan.action == "pull", plan.explain()
    assert plan.decode_pod == p1.decode_pod  # the D holding the conversation
    assert plan.prefill_params == d_answer(len(held), req="r200").to_dict()
    assert plan.pulled_tokens == len(held) and plan.local_tokens == 0
    # used once: the same conversation without a fresh D answer recomputes
    again = planner.plan("c", prompt2, ["p0"], ["d0", "d1"])
    assert again.action == "recompute" and "no live retained entry" in again.reasons[-1]
    st_ = planner.stats()
    assert st_.pulls == 1 and st_.turns == 3 and st_.recomputes == {"no_entry": 2}


def test_edited_history_is_clipped_and_explained():
    planner, _ = make(threshold=16)
    prompt1 = list(range(300))
    out1 = list(range(1000, 1040))
    turn(planner, "c", prompt1, out1)
    edited = prompt1[:100] + prompt1[110:] + out1 + [5, 6, 7]  # a span stripped at token 100
    plan = planner.plan("c", edited, ["p0"], ["d0", "d1"])
    assert plan.action == "pull"
    assert plan.prefill_params["remote_num_tokens"] == 96
    assert plan.prefill_params["remote_block_ids"] == [list(range(10, 16))]
    assert plan.guard.clipped and "token 100" in plan.guard.reason
    assert planner.stats().clipped == 1
    # a change in the first block: nothing reusable, entry dropped
    turn(planner, "c2", prompt1, out1)
    plan = planner.plan("c2", [7] + prompt1[1:] + out1, ["p0"], ["d0"])
    assert plan.action == "recompute" and plan.prefill_params["remote_block_ids"] is None
    assert "c2" not in planner.store


def test_guard_off_sends_unclipped_params():
    planner, _ = make(guard=False)
    prompt1 = list(range(300))
    turn(planner, "c", prompt1, [1, 2, 3])
    plan = planner.plan("c", [9] * 400, ["p0"], ["d0"])
    assert plan.action == "pull" and plan.prefill_params["remote_num_tokens"] == 302


def test_threshold_counts_local_hits():
    planner, _ = make(threshold=64)
    prompt1 = list(range(200))
    out = list(range(1000, 1010))
    turn(planner, "c", prompt1, out)
    # p0 already holds the first 192 tokens (12 blocks) in its own prefix cache
    idx = planner.index
    idx.block_stored("p0", 0, list(range(1, 13)), None, prompt1[:192], GPU, block_size=BS)
    plan = planner.plan("c", prompt1 + out + [1], ["p0", "p1"], ["d0", "d1"])
    assert plan.prefill_pod == "p0" and plan.local_tokens == 192
    assert plan.action == "recompute" and "< threshold 64" in plan.reasons[-1]
    assert plan.pulled_tokens == 0
    assert predicted_pull_tokens(209, 211, 192) == 17


def test_decode_choice_prefers_holder_unless_loaded():
    planner, _ = make()
    prompt1 = list(range(400))
    out = list(range(1000, 1100))
    first = turn(planner, "c", prompt1, out, ds=("d1",))
    assert first.decode_pod == "d1"
    p2 = prompt1 + out + [4]
    plan = planner.plan("c", p2, ["p0"], ["d0", "d1"])
    assert plan.decode_pod == "d1" and "holds the conversation" in plan.reasons[1]
    turn(planner, "c3", prompt1, out, ds=("d1",))
    busy = {"d1": LoadSnapshot(waiting=50, kv_usage=0.99), "d0": LoadSnapshot()}
    plan = planner.plan("c3", p2, ["p0"], ["d0", "d1"], busy)
    assert plan.decode_pod == "d0" and "d1 holds the conversation but lost" in plan.reasons[1]
    assert plan.action == "pull"  # P still pulls from d1, wherever D runs now


def test_expiry_gone_pod_fallback_and_bad_answers():
    planner, clock = make(ttl=10.0)
    prompt1 = list(range(200))
    turn(planner, "c", prompt1, [1, 2])
    clock.t += 10.0
    assert planner.plan("c", prompt1 + [1, 2, 3], ["p0"], ["d0", "d1"]).action == "recompute"
    turn(planner, "c", prompt1, [1, 2], ds=("d1",))
    plan = planner.plan("c", prompt1 + [1, 2, 3], ["p0"], ["d0"])
    assert plan.action == "recompute" and "no longer a decode candidate" in plan.reasons[-1]
    turn(planner, "c", prompt1, [1, 2])
    plan = planner.plan("c", prompt1 + [1, 2, 3], ["p0"], ["d0", "d1"])
    fb = planner.fallback(plan, "prefill_http_500")
    assert fb.action == "recompute" and fb.prefill_params["remote_block_ids"] is None and fb.fallback
    assert planner.stats().fallbacks == {"prefill_http_500": 1}
    # D answers that do not fit their tokens are dropped
    bad = d_answer(500)
    assert planner.decode_answered(plan, bad, prompt1) is None
    assert planner.stats().bad_decode_answers == 1
    assert planner.decode_answered(plan, None, prompt1) is None and "c" not in planner.store
    with pytest.raises(ValueError):
        planner.plan("c", prompt1, [], ["d0"])


@st.composite
def conversations(draw):
    steps = []
    for _ in range(draw(st.integers(1, 5))):
        edit = draw(st.sampled_from(["extend", "strip", "change", "fresh"]))
        steps.append(
            (
                edit,
                draw(st.integers(0, 10**6)),
                draw(st.lists(st.integers(0, 30), min_size=1, max_size=60)),
                draw(st.lists(st.integers(0, 30), min_size=1, max_size=40)),
            )
        )
    return draw(st.sampled_from([0, 16, 64])), steps


@given(conversations())
@settings(max_examples=200, deadline=None)
def test_random_conversations_never_pull_mismatched_tokens(case):
    threshold, steps = case
    planner, _ = make(threshold=threshold)
    history: list[int] = []
    held: list[int] | None = None
    for edit, r, new, output in steps:
        prompt = list(history)
        if edit == "strip" and prompt:
            i = r % len(prompt)
            del prompt[i : i + 1 + r % 7]
        elif edit == "change" and prompt:
            prompt[r % len(prompt)] = 31
        elif edit == "fresh":
            prompt = []
        prompt += new
        plan = planner.plan("c", prompt, ["p0", "p1"], ["d0", "d1"])
        if plan.action == "pull":
            assert held is not None
            m = plan.prefill_params["remote_num_tokens"]
            assert held[:m] == prompt[:m]
            assert len(plan.prefill_params["remote_block_ids"][0]) == -(-m // BS)
            assert plan.pulled_tokens == predicted_pull_tokens(m, len(prompt), plan.local_tokens)
            assert plan.pulled_tokens >= max(threshold, 1)
        else:
            assert plan.prefill_params["remote_block_ids"] is None
        n = len(prompt) + len(output) - 1
        planner.decode_answered(plan, d_answer(n), prompt + output)
        held = (prompt + output)[:n]
        history = prompt + output


def test_decode_only_keeps_the_retained_entry_and_prefers_its_holder():
    """A turn D serves alone (a batch, n > 1, prompt logprobs) neither spends nor drops the
    conversation's entry: the next ordinary turn still pulls it."""
    planner, _ = make()
    prompt, output = list(range(1, 200)), list(range(500, 540))
    first = turn(planner, "c", prompt, output)
    held = planner.store.get("c")
    assert held is not None
    alone = planner.decode_only("c", prompt + output + [7] * 5, ["d0", "d1"], reason="n=2")
    assert alone.action == "decode_only" and alone.prefill_pod == "" and alone.prefill_params == {}
    assert alone.pulled_tokens == 0 and alone.prefill_choice is None
    assert alone.decode_pod == first.decode_pod
    assert "n=2" in alone.reasons[-1]
    assert planner.store.get("c") == held
    nxt = planner.plan("c", prompt + output + [9] * 40, ["p0", "p1"], ["d0", "d1"])
    assert nxt.action == "pull"
    s = planner.stats()
    assert s.decode_only == 1 and s.turns == 3
    with pytest.raises(ValueError):
        planner.decode_only("c", prompt, [], reason="x")


def test_a_prefill_pod_that_does_not_answer_leaves_the_same_turn_to_its_decode_pod():
    planner, _ = make()
    prompt, output = list(range(1, 200)), list(range(500, 540))
    turn(planner, "c", prompt, output)
    plan = planner.plan("c", prompt + output + [9] * 40, ["p0"], ["d0", "d1"])
    assert plan.action == "pull"
    turns = planner.stats().turns
    fb = planner.fallback(plan, "prefill_unreachable", decode_only=True)
    assert fb.action == "decode_only" and fb.prefill_pod == "" and fb.prefill_params == {}
    assert fb.decode_pod == plan.decode_pod and fb.pulled_tokens == 0 and fb.local_tokens == 0
    assert fb.fallback == "prefill_unreachable" and "prefill_unreachable" in fb.reasons[-1]
    s = planner.stats()
    assert s.turns == turns and s.fallbacks == {"prefill_unreachable": 1}


def test_cache_salt_scopes_local_hits_and_the_retained_entry():
    """The engines salt their block hashes with a request's cache_salt: P's salted blocks count as
    local hits only for a request with that salt, and a conversation's retained tokens match only
    under the salt they were kept with."""
    planner, _ = make(threshold=16)
    prompt = list(range(1, 200))  # 12 whole blocks
    planner.index.add_held("p0", planner.request_keys(prompt, "tenant-a"), GPU)
    salted = planner.plan(None, prompt, ["p0"], ["d0"], cache_salt="tenant-a")
    assert salted.local_tokens == 192 and salted.cache_salt == "tenant-a"
    assert planner.plan(None, prompt, ["p0"], ["d0"]).local_tokens == 0
    assert planner.plan(None, prompt, ["p0"], ["d0"], cache_salt="tenant-b").local_tokens == 0
    # turn 1 with a salt; P holds that prompt's blocks, D retains prompt + answer under the salt
    output = list(range(500, 560))
    plan1 = planner.plan("c", prompt, ["p0"], ["d0"], cache_salt="tenant-a")
    planner.decode_answered(plan1, d_answer(len(prompt) + len(output) - 1), prompt + output)
    prompt2 = prompt + output + [7] * 20
    plan2 = planner.plan("c", prompt2, ["p0"], ["d0"], cache_salt="tenant-a")
    assert plan2.action == "pull", plan2.explain()
    # the engine's counts: P reuses its 192 salted tokens and pulls the rest of the retained 258
    assert plan2.local_tokens == 192 and plan2.pulled_tokens == 258 - 192
    # the same conversation under another salt finds nothing reusable
    planner.decode_answered(plan2, d_answer(len(prompt2) + 9), prompt2 + list(range(900, 910)))
    other = planner.plan("c", prompt2 + [8] * 40, ["p0"], ["d0"], cache_salt="tenant-b")
    assert other.action == "recompute" and other.local_tokens == 0, other.explain()


def test_a_hybrid_prefill_pod_is_promised_what_its_hit_rule_serves():
    """P holds 8 blocks in its full-attention group but only blocks 0-3 in its sliding-window group
    (window 2 blocks): vLLM serves 4 blocks from cache, not 8; the plan says 4 and why."""
    from kvindex.hybrid import GroupSpec

    planner, _ = make()
    prompt = list(range(1000, 1000 + 8 * BS + 5))
    full = GroupSpec(group_idx=1, kind="full_attention", block_size=BS)
    swa = GroupSpec(group_idx=0, kind="sliding_window", block_size=BS, window=2 * BS)
    hashes = [5000 + i for i in range(8)]
    index = planner.index
    index.block_stored("p0", 0, hashes[:4], None, prompt[: 4 * BS], GPU, block_size=BS, group=swa)
    index.block_stored("p0", 0, hashes, None, prompt[: 8 * BS], GPU, block_size=BS, group=full)
    plan = planner.plan(None, prompt, ["p0"], ["d0"])
    assert plan.local_tokens == 4 * BS, plan.explain()
    # the same index without the sliding-window group promises all 8 blocks
    plain, _ = make()
    plain.index.block_stored("p0", 0, hashes, None, prompt[: 8 * BS], GPU, block_size=BS, group=full)
    assert plain.plan(None, prompt, ["p0"], ["d0"]).local_tokens == 8 * BS


def test_a_hybrid_decode_answer_is_retained_and_reused_whole():
    """vLLM 0.32's NixlConnector names a sliding-window group's in-window tail only: D's answer is kept,
    the next turn extending it pulls, and a turn editing inside it gets no params (P recomputes)."""
    planner, _ = make(threshold=0)
    prompt1, output = list(range(1000, 1000 + 6 * BS)), [7, 8, 9]
    held = len(prompt1) + len(output) - 1

    def first_turn(cid: str, groups: list[list[int]] | None = None) -> object:
        plan = planner.plan(cid, prompt1, ["p0"], ["d0"])
        answer = d_answer(held).to_dict()
        answer["remote_block_ids"] = groups or [[90, 91], answer["remote_block_ids"][0]]  # group 0: the window's tail
        return planner.decode_answered(plan, parse_params(answer), prompt1 + output)

    assert first_turn("extends") is not None and first_turn("edits") is not None
    assert planner.stats().bad_decode_answers == 0
    extended = planner.plan("extends", prompt1 + output + [4, 5], ["p0"], ["d0"])
    assert extended.action == "pull" and extended.pulled_tokens == held, extended.explain()
    edited = list(prompt1 + output)
    edited[3 * BS] += 1
    clipped = planner.plan("edits", edited + [4, 5], ["p0"], ["d0"])
    assert clipped.action == "recompute" and clipped.guard is not None and clipped.guard.clipped, clipped.explain()
    # every group short of the tokens: the answer does not belong to them
    assert first_turn("bad", [[90, 91], [92]]) is None
    assert planner.stats().bad_decode_answers == 1
