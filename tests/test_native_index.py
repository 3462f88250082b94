"""The compiled index (kvindex.native) against the pure-Python reference (kvindex.reference).

1. Every case of tests/test_index.py, and the pool's oracle state machines of
   tests/test_pool_stateful.py, run again with the compiled index.
2. A hypothesis state machine drives both implementations with the same steps
   (stores with known, unknown and no parents, token-less stores, removals,
   clears by pod and by rank, speculative entries and clock steps, router-held
   entries (add_held / remove_held), a small LRU
   capacity and orphan bound) and compares every read: prefix match (per pod
   and for all pods), lookup, best DP rank, level 2, pod keys, pods, models,
   sizes and counters.
3. Request keys computed by the compiled chain equal kvindex.keys' bit for bit.
"""

from __future__ import annotations

import random

import hypothesis.strategies as st
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule, run_state_machine_as_test

import tests.test_index as reference_cases
import tests.test_pool_stateful as pool_stateful
from kvindex.facade import Config, Indexer
from kvevents.events import AllBlocksCleared, BlockRemoved, BlockStored
from kvindex import _native, make_index
from kvindex.reference import KVBlockIndex
from kvindex.keys import TokenProcessor
from kvindex.native import NativeKVBlockIndex, _summarise
from kvindex.contract import KVIndex
from kvindex.tiers import tier_bit
from tests.oracle import Universe, same_on_both

# -- 1. the reference's own cases, on the compiled index

REFERENCE_CASES = sorted(n for n in dir(reference_cases) if n.startswith("test_"))


@pytest.mark.parametrize("name", REFERENCE_CASES)
def test_reference_case_on_native(name, monkeypatch):
    monkeypatch.setattr(reference_cases, "KVBlockIndex", NativeKVBlockIndex)
    getattr(reference_cases, name)()


@pytest.mark.parametrize("machine", ["PoolMachine", "SmallCapacityMachine"])
def test_pool_oracle_machines_on_native(machine, monkeypatch):
    monkeypatch.setattr(pool_stateful, "KVBlockIndex", NativeKVBlockIndex)
    run_state_machine_as_test(getattr(pool_stateful, machine), settings=pool_stateful.SETTINGS)


def test_both_satisfy_the_protocol_and_config_selects():
    tp = TokenProcessor(block_size=4)
    assert isinstance(KVBlockIndex(tp), KVIndex)
    assert isinstance(NativeKVBlockIndex(tp), KVIndex)
    assert type(make_index("native", tp)) is NativeKVBlockIndex
    assert type(make_index("python", tp)) is KVBlockIndex
    with pytest.raises(ValueError):
        make_index("rust", tp)
    with pytest.raises(ValueError):
        Config.from_dict({"kv_block_index_config": {"backend": "fast"}})
    for backend, cls in (("native", NativeKVBlockIndex), ("python", KVBlockIndex)):
        ix = Indexer(Config.from_dict({"kv_block_index_config": {"backend": backend}}))
        assert type(ix.index) is cls


# -- 2. the same steps on both implementations

BS = 4
PODS = ["a", "b", "c"]
RANKS = [0, 1]
TIERS = ["gpu", "cpu", "storage"]
MODELS = [None, "m"]


def make_universe() -> Universe:
    rnd = random.Random(99)
    base = [rnd.randrange(1000) for _ in range(3 * BS)]
    paths = []
    for p in range(5):
        shared = base[: (p % 3) * BS]
        tail = [rnd.randrange(1000) for _ in range(6 * BS - len(shared))]
        paths.append(tuple(shared + tail))
    return Universe(BS, paths, TokenProcessor(block_size=BS, hash_seed=11))


U = make_universe()
EVENT_KINDS = (BlockStored, BlockRemoved, AllBlocksCleared)


