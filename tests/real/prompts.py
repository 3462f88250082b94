"""Deterministic prompts for the real-engine tests (the tiny model's tokenizer reserves ids 0-2).

``VOCAB`` made the text prompts recorded in tests/data/vllm_live_events.json:
changing it changes those prompts (re-record with KVINDEX_RECORD_LIVE=1).
"""

from __future__ import annotations

import random

VOCAB = (
    "the router sends each request to the pod that already holds the longest "
    "prefix of its blocks so that the engine can skip the prefill of cached tokens"
).split()

ROUTER_VOCAB = (
    "a router that knows which pod holds the blocks of a prompt sends the request "
    "there and the engine skips the prefill of every cached token in that prefix"
).split()


def token_prompt(seed: str, length: int) -> list[int]:
    """Deterministic token ids in [3, 600) (0-2 are the tokenizer's special tokens)."""
    rng = random.Random(seed)
    return [rng.randrange(3, 600) for _ in range(length)]


def text_prompt(seed: str, words: int, vocab: list[str] = VOCAB) -> str:
    """Deterministic English-like text of ``words`` words drawn from ``vocab``."""
    rng = random.Random(seed)
    return " ".join(rng.choice(vocab) for _ in range(words))
