"""The reference router tokenizes locally when configured (examples/router/app.py, kvindex.tokenize).

The fallback to an engine's /tokenize for requests the library cannot
reproduce is exercised against real engines in tests/real/fleet/test_router.py.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

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


def _sse(*chunks: object) -> bytes:
    return b"".join(b"data: " + msgspec.json.encode(c) + b"\n\n" for c in chunks) + b"data: [DONE]\n\n"


def test_a_streamed_answer_reports_its_usage_chunk() -> None:
    from examples.router.answers import answer_cached_tokens

    usage = {"choices": [], "usage": {"prompt_tokens": 90, "prompt_tokens_details": {"cached_tokens": 64}}}
    text = {"choices": [{"index": 0, "text": "usage"}]}  # the word in a text chunk is not a usage chunk
    assert answer_cached_tokens(_sse(text, usage), streamed=True) == 64
    assert answer_cached_tokens(_sse(text, {"choices": [], "usage": {"prompt_tokens": 90}}), streamed=True) is None
    assert answer_cached_tokens(_sse(text), streamed=True) is None
    assert answer_cached_tokens(b'data: {"usage": ', streamed=True) is None  # cut: not reported
    details = {"usage": {"prompt_tokens_details": {"cached_tokens": -1}}}
    assert answer_cached_tokens(msgspec.json.encode(details), streamed=False) is None


@given(st.binary(max_size=300), st.booleans())
@settings(max_examples=300, deadline=None)
def test_answer_parsing_never_raises_on_garbage(raw: bytes, streamed: bool) -> None:
    from examples.router.answers import answer_cached_tokens

    got = answer_cached_tokens(raw, streamed)
    assert got is None or (type(got) is int and got >= 0)


_json = st.recursive(
    st.none() | st.booleans() | st.integers() | st.text(max_size=5),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.sampled_from(["usage", "prompt_tokens_details", "cached_tokens", "x"]), inner, max_size=3),
    max_leaves=8,
)


@given(st.lists(_json, max_size=4), st.one_of(st.none(), st.integers(-5, 10**6)))
@settings(max_examples=200, deadline=None)
def test_the_last_usage_chunk_of_a_stream_is_read(noise: list[object], cached: int | None) -> None:
    """Arbitrary chunks, then (maybe) a usage chunk: its value when valid, else None."""
    from examples.router.answers import answer_cached_tokens

    chunks = [c for c in noise if not (isinstance(c, dict) and "usage" in c)]
    if cached is not None:
        chunks.append({"choices": [], "usage": {"prompt_tokens_details": {"cached_tokens": cached}}})
    want = cached if cached is not None and cached >= 0 else None
    assert answer_cached_tokens(_sse(*chunks), streamed=True) == want


def test_token_id_prompts_are_used_as_given(model_dir: Path) -> None:
    router = _router(model_dir)
    ids, source = asyncio.run(router.prompt_token_ids("/v1/completions", {"prompt": [[5, 6, 7], "x"]}))
    assert (ids, source) == ([5, 6, 7], "token_ids")
