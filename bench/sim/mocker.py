"""Cross-check of the simulator against NVIDIA Dynamo's own (its mocker), on the same requests.

A seed-002 workload becomes a Mooncake trace (one JSON line per request:
``timestamp`` ms, ``input_length``, ``output_length``, ``hash_ids``: one id
per prompt block of ``block_size`` tokens, equal ids for equal prefixes, the
last partial block included), the very requests :func:`bench.sim.cluster.run`
simulates for the same seed.  ``dynamo._core.run_mocker_trace_replay``
(ai-dynamo-runtime 1.6.1) replays it through Dynamo's engine simulator with
its ``round_robin`` router and with its ``kv_router``; our simulator runs the
same requests with ``random`` and with Dynamo's real selector
(:class:`bench.sim.dynamo_peer.DynamoSelector`).  The comparison is of
ratios within each simulator (KV-aware / KV-blind), since the two engine
timing models differ.

Engine settings given to the mocker (``extra_engine_args={"engine": ...}``):
the pods' block size, KV blocks, ``max_num_seqs`` and
``max_num_batched_tokens``, prefix caching on; its KV events reach its router
``kv_event_lag_ms`` late (our ``event_delay``).
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

import msgspec

from bench.sim.cluster import RunOptions, RunResult
from bench.sim.workload import Workload, build_requests

__all__ = ["CrossCheck", "MockerResult", "cross_check", "cross_table", "replay", "trace_records"]

os.environ.setdefault("DYN_LOG", "error")

try:
    from dynamo._core import run_mocker_trace_replay
except ImportError:  # pragma: no cover - ai-dynamo-runtime not installed
    run_mocker_trace_replay = None


class MockerResult(msgspec.Struct, frozen=True, kw_only=True):
    """One replay's summary (Dynamo's names in comments): TTFT p90 / mean in
    seconds (p90_ttft_ms, mean_ttft_ms), output tok/s
    (output_throughput_tok_s), reuse (prefix_cache_reused_ratio), first
    admission reuse (first_admission_prefix_cache_reused_ratio), simulated
    duration s (duration_ms), requests completed."""

    router_mode: str
    ttft_p90: float
    ttft_mean: float
    output_tok_s: float
    reuse: float
    first_reuse: float
    duration: float
    completed: int


class CrossCheck(msgspec.Struct, frozen=True, kw_only=True):
    """Dynamo's mocker (round_robin, kv_router; ``mocker`` with its own engine speed,
    ``mocker_matched`` with its prefill slowed to ours, ``timing`` the knobs) beside our
    simulator (random, dynamo) on one trace."""

    workload: str
    seed: int
    requests: int
    mocker: dict[str, MockerResult]
    mocker_matched: dict[str, MockerResult]
    timing: dict[str, float]
    ours: dict[str, RunResult]


def trace_records(workload: Workload, seed: int, block_size: int) -> list[dict]:
    """The run's requests (:func:`build_requests`) as Mooncake records."""
    ids: dict[object, int] = {}
    out = []
    for r in build_requests(workload, seed, block_size):
        full = len(r.prompt) // block_size
        hids = [ids.setdefault(h, len(ids)) for h in r.hashes[:full]]
        if len(r.prompt) % block_size:  # the partial last block: the same prompt gives the same id
            hids.append(ids.setdefault(("tail", r.hashes[full - 1] if full else r.group, len(r.prompt)), len(ids)))
        out.append({"timestamp": round(r.arrival * 1000.0, 3), "input_length": len(r.prompt),
                    "output_length": r.out_len, "hash_ids": hids})
    return out


def engine_args(workload: Workload, options: RunOptions, timing: dict | None = None) -> dict:
    """The mocker engine's settings for the workload's pods; ``timing``: its speed knobs
    (``speedup_ratio``, ``decode_speedup_ratio``), its defaults when None."""
    return {"engine": {"block_size": options.block_size,
                       "num_gpu_blocks": workload.capacity_tokens // options.block_size,
                       "max_num_seqs": options.max_num_seqs,
                       "max_num_batched_tokens": options.max_num_batched_tokens,
                       "enable_prefix_caching": True, **(timing or {})}}


