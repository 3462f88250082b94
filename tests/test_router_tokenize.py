"""The reference router tokenizes locally when configured (examples/router/app.py, kvindex.tokenize).

The fallback to an engine's /tokenize for requests the library cannot
reproduce is exercised against real engines in tests/real/fleet/test_router.py.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import msgspec
import pytest

import transformers  # noqa: E402,F401  (the extra kvindex[tokenize]; make test installs it)

from examples.router.app import EngineSpec, Router, RouterConfig, TokenizerSpec  # noqa: E402
from kvindex.tokenize import RequestTokenizer  # noqa: E402
from tests.tokenize_model import make_tokenizer_dir  # noqa: E402


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tokenizer_dir(tmp_path_factory.mktemp("tok"))


def _router(model_dir: Path) -> Router:
    engine = EngineSpec(pod="pod-0", url="http://127.0.0.1:9", endpoint="tcp://127.0.0.1:9")
    return Router(RouterConfig(engines=[engine], tokenizer=TokenizerSpec(model_dir=str(model_dir))))


def test_chat_and_text_completions_are_tokenized_in_the_router(model_dir: Path) -> None:
    router = _router(model_dir)
    ref = RequestTokenizer(model_dir, cache_entries=0)
    chat = {"model": "m", "messages": [{"role": "user", "content": "which pod?"}]}
    ids, source = asyncio.run(router.prompt_token_ids("/v1/chat/completions", chat))
    assert source == "local" and ids == ref.chat(chat).token_ids
    batch = {"model": "m", "prompt": ["router pod", "other"]}
    ids, source = asyncio.run(router.prompt_token_ids("/v1/completions", batch))
    assert source == "local" and ids == ref.completion(batch).prompts[0]  # a batch is scored on its first prompt
    text = router.registry.get_sample_value("kvindex_router_local_tokenize_total", {"result": "exact"})
    assert text == 2


def test_the_tokenizer_section_reads_from_config_files(model_dir: Path) -> None:
    data = {"engines": [{"pod": "p", "url": "http://h:1", "endpoint": "tcp://h:2"}],
            "tokenizer": {"model_dir": str(model_dir), "chat_template": "{{ messages }}"}}
    config = msgspec.convert(data, RouterConfig)
    assert config.tokenizer is not None and config.tokenizer.chat_template == "{{ messages }}"
    with pytest.raises(msgspec.ValidationError):
        msgspec.convert({**data, "tokenizer": {"model_dir": "x", "chat_templat": "typo"}}, RouterConfig)


def test_an_answer_with_cached_tokens_is_reported_as_truth(model_dir: Path) -> None:
    from examples.router.app import Decision
    from kvindex import Config, Indexer

    router = _router(model_dir)
    router.indexer = Indexer(Config())
    d = Decision(id=1, path="/v1/completions", policy="kvindex", pod="pod-0", token_source="local", prompt_tokens=100,
                 request_blocks=3, matched_tokens=96, predicted_cached_tokens=96, matched={}, totals={}, stream=False)
    router.report_truth(d, msgspec.json.encode({"usage": {"prompt_tokens_details": {"cached_tokens": 64}}}))
    router.report_truth(d, b'{"usage": {"prompt_tokens": 100}}')  # no details: not reported
    router.report_truth(d, b"not json")
    t = router.indexer.prediction_truth()["pod-0"]
    assert (t.requests, t.predicted, t.confirmed, t.over) == (1, 96, 64, 32)


def test_token_id_prompts_are_used_as_given(model_dir: Path) -> None:
    router = _router(model_dir)
    ids, source = asyncio.run(router.prompt_token_ids("/v1/completions", {"prompt": [[5, 6, 7], "x"]}))
    assert (ids, source) == ([5, 6, 7], "token_ids")
