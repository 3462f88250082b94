"""Unit tests of the sequencer's replay retry and cut decisions (a pure state machine, no sockets).

The pool-level regression tests with real ZMQ ROUTER endpoints are in
tests/test_writepath_faults.py; these pin the decisions themselves.
"""

from __future__ import annotations

import hypothesis.strategies as st
from hypothesis import given, settings

from kvevents.sequencer import Apply, Batch, Clear, Complete, Confirm, Count, Replay, Sequencer


def b(seq: int, ts: float | None = None) -> Batch:
    """Batch ``seq`` of one engine process (timestamps grow with seq)."""
    return Batch(seq, 100.0 + seq if ts is None else ts)


def counts(actions: list) -> dict[str, int]:
    out: dict[str, int] = {}
    for a in actions:
        if type(a) is Count:
            out[a.name] = out.get(a.name, 0) + a.n
    return out


def applied(actions: list) -> list[int]:
    return [a.batch.seq for a in actions if type(a) is Apply]


def started(n: int = 3, max_retries: int = 10) -> Sequencer:
    """A complete stream holding seqs 0..n-1 (started from the engine's buffer)."""
    s = Sequencer(True, max_retries)
    assert s.live(b(0))[-1] == Replay(0)
    for k in range(n):
        s.replayed(b(k))
    s.replay_end(True)
    assert s.complete and s.last == n - 1
    return s


def fail_gap(s: Sequencer, seq: int) -> list:
    """A live message with a gap whose replay (from our last batch) times out with nothing."""
    out = s.live(b(seq))
    assert out[-1] == Replay(s.last)
    return out + s.replay_end(False)


# ---------------------------------------------------------------- a replay that fails without applying


def test_a_failed_gap_replay_is_held_for_a_retry_not_given_up() -> None:
    s = started()
    out = fail_gap(s, 5)
    c = counts(out)
    assert c["replay_failures"] == 1 and "gaps_unrecovered" not in c and c["deferred"] == 1
    assert Complete(False, "replay (gap) failed") in out and applied(out) == []
    assert s.retry_pending and s.retry_attempts == 1 and s.exact  # what we hold is still exact as of ``last``
    # live messages past the gap wait in the engine's buffer: no replay asked, nothing applied
    for seq in (6, 7):
        out = s.live(b(seq))
        assert counts(out) == {"deferred": 1} and not any(type(a) is Replay for a in out)
    assert s.last == 2


def test_the_retry_asks_from_our_last_batch_and_converges() -> None:
    s = started()
    fail_gap(s, 5)
    out = s.retry()
    assert counts(out) == {"replay_retries": 1, "replay_requests": 1} and out[-1] == Replay(2)
    assert not s.retry_pending
    s.replayed(b(2))  # our last batch, same process
    got = []
    for seq in range(3, 8):
        got += applied(s.replayed(b(seq)))
    out = s.replay_end(True)
    assert got == [3, 4, 5, 6, 7] and s.complete and s.retry_attempts == 0
    assert Complete(True, "replay (gap) ended") in out
    assert applied(s.live(b(8))) == [8]  # the live stream goes on


def test_a_message_continuing_our_sequence_applies_while_a_retry_waits() -> None:
    """The gap was a reordering: the missing message arrives late and continues the sequence."""
    s = started()
    fail_gap(s, 4)
    assert applied(s.live(b(3))) == [3] and s.retry_pending and not s.complete
    out = s.retry()
    assert out[-1] == Replay(3)


def test_a_restart_during_the_outage_is_caught_by_the_retry() -> None:
    s = started()
    fail_gap(s, 5)
    s.retry()
    out = s.replayed(b(2, ts=502.0))  # a new process's batch 2: not the one we applied
    assert counts(out).get("restarts") == 1
    out = s.replay_end(True)
    assert out[-1] == Replay(0)


