"""Real NIXL (UCX, DRAM) between two processes: next-turn params, clipped by the guard, drive a READ of exactly
the retained blocks that match the new prompt, and the bytes P receives are the KV of its own prompt.

The decode side is a child process with its own NIXL agent (examples/nixl_kv.py); a block's bytes are a
function of all tokens up to its end, so a block retained for other tokens cannot pass the byte check.
"""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from connector.params import parse_params
from connector.planner import PDPlanner
from connector.retained import RetainedStore
from examples.nixl_kv import DecodeProcess, PrefillAgent, nixl_available
from kvindex.reference import KVBlockIndex
from kvindex.keys import TokenProcessor

pytestmark = pytest.mark.vllm

if not nixl_available():  # these tests must run wherever the suite runs: fail, never skip
    pytest.fail("nixl does not import: `make test` installs nixl and nixl-cu12 (--no-deps)", pytrace=False)

BS = 4
BLOCK_BYTES = 1024
REGIONS = 4  # e.g. K and V of 2 layers


@pytest.fixture(scope="module")
def pair():
    with DecodeProcess(512, BLOCK_BYTES, REGIONS, name="decode-test") as d:
        p = PrefillAgent(d.info, 128)
        try:
            yield d, p
        finally:
            p.close()


def planner(guard: bool = True) -> PDPlanner:
    tp = TokenProcessor(block_size=BS)
    index = KVBlockIndex(tp)
    return PDPlanner(index, tp, RetainedStore(index), recompute_threshold=0, guard=guard)


@st.composite
def turn_pairs(draw):
    prompt1 = draw(st.lists(st.integers(0, 9), min_size=1, max_size=80))
    output = draw(st.lists(st.integers(0, 9), min_size=1, max_size=30))
    history = prompt1 + output
    kind = draw(st.sampled_from(["extend", "strip", "change", "insert"]))
    new = list(history)
    i = draw(st.integers(0, len(new) - 1))
    if kind == "strip":
        del new[i : i + draw(st.integers(1, 12))]
    elif kind == "change":
        new[i] = (new[i] + 1) % 10
    elif kind == "insert":
        new.insert(i, 10)
    new += draw(st.lists(st.integers(0, 9), min_size=1, max_size=20))
    return prompt1, output, new


@given(turn_pairs())
@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
def test_clipped_params_read_exactly_the_matching_blocks(pair, case):
    d, p = pair
    prompt1, output, prompt2 = case
    tokens = prompt1 + output
    held_n = len(tokens) - 1  # vLLM: prompt + generated - 1
    for guard in (True, False):
        pl = planner(guard)
        first = pl.plan("conv", prompt1, ["p0"], ["d0"])
        answer = parse_params(d.retain(tokens, held_n, BS))
        assert pl.decode_answered(first, answer, tokens) is not None
        plan = pl.plan("conv", prompt2, ["p0"], ["d0"])
        ids_all = answer.remote_block_ids[0]
        try:
            if plan.action != "pull":
                assert guard and plan.prefill_params["remote_block_ids"] is None
                assert tokens[:BS] != prompt2[:BS] or len(prompt2) < BS or held_n < BS
                continue
            params = plan.prefill_params
            m = params["remote_num_tokens"]
            ids = params["remote_block_ids"][0]
            assert ids == ids_all[: len(ids)]
            p.read(ids)
            bad = p.mismatched_blocks(prompt2, m, BS)
            if guard:
                # every byte P received is the KV of its own prompt's tokens
                assert bad == [], (m, bad)
                assert tokens[:m] == prompt2[:m]
            else:
                # unguarded: whenever the prompt departs from D's tokens inside the
                # retained range, P received KV of other tokens, and the bytes show it
                diverge = next((j for j in range(min(m, len(prompt2))) if tokens[j] != prompt2[j]), None)
                if diverge is not None:
                    assert diverge // BS in bad
                elif len(prompt2) >= m:
                    assert bad == []
        finally:
            d.release(ids_all)


def test_reader_notifies_decode(pair):
    d, p = pair
    toks = list(range(50))
    params = d.retain(toks, 49, BS)
    ids = params["remote_block_ids"][0]
    p.read(ids, notif=params["remote_request_id"].encode())
    assert p.mismatched_blocks(toks, 49, BS) == []
    import time

    deadline = time.monotonic() + 10
    while params["remote_request_id"].encode() not in d.notifs():
        assert time.monotonic() < deadline, "no notification at D"
        time.sleep(0.05)
    d.release(ids)


def test_unguarded_edit_reads_other_tokens_kv_and_guard_prevents_it(pair):
    """A client that strips a span: unclipped params make P receive KV of tokens it did not send."""
    d, p = pair
    tokens = list(range(40))
    prompt2 = tokens[:10] + tokens[14:] + [7, 7, 7]  # span 10..13 stripped
    for guard, expect_bad in ((False, True), (True, False)):
        pl = planner(guard)
        first = pl.plan("c", tokens[:30], ["p0"], ["d0"])
        answer = parse_params(d.retain(tokens, 39, BS))
        pl.decode_answered(first, answer, tokens)
        plan = pl.plan("c", prompt2, ["p0"], ["d0"])
        ids = plan.prefill_params["remote_block_ids"][0]
        m = plan.prefill_params["remote_num_tokens"]
        p.read(ids)
        bad = p.mismatched_blocks(prompt2, m, BS)
        assert (m, bool(bad)) == ((39, True) if expect_bad else (8, False)), (m, bad)
        if expect_bad:
            assert bad == list(range(2, 10))  # blocks from the stripped span on
        d.release(answer.remote_block_ids[0])
