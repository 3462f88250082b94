"""The Redis backend (kvindex.redis_index) against the pure-Python reference, on a real redis-server.

1. Every case of tests/test_index.py runs again on the Redis index.
2. A hypothesis state machine drives the reference and the Redis index with
   the same steps (the steps of tests/test_native_index.py: stores with known,
   unknown and no parents, token-less stores, removals, clears, speculative
   entries with a fake clock, held entries, a small LRU capacity and orphan
   bound) and compares every read, sizes and counters.
3. Idempotent writes: every event applied twice (as two replicas that both
   ingest would) leaves the same shared state as once.
4. The facade: ``backend: redis`` in the configuration selects it and scores
   as the reference does.

The engine-model test (tests/test_engine_model.py) runs with this backend too
(its ``index_factory`` parameter ``redis``).
"""

from __future__ import annotations

import itertools

import hypothesis.strategies as st
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis.stateful import initialize, run_state_machine_as_test

import tests.test_index as reference_cases
import tests.test_native_index as native_cases
from kvevents.events import AllBlocksCleared, BlockRemoved, BlockStored
from kvindex.facade import Config, Indexer
from kvindex.keys import TokenProcessor
from kvindex import make_index
from kvindex.reference import KVBlockIndex
from kvindex.contract import KVIndex
from kvindex.redis_index import RedisKVBlockIndex
from tests.test_native_index import BS, PODS, RANKS, TIERS, U

_prefixes = itertools.count()


def fresh(url: str):
    """A factory of Redis indexes with the reference's signature, each under its own key prefix."""

    def make(token_processor=None, **kw):
        return RedisKVBlockIndex(token_processor, url=url, key_prefix=f"t{next(_prefixes)}:", **kw)

    return make


# -- 1. the reference's own cases

REFERENCE_CASES = sorted(n for n in dir(reference_cases) if n.startswith("test_"))


@pytest.mark.parametrize("name", REFERENCE_CASES)
def test_reference_case_on_redis(name, monkeypatch, redis_url):
    monkeypatch.setattr(reference_cases, "KVBlockIndex", fresh(redis_url))
    getattr(reference_cases, name)()


def test_protocol_and_selection(redis_url):
    tp = U.tp
    ix = make_index("redis", tp, redis_url=redis_url, key_prefix="sel:")
    assert isinstance(ix, RedisKVBlockIndex) and isinstance(ix, KVIndex)
    assert ix.key_prefix == "sel:"
    with pytest.raises(ValueError):
        RedisKVBlockIndex(tp)  # neither url nor client
    cfg = Config.from_dict({"kv_block_index_config": {"backend": "redis", "redis_config": {"url": redis_url}}})
    assert type(Indexer(cfg).index) is RedisKVBlockIndex
    with pytest.raises(ValueError):
        Config.from_dict({"kv_block_index_config": {"redis_config": {"key_prefix": ""}}})


# -- 2. the same steps on the reference and on Redis


class RedisSameSteps(native_cases.SameSteps):
    """tests/test_native_index.SameSteps with the Redis index as the second implementation."""

    url = ""

    @initialize(capacity=st.sampled_from([3, 8, 1_000]), orphans=st.sampled_from([0, 4, 100]))
    def build(self, capacity, orphans):
        clock = lambda: self.now[0]  # noqa: E731
        self.ixs = [
            KVBlockIndex(U.tp, capacity=capacity, max_orphan_blocks=orphans, clock=clock),
            RedisKVBlockIndex(U.tp, capacity=capacity, max_orphan_blocks=orphans, clock=clock, url=self.url,
                              key_prefix=f"ss{next(_prefixes)}:"),
        ]


def test_same_steps_as_the_reference(redis_url, monkeypatch):
    # the invariant ends with the compiled index's self-check: not here
    monkeypatch.setattr(RedisKVBlockIndex, "check", lambda self: None, raising=False)
    machine = type("Machine", (RedisSameSteps,), {"url": redis_url})
    run_state_machine_as_test(machine, settings=settings(
        max_examples=15, stateful_step_count=25, deadline=None, suppress_health_check=list(HealthCheck),
    ))


# -- 3. idempotent writes