class SameSteps(RuleBasedStateMachine):
    """Reference and compiled index fed the same steps; every read compared."""

    TP = U.tp  # the key mode (a subclass runs the engine-compatible one)

    def __init__(self) -> None:
        super().__init__()
        self.now = [100.0]
        self.ixs: list = []

    @initialize(capacity=st.sampled_from([3, 8, 1_000]), orphans=st.sampled_from([0, 4, 100]))
    def build(self, capacity, orphans):
        clock = lambda: self.now[0]  # noqa: E731
        self.ixs = [
            KVBlockIndex(self.TP, capacity=capacity, max_orphan_blocks=orphans, clock=clock),
            NativeKVBlockIndex(self.TP, capacity=capacity, max_orphan_blocks=orphans, clock=clock),
        ]

    def keys(self, p: int) -> list[int]:
        """The request keys of path p (what the read path looks up)."""
        return U.request_keys(p)

    def both(self, name, *args, **kw):
        return same_on_both(self.ixs, name, *args, **kw)

    @rule(
        pod=st.sampled_from(PODS),
        rank=st.sampled_from(RANKS),
        path=st.integers(0, len(U.paths) - 1),
        span=st.tuples(st.integers(0, 5), st.integers(1, 3)),
        tier=st.sampled_from(TIERS),
        model=st.sampled_from(MODELS),
        parent_kind=st.sampled_from(["own", "own", "unknown", "none"]),
    )
    def store(self, pod, rank, path, span, tier, model, parent_kind):
        i, n = span
        j = min(i + n, U.n_blocks(path))
        if i >= j:
            return
        eks = [U.ek(path, k) for k in range(i, j)]
        if i == 0 or parent_kind == "none":
            parent = None
        elif parent_kind == "unknown":
            parent = U.ek(path, i - 1) ^ 0x5A5A  # never stored
        else:
            parent = U.ek(path, i - 1)
        self.both("block_stored", pod, rank, eks, parent, list(U.tokens(path, i, j)), tier, block_size=BS, model=model)

    @rule(pod=st.sampled_from(PODS), rank=st.sampled_from(RANKS), path=st.integers(0, len(U.paths) - 1),
          i=st.integers(0, 5), tier=st.sampled_from(TIERS), model=st.sampled_from(MODELS))
    def offload(self, pod, rank, path, i, tier, model):
        self.both("block_stored", pod, rank, [U.ek(path, i), U.ek(path, min(i + 1, 5))], None, None, tier,
                  model=model)

    @rule(pod=st.sampled_from(PODS), rank=st.sampled_from(RANKS), path=st.integers(0, len(U.paths) - 1),
          i=st.integers(0, 5), tier=st.sampled_from(TIERS), model=st.sampled_from(MODELS))
    def remove(self, pod, rank, path, i, tier, model):
        self.both("block_removed", pod, rank, [U.ek(path, i), 77], tier, model=model)

    @rule(pod=st.sampled_from(PODS + ["d"]), rank=st.none() | st.sampled_from(RANKS),
          model=st.sampled_from(["all", *MODELS, "other"]))
    def clear(self, pod, rank, model):
        if model == "all":
            self.both("clear", pod, rank)
        else:
            self.both("clear", pod, rank, model=model)

    @rule(pod=st.sampled_from(PODS), path=st.integers(0, len(U.paths) - 1), n=st.integers(1, 6),
          ttl=st.sampled_from([1.0, 5.0]))
    def speculative(self, pod, path, n, ttl):
        self.both("add_speculative", self.keys(path)[:n], pod, ttl)

    @rule(pod=st.sampled_from(PODS + ["d"]), path=st.integers(0, len(U.paths) - 1), n=st.integers(1, 6),
          tier=st.sampled_from(["decode_retained", "gpu"]), add=st.booleans())
    def held(self, pod, path, n, tier, add):
        self.both("add_held" if add else "remove_held", pod, self.keys(path)[:n], tier)

    @rule(pod=st.sampled_from(PODS), rank=st.sampled_from(RANKS), model=st.sampled_from(MODELS),
          steps=st.lists(st.tuples(
              st.sampled_from(["store", "store", "store", "orphan", "extra", "tokenless", "bad_size", "new_tier",
                               "remove", "clear"]),
              st.integers(0, len(U.paths) - 1), st.integers(0, 5), st.integers(1, 3),
              st.sampled_from(TIERS)), min_size=1, max_size=8))
    def batch(self, pod, rank, model, steps):
        """One decoded batch through apply_events: runs of plain events in one native call, the rest per event."""
        evs = []
        for kind, path, i, n, tier in steps:
            j = min(i + n, U.n_blocks(path))
            eks = tuple(U.ek(path, k) for k in range(i, j))
            toks = tuple(U.tokens(path, i, j))
            parent = None if i == 0 else U.ek(path, i - 1)
            if kind == "store":
                evs.append(BlockStored(eks, parent, toks, BS, tier))
            elif kind == "orphan":
                evs.append(BlockStored(eks, U.ek(path, i) ^ 0x5A5A, toks, BS, tier))
            elif kind == "extra":
                evs.append(BlockStored(eks, parent, toks, BS, tier, extra_keys=tuple(("x",) for _ in eks)))
            elif kind == "tokenless":
                evs.append(BlockStored(eks, None, (), BS, tier))
            elif kind == "bad_size":
                evs.append(BlockStored(eks, parent, toks[:-1], BS, tier))
            elif kind == "new_tier":
                evs.append(BlockStored(eks, parent, toks, BS, "nvme-test"))
            elif kind == "remove":
                evs.append(BlockRemoved(eks + (77,), tier))
            else:
                evs.append(AllBlocksCleared())
        res = self.both("apply_events", pod, rank, tuple(evs), model=model, kinds=EVENT_KINDS)
        if res[0] == "ok":
            # the per-tier block tallies a pool's counters take: a plain count over the events processed
            want: tuple[dict, dict] = ({}, {})
            for ev in evs[: len(evs) - res[1].left]:
                d = want[0] if type(ev) is BlockStored else want[1] if type(ev) is BlockRemoved else None
                if d is not None:
                    d[ev.tier] = d.get(ev.tier, 0) + len(ev.block_hashes)
            assert (res[1].stored_by_tier, res[1].removed_by_tier) == want

    @rule(dt=st.sampled_from([0.5, 2.0, 10.0]))
    def tick(self, dt):
        self.now[0] += dt

    @rule(path=st.integers(0, len(U.paths) - 1),
          pods=st.none() | st.lists(st.sampled_from(PODS + ["d", "zz"]), max_size=3),
          as_array=st.booleans())
    def match(self, path, pods, as_array):
        keys = self.keys(path)
        arg = np.array(keys, dtype=np.uint64) if as_array else keys
        self.both("prefix_match", arg, pods)

    @rule(path=st.integers(0, len(U.paths) - 1),
          pods=st.none() | st.lists(st.sampled_from(PODS + ["d", "zz"]), max_size=3),
          from_tokens=st.booleans())
    def summary(self, path, pods, from_tokens):
        """The read path's one-call forms (they refresh recency like prefix_match) against the
        reference's prefix_match, summarised."""
        ref, nat = self.ixs
        if not hasattr(nat, "match_tokens"):  # the machine also drives other backends (tests/test_redis_index.py)
            return
        from_tokens = from_tokens and not ref.token_processor.engine_compatible  # compat keys are U's engine keys
        weights = [1.0, 0.75, 0.5, 0.25]
        keys = self.keys(path)
        want = _summarise(ref.prefix_match(keys, pods), weights)
        if from_tokens:
            ranks: dict = {}
            got_keys, got = nat.match_tokens(list(U.paths[path]), pods, weights, model=U.model, dp_ranks=ranks)
            assert got_keys.tolist() == keys
            assert set(ranks) <= set(got)
            for pod, rank in ranks.items():  # the rank holding the whole match is best_dp_rank's answer
                assert rank == ref.best_dp_rank(pod, keys[: got[pod][0]]), (pod, ranks)
        else:
            got = nat.prefix_summary(keys, pods, weights)
        assert got == want

    @rule(path=st.integers(0, len(U.paths) - 1), pod=st.sampled_from(PODS))
    def dp_rank(self, path, pod):
        self.both("best_dp_rank", pod, self.keys(path))

    @invariant()
    def same_reads(self):
        if not self.ixs:
            return
        for p in range(len(U.paths)):
            keys = self.keys(p)
            self.both("lookup", keys)
            for i in range(len(keys)):
                self.both("request_key_of", U.ek(p, i))
                for model in (*MODELS, "other"):
                    self.both("request_key_of", U.ek(p, i), model)
        for pod in PODS:
            for rank in (None, *RANKS):
                self.both("pod_keys", pod, rank)
        self.both("pods")
        self.both("models")
        self.both("stats")
        self.both("__len__")
        self.ixs[1].check()


