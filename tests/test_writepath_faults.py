"""Regression tests for the write-path faults of issue 6, one per fault, through the real pool and index.

Replay endpoints are real ZMQ ROUTER sockets (:class:`tests.engine_model.ReplayServer`)
serving model engines' buffers as vLLM does.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import numpy as np
import pytest

from kvindex.facade import Indexer
from kvevents.pool import EventPool, RawMessage, Source
from kvindex.reference import KVBlockIndex
from kvindex.keys import TokenProcessor
from tests.engine_model import MALFORMED_EVENT, ModelEngine, Paths, ReplayServer
from tests.oracle import batch_payload, removed_event, seq_frame, stored_event

BS = 4
PATHS = Paths.make(11, block_size=BS, n_paths=12, n_blocks=3)
TP = TokenProcessor(block_size=BS, hash_seed=5)


class Rig:
    """Model engines with real replay endpoints -> EventPool -> KVBlockIndex."""

    def __init__(self, *engines: ModelEngine, replay: bool = True, queue_size: int = 10_000, **pool_kw: object) -> None:
        self.engines = list(engines)
        self.index = KVBlockIndex(TP)
        self.server = ReplayServer(self.engines) if replay else None
        pool_kw.setdefault("replay_timeout", 2.0)
        self.pool = EventPool(self.index, concurrency=2, queue_size=queue_size, **pool_kw)  # type: ignore[arg-type]
        self.pool.start()

    def source(self, e: ModelEngine) -> Source:
        ep = self.server.endpoint(e) if self.server is not None else None
        return Source(pod=e.pod, replay=ep, model=e.model)

    def deliver(self, e: ModelEngine, frames: tuple[bytes, bytes, bytes]) -> bool:
        return self.pool.submit(RawMessage(self.source(e), *frames))

    def view(self, e: ModelEngine) -> set[tuple[int, str]]:
        """(engine key, tier) the index says ``e``'s publisher holds."""
        rk2ek = PATHS.rk_to_ek(TP, e.model)
        out = set()
        for rk, entries in zip(rk2ek, self.index.lookup(list(rk2ek))):
            for x in entries:
                if x.pod == e.pod and x.dp_rank == e.dp_rank and not x.speculative:
                    out.add((rk2ek[rk], x.tier))
        return out

    def state(self, e: ModelEngine):
        return next(s for s in self.pool.completeness(e.pod) if s.model == e.model and s.dp_rank == e.dp_rank)

    def close(self) -> None:
        self.pool.stop()
        if self.server is not None:
            self.server.close()


@pytest.fixture
def rigs() -> Iterator[list[Rig]]:
    made: list[Rig] = []
    yield made
    for r in made:
        r.close()


def store(e: ModelEngine, p: int, i: int = 0, j: int | None = None) -> list:
    """Events of ``e`` storing blocks i..j of path p (applied to the engine)."""
    j = PATHS.n_blocks(p) if j is None else j
    eks = [PATHS.ek(p, b) for b in range(i, j)]
    for ek in eks:
        e.held.setdefault(ek, set()).add("gpu")
    return [stored_event(eks, PATHS.ek(p, i - 1) if i else None, PATHS.tokens(p, i, j), BS)]


def remove(e: ModelEngine, eks: list[int]) -> list:
    for ek in eks:
        e._drop(ek, "gpu")
    return [removed_event(eks)]


# ---------------------------------------------------------------- partial replay coverage


def test_gap_the_buffer_only_partly_covers_clears_and_rebuilds(rigs: list[Rig]) -> None:
    """A block removed inside the lost range must not stay in the index for good."""
    e = ModelEngine("pod-a", "m", 0, PATHS, buffer_steps=3)
    rig = Rig(e)
    rigs.append(rig)
    rig.deliver(e, e.publish(store(e, 0)))
    assert rig.pool.flush(10)  # the stream's start is checked against the buffer (one replay)
    e.publish(remove(e, [PATHS.ek(0, 2)]))  # lost, and out of the buffer below
    e.publish(store(e, 1))  # lost, and out of the buffer
    frames = [e.publish(store(e, p)) for p in (2, 3, 4)]
    rig.deliver(e, frames[-1])
    assert rig.pool.flush(10)
    s = rig.pool.stats()
    assert s.gaps == 1 and s.gaps_unrecovered == 1 and s.restarts == 0 and s.replay_requests == 2
    got = rig.view(e)
    assert (PATHS.ek(0, 2), "gpu") not in got  # the removed block is gone
    assert got <= e.view()
    # rebuilt from what the buffer holds: paths 2..4 (whose chains are whole)
    assert got == {(PATHS.ek(p, i), "gpu") for p in (2, 3, 4) for i in range(3)}
    assert not rig.state(e).complete


