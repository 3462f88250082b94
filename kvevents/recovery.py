"""The shards' recovery side: replays, restart checks, retries, bootstraps, rejoin checks, resyncs.

Everything here asks an engine's replay endpoint (vLLM's ZmqEventPublisher
replay service, see :mod:`kvevents.replay`) or schedules such an ask: the
replays and checks the :class:`~kvevents.sequencer.Sequencer` returns,
failed replays asked again after a backoff, bootstraps when a subscription
first connects, rejoin checks after it (re)joins, and the resyncs and
rebuilds after a dropped message or a lost index write.  :class:`_Recovery`
is mixed into the shard (:class:`kvevents.shards._Shard`), which provides the
executor (``_run``) that performs the sequencer's answers.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from typing import Protocol

import zmq

from kvevents.actions import Action
from kvevents.events import EventBatch
from kvevents.misconfig import ConfigCheck
from kvevents.messages import Source, StoreObserver, _as_batch, _Bootstrap
from kvevents.replay import ReplayClient, ReplayCut
from kvevents.sequencer import backoff
from kvevents.stats import RateLimitedLog, StreamKey, _Counters, _Stream
from kvevents.wire import PayloadError, decode_seq, parse_topic
from kvindex.contract import IndexUnavailable, KVIndex, SharedStore

__all__ = ["ShardHost"]


class ShardHost(Protocol):
    """What a shard uses of its pool (:class:`kvevents.pool.EventPool`): its index, settings and logs."""

    index: KVIndex
    queue_size: int
    zmq_context: zmq.Context
    replay_timeout: float
    replay_max_batches: int
    replay_retries: int
    replay_retry_delay: float
    replay_retry_max_delay: float
    rejoin_checks: int
    rejoin_check_delay: float
    rlog: RateLimitedLog
    config_check: ConfigCheck
    fast_path: bool
    store_observers: tuple[StoreObserver, ...]

    def route(self, source: Source, topic: bytes) -> tuple[str | None, str | None]: ...

    def observers_of(self, pod: str, dp_rank: int, model: str | None) -> tuple[StoreObserver, ...]: ...


class _Recovery:
    """A shard's replay sockets and the replays, checks and retries it owes its streams."""

    # the shard's (see kvevents.shards._Shard)
    c: _Counters
    streams: dict[StreamKey, _Stream]
    _run: Callable[[_Stream, list[Action]], None]
    _error: Callable[..., None]
    _decode: Callable[[str, bytes, bytes], tuple[int, EventBatch] | None]
    _stream: Callable[[str, str | None, int, Source], _Stream]
    _streams_of: Callable[..., list[_Stream]]

    def __init__(self, pool: ShardHost) -> None:
        self.pool = pool
        self.resync: set[str] = set()  # pods that lost a message to a full queue
        self.resync_due: set[StreamKey] = set()
        self.forget_due: set[str] = set()  # removed pods whose clear the index could not take yet
        # streams whose failed replay is to be asked again: key -> (monotonic deadline, failures then)
        self.retry_at: dict[StreamKey, tuple[float, int]] = {}
        # retries take at most about half of the shard's time: after one that took t seconds
        # (a timeout, with a dead endpoint) the next waits t, so queued messages keep flowing
        self.retry_not_before = 0.0
        # bootstraps whose first ask failed, asked again after the pool's backoff: (deadline, failures, item)
        self.boot_at: list[tuple[float, int, _Bootstrap]] = []
        # (pod, rank) -> (deadline, checks done, how to ask) of the next look at the buffer of a publisher
        # whose subscription (re)joined and that has not been heard from since (see ``_rejoin_checks``)
        self.rejoin: dict[tuple[str, int], tuple[float, int, _Bootstrap]] = {}
        # the index's data generation (a shared store that lost its data bumps it): streams are rebuilt
        self.shared = pool.index if isinstance(pool.index, SharedStore) else None
        self.index_gen = self.shared.generation if self.shared is not None else 0
        self.replay = ReplayClient(
            pool.zmq_context, timeout=pool.replay_timeout, on_error=self._error, max_batches=pool.replay_max_batches
        )

    # -- replay

    def _replay_items(self, st: _Stream, start: int) -> Iterator[tuple[int, EventBatch | None]]:
        """(seq, batch or None when unreadable) of the engine's buffered batches from ``start``."""
        for topic, seq_frame, payload in self.replay.request(st.replay_endpoint, start):
            if topic is not None and st.model is not None and parse_topic(topic)[1] not in (None, st.model):
                continue  # another model's stream (the engine came back serving another model): not ours
            try:
                seq = decode_seq(seq_frame)
            except PayloadError as exc:
                self._error(exc.kind, f"replay: {exc}")
                continue
            decoded = self._decode(st.engine, seq_frame, payload)
            if decoded is None:
                yield seq, None
                continue
            batch = decoded[1]
            if batch.dp_rank is not None and batch.dp_rank != st.rank:
                continue
            yield seq, batch

    def _replay(self, st: _Stream, start: int) -> None:
        """Ask the stream's engine for its batches from ``start``; feed them and the end to the sequencer."""
        ok = cut = False
        try:
            for seq, batch in self._replay_items(st, start):
                self._run(st, st.seq.replayed(None if batch is None else _as_batch(seq, batch), seq))
                if st.seq.hole_pending:
                    break  # a reply was lost: stop reading (the socket is discarded) and ask again at once
            ok = True
        except ReplayCut as exc:
            cut = True
            self.pool.rlog.warn("replay_cut", "kvevents: pod %s rank %s: %s", st.pod, st.rank, exc)
        except TimeoutError:
            self._error("replay_timeout", f"pod {st.pod} rank {st.rank}: replay from {st.replay_endpoint} timed out")
        except (ValueError, zmq.ZMQError) as exc:
            self._error("replay", f"pod {st.pod} rank {st.rank}: replay from {st.replay_endpoint} failed: {exc}")
        self._run(st, st.seq.replay_end(ok, cut))

    def _schedule_retry(self, st: _Stream) -> None:
        """Set the time of the stream's pending replay retry (backoff from its failures in a row)."""
        sq = st.seq
        key = (st.pod, st.model, st.rank)
        when = self.retry_at.get(key)
        if when is None or when[1] != sq.retry_attempts:
            pool = self.pool
            delay = sq.retry_delay(pool.replay_retry_delay, pool.replay_retry_max_delay)
            self.retry_at[key] = (time.monotonic() + delay, sq.retry_attempts)

    def _retries(self) -> None:
        """Ask again the most overdue failed replay whose backoff has passed (while the index takes writes).

        One per call, and not before ``retry_not_before``: a retry that ran
        into a timeout delays the next by as long, so retries take at most
        about half of the shard's time and its queue keeps moving.
        """
        now = time.monotonic()
        if now < self.retry_not_before:
            return
        key, (t, _n) = min(self.retry_at.items(), key=lambda kv: kv[1][0])
        if t > now:
            return
        if self.shared is not None and not self.shared.writable():
            return
        del self.retry_at[key]
        st = self.streams.get(key)
        if st is not None:
            self._run(st, st.seq.retry())
            self.retry_not_before = time.monotonic() + (time.monotonic() - now)

    def _same_process(self, st: _Stream, seq: int, ts: float | None) -> bool | None:
        """Is the publisher still the process whose batch ``seq`` (engine timestamp ``ts``) we applied?

        Asks the replay endpoint for batches from ``seq``: the same process
        still has that batch with the same engine timestamp (a process that
        moved more than its buffer past it answers no: too much was missed to
        trust the stream).  None when the endpoint could not be asked.
        """
        if st.replay_endpoint is None:
            return None
        try:
            for r_seq, r_batch in self._replay_items(st, seq):
                if r_batch is None:
                    return False
                # only the first batch matters; closing the generator discards the rest
                return r_seq == seq and r_batch.ts == ts
            return False
        except TimeoutError:
            self._error("replay_timeout", f"pod {st.pod} rank {st.rank}: replay from {st.replay_endpoint} timed out")
            return None
        except (ValueError, zmq.ZMQError) as exc:
            self._error("replay", f"pod {st.pod} rank {st.rank}: replay from {st.replay_endpoint} failed: {exc}")
            return None

    def _bootstrap(self, item: _Bootstrap, failures: int = 0) -> bool:
        """Rebuild a publisher's stream from its replay buffer when the subscriber first connects.

        The stream is keyed by the model its topic names (as its live
        messages will be), so the first buffered batch is fetched first to
        learn it; an empty buffer leaves the stream to the first live message.
        Returns False when the endpoint could not be asked (then asked again
        later, up to ``replay_retries`` failures in all).
        """
        src = item.source
        endpoint = src.replay_endpoint(item.pod, item.dp_rank)
        if endpoint is None:
            return True
        model = src.model
        try:
            for topic, _seq, _payload in self.replay.request(endpoint, 0):
                if topic is not None:
                    model = parse_topic(topic)[1] or model
                break  # closing the request discards the rest
            else:
                return True
        except TimeoutError:
            self._error("replay_timeout", f"pod {item.pod} rank {item.dp_rank}: replay from {endpoint} timed out")
            self._boot_later(item, failures)
            return False
        except (ValueError, zmq.ZMQError) as exc:
            self._error("replay", f"pod {item.pod} rank {item.dp_rank}: replay from {endpoint} failed: {exc}")
            self._boot_later(item, failures)
            return False
        st = self._stream(item.pod, model, item.dp_rank, src)
        self._run(st, st.seq.bootstrap())
        return True

    def _boot_later(self, item: _Bootstrap, failures: int) -> None:
        """A bootstrap whose ask failed is asked again after the pool's backoff (as a failed
        replay: ``replay_retry_delay`` doubled per failure, at most ``replay_retry_max_delay``), up
        to ``replay_retries`` times.  An engine that published everything before we subscribed
        publishes nothing more that would start its stream."""
        pool = self.pool
        if failures >= pool.replay_retries:
            return
        delay = backoff(pool.replay_retry_delay, failures, pool.replay_retry_max_delay)
        self.boot_at.append((time.monotonic() + delay, failures + 1, item))

    def _boot_retries(self) -> None:
        """Ask again the bootstraps whose backoff has passed, unless a message started the stream meanwhile."""
        now = time.monotonic()
        due = [b for b in self.boot_at if b[0] <= now]
        if not due:
            return
        self.boot_at = [b for b in self.boot_at if b[0] > now]
        for _t, failures, item in due:
            if self._streams_of(item.pod, item.dp_rank):
                continue  # a live message started the stream (its start is checked against the buffer)
            self.c.replay_retries += 1
            if self._bootstrap(item, failures):
                self._rejoined(item, 0)  # answered at last: the subscription's join window may not be over

    def _rejoined(self, item: _Bootstrap, done: int) -> None:
        """Schedule the next look at the buffer of a publisher whose subscription (re)joined.

        The subscriber learns of the connection at its handshake, and the
        pool then asks the engine's buffer (bootstrap, reconnect check); but
        the subscription takes effect at the publisher a little later, and a
        batch published in between is lost live and not in that answer.  An
        engine that then stays idle would never reveal the loss, so the buffer
        is asked again ``rejoin_checks`` times (``rejoin_check_delay`` seconds
        after, doubling) until a live message of the publisher arrives, which
        shows the subscription in effect (a loss before it is then a gap), or
        until an ask fails (the endpoint's retries then go on as for any
        failed replay; a bootstrap answered at last by its retry looks again).
        """
        pool = self.pool
        if done >= pool.rejoin_checks or item.source.replay_endpoint(item.pod, item.dp_rank) is None:
            self.rejoin.pop((item.pod, item.dp_rank), None)
            return
        when = time.monotonic() + backoff(pool.rejoin_check_delay, done)
        self.rejoin[(item.pod, item.dp_rank)] = (when, done + 1, item)

    def _rejoin_checks(self) -> None:
        """Look again at the buffers of rejoined publishers not heard from since (see ``_rejoined``)."""
        now = time.monotonic()
        for key, (when, done, item) in list(self.rejoin.items()):
            if when > now:
                continue
            streams = self._streams_of(item.pod, item.dp_rank)
            failures = self.c.replay_failures
            if any(st.seq.retry_pending for st in streams):
                ok = True  # a failed replay waits for its retry, which asks the buffer anyway
            elif streams:
                for st in streams:  # from our last batch on, which the same process still holds
                    self._run(st, st.seq.bootstrap())
                ok = self.c.replay_failures == failures
            else:
                ok = self._bootstrap(item)  # none yet: the buffer was empty (or its ask failed)
            if ok:
                self._rejoined(item, done)
            else:
                self.rejoin.pop(key, None)

    def _note_drops(self) -> None:
        """Streams of pods that lost a message to a full queue: incomplete now, replayed when idle."""
        pods, self.resync = self.resync, set()
        for key, st in self.streams.items():
            if st.pod in pods:
                self._run(st, st.seq.dropped())
                self.resync_due.add(key)

    def _index_failed(self, st: _Stream, msg: str, n: int = 1) -> None:
        """The index refused a write of ``st``: incomplete now, rebuilt when the index takes writes."""
        self._unavailable(msg, n)
        self._run(st, st.seq.index_failed())
        self.resync_due.add((st.pod, st.model, st.rank))

    def _index_reset(self) -> None:
        """The index lost its data (e.g. its Redis restarted empty): every stream is rebuilt."""
        self.index_gen = self.shared.generation if self.shared is not None else 0
        for st in list(self.streams.values()):
            self._index_failed(st, f"pod {st.pod}: the index lost its data", 0)

    def _unavailable(self, msg: str, n: int = 1) -> None:
        self.c.index_unavailable += n
        self.pool.rlog.warn("index_unavailable", "kvevents: %s", msg)

    def _resync(self) -> None:
        if self.shared is not None and not self.shared.writable():
            return  # replays and rebuilds wait until the index takes writes again
        for pod in list(self.forget_due):
            try:
                self.pool.index.clear(pod)
                self.forget_due.discard(pod)
            except IndexUnavailable:
                return
        keys, self.resync_due = self.resync_due, set()
        for key in keys:
            st = self.streams.get(key)
            if st is not None:
                self._run(st, st.seq.idle())