def test_retries_are_bounded_then_the_stream_goes_on_without_asking() -> None:
    s = started(max_retries=2)
    fail_gap(s, 5)
    for k in (1, 2):
        assert s.retry()[-1] == Replay(2)
        out = s.replay_end(False)
        assert s.retry_pending == (k < 2)
    c = counts(out)
    assert c["replay_failures"] == 1 and c["gaps_unrecovered"] == 1 and not s.exact and not s.complete
    assert s.retry() == []
    # the next gap asks once more (the endpoint may be back); failing, it is not retried but held
    # as a candidate, as without an endpoint; the message after it continues it and asks once more
    # too, and failing again both are applied past the gap
    assert s.live(b(9))[-1] == Replay(2)
    out = s.replay_end(False)
    assert not s.retry_pending and counts(out)["gaps_unrecovered"] == 1 and applied(out) == []
    assert s.live(b(10))[-1] == Replay(2)
    out = s.replay_end(False)
    assert applied(out) == [9, 10] and not s.complete and not s.retry_pending
    assert s.live(b(12))[-1] == Replay(10)
    for seq in (10, 11, 12):
        s.replayed(b(seq))
    s.replay_end(True)  # the endpoint answers again: failures are retried again from now on
    assert s.live(b(14))[-1] == Replay(12)
    s.replay_end(False)
    assert s.retry_pending


def test_the_backoff_doubles_from_the_base_up_to_the_cap() -> None:
    s = started(max_retries=10)
    fail_gap(s, 5)
    delays = [s.retry_delay(0.05, 1.0)]
    for _ in range(7):
        s.retry()
        s.replay_end(False)
        delays.append(s.retry_delay(0.05, 1.0))
    assert delays == [0.05, 0.1, 0.2, 0.4, 0.8, 1.0, 1.0, 1.0]


def test_a_failed_start_check_defers_every_message_until_its_retry() -> None:
    s = Sequencer(True)
    assert s.live(b(0))[-1] == Replay(0)
    out = s.replay_end(False)
    assert counts(out)["deferred"] == 1 and s.retry_pending and s.last is None
    assert counts(s.live(b(1))) == {"deferred": 1}
    out = s.retry()
    assert out[-1] == Replay(0)
    for seq in (0, 1, 2):
        s.replayed(b(seq))
    s.replay_end(True)
    assert s.complete and s.last == 2


def test_zero_retries_keeps_the_behaviour_of_giving_up_at_once() -> None:
    s = started(max_retries=0)
    out = fail_gap(s, 5)
    assert counts(out)["gaps_unrecovered"] == 1 and not s.retry_pending and not s.complete


# ---------------------------------------------------------------- a replay cut at its bound


def test_a_cut_after_progress_asks_for_the_rest_and_marks_the_stream_incomplete() -> None:
    s = started()
    assert s.live(b(9))[-1] == Replay(2)
    for seq in range(2, 6):
        s.replayed(b(seq))
    out = s.replay_end(False, cut=True)
    c = counts(out)
    assert c == {"replay_cuts": 1, "replay_requests": 1}
    assert Complete(False, "replay cut off at its bound; asking for the rest") in out
    assert out[-1] == Replay(5) and not s.complete
    for seq in range(5, 10):
        s.replayed(b(seq))
    out = s.replay_end(True)
    assert s.complete and s.last == 9
    assert counts(out).get("duplicates") == 1  # the live message that started it, applied by the replay


def test_a_cut_that_applied_nothing_is_a_failure_retried_later() -> None:
    s = started()
    assert s.live(b(9))[-1] == Replay(2)
    s.replayed(b(2))  # only our own last batch before the cut
    out = s.replay_end(False, cut=True)
    c = counts(out)
    assert c["replay_cuts"] == 1 and c["replay_failures"] == 1 and s.retry_pending
    assert not any(type(a) is Replay for a in out)


# ---------------------------------------------------------------- property: bounded asking


@settings(max_examples=300, deadline=None)
@given(
    max_retries=st.integers(0, 5),
    answers=st.lists(st.sampled_from(["fail", "ok", "live", "next", "wait"]), min_size=1, max_size=40),
)
def test_retries_in_a_row_never_exceed_the_bound(max_retries: int, answers: list[str]) -> None:
    """Whatever the interleaving of live messages, failures and answers: at most ``max_retries``
    retries between two answered replays; a retry is pending only while the stream is incomplete;
    a complete stream holds the engine's newest batch (or a replay is bringing it)."""
    s = started(max_retries=max_retries)
    newest = s.last  # the engine's newest seq
    retries = 0
    outstanding = False
    for ans in answers:
        if outstanding:
            if ans == "fail":
                out = s.replay_end(False)
            else:
                for seq in range(s.last, newest + 1):  # type: ignore[arg-type]
                    s.replayed(b(seq))
                out = s.replay_end(True)
                retries = 0
        elif ans in ("live", "fail"):
            newest += 2  # one lost on the way, the next arrives
            out = s.live(b(newest))
        elif ans == "next" and s.last == newest:
            newest += 1
            out = s.live(b(newest))
        else:
            out = s.retry()
        retries += counts(out).get("replay_retries", 0)
        outstanding = bool(out) and type(out[-1]) is Replay
        assert retries <= max_retries
        assert not (s.retry_pending and s.complete)
        if s.complete and not outstanding:
            assert s.last == newest