def test_stale_queued_messages_after_a_partial_replay_are_not_restarts(rigs: list[Rig]) -> None:
    """The issue's minimal form: buffer 5..9; live 0, 2, 3, 4 arrive (1 is lost).

    One replay (the one checking the stream's start against the buffer) and no
    restart; batch 1 is lost for good (what it removed is unknown), so the
    stream is rebuilt from the buffer, marked incomplete, and the queued
    0, 2, 3, 4 are counted stale.
    """
    e = ModelEngine("pod-a", "m", 0, PATHS, buffer_steps=5)
    rig = Rig(e)
    rigs.append(rig)
    frames = [e.publish(store(e, p)) for p in range(10)]
    for seq in (0, 2, 3, 4):
        rig.deliver(e, frames[seq])
    assert rig.pool.flush(10)
    s = rig.pool.stats()
    assert s.replay_requests == 1 and s.restarts == 0 and s.clears == 0
    assert s.stale == 4 and s.gaps_unrecovered == 1
    assert rig.view(e) == {(PATHS.ek(p, i), "gpu") for p in range(5, 10) for i in range(3)}
    assert not rig.state(e).complete
    # the live stream catches up: still no restart, nothing re-replayed
    for seq in range(5, 10):
        rig.deliver(e, frames[seq])
    rig.deliver(e, e.publish(store(e, 10)))
    assert rig.pool.flush(10)
    s = rig.pool.stats()
    assert s.replay_requests == 1 and s.restarts == 0 and s.duplicates == 5


def test_stale_messages_under_a_burst_settle_with_one_replay(rigs: list[Rig]) -> None:
    """A burst beyond the queue bound: queued messages older than a replay are duplicates, never restarts."""
    e = ModelEngine("pod-a", "m", 0, PATHS, buffer_steps=10_000)
    rig = Rig(e, queue_size=50)
    rigs.append(rig)
    dropped = 0
    for n in range(2_000):
        p = n % len(PATHS.paths)
        events = store(e, p) if n % 2 == 0 else remove(e, [PATHS.ek(p - 1 if p else 0, 0)])
        dropped += not rig.deliver(e, e.publish(events))
    rig.deliver(e, e.publish([]))
    assert rig.pool.flush(30)
    s = rig.pool.stats()
    assert dropped > 0 and s.restarts == 0 and s.clears == 0
    # one per gap, per drop notice (resync) and per hole, never one per queued message
    assert s.replay_requests <= 1 + s.gaps + s.resyncs + s.replay_holes and s.replay_requests < 20
    assert rig.view(e) == e.view()
    assert rig.state(e).complete


# ---------------------------------------------------------------- replays that fail or are cut


def wait_for(cond, timeout: float = 60.0) -> bool:
    """Poll ``cond()`` until it holds or ``timeout`` seconds pass (retries run on the pool's own clock)."""
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


def test_a_replay_that_times_out_is_retried_once_the_endpoint_answers(rigs: list[Rig]) -> None:
    """The endpoint does not answer for a while (busy engine, replies lost), then does: the gap is filled."""
    e = ModelEngine("pod-a", "m", 0, PATHS)
    rig = Rig(e, replay_timeout=0.3)
    rigs.append(rig)
    rig.deliver(e, e.publish(store(e, 0)))
    assert rig.pool.flush(10) and wait_for(lambda: rig.state(e).complete)
    rig.server.pause(e)
    e.publish(remove(e, [PATHS.ek(0, 2)]))  # lost on the way
    for p in (1, 2, 3):
        rig.deliver(e, e.publish(store(e, p)))  # seq 2 shows the gap; its replay times out
    assert rig.pool.flush(10)
    s = rig.pool.stats()
    assert s.replay_failures >= 1 and not rig.state(e).complete and rig.pool.pending_retries() == 1
    # the stream waits at its last batch: the messages past the gap are fetched by the retry
    assert s.deferred >= 2 and rig.state(e).last_seq == 0
    rig.server.resume(e)
    # no further live message: the retry alone converges
    assert wait_for(lambda: rig.state(e).complete), rig.state(e)
    assert rig.view(e) == e.view() and rig.state(e).last_seq == e.next_seq - 1
    s = rig.pool.stats()
    assert s.replay_retries >= 1 and s.gaps_unrecovered == 0 and s.restarts == 0 and s.clears == 0
    assert rig.pool.pending_retries() == 0
    # and the live stream goes on
    for p in (4, 5):
        rig.deliver(e, e.publish(store(e, p)))
    rig.deliver(e, e.publish(remove(e, [PATHS.ek(4, 1), PATHS.ek(4, 2)])))
    assert rig.pool.flush(10)
    assert rig.view(e) == e.view() and rig.state(e).complete


