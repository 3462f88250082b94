"""Prefix scorer: pure scoring against an oracle, the ordering rules, tiers, and the real index."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvindex.tiers import CPU, GPU, STORAGE, TierWeights, mask_of, tier_bit
from scorer.prefix import PrefixIndex, PrefixScore, prefix_scores_from_matches, score_prefix

GPU_M, CPU_M, STO_M = tier_bit(GPU), tier_bit(CPU), tier_bit(STORAGE)
ODD_M = tier_bit("nvme-far")  # a tier nobody configured: weighs 0
TIER_WEIGHT = {GPU_M: 1.0, CPU_M: 0.8, STO_M: 0.5, ODD_M: 0.0}
BIT_NAMES = {GPU_M: GPU, CPU_M: CPU, STO_M: STORAGE, ODD_M: "nvme-far"}


# ---------------------------------------------------------------- the oracle


def oracle(masks_by_pod, request_blocks, block_size, candidates):
    """Plain recomputation: walk each pod's masks until the first empty one."""
    pods = list(masks_by_pod) if candidates is None else list(dict.fromkeys(candidates))
    out = {}
    for pod in pods:
        n, weighted, tiers = 0, 0.0, set()
        for mask in masks_by_pod.get(pod, []):
            if mask == 0:
                break
            n += 1
            bits = [b for b in TIER_WEIGHT if mask & b]
            weighted += max(TIER_WEIGHT[b] for b in bits)
            tiers.update(bits)
        if n == 0:
            out[pod] = (0, 0, 0.0, 0.0, None)
            continue
        # heaviest tier; on equal weight the earliest registered (gpu, cpu, storage, then others)
        best_bit = max(tiers, key=lambda b: (TIER_WEIGHT[b], -b))
        out[pod] = (n, n * block_size, weighted, min(1.0, weighted / request_blocks), BIT_NAMES[best_bit])
    return out


masks_st = st.integers(min_value=0, max_value=15).map(
    lambda m: sum(b for i, b in enumerate((GPU_M, CPU_M, STO_M, ODD_M)) if m >> i & 1)
)
pod_ids = st.sampled_from(["p0", "p1", "p2", "p3", "p4"])


@st.composite
def match_cases(draw):
    request_blocks = draw(st.integers(min_value=0, max_value=20))
    matches = draw(
        st.dictionaries(pod_ids, st.lists(masks_st, min_size=1, max_size=request_blocks) if request_blocks else st.just([]))
    )
    candidates = draw(st.none() | st.lists(pod_ids, max_size=6))
    block_size = draw(st.sampled_from([1, 16, 32, 64]))
    return matches, request_blocks, block_size, candidates


@settings(max_examples=200, deadline=None)
@given(match_cases())
def test_prefix_scores_match_oracle(case):
    matches, request_blocks, block_size, candidates = case
    got = prefix_scores_from_matches(matches, request_blocks, block_size, candidates, TierWeights())
    want = oracle(matches, request_blocks, block_size, candidates)
    assert list(got) == list(want)
    for pod, (n, tokens, weighted, coverage, best) in want.items():
        s = got[pod]
        assert s.pod == pod
        assert (s.matched_blocks, s.matched_tokens, s.best_tier) == (n, tokens, best)
        assert s.weighted_blocks == pytest.approx(weighted)
        assert s.coverage == pytest.approx(coverage)
        assert 0.0 <= s.coverage <= 1.0


# ------------------------------------------------------- the ordering rules


@settings(max_examples=200, deadline=None)
@given(
    request_blocks=st.integers(min_value=1, max_value=2000),
    data=st.data(),
    tier=st.sampled_from([GPU_M, CPU_M, STO_M, GPU_M | CPU_M, CPU_M | STO_M]),
)
def test_shorter_prefix_never_scores_like_none(request_blocks, data, tier):
    """Any positively weighted hit beats no hit; a longer run in the same tier beats a shorter one."""
    short = data.draw(st.integers(min_value=1, max_value=request_blocks))
    longer = data.draw(st.integers(min_value=short, max_value=request_blocks))
    matches = {"short": [tier] * short, "long": [tier] * longer}
    s = prefix_scores_from_matches(matches, request_blocks, 16, ["none", "short", "long"], TierWeights())
    assert s["none"].coverage == 0.0
    assert s["short"].coverage > s["none"].coverage
    assert s["long"].coverage >= s["short"].coverage
    if longer > short:
        assert s["long"].coverage > s["short"].coverage


