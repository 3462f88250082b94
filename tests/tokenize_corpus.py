"""Generated OpenAI request bodies for the tokenization equality tests.

``corpus(seed, n)`` returns ``n`` deterministic cases, each a
``(path, body)`` pair for /v1/chat/completions or /v1/completions: chat with
system prompts, multi-turn with assistant turns, tools and tool calls and tool
results, developer messages, text-part lists, special-token text,
continue_final_message, add_generation_prompt false, add_special_tokens,
chat_template_kwargs, documents; completions with text, token ids and batches.
Bodies hold no ``model`` and no sampling fields; the tests add those.
"""

from __future__ import annotations

import json
import random
from typing import Any

WORDS = (
    "the router pod engine block cache prefix token request index event score queue model "
    "memory layer head batch stream page table key value store hash chain window tier decode "
    "prefill transfer lease metric latency shard worker thread socket frame payload fleet"
).split()
ODD = ["<s>", "</s>", "<pad>", "<|im_start|>", "<|im_end|>", "<|eot_id|>", "  ", "\n", "\n\n", "\t",
       "café", "日本語", "🙂", "{\"json\": [1, 2]}", "x<s>y", "   leading", "trailing   ", "12345", "?!", "---"]
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Weather for a city.",
     "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}},
    {"type": "function", "function": {"name": "add", "parameters": {
        "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}}}},
    {"type": "function", "function": {"name": "noop"}},
]


def text(rng: random.Random, lo: int = 1, hi: int = 14) -> str:
    """A short text of words with, sometimes, special-token text, odd spacing or non-ASCII."""
    parts = []
    for _ in range(rng.randint(lo, hi)):
        parts.append(rng.choice(ODD) if rng.random() < 0.15 else rng.choice(WORDS))
    sep = rng.choice([" ", " ", " ", "", "\n"])
    out = sep.join(parts)
    return out.capitalize() if rng.random() < 0.5 else out


def _content(rng: random.Random) -> Any:
    if rng.random() < 0.2:
        return [{"type": "text", "text": text(rng)} for _ in range(rng.randint(1, 3))]
    return text(rng)


def _tool_call(rng: random.Random, i: int) -> dict[str, Any]:
    name, args = rng.choice([("get_weather", {"city": rng.choice(["Paris", "Oslo", "Lima"])}),
                             ("add", {"a": rng.randint(0, 99), "b": rng.randint(0, 99)}), ("noop", {})])
    arguments = json.dumps(args) if rng.random() < 0.9 else rng.choice(["", "not json", "[1]"])
    return {"id": f"call_{i}", "type": "function", "function": {"name": name, "arguments": arguments}}


def conversation(rng: random.Random, *, tools: bool) -> list[dict[str, Any]]:
    """System (sometimes), then user/assistant turns, with tool calls and results when ``tools``."""
    msgs: list[dict[str, Any]] = []
    if rng.random() < 0.6:
        msgs.append({"role": "system", "content": text(rng, 3, 12)})
    for turn in range(rng.randint(1, 2 if tools else 3)):
        msgs.append({"role": "user", "content": _content(rng)})
        if tools and rng.random() < 0.6:
            calls = [_tool_call(rng, turn * 10 + j) for j in range(rng.randint(1, 2))]
            msgs.append({"role": "assistant", "content": None, "tool_calls": calls})
            for c in calls:
                msgs.append({"role": "tool", "tool_call_id": c["id"], "content": text(rng, 1, 6)})
        msgs.append({"role": "assistant", "content": text(rng)})
    if rng.random() < 0.7:
        msgs.append({"role": "user", "content": _content(rng)})
    return msgs


def chat_case(rng: random.Random) -> dict[str, Any]:
    """One /v1/chat/completions body."""
    use_tools = rng.random() < 0.35
    body: dict[str, Any] = {"messages": conversation(rng, tools=use_tools)}
    if use_tools:
        body["tools"] = rng.sample(TOOLS, rng.randint(1, 2))
    r = rng.random()
    if r < 0.12 and body["messages"][-1]["role"] == "user":
        body["messages"].append({"role": "assistant", "content": text(rng)})
        body["continue_final_message"] = True
        body["add_generation_prompt"] = False
    elif r < 0.2:
        body["add_generation_prompt"] = False
    if rng.random() < 0.1:
        body["add_special_tokens"] = True
    if rng.random() < 0.35:
        kw: dict[str, Any] = rng.choice([{"enable_thinking": False}, {"enable_thinking": True},
                                         {"date_string": "1 Dec 2026"}, {"unused_flag": 3}])
        body["chat_template_kwargs"] = kw
    if rng.random() < 0.08:
        body["messages"].insert(0, {"role": "developer", "content": text(rng)})
    if rng.random() < 0.1:
        body["documents"] = [{"title": text(rng, 1, 3), "text": text(rng)} for _ in range(rng.randint(1, 2))]
    return body


def completion_case(rng: random.Random) -> dict[str, Any]:
    """One /v1/completions body: a text, ids, or a batch of either."""
    ids = rng.random() < 0.3  # a batch is all texts or all token ids (the engine's request schema)

    def one() -> Any:
        if ids:
            return [rng.randrange(3, 300) for _ in range(rng.randint(1, 40))]
        return text(rng, 1, 30)
    r = rng.random()
    body: dict[str, Any] = {"prompt": one() if r < 0.7 else [one() for _ in range(rng.randint(2, 3))]}
    if rng.random() < 0.2:
        body["add_special_tokens"] = False
    return body


def corpus(seed: int, n: int, *, chat_share: float = 0.75) -> list[tuple[str, dict[str, Any]]]:
    """``n`` cases (path, body), reproducible from ``seed``."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        if rng.random() < chat_share:
            out.append(("/v1/chat/completions", chat_case(rng)))
        else:
            out.append(("/v1/completions", completion_case(rng)))
    return out
