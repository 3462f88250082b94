"""Which pod a message is filed under: the subscription's configured pod, else the topic's."""

from __future__ import annotations

from kvevents.pool import EventPool, RawMessage, Source
from kvindex.index import KVBlockIndex
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
