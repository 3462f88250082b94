"""Seed 000 with conditional disaggregation: D serves a turn alone when little is left to prefill.

The seed's benchmark (:func:`bench.sim.pd.run_benchmark`: its clients, P and D
as continuously batching engines, every turn planned by
:class:`connector.planner.PDPlanner` over the library's index), each model
calibrated on its own published off curve (:func:`bench.sim.pd.calibrate_bench`),
three policies side by side at every context of the seed's sweep:

- ``on``: the seed's policy (1 P without prefix cache, D's retained KV pulled);
- ``ours``: our best so far (2 P with prefix caching, the index picks P, pull
  or recompute with the advisor's threshold);
- ``cond``: ``ours`` plus the decode-alone rule
  (:class:`connector.decode_alone.DecodeAloneRule`, its defaults; D's load is
  its queue and running requests).

Beside TTFT, D's step time (mean and 99th percentile over every step D ran):
what D computes alone lands in its decode steps, i.e. in the inter-token
latency of the requests it is decoding.  :func:`cond_sweep` also runs ``cond``
over several ``max_tokens`` to show where the rule's default sits.
"""

from __future__ import annotations

from collections.abc import Sequence

import msgspec
import numpy as np

from bench.sim.pd import (
    GLM5_FP8,
    QWEN3_32B,
    SEED_CLIENTS,
    SEED_TURNS,
    BenchClients,
    PDModel,
    SeedCurves,
    TurnStructure,
    _plot_ttft,
    calibrate_bench,
    run_benchmark,
)
from connector.advisor import ModelKV, TransferCost, advise
from connector.decode_alone import DecodeAloneRule

__all__ = ["CondPoint", "CondResult", "ThresholdRow", "cond_sweep", "cond_table", "plot_cond"]

#: KV shapes for the advisor (as bench.sim.pd assumes them).
KV_SHAPES = {QWEN3_32B.name: ModelKV(name=QWEN3_32B.name, layers=64, kv_heads=8, head_dim=128),
             GLM5_FP8.name: ModelKV(name=GLM5_FP8.name, layers=78, latent_dim=576, dtype_bytes=1.0)}
#: Contexts of the seed's sweep per model (its published curves run 2k-24k and 2k-20k).
SWEEP = {QWEN3_32B.name: tuple(range(2000, 24001, 2000)), GLM5_FP8.name: tuple(range(2000, 20001, 2000))}


class Measure(msgspec.Struct, frozen=True):
    """One run: mean TTFT (s), share of requests served by D alone, D's step time mean, p99 and max (s)."""

    ttft: float
    alone: float
    d_step: float
    d_step_p99: float
    d_step_max: float


class CondPoint(msgspec.Struct, frozen=True):
    """One model and context: the three policies."""

    model: str
    prefix: int
    requests: int
    on: Measure
    ours: Measure
    cond: Measure


class ThresholdRow(msgspec.Struct, frozen=True):
    """``cond`` with one ``max_tokens`` at one context."""

    model: str
    prefix: int
    max_tokens: int
    measure: Measure


class CondResult(msgspec.Struct, frozen=True):
    rule: DecodeAloneRule
    models: dict[str, PDModel]
    ours_threshold: dict[str, int]
    points: list[CondPoint]
    thresholds: list[ThresholdRow] = []


def measure(model: PDModel, policy: str, prefix: int, threshold: int, rule: DecodeAloneRule | None,
            **kw) -> tuple[int, Measure]:
    """(requests, :class:`Measure`) of one benchmark run."""
    trace: dict = {}
    recs = run_benchmark(model, policy, prefix, threshold=threshold, decode_alone=rule, trace=trace, **kw)
    steps = np.array([e - s for s, e in trace["steps"]["d0"]])
    return len(recs), Measure(sum(r.ttft for r in recs) / len(recs),
                              sum(r.action == "decode_only" for r in recs) / len(recs),
                              float(steps.mean()), float(np.percentile(steps, 99)), float(steps.max()))


def _ours_threshold(curves: SeedCurves, m: PDModel, block_size: int) -> int:
    adv = advise(KV_SHAPES[curves.name], m.alpha, TransferCost(latency_s=m.latency, bytes_per_s=m.bandwidth),
                 block_size=block_size)
    return adv.recommended_threshold if adv.recommended_threshold is not None else 64