def test_min_max_normalisation_would_tie_but_coverage_does_not():
    # llm-d min-max normalises over pods with hits: "a" (1 block) would get 0, same as "c" (none)
    w = TierWeights()
    s = prefix_scores_from_matches({"a": [GPU_M], "b": [GPU_M] * 4}, 10, 16, ["a", "b", "c"], w)
    assert [s[p].coverage for p in "abc"] == [pytest.approx(0.1), pytest.approx(0.4), 0.0]
    # and a lone short hit is worth what it covers, not 1.0
    lone = prefix_scores_from_matches({"a": [GPU_M]}, 1000, 16, ["a", "b"], w)
    assert lone["a"].coverage == pytest.approx(0.001)


def test_block_after_a_gap_never_counts():
    w = TierWeights()
    s = prefix_scores_from_matches({"p": [GPU_M, GPU_M, 0, GPU_M, GPU_M]}, 5, 16, None, w)["p"]
    assert (s.matched_blocks, s.matched_tokens, s.weighted_blocks) == (2, 32, 2.0)
    assert s.coverage == pytest.approx(0.4)
    first = prefix_scores_from_matches({"p": [0, GPU_M, GPU_M]}, 3, 16, None, w)["p"]
    assert first == PrefixScore(pod="p")


def test_tier_weighting_gpu_cpu_storage_unknown():
    w = TierWeights()
    s = prefix_scores_from_matches(
        {"g": [GPU_M] * 4, "c": [CPU_M] * 4, "s": [STO_M] * 4, "u": [ODD_M] * 4, "gc": [GPU_M | CPU_M] * 4},
        4,
        32,
        None,
        w,
    )
    assert s["g"].coverage == pytest.approx(1.0) and s["g"].best_tier == GPU
    assert s["c"].coverage == pytest.approx(0.8) and s["c"].best_tier == CPU
    assert s["s"].coverage == pytest.approx(0.5) and s["s"].best_tier == STORAGE
    # an unconfigured tier is held (the match is real) but weighs nothing
    assert (s["u"].matched_blocks, s["u"].matched_tokens, s["u"].coverage) == (4, 128, 0.0)
    assert s["gc"].coverage == pytest.approx(1.0) and s["gc"].best_tier == GPU
    # mixed per block: gpu, cpu, storage, gpu -> (1 + .8 + .5 + 1) / 4
    mixed = prefix_scores_from_matches({"m": [GPU_M, CPU_M, STO_M, GPU_M]}, 4, 16, None, w)["m"]
    assert mixed.weighted_blocks == pytest.approx(3.3)
    assert mixed.best_tier == GPU


def test_configured_weights_change_the_order():
    w = TierWeights({GPU: 1.0, CPU: 1.0, "nvme-far": 0.25})
    s = prefix_scores_from_matches({"c": [CPU_M] * 2, "u": [ODD_M] * 2}, 2, 16, None, w)
    assert s["c"].coverage == pytest.approx(1.0)
    assert s["u"].coverage == pytest.approx(0.25) and s["u"].best_tier == "nvme-far"
    # storage is unconfigured here: weighs 0
    assert prefix_scores_from_matches({"s": [STO_M]}, 1, 16, None, w)["s"].coverage == 0.0


def test_weights_above_one_are_clamped_to_full_coverage():
    w = TierWeights({GPU: 2.0})
    s = prefix_scores_from_matches({"p": [GPU_M] * 3}, 4, 16, None, w)["p"]
    assert s.weighted_blocks == pytest.approx(6.0)
    assert s.coverage == 1.0


def test_zero_request_blocks_gives_zero_scores():
    s = prefix_scores_from_matches({}, 0, 16, ["a", "b"], TierWeights())
    assert s == {"a": PrefixScore(pod="a"), "b": PrefixScore(pod="b")}
    assert s["a"].matched_tokens == 0 and s["a"].best_tier is None


