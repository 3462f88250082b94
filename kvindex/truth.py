"""Predicted vs confirmed cached tokens, per pod: is the index's prediction right?

A router predicts, for each routed request, how many prompt tokens the chosen
engine will serve from its prefix cache; the engine's answer says how many it
did (``usage.prompt_tokens_details.cached_tokens`` with
``--enable-prompt-tokens-details``, vLLM 0.32, or the request's increase of
``vllm:prefix_cache_hits_total``). :class:`PredictionTruth` keeps, per pod,
totals of predicted, confirmed, correctly predicted (``min(predicted,
confirmed)``), over- and under-predicted tokens, and a window of the last
requests. Precision = correct / predicted, recall = correct / confirmed.

A pod is unhealthy when, over a full window with enough tokens in play, its
precision or recall falls below the thresholds: a sustained mismatch such as a
block-size or tokenization error, not one unlucky request. Pure accounting:
no clock, no threads; callers serialise (the facade holds a lock).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field


@dataclass(frozen=True)
class PodTruth:
    """One pod's totals (tokens) and its health over the window."""

    requests: int
    predicted: int
    confirmed: int
    correct: int
    over: int
    under: int
    window_precision: float | None  # None until the window has predicted tokens
    window_recall: float | None  # None until the window has confirmed tokens
    healthy: bool

    @property
    def precision(self) -> float | None:
        """correct / predicted over all requests (None with nothing predicted)."""
        return self.correct / self.predicted if self.predicted else None

    @property
    def recall(self) -> float | None:
        """correct / confirmed over all requests (None with nothing confirmed)."""
        return self.correct / self.confirmed if self.confirmed else None


@dataclass
class _Pod:
    requests: int = 0
    predicted: int = 0
    confirmed: int = 0
    correct: int = 0
    window: deque[tuple[int, int]] = field(default_factory=deque)


class PredictionTruth:
    """Per-pod accounting of predicted vs engine-confirmed cached tokens.

    Args:
        window: requests per pod judged for health (the last ones).
        min_tokens: tokens (predicted or confirmed) the window must hold before
            a pod can be judged unhealthy.
        min_precision, min_recall: the thresholds (0..1).

    Raises ValueError on bad arguments.
    """

    def __init__(self, *, window: int = 64, min_tokens: int = 1024,
                 min_precision: float = 0.8, min_recall: float = 0.5) -> None:
        if window < 1 or min_tokens < 0:
            raise ValueError("window must be >= 1 and min_tokens >= 0")
        if not (0.0 <= min_precision <= 1.0 and 0.0 <= min_recall <= 1.0):
            raise ValueError("min_precision and min_recall must be in [0, 1]")
        self.window = window
        self.min_tokens = min_tokens
        self.min_precision = min_precision
        self.min_recall = min_recall
        self._pods: dict[str, _Pod] = {}

    def report(self, pod: str, predicted: int, confirmed: int) -> None:
        """Record one request routed to ``pod``: tokens predicted cached, and what the engine confirmed.

        Raises ValueError on negative counts (a caller's mistake).
        """
        if predicted < 0 or confirmed < 0:
            raise ValueError(f"token counts must be >= 0, got predicted={predicted} confirmed={confirmed}")
        p = self._pods.setdefault(pod, _Pod())
        p.requests += 1
        p.predicted += predicted
        p.confirmed += confirmed
        p.correct += min(predicted, confirmed)
        p.window.append((predicted, confirmed))
        if len(p.window) > self.window:
            p.window.popleft()

    def forget(self, pod: str) -> None:
        """Drop a pod's record (e.g. the engine was removed)."""
        self._pods.pop(pod, None)

    def pod(self, pod: str) -> PodTruth | None:
        """One pod's totals and health (None if never reported)."""
        p = self._pods.get(pod)
        if p is None:
            return None
        wp = sum(a for a, _ in p.window)
        wc = sum(b for _, b in p.window)
        wok = sum(min(a, b) for a, b in p.window)
        prec = wok / wp if wp else None
        rec = wok / wc if wc else None
        judged = len(p.window) >= self.window and max(wp, wc) >= self.min_tokens
        bad = judged and ((prec is not None and prec < self.min_precision)
                          or (rec is not None and rec < self.min_recall))
        return PodTruth(
            requests=p.requests, predicted=p.predicted, confirmed=p.confirmed, correct=p.correct,
            over=p.predicted - p.correct, under=p.confirmed - p.correct,
            window_precision=prec, window_recall=rec, healthy=not bad,
        )

    def pods(self) -> dict[str, PodTruth]:
        """Every reported pod's :class:`PodTruth`."""
        return {name: t for name in sorted(self._pods) if (t := self.pod(name)) is not None}