TestSameSteps = SameSteps.TestCase
TestSameSteps.settings = settings(
    max_examples=150, stateful_step_count=40, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)


class CompatSameSteps(SameSteps):
    """SameSteps in engine-compatible mode: request keys are engine keys, no level 2; the
    compiled index finds a stream's carried entries through level 1."""

    TP = TokenProcessor(block_size=BS, algorithm="vllm_sha256_cbor")

    def keys(self, p: int) -> list[int]:
        return [U.ek(p, i) for i in range(U.n_blocks(p))]


TestCompatSameSteps = CompatSameSteps.TestCase
TestCompatSameSteps.settings = settings(
    max_examples=60, stateful_step_count=40, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)


def test_pod_slots_are_reused_when_pods_leave():
    ix = NativeKVBlockIndex(U.tp)
    for round_ in range(300):
        pod = f"pod-{round_}"
        ix.block_stored(pod, 0, [U.ek(0, 0)], None, list(U.tokens(0, 0, 1)), "gpu", block_size=BS)
        assert ix.pods() == {pod}
        assert ix.clear(pod) == 1
    assert ix.pods() == frozenset() and len(ix) == 0
    ix.check()


def test_streams_of_many_records_read_and_clear_as_the_reference():
    """Streams past the small cases of the state machine: more than 65,536 records (several chunks
    of a stream's record set), chunks past 4,096 members (bitmaps), removals down below 2,048
    (arrays again), records reused in random order, and clears, against the reference."""
    tp = TokenProcessor(block_size=1)
    ref, nat = KVBlockIndex(tp, capacity=10**6), NativeKVBlockIndex(tp, capacity=10**6)
    rnd = random.Random(5)
    by_pod: dict[str, list[int]] = {"a": [], "b": []}
    seq = 0

    def store(pod: str, n: int) -> None:
        nonlocal seq
        eks = [rnd.getrandbits(64) for _ in range(n)]
        toks = [seq] + [rnd.randrange(1, 50_000) for _ in range(n - 1)]  # every sequence distinct
        seq += 1
        for ix in (ref, nat):
            ix.block_stored(pod, 0, eks, None, toks, "gpu", block_size=1)
        by_pod[pod].extend(eks)

    def same() -> None:
        nat.check()
        for pod in ("a", "b"):
            assert nat.pod_keys(pod) == ref.pod_keys(pod)
        assert nat.stats() == ref.stats()

    for k in range(560):  # 143,360 records, 256 per event, the pods alternating
        store("ab"[k % 2], 256)
    same()
    gone = rnd.sample(by_pod["a"], len(by_pod["a"]) * 19 // 20)
    for i in range(0, len(gone), 1000):
        assert nat.block_removed("a", 0, gone[i:i + 1000], "gpu") == ref.block_removed("a", 0, gone[i:i + 1000], "gpu")
    same()
    for k in range(100):  # the freed records come back in random order (into a's arrays, b's bitmaps)
        store("ab"[k % 2], 64)
    same()
    assert nat.clear("a") == ref.clear("a")
    same()
    assert nat.clear("b", 0) == ref.clear("b", 0)
    same()
    assert len(nat) == len(ref) == 0


def test_prefix_summary_equals_scoring_the_masks():
    ix = NativeKVBlockIndex(U.tp)
    ref = KVBlockIndex(U.tp)
    for x in (ix, ref):
        x.block_stored("a", 0, [U.ek(0, k) for k in range(4)], None, list(U.tokens(0, 0, 4)), "gpu", block_size=BS)
        x.block_stored("b", 1, [U.ek(0, k) for k in range(2)], None, list(U.tokens(0, 0, 2)), "cpu", block_size=BS)
        x.block_stored("b", 0, [U.ek(0, 0)], None, None, "storage")
    weights = [0.0] * 3
    weights[tier_bit("gpu").bit_length() - 1] = 1.0
    weights[tier_bit("cpu").bit_length() - 1] = 0.8
    weights[tier_bit("storage").bit_length() - 1] = 0.5
    keys = U.request_keys(0)
    gpu, cpu, storage = tier_bit("gpu"), tier_bit("cpu"), tier_bit("storage")
    assert ix.prefix_summary(keys, None, weights) == {"a": (4, 4.0, gpu), "b": (2, 0.8 + 0.8, cpu | storage)}
    assert ix.prefix_match(keys) == ref.prefix_match(keys)


# -- 3. compiled request keys


@settings(max_examples=200, deadline=None)
@given(
    toks=st.lists(st.integers(0, 2**64 - 1), max_size=80),
    bs=st.sampled_from([1, 4, 16]),
    seed=st.integers(0, 2**64 - 1) | st.text(max_size=5),
    model=st.none() | st.text(max_size=5),
)
def test_native_chain_is_bit_identical(toks, bs, seed, model):
    tp = TokenProcessor(block_size=bs, hash_seed=seed)
    want = tp.request_keys(toks, model=model)
    got = _native.xxh3_chain(tp._root(model, None), np.array(toks, dtype=np.uint64), tp._K, tp._A, None)
    assert np.frombuffer(got, dtype=np.uint64).tolist() == want.tolist()
    got_list = _native.xxh3_chain(tp._root(model, None), toks, tp._K, tp._A)
    assert np.frombuffer(got_list, dtype=np.uint64).tolist() == want.tolist()


# -- 4. the facade's compiled read path gives the reference's scores


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    stores=st.lists(
        st.tuples(st.sampled_from(PODS), st.sampled_from(RANKS), st.integers(0, len(U.paths) - 1),
                  st.integers(1, 6), st.sampled_from(TIERS)),
        max_size=12,
    ),
    path=st.integers(0, len(U.paths) - 1),
    extra_tokens=st.integers(0, 7),
    pods=st.none() | st.lists(st.sampled_from(PODS + ["zz"]), min_size=1, max_size=4),
    as_array=st.booleans(),
)
def test_indexer_score_same_on_both_backends(stores, path, extra_tokens, pods, as_array):
    def indexer(backend):
        return Indexer(Config.from_dict({
            "token_processor_config": {"block_size": BS, "hash_seed": 11},
            "kv_block_index_config": {"backend": backend},
            "scorer_config": {"tier_weights": {"gpu": 1.0, "cpu": 0.7, "storage": 0.3}},
        }))

    ixs = [indexer("python"), indexer("native")]
    for ix in ixs:
        for pod, rank, p, n, tier in stores:
            eks = [U.ek(p, k) for k in range(n)]
            ix.index.block_stored(pod, rank, eks, None, list(U.tokens(p, 0, n)), tier, block_size=BS)
    tokens = list(U.paths[path]) + list(range(extra_tokens))
    arg = np.array(tokens, dtype=np.int64) if as_array else tokens
    a, b = (ix.score(arg, pods) for ix in ixs)
    assert a == b
    assert ixs[0].index.stats() == ixs[1].index.stats()