def test_a_stream_whose_endpoint_does_not_answer_at_first_starts_once_it_does(rigs: list[Rig]) -> None:
    e = ModelEngine("pod-a", "m", 0, PATHS)
    rig = Rig(e, replay_timeout=0.3)
    rigs.append(rig)
    rig.server.pause(e)
    for p in range(3):
        rig.deliver(e, e.publish(store(e, p)))
    assert rig.pool.flush(10)
    assert rig.state(e).last_seq is None and not rig.state(e).complete
    rig.server.resume(e)
    assert wait_for(lambda: rig.state(e).complete), rig.state(e)
    assert rig.view(e) == e.view()
    assert rig.pool.stats().gaps_unrecovered == 0


def test_a_bootstrap_whose_endpoint_does_not_answer_at_first_is_asked_again(rigs: list[Rig]) -> None:
    """An engine that published everything before we subscribed, and whose endpoint is busy when the
    subscription's bootstrap asks: no live message will come to start the stream, so the bootstrap
    itself is asked again after the backoff and rebuilds the index from the engine's buffer."""
    e = ModelEngine("pod-a", "m", 0, PATHS)
    rig = Rig(e, replay_timeout=0.3)
    rigs.append(rig)
    for p in range(3):
        e.publish(store(e, p))  # before the subscription: nobody receives these
    rig.server.pause(e)
    rig.pool.bootstrap(rig.source(e), e.pod, e.dp_rank)
    assert wait_for(lambda: rig.pool.stats().errors_by_kind.get("replay_timeout", 0) >= 1)
    assert rig.pool.completeness(e.pod) == []
    rig.server.resume(e)
    assert wait_for(lambda: any(s.complete for s in rig.pool.completeness(e.pod))), rig.pool.completeness(e.pod)
    assert rig.view(e) == e.view() and rig.state(e).last_seq == e.next_seq - 1
    assert rig.pool.stats().messages == 0 and rig.pool.stats().replay_retries >= 1


def test_a_bootstrap_is_asked_again_at_most_replay_retries_times(rigs: list[Rig]) -> None:
    e = ModelEngine("pod-a", "m", 0, PATHS)
    rig = Rig(e, replay_timeout=0.2, replay_retries=2, replay_retry_delay=0.01, replay_retry_max_delay=0.02)
    rigs.append(rig)
    e.publish(store(e, 0))
    rig.server.pause(e)
    rig.pool.bootstrap(rig.source(e), e.pod, e.dp_rank)
    assert wait_for(lambda: rig.pool.stats().errors_by_kind.get("replay_timeout", 0) >= 3)
    time.sleep(1.0)  # longer than the backoff and another timeout: no fourth ask
    assert rig.pool.stats().errors_by_kind.get("replay_timeout", 0) == 3
    assert rig.pool.completeness(e.pod) == []


def test_retries_are_bounded_then_the_live_stream_is_taken_as_is(rigs: list[Rig]) -> None:
    """An endpoint that never answers: a bounded number of retries, then live messages apply (incomplete)."""
    e = ModelEngine("pod-a", "m", 0, PATHS)
    rig = Rig(e, replay_timeout=0.3, replay_retries=3, replay_retry_max_delay=0.2)
    rigs.append(rig)
    rig.deliver(e, e.publish(store(e, 0)))
    assert rig.pool.flush(10) and wait_for(lambda: rig.state(e).complete)
    s0 = rig.pool.stats()
    rig.server.pause(e)
    e.publish(store(e, 1))  # lost
    rig.deliver(e, e.publish(store(e, 2)))
    assert rig.pool.flush(10)
    assert wait_for(lambda: rig.pool.stats().replay_failures >= s0.replay_failures + 4)
    time.sleep(1.5)  # longer than the capped backoff plus a timeout: no fifth retry comes
    assert rig.pool.pending_retries() == 0
    s = rig.pool.stats()
    # the gap replay, then 3 retries with backoff, then no more: a dead endpoint costs a bounded time
    assert s.replay_requests - s0.replay_requests == 1 + 3 and s.replay_retries - s0.replay_retries == 3
    assert s.replay_failures - s0.replay_failures == 4
    assert s.gaps_unrecovered == 1 and not rig.state(e).complete
    for p in (3, 4):  # the next gap asks once more, its continuation once more, then it is taken as is
        rig.deliver(e, e.publish(store(e, p)))
    assert rig.pool.flush(10)
    time.sleep(1.0)
    st_ = rig.state(e)
    assert st_.last_seq == e.next_seq - 1 and not st_.complete
    s = rig.pool.stats()
    assert s.replay_requests - s0.replay_requests == 6 and s.replay_retries - s0.replay_retries == 3
    assert rig.pool.pending_retries() == 0
    assert {(PATHS.ek(p, i), "gpu") for p in (3, 4) for i in range(3)} <= rig.view(e) <= e.view()


