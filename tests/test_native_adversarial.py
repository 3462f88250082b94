"""Adversarial checks of the compiled read path against its references.

1. The compiled walk's runs of blocks with the same holders (``prefix_summary`` /
   ``match_tokens``) against the pure-Python index (kvindex.reference), driven by a
   state machine that builds long runs of identical holder sets over many pods
   (more than 64, with slots given back and reused by new pods) and breaks them
   with removals, clears, LRU evictions, other tiers, DP ranks and models.  Every
   read is compared, with the DP ranks ``match_tokens(dp_ranks=)`` fills in held
   to an exact oracle (the pods whose matched blocks one rank holds, and only
   those).
2. ``TTFTPicker.pick`` (its compiled pass) against ``TTFTPicker._pick_py`` on
   inputs outside the plain domain: prompt lengths past 2**53 and 2**63,
   estimated prompt lengths, float/int/str/dict subclasses, duplicate and
   unknown candidates, many exact ties, -0.0; same rows (repr, so types and
   signs count) and order, or the same exception.  A field getter that drops
   the last reference to its object must not crash the pass; repeated picks
   (answered and declined) must not leak Python objects.
"""

from __future__ import annotations

import gc
import math
import tracemalloc

import hypothesis.strategies as st
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from kvindex import _native
from kvindex.reference import KVBlockIndex
from kvindex.keys import TokenProcessor
from kvindex.native import NativeKVBlockIndex, _summarise
from scorer.load import LoadSnapshot
from scorer.picker import PodInputs, TTFTPicker, _prompt_tokens, _unique_candidates
from scorer.prefix import PrefixScore
from tests.oracle import engine_hash, same_on_both

# -- 1. the walk's same-holder runs over many pods

BS = 4
N_BLOCKS = 24
N_PODS = 72  # past 64: slots past one machine word
PODS = [f"p{i:02d}" for i in range(N_PODS)]
RANKS = [0, 1, 2]
TIERS = ["gpu", "cpu", "storage"]
MODELS = [None, "m"]
WEIGHTS = [1.0, 0.75, 0.5, 0.25]


def _paths() -> list[tuple[int, ...]]:
    """Three paths sharing prefixes (path 1 shares 8 blocks with path 0, path 2 shares 16)."""
    p0 = tuple(range(1000, 1000 + N_BLOCKS * BS))
    p1 = p0[: 8 * BS] + tuple(range(5000, 5000 + (N_BLOCKS - 8) * BS))
    p2 = p0[: 16 * BS] + tuple(range(9000, 9000 + (N_BLOCKS - 16) * BS))
    return [p0, p1, p2]


PATHS = _paths()
EKS = [[engine_hash(p[: (i + 1) * BS]) for i in range(N_BLOCKS)] for p in PATHS]


def _exact_ranks(ref: KVBlockIndex, keys: list[int], got: dict) -> dict[str, int]:
    """pod -> the one DP rank holding all of its matched blocks (pods with two or more ranks left out)."""
    out = {}
    rows = ref.lookup(keys)
    for pod, (n, _w, _u) in got.items():
        ranks = {e.dp_rank for row in rows[:n] for e in row if e.pod == pod and not e.speculative}
        if len(ranks) == 1:
            out[pod] = ranks.pop()
    return out


