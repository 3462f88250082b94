"""Run the simulator's sweeps: ``python -m bench.sim [--quick] [--section 2,3,4,m]``.

Section 2 (seed 002): every scheduler of :data:`bench.sim.schedulers.SCHEDULERS`
on both seed-002 workloads, in one process, the same requests for each
(``dynamo`` is NVIDIA Dynamo's own selector, ai-dynamo-runtime 1.6.1).
Section m: the same requests as a Mooncake trace through Dynamo's mocker
(:mod:`bench.sim.mocker`), beside section 2's random and dynamo rows.
Section 3 (seed 000): the 1P1D bidirectional-transfer TTFT curve
(:mod:`bench.sim.pd`).  Section 4 (seed 000): the seed's policy, ours and ours
with conditional disaggregation, both models (:mod:`bench.sim.pd_cond`).
Prints markdown tables and writes ``bench/out/sim_seed002.{json,md}``,
``sim_seed002_<workload>.png``, ``sim_seed000.{json,md,png}``,
``sim_seed000_cond.{json,md,png}``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import sys
import time
from pathlib import Path

import msgspec

from bench.sim import pd, pd_cond
from bench.sim.cluster import RunOptions, RunResult, run
from bench.sim.mocker import cross_check, cross_table
from bench.sim.schedulers import SCHEDULERS
from bench.sim.workload import SEED002_37, SEED002_73, quick

#: Seed 002's published table (llm-d precise prefix-cache benchmark; 73 % workload):
#: output tok/s, TTFT p90 s, TTFT mean s, waiting queue mean.
PUBLISHED = {
    "precise": (8730.0, 0.542, 0.298, 0.1),
    "approximate": (6944.4, 31.083, 13.316, 8.1),
    "load": (4428.7, 94.865, 46.987, 28.9),
    "random": (4428.7, 92.551, 45.281, 27.3),
}


def _ratios(r: RunResult, ref: RunResult | None) -> tuple[str, str]:
    top = r.stages[-1].ttft_p90
    rp = f"{top / ref.stages[-1].ttft_p90:.3f}" if ref and ref.stages[-1].ttft_p90 > 0 else "-"
    rt = f"{r.output_tok_s / ref.output_tok_s:.2f}" if ref and ref.output_tok_s > 0 else "-"
    return rp, rt


def table(results: list[RunResult]) -> str:
    """Markdown table of one workload's runs, with ratios against ``precise`` and the real Dynamo selector."""
    ref = next((r for r in results if r.scheduler == "precise"), None)
    dyn = next((r for r in results if r.scheduler == "dynamo"), None)
    lines = [
        "| scheduler | output tok/s | TTFT p90 s | TTFT mean s | TTFT p90 at top QPS s | waiting mean | hit rate | "
        "preemptions | p90 top / precise | tok/s / precise | p90 top / dynamo | tok/s / dynamo |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        rp, rt = _ratios(r, ref)
        dp, dt = _ratios(r, dyn)
        lines.append(
            f"| {r.scheduler} | {r.output_tok_s:,.0f} | {r.ttft_p90:.3f} | {r.ttft_mean:.3f} | {r.stages[-1].ttft_p90:.3f} | "
            f"{r.waiting_mean:.1f} | {r.hit_rate:.3f} | {r.preemptions} | {rp} | {rt} | {dp} | {dt} |"
        )
    return "\n".join(lines)


def published_table() -> str:
    lines = ["| scheduler | output tok/s | TTFT p90 s | TTFT mean s | waiting mean |", "|---|---|---|---|---|"]
    for k, (a, b, c, d) in PUBLISHED.items():
        lines.append(f"| {k} | {a:,.1f} | {b:.3f} | {c:.3f} | {d:.1f} |")
    return "\n".join(lines)


def plot(results: list[RunResult], path: Path, title: str) -> None:
    """Per-QPS TTFT p90 and mean (log scale), one line per scheduler."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    for r in results:
        qps = [s.qps for s in r.stages]
        axes[0].plot(qps, [max(s.ttft_p90, 1e-3) for s in r.stages], marker="o", label=r.scheduler)
        axes[1].plot(qps, [max(s.ttft_mean, 1e-3) for s in r.stages], marker="o", label=r.scheduler)
    for ax, what in zip(axes, ("TTFT p90 (s)", "TTFT mean (s)")):
        ax.set_yscale("log")
        ax.set_xlabel("offered load (QPS), requests by arrival stage")
        ax.set_ylabel(what)
        ax.grid(True, which="both", alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.sim", description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="scaled-down workloads (seconds; used by the tests)")
    ap.add_argument("--section", default="2,3,4,m",
                    help="which sections: 2 (seed 002 table), 3 (seed 000 curve), 4 (seed 000, conditional "
                         "disaggregation), m (Dynamo's mocker on section 2's trace; needs 2)")
    ap.add_argument("--workloads", default="73,37", help="seed-002 workloads: 73, 37")
    ap.add_argument("--schedulers", default=",".join(SCHEDULERS))
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--transport", default="inproc", choices=("inproc", "zmq"))
    ap.add_argument("--event-delay", type=float, default=0.005, help="seconds from a step's end to the router")
    ap.add_argument("--out", default="bench/out")
    ap.add_argument("--no-plot", action="store_true")
    args = ap.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    sections = {s.strip() for s in args.section.split(",")}
    stamp = {
        "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "machine": f"{platform.machine()}, {platform.processor() or 'cpu'}, python {platform.python_version()}",
        "quick": args.quick,
        "seed": args.seed,
    }
    suffix = "_quick" if args.quick else ""
    if "2" in sections:
        opts = RunOptions(transport=args.transport, event_delay=args.event_delay)
        report: dict = {"meta": stamp, "published": PUBLISHED, "workloads": {}}
        md = [f"# Seed 002 in the simulator ({stamp['date']}, seed {args.seed}{', quick' if args.quick else ''})", ""]
        md += ["Published (llm-d, 8 x 2 H100, Qwen3-32B, 73 % workload):", "", published_table(), ""]
        for wname in args.workloads.split(","):
            w = {"73": SEED002_73, "37": SEED002_37}[wname.strip()]
            if args.quick:
                w = quick(w)
            results = []
            for s in args.schedulers.split(","):
                t0 = time.perf_counter()
                r = run(w, s.strip(), seed=args.seed, options=opts)
                print(f"{w.name:18s} {r.scheduler:18s} {r.output_tok_s:9,.0f} tok/s  TTFT p90 {r.ttft_p90:8.3f} s  "
                      f"mean {r.ttft_mean:8.3f} s  hit {r.hit_rate:.3f}  ({time.perf_counter() - t0:.1f} s)",
                      file=sys.stderr, flush=True)
                results.append(r)
            md += [f"## {w.name}: {w.pods} pods x {w.capacity_tokens:,} KV tokens, {w.customers} x "
                   f"{w.users_per_customer} users, {w.shared_tokens:,} + {w.question_tokens:,} in, "
                   f"{w.output_tokens:,} out, QPS {list(w.qps_stages)} x {w.stage_seconds:g} s "
                   f"(resident {w.resident_fraction:.0%})", "", table(results), ""]
            report["workloads"][w.name] = {"workload": msgspec.to_builtins(w),
                                           "runs": [msgspec.to_builtins(r) for r in results]}
            if "m" in sections:  # Dynamo's mocker on the same requests, beside our random and dynamo rows
                t0 = time.perf_counter()
                cc = cross_check(w, args.seed, opts, ours={r.scheduler: r for r in results})
                print(f"{w.name:18s} mocker cross-check ({time.perf_counter() - t0:.1f} s)", file=sys.stderr, flush=True)
                md += [f"### {w.name}: Dynamo's mocker on the same trace", "", cross_table(cc), ""]
                report["workloads"][w.name]["mocker"] = msgspec.to_builtins(cc)
            if not args.no_plot:
                plot(results, out / f"sim_seed002_{w.name}.png", f"{w.name}: TTFT per offered load")
        (out / f"sim_seed002{suffix}.json").write_text(json.dumps(report, indent=1))
        (out / f"sim_seed002{suffix}.md").write_text("\n".join(md) + "\n")
        print("\n".join(md))
    if "3" in sections:
        if args.quick:  # the unfitted prediction (the seed's benchmark clients), three points, off fit to 1e-3
            res = pd.sweep(structure=pd.SEED_TURNS, contexts=(2000, 12000, 24000))
            fits: list[pd.CrossFit] = []
            bench = pd.bench_sweep(contexts=(2000, 12000, 24000), link_variant=False, rtol=1e-3)
        else:  # the seed's published conversations; the fitted share, honestly: fit one model, predict the other
            res = pd.sweep(structure=pd.SEED_TURNS)
            fits = pd.cross_fit()
            bench = pd.bench_sweep()  # the same conversations with the seed's benchmark clients (2 at once)
        doc = {"sweep": msgspec.to_builtins(res), "cross_fit": msgspec.to_builtins(fits),
               "benchmark": msgspec.to_builtins(bench)}
        (out / f"sim_seed000{suffix}.json").write_text(json.dumps(doc, indent=1))
        text = pd.table(res)
        if fits:
            text += "\n\nShare of new tokens per turn fitted on one model's on points, the other's predicted:\n\n"
            text += "| fitted on | share | own errors | predicted | prediction errors |\n|---|---|---|---|---|\n"
            text += "\n".join(
                f"| {c.fitted_on} | {c.new_fraction:.1%} | "
                + ", ".join(f"{e:+.1%} at {L:,}" for L, e in sorted(c.own_error.items()))
                + f" | {c.predicted} | "
                + ", ".join(f"{e:+.1%} at {L:,}" for L, e in sorted(c.predicted_error.items())) + " |"
                for c in fits)
        if bench is not None:
            text += "\n\nThe seed's benchmark clients, queueing on P and D in the model (off fit with it):\n\n"
            text += pd.bench_table(bench)
        (out / f"sim_seed000{suffix}.md").write_text(f"# Seed 000 in the simulator ({stamp['date']})\n\n{text}\n")
        if not args.no_plot:
            pd.plot(res, out / f"sim_seed000{suffix}.png")
            if bench is not None:
                pd.plot_bench(bench, out / f"sim_seed000_bench{suffix}.png")
        print(text)
    if "4" in sections:
        if args.quick:
            cres = pd_cond.cond_sweep(contexts={name: (2000, 12000) for name in pd_cond.SWEEP}, rtol=1e-3)
        else:
            cres = pd_cond.cond_sweep(thresholds=(128, 256, 512, 1024, 2048, 4096, 8192),
                                      threshold_contexts=(2000, 6000, 12000, 24000))
        (out / f"sim_seed000_cond{suffix}.json").write_text(json.dumps(msgspec.to_builtins(cres), indent=1))
        text = pd_cond.cond_table(cres)
        (out / f"sim_seed000_cond{suffix}.md").write_text(
            f"# Seed 000, conditional disaggregation ({stamp['date']}, {stamp['machine']})\n\n{text}\n")
        if not args.no_plot:
            pd_cond.plot_cond(cres, out / f"sim_seed000_cond{suffix}.png")
        print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