@pytest.mark.parametrize("joined", ["fresh", "gap"])
def test_a_replay_cut_by_its_batch_bound_asks_for_the_rest(rigs: list[Rig], joined: str) -> None:
    """The endpoint holds more batches than ``replay_max_batches``: the rest is asked for, the stream converges."""
    e = ModelEngine("pod-a", "m", 0, PATHS, buffer_steps=10_000)
    rig = Rig(e, replay_max_batches=8)
    rigs.append(rig)
    if joined == "gap":
        rig.deliver(e, e.publish(store(e, 0)))
        assert rig.pool.flush(10) and rig.state(e).complete
    frames = None
    for n in range(50):
        p = n % len(PATHS.paths)
        frames = e.publish(store(e, p) if n % 3 else remove(e, [PATHS.ek((p + 5) % len(PATHS.paths), 1)]))
    rig.deliver(e, frames)  # only the newest arrives: a replay of ~50 batches, 8 at a time
    assert rig.pool.flush(30)
    s = rig.pool.stats()
    st_ = rig.state(e)
    assert st_.last_seq == e.next_seq - 1 and st_.complete, st_
    assert rig.view(e) == e.view()
    assert s.replay_cuts >= 5 and s.gaps_unrecovered == 0 and s.clears == 0 and s.restarts == 0
    assert s.replay_requests == s.replay_cuts + 1 + (joined == "gap")


def test_a_replay_exactly_as_long_as_the_bound_is_not_cut(rigs: list[Rig]) -> None:
    e = ModelEngine("pod-a", "m", 0, PATHS)
    rig = Rig(e, replay_max_batches=5)
    rigs.append(rig)
    frames = [e.publish(store(e, p)) for p in range(5)]
    rig.deliver(e, frames[-1])
    assert rig.pool.flush(10)
    s = rig.pool.stats()
    assert s.replay_cuts == 0 and s.replay_requests == 1 and rig.state(e).complete
    assert rig.view(e) == e.view()


# ---------------------------------------------------------------- per-event decode


def test_a_malformed_event_does_not_drop_the_valid_removal_beside_it(rigs: list[Rig]) -> None:
    e = ModelEngine("pod-a", "m", 0, PATHS)
    rig = Rig(e)
    rigs.append(rig)
    rig.deliver(e, e.publish(store(e, 0)))
    rig.deliver(e, e.publish(remove(e, [PATHS.ek(0, 2)]), extra_raw=[(0, MALFORMED_EVENT)]))
    assert rig.pool.flush(10)
    assert rig.view(e) == e.view() == {(PATHS.ek(0, i), "gpu") for i in range(2)}
    s = rig.pool.stats()
    assert s.errors_by_kind.get("schema") == 1 and s.batches == 2
    assert not rig.state(e).complete  # what the bad event meant is unknown


# ---------------------------------------------------------------- orphans stored twice


def test_a_block_stored_twice_under_an_unknown_parent_then_removed_twice_stays_removed() -> None:
    """vLLM can hold two physical blocks with one hash: two stores, two removals, then the parent arrives."""
    ix = KVBlockIndex(TP)
    parent, child = PATHS.ek(0, 0), PATHS.ek(0, 1)
    for _ in range(2):
        assert ix.block_stored("p", 0, [child], parent, PATHS.tokens(0, 1, 2), "gpu", model="m") == 0
    assert ix.block_removed("p", 0, [child], "gpu", model="m") == 1
    ix.block_removed("p", 0, [child], "gpu", model="m")
    ix.block_stored("p", 0, [parent], None, PATHS.tokens(0, 0, 1), "gpu", model="m")
    rks = TP.request_keys(list(PATHS.tokens(0, 0, 2)), model="m")
    assert ix.prefix_match(rks) == {"p": [1]}
    assert ix.stats().orphan_blocks == 0


# ---------------------------------------------------------------- hostile seqs


@pytest.mark.parametrize("replay", [True, False])
def test_one_huge_seq_does_not_wipe_the_pod(rigs: list[Rig], replay: bool) -> None:
    e = ModelEngine("pod-a", "m", 0, PATHS)
    rig = Rig(e, replay=replay)
    rigs.append(rig)
    for p in range(3):
        rig.deliver(e, e.publish(store(e, p)))
    hostile = stored_event([PATHS.ek(9, 0)], None, PATHS.tokens(9, 0, 1), BS)
    rig.deliver(e, (e.topic, seq_frame(2**64 - 2), batch_payload([hostile], dp_rank=0)))
    for p in range(3, 5):
        rig.deliver(e, e.publish(store(e, p)))
    assert rig.pool.flush(10)
    s = rig.pool.stats()
    assert s.restarts == 0 and s.clears == 0 and s.unconfirmed == 1
    assert rig.view(e) == e.view()  # the hostile block is not held, the engine's are
    if replay:
        assert rig.state(e).complete


