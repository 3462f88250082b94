"""Pickers: the weighted picker against a brute-force oracle, the baselines, and explanations."""

from __future__ import annotations

import math
from collections import Counter

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from scorer.load import LoadSnapshot
from scorer.picker import Choice, LoadPicker, PickerWeights, RandomPicker, TTFTPicker, WeightedPicker
from scorer.prefix import PrefixScore

PODS = ["pod-a", "pod-b", "pod-c", "pod-d", "pod-e", "pod-f"]


def oracle_pick(weights, prefix, loads, candidates, use_prefix=True):
    """Plain recomputation of every total and the winner, straight from the rules."""
    pods = list(dict.fromkeys(candidates))
    cov, kv, qlen = {}, {}, {}
    for p in pods:
        cov[p] = min(1.0, max(0.0, prefix[p].coverage)) if p in prefix else 0.0
        ld = loads.get(p, LoadSnapshot())
        kv[p] = 1.0 - min(1.0, max(0.0, ld.kv_usage))
        qlen[p] = ld.waiting + ld.in_flight
    lo, hi = min(qlen.values()), max(qlen.values())
    queue = {p: 1.0 if hi == lo else (hi - qlen[p]) / (hi - lo) for p in pods}
    total = {p: weights.prefix * cov[p] + weights.kv_usage * kv[p] + weights.queue * queue[p] for p in pods}
    best = None
    for p in pods:  # brute-force argmax with the documented tie-break
        if best is None:
            best = p
            continue
        a, b = (total[p], cov[p] if use_prefix else 0, -qlen[p]), (total[best], cov[best] if use_prefix else 0, -qlen[best])
        if a > b or (a == b and p < best):
            best = p
    return best, total, cov, kv, queue


coverages = st.sampled_from([0.0, 0.125, 0.25, 0.5, 1.0]) | st.floats(0.0, 1.0)
usages = st.sampled_from([0.0, 0.5, 1.0]) | st.floats(0.0, 1.0)
counts = st.sampled_from([0.0, 1.0, 2.0]) | st.floats(0.0, 500.0, allow_subnormal=False)


@st.composite
def pick_cases(draw):
    candidates = draw(st.lists(st.sampled_from(PODS), min_size=1, max_size=8))
    prefix = {
        p: PrefixScore(pod=p, matched_blocks=1, matched_tokens=16, weighted_blocks=1.0, coverage=draw(coverages))
        for p in draw(st.lists(st.sampled_from(PODS), max_size=6, unique=True))
    }
    loads = {
        p: LoadSnapshot(waiting=draw(counts), kv_usage=draw(usages), in_flight=draw(st.integers(0, 5)))
        for p in draw(st.lists(st.sampled_from(PODS), max_size=6, unique=True))
    }
    weights = draw(
        st.just(PickerWeights())
        | st.builds(
            PickerWeights,
            prefix=st.sampled_from([0.0, 1.0, 3.0]),
            kv_usage=st.sampled_from([0.0, 1.0, 2.0]),
            queue=st.sampled_from([0.0, 2.0, 5.0]),
        )
    )
    return weights, prefix, loads, candidates


@settings(max_examples=200, deadline=None)
@given(pick_cases())
def test_weighted_picker_matches_oracle(case):
    weights, prefix, loads, candidates = case
    choice = WeightedPicker(weights).pick(prefix, loads, candidates)
    best, total, cov, kv, queue = oracle_pick(weights, prefix, loads, candidates)
    assert choice.pod == best
    assert choice.score == pytest.approx(total[best])
    assert set(choice.explanation) == set(candidates)
    assert next(iter(choice.explanation)) == best
    for p, e in choice.explanation.items():
        assert e.total == pytest.approx(total[p])
        assert (e.prefix, e.kv_usage) == (pytest.approx(cov[p]), pytest.approx(kv[p]))
        assert e.queue == pytest.approx(queue[p])
        assert 0.0 <= e.queue <= 1.0 and 0.0 <= e.kv_usage <= 1.0
        assert e.load_known == (p in loads)
    # the choice does not depend on candidate order
    again = WeightedPicker(weights).pick(prefix, loads, list(reversed(candidates)))
    assert again.pod == choice.pod