class ManyPodRuns(RuleBasedStateMachine):
    """Both indexes fed groups of pods storing prefixes of shared paths (long runs of blocks with
    the same holder set), broken by removals, clears (pods leave; new pods reuse their slots), LRU
    evictions, tiers, ranks, models, speculative and router-held entries."""

    TP = TokenProcessor(block_size=BS, hash_seed=5)
    EKS = EKS  # the engine keys of each path's blocks

    def __init__(self) -> None:
        super().__init__()
        self.now = [50.0]
        self.ixs: list = []
        self.extra = False  # speculative or held entries were added (reads then leave dp_ranks alone)

    @initialize(capacity=st.sampled_from([20, 60, 100_000]))
    def build(self, capacity):
        clock = lambda: self.now[0]  # noqa: E731
        self.ixs = [KVBlockIndex(self.TP, capacity=capacity, clock=clock),
                    NativeKVBlockIndex(self.TP, capacity=capacity, clock=clock)]

    def both(self, name, *args, **kw):
        return same_on_both(self.ixs, name, *args, **kw)

    @rule(first=st.integers(0, N_PODS - 1), count=st.integers(1, N_PODS), step=st.sampled_from([1, 1, 3]),
          rank=st.sampled_from([0, 0, *RANKS]), tier=st.sampled_from(TIERS), model=st.sampled_from([None, *MODELS]),
          path=st.integers(0, 2), start=st.just(0) | st.integers(0, N_BLOCKS - 1), n=st.integers(1, N_BLOCKS))
    def group_store(self, first, count, step, rank, tier, model, path, start, n):
        """Pods first, first+step, ... each store blocks [start, start+n) of one path (parent: the
        block before, which makes an orphan where the pod does not hold it).  Over a prefix the pods
        stored in another tier or rank, this changes the holders' attributes (not their pods) from
        one block to the next."""
        j = min(N_BLOCKS, start + n)
        parent = None if start == 0 else self.EKS[path][start - 1]
        toks = list(PATHS[path][start * BS: j * BS])
        for k in range(count):
            pod = PODS[(first + k * step) % N_PODS]
            self.both("block_stored", pod, rank, self.EKS[path][start:j], parent, toks, tier, block_size=BS, model=model)

    @rule(first=st.integers(0, N_PODS - 1), count=st.integers(1, 8), rank=st.sampled_from(RANKS),
          tier=st.sampled_from(TIERS), model=st.sampled_from(MODELS), path=st.integers(0, 2),
          i=st.integers(0, N_BLOCKS - 1))
    def remove_middle(self, first, count, rank, tier, model, path, i):
        for k in range(count):
            self.both("block_removed", PODS[(first + k) % N_PODS], rank, [self.EKS[path][i]], tier, model=model)

    @rule(first=st.integers(0, N_PODS - 1), count=st.integers(1, N_PODS), rank=st.none() | st.sampled_from(RANKS),
          model=st.sampled_from(["all", *MODELS]))
    def clear_group(self, first, count, rank, model):
        """Pods leave (their slots go back to be reused by the next new pods)."""
        for k in range(count):
            pod = PODS[(first + k) % N_PODS]
            if model == "all":
                self.both("clear", pod, rank)
            else:
                self.both("clear", pod, rank, model=model)

    @rule(pod=st.sampled_from(PODS[:6]), path=st.integers(0, 2), n=st.integers(1, N_BLOCKS),
          ttl=st.sampled_from([1.0, 5.0]))
    def speculative(self, pod, path, n, ttl):
        self.extra = True
        keys = [int(k) for k in self.TP.request_keys(list(PATHS[path][: n * BS]))]
        self.both("add_speculative", keys, pod, ttl)

    @precondition(lambda self: self.extra)
    @rule(dt=st.sampled_from([2.0, 10.0]))
    def tick(self, dt):
        self.now[0] += dt

    @rule(path=st.integers(0, 2), upto=st.integers(0, N_BLOCKS), tail=st.integers(0, BS - 1),
          model=st.sampled_from([None, *MODELS]),
          pods=st.none() | st.lists(st.sampled_from(PODS[:12] + ["zz", ""]), max_size=10)
          | st.builds(lambda a, b: PODS[a:b] + PODS[a:b], st.integers(0, N_PODS), st.integers(0, N_PODS)),
          as_array=st.booleans())
    def read(self, path, upto, tail, model, pods, as_array):
        """prefix_summary and match_tokens (with dp_ranks) against the reference's prefix match,
        summarised; the prompt may be empty or end mid-block; candidates may repeat or be unknown."""
        ref, nat = self.ixs
        toks = list(PATHS[path][: upto * BS + tail])
        keys = [int(k) for k in self.TP.request_keys(toks, model=model)]
        want = _summarise(ref.prefix_match(keys, pods), WEIGHTS)
        karg = np.array(keys, dtype=np.uint64) if as_array else keys
        assert nat.prefix_summary(karg, pods, WEIGHTS) == want
        ranks: dict = {}
        targ = np.array(toks, dtype=np.uint64) if as_array else toks
        got_keys, got = nat.match_tokens(targ, pods, WEIGHTS, model=model, dp_ranks=ranks)
        assert got_keys.tolist() == keys
        assert got == want, (got, want)
        if not self.extra and not self.TP.engine_compatible:  # (compat mode's keys come from Python: no ranks)
            assert ranks == _exact_ranks(ref, keys, got)
        else:
            assert set(ranks) <= set(got)
        for pod, rank in ranks.items():
            assert rank == ref.best_dp_rank(pod, keys[: got[pod][0]])

    @invariant()
    def same_sizes_and_full_reads(self):
        """After every step: sizes, and the summary of each whole path for both models and all pods
        (prefix_summary does not refresh recency differently from the reference's prefix_match)."""
        if not self.ixs:
            return
        ref, nat = self.ixs
        self.both("pods")
        self.both("__len__")
        nat.check()
        for path in range(len(PATHS)):
            for model in MODELS:
                keys = [int(k) for k in self.TP.request_keys(list(PATHS[path]), model=model)]
                assert nat.prefix_summary(keys, None, WEIGHTS) == _summarise(ref.prefix_match(keys, None), WEIGHTS)