@pytest.mark.parametrize("replay", [True, False])
def test_one_backward_seq_does_not_wipe_the_pod(rigs: list[Rig], replay: bool) -> None:
    e = ModelEngine("pod-a", "m", 0, PATHS)
    rig = Rig(e, replay=replay)
    rigs.append(rig)
    for p in range(4):
        rig.deliver(e, e.publish(store(e, p)))
    hostile = removed_event([PATHS.ek(0, 0)])
    rig.deliver(e, (e.topic, seq_frame(0), batch_payload([hostile], dp_rank=0, ts=5.0)))
    rig.deliver(e, e.publish(store(e, 4)))
    assert rig.pool.flush(10)
    s = rig.pool.stats()
    assert s.restarts == 0 and s.clears == 0
    assert rig.view(e) == e.view()


def test_a_real_restart_is_still_caught_without_a_replay_endpoint(rigs: list[Rig]) -> None:
    e = ModelEngine("pod-a", "m", 0, PATHS)
    rig = Rig(e, replay=False)
    rigs.append(rig)
    for p in range(4):
        rig.deliver(e, e.publish(store(e, p)))
    e.restart()
    rig.deliver(e, e.publish(store(e, 5)))
    assert rig.pool.flush(10)
    assert rig.pool.stats().restarts == 0  # one message cannot tell
    rig.deliver(e, e.publish(store(e, 6)))  # the next one continues it: confirmed
    assert rig.pool.flush(10)
    assert rig.pool.stats().restarts == 1
    assert rig.view(e) == e.view()
    assert rig.state(e).complete  # caught from its seq 0


def test_a_restart_whose_seqs_passed_ours_is_caught_by_the_gap_replay(rigs: list[Rig]) -> None:
    """The router missed the restart and the new process's first messages: its replay buffer gives it away."""
    e = ModelEngine("pod-a", "m", 0, PATHS)
    rig = Rig(e)
    rigs.append(rig)
    for p in range(2):
        rig.deliver(e, e.publish(store(e, p)))
    assert rig.pool.flush(10)
    e.restart()
    for p in range(2, 6):
        frames = e.publish(store(e, p))
    rig.deliver(e, frames)  # seq 3 of the new process after seq 1 of the old: a gap
    assert rig.pool.flush(10)
    assert rig.pool.stats().restarts == 1
    assert rig.view(e) == e.view()
    assert rig.state(e).complete


# ---------------------------------------------------------------- two models on one pod


def test_two_models_on_one_pod_are_two_streams(rigs: list[Rig]) -> None:
    a = ModelEngine("pod-a", "model-a", 0, PATHS)
    b = ModelEngine("pod-a", "model-b", 0, PATHS)
    rig = Rig(a, b)
    rigs.append(rig)
    for n in range(6):  # interleaved, each with its own seq from 0, the same tokens
        rig.deliver(a, a.publish(store(a, n)))
        rig.deliver(b, b.publish(store(b, n)))
    rig.deliver(a, a.publish(remove(a, [PATHS.ek(0, 2), PATHS.ek(1, 2)])))
    rig.deliver(b, b.publish(remove(b, [PATHS.ek(2, 2)])))
    assert rig.pool.flush(10)
    s = rig.pool.stats()
    assert s.restarts == 0 and s.gaps == 0 and s.replay_requests == 2  # each stream's start is checked
    assert rig.view(a) == a.view() and rig.view(b) == b.view()
    assert a.view() != b.view()
    assert [(x.model, x.complete) for x in rig.pool.completeness("pod-a")] == [("model-a", True), ("model-b", True)]
    # the same tokens under two models: each model's request keys see its own copy
    for p in range(6):
        for m, e in (("model-a", a), ("model-b", b)):
            rks = TP.request_keys(list(PATHS.paths[p]), model=m)
            n = len(rig.index.prefix_match(rks).get("pod-a", []))
            want = next((i for i in range(3) if (PATHS.ek(p, i), "gpu") not in e.view()), 3)
            assert n == want
    # an AllBlocksCleared of one model leaves the other's blocks
    rig.deliver(a, a.publish([{"type": "AllBlocksCleared"}]))
    a.held.clear()
    assert rig.pool.flush(10)
    assert rig.view(a) == set() and rig.view(b) == b.view()


