"""Pickers: choose one pod from prefix scores and load, and explain the choice.

Read path: ... -> prefix scores -> **picker (with load)** -> chosen pod +
explanation.

:class:`WeightedPicker` mixes three normalised scorer outputs, each in 0..1,
with the weights of the llm-d precise prefix-cache benchmark (prefix 3 :
kv-usage 2 : queue 2):

* prefix score = :attr:`PrefixScore.coverage` (absolute, see
  :mod:`scorer.prefix`);
* kv-usage score = ``1 - kv_usage`` clamped to 0..1;
* queue score = min-max normalisation over the candidates of
  ``waiting + in_flight``, inverted so the shortest queue gets 1 and the
  longest 0 (all equal -> 1 for every candidate).

:class:`LoadPicker` (kv-usage + queue only) and :class:`RandomPicker` are the
baselines of that benchmark.  All pickers share the ``pick`` signature and
return a :class:`Choice`.
"""

from __future__ import annotations

import math
import random
from collections.abc import Mapping, Sequence

import msgspec

from scorer.load import LoadSnapshot
from scorer.prefix import PrefixScore

__all__ = [
    "Choice",
    "LoadPicker",
    "PickerWeights",
    "PodExplanation",
    "RandomPicker",
    "TTFTPicker",
    "WeightedPicker",
]


class PickerWeights(msgspec.Struct, frozen=True, kw_only=True):
    """Weights of the scorers in :class:`WeightedPicker` (each finite, >= 0).

    Defaults are the llm-d precise-scheduling benchmark's: prefix 3.0,
    kv_usage 2.0, queue 2.0.

    Raises:
        ValueError: a negative or non-finite weight.
    """

    prefix: float = 3.0
    kv_usage: float = 2.0
    queue: float = 2.0

    def __post_init__(self) -> None:
        for name in ("prefix", "kv_usage", "queue"):
            v = getattr(self, name)
            if not (math.isfinite(v) and v >= 0.0):
                raise ValueError(f"picker weight {name!r} must be finite and >= 0, got {v}")


class PodExplanation(msgspec.Struct, frozen=True, kw_only=True):
    """One candidate's scores and raw inputs in a :class:`Choice`.

    Fields:
        total: the picker's total for this pod (weighted sum; for
            :class:`RandomPicker` 1.0 for the drawn pod, 0.0 for the others).
        prefix: prefix score = coverage, 0..1.
        kv_usage: kv-usage score = 1 - usage, 0..1.
        queue: queue score, 0..1 (1 = shortest queue among the candidates).
        matched_tokens: tokens of the pod's consecutive prefix match.
        waiting: engine-reported waiting requests (raw input).
        in_flight: router-side in-flight requests (raw input).
        kv_cache_usage: engine-reported KV usage fraction (raw input, 0..1).
        load_known: False when no LoadSnapshot was given for the pod (its load
            then counts as zeros).
        reason: one short line on why the pod won or lost.
    """

    total: float
    prefix: float
    kv_usage: float
    queue: float
    matched_tokens: int
    waiting: float
    in_flight: int
    kv_cache_usage: float
    load_known: bool
    reason: str
    uncached_tokens: int = 0
    queued_tokens: float = 0.0
    cost: float = 0.0


