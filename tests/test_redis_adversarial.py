"""The Redis backends under hostile names, server-side errors and expiry, on a real redis-server.

1. Names that collide with the key layout (':', '{', '}', spaces, unicode,
   empty strings) for pods and models, DP ranks from -2**63 to 2**64, and
   engine keys in every vLLM hash form (0, >= 2**63, negative int64): the
   Redis index answers every read as the reference does (hypothesis).
2. A server that answers with an error instead of data (BUSY: another client's
   script runs too long; OOM: maxmemory reached) is an outage: ``score()``
   answers without prefix information, writes raise IndexUnavailable (the
   write path then rebuilds the stream), nothing else escapes.
3. Held entries that expired on the server (``held_ttl``) leave no pod behind
   in ``pods()`` (which the facade takes as its candidates).
4. ``drop_all`` deletes only its own prefix's keys, whatever characters the
   prefix holds (SCAN patterns are globs).
5. The decode-retained store in Redis during an outage answers as an empty
   store (the P/D planner recomputes) and never raises; it works again when
   the server is back.
6. A slow server (a call outlives ``socket_timeout``): the client does not
   send the call again, so a script that is not idempotent (``add_held``)
   runs at most once.
7. Any conversation id (lone surrogates included) and the ttl bounds of the
   retained store.
8. A server restarted empty hands model ids out again: a write with an id
   this process learned before never lands under another model's id.
"""

from __future__ import annotations

import itertools
import threading
import time

import hypothesis.strategies as st
import pytest
import redis
from hypothesis import HealthCheck, given, settings

from kvindex.facade import Config, Indexer
from kvindex.reference import KVBlockIndex
from kvindex.contract import IndexUnavailable
from kvindex.redis_index import RedisKVBlockIndex
from kvindex.tiers import DECODE_RETAINED, tier_bit
from scorer.load import LoadSnapshot
from tests.test_native_index import BS, U

_prefixes = itertools.count()

NAMES = st.sampled_from(["", ":", "a:b", "r:0:a", "{x}", "}{", "a b", "~", "-1", "ünï😀", "x" * 300]) | st.text(
    max_size=6
)
INT64 = st.sampled_from([0, 1, 2**63 - 1, 2**63, 2**64 - 1, -1, -(2**63)]) | st.integers(-(2**63), 2**64 - 1)


# -- 1. hostile names, ranks and engine keys


@settings(max_examples=30, deadline=None, suppress_health_check=list(HealthCheck))
@given(
    steps=st.lists(
        st.tuples(
            st.sampled_from(["store", "store", "offload", "remove", "clear_rank", "clear_model", "held"]),
            NAMES, st.none() | NAMES, st.sampled_from([0, 1, -1, 2**63, -(2**63), 2**64]),
            st.integers(0, len(U.paths) - 1), st.integers(1, 4), st.sampled_from(["gpu", "cpu"]), INT64,
        ),
        min_size=1, max_size=12,
    )
)
def test_hostile_names_ranks_and_keys_read_as_the_reference(redis_url, steps):
    ref = KVBlockIndex(U.tp)
    rd = RedisKVBlockIndex(U.tp, url=redis_url, key_prefix=f"adv{next(_prefixes)}:")
    pods: set[str] = set()
    models: set[str | None] = {None}
    for kind, pod, model, rank, path, n, tier, salt in steps:
        pods.add(pod)
        models.add(model)
        eks = [U.ek(path, k) ^ salt if salt >= 0 else -((U.ek(path, k) ^ -salt) % 2**63) for k in range(n)]
        for ix in (ref, rd):
            if kind == "store":
                ix.block_stored(pod, rank, eks, None, list(U.tokens(path, 0, n)), tier, block_size=BS, model=model)
            elif kind == "offload":
                ix.block_stored(pod, rank, eks[-1:], None, None, tier, model=model)
            elif kind == "remove":
                ix.block_removed(pod, rank, eks[-1:], tier, model=model)
            elif kind == "clear_rank":
                ix.clear(pod, rank)
            elif kind == "clear_model":
                ix.clear(pod, model=model)
            else:
                ix.add_held(pod, U.tp.request_keys(list(U.paths[path]), model=model)[:n], "decode_retained")
        assert rd.pods() == ref.pods()
    for p in range(len(U.paths)):
        for model in models:
            keys = U.tp.request_keys(list(U.paths[p]), model=model)
            assert rd.prefix_match(keys) == ref.prefix_match(keys)
            assert rd.prefix_match(keys, sorted(pods)) == ref.prefix_match(keys, sorted(pods))
            assert rd.lookup(keys) == ref.lookup(keys)
            for pod in pods:
                assert rd.best_dp_rank(pod, keys) == ref.best_dp_rank(pod, keys)
    for pod in pods:
        assert rd.pod_keys(pod) == ref.pod_keys(pod)
    assert rd.models() == ref.models()
    a, b = ref.stats(), rd.stats()
    assert (a.keys, a.entries, a.engine_keys, a.pods) == (b.keys, b.entries, b.engine_keys, b.pods)