TestManyPodRuns = ManyPodRuns.TestCase
TestManyPodRuns.settings = settings(max_examples=80, stateful_step_count=25, deadline=None,
                                    suppress_health_check=[HealthCheck.too_slow])


_COMPAT_TP = TokenProcessor(block_size=BS, algorithm="vllm_sha256_cbor")


class CompatManyPodRuns(ManyPodRuns):
    """The same in engine-compatible key mode (request keys are the engine's block hashes)."""

    TP = _COMPAT_TP
    EKS = [[int(k) for k in _COMPAT_TP.request_keys(list(p))] for p in PATHS]  # request keys are engine keys


TestCompatManyPodRuns = CompatManyPodRuns.TestCase
TestCompatManyPodRuns.settings = settings(max_examples=20, stateful_step_count=25, deadline=None,
                                          suppress_health_check=[HealthCheck.too_slow])


# -- 2. the ttft picker's compiled pass against its Python loop, outside the plain domain


class F(float):
    """A float subclass (the compiled pass must leave it to the Python loop)."""


class I(int):  # noqa: E742 - a short name for an int subclass
    """An int subclass."""


class S(str):
    """A str subclass pod id."""


class D(dict):
    """A dict subclass of prefix scores or loads."""


_LOADS = st.sampled_from([0.0, -0.0, 0.5, 1.0, 3.0, 1e300, 2.0**53, math.inf, math.nan, -1.0])
_NUM = st.one_of(
    _LOADS,
    st.integers(-2, 10),
    st.sampled_from([2**53, 2**63, -(2**53)]),
    st.builds(F, _LOADS),
    st.builds(I, st.integers(0, 5)),
    st.floats(0.0, 1.0),
)
_POD = st.sampled_from(["a", "b", "c", "d", "e"]) | st.builds(S, st.sampled_from(["a", "b", "f"]))


@st.composite
def odd_picks(draw):
    # many pods with equal inputs: exact ties in cost and queue, ranked by pod id
    tie_pods = draw(st.integers(0, 40))
    cands = draw(st.lists(_POD, min_size=1, max_size=8)) + [f"t{k:02d}" for k in range(tie_pods)]
    cands = draw(st.permutations(cands))
    if draw(st.booleans()):
        cands = cands + cands[: draw(st.integers(0, len(cands)))]  # duplicates
    plain = draw(st.booleans())
    num = (st.sampled_from([0.0, -0.0, 0.25, 0.5, 1.0])) if plain else _NUM
    prefix: dict = D() if draw(st.booleans()) and not plain else {}
    loads: dict = D() if draw(st.booleans()) and not plain else {}
    for p in draw(st.lists(_POD, max_size=6)) + [f"t{k:02d}" for k in range(0, tie_pods, 2)]:
        mb = draw(st.integers(0, 50) | (st.just(0) if plain else _NUM))
        mt = draw(st.sampled_from([4 * mb if isinstance(mb, int) else 0, 0, 3]) | (st.just(0) if plain else _NUM))
        prefix[p] = PrefixScore(pod=p, matched_blocks=mb, matched_tokens=mt, weighted_blocks=draw(num),
                                coverage=draw(num))
    for p in draw(st.lists(_POD, max_size=6)) + [f"t{k:02d}" for k in range(0, tie_pods, 3)]:
        loads[p] = LoadSnapshot(waiting=draw(num), kv_usage=draw(num),
                                in_flight=draw(st.integers(0, 3) if plain else _NUM),
                                prefill_tokens=draw(st.none() | num))
    prompt = draw(st.none() | st.integers(0, 300) | st.sampled_from([2**53 - 1, 2**53, 2**53 + 1, 2**63 - 1, 2**63,
                                                                      2**64, 10**30]) | st.builds(I, st.integers(0, 99)))
    picker = TTFTPicker(kv_pressure=draw(st.sampled_from([0.0, 10.0])), tie_tokens=draw(st.sampled_from([0.0, 5.0])))
    return picker, prefix, loads, cands, prompt