class Choice(msgspec.Struct, frozen=True, kw_only=True):
    """Outcome of a pick.

    Fields:
        pod: the chosen pod id.
        score: its total (see :attr:`PodExplanation.total`).
        dp_rank: data-parallel rank hint within the pod, or None.  The
            pickers work per pod and leave it None; ``indexer.Indexer.score``
            fills in the rank holding the chosen pod's longest prefix
            (``KVBlockIndex.best_dp_rank``).
        explanation: pod -> :class:`PodExplanation` for every candidate, in
            ranking order (the chosen pod first).
        picker: name of the picker that decided ("weighted", "load", "random").
        weights: the weights the total was computed with (None for the random picker).
    """

    pod: str
    score: float
    explanation: dict[str, PodExplanation]
    dp_rank: int | None = None
    picker: str = "weighted"
    weights: PickerWeights | None = None

    def explain(self) -> str:
        """A human-readable table: one row per candidate, the chosen pod marked ``*``."""
        header = ("", "pod", "total", "prefix", "kv", "queue", "tokens", "waiting", "inflight", "kv_use", "reason")
        if self.picker == TTFTPicker.name:
            return self._explain_ttft()
        rows = [header]
        for pod, e in self.explanation.items():
            rows.append(
                (
                    "*" if pod == self.pod else "",
                    pod,
                    f"{e.total:.3f}",
                    f"{e.prefix:.3f}",
                    f"{e.kv_usage:.3f}",
                    f"{e.queue:.3f}",
                    str(e.matched_tokens),
                    f"{e.waiting:g}" if e.load_known else "-",
                    str(e.in_flight),
                    f"{e.kv_cache_usage:.2f}" if e.load_known else "-",
                    e.reason,
                )
            )
        head = f"picker={self.picker} chosen={self.pod} score={self.score:.3f}"
        if self.weights is not None:
            w = self.weights
            head += (f"  (total = {w.prefix:g} x prefix + {w.kv_usage:g} x kv + {w.queue:g} x queue;"
                     " the three columns are unweighted, 0..1)")
        return _table(head, rows)

    def _explain_ttft(self) -> str:
        header = ("", "pod", "cost", "queued", "uncached", "kv_use", "tokens", "waiting", "inflight", "reason")
        rows = [header]
        for pod, e in self.explanation.items():
            rows.append(
                (
                    "*" if pod == self.pod else "",
                    pod,
                    f"{e.cost:.0f}",
                    f"{e.queued_tokens:.0f}",
                    str(e.uncached_tokens),
                    f"{e.kv_cache_usage:.2f}" if e.load_known else "-",
                    str(e.matched_tokens),
                    f"{e.waiting:g}" if e.load_known else "-",
                    str(e.in_flight),
                    e.reason,
                )
            )
        head = (f"picker={self.picker} chosen={self.pod} cost={-self.score:.0f} tokens"
                "  (cost = queued + uncached x (1 + kv_pressure x kv_use) + kv_stall x overflow; lowest wins)")
        return _table(head, rows)


def _table(head: str, rows: list[tuple[str, ...]]) -> str:
    """``head``, then ``rows`` (the first is the header) in aligned columns; the last column is not padded."""
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]) - 1)]
    return "\n".join([head] + ["  ".join(c.ljust(w) for c, w in zip(r[:-1], widths)) + "  " + r[-1] for r in rows])


def _finite_nonneg(x: float) -> float:
    x = float(x)
    return x if math.isfinite(x) and x > 0.0 else 0.0


def _unit(x: float) -> float:
    x = float(x)
    if not math.isfinite(x):
        return 0.0 if x != x or x < 0 else 1.0
    return 0.0 if x < 0.0 else 1.0 if x > 1.0 else x


def _unique_candidates(candidates: Sequence[str]) -> list[str]:
    if isinstance(candidates, (str, bytes)):
        raise TypeError("candidates must be a sequence of pod ids, not a single string")
    out = list(dict.fromkeys(candidates))
    if not out:
        raise ValueError("no candidate pods to pick from")
    return out


class _Inputs(msgspec.Struct):
    pod: str
    prefix: float
    kv: float
    queue_len: float
    queue: float
    matched_tokens: int
    waiting: float
    in_flight: int
    kv_cache_usage: float
    load_known: bool

    def explanation(self, total: float, reason: str) -> PodExplanation:
        return PodExplanation(
            total=total,
            prefix=self.prefix,
            kv_usage=self.kv,
            queue=self.queue,
            matched_tokens=self.matched_tokens,
            waiting=self.waiting,
            in_flight=self.in_flight,
            kv_cache_usage=self.kv_cache_usage,
            load_known=self.load_known,
            reason=reason,
        )