def test_level_two_is_scoped_by_model() -> None:
    ix = KVBlockIndex(TP)
    ek0 = PATHS.ek(0, 0)
    ix.block_stored("p", 0, [ek0], None, PATHS.tokens(0, 0, 1), "gpu", model="a")
    ix.block_stored("q", 0, [ek0], None, PATHS.tokens(0, 0, 1), "gpu", model="b")
    assert ix.request_key_of(ek0, "a") == int(TP.request_keys(list(PATHS.tokens(0, 0, 1)), model="a")[0])
    assert ix.request_key_of(ek0, "b") == int(TP.request_keys(list(PATHS.tokens(0, 0, 1)), model="b")[0])
    # a child under model a on another pod chains from model a's key, not b's
    ix.block_stored("r", 0, [PATHS.ek(0, 1)], ek0, PATHS.tokens(0, 1, 2), "gpu", model="a")
    assert ix.prefix_match(TP.request_keys(list(PATHS.tokens(0, 0, 2)), model="a"), ["p", "r"]) == {"p": [1]}
    assert len(ix.pod_keys("r")) == 1 and ix.stats().orphan_blocks == 0
    assert ix.pod_keys("r") == {int(TP.request_keys(list(PATHS.tokens(0, 0, 2)), model="a")[1])}


def test_a_removal_reaches_a_waiting_store_whose_other_tier_is_attached() -> None:
    """Found by the engine-model test: gpu store waiting for its parent, cpu copy attached via another pod's key."""
    ix = KVBlockIndex(TP)
    ek0, ek1 = PATHS.ek(2, 0), PATHS.ek(2, 1)
    ix.block_stored("q", 0, [ek0, ek1], None, PATHS.tokens(2, 0, 2), "gpu", model="m")
    ix.block_removed("q", 0, [ek0], "gpu", model="m")  # q keeps ek1 only: ek0 is unknown now
    assert ix.block_stored("p", 0, [ek1], ek0, PATHS.tokens(2, 1, 2), "gpu", model="m") == 0  # waits
    assert ix.block_stored("p", 0, [ek1], None, (), "cpu", model="m") == 1  # offload: known through q
    assert ix.block_removed("p", 0, [ek1], "gpu", model="m") == 1
    ix.block_stored("p", 0, [ek0], None, PATHS.tokens(2, 0, 1), "gpu", model="m")  # the parent arrives
    rk1 = int(TP.request_keys(list(PATHS.tokens(2, 0, 2)), model="m")[1])
    assert {(x.pod, x.tier) for x in ix.lookup([rk1])[0]} == {("p", "cpu"), ("q", "gpu")}


def test_an_orphan_waits_for_its_parent_under_its_own_model() -> None:
    """Found by the engine-model test: model a's parent released model b's waiting child with a's keys."""
    ix = KVBlockIndex(TP)
    ek0, ek1 = PATHS.ek(1, 0), PATHS.ek(1, 1)
    assert ix.block_stored("p", 0, [ek1], ek0, PATHS.tokens(1, 1, 2), "gpu", model="b") == 0
    ix.block_stored("q", 0, [ek0], None, PATHS.tokens(1, 0, 1), "gpu", model="a")
    assert ix.stats().orphan_blocks == 1 and ix.pod_keys("p") == set()
    ix.block_stored("p", 0, [ek0], None, PATHS.tokens(1, 0, 1), "gpu", model="b")
    rks_b = TP.request_keys(list(PATHS.tokens(1, 0, 2)), model="b")
    assert ix.pod_keys("p") == set(rks_b.tolist()) and ix.stats().orphan_blocks == 0


# ---------------------------------------------------------------- pod churn


def test_pods_that_come_and_go_leave_nothing_behind() -> None:
    ix = KVBlockIndex(TP)
    rks = TP.request_keys(list(PATHS.paths[0]), model="m")
    for gen in range(300):
        pods = [f"pod-{gen}-{k}" for k in range(4)]
        for pod in pods:
            ix.block_stored(pod, 0, [PATHS.ek(0, i) for i in range(3)], None, PATHS.paths[0], "gpu", model="m")
        assert set(ix.prefix_match(rks)) == set(pods)
        for k, pod in enumerate(pods):
            if k % 2:
                ix.clear(pod)
            else:
                ix.block_removed(pod, 0, [PATHS.ek(0, i) for i in range(3)], "gpu", model="m")
    assert len(ix) == 0 and ix.pods() == frozenset()
    # the per-pod tables are empty and the pod bits were reused (4 pods at a time)
    assert not ix._pod_masks and not ix._pod_bits and not ix._streams and not ix._holders
    assert len(ix._free_bits) <= 4 and max(ix._free_bits) < 1 << 4
    st = ix.stats()
    assert st.keys == st.entries == st.engine_keys == st.pods == 0


def test_forgotten_pods_free_their_streams_in_the_pool(rigs: list[Rig]) -> None:
    engines = [ModelEngine(f"pod-{k}", "m", 0, PATHS) for k in range(20)]
    rig = Rig(*engines)
    rigs.append(rig)
    for e in engines:
        rig.deliver(e, e.publish(store(e, 0)))
    assert rig.pool.flush(10)
    for e in engines:
        rig.pool.forget_pod(e.pod)
    assert rig.pool.flush(10)
    assert rig.pool.completeness() == [] and len(rig.index) == 0 and not rig.index._pod_bits


