"""The sharded pool: per-pod ordered workers that apply KV events to an index.

Write path: subscriber -> :meth:`EventPool.submit` -> shard (stable hash of the
pod id, so one pod's messages are applied in the order they arrived) ->
decode (vLLM or SGLang adapter) -> sequence check -> index.

Streams: one per publisher = (pod, model, DP rank); the pod from the
subscription or the topic ``kv@<pod>@<model>``, the model from the topic, the
rank from the batch.  Two models published under one pod id are two streams
(each with its own seq from 0) whose blocks never touch.

Sequence numbers (vLLM: 8 bytes big-endian, from 0 per publisher process):
every decision (apply, duplicate, stale, gap -> replay from N, partial replay
-> clear and rebuild, restart -> confirm, then clear and replay, completeness)
is made by the stream's :class:`~kvevents.sequencer.Sequencer`, a pure state
machine; the shard only decodes, feeds it, and performs the actions it
returns (apply a batch, clear the stream, ask the replay endpoint, count).
See :mod:`kvevents.sequencer` for the rules, including the restart rule (a
backward seq is a restart only when the engine's replay buffer, or the
stream's next message, confirms it).

Joining: the subscriber sees its connection's handshake, not the moment the
publisher takes the subscription; a batch published in between is lost live
and may be missing from the replay asked at the handshake.  Until a
publisher's first live message after a (re)join, the pool looks at its
replay buffer again a few times (``rejoin_checks``), so an engine that goes
idle right after such a batch is still indexed.

Overflow policy: at most ``queue_size`` messages wait per shard (control items
such as flush, stop and disconnect notices are never refused).  Beyond that a
message is dropped, counted in ``dropped_messages``, and its pod's streams
are marked incomplete and for resync: at the stream's next in-sequence
message, or once the shard is idle (or at a flush), whichever comes first,
every such stream with a replay endpoint is replayed from its last applied
batch on, which makes it complete again when the replay covers the range.  (A
later message of the stream would also reveal a gap; the next seq is not
trusted after a drop because the dropped messages may have been a restarted
engine's first batches, and the replay checks that the engine still holds our
last batch.)  The drop also leaves a marker in the queue at the lost message's
place, so the stream learns where it was (a restart candidate held before it
is not confirmed by a message after it).  Bad input never raises out of a
worker: it is counted by kind and logged at most once per kind per minute.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from typing import NamedTuple

import msgspec
import xxhash
import zmq

from kvevents.events import AllBlocksCleared, BlockRemoved, BlockStored, EventBatch
from kvevents.misconfig import ConfigCheck, StreamCheck
from kvevents.replay import ReplayClient, ReplayCut
from kvevents.sequencer import Action, Apply, Batch, Clear, Complete, Confirm, Count, Replay, Sequencer
from kvevents.sglang import decode_sglang_batch
from kvevents.wire import REPLAY_END_SEQ, PayloadError, decode_seq, decode_vllm_batch, parse_topic
from kvindex.contract import ApplyResult
from kvindex.side_tables import apply_each
from kvindex.contract import IndexUnavailable, KVIndex

__all__ = [
    "Source", "RawMessage", "PoolStats", "StreamState", "StreamCounters", "EventPool", "RateLimitedLog", "StoreObserver",
]

#: ``fn(pod, dp_rank, model, event)``: called before a BlockStored is applied (see
#: :meth:`EventPool.add_store_observer`).
StoreObserver = Callable[[str, int, "str | None", BlockStored], None]

log = logging.getLogger("kvevents.pool")

#: Topics whose (pod, model) an EventPool remembers (then it starts over).
_TOPIC_CACHE = 4096

# the event classes the index's batch apply dispatches on (kvindex does not import kvevents)
_EVENT_KINDS = (BlockStored, BlockRemoved, AllBlocksCleared)

DECODERS: dict[str, Callable[[bytes], EventBatch]] = {
    "vllm": decode_vllm_batch,
    "sglang": decode_sglang_batch,
}


class Source(NamedTuple):
    """Where messages come from: one subscription (an engine endpoint, or a bound socket).

    pod: pod id used when the topic carries none (None: the topic must name it).
    engine: "vllm" or "sglang" (selects the payload decoder).
    replay: replay endpoint for this publisher, or a callable (pod, dp_rank)
        -> endpoint | None for bound sockets many publishers dial into.
    dp_rank: DP rank used when the batch carries none.
    model: model name used when the topic carries none.
    """

    pod: str | None = None
    engine: str = "vllm"
    replay: str | Callable[[str, int], str | None] | None = None
    dp_rank: int = 0
    model: str | None = None

    def replay_endpoint(self, pod: str, dp_rank: int) -> str | None:
        """The replay endpoint serving (pod, dp_rank), or None."""
        if self.replay is None or isinstance(self.replay, str):
            return self.replay
        return self.replay(pod, dp_rank)


class RawMessage(NamedTuple):
    """One three-frame KV-event message as received: topic, seq frame, payload."""

    source: Source
    topic: bytes
    seq: bytes
    payload: bytes


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
        "messages", "batches", "events", "clears", "stored", "removed", "check",
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
    misconfigured: tuple[str, ...] = ()


class _Flush(NamedTuple):
    done: threading.Event


class _Bootstrap(NamedTuple):
    source: Source
    pod: str
    dp_rank: int


class _Forget(NamedTuple):
    pod: str


class _Dropped(NamedTuple):
    """A message of ``pod`` was dropped here (the queue was full): the drop's place in the order."""

    pod: str


