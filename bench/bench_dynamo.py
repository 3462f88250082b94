"""kvindex against NVIDIA Dynamo's KV indexer, in the same process, interleaved.

Peer: ai-dynamo-runtime 1.6.1 (its Rust RadixTree through its Python binding;
``pip install --no-deps ai-dynamo-runtime==1.6.1``, in the ``bench`` extra).
Same data for both: block size 16, random token ids, random 64-bit engine
block hashes.  Each pod holds its own sequences (no block shared by two pods),
so entries = (block, pod) pairs = blocks stored.

Measures:
- read path, a prompt of 1k .. 128k tokens; pod p of P holds the prompt's first
  (p + 1) / P of its blocks, and the index also holds filler sequences up to
  the index size: ours ``Indexer.score()`` end to end (request keys + match +
  prefix scores + picker; list input as a router has it, and numpy input), and
  ``index.prefix_match`` alone on precomputed keys; Dynamo
  ``compute_block_hash_for_seq`` + ``find_matches``.  Calls alternate, ours
  then Dynamo's; median, p99 and minimum per call.
- the same at 8,192 tokens against the index size.
- ingest, one core: ours from raw vLLM msgpack payloads (``decode_vllm_batch``
  + ``apply_events`` per batch, as the pool does, no pool threads), Dynamo ``apply_event`` from
  pre-encoded JSON; blocks per CPU second (process time, all threads).
- score p99 while an EventPool ingests at full speed, against the idle p99 in
  the same run.
- memory per (block, pod): RSS delta of a fresh process that stores the
  entries (ours with the compiled index, and the pure-Python reference), with
  the 8-byte floor (one hash per block).

Prints tables, writes bench/out/dynamo.json and two PNG plots.  Timings live
here, never in tests.  Run: ``python bench/bench_dynamo.py [--quick]``.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import msgspec  # noqa: E402
import numpy as np  # noqa: E402

from kvindex.facade import Config, Indexer  # noqa: E402
from kvevents.events import AllBlocksCleared, BlockRemoved, BlockStored  # noqa: E402
from kvevents.pool import EventPool, RawMessage, Source  # noqa: E402
from kvevents.wire import decode_vllm_batch  # noqa: E402

try:  # the fast decoding (absent from older trees: the bench then measures the reference path only)
    from kvevents.fastwire import decode_fast  # noqa: E402
except ImportError:  # pragma: no cover
    decode_fast = None

BS = 16
EVENT_KINDS = (BlockStored, BlockRemoved, AllBlocksCleared)
OUT = ROOT / "bench" / "out"

try:
    from dynamo._core import RadixTree, compute_block_hash_for_seq
except ImportError:  # pragma: no cover - the bench extra is not installed
    RadixTree = compute_block_hash_for_seq = None


def make_indexer(backend: str = "native", capacity: int = 20_000_000) -> Indexer:
    return Indexer(Config.from_dict({
        "model_name": "m",
        "token_processor_config": {"block_size": BS},
        "kv_block_index_config": {"backend": backend, "in_memory_config": {"size": capacity}},
    }))


class Fleet:
    """The same contents in our index and in Dynamo's radix tree."""

    def __init__(self, pods: int, backend: str = "native", dynamo: bool = True) -> None:
        self.pods = [f"pod-{p}" for p in range(pods)]
        self.ix = make_indexer(backend)
        self.tree = RadixTree() if dynamo else None
        self.event_id = 0
        self.rng = random.Random(7)

    def store(self, p: int, tokens: list[int], blocks_per_event: int = 64) -> None:
        """Store ``tokens`` (whole blocks) as one sequence on pod ``p`` in both indexes."""
        n = len(tokens) // BS
        # engine block hashes are a function of the token path (as engines' are; Dynamo relies on it)
        eks = (self.ix.request_keys(tokens, model="engine") >> np.uint64(1)).tolist()
        local = compute_block_hash_for_seq(tokens, BS) if self.tree is not None else None
        parent = None
        for i in range(0, n, blocks_per_event):
            j = min(n, i + blocks_per_event)
            self.ix.index.block_stored(self.pods[p], 0, eks[i:j], parent, tokens[i * BS : j * BS], "gpu",
                                       block_size=BS, model="m")
            if self.tree is not None:
                self.event_id += 1
                ev = {"event_id": self.event_id, "data": {"stored": {"parent_hash": parent, "blocks": [
                    {"block_hash": eks[k], "tokens_hash": local[k]} for k in range(i, j)]}}, "dp_rank": 0}
                self.tree.apply_event(p, json.dumps(ev).encode())
            parent = eks[j - 1]

    def fill(self, entries: int, seq_blocks: int = 256) -> None:
        """Add filler sequences, round robin over pods, until ``entries`` blocks are stored."""
        rng = np.random.default_rng(1)
        stored = 0
        p = 0
        while stored < entries:
            n = min(seq_blocks, entries - stored)
            self.store(p, rng.integers(1, 50_000, size=n * BS).tolist())
            stored += n
            p = (p + 1) % len(self.pods)

    def sync(self) -> None:
        """Dynamo applies events on its own thread: a query after them waits for them."""
        if self.tree is not None:
            self.tree.find_matches([1, 2, 3])