def test_candidates_restrict_and_fill():
    s = prefix_scores_from_matches({"a": [GPU_M], "x": [GPU_M]}, 2, 16, ["b", "a"], TierWeights())
    assert list(s) == ["b", "a"]
    assert s["b"] == PrefixScore(pod="b")
    assert s["a"].matched_blocks == 1


@pytest.mark.parametrize(
    ("kwargs", "exc"),
    [
        ({"request_blocks": -1}, ValueError),
        ({"block_size": 0}, ValueError),
        ({"matches": {"a": [GPU_M] * 3}, "request_blocks": 2}, ValueError),
        ({"candidates": "pod-a"}, TypeError),
    ],
)
def test_misuse_raises(kwargs, exc):
    args = {"matches": {}, "request_blocks": 2, "block_size": 16, "candidates": None, "weights": TierWeights()}
    args.update(kwargs)
    with pytest.raises(exc):
        prefix_scores_from_matches(**args)


# --------------------------------------------------------- score_prefix


class DictIndex:
    """An index stand-in defined by pod -> {request key: mask}: the oracle of prefix_match."""

    def __init__(self, held: dict[str, dict[int, int]]):
        self.held = held
        self.calls = 0

    def pods(self) -> frozenset[str]:
        return frozenset(self.held)

    def prefix_match(self, request_keys, pods=None):
        self.calls += 1
        out = {}
        for pod in self.held if pods is None else pods:
            masks = []
            for k in request_keys:
                m = self.held.get(pod, {}).get(int(k), 0)
                if not m:
                    break
                masks.append(m)
            if masks:
                out[pod] = masks
        return out


def test_score_prefix_all_known_pods_and_short_prompt():
    idx = DictIndex({"a": {1: GPU_M, 2: GPU_M, 4: GPU_M}, "b": {1: CPU_M}, "c": {9: GPU_M}})
    assert isinstance(idx, PrefixIndex)
    s = score_prefix(idx, [1, 2, 3, 4], block_size=16)
    assert set(s) == {"a", "b", "c"}
    assert (s["a"].matched_blocks, s["a"].coverage) == (2, pytest.approx(0.5))
    assert s["b"].coverage == pytest.approx(0.2)
    assert s["c"] == PrefixScore(pod="c")
    only = score_prefix(idx, [1, 2], ["b", "zz"], block_size=16)
    assert list(only) == ["b", "zz"] and only["zz"] == PrefixScore(pod="zz")
    calls = idx.calls
    empty = score_prefix(idx, [], block_size=16)
    assert empty == {p: PrefixScore(pod=p) for p in ("a", "b", "c")}
    assert score_prefix(idx, [], ["q"], block_size=16) == {"q": PrefixScore(pod="q")}
    assert idx.calls == calls  # no match query for a prompt without a full block
    with pytest.raises(ValueError):
        score_prefix(idx, [1], block_size=0)
    with pytest.raises(TypeError):
        score_prefix(idx, [1], "a", block_size=16)


def test_score_prefix_custom_weights():
    idx = DictIndex({"a": {1: STO_M, 2: STO_M}})
    s = score_prefix(idx, [1, 2], block_size=16, weights=TierWeights({STORAGE: 1.0}))
    assert s["a"].coverage == pytest.approx(1.0)


# ------------------------------------------------- through the real index


def _real_index(block_size: int):
    from kvindex.reference import KVBlockIndex
    from kvindex.keys import TokenProcessor

    return KVBlockIndex(TokenProcessor(algorithm="vllm_sha256_cbor", block_size=block_size))