def test_a_failed_reconnect_check_is_retried_and_nothing_applies_before_it() -> None:
    """The engine may have restarted while we were away: not even the next seq applies unchecked."""
    s = started()
    s.disconnected()
    out = s.reconnected()
    assert out[-1] == Confirm(2, 102.0)
    out = s.confirmed(None)
    assert s.retry_pending and not s.complete
    assert counts(s.live(b(3, ts=900.0))) == {"deferred": 1} and s.last == 2  # a new process's seq 3?
    out = s.retry()
    assert out[-1] == Replay(2)
    out = s.replayed(b(2, ts=899.0))  # not our batch 2: a new process
    assert counts(out)["restarts"] == 1
    assert s.replay_end(True)[-1] == Replay(0)


def test_a_reconnect_after_the_stream_was_cleared_asks_nothing_and_a_fresh_start_follows() -> None:
    """Disconnected while a failed resync waits; its retry finds the engine's buffer empty (a new
    process that has published nothing yet): the stream is cleared.  The reconnect then has no
    applied batch left to check (it used to ask the endpoint about seq None); the new process's
    first message starts the stream from its buffer.  Found by the sequencer world."""
    s = started(1)
    s.disconnected()
    assert s.reconnected()[-1] == Confirm(0, 100.0)
    assert s.confirmed(True)[-1] == Replay(0)
    s.replay_end(False)
    assert s.retry_pending
    s.disconnected()
    assert s.retry()[-1] == Replay(0)
    out = s.replay_end(True)  # nothing replayed: our batch 0 is gone
    assert counts(out)["restarts"] == 1 and out[-1] == Replay(0) and s.last is None
    assert s.replay_end(True) == []
    assert s.reconnected() == []
    assert s.live(b(0, ts=900.0))[-1] == Replay(0)
    s.replayed(b(0, ts=900.0))
    s.replay_end(True)
    assert s.complete and s.last == 0 and s.last_ts == 900.0


def test_a_batch_applied_past_a_loss_after_giving_up_keeps_the_stream_incomplete_once_the_endpoint_answers() -> None:
    """The retries ran out after a drop; a restarted engine's seq 0 came while the endpoint was
    down and was discarded by a second drop; its seq 1 continues our (old) seq 0 and is applied
    unchecked.  When the endpoint answers again, a replay from our last batch finds that batch
    (the new process's seq 1) and cannot see that our seq 0 was another process's: the stream
    must not claim to be complete.  Found by the sequencer world (there, the retries were spent
    by reconnect checks: see the next test for what a disconnect adds)."""
    s = started(1, max_retries=1)
    s.dropped()
    for _ in range(2):  # the resyncs fail: the second one spends the retries
        assert (s.idle() or s.retry())[-1] == Replay(0)
        s.replay_end(False)
    assert not s.retry_pending
    assert s.live(b(0, ts=500.0))[-1] == Confirm(0, 100.0)  # the new process's seq 0: cannot be checked
    s.confirmed(None)
    s.dropped()  # discards it
    assert s.idle()[-1] == Replay(0)
    s.replay_end(False)
    assert applied(s.live(b(1, ts=501.0))) == [1]  # the new process's seq 1, taken as is
    assert s.live(b(3, ts=503.0))[-1] == Replay(1)  # a gap: the endpoint answers again
    for k in (1, 2, 3):
        s.replayed(b(k, ts=500.0 + k))
    s.replay_end(True)
    assert s.last == 3 and not s.complete