# ---------------------------------------------------------------- smaller ones


def test_empty_float_array_scores_empty() -> None:
    ix = Indexer()
    for tokens in (np.array([]), np.array([], dtype=np.float32), []):
        s = ix.score(tokens)
        assert s.request_blocks == 0 and s.prefix == {} and s.choice is None


def test_old_integer_lora_id_in_extra_keys_is_scoped_not_dropped(rigs: list[Rig]) -> None:
    e = ModelEngine("pod-a", "m", 0, PATHS)
    rig = Rig(e)
    rigs.append(rig)
    eks = [PATHS.ek(0, i) for i in range(3)]
    ev = stored_event(eks, None, PATHS.paths[0], BS, extra_keys=[[7], [7], [7]])
    rig.deliver(e, e.publish([ev]))
    assert rig.pool.flush(10)
    assert rig.pool.stats().decode_errors == 0
    scoped = TP.request_keys(list(PATHS.paths[0]), model="m", lora="lora_int_id:7")
    assert rig.index.prefix_match(scoped) == {"pod-a": [1, 1, 1]}
    # never taken for the base model's blocks
    assert rig.index.prefix_match(TP.request_keys(list(PATHS.paths[0]), model="m")) == {}


# ---------------------------------------------------------------- completeness


def test_completeness_after_a_drop_is_restored_by_the_resync(rigs: list[Rig]) -> None:
    e = ModelEngine("pod-a", "m", 0, PATHS)
    rig = Rig(e, queue_size=5)
    rigs.append(rig)
    rig.deliver(e, e.publish(store(e, 0)))
    assert rig.pool.flush(10)
    first = rig.state(e)
    assert first.complete and first.since is not None and first.since <= time.monotonic()
    # a burst through a queue of 5 whose last message is dropped: no later message shows the gap
    for n in range(100_000):
        if not rig.deliver(e, e.publish(store(e, 1 + n % 8))) and n >= 199:
            break
    else:
        raise AssertionError("a queue of 5 never dropped a message of a 100,000-message burst")
    assert rig.pool.flush(10)  # the resync runs at the flush
    st = rig.state(e)
    assert st.complete and st.since > first.since and st.last_seq == e.next_seq - 1
    assert rig.view(e) == e.view()
    assert rig.pool.stats().resyncs >= 1


def test_completeness_after_a_reconnect_without_replay(rigs: list[Rig]) -> None:
    e = ModelEngine("pod-a", "m", 0, PATHS)
    rig = Rig(e, replay=False)
    rigs.append(rig)
    rig.deliver(e, e.publish(store(e, 0)))
    assert rig.pool.flush(10) and rig.state(e).complete
    rig.pool.disconnected("pod-a")
    assert rig.pool.flush(10) and not rig.state(e).complete
    rig.pool.reconnected("pod-a")
    assert rig.pool.flush(10)
    st = rig.state(e)
    assert not st.complete and st.last_seq is None
    assert rig.view(e) == set()  # cleared: a restarted engine's blocks are never predicted


def test_completeness_through_the_indexer_facade() -> None:
    ix = Indexer(index=KVBlockIndex(TP))
    with ix:
        ix.pool.submit(RawMessage(Source(pod="p"), b"kv@p@m", seq_frame(3), batch_payload([])))
        assert ix.flush(10)
        (st,) = ix.completeness()
        assert (st.pod, st.model, st.dp_rank, st.complete) == ("p", "m", 0, False)  # joined late, no replay
        ix.pool.submit(RawMessage(Source(pod="p"), b"kv@p@m", seq_frame(4), batch_payload([{"type": "AllBlocksCleared"}])))
        assert ix.flush(10)
        assert ix.completeness("p")[0].complete  # a clear makes the engine's state known
        assert ix.stats().events.incomplete_streams == 0


def test_a_dropped_message_leaves_one_marker_at_its_place_in_the_queue() -> None:
    """The shard learns where a message was lost (kvevents.pool._Shard.offer): one marker per
    run of drops of a pod, after the messages queued before it and before the ones after it."""
    from kvevents.pool import _Dropped

    index = KVBlockIndex(TokenProcessor(block_size=4))
    pool = EventPool(index, concurrency=1, queue_size=2)  # not started: the queue only fills
    src = Source(pod="pod-a")
    msg = RawMessage(src, b"kv@pod-a@m", seq_frame(0), b"")
    assert [pool.submit(msg) for _ in range(4)] == [True, True, False, False]
    shard = pool._shards[0]
    items = []
    while not shard.queue.empty():
        items.append(shard.queue.get_nowait())
    assert items[:2] == [msg, msg] and items[2:] == [_Dropped("pod-a")]
    assert pool.stats().dropped_messages == 2