@settings(max_examples=15, deadline=None, suppress_health_check=list(HealthCheck))
@given(
    steps=st.lists(
        st.tuples(
            st.sampled_from(["store", "store", "offload", "remove", "clear"]), st.sampled_from(PODS),
            st.sampled_from(RANKS), st.integers(0, len(U.paths) - 1), st.integers(1, 6), st.sampled_from(TIERS),
        ),
        max_size=25,
    )
)
def test_every_event_applied_twice_changes_nothing(redis_url, steps):
    once = RedisKVBlockIndex(U.tp, url=redis_url, key_prefix=f"once{next(_prefixes)}:")
    twice = RedisKVBlockIndex(U.tp, url=redis_url, key_prefix=f"twice{next(_prefixes)}:")
    # a second replica's client on the same prefix as ``twice``
    twin = RedisKVBlockIndex(U.tp, url=redis_url, key_prefix=twice.key_prefix)

    def apply(ix, kind, pod, rank, path, n, tier):
        eks = [U.ek(path, k) for k in range(n)]
        if kind == "store":
            ix.block_stored(pod, rank, eks, None, list(U.tokens(path, 0, n)), tier, block_size=BS)
        elif kind == "offload":
            ix.block_stored(pod, rank, eks[-1:], None, None, tier)
        elif kind == "remove":
            ix.block_removed(pod, rank, eks[-1:], tier)
        else:
            ix.clear(pod, rank)

    for step in steps:
        apply(once, *step)
        apply(twice, *step)
        apply(twin, *step)
    for p in range(len(U.paths)):
        keys = U.request_keys(p)
        assert twice.prefix_match(keys) == once.prefix_match(keys)
        assert twin.lookup(keys) == once.lookup(keys)
    a, b = once.stats(), twice.stats()
    assert (a.keys, a.entries, a.engine_keys, a.pods) == (b.keys, b.entries, b.engine_keys, b.pods)
    for pod in PODS:
        assert twice.pod_keys(pod) == once.pod_keys(pod)


# -- 4. the facade


@settings(max_examples=15, deadline=None, suppress_health_check=list(HealthCheck))
@given(
    stores=st.lists(
        st.tuples(st.sampled_from(PODS), st.sampled_from(RANKS), st.integers(0, len(U.paths) - 1),
                  st.integers(1, 6), st.sampled_from(TIERS)),
        max_size=12,
    ),
    path=st.integers(0, len(U.paths) - 1),
    extra_tokens=st.integers(0, 7),
    pods=st.none() | st.lists(st.sampled_from(PODS + ["zz"]), min_size=1, max_size=4),
)
def test_indexer_scores_as_the_reference(redis_url, stores, path, extra_tokens, pods):
    def indexer(backend, prefix=None):
        kv: dict = {"backend": backend}
        if prefix is not None:
            kv["redis_config"] = {"url": redis_url, "key_prefix": prefix}
        return Indexer(Config.from_dict({
            "token_processor_config": {"block_size": BS, "hash_seed": 11},
            "kv_block_index_config": kv,
            "scorer_config": {"tier_weights": {"gpu": 1.0, "cpu": 0.7, "storage": 0.3}},
        }))

    ixs = [indexer("python"), indexer("redis", f"ix{next(_prefixes)}:")]
    for ix in ixs:
        for pod, rank, p, n, tier in stores:
            eks = [U.ek(p, k) for k in range(n)]
            ix.index.block_stored(pod, rank, eks, None, list(U.tokens(p, 0, n)), tier, block_size=BS)
    tokens = np.array(list(U.paths[path]) + list(range(extra_tokens)), dtype=np.int64)
    a, b = (ix.score(tokens, pods) for ix in ixs)
    assert a == b