def test_a_batch_applied_past_an_unchecked_disconnect_is_caught_once_the_endpoint_answers() -> None:
    """As above, the retries spent by reconnect checks that failed: the check the endpoint finally
    answers asks for our last batch from before the disconnect (seq 0 of the old process), which
    the new process does not hold, so the stream is rebuilt from its buffer and complete.  (It
    used to ask for our last batch, the new process's seq 1, and could only stay incomplete.)"""
    s = started(1, max_retries=1)
    s.dropped()
    for _ in range(2):  # the reconnect checks fail: the second one spends the retries
        s.disconnected()
        assert s.reconnected()[-1] == Confirm(0, 100.0)
        s.confirmed(None)
    assert s.live(b(0, ts=500.0))[-1] == Confirm(0, 100.0)  # the new process's seq 0: cannot be checked
    s.confirmed(None)
    s.dropped()  # discards it
    assert s.retry()[-1] == Replay(0)
    s.replay_end(False)
    assert applied(s.live(b(1, ts=501.0))) == [1]  # the new process's seq 1, taken as is
    s.disconnected()
    assert s.reconnected()[-1] == Confirm(0, 100.0)  # not Confirm(1, 501.0)
    out = s.confirmed(False)  # the endpoint answers again: not the process we know
    assert counts(out).get("restarts") == 1 and out[-1] == Replay(0)
    assert applied(s.replayed(b(0, ts=500.0)) + s.replayed(b(1, ts=501.0))) == [0, 1]
    s.replay_end(True)
    assert s.complete and s.last == 1 and s.last_ts == 501.0


def test_a_restart_behind_a_message_that_continues_our_seq_after_a_disconnect_is_still_checked() -> None:
    """The connection drops; a message continuing our sequence comes before the reconnect (what
    the old connection still delivered, or a restarted engine's batch that overtook the reconnect
    notice): it is applied, and the reconnect still checks the process, against our last batch
    from before the drop.  It used to take the continuing message as proof of the same process
    and check nothing at the reconnect, so a restarted engine that then stayed idle left the old
    process's blocks in the index for good."""
    s = started(3)  # 0..2 @ 100..102
    s.disconnected()
    assert applied(s.live(b(3))) == [3] and not s.complete
    assert s.reconnected()[-1] == Confirm(2, 102.0)
    out = s.confirmed(False)  # a new process (it published while we were reconnecting)
    assert counts(out).get("restarts") == 1 and any(type(a) is Clear for a in out) and out[-1] == Replay(0)
    assert applied(s.replayed(b(0, ts=900.0))) == [0]
    s.replay_end(True)
    assert s.complete and s.last == 0 and s.last_ts == 900.0
    # the same process (a blip): checked, then what was missed meanwhile is replayed
    s = started(3)
    s.disconnected()
    assert applied(s.live(b(3))) == [3]
    assert s.reconnected()[-1] == Confirm(2, 102.0)
    assert s.confirmed(True)[-1] == Replay(3)
    s.replayed(b(3))
    assert applied(s.replayed(b(4))) == [4]
    s.replay_end(True)
    assert s.complete and s.last == 4
    s.disconnected()  # the next drop is checked against the batch applied last
    assert s.reconnected()[-1] == Confirm(4, 104.0)


def test_a_late_copy_of_our_last_batch_does_not_discard_a_waiting_restart_candidate() -> None:
    """A new process's seq 0 waits as a candidate (the endpoint did not answer); a late copy of
    our own seq 0 arrives, then the new process's seq 1.  The copy is a duplicate: the candidate
    stays, and seq 1 confirms the restart (it used to be applied as our seq 1, mixing the two
    processes).  Found by the sequencer world."""
    s = started(1)
    assert s.live(b(0, ts=500.0))[-1] == Confirm(0, 100.0)
    s.confirmed(None)
    assert counts(s.live(b(0))) == {"duplicates": 1}
    out = s.live(b(1, ts=501.0))
    assert counts(out).get("restarts") == 1 and applied(out) == [] and out[-1] == Replay(0)


# ---------------------------------------------------------------- unnoticed restarts while the endpoint is down


def test_restarts_in_a_row_while_the_endpoint_is_down_rebuild_from_the_newest_process() -> None:
    """Three processes start (seq 0 each) while the replay endpoint does not answer.

    The first one's seq 0 is held as a candidate (the check could not be
    asked); the second one's seq 0 has the same seq but another engine time:
    not the same message, so it replaces the candidate; the third process's
    seq 0 likewise, and its seq 1 confirms the restart, which then rebuilds
    from the engine's buffer instead of trusting the messages (one of them
    may be an older process's).  Found by the engine-model test.
    """
    s = started(1)
    for gen in (1, 2, 3):
        out = s.live(b(0, ts=1000.0 * gen))
        assert out[-1] == Confirm(0, 100.0), out
        out = s.confirmed(None)  # the endpoint does not answer
        assert applied(out) == [] and s.last == 0
    out = s.live(b(1, ts=3000.5))  # the newest process's next batch
    assert counts(out).get("restarts") == 1 and applied(out) == []
    assert out[-1] == Replay(0) and not s.complete
    s.replayed(b(0, ts=3000.0))
    s.replayed(b(1, ts=3000.5))
    out = s.replay_end(True)
    assert s.complete and s.last == 1 and s.last_ts == 3000.5
    assert counts(out).get("duplicates") == 1  # the pending message was replayed already