@settings(max_examples=150, deadline=None)
@given(pick_cases())
def test_load_picker_matches_oracle_and_ignores_prefix(case):
    _, prefix, loads, candidates = case
    choice = LoadPicker().pick(prefix, loads, candidates)
    best, total, *_ = oracle_pick(PickerWeights(prefix=0.0), prefix, loads, candidates, use_prefix=False)
    assert choice.pod == best
    assert choice.score == pytest.approx(total[best])
    assert LoadPicker().pick({}, loads, candidates).pod == choice.pod


def test_default_weights_are_the_benchmarks():
    assert PickerWeights() == PickerWeights(prefix=3.0, kv_usage=2.0, queue=2.0)
    for bad in (-1.0, math.inf, math.nan):
        with pytest.raises(ValueError):
            PickerWeights(prefix=bad)


def test_worked_example():
    prefix = {
        "a": PrefixScore(pod="a", matched_blocks=6, matched_tokens=96, weighted_blocks=6.0, coverage=0.75),
        "b": PrefixScore(pod="b", matched_blocks=2, matched_tokens=32, weighted_blocks=2.0, coverage=0.25),
    }
    loads = {
        "a": LoadSnapshot(waiting=6, in_flight=2, kv_usage=0.9),
        "b": LoadSnapshot(waiting=0, in_flight=0, kv_usage=0.2),
        "c": LoadSnapshot(waiting=2, in_flight=0, kv_usage=0.0),
    }
    c = WeightedPicker().pick(prefix, loads, ["a", "b", "c"])
    # a: 3*.75 + 2*.1 + 2*0 = 2.45 ; b: 3*.25 + 2*.8 + 2*1 = 4.35 ; c: 0 + 2*1 + 2*.75 = 3.5
    assert c.pod == "b" and c.score == pytest.approx(4.35)
    assert list(c.explanation) == ["b", "c", "a"]
    e = c.explanation
    assert (e["a"].total, e["c"].total) == (pytest.approx(2.45), pytest.approx(3.5))
    assert (e["a"].matched_tokens, e["a"].waiting, e["a"].in_flight, e["a"].kv_cache_usage) == (96, 6, 2, 0.9)
    assert e["c"].queue == pytest.approx(0.75)
    assert e["b"].reason.startswith("highest total")
    assert "queue" in e["a"].reason  # a lost mostly on its queue
    assert c.dp_rank is None and c.picker == "weighted"
    # with prefix dominating, the long prefix wins
    assert WeightedPicker(PickerWeights(prefix=10.0)).pick(prefix, loads, ["a", "b", "c"]).pod == "a"


def test_tie_break_order():
    idle = {p: LoadSnapshot() for p in "xyz"}
    # equal totals: higher prefix first... (prefix weight 0 so the prefix only breaks ties)
    pre = {"y": PrefixScore(pod="y", matched_blocks=1, matched_tokens=16, weighted_blocks=1, coverage=0.5)}
    c = WeightedPicker(PickerWeights(prefix=0.0)).pick(pre, idle, ["z", "y", "x"])
    assert c.pod == "y" and c.explanation["y"].reason == "tie on total; higher prefix"
    # ...then the shorter raw queue (queue weight 0 so the queue only breaks ties)
    loads = {"x": LoadSnapshot(waiting=3), "y": LoadSnapshot(waiting=1), "z": LoadSnapshot(waiting=2)}
    c = WeightedPicker(PickerWeights(queue=0.0)).pick({}, loads, ["x", "z", "y"])
    assert c.pod == "y" and c.explanation["y"].reason == "tie on total; shorter queue"
    # ...then the pod id
    c = WeightedPicker().pick({}, idle, ["z", "y", "x"])
    assert c.pod == "x" and c.explanation["x"].reason == "tie on total; first pod id"
    assert list(c.explanation) == ["x", "y", "z"]


def test_missing_load_counts_as_idle_and_all_equal_queue_is_one():
    c = WeightedPicker().pick({}, {"b": LoadSnapshot(waiting=1, kv_usage=0.5)}, ["a", "b"])
    assert c.pod == "a" and not c.explanation["a"].load_known
    same = WeightedPicker().pick({}, {p: LoadSnapshot(waiting=4, in_flight=1) for p in "ab"}, ["a", "b"])
    assert [e.queue for e in same.explanation.values()] == [1.0, 1.0]


