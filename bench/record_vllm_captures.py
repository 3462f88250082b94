"""Record vLLM 0.33 / 0.34 KV-event captures and lookahead block hashes as test data.

    python bench/record_vllm_captures.py SRC_0_33 SRC_0_34

``SRC_*``: folders holding the unpacked ``vllm`` package of the released wheels
(``pip download --no-deps vllm==0.33.0``, then ``unzip ... 'vllm/*.py'``).  No
vLLM is installed: bench/vllm_wheel_source.py loads the event structs and the
pure hashing functions from those files.  Writes:

* tests/data/vllm033_capture_events.json, tests/data/vllm034_capture_events.json:
  ZMQ messages (topic, sequence frame, payload) encoded as vLLM's
  ``ZmqEventPublisher`` does (``msgspec.msgpack.Encoder().encode(KVEventBatch)``,
  ``seq.to_bytes(8, "big")``; kv_events.py l.486-511), with the events they hold;
* tests/data/vllm_lookahead_block_hashes.json: block hashes computed by 0.33's
  ``get_request_block_hasher`` with L = 0, 1, 2, 3 lookahead tokens (checked
  equal under 0.34's code).

Read by tests/test_wire_vllm033.py and tests/test_vllm_lookahead_hashes.py.
"""

from __future__ import annotations

import json
import os
import random
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from record_vllm_hashes import jsonable  # noqa: E402  (tuples -> lists, bytes -> hex; no vLLM import)
from vllm_wheel_source import LoRA, MMFeature, Request, load_event_structs, load_hashing  # noqa: E402

DATA = Path(__file__).resolve().parent.parent / "tests" / "data"
TOPIC = "kv@pod-a@tiny-llama"


def _hash_cases() -> list[dict[str, Any]]:
    rng = random.Random(20261204)
    short = [rng.randrange(0, 32000) for _ in range(45)]
    medium = [rng.randrange(0, 152000) for _ in range(100)]
    cases: list[dict[str, Any]] = []
    for la in (0, 1, 2, 3):
        cases += [
            {"name": f"short_bs16_L{la}", "block_size": 16, "tokens": short, "lookahead": la},
            {"name": f"exact_bs16_L{la}", "block_size": 16, "tokens": short[:32], "lookahead": la},
            {"name": f"medium_bs32_L{la}", "block_size": 32, "tokens": medium, "lookahead": la},
            {"name": f"salt_bs16_L{la}", "block_size": 16, "tokens": medium, "lookahead": la,
             "cache_salt": "tenant-7"},
            {"name": f"lora_bs16_L{la}", "block_size": 16, "tokens": medium, "lookahead": la,
             "lora": ["sql-adapter", "/adapters/sql-adapter-v3"]},
            # items inside a block, across a boundary, and starting inside the next block's first tokens
            {"name": f"mm_bs16_L{la}", "block_size": 16, "tokens": medium, "lookahead": la,
             "mm": [["img-7f3a9c", 5, 20], ["img-11be02", 32, 4], ["aud-90cd44", 49, 3]]},
            {"name": f"lora_mm_salt_bs16_L{la}", "block_size": 16, "tokens": medium, "lookahead": la,
             "lora": ["chat", "/adapters/chat"], "mm": [["img-c0ffee", 16, 30]], "cache_salt": "org-42"},
        ]
    return cases


def _request(case: dict[str, Any]) -> Request:
    mm = [MMFeature(i, o, n) for i, o, n in case.get("mm", [])]
    lora = LoRA(*case["lora"]) if case.get("lora") else None
    return Request(case["tokens"], mm, lora, case.get("cache_salt"))


def _hash_case(h: Any, case: dict[str, Any], algo: str, seed: str | None) -> dict[str, Any]:
    """One case through vLLM's hasher, plus the per-block event fields the block pool would publish."""
    fn = h.sha256_cbor if algo == "sha256_cbor" else h.sha256
    if seed is None:
        os.environ.pop("PYTHONHASHSEED", None)
    else:
        os.environ["PYTHONHASHSEED"] = seed
    h.globals["init_none_hash"](fn)
    bs, la = case["block_size"], case["lookahead"]
    req = _request(case)
    digests = h.get_request_block_hasher(bs, fn, la)(req)
    extras: list[Any] = []
    mm_idx = 0
    for i in range(len(digests)):  # as BlockPool._generate_event_extra_keys (0.33 block_pool.py l.358-366)
        s, e = i * bs, (i + 1) * bs
        if la:
            ek, mm_idx = h.generate_lookahead_block_hash_extra_keys(req, s, e, e + la, mm_idx)
        else:
            ek, mm_idx = h.generate_block_hash_extra_keys(req, s, e, mm_idx)
        extras.append(ek)
    return {
        "name": case["name"], "algorithm": algo, "engine_hash_seed": seed, "block_size": bs,
        "lookahead": la, "tokens": case["tokens"], "cache_salt": case.get("cache_salt"),
        "lora": case.get("lora"),
        "event_extra_keys": jsonable(h.to_event_extra_keys(extras)),
        "lookahead_token_ids": [case["tokens"][(i + 1) * bs:(i + 1) * bs + la] for i in range(len(digests))]
        if la else None,
        "block_hashes": [h.maybe_convert_block_hash(d) for d in digests],
        "digests_hex": [d.hex() for d in digests],
    }