# -- 2. errors in place of answers


@pytest.fixture
def admin(redis_url):
    client = redis.Redis.from_url(redis_url)
    try:
        yield client
    finally:
        client.config_set("maxmemory", 0)
        client.config_set("busy-reply-threshold", 5000)
        client.close()


def _loaded(redis_url):
    ix = RedisKVBlockIndex(U.tp, url=redis_url, key_prefix=f"err{next(_prefixes)}:", retry_interval=0.05,
                           socket_timeout=5.0)
    indexer = Indexer(Config.from_dict({"token_processor_config": {"block_size": BS, "hash_seed": 11},
                                        "scorer_config": {"picker": "weighted"}}), index=ix)
    ix.block_stored("a", 0, [U.ek(0, k) for k in range(6)], None, list(U.tokens(0, 0, 6)), "gpu", block_size=BS)
    return ix, indexer


def _degraded(ix, indexer):
    """score() and every read answer without prefix information; writes raise IndexUnavailable."""
    loads = {"a": LoadSnapshot(waiting=4), "b": LoadSnapshot()}
    time.sleep(0.06)  # past the retry interval: the server itself is asked
    s = indexer.score(list(U.paths[0]), ["a", "b"], loads=loads)
    assert all(p.matched_blocks == 0 for p in s.prefix.values()) and s.pod == "b"
    time.sleep(0.06)
    assert ix.prefix_match(U.request_keys(0)) == {}
    time.sleep(0.06)
    with pytest.raises(IndexUnavailable):
        ix.block_stored("a", 0, [U.ek(1, 0)], None, list(U.tokens(1, 0, 1)), "gpu", block_size=BS)
    time.sleep(0.06)
    with pytest.raises(IndexUnavailable):
        ix.clear("a")
    time.sleep(0.06)
    assert not ix.writable()
    assert ix.stats().redis_errors >= 4


def test_out_of_memory_server_is_an_outage(redis_url, admin):
    ix, indexer = _loaded(redis_url)
    admin.config_set("maxmemory", 1)
    _degraded(ix, indexer)
    admin.config_set("maxmemory", 0)
    time.sleep(0.06)
    assert ix.writable()
    assert indexer.score(list(U.paths[0]), ["a"]).prefix["a"].matched_blocks == 6


def test_busy_server_is_an_outage(redis_url, admin):
    ix, indexer = _loaded(redis_url)
    admin.config_set("busy-reply-threshold", 50)
    started = threading.Event()

    def long_script():
        c = redis.Redis.from_url(redis_url)
        started.set()
        # a read-only script busy for up to 30 s (server clock): other clients get BUSY until SCRIPT KILL
        try:
            c.eval("local t = redis.call('TIME') local s = t[1] * 1000000 + t[2] "
                   "while true do local u = redis.call('TIME') if u[1] * 1000000 + u[2] - s > 30000000 then break end "
                   "end return 1", 0)
        except redis.exceptions.ResponseError:
            pass  # killed
        finally:
            c.close()

    th = threading.Thread(target=long_script)
    th.start()
    started.wait()
    deadline = time.monotonic() + 20
    while True:  # until the server answers BUSY
        try:
            admin.ping()
        except redis.exceptions.ResponseError:
            break
        assert time.monotonic() < deadline, "the long script did not start"
        time.sleep(0.01)
    try:
        _degraded(ix, indexer)
    finally:
        try:
            admin.script_kill()
        except redis.exceptions.ResponseError:
            pass  # it had ended
        th.join()
    time.sleep(0.06)
    assert ix.writable()


# -- 3. held entries expired on the server


def test_expired_held_entries_leave_no_pod(redis_url):
    ix = RedisKVBlockIndex(U.tp, url=redis_url, key_prefix=f"held{next(_prefixes)}:", held_ttl=0.1)
    ix.add_held("d", U.request_keys(0), "decode_retained")
    assert ix.pods() == {"d"}
    time.sleep(0.3)
    assert ix.prefix_match(U.request_keys(0)) == {}
    assert ix.pods() == frozenset()


# -- 4. drop_all and glob characters