def _gather(
    prefix: Mapping[str, PrefixScore], loads: Mapping[str, LoadSnapshot], pods: list[str]
) -> list[_Inputs]:
    """Normalised scorer outputs per candidate (queue min-max over ``pods``)."""
    rows: list[_Inputs] = []
    for pod in pods:
        ps = prefix.get(pod)
        ld = loads.get(pod)
        waiting = _finite_nonneg(ld.waiting) if ld is not None else 0.0
        in_flight = max(0, int(ld.in_flight)) if ld is not None else 0
        usage = _unit(ld.kv_usage) if ld is not None else 0.0
        rows.append(
            _Inputs(
                pod=pod,
                prefix=_unit(ps.coverage) if ps is not None else 0.0,
                kv=1.0 - usage,
                queue_len=waiting + in_flight,
                queue=1.0,
                matched_tokens=ps.matched_tokens if ps is not None else 0,
                waiting=waiting,
                in_flight=in_flight,
                kv_cache_usage=usage,
                load_known=ld is not None,
            )
        )
    lo = min(r.queue_len for r in rows)
    hi = max(r.queue_len for r in rows)
    if hi > lo:
        span = hi - lo
        for r in rows:
            r.queue = (hi - r.queue_len) / span
    return rows


class WeightedPicker:
    """Weighted sum of normalised scorer outputs; deterministic.

    ``total = w.prefix * coverage + w.kv_usage * (1 - kv_usage) + w.queue * queue``
    (see the module docstring for each term).  The pod with the largest total
    wins; ties go to the higher prefix score, then the shorter raw queue
    (``waiting + in_flight``), then the smaller pod id (string order), so the
    choice never depends on candidate order.

    A candidate without an entry in ``prefix`` has coverage 0; one without a
    LoadSnapshot in ``loads`` has zero load (waiting 0, in_flight 0, usage 0),
    i.e. it looks idle: feed the router's in-flight counts to avoid piling
    requests on a pod whose metrics are not yet scraped.
    """

    name = "weighted"

    def __init__(self, weights: PickerWeights | None = None) -> None:
        self.weights = weights if weights is not None else PickerWeights()

    def _prefix_tiebreak(self) -> bool:
        return True

    def pick(
        self,
        prefix: Mapping[str, PrefixScore],
        loads: Mapping[str, LoadSnapshot],
        candidates: Sequence[str],
        *,
        prompt_tokens: int | None = None,
    ) -> Choice:
        """Choose one of ``candidates``.

        Args:
            prefix: pod -> PrefixScore (e.g. from :func:`scorer.prefix.score_prefix`);
                entries for non-candidates are ignored.
            loads: pod -> LoadSnapshot; missing pods count as zero load.
            candidates: pod ids to choose from (duplicates are ignored).
            prompt_tokens: the prompt's length in tokens (ignored here; the
                cost-based :class:`TTFTPicker` uses it).

        Returns:
            The Choice, with an explanation row for every candidate.

        Raises:
            ValueError: no candidates.
            TypeError: ``candidates`` is a single string.
        """
        pods = _unique_candidates(candidates)
        w = self.weights
        rows = _gather(prefix, loads, pods)
        totals = {r.pod: w.prefix * r.prefix + w.kv_usage * r.kv + w.queue * r.queue for r in rows}
        use_prefix = self._prefix_tiebreak()

        def key(r: _Inputs) -> tuple[float, float, float, str]:
            return (-totals[r.pod], -r.prefix if use_prefix else 0.0, r.queue_len, r.pod)

        ranked = sorted(rows, key=key)
        win = ranked[0]
        expl: dict[str, PodExplanation] = {}
        for i, r in enumerate(ranked):
            expl[r.pod] = r.explanation(totals[r.pod], self._reason(i, r, win, ranked, totals, use_prefix))
        return Choice(pod=win.pod, score=totals[win.pod], explanation=expl, picker=self.name, weights=self.weights)

    def _reason(
        self,
        rank: int,
        r: _Inputs,
        win: _Inputs,
        ranked: list[_Inputs],
        totals: dict[str, float],
        use_prefix: bool,
    ) -> str:
        w = self.weights
        if rank == 0:
            if len(ranked) == 1:
                return "only candidate"
            second = ranked[1]
            if totals[second.pod] < totals[r.pod]:
                return f"highest total (+{totals[r.pod] - totals[second.pod]:.3f} over {second.pod})"
            if use_prefix and r.prefix > second.prefix:
                return "tie on total; higher prefix"
            if r.queue_len < second.queue_len:
                return "tie on total; shorter queue"
            return "tie on total; first pod id"
        gap = totals[win.pod] - totals[r.pod]
        if gap <= 0.0:
            return "tie on total; lost the tie-break"
        parts = {
            "prefix": w.prefix * (win.prefix - r.prefix),
            "kv-usage": w.kv_usage * (win.kv - r.kv),
            "queue": w.queue * (win.queue - r.queue),
        }
        main = max(parts, key=lambda k: (parts[k], k))
        return f"-{gap:.3f} vs {win.pod}, mostly {main}"