def test_garbage_load_values_are_tamed():
    loads = {
        "a": LoadSnapshot(waiting=math.nan, kv_usage=math.nan),
        "b": LoadSnapshot(waiting=math.inf, kv_usage=7.0),
        "c": LoadSnapshot(waiting=-5.0, kv_usage=-1.0),
    }
    c = WeightedPicker().pick({}, loads, ["a", "b", "c"])
    for e in c.explanation.values():
        assert math.isfinite(e.total) and 0.0 <= e.kv_usage <= 1.0 and 0.0 <= e.queue <= 1.0
    assert c.explanation["b"].kv_usage == 0.0


@pytest.mark.parametrize("picker", [WeightedPicker(), LoadPicker(), RandomPicker(seed=1)])
def test_misuse(picker):
    with pytest.raises(ValueError):
        picker.pick({}, {}, [])
    with pytest.raises(TypeError):
        picker.pick({}, {}, "pod-a")
    one = picker.pick({}, {}, ["solo", "solo"])
    assert one.pod == "solo" and list(one.explanation) == ["solo"]


def test_random_picker_is_seeded_order_free_and_covers_all():
    cands = ["p1", "p2", "p3", "p4"]
    a = [RandomPicker(seed=7).pick({}, {}, cands).pod for _ in range(3)]
    r1, r2 = RandomPicker(seed=7), RandomPicker(seed=7)
    seq1 = [r1.pick({}, {}, cands).pod for _ in range(200)]
    seq2 = [r2.pick({}, {}, list(reversed(cands))).pod for _ in range(200)]
    assert seq1 == seq2
    assert a == [seq1[0]] * 3
    assert set(Counter(seq1)) == set(cands)
    c = RandomPicker(seed=3).pick({}, {}, cands)
    assert c.picker == "random" and c.score == 1.0
    assert c.explanation[c.pod].total == 1.0
    assert sum(e.total for e in c.explanation.values()) == 1.0


def test_explain_table_and_roundtrip():
    prefix = {"a": PrefixScore(pod="a", matched_blocks=2, matched_tokens=64, weighted_blocks=2.0, coverage=0.5)}
    c = WeightedPicker().pick(prefix, {"b": LoadSnapshot(waiting=3, kv_usage=0.25)}, ["a", "b"])
    text = c.explain()
    lines = text.splitlines()
    assert lines[0] == "picker=weighted chosen=a score=5.500  (total = 3 x prefix + 2 x kv + 2 x queue; the three columns are unweighted, 0..1)"
    assert lines[1].split()[:4] == ["pod", "total", "prefix", "kv"]
    assert lines[2].startswith("*  a") and "64" in lines[2]
    assert lines[3].split()[0] == "b" and "0.25" in lines[3]
    # the choice is a plain msgspec struct: JSON round trip
    assert msgspec.json.decode(msgspec.json.encode(c), type=Choice) == c


# -- TTFTPicker: cost = queued + uncached x (1 + kv_pressure x usage) + kv_stall x overflow


def oracle_ttft(prefix, loads, candidates, prompt, kv_pressure, kv_stall=100.0, reserve=16.0):
    """Plain recomputation of every cost and the winner (lowest cost, then shorter queue, then pod id)."""
    pods = list(dict.fromkeys(candidates))
    cost = {}
    for p in pods:
        ps = prefix.get(p)
        cached = 0.0
        if ps is not None and ps.matched_blocks > 0:
            cached = min(max(ps.weighted_blocks, 0.0) * ps.matched_tokens / ps.matched_blocks, max(0, prompt - 1))
        ld = loads.get(p, LoadSnapshot())
        use = min(1.0, max(0.0, ld.kv_usage))
        queued = ld.prefill_tokens if ld.prefill_tokens is not None else ld.waiting * prompt
        uncached = max(0.0, prompt - cached)
        overflow = 0.0
        if ld.kv_capacity_tokens is not None:
            growth = ld.running * reserve
            overflow = max(0.0, queued + uncached + growth - (1 - use) * ld.kv_capacity_tokens)
        cost[p] = queued + uncached * (1 + kv_pressure * use) + kv_stall * overflow
    best = min(pods, key=lambda p: (cost[p], loads.get(p, LoadSnapshot()).waiting + loads.get(p, LoadSnapshot()).in_flight, p))
    return best, cost


