"""Flush with a guarantee: wait until the index has applied what each engine published before the call.

The pool's own flush only drains what the subscriber has already queued; a
batch still in ZMQ's buffers (between the engine's PUB socket and ours) is not
covered.  Here each engine's replay endpoint is asked for the newest seq it
has published (vLLM's replay protocol, vllm/distributed/kv_events.py), and the
wait lasts until the pool's stream of that engine (pod, DP rank) has applied
that seq or a later one of the same engine process: the engine must still
hold the stream's last applied batch with the same engine timestamp (the rule
the sequencer uses to tell a restarted engine).  A stream that stops short of
its goal (its last message lost on the way, nothing after it to reveal the
gap) is looked at again from the engine's buffer, as after a join.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable

import msgspec
import zmq

from kvevents.pool import DECODERS, EventPool, Source
from kvevents.subscriber import EngineEndpoint, offset_port
from kvevents.tails import Tail, ask_tails
from kvevents.wire import PayloadError, parse_topic

__all__ = ["FlushReport", "flush_engines"]

log = logging.getLogger("indexer")

#: seconds between looks at the pool while waiting
_POLL = 0.002
#: seconds a stream short of its goal may make no progress before the pool is asked to look
#: at the engine's buffer (then doubling)
_NUDGE_AFTER = 0.25


class FlushReport(msgspec.Struct, frozen=True, kw_only=True):
    """What :meth:`kvindex.Indexer.flush_report` found.

    ok: everything queued is applied, and for every engine DP rank with a
    replay endpoint the index has applied the newest batch the engine had
    published when asked (or a later one); False after ``timeout`` or when
    an endpoint did not answer.  Each list names ``pod/rank``: caught_up
    (verified), behind (not caught up by the deadline), unreachable (the
    replay endpoint did not answer within the replay timeout), unverified (no
    replay endpoint: only what the subscriber had received is covered), down
    (no subscription up to the engine: nothing it publishes can reach us, so
    it is not asked and does not make ``ok`` False; see
    :meth:`kvindex.Indexer.wait_connected`).
    waited: seconds the call took.
    """

    ok: bool
    caught_up: list[str] = msgspec.field(default_factory=list)
    behind: list[str] = msgspec.field(default_factory=list)
    unreachable: list[str] = msgspec.field(default_factory=list)
    unverified: list[str] = msgspec.field(default_factory=list)
    down: list[str] = msgspec.field(default_factory=list)
    waited: float = 0.0


Applied = tuple[int, float | None]  # (seq, engine timestamp) of a stream's last applied batch


class _Target:
    """One engine DP rank being waited for."""

    __slots__ = ("pod", "rank", "endpoint", "model", "engine", "goal", "held", "gone", "seen", "since", "nudge")

    def __init__(self, pod: str, rank: int, endpoint: str, model: str | None, engine: str) -> None:
        self.pod = pod
        self.rank = rank
        self.endpoint = endpoint
        self.model = model  # the model its stream is filed under (topic, else configured)
        self.engine = engine  # payload format
        self.goal: int | None = None  # the engine's newest seq when asked (None: nothing to wait for)
        self.held: Applied | None = None  # a batch of ours the engine was seen to hold
        # our last applied batch when the engine answered that it holds nothing at all: a new
        # process that has published nothing yet; done once the pool's stream moved off it
        self.gone: Applied | None = None
        self.seen: Applied | None = None  # the stream's last applied batch at the last look
        self.since = time.monotonic()  # when ``seen`` last changed (or the pool was last asked to look)
        self.nudge = _NUDGE_AFTER

    @property
    def label(self) -> str:
        return f"{self.pod}/{self.rank}"

    def source(self) -> Source:
        return Source(pod=self.pod, engine=self.engine, replay=self.endpoint, dp_rank=self.rank, model=self.model)

    def holds(self, tail: Tail, applied: Applied) -> bool:
        """The engine's answer from our last seq starts with our last batch (same seq and timestamp)."""
        if tail.first != applied[0] or tail.first_payload is None:
            return False
        try:
            return DECODERS[self.engine](tail.first_payload).ts == applied[1]
        except (PayloadError, KeyError):
            return False

    def stalled(self, applied: Applied | None, now: float) -> bool:
        """No progress for a while (then the clock restarts, waiting twice as long)."""
        if applied != self.seen:
            self.seen, self.since = applied, now
            return False
        if now - self.since < self.nudge:
            return False
        self.since, self.nudge = now, 2 * self.nudge
        return True


def _targets(
    engines: Iterable[EngineEndpoint], bind_replay: dict[str, str], bind_engine: str, default_model: str | None,
    pool: EventPool,
) -> tuple[list[_Target], list[str]]:
    """(engine ranks with a replay endpoint, labels of those without)."""
    out: list[_Target] = []
    unverified: list[str] = []
    for eng in engines:
        for rank, _ep, replay in eng.ranks():
            if replay is None:
                unverified.append(f"{eng.pod}/{rank}")
            else:
                out.append(_Target(eng.pod, rank, replay, eng.model or default_model, eng.engine))
    for pod, ep in bind_replay.items():
        ranks = {st.dp_rank for st in pool.completeness(pod)} | {0}
        out.extend(_Target(pod, r, offset_port(ep, r), default_model, bind_engine) for r in sorted(ranks))
    return out, unverified


def _applied(pool: EventPool, t: _Target) -> Applied | None:
    """(seq, engine timestamp) of the last batch the pool applied for ``t``'s stream (None: none yet)."""
    states = [s for s in pool.completeness(t.pod) if s.dp_rank == t.rank]
    match = [s for s in states if s.model == t.model]
    if not match and len(states) == 1:
        match = states
    if not match or match[0].last_seq is None:
        return None
    return match[0].last_seq, match[0].last_ts


