"""The hybrid hit rule (kvindex.hybrid.predict_hit) against a brute-force restatement of vLLM 0.32's coordinator."""

from __future__ import annotations

from math import lcm

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvindex.hybrid import GroupSpec, predict_hit, spec_from_store
from scorer.prefix import predicted_cached_tokens

# ---------------------------------------------------------------- the oracle


def accepts(g: GroupSpec, present, t: int) -> bool:
    """Can group ``g`` serve exactly the first ``t`` tokens from cache?"""
    if t == 0:
        return True
    b = g.block_size
    if g.rule == "full":  # every block of the prefix
        return all(present(g.group_idx, (k + 1) * b) for k in range(t // b))
    if g.rule == "sliding_window":  # the blocks the last token's window reaches
        need = -(-(g.window - 1) // b)
        return all(present(g.group_idx, (k + 1) * b) for k in range(max(0, t // b - need), t // b))
    if g.rule == "mamba":  # the state after token t
        return present(g.group_idx, t)
    return False


def brute_hit(groups, present, n: int) -> int:
    """The longest aligned prefix shorter than the prompt that every group accepts."""
    align = lcm(*(g.block_size for g in groups))
    best = 0
    for t in range(0, n, align):  # t <= n - 1: the last prompt token is recomputed
        if all(accepts(g, present, t) for g in groups):
            best = t
    return best


# ---------------------------------------------------------------- strategies

KINDS = ["full_attention", "mla_attention", "sliding_window", "mamba"]


@st.composite
def models(draw, eagle: bool = False):
    """Groups (distinct indexes, kinds, block sizes from a few multiples of 16) and per-group presence."""
    n_groups = draw(st.integers(1, 4))
    base = draw(st.sampled_from([16, 32]))
    groups = []
    for g in range(n_groups):
        kind = draw(st.sampled_from(KINDS))
        b = base * draw(st.sampled_from([1, 2, 3]))
        # windows around multiples of the block size (where ceil((w - 1) / b) steps) and anywhere
        window = draw(st.one_of(st.integers(1, 4).map(lambda k: k * b + draw(st.sampled_from([0, 1, 2]))),
                                st.integers(2, 5 * b))) if kind == "sliding_window" else None
        groups.append(GroupSpec(g, kind, b, window, eagle and draw(st.booleans())))
    n = draw(st.integers(0, 16 * base))
    held = {
        g.group_idx: draw(st.sets(st.integers(1, max(1, n // g.block_size)), max_size=6)) for g in groups
    }
    shared = draw(st.integers(0, n))
    for g in groups:  # dense prefixes are the common case: one shared by all groups or a group's own
        cut = draw(st.sampled_from([0, shared, draw(st.integers(0, n))]))
        held[g.group_idx] |= set(range(1, cut // g.block_size + 1))
        if draw(st.booleans()):  # and holes in it
            held[g.group_idx] -= draw(st.sets(st.integers(1, max(1, n // g.block_size)), max_size=5))
    order = draw(st.permutations(groups))
    return list(order), held, n


def presence(groups, held):
    sizes = {g.group_idx: g.block_size for g in groups}

    def present(g: int, end: int) -> bool:
        assert end % sizes[g] == 0, "asked for a token that is no block end"
        return end // sizes[g] in held[g]

    return present


# ---------------------------------------------------------------- properties


@settings(max_examples=500)
@given(models())
def test_rule_equals_brute_force(model) -> None:
    groups, held, n = model
    present = presence(groups, held)
    got = predict_hit(groups, present, n)
    assert got.tokens == brute_hit(groups, present, n)
    assert got.longest >= got.tokens
    bound = max(n - 1, 0)
    align = lcm(*(g.block_size for g in groups))
    assert (got.limited_by is None) == (got.tokens == bound - bound % align)
    assert got.limited_by is None or got.limited_by in {g.group_idx for g in groups}


@given(st.integers(0, 60), st.integers(0, 2000), st.sampled_from([16, 32, 64]), st.sampled_from(KINDS[:2]))
def test_plain_model_reduces_to_todays_rule(matched: int, n: int, b: int, kind: str) -> None:
    """One full-attention group: min(matched, (N-1)//b) * b, as scorer.prefix.predicted_cached_tokens."""
    g = GroupSpec(0, kind, b)
    got = predict_hit([g], lambda _g, end: end // b <= matched, n)
    assert got.tokens == predicted_cached_tokens(matched, n, b)


@settings(max_examples=150)
@given(models(eagle=True))
def test_eagle_never_claims_more(model) -> None:
    """Dropping a block for EAGLE only ever lowers the hit."""
    groups, held, n = model
    present = presence(groups, held)
    plain = [GroupSpec(g.group_idx, g.kind, g.block_size, g.window) for g in groups]
    assert predict_hit(groups, present, n).tokens <= predict_hit(plain, present, n).tokens


# ---------------------------------------------------------------- worked cases


def dense(groups_held):
    return lambda g, end: end in groups_held[g]


def test_sliding_window_needs_only_the_trailing_window() -> None:
    # group 0: SWA window 64 over 32-token blocks (need 2 blocks); group 1: full attention
    swa, full = GroupSpec(0, "sliding_window", 32, 64), GroupSpec(1, "full_attention", 32)
    held = {0: {96, 128}, 1: {32, 64, 96, 128, 160}}  # SWA lost blocks 1-2
    got = predict_hit([swa, full], dense(held), 200)
    assert (got.tokens, got.limited_by, got.longest) == (128, 0, 160)


def test_sliding_window_edges() -> None:
    full = GroupSpec(1, "full_attention", 32)
    every = {32 * k for k in range(1, 9)}
    # a window of 33 tokens needs ceil(32 / 32) = 1 block, one of 34 needs 2
    one, two = GroupSpec(0, "sliding_window", 32, 33), GroupSpec(0, "sliding_window", 32, 34)
    assert predict_hit([one, full], dense({0: {160}, 1: every}), 200).tokens == 160
    assert predict_hit([two, full], dense({0: {160}, 1: every}), 200).tokens == 0
    # 16-token blocks under a 32-token alignment: a window must end on a multiple of 32
    swa = GroupSpec(0, "sliding_window", 16, 17)
    assert predict_hit([swa, full], dense({0: {80}, 1: every}), 200).tokens == 0
    assert predict_hit([swa, full], dense({0: {80, 64}, 1: every}), 200).tokens == 64
    # no whole window anywhere: a run from the first block still counts
    wide = GroupSpec(0, "sliding_window", 32, 200)
    assert predict_hit([wide, full], dense({0: {32, 64, 128}, 1: every}), 250).tokens == 64


def test_mamba_state_exactly_at_the_boundary() -> None:
    mamba, full = GroupSpec(0, "mamba", 32), GroupSpec(1, "full_attention", 32)
    held = {0: {64}, 1: {32, 64, 96, 128}}
    got = predict_hit([mamba, full], dense(held), 300)
    assert (got.tokens, got.limited_by, got.longest) == (64, 0, 128)
    # a 16-token Mamba block under a 32-token alignment: a state at 48 serves nothing
    small = GroupSpec(0, "mamba", 16)
    assert predict_hit([small, full], dense({0: {48}, 1: held[1]}), 300).tokens == 0
    # the second request sharing a long prefix: Mamba holds no state there -> 0
    assert predict_hit([mamba, full], dense({0: set(), 1: held[1]}), 300).tokens == 0


def test_lcm_alignment() -> None:
    # SWA 16-token blocks, full 64-token blocks (Gemma-4-like): hits land on multiples of 64
    swa, full = GroupSpec(0, "sliding_window", 16, 32), GroupSpec(1, "full_attention", 64)
    held = {0: {16 * k for k in range(1, 12)}, 1: {64, 128}}
    assert predict_hit([swa, full], dense(held), 180).tokens == 128
    assert predict_hit([swa, full], dense(held), 128).tokens == 64  # 127 rounds down to 64


def test_last_prompt_token_is_recomputed() -> None:
    g = GroupSpec(0, "full_attention", 32)
    assert predict_hit([g], lambda _g, _e: True, 64).tokens == 32
    assert predict_hit([g], lambda _g, _e: True, 65).tokens == 64
    assert predict_hit([g], lambda _g, _e: True, 1).tokens == 0
    assert predict_hit([g], lambda _g, _e: True, 0).tokens == 0


def test_eagle_drops_the_last_block() -> None:
    full = GroupSpec(0, "full_attention", 32, eagle=True)
    assert predict_hit([full], lambda _g, _e: True, 200).tokens == 160
    swa = GroupSpec(0, "sliding_window", 32, 64, eagle=True)  # needs 3 blocks, then drops one
    assert predict_hit([swa], dense({0: {96, 128, 160}}), 200).tokens == 128
    assert predict_hit([swa], dense({0: {128, 160}}), 200).tokens == 0


def test_unmodelled_kind_predicts_no_hit() -> None:
    groups = [GroupSpec(0, "full_attention", 32), GroupSpec(1, "chunked_local_attention", 32)]
    got = predict_hit(groups, lambda _g, _e: True, 300)
    assert got.tokens == 0 and got.limited_by == 1


def test_spec_from_store_and_bad_arguments() -> None:
    assert spec_from_store(None, None, 32, None) == GroupSpec(0, "full_attention", 32)
    assert spec_from_store(2, "sliding_window", 16, 128).rule == "sliding_window"
    assert spec_from_store(2, "sliding_window", 16, None).rule == "none"
    with pytest.raises(ValueError):
        spec_from_store(0, "mamba", 0, None)
    with pytest.raises(ValueError):
        spec_from_store(-1, "mamba", 16, None)
    with pytest.raises(ValueError):
        predict_hit([], lambda _g, _e: True, 10)
    with pytest.raises(ValueError):
        predict_hit([GroupSpec(0, "mamba", 16)] * 2, lambda _g, _e: True, 10)
    with pytest.raises(ValueError):
        predict_hit([GroupSpec(0, "mamba", 16)], lambda _g, _e: True, -1)
