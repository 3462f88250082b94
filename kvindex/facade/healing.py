"""Healing: ask engines to re-announce their cached prefixes while the index's state is incomplete.

vLLM publishes, per request, a BlockStored for the prefix-cache blocks the
request *reused* when the request carries
``"vllm_xargs": {"kv_cache_report_mode": "full"}`` (vLLM PR #45261; the
OpenAI server copies ``vllm_xargs`` into ``SamplingParams.extra_args``, and
``vllm/v1/core/kv_cache_manager.py`` ``get_computed_blocks`` calls
``emit_cached_block_events``: one BlockStored, parent nil, token ids and
hashes of blocks ``0 .. hits - 1``).  The default mode ("incremental")
publishes only newly stored blocks, so blocks an engine cached while the
index was not listening stay invisible: the first requests that reuse them
are routed blind.

:class:`HealingPolicy` tells a router, per request and per (pod, DP rank,
model) stream, whether to ask for the full report:

- A stream *needs healing* while the write path marks it incomplete
  (:meth:`kvevents.pool.EventPool.completeness`): the router joined after the
  engine's seq 0 left its replay buffer (``buffer_steps``), a gap the replay
  could not cover, a dropped message not yet replayed, a reconnect without
  replay, or a malformed event (not while its engine is misconfigured:
  a full report cannot mend that).  A stream the pool has not seen yet does
  not (an engine that published nothing has nothing cached; one whose
  replay endpoint failed or that has none shows up incomplete with its
  first message).  A stream that becomes complete again
  on the write path (a replay covering the loss, a restart at seq 0, an
  AllBlocksCleared) stops needing it at once.
- *Healed* rule (cheap: per request a scan of the pool's stream table and a
  few counters, no index work; per re-announce on a stream being healed,
  one index lookup per block): the policy watches
  the BlockStored events whose parent is nil (the shape of every
  re-announce) on streams being healed and counts the blocks the index did
  not yet hold for that stream (a *discovery*).  The stream is judged healed
  after ``quiet_requests`` consecutive full-report requests to it ended
  without a discovery, or after ``max_requests`` full-report requests in
  all, whichever comes first.  A new loss on the stream (its ``losses``
  count moves) starts a new healing episode.
- Why it is sound enough: every full-report request makes the index hold
  exactly the engine's cached prefix of that prompt; blocks the engine held
  before the router joined either get reused (and are then re-announced) or
  get evicted.  When many requests in a row reuse nothing unknown, the
  traffic's working set is known.  The rule errs on the long side: a prompt
  with no cached prefix on the engine is stored with a parent-nil
  BlockStored too, and counts as a discovery (events cannot tell the two
  apart), so a workload of unrelated prompts ends by the cap.  The cost of
  a full report is one extra event per request, whose blocks the index
  already holds (idempotent).

Use (any router; :class:`kvindex.Indexer` users pass ``ix.pool``)::

    heal = HealingPolicy(ix.pool)
    ...
    if heal.wants_full_report(pod, dp_rank, model):
        body = with_full_report(body)   # kv_cache_report_mode merged into the client's vllm_xargs
        heal.full_report_sent(pod, dp_rank, model)
    ... send, wait for the answer ...
    heal.full_report_done(pod, dp_rank, model)   # only for requests that carried it
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import NamedTuple

import msgspec

from kvevents.events import BlockStored
from kvevents.pool import EventPool, StreamState
from kvindex.contract import GroupAware

__all__ = ["HealingPolicy", "HealingState", "HealingStats", "FULL_REPORT_XARGS", "with_full_report"]

#: the ``vllm_xargs`` entry that makes vLLM re-announce reused prefix blocks (vLLM PR #45261)
FULL_REPORT_XARGS = {"kv_cache_report_mode": "full"}


def with_full_report(body: dict) -> dict:
    """A copy of an OpenAI request body asking for the full KV-cache report.

    Merges ``kv_cache_report_mode: "full"`` into the body's ``vllm_xargs``
    (other keys the client gave are kept; a client's own
    ``kv_cache_report_mode`` is overridden).  A ``vllm_xargs`` that is not a
    JSON object is left alone (the engine rejects it as it would have).
    """
    xargs = body.get("vllm_xargs")
    if xargs is None:
        xargs = {}
    if not isinstance(xargs, dict):
        return dict(body)
    return {**body, "vllm_xargs": {**xargs, **FULL_REPORT_XARGS}}


class HealingState(NamedTuple):
    """One stream's healing episode (a snapshot; see :meth:`HealingPolicy.states`).

    pod, model, dp_rank: the publisher stream.
    healing: full reports are still wanted.
    sent: full-report requests sent in this episode; done: of those, ended.
    quiet: full-report requests ended since the last discovery.
    discoveries: parent-nil BlockStored events that added blocks the index
        did not hold for the stream; learned_blocks: those blocks.
    why: ``incomplete`` (healing), ``quiet`` or ``cap`` (how it ended).
    """

    pod: str
    model: str | None
    dp_rank: int
    healing: bool
    sent: int
    done: int
    quiet: int
    discoveries: int
    learned_blocks: int
    why: str


class HealingStats(msgspec.Struct, frozen=True):
    """Counters of a :class:`HealingPolicy` since it was made.

    healing_streams: streams whose full report is wanted now;
    full_reports_sent / full_reports_done: requests sent with it / ended;
    discoveries / learned_blocks: re-announces that taught the index blocks it
    did not hold, and those blocks; episodes: healing episodes started;
    healed_quiet / healed_cap: episodes ended by the quiet rule / by the cap.
    """

    healing_streams: int
    full_reports_sent: int
    full_reports_done: int
    discoveries: int
    learned_blocks: int
    episodes: int
    healed_quiet: int
    healed_cap: int


class _Episode:
    __slots__ = ("losses", "healing", "sent", "done", "quiet", "discoveries", "learned", "why", "fresh")

    def __init__(self, losses: int) -> None:
        self.losses = losses
        self.healing = True
        self.fresh = False  # a discovery since the last ended request
        self.sent = self.done = self.quiet = self.discoveries = self.learned = 0
        self.why = "incomplete"


_Key = tuple[str, str | None, int]  # (pod, model, dp_rank)


class HealingPolicy:
    """Per stream: should the next request carry ``kv_cache_report_mode: "full"``?

    Args:
        pool: the write path's :class:`~kvevents.pool.EventPool` (its
            ``completeness()`` says which streams lost state; the policy adds
            itself as a store observer to count discoveries).
        quiet_requests: consecutive full-report requests ended without a
            discovery after which a stream is judged healed (>= 1).
        max_requests: full-report requests per episode after which the stream
            is judged healed anyway (>= quiet_requests).
        report_window: seconds after a full-report request is sent or ends
            during which a :class:`~kvindex.contract.GroupAware` index believes
            a re-announce of a sliding-window or Mamba group only for the
            blocks that group surely holds (hybrid models: vLLM reports every
            group's hashes for a hit; see :mod:`kvindex.groups`).

    Thread-safe: the router's threads or event loop call the query and
    counting methods; the pool's shard threads call the observer.  Call
    :meth:`close` to detach from the pool.

    Raises:
        ValueError: bounds out of range.
    """

    def __init__(
        self, pool: EventPool, *, quiet_requests: int = 8, max_requests: int = 256, report_window: float = 30.0
    ) -> None:
        if quiet_requests < 1:
            raise ValueError(f"quiet_requests must be >= 1, got {quiet_requests}")
        if max_requests < quiet_requests:
            raise ValueError(f"max_requests must be >= quiet_requests ({quiet_requests}), got {max_requests}")
        if not report_window >= 0:
            raise ValueError(f"report_window must be >= 0, got {report_window}")
        self.pool = pool
        self.index = pool.index
        self.report_window = report_window
        self._grouped = isinstance(pool.index, GroupAware)
        self.quiet_requests = quiet_requests
        self.max_requests = max_requests
        self._lock = threading.Lock()
        self._episodes: dict[_Key, _Episode] = {}
        self._c = dict.fromkeys(
            ("sent", "done", "discoveries", "learned", "episodes", "healed_quiet", "healed_cap"), 0
        )
        self._observer: Callable[[str, int, str | None, BlockStored], None] | None = self._on_stored
        pool.add_store_observer(self._on_stored, wants=self._healing)

    def close(self) -> None:
        """Stop observing the pool (the policy then only answers from completeness)."""
        if self._observer is not None:
            self.pool.remove_store_observer(self._observer)
            self._observer = None

    # -- the router's calls

    def _streams(self, pod: str, dp_rank: int | None, model: str | None) -> list[StreamState]:
        return [
            s for s in self.pool.completeness(pod)
            if (dp_rank is None or s.dp_rank == dp_rank) and (model is None or s.model is None or s.model == model)
        ]

    def _episode(self, s: StreamState) -> _Episode | None:
        """The stream's live episode (made or renewed as its state says); None when complete. Lock held."""
        key = (s.pod, s.model, s.dp_rank)
        if s.complete or s.misconfigured:  # a full report cannot mend a configuration
            self._episodes.pop(key, None)
            return None
        ep = self._episodes.get(key)
        if ep is None or ep.losses != s.losses:
            ep = self._episodes[key] = _Episode(s.losses)
            self._c["episodes"] += 1
        return ep

    def wants_full_report(self, pod: str, dp_rank: int | None = 0, model: str | None = None) -> bool:
        """True when a request sent now to ``pod`` (DP rank ``dp_rank``, ``model``; None = any
        rank / any model, e.g. when the engine picks the rank) should carry
        ``kv_cache_report_mode: "full"``: one of those streams is incomplete and not yet
        judged healed.  Streams the pool has not seen are not asked."""
        streams = self._streams(pod, dp_rank, model)
        with self._lock:
            want = False
            for s in streams:
                ep = self._episode(s)
                if ep is not None and ep.healing:
                    want = True
            return want

    def full_report_sent(self, pod: str, dp_rank: int | None = 0, model: str | None = None) -> None:
        """Count a request sent to ``pod`` with the full report (after :meth:`wants_full_report`)."""
        streams = self._streams(pod, dp_rank, model)
        self._distrust(streams)
        with self._lock:
            self._c["sent"] += 1
            for s in streams:
                ep = self._episode(s)
                if ep is None or not ep.healing:
                    continue
                ep.sent += 1
                if ep.sent >= self.max_requests:
                    ep.healing, ep.why = False, "cap"
                    self._c["healed_cap"] += 1

    def full_report_done(self, pod: str, dp_rank: int | None = 0, model: str | None = None) -> None:
        """Count a full-report request to ``pod`` as ended (its answer came back, so the
        engine has published its events); ``quiet_requests`` such ends in a row without a
        discovery heal the stream."""
        self._distrust(self._streams(pod, dp_rank, model))
        with self._lock:
            self._c["done"] += 1
            for key, ep in self._episodes.items():
                if key[0] != pod or dp_rank not in (None, key[2]) or (model is not None and key[1] not in (None, model)):
                    continue
                if not ep.healing:
                    continue
                ep.done += 1
                if ep.fresh:
                    ep.fresh, ep.quiet = False, 0  # this request (or one in flight with it) discovered
                else:
                    ep.quiet += 1
                if ep.quiet >= self.quiet_requests:
                    ep.healing, ep.why = False, "quiet"
                    self._c["healed_quiet"] += 1

    def _distrust(self, streams: list[StreamState]) -> None:
        """Open (or extend) the streams' report window on a group-keeping index."""
        if self._grouped and self.report_window > 0:
            for s in streams:
                self.index.distrust_reports(s.pod, s.dp_rank, model=s.model, seconds=self.report_window)  # type: ignore[attr-defined]

    # -- the write path's calls (shard threads)

    def _healing(self, pod: str, dp_rank: int, model: str | None) -> bool:
        """Does this stream have a live healing episode (else its batches need no observing)?"""
        ep = self._episodes.get((pod, model, dp_rank))
        return ep is not None and ep.healing

    def _on_stored(self, pod: str, dp_rank: int, model: str | None, ev: BlockStored) -> None:
        """Before a BlockStored applies: count blocks of a parent-nil store the stream did not hold."""
        if ev.parent_block_hash is not None or not ev.token_ids:
            return
        key = (pod, model, dp_rank)
        with self._lock:
            ep = self._episodes.get(key)
            if ep is None or not ep.healing:
                return
        rks = [self.index.request_key_of(ek, model) for ek in ev.block_hashes]
        known = [rk for rk in rks if rk is not None]
        held = 0
        if known:
            for entries in self.index.lookup(known):
                if any(
                    e.pod == pod and e.dp_rank == dp_rank and not e.speculative and e.tier != "decode_retained"
                    for e in entries
                ):
                    held += 1
        new = len(rks) - held
        if new <= 0:
            return
        with self._lock:
            ep = self._episodes.get(key)
            if ep is None or not ep.healing:
                return
            ep.quiet, ep.fresh = 0, True
            ep.discoveries += 1
            ep.learned += new
            self._c["discoveries"] += 1
            self._c["learned"] += new

    # -- observability

    def states(self) -> list[HealingState]:
        """Every stream with a healing episode (live or ended), sorted."""
        with self._lock:
            out = [
                HealingState(k[0], k[1], k[2], ep.healing, ep.sent, ep.done, ep.quiet, ep.discoveries, ep.learned, ep.why)
                for k, ep in self._episodes.items()
            ]
        out.sort(key=lambda h: (h.pod, h.model or "", h.dp_rank))
        return out

    def stats(self) -> HealingStats:
        """Counters since the policy was made (see :class:`HealingStats`)."""
        with self._lock:
            c = self._c
            return HealingStats(
                healing_streams=sum(1 for ep in self._episodes.values() if ep.healing),
                full_reports_sent=c["sent"],
                full_reports_done=c["done"],
                discoveries=c["discoveries"],
                learned_blocks=c["learned"],
                episodes=c["episodes"],
                healed_quiet=c["healed_quiet"],
                healed_cap=c["healed_cap"],
            )