def _ask(ctx: zmq.Context, targets: list[_Target], starts: dict[int, int], timeout: float) -> dict[int, Tail | None]:
    return ask_tails(ctx, {i: (targets[i].endpoint, s) for i, s in starts.items()}, timeout)


def _set_goals(ctx: zmq.Context, pool: EventPool, targets: list[_Target], idx: list[int], timeout: float) -> set[int]:
    """Ask the engines of ``targets[idx]`` for their newest seq (the goal); return those that did not answer.

    Asked from the stream's last applied seq; an engine that holds nothing
    from there is a new process below it (a restart) and is asked from 0.
    """
    applied = {i: _applied(pool, targets[i]) for i in idx}
    tails = _ask(ctx, targets, {i: a[0] if a is not None else 0 for i, a in applied.items()}, timeout)
    again = {}
    for i, tail in tails.items():
        t, a = targets[i], applied[i]
        if tail is None:
            continue
        if tail.topic is not None:
            t.model = parse_topic(tail.topic)[1] or t.model
        t.held = a if a is not None and t.holds(tail, a) else None
        t.goal = tail.last
        t.gone = None
        if tail.last is None and a is not None:
            again[i] = 0
    for i, tail in (_ask(ctx, targets, again, timeout) if again else {}).items():
        tails[i] = tail
        if tail is not None:
            targets[i].goal = tail.last
            targets[i].gone = applied[i] if tail.last is None else None
    return {i for i, tail in tails.items() if tail is None}


def _confirm(
    ctx: zmq.Context, pool: EventPool, targets: list[_Target], check: dict[int, Applied],
    done: list[str], lost: set[int], timeout: float,
) -> set[int]:
    """Of the streams that reached their goal (index -> last applied batch), return those finished.

    One is caught up only if the engine still holds its last applied batch
    (so its seq is in the engine's current numbering, not an earlier
    process's); else its goal is asked again.
    """
    ask = {i: a[0] for i, a in check.items() if targets[i].held != a}
    tails = _ask(ctx, targets, ask, timeout) if ask else {}
    finished: set[int] = set()
    retarget = []
    for i, a in check.items():
        t = targets[i]
        if i not in tails or (tails[i] is not None and t.holds(tails[i], a)):  # type: ignore[arg-type]
            done.append(t.label)
            finished.add(i)
        elif tails[i] is None:
            lost.add(i)
            finished.add(i)
        else:
            retarget.append(i)
    if retarget:
        failed = _set_goals(ctx, pool, targets, retarget, timeout)
        lost.update(failed)
        finished.update(failed)
        for i in retarget:
            if i not in failed and targets[i].goal is None and targets[i].gone is None:
                done.append(targets[i].label)
                finished.add(i)
    return finished


def flush_engines(
    pool: EventPool,
    engines: Iterable[EngineEndpoint],
    *,
    bind_replay: dict[str, str],
    bind_engine: str,
    default_model: str | None,
    timeout: float,
    replay_timeout: float,
    down: frozenset[tuple[str, int]] = frozenset(),
) -> FlushReport:
    """Wait until ``pool`` has applied what every engine published before the call; see :class:`FlushReport`."""
    t0 = time.monotonic()
    deadline = t0 + timeout
    drained = pool.flush(timeout)  # what is queued first (RuntimeError when not started): less to ask for
    targets, unverified = _targets(engines, bind_replay, bind_engine, default_model, pool)
    skipped = sorted(t.label for t in targets if (t.pod, t.rank) in down)
    targets = [t for t in targets if (t.pod, t.rank) not in down]
    ctx = pool.zmq_context
    ask_for = min(replay_timeout, timeout)
    lost = _set_goals(ctx, pool, targets, list(range(len(targets))), ask_for) if targets and drained else set()
    pending = [
        i for i in range(len(targets))
        if i not in lost and (targets[i].goal is not None or targets[i].gone is not None or not drained)
    ]
    done = [targets[i].label for i in range(len(targets)) if i not in lost and i not in pending]
    while pending and drained:
        check: dict[int, Applied] = {}
        cleared: set[int] = set()
        now = time.monotonic()
        for i in pending:
            t = targets[i]
            a = _applied(pool, t)
            if t.gone is not None:
                if a is None:  # the pool has seen the restart and cleared the old process's blocks
                    cleared.add(i)
                elif a != t.gone:  # ... and applied the new process's: confirmed like any other
                    t.gone = None
                    check[i] = a
                continue
            if a is not None and t.goal is not None and a[0] >= t.goal:
                check[i] = a
            elif t.stalled(a, now):
                pool.bootstrap(t.source(), t.pod, t.rank)  # a look at the buffer from our last batch on
        finished = _confirm(ctx, pool, targets, check, done, lost, ask_for) if check else set()
        done.extend(targets[i].label for i in cleared)
        finished |= cleared
        pending = [i for i in pending if i not in finished]
        if not pending or time.monotonic() >= deadline:
            break
        # a stream past its goal but not finished waits for the pool to see the engine's restart
        time.sleep(_POLL if len(finished) == len(check) else 10 * _POLL)
        drained = pool.flush(max(0.0, deadline - time.monotonic()))
    report = FlushReport(
        ok=drained and not pending and not lost,
        caught_up=sorted(done), behind=sorted(targets[i].label for i in pending),
        unreachable=sorted(targets[i].label for i in lost), unverified=sorted(unverified), down=skipped,
        waited=time.monotonic() - t0,
    )
    if report.unreachable:
        log.warning("flush: replay endpoints of %s did not answer: their in-flight events are not covered",
                    report.unreachable)
    return report
