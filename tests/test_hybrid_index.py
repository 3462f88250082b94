"""Per-group state of the reference and compiled indexes, driven by a model engine with several KV-cache groups.

The model engine (sliding window, full attention, Mamba; block size 4) caches
what vLLM 0.32 keeps under its default sparse retention: every prompt block
for full attention, only the trailing window at the prompt's last boundary for
the sliding-window group, only the state at that boundary for Mamba.  It
evicts blocks of one group at a time, resets its prefix cache and restarts.
Its events go through the real decoder (kvevents.wire) and the index's batch
apply, as the pool sends them (the compiled index's runs through its core).
"""

from __future__ import annotations

import random

import pytest
from hypothesis import Phase, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule, run_state_machine_as_test

from kvevents.events import AllBlocksCleared, BlockRemoved, BlockStored
from kvevents.wire import decode_vllm_batch
from kvindex.contract import GroupAware
from kvindex.hybrid import GroupSpec, predict_hit
from kvindex import Config, Indexer
from kvindex.keys import TokenProcessor
from kvindex.reference import KVBlockIndex
from kvindex.tiers import GPU, tier_bit
from tests.oracle import batch_payload, cleared_event, engine_hash, removed_event, stored_event

KINDS = (BlockStored, BlockRemoved, AllBlocksCleared)
BS = 4
GROUPS = (GroupSpec(0, "sliding_window", BS, 8), GroupSpec(1, "full_attention", BS), GroupSpec(2, "mamba", BS))
SWA_NEED = 2  # ceil((8 - 1) / 4)
PODS = ("a", "b")
GPU_BIT = tier_bit(GPU)


def _paths(seed: int) -> list[tuple[int, ...]]:
    """Prompts sharing leading blocks (a system prompt, then users' turns)."""
    rnd = random.Random(seed)
    base = [rnd.randrange(1, 9_000) for _ in range(6 * BS)]
    out = []
    for p in range(6):
        shared = base[: (p % 4) * 2 * BS]
        out.append(tuple(shared + [rnd.randrange(1, 9_000) for _ in range(rnd.randrange(1, 5) * BS + p)]))
    return out