def record_hashes(h33: Any, h34: Any) -> list[dict[str, Any]]:
    out = []
    for algo in ("sha256_cbor", "sha256"):
        for seed in (None, "4242"):
            for case in _hash_cases():
                rec = _hash_case(h33, case, algo, seed)
                if _hash_case(h34, case, algo, seed) != rec:
                    raise SystemExit(f"0.33 and 0.34 disagree on {case['name']}")
                out.append(rec)
    os.environ.pop("PYTHONHASHSEED", None)
    return out


def _stored(ev: Any, rec: dict[str, Any], **kw: Any) -> Any:
    bs = rec["block_size"]
    n = len(rec["block_hashes"])
    lora = rec["lora"]
    extras = rec["event_extra_keys"]
    return ev.BlockStored(
        block_hashes=rec["block_hashes"], parent_block_hash=None, token_ids=rec["tokens"][: n * bs],
        block_size=bs, lora_id=1 if lora else None, medium="GPU", lora_name=lora[0] if lora else None,
        extra_keys=None if extras is None else [None if e is None else tuple(e) for e in extras],
        lookahead_token_ids=rec["lookahead_token_ids"], **kw,
    )


def _messages(ev: Any, recs: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    """Batches as an engine publishes them: plain, hybrid groups, removal, clear, digest hashes."""
    la = recs["lora_mm_salt_bs16_L1"]
    hyb = recs["medium_bs32_L2"]
    half = len(hyb["block_hashes"]) // 2
    batches = [
        ("lookahead_lora_mm_salt", ev.KVEventBatch(ts=1764806400.25, events=[_stored(ev, la, group_idx=0)]), None),
        ("plain_no_lookahead", ev.KVEventBatch(ts=1764806400.5, events=[_stored(
            ev, recs["short_bs16_L0"], group_idx=0, kv_cache_spec_kind="full_attention")],
            data_parallel_rank=0), None),
        ("hybrid_groups_lookahead", ev.KVEventBatch(ts=1764806401.0, events=[
            _stored(ev, hyb, group_idx=0, kv_cache_spec_kind="full_attention", session_id="sess-1"),
            _stored(ev, hyb, group_idx=1, kv_cache_spec_kind="sliding_window",
                    kv_cache_spec_sliding_window=64, locality="LOCAL"),
        ], data_parallel_rank=1), None),
        ("removed_and_cleared", ev.KVEventBatch(ts=1764806402.0, events=[
            ev.BlockRemoved(block_hashes=hyb["block_hashes"][half:], medium="GPU", group_idx=1),
            ev.BlockRemoved(block_hashes=hyb["block_hashes"][:1], medium="CPU", group_idx=0, ownership="lmcache"),
            ev.AllBlocksCleared(),
        ], data_parallel_rank=1), None),
        ("digest_hashes_lookahead", ev.KVEventBatch(ts=1764806403.0, events=[ev.BlockStored(
            block_hashes=[bytes.fromhex(d) for d in recs["short_bs16_L3"]["digests_hex"]],
            parent_block_hash=None, token_ids=recs["short_bs16_L3"]["tokens"][:32], block_size=16,
            lora_id=None, medium="GPU", lora_name=None, group_idx=0,
            lookahead_token_ids=recs["short_bs16_L3"]["lookahead_token_ids"])]), "bytes hashes "
         "(VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0)"),
    ]
    enc = __import__("msgspec").msgpack.Encoder()
    out = []
    for seq, (name, batch, note) in enumerate(batches):
        out.append({
            "name": name, "note": note, "topic": TOPIC, "seq_hex": seq.to_bytes(8, "big").hex(),
            "payload_hex": enc.encode(batch).hex(), "source_cases": sorted(
                {r["name"] for r in recs.values() if any(
                    getattr(e, "block_hashes", None) == r["block_hashes"] for e in batch.events)}),
        })
    return out


def main() -> None:
    src33, src34 = Path(sys.argv[1]), Path(sys.argv[2])
    h33, hlines = load_hashing(src33)
    h34, _ = load_hashing(src34)
    hashes = record_hashes(h33, h34)
    (DATA / "vllm_lookahead_block_hashes.json").write_text(json.dumps({
        "source": "vllm 0.33.0 wheel, loaded without installing: vllm/v1/core/kv_cache_utils.py "
                  "get_request_block_hasher (equal under 0.34.0)",
        "lines": hlines, "cases": hashes}, indent=1) + "\n")
    by_name = {r["name"]: r for r in hashes if r["algorithm"] == "sha256_cbor" and r["engine_hash_seed"] is None}
    for ver, src in (("033", src33), ("034", src34)):
        ev, lines = load_event_structs(src)
        doc = {
            "source": f"vllm 0.{ver[1:]}.0 wheel: vllm/distributed/kv_events.py structs, encoded with "
                      "msgspec.msgpack.Encoder as ZmqEventPublisher does; hashes from "
                      "tests/data/vllm_lookahead_block_hashes.json (sha256_cbor, no PYTHONHASHSEED)",
            "lines": lines, "messages": _messages(ev, by_name),
        }
        (DATA / f"vllm{ver}_capture_events.json").write_text(json.dumps(doc, indent=1) + "\n")
    print(f"wrote {len(hashes)} hash cases and the 0.33 / 0.34 captures to {DATA}")


if __name__ == "__main__":
    main()
