"""The guard's safety property: emitted params never name a block whose tokens differ from the new prompt's."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from connector.guard import clip_to_prompt, common_prefix_len
from connector.params import parse_params
from kvindex.keys import TokenProcessor


def d_answer(n_tokens: int, bs: int, groups: int, base: int = 100):
    nb = -(-n_tokens // bs)
    return parse_params(
        {
            "do_remote_prefill": False,
            "do_remote_decode": True,
            # distinct ids per group, so a test can map an id back to its block index
            "remote_block_ids": [[base + g * 1000 + i for i in range(nb)] for g in range(groups)],
            "remote_engine_id": "eng-d",
            "remote_request_id": "req",
            "remote_host": "127.0.0.1",
            "remote_port": 5600,
            "remote_num_tokens": n_tokens,
            "remote_blocks_expiry_time": 5.0,
            "transfer_mode": "pull",
            "future": {"kept": True},
        }
    )


@st.composite
def history_and_edit(draw):
    bs = draw(st.sampled_from([1, 2, 4, 16]))
    vocab = draw(st.integers(2, 50))
    held = draw(st.lists(st.integers(0, vocab), min_size=1, max_size=120))
    new = list(held)
    kind = draw(st.sampled_from(["extend", "delete", "insert", "change", "strip", "truncate", "none"]))
    if kind == "delete" and new:
        i = draw(st.integers(0, len(new) - 1))
        del new[i]
    elif kind == "insert":
        i = draw(st.integers(0, len(new)))
        new.insert(i, draw(st.integers(0, vocab)))
    elif kind == "change" and new:
        i = draw(st.integers(0, len(new) - 1))
        new[i] = draw(st.integers(0, vocab))
    elif kind == "strip" and new:
        i = draw(st.integers(0, len(new) - 1))
        j = draw(st.integers(i, len(new)))
        del new[i:j]
    elif kind == "truncate":
        new = new[: draw(st.integers(0, len(new)))]
    new += draw(st.lists(st.integers(0, vocab), max_size=40))  # the new turn's tokens
    return bs, held, new, draw(st.integers(1, 3))


@given(history_and_edit())
@settings(max_examples=1000, deadline=None)
def test_emitted_blocks_always_match_the_prompt(case):
    bs, held, prompt, groups = case
    tp = TokenProcessor(block_size=bs)
    params = d_answer(len(held), bs, groups)
    r = clip_to_prompt(params, held, tp.request_keys(held), prompt, tp.request_keys(prompt), bs)
    if r.params is None:
        assert r.reusable_tokens == 0 and r.blocks == 0
        return
    m = r.params.remote_num_tokens
    assert m == r.reusable_tokens and 0 < m <= len(held)
    # the tokens P will load KV for are exactly the prompt's tokens at those positions
    assert held[:m] == prompt[:m]
    for g, ids in enumerate(r.params.remote_block_ids):
        assert len(ids) == -(-m // bs)
        for ident in ids:
            i = ident - 100 - g * 1000  # the block index this id held in D's answer
            lo, hi = i * bs, min((i + 1) * bs, len(held))
            assert held[lo:hi] == prompt[lo:hi], "a block with other tokens than the prompt's"
    # unknown fields ride along; the input is not modified
    assert r.params.extra == {"future": {"kept": True}}
    assert params.remote_num_tokens == len(held)
    # maximal: nothing that matches is thrown away, beyond whole-block rounding
    common = common_prefix_len(held, prompt)
    assert r.common_tokens == min(common, len(held))
    if common >= len(held):
        assert m == len(held) and not r.clipped
    else:
        assert m == common // bs * bs


def test_examples():
    bs = 4
    tp = TokenProcessor(block_size=bs)
    held = list(range(10))
    p = d_answer(10, bs, 1)
    k = tp.request_keys
    # the prompt extends everything: unchanged (the partial last block too)
    r = clip_to_prompt(p, held, k(held), held + [7, 7], k(held + [7, 7]), bs)
    assert r.params.to_dict() == p.to_dict() and not r.clipped
    # a changed token in block 1: only block 0 survives
    edited = held[:5] + [99] + held[6:] + [7]
    r = clip_to_prompt(p, held, k(held), edited, k(edited), bs)
    assert r.params.remote_block_ids == [[100]] and r.params.remote_num_tokens == 4 and r.clipped
    # a change in block 0: nothing
    edited = [99] + held[1:]
    r = clip_to_prompt(p, held, k(held), edited, k(edited), bs)
    assert r.params is None
    # same tokens, other key scope (e.g. another LoRA): nothing
    r = clip_to_prompt(p, held, k(held), held + [1], k(held + [1], lora="other"), bs)
    assert r.params is None and "key scope" in r.reason
    with pytest.raises(ValueError):
        clip_to_prompt(d_answer(4, bs, 1), held, k(held), held, k(held), bs)  # 1 block for 10 tokens


@given(history_and_edit(), st.integers(1, 3))
@settings(max_examples=500, deadline=None)
def test_a_hybrid_answer_is_reused_whole_or_not_at_all(case, tail: int):
    """A sliding-window / state group names only the retained sequence's last blocks (vLLM 0.32 NixlConnector):
    the params go out unchanged when the prompt extends every retained token, else not at all."""
    bs, held, prompt, _ = case
    tp = TokenProcessor(block_size=bs)
    params = d_answer(len(held), bs, 2)
    nb = -(-len(held) // bs)
    if tail >= nb:
        return  # the window covers the whole sequence: not a tail group
    raw = params.to_dict()
    raw["remote_block_ids"] = [raw["remote_block_ids"][0], raw["remote_block_ids"][1][-tail:]]
    hybrid = parse_params(raw)
    r = clip_to_prompt(hybrid, held, tp.request_keys(held), prompt, tp.request_keys(prompt), bs)
    if common_prefix_len(held, prompt) >= len(held):
        assert r.params is not None and r.params.to_dict() == hybrid.to_dict() and not r.clipped
    else:
        assert r.params is None and r.reusable_tokens == 0 and r.clipped


def test_a_hybrid_answer_cut_short_says_why():
    bs = 4
    tp = TokenProcessor(block_size=bs)
    held = list(range(20))
    raw = d_answer(20, bs, 2).to_dict()
    raw["remote_block_ids"][1] = raw["remote_block_ids"][1][-2:]  # the window's two blocks
    edited = held[:12] + [99] + held[13:]
    r = clip_to_prompt(parse_params(raw), held, tp.request_keys(held), edited, tp.request_keys(edited), bs)
    assert r.params is None and "[1]" in r.reason and "no partial reuse" in r.reason