# ---------------------------------------------------------------- joining and rejoining, then idle
# (found by tests/test_engine_model.py's RejoinEngineMachine; here the subscriber's notices are
# given in the order it can give them, and no live message ever reveals the loss)


def test_a_batch_published_after_the_bootstrap_but_before_the_subscription_took_effect_is_indexed(
    rigs: list[Rig],
) -> None:
    """The subscriber's handshake is done and the bootstrap replay has answered (seqs 0..2), but
    the publisher has not taken the subscription yet (its side of the connection lags): seqs 3..5
    are lost at the PUB, and the engine then stays idle.  The subscriber cannot see when the
    subscription takes effect; the pool must look at the engine's buffer again."""
    e = ModelEngine("pod-a", "m", 0, PATHS)
    rig = Rig(e)
    rigs.append(rig)
    for p in range(3):
        e.publish(store(e, p))
    rig.pool.bootstrap(rig.source(e), e.pod, 0)
    assert rig.pool.flush(10) and rig.state(e).last_seq == 2
    for p in range(3, 6):
        e.publish(store(e, p))  # lost: not subscribed yet
    assert wait_for(lambda: rig.pool.flush(10) and rig.view(e) == e.view()), "seqs 3..5 never reached the index"
    assert rig.state(e).complete and rig.state(e).last_seq == 5


def test_a_restarted_engine_serving_after_the_reconnect_check_is_indexed(rigs: list[Rig]) -> None:
    """The engine restarts; the reconnect check finds the new process (seq 0 buffered) and rebuilds;
    its seq 1 is published before its publisher has taken the new subscription, and it stays idle."""
    e = ModelEngine("pod-a", "m", 0, PATHS)
    rig = Rig(e)
    rigs.append(rig)
    rig.deliver(e, e.publish(store(e, 0)))
    assert rig.pool.flush(10) and rig.state(e).complete
    rig.pool.disconnected(e.pod, 0)
    e.restart()
    e.publish(store(e, 1))
    rig.pool.reconnected(e.pod, 0, rig.source(e))
    assert rig.pool.flush(10) and rig.view(e) == e.view()
    e.publish(store(e, 2))  # lost: the subscription has not rejoined yet
    assert wait_for(lambda: rig.pool.flush(10) and rig.view(e) == e.view()), "seq 1 never reached the index"
    assert rig.state(e).complete and rig.state(e).last_seq == 1


def test_a_message_continuing_our_seq_after_a_disconnect_does_not_stand_for_the_reconnect_check(
    rigs: list[Rig],
) -> None:
    """The connection drops; the old connection's last message (our next seq) reaches the pool
    after the disconnect notice; the engine restarts and its first batch is lost while the
    subscription rejoins; it stays idle.  The reconnect must still find the new process: the
    old process's blocks may not stay in the index."""
    e = ModelEngine("pod-a", "m", 0, PATHS)
    rig = Rig(e)
    rigs.append(rig)
    rig.deliver(e, e.publish(store(e, 0)))
    assert rig.pool.flush(10)
    old = e.publish(store(e, 1))
    rig.pool.disconnected(e.pod, 0)
    rig.deliver(e, old)
    e.restart()
    e.publish(store(e, 2))  # lost: the subscription has not rejoined yet
    rig.pool.reconnected(e.pod, 0, rig.source(e))
    assert rig.pool.flush(10)
    assert rig.view(e) == e.view() and rig.state(e).complete and rig.pool.stats().restarts == 1


def test_an_engine_restarted_with_nothing_published_is_complete_and_empty() -> None:
    """The fake engine restarts (new process, empty cache) and publishes nothing: the indexer
    drops its blocks and reports the stream complete (it used to stay 'disconnected' until the
    engine published again), and picks up what the new process publishes later."""
    from kvevents.testing import FakeEngine
    from kvindex.facade import Config

    eng = FakeEngine(pod="pod-a", model="m", block_size=4, capacity_blocks=64)
    cfg = Config.from_dict({"model_name": "m", "token_processor_config": {"block_size": 4},
                            "kv_events_config": {"engines": [eng.engine_entry()]}})
    try:
        with Indexer(cfg) as ix:
            for i in range(3):
                eng.serve([i * 100 + t for t in range(1, 17)])
            assert ix.flush()
            assert ix.index.stats().keys == 12 and all(s.complete for s in ix.completeness())
            eng.restart()
            deadline = time.monotonic() + 60
            while not (ix.index.stats().keys == 0 and all(s.complete for s in ix.completeness())):
                assert time.monotonic() < deadline, ix.completeness()
                time.sleep(0.05)
            eng.serve(list(range(1, 9)))
            assert ix.flush()
            assert ix.score(list(range(1, 9))).prefix["pod-a"].matched_blocks == 2
            assert ix.index.stats().keys == 2 and all(s.complete for s in ix.completeness())
    finally:
        eng.close()
