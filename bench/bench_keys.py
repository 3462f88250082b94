"""Request-key latency of kvindex.keys.TokenProcessor (read path, step 1).

For prompts of 1,024, 8,192 and 32,768 random token ids (ids < 152,000) at
block size 16, times ``request_keys`` with the ``xxh3_chain`` algorithm (the
tokens given as an int64 numpy array and as a Python list) and with the two
engine-compatible algorithms (``vllm_sha256_cbor``, ``vllm_sha256``: one
SHA-256 per block, as vLLM computes them).

Peer in the same run: the plain way to chain a 64-bit hash over blocks, a
Python loop over the blocks calling ``xxhash.xxh3_64_intdigest(block bytes,
seed=previous key)`` on the int64 array's bytes; the ``x peer`` column is the
peer's median time divided by ours (> 1 means we are faster).

Every figure is the median (and the minimum, a steadier figure on a shared
machine) over repetitions of the mean time of one call in a batch of about
5 ms of calls, in microseconds; the implementations take turns batch by batch.
``x peer`` uses the medians.  Prints a table and writes
bench/out/keys.json.  Run: ``.venv/bin/python bench/bench_keys.py [--seconds 1.0]``.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import xxhash

from kvindex.keys import TokenProcessor

BLOCK_SIZE = 16
SIZES = (1_024, 8_192, 32_768)
OUT = Path(__file__).resolve().parent / "out" / "keys.json"


def peer_keys(tokens: np.ndarray, block_size: int, seed: int = 0) -> np.ndarray:
    """Scalar chained xxh3_64 over blocks: the straightforward implementation."""
    n = tokens.shape[0] // block_size
    data = tokens[: n * block_size].astype(np.int64, copy=False).tobytes()
    step = block_size * 8
    out = np.empty(n, dtype=np.uint64)
    h = seed
    for i in range(n):
        h = xxhash.xxh3_64_intdigest(data[i * step : (i + 1) * step], seed=h)
        out[i] = h
    return out


def median_us(
    fns: dict[str, Callable[[], Any]], seconds: float
) -> dict[str, tuple[float, float]]:
    """Per function: (median, min) over repetitions of the per-call time (us) of a batch.

    The functions take turns, one batch each per round, so a change in the
    machine's load during the run affects all of them alike.
    """
    batches = {}
    for name, fn in fns.items():
        t0 = time.perf_counter()
        fn()
        one = max(time.perf_counter() - t0, 1e-7)
        batches[name] = max(1, int(0.005 / one))  # about 5 ms per batch
    rounds = max(9, int(seconds / (0.005 * len(fns))))
    samples: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            batch = batches[name]
            t0 = time.perf_counter()
            for _ in range(batch):
                fn()
            samples[name].append((time.perf_counter() - t0) / batch * 1e6)
    return {name: (statistics.median(v), min(v)) for name, v in samples.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seconds", type=float, default=1.0, help="seconds of timing per implementation and size")
    args = ap.parse_args()

    rng = np.random.default_rng(20261130)
    xxh = TokenProcessor(block_size=BLOCK_SIZE, hash_seed="bench")
    cbor = TokenProcessor(block_size=BLOCK_SIZE, algorithm="vllm_sha256_cbor")
    pick = TokenProcessor(block_size=BLOCK_SIZE, algorithm="vllm_sha256")
    rows = []
    for size in SIZES:
        arr = rng.integers(0, 152_000, size=size, dtype=np.int64)
        lst = arr.tolist()
        peer_name = "peer: xxh3_64 loop per block (numpy)"
        cases = {
            peer_name: lambda: peer_keys(arr, BLOCK_SIZE),
            "xxh3_chain (numpy int64)": lambda: xxh.request_keys(arr),
            "xxh3_chain (list)": lambda: xxh.request_keys(lst),
            "xxh3_chain (numpy, model+lora)": lambda: xxh.request_keys(arr, model="m", lora="a"),
            "vllm_sha256_cbor (list)": lambda: cbor.request_keys(lst),
            "vllm_sha256 (list)": lambda: pick.request_keys(lst),
        }
        times = median_us(cases, args.seconds * len(cases))
        for name, (us, best) in times.items():
            rows.append({"tokens": size, "blocks": size // BLOCK_SIZE, "impl": name,
                         "median_us": us, "min_us": best,
                         "x_peer": times[peer_name][0] / us})

    print(f"request_keys, block size {BLOCK_SIZE}; median us per call; x peer = peer time / ours")
    print(f"{'tokens':>7} {'blocks':>6}  {'implementation':<38} "
          f"{'median us':>10} {'min us':>9} {'x peer':>7}")
    for r in rows:
        print(f"{r['tokens']:>7} {r['blocks']:>6}  {r['impl']:<38} {r['median_us']:>10.1f} "
              f"{r['min_us']:>9.1f} {r['x_peer']:>7.2f}")
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(json.dumps({
        "bench": "request_keys",
        "block_size": BLOCK_SIZE,
        "unit": "microseconds per call (median and min over batches)",
        "peer": "Python loop over blocks of xxhash.xxh3_64_intdigest(block bytes, seed=previous)",
        "machine": {"python": platform.python_version(), "numpy": np.__version__,
                    "processor": platform.processor() or platform.machine()},
        "rows": rows,
    }, indent=1) + "\n")
    print(f"wrote {OUT}")


if __name__ == "__main__":
    main()
