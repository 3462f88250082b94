"""Decode rate of the vLLM and SGLang payload decoders (write path, step 1).

A realistic vLLM batch: 4 BlockStored events of 1, 3, 5 and 8 blocks at block
size 16 (uint64 hashes, about half >= 2**63; token ids; medium "GPU") plus one
BlockRemoved of 4 blocks; encoded as current vLLM does (tagged maps, default
fields omitted) and as older vLLM did (positional arrays).  SGLang publishes
one page per BlockStored, so its batch is the same 17 stored blocks as 17
one-block events plus a 4-block removal as 4 events.

Peer in the same run: ``msgspec.msgpack.decode`` of the same bytes into plain
Python objects (no schema, no validation, no domain events), the floor of any
msgpack decoder; the table reports our rate as a ratio of it.

Prints a table and writes bench/out/decode.json.  Run:
``.venv/bin/python bench/bench_decode.py [--seconds 1.0]``.
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import time
from pathlib import Path

import msgspec

from kvevents.sglang import decode_sglang_batch
from kvevents.wire import decode_vllm_batch

BLOCK_SIZE = 16
STORED_BLOCKS = (1, 3, 5, 8)
REMOVED_BLOCKS = 4


def _payloads(rng: random.Random) -> dict[str, tuple[bytes, int]]:
    def h() -> int:
        return rng.getrandbits(64)

    stored = []
    parent = None
    for n in STORED_BLOCKS:
        hashes = [h() for _ in range(n)]
        toks = [rng.randrange(150_000) for _ in range(n * BLOCK_SIZE)]
        stored.append((hashes, parent, toks))
        parent = hashes[-1]
    removed = [h() for _ in range(REMOVED_BLOCKS)]
    blocks = sum(STORED_BLOCKS) + REMOVED_BLOCKS
    ts = time.time()

    vllm_map = [
        {"type": "BlockStored", "block_hashes": hs, "parent_block_hash": p, "token_ids": t,
         "block_size": BLOCK_SIZE, "lora_id": None, "medium": "GPU", "lora_name": None}
        for hs, p, t in stored
    ] + [{"type": "BlockRemoved", "block_hashes": removed, "medium": "GPU"}]
    vllm_arr = [
        ["BlockStored", hs, p, t, BLOCK_SIZE, None, "GPU"] for hs, p, t in stored
    ] + [["BlockRemoved", removed, "GPU"]]

    sgl = []
    for hs, p, t in stored:
        for i, hh in enumerate(hs):
            signed = hh - 2**64 if hh >= 2**63 else hh
            sgl.append(["BlockStored", [signed], p, t[i * BLOCK_SIZE:(i + 1) * BLOCK_SIZE], BLOCK_SIZE, None, "GPU"])
            p = signed
    sgl += [["BlockRemoved", [hh - 2**64 if hh >= 2**63 else hh], "GPU"] for hh in removed]

    enc = msgspec.msgpack.encode
    return {
        "vllm map": (enc([ts, vllm_map, 0]), blocks),
        "vllm array": (enc([ts, vllm_arr, 0]), blocks),
        "sglang array": (enc([ts, sgl, 0]), blocks),
    }


def _rate(fn, payload: bytes, seconds: float) -> float:
    """Calls per second of fn(payload), best of 3 runs of ~seconds/3."""
    n = 1
    while True:  # calibrate
        t0 = time.perf_counter()
        for _ in range(n):
            fn(payload)
        dt = time.perf_counter() - t0
        if dt > 0.05:
            break
        n *= 2
    per_run = max(1, int(n * (seconds / 3) / dt))
    best = 0.0
    for _ in range(3):
        t0 = time.perf_counter()
        for _ in range(per_run):
            fn(payload)
        best = max(best, per_run / (time.perf_counter() - t0))
    return best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seconds", type=float, default=1.0, help="measuring time per row (s)")
    ap.add_argument("--out", default=str(Path(__file__).parent / "out" / "decode.json"))
    args = ap.parse_args()

    payloads = _payloads(random.Random(7))
    decoders = {"vllm map": decode_vllm_batch, "vllm array": decode_vllm_batch, "sglang array": decode_sglang_batch}
    raw = msgspec.msgpack.Decoder()
    rows = []
    for name, (payload, blocks) in payloads.items():
        batch = decoders[name](payload)  # sanity: decodes
        assert sum(len(getattr(e, "block_hashes", ())) for e in batch.events) == blocks
        ours = _rate(decoders[name], payload, args.seconds)
        peer = _rate(raw.decode, payload, args.seconds)
        rows.append({
            "form": name, "payload_bytes": len(payload), "events": len(batch.events),
            "blocks": blocks, "batches_per_s": ours, "blocks_per_s": ours * blocks,
            "us_per_batch": 1e6 / ours, "untyped_msgpack_batches_per_s": peer,
            "ratio_vs_untyped": ours / peer,
        })

    hdr = f"{'form':<13} {'bytes':>6} {'events':>6} {'blocks':>6} {'batches/s':>11} {'blocks/s':>12} {'us/batch':>9} {'untyped/s':>11} {'ratio':>6}"
    print(hdr)
    print("-" * len(hdr))
    for r in rows:
        print(f"{r['form']:<13} {r['payload_bytes']:>6} {r['events']:>6} {r['blocks']:>6} "
              f"{r['batches_per_s']:>11,.0f} {r['blocks_per_s']:>12,.0f} {r['us_per_batch']:>9.1f} "
              f"{r['untyped_msgpack_batches_per_s']:>11,.0f} {r['ratio_vs_untyped']:>6.2f}")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({
        "bench": "decode", "block_size": BLOCK_SIZE, "stored_blocks_per_event": STORED_BLOCKS,
        "removed_blocks": REMOVED_BLOCKS, "msgspec": msgspec.__version__,
        "python": platform.python_version(), "seconds_per_row": args.seconds, "rows": rows,
    }, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
