"""Sequencing of one publisher's KV-event stream: a pure, synchronous state machine.

One :class:`Sequencer` per publisher stream = (pod, model, DP rank).  It holds
no sockets, threads or index: the pool's shard feeds it what arrived and
performs the :data:`Action` values it returns, in order, feeding the answers
of replays and restart checks back in.  This keeps every sequencing decision
in one place that a test can drive through any interleaving.

Inputs (methods): :meth:`~Sequencer.live` (a live batch, or a message whose
payload failed to decode), :meth:`~Sequencer.replayed` / :meth:`~Sequencer.replay_end`
(the batches of a replay the sequencer asked for, then its end or failure),
:meth:`~Sequencer.confirmed` (the answer to a restart check),
:meth:`~Sequencer.dropped` (a message of this pod was lost to a full queue),
:meth:`~Sequencer.disconnected` / :meth:`~Sequencer.reconnected`,
:meth:`~Sequencer.index_failed` (the index could not take a write: its store,
e.g. Redis, was unreachable), :meth:`~Sequencer.idle` (the shard's queue is
empty; the index takes writes again), :meth:`~Sequencer.retry` (the backoff of
a failed replay has passed).

Outputs (actions): :class:`Apply` (apply a batch to the index),
:class:`Clear` (forget the stream's blocks), :class:`Replay` (ask the engine's
replay endpoint for its batches from seq N, then call ``replayed`` for each
and ``replay_end``), :class:`Confirm` (ask the replay endpoint for the batch
at seq N and call ``confirmed`` with whether it is the batch we applied),
:class:`Count` (a statistic), :class:`Complete` (the completeness flag
changed).

The rules (vLLM seqs start at 0 per engine process and grow by 1 per batch;
vllm/distributed/kv_events.py ``ZmqEventPublisher``, vLLM 0.32) are written
out in docs/design.md, "The sequencer's rules".
"""

from __future__ import annotations

import math

# the action types (kvevents.actions) are importable from here as before
from kvevents.actions import Action, Apply, Batch, Clear, Complete, Confirm, Count, Replay
from kvevents.seqstate import _SequencerState

__all__ = [
    "Action",
    "Apply",
    "Batch",
    "Clear",
    "Complete",
    "Confirm",
    "Count",
    "Replay",
    "Sequencer",
    "backoff",
]


def backoff(base: float, n: int, cap: float = math.inf) -> float:
    """Seconds to wait after ``n`` doublings: ``base * 2**n``, at most ``cap``."""
    return min(cap, base * 2.0**n)


