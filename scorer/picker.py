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

from kvindex.accel import native as _native
from scorer.load import LoadSnapshot
from scorer.prefix import PrefixScore

__all__ = [
    "Choice",
    "LoadPicker",
    "PickerWeights",
    "PodExplanation",
    "PodInputs",
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


class PodInputs(msgspec.Struct, frozen=True, array_like=True, gc=False):
    """One candidate of a pick, compactly: what :class:`PodExplanation` is derived from.

    A pick builds one per candidate (cheap: no strings); the explanation rows,
    their normalised queue score and their reasons are derived from these only
    when :attr:`Choice.explanation` is read.  Fields as in
    :class:`PodExplanation`, except ``kv`` (= kv-usage score, 1 - usage) and
    ``queue_len`` (raw ``waiting + in_flight``; the queue score is its min-max
    normalisation over the candidates) and ``overflow_tokens`` (the ttft
    picker's KV overflow, see :class:`TTFTPicker`).
    """

    pod: str
    total: float
    prefix: float
    kv: float
    queue_len: float
    matched_tokens: int
    waiting: float
    in_flight: int
    kv_cache_usage: float
    load_known: bool
    uncached_tokens: int = 0
    queued_tokens: float = 0.0
    cost: float = 0.0
    overflow_tokens: float = 0.0


class Choice(msgspec.Struct, frozen=True, kw_only=True, dict=True):
    """Outcome of a pick.

    Fields:
        pod: the chosen pod id.
        score: its total (see :attr:`PodExplanation.total`).
        dp_rank: data-parallel rank hint within the pod, or None.  The
            pickers work per pod and leave it None; ``kvindex.Indexer.score``
            fills in the rank holding the chosen pod's longest prefix
            (``KVBlockIndex.best_dp_rank``).
        rows: one :class:`PodInputs` per candidate, in ranking order (the
            chosen pod first); the compact form :attr:`explanation` is built from.
        picker: name of the picker that decided ("weighted", "load", "random", "ttft").
        weights: the weights the total was computed with (None for the random
            and ttft pickers).
        tie_tokens: the ttft picker's tie margin in tokens (0 for the others).

    :attr:`explanation` and :meth:`explain` are computed on first use (a
    router that only needs the pod pays for neither), then kept.
    """

    pod: str
    score: float
    rows: tuple[PodInputs, ...] = ()
    dp_rank: int | None = None
    picker: str = "weighted"
    weights: PickerWeights | None = None
    tie_tokens: float = 0.0

    @property
    def explanation(self) -> dict[str, PodExplanation]:
        """pod -> :class:`PodExplanation` for every candidate, in ranking order (the chosen pod first).

        Built from :attr:`rows` on first access (the reasons are formatted
        then), then cached on the instance.
        """
        cached = self.__dict__.get("_explanation")
        if cached is None:
            cached = self.__dict__["_explanation"] = _explain_rows(self)
        return cached

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


def _queue_scores(rows: Sequence[PodInputs]) -> list[float]:
    """Queue score per row: min-max of ``queue_len`` over the rows, inverted (all equal: 1.0 each)."""
    lo = min(r.queue_len for r in rows)
    hi = max(r.queue_len for r in rows)
    if hi > lo:
        span = hi - lo
        return [(hi - r.queue_len) / span for r in rows]
    return [1.0] * len(rows)


def _explain_rows(c: Choice) -> dict[str, PodExplanation]:
    """The per-candidate explanation of ``c`` (its rows, normalised queue score and reasons)."""
    rows = c.rows
    if not rows:
        return {}
    queue = _queue_scores(rows)
    if c.picker == TTFTPicker.name:
        reasons = _ttft_reasons(rows, c.tie_tokens)
    elif c.picker == RandomPicker.name:
        reasons = ["drawn at random" if r.pod == c.pod else "not drawn" for r in rows]
    else:
        reasons = _weighted_reasons(rows, queue, c.weights or PickerWeights(), c.picker != LoadPicker.name)
    return {
        r.pod: PodExplanation(
            total=r.total, prefix=r.prefix, kv_usage=r.kv, queue=q, matched_tokens=r.matched_tokens,
            waiting=r.waiting, in_flight=r.in_flight, kv_cache_usage=r.kv_cache_usage, load_known=r.load_known,
            reason=why, uncached_tokens=r.uncached_tokens, queued_tokens=r.queued_tokens, cost=r.cost,
        )
        for r, q, why in zip(rows, queue, reasons)
    }


def _weighted_reasons(rows: Sequence[PodInputs], queue: list[float], w: PickerWeights, use_prefix: bool) -> list[str]:
    """Why each ranked row of a weighted (or load) pick won or lost."""
    win = rows[0]
    out: list[str] = []
    for rank, r in enumerate(rows):
        if rank == 0:
            if len(rows) == 1:
                out.append("only candidate")
                continue
            second = rows[1]
            if second.total < r.total:
                out.append(f"highest total (+{r.total - second.total:.3f} over {second.pod})")
            elif use_prefix and r.prefix > second.prefix:
                out.append("tie on total; higher prefix")
            elif r.queue_len < second.queue_len:
                out.append("tie on total; shorter queue")
            else:
                out.append("tie on total; first pod id")
            continue
        gap = win.total - r.total
        if gap <= 0.0:
            out.append("tie on total; lost the tie-break")
            continue
        parts = {
            "prefix": w.prefix * (win.prefix - r.prefix),
            "kv-usage": w.kv_usage * (win.kv - r.kv),
            "queue": w.queue * (queue[0] - queue[rank]),
        }
        main = max(parts, key=lambda k: (parts[k], k))
        out.append(f"-{gap:.3f} vs {win.pod}, mostly {main}")
    return out


def _ttft_reasons(rows: Sequence[PodInputs], tie: float) -> list[str]:
    """Why each ranked row of a ttft pick won or lost."""
    win = rows[0]
    out: list[str] = []
    for rank, r in enumerate(rows):
        if rank == 0:
            if len(rows) == 1:
                out.append("only candidate")
                continue
            second = rows[1]
            gap = second.cost - r.cost
            if gap > tie:
                out.append(f"lowest cost ({gap:.0f} tokens below {second.pod})")
            elif r.queue_len < second.queue_len:
                out.append("tie on cost; shorter queue")
            else:
                out.append("tie on cost; first pod id")
            continue
        gap = r.cost - win.cost
        if gap <= tie:
            out.append("tie on cost; lost the tie-break")
            continue
        if r.overflow_tokens > win.overflow_tokens:
            out.append(f"+{gap:.0f} tokens vs {win.pod}, mostly kv overflow ({r.overflow_tokens:.0f} tokens do not fit)")
            continue
        dq = r.queued_tokens - win.queued_tokens
        du = r.uncached_tokens - win.uncached_tokens
        main = "queued prefill" if dq >= du and dq > 0 else "uncached prefix" if du > 0 else "kv headroom"
        out.append(f"+{gap:.0f} tokens vs {win.pod}, mostly {main}")
    return out


def _table(head: str, rows: list[tuple[str, ...]]) -> str:
    """``head``, then ``rows`` (the first is the header) in aligned columns; the last column is not padded."""
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]) - 1)]
    return "\n".join([head] + ["  ".join(c.ljust(w) for c, w in zip(r[:-1], widths)) + "  " + r[-1] for r in rows])


