"""kvindex.truth: predicted vs confirmed cached tokens per pod, held to a plain oracle."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvindex.truth import PredictionTruth

reports = st.lists(st.tuples(st.sampled_from(["a", "b"]), st.integers(0, 4096), st.integers(0, 4096)), max_size=120)


@given(reports, st.integers(1, 20))
def test_totals_and_health_match_the_oracle(rs: list[tuple[str, int, int]], window: int) -> None:
    t = PredictionTruth(window=window, min_tokens=100, min_precision=0.8, min_recall=0.5)
    for pod, p, c in rs:
        t.report(pod, p, c)
    for pod in {r[0] for r in rs}:
        mine = [(p, c) for q, p, c in rs if q == pod]
        got = t.pod(pod)
        assert got is not None
        assert (got.requests, got.predicted, got.confirmed) == (len(mine), sum(p for p, _ in mine), sum(c for _, c in mine))
        assert got.over == sum(max(0, p - c) for p, c in mine) and got.under == sum(max(0, c - p) for p, c in mine)
        last = mine[-window:]
        wp, wc, ok = sum(p for p, _ in last), sum(c for _, c in last), sum(min(p, c) for p, c in last)
        judged = len(mine) >= window and max(wp, wc) >= 100
        unhealthy = judged and ((wp > 0 and ok / wp < 0.8) or (wc > 0 and ok / wc < 0.5))
        assert got.healthy is not unhealthy
    assert t.pod("never") is None


def test_a_sustained_overprediction_marks_the_pod_unhealthy_and_recovers() -> None:
    t = PredictionTruth(window=8, min_tokens=64)
    for _ in range(8):
        t.report("a", 128, 128)
    assert t.pod("a").healthy  # type: ignore[union-attr]
    for _ in range(8):
        t.report("a", 128, 0)  # e.g. a block-size or tokenization mismatch: nothing predicted is found
    got = t.pod("a")
    assert got is not None and not got.healthy and got.window_precision == 0.0 and got.precision == 0.5
    for _ in range(8):
        t.report("a", 64, 64)
    assert t.pods()["a"].healthy


def test_misuse_raises() -> None:
    with pytest.raises(ValueError):
        PredictionTruth(window=0)
    with pytest.raises(ValueError):
        PredictionTruth(min_precision=2.0)
    with pytest.raises(ValueError):
        PredictionTruth().report("a", -1, 0)


def test_the_indexer_reports_truth_in_its_metrics() -> None:
    from prometheus_client import CollectorRegistry

    from kvindex import Config, Indexer

    ix = Indexer(Config())
    reg = CollectorRegistry()
    ix.register_metrics(reg)
    ix.report_cached("pod-a", 96, 64)
    ix.report_cached("pod-a", 0, 32)
    t = ix.prediction_truth()["pod-a"]
    assert (t.predicted, t.confirmed, t.over, t.under) == (96, 96, 32, 32)
    assert reg.get_sample_value("kvindex_prediction_over_tokens_total", {"pod": "pod-a"}) == 32
    assert reg.get_sample_value("kvindex_prediction_healthy", {"pod": "pod-a"}) == 1.0
    assert reg.get_sample_value("kvindex_prediction_window_precision", {"pod": "pod-a"}) == 64 / 96