def _write(path: Path, records: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def matched_timing(workload: Workload, options: RunOptions | None = None) -> dict:
    """Mocker speed knobs that give its engine our cold prefill time for the workload's prompt
    (``speedup_ratio`` = its time / ours, from a probe of 3 lone requests) while keeping its own
    decode speed (``decode_speedup_ratio`` = 1 / speedup_ratio: it multiplies, measured)."""
    opt = options or RunOptions()
    n = workload.shared_tokens + workload.question_tokens
    blocks = -(-n // opt.block_size)
    probe = [{"timestamp": i * 100_000, "input_length": n, "output_length": 2,
              "hash_ids": list(range(i * blocks, (i + 1) * blocks))} for i in range(3)]
    with tempfile.TemporaryDirectory() as d:
        res = run_mocker_trace_replay([str(_write(Path(d) / "probe.jsonl", probe))],
                                      extra_engine_args=engine_args(workload, opt), num_workers=1,
                                      router_mode="round_robin", trace_block_size=opt.block_size)
    ours = opt.cost.prefill_time(n)
    ratio = res.summary["mean_ttft_ms"] / 1000.0 / ours
    return {"speedup_ratio": ratio, "decode_speedup_ratio": 1.0 / ratio}


def replay(trace: Path, workload: Workload, router_mode: str, options: RunOptions | None = None,
           timing: dict | None = None) -> MockerResult:
    """Replay ``trace`` through Dynamo's mocker with ``router_mode`` ("round_robin" or "kv_router")."""
    if run_mocker_trace_replay is None:
        raise RuntimeError("the mocker needs ai-dynamo-runtime: pip install --no-deps ai-dynamo-runtime==1.6.1")
    opt = options or RunOptions()
    lag = opt.event_delay * 1000.0 if router_mode == "kv_router" else None
    res = run_mocker_trace_replay([str(trace)], extra_engine_args=engine_args(workload, opt, timing),
                                  num_workers=workload.pods, router_mode=router_mode,
                                  trace_block_size=opt.block_size, kv_event_lag_ms=lag)
    s = res.summary
    return MockerResult(router_mode=router_mode, ttft_p90=s["p90_ttft_ms"] / 1000.0,
                        ttft_mean=s["mean_ttft_ms"] / 1000.0, output_tok_s=s["output_throughput_tok_s"],
                        reuse=s["prefix_cache_reused_ratio"],
                        first_reuse=s["first_admission_prefix_cache_reused_ratio"],
                        duration=s["duration_ms"] / 1000.0, completed=int(s["completed_requests"]))


def cross_check(workload: Workload, seed: int = 1, options: RunOptions | None = None,
                ours: dict[str, RunResult] | None = None) -> CrossCheck:
    """The mocker's two routers and our simulator's ``random`` and ``dynamo`` on the same requests;
    ``ours``: runs already made (same workload, seed and options), else they are run here."""
    from bench.sim.cluster import run

    opt = options or RunOptions()
    recs = trace_records(workload, seed, opt.block_size)
    timing = matched_timing(workload, opt)
    modes = ("round_robin", "kv_router")
    with tempfile.TemporaryDirectory() as d:
        path = _write(Path(d) / "trace.jsonl", recs)
        mock = {m: replay(path, workload, m, opt) for m in modes}
        matched = {m: replay(path, workload, m, opt, timing) for m in modes}
    have = dict(ours or {})
    for s in ("random", "dynamo"):
        if s not in have:
            have[s] = run(workload, s, seed=seed, options=opt)
    return CrossCheck(workload=workload.name, seed=seed, requests=len(recs), mocker=mock, mocker_matched=matched,
                      timing=timing, ours={s: have[s] for s in ("random", "dynamo")})


def cross_table(cc: CrossCheck) -> str:
    """Markdown: the six rows, then the KV-aware / KV-blind ratio in each simulator."""
    def row(name, r):
        if isinstance(r, MockerResult):
            return name, r.output_tok_s, r.ttft_p90, r.ttft_mean, r.reuse, r.first_reuse
        return name, r.output_tok_s, r.ttft_p90, r.ttft_mean, r.hit_rate, r.first_hit_rate

    sp = cc.timing["speedup_ratio"]
    pairs = [
        ("Dynamo mocker", row("Dynamo mocker, kv_router", cc.mocker["kv_router"]),
         row("Dynamo mocker, round_robin", cc.mocker["round_robin"])),
        (f"Dynamo mocker, our prefill speed (x{sp:.2f})",
         row(f"Dynamo mocker x{sp:.2f}, kv_router", cc.mocker_matched["kv_router"]),
         row(f"Dynamo mocker x{sp:.2f}, round_robin", cc.mocker_matched["round_robin"])),
        ("ours", row("ours, Dynamo's selector", cc.ours["dynamo"]), row("ours, random", cc.ours["random"])),
    ]
    lines = ["| simulator, router | output tok/s | TTFT p90 s | TTFT mean s | reuse | reuse at first admission |",
             "|---|---|---|---|---|---|"]
    for _, a, b in pairs:
        lines += [f"| {n} | {t:,.0f} | {p:.3f} | {m:.3f} | {r:.3f} | {f:.3f} |" for n, t, p, m, r, f in (b, a)]
    lines += ["", "| KV-aware / KV-blind | TTFT p90 | TTFT mean | output tok/s | reuse | reuse at first admission |",
              "|---|---|---|---|---|---|"]
    for name, a, b in pairs:
        lines.append(f"| {name} | {a[2] / b[2]:.3f} | {a[3] / b[3]:.3f} | {a[1] / b[1]:.2f} | "
                     f"{a[4] / b[4]:.2f} | {a[5] / b[5]:.2f} |")
    return "\n".join(lines)
