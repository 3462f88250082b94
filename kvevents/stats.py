"""Write-path counters and completeness: per shard, per publisher stream, and their snapshots."""

from __future__ import annotations

import logging
import threading
import time
from typing import NamedTuple

import msgspec

from kvevents.misconfig import ConfigCheck, StreamCheck
from kvevents.sequencer import Sequencer

__all__ = ["PoolStats", "RateLimitedLog", "StreamCounters", "StreamState"]

#: Key of one publisher stream in a shard: (pod, model, DP rank).
StreamKey = tuple[str, str | None, int]


class PoolStats(msgspec.Struct, frozen=True):
    """Write-path counters (a snapshot; see :meth:`EventPool.stats`).

    messages: messages taken from the queues; batches: batches applied (live and
    replayed); events / blocks_stored / blocks_removed / clears: what they
    carried; decode_errors: messages or events that failed to decode or apply
    (events of a type this library does not know count as kind
    ``unknown_event``); errors_by_kind: the same per kind; gaps: seq gaps
    seen; gaps_unrecovered: gaps a replay could not fill (no endpoint, timeout, or the engine's buffer
    no longer held them); replay_requests / replayed_batches: replays asked and
    batches they returned; duplicates: batches skipped as already applied;
    restarts: engine restarts confirmed (see the restart rule in
    :mod:`kvevents.sequencer`); dropped_messages: lost
    to full queues; resyncs: replays started by the overflow policy; orphans:
    blocks that waited for an unknown parent (from the index); queued: messages
    waiting now; stale: live messages skipped because a replay had already
    moved their stream past a range the engine's buffer no longer held;
    unconfirmed: messages skipped because the engine did not confirm their
    seq (a forward jump its buffer does not know, a backward seq its replay
    buffer contradicts: hostile or corrupt publishers); replay_failures:
    replays or restart checks that timed out or failed; replay_holes: replays
    with a seq missing inside them (a reply lost on the way), asked again from
    the hole; replay_retries: replays asked again after one failed without
    applying anything (with backoff, see :class:`EventPool`); deferred: live
    messages not applied while their stream waited for such a retry (the
    retry fetches them from the engine's buffer); replay_cuts: replays cut off
    at ``replay_max_batches`` (or their time limit) after applying something,
    the rest asked for at once; incomplete_streams:
    streams whose completeness flag is false now (see
    :meth:`EventPool.completeness`); index_unavailable: events not applied
    because the index's store (Redis) was unreachable; rebuilds: streams
    cleared and rebuilt from the engine's buffer after such a loss;
    misconfigured_streams: streams whose engine's configuration does not
    match ours (``StreamState.misconfigured``; their refused events count
    as kind ``misconfigured``).
    """

    messages: int
    batches: int
    events: int
    blocks_stored: int
    blocks_removed: int
    clears: int
    decode_errors: int
    errors_by_kind: dict[str, int]
    gaps: int
    gaps_unrecovered: int
    replay_requests: int
    replayed_batches: int
    duplicates: int
    restarts: int
    dropped_messages: int
    resyncs: int
    orphans: int
    queued: int
    stale: int = 0
    unconfirmed: int = 0
    replay_failures: int = 0
    incomplete_streams: int = 0
    replay_holes: int = 0
    index_unavailable: int = 0
    rebuilds: int = 0
    replay_retries: int = 0
    deferred: int = 0
    replay_cuts: int = 0
    misconfigured_streams: int = 0


class RateLimitedLog:
    """Logs a warning at most once per ``kind`` per ``interval`` seconds, with the count since."""

    def __init__(self, logger: logging.Logger, interval: float = 60.0) -> None:
        self._logger = logger
        self._interval = interval
        self._last: dict[str, float] = {}
        self._suppressed: dict[str, int] = {}
        self._lock = threading.Lock()

    def warn(self, kind: str, msg: str, *args: object) -> None:
        now = time.monotonic()
        with self._lock:
            last = self._last.get(kind)
            if last is not None and now - last < self._interval:
                self._suppressed[kind] = self._suppressed.get(kind, 0) + 1
                return
            self._last[kind] = now
            skipped = self._suppressed.pop(kind, 0)
        if skipped:
            msg += f" ({skipped} more since the last report)"
        self._logger.warning(msg, *args)


