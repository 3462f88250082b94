"""The sharded pool: per-pod ordered workers that apply KV events to an index.

Write path: subscriber -> :meth:`EventPool.submit` -> shard (stable hash of the
pod id, so one pod's messages are applied in the order they arrived) ->
decode (vLLM or SGLang adapter) -> sequence check -> index.

Sequence numbers (vLLM: 8 bytes big-endian, from 0 per publisher process) are
tracked per stream = (pod, DP rank):

- next expected seq: applied.
- a gap: the missing range is asked from the engine's replay endpoint (DEALER
  socket, vLLM's replay protocol; see :mod:`kvevents.replay`) and applied in
  order, then the message itself unless the replay already covered it.
- seq at or below the last applied one: a duplicate of a batch a replay
  already applied (same seq and same engine timestamp) is skipped; anything
  else means the engine restarted (vLLM restarts seq at 0), so the stream's
  blocks are cleared from the index and the stream starts over (replaying
  from 0 what the new process has buffered, when it has a replay endpoint).
- after the subscriber saw the connection drop and come back: the engine is
  asked (replay from our last seq) whether it is still the process we knew,
  before anything else of that stream is applied; without a replay endpoint
  the stream is cleared (see ``_on_reconnected``).

Overflow policy: at most ``queue_size`` messages wait per shard (control items
such as flush, stop and disconnect notices are never refused).  Beyond that a
message is dropped, counted in ``dropped_messages``, and its pod
is marked for resync: once the shard is idle, every stream of that pod with a
replay endpoint is replayed from its last applied seq.  (A later message of
the stream would also reveal the gap.)  Bad input never raises out of a
worker: it is counted by kind and logged at most once per kind per minute.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable, Iterator
from typing import NamedTuple

import msgspec
import xxhash
import zmq

from kvevents.events import AllBlocksCleared, BlockRemoved, BlockStored, EventBatch
from kvevents.replay import ReplayClient
from kvevents.sglang import decode_sglang_batch
from kvevents.wire import REPLAY_END_SEQ, PayloadError, decode_seq, decode_vllm_batch, parse_topic
from kvindex.protocol import KVIndex

__all__ = ["Source", "RawMessage", "PoolStats", "EventPool", "RateLimitedLog"]

log = logging.getLogger("kvevents.pool")

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
    restarts: engine restarts detected (seq went back); dropped_messages: lost
    to full queues; resyncs: replays started by the overflow policy; orphans:
    blocks that waited for an unknown parent (from the index); queued: messages
    waiting now.
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
    """Sequence state of one publisher stream (pod, DP rank)."""

    __slots__ = ("last", "last_ts", "suspect", "replayed", "replay_max", "replay_endpoint", "engine", "model")

    def __init__(self, replay_endpoint: str | None, engine: str, model: str | None = None) -> None:
        self.model = model
        self.last: int | None = None
        self.last_ts: float | None = None
        # the publisher's connection dropped since the last applied batch: it
        # may be a new process whose seq has already passed ours
        self.suspect = False
        # seq -> engine ts of batches a replay applied that the live stream
        # may still deliver; cleared once the live stream is past them
        self.replayed: dict[int, float] = {}
        self.replay_max = -1
        self.replay_endpoint = replay_endpoint
        self.engine = engine


class _Flush(NamedTuple):
    done: threading.Event


class _Bootstrap(NamedTuple):
    source: Source
    pod: str
    dp_rank: int


class _Forget(NamedTuple):
    pod: str


class _Disconnected(NamedTuple):
    pod: str
    dp_rank: int


class _Reconnected(NamedTuple):
    pod: str
    dp_rank: int


_STOP = object()


class _Counters:
    __slots__ = (
        "messages", "batches", "events", "blocks_stored", "blocks_removed", "clears",
        "decode_errors", "gaps", "gaps_unrecovered", "replay_requests", "replayed_batches",
        "duplicates", "restarts", "resyncs", "errors_by_kind",
    )

    def __init__(self) -> None:
        for name in self.__slots__:
            setattr(self, name, 0)
        self.errors_by_kind: dict[str, int] = {}


class _Shard:
    """One worker thread with its queue, stream states and replay sockets."""

    def __init__(self, pool: EventPool, n: int) -> None:
        self.pool = pool
        self.n = n
        # one ordered queue for messages and control items; only messages count
        # against queue_size (control items must never block or be dropped)
        self.queue: queue.SimpleQueue = queue.SimpleQueue()
        self.pending = 0  # messages queued, guarded by pending_lock
        self.pending_lock = threading.Lock()
        self.streams: dict[tuple[str, int], _Stream] = {}
        self.c = _Counters()
        self.resync: set[str] = set()
        self.replay = ReplayClient(
            pool.zmq_context, timeout=pool.replay_timeout, on_error=self._error, max_batches=pool.replay_max_batches
        )
        self.thread: threading.Thread | None = None

    def start(self) -> None:
        self.thread = threading.Thread(target=self.run, name=f"kvevents-shard-{self.n}", daemon=True)
        self.thread.start()

    def offer(self, msg: RawMessage) -> bool:
        """Queue a message unless ``queue_size`` messages are already waiting."""
        with self.pending_lock:
            if self.pending >= self.pool.queue_size:
                return False
            self.pending += 1
        self.queue.put(msg)
        return True

    # -- loop

    def run(self) -> None:
        try:
            while True:
                try:
                    item = self.queue.get(timeout=0.05)
                except queue.Empty:
                    if self.resync:
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
            if self.resync:
                self._resync()
            item.done.set()
        elif isinstance(item, _Bootstrap):
            self._bootstrap(item)
        elif isinstance(item, _Disconnected):
            st = self.streams.get((item.pod, item.dp_rank))
            if st is not None and st.last is not None:
                st.suspect = True
        elif isinstance(item, _Reconnected):
            self._on_reconnected(item.pod, item.dp_rank)
        elif isinstance(item, _Forget):
            for key in [k for k in self.streams if k[0] == item.pod]:
                del self.streams[key]
            self.pool.index.clear(item.pod)

    # -- messages

    def _on_message(self, msg: RawMessage) -> None:
        c = self.c
        c.messages += 1
        pod, model = self.pool.route(msg.source, msg.topic)
        if pod is None:
            self._error("topic", "message with unparseable topic and no configured pod")
            return
        decoded = self._decode(msg.source, msg.seq, msg.payload)
        if decoded is None:
            return
        seq, batch = decoded
        if seq == REPLAY_END_SEQ:
            self._error("seq", "live message carries the replay end-marker seq")
            return
        rank = batch.dp_rank if batch.dp_rank is not None else msg.source.dp_rank
        st = self.streams.get((pod, rank))
        if st is None:
            st = self.streams[(pod, rank)] = _Stream(msg.source.replay_endpoint(pod, rank), msg.source.engine, model)
        self._sequence(st, msg.source, pod, rank, model, seq, batch)

    def _decode(self, source: Source, seq_frame: bytes, payload: bytes) -> tuple[int, EventBatch] | None:
        decoder = DECODERS.get(source.engine)
        if decoder is None:
            self._error("engine", f"unknown engine format {source.engine!r}")
            return None
        try:
            return decode_seq(seq_frame), decoder(payload)
        except PayloadError as exc:
            self._error(exc.kind, f"bad payload ({exc.kind}): {exc}")
            return None

    def _sequence(
        self, st: _Stream, source: Source, pod: str, rank: int, model: str | None, seq: int, batch: EventBatch
    ) -> None:
        c = self.c
        if st.suspect:
            st.suspect = False
            if seq != st.last + 1 and not self._same_process(st, pod, rank):
                self._restarted(st, pod, rank, f"seq {seq} after {st.last}, following a disconnect")
        if st.last is not None and seq <= st.last:
            if st.replayed.get(seq) == batch.ts:
                c.duplicates += 1
                return
            # the publisher went back: a new engine process
            self._restarted(st, pod, rank, f"seq {seq} after {st.last}")
        gap = False
        if st.last is None:
            if seq > 0 and st.replay_endpoint is not None:
                # joined late or missed the first messages: take what the engine still buffers
                self._replay(st, pod, rank, model, 0)
        elif seq > st.last + 1:
            c.gaps += 1
            gap = True
            if st.replay_endpoint is not None:
                self._replay(st, pod, rank, model, st.last + 1)
        if st.last is not None:
            if seq <= st.last:  # a replay already applied it
                c.duplicates += 1
                return
            if gap and seq > st.last + 1:
                c.gaps_unrecovered += 1
                self.pool.rlog.warn("gap", "pod %s rank %s: seq %s..%s lost", pod, rank, st.last + 1, seq - 1)
        self._apply(st, pod, rank, model, seq, batch)
        if st.replayed and seq > st.replay_max:
            st.replayed.clear()  # the live stream is past everything a replay applied

    def _on_reconnected(self, pod: str, rank: int) -> None:
        """The publisher is reachable again after a disconnect: check it before any message does.

        Without this, a restarted engine that has not published yet would
        keep its predecessor's blocks in the index until its first message.
        Without a replay endpoint the stream is cleared: it cannot be told
        from a restart (configure replay endpoints to keep the index across
        network blips).
        """
        st = self.streams.get((pod, rank))
        if st is None or not st.suspect:
            return
        st.suspect = False
        if st.replay_endpoint is None:
            # nothing to verify against: a restarted engine has an empty cache, so
            # forget the pod rather than predict blocks it may no longer hold
            self._restarted(st, pod, rank, "reconnected; no replay endpoint to verify it is the same process")
        elif not self._same_process(st, pod, rank):
            self._restarted(st, pod, rank, "a different process answered after a reconnect")
            self._replay(st, pod, rank, st.model, 0)

    def _restarted(self, st: _Stream, pod: str, rank: int, why: str) -> None:
        """A new engine process: forget the stream's blocks and sequence."""
        self.c.restarts += 1
        self.pool.rlog.warn("restart", "pod %s rank %s restarted (%s); clearing", pod, rank, why)
        self.pool.index.clear(pod, rank)
        st.last = st.last_ts = None
        st.replayed.clear()

    def _same_process(self, st: _Stream, pod: str, rank: int) -> bool:
        """After a disconnect, is the publisher still the process whose batch ``st.last`` we applied?

        With a replay endpoint: ask for batches from ``st.last``; the same
        process still has that batch with the same engine timestamp (unless
        over ``buffer_steps`` batches went by, which is treated as a restart:
        too much was missed to trust the stream).  Without one: only a
        message that continues the sequence exactly counts as the same process.
        """
        if st.replay_endpoint is None:
            return False
        self.c.replay_requests += 1
        try:
            for _topic, seq_frame, payload in self.replay.request(st.replay_endpoint, st.last):
                decoded = self._decode(Source(pod=pod, engine=st.engine, dp_rank=rank), seq_frame, payload)
                if decoded is None:
                    continue
                r_seq, r_batch = decoded
                if r_batch.dp_rank is not None and r_batch.dp_rank != rank:
                    continue
                # only the first batch matters; closing the generator discards the rest
                return r_seq == st.last and r_batch.ts == st.last_ts
            return False
        except TimeoutError:
            self._error("replay_timeout", f"pod {pod} rank {rank}: replay from {st.replay_endpoint} timed out")
            return False  # unverifiable: forget rather than predict blocks the engine may not hold
        except (ValueError, zmq.ZMQError) as exc:
            self._error("replay", f"pod {pod} rank {rank}: replay from {st.replay_endpoint} failed: {exc}")
            return False

    def _apply(self, st: _Stream, pod: str, rank: int, model: str | None, seq: int, batch: EventBatch) -> None:
        c = self.c
        index = self.pool.index
        st.last = seq
        st.last_ts = batch.ts
        c.batches += 1
        for ev in batch.events:
            c.events += 1
            try:
                if type(ev) is BlockStored:
                    index.block_stored(
                        pod, rank, ev.block_hashes, ev.parent_block_hash, ev.token_ids, ev.tier,
                        block_size=ev.block_size, extra_keys=ev.extra_keys, lora_name=ev.lora_name, model=model,
                    )
                    c.blocks_stored += len(ev.block_hashes)
                elif type(ev) is BlockRemoved:
                    index.block_removed(pod, rank, ev.block_hashes, ev.tier)
                    c.blocks_removed += len(ev.block_hashes)
                elif type(ev) is AllBlocksCleared:
                    index.clear(pod, rank)
                    c.clears += 1
            except (ValueError, TypeError) as exc:
                self._error("apply", f"pod {pod}: event not applied: {exc}")
        if batch.skipped_events:
            self._error(
                "unknown_event", f"pod {pod}: {batch.skipped_events} event(s) of an unknown type skipped",
                batch.skipped_events,
            )

    # -- replay

    def _replay(self, st: _Stream, pod: str, rank: int, model: str | None, start: int) -> None:
        """Ask the stream's engine for its batches from ``start`` on and apply the ones not yet applied."""
        c = self.c
        c.replay_requests += 1
        source = Source(pod=pod, engine=st.engine, dp_rank=rank, model=model)
        try:
            for topic, seq_frame, payload in self.replay.request(st.replay_endpoint, start):
                r_model = model
                if topic is not None:
                    # the replay endpoint is this stream's publisher's own, whatever its topic says
                    r_model = parse_topic(topic)[1] or model
                decoded = self._decode(source, seq_frame, payload)
                if decoded is None:
                    continue
                seq, batch = decoded
                if batch.dp_rank is not None and batch.dp_rank != rank:
                    continue
                c.replayed_batches += 1
                if st.last is not None:
                    if seq <= st.last:
                        continue
                    if seq > st.last + 1:
                        c.gaps_unrecovered += 1  # the engine's buffer no longer holds them
                st.replayed[seq] = batch.ts
                st.replay_max = max(st.replay_max, seq)
                self._apply(st, pod, rank, r_model, seq, batch)
        except TimeoutError:
            self._error("replay_timeout", f"pod {pod} rank {rank}: replay from {st.replay_endpoint} timed out")
        except (ValueError, zmq.ZMQError) as exc:
            self._error("replay", f"pod {pod} rank {rank}: replay from {st.replay_endpoint} failed: {exc}")

    def _bootstrap(self, item: _Bootstrap) -> None:
        key = (item.pod, item.dp_rank)
        st = self.streams.get(key)
        if st is None:
            st = self.streams[key] = _Stream(
                item.source.replay_endpoint(item.pod, item.dp_rank), item.source.engine, item.source.model
            )
        if st.replay_endpoint is None:
            return
        self._replay(st, item.pod, item.dp_rank, item.source.model, 0 if st.last is None else st.last + 1)

    def _resync(self) -> None:
        pods, self.resync = self.resync, set()
        for (pod, rank), st in list(self.streams.items()):
            if pod in pods and st.replay_endpoint is not None:
                self.c.resyncs += 1
                start = 0 if st.last is None else st.last + 1
                if start < REPLAY_END_SEQ:
                    self._replay(st, pod, rank, st.model, start)

    def _error(self, kind: str, msg: str, n: int = 1) -> None:
        c = self.c
        c.decode_errors += n
        c.errors_by_kind[kind] = c.errors_by_kind.get(kind, 0) + n
        self.pool.rlog.warn(kind, "kvevents: %s", msg)


