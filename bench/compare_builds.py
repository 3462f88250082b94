"""The compiled backend of this tree against another build of it, side by side in one run (plain models).

Each round runs one fresh process per build, alternating (baseline, this
tree), each measuring with the compiled index (``backend: native``):

- score: ``Indexer.score()`` of an 8,192-token prompt (block size 16) over 8
  pods holding 1/8 .. 8/8 of it, beside ``--entries`` other entries; median
  microseconds of ``--reps`` calls;
- ingest: vLLM msgpack batches of one 8-block BlockStored each, decoded and
  applied as the pool does (``decode_vllm_batch`` + ``apply_events``), blocks
  per CPU second; once without ``group_idx`` (vLLM before the field) and once
  with ``group_idx`` 0 and kind ``full_attention`` (a plain model on a vLLM
  that sends them);
- memory (``--memory-entries``, 0 = skip): RSS delta per (block, pod) of
  that many entries over 8 pods.

The baseline is a source tree with its compiled core built in place, e.g.
``git archive <rev> | tar -x -C DIR`` plus a copy of that revision's
``kvindex/_native*.so``.  Prints medians over rounds and the ratios this
tree / baseline; timings live here, never in tests.
Run: ``taskset -c 1 python bench/compare_builds.py --baseline DIR``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

CHILD = r"""
import json, os, random, sys, time
root = {root!r}
if {other}:  # import kvindex from `root`, not through this tree's editable install
    sys.meta_path[:] = [f for f in sys.meta_path if "ScikitBuild" not in type(f).__name__]
sys.path[:] = [root] + [p for p in sys.path if p not in ("", ".")]
import msgspec
import numpy as np
from kvindex.facade import Config, Indexer
from kvevents.events import AllBlocksCleared, BlockRemoved, BlockStored
from kvevents.wire import decode_vllm_batch
import kvindex
assert kvindex.__file__.startswith(root), kvindex.__file__
KINDS = (BlockStored, BlockRemoved, AllBlocksCleared)
BS = 16

def indexer(size):
    return Indexer(Config.from_dict({{"token_processor_config": {{"block_size": BS}},
        "kv_block_index_config": {{"backend": "native", "in_memory_config": {{"size": size}}}}}}))

def rss():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")

out = {{}}
rng = random.Random(5)
if {memory_entries}:
    base = rss()
    ix = indexer({memory_entries} + 10).index
    toks = np.random.default_rng(1).integers(1, 50000, size=256 * BS).tolist()
    stored, p = 0, 0
    while stored < {memory_entries}:
        n = min(256, {memory_entries} - stored)
        eks = [rng.getrandbits(64) for _ in range(n)]
        parent = None
        for i in range(0, n, 64):
            j = min(n, i + 64)
            toks[0] = stored + i
            ix.block_stored("pod-%d" % p, 0, eks[i:j], parent, toks[i * BS : j * BS], "gpu", block_size=BS)
            parent = eks[j - 1]
        stored += n
        p = (p + 1) % 8
    out["memory_bytes_per_entry"] = (rss() - base) / {memory_entries}
    del ix

# score: 8 pods holding 1/8 .. 8/8 of an 8,192-token prompt, beside other entries
ix = indexer({entries} + 10_000)
prompt = [rng.randrange(1, 50_000) for _ in range(8192)]
keys = ix.token_processor.request_keys(prompt)
for p in range(8):
    n = len(keys) * (p + 1) // 8
    ix.index.block_stored("pod-%d" % p, 0, [int(k) ^ 0x5A5A for k in keys[:n]], None, prompt[: n * BS], "gpu",
                          block_size=BS)
filled = 0
while filled < {entries}:
    toks = [rng.randrange(1, 50_000) for _ in range(64 * BS)]
    ix.index.block_stored("pod-%d" % (filled % 8), 0, [rng.getrandbits(64) for _ in range(64)], None, toks, "gpu",
                          block_size=BS)
    filled += 64
pods = ["pod-%d" % p for p in range(8)]
for _ in range(20):
    ix.score(prompt, pods)
ts = []
for _ in range({reps}):
    t0 = time.perf_counter()
    ix.score(prompt, pods)
    ts.append(time.perf_counter() - t0)
ts.sort()
out["score_8k_us"] = ts[len(ts) // 2] * 1e6

# ingest: decode + apply_events of one 8-block store per batch
group0 = {{"group_idx": 0, "kv_cache_spec_kind": "full_attention"}}
for label, extra in (("ingest_plain", {{}}), ("ingest_group0", group0)):
    payloads = []
    parent = None
    for i in range({events}):
        hs = [rng.getrandbits(63) for _ in range(8)]
        ev = {{"type": "BlockStored", "block_hashes": hs, "parent_block_hash": parent,
              "token_ids": [rng.randrange(30_000) for _ in range(8 * BS)], "block_size": BS, "medium": "GPU",
              "lora_id": None, "lora_name": None, **extra}}
        parent = hs[-1] if i % 16 else None
        payloads.append(msgspec.msgpack.encode([time.time(), [ev], 0]))
    best = 0.0
    for _ in range(3):
        index = indexer({events} * 8 + 10).index
        c0 = time.process_time()
        for pl in payloads:
            b = decode_vllm_batch(pl)
            index.apply_events("pod-0", 0, b.events, model=None, kinds=KINDS)
        best = max(best, {events} * 8 / (time.process_time() - c0))
        assert index.stats().entries == {events} * 8, index.stats()
    out[label] = best
print(json.dumps(out))
"""

METRICS = (("score_8k_us", "score(), 8,192 tokens, 8 pods, median us", False),
           ("ingest_plain", "ingest, no group_idx, blocks per CPU s (best of 3)", True),
           ("ingest_group0", "ingest, group_idx 0 full attention, blocks per CPU s", True),
           ("memory_bytes_per_entry", "memory per (block, pod), RSS delta, bytes", False))


def run(root: Path, args: argparse.Namespace) -> dict[str, float]:
    code = CHILD.format(root=str(root), other=root != ROOT, entries=args.entries, reps=args.reps, events=args.events,
                        memory_entries=args.memory_entries)
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=7200, cwd="/")
    if r.returncode:
        raise RuntimeError(f"child for {root} failed: {r.stderr[-3000:]}")
    return json.loads(r.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--baseline", required=True, type=Path, help="a source tree with its compiled core built in place")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--entries", type=int, default=200_000)
    ap.add_argument("--reps", type=int, default=300)
    ap.add_argument("--events", type=int, default=10_000)
    ap.add_argument("--memory-entries", type=int, default=0)
    args = ap.parse_args(argv)
    res: dict[str, list[dict[str, float]]] = {"baseline": [], "this": []}
    for i in range(args.rounds):
        for name, root in (("baseline", args.baseline.resolve()), ("this", ROOT)):
            res[name].append(run(root, args))
            print(f"round {i + 1} {name}: {res[name][-1]}", flush=True)
    print(f"{'what (median of rounds; best of rounds)':<58} {'baseline':>12} {'this tree':>12} {'ratio':>7}"
          f" {'best: baseline':>15} {'this tree':>12} {'ratio':>7}")
    for key, label, higher in METRICS:
        if key not in res["this"][0]:
            continue
        a = statistics.median(r[key] for r in res["baseline"])
        b = statistics.median(r[key] for r in res["this"])
        best = max if higher else min
        c = best(r[key] for r in res["baseline"])
        d = best(r[key] for r in res["this"])
        print(f"{label:<58} {a:>12,.1f} {b:>12,.1f} {b / a:>7.3f} {c:>15,.1f} {d:>12,.1f} {d / c:>7.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
