"""The shared Redis index vs the in-memory compiled index: score latency and ingest rate, as ratios.

Starts its own redis-server (Debian's package; tests/redis_server.py) on a
free loopback port, persistence off, and fills both indexes with the same
events: 8 pods, token paths of 64 blocks (block size 16) stored as
BlockStored events of 16 blocks each (the first without a parent, the
others chained to the previous event's last block), until ``--entries``
(request key, pod) entries are held.

Measures, for each backend:

- ingest: BlockStored events/s and blocks/s applied by one writer, the
  first half of the fill one ``block_stored`` call per event, the second
  half as the pool applies a decoded batch (``apply_events``, one pod's 4
  chained events of 16 blocks per batch);
- memory (Redis): the server's ``used_memory`` growth over the fill, per
  (request key, pod) entry;
- CPU (Redis): this process's and the server's CPU time per block stored and
  per ``score()`` (steadier than wall time on a shared machine);
- read path: ``Indexer.score()`` of an 8,192-token prompt (512 blocks) with
  8 candidate pods, pod i holding the first (i+1)/8 of it, and
  ``prefix_match`` of its 512 request keys alone: median and p99 over
  ``--reps`` calls.

Prints a table with Redis / native ratios and writes bench/out/redis.json.
Timings live here, never in tests.
Run: ``python bench/bench_redis.py [--entries N] [--reps R]``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402

from kvevents.events import AllBlocksCleared, BlockRemoved, BlockStored  # noqa: E402
from kvindex.facade import Config, Indexer  # noqa: E402
from kvindex.keys import TokenProcessor  # noqa: E402
from kvindex.native import NativeKVBlockIndex  # noqa: E402
from kvindex.redis_index import RedisKVBlockIndex  # noqa: E402
from tests.redis_server import RedisServer  # noqa: E402

BS = 16
PODS = [f"pod-{i}" for i in range(8)]
PATH_BLOCKS = 64
EVENT_BLOCKS = 16


def events(entries: int, seed: int = 1):
    """(pod, engine keys, parent, tokens) BlockStored events until ``entries`` entries."""
    rnd = random.Random(seed)
    n = 0
    ek = 1
    while n < entries:
        toks = [rnd.randrange(1, 50_000) for _ in range(PATH_BLOCKS * BS)]
        for pod in rnd.sample(PODS, rnd.randint(1, 3)):
            parent = None
            base = ek
            for e in range(PATH_BLOCKS // EVENT_BLOCKS):
                eks = list(range(base + e * EVENT_BLOCKS, base + (e + 1) * EVENT_BLOCKS))
                yield pod, eks, parent, toks[e * EVENT_BLOCKS * BS:(e + 1) * EVENT_BLOCKS * BS]
                parent = eks[-1]
                n += EVENT_BLOCKS
                if n >= entries:
                    return
        ek += PATH_BLOCKS  # the same tokens have the same engine keys on every pod


KINDS = (BlockStored, BlockRemoved, AllBlocksCleared)
BATCH_EVENTS = PATH_BLOCKS // EVENT_BLOCKS


def _rate(n_ev: int, n_blocks: int, dt: float, cpu: tuple[float, float]) -> dict:
    return {"events": n_ev, "blocks": n_blocks, "seconds": dt, "events_per_s": n_ev / dt, "blocks_per_s": n_blocks / dt,
            "client_cpu_us_per_block": cpu[0] * 1e6 / n_blocks, "server_cpu_us_per_block": cpu[1] * 1e6 / n_blocks}


def server_cpu(index) -> float:
    """CPU seconds the Redis server has used (0 for an in-process index)."""
    client = getattr(index, "client", None)
    if client is None:
        return 0.0
    info = client.info("cpu")
    return info["used_cpu_user"] + info["used_cpu_sys"]


class _Cpu:
    """CPU seconds of this process and of the Redis server over a ``with`` block (steadier than wall
    time on a shared machine)."""

    def __init__(self, index) -> None:
        self.index = index
        self.used = (0.0, 0.0)

    def __enter__(self) -> _Cpu:
        self._t = (time.process_time(), server_cpu(self.index))
        return self

    def __exit__(self, *exc: object) -> None:
        self.used = (time.process_time() - self._t[0], server_cpu(self.index) - self._t[1])


def fill(index, entries: int) -> dict:
    """The first half one ``block_stored`` per event, the rest in batches through ``apply_events``."""
    evs = list(events(entries))
    half = len(evs) // 2
    half -= half % BATCH_EVENTS
    t0 = time.perf_counter()
    with _Cpu(index) as cpu_each:
        for pod, eks, parent, toks in evs[:half]:
            index.block_stored(pod, 0, eks, parent, toks, "gpu", block_size=BS, model="m")
    dt_each = time.perf_counter() - t0
    batches: list[tuple[str, list[BlockStored]]] = []
    for pod, eks, parent, toks in evs[half:]:
        ev = BlockStored(tuple(eks), parent, tuple(toks), BS, "gpu")
        if batches and batches[-1][0] == pod and len(batches[-1][1]) < BATCH_EVENTS and parent is not None:
            batches[-1][1].append(ev)
        else:
            batches.append((pod, [ev]))
    t0 = time.perf_counter()
    with _Cpu(index) as cpu_batch:
        for pod, batch in batches:
            r = index.apply_events(pod, 0, batch, model="m", kinds=KINDS)
            assert r.unavailable is None and not r.errors, r
    dt_batch = time.perf_counter() - t0
    blocks_each = sum(len(e[1]) for e in evs[:half])
    blocks_batch = sum(len(e[1]) for e in evs[half:])
    return {
        "block_stored": _rate(half, blocks_each, dt_each, cpu_each.used),
        "apply_events": _rate(len(evs) - half, blocks_batch, dt_batch, cpu_batch.used),
        "batches": len(batches),
    }


def prompt_setup(index, tp: TokenProcessor) -> np.ndarray:
    """An 8,192-token prompt; pod i holds its first (i+1)/8 (stored with engine keys of their own)."""
    rnd = random.Random(99)
    toks = np.array([rnd.randrange(1, 50_000) for _ in range(8192)], dtype=np.int64)
    n = 8192 // BS
    for i, pod in enumerate(PODS):
        k = n * (i + 1) // 8
        eks = list(range(10**12, 10**12 + k))
        for s in range(0, k, 64):
            e = min(k, s + 64)
            index.block_stored(pod, 0, eks[s:e], eks[s - 1] if s else None, toks[s * BS:e * BS].tolist(), "gpu",
                               block_size=BS, model="m")
    return toks


def timed(fn, reps: int, index) -> dict:
    for _ in range(3):
        fn()
    ts = []
    with _Cpu(index) as cpu:
        for _ in range(reps):
            t0 = time.perf_counter()
            fn()
            ts.append(time.perf_counter() - t0)
    ts.sort()
    return {"median_ms": statistics.median(ts) * 1e3, "p99_ms": ts[min(len(ts) - 1, int(len(ts) * 0.99))] * 1e3,
            "client_cpu_ms": cpu.used[0] * 1e3 / reps, "server_cpu_ms": cpu.used[1] * 1e3 / reps}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--entries", type=int, default=250_000, help="(request key, pod) entries to fill")
    ap.add_argument("--reps", type=int, default=200)
    args = ap.parse_args()
    tp = TokenProcessor(block_size=BS)
    results: dict = {
        "entries": args.entries, "pods": len(PODS), "prompt_tokens": 8192,
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "machine": platform.processor() or platform.machine(),
        "cpus": os.cpu_count(), "cpus_allowed": len(os.sched_getaffinity(0)), "loadavg_before": os.getloadavg(),
    }
    with RedisServer() as srv:
        backends = {
            "native": NativeKVBlockIndex(tp, capacity=4_000_000),
            "redis": RedisKVBlockIndex(tp, capacity=4_000_000, url=srv.url),
        }
        for name, index in backends.items():
            mem0 = index.client.info("memory")["used_memory"] if name == "redis" else 0
            r: dict = {"ingest": fill(index, args.entries)}
            if name == "redis":
                used = index.client.info("memory")["used_memory"] - mem0
                r["redis_bytes_per_entry"] = used / max(1, index.stats().entries)
            toks = prompt_setup(index, tp)
            ix = Indexer(Config.from_dict({"model_name": "m", "token_processor_config": {"block_size": BS}}),
                         index=index)
            keys = ix.request_keys(toks)
            assert ix.score(toks, PODS).prefix[PODS[-1]].matched_blocks == 512
            r["score"] = timed(lambda: ix.score(toks, PODS), args.reps, index)  # noqa: B023
            r["prefix_match"] = timed(lambda: index.prefix_match(keys, PODS), args.reps, index)  # noqa: B023
            st = index.stats()
            r["index"] = {"keys": st.keys, "entries": st.entries}
            if name == "redis":
                info = index.client.info("memory")
                r["redis_used_memory_mb"] = info["used_memory"] / 2**20
            results[name] = r
    n, rd = results["native"], results["redis"]
    results["ratios_redis_over_native"] = {
        "ingest_block_stored": rd["ingest"]["block_stored"]["blocks_per_s"] / n["ingest"]["block_stored"]["blocks_per_s"],
        "ingest_apply_events": rd["ingest"]["apply_events"]["blocks_per_s"] / n["ingest"]["apply_events"]["blocks_per_s"],
        "score_median": rd["score"]["median_ms"] / n["score"]["median_ms"],
        "score_p99": rd["score"]["p99_ms"] / n["score"]["p99_ms"],
        "prefix_match_median": rd["prefix_match"]["median_ms"] / n["prefix_match"]["median_ms"],
        "prefix_match_p99": rd["prefix_match"]["p99_ms"] / n["prefix_match"]["p99_ms"],
    }
    results["loadavg_after"] = os.getloadavg()
    print(f"{args.entries:,} entries, {len(PODS)} pods, 8,192-token prompt (512 blocks), {args.reps} reps; "
          f"{results['date']}, {results['cpus']} CPUs ({results['cpus_allowed']} allowed), "
          f"load average {results['loadavg_before'][0]:.2f} before, {results['loadavg_after'][0]:.2f} after")
    print(f"{'':28}{'native':>14}{'redis':>14}{'redis/native':>14}")
    rows = [
        ("ingest blocks/s block_stored", n["ingest"]["block_stored"]["blocks_per_s"],
         rd["ingest"]["block_stored"]["blocks_per_s"]),
        ("ingest blocks/s apply_events", n["ingest"]["apply_events"]["blocks_per_s"],
         rd["ingest"]["apply_events"]["blocks_per_s"]),
        ("score median ms", n["score"]["median_ms"], rd["score"]["median_ms"]),
        ("score p99 ms", n["score"]["p99_ms"], rd["score"]["p99_ms"]),
        ("prefix_match median ms", n["prefix_match"]["median_ms"], rd["prefix_match"]["median_ms"]),
        ("prefix_match p99 ms", n["prefix_match"]["p99_ms"], rd["prefix_match"]["p99_ms"]),
    ]
    for label, a, b in rows:
        print(f"{label:28}{a:14.3f}{b:14.3f}{b / a:14.2f}")
    ri, rs = rd["ingest"], rd["score"]
    print("redis CPU (steadier than wall time on a shared machine): per block stored, client + server us: "
          f"block_stored {ri['block_stored']['client_cpu_us_per_block']:.1f} + "
          f"{ri['block_stored']['server_cpu_us_per_block']:.1f}, apply_events "
          f"{ri['apply_events']['client_cpu_us_per_block']:.1f} + {ri['apply_events']['server_cpu_us_per_block']:.1f}; "
          f"per score(), client + server ms: {rs['client_cpu_ms']:.2f} + {rs['server_cpu_ms']:.2f}")
    print(f"index: {rd['index']['keys']:,} keys, {rd['index']['entries']:,} entries; "
          f"Redis used memory {rd['redis_used_memory_mb']:.0f} MiB, "
          f"{rd['redis_bytes_per_entry']:.0f} B per entry (growth over the fill)")
    out = ROOT / "bench" / "out"
    out.mkdir(parents=True, exist_ok=True)
    (out / "redis.json").write_text(json.dumps(results, indent=2))
    print(f"wrote {out / 'redis.json'}")


if __name__ == "__main__":
    main()