class _Disconnected(NamedTuple):
    pod: str
    dp_rank: int


class _Reconnected(NamedTuple):
    pod: str
    dp_rank: int
    source: Source | None = None  # to bootstrap from when nothing applied is left to check


_STOP = object()


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


class _Shard:
    """One worker thread with its queue, stream sequencers and replay sockets: a thin executor.

    Every sequencing decision is the :class:`~kvevents.sequencer.Sequencer`'s;
    the shard decodes, feeds it, and performs the actions it returns.
    """

    def __init__(self, pool: EventPool, n: int) -> None:
        self.pool = pool
        self.n = n
        # one ordered queue for messages and control items; only messages count
        # against queue_size (control items must never block or be dropped)
        self.queue: queue.SimpleQueue = queue.SimpleQueue()
        self.pending = 0  # messages queued, guarded by pending_lock
        self.pending_lock = threading.Lock()
        self.last_dropped: str | None = None  # the pod of the last queued drop marker, if nothing was queued since
        self.streams: dict[tuple[str, str | None, int], _Stream] = {}
        self.c = _Counters()
        self.resync: set[str] = set()  # pods that lost a message to a full queue
        self.resync_due: set[tuple[str, str | None, int]] = set()
        self.forget_due: set[str] = set()  # removed pods whose clear the index could not take yet
        # streams whose failed replay is to be asked again: key -> (monotonic deadline, failures then)
        self.retry_at: dict[tuple[str, str | None, int], tuple[float, int]] = {}
        # retries take at most about half of the shard's time: after one that took t seconds
        # (a timeout, with a dead endpoint) the next waits t, so queued messages keep flowing
        self.retry_not_before = 0.0
        # bootstraps whose first ask failed, asked again after the pool's backoff: (deadline, failures, item)
        self.boot_at: list[tuple[float, int, _Bootstrap]] = []
        # (pod, rank) -> (deadline, checks done, how to ask) of the next look at the buffer of a publisher
        # whose subscription (re)joined and that has not been heard from since (see ``_rejoin_checks``)
        self.rejoin: dict[tuple[str, int], tuple[float, int, _Bootstrap]] = {}
        # the index's data generation (a shared store that lost its data bumps it): streams are rebuilt
        self.index_gen = getattr(pool.index, "generation", 0)
        self.replay = ReplayClient(
            pool.zmq_context, timeout=pool.replay_timeout, on_error=self._error, max_batches=pool.replay_max_batches
        )
        self.thread: threading.Thread | None = None

    def start(self) -> None:
        self.thread = threading.Thread(target=self.run, name=f"kvevents-shard-{self.n}", daemon=True)
        self.thread.start()

    def offer(self, msg: RawMessage, pod: str | None = None) -> bool:
        """Queue a message unless ``queue_size`` messages are already waiting.

        A message that does not fit leaves a :class:`_Dropped` marker in its
        place (one per run of drops of a pod), so that its stream learns where
        the lost message was: the messages queued before it are not after it.
        """
        with self.pending_lock:
            if self.pending >= self.pool.queue_size:
                if pod is not None and self.last_dropped != pod:
                    self.last_dropped = pod
                    self.queue.put(_Dropped(pod))
                return False
            self.pending += 1
            self.last_dropped = None
            self.queue.put(msg)
        return True

    # -- loop

    def run(self) -> None:
        try:
            while True:
                if getattr(self.pool.index, "generation", 0) != self.index_gen:
                    self._guarded(self._index_reset)
                if self.resync:
                    self._guarded(self._note_drops)
                if self.retry_at:
                    self._guarded(self._retries)
                if self.boot_at:
                    self._guarded(self._boot_retries)
                if self.rejoin:
                    self._guarded(self._rejoin_checks)
                try:
                    item = self.queue.get(timeout=0.05)
                except queue.Empty:
                    if self.resync_due or self.forget_due:
                        self._guarded(self._resync)
                    continue
                if item is _STOP:
                    break
                if isinstance(item, RawMessage):
                    with self.pending_lock:
                        self.pending -= 1
                self._guarded(self._handle, item)
        finally:
            self.replay.close()

    def _guarded(self, fn: Callable[..., None], *args: object) -> None:
        try:
            fn(*args)
        except Exception as exc:  # never let bad input kill the worker
            self._error("internal", f"unexpected {type(exc).__name__}: {exc}")
            log.exception("kvevents worker error")

    def _handle(self, item: object) -> None:
        if isinstance(item, RawMessage):
            self._on_message(item)
        elif isinstance(item, _Flush):
            self._note_drops()
            if self.resync_due or self.forget_due:
                self._resync()
            if self.retry_at:
                self._retries()
            item.done.set()
        elif isinstance(item, _Bootstrap):
            if self._bootstrap(item):
                self._rejoined(item, 0)
        elif isinstance(item, _Dropped):
            # where the lost message was: a candidate held before it is not continued by what follows
            for st in self._streams_of(item.pod):
                self._run(st, st.seq.dropped(in_place=True))
        elif isinstance(item, _Disconnected):
            self.rejoin.pop((item.pod, item.dp_rank), None)  # the reconnect looks again
            for st in self._streams_of(item.pod, item.dp_rank):
                self._run(st, st.seq.disconnected())
        elif isinstance(item, _Reconnected):
            streams = self._streams_of(item.pod, item.dp_rank)
            fresh = all(st.seq.last is None for st in streams)  # nothing applied (yet, or since a restart)
            for st in streams:
                self._run(st, st.seq.reconnected())
            if item.source is not None:
                boot = _Bootstrap(item.source, item.pod, item.dp_rank)
                # nothing to check against the engine when fresh, and what it published while we
                # rejoined (a restarted engine's first batches) is only in its buffer: take it from there
                if not fresh or self._bootstrap(boot):
                    self._rejoined(boot, 0)
        elif isinstance(item, _Forget):
            self.boot_at = [b for b in self.boot_at if b[2].pod != item.pod]
            for key in [k for k in self.rejoin if k[0] == item.pod]:
                del self.rejoin[key]
            for key in [k for k in self.streams if k[0] == item.pod]:
                del self.streams[key]
                self.resync_due.discard(key)
                self.retry_at.pop(key, None)
            try:
                self.pool.index.clear(item.pod)
            except IndexUnavailable as exc:
                self.forget_due.add(item.pod)  # cleared when the index takes writes again
                self._unavailable(f"pod {item.pod}: removal not applied: {exc}")

    def _streams_of(self, pod: str, rank: int | None = None) -> list[_Stream]:
        return [st for st in self.streams.values() if st.pod == pod and (rank is None or st.rank == rank)]

    def _stream(self, pod: str, model: str | None, rank: int, source: Source) -> _Stream:
        key = (pod, model, rank)
        st = self.streams.get(key)
        if st is None:
            st = self.streams[key] = _Stream(
                pod, model, rank, source.replay_endpoint(pod, rank), source.engine, self.pool.replay_retries,
                self.pool.config_check.stream(pod, model, rank, source.model),
            )
        return st

    # -- messages

    def _on_message(self, msg: RawMessage) -> None:
        self.c.messages += 1
        pod, model = self.pool.route(msg.source, msg.topic)
        if pod is None:
            self._error("topic", "message with unparseable topic and no configured pod")
            return
        decoded = self._decode(msg.source.engine, msg.seq, msg.payload)
        if decoded is None:
            return  # an unreadable message moves no sequence (see Sequencer.live)
        seq, batch = decoded
        if seq == REPLAY_END_SEQ:
            self._error("seq", "live message carries the replay end-marker seq")
            return
        rank = batch.dp_rank if batch.dp_rank is not None else msg.source.dp_rank
        if self.rejoin:
            self.rejoin.pop((pod, rank), None)  # heard from: the subscription has taken effect
        st = self._stream(pod, model, rank, msg.source)
        st.messages += 1
        self._run(st, st.seq.live(_as_batch(seq, batch)))

    def _decode(self, engine: str, seq_frame: bytes, payload: bytes) -> tuple[int, EventBatch] | None:
        decoder = DECODERS.get(engine)
        if decoder is None:
            self._error("engine", f"unknown engine format {engine!r}")
            return None
        try:
            return decode_seq(seq_frame), decoder(payload)
        except PayloadError as exc:
            self._error(exc.kind, f"bad payload ({exc.kind}): {exc}")
            return None

    # -- the executor

    def _run(self, st: _Stream, actions: list[Action]) -> None:
        """Perform a sequencer's actions in order (replays and checks feed their answers back)."""
        c = self.c
        for a in actions:
            t = type(a)
            if t is Apply:
                if a.batch.lossy:
                    st.losses += 1
                self._apply(st, a.batch.body)
            elif t is Count:
                setattr(c, a.name, getattr(c, a.name) + a.n)
            elif t is Clear:
                self.pool.rlog.warn(
                    "clear", "pod %s model %s rank %s: clearing (%s)", st.pod, st.model, st.rank, a.why
                )
                st.losses += 1
                st.check.rearm()
                try:
                    self.pool.index.clear(st.pod, st.rank, model=st.model)
                except IndexUnavailable as exc:
                    self._index_failed(st, f"pod {st.pod}: clear not applied: {exc}")
            elif t is Complete:
                st.why = a.why
                if a.complete:
                    st.complete_since = time.monotonic()
                else:
                    st.losses += 1
            elif t is Replay:
                self._replay(st, a.start)
            elif t is Confirm:
                self._run(st, st.seq.confirmed(self._same_process(st, a.seq, a.ts)))
        if st.seq.retry_pending:
            self._schedule_retry(st)

    def _apply(self, st: _Stream, batch: EventBatch) -> None:
        c = self.c
        index = self.pool.index
        pod, rank, model = st.pod, st.rank, st.model
        c.batches += 1
        c.events += len(batch.events)
        st.batches += 1
        apply = getattr(index, "apply_events", None)
        observers = self.pool.observers_of(pod, rank, model)
        if observers:
            # observers see the index as it is just before each BlockStored: one event at a time
            r = ApplyResult()
            events = batch.events
            for i, ev in enumerate(events):
                if type(ev) is BlockStored:
                    self._observe(st, ev, observers)
                apply_each(index, pod, rank, events[i : i + 1], model, _EVENT_KINDS, result=r)
                if r.unavailable is not None:
                    r.left = len(events) - i
                    break
        elif apply is not None:  # the whole batch in one call (the compiled index: runs of events natively)
            r = apply(pod, rank, batch.events, model=model, kinds=_EVENT_KINDS)
        else:
            r = apply_each(index, pod, rank, batch.events, model, _EVENT_KINDS)
        c.blocks_stored += r.stored_blocks
        c.blocks_removed += r.removed_blocks
        c.clears += r.clears
        # per stream, by tier: the blocks the processed events carried (one step per event, not per block)
        done = len(batch.events) - r.left
        st.events += done
        st.clears += r.clears
        # (the index tallies them: ApplyResult.stored_by_tier / removed_by_tier)
        if r.stored_by_tier:
            into = st.stored
            for tier, k in r.stored_by_tier.items():
                into[tier] = into.get(tier, 0) + k
        if r.removed_by_tier:
            into = st.removed
            for tier, k in r.removed_by_tier.items():
                into[tier] = into.get(tier, 0) + k
        if r.errors or st.check.watching:
            st.check.events(batch.events)
        if st.check.problems and r.errors:  # logged once by the check: only counted here
            self._error("misconfigured", "", len(r.errors), quiet=True)
        else:
            for msg in r.errors:
                self._error("apply", f"pod {pod}: event not applied: {msg}")
        if r.unavailable is not None:
            # the rest of the batch was not applied either (order matters); the stream is rebuilt
            self._index_failed(st, f"pod {pod}: {r.left} event(s) not applied: {r.unavailable}", r.left)
        if batch.skipped_events:
            self._error(
                "unknown_event", f"pod {pod}: {batch.skipped_events} event(s) of an unknown type skipped",
                batch.skipped_events,
            )
        for kind in batch.bad_events:
            self._error(kind, f"pod {pod}: a malformed event ({kind}) was left out of its batch")

    def _observe(self, st: _Stream, ev: BlockStored, observers: Sequence[StoreObserver]) -> None:
        """Show a BlockStored to the stream's store observers before it is applied (never raises)."""
        for fn in observers:
            try:
                fn(st.pod, st.rank, st.model, ev)
            except Exception as exc:
                self._error("observer", f"store observer {fn!r} failed: {type(exc).__name__}: {exc}")

    # -- replay

    def _replay_items(self, st: _Stream, start: int) -> Iterator[tuple[int, EventBatch | None]]:
        """(seq, batch or None when unreadable) of the engine's buffered batches from ``start``."""
        for _topic, seq_frame, payload in self.replay.request(st.replay_endpoint, start):
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
        writable = getattr(self.pool.index, "writable", None)
        if writable is not None and not writable():
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
        delay = min(pool.replay_retry_delay * 2.0**failures, pool.replay_retry_max_delay)
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
        when = time.monotonic() + pool.rejoin_check_delay * 2.0**done
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
        self.index_gen = getattr(self.pool.index, "generation", 0)
        for st in list(self.streams.values()):
            self._index_failed(st, f"pod {st.pod}: the index lost its data", 0)

    def _unavailable(self, msg: str, n: int = 1) -> None:
        self.c.index_unavailable += n
        self.pool.rlog.warn("index_unavailable", "kvevents: %s", msg)

    def _resync(self) -> None:
        writable = getattr(self.pool.index, "writable", None)
        if writable is not None and not writable():
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

    def _error(self, kind: str, msg: str, n: int = 1, quiet: bool = False) -> None:
        c = self.c
        c.decode_errors += n
        c.errors_by_kind[kind] = c.errors_by_kind.get(kind, 0) + n
        if not quiet:
            self.pool.rlog.warn(kind, "kvevents: %s", msg)