def test_score_prefix_through_real_index():
    bs = 16
    idx = _real_index(bs)
    tp = idx.token_processor
    tokens = list(range(1000, 1000 + 8 * bs))
    keys = [int(k) for k in tp.request_keys(tokens)]
    assert len(keys) == 8

    def store(pod, rank, lo, hi, tier="gpu"):
        parent = keys[lo - 1] if lo else None
        idx.block_stored(pod, rank, keys[lo:hi], parent, tokens[lo * bs : hi * bs], tier, block_size=bs)

    store("full", 0, 0, 8)
    store("half", 1, 0, 4)  # a DP rank != 0 still counts for the pod
    store("gap", 0, 0, 2)
    store("gap", 0, 3, 6)  # blocks 3..5 after a gap at block 2 never count
    store("cpu", 0, 0, 8, tier="cpu")
    store("other", 0, 0, 2)
    idx.block_stored("offl", 0, keys[:3], None, tokens[: 3 * bs], "gpu", block_size=bs)
    idx.block_stored("offl", 0, keys[:3], None, None, "cpu")  # token-less offload adds a tier
    idx.add_speculative(keys[:5], "spec", ttl=60.0)

    s = score_prefix(idx, keys, block_size=bs)
    assert set(s) >= {"full", "half", "gap", "cpu", "other", "offl", "spec"}
    assert (s["full"].matched_blocks, s["full"].coverage) == (8, pytest.approx(1.0))
    assert (s["half"].matched_tokens, s["half"].coverage) == (64, pytest.approx(0.5))
    assert (s["gap"].matched_blocks, s["gap"].coverage) == (2, pytest.approx(0.25))
    assert (s["cpu"].coverage, s["cpu"].best_tier) == (pytest.approx(0.8), CPU)
    assert (s["offl"].matched_blocks, s["offl"].best_tier) == (3, GPU)
    assert s["offl"].coverage == pytest.approx(3 / 8)
    assert (s["spec"].matched_blocks, s["spec"].best_tier) == (5, GPU)
    # restricting candidates, with one the index does not know
    r = score_prefix(idx, keys[:2], ["other", "nobody"], block_size=bs)
    assert r["other"].coverage == pytest.approx(1.0) and r["nobody"] == PrefixScore(pod="nobody")
    # a prompt shorter than one block
    short = tp.request_keys(tokens[: bs - 1])
    assert len(short) == 0
    z = score_prefix(idx, short, block_size=bs)
    assert all(v == PrefixScore(pod=p) for p, v in z.items()) and "full" in z
    # numpy request keys work as well
    np_keys = tp.request_keys(tokens)
    assert score_prefix(idx, np_keys, ["half"], block_size=bs)["half"].matched_blocks == 4


@settings(max_examples=100, deadline=None)
@given(
    held=st.dictionaries(
        st.sampled_from(["a", "b", "c"]),
        st.lists(st.tuples(st.integers(0, 9), st.sampled_from(["gpu", "cpu", "storage"])), max_size=12),
        max_size=3,
    ),
    n_req=st.integers(0, 10),
)
def test_real_index_agrees_with_dict_oracle(held, n_req):
    """Blocks stored one at a time (any order, tiers mixed) score as the dict oracle says."""
    bs = 32
    idx = _real_index(bs)
    tokens = list(range(7, 7 + 10 * bs))
    keys = [int(k) for k in idx.token_processor.request_keys(tokens)]
    model: dict[str, dict[int, int]] = {}
    for pod, blocks in held.items():
        for b, tier in blocks:
            idx.block_stored(pod, 0, [keys[b]], keys[b - 1] if b else None, tokens[b * bs : (b + 1) * bs], tier, block_size=bs)
            m = model.setdefault(pod, {})
            m[keys[b]] = m.get(keys[b], 0) | mask_of([tier])
    req = keys[:n_req]
    got = score_prefix(idx, req, ["a", "b", "c"], block_size=bs)
    want = score_prefix(DictIndex(model), req, ["a", "b", "c"], block_size=bs)
    assert got == want


def test_predicted_cached_tokens_follows_vllms_hit_rule():
    from scorer.prefix import predicted_cached_tokens

    assert predicted_cached_tokens(4, 128, 32) == 96  # fully cached, block-aligned: the last block is recomputed
    assert predicted_cached_tokens(4, 129, 32) == 128
    assert predicted_cached_tokens(2, 200, 32) == 64  # the match is the limit
    assert predicted_cached_tokens(5, 0, 32) == 0
    assert predicted_cached_tokens(1, 32, 32) == 0
    with pytest.raises(ValueError):
        predicted_cached_tokens(-1, 10, 32)
