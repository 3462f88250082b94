"""Which pod a message is filed under: the subscription's configured pod, else the topic's."""

from __future__ import annotations

import hypothesis.strategies as st
from hypothesis import given, settings

from kvevents.pool import _TOPIC_CACHE, EventPool, RawMessage, Source
from kvevents.wire import parse_topic
from kvindex.reference import KVBlockIndex
from kvindex.keys import TokenProcessor
from tests.oracle import batch_payload, seq_frame, stored_event

BS = 4
TOKENS = list(range(1, 9))


def run(source: Source, topic: bytes) -> tuple[KVBlockIndex, EventPool]:
    index = KVBlockIndex(TokenProcessor(block_size=BS))
    pool = EventPool(index, concurrency=1)
    with pool:
        pool.submit(RawMessage(source, topic, seq_frame(0), batch_payload([stored_event([1, 2], None, TOKENS, BS)])))
        assert pool.flush(10)
    return index, pool


def test_configured_pod_wins_and_a_mismatch_is_counted():
    index, pool = run(Source(pod="pod-a"), b"kv@engine-7@m")
    assert index.pods() == {"pod-a"}
    assert pool.stats().errors_by_kind == {"topic_pod_mismatch": 1}
    # the model still comes from the topic: keys are scoped by it
    keys = index.token_processor.request_keys(TOKENS, model="m")
    assert len(index.prefix_match(keys)["pod-a"]) == 2


def test_bound_socket_takes_the_topics_pod():
    index, pool = run(Source(pod=None), b"kv@engine-7@m")
    assert index.pods() == {"engine-7"}
    assert pool.stats().decode_errors == 0


def test_matching_topic_is_silent():
    index, pool = run(Source(pod="pod-a", model="other"), b"kv@pod-a@m")
    assert index.pods() == {"pod-a"} and pool.stats().decode_errors == 0
    assert index.prefix_match(index.token_processor.request_keys(TOKENS, model="m"))


@settings(max_examples=200, deadline=None)
@given(
    st.lists(
        st.one_of(
            st.binary(max_size=12),
            st.builds(lambda p, m, meta: b"kv@" + p + b"@" + m + meta, st.binary(max_size=6), st.binary(max_size=6),
                      st.sampled_from([b"", b"\x00sgl-kv-epoch=3"])),
        ),
        max_size=30,
    ),
    st.sampled_from([None, "cfg-pod"]),
)
def test_remembered_topics_route_as_parse_topic(topics: list[bytes], pod: str | None) -> None:
    """route() and submit()'s pod read each topic once and remember it: the answers stay parse_topic's."""
    pool = EventPool(KVBlockIndex(TokenProcessor(block_size=16)), concurrency=2)
    source = Source(pod=pod, model="cfg-model")
    for _ in range(2):  # the second pass answers from the remembered topics
        for t in topics:
            tp, tm = parse_topic(t)
            assert pool.route(source, t) == ((pod if pod is not None else tp), tm or "cfg-model")
            assert pool._topic(bytearray(t)) == (tp, tm)  # other bytes-likes are parsed, not remembered


def test_remembered_topics_are_bounded() -> None:
    pool = EventPool(KVBlockIndex(TokenProcessor(block_size=16)), concurrency=1)
    for i in range(_TOPIC_CACHE + 10):
        assert pool._topic(f"kv@p{i}@m".encode()) == (f"p{i}", "m")
    assert 0 < len(pool._topics) <= _TOPIC_CACHE