def _outcome(fn):
    try:
        c = fn()
    except Exception as e:  # noqa: BLE001 - compared by type
        return ("err", type(e))
    return ("ok", c.pod, repr(c.score), [repr(r) for r in c.rows])


@settings(max_examples=250, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(odd_picks())
def test_ttft_pick_equals_the_python_loop_on_odd_inputs(case):
    """pick() (compiled pass, or the loop where it declines) answers or raises as the Python loop."""
    picker, prefix, loads, cands, prompt = case

    def ref():
        pods = _unique_candidates(cands)
        return picker._pick_py(pods, _prompt_tokens(prompt, prefix, pods), prefix, loads)

    assert _outcome(lambda: picker.pick(prefix, loads, cands, prompt_tokens=prompt)) == _outcome(ref)


@pytest.mark.parametrize("n", [2**53 - 1, 2**53, 2**63 - 1, 2**63, 2**64, 10**30])
def test_ttft_rows_decline_prompts_it_cannot_hold_exactly(n):
    """A prompt length past 2**53 (past 2**63 too) is the Python loop's, not a TypeError."""
    picker = TTFTPicker()
    prefix = {"a": PrefixScore(pod="a", matched_blocks=1, matched_tokens=16, weighted_blocks=1.0, coverage=0.5)}
    loads = {"a": LoadSnapshot(waiting=1.0)}
    want = picker._pick_py(["a", "b"], n, prefix, loads)
    got = picker.pick(prefix, loads, ["a", "b"], prompt_tokens=n)
    assert [repr(r) for r in got.rows] == [repr(r) for r in want.rows]
    assert _native.ttft_rows(prefix, loads, ["a", "b"], n, 10.0, 0.0, 16.0, 0.0, PodInputs) is None or n < 2**53
    # an estimated prompt length past 2**63 (prompt_tokens=None): the same
    big = {"a": PrefixScore(pod="a", matched_blocks=1, matched_tokens=16, weighted_blocks=1e20, coverage=1.0)}
    assert _outcome(lambda: picker.pick(big, loads, ["a"])) == _outcome(
        lambda: picker._pick_py(["a"], _prompt_tokens(None, big, ["a"]), big, loads))


class _DropsItself:
    """Prefix-score-like: reading ``coverage`` removes it from the dict that held its only reference."""

    def __init__(self, home: dict, key: str) -> None:
        self.home, self.key = home, key
        self.matched_blocks, self.matched_tokens, self.weighted_blocks = 1, 16, 1.0

    @property
    def coverage(self) -> float:
        home, self.home = self.home, None
        if home is not None:
            del home[self.key]
        gc.collect()
        return 0.5


class _LoadDropsItself:
    def __init__(self, home: dict, key: str) -> None:
        self.home, self.key = home, key
        self.in_flight, self.kv_usage, self.prefill_tokens = 1, 0.25, None

    @property
    def waiting(self) -> float:
        home, self.home = self.home, None
        if home is not None:
            del home[self.key]
        gc.collect()
        return 2.0


def test_ttft_pick_survives_getters_that_drop_their_object():
    """The compiled pass owns the values it reads fields of (a getter may drop the dict's reference)."""
    picker = TTFTPicker()
    for _ in range(20):
        prefix: dict = {}
        loads: dict = {}
        prefix["a"] = _DropsItself(prefix, "a")
        loads["a"] = _LoadDropsItself(loads, "a")
        c = picker.pick(prefix, loads, ["a", "b"], prompt_tokens=64)
        [bytearray(64) for _ in range(200)]  # reuse the freed memory
        prefix2: dict = {"a": PrefixScore(pod="a", matched_blocks=1, matched_tokens=16, weighted_blocks=1.0,
                                          coverage=0.5)}
        loads2: dict = {"a": LoadSnapshot(waiting=2.0, in_flight=1, kv_usage=0.25)}
        want = picker._pick_py(["a", "b"], 64, prefix2, loads2)
        assert [repr(r) for r in c.rows] == [repr(r) for r in want.rows]


def test_ttft_rows_do_not_leak():
    """Answered and declined compiled passes leave no Python objects behind."""
    picker = TTFTPicker(tie_tokens=1.0)
    pods = [f"p{k}" for k in range(16)]
    prefix = {p: PrefixScore(pod=p, matched_blocks=k, matched_tokens=16 * k, weighted_blocks=float(k),
                             coverage=k / 16) for k, p in enumerate(pods)}
    loads = {p: LoadSnapshot(waiting=float(k % 3), in_flight=k % 2, kv_usage=0.5) for k, p in enumerate(pods)}
    odd = dict(loads)
    odd["p15"] = LoadSnapshot(waiting=F(1.0))  # declined at the last pod, after 15 rows were built

    def run(n):
        for _ in range(n):
            picker.pick(prefix, loads, pods, prompt_tokens=512)
            picker.pick(prefix, odd, pods, prompt_tokens=512)
            _native.ttft_rows(prefix, odd, pods, 2**64, 10.0, 0.0, 16.0, 0.0, PodInputs)

    run(200)
    gc.collect()
    tracemalloc.start()
    try:
        run(50)
        gc.collect()
        before = tracemalloc.get_traced_memory()[0]
        run(2000)
        gc.collect()
        after = tracemalloc.get_traced_memory()[0]
    finally:
        tracemalloc.stop()
    # a leaked row per pick would be 2000 x ~200 bytes; allow allocator noise only
    assert after - before < 20_000, after - before


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    fill=st.sampled_from([0, 3, 70]),
    base=st.lists(st.tuples(st.sampled_from(TIERS), st.sampled_from([0, 0, 1]), st.integers(1, N_BLOCKS)),
                  min_size=1, max_size=4),
    overlays=st.lists(st.tuples(st.integers(0, 3), st.sampled_from(["gpu", "cpu", "storage"]),
                                st.sampled_from([0, 0, 1]), st.integers(0, N_BLOCKS - 1), st.integers(1, 8),
                                st.booleans()),
                      max_size=6),
    pods=st.none() | st.lists(st.sampled_from(["q0", "q1", "q2", "q3", "p00", "zz"]), min_size=1, max_size=6),
)
def test_runs_whose_holders_keep_their_pods_but_change_attributes(fill, base, overlays, pods):
    """Blocks whose holders are the same pods in the same order but whose tier masks or DP ranks
    differ from the previous block's (a sub-range stored again in another tier, or removed from
    one tier; another rank's copy), among ``fill`` pods holding the whole path: the compiled
    summary and dp_ranks equal the reference's."""
    tp = ManyPodRuns.TP
    path, eks = PATHS[0], EKS[0]
    ref, nat = KVBlockIndex(tp), NativeKVBlockIndex(tp)
    toks = list(path)

    def both(name, *args, **kw):
        for x in (ref, nat):
            getattr(x, name)(*args, **kw)

    for k in range(fill):
        both("block_stored", PODS[k], 0, eks, None, toks, "gpu", block_size=BS)
    for q, (tier, rank, n) in enumerate(base):
        both("block_stored", f"q{q}", rank, eks[:n], None, toks[: n * BS], tier, block_size=BS)
    for q, tier, rank, a, n, remove in overlays:
        b = min(N_BLOCKS, a + n)
        if remove:
            both("block_removed", f"q{q}", rank, eks[a:b], tier)
        else:
            both("block_stored", f"q{q}", rank, eks[a:b], None if a == 0 else eks[a - 1], toks[a * BS: b * BS],
                 tier, block_size=BS)
    keys = [int(k) for k in tp.request_keys(toks)]
    want = _summarise(ref.prefix_match(keys, pods), WEIGHTS)
    assert nat.prefix_summary(keys, pods, WEIGHTS) == want
    ranks: dict = {}
    _, got = nat.match_tokens(toks, pods, WEIGHTS, dp_ranks=ranks)
    assert got == want
    assert ranks == _exact_ranks(ref, keys, got)


@pytest.mark.parametrize("attr", ["kv_pressure", "kv_stall", "tie_tokens"])
@pytest.mark.parametrize("value", [math.inf, math.nan, -1.0, -0.0])
def test_ttft_pick_with_parameters_changed_after_construction(attr, value):
    """Parameters set past the constructor's checks: pick() still ranks as the Python loop (the
    compiled pass declines what it cannot order the same way, e.g. NaN costs)."""
    picker = TTFTPicker(tie_tokens=1.0)
    setattr(picker, attr, value)
    pods = [f"p{k:03d}" for k in range(100)]
    loads = {q: LoadSnapshot(waiting=float(k % 7), kv_usage=0.0 if k % 2 else 0.5) for k, q in enumerate(pods)}
    for n in (0, 100, 1000):
        assert _outcome(lambda: picker.pick({}, loads, pods, prompt_tokens=n)) == _outcome(
            lambda: picker._pick_py(pods, n, {}, loads))