def test_a_duplicate_of_the_candidate_keeps_it() -> None:
    s = started(3)
    s.live(b(0, ts=900.0))
    s.confirmed(None)
    assert counts(s.live(b(0, ts=900.0))) == {"duplicates": 1}
    out = s.live(b(1, ts=900.5))
    assert counts(out).get("restarts") == 1 and out[-1] == Replay(0)


# ---------------------------------------------------------------- compound faults found by the sequencer's world model
# (tests/test_sequencer_world.py); each is the shrunk interleaving


def test_a_gap_replay_whose_buffer_starts_after_our_last_batch_clears_the_stream() -> None:
    """An unnoticed restart while the endpoint is down; the new process's seq 1 is dropped; its
    seq 2 shows a gap.  The gap replay asks from our last batch (0) to check the process, but the
    engine's short buffer holds only the new process's 1 and 2: seq 1 = our last + 1 used to be
    applied as if it continued the old process, whose blocks then stayed in the index.  The
    buffer cannot vouch for our last batch: the stream is rebuilt from what it holds."""
    s = started(1)
    out = s.live(b(0, ts=2000.0))  # the new process's seq 0
    assert out[-1] == Confirm(0, 100.0)
    s.confirmed(None)  # the endpoint does not answer: held as a candidate
    s.dropped()  # its seq 1 lost to a full queue
    out = s.live(b(2, ts=2000.2))
    assert out[-1] == Replay(0)
    out = s.replayed(b(1, ts=2000.1))  # the buffer (2 batches) no longer holds any seq 0
    assert any(type(a) is Clear for a in out) and applied(out) == [1]
    out += s.replayed(b(2, ts=2000.2))
    out += s.replay_end(True)
    assert s.last == 2 and s.last_ts == 2000.2 and not s.complete
    assert counts(out).get("gaps_unrecovered") == 1


def test_the_same_process_whose_buffer_moved_past_our_last_batch_is_rebuilt_not_trusted() -> None:
    s = started(3)
    out = s.live(b(9))
    assert out[-1] == Replay(2)
    out = s.replayed(b(3))  # batch 2 is gone: the process cannot be told from a new one
    assert any(type(a) is Clear for a in out) and applied(out) == [3]
    for k in range(4, 10):
        s.replayed(b(k))
    s.replay_end(True)
    assert s.last == 9 and not s.complete


def test_a_backward_seq_that_could_not_be_checked_makes_the_stream_incomplete_until_decided() -> None:
    """An unnoticed restart while the endpoint is down: the stream used to stay complete
    (the engine holding nothing of it) until a next message decided."""
    s = started(3)
    out = s.live(b(0, ts=2000.0))
    assert out[-1] == Confirm(2, 102.0)
    out = s.confirmed(None)
    assert not s.complete and Complete(False, "a backward seq awaits its confirmation") in out
    # a message continuing our own sequence shows it was not the engine's: complete again
    out = s.live(b(3))
    assert applied(out) == [3] and s.complete


def test_a_drop_between_a_candidate_and_its_successor_does_not_confirm_it() -> None:
    """Retries ran out while the endpoint was down; the first message of a new process became a
    candidate; a still newer process's seq 0 was dropped (the pool noticed) and its seq 1 used to
    confirm the candidate: two processes' batches applied as one, reported complete."""
    s = Sequencer(True, max_retries=0)
    out = s.live(b(0, ts=1000.0))
    assert out[-1] == Replay(0)
    s.replay_end(False)  # gave up at once (no retries)
    out = s.live(b(0, ts=2000.0))  # an unnoticed restart
    assert out[-1] == Replay(0)
    s.replay_end(False)  # still down: held as a candidate the next message must continue
    out = s.dropped()  # a third process's seq 0 was lost to a full queue
    assert counts(out).get("unconfirmed") == 1
    out = s.live(b(1, ts=3000.1))  # ... and its seq 1 arrives
    assert applied(out) == [] and out[-1] == Replay(0)  # judged on its own: the engine's buffer is asked
    s.replayed(b(0, ts=3000.0))
    s.replayed(b(1, ts=3000.1))
    s.replay_end(True)
    assert s.complete and s.last_ts == 3000.1