def _as_batch(seq: int, batch: EventBatch) -> Batch:
    """The sequencer's view of a decoded batch."""
    return Batch(seq, batch.ts, AllBlocksCleared in map(type, batch.events), bool(batch.bad_events), batch)


class EventPool:
    """N shard workers applying KV-event messages to a :class:`~kvindex.contract.KVIndex`.

    Args:
        index: the index to write.
        concurrency: number of shards (worker threads), >= 1 (default 4).
        queue_size: bound of each shard's queue in messages, >= 1.
        replay_timeout: seconds to wait for each replay reply before giving up.
        replay_max_batches: a replay that sends more batches than this without
            its end marker is cut off (vLLM's buffer holds 10,000 by default);
            what it applied stays, the stream is incomplete meanwhile and the
            rest is asked for at once from the first missing seq
            (``replay_cuts``).
        replay_retries: a replay (or a stream's start check) that times out or
            fails without applying anything is asked again up to this many
            times in a row (``replay_retries``), >= 0.
        replay_retry_delay / replay_retry_max_delay: seconds before the first
            retry (default: the shard's idle poll, 0.05 s), doubled after each
            failure, at most the max (default 5 s; with the defaults the 10
            retries span ~21 s plus their timeouts).  Meanwhile the stream
            stays at its last applied batch and incomplete, and live messages
            that need the replay are not applied (``deferred``: the retry
            fetches them from the engine's buffer).  When the retries run out
            the stream goes on as without a replay endpoint (incomplete) until
            the endpoint answers a later check.
        rejoin_checks / rejoin_check_delay: after a subscription (re)joins
            (:meth:`bootstrap`, or :meth:`reconnected` with a source), the
            engine's replay buffer is asked again this many times (>= 0),
            ``rejoin_check_delay`` seconds after (doubling: with the defaults
            over ~13 s), until a live message of that publisher arrives.  The
            subscriber sees its handshake, not the moment the publisher takes
            the subscription: a batch published in between is lost live, is
            not in the answer asked at the handshake, and an engine that then
            stays idle never reveals the gap.  A subscription that takes
            effect later than the last check leaves that batch lost until the
            engine's next message.
        zmq_context: context for replay sockets (default: the process's).
        config_check: what each stream's engine is checked against (block
            size, engine-hash algorithm, model; see :mod:`kvevents.misconfig`);
            default: the index's token processor, no expected model.

    Use: ``start()``, then ``submit()`` from the subscriber, ``flush()`` to
    wait until everything queued so far is applied, ``stop()``.
    """

    def __init__(
        self,
        index: KVIndex,
        *,
        concurrency: int = 4,
        queue_size: int = 10_000,
        replay_timeout: float = 2.0,
        replay_max_batches: int = 20_000,
        replay_retries: int = 10,
        replay_retry_delay: float = 0.05,
        replay_retry_max_delay: float = 5.0,
        rejoin_checks: int = 6,
        rejoin_check_delay: float = 0.2,
        zmq_context: zmq.Context | None = None,
        config_check: ConfigCheck | None = None,
    ) -> None:
        if concurrency < 1:
            raise ValueError(f"concurrency must be >= 1, got {concurrency}")
        if queue_size < 1:
            raise ValueError(f"queue_size must be >= 1, got {queue_size}")
        self.index = index
        self.queue_size = queue_size
        self.concurrency = concurrency
        if not 0 < replay_timeout < 3600:
            raise ValueError(f"replay_timeout must be in (0, 3600) seconds, got {replay_timeout}")
        if replay_max_batches < 1:
            raise ValueError(f"replay_max_batches must be >= 1, got {replay_max_batches}")
        if replay_retries < 0:
            raise ValueError(f"replay_retries must be >= 0, got {replay_retries}")
        if not 0 < replay_retry_delay <= replay_retry_max_delay < 3600:
            raise ValueError(
                "need 0 < replay_retry_delay <= replay_retry_max_delay < 3600 seconds, got "
                f"{replay_retry_delay}, {replay_retry_max_delay}"
            )
        if rejoin_checks < 0:
            raise ValueError(f"rejoin_checks must be >= 0, got {rejoin_checks}")
        if not 0 < rejoin_check_delay < 3600:
            raise ValueError(f"rejoin_check_delay must be in (0, 3600) seconds, got {rejoin_check_delay}")
        self.rejoin_checks = rejoin_checks
        self.rejoin_check_delay = rejoin_check_delay
        self.replay_timeout = replay_timeout
        self.replay_max_batches = replay_max_batches
        self.replay_retries = replay_retries
        self.replay_retry_delay = replay_retry_delay
        self.replay_retry_max_delay = replay_retry_max_delay
        self.zmq_context = zmq_context or zmq.Context.instance()
        self.config_check = config_check or ConfigCheck(getattr(index, "token_processor", None))
        self.rlog = RateLimitedLog(log)
        self._dropped = 0
        self._extra_errors: dict[str, int] = {}  # counted outside the shards (frames, topics)
        self._topics: dict[bytes, tuple[str | None, str | None]] = {}  # topic -> parse_topic(topic)
        self._lock = threading.Lock()
        self._shards = [_Shard(self, i) for i in range(concurrency)]
        self._started = False
        #: callables ``fn(pod, dp_rank, model, event)`` shown every BlockStored just before it is
        #: applied, on the shard's thread (see :meth:`add_store_observer`)
        self.store_observers: tuple[StoreObserver, ...] = ()
        self._observer_wants: dict[StoreObserver, Callable[[str, int, str | None], bool] | None] = {}

    # -- lifecycle

    def start(self) -> None:
        """Start the worker threads (idempotent)."""
        if not self._started:
            self._started = True
            for s in self._shards:
                s.start()

    def stop(self, timeout: float = 5.0) -> None:
        """Stop the workers after the messages already queued; closes replay sockets."""
        if not self._started:
            return
        deadline = time.monotonic() + timeout
        for s in self._shards:
            s.queue.put(_STOP)
        for s in self._shards:
            if s.thread is not None:
                s.thread.join(max(0.0, deadline - time.monotonic()))
        self._started = False

    def __enter__(self) -> EventPool:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def add_store_observer(
        self, fn: StoreObserver, wants: Callable[[str, int, str | None], bool] | None = None
    ) -> None:
        """Call ``fn(pod, dp_rank, model, event)`` for every BlockStored just before the index applies it.

        Runs on the shard's worker thread, so the index still shows the
        stream's state before the event (e.g. :class:`indexer.healing.HealingPolicy`
        counts the re-announced blocks it did not hold).  ``fn`` must be quick
        and thread-safe; an exception it raises is counted (``observer``) and
        the event is applied anyway.  ``wants(pod, dp_rank, model)``, asked
        once per batch, limits ``fn`` to the streams it answers True for
        (None: every stream).  A batch of an observed stream is applied one
        event at a time; the others keep the whole-batch apply.
        """
        self._observer_wants[fn] = wants
        self.store_observers = (*self.store_observers, fn)

    def remove_store_observer(self, fn: StoreObserver) -> None:
        """Stop calling ``fn`` (no error when it was not added)."""
        self.store_observers = tuple(f for f in self.store_observers if f != fn)
        self._observer_wants.pop(fn, None)

    def observers_of(self, pod: str, dp_rank: int, model: str | None) -> tuple[StoreObserver, ...]:
        """The store observers that want this stream's next batch (usually none: ``()``)."""
        obs = self.store_observers
        if not obs:
            return obs
        wants = self._observer_wants
        return tuple(fn for fn in obs if (w := wants.get(fn)) is None or w(pod, dp_rank, model))

    # -- input

    def shard_of(self, pod: str) -> int:
        """Stable shard number of a pod id (xxh3-64 of its UTF-8 bytes, mod N)."""
        if len(self._shards) == 1:
            return 0
        return xxhash.xxh3_64_intdigest(pod.encode()) % len(self._shards)

    def route(self, source: Source, topic: bytes) -> tuple[str | None, str | None]:
        """(pod, model) of a message.

        The pod: the subscription's configured pod when it has one (one socket
        per engine: the router's name for it is what it routes by), else the
        topic's ``kv@<pod>@<model>``.  The model: the topic's, else the
        configured one.  A topic naming another pod than the configured one
        is counted (``topic_pod_mismatch``) and logged: the blocks are filed
        under the configured pod.
        """
        pod, model = self._topic(topic)
        if source.pod is not None:
            if pod is not None and pod != source.pod:
                self.record_error(
                    "topic_pod_mismatch",
                    f"topic names pod {pod!r} but the subscription is configured as {source.pod!r}; "
                    f"filing its blocks under {source.pod!r}",
                )
            pod = source.pod
        return (pod, model or source.model)

    def _topic(self, topic: bytes) -> tuple[str | None, str | None]:
        """:func:`parse_topic`, remembered per topic (a fleet has a few topics, each message repeats one)."""
        hit = self._topics.get(topic) if type(topic) is bytes else None
        if hit is None:
            hit = parse_topic(topic)
            if type(topic) is bytes:
                if len(self._topics) >= _TOPIC_CACHE:
                    self._topics = {}
                self._topics[topic] = hit
        return hit

    def submit(self, msg: RawMessage) -> bool:
        """Queue one message for its pod's shard; never blocks.

        Returns False when the shard queue is full: the message is dropped,
        counted, and the pod is marked for resync (see module doc).
        """
        pod = msg.source.pod or self._topic(msg.topic)[0]
        shard = self._shards[self.shard_of(pod or "")]
        if shard.offer(msg, pod):
            return True
        else:
            with self._lock:
                self._dropped += 1
            if pod is not None:
                shard.resync.add(pod)
            self.rlog.warn("dropped", "kvevents: shard queue full, message for pod %s dropped", pod)
            return False

    def bootstrap(self, source: Source, pod: str, dp_rank: int = 0) -> None:
        """Queue a replay from seq 0 for (pod, dp_rank) from its replay endpoint.

        Called by the subscriber when it first connects to an engine, so an
        index started after its engines rebuilds what they still buffer.
        """
        self._shards[self.shard_of(pod)].queue.put(_Bootstrap(source, pod, dp_rank))

    def disconnected(self, pod: str, dp_rank: int = 0) -> None:
        """Note that the connection to (pod, dp_rank)'s publisher dropped.

        The stream's next message is then checked against the engine before it
        is applied (see ``_same_process``): an engine that restarted and
        published past our last seq before we reconnected is still detected.
        """
        self._shards[self.shard_of(pod)].queue.put(_Disconnected(pod, dp_rank))

    def reconnected(self, pod: str, dp_rank: int = 0, source: Source | None = None) -> None:
        """Note that the connection to (pod, dp_rank)'s publisher is back after a drop.

        With a replay endpoint the shard asks the engine at once whether it is
        the process we knew (see ``_on_reconnected``), so a restarted engine's
        old blocks leave the index before it publishes anything.  A stream
        with nothing applied (none yet, or cleared by a restart) has nothing
        to check: with ``source`` (its replay endpoint) it is bootstrapped
        again, so batches the engine published while the connection was
        rejoining are not lost when it then stays idle.
        """
        self._shards[self.shard_of(pod)].queue.put(_Reconnected(pod, dp_rank, source))

    def forget_pod(self, pod: str) -> None:
        """Queue the removal of a pod: its streams and all its index entries."""
        self._shards[self.shard_of(pod)].queue.put(_Forget(pod))

    def record_error(self, kind: str, msg: str) -> None:
        """Count a malformed message seen before it reached a shard (e.g. wrong frame count)."""
        with self._lock:
            self._extra_errors[kind] = self._extra_errors.get(kind, 0) + 1
        self.rlog.warn(kind, "kvevents: %s", msg)

    def flush(self, timeout: float | None = 10.0) -> bool:
        """Wait until every message queued before this call is applied.

        Returns False on timeout.  Raises RuntimeError if the pool is not started.
        """
        if not self._started:
            raise RuntimeError("pool not started")
        deadline = None if timeout is None else time.monotonic() + timeout
        marks = []
        for s in self._shards:
            m = _Flush(threading.Event())
            s.queue.put(m)
            marks.append(m)
        for m in marks:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            if not m.done.wait(left):
                return False
        return True

    # -- output

    def stats(self) -> PoolStats:
        """A snapshot of the write-path counters, summed over shards."""
        total = _Counters()
        queued = 0
        for s in self._shards:
            queued += s.pending
            for name in _Counters.__slots__:
                if name != "errors_by_kind":
                    setattr(total, name, getattr(total, name) + getattr(s.c, name))
            for k, v in list(s.c.errors_by_kind.items()):
                total.errors_by_kind[k] = total.errors_by_kind.get(k, 0) + v
        with self._lock:
            for k, v in self._extra_errors.items():
                total.errors_by_kind[k] = total.errors_by_kind.get(k, 0) + v
                total.decode_errors += v
            dropped = self._dropped
        states = self.completeness()
        return PoolStats(
            **{n: getattr(total, n) for n in _Counters.__slots__},
            dropped_messages=dropped,
            orphans=self.index.stats().orphans,
            queued=queued,
            incomplete_streams=sum(1 for s in states if not s.complete),
            misconfigured_streams=sum(1 for s in states if s.misconfigured),
        )

    def pending_retries(self) -> int:
        """Streams whose failed replay is waiting to be asked again (a snapshot)."""
        return sum(1 for s in self._shards for st in list(s.streams.values()) if st.seq.retry_pending)

    def streams(self) -> Iterator[tuple[str, int, int | None]]:
        """(pod, dp_rank, last applied seq) for every stream seen (a snapshot)."""
        for s in self._shards:
            for st in list(s.streams.values()):
                yield st.pod, st.rank, st.seq.last

    def stream_counters(self) -> list[StreamCounters]:
        """Ingest counters per publisher stream (pod, model, DP rank), sorted (a snapshot).

        Reads plain integers the shard workers update (no lock on the write
        path): each value is one the worker wrote, possibly a batch behind.
        """
        out: list[StreamCounters] = []
        for s in self._shards:
            for st in list(s.streams.values()):
                out.append(StreamCounters(
                    st.pod, st.model, st.rank, st.messages, st.batches, st.events, st.clears,
                    dict(st.stored), dict(st.removed),
                ))
        out.sort(key=lambda x: (x.pod, x.model or "", x.dp_rank))
        return out

    def completeness(self, pod: str | None = None) -> list[StreamState]:
        """Whether the index is known to hold exactly each publisher stream's blocks (a snapshot).

        One :class:`StreamState` per stream (pod, model, DP rank) seen,
        sorted; only ``pod``'s when given.  A stream is complete when the
        blocks applied equal the engine's as of its last applied seq and no
        message since is known to be lost (see :mod:`kvevents.sequencer` for
        what clears and sets the flag).  ``since`` is this process's
        ``time.monotonic()`` when it last became complete.
        """
        out: list[StreamState] = []
        for s in self._shards:
            for st in list(s.streams.values()):
                if pod is None or st.pod == pod:
                    sq = st.seq
                    bad = st.check.problems
                    out.append(StreamState(
                        st.pod, st.model, st.rank, sq.complete and not bad, st.complete_since, sq.last,
                        "; ".join(p.message for p in bad) if bad else st.why, st.losses, tuple(p.reason for p in bad),
                    ))
        out.sort(key=lambda x: (x.pod, x.model or "", x.dp_rank))
        return out
