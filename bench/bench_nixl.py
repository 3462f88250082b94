"""NIXL READ time vs number of blocks and block size, between two processes (UCX, DRAM); advisor thresholds.

A decode-side process holds a pool of KV blocks in NIXL-registered memory
(examples/nixl_kv.py: ``regions`` x blocks x block bytes, regions standing for
the K and V caches of the layers); this process READs ``n`` of them (random,
non-contiguous block ids: one descriptor per region and block) and checks the
bytes once per configuration.  Each configuration is timed ``--reps`` times
after one warm-up read; the figure is the median (and the minimum) in
milliseconds.

Peer in the same run: a plain in-process gather of the same blocks with numpy
(``np.take`` into a preallocated buffer), the floor of any copy;
``x peer`` = NIXL median / peer median (how many times slower than a local
memory copy the cross-process transfer is).

A least-squares line ``time = latency + bytes / bandwidth`` over every
configuration feeds :func:`connector.advisor.advise` for two models (their
assumed dimensions are printed): the break-even tokens and the recommended
``kv_recompute_threshold``, with the prefill cost per token taken from the
TTFT figures of vLLM PR #32553 (seed 000, prefix caching off on P).

First, the descriptor preparation vLLM's NIXL worker does for every request
it loads (:func:`prep_rows`: ``make_prepped_xfer`` by descriptor count, in
this process); ``bench/sim/pd.py`` uses its medians (``NIXL_PREP_S``).

Writes bench/out/nixl.json and bench/out/nixl.png.  Run under the engine lock:
``flock /tmp/kvindex-engines.lock .venv/bin/python bench/bench_nixl.py``.
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import statistics
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from connector.advisor import ModelKV, advise, fit_transfer_cost, prefill_cost_per_token  # noqa: E402
from examples.nixl_kv import DecodeProcess, PrefillAgent  # noqa: E402

OUT = ROOT / "bench" / "out"
REGIONS = 2
BLOCK_BYTES = (16 * 1024, 64 * 1024, 256 * 1024)
BLOCKS = (1, 4, 16, 64)
BS = 16

MODELS = [
    # Qwen3-32B: 64 layers, GQA 8 KV heads x head_dim 128, bf16 KV
    (ModelKV(name="Qwen3-32B-like", layers=64, kv_heads=8, head_dim=128, dtype_bytes=2),
     # TTFT with prefix caching off: 158 ms at 2k tokens, 778 ms at 24k
     prefill_cost_per_token(2_000, 0.158, 24_000, 0.778)),
    # GLM-5-like: MLA latent 512 + rope 64 = 576 values per token and layer, 78 layers, FP8 KV
    (ModelKV(name="GLM-5-like", layers=78, latent_dim=576, dtype_bytes=1),
     # GLM-5-FP8 TTFT off: 500 ms (read as at 2k tokens) -> 2,334 ms at 20k
     prefill_cost_per_token(2_000, 0.500, 20_000, 2.334)),
]


#: Descriptor preparation as vLLM's NixlConnector does it for one request on one tensor-parallel rank of
#: Qwen3-32B at TP 8: 128 regions (K and V of 64 layers), 16-token blocks of 1 KV head x 128 x bf16 = 4 KiB.
PREP_REGIONS = 128
PREP_BLOCK_BYTES = 4096
PREP_BLOCKS = (16, 64, 256, 512, 1024, 1600)


def prep_rows(reps: int) -> list[dict]:
    """Milliseconds ``make_prepped_xfer`` takes per READ, by descriptor count (median and min over ``reps``).

    vLLM's NIXL worker prepares both sides' descriptor lists once per remote
    engine (``prep_xfer_dlist`` over every region and block, at the handshake),
    then, for every request it loads, computes the descriptor ids of the
    request's blocks in every region and calls ``make_prepped_xfer`` before
    ``transfer``: CPU work on the worker's thread that grows with the blocks
    read and that NIXL's transfer telemetry (timed from the post) does not
    include.  Two agents in this process (the preparation is local work),
    random remote blocks, one warm-up; each READ is also completed and checked
    for state DONE."""
    from examples.nixl_kv import _agent

    nb = max(PREP_BLOCKS) + 100
    d, p = _agent("prep-d"), _agent("prep-p")
    dpool = np.ones((PREP_REGIONS, nb, PREP_BLOCK_BYTES), dtype=np.uint8)
    ppool = np.zeros_like(dpool)
    d.register_memory([(dpool.ctypes.data, dpool.nbytes, 0, "")], "DRAM")
    p.register_memory([(ppool.ctypes.data, ppool.nbytes, 0, "")], "DRAM")
    remote = p.add_remote_agent(d.get_agent_metadata())
    remote = remote.decode() if isinstance(remote, bytes) else remote

    def dlist(base: int) -> list[tuple[int, int, int]]:
        return [(base + (r * nb + b) * PREP_BLOCK_BYTES, PREP_BLOCK_BYTES, 0)
                for r in range(PREP_REGIONS) for b in range(nb)]

    local_h = p.prep_xfer_dlist("NIXL_INIT_AGENT", dlist(ppool.ctypes.data), "DRAM")
    remote_h = p.prep_xfer_dlist(remote, dlist(dpool.ctypes.data), "DRAM")
    region_base = np.arange(PREP_REGIONS)[:, None] * nb
    rng = np.random.default_rng(3)
    rows = []
    for n in PREP_BLOCKS:
        times = []
        for i in range(reps + 1):
            blocks = rng.choice(nb, size=n, replace=False)
            t0 = time.perf_counter()
            remote_ids = (region_base + blocks[None, :]).ravel()
            local_ids = (region_base + np.arange(n)[None, :]).ravel()
            h = p.make_prepped_xfer("READ", local_h, local_ids, remote_h, remote_ids, b"prep")
            t1 = time.perf_counter()
            state = p.transfer(h)
            while state not in ("DONE", "ERR"):
                state = p.check_xfer_state(h)
            p.release_xfer_handle(h)
            if state != "DONE":
                raise RuntimeError("NIXL READ failed")
            if i:  # the first is the warm-up
                times.append(t1 - t0)
        rows.append({"descriptors": n * PREP_REGIONS, "blocks": n, "prep_ms_median": statistics.median(times) * 1e3,
                     "prep_ms_min": min(times) * 1e3})
    p.release_dlist_handle(local_h)
    p.release_dlist_handle(remote_h)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=15)
    args = ap.parse_args()
    OUT.mkdir(parents=True, exist_ok=True)
    prep = prep_rows(args.reps)
    print(f"{'descriptors':>11} {'blocks':>6} {'prep ms':>8} {'min ms':>7} {'ns/desc':>7}")
    for r in prep:
        print(f"{r['descriptors']:>11} {r['blocks']:>6} {r['prep_ms_median']:>8.2f} {r['prep_ms_min']:>7.2f} "
              f"{r['prep_ms_median'] * 1e6 / r['descriptors']:>7.0f}")
    rows = []
    rng = random.Random(7)
    for bb in BLOCK_BYTES:
        pool_blocks = max(BLOCKS) * 4
        with DecodeProcess(pool_blocks, bb, REGIONS, name=f"bench-d-{bb}") as d:
            p = PrefillAgent(d.info, max(BLOCKS))
            try:
                tokens = list(range(pool_blocks * BS))
                params = d.retain(tokens, len(tokens), BS)
                ids_all = params["remote_block_ids"][0]
                # the peer: the same pool layout in this process, gathered with numpy
                local_pool = np.random.default_rng(1).integers(0, 255, (REGIONS, pool_blocks, bb), dtype=np.uint8)
                dst = np.empty((REGIONS, max(BLOCKS), bb), dtype=np.uint8)
                for n in BLOCKS:
                    pick = sorted(rng.sample(range(len(ids_all)), n))
                    ids = [ids_all[i] for i in pick]
                    p.read(ids)  # warm-up (connection set-up) and check once
                    for j, i in enumerate(pick):
                        upto = min((i + 1) * BS, len(tokens))
                        from examples.nixl_kv import block_content

                        assert np.array_equal(p.buf[0, j], block_content(tokens, upto, 0, bb)), "bad bytes"
                    t_nixl, t_peer = [], []
                    for _ in range(args.reps):
                        t_nixl.append(p.read(ids))
                        t0 = time.perf_counter()
                        np.take(local_pool, pick, axis=1, out=dst[:, :n])
                        t_peer.append(time.perf_counter() - t0)
                    nbytes = n * bb * REGIONS
                    med, peer = statistics.median(t_nixl), statistics.median(t_peer)
                    rows.append(
                        {
                            "block_bytes": bb,
                            "blocks": n,
                            "descriptors": n * REGIONS,
                            "bytes": nbytes,
                            "nixl_ms_median": med * 1e3,
                            "nixl_ms_min": min(t_nixl) * 1e3,
                            "peer_ms_median": peer * 1e3,
                            "x_peer": med / peer if peer > 0 else float("inf"),
                            "nixl_GBps": nbytes / med / 1e9,
                        }
                    )
            finally:
                p.close()

    print(f"{'block B':>9} {'blocks':>6} {'MiB':>8} {'nixl ms':>9} {'min ms':>8} {'GB/s':>7} {'peer ms':>8} {'x peer':>7}")
    for r in rows:
        print(
            f"{r['block_bytes']:>9} {r['blocks']:>6} {r['bytes'] / 2**20:>8.3f} {r['nixl_ms_median']:>9.3f} "
            f"{r['nixl_ms_min']:>8.3f} {r['nixl_GBps']:>7.2f} {r['peer_ms_median']:>8.3f} {r['x_peer']:>7.1f}"
        )
    fits = {
        "median": fit_transfer_cost([r["bytes"] for r in rows], [r["nixl_ms_median"] / 1e3 for r in rows]),
        "min": fit_transfer_cost([r["bytes"] for r in rows], [r["nixl_ms_min"] / 1e3 for r in rows]),
    }
    advice = []
    for which, cost in fits.items():
        print(f"\nfit on {which} times: latency {cost.latency_s * 1e3:.3f} ms + bytes / {cost.bytes_per_s / 1e9:.2f} GB/s")
        for model, c in MODELS:
            a = advise(model, c, cost, block_size=BS)
            advice.append({"fit": which, **msgspec_to_dict(a), "model_dims": msgspec_to_dict(model)})
            thr = a.recommended_threshold
            print(
                f"{model.name:>15}: KV {model.kv_bytes_per_token / 1024:.1f} KiB/token, prefill {c * 1e6:.1f} us/token, "
                f"transfer {a.transfer_s_per_token * 1e6:.2f} us/token -> break-even {a.break_even_tokens:.0f} tokens, "
                f"recommended kv_recompute_threshold {thr if thr is not None else 'none (pulling never pays)'}"
            )
    # For comparison, not measured here: the GPU link implied by vLLM PR #32553's seed-000 figures
    # (Qwen3-32B: a turn-2 transfer took 30 ms at 2k tokens and 130 ms at 24k tokens of KV).
    qwen_kv = MODELS[0][0].kv_bytes_per_token
    seed = fit_transfer_cost([2_000 * qwen_kv, 24_000 * qwen_kv], [0.030, 0.130])
    print(f"\nseed-000 GPU link (inferred, not measured here): latency {seed.latency_s * 1e3:.1f} ms + bytes / "
          f"{seed.bytes_per_s / 1e9:.1f} GB/s")
    for model, c in MODELS:
        a = advise(model, c, seed, block_size=BS)
        advice.append({"fit": "seed000_gpu_link", **msgspec_to_dict(a), "model_dims": msgspec_to_dict(model)})
        print(f"{model.name:>15}: break-even {a.break_even_tokens:.0f} tokens, recommended kv_recompute_threshold "
              f"{a.recommended_threshold}")
    result = {
        "machine": platform.platform(),
        "python": platform.python_version(),
        "regions": REGIONS,
        "reps": args.reps,
        "rows": rows,
        "prep": {"regions": PREP_REGIONS, "block_bytes": PREP_BLOCK_BYTES, "rows": prep},
        "fit": {k: {"latency_s": v.latency_s, "bytes_per_s": v.bytes_per_s} for k, v in fits.items()},
        "advice": advice,
    }
    (OUT / "nixl.json").write_text(json.dumps(result, indent=2))
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(6, 4))
        for bb in BLOCK_BYTES:
            rs = [r for r in rows if r["block_bytes"] == bb]
            ax.loglog([r["bytes"] for r in rs], [r["nixl_ms_median"] for r in rs], "o-", label=f"NIXL, {bb // 1024} KiB blocks")
            ax.loglog([r["bytes"] for r in rs], [r["peer_ms_median"] for r in rs], "x:", label=f"numpy gather, {bb // 1024} KiB")
        ax.set_xlabel("bytes read")
        ax.set_ylabel("ms (median)")
        ax.legend(fontsize=7)
        ax.set_title("NIXL READ across processes (UCX, DRAM)")
        fig.tight_layout()
        fig.savefig(OUT / "nixl.png", dpi=120)
    except ImportError:
        print("matplotlib not installed: no plot (pip install -e '.[bench]')")
    print(f"wrote {OUT / 'nixl.json'}")


def msgspec_to_dict(obj) -> dict:
    import msgspec

    return msgspec.to_builtins(obj)


if __name__ == "__main__":
    main()
