"""The state of one publisher stream's sequencer and the primitive steps its rules are made of.

:class:`_SequencerState` holds what :class:`kvevents.sequencer.Sequencer`
knows of its stream (last applied seq and engine timestamp, exactness, loss,
the held candidate, the replay in progress) and the steps every input uses:
apply a batch, clear the stream, start a replay, hold a candidate, note a
completeness change.  Pure: no sockets, threads or index.
"""

from __future__ import annotations

from kvevents.actions import Action, Apply, Batch, Clear, Complete, Count, Replay

__all__: list[str] = []


class _SequencerState:
    """Sequence state of one publisher stream (see :class:`kvevents.sequencer.Sequencer`)."""

    __slots__ = (
        "has_replay", "last", "last_ts", "exact", "lost", "suspect", "complete",
        "_replayed", "_replay_max", "_holes", "_candidate", "_pending", "_op",
        "_r_start", "_r_first", "_r_count", "_r_cleared", "_resync_due", "_r_verify", "_r_restart",
        "_r_hole", "_r_retries", "_r_last0", "broken", "_rebuild_due",
        "max_retries", "retry_attempts", "_retry", "_gave_up", "_check_due", "_recent", "_r_bad", "_held",
        "_mark", "down",
    )

    #: applied batches (live or replayed) whose timestamps are kept to judge a backward message
    RECENT = 64

    def __init__(self, has_replay: bool, max_retries: int = 10) -> None:
        if max_retries < 0:
            raise ValueError(f"max_retries must be >= 0, got {max_retries}")
        self.has_replay = has_replay
        self.max_retries = max_retries  # retries of a replay that failed without applying anything
        self.retry_attempts = 0  # replays in a row that failed without applying anything
        self._retry: str | None = None  # the op of the replay to ask again (see ``retry``)
        self._gave_up = False  # the retries ran out: failures are not retried until the endpoint answers
        self._check_due = False  # a reconnect check failed: nothing applies before the retry checks the process
        self.last: int | None = None  # last applied seq
        self.last_ts: float | None = None
        self.exact = False  # applied state == engine state as of ``last``
        self.lost = False  # messages after ``last`` may have been lost
        self.suspect = False  # the connection dropped and no check since has found the process we know
        # (seq, ts) of the last batch applied before the connection dropped, until a check after the
        # reconnect finds it in the engine's buffer: what was applied since may be another process's
        self._mark: tuple[int, float | None] | None = None
        self.down = False  # disconnected, not reconnected since: live messages may be missed
        self.complete = False
        self._replayed: dict[int, float] = {}  # seq -> ts of batches a replay applied
        self._recent: dict[int, float] = {}  # seq -> ts of the last RECENT batches applied (live or replayed)
        self._replay_max = -1
        self._holes: list[tuple[int, int]] = []  # seq ranges a replay could not deliver
        self._candidate: tuple[str, Batch] | None = None  # ("back" | "fwd", batch) awaiting confirmation
        self._pending: Batch | None = None  # the live batch waiting for a replay / check
        self._op: str | None = None  # what the outstanding Replay / Confirm is for
        self._r_start = 0
        self._r_first: int | None = None
        self._r_count = 0
        self._r_cleared = False
        self._resync_due = False
        self._r_verify: tuple[int, float | None] | None = None  # (seq, ts) the replay's first batch must be
        self._r_restart = False
        self._r_hole = False  # the replay in progress skipped a seq after reaching back far enough
        self._r_bad: int | None = None  # the replay in progress's newest unreadable batch's seq
        self._r_retries = 0  # replays in a row asked again for a hole without progress
        self._r_last0: int | None = None  # ``last`` when the replay in progress was asked
        self._held: Batch | None = None  # the unchecked message the pending batch continued (see replay_end)
        self.broken = False  # the index failed to take a write of this stream since its last rebuild
        self._rebuild_due = False

    # ------------------------------------------------------------ helpers

    def _set_complete(self, out: list[Action], why: str) -> None:
        # a backward candidate is a possible restart nobody could check yet: the engine may hold
        # nothing of what we hold, so the stream is not reported complete while it waits
        c = self.exact and not self.lost and not self.broken and (self._candidate is None or self._candidate[0] != "back")
        if c != self.complete:
            self.complete = c
            out.append(Complete(c, why))

    def _apply(self, out: list[Action], b: Batch, replayed: bool = False) -> None:
        self.last = b.seq
        self.last_ts = b.ts
        recent = self._recent
        recent.pop(b.seq, None)
        recent[b.seq] = b.ts
        if len(recent) > self.RECENT:
            del recent[next(iter(recent))]
        if b.resets:
            self.exact = True  # AllBlocksCleared: the engine's state is known from here
        if b.lossy:
            self.exact = False
        out.append(Apply(b, replayed))

    def _clear(self, out: list[Action], why: str) -> None:
        out.append(Clear(why))
        self._check_due = False
        self.last = self.last_ts = None
        self.suspect = False  # nothing applied is left for a reconnect to check
        self._mark = None
        self._replayed.clear()
        self._recent.clear()
        self._replay_max = -1
        self._holes.clear()
        self.exact = False

    def _known(self) -> tuple[int, float | None]:
        """(seq, ts) of the batch a check asks the engine for: the last one applied before the
        connection dropped while no check has found it since, else the last one applied."""
        if self._mark is not None:
            return self._mark
        return self.last, self.last_ts  # type: ignore[return-value]

    def _start_replay(self, out: list[Action], op: str, start: int) -> list[Action]:
        self._op = op
        self._retry = None  # this replay stands for any retry that was due
        self._r_verify = None
        self._r_restart = False
        self._r_bad = None
        if self.last is not None and start == self.last + 1:
            # ask from our last batch too: the same process still has it with the same timestamp,
            # so a restart whose new seqs passed ours is caught here (after a disconnect, from our
            # last batch before it: see ``_known``)
            self._r_verify = self._known()
            start = self._r_verify[0]
        self._r_start = start
        self._r_last0 = self.last
        self._r_first = None
        self._r_count = 0
        self._r_cleared = False
        out.append(Count("replay_requests"))
        out.append(Replay(start))
        return out

    def _hold(self, out: list[Action], kind: str, b: Batch) -> None:
        """Hold ``b`` as the candidate the stream's next message must continue.

        A backward message whose engine time is not later than our last batch's is no new
        process (its clock would be later): it is dropped.  Of two unconfirmed messages the
        one with the later engine time is kept (an older one is a stale or foreign message,
        or an older process's).
        """
        if kind == "back" and self.last_ts is not None and b.ts <= self.last_ts:
            out.append(Count("unconfirmed"))
            return
        if self._candidate is not None and self._candidate[1].ts > b.ts:
            out.append(Count("unconfirmed"))
            return
        self._candidate = (kind, b)
        self._set_complete(out, "a backward seq awaits its confirmation" if kind == "back" else "a gap awaits its next message")

    def _in_hole(self, seq: int) -> bool:
        return any(lo <= seq <= hi for lo, hi in self._holes)

    def _forget_passed(self, seq: int) -> None:
        if seq > self._replay_max:
            self._replayed.clear()
            self._holes.clear()
