"""Index and pool throughput, read-path latency; against a plain dict-of-sets peer in the same run.

Measures:
- ingest: BlockStored events of 4 blocks (block size 16) applied to KVBlockIndex
  directly, and through the EventPool (msgpack decode + sequence check + apply),
  vs the peer (request key -> set of pods, engine key -> request key, the
  shape of a minimal in-memory index) fed the same events;
- read path for an 8,192-token prompt (512 blocks) with 8 candidate pods holding
  1/8 .. 8/8 of it: request_keys, prefix_match, and the whole Indexer.score(),
  vs the peer's per-key, per-pod lookup loop.

Prints a table and writes bench/out/index.json.  Timings live here, never in tests.
Run: ``python bench/bench_index.py [--events N] [--reps R]``.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import msgspec  # noqa: E402
import numpy as np  # noqa: E402

from kvindex.facade import Config, Indexer  # noqa: E402
from kvevents.pool import EventPool, RawMessage, Source  # noqa: E402
from kvindex.reference import KVBlockIndex  # noqa: E402
from kvindex.keys import TokenProcessor  # noqa: E402

BS = 16


class PeerIndex:
    """The simplest correct shape: request key -> pods, engine key -> request key."""

    def __init__(self, tp: TokenProcessor) -> None:
        self.tp = tp
        self.blocks: dict[int, set[str]] = {}
        self.engine: dict[int, int] = {}

    def block_stored(self, pod, engine_keys, parent, tokens) -> None:
        prk = None if parent is None else self.engine.get(parent)
        rks = self.tp.chain(prk, tokens).tolist()
        for ek, rk in zip(engine_keys, rks):
            self.engine[ek] = rk
            self.blocks.setdefault(rk, set()).add(pod)

    def prefix_match(self, keys, pods) -> dict[str, int]:
        out = {}
        for pod in pods:
            n = 0
            for k in keys:
                held = self.blocks.get(k)
                if held is None or pod not in held:
                    break
                n += 1
            if n:
                out[pod] = n
        return out


def make_events(n: int, pods: int = 4, blocks: int = 4) -> list[tuple[str, list[int], int | None, list[int]]]:
    rng = random.Random(1)
    parents: dict[str, int | None] = {}
    out = []
    for i in range(n):
        pod = f"pod-{i % pods}"
        toks = [rng.randrange(30_000) for _ in range(blocks * BS)]
        hashes = [rng.getrandbits(64) for _ in range(blocks)]
        out.append((pod, hashes, parents.get(pod), toks))
        parents[pod] = hashes[-1]
    return out


def timed(fn, reps: int) -> float:
    """Median seconds of ``reps`` calls."""
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts)


def bench_ingest(n_events: int) -> dict[str, float]:
    events = make_events(n_events)
    n_blocks = sum(len(e[1]) for e in events)
    tp = TokenProcessor(block_size=BS)

    ix = KVBlockIndex(tp)
    t0 = time.perf_counter()
    for pod, hashes, parent, toks in events:
        ix.block_stored(pod, 0, hashes, parent, toks, "gpu", block_size=BS)
    direct = n_blocks / (time.perf_counter() - t0)

    peer = PeerIndex(tp)
    t0 = time.perf_counter()
    for pod, hashes, parent, toks in events:
        peer.block_stored(pod, hashes, parent, toks)
    peer_rate = n_blocks / (time.perf_counter() - t0)

    msgs = []
    seqs: dict[str, int] = {}
    for pod, hashes, parent, toks in events:
        ev = {"type": "BlockStored", "block_hashes": hashes, "parent_block_hash": parent, "token_ids": toks,
              "block_size": BS, "medium": "GPU", "lora_id": None, "lora_name": None}
        s = seqs.get(pod, 0)
        seqs[pod] = s + 1
        msgs.append(RawMessage(Source(), f"kv@{pod}@m".encode(), s.to_bytes(8, "big"),
                               msgspec.msgpack.encode([time.time(), [ev], 0])))
    rates = {}
    for shards in (1, 4):
        pool = EventPool(KVBlockIndex(tp), concurrency=shards, queue_size=len(msgs) + 10)
        pool.start()
        t0 = time.perf_counter()
        for m in msgs:
            pool.submit(m)
        pool.flush(120)
        rates[shards] = n_blocks / (time.perf_counter() - t0)
        assert pool.stats().blocks_stored == n_blocks
        pool.stop()
    return {"index_blocks_per_s": direct, "peer_blocks_per_s": peer_rate,
            "pool_1_shard_blocks_per_s": rates[1], "pool_4_shards_blocks_per_s": rates[4]}


def bench_read(reps: int, pods: int = 8, tokens: int = 8192) -> dict[str, float]:
    cfg = Config.from_dict({"model_name": "m", "token_processor_config": {"block_size": BS}})
    ix = Indexer(cfg)
    peer = PeerIndex(ix.token_processor)
    rng = np.random.default_rng(0)
    prompt = rng.integers(1, 30_000, size=tokens)
    plist = prompt.tolist()
    n_blocks = tokens // BS
    cands = [f"pod-{p}" for p in range(pods)]
    for p, pod in enumerate(cands):
        held = n_blocks * (p + 1) // pods
        eks = list(range(p * 10**6, p * 10**6 + held))
        ix.index.block_stored(pod, 0, eks, None, plist[: held * BS], "gpu", block_size=BS, model="m")
        for ek, rk in zip(eks, ix.request_keys(plist[: held * BS]).tolist()):
            peer.blocks.setdefault(rk, set()).add(pod)
    keys = ix.request_keys(prompt)
    klist = keys.tolist()
    assert {p: len(m) for p, m in ix.index.prefix_match(keys, cands).items()} == peer.prefix_match(klist, cands)
    return {
        "request_keys_numpy_us": timed(lambda: ix.request_keys(prompt), reps) * 1e6,
        "request_keys_list_us": timed(lambda: ix.request_keys(plist), reps) * 1e6,
        "prefix_match_us": timed(lambda: ix.index.prefix_match(keys, cands), reps) * 1e6,
        "peer_prefix_match_us": timed(lambda: peer.prefix_match(klist, cands), reps) * 1e6,
        "score_numpy_us": timed(lambda: ix.score(prompt, cands), reps) * 1e6,
        "score_list_us": timed(lambda: ix.score(plist, cands), reps) * 1e6,
    }


def plot(ingest: dict[str, float], read: dict[str, float], path: Path) -> None:
    """Two bar charts: ingest blocks/s and read-path microseconds, ours beside the peer."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    names = ["peer", "index", "pool x1", "pool x4"]
    vals = [ingest[k] for k in ("peer_blocks_per_s", "index_blocks_per_s", "pool_1_shard_blocks_per_s",
                                "pool_4_shards_blocks_per_s")]
    a.bar(names, vals, color=["grey", "C0", "C0", "C0"])
    a.set_title("ingest, blocks/s (higher is better)")
    names = ["peer match", "prefix_match", "request_keys", "score()"]
    vals = [read[k] for k in ("peer_prefix_match_us", "prefix_match_us", "request_keys_numpy_us", "score_numpy_us")]
    b.bar(names, vals, color=["grey", "C0", "C0", "C0"])
    b.set_title("8,192-token prompt, 8 pods, us (lower is better)")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--events", type=int, default=5000)
    ap.add_argument("--reps", type=int, default=200)
    args = ap.parse_args(argv)
    ingest = bench_ingest(args.events)
    read = bench_read(args.reps)
    print(f"ingest, {args.events} BlockStored events of 4 blocks (block size 16), 4 pods")
    print(f"  {'path':<28} {'blocks/s':>12} {'vs peer':>8}")
    peer = ingest["peer_blocks_per_s"]
    for name, key in (("peer (dict of sets)", "peer_blocks_per_s"), ("KVBlockIndex direct", "index_blocks_per_s"),
                      ("EventPool, 1 shard", "pool_1_shard_blocks_per_s"),
                      ("EventPool, 4 shards", "pool_4_shards_blocks_per_s")):
        print(f"  {name:<28} {ingest[key]:>12,.0f} {ingest[key] / peer:>8.2f}")
    print("read path, 8,192-token prompt (512 blocks), 8 candidate pods, median us")
    print(f"  {'step':<28} {'us':>12} {'vs peer':>8}")
    for name, key in (("request_keys (numpy in)", "request_keys_numpy_us"), ("request_keys (list in)", "request_keys_list_us"),
                      ("prefix_match", "prefix_match_us"), ("peer prefix match", "peer_prefix_match_us"),
                      ("score() (numpy in)", "score_numpy_us"), ("score() (list in)", "score_list_us")):
        ratio = read["peer_prefix_match_us"] / read[key] if key.startswith("prefix") else float("nan")
        print(f"  {name:<28} {read[key]:>12.1f} {ratio:>8.2f}")
    out = ROOT / "bench" / "out"
    out.mkdir(parents=True, exist_ok=True)
    (out / "index.json").write_text(json.dumps({"ingest": ingest, "read": read}, indent=2))
    plot(ingest, read, out / "index.png")
    print(f"wrote {out / 'index.json'} and {out / 'index.png'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