def test_a_chained_batch_is_one_script_call(redis_url):
    """A stream's decoded batch of chained stores (and the next batch continuing it) costs one script call
    each, and leaves the reference's state."""
    kinds = (BlockStored, BlockRemoved, AllBlocksCleared)
    ref = KVBlockIndex(TokenProcessor(block_size=BS))
    ix = fresh(redis_url)(TokenProcessor(block_size=BS))
    path = max(range(len(U.paths)), key=U.n_blocks)
    n = U.n_blocks(path)
    assert n >= 4
    cuts = [0, 1, n // 2, n - 1, n]
    evs = [
        BlockStored(tuple(U.ek(path, k) for k in range(i, j)), None if i == 0 else U.ek(path, i - 1),
                    tuple(U.tokens(path, i, j)), BS, "gpu")
        for i, j in itertools.pairwise(cuts)
    ]
    calls = []
    run = ix._run
    ix._run = lambda name, *a, **kw: (calls.append(name), run(name, *a, **kw))[1]
    for index in (ref, ix):
        index.apply_events("p", 0, evs[:2], model="m", kinds=kinds)
    first = [c for c in calls if c == "batch"]
    calls.clear()
    for index in (ref, ix):
        index.apply_events("p", 0, evs[2:] + [BlockRemoved((U.ek(path, n - 1),), "gpu")], model="m", kinds=kinds)
    assert first == ["batch"] and calls == ["batch"]
    keys = ref.token_processor.request_keys(np.array(U.paths[path][: n * BS]), model="m")
    want = ref.prefix_match(keys)
    assert len(want["p"]) == n - 1  # the last block was removed
    assert ix.prefix_match(keys) == want
    assert ix.lookup(keys) == ref.lookup(keys)


# -- 5. the LRU in buckets


def _chain_tokens(seed: int, n_blocks: int) -> list[int]:
    rnd = np.random.default_rng(seed)
    return [int(t) for t in rnd.integers(1, 50_000, n_blocks * BS)]


@settings(max_examples=12, deadline=None, suppress_health_check=list(HealthCheck))
@given(
    capacity=st.sampled_from([100, 250]),
    steps=st.lists(
        st.tuples(st.sampled_from(["store", "store", "match", "remove"]), st.sampled_from(PODS),
                  st.integers(0, 11), st.integers(5, 60)),
        min_size=5, max_size=40,
    ),
)
def test_bucketed_lru_evicts_as_the_reference(redis_url, capacity, steps):
    """A capacity of 100 or 250 keys spreads the LRU over 2 or 4 buckets: stores past the capacity,
    matches that refresh, and removals leave every index read and size as the reference's."""
    ref = KVBlockIndex(U.tp, capacity=capacity)
    ix = fresh(redis_url)(U.tp, capacity=capacity)
    chains = {s: _chain_tokens(s, 60) for s in range(12)}
    keys = {s: U.tp.request_keys(np.array(t)) for s, t in chains.items()}
    for op, pod, seed, n in steps:
        eks = [(seed << 16) + i for i in range(n)]
        for index in (ref, ix):
            if op == "store":
                index.block_stored(pod, 0, eks, None, chains[seed][: n * BS], "gpu", block_size=BS)
            elif op == "match":
                index.prefix_match(keys[seed][:n])
            else:
                index.block_removed(pod, 0, eks[n // 2:], "gpu")
        assert ix.stats().keys == ref.stats().keys
    assert ix.stats().evictions == ref.stats().evictions
    for s in chains:
        assert ix.lookup(keys[s]) == ref.lookup(keys[s])
        assert ix.prefix_match(keys[s]) == ref.prefix_match(keys[s])
    assert len(ix) == len(ref)


def test_lru_buckets_stay_small_listpacks_when_full(redis_url):
    """At its capacity the LRU's buckets hold about 80 keys each, below the server's default listpack
    limit of 128 (zset-max-listpack-entries): each one stays compact."""
    import redis as redis_py

    capacity = 4_000
    ix = fresh(redis_url)(U.tp, capacity=capacity)
    for s in range(capacity // 50 + 10):
        ix.block_stored("a", 0, [(s << 16) + i for i in range(50)], None, _chain_tokens(1_000 + s, 50), "gpu",
                        block_size=BS)
    assert len(ix) == capacity and ix.stats().evictions > 0
    client = redis_py.Redis.from_url(redis_url)
    buckets = [k for k in client.scan_iter(match=ix.key_prefix + "l:*")]
    assert len(buckets) == capacity // 80
    sizes = [client.zcard(b) for b in buckets]
    assert sum(sizes) == capacity and max(sizes) < 128
    assert {client.object("encoding", b) for b in buckets} == {b"listpack"}


def test_matches_between_stores_refresh_in_order_of_last_use(redis_url):
    """Twenty matches in a row (past the touch log's 8 waiting matches, so a match applies it too), the
    same prefixes matched again in another order, then stores past the capacity: the evictions are the
    reference's."""
    ref = KVBlockIndex(U.tp, capacity=250)
    ix = fresh(redis_url)(U.tp, capacity=250)
    chains = {s: _chain_tokens(s, 40) for s in range(6)}
    keys = {s: U.tp.request_keys(np.array(t)) for s, t in chains.items()}
    order = [3, 0, 5, 1, 4, 2, 0, 3, 1, 5, 2, 4, 1, 0, 3, 2, 5, 4, 0, 1]
    for index in (ref, ix):
        for s in range(6):
            index.block_stored("ab"[s % 2], 0, [(s << 16) + i for i in range(40)], None, chains[s], "gpu",
                               block_size=BS)
        for n, s in enumerate(order):
            index.prefix_match(keys[s][: 10 + n])
        for s in range(6, 9):
            index.block_stored("c", 0, [(s << 16) + i for i in range(40)], None, _chain_tokens(s, 40), "gpu",
                               block_size=BS)
    assert ref.stats().evictions > 0
    assert ix.stats().evictions == ref.stats().evictions
    for s in chains:
        assert ix.lookup(keys[s]) == ref.lookup(keys[s])


# -- 6. streams of thousands of entries


def test_streams_of_thousands_read_and_clear_as_the_reference(redis_url):
    """Streams of thousands of entries, through removals, stores of reused engine keys and clears, read
    as the reference does."""
    import random

    tp = TokenProcessor(block_size=1)
    ref, ix = KVBlockIndex(tp, capacity=10**6), fresh(redis_url)(tp, capacity=10**6)
    rnd = random.Random(7)
    by_pod: dict[str, list[int]] = {"a": [], "b": []}
    seq = itertools.count()

    def store(pod: str, n: int, eks: list[int] | None = None) -> None:
        eks = eks or [rnd.getrandbits(64) for _ in range(n)]
        toks = [next(seq)] + [rnd.randrange(1, 50_000) for _ in range(len(eks) - 1)]  # every sequence distinct
        for index in (ref, ix):
            index.block_stored(pod, 0, eks, None, toks, "gpu", block_size=1)
        by_pod[pod].extend(eks)

    def same() -> None:
        for pod in ("a", "b"):
            assert ix.pod_keys(pod) == ref.pod_keys(pod)
            assert ix.pod_keys(pod, 0) == ref.pod_keys(pod, 0)
        assert ix.stats().keys == ref.stats().keys and ix.stats().entries == ref.stats().entries
        sample = rnd.sample(by_pod["a"] + by_pod["b"], 200)
        assert [ix.request_key_of(ek) for ek in sample] == [ref.request_key_of(ek) for ek in sample]

    for k in range(40):  # 10,240 entries, 256 per event
        store("ab"[k % 2], 256)
    same()
    gone = rnd.sample(by_pod["a"], 4_800)
    for i in range(0, len(gone), 500):
        assert ix.block_removed("a", 0, gone[i:i + 500], "gpu") == ref.block_removed("a", 0, gone[i:i + 500], "gpu")
    same()
    store("a", 0, gone[:300])  # engine keys come back with other content
    store("b", 0, rnd.sample(by_pod["b"], 100))  # and again with other content on the same stream
    same()
    assert ix.clear("a") == ref.clear("a")
    same()
    assert ix.clear("b", 0) == ref.clear("b", 0)
    same()
    assert len(ix) == len(ref) == 0


def test_matches_before_any_store_leave_no_touch_log(redis_url):
    """Matches that find only held entries, before any block is stored, have nothing to refresh in the
    LRU: the touch log stays empty (it would otherwise grow with every match until the first store)."""
    import redis as redis_py

    ix = fresh(redis_url)(U.tp, capacity=1_000)
    keys = U.tp.request_keys(np.array(_chain_tokens(3, 8)))
    ix.add_held("p", keys, "gpu")
    for _ in range(30):
        assert len(ix.prefix_match(keys)["p"]) == len(keys)
    assert redis_py.Redis.from_url(redis_url).llen(ix.key_prefix + "llog") == 0
