"""The decode-retained store in Redis (connector.redis_retained) on a real redis-server.

- It behaves as the in-memory store where both are specified: put, use once,
  replace, discard, the index mirror (tier decode_retained) appears with the
  entry and goes with it.
- A second replica (another store object with its own client, and another
  process) takes the entry turn 1 stored.
- Two replicas taking the same entry at once: exactly one gets it (many rounds,
  with a barrier); with max_uses 2, exactly two.
- Entries expire with their TTL (server clock), and their index mirror goes.
"""

from __future__ import annotations

import itertools
import subprocess
import sys
import threading
import time

import msgspec
import pytest

from connector.redis_retained import RedisRetainedStore
from connector.retained import RetainedStore
from kvindex.reference import KVBlockIndex
from kvindex.keys import TokenProcessor
from kvindex.redis_index import RedisKVBlockIndex
from kvindex.tiers import DECODE_RETAINED, tier_bit
from tests.test_connector_retained import BS, d_params

_prefixes = itertools.count()
TP = TokenProcessor(block_size=BS)
TOKENS = list(range(1, 40))


def stores(url: str, n: int = 2, **kw) -> list[RedisRetainedStore]:
    prefix = f"ret{next(_prefixes)}:"
    return [RedisRetainedStore(url=url, key_prefix=prefix, **kw) for _ in range(n)]


def test_same_behaviour_as_the_in_memory_store(redis_url):
    keys = TP.request_keys(TOKENS).tolist()
    idx_prefix = f"retix{next(_prefixes)}:"
    for store in (
        RetainedStore(KVBlockIndex(TP)),
        RedisRetainedStore(RedisKVBlockIndex(TP, url=redis_url, key_prefix=idx_prefix), url=redis_url,
                           key_prefix=f"ret{next(_prefixes)}:"),
    ):
        index = store.index
        entry = store.put("c1", "d0", d_params(len(TOKENS)), TOKENS, keys)
        assert entry.tokens == tuple(TOKENS) and entry.request_keys == tuple(keys) and entry.uses_left == 1
        assert entry.expiry == pytest.approx(entry.created + 450.0)
        assert index.prefix_match(keys) == {"d0": [tier_bit(DECODE_RETAINED)] * len(keys)}
        assert "c1" in store and store.get("c1") == entry and store.conversations() == ["c1"]
        got = store.take("c1")
        assert got == entry
        assert store.take("c1") is None and "c1" not in store
        assert index.prefix_match(keys) == {}
        store.put("c2", "d0", d_params(len(TOKENS)), TOKENS, keys)
        store.put("c2", "d1", d_params(len(TOKENS)), TOKENS, keys)  # replaces
        assert set(index.prefix_match(keys)) == {"d1"}
        assert store.discard("c2") and not store.discard("c2")
        assert index.prefix_match(keys) == {}
        s = store.stats()
        assert (s.entries, s.stored, s.replaced, s.used_up, s.discarded) == (0, 3, 1, 1, 1)
        with pytest.raises(ValueError):
            store.put("c3", "d0", d_params(len(TOKENS) + 5), TOKENS, keys)


def test_another_replica_takes_turn_two(redis_url):
    a, b = stores(redis_url)
    keys = TP.request_keys(TOKENS).tolist()
    entry = a.put("conv", "d0", d_params(len(TOKENS), "req-1"), TOKENS, keys)
    got = b.take("conv")
    assert got == entry and got.params.remote_request_id == "req-1"
    assert a.take("conv") is None
    # and from another process
    a.put("conv2", "d0", d_params(len(TOKENS), "req-2"), TOKENS, keys)
    code = (
        "import sys, msgspec\n"
        "from connector.redis_retained import RedisRetainedStore\n"
        f"s = RedisRetainedStore(url={redis_url!r}, key_prefix={a.key_prefix!r})\n"
        "e = s.take('conv2')\n"
        "print(msgspec.json.encode(None if e is None else [e.decode_pod, e.params.remote_request_id, "
        "list(e.tokens)]).decode())\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert msgspec.json.decode(out.stdout) == ["d0", "req-2", TOKENS]
    assert a.get("conv2") is None and b.take("conv2") is None


@pytest.mark.parametrize("max_uses", [1, 2])
def test_concurrent_takes_give_each_use_to_one_replica(redis_url, max_uses):
    replicas = stores(redis_url, 4, max_uses=max_uses)
    keys = TP.request_keys(TOKENS).tolist()
    rounds = 40
    barrier = threading.Barrier(len(replicas))
    got: list[list[int]] = [[] for _ in range(rounds)]
    lock = threading.Lock()

    def worker(store: RedisRetainedStore) -> None:
        for r in range(rounds):
            barrier.wait()
            if store is replicas[0]:
                store.put(f"c{r}", "d0", d_params(len(TOKENS)), TOKENS, keys)
            barrier.wait()
            e = store.take(f"c{r}")
            if e is not None:
                with lock:
                    got[r].append(e.uses_left)

    threads = [threading.Thread(target=worker, args=(s,)) for s in replicas]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert all(sorted(g) == list(range(1, max_uses + 1)) for g in got), got
    assert len(replicas[0]) == 0


def test_entries_expire_with_their_ttl(redis_url):
    index = RedisKVBlockIndex(TP, url=redis_url, key_prefix=f"retix{next(_prefixes)}:")
    prefix = f"ret{next(_prefixes)}:"
    a = RedisRetainedStore(index, url=redis_url, key_prefix=prefix, ttl=0.3, grace=5.0)
    b = RedisRetainedStore(index, url=redis_url, key_prefix=prefix, ttl=0.3, grace=5.0)
    keys = TP.request_keys(TOKENS).tolist()
    a.put("c", "d0", d_params(len(TOKENS)), TOKENS, keys)
    assert b.get("c") is not None and index.prefix_match(keys)
    time.sleep(0.5)
    assert b.get("c") is None and b.take("c") is None and len(a) == 0  # past its expiry: never returned
    assert b.expire() == 0  # take already ran the expiry and took the mirror out of the index
    assert index.prefix_match(keys) == {}
    assert a.stats().expired + b.stats().expired == 1
    # with no router left, the server drops the key itself after ttl + grace
    c = RedisRetainedStore(url=redis_url, key_prefix=f"ret{next(_prefixes)}:", ttl=0.2, grace=0.1)
    c.put("gone", "d0", d_params(len(TOKENS)), TOKENS, keys)
    time.sleep(0.6)
    assert c.client.exists(c.key_prefix + "r:gone") == 0