def cond_sweep(*, rule: DecodeAloneRule = DecodeAloneRule(), contexts: dict[str, Sequence[int]] | None = None,
               clients: BenchClients = SEED_CLIENTS, structure: TurnStructure = SEED_TURNS, block_size: int = 16,
               rtol: float = 1e-5, thresholds: Sequence[int] = (), threshold_contexts: Sequence[int] = ()) -> CondResult:
    """Calibrate both models on their off curves, run on / ours / cond at ``contexts`` (default: the seed's
    sweep, :data:`SWEEP`), and ``cond`` for Qwen3-32B with each of ``thresholds`` at ``threshold_contexts``."""
    contexts = contexts or SWEEP
    kw = dict(structure=structure, clients=clients, block_size=block_size)
    models: dict[str, PDModel] = {}
    ours_t: dict[str, int] = {}
    points = []
    for cur in (QWEN3_32B, GLM5_FP8):
        m = models[cur.name] = calibrate_bench(cur, **kw, rtol=rtol)
        t = ours_t[cur.name] = _ours_threshold(cur, m, block_size)
        for x in contexts.get(cur.name, ()):
            n, on = measure(m, "on", x, 64, None, **kw)
            _, ours = measure(m, "ours", x, t, None, **kw)
            _, cond = measure(m, "ours", x, t, rule, **kw)
            points.append(CondPoint(cur.name, x, n, on, ours, cond))
    rows = []
    q = models[QWEN3_32B.name]
    for x in threshold_contexts:
        for mt in thresholds:
            r = msgspec.structs.replace(rule, max_tokens=mt)
            rows.append(ThresholdRow(QWEN3_32B.name, x, mt, measure(q, "ours", x, ours_t[QWEN3_32B.name], r, **kw)[1]))
    return CondResult(rule, models, ours_t, points, rows)


def cond_table(res: CondResult) -> str:
    """Markdown: the three policies per model and context, then the threshold sweep."""
    r = res.rule
    lines = [
        f"Rule: D alone when it would prefill at most {r.max_tokens} tokens, D's queue <= {r.max_waiting:g}, "
        f"KV usage < {r.max_kv_usage:g}. ours: 2 P with prefix caching, recompute threshold "
        + ", ".join(f"{t} ({n})" for n, t in res.ours_threshold.items()) + ".",
        "",
        "| model | prefix | requests | on ms | ours ms | cond ms | cond / on | cond / ours | cond: D alone | "
        "D step mean ms ours / cond | D step max ms ours / cond |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for p in res.points:
        lines.append(
            f"| {p.model} | {p.prefix:,} | {p.requests} | {p.on.ttft * 1e3:.0f} | {p.ours.ttft * 1e3:.0f} | "
            f"{p.cond.ttft * 1e3:.0f} | {p.cond.ttft / p.on.ttft:.2f} | {p.cond.ttft / p.ours.ttft:.2f} | "
            f"{p.cond.alone:.0%} | {p.ours.d_step * 1e3:.2f} / {p.cond.d_step * 1e3:.2f} | "
            f"{p.ours.d_step_max * 1e3:.0f} / {p.cond.d_step_max * 1e3:.0f} |")
    if res.thresholds:
        lines += ["", "Threshold sweep (Qwen3-32B, cond with max_tokens = T):", "",
                  "| prefix | T | mean TTFT ms | D alone | D step mean ms | D step p99 ms | D step max ms |",
                  "|---|---|---|---|---|---|---|"]
        for row in res.thresholds:
            m = row.measure
            lines.append(f"| {row.prefix:,} | {row.max_tokens:,} | {m.ttft * 1e3:.0f} | {m.alone:.0%} | "
                         f"{m.d_step * 1e3:.2f} | {m.d_step_p99 * 1e3:.1f} | {m.d_step_max * 1e3:.0f} |")
    return "\n".join(lines)


def plot_cond(res: CondResult, path) -> None:
    """Qwen3-32B's mean TTFT per prefix: on, ours, cond, and the seed's points."""
    pts = [p for p in res.points if p.model == QWEN3_32B.name]
    _plot_ttft(path, [p.prefix for p in pts],
               [([p.on.ttft for p in pts], "on: the seed's policy (1 P, predicted)"),
                ([p.ours.ttft for p in pts], "ours: 2 P with prefix cache + index"),
                ([p.cond.ttft for p in pts], f"cond: ours + D alone below {res.rule.max_tokens} tokens")],
               (QWEN3_32B.off, QWEN3_32B.on), "conversation prefix tokens (mean TTFT over the benchmark's requests)",
               "Seed 000: Qwen3-32B, conditional disaggregation")