# -- 5. readers run while writers apply


def test_concurrent_readers_and_writers_end_as_the_sequential_reference():
    """Two writer threads (one per pod, as the pool's shards) and two readers; the end
    state equals the reference fed the same per-pod event sequences one after the other."""
    import threading

    ix = NativeKVBlockIndex(U.tp, capacity=10_000)
    ref = KVBlockIndex(U.tp, capacity=10_000)
    steps = {
        pod: [(p, n, k % 3 == 2) for k, (p, n) in enumerate((p, n) for p in range(len(U.paths)) for n in range(1, 7))]
        for pod in ("a", "b")
    }

    def apply(index, pod):
        for p, n, clear in steps[pod]:
            eks = [U.ek(p, k) for k in range(n)]
            index.block_stored(pod, 0, eks, None, list(U.tokens(p, 0, n)), "gpu", block_size=BS)
            if clear:
                index.block_removed(pod, 0, eks[-1:], "gpu")

    stop = threading.Event()
    errors: list[BaseException] = []

    def read():
        try:
            while not stop.is_set():
                for p in range(len(U.paths)):
                    for pod, masks in ix.prefix_match(U.request_keys(p)).items():
                        assert pod in ("a", "b") and all(masks)
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    readers = [threading.Thread(target=read) for _ in range(2)]
    writers = [threading.Thread(target=apply, args=(ix, pod)) for pod in ("a", "b")]
    for t in readers + writers:
        t.start()
    for t in writers:
        t.join()
    stop.set()
    for t in readers:
        t.join()
    assert not errors, errors
    for pod in ("a", "b"):
        apply(ref, pod)
    for p in range(len(U.paths)):
        assert ix.prefix_match(U.request_keys(p)) == ref.prefix_match(U.request_keys(p))
        assert ix.lookup(U.request_keys(p)) == ref.lookup(U.request_keys(p))
    assert ix.stats() == ref.stats()
    ix.check()


