"""The Redis index's binary keys and its layout marker (docs/design.md, "Redis layout").

An index written by an older kvindex (decimal keys, one ``pm:<pod>`` hash per
pod, no ``layout`` key) must not be misread: every call raises
:class:`kvindex.redis_index.LayoutMismatch` until its keys are deleted.
"""

from __future__ import annotations

import hypothesis.strategies as st
import pytest
import redis
from hypothesis import given

from kvindex.keys import TokenProcessor
from kvindex.redis_batch import from_k8, k8, k8s
from kvindex.redis_index import LAYOUT, LayoutMismatch, RedisKVBlockIndex

KEYS = st.integers(-(2**63), 2**64 - 1) | st.sampled_from([0, 255 << 56, (255 << 56) - 1, 2**64 - 1, -1, -(2**63)])


@given(st.lists(KEYS, max_size=20))
def test_binary_keys_round_trip_and_split(keys):
    one = k8s(keys)
    assert one == b"".join(map(k8, keys))
    # the scripts split a string of keys by its first byte: 255 starts a 10-byte key, any other an 8-byte one
    out, i = [], 0
    while i < len(one):
        w = 10 if one[i] == 255 else 8
        out.append(from_k8(one[i:i + w]))
        i += w
    assert out == keys


@pytest.mark.parametrize("bad", [2**64, -(2**63) - 1])
def test_keys_outside_the_hash_range_are_refused(bad):
    with pytest.raises(ValueError):
        k8(bad)
    with pytest.raises(ValueError):
        k8s([1, bad])


def _index(url: str, prefix: str = "kvindex:{t}:") -> RedisKVBlockIndex:
    return RedisKVBlockIndex(TokenProcessor(block_size=4), url=url, key_prefix=prefix)


def test_a_fresh_index_is_marked_and_reopens(redis_url):
    ix = _index(redis_url)
    assert ix.block_stored("p", 0, [7], None, [1, 2, 3, 4], "gpu") == 1
    client = redis.Redis.from_url(redis_url)
    assert client.get("kvindex:{t}:layout") == LAYOUT
    again = _index(redis_url)
    assert again.pod_keys("p") == ix.pod_keys("p") and len(again.pod_keys("p")) == 1


def test_an_old_layout_raises_until_dropped(redis_url):
    client = redis.Redis.from_url(redis_url)
    # what a version-1 index leaves: the epoch token, decimal keys, no layout key
    client.set("kvindex:{t}:epoch", "0123")
    client.hset("kvindex:{t}:pm:p", "123", "1")
    ix = _index(redis_url)
    with pytest.raises(LayoutMismatch, match="layout 1"):
        ix.prefix_match([123])
    with pytest.raises(LayoutMismatch):
        ix.block_stored("p", 0, [7], None, [1, 2, 3, 4], "gpu")
    other = _index(redis_url, "kvindex:{other}:")  # another prefix on the same server is not concerned
    assert other.block_stored("p", 0, [7], None, [1, 2, 3, 4], "gpu") == 1
    assert ix.drop_all() >= 2
    assert not client.keys("kvindex:{t}:*")
    assert ix.block_stored("p", 0, [7], None, [1, 2, 3, 4], "gpu") == 1
    assert client.get("kvindex:{t}:layout") == LAYOUT


def test_a_newer_layout_raises(redis_url):
    redis.Redis.from_url(redis_url).set("kvindex:{t}:layout", "99")
    with pytest.raises(LayoutMismatch, match="layout 99"):
        _index(redis_url).pods()