def test_a_rebuild_replay_whose_tail_is_lost_is_asked_again_not_left_complete() -> None:
    """A rebuild (the index lost writes) whose replay stops after a few batches (the rest and
    the end marker lost): the stream used to be reported complete at the last batch it got,
    forever if the engine publishes nothing more."""
    s = started(5)
    s.index_failed()
    assert s.idle()[-1] == Replay(0)
    s.replayed(b(0))
    s.replayed(b(1))
    out = s.replay_end(False)  # timed out
    assert out[-1] == Replay(1) and counts(out).get("replay_holes") == 1  # from our last batch, checked
    for k in range(1, 5):
        s.replayed(b(k))
    s.replay_end(True)
    assert s.complete and s.last == 4


def test_without_replay_one_backward_message_older_than_our_last_batch_neither_clears_nor_applies() -> None:
    """A foreign or corrupt message at our last seq, with an older engine time, used to be held as
    a restart candidate that the engine's next batch confirmed: the pod was cleared and the
    message applied.  A new process's clock is later than our last batch's."""
    s = Sequencer(False)
    for k in range(3):
        s.live(b(k))
    out = s.live(Batch(2, 1.0))
    assert counts(out) == {"unconfirmed": 1} and s.complete
    out = s.live(b(3))
    assert applied(out) == [3] and not any(type(a) is Clear for a in out) and s.complete


def test_a_candidate_is_not_confirmed_by_an_older_message_nor_replaced_by_one() -> None:
    """Retries ran out; a new process's seq 0 waits as a candidate; a foreign message with seq 1
    and an old engine time came next and used to confirm it (both applied, the stream complete)."""
    s = Sequencer(True, max_retries=0)
    s.live(b(0, ts=1000.0))
    s.replay_end(False)  # gave up
    assert s.live(b(0, ts=2000.0))[-1] == Replay(0)
    s.replay_end(False)  # candidate 0@2000
    out = s.live(Batch(1, 1.0))  # not its successor: judged on its own
    assert applied(out) == [] and out[-1] == Replay(0)
    out = s.replay_end(False)
    assert counts(out).get("unconfirmed") == 1  # the older message does not replace the candidate
    out = s.live(b(1, ts=2000.1))  # the engine's own next batch confirms it: the endpoint is asked once more
    assert applied(out) == [] and out[-1] == Replay(0)
    out = s.replay_end(False)  # still no answer: the confirming batch starts the stream alone
    assert applied(out) == [1] and s.last_ts == 2000.1 and not s.complete


def test_an_unchecked_start_is_never_built_on_a_message_no_process_published() -> None:
    """Retries spent, the engine's seq 0 lost to a full queue, a foreign message with seq 0 in
    its place, then the engine's seq 1: the foreign one used to start the stream (applied, the
    stream complete).  The endpoint is asked again and rebuilds the stream from its buffer."""
    s = Sequencer(True, max_retries=0)
    s.live(Batch(2**64 - 2, 1.0))  # a corrupt first message
    s.replay_end(False)  # gave up at once
    s.dropped()  # the engine's seq 0
    assert s.live(Batch(0, 1.0))[-1] == Replay(0)
    s.replay_end(False)  # held as a candidate
    out = s.live(b(1, ts=1001.0))
    assert applied(out) == [] and out[-1] == Replay(0)
    for seq, ts in ((0, 1000.0), (1, 1001.0)):
        s.replayed(b(seq, ts=ts))
    out = s.replay_end(True)
    assert s.last == 1 and s.last_ts == 1001.0 and s.complete


def test_a_drop_marker_after_a_candidate_queued_before_it_discards_the_candidate() -> None:
    """The shard notices a drop before the messages queued ahead of the lost one: a new
    process's seq 0 queued before the drop became a candidate only after that early notice,
    and a still newer process's seq 1 (after the lost seq 0) confirmed it.  The marker the pool
    leaves at the lost message's place discards it (retries spent, endpoint down)."""
    s = Sequencer(True, max_retries=0)
    s.live(b(0, ts=1000.0))
    s.replay_end(False)  # gave up at once
    s.dropped()  # the early notice: the stream holds nothing yet
    assert s.live(b(0, ts=2000.0))[-1] == Replay(0)  # queued before the drop
    s.replay_end(False)  # held as a candidate
    out = s.dropped(in_place=True)  # the marker at the lost message's place
    assert counts(out) == {"unconfirmed": 1}
    out = s.live(b(1, ts=3000.1))
    assert applied(out) == [] and out[-1] == Replay(0)


