"""Where an EventPool shard's time per message goes: frames -> stream -> sequencer -> apply.

Takes pre-encoded vLLM messages of bench_dynamo's two event shapes and, on
this thread, times each step of a shard's message handling over all of them
(CPU time per message): routing (topic -> pod, model), decoding (seq frame
and payload), the stream lookup, the sequencer (``Sequencer.live``), the
index's batch apply, and the whole handler (``_Shard._on_message``) on a
fresh pool; the executor's own work (performing the actions, the counters)
is the whole minus the steps.  Each step's objects stay alive until the
next, as in a queue that is behind.  Then cProfile's top functions by own
time (inflated by the profiler's per-call cost; for where, not how much).
Run pinned: ``taskset -c 1 python bench/profile_pool.py [--no-fast] [--shape decode]``.
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

import bench_dynamo as bd  # noqa: E402
from kvevents.fastwire import FastBatch  # noqa: E402
from kvevents.messages import _as_batch  # noqa: E402


def split(shape: str, fast: bool, n_blocks: int) -> dict[str, float]:
    """Microseconds per message of each step (see the module docstring)."""
    ours, _ = bd.shape_payloads(shape, n_blocks, [f"pod-{p}" for p in range(8)])
    msgs = bd._messages(ours)
    n = len(msgs)
    out: dict[str, float] = {}

    def timed(name: str, fn):
        t0 = time.process_time()
        r = fn()
        out[name] = (time.process_time() - t0) / n * 1e6
        return r

    pool = bd._pool(bd.make_indexer().index, 1, fast, n + 10)
    sh = pool._shards[0]
    routes = timed("route", lambda: [pool.route(m.source, m.topic) for m in msgs])
    decs = timed("decode", lambda: [sh._decode("vllm", m.seq, m.payload) for m in msgs])
    sts = timed("stream", lambda: [sh._stream(p, mo, 0, m.source) for (p, mo), m in zip(routes, msgs)])
    timed("sequencer", lambda: [st.seq.live(_as_batch(seq, b)) for st, (seq, b) in zip(sts, decs)])
    ix = pool.index

    def apply() -> None:
        for (pod, _), (_, b) in zip(routes, decs):
            if type(b) is FastBatch:
                ix.apply_raw(pod, 0, b.raw, b.slow_events, model="m", kinds=bd.EVENT_KINDS)
            else:
                ix.apply_events(pod, 0, b.events, model="m", kinds=bd.EVENT_KINDS)

    timed("index apply", apply)
    pool = bd._pool(bd.make_indexer().index, 1, fast, n + 10)
    sh = pool._shards[0]
    timed("whole handler", lambda: [sh._on_message(m) for m in msgs])
    out["executor and counters"] = out["whole handler"] - sum(
        out[k] for k in ("route", "decode", "stream", "sequencer", "index apply"))
    return out


def top(shape: str, fast: bool, n_blocks: int, k: int = 10) -> str:
    ours, _ = bd.shape_payloads(shape, n_blocks, [f"pod-{p}" for p in range(8)])
    msgs = bd._messages(ours)
    pool = bd._pool(bd.make_indexer().index, 1, fast, len(msgs) + 10)
    sh = pool._shards[0]
    prof = cProfile.Profile()
    prof.enable()
    for m in msgs:
        sh._on_message(m)
    prof.disable()
    stats = pstats.Stats(prof).stats
    per = 1e6 / len(msgs)
    best = sorted(((tt, name) for (_f, _l, name), (_cc, _nc, tt, _ct, _c) in stats.items()), reverse=True)[:k]
    return ", ".join(f"{name} {tt * per:.2f}" for tt, name in best)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", choices=list(bd.SHAPES), action="append")
    ap.add_argument("--fast", action=argparse.BooleanOptionalAction, default=None)
    ap.add_argument("--blocks", type=int, default=80_000)
    ap.add_argument("--runs", type=int, default=3, help="best of (per step)")
    args = ap.parse_args()
    for shape in args.shape or list(bd.SHAPES):
        per_batch, blocks = bd.SHAPES[shape]
        for fast in ([args.fast] if args.fast is not None else [False, True]):
            runs = [split(shape, fast, args.blocks) for _ in range(args.runs)]
            best = {k: min(r[k] for r in runs) for k in runs[0]}
            print(f"{shape} ({per_batch} events x {blocks} blocks per message), "
                  f"{'fast' if fast else 'reference'} decoder, us per message (best of {args.runs}):")
            print("  " + ", ".join(f"{k} {v:.2f}" for k, v in best.items()))
            print("  cProfile own time (us/msg, inflated): " + top(shape, fast, args.blocks // 4))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
