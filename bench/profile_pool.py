"""Where an EventPool shard's time per message goes: frames -> stream -> sequencer -> apply.

Feeds pre-encoded vLLM messages (bench_dynamo's two event shapes) to one
shard's message handler on this thread, under cProfile, and prints the
cumulative microseconds per message of each step: routing (topic -> pod,
model), decoding (seq frame and payload), the stream and its sequencer, the
apply (the index call, and the counting around it).  Run pinned:
``taskset -c 1 python bench/profile_pool.py [--fast/--no-fast] [--shape decode]``.
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

# (label, function name as cProfile names it): the steps of kvevents.shards._Shard._on_message
STEPS = [
    ("whole message (_on_message)", "_on_message"),
    ("  route: topic -> (pod, model)", "route"),
    ("  decode: seq frame + payload", "_decode"),
    ("    fast decoder (msgspec + read_raw_batch)", "decode_fast"),
    ("    reference decoder", "decode_vllm_batch"),
    ("  stream lookup", "_stream"),
    ("  sequencer (Sequencer.live)", "live"),
    ("  executor (_run: apply and count)", "_run"),
    ("    apply, fast (_apply_fast)", "_apply_fast"),
    ("      index.apply_raw", "apply_raw"),
    ("    apply, reference (index.apply_events)", "apply_events"),
    ("    counting (_tally)", "_tally"),
]


def profile(shape: str, fast: bool, n_blocks: int) -> None:
    pods = [f"pod-{p}" for p in range(8)]
    ours, _ = bd.shape_payloads(shape, n_blocks, pods)
    pool = bd._pool(bd.make_indexer().index, 1, fast, len(ours) + 10)
    shard = pool._shards[0]
    msgs = bd._messages(ours)
    warm = len(msgs) // 10
    for m in msgs[:warm]:  # the streams' first batches (the configuration check looks at them)
        shard._on_message(m)
    rest = msgs[warm:]
    t0 = time.process_time()
    for m in rest:
        shard._on_message(m)
    plain = (time.process_time() - t0) / len(rest) * 1e6
    # the same again under the profiler (a fresh pool: same state as above)
    pool = bd._pool(bd.make_indexer().index, 1, fast, len(ours) + 10)
    shard = pool._shards[0]
    for m in msgs[:warm]:
        shard._on_message(m)
    prof = cProfile.Profile()
    prof.enable()
    for m in rest:
        shard._on_message(m)
    prof.disable()
    stats = pstats.Stats(prof).stats  # (file, line, name) -> (cc, nc, tt, ct, callers)
    by_name: dict[str, float] = {}
    for (_f, _l, name), (_cc, _nc, _tt, ct, _callers) in stats.items():
        by_name[name] = by_name.get(name, 0.0) + ct
    per = 1e6 / len(rest)
    per_batch, blocks = bd.SHAPES[shape]
    print(f"{shape} ({per_batch} events x {blocks} blocks per message), {'fast' if fast else 'reference'} decoder: "
          f"{plain:.2f} us per message unprofiled ({plain / (per_batch * blocks):.2f} us per block)")
    for label, name in STEPS:
        if name in by_name:
            print(f"  {label:<46} {by_name[name] * per:8.2f} us (profiled)")
    top = sorted(((tt, name) for (_f, _l, name), (_cc, _nc, tt, _ct, _c) in stats.items()), reverse=True)[:8]
    print("  own time, top functions: " + ", ".join(f"{name} {tt * per:.2f}" for tt, name in top))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", choices=list(bd.SHAPES), action="append")
    ap.add_argument("--fast", action=argparse.BooleanOptionalAction, default=None)
    ap.add_argument("--blocks", type=int, default=80_000)
    args = ap.parse_args()
    for shape in args.shape or list(bd.SHAPES):
        for fast in ([args.fast] if args.fast is not None else [False, True]):
            profile(shape, fast, args.blocks)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