def test_an_in_place_drop_notice_alone_asks_nothing() -> None:
    s = started(3)
    assert s.dropped(in_place=True) == [] and s.complete


def test_our_next_seq_newer_than_a_backward_candidate_is_checked_not_applied() -> None:
    """An unnoticed restart while the endpoint is down: the new process's seq 0 waits as a
    candidate, its seq 1 is lost, and its seq 2 = our last + 1 used to discard the candidate
    and be applied as our old process's next batch (found by the engine-model test)."""
    s = started(2)  # 0@100, 1@101
    assert s.live(b(0, ts=2000.0))[-1] == Confirm(1, 101.0)
    s.confirmed(None)
    out = s.live(b(2, ts=2000.2))
    assert applied(out) == [] and out[-1] == Replay(1)
    out = s.replayed(b(1, ts=2000.1))  # the engine's batch 1 is not ours: a new process
    assert counts(out).get("restarts") == 1
    out = s.replay_end(True)
    assert out[-1] == Replay(0)
    for k in range(3):
        s.replayed(b(k, ts=2000.0 + k / 10))
    s.replay_end(True)
    assert s.complete and s.last == 2 and s.last_ts == 2000.2


def test_a_new_process_whose_seq_1_overtook_its_seq_0_is_rebuilt_not_mixed() -> None:
    """An unnoticed restart while we hold seq 0 of the old process: the new process's seq 1
    arrives first (its seq 0 delayed on the network) and continues our sequence, then its seq 0
    comes.  The endpoint confirms our last batch (the new process's seq 1); that seq 0 is newer
    than the seq 0 we hold, so what we hold mixes two processes and is rebuilt from the buffer
    (it used to be dropped as a stray message, the old process's blocks kept)."""
    s = Sequencer(True)
    assert s.live(b(0, ts=1002.0))[-1] == Replay(0)
    s.replayed(b(0, ts=1002.0))
    s.replay_end(True)
    assert applied(s.live(b(1, ts=1003.1))) == [1]
    assert s.live(b(0, ts=1003.0))[-1] == Confirm(1, 1003.1)
    out = s.confirmed(True)
    assert any(isinstance(a, Clear) for a in out) and out[-1] == Replay(0)
    assert applied(s.replayed(b(0, ts=1003.0)) + s.replayed(b(1, ts=1003.1))) == [0, 1]
    s.replay_end(True)
    assert s.complete and s.last == 1


def test_a_live_duplicate_of_a_recent_batch_is_counted_as_one() -> None:
    """The network delivers a batch twice after its successor: the check finds our last batch
    held by the same process and the repeat is a duplicate (nothing cleared, nothing applied)."""
    s = started(1)
    assert applied(s.live(b(1)) + s.live(b(2))) == [1, 2]
    out = s.live(b(1))
    assert out[-1] == Confirm(2, 102.0)
    out = s.confirmed(True)
    assert counts(out).get("duplicates") == 1 and not any(isinstance(a, Clear) for a in out)


def test_an_unreadable_newest_replayed_batch_is_asked_again_not_taken_as_the_end() -> None:
    """A rebuild replay whose last batch is unreadable, then the end marker: the stream used to
    end complete one batch short of the engine.  The rest is asked again from the missing seq."""
    s = Sequencer(True)
    assert s.live(b(0))[-1] == Replay(0)
    s.replayed(b(0))
    s.replayed(None, 1)
    out = s.replay_end(True)
    assert out[-1] == Replay(0) and counts(out).get("replay_holes") == 1  # from our last batch (checked), for 1
    s.replayed(b(0))
    s.replayed(b(1))
    s.replay_end(True)
    assert s.complete and s.last == 1


