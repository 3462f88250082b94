"""KV-cache groups on the Redis backend: memory per entry and ingest rate of plain and hybrid streams, as ratios.

Starts its own redis-server per case (tests/redis_server.py; persistence
off) and fills a Redis index through ``apply_events`` (one pod's 4 chained
events of 16 blocks per batch, block size 16, 2 of 8 pods per path) until
``--entries`` (block, pod) entries of the main tables are held, in engine-hash
mode (``vllm_sha256_cbor``, what a hybrid fleet uses) and own-hash mode:

- plain: events without group fields (engines before vLLM's group fields);
- plain + group 0: the same events with ``group_idx`` 0 and kind
  ``full_attention`` (what a plain model's engine sends now);
- hybrid: the plain + group 0 events, each followed by the same blocks'
  store in a sliding-window group 1 (window 32): twice the blocks per batch.

Reports the server's ``used_memory`` growth per main-table entry and per
group entry, and ingest blocks/s; ratios against plain in the same run.
Writes bench/out/redis_groups.json.  Timings live here, never in tests.
Run: ``taskset -c 1 python bench/bench_redis_groups.py [--entries N]``.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from kvevents.events import AllBlocksCleared, BlockRemoved, BlockStored  # noqa: E402
from kvindex.keys import TokenProcessor  # noqa: E402
from kvindex.redis_index import RedisKVBlockIndex  # noqa: E402
from tests.redis_server import RedisServer  # noqa: E402

BS = 16
KINDS = (BlockStored, BlockRemoved, AllBlocksCleared)
PODS = [f"pod-{i}" for i in range(8)]
FULL = {"group_idx": 0, "kv_cache_spec_kind": "full_attention"}
SWA = {"group_idx": 1, "kv_cache_spec_kind": "sliding_window", "kv_cache_spec_sliding_window": 32}


def fill(url: str, compat: bool, case: str, entries: int) -> dict:
    """Fill one index; returns bytes per main entry and per group entry, and blocks/s."""
    tp = TokenProcessor(BS, algorithm="vllm_sha256_cbor" if compat else "xxh3_chain")
    ix = RedisKVBlockIndex(tp, url=url, capacity=4 * entries)
    mem0 = ix.client.info("memory")["used_memory"]
    rnd = random.Random(1)
    n = blocks = 0
    ek = 1
    seconds = 0.0
    while n < entries:
        toks = [rnd.randrange(1, 50_000) for _ in range(64 * BS)]
        keys = tp.request_keys(toks).tolist() if compat else list(range(ek, ek + 64))
        ek += 64
        for pod in rnd.sample(PODS, 2):
            evs = []
            parent = None
            for e in range(4):
                eks = tuple(keys[e * 16:(e + 1) * 16])
                chunk = tuple(toks[e * 16 * BS:(e + 1) * 16 * BS])
                evs.append(BlockStored(eks, parent, chunk, BS, "gpu", **(FULL if case != "plain" else {})))
                if case == "hybrid":
                    evs.append(BlockStored(eks, parent, chunk, BS, "gpu", **SWA))
                parent = eks[-1]
            t0 = time.perf_counter()
            r = ix.apply_events(pod, 0, evs, model="m", kinds=KINDS)
            seconds += time.perf_counter() - t0
            assert not r.errors and r.unavailable is None, r
            n += 64
            blocks += r.stored_blocks
    used = ix.client.info("memory")["used_memory"] - mem0
    st = ix.stats()
    ix.client.close()
    return {"entries": st.entries, "group_entries": st.group_entries, "used_memory": used,
            "bytes_per_entry": used / (st.entries + st.group_entries), "blocks_per_s": blocks / seconds}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--entries", type=int, default=100_000, help="main-table (block, pod) entries to fill")
    args = ap.parse_args()
    results: dict = {"entries": args.entries, "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                     "cpus_allowed": len(os.sched_getaffinity(0)), "loadavg_before": os.getloadavg()}
    for compat in (True, False):
        mode = "engine_hash" if compat else "own_hash"
        for case in ("plain", "plain_group0", "hybrid"):
            with RedisServer() as srv:
                results[f"{mode}/{case}"] = fill(srv.url, compat, case, args.entries)
    results["loadavg_after"] = os.getloadavg()
    print(f"{args.entries:,} main entries per case; {results['date']}, {results['cpus_allowed']} CPUs allowed, "
          f"load average {results['loadavg_before'][0]:.2f} before, {results['loadavg_after'][0]:.2f} after")
    print(f"{'':28}{'B/entry':>10}{'ratio':>8}{'blocks/s':>12}{'ratio':>8}")
    for mode in ("engine_hash", "own_hash"):
        base = results[f"{mode}/plain"]
        for case in ("plain", "plain_group0", "hybrid"):
            r = results[f"{mode}/{case}"]
            mem, rate = r["bytes_per_entry"], r["blocks_per_s"]
            print(f"{mode + ' ' + case:28}{mem:10.1f}{mem / base['bytes_per_entry']:8.2f}"
                  f"{rate:12.0f}{rate / base['blocks_per_s']:8.2f}")
    out = ROOT / "bench" / "out"
    out.mkdir(parents=True, exist_ok=True)
    (out / "redis_groups.json").write_text(json.dumps(results, indent=2))
    print(f"wrote {out / 'redis_groups.json'}")


if __name__ == "__main__":
    main()