@st.composite
def ttft_cases(draw):
    candidates = draw(st.lists(st.sampled_from(PODS), min_size=1, max_size=8))
    prompt = draw(st.integers(0, 4000))
    prefix = {}
    for p in draw(st.lists(st.sampled_from(PODS), max_size=6, unique=True)):
        blocks = draw(st.integers(1, 64))
        w = draw(st.sampled_from([1.0, 0.8, 0.5]))
        prefix[p] = PrefixScore(pod=p, matched_blocks=blocks, matched_tokens=16 * blocks,
                                weighted_blocks=w * blocks, coverage=min(1.0, 16 * w * blocks / max(1, prompt)))
    loads = {
        p: LoadSnapshot(waiting=draw(st.integers(0, 20)), kv_usage=draw(usages), in_flight=draw(st.integers(0, 5)),
                        running=draw(st.integers(0, 300)),
                        prefill_tokens=draw(st.none() | st.floats(0.0, 50_000.0, allow_subnormal=False)),
                        kv_capacity_tokens=draw(st.none() | st.sampled_from([0.0, 4096.0, 65_536.0])))
        for p in draw(st.lists(st.sampled_from(PODS), max_size=6, unique=True))
    }
    return (prefix, loads, candidates, prompt, draw(st.sampled_from([0.0, 1.0, 10.0])),
            draw(st.sampled_from([0.0, 100.0])), draw(st.sampled_from([0.0, 16.0])))


@settings(max_examples=200, deadline=None)
@given(ttft_cases())
def test_ttft_picker_matches_oracle(case):
    prefix, loads, candidates, prompt, kvp, stall, reserve = case
    c = TTFTPicker(kv_pressure=kvp, kv_stall=stall, decode_reserve=reserve).pick(
        prefix, loads, candidates, prompt_tokens=prompt)
    best, cost = oracle_ttft(prefix, loads, candidates, prompt, kvp, stall, reserve)
    assert c.pod == best
    assert c.score == pytest.approx(-cost[best])
    assert set(c.explanation) == set(candidates) and next(iter(c.explanation)) == best
    for p, e in c.explanation.items():
        assert e.cost == pytest.approx(cost[p]) and e.total == pytest.approx(-cost[p])
        assert 0 <= e.uncached_tokens <= prompt
    assert TTFTPicker(kv_pressure=kvp, kv_stall=stall, decode_reserve=reserve).pick(
        prefix, loads, list(reversed(candidates)), prompt_tokens=prompt).pod == c.pod


def test_ttft_picker_kv_overflow():
    """A pod whose free KV cannot hold the queued prefill plus this request's uncached tokens
    (plus the running requests' growth) loses to one where it fits, even with a longer
    prefix; without capacity the term is off."""
    prefix = {"a": PrefixScore(pod="a", matched_blocks=250, matched_tokens=4000, weighted_blocks=250.0, coverage=0.8)}
    loads = {"a": LoadSnapshot(prefill_tokens=2000.0, kv_usage=0.95, kv_capacity_tokens=40_000.0),
             "b": LoadSnapshot(prefill_tokens=0.0, kv_usage=0.5, kv_capacity_tokens=40_000.0)}
    p = TTFTPicker(kv_pressure=1.0, kv_stall=100.0, decode_reserve=16.0)
    c = p.pick(prefix, loads, ["a", "b"], prompt_tokens=5000)
    # a: 2000 + 1000 x 1.95 + 100 x (2000 + 1000 - 2000) = 103,950 ; b: 5000 x 1.5 = 7,500 (20,000 free)
    assert c.pod == "b" and c.explanation["a"].cost == pytest.approx(103_950.0)
    assert "kv overflow" in c.explanation["a"].reason and "kv_stall x overflow" in c.explain().splitlines()[0]
    assert TTFTPicker(kv_pressure=1.0, kv_stall=0.0).pick(prefix, loads, ["a", "b"], prompt_tokens=5000).pod == "a"
    unknown = {k: msgspec.structs.replace(v, kv_capacity_tokens=None) for k, v in loads.items()}
    assert p.pick(prefix, unknown, ["a", "b"], prompt_tokens=5000).pod == "a"
    with pytest.raises(ValueError):
        TTFTPicker(kv_stall=-1.0)
    with pytest.raises(ValueError):
        TTFTPicker(decode_reserve=math.nan)
    # a full hit fits in a's 2,000 free tokens, unless 200 running requests grow by 16 tokens each first
    full = {"a": PrefixScore(pod="a", matched_blocks=312, matched_tokens=4992, weighted_blocks=312.0, coverage=1.0)}
    quiet = {"a": LoadSnapshot(prefill_tokens=0.0, kv_usage=0.95, kv_capacity_tokens=40_000.0, running=10),
             "b": LoadSnapshot(prefill_tokens=0.0, kv_usage=0.5, kv_capacity_tokens=40_000.0, running=10)}
    assert p.pick(full, quiet, ["a", "b"], prompt_tokens=5000).pod == "a"
    busy = dict(quiet, a=msgspec.structs.replace(quiet["a"], running=200))
    assert p.pick(full, busy, ["a", "b"], prompt_tokens=5000).pod == "b"