@settings(max_examples=20, deadline=None, suppress_health_check=list(HealthCheck))
# any text a key prefix may be (the constructor rejects NUL: tested in its own test)
@given(prefix=st.sampled_from(["kv?:", "kv*:", "kv[ab]:", "kv\\", "k[^x]:", "*"])
       | st.text(st.characters(blacklist_characters="\0"), min_size=1, max_size=5))
def test_drop_all_deletes_only_its_prefix(redis_url, prefix):
    client = redis.Redis.from_url(redis_url)
    client.flushall()
    others = ["kvA:x", "kva:x", "kv\\x", "kvv:x", "other", prefix[:-1] + "Z" + "x"]
    others = [o for o in others if not o.startswith(prefix)]
    for o in others:
        client.set(o, 1)
    ix = RedisKVBlockIndex(U.tp, client=client, key_prefix=prefix)
    ix.block_stored("a", 0, [U.ek(0, 0)], None, list(U.tokens(0, 0, 1)), "gpu", block_size=BS)
    mine = [k for k in client.keys() if k.startswith(prefix.encode())]
    assert ix.drop_all() == len(mine)
    assert all(client.exists(o) for o in others)
    assert not [k for k in client.keys() if k.startswith(prefix.encode())]



@pytest.mark.parametrize("prefix", ["", "\0", "kv\0:"])
def test_a_key_prefix_that_is_empty_or_holds_nul_is_refused(redis_url, prefix):
    client = redis.Redis.from_url(redis_url)
    with pytest.raises(ValueError, match="key_prefix"):
        RedisKVBlockIndex(U.tp, client=client, key_prefix=prefix)

# -- 5. the decode-retained store during an outage


def test_retained_store_answers_as_empty_during_an_outage():
    from connector.planner import PDPlanner
    from connector.redis_retained import RedisRetainedStore
    from tests.redis_server import RedisServer
    from tests.test_connector_retained import d_params

    tokens = list(U.paths[0])
    keys = U.request_keys(0)
    with RedisServer() as server:
        ix = RedisKVBlockIndex(U.tp, url=server.url, retry_interval=0.05, socket_timeout=0.5)
        store = RedisRetainedStore(ix, url=server.url, retry_interval=0.05, socket_timeout=0.5)
        planner = PDPlanner(ix, U.tp, store, recompute_threshold=1)
        store.put("c1", "d0", d_params(len(tokens)), tokens, keys)
        assert store.get("c1") is not None

        server.stop()
        for _ in range(2):  # the first calls find the server gone; the next ones fail fast
            assert store.get("c1") is None and store.take("c1") is None and "c1" not in store
            assert store.discard("c1") is False and store.expire() == 0
            assert len(store) == 0 and store.conversations() == []
            entry = store.put("c2", "d0", d_params(len(tokens)), tokens, keys)  # returned, not stored
            assert entry.conversation_id == "c2" and entry.request_keys == tuple(keys)
            plan = planner.plan("c1", tokens + [7] * BS, ["p0"], ["d0"])
            assert plan.action == "recompute"
            time.sleep(0.06)
        assert store.stats().redis_errors >= 10

        server.start()
        deadline = time.monotonic() + 20
        while not ix.writable():
            assert time.monotonic() < deadline
            time.sleep(0.02)
        time.sleep(0.06)
        store.put("c3", "d0", d_params(len(tokens)), tokens, keys)
        assert ix.prefix_match(keys) == {"d0": [tier_bit(DECODE_RETAINED)] * len(keys)}
        assert store.take("c3") is not None and ix.prefix_match(keys) == {}


# -- 6. a slow server: a call that timed out is not sent again


def _hold_server(url: str, seconds: float) -> threading.Thread:
    """Another client's read-only script keeps the server busy ``seconds`` (no BUSY error: below the threshold)."""
    us = int(seconds * 1e6)

    def run():
        c = redis.Redis.from_url(url)
        c.eval("local t = redis.call('TIME') local s = t[1] * 1000000 + t[2] while true do "
               f"local u = redis.call('TIME') if u[1] * 1000000 + u[2] - s > {us} then break end end return 1", 0)
        c.close()

    th = threading.Thread(target=run)
    th.start()
    return th


def test_a_timed_out_call_runs_once(redis_url):
    admin = redis.Redis.from_url(redis_url)
    for attempt in range(3):
        ix = RedisKVBlockIndex(U.tp, url=redis_url, key_prefix=f"slow{next(_prefixes)}:", socket_timeout=0.2,
                               retry_interval=0.0)
        ix.add_held("x", [1], "gpu")  # connected, scripts loaded
        th = _hold_server(redis_url, 0.35)
        time.sleep(0.03)
        try:
            ix.add_held("d", [5], "decode_retained")  # outlives socket_timeout: its outcome is unknown to us
        except IndexUnavailable:
            pass
        th.join()
        time.sleep(0.2)
        # applied once at most: one remove_held ends it
        assert admin.hget(ix.key_prefix + "hc:d", "5:" + str(tier_bit(DECODE_RETAINED))) in (None, b"1")
        assert ix.remove_held("d", [5], "decode_retained") in (0, 1)
        assert ix.prefix_match([5], ["d"]) == {}
    admin.close()