class _Stream:
    """One publisher stream (pod, model, DP rank): its sequencer plus what the shard needs to act."""

    __slots__ = (
        "pod", "model", "rank", "seq", "replay_endpoint", "engine", "complete_since", "why", "losses",
        "messages", "batches", "events", "clears", "stored", "removed", "check", "flat",
    )

    def __init__(
        self, pod: str, model: str | None, rank: int, replay_endpoint: str | None, engine: str, max_retries: int = 10,
        check: StreamCheck | None = None,
    ) -> None:
        self.pod = pod
        self.model = model
        self.rank = rank
        self.replay_endpoint = replay_endpoint
        self.engine = engine
        self.seq = Sequencer(replay_endpoint is not None, max_retries)
        self.complete_since: float | None = None  # monotonic time it last became complete
        self.why = "no batch yet"
        # ingest counters of this stream (read by EventPool.stream_counters)
        self.messages = 0
        self.batches = 0
        self.events = 0
        self.clears = 0
        self.stored: dict[str, int] = {}  # tier -> blocks stored
        self.removed: dict[str, int] = {}  # tier -> blocks removed
        self.losses = 0  # times state was lost: became incomplete, cleared, or a lossy batch applied
        self.check = check if check is not None else ConfigCheck(None).stream(pod, model, rank)
        #: whether a fast batch may go raw (without group fields, naming group 0 full attention) and
        #: whether the index learned groups of the stream; None: ask the index
        self.flat: tuple[bool, bool, bool] | None = None


class StreamCounters(NamedTuple):
    """Ingest counters of one publisher stream (a snapshot; see :meth:`EventPool.stream_counters`).

    pod, model, dp_rank: the publisher (model None when its topic names none).
    messages: live messages that reached the stream's sequencer (decodable,
        with a pod); batches: batches applied (live and replayed); events:
        events in them; clears: AllBlocksCleared events applied;
    blocks_stored / blocks_removed: tier -> blocks the stream's BlockStored /
        BlockRemoved events carried (each block once per event, whether or
        not the index changed).  Counters start at 0 when the stream is first
        seen and go away with the pod (:meth:`EventPool.forget_pod`).
    """

    pod: str
    model: str | None
    dp_rank: int
    messages: int
    batches: int
    events: int
    clears: int
    blocks_stored: dict[str, int]
    blocks_removed: dict[str, int]


class StreamState(NamedTuple):
    """Completeness of one publisher stream (a snapshot; see :meth:`EventPool.completeness`).

    pod, model, dp_rank: the publisher (model None when its topic names none).
    complete: the index holds exactly what the engine held as of ``last_seq``
        and nothing since is known to be lost.  False after an unrecoverable
        gap, a dropped message (until a replay catches up), a reconnect
        without replay, a restart or a start caught after the engine's seq 0
        was gone, or a malformed event.
    since: ``time.monotonic()`` of this process when it last became
        complete; None if it never was.
    last_seq: last applied seq (None before the first batch or after a clear).
    why: what last changed the flag (free text, for logs and explanations).
    losses: how many times the stream lost state so far (it became
        incomplete, was cleared, or applied a batch with a malformed event);
        a change means a new loss even while the stream stays incomplete.
    last_ts: the engine timestamp of the batch at ``last_seq`` (None with it).
    misconfigured: the reasons (:data:`kvevents.misconfig.REASONS`) the
        engine's configuration does not match ours; while any, ``complete``
        is False and ``why`` says what to set.
    """

    pod: str
    model: str | None
    dp_rank: int
    complete: bool
    since: float | None
    last_seq: int | None
    why: str
    losses: int = 0
    last_ts: float | None = None
    misconfigured: tuple[str, ...] = ()


class _Counters:
    __slots__ = (
        "messages", "batches", "events", "blocks_stored", "blocks_removed", "clears",
        "decode_errors", "gaps", "gaps_unrecovered", "replay_requests", "replayed_batches",
        "duplicates", "restarts", "resyncs", "stale", "unconfirmed", "replay_failures", "replay_holes",
        "errors_by_kind", "index_unavailable", "rebuilds", "replay_retries", "deferred", "replay_cuts",
    )

    def __init__(self) -> None:
        for name in self.__slots__:
            setattr(self, name, 0)
        self.errors_by_kind: dict[str, int] = {}

