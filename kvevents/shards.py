"""The pool's shards: one worker thread each, with its ordered queue, streams and counters.

A shard takes messages and control items from its queue in order, decodes
each message (vLLM or SGLang adapter), feeds it to its stream's
:class:`~kvevents.sequencer.Sequencer` and performs the actions it returns:
apply a batch to the index, clear a stream, count, or ask the engine's replay
endpoint (:mod:`kvevents.recovery`).  Bad input never raises out of the
worker: it is counted by kind and logged at most once per kind per minute.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable, Sequence

from kvevents.actions import Action, Apply, Clear, Complete, Confirm, Count, Replay
from kvevents.events import AllBlocksCleared, BlockRemoved, BlockStored, EventBatch
from kvevents.fastwire import FastBatch, decode_fast
from kvindex.hybrid import FULL_KINDS, GroupSpec
from kvevents.misconfig import MODEL_NAME
from kvevents.messages import (
    _STOP, DECODERS, RawMessage, Source, StoreObserver, _as_batch, _Bootstrap, _Disconnected, _Dropped,
    _Flush, _Forget, _Reconnected,
)
from kvevents.recovery import ShardHost, _Recovery
from kvevents.stats import StreamKey, _Counters, _Stream
from kvevents.wire import REPLAY_END_SEQ, PayloadError, decode_seq, decode_vllm_batch
from kvindex.contract import ApplyResult, BatchApply, GroupAware, IndexUnavailable, RawApply
from kvindex.side_tables import apply_each

log = logging.getLogger("kvevents.pool")  # the pool's logger (one name for the write path's records)

# the event classes the index's batch apply dispatches on (kvindex does not import kvevents)
_EVENT_KINDS = (BlockStored, BlockRemoved, AllBlocksCleared)


class _Shard(_Recovery):
    """One worker thread with its queue, stream sequencers and replay sockets: a thin executor.

    Every sequencing decision is the :class:`~kvevents.sequencer.Sequencer`'s;
    the shard decodes, feeds it, and performs the actions it returns.
    """

    def __init__(self, pool: ShardHost, n: int) -> None:
        super().__init__(pool)
        self.n = n
        # one ordered queue for messages and control items; only messages count
        # against queue_size (control items must never block or be dropped)
        self.queue: queue.SimpleQueue = queue.SimpleQueue()
        self.pending = 0  # messages queued, guarded by pending_lock
        self.pending_lock = threading.Lock()
        self.last_dropped: str | None = None  # the pod of the last queued drop marker, if nothing was queued since
        self.streams: dict[StreamKey, _Stream] = {}
        self.c = _Counters()
        self.thread: threading.Thread | None = None
        self.batch_apply = isinstance(pool.index, BatchApply)  # checked once: _apply runs per message
        # vLLM payloads decoded without Python objects per token, for a backend that applies them so
        self.fast = pool.fast_path and isinstance(pool.index, RawApply)
        self.grouped = isinstance(pool.index, GroupAware)

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
                if self.shared is not None and self.shared.generation != self.index_gen:
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
                    self._guarded(self._on_message, item)  # (what _handle does with a message)
                    continue
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
                self._drop_stream(key)
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
                self.pool.config_check.stream(pod, model, rank, source.model, source.engine),
            )
            self._retire_wrong_models(st)
        return st

    def _drop_stream(self, key: StreamKey) -> None:
        """Forget a stream's sequence state and its pending resync and retry."""
        del self.streams[key]
        self.resync_due.discard(key)
        self.retry_at.pop(key, None)

    def _retire_wrong_models(self, new: _Stream) -> None:
        """A publisher heard under a new model ends its streams flagged for the wrong model.

        An engine publishes one model (its topic is set at start-up), so a new
        model on the same (pod, rank) means it restarted with another one; the
        old streams' flags and blocks (scoped to a model nobody scores) go.
        What an old stream's replay took of the new process (replayed batches
        carry no topic) goes with them; the new stream, fresh, takes the
        engine's buffer from seq 0 again (``Sequencer`` rule for a first message).
        """
        for key, old in list(self.streams.items()):
            if old is new or old.pod != new.pod or old.rank != new.rank:
                continue
            if not any(p.reason == MODEL_NAME for p in old.check.problems):
                continue
            self._drop_stream(key)
            log.warning("kvevents: %s (rank %s) now publishes model %r: its stream of model %r is retired",
                        new.pod, new.rank, new.model, old.model)
            try:
                self.pool.index.clear(old.pod, old.rank, model=old.model)
            except IndexUnavailable as exc:
                self._unavailable(f"pod {old.pod}: blocks of model {old.model!r} not removed: {exc}")

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

    def _decode(self, engine: str, seq_frame: bytes, payload: bytes) -> tuple[int, EventBatch | FastBatch] | None:
        decoder = DECODERS.get(engine)
        if decoder is None:
            self._error("engine", f"unknown engine format {engine!r}")
            return None
        try:
            seq = decode_seq(seq_frame)
            if self.fast and decoder is decode_vllm_batch:  # (SGLang's and a replaced decoder: theirs)
                fb = decode_fast(payload)
                if fb is not None:
                    return seq, fb
            return seq, decoder(payload)
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
                st.flat = None
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

    def _apply(self, st: _Stream, batch: EventBatch | FastBatch) -> None:
        if type(batch) is FastBatch:
            if self._fast_ready(st, batch):
                self._apply_fast(st, batch)
                return
            batch = batch.slow()
        if st.flat is not None and (st.flat[0] or st.flat[1]):
            st.flat = None  # the reference path may teach a GroupAware index groups: ask again
        c = self.c
        index = self.pool.index
        pod, rank, model = st.pod, st.rank, st.model
        c.batches += 1
        c.events += len(batch.events)
        st.batches += 1
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
        elif self.batch_apply:  # the whole batch in one call (the compiled index: runs of events natively)
            r = index.apply_events(pod, rank, batch.events, model=model, kinds=_EVENT_KINDS)  # type: ignore[union-attr]
        else:
            r = apply_each(index, pod, rank, batch.events, model, _EVENT_KINDS)
        self._tally(st, batch, r, len(batch.events))

    def _fast_ready(self, st: _Stream, fb: FastBatch) -> bool:
        """Whether a fast-decoded batch may be applied as such: nothing looks at its events
        (no store observer, no configuration check watching) and no KV-cache group but a
        full-attention one is known for the stream (checked once per stream, again after a clear
        or a batch applied the reference way)."""
        if st.check.watching or (self.pool.store_observers and self.pool.observers_of(st.pod, st.rank, st.model)):
            return False
        if self.grouped:
            flat = st.flat
            if flat is None:
                index = self.pool.index
                specs = index.group_specs(st.pod, st.rank, model=st.model)  # type: ignore[attr-defined]
                plain = len(specs) <= 1 and all(g.kind in FULL_KINDS for g in specs.values())
                # a batch naming group 0 as full attention (every vLLM 0.32 store of a plain model) once
                # the stream has learned exactly that group: the reference path would change nothing
                named = plain and specs.get(0) == GroupSpec(0, "full_attention", index.block_size)  # type: ignore[attr-defined]
                flat = st.flat = (plain, named, bool(specs))
            if fb.raw.resets and flat[2]:
                return False  # a clear forgets the stream's groups too: the reference way
            return flat[1] if fb.raw.grouped else flat[0]
        return True

    def _apply_fast(self, st: _Stream, fb: FastBatch) -> None:
        c = self.c
        n = len(fb.raw)
        c.batches += 1
        c.events += n
        st.batches += 1
        r = self.pool.index.apply_raw(  # type: ignore[attr-defined]
            st.pod, st.rank, fb.raw, fb.slow_events, model=st.model, kinds=_EVENT_KINDS)
        self._tally(st, fb, r, n)

    def _tally(self, st: _Stream, batch: EventBatch | FastBatch, r: ApplyResult, n: int) -> None:
        """Count an applied batch's result; report its errors, losses and left-out events."""
        c = self.c
        pod = st.pod
        c.blocks_stored += r.stored_blocks
        c.blocks_removed += r.removed_blocks
        c.clears += r.clears
        # per stream, by tier: the blocks the processed events carried (one step per event, not per block)
        done = n - r.left
        st.events += done
        st.clears += r.clears
        # (the index tallies them: ApplyResult.stored_by_tier / removed_by_tier)
        _add_blocks(st.stored, r.stored_by_tier)
        _add_blocks(st.removed, r.removed_by_tier)
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

    def _error(self, kind: str, msg: str, n: int = 1, quiet: bool = False) -> None:
        c = self.c
        c.decode_errors += n
        c.errors_by_kind[kind] = c.errors_by_kind.get(kind, 0) + n
        if not quiet:
            self.pool.rlog.warn(kind, "kvevents: %s", msg)


def _add_blocks(into: dict[str, int], by_tier: dict[str, int]) -> None:
    """Add per-tier block counts; a tier with no block counts nothing (an empty removal leaves no
    zero entry, whichever apply path counted it)."""
    for tier, k in by_tier.items():
        if k:
            into[tier] = into.get(tier, 0) + k