class LoadPicker(WeightedPicker):
    """Load-only baseline: kv-usage and queue scores, no prefix.

    Same as :class:`WeightedPicker` with ``PickerWeights(prefix=0.0,
    kv_usage=kv_usage, queue=queue)`` and a tie-break that ignores prefix
    (shorter raw queue, then pod id), so prefix information never leaks in.
    The ``prefix`` argument only feeds the explanation.
    """

    name = "load"

    def __init__(self, *, kv_usage: float = 2.0, queue: float = 2.0) -> None:
        super().__init__(PickerWeights(prefix=0.0, kv_usage=kv_usage, queue=queue))

    def _prefix_tiebreak(self) -> bool:
        return False


class RandomPicker:
    """Random baseline: a uniform draw among the distinct candidates.

    ``seed`` makes the sequence of draws reproducible; the draw is made over
    the candidates sorted by pod id so that it does not depend on their
    order.  The explanation carries the same per-pod scores as
    :class:`WeightedPicker` computes (for comparison) but ``total`` is 1.0 for
    the drawn pod and 0.0 for the others.
    """

    name = "random"

    def __init__(self, seed: int | None = None) -> None:
        self._rng = random.Random(seed)

    def pick(
        self,
        prefix: Mapping[str, PrefixScore],
        loads: Mapping[str, LoadSnapshot],
        candidates: Sequence[str],
        *,
        prompt_tokens: int | None = None,
    ) -> Choice:
        """Choose one of ``candidates`` at random (same contract as :meth:`WeightedPicker.pick`)."""
        pods = sorted(_unique_candidates(candidates))
        chosen = self._rng.choice(pods)
        rows = _gather(prefix, loads, pods)
        rows.sort(key=lambda r: (r.pod != chosen, r.pod))
        expl = {
            r.pod: r.explanation(1.0 if r.pod == chosen else 0.0, "drawn at random" if r.pod == chosen else "not drawn")
            for r in rows
        }
        return Choice(pod=chosen, score=1.0, explanation=expl, picker=self.name)


