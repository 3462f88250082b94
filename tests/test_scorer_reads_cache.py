"""Which requests read the engine's prefix cache (scorer.reads_prefix_cache, used by the router)."""

from __future__ import annotations

import pytest

from scorer import reads_prefix_cache

CMPL, CHAT = "/v1/completions", "/v1/chat/completions"


@pytest.mark.parametrize(
    ("path", "body", "reads"),
    [
        (CMPL, {"prompt": [1, 2]}, True),
        (CMPL, {"prompt": [1, 2], "logprobs": 5}, True),  # sampled-token logprobs only
        (CMPL, {"prompt": [1, 2], "prompt_logprobs": 0}, False),
        (CMPL, {"prompt": [1, 2], "prompt_logprobs": None}, True),
        (CMPL, {"prompt": [1, 2], "echo": True}, True),  # echo without logprobs: no prompt logprobs
        (CMPL, {"prompt": [1, 2], "echo": True, "logprobs": 0}, False),
        (CMPL, {"prompt": [1, 2], "echo": False, "logprobs": 3}, True),
        (CHAT, {"messages": []}, True),
        (CHAT, {"messages": [], "logprobs": True, "top_logprobs": 5}, True),
        (CHAT, {"messages": [], "echo": True}, False),  # top_logprobs defaults to 0 in vLLM's chat request
        (CHAT, {"messages": [], "echo": True, "top_logprobs": None}, True),
        (CHAT, {"messages": [], "prompt_logprobs": 2}, False),
    ],
)
def test_reads_prefix_cache_follows_vllm_prompt_logprobs_rule(path: str, body: dict, reads: bool) -> None:
    assert reads_prefix_cache(path, body) is reads