def test_ttft_picker_worked_example_and_explain():
    # 2,000-token prompt; a holds 1,600 cached tokens but has 3,000 tokens of prefill queued.
    prefix = {"a": PrefixScore(pod="a", matched_blocks=100, matched_tokens=1600, weighted_blocks=100.0, coverage=0.8)}
    loads = {"a": LoadSnapshot(prefill_tokens=3000.0, kv_usage=0.5), "b": LoadSnapshot(prefill_tokens=0.0, kv_usage=0.0)}
    p = TTFTPicker(kv_pressure=1.0)
    c = p.pick(prefix, loads, ["a", "b"], prompt_tokens=2000)
    # a: 3000 + 400 x 1.5 = 3600 ; b: 0 + 2000 x 1 = 2000
    assert c.pod == "b" and c.score == -2000.0
    assert c.explanation["a"].cost == 3600.0 and c.explanation["a"].uncached_tokens == 400
    assert "queued prefill" in c.explanation["a"].reason
    lines = c.explain().splitlines()
    assert lines[0].startswith("picker=ttft chosen=b cost=2000 tokens")
    assert lines[2].startswith("*  b")
    # less queued work on a: the prefix wins
    loads["a"] = LoadSnapshot(prefill_tokens=500.0, kv_usage=0.5)
    assert p.pick(prefix, loads, ["a", "b"], prompt_tokens=2000).pod == "a"
    # the prompt length is estimated from the coverage when not given (1,600 / 0.8)
    assert p.pick(prefix, loads, ["a", "b"]).explanation["b"].uncached_tokens == 2000
    for bad in (-1.0, math.inf, math.nan):
        with pytest.raises(ValueError):
            TTFTPicker(kv_pressure=bad)
    with pytest.raises(ValueError):
        p.pick(prefix, loads, ["a"], prompt_tokens=-3)


@settings(max_examples=100, deadline=None)
@given(pick_cases())
def test_explanation_is_lazy_and_stable(case):
    """The explanation is built from the choice's rows on first read, then kept; it survives a round trip."""
    weights, prefix, loads, candidates = case
    for picker in (WeightedPicker(weights), LoadPicker(), RandomPicker(seed=1), TTFTPicker()):
        c = picker.pick(prefix, loads, candidates, prompt_tokens=64)
        assert "_explanation" not in c.__dict__  # nothing formatted by the pick itself
        assert [r.pod for r in c.rows] == list(dict.fromkeys(r.pod for r in c.rows))
        assert c.rows[0].pod == c.pod and c.rows[0].total == c.score
        e = c.explanation
        assert e is c.explanation  # kept
        assert list(e) == [r.pod for r in c.rows] and set(e) == set(candidates)
        back = msgspec.json.decode(msgspec.json.encode(c), type=Choice)
        assert back == c and back.explanation == e and back.explain() == c.explain()


# -- the compiled pass of TTFTPicker.pick against its Python loop (the reference)

_odd_floats = st.sampled_from([-0.0, -1.0, math.inf, -math.inf, math.nan, 1.5, 2.0**60]) | st.floats()
_fields = st.one_of(
    st.floats(0.0, 1.0),
    st.floats(0.0, 1e6, allow_subnormal=False),
    st.sampled_from([0.0, 0.5, 1.0, 2.5, 3.5]),
    st.integers(-3, 10),
    st.booleans(),
    _odd_floats,
)


def _plain_float(x):
    return st.floats(0.0, x, allow_subnormal=False) | st.sampled_from([0.0, 0.5, 1.0])