def stats_us(ts: list[float]) -> dict[str, float]:
    s = sorted(ts)
    return {"median_us": statistics.median(s) * 1e6, "p99_us": s[min(len(s) - 1, int(len(s) * 0.99))] * 1e6,
            "min_us": s[0] * 1e6}


def interleaved(fns: dict[str, callable], reps: int) -> dict[str, dict[str, float]]:
    ts: dict[str, list[float]] = {k: [] for k in fns}
    for fn in fns.values():  # warm up
        fn()
    for _ in range(reps):
        for k, fn in fns.items():
            t0 = time.perf_counter()
            fn()
            ts[k].append(time.perf_counter() - t0)
    return {k: stats_us(v) for k, v in ts.items()}


def read_case(fleet: Fleet, tokens: int, reps: int) -> dict[str, dict[str, float]]:
    rng = np.random.default_rng(tokens)
    prompt = rng.integers(1, 50_000, size=tokens)
    plist = prompt.tolist()
    n = tokens // BS
    P = len(fleet.pods)
    for p in range(P):
        held = max(1, n * (p + 1) // P)
        fleet.store(p, plist[: held * BS])
    fleet.sync()
    ix, tree, cands = fleet.ix, fleet.tree, fleet.pods
    keys = ix.request_keys(prompt)
    # both indexes agree on what each pod holds
    want = {fleet.pods[p]: max(1, n * (p + 1) // P) for p in range(P)}
    got = {p: len(m) for p, m in ix.index.prefix_match(keys, cands).items()}
    assert got == want, (got, want)
    dyn = tree.find_matches(compute_block_hash_for_seq(plist, BS)).scores
    assert {fleet.pods[w]: v for (w, _r), v in dyn.items()} == want
    return interleaved({
        "ours_score_list": lambda: ix.score(plist, cands),
        "ours_score_numpy": lambda: ix.score(prompt, cands),
        "ours_prefix_match": lambda: ix.index.prefix_match(keys, cands),
        "dynamo": lambda: tree.find_matches(compute_block_hash_for_seq(plist, BS)),
    }, reps)


def vllm_payloads(n_events: int, blocks: int, pods: int) -> tuple[list[tuple[str, bytes]], list[tuple[int, bytes]]]:
    """The same BlockStored events as vLLM msgpack payloads (ours) and Dynamo JSON (theirs)."""
    rng = random.Random(3)
    nrng = np.random.default_rng(3)
    ours, theirs = [], []
    parents: dict[int, int | None] = {}
    for i in range(n_events):
        p = i % pods
        toks = nrng.integers(1, 50_000, size=blocks * BS).tolist()
        eks = [rng.getrandbits(64) for _ in range(blocks)]
        parent = parents.get(p)
        ev = {"type": "BlockStored", "block_hashes": eks, "parent_block_hash": parent, "token_ids": toks,
              "block_size": BS, "medium": "GPU"}
        ours.append((f"pod-{p}", msgspec.msgpack.encode([time.time(), [ev], 0])))
        local = compute_block_hash_for_seq(toks, BS)
        theirs.append((p, json.dumps({"event_id": i + 1, "data": {"stored": {"parent_hash": parent, "blocks": [
            {"block_hash": eks[k], "tokens_hash": local[k]} for k in range(blocks)]}}, "dp_rank": 0}).encode()))
        parents[p] = eks[-1] if rng.random() < 0.9 else None
    return ours, theirs


def bench_ingest(n_events: int, blocks: int, pods: int, runs: int) -> dict[str, float]:
    ours, theirs = vllm_payloads(n_events, blocks, pods)
    n_blocks = n_events * blocks
    res: dict[str, list[float]] = {"ours": [], "dynamo": [], "pool": []}
    for _ in range(runs):
        # through an EventPool (one shard): sequencing, decode, apply and the per-stream counters
        ix = make_indexer().index
        pool = EventPool(ix, concurrency=1, queue_size=len(ours) + 10)
        pool.start()
        seqs: dict[str, int] = {}
        msgs = []
        for pod, payload in ours:
            s = seqs.get(pod, 0)
            seqs[pod] = s + 1
            msgs.append(RawMessage(Source(), f"kv@{pod}@m".encode(), s.to_bytes(8, "big"), payload))
        t0 = time.process_time()
        for m in msgs:
            pool.submit(m)
        while pool.stats().blocks_stored < n_blocks:
            time.sleep(0.001)
        res["pool"].append(n_blocks / (time.process_time() - t0))
        pool.stop()
        ix = make_indexer().index
        t0 = time.process_time()
        for pod, payload in ours:
            ix.apply_events(pod, 0, decode_vllm_batch(payload).events, model="m", kinds=EVENT_KINDS)
        res["ours"].append(n_blocks / (time.process_time() - t0))
        assert ix.stats().stored_blocks == n_blocks
        tree = RadixTree()
        t0 = time.process_time()
        for w, data in theirs:
            tree.apply_event(w, data)
        tree.find_matches([1])  # waits for the events to be applied
        res["dynamo"].append(n_blocks / (time.process_time() - t0))
    return {"ours_blocks_per_cpu_s": max(res["ours"]), "dynamo_blocks_per_cpu_s": max(res["dynamo"]),
            "ours_pool_blocks_per_cpu_s": max(res["pool"]),
            "ours_median": statistics.median(res["ours"]), "dynamo_median": statistics.median(res["dynamo"]),
            "ours_pool_median": statistics.median(res["pool"])}


# The two event shapes of issue 22: a prefill step's store (8 blocks in one event, one event per
# batch) and decode steps (batches of 16 one-block events, each extending its own request).
SHAPES = {"prefill": (1, 8), "decode": (16, 1)}


def shape_payloads(shape: str, n_blocks: int, pods: list[str]) -> tuple[list[tuple[str, bytes]], list[tuple[int, bytes]]]:
    """``n_blocks`` blocks as vLLM msgpack batches of ``shape`` (ours, round robin over pods) and the
    same stores as Dynamo JSON events (theirs, one per BlockStored)."""
    per_batch, blocks = SHAPES[shape]
    rng = random.Random(3)
    nrng = np.random.default_rng(3)
    ours, theirs = [], []
    chains: dict[tuple[int, int], int | None] = {}  # (pod, request) -> the request's last block hash
    eid = 0
    for b in range(n_blocks // (per_batch * blocks)):
        p = b % len(pods)
        evs = []
        for r in range(per_batch):
            toks = nrng.integers(1, 50_000, size=blocks * BS).tolist()
            eks = [rng.getrandbits(64) for _ in range(blocks)]
            parent = chains.get((p, r))
            evs.append({"type": "BlockStored", "block_hashes": eks, "parent_block_hash": parent, "token_ids": toks,
                        "block_size": BS, "medium": "GPU"})
            local = compute_block_hash_for_seq(toks, BS)
            eid += 1
            theirs.append((p, json.dumps({"event_id": eid, "data": {"stored": {"parent_hash": parent, "blocks": [
                {"block_hash": eks[k], "tokens_hash": local[k]} for k in range(blocks)]}}, "dp_rank": 0}).encode()))
            chains[(p, r)] = eks[-1] if rng.random() < 0.9 else None
        ours.append((pods[p], msgspec.msgpack.encode([time.time(), evs, 0])))
    return ours, theirs


def _pool(ix, concurrency: int, fast: bool, queue_size: int) -> EventPool:
    try:
        return EventPool(ix, concurrency=concurrency, queue_size=queue_size, fast_path=fast)
    except TypeError:  # a tree without the fast path
        return EventPool(ix, concurrency=concurrency, queue_size=queue_size)


def _messages(ours: list[tuple[str, bytes]]) -> list[RawMessage]:
    seqs: dict[str, int] = {}
    msgs = []
    for pod, payload in ours:
        s = seqs.get(pod, 0)
        seqs[pod] = s + 1
        msgs.append(RawMessage(Source(), f"kv@{pod}@m".encode(), s.to_bytes(8, "big"), payload))
    return msgs


def _pool_rate(ours: list[tuple[str, bytes]], n_blocks: int, fast: bool, concurrency: int = 1,
               clock=time.process_time) -> float:
    """Blocks per second (``clock``) through an EventPool: every message queued first, then the
    shards started and timed until the last block is applied."""
    ix = make_indexer().index
    pool = _pool(ix, concurrency, fast, len(ours) + 10)
    for m in _messages(ours):
        pool.submit(m)
    t0 = clock()
    pool.start()
    assert pool.flush(timeout=600)  # waits without polling: the shards run alone
    rate = n_blocks / (clock() - t0)
    assert pool.stats().blocks_stored == n_blocks
    pool.stop()
    return rate


def _direct_rate(ours: list[tuple[str, bytes]], n_blocks: int, fast: bool) -> float:
    """Blocks per CPU second of decode + apply per batch, no pool (fast: decode_fast + apply_raw)."""
    ix = make_indexer().index
    t0 = time.process_time()
    if fast:
        for pod, payload in ours:
            fb = decode_fast(payload)
            if fb is None:
                ix.apply_events(pod, 0, decode_vllm_batch(payload).events, model="m", kinds=EVENT_KINDS)
            else:
                ix.apply_raw(pod, 0, fb.raw, fb.slow_events, model="m", kinds=EVENT_KINDS)
    else:
        for pod, payload in ours:
            ix.apply_events(pod, 0, decode_vllm_batch(payload).events, model="m", kinds=EVENT_KINDS)
    rate = n_blocks / (time.process_time() - t0)
    assert ix.stats().stored_blocks == n_blocks
    return rate


def bench_shapes(n_blocks: int, runs: int) -> dict[str, dict[str, float]]:
    """Per shape, blocks per CPU second (best of ``runs``, interleaved): ours decode + apply (reference
    decoder, fast decoder), through one EventPool shard (each way), Dynamo apply_event from JSON."""
    out: dict[str, dict[str, float]] = {}
    pods = [f"pod-{p}" for p in range(8)]
    for shape in SHAPES:
        ours, theirs = shape_payloads(shape, n_blocks, pods)
        res: dict[str, list[float]] = {}
        for _ in range(runs):
            res.setdefault("direct_ref", []).append(_direct_rate(ours, n_blocks, False))
            if decode_fast is not None:
                res.setdefault("direct_fast", []).append(_direct_rate(ours, n_blocks, True))
            res.setdefault("pool_ref", []).append(_pool_rate(ours, n_blocks, False))
            if decode_fast is not None:
                res.setdefault("pool_fast", []).append(_pool_rate(ours, n_blocks, True))
            tree = RadixTree()
            t0 = time.process_time()
            for w, data in theirs:
                tree.apply_event(w, data)
            tree.find_matches([1])  # waits for the events to be applied
            res.setdefault("dynamo", []).append(n_blocks / (time.process_time() - t0))
        out[shape] = {k: max(v) for k, v in res.items()} | {f"{k}_median": statistics.median(v) for k, v in res.items()}
    return out


def balanced_pods(n: int, shards: int = 2) -> list[str]:
    """``n`` pod names spread evenly over ``shards`` EventPool shards."""
    probe = EventPool(make_indexer().index, concurrency=shards)
    by: dict[int, list[str]] = {s: [] for s in range(shards)}
    i = 0
    while min(len(v) for v in by.values()) < n // shards:
        name = f"pod-{i}"
        i += 1
        if len(by[probe.shard_of(name)]) < n // shards:
            by[probe.shard_of(name)].append(name)
    return [p for v in zip(*by.values()) for p in v]


def bench_scaling(n_blocks: int, runs: int) -> dict[str, dict[str, float]]:
    """Blocks per wall second through an EventPool of one shard and of two, 16 pods' streams (unpinned)."""
    out: dict[str, dict[str, float]] = {}
    pods = balanced_pods(16)
    for shape in SHAPES:
        ours, _ = shape_payloads(shape, n_blocks, pods)
        res: dict[str, list[float]] = {}
        for _ in range(runs):
            for fast in ((False, True) if decode_fast is not None else (False,)):
                name = "fast" if fast else "ref"
                for k in (1, 2):
                    res.setdefault(f"{name}_{k}", []).append(
                        _pool_rate(ours, n_blocks, fast, k, clock=time.perf_counter))
        out[shape] = {k: max(v) for k, v in res.items()}
    return out


def print_shapes(r: dict[str, dict[str, float]], n_blocks: int) -> None:
    print(f"ingest, {n_blocks:,} blocks per shape, blocks per CPU second (best of runs); x = / Dynamo")
    print(f"  {'shape':<34} {'Dynamo':>10} {'direct ref':>11} {'x':>6} {'direct fast':>12} {'x':>6} "
          f"{'pool ref':>10} {'x':>6} {'pool fast':>10} {'x':>6}")
    for shape, v in r.items():
        per_batch, blocks = SHAPES[shape]
        d = v["dynamo"]
        cells = []
        for k in ("direct_ref", "direct_fast", "pool_ref", "pool_fast"):
            cells += [f"{v[k]:,.0f}", f"{v[k] / d:.2f}"] if k in v else ["n/a", ""]
        label = f"{shape} ({per_batch} ev/batch x {blocks} blk)"
        print(f"  {label:<34} {d:>10,.0f} {cells[0]:>11} {cells[1]:>6} {cells[2]:>12} {cells[3]:>6} "
              f"{cells[4]:>10} {cells[5]:>6} {cells[6]:>10} {cells[7]:>6}")


def print_scaling(r: dict[str, dict[str, float]], n_blocks: int) -> None:
    print(f"ingest through an EventPool, 16 pods, {n_blocks:,} blocks, blocks per wall second (best of runs)")
    for shape, v in r.items():
        for name in ("ref", "fast"):
            if f"{name}_1" in v:
                print(f"  {shape:<8} {name:<5} 1 shard {v[f'{name}_1']:>12,.0f}   2 shards {v[f'{name}_2']:>12,.0f}"
                      f"   ratio {v[f'{name}_2'] / v[f'{name}_1']:.2f}x")


def bench_under_ingest(reps: int, pods: int = 8) -> dict[str, float]:
    """Score p99 idle, then while a pool applies events as fast as it can."""
    ix = make_indexer()
    rng = np.random.default_rng(5)
    prompt = rng.integers(1, 50_000, size=8192).tolist()
    cands = [f"pod-{p}" for p in range(pods)]
    for p, pod in enumerate(cands):
        held = 512 * (p + 1) // pods
        ix.index.block_stored(pod, 0, list(range(p << 20, (p << 20) + held)), None, prompt[: held * BS], "gpu",
                              block_size=BS, model="m")
    ours, _ = vllm_payloads(20_000, 8, pods) if compute_block_hash_for_seq else ([], [])
    idle = [0.0] * reps
    for i in range(reps):
        t0 = time.perf_counter()
        ix.score(prompt, cands)
        idle[i] = time.perf_counter() - t0
    pool = EventPool(ix.index, concurrency=1, queue_size=len(ours) + 10)
    pool.start()
    seqs: dict[str, int] = {}
    for pod, payload in ours:
        s = seqs.get(pod, 0)
        seqs[pod] = s + 1
        pool.submit(RawMessage(Source(), f"kv@w{pod}@m".encode(), s.to_bytes(8, "big"), payload))
    busy: list[float] = []
    before = pool.stats().blocks_stored
    t_start = time.perf_counter()
    while len(busy) < reps and pool.stats().blocks_stored < len(ours) * 8:
        t0 = time.perf_counter()
        ix.score(prompt, cands)
        busy.append(time.perf_counter() - t0)
    applied = pool.stats().blocks_stored - before
    rate = applied / (time.perf_counter() - t_start)
    pool.stop()
    a, b = stats_us(idle), stats_us(busy)
    return {"idle_p99_us": a["p99_us"], "busy_p99_us": b["p99_us"], "idle_median_us": a["median_us"],
            "busy_median_us": b["median_us"], "busy_samples": len(busy), "pool_blocks_per_s_meanwhile": rate}


MEMORY_CHILD = r"""
import json, os, random, sys
sys.path.insert(0, {root!r})
def rss():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
kind, entries, pods = {kind!r}, {entries}, {pods}
import numpy as np
rng = random.Random(11)
seq = 256
if kind == "dynamo":
    from dynamo._core import RadixTree
    tree = RadixTree()
    tree.find_matches([1])
else:
    from kvindex.facade import Config, Indexer
    ix = Indexer(Config.from_dict({{"model_name": "m", "token_processor_config": {{"block_size": 16}},
        "kv_block_index_config": {{"backend": kind, "in_memory_config": {{"size": entries + 10}}}}}})).index
toks = np.random.default_rng(1).integers(1, 50000, size=seq * 16).tolist()
base = rss()
stored, p, eid = 0, 0, 0
while stored < entries:
    n = min(seq, entries - stored)
    eks = [rng.getrandbits(64) for _ in range(n)]
    parent = None
    for i in range(0, n, 64):
        j = min(n, i + 64)
        if kind == "dynamo":
            eid += 1
            ev = {{"event_id": eid, "data": {{"stored": {{"parent_hash": parent, "blocks": [
                {{"block_hash": eks[k], "tokens_hash": rng.getrandbits(64)}} for k in range(i, j)]}}}}, "dp_rank": 0}}
            tree.apply_event(p, json.dumps(ev).encode())
        else:
            toks[0] = stored + i  # every sequence distinct
            ix.block_stored("pod-%d" % p, 0, eks[i:j], parent, toks[i * 16 : j * 16], "gpu", block_size=16, model="m")
        parent = eks[j - 1]
    stored += n
    p = (p + 1) % pods
if kind == "dynamo":
    tree.find_matches([1])
else:
    assert ix.stats().entries == entries, ix.stats()
print(json.dumps({{"bytes": rss() - base}}))
"""


def bench_memory(entries: int, pods: int, kinds: list[str]) -> dict[str, float]:
    out = {}
    for kind in kinds:
        code = MEMORY_CHILD.format(root=str(ROOT), kind=kind, entries=entries, pods=pods)
        r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=3600)
        if r.returncode:
            raise RuntimeError(f"memory child {kind} failed: {r.stderr[-2000:]}")
        out[kind] = json.loads(r.stdout.strip().splitlines()[-1])["bytes"] / entries
    return out


def plot(by_len: dict[int, dict], by_size: dict[int, dict], path_len: Path, path_size: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    for data, xlabel, path, title in ((by_len, "prompt tokens", path_len, "read path vs prompt length, 8 pods"),
                                      (by_size, "index entries", path_size, "read path vs index size, 8,192 tokens")):
        fig, ax = plt.subplots(figsize=(7, 4.5))
        xs = sorted(data)
        for key, label, color in (("ours_score_list", "kvindex Indexer.score() (list in)", "C0"),
                                  ("ours_prefix_match", "kvindex prefix_match (keys given)", "C2"),
                                  ("dynamo", "Dynamo hash + find_matches", "C3")):
            ax.plot(xs, [data[x][key]["median_us"] for x in xs], "-o", color=color, label=label + ", median")
            ax.plot(xs, [data[x][key]["min_us"] for x in xs], ":", color=color, label=label + ", min")
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel(xlabel)
        ax.set_ylabel("us per call")
        ax.set_title(title)
        ax.legend(fontsize=7)
        fig.tight_layout()
        fig.savefig(path, dpi=100)
        plt.close(fig)


def print_ingest(ingest: dict) -> None:
    print(f"ingest, 20,000 BlockStored events of 8 blocks, one core, blocks per CPU second (best of 3): "
          f"ours (msgpack decode + apply) {ingest['ours_blocks_per_cpu_s']:,.0f}, "
          f"Dynamo (apply_event JSON) {ingest['dynamo_blocks_per_cpu_s']:,.0f}, "
          f"ratio {ingest['ours_blocks_per_cpu_s'] / ingest['dynamo_blocks_per_cpu_s']:.2f}x; "
          f"ours through an EventPool shard {ingest['ours_pool_blocks_per_cpu_s']:,.0f} "
          f"({ingest['ours_pool_blocks_per_cpu_s'] / ingest['dynamo_blocks_per_cpu_s']:.2f}x); "
          f"medians: ours {ingest['ours_median']:,.0f}, Dynamo {ingest['dynamo_median']:,.0f} "
          f"({ingest['ours_median'] / ingest['dynamo_median']:.2f}x), pool {ingest['ours_pool_median']:,.0f} "
          f"({ingest['ours_pool_median'] / ingest['dynamo_median']:.2f}x)")


def print_memory(mem: dict, entries: int) -> None:
    parts = [f"{label} {mem[k]:.1f} B" for k, label in (("native", "compiled"), ("dynamo", "Dynamo"),
                                                       ("python", "Python reference")) if k in mem]
    ratio = f"; compiled / Dynamo {mem['native'] / mem['dynamo']:.2f}" if "native" in mem and "dynamo" in mem else ""
    print(f"memory per (block, pod), {entries:,} entries, 8 pods, RSS delta: {', '.join(parts)}{ratio}; floor 8 B")


def score_section(args: argparse.Namespace) -> int:
    """The score targets alone: 8,192 and 131,072 tokens at 8 and 64 pods, then score p99 under ingest."""
    print(f"score() vs Dynamo, {args.entries:,} entries, interleaved, {args.reps} reps; ratio = ours / Dynamo")
    print(f"  {'case':<30} {'ours med':>10} {'ours p99':>10} {'ours min':>10} {'dyn med':>10} {'dyn p99':>10} "
          f"{'dyn min':>10} {'med x':>6} {'min x':>6}")
    out: dict = {}
    for pods in (8, 64):
        fleet = Fleet(pods)
        fleet.fill(args.entries)
        fleet.sync()
        for tokens in (8192, 131072):
            r = read_case(fleet, tokens, args.reps if tokens <= 32768 else max(5, args.reps // 5))
            out[f"{tokens}/{pods}"] = r
            for name, key in ((f"score() {tokens:>6} tok, {pods} pods", "ours_score_list"),
                              ("  numpy in", "ours_score_numpy"), ("  prefix_match only", "ours_prefix_match")):
                o, d = r[key], r["dynamo"]
                print(f"  {name:<30} {o['median_us']:>10.0f} {o['p99_us']:>10.0f} {o['min_us']:>10.0f} "
                      f"{d['median_us']:>10.0f} {d['p99_us']:>10.0f} {d['min_us']:>10.0f} "
                      f"{o['median_us'] / d['median_us']:>6.2f} {o['min_us'] / d['min_us']:>6.2f}", flush=True)
        del fleet
    under = bench_under_ingest(args.reps * 2)
    print(f"score() p99 while the pool ingests: {under['busy_p99_us']:.0f} us vs idle {under['idle_p99_us']:.0f} us "
          f"({under['busy_p99_us'] / under['idle_p99_us']:.2f}x; {under['busy_samples']} samples)")
    return 0


def run_section(args: argparse.Namespace) -> int:
    """One section alone (``--only``): its result line, no JSON file, no plots."""
    if args.only == "score":
        return score_section(args)
    if args.only == "shapes":
        print_shapes(bench_shapes(args.blocks, args.runs), args.blocks)
    elif args.only == "scaling":
        print_scaling(bench_scaling(args.blocks, args.runs), args.blocks)
    elif args.only == "memory":
        kinds = [k for k in args.memory_kinds.split(",") if k]
        print_memory(bench_memory(args.memory_entries, 8, kinds), args.memory_entries)
    else:
        print_ingest(bench_ingest(2_000 if args.quick else 20_000, 8, 8, 3))
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="small sizes (a smoke run)")
    ap.add_argument("--reps", type=int, default=100)
    ap.add_argument("--entries", type=int, default=1_000_000, help="index size for the read path")
    ap.add_argument("--memory-entries", type=int, default=2_000_000)
    ap.add_argument("--only", choices=["memory", "ingest", "shapes", "scaling", "score"],
                    help="run one section and print its line (shapes: both event shapes, pin it with taskset; "
                         "scaling: one shard vs two, unpinned)")
    ap.add_argument("--blocks", type=int, default=160_000, help="blocks per shape (shapes, scaling)")
    ap.add_argument("--runs", type=int, default=3, help="runs per measure (shapes, scaling)")
    ap.add_argument("--memory-kinds", default="native,dynamo,python",
                    help="comma-separated backends of the memory section (native, dynamo, python)")
    args = ap.parse_args(argv)
    if RadixTree is None:
        print("ai-dynamo-runtime is not installed: pip install --no-deps ai-dynamo-runtime==1.6.1")
        return 1
    if args.quick:
        args.reps, args.entries, args.memory_entries = 20, 50_000, 100_000
    OUT.mkdir(parents=True, exist_ok=True)
    result: dict = {"date": time.strftime("%Y-%m-%d"), "block_size": BS}
    if args.only:
        return run_section(args)

    lengths = [1024, 2048, 4096, 8192, 16384, 32768, 65536, 131072]
    by_len: dict[int, dict] = {}
    by_pods: dict[int, dict] = {}
    for pods in (8, 64):
        fleet = Fleet(pods)
        fleet.fill(args.entries)
        fleet.sync()
        for tokens in lengths if pods == 8 else [8192, 131072]:
            r = read_case(fleet, tokens, args.reps if tokens <= 32768 else max(5, args.reps // 5))
            if pods == 8:
                by_len[tokens] = r
            by_pods.setdefault(pods, {})[tokens] = r
        del fleet
    by_size: dict[int, dict] = {}
    for size in sorted({10_000, 100_000, args.entries}):
        fleet = Fleet(8)
        fleet.fill(size)
        fleet.sync()
        by_size[size] = read_case(fleet, 8192, args.reps)
        del fleet
    result["read_by_length_8_pods"] = by_len
    result["read_by_pods"] = by_pods
    result["read_by_size_8192"] = by_size

    ingest = bench_ingest(2_000 if args.quick else 20_000, 8, 8, 3)
    result["ingest"] = ingest
    under = bench_under_ingest(args.reps * 2)
    result["score_under_ingest"] = under
    mem = bench_memory(args.memory_entries, 8, ["native", "dynamo", "python"])
    result["memory_bytes_per_entry"] = mem

    print(f"kvindex vs Dynamo (ai-dynamo-runtime 1.6.1), block size {BS}, {args.entries:,} entries, "
          f"interleaved, {args.reps} reps; ratio = ours / Dynamo (lower is better)")
    print(f"  {'case':<30} {'ours med':>10} {'ours p99':>10} {'ours min':>10} {'dyn med':>10} {'dyn p99':>10} "
          f"{'dyn min':>10} {'med x':>6} {'min x':>6}")

    def row(name: str, r: dict, key: str = "ours_score_list") -> None:
        o, d = r[key], r["dynamo"]
        print(f"  {name:<30} {o['median_us']:>10.0f} {o['p99_us']:>10.0f} {o['min_us']:>10.0f} "
              f"{d['median_us']:>10.0f} {d['p99_us']:>10.0f} {d['min_us']:>10.0f} "
              f"{o['median_us'] / d['median_us']:>6.2f} {o['min_us'] / d['min_us']:>6.2f}")

    for pods, cases in by_pods.items():
        for tokens, r in cases.items():
            row(f"score() {tokens:>6} tok, {pods} pods", r)
            row(f"  numpy in", r, "ours_score_numpy")
            row(f"  prefix_match only", r, "ours_prefix_match")
    for size, r in by_size.items():
        row(f"score() 8192 tok, {size:,} entries", r)
    print_ingest(ingest)
    print(f"score() p99 while the pool ingests: {under['busy_p99_us']:.0f} us vs idle {under['idle_p99_us']:.0f} us "
          f"({under['busy_p99_us'] / under['idle_p99_us']:.2f}x; {under['busy_samples']} samples, "
          f"pool {under['pool_blocks_per_s_meanwhile']:,.0f} blocks/s meanwhile)")
    print_memory(mem, args.memory_entries)
    (OUT / "dynamo.json").write_text(json.dumps(result, indent=1))
    try:
        plot(by_len, by_size, OUT / "dynamo_by_length.png", OUT / "dynamo_by_size.png")
    except ImportError:
        print("matplotlib missing: no plots")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
