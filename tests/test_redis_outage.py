"""A Redis outage: reads degrade to load-only choices, writes are counted and repaired, the index recovers.

Each test runs its own redis-server (tests/redis_server.py), stops it, and
starts it again on the same port.  Persistence is off, so the server comes
back empty: the index notices (its epoch key is gone) and the write path
rebuilds every stream from the engines' replay buffers.
"""

from __future__ import annotations

import time

import pytest

from examples.simfleet.engine import SimEngine
from kvindex.facade import Config, Indexer
from kvindex.contract import IndexUnavailable
from kvindex.redis_index import RedisKVBlockIndex
from scorer.load import LoadSnapshot
from tests.redis_server import RedisServer
from tests.test_native_index import BS, U
from tests.test_redis_replicas import engine_prefix, prompts


@pytest.fixture
def server():
    srv = RedisServer().start()
    try:
        yield srv
    finally:
        srv.close()


def wait(cond, timeout: float = 30.0, what: str = "") -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


def test_index_degrades_and_recovers(server):
    ix = RedisKVBlockIndex(U.tp, url=server.url, retry_interval=0.1, socket_timeout=0.5)
    indexer = Indexer(Config.from_dict({"token_processor_config": {"block_size": BS, "hash_seed": 11},
                                        "scorer_config": {"picker": "weighted"}}), index=ix)
    eks = [U.ek(0, k) for k in range(6)]
    ix.block_stored("a", 0, eks, None, list(U.tokens(0, 0, 6)), "gpu", block_size=BS)
    tokens = list(U.paths[0])
    loads = {"a": LoadSnapshot(waiting=4, kv_usage=0.5), "b": LoadSnapshot()}
    before = indexer.score(tokens, ["a", "b"], loads=loads)
    assert before.prefix["a"].matched_blocks == 6 and before.pod == "a"

    server.stop()
    during = indexer.score(tokens, ["a", "b"], loads=loads)  # never raises
    assert all(p.matched_blocks == 0 for p in during.prefix.values())
    assert during.pod == "b"  # load alone decides
    assert ix.prefix_match(U.request_keys(0)) == {} and ix.lookup(U.request_keys(0)[:2]) == [(), ()]
    assert ix.best_dp_rank("a", U.request_keys(0)) is None and ix.pods() == frozenset()
    ix.add_speculative(U.request_keys(0), "b", 5.0)  # dropped, not raised
    with pytest.raises(IndexUnavailable):
        ix.block_stored("a", 0, eks, None, list(U.tokens(0, 0, 6)), "gpu", block_size=BS)
    with pytest.raises(IndexUnavailable):
        ix.block_removed("a", 0, eks, "gpu")
    with pytest.raises(IndexUnavailable):
        ix.clear("a")
    st = ix.stats()
    assert st.redis_errors >= 8 and st.dropped_writes == 4
    assert not ix.writable()

    server.start()
    wait(ix.writable, what="the server")
    assert ix.generation == 1  # it came back empty, and the index noticed
    assert ix.prefix_match(U.request_keys(0)) == {}
    ix.block_stored("a", 0, eks, None, list(U.tokens(0, 0, 6)), "gpu", block_size=BS)
    assert indexer.score(tokens, ["a", "b"], loads=loads).prefix["a"].matched_blocks == 6


def test_write_path_rebuilds_after_an_outage(server):
    engines = [
        SimEngine(pod=p, endpoint="tcp://127.0.0.1:*", replay_endpoint="tcp://127.0.0.1:*", capacity_blocks=40,
                  block_size=16)
        for p in ("pod-a", "pod-b")
    ]
    import random

    rnd = random.Random(3)
    work = prompts(rnd, 40)
    cfg = Config.from_dict({
        "model_name": "sim-model",
        "kv_block_index_config": {"backend": "redis", "redis_config": {
            "url": server.url, "retry_interval": 0.1, "socket_timeout": 0.5}},
        "kv_events_config": {"engines": [
            {"pod": e.stats().pod, "endpoint": e.endpoint, "replay_endpoint": e.replay_endpoint} for e in engines]},
    })
    pods = ["pod-a", "pod-b"]

    def caught_up() -> bool:
        last = {p: s for p, _r, s in ix.pool.streams()}
        return all(last.get(e.stats().pod) == e.stats().next_seq - 1 for e in engines)

    def matches_engines() -> None:
        for tokens in work:
            got = {p: v.matched_blocks for p, v in ix.score(tokens, pods).prefix.items()}
            assert got == {e.stats().pod: engine_prefix(e, tokens) for e in engines}

    try:
        with Indexer(cfg) as ix:
            for tokens in work[:15]:
                rnd.choice(engines).serve(tokens)
            wait(caught_up, what="live events")
            assert ix.flush(30)
            matches_engines()
            assert all(s.complete for s in ix.completeness())

            server.stop()
            for tokens in work[15:30]:
                engines[0].serve(tokens)  # pod-a's events cannot be written
            wait(lambda: ix.stats().events.index_unavailable > 0, what="a refused write")
            wait(caught_up, what="pod-a's events")
            states = {s.pod: s.complete for s in ix.completeness()}
            assert states["pod-a"] is False
            s = ix.score(work[0], pods)  # never raises: no prefix information
            assert all(p.matched_blocks == 0 for p in s.prefix.values())
            assert ix.stats().index.redis_errors > 0

            server.start()  # empty: both pods' streams are rebuilt from the engines' buffers
            wait(lambda: ix.stats().events.rebuilds >= 2 and all(s.complete for s in ix.completeness()),
                 what="the rebuild")
            assert ix.flush(30)
            matches_engines()
            for tokens in work[30:]:
                rnd.choice(engines).serve(tokens)
            wait(caught_up, what="live events after the outage")
            assert ix.flush(30)
            matches_engines()
    finally:
        for e in engines:
            e.close()