class EventPool:
    """N shard workers applying KV-event messages to a :class:`~kvindex.protocol.KVIndex`.

    Args:
        index: the index to write.
        concurrency: number of shards (worker threads), >= 1 (default 4).
        queue_size: bound of each shard's queue in messages, >= 1.
        replay_timeout: seconds to wait for each replay reply before giving up.
        replay_max_batches: a replay that sends more batches than this without
            its end marker is cut off (vLLM's buffer holds 10,000 by default).
        zmq_context: context for replay sockets (default: the process's).

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
        zmq_context: zmq.Context | None = None,
    ) -> None:
        if concurrency < 1:
            raise ValueError(f"concurrency must be >= 1, got {concurrency}")
        if queue_size < 1:
            raise ValueError(f"queue_size must be >= 1, got {queue_size}")
        self.index = index
        self.queue_size = queue_size
        if not 0 < replay_timeout < 3600:
            raise ValueError(f"replay_timeout must be in (0, 3600) seconds, got {replay_timeout}")
        if replay_max_batches < 1:
            raise ValueError(f"replay_max_batches must be >= 1, got {replay_max_batches}")
        self.replay_timeout = replay_timeout
        self.replay_max_batches = replay_max_batches
        self.zmq_context = zmq_context or zmq.Context.instance()
        self.rlog = RateLimitedLog(log)
        self._dropped = 0
        self._extra_errors: dict[str, int] = {}  # counted outside the shards (frames, topics)
        self._lock = threading.Lock()
        self._shards = [_Shard(self, i) for i in range(concurrency)]
        self._started = False

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

    # -- input

    def shard_of(self, pod: str) -> int:
        """Stable shard number of a pod id (xxh3-64 of its UTF-8 bytes, mod N)."""
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
        pod, model = parse_topic(topic)
        if source.pod is not None:
            if pod is not None and pod != source.pod:
                self.record_error(
                    "topic_pod_mismatch",
                    f"topic names pod {pod!r} but the subscription is configured as {source.pod!r}; "
                    f"filing its blocks under {source.pod!r}",
                )
            pod = source.pod
        return (pod, model or source.model)

    def submit(self, msg: RawMessage) -> bool:
        """Queue one message for its pod's shard; never blocks.

        Returns False when the shard queue is full: the message is dropped,
        counted, and the pod is marked for resync (see module doc).
        """
        pod = msg.source.pod or parse_topic(msg.topic)[0]
        shard = self._shards[self.shard_of(pod or "")]
        if shard.offer(msg):
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

    def reconnected(self, pod: str, dp_rank: int = 0) -> None:
        """Note that the connection to (pod, dp_rank)'s publisher is back after a drop.

        With a replay endpoint the shard asks the engine at once whether it is
        the process we knew (see ``_on_reconnected``), so a restarted engine's
        old blocks leave the index before it publishes anything.
        """
        self._shards[self.shard_of(pod)].queue.put(_Reconnected(pod, dp_rank))

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
        return PoolStats(
            **{n: getattr(total, n) for n in _Counters.__slots__},
            dropped_messages=dropped,
            orphans=self.index.stats().orphans,
            queued=queued,
        )

    def streams(self) -> Iterator[tuple[str, int, int | None]]:
        """(pod, dp_rank, last applied seq) for every stream seen (a snapshot)."""
        for s in self._shards:
            for (pod, rank), st in list(s.streams.items()):
                yield pod, rank, st.last