def test_an_unreadable_newest_batch_that_stays_unreadable_leaves_the_stream_incomplete() -> None:
    s = Sequencer(True)
    s.live(b(0))
    s.replayed(b(0))
    s.replayed(None, 1)
    out = s.replay_end(True)
    asks = 0
    while out and out[-1] == Replay(0):
        asks += 1
        assert asks <= Sequencer.MAX_HOLE_RETRIES + 1, "asked again without end"
        s.replayed(b(0))
        s.replayed(None, 1)
        out = s.replay_end(True)
    assert asks >= 1 and counts(out).get("gaps_unrecovered") == 1
    assert not s.complete and s.last == 0


def test_after_a_drop_the_next_seq_waits_for_the_failed_resync_not_applied() -> None:
    """A drop, an unnoticed restart whose seq 0 could not be checked (endpoint down) and whose
    candidate a second drop discarded, the resync replay failing: the new process's seq 1, which
    continues our seq 0, used to be applied at once and the retried resync then checked it
    against itself (complete, the new seq 0 missing, the old process's blocks kept).  It now
    waits in the engine's buffer for the retry, which finds the new process and rebuilds."""
    s = started(1)
    s.dropped()
    assert s.live(b(0, ts=500.0))[-1] == Confirm(0, 100.0)
    s.confirmed(None)  # endpoint down: held as a candidate
    s.dropped()  # discards it
    out = s.idle()
    assert out[-1] == Replay(0)  # the resync, from our last batch
    s.replay_end(False)
    assert s.retry_pending
    out = s.live(b(1, ts=500.1))
    assert applied(out) == [] and counts(out).get("deferred") == 1
    out = s.retry()
    assert out[-1] == Replay(0)
    out = s.replayed(b(0, ts=500.0))  # not our seq-0 batch (100.0): a new process
    assert any(isinstance(a, Clear) for a in out)
    out = s.replay_end(True)
    assert out[-1] == Replay(0)
    got = s.replayed(b(0, ts=500.0)) + s.replayed(b(1, ts=500.1))
    s.replay_end(True)
    assert applied(got) == [0, 1] and s.complete and s.last_ts == 500.1


def test_a_gap_held_while_the_endpoint_was_given_up_asks_it_again_when_continued() -> None:
    """Retries spent, seq 3 lost, seq 4 held: seq 5 continues it.  The endpoint is asked once more
    (it answers again): the lost seq 3 (a removal) is replayed, not skipped."""
    s = started(3, max_retries=0)
    assert s.live(b(4))[-1] == Replay(2)
    s.replay_end(False)  # given up at once: 4 held
    out = s.live(b(5))
    assert applied(out) == [] and out[-1] == Replay(2)
    got = []
    for k in (2, 3, 4):
        got += s.replayed(b(k))
    got += s.replay_end(True)
    assert applied(got) == [3, 4, 5] and s.last == 5  # (still reported incomplete: the gap was counted lost)


def test_a_gap_held_while_the_endpoint_stays_down_is_applied_past_as_before() -> None:
    s = started(3, max_retries=0)
    s.live(b(4))
    s.replay_end(False)
    assert s.live(b(5))[-1] == Replay(2)
    out = s.replay_end(False)
    assert applied(out) == [4, 5] and counts(out).get("gaps_unrecovered") == 1 and not s.complete


def test_a_restarted_engine_that_has_published_nothing_leaves_the_stream_complete_and_empty() -> None:
    """The reconnect check finds another process whose buffer is empty: it holds nothing, as the
    cleared stream does, so the stream is complete (it used to stay incomplete until the engine
    published); a drop or a disconnect before its first message makes it incomplete again."""
    s = started(3)
    s.disconnected()
    assert not s.complete
    assert s.reconnected()[-1] == Confirm(2, 102.0)
    out = s.confirmed(False)
    assert any(isinstance(a, Clear) for a in out) and out[-1] == Replay(0)
    assert not s.complete  # asked, not answered yet
    s.replay_end(True)  # the new process's buffer: empty
    assert s.complete and s.last is None
    s.dropped()
    assert not s.complete
    assert s.live(b(1, ts=900.0))[-1] == Replay(0)  # its next message starts it from the buffer
    s.replayed(b(0, ts=899.0))
    s.replayed(b(1, ts=900.0))
    s.replay_end(True)
    assert s.complete and s.last == 1


def test_a_restart_found_while_disconnected_again_is_not_complete() -> None:
    s = started(1)
    s.disconnected()
    s.reconnected()
    s.disconnected()  # down again before the check's answer
    s.confirmed(False)
    s.replay_end(True)
    assert not s.complete and s.last is None
