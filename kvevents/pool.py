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
import threading
import time
from collections.abc import Callable, Iterator

import xxhash
import zmq

# the pool's parts (kvevents.messages, .stats, .shards, .recovery); the names other code
# imports from here are re-exported
from kvevents.messages import _STOP, DECODERS, RawMessage, Source, StoreObserver, _Bootstrap, _Disconnected
from kvevents.messages import _Dropped as _Dropped
from kvevents.messages import _Flush, _Forget, _Reconnected
from kvevents.misconfig import ConfigCheck
from kvevents.shards import _Shard
from kvevents.stats import PoolStats, RateLimitedLog, StreamCounters, StreamState, _Counters
from kvevents.wire import parse_topic
from kvindex.contract import KVIndex

__all__ = [
    "Source", "RawMessage", "PoolStats", "StreamState", "StreamCounters", "EventPool", "RateLimitedLog", "StoreObserver",
    "DECODERS",
]

log = logging.getLogger("kvevents.pool")

#: Topics whose (pod, model) an EventPool remembers (then it starts over).
_TOPIC_CACHE = 4096


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
        fast_path: decode vLLM payloads of the plain shape without Python
            objects per token and apply them in one compiled call
            (:mod:`kvevents.fastwire`; only with the compiled index, same
            results as without); False: always the reference decoder.

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
        fast_path: bool = True,
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
        self.fast_path = fast_path
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
        stream's state before the event (e.g. :class:`kvindex.facade.healing.HealingPolicy`
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
                        "; ".join(p.message for p in bad) if bad else st.why, st.losses, sq.last_ts,
                        tuple(p.reason for p in bad),
                    ))
        out.sort(key=lambda x: (x.pod, x.model or "", x.dp_rank))
        return out