class HybridEngines(RuleBasedStateMachine):
    """Two pods serving one hybrid model; the index (``backend``) follows their events."""

    compat = False
    backend = "python"
    shadowed = True  # held to the reference too (off in the mutation checks: the engine's truth must catch them)

    def __init__(self) -> None:
        super().__init__()
        algo = "vllm_sha256_cbor" if self.compat else "xxh3_chain"
        self.ix = Indexer(Config.from_dict({
            "token_processor_config": {"block_size": BS, "algorithm": algo},
            "kv_block_index_config": {"backend": self.backend},
        }))
        self.tp = self.ix.token_processor
        self.index = self.ix.index
        assert isinstance(self.index, BACKENDS[self.backend]())
        # another backend is also held to the reference, fed the same batches
        self.shadow = KVBlockIndex(self.tp) if self.backend != "python" and self.shadowed else None
        self.paths = _paths(0)
        self.held: dict[str, dict[int, set[int]]] = {p: {g.group_idx: set() for g in GROUPS} for p in PODS}

    @initialize(seed=st.integers(0, 3))
    def setup(self, seed: int) -> None:
        self.paths = _paths(seed)

    # -- the engine

    def eks(self, path: tuple[int, ...]) -> list[int]:
        n = len(path) // BS
        if self.compat:
            return [int(k) for k in self.tp.request_keys(path)]
        return [engine_hash(path[: (i + 1) * BS]) for i in range(n)]

    def publish(self, pod: str, events: list) -> None:
        batch = decode_vllm_batch(batch_payload(events))
        assert not batch.bad_events
        r = self.index.apply_events(pod, 0, batch.events, kinds=KINDS)
        assert not r.errors, r.errors
        if self.shadow is not None:
            assert self.shadow.apply_events(pod, 0, batch.events, kinds=KINDS) == r

    def kept(self, group: GroupSpec, n_tokens: int) -> list[int]:
        """Blocks a group keeps of a prompt: all (full), the trailing window or the state at its boundary."""
        last = (n_tokens - 1) // BS  # blocks before the replay boundary N - 1
        if group.kind == "full_attention":
            return list(range(n_tokens // BS))
        if group.kind == "sliding_window":
            return list(range(max(0, last - SWA_NEED), last))
        return [last - 1] if last else []

    @rule(pod=st.sampled_from(PODS), p=st.integers(0, 5), sparse=st.booleans(), hit=st.integers(0, 8))
    def serve(self, pod: str, p: int, sparse: bool, hit: int) -> None:
        """A request: every group stores its new kept blocks.

        Dense: one event per kept block. Sparse (vLLM's default retention,
        #44451): a sliding-window or Mamba group publishes one event whose
        tokens cover every full block after the request's hit (``hit``
        blocks, at most what the full group holds) and whose hashes name only
        the kept ones, without saying which chunk each is.
        """
        path = self.paths[p]
        eks = self.eks(path)
        n = len(path) // BS
        start = 0
        while start < min(hit, n) and eks[start] in self.held[pod][1]:
            start += 1
        events = []
        for g in GROUPS:
            held = self.held[pod][g.group_idx]
            new = [i for i in self.kept(g, len(path)) if eks[i] not in held and (i >= start or not sparse)]
            held.update(eks[i] for i in new)
            fields = {"group_idx": g.group_idx, "kv_cache_spec_kind": g.kind, "kv_cache_spec_sliding_window": g.window}
            if sparse and g.kind != "full_attention":
                if start < n:
                    events.append(stored_event(
                        [eks[i] for i in new], eks[start - 1] if start else None, path[start * BS : n * BS], BS,
                        **fields,
                    ))
                continue
            events.extend(
                stored_event([eks[i]], eks[i - 1] if i else None, path[i * BS : (i + 1) * BS], BS, **fields)
                for i in new
            )
        self.publish(pod, events)

    @rule(pod=st.sampled_from(PODS), p=st.integers(0, 5))
    def full_report(self, pod: str, p: int) -> None:
        """A healing request (``kv_cache_report_mode: "full"``): vLLM re-announces blocks ``0 .. hit-1``
        for every group, though a sliding-window or Mamba group holds only those at the hit's end."""
        path = self.paths[p]
        eks = self.eks(path)
        hit = predict_hit(list(GROUPS), lambda g, end: eks[end // BS - 1] in self.held[pod][g], len(path))
        n = hit.tokens // BS
        if not n:
            return
        for ix in (self.index, self.shadow):
            if ix is not None:
                ix.distrust_reports(pod, 0, model=None, seconds=3600)  # what the healing policy opens
        self.publish(pod, [
            stored_event(eks[:n], None, path[: n * BS], BS, group_idx=g.group_idx, kv_cache_spec_kind=g.kind,
                         kv_cache_spec_sliding_window=g.window)
            for g in GROUPS
        ])

    @rule(pod=st.sampled_from(PODS), g=st.sampled_from([0, 1, 2]), pick=st.integers(0, 10**6))
    def evict(self, pod: str, g: int, pick: int) -> None:
        held = sorted(self.held[pod][g])
        if not held:
            return
        ek = held[pick % len(held)]
        self.held[pod][g].discard(ek)
        self.publish(pod, [removed_event([ek]) | {"group_idx": g}])

    @rule(pod=st.sampled_from(PODS))
    def reset_prefix_cache(self, pod: str) -> None:
        for h in self.held[pod].values():
            h.clear()
        self.publish(pod, [cleared_event()])

    @rule(pod=st.sampled_from(PODS))
    def restart(self, pod: str) -> None:
        for h in self.held[pod].values():
            h.clear()
        n = self.index.clear(pod, 0, model=None)  # what the pool does when the sequence restarts at 0
        assert self.shadow is None or self.shadow.clear(pod, 0, model=None) == n

    # -- the properties

    def claims(self, pod: str) -> dict[int, set[int]]:
        """group -> engine keys of the universe's blocks the index says the pod holds (gpu)."""
        out: dict[int, set[int]] = {g.group_idx: set() for g in GROUPS}
        for path in self.paths:
            keys = self.tp.request_keys(path)
            for g, masks in self.index.group_match(keys, pod).items():
                out[g].update(ek for ek, m in zip(self.eks(path), masks) if m & GPU_BIT)
        return out

    @invariant()
    def never_claims_a_block_the_engine_lacks(self) -> None:
        for pod in PODS:
            claims = self.claims(pod)
            for g in claims:
                assert claims[g] <= self.held[pod][g], (pod, g)
                if self.compat or g == 1:  # nothing is lost either (own-hash: sparse parents may be unknown)
                    universe = {ek for path in self.paths for ek in self.eks(path)}
                    assert claims[g] == self.held[pod][g] & universe, (pod, g)

    @invariant()
    def agrees_with_the_reference(self) -> None:
        if self.shadow is None:
            return
        assert self.index.stats() == self.shadow.stats()
        for pod in PODS:
            assert self.index.group_specs(pod) == self.shadow.group_specs(pod)
            assert self.index.grouped_ranks(pod) == self.shadow.grouped_ranks(pod)
            for path in self.paths:
                keys = self.tp.request_keys(path)
                assert self.index.group_match(keys, pod) == self.shadow.group_match(keys, pod)
                assert self.index.prefix_match(keys, [pod]) == self.shadow.prefix_match(keys, [pod])

    @invariant()
    def counts_its_group_entries(self) -> None:
        assert self.index._groups.size == self.index._groups.entries() == self.index.stats().group_entries

    @invariant()
    def predicts_what_the_engine_would_serve(self) -> None:
        if not self.compat:
            return
        for pod in PODS:
            for path in self.paths:
                keys = self.tp.request_keys(path)
                specs = list(self.index.group_specs(pod).values())
                if not specs:
                    continue
                masks = self.index.group_match(keys, pod)
                eks = self.eks(path)
                mine = predict_hit(specs, lambda g, end: bool(masks[g][end // BS - 1] & GPU_BIT), len(path))
                truth = predict_hit(specs, lambda g, end: eks[end // BS - 1] in self.held[pod][g], len(path))
                assert mine == truth
                # what a router reads: score()'s predicted cached tokens per pod, and why
                score = self.ix.score(list(path), [pod])
                assert score.predicted_cached_tokens(pod) == truth.tokens, (pod, path, truth)
                if len(specs) > 1 and self.index.prefix_match(keys, [pod]):  # hybrid so far, and matched
                    assert score.prefix[pod].hybrid and score.prefix[pod].limited_by_group == truth.limited_by


class CompatEngines(HybridEngines):
    compat = True


class NativeEngines(HybridEngines):
    backend = "native"


class NativeCompatEngines(HybridEngines):
    compat = True
    backend = "native"


def _reference() -> type:
    return KVBlockIndex


def _native() -> type:
    return pytest.importorskip("kvindex.native").NativeKVBlockIndex


#: backend name -> its index class (the compiled one skips the test where it is not built)
BACKENDS = {"python": _reference, "native": _native}

SETTINGS = settings(max_examples=60, stateful_step_count=25)


@pytest.mark.parametrize("machine", [HybridEngines, NativeEngines], ids=["python", "native"])
def test_own_hash_mode(machine: type) -> None:
    BACKENDS[machine.backend]()
    run_state_machine_as_test(machine, settings=SETTINGS)


@pytest.mark.parametrize("machine", [CompatEngines, NativeCompatEngines], ids=["python", "native"])
def test_engine_hash_mode(machine: type) -> None:
    BACKENDS[machine.backend]()
    run_state_machine_as_test(machine, settings=SETTINGS)


@pytest.mark.parametrize("machine", [CompatEngines, NativeCompatEngines], ids=["python", "native"])
def test_ignoring_group_idx_on_removal_breaks_the_property(machine: type, monkeypatch: pytest.MonkeyPatch) -> None:
    """Mutation check: a removal applied without its group (what a merged index does) is caught."""
    cls = BACKENDS[machine.backend]()
    original = cls.block_removed

    def merged(self, pod, dp_rank, engine_keys, tier, *, model=None, group_idx=None):
        return original(self, pod, dp_rank, engine_keys, tier, model=model)

    monkeypatch.setattr(cls, "block_removed", merged)
    monkeypatch.setattr(machine, "shadowed", False)
    with pytest.raises(AssertionError):
        run_state_machine_as_test(
            machine,
            settings=settings(max_examples=200, stateful_step_count=25, database=None, phases=[Phase.generate],
                              derandomize=True),
        )


def test_believing_every_reannounced_block_breaks_the_property(monkeypatch: pytest.MonkeyPatch) -> None:
    """Mutation check: a re-announce taken whole (no report window) is caught."""
    from kvindex.groups import GroupTables

    monkeypatch.setattr(GroupTables, "believed", lambda self, stream, group, parent, n: n)
    with pytest.raises(AssertionError):
        run_state_machine_as_test(
            CompatEngines,
            settings=settings(max_examples=400, stateful_step_count=40, database=None, phases=[Phase.generate],
                              derandomize=True),
        )


@pytest.mark.parametrize("machine", [NativeCompatEngines, NativeEngines], ids=["engine-hash", "own-hash"])
def test_the_core_merging_removals_breaks_the_property(machine: type, monkeypatch: pytest.MonkeyPatch) -> None:
    """Mutation check of the compiled batch path: a core told the stream keeps no groups takes every
    removal (and clear) into the primary group's tables, and is caught."""
    cls = BACKENDS[machine.backend]()
    monkeypatch.setattr(cls, "_gate", lambda self, stream: ())
    monkeypatch.setattr(machine, "shadowed", False)
    with pytest.raises(AssertionError):
        run_state_machine_as_test(
            machine,
            settings=settings(max_examples=200, stateful_step_count=25, database=None, phases=[Phase.generate],
                              derandomize=True),
        )


def test_every_backend_keeps_groups() -> None:
    """The reference, compiled and Redis backends keep KV-cache groups (the write path passes them)."""
    from kvindex.redis_index import RedisKVBlockIndex

    assert isinstance(KVBlockIndex(), GroupAware)
    assert issubclass(RedisKVBlockIndex, GroupAware)
    ix = _native()(TokenProcessor(BS))
    assert isinstance(ix, GroupAware)
    path = tuple(range(1, 9))
    eks = [engine_hash(path[:4]), engine_hash(path)]
    ev = [stored_event(eks, None, path, BS, group_idx=g, kv_cache_spec_kind=k) for g, k in
          ((0, "sliding_window"), (1, "full_attention"))]
    r = ix.apply_events("a", 0, decode_vllm_batch(batch_payload(ev)).events, kinds=KINDS)
    assert not r.errors
    assert (ix.stats().entries, ix.stats().group_entries) == (2, 2)  # full attention in the core, the window beside
    keys = ix.token_processor.request_keys(path)
    r = ix.apply_events("a", 0, decode_vllm_batch(batch_payload(
        [removed_event(eks) | {"group_idx": 0}])).events, kinds=KINDS)
    assert not r.errors and ix.stats().group_entries == 0
    assert ix.prefix_match(keys)["a"] == [GPU_BIT, GPU_BIT]  # the sliding window's removal left full attention
    assert ix.group_match(keys, "a") == {0: [0, 0], 1: [GPU_BIT, GPU_BIT]}


@pytest.mark.parametrize("backend", ["python", "native"])
def test_plain_model_unchanged(backend: str) -> None:
    """group_idx absent or 0 with full attention: the main tables only, nothing per group."""
    path = tuple(range(1, 13))
    eks = [engine_hash(path[: (i + 1) * BS]) for i in range(3)]
    for extra in ({}, {"group_idx": 0, "kv_cache_spec_kind": "full_attention"}):
        ix = BACKENDS[backend]()(TokenProcessor(BS))
        batch = decode_vllm_batch(batch_payload([stored_event(eks, None, path, BS, **extra)]))
        ix.apply_events("a", 0, batch.events, kinds=KINDS)
        keys = TokenProcessor(BS).request_keys(path)
        assert len(ix.prefix_match(keys)["a"]) == 3
        assert ix.stats().group_entries == 0
        batch = decode_vllm_batch(batch_payload([removed_event(eks[2:]) | extra]))
        ix.apply_events("a", 0, batch.events, kinds=KINDS)
        assert len(ix.prefix_match(keys)["a"]) == 2


def test_sparse_stores_decode_and_are_kept_by_hash() -> None:
    """vLLM's sparse retention (#44451): tokens over 3 blocks, one hash; taken in engine-hash mode only."""
    path = tuple(range(1, 13))
    tp = TokenProcessor(BS, algorithm="vllm_sha256_cbor")
    eks = [int(k) for k in tp.request_keys(path)]
    swa = stored_event([eks[2]], None, path, BS, group_idx=0, kv_cache_spec_kind="sliding_window",
                       kv_cache_spec_sliding_window=8)
    full = stored_event(eks, None, path, BS, group_idx=1, kv_cache_spec_kind="full_attention")
    lone = stored_event([], None, path, BS, group_idx=2, kv_cache_spec_kind="mamba")  # no hash kept: no block
    bad = stored_event([eks[2]], None, path, BS, group_idx=1, kv_cache_spec_kind="full_attention")
    batch = decode_vllm_batch(batch_payload([swa, full, lone, bad]))
    assert [e.sparse for e in batch.events] == [True, False, True]
    assert len(batch.bad_events) == 1 and "token_ids" in batch.bad_events[0]  # full attention is always dense

    compat = KVBlockIndex(tp)
    assert not compat.apply_events("a", 0, batch.events, kinds=KINDS).errors
    assert compat.group_match(eks, "a")[0] == [0, 0, GPU_BIT]
    own = KVBlockIndex(TokenProcessor(BS))
    assert not own.apply_events("a", 0, decode_vllm_batch(batch_payload(
        [stored_event([engine_hash(path[:4 * (i + 1)]) for i in range(3)], None, path, BS, group_idx=1,
                      kv_cache_spec_kind="full_attention"),
         stored_event([engine_hash(path)], None, path, BS, group_idx=0, kv_cache_spec_kind="sliding_window",
                      kv_cache_spec_sliding_window=8)])).events, kinds=KINDS).errors
    assert own.stats().group_unmapped == 1 and own.stats().group_entries == 0  # which chunk: unknown

    native = _native()(tp)  # the compiled index keeps them alike
    assert not native.apply_events("a", 0, batch.events, kinds=KINDS).errors
    assert native.group_match(eks, "a") == compat.group_match(eks, "a")
    assert native.stats() == compat.stats()


@pytest.mark.parametrize("backend", ["python", "native"])
def test_own_hash_mode_holds_a_group_store_until_its_parent_is_known(backend: str) -> None:
    """vLLM publishes group 0 first: a sliding-window block whose parent the full group stores next waits for it;
    a block removed while waiting is never claimed."""
    path = tuple(range(1, 13))
    eks = [engine_hash(path[: 4 * (i + 1)]) for i in range(3)]
    swa = {"group_idx": 0, "kv_cache_spec_kind": "sliding_window", "kv_cache_spec_sliding_window": 8}
    full = {"group_idx": 1, "kv_cache_spec_kind": "full_attention"}
    for removed in (False, True):
        ix = BACKENDS[backend]()(TokenProcessor(BS))
        events = [stored_event(eks[1:], eks[0], path[4:], BS, **swa)]
        if removed:
            events.append(removed_event([eks[1]]) | {"group_idx": 0})
        events.append(stored_event(eks, None, path, BS, **full))
        r = ix.apply_events("a", 0, decode_vllm_batch(batch_payload(events)).events, kinds=KINDS)
        assert not r.errors
        keys = ix.token_processor.request_keys(path)
        want = [0, 0, GPU_BIT] if removed else [0, GPU_BIT, GPU_BIT]
        assert ix.group_match(keys, "a")[0] == want
        assert ix.stats().group_unmapped == 0


@pytest.mark.parametrize("backend", ["python", "native", "redis"])
def test_group_tables_are_bounded_by_the_capacity(backend: str, request: pytest.FixtureRequest) -> None:
    """Beyond the index's capacity the oldest non-primary entries are forgotten (never a false claim; on
    Redis the count is shared and the evictions this process's); a clear forgets the groups."""
    tp = TokenProcessor(BS, algorithm="vllm_sha256_cbor")
    if backend == "redis":
        from kvindex.redis_index import RedisKVBlockIndex

        ix = RedisKVBlockIndex(tp, url=request.getfixturevalue("redis_url"), capacity=4)
    else:
        ix = BACKENDS[backend]()(tp, capacity=4)
    path = tuple(range(1, 25))
    eks = [int(k) for k in tp.request_keys(path)]
    ev = stored_event(eks, None, path, BS, group_idx=0, kv_cache_spec_kind="sliding_window",
                      kv_cache_spec_sliding_window=8)
    assert not ix.apply_events("a", 0, decode_vllm_batch(batch_payload([ev])).events, kinds=KINDS).errors
    st_ = ix.stats()
    assert (st_.group_entries, st_.group_evictions) == (4, 2)
    assert ix.group_match(eks, "a")[0] == [0, 0] + [GPU_BIT] * 4  # the newest kept
    ix.clear("a")
    assert ix.stats().group_entries == 0 and ix.group_specs("a") == {} and ix.grouped_ranks("a") == []
    if backend == "redis":
        ix.client.close()


# -- the Redis backend (kvindex.redis_groups): the same model engine on a real redis-server

class RedisHybridEngines(HybridEngines):
    """The model engine's state machine on the Redis backend (group state kept in the server)."""

    url = ""  # the session server's, set by the test

    def __init__(self) -> None:
        import redis

        from kvindex.redis_index import RedisKVBlockIndex

        RuleBasedStateMachine.__init__(self)
        flush = redis.Redis.from_url(self.url)
        flush.flushall()
        flush.close()
        algo = "vllm_sha256_cbor" if self.compat else "xxh3_chain"
        self.ix = Indexer(Config.from_dict({
            "token_processor_config": {"block_size": BS, "algorithm": algo},
            "kv_block_index_config": {"backend": "redis", "redis_config": {"url": self.url}},
        }))
        self.tp = self.ix.token_processor
        self.index = self.ix.index
        assert isinstance(self.index, RedisKVBlockIndex) and isinstance(self.index, GroupAware)
        self.paths = _paths(0)
        self.held = {p: {g.group_idx: set() for g in GROUPS} for p in PODS}
        # the reference, fed the same batches, clears and report windows: the oracle of every group read
        self.ref = KVBlockIndex(self.tp)
        self.shadow = None  # the base class's shadow: self.ref is this machine's (fed through the wrappers)
        for name in ("clear", "distrust_reports"):
            setattr(self.index, name, self._both(getattr(self.index, name), getattr(self.ref, name)))

    @staticmethod
    def _both(redis_call, reference_call):
        def call(*args, **kw):
            reference_call(*args, **kw)
            return redis_call(*args, **kw)
        return call

    def publish(self, pod: str, events: list) -> None:
        super().publish(pod, events)
        r = self.ref.apply_events(pod, 0, decode_vllm_batch(batch_payload(events)).events, kinds=KINDS)
        assert not r.errors, r.errors

    def teardown(self) -> None:
        self.index.client.close()

    @invariant()
    def reads_as_the_reference(self) -> None:
        for pod in PODS:
            assert self.index.group_specs(pod) == self.ref.group_specs(pod)
            assert self.index.grouped_ranks(pod) == self.ref.grouped_ranks(pod)
            for path in self.paths:
                keys = self.tp.request_keys(path)
                assert self.index.group_match(keys, pod) == self.ref.group_match(keys, pod), (pod, path)
        a, b = self.index.stats(), self.ref.stats()
        assert (a.group_entries, a.group_unmapped, a.group_trimmed) == (b.group_entries, b.group_unmapped,
                                                                         b.group_trimmed)

    @invariant()
    def counts_its_group_entries(self) -> None:
        """The shared count of non-primary entries is what the pods' sliding-window and Mamba groups hold."""
        held = sum(len(claims[g]) for pod in PODS for g, claims in [(g, self.claims(pod)) for g in (0, 2)])
        assert self.index.stats().group_entries == held


class RedisCompatEngines(RedisHybridEngines):
    compat = True


REDIS_SETTINGS = settings(max_examples=25, stateful_step_count=25)


@pytest.mark.parametrize("machine", [RedisHybridEngines, RedisCompatEngines], ids=["own_hash", "engine_hash"])
def test_redis_backend(redis_url: str, machine: type[RedisHybridEngines]) -> None:
    machine.url = redis_url
    run_state_machine_as_test(machine, settings=REDIS_SETTINGS)


def test_redis_ignoring_group_idx_on_removal_breaks_the_property(
    redis_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Mutation check on the Redis backend: a removal sent without its group (the main tables') is caught."""
    from kvindex import redis_batch

    original = redis_batch.removal_args
    monkeypatch.setattr(redis_batch, "removal_args", lambda group_idx, bit, eks: original(None, bit, eks))
    RedisCompatEngines.url = redis_url
    with pytest.raises(AssertionError):
        run_state_machine_as_test(
            RedisCompatEngines,
            settings=settings(max_examples=200, stateful_step_count=25, database=None, phases=[Phase.generate],
                              derandomize=True),
        )


def test_two_redis_indexes_agree_on_a_hybrid_stream(redis_url: str) -> None:
    """One index ingests a hybrid engine's events; another on the same server sees the same groups, specs and
    score, which are the reference backend's."""
    from kvindex.redis_index import RedisKVBlockIndex

    tp = TokenProcessor(BS, algorithm="vllm_sha256_cbor")
    writer, reader = (RedisKVBlockIndex(tp, url=redis_url) for _ in range(2))
    reference = KVBlockIndex(tp)
    path = tuple(range(1, 17))
    eks = [int(k) for k in tp.request_keys(path)]
    swa = {"group_idx": 0, "kv_cache_spec_kind": "sliding_window", "kv_cache_spec_sliding_window": 8}
    events = [stored_event(eks[1:3], None, path, BS, **swa),  # sparse: the window before the last block
              stored_event(eks, None, path, BS, group_idx=1, kv_cache_spec_kind="full_attention"),
              stored_event([eks[2]], None, path, BS, group_idx=2, kv_cache_spec_kind="mamba"),
              removed_event([eks[3]]) | {"group_idx": 1}]
    for ix in (writer, reference):
        r = ix.apply_events("a", 0, decode_vllm_batch(batch_payload(events)).events, kinds=KINDS)
        assert not r.errors and r.unavailable is None
    cfg = {"token_processor_config": {"block_size": BS, "algorithm": "vllm_sha256_cbor"}}
    scorers = [Indexer(Config.from_dict(cfg), index=ix) for ix in (writer, reader, reference)]

    def agree(masks: dict[int, list[int]], tokens: int, limited_by: int | None) -> None:
        for ix, scorer in zip((writer, reader, reference), scorers):
            assert ix.group_match(eks, "a") == masks
            assert ix.group_specs("a") == {g.group_idx: g for g in GROUPS}
            assert ix.grouped_ranks("a") == [0]
            assert ix.stats().group_entries == sum(sum(1 for m in masks[g] if m) for g in (0, 2))
            score = scorer.score(list(path), ["a"])
            assert score.predicted_cached_tokens("a") == tokens
            assert score.prefix["a"].hybrid and score.prefix["a"].limited_by_group == limited_by

    g = GPU_BIT
    agree({0: [0, g, g, 0], 1: [g, g, g, 0], 2: [0, 0, g, 0]}, 3 * BS, None)
    # the other replica ingests the same events too (both subscribe): nothing changes
    assert not reader.apply_events("a", 0, decode_vllm_batch(batch_payload(events)).events, kinds=KINDS).errors
    agree({0: [0, g, g, 0], 1: [g, g, g, 0], 2: [0, 0, g, 0]}, 3 * BS, None)
    # a removal of one group, ingested by the other replica, never crosses into another group
    removal = decode_vllm_batch(batch_payload([removed_event([eks[2]]) | {"group_idx": 0}])).events
    for ix in (reader, reference):
        assert not ix.apply_events("a", 0, removal, kinds=KINDS).errors
    agree({0: [0, g, 0, 0], 1: [g, g, g, 0], 2: [0, 0, g, 0]}, 0, 0)
    for ix in (writer, reader):
        ix.client.close()


@pytest.mark.parametrize("algo", ["xxh3_chain", "vllm_sha256_cbor"])
def test_the_compiled_read_path_bounds_hybrid_pods_only(algo: str) -> None:
    """score() on the compiled backend (one-call token match) equals the reference's: a hybrid pod whose
    sliding-window group lost its trailing blocks is cut to the rule's hit, a plain pod keeps its match."""
    _native()
    path = tuple(range(1, 6 * BS + 3))
    swa = {"group_idx": 0, "kv_cache_spec_kind": "sliding_window", "kv_cache_spec_sliding_window": 8}
    full = {"group_idx": 1, "kv_cache_spec_kind": "full_attention"}
    ixs = [Indexer(Config.from_dict({"token_processor_config": {"block_size": BS, "algorithm": algo},
                                     "kv_block_index_config": {"backend": b}})) for b in ("python", "native")]
    tp = ixs[0].token_processor
    eks = [int(k) for k in tp.request_keys(path)] if algo != "xxh3_chain" else [
        engine_hash(path[: (i + 1) * BS]) for i in range(6)]
    batches = {
        "hybrid": [stored_event(eks, None, path[: 6 * BS], BS, **full),
                   stored_event(eks, None, path[: 6 * BS], BS, **swa),
                   removed_event(eks[3:5]) | {"group_idx": 0}],
        "plain": [stored_event(eks, None, path[: 6 * BS], BS)],
    }
    scores = []
    for ix in ixs:
        for pod, events in batches.items():
            batch = decode_vllm_batch(batch_payload(events))
            assert not ix.index.apply_events(pod, 0, batch.events, kinds=KINDS).errors
        assert ix._token_match == (ix.index is ixs[1].index)  # the compiled backend reads in one call
        scores.append(ix.score(list(path), ["hybrid", "plain"]))
    ref, nat = scores
    assert nat.prefix == ref.prefix and nat.pod == ref.pod
    # the window (2 blocks) must end at a hit: blocks 3 and 4 are gone, so the hit ends after block 2 (12 tokens)
    assert nat.predicted_cached_tokens("hybrid") == 3 * BS and nat.prefix["hybrid"].limited_by_group == 0
    assert nat.prefix["hybrid"].hybrid and not nat.prefix["plain"].hybrid
    assert nat.predicted_cached_tokens("plain") == 6 * BS


def test_the_compiled_batch_apply_routes_odd_groups_as_the_reference() -> None:
    """Events the core must leave to Python: a removal naming a negative or unknown group while no primary
    group is known, a store without group_idx beside grouped ones, a clear of a grouped stream."""
    path = tuple(range(1, 2 * BS + 1))
    tp = TokenProcessor(BS, algorithm="vllm_sha256_cbor")
    eks = [int(k) for k in tp.request_keys(path)]
    swa = {"group_idx": 0, "kv_cache_spec_kind": "sliding_window", "kv_cache_spec_sliding_window": 8}
    batches = [
        [BlockStored(tuple(eks), None, path, BS, GPU, **swa), BlockStored(tuple(eks), None, path, BS, GPU)],
        [BlockRemoved((eks[0],), GPU, group_idx=-1), BlockRemoved((eks[1],), GPU, group_idx=5)],
        [BlockStored(tuple(eks), None, path, BS, GPU, group_idx=1, kv_cache_spec_kind="full_attention"),
         BlockRemoved((eks[1],), GPU, group_idx=1), BlockRemoved((eks[0],), GPU, group_idx=0)],
        [AllBlocksCleared(), BlockStored(tuple(eks), None, path, BS, GPU, group_idx=1)],
    ]
    ref, nat = KVBlockIndex(tp), _native()(tp)
    for events in batches:
        assert nat.apply_events("a", 0, events, kinds=KINDS) == ref.apply_events("a", 0, events, kinds=KINDS)
        assert nat.stats() == ref.stats()
        assert nat.group_match(eks, "a") == ref.group_match(eks, "a")
        assert nat.prefix_match(eks) == ref.prefix_match(eks)
    assert nat.prefix_match(eks) == {"a": [GPU_BIT, GPU_BIT]}
