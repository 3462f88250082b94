"""Deterministic prompts for the real-engine tests (the tiny model's tokenizer reserves ids 0-2)."""

from __future__ import annotations

import random

VOCAB = (
    "a router that knows which pod holds the blocks of a prompt sends the request "
    "there and the engine skips the prefill of every cached token in that prefix"
).split()


def token_prompt(seed: str, length: int) -> list[int]:
    """Deterministic token ids in [3, 600) (0-2 are the tokenizer's special tokens)."""
    rng = random.Random(seed)
    return [rng.randrange(3, 600) for _ in range(length)]


def text_prompt(seed: str, words: int) -> str:
    """Deterministic English-like text."""
    rng = random.Random(seed)
    return " ".join(rng.choice(VOCAB) for _ in range(words))