# -- 4. the block-index sets under long probe runs

_M64 = (1 << 64) - 1


def _unfmix64(h: int) -> int:
    """The key whose fmix64 (native/native.cpp, MurmurHash3's finalizer) is ``h``."""
    h ^= h >> 33
    h = (h * pow(0xC4CEB9FE1A85EC53, -1, 1 << 64)) & _M64
    h ^= h >> 33
    h = (h * pow(0xFF51AFD7ED558CCD, -1, 1 << 64)) & _M64
    return h ^ (h >> 33)


def _fmix64(x: int) -> int:
    x ^= x >> 33
    x = (x * 0xFF51AFD7ED558CCD) & _M64
    x ^= x >> 33
    x = (x * 0xC4CEB9FE1A85EC53) & _M64
    return x ^ (x >> 33)


def test_sets_with_keys_sharing_home_slots_match_a_dict_model():
    """Request and engine keys whose hashes share a home slot (runs far longer than the 31 a slot
    records), a run wrapping past the table's end, and random keys: stores, removals, re-stores
    and evictions leave every lookup, resolve and the internal invariants as a dict model says."""
    assert all(_fmix64(_unfmix64(h)) == h for h in (0, 1, _M64, 0x0123456789ABCDEF))
    rng = random.Random(7)
    clusters = [(c << 61) + 12345 for c in range(8)] + [_M64 - 150]
    same_home = [_unfmix64(base + i) for base in clusters for i in range(120)]
    rks = same_home + [rng.getrandbits(64) for _ in range(1500)]
    rng.shuffle(rks)
    rks = list(dict.fromkeys(rks))
    eks = [_unfmix64((rng.choice(clusters) + 1000 + i) & _M64) for i in range(len(rks))]
    eks = list(dict.fromkeys(eks))[: len(rks)]
    rks = rks[: len(eks)]
    pods = ["a", "b", "c"]
    core = _native.IndexCore(10**6, False)
    model: dict[int, set[str]] = {}  # request key -> pods holding it
    streams: dict[str, dict[int, int]] = {p: {} for p in pods}  # engine key -> request key
    owner = {}
    for i, (ek, rk) in enumerate(zip(eks, rks)):
        p = pods[i % 3]
        owner[ek] = (p, rk)
        core.store_keys(p, 0, 0, [ek], [rk], 1)
        model.setdefault(rk, set()).add(p)
        streams[p][ek] = rk
    core.check()

    def compare() -> None:
        core.check()
        got = core.lookup(rks)
        for rk, holders in zip(rks, got):
            assert {h[0] for h in holders} == model.get(rk, set())
        for p in pods:
            for ek in eks[:300]:
                # the pod's own stream, else level 2 (each engine key has one owner stream)
                want = streams[p].get(ek, streams[owner[ek][0]].get(ek))
                assert core.resolve(p, 0, 0, ek) == want
        assert len(core) == len(model)

    compare()
    for ek in rng.sample(eks, len(eks) // 2):
        p, rk = owner[ek]
        if streams[p].pop(ek, None) is not None:
            assert core.remove(p, 0, 0, [ek], 1) == [True]
            model[rk].discard(p)
            if not model[rk]:
                del model[rk]
    compare()
    for ek in rng.sample(eks, len(eks) // 4):
        p, rk = owner[ek]
        core.store_keys(p, 0, 0, [ek], [rk], 1)
        model.setdefault(rk, set()).add(p)
        streams[p][ek] = rk
    compare()
    # an LRU bound far below the size: every store evicts the least recently used key
    small = _native.IndexCore(100, False)
    for ek, rk in zip(eks, rks):
        small.store_keys("a", 0, 0, [ek], [rk], 1)
    small.check()
    assert len(small) == 100
    assert [bool(h) for h in small.lookup(rks)] == [i >= len(rks) - 100 for i in range(len(rks))]


# -- 6. the logged recency refresh and the multi-call mark


def _chain(n_blocks: int, seed: int) -> list[int]:
    rnd = random.Random(seed)
    return [rnd.randrange(1, 50_000) for _ in range(n_blocks * BS)]


def test_recency_log_past_its_bound_evicts_as_the_reference():
    """More matched blocks between two writes than the core's touch log holds (65,536): the
    reader applies the log itself; the evictions that follow are the reference's."""
    capacity = 9_000
    ixs = [KVBlockIndex(U.tp, capacity=capacity), NativeKVBlockIndex(U.tp, capacity=capacity)]
    seqs = [_chain(n, s) for s, n in enumerate((4_096, 3_000, 1_500, 2_000))]
    keys = [U.tp.request_keys(t) for t in seqs]
    for ix in ixs:
        for p, toks in enumerate(seqs[:3]):
            ix.block_stored("abc"[p], 0, list(range(p << 20, (p << 20) + len(toks) // BS)), None, toks, "gpu",
                            block_size=BS)
    rnd = random.Random(5)
    order = [rnd.choice([0, 0, 1, 2]) for _ in range(40)]  # about 30 x 4,096 matched blocks from seq 0
    for ix in ixs:
        for q in order:
            ix.prefix_match(keys[q][: len(keys[q]) * (1 + q) // 3])
            if isinstance(ix, NativeKVBlockIndex):
                ix.prefix_summary(keys[2][:700], None, [1.0])  # also logged
            else:
                ix.prefix_match(keys[2][:700])
        # evicts 1,500 least recently used keys
        ix.block_stored("d", 0, list(range(3 << 20, (3 << 20) + 2_000)), None, seqs[3], "gpu", block_size=BS)
    assert ixs[0].stats() == ixs[1].stats()
    assert ixs[0].stats().evictions > 0
    for k in keys:
        assert ixs[0].lookup(k) == ixs[1].lookup(k)
    ixs[1].check()


def test_guarded_reads_wait_for_a_multi_call_event():
    """While a writer is inside an event it applies in several core calls, the core answers a
    guarded read None (before touching anything) and the index's lock-free reads wait for the
    event on the Python lock; unguarded reads still answer."""
    import threading

    ix = NativeKVBlockIndex(U.tp)
    toks = list(U.paths[0])
    n = len(toks) // BS
    ix.block_stored("a", 0, list(range(1, n + 1)), None, toks, "gpu", block_size=BS)
    keys = np.array(U.request_keys(0), dtype=np.uint64)
    core = ix._core
    state = U.tp._root(U.model, None)
    with ix._lock:
        ix._wgen += 1
        core.begin_multi()
        assert core.prefix_summary(keys, None, [1.0], True, True) is None
        assert core.prefix_match(keys, None, True, True) is None
        assert core.match_tokens(state, toks, ix._K, ix._A, None, [1.0], True, True) is None
        assert core.prefix_summary(keys, None, [1.0], False)[1] == n
        got: dict = {}
        readers = [
            threading.Thread(target=lambda: got.__setitem__("summary", ix.prefix_summary(keys, None, [1.0, 0.5]))),
            threading.Thread(target=lambda: got.__setitem__("tokens", ix.match_tokens(toks, None, [1.0, 0.5],
                                                                                        model=U.model)[1])),
            threading.Thread(target=lambda: got.__setitem__("match", ix.prefix_match(keys))),
            threading.Thread(target=lambda: got.__setitem__("rank", ix.best_dp_rank("a", keys))),
        ]
        for t in readers:
            t.start()
        for t in readers:
            t.join(0.3)
        assert all(t.is_alive() for t in readers) and not got  # they wait for the event
        ix.block_stored("b", 0, list(range(100, 100 + n)), None, toks, "cpu", block_size=BS)
        core.end_multi()
        ix._wgen += 1
    for t in readers:
        t.join(30)
    assert not any(t.is_alive() for t in readers)
    both = {"a": (n, float(n), tier_bit("gpu")), "b": (n, 0.5 * n, tier_bit("cpu"))}
    assert got["summary"] == got["tokens"] == both
    assert set(got["match"]) == {"a", "b"} and got["rank"] == 0
    with pytest.raises(RuntimeError):
        core.end_multi()


def test_readers_never_see_half_of_an_orphan_release():
    """A store whose parent arrives after its child: the parent's event attaches the waiting
    child in a second core call.  Lock-free readers see both blocks' pods or neither, never
    the parent alone."""
    import threading

    ix = NativeKVBlockIndex(U.tp)
    toks = _chain(2, 7)
    keys = np.array(U.tp.request_keys(toks), dtype=np.uint64)
    stop = threading.Event()
    seen: set = set()
    errors: list[BaseException] = []

    def read():
        try:
            while not stop.is_set():
                s = ix.prefix_summary(keys, ["p"], [1.0])
                got = s.get("p", (0,))[0]
                assert ix.match_tokens(toks, ["p"], [1.0])[1].get("p", (0,))[0] in (0, 2)
                seen.add(got)
                assert got in (0, 2), got
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    readers = [threading.Thread(target=read) for _ in range(2)]
    for t in readers:
        t.start()
    try:
        for _ in range(1_000):
            ix.block_stored("p", 0, [2], 1, toks[BS:], "gpu", block_size=BS)  # child first: waits as an orphan
            ix.block_stored("p", 0, [1], None, toks[:BS], "gpu", block_size=BS)  # parent: attaches the child
            assert ix.prefix_summary(keys, ["p"], [1.0])["p"][0] == 2
            ix.clear("p")
    finally:
        stop.set()
        for t in readers:
            t.join()
    assert not errors, errors
    ix.check()


# -- the walk's runs of blocks with the same holders

_RUN_PODS = ["a", "b", "c", "d", "e", "f"]
_RUN_PATH = tuple(range(500, 500 + BS * 40))


@settings(max_examples=150, deadline=None)
@given(
    ops=st.lists(
        st.tuples(st.sampled_from(["store", "store", "store", "remove"]), st.sampled_from(_RUN_PODS),
                  st.sampled_from(RANKS), st.sampled_from(TIERS), st.integers(0, 40), st.integers(1, 40)),
        min_size=1, max_size=14,
    ),
    pods=st.none() | st.lists(st.sampled_from(_RUN_PODS + ["zz"]), min_size=1, max_size=5),
    upto=st.integers(1, 40),
)
def test_summary_over_shared_prefixes_equals_the_reference(ops, pods, upto):
    """Many pods holding prefixes of one path, in drawn orders, ranks and tiers, with blocks
    removed from the middle: runs of blocks whose holders repeat, broken where a pod's match ends,
    a tier or rank changes or a holder is added or dropped.  The compiled summary (and match_tokens'
    DP ranks) equal the reference's prefix match summarised (and best_dp_rank)."""
    from tests.oracle import engine_hash

    eks = [engine_hash(_RUN_PATH[: (i + 1) * BS]) for i in range(40)]
    ref, nat = KVBlockIndex(U.tp), NativeKVBlockIndex(U.tp)
    for kind, pod, rank, tier, start, n in ops:
        for x in (ref, nat):
            if kind == "store":  # a prefix of the path: blocks [0, n)
                x.block_stored(pod, rank, eks[:n], None, list(_RUN_PATH[: n * BS]), tier, block_size=BS)
            else:  # one block dropped from the middle of a run
                x.block_removed(pod, rank, [eks[min(start, 39)]], tier)
    weights = [1.0, 0.75, 0.5, 0.25]
    toks = list(_RUN_PATH[: upto * BS])
    keys = [int(k) for k in U.tp.request_keys(toks)]
    want = _summarise(ref.prefix_match(keys, pods), weights)
    assert nat.prefix_summary(keys, pods, weights) == want
    ranks: dict = {}
    got_keys, got = nat.match_tokens(toks, pods, weights, dp_ranks=ranks)
    assert got_keys.tolist() == keys and got == want
    assert set(ranks) <= set(got)
    for pod, rank in ranks.items():
        assert rank == ref.best_dp_rank(pod, keys[: got[pod][0]])
