"""A small tokenizer folder for the tokenization tests (no download, no torch).

A byte-level BPE trained here on the corpus words, with special tokens as chat
models have them (``<|im_start|>``, ``<|im_end|>``, ``<s>``, ``</s>``), one
added token that strips the spaces before it (``<|lstrip|>``, never a cut
point) and one that contains another (``<|im_end|>!``), saved through
transformers with a ChatML-style chat template.
"""

from __future__ import annotations

from pathlib import Path

from tests.tokenize_corpus import ODD, WORDS

SPECIAL = ["<s>", "</s>", "<|im_start|>", "<|im_end|>"]
CHATML = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def make_tokenizer_dir(out: Path, *, chat_template: str = CHATML) -> Path:
    """Write tokenizer.json + tokenizer_config.json into ``out``; return ``out``."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=600, special_tokens=SPECIAL, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    lines = [" ".join(WORDS[i:] + WORDS[:i]) for i in range(len(WORDS))] + ODD
    tok.train_from_iterator(lines, trainer)
    tok.add_special_tokens([AddedToken("<|lstrip|>", lstrip=True, normalized=False, special=True),
                            AddedToken("<|im_end|>!", normalized=False, special=True)])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>")
    fast.chat_template = chat_template
    out.mkdir(parents=True, exist_ok=True)
    fast.save_pretrained(str(out))
    return out