class Sequencer(_SequencerState):
    """Sequence state of one publisher stream (pod, model, DP rank).

    Args:
        has_replay: the publisher has a replay endpoint the shard can ask.

    Every input method returns the list of actions to perform in order.  When
    a :class:`Replay` or :class:`Confirm` is returned it is the last action;
    the caller must then answer (``replayed``... ``replay_end``, or
    ``confirmed``) before giving this sequencer any other input.
    """

    __slots__ = ()

    #: replays in a row that end at the same hole (no batch applied) before it is taken as lost
    MAX_HOLE_RETRIES = 3

    #: replayed-batch timestamps kept to recognise duplicates (bounded)
    MAX_REMEMBERED = 50_000

    #: the replay ops whose failure (nothing applied) is retried with backoff
    RETRIED_OPS = ("gap", "fresh", "bootstrap", "resync", "restart")

    @property
    def retry_pending(self) -> bool:
        """A replay failed without applying anything and is to be asked again (:meth:`retry`)."""
        return self._retry is not None

    def retry_delay(self, base: float, cap: float) -> float:
        """Seconds to wait before the pending :meth:`retry`: ``base`` doubled per failure in a row, at most ``cap``."""
        return backoff(base, max(0, min(self.retry_attempts - 1, 60)), cap)

    @property
    def hole_pending(self) -> bool:
        """The replay in progress has a hole and will be asked again: the rest of it need not be read."""
        return self._r_hole

    # ------------------------------------------------------------- inputs

    def live(self, b: Batch | None, seq: int | None = None) -> list[Action]:
        """A live message: its decoded batch, or None (with its ``seq``) when its payload was unreadable.

        An unreadable message does not move the sequence: its seq cannot be
        trusted, and if it was the engine's, the next message reveals the gap
        and the replay fetches it.
        """
        out: list[Action] = []
        if b is None:
            return out
        if self._candidate is not None:
            decided = self._live_with_candidate(out, b)
            if decided is not None:
                return decided
        if self._waits_for_retry(b):
            # a replay this message needs failed and is asked again later (``retry``): the engine's
            # buffer holds this message too, so it waits there rather than being applied past a hole
            out.append(Count("deferred"))
            return out
        if self.suspect and self.last is not None and b.seq != self.last + 1:
            # our sequence continuing (what the dropped connection still delivered, or a blip) is
            # applied below; the reconnect checks the process all the same, against our last batch
            # from before the drop: a restarted engine's batch can continue our seq too
            return self._live_after_disconnect(out, b)
        if self.last is None:
            return out + self._fresh(b)
        if b.seq == self.last + 1:
            return self._live_next(out, b)
        if b.seq <= self.last:
            return out + self._backward(b)
        # a gap
        out.append(Count("gaps"))
        if self.has_replay:
            self._pending = b
            return self._start_replay(out, "gap", self.last + 1)
        self._hold(out, "fwd", b)
        return out

    def _live_with_candidate(self, out: list[Action], b: Batch) -> list[Action] | None:
        """A live message while a candidate is held: the actions when it settles the message, else
        None (the candidate may have been dropped) and :meth:`live` goes on with it."""
        kind, cb = self._candidate  # type: ignore[misc]
        if self._recent.get(b.seq) == b.ts:
            # a copy of a batch we applied (delivered again late): it says nothing about the
            # candidate, which still waits for its successor
            out.append(Count("duplicates"))
            return out
        if b.seq == cb.seq + 1 and b.ts >= cb.ts:
            return self._candidate_continued(out, kind, cb, b)
        if kind == "back" and b.seq == cb.seq and b.ts == cb.ts:
            out.append(Count("duplicates"))
            return out  # the same message again
        if kind == "back" and b.seq <= cb.seq and b.ts < cb.ts and (self.last_ts is None or b.ts <= self.last_ts):
            # older than the candidate and than our last batch: not a still newer process starting
            # over, but a message from before both (a late copy, or not the engine's); it must not
            # take the candidate's place
            out.append(Count("stale"))
            return out
        if (
            kind == "back" and self.has_replay and self.last is not None and b.seq == self.last + 1
            and b.ts > cb.ts
        ):
            # our next seq, but newer than the candidate (itself newer than our last batch): the
            # candidate's process may have reached our seq, its batches between lost; the
            # engine's buffer decides (a replay from our last batch checks the process)
            self._candidate = None
            out.append(Count("unconfirmed"))
            self._pending = b
            return self._start_replay(out, "gap", self.last + 1)
        if self.last is not None and b.seq == self.last + 1 or kind == "back" and b.seq == cb.seq:
            # our sequence continues (the candidate was not the engine's), or another message
            # with the candidate's seq: a still newer process starting over, judged below as a
            # backward message of its own
            self._candidate = None
            out.append(Count("unconfirmed"))
        return None

    def _candidate_continued(self, out: list[Action], kind: str, cb: Batch, b: Batch) -> list[Action]:
        """``b`` continues the held candidate ``cb`` (its seq + 1, not older): the candidate is decided."""
        self._candidate = None
        if kind == "back" and self.has_replay:
            # the endpoint could not be asked when the candidate came; it is the authority:
            # rebuild from the new process's buffer (the candidate itself may be a still
            # older process's first batch when this one's was lost)
            out.append(Count("restarts"))
            self._clear(out, f"restart: seq {cb.seq}, {b.seq} after {self.last}")
            self.lost = True
            self._set_complete(out, "restart")
            self._pending = b
            return self._start_replay(out, "restart", 0)
        if kind == "back":
            out.append(Count("restarts"))
            self._clear(out, f"restart confirmed: seq {cb.seq}, {b.seq} after {self.last}")
            self._apply(out, cb)
            self.exact = cb.seq == 0 or cb.resets
        elif self.has_replay and (self.last is None or cb.seq > self.last + 1):
            # a start or a gap nobody could check (the endpoint did not answer): ask it once
            # more, it rebuilds or fills the stream from its buffer; if it does not answer,
            # replay_end goes on without it
            self._pending = b
            self._held = cb
            if self.last is None:
                return self._start_replay(out, "fresh", 0)
            return self._start_replay(out, "gap", self.last + 1)
        elif self.last is None and cb.seq == 0:
            self.exact = True  # a stream starting at seq 0, confirmed by its next message
            self._apply(out, cb)
        else:
            out.append(Count("gaps_unrecovered"))
            self.exact = False
            self._apply(out, cb)
        self.lost = False
        self._apply(out, b)
        self._set_complete(out, "restart" if kind == "back" else "unrecovered gap")
        return out

    def _waits_for_retry(self, b: Batch) -> bool:
        """A failed replay is to be asked again and ``b`` needs it (past a gap, a stream's first, or
        the next seq while a check, a resync or an older engine time is in question)."""
        return self._retry is not None and (
            self.last is None or b.seq > self.last + 1 or b.seq == self.last + 1 and (
                self._check_due or self._resync_due or self._retry == "resync"
                or self.last_ts is not None and b.ts < self.last_ts
            )
        )

    def _live_after_disconnect(self, out: list[Action], b: Batch) -> list[Action]:
        """A live message after a disconnect that does not continue our sequence: check the process."""
        self.suspect = False
        self._pending = b
        if not self.has_replay:
            # cannot tell a restart from a blip: forget, then take this message as a fresh start
            self._pending = None
            out.append(Count("restarts"))
            self._clear(out, f"seq {b.seq} after {self.last} following a disconnect; no replay endpoint")
            return out + self._fresh(b)
        self._op = "confirm-live"
        out.append(Count("replay_requests"))
        out.append(Confirm(*self._known()))
        return out

    def _live_next(self, out: list[Action], b: Batch) -> list[Action]:
        """A live message with our next seq (``last`` + 1)."""
        if self.has_replay and self.last_ts is not None and b.ts < self.last_ts:
            # the next seq with an older engine time: a previous process's message still
            # queued after we moved to its successor (whose buffer is asked instead)
            self._pending = b
            return self._start_replay(out, "gap", self.last + 1)  # type: ignore[operator]
        if self.has_replay and self._resync_due:
            # a message of this pod was dropped since our last batch: the dropped ones may
            # have been a restarted engine's first batches, and this one its next, so the
            # next seq proves nothing.  Resync now (from our last batch, which the same
            # process still holds), not at the next idle moment, which would verify
            # against the new process's own batch once this one were applied.
            self._resync_due = False
            out.append(Count("resyncs"))
            self._pending = b
            return self._start_replay(out, "resync", self.last + 1)  # type: ignore[operator]
        if self.lost and self._gave_up:
            # applied past a possible loss nobody could check (the endpoint was given up): a
            # restart whose first batches were lost goes unseen, and a later replay from our
            # last batch cannot tell, so the stream no longer claims to be exact
            self.exact = False
        self._apply(out, b)
        self._forget_passed(b.seq)
        self._set_complete(out, "in sequence")
        return out

    def _fresh(self, b: Batch) -> list[Action]:
        """First message of a stream we hold nothing of (new, or cleared)."""
        out: list[Action] = []
        if self.has_replay:
            # even a seq 0 is checked against the engine's buffer: one message cannot start a stream
            self._pending = b
            return self._start_replay(out, "fresh", 0)
        if b.seq == 0:
            self.exact = True
            self.lost = False
            self._apply(out, b)
            self._set_complete(out, "started at seq 0")
            return out
        # joined late without a replay: what came before is unknown
        self.exact = False
        self._apply(out, b)
        self._set_complete(out, "joined late without replay")
        return out

    def _backward(self, b: Batch) -> list[Action]:
        out: list[Action] = []
        if self._replayed.get(b.seq) == b.ts:
            out.append(Count("duplicates"))
            return out
        if self._in_hole(b.seq) and (self.last_ts is None or b.ts <= self.last_ts):
            # published before the batches a replay moved us to (a newer engine time would
            # be a new process starting over: checked below)
            out.append(Count("stale"))
            return out
        if self.has_replay:
            self._pending = b
            self._op = "confirm-back"
            out.append(Count("replay_requests"))
            out.append(Confirm(*self._known()))
            return out
        self._hold(out, "back", b)
        return out

    def replayed(self, b: Batch | None, seq: int | None = None) -> list[Action]:
        """One batch of the replay in progress (None with its ``seq`` when unreadable)."""
        out: list[Action] = []
        s = b.seq if b is not None else seq
        if s is None:
            return out
        self._r_count += 1
        first = self._r_first is None
        if first:
            self._r_first = s
        if self._r_restart:
            return out  # a new process: replayed again from its seq 0 at the end
        if first and self._r_verify is not None and s == self._r_verify[0]:
            if b is not None and b.ts == self._r_verify[1]:
                if not self.suspect:
                    self._mark = None  # the reconnect is checked: the process we know
                return out  # our last batch: the same process
            out.append(Count("restarts"))
            self._clear(out, f"the engine's batch {s} is not the one applied: a new process")
            self._r_restart = True
            return out
        if first and self._r_verify is not None and s > self._r_verify[0] and self.last is not None:
            # the buffer no longer holds our last batch, so it cannot tell us whether this is still
            # our process (a new one that published past our seq looks the same): what we hold
            # cannot be trusted; rebuilt from what the buffer holds (incomplete, judged below)
            self._clear(out, f"the engine's buffer starts at {s}, after our last batch {self._r_verify[0]}")
        if b is None:
            self._r_bad = s if self._r_bad is None else max(self._r_bad, s)
            return out  # a hole: the next readable batch will show it (or the replay's end)
        if self._r_hole:
            return out  # the rest of a replay with a hole: asked again at its end
        out.append(Count("replayed_batches"))
        if self.last is not None and b.seq <= self.last:
            return out
        expected = self._r_start if self.last is None else self.last + 1
        if (
            b.seq > expected and self.last is not None and self._r_first is not None
            and self._r_first <= expected and self._r_retries < self.MAX_HOLE_RETRIES
        ):
            # the engine's buffer reached back to what we need, but a batch in between did not
            # arrive (e.g. a reply burst beyond the sockets' high-water marks, which vLLM's ROUTER
            # drops): ask again from the first missing seq at this replay's end
            out.append(Count("replay_holes"))
            self._r_hole = True
            return out
        if b.seq > expected:
            # the buffer no longer holds expected..seq-1: rebuild from what it holds
            out.append(Count("gaps_unrecovered"))
            if self.last is not None or self._r_cleared:
                self._clear(out, f"seq {expected}..{b.seq - 1} lost; rebuilding from the engine's buffer")
            self._holes.append((expected, b.seq - 1))
            self.exact = False
        elif self.last is None and b.seq == 0:
            self.exact = True
        self._r_cleared = True
        self._replayed[b.seq] = b.ts
        if len(self._replayed) > self.MAX_REMEMBERED:
            for k in sorted(self._replayed)[: len(self._replayed) // 2]:
                del self._replayed[k]
        self._replay_max = max(self._replay_max, b.seq)
        self._apply(out, b, replayed=True)
        return out

    def replay_end(self, ok: bool, cut: bool = False) -> list[Action]:
        """The replay in progress ended: ``ok`` when its end marker came, False on timeout or error.

        ``cut``: the client stopped reading it at its bound (``replay_max_batches``
        batches, or its time limit) before the end marker: the batches after
        the cut were not applied.  When the replay applied something the rest
        is asked for at once from the first missing seq (counted
        ``replay_cuts``); a cut that applied nothing is a failure like a
        timeout.  A failure that applied nothing is asked again later
        (:meth:`retry`, backoff chosen by the caller from :meth:`retry_delay`)
        up to ``max_retries`` times in a row; meanwhile the stream stays at its
        last batch, incomplete, and live messages that would need the replay
        wait in the engine's buffer (``deferred``).  When the retries run out,
        the stream goes on as without a replay endpoint (the gap counted
        ``gaps_unrecovered``, the stream incomplete; an unnoticed restart
        whose first batches are lost meanwhile is not seen then, and the
        stream stays incomplete); later gaps still ask the
        endpoint once each (and once more when the next message continues the
        held one), but their failures are retried again only after
        the endpoint has answered a replay or check.
        """
        out: list[Action] = []
        if cut:
            out.append(Count("replay_cuts"))
        if self._r_restart:
            self._r_restart = False
            return self._start_replay(out, "restart", 0)  # keeps the pending batch
        bad_tail = ok and self._r_bad is not None and (self.last is None or self._r_bad > self.last)
        progressed = self.last is not None and self.last != self._r_last0
        again = self._replay_again(out, ok, cut, bad_tail, progressed)
        if again is not None:
            return again
        self._r_retries = 0
        op, self._op = self._op, None
        if ok and self._r_count == 0 and self.last is not None and self._r_verify is not None:
            # the engine holds nothing from our last batch on: a new process whose seqs are
            # still below ours (the pending message, if any, is judged after its rebuild)
            out.append(Count("restarts"))
            self._clear(out, "the engine's buffer no longer has our last batch nor anything after it")
            return self._start_replay(out, "restart", 0)
        pending, self._pending = self._pending, None
        held, self._held = self._held, None
        hold = self._replay_outcome(out, ok, op, progressed, bad_tail)
        if ok and op == "restart" and self._r_count == 0 and self.last is None and not self.down:
            # a new process whose buffer is empty has published nothing: it holds nothing, as we do
            # (while disconnected, what it publishes next may be missed: the rejoin looks again)
            self.exact = True
        if pending is not None and hold and (self.last is None or pending.seq > self.last):
            out.append(Count("deferred"))  # the retry fetches it from the engine's buffer
            pending = None
        if pending is not None:
            self._settle_pending(out, ok, pending, held)
        self._set_complete(out, f"replay ({op}) {'ended' if ok else 'failed'}")
        return out

    def _replay_again(
        self, out: list[Action], ok: bool, cut: bool, bad_tail: bool, progressed: bool
    ) -> list[Action] | None:
        """The ended replay is asked again at once (a hole, a cut after progress, a lost tail): its
        actions; else None."""
        if bad_tail and self.last is not None and not self._r_hole and self._r_retries < self.MAX_HOLE_RETRIES:
            # the newest batches the engine replayed were unreadable and nothing after them came: a
            # hole at the end, asked again from the first missing seq like one in the middle
            out.append(Count("replay_holes"))
            self._r_hole = True
        if self._r_hole:
            self._r_hole = False
            self._r_retries = 0 if self.last != self._r_last0 else self._r_retries + 1
            return self._start_replay(out, self._op or "gap", self.last + 1)  # type: ignore[operator]
        if cut and progressed and self._op in self.RETRIED_OPS and self.last < 2**64 - 2:  # type: ignore[operator]
            # the endpoint holds more than one replay may read: the rest, from the first missing seq
            self._r_retries = 0
            self.retry_attempts = 0
            if not self.lost:
                self.lost = True
                self._set_complete(out, "replay cut off at its bound; asking for the rest")
            return self._start_replay(out, self._op, self.last + 1)  # type: ignore[arg-type, operator]
        if (
            not ok and self.MAX_HOLE_RETRIES > 0 and progressed
            and self._op in ("gap", "fresh", "bootstrap", "resync", "restart")
        ):
            # the replay stopped after making progress: its tail (end marker included) was lost on
            # the way, as a hole with nothing after it; ask again from the first missing seq
            out.append(Count("replay_holes"))
            self._r_retries = 0
            self.retry_attempts = 0
            return self._start_replay(out, self._op, self.last + 1)  # type: ignore[arg-type, operator]
        return None

    def _replay_outcome(self, out: list[Action], ok: bool, op: str | None, progressed: bool, bad_tail: bool) -> bool:
        """Take the ended replay's outcome (the stream's loss and retry state); True when it failed
        without applying anything and is to be asked again (the stream waits at ``last``)."""
        hold = False  # a failure that applied nothing, asked again later: the stream waits at ``last``
        if ok:
            self.lost = False  # we now have everything the engine published up to its newest batch
            self.retry_attempts = 0
            self._gave_up = False
            self._check_due = False
            if self._candidate is not None and self._r_count > 0:
                self._candidate = None  # the engine's buffer is the authority now
                out.append(Count("unconfirmed"))
            if bad_tail:
                self.lost = True  # the buffer's newest batches stayed unreadable: they are lost
                out.append(Count("gaps_unrecovered"))
        else:
            out.append(Count("replay_failures"))
            if progressed:
                self.retry_attempts = 0
            elif self.has_replay and op in self.RETRIED_OPS and not self._gave_up:
                self.retry_attempts += 1
                if self.retry_attempts <= self.max_retries:
                    hold = True
                    self._retry = op
                    self.lost = True
                else:
                    self.retry_attempts = 0
                    self._gave_up = True  # taken as is until the endpoint answers again
                    self._check_due = False
            if not hold and op in ("gap", "fresh"):
                out.append(Count("gaps_unrecovered"))
                self.exact = False
        return hold

    def _settle_pending(self, out: list[Action], ok: bool, pending: Batch, held: Batch | None) -> None:
        """Judge the live message that waited for the ended replay (``held``: the unchecked one it
        continued)."""
        if self.last is None:
            if ok:
                # the engine's buffer is empty: it has not published this message (vLLM
                # buffers a batch as it publishes it); its next message starts the stream
                out.append(Count("unconfirmed"))
            elif held is not None:
                # a start: only the continuing message is applied (joined late), never the
                # unchecked one before it, which may be a message no process published
                out.append(Count("unconfirmed"))
                self.exact = False
                self._apply(out, pending)
            else:
                self._hold(out, "fwd", pending)  # could not ask: the next message must continue it
        elif pending.seq <= self.last:
            if self._replayed.get(pending.seq) == pending.ts:
                out.append(Count("duplicates"))
            else:
                out.append(Count("stale" if self._in_hole(pending.seq) else "unconfirmed"))
        elif pending.seq == self.last + 1:
            if ok and self.last_ts is not None and pending.ts < self.last_ts:
                out.append(Count("unconfirmed"))  # older than the batch before it: not this process's
            else:
                self._apply(out, pending)
        elif ok and self._r_count > 0:
            out.append(Count("unconfirmed"))  # beyond the engine's newest batch
        elif not ok and held is not None and held.seq > self.last and held.seq + 1 == pending.seq:
            # the gap's two messages, as without an endpoint (the failure counted the gap)
            self.exact = False
            self._apply(out, held)
            self._apply(out, pending)
        else:
            # no buffer to check against (or the check failed): the next message decides
            self._hold(out, "fwd", pending)

    def retry(self) -> list[Action]:
        """Ask again the replay that failed without applying anything (when :attr:`retry_pending`).

        The caller calls it once :meth:`retry_delay` has passed since the
        failure (and the index takes writes).  The replay is asked from the
        stream's last batch on (from seq 0 when it holds none), as a gap
        replay: the engine must still hold our last batch, so a restart during
        the outage is caught.  Returns [] when no retry is pending.
        """
        out: list[Action] = []
        if self._retry is None or self._op is not None:
            return out
        op, self._retry = self._retry, None
        out.append(Count("replay_retries"))
        if self.last is None:
            return self._start_replay(out, op, 0)
        if self.last >= 2**64 - 2:
            return out
        self._resync_due = False  # the retry checks the process and replays what was missed
        return self._start_replay(out, "resync" if op == "resync" else "gap", self.last + 1)

    def confirmed(self, same: bool | None) -> list[Action]:
        """Answer to :class:`Confirm`: True = the process we know; False = another; None = could not ask."""
        out: list[Action] = []
        op, self._op = self._op, None
        pending, self._pending = self._pending, None
        if same is not None:
            self._gave_up = False  # the endpoint answers again
        if same is None:
            out.append(Count("replay_failures"))
            if pending is not None:
                if op == "confirm-live" and pending.seq > (self.last or 0):
                    self._hold(out, "fwd", pending)
                else:
                    self._hold(out, "back", pending)
            else:
                self.lost = True
                if op == "confirm-reconnect" and self.has_replay and self.last is not None and not self._gave_up:
                    # the engine may have restarted: ask again later (a resync replay from our last
                    # batch checks the process); until then no message applies, not even the next seq
                    self.retry_attempts += 1
                    if self.retry_attempts <= self.max_retries:
                        self._retry = "resync"
                        self._check_due = True
                    else:
                        self.retry_attempts = 0
                        self._gave_up = True
                self._set_complete(out, "reconnect check failed")
            return out
        if same:
            if not self.suspect:
                self._mark = None  # the reconnect is checked: the process we know
            if pending is not None and pending.seq <= (self.last if self.last is not None else -1):
                ours = self._recent.get(pending.seq)
                if ours is not None and ours == pending.ts:
                    out.append(Count("duplicates"))
                elif ours is not None and ours < pending.ts < self.last_ts:  # type: ignore[operator]
                    # the process that holds our last batch published this one at a seq we hold an
                    # older process's batch for (its first batches came after its next one): what
                    # we hold mixes two processes; rebuilt from the engine's buffer
                    out.append(Count("restarts"))
                    self._clear(out, f"seq {pending.seq} of the process holding our last batch is not the one applied")
                    return self._start_replay(out, "restart", 0)
                else:
                    out.append(Count("unconfirmed"))  # a message that is not the engine's
                pending = None
            # catch up on what was missed (a gap, or the disconnect)
            self._pending = pending
            return self._start_replay(out, "gap", self.last + 1)  # type: ignore[operator]
        out.append(Count("restarts"))
        self._clear(out, "a different engine process answered")
        self._pending = pending
        return self._start_replay(out, "restart", 0)

    def dropped(self, in_place: bool = False) -> list[Action]:
        """A message of this pod was dropped (full queue): the stream may miss batches.

        ``in_place``: the notice comes at the lost message's place in the order
        (after the messages queued before it), following an earlier notice the
        shard gave as soon as it saw the drop: it only discards a candidate held
        since (the earlier notice marked the stream and asked for its resync).
        """
        out: list[Action] = []
        if in_place:
            if self._candidate is not None:
                self._candidate = None
                out.append(Count("unconfirmed"))
                self._set_complete(out, "message dropped")
            return out
        if self._candidate is not None:
            # the dropped message may have come between the candidate and its successor (e.g. a
            # still newer process's first batch): the next message no longer confirms it
            self._candidate = None
            out.append(Count("unconfirmed"))
        self.lost = True  # with nothing applied, the next message starts the stream from the buffer
        if self.last is not None:
            self._resync_due = True
        self._set_complete(out, "message dropped")
        return out

    def disconnected(self) -> list[Action]:
        """The connection to the publisher dropped: messages may be lost, the engine may restart."""
        out: list[Action] = []
        self.down = True
        if self.last is not None:
            self.suspect = True
            if self._mark is None:
                self._mark = (self.last, self.last_ts)
        self.lost = True
        self._set_complete(out, "disconnected")
        return out

    def reconnected(self) -> list[Action]:
        """The connection is back: check the publisher before anything else is applied."""
        out: list[Action] = []
        self.down = False
        if not self.suspect:
            return out
        self.suspect = False
        if not self.has_replay:
            out.append(Count("restarts"))
            self._clear(out, "reconnected; no replay endpoint to verify it is the same process")
            self.lost = True  # what the engine holds now is unknown
            self._set_complete(out, "reconnect without replay")
            return out
        if self.last is None:
            # cleared since the drop (a restart was found): nothing applied is left to check, and
            # what comes next is checked as a fresh start
            return out
        self._op = "confirm-reconnect"
        out.append(Count("replay_requests"))
        out.append(Confirm(*self._known()))
        return out

    def bootstrap(self) -> list[Action]:
        """The subscriber connected for the first time: take what the engine still buffers.

        Also a later look at the buffer of a publisher whose subscription
        (re)joined (from our last batch on, which the same process still holds).
        """
        out: list[Action] = []
        if not self.has_replay or self._candidate is not None:
            return out
        return self._start_replay(out, "bootstrap", 0 if self.last is None else self.last + 1)

    def index_failed(self) -> list[Action]:
        """The index could not take a write of this stream (its store was unreachable).

        The index may now hold less or more than the engine: the stream is
        incomplete until :meth:`idle` rebuilds it.  Safe to call while a
        replay is in progress (it only marks the stream).
        """
        out: list[Action] = []
        self.broken = True
        self._rebuild_due = True
        self._set_complete(out, "index write failed")
        return out

    def rebuild_due(self) -> bool:
        """A write was lost (:meth:`index_failed`) and the stream awaits its rebuild."""
        return self._rebuild_due

    def idle(self) -> list[Action]:
        """The shard's queue is empty and the index takes writes: rebuild a stream whose
        writes were lost, or replay what a drop may have lost (resync)."""
        out: list[Action] = []
        if self._rebuild_due and self._op is None:
            self._rebuild_due = False
            self.broken = False
            self._resync_due = False
            out.append(Count("rebuilds"))
            self._clear(out, "index writes were lost; rebuilding from the engine's buffer")
            if self.has_replay:
                return self._start_replay(out, "restart", 0)
            self._set_complete(out, "rebuilt without replay")
            return out
        if (
            self._resync_due and self.lost and self.has_replay and not self.suspect and self._candidate is None
            and self._retry is None
        ):
            self._resync_due = False
            out.append(Count("resyncs"))
            start = 0 if self.last is None else self.last + 1
            if start < 2**64 - 1:
                return self._start_replay(out, "resync", start)
        return out