# -- 7. conversation ids and TTLs the retained store must take


@settings(max_examples=25, deadline=None, suppress_health_check=list(HealthCheck))
@given(cids=st.lists(
    st.text(max_size=8) | st.sampled_from(["", "rz", "r:x", "{c}", "*", "a b", "x" * 5000])
    # aiohttp decodes undecodable header bytes to lone surrogates (x-conversation-id: a\xff -> 'a\udcff')
    | st.text(alphabet=st.characters(min_codepoint=0xD800, max_codepoint=0xDFFF), min_size=1, max_size=3)
    | st.builds(lambda a, b: a + b, st.text(max_size=3), st.sampled_from(["\udcff", "\ud800", "\udfff"])),
    min_size=1, max_size=4, unique=True,
))
def test_retained_store_takes_any_conversation_id(redis_url, cids):
    from connector.redis_retained import RedisRetainedStore
    from connector.retained import RetainedStore
    from tests.test_connector_retained import d_params

    tokens = list(U.paths[0])
    keys = U.request_keys(0)
    ix = RedisKVBlockIndex(U.tp, url=redis_url, key_prefix=f"cid{next(_prefixes)}:")
    ref = RetainedStore(KVBlockIndex(U.tp))
    store = RedisRetainedStore(ix, url=redis_url, key_prefix=ix.key_prefix + "retained:")
    for s in (ref, store):
        for cid in cids:
            assert s.put(cid, "d0", d_params(len(tokens)), tokens, keys).conversation_id == cid
    assert sorted(store.conversations()) == sorted(ref.conversations()) == sorted(cids)
    for cid in cids:
        assert cid in store and store.get(cid).conversation_id == cid
        got = store.take(cid)
        want = ref.take(cid)
        assert got is not None and (got.conversation_id, got.request_keys, got.tokens) == (
            want.conversation_id, want.request_keys, want.tokens)
        assert store.take(cid) is None and cid not in store
    assert ix.prefix_match(keys) == {}


def test_retained_store_ttl_bounds(redis_url):
    from connector.redis_retained import RedisRetainedStore
    from tests.test_connector_retained import d_params

    for bad in (0.0, -1.0, float("nan"), float("inf"), 1e17):
        with pytest.raises(ValueError):
            RedisRetainedStore(url=redis_url, ttl=bad)
    with pytest.raises(ValueError):
        RedisRetainedStore(url=redis_url, grace=float("inf"))
    tokens = list(U.paths[0])
    store = RedisRetainedStore(url=redis_url, key_prefix=f"ttl{next(_prefixes)}:", ttl=3e8)  # ~10 years
    entry = store.put("c", "d0", d_params(len(tokens)), tokens, U.request_keys(0))
    assert store.take("c") == entry


# -- 8. model ids learned before the server lost its data


def test_model_ids_from_before_a_restart_are_never_written():
    from tests.redis_server import RedisServer

    def store(ix, pod, path, model):
        ix.block_stored(pod, 0, [U.ek(path, 0)], None, list(U.tokens(path, 0, 1)), "gpu", block_size=BS, model=model)

    ref = KVBlockIndex(U.tp)
    store(ref, "p", 1, "B")
    with RedisServer() as server:
        a = RedisKVBlockIndex(U.tp, url=server.url, retry_interval=0.05)
        for m in ("A", "B"):
            store(a, "p", 0, m)  # a learns ids A=1, B=2
        server.stop()
        server.start()  # empty
        try:
            store(a, "p", 1, "B")  # refused (the write path rebuilds the stream) or written under B's new id
        except IndexUnavailable:
            pass
        c = RedisKVBlockIndex(U.tp, url=server.url)
        store(c, "q", 2, "X")
        store(c, "q", 3, "Y")  # ids 1 and 2 again, on the new server
        assert c.request_key_of(U.ek(1, 0), "Y") is None  # B's block never lands under Y's id
        assert c.clear("p", model="Y") == 0
        time.sleep(0.06)
        assert a.writable()
        store(a, "p", 1, "B")
        want = ref.request_key_of(U.ek(1, 0), "B")
        assert a.request_key_of(U.ek(1, 0), "B") == c.request_key_of(U.ek(1, 0), "B") == want
        assert c.pod_keys("p") == {want}