class TTFTPicker:
    """Cost-based picker: the pod where this request's first token is expected soonest.

    Estimated cost of pod p, in prefill tokens (lowest wins)::

        cost(p) = queued(p) + uncached(p) x (1 + kv_pressure x kv_usage(p))

    * uncached(p) = prompt tokens the pod would still compute:
      ``prompt_tokens - cached(p)``, where cached(p) is the pod's consecutive
      prefix, each block weighted by its tier (gpu 1, cpu 0.8, ...: a block in
      a slower tier costs part of a recompute), capped at ``prompt_tokens - 1``
      (the engine always computes the last token; vLLM 0.32
      ``KVCacheManager.get_computed_blocks``).
    * queued(p) = prefill work ahead of it on that pod: the router's
      ``LoadSnapshot.prefill_tokens`` (prompt tokens still to prefill of the
      requests it sent there), or, when the router does not track it,
      ``waiting x prompt_tokens`` (each queued request taken as large as this one).
    * kv_pressure x kv_usage(p): KV headroom.  New blocks on a nearly full pod
      evict cached prefixes other requests would reuse (and at the limit
      preempt running requests), so the work placed there costs more the
      fuller it is; a full hit writes nothing and pays nothing for it.
    * overflow(p) = ``max(0, queued(p) + uncached(p) + running(p) x
      decode_reserve - free(p))`` with free(p) = ``(1 - kv_usage) x
      kv_capacity_tokens`` (when the pod's ``LoadSnapshot.kv_capacity_tokens``
      is known; else no overflow): the KV that this request, the prefill
      queued ahead of it and the growth of the running requests meanwhile
      (each decoding request writes one token per step, and vLLM 0.32's
      scheduler serves running requests first) must allocate beyond what is
      free.  The scheduler admits waiting requests in order only while their
      blocks can be allocated (``KVCacheManager.allocate_slots``) and a
      decoding request that finds no free block preempts the newest running
      one, so such a request waits, and the queue behind it too, until
      running requests finish: a stall of decode length (tens of seconds for
      long answers), not of prefill length.  Each overflowing token costs
      ``kv_stall`` prefill tokens, which ranks every pod where the work fits
      before any where it does not, and among the latter the smallest
      overflow first.  Off by default (``kv_stall`` 0): in the fleet
      simulator (bench/sim/README.md) it did not remove the stalls of a fleet
      whose KV is full everywhere (it moves misses onto pods that then stall
      in turn), so it is there to try, not a tuned default.

    The full cost::

        cost(p) = queued(p) + uncached(p) x (1 + kv_pressure x kv_usage(p))
                  + kv_stall x overflow(p)

    All terms are in tokens, so no hardware calibration is needed: prefill
    time is close to linear in tokens on one pod type.  Ties (within
    ``tie_tokens``) go to the smaller ``waiting + in_flight``, then the
    smaller pod id.  ``Choice.score`` and ``PodExplanation.total`` are the
    negated cost (higher is better, as for the other pickers); the
    explanation carries cost, queued and uncached tokens per pod.

    Args:
        kv_pressure: weight of the KV-headroom term (>= 0, finite).
        kv_stall: cost in prefill tokens of one token of KV overflow (>= 0,
            finite; 0, the default, turns the term off; 100 makes any
            overflow outweigh a full miss).
        decode_reserve: tokens each running request is expected to add to
            its KV before this request's first token (>= 0, finite).
        tie_tokens: costs closer than this count as equal (>= 0).

    Raises:
        ValueError: a negative or non-finite parameter.
    """

    name = "ttft"

    def __init__(
        self,
        *,
        kv_pressure: float = 10.0,
        kv_stall: float = 0.0,
        decode_reserve: float = 16.0,
        tie_tokens: float = 0.0,
    ) -> None:
        for n, v in (("kv_pressure", kv_pressure), ("kv_stall", kv_stall), ("decode_reserve", decode_reserve),
                     ("tie_tokens", tie_tokens)):
            if not (math.isfinite(v) and v >= 0.0):
                raise ValueError(f"{n} must be finite and >= 0, got {v}")
        self.kv_pressure = float(kv_pressure)
        self.kv_stall = float(kv_stall)
        self.decode_reserve = float(decode_reserve)
        self.tie_tokens = float(tie_tokens)
        self.weights = None

    def pick(
        self,
        prefix: Mapping[str, PrefixScore],
        loads: Mapping[str, LoadSnapshot],
        candidates: Sequence[str],
        *,
        prompt_tokens: int | None = None,
    ) -> Choice:
        """Choose one of ``candidates`` (same contract as :meth:`WeightedPicker.pick`).

        ``prompt_tokens`` should be given (``indexer.Indexer.score`` does); when
        None it is estimated from the prefix scores (matched tokens / coverage).
        """
        pods = _unique_candidates(candidates)
        rows = _gather(prefix, loads, pods)
        n_prompt = _prompt_tokens(prompt_tokens, prefix, pods)
        costs: dict[str, float] = {}
        uncached: dict[str, int] = {}
        queued: dict[str, float] = {}
        overflow: dict[str, float] = {}
        for r in rows:
            ps = prefix.get(r.pod)
            cached = 0.0
            if ps is not None and ps.matched_blocks > 0:
                block = ps.matched_tokens / ps.matched_blocks
                cached = min(_finite_nonneg(ps.weighted_blocks) * block, float(max(0, n_prompt - 1)))
            un = max(0.0, n_prompt - cached)
            ld = loads.get(r.pod)
            q = (
                _finite_nonneg(ld.prefill_tokens)
                if ld is not None and ld.prefill_tokens is not None
                else r.waiting * n_prompt
            )
            over = 0.0
            cap = ld.kv_capacity_tokens if ld is not None else None
            if cap is not None and self.kv_stall > 0.0:
                free = (1.0 - r.kv_cache_usage) * _finite_nonneg(cap)
                growth = _finite_nonneg(ld.running) * self.decode_reserve
                over = max(0.0, q + un + growth - free)
            uncached[r.pod] = int(round(un))
            queued[r.pod] = q
            overflow[r.pod] = over
            costs[r.pod] = q + un * (1.0 + self.kv_pressure * r.kv_cache_usage) + self.kv_stall * over
        best_cost = min(costs.values())
        tie = self.tie_tokens

        def key(r: _Inputs) -> tuple[float, float, str]:
            c = costs[r.pod]
            return (best_cost if c - best_cost <= tie else c, r.queue_len, r.pod)

        ranked = sorted(rows, key=key)
        win = ranked[0]
        expl: dict[str, PodExplanation] = {}
        for i, r in enumerate(ranked):
            if i == 0:
                reason = "only candidate" if len(ranked) == 1 else self._win_reason(r, ranked[1], costs)
            else:
                reason = self._lose_reason(r, win, costs, queued, uncached, overflow)
            e = r.explanation(-costs[r.pod], reason)
            expl[r.pod] = msgspec.structs.replace(
                e, cost=costs[r.pod], queued_tokens=queued[r.pod], uncached_tokens=uncached[r.pod]
            )
        return Choice(pod=win.pod, score=-costs[win.pod], explanation=expl, picker=self.name)

    def _win_reason(self, r: _Inputs, second: _Inputs, costs: dict[str, float]) -> str:
        gap = costs[second.pod] - costs[r.pod]
        if gap > self.tie_tokens:
            return f"lowest cost ({gap:.0f} tokens below {second.pod})"
        if r.queue_len < second.queue_len:
            return "tie on cost; shorter queue"
        return "tie on cost; first pod id"

    def _lose_reason(
        self,
        r: _Inputs,
        win: _Inputs,
        costs: dict[str, float],
        queued: dict[str, float],
        uncached: dict[str, int],
        overflow: dict[str, float],
    ) -> str:
        gap = costs[r.pod] - costs[win.pod]
        if gap <= self.tie_tokens:
            return "tie on cost; lost the tie-break"
        if overflow[r.pod] > overflow[win.pod]:
            return f"+{gap:.0f} tokens vs {win.pod}, mostly kv overflow ({overflow[r.pod]:.0f} tokens do not fit)"
        dq = queued[r.pod] - queued[win.pod]
        du = uncached[r.pod] - uncached[win.pod]
        main = "queued prefill" if dq >= du and dq > 0 else "uncached prefix" if du > 0 else "kv headroom"
        return f"+{gap:.0f} tokens vs {win.pod}, mostly {main}"


def _prompt_tokens(given: int | None, prefix: Mapping[str, PrefixScore], pods: list[str]) -> int:
    """The prompt length: as given, else the largest ``matched_tokens / coverage`` seen (0 if none)."""
    if given is not None:
        if isinstance(given, bool) or not isinstance(given, int) or given < 0:
            raise ValueError(f"prompt_tokens must be an int >= 0, got {given!r}")
        return given
    est = 0.0
    for p in pods:
        ps = prefix.get(p)
        if ps is not None and ps.coverage > 0.0 and ps.matched_blocks > 0:
            per_block = ps.matched_tokens / ps.matched_blocks
            est = max(est, ps.weighted_blocks / ps.coverage * per_block)
    return int(round(est))