_INF = math.inf


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


def _gather(
    prefix: Mapping[str, PrefixScore], loads: Mapping[str, LoadSnapshot], pods: list[str]
) -> list[PodInputs]:
    """One :class:`PodInputs` per candidate (total 0.0: the picker sets it)."""
    rows: list[PodInputs] = []
    pget, lget = prefix.get, loads.get
    for pod in pods:
        ps = pget(pod)
        ld = lget(pod)
        if ld is not None:
            waiting = _finite_nonneg(ld.waiting)
            in_flight = max(0, int(ld.in_flight))
            usage = _unit(ld.kv_usage)
        else:
            waiting, in_flight, usage = 0.0, 0, 0.0
        if ps is not None:
            cov, matched = _unit(ps.coverage), ps.matched_tokens
        else:
            cov, matched = 0.0, 0
        rows.append(PodInputs(pod, 0.0, cov, 1.0 - usage, waiting + in_flight, matched, waiting, in_flight, usage,
                              ld is not None))
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
            The Choice, with a row for every candidate (its explanation is
            formatted when first read).

        Raises:
            ValueError: no candidates.
            TypeError: ``candidates`` is a single string.
        """
        pods = _unique_candidates(candidates)
        w = self.weights
        rows = _gather(prefix, loads, pods)
        queue = _queue_scores(rows)
        wp, wk, wq = w.prefix, w.kv_usage, w.queue
        use_prefix = self._prefix_tiebreak()
        keyed = []
        for r, q in zip(rows, queue):
            total = wp * r.prefix + wk * r.kv + wq * q
            keyed.append(((-total, -r.prefix if use_prefix else 0.0, r.queue_len, r.pod), total, r))
        keyed.sort(key=lambda t: t[0])
        ranked = tuple(msgspec.structs.replace(r, total=total) for _k, total, r in keyed)
        win = ranked[0]
        return Choice(pod=win.pod, score=win.total, rows=ranked, picker=self.name, weights=w)


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
        ranked = tuple(msgspec.structs.replace(r, total=1.0 if r.pod == chosen else 0.0) for r in rows)
        return Choice(pod=chosen, score=1.0, rows=ranked, picker=self.name)


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

        ``prompt_tokens`` should be given (``kvindex.Indexer.score`` does); when
        None it is estimated from the prefix scores (matched tokens / coverage).
        One pass over the candidates with no strings formatted: the
        explanation is derived from the returned rows when first read.
        """
        pods = _unique_candidates(candidates)
        n_prompt = _prompt_tokens(prompt_tokens, prefix, pods)
        kvp, stall, reserve = self.kv_pressure, self.kv_stall, self.decode_reserve
        # the compiled pass: the same rows and order for the common inputs (exact floats and ints
        # in range, dicts, str pod ids, no kv_stall); None sends anything else through the loop below
        if _native is not None:
            ranked = _native.ttft_rows(
                prefix, loads, pods, n_prompt, kvp, stall, reserve, self.tie_tokens, PodInputs)
        else:
            ranked = None
        if ranked is not None:
            win = ranked[0]
            return Choice(pod=win.pod, score=win.total, rows=ranked, picker=self.name, tie_tokens=self.tie_tokens)
        return self._pick_py(pods, n_prompt, prefix, loads)

    def _pick_py(
        self, pods: list[str], n_prompt: int, prefix: Mapping[str, PrefixScore], loads: Mapping[str, LoadSnapshot]
    ) -> Choice:
        """The per-candidate loop of :meth:`pick` for any inputs (the reference of the compiled pass)."""
        hit_cap = float(max(0, n_prompt - 1))
        kvp, stall, reserve = self.kv_pressure, self.kv_stall, self.decode_reserve
        pget, lget = prefix.get, loads.get
        costed = []
        for pod in pods:
            ps = pget(pod)
            ld = lget(pod)
            # the plain comparisons take the common case (finite, in range; NaN fails them) without
            # a call; anything else goes through the clamping helpers
            if ld is not None:
                waiting = ld.waiting
                if waiting.__class__ is not float or not 0.0 <= waiting < _INF:
                    waiting = _finite_nonneg(waiting)
                in_flight = ld.in_flight
                if in_flight.__class__ is not int or in_flight < 0:
                    in_flight = max(0, int(in_flight))
                usage = ld.kv_usage
                if usage.__class__ is not float or not 0.0 <= usage <= 1.0:
                    usage = _unit(usage)
                q = ld.prefill_tokens
                if q is None:
                    q = waiting * n_prompt
                elif q.__class__ is not float or not 0.0 <= q < _INF:
                    q = _finite_nonneg(q)
            else:
                waiting, in_flight, usage, q = 0.0, 0, 0.0, 0.0
            cached = 0.0
            if ps is not None:
                cov, matched, mb = ps.coverage, ps.matched_tokens, ps.matched_blocks
                if cov.__class__ is not float or not 0.0 <= cov <= 1.0:
                    cov = _unit(cov)
                if mb > 0:
                    wb = ps.weighted_blocks
                    if wb.__class__ is not float or not 0.0 <= wb < _INF:
                        wb = _finite_nonneg(wb)
                    cached = wb * (matched / mb)
                    if cached > hit_cap:
                        cached = hit_cap
            else:
                cov, matched = 0.0, 0
            un = n_prompt - cached if n_prompt > cached else 0.0
            over = 0.0
            if stall > 0.0 and ld is not None and ld.kv_capacity_tokens is not None:
                free = (1.0 - usage) * _finite_nonneg(ld.kv_capacity_tokens)
                over = max(0.0, q + un + _finite_nonneg(ld.running) * reserve - free)
            cost = q + un * (1.0 + kvp * usage) + stall * over
            qlen = waiting + in_flight
            # the row now (round of a float is an int); (cost, queue, pod) ranks it
            costed.append((cost, qlen, pod, PodInputs(pod, -cost, cov, 1.0 - usage, qlen, matched, waiting, in_flight,
                                                      usage, ld is not None, round(un), q, cost, over)))
        tie = self.tie_tokens
        if tie > 0.0:
            best_cost = min(t[0] for t in costed)
            costed.sort(key=lambda t: (best_cost if t[0] - best_cost <= tie else t[0], t[1], t[2]))
        else:
            costed.sort()  # (cost, queue, pod, row): pod ids are unique, so the rows are never compared
        ranked = tuple([t[3] for t in costed])
        win = ranked[0]
        return Choice(pod=win.pod, score=win.total, rows=ranked, picker=self.name, tie_tokens=tie)


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
