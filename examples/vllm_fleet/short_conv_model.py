"""Generate a tiny Mamba-family hybrid (LFM2: a short-convolution layer, then full attention).

Run it with the vLLM virtualenv's interpreter (it needs torch and transformers)::

    ~/.cache/kvindex/vllm-venv/bin/python examples/vllm_fleet/short_conv_model.py --base DIR --out DIR

``--base`` is the generated test model (make_model.py): its tokenizer, chat
template and special ids are reused (symlinks). The new ``config.json`` +
``model.safetensors`` hold an ``Lfm2ForCausalLM`` with hidden size 256, layer 0
a short convolution (vLLM gives it a ``MambaSpec`` KV-cache group: its state
is cached at block boundaries in "align" mode, vllm/model_executor/models/config.py),
layer 1 full attention (4 heads, 2 KV heads), random weights from a fixed
seed, bfloat16. The convolution state (256 x 2 values) is far smaller than one
32-token attention page, so vLLM keeps ``--block-size`` 32 for both groups
(it pads the state page up to the attention page: vllm/platforms/interface.py).

vLLM 0.32's lfm2.py reads ``conv_dim`` and ``block_dim``, which transformers'
``Lfm2Config`` no longer writes: they are added (= hidden size).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

MARKER = "kvindex-short-conv.json"
RECIPE = {"hidden_size": 256, "intermediate_size": 512, "layer_types": ["conv", "full_attention"],
          "num_attention_heads": 4, "num_key_value_heads": 2, "conv_L_cache": 3, "seed": 5, "dtype": "bfloat16"}
SHARED = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json")


def is_complete(out: Path) -> bool:
    """Whether ``out`` holds a model built from :data:`RECIPE`."""
    try:
        return json.loads((out / MARKER).read_text()) == RECIPE and (out / "model.safetensors").is_file()
    except (OSError, ValueError):
        return False


def build(base: Path, out: Path) -> Path:
    """Write the model into ``out`` (nothing when it is complete); returns ``out``."""
    if is_complete(out):
        return out
    import torch
    from transformers import Lfm2Config, Lfm2ForCausalLM

    src = json.loads((base / "config.json").read_text())
    torch.manual_seed(RECIPE["seed"])
    config = Lfm2Config(
        vocab_size=src["vocab_size"], num_hidden_layers=len(RECIPE["layer_types"]),
        max_position_embeddings=src["max_position_embeddings"], bos_token_id=src["bos_token_id"],
        eos_token_id=src["eos_token_id"], pad_token_id=src["pad_token_id"], tie_word_embeddings=True,
        **{k: v for k, v in RECIPE.items() if k not in ("seed", "dtype")},
    )
    model = Lfm2ForCausalLM(config).to(getattr(torch, RECIPE["dtype"]))
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(out), safe_serialization=True)
    written = json.loads((out / "config.json").read_text())
    written.update(conv_dim=RECIPE["hidden_size"], block_dim=RECIPE["hidden_size"])
    (out / "config.json").write_text(json.dumps(written, indent=2) + "\n")
    for name in SHARED:
        link = out / name
        if (base / name).exists() and not (link.exists() or link.is_symlink()):
            link.symlink_to((base / name).resolve())
    (out / MARKER).write_text(json.dumps(RECIPE))
    return out


def main(argv: list[str] | None = None) -> int:
    """Command line: build the model, print its folder."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base", type=Path, required=True, help="the generated test model (make_model.py)")
    parser.add_argument("--out", type=Path, required=True, help="model folder to write")
    args = parser.parse_args(argv)
    print(build(args.base, args.out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