@st.composite
def ttft_native_cases(draw, plain: bool):
    """Picker inputs; ``plain`` draws only exact floats/ints in range (the compiled pass's domain),
    otherwise any of ints, bools, NaN, infinities, negatives and values past 2**53."""
    candidates = draw(st.lists(st.sampled_from(PODS), min_size=1, max_size=8, unique=True))
    prompt = draw(st.integers(0, 5000) | st.sampled_from([0, 1, 2, 16, 17]))
    prefix = {}
    for p in draw(st.lists(st.sampled_from(PODS), max_size=6, unique=True)):
        mb = draw(st.integers(0, 400))
        mt = draw(st.sampled_from([16 * mb, 16 * mb + 1, 0]))
        if plain:
            wb, cov = draw(_plain_float(1e4)), draw(st.floats(0.0, 1.0))
        else:
            wb, cov = draw(_fields), draw(_fields)
            mb = draw(st.just(mb) | st.sampled_from([2**60, -1, True]))
        prefix[p] = PrefixScore(pod=p, matched_blocks=mb, matched_tokens=mt, weighted_blocks=wb, coverage=cov)
    loads = {}
    for p in draw(st.lists(st.sampled_from(PODS), max_size=6, unique=True)):
        if plain:
            loads[p] = LoadSnapshot(waiting=draw(_plain_float(50.0)), kv_usage=draw(st.floats(0.0, 1.0)),
                                    in_flight=draw(st.integers(0, 9)),
                                    prefill_tokens=draw(st.none() | _plain_float(1e5)))
        else:
            loads[p] = LoadSnapshot(waiting=draw(_fields), kv_usage=draw(_fields), in_flight=draw(_fields),
                                    running=draw(_fields), prefill_tokens=draw(st.none() | _fields),
                                    kv_capacity_tokens=draw(st.none() | _fields))
    if draw(st.booleans()):  # explicit None values count as missing
        prefix[draw(st.sampled_from(PODS))] = None
        loads[draw(st.sampled_from(PODS))] = None
    picker = TTFTPicker(kv_pressure=draw(st.sampled_from([0.0, 1.0, 10.0, 0.3])),
                        kv_stall=0.0 if plain else draw(st.sampled_from([0.0, 100.0])),
                        tie_tokens=draw(st.sampled_from([0.0, 0.0, 1.0, 100.0, 1e9])))
    return picker, prefix, loads, candidates, prompt


def _exact(rows):
    """Every field with its type (repr tells int from float and -0.0 from 0.0)."""
    return [repr(r) for r in rows]


@settings(max_examples=300, deadline=None)
@given(ttft_native_cases(plain=True))
def test_ttft_native_rows_equal_the_python_loop(case):
    """On exact floats and ints in range the compiled pass answers (it never declines them) with
    the Python loop's rows, bit for bit and in the same order; the pick uses it."""
    from kvindex import _native
    from scorer.picker import PodInputs

    picker, prefix, loads, candidates, prompt = case
    ranked = _native.ttft_rows(prefix, loads, candidates, prompt, picker.kv_pressure, picker.kv_stall,
                               picker.decode_reserve, picker.tie_tokens, PodInputs)
    assert ranked is not None
    ref = picker._pick_py(candidates, prompt, prefix, loads)
    assert _exact(ranked) == _exact(ref.rows)
    c = picker.pick(prefix, loads, candidates, prompt_tokens=prompt)
    assert c == ref and _exact(c.rows) == _exact(ref.rows) and c.explain() == ref.explain()


@settings(max_examples=300, deadline=None)
@given(ttft_native_cases(plain=False))
def test_ttft_native_rows_decline_or_agree_on_odd_inputs(case):
    """Ints, bools, NaN, infinities, negatives, huge counts, kv_stall: the compiled pass either
    declines (None, the Python loop decides) or gives the Python loop's rows; pick() raises or
    answers exactly as the loop does."""
    from kvindex import _native
    from scorer.picker import PodInputs

    picker, prefix, loads, candidates, prompt = case
    try:
        ref = picker._pick_py(candidates, prompt, prefix, loads)
    except Exception as e:  # noqa: BLE001 - the same error must come out of pick()
        with pytest.raises(type(e)):
            picker.pick(prefix, loads, candidates, prompt_tokens=prompt)
        return
    ranked = _native.ttft_rows(prefix, loads, candidates, prompt, picker.kv_pressure, picker.kv_stall,
                               picker.decode_reserve, picker.tie_tokens, PodInputs)
    if ranked is not None:
        assert _exact(ranked) == _exact(ref.rows)
    assert _exact(picker.pick(prefix, loads, candidates, prompt_tokens=prompt).rows) == _exact(ref.rows)
