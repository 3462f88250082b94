"""kvindex.tokenize: what vLLM 0.32 hands the chat template, and when the library says it cannot.

The ids themselves are held to real engines in tests/real/hybrid/test_tokenize_equality.py;
here the preparation rules (vllm/renderers/chat_utils.py, hf.py, params.py) are
checked on a local tokenizer, and every unsupported input gives exact=False.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import transformers  # noqa: E402,F401  (the extra kvindex[tokenize]; make test installs it)

from kvindex.tokenize import RequestTokenizer, load_chat_template  # noqa: E402
from kvindex.tokenize import messages as m  # noqa: E402
from tests.tokenize_corpus import corpus  # noqa: E402
from tests.tokenize_model import make_tokenizer_dir  # noqa: E402

ECHO = "{{ messages | tojson }}|{{ tools | tojson }}|{{ add_generation_prompt }}|{{ extra | default('-') }}"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tokenizer_dir(tmp_path_factory.mktemp("tok"))


@pytest.fixture(scope="module")
def tok(model_dir: Path) -> RequestTokenizer:
    return RequestTokenizer(model_dir)


@pytest.fixture(scope="module")
def echo(model_dir: Path) -> RequestTokenizer:
    return RequestTokenizer(model_dir, chat_template=ECHO)


def test_request_flags_override_template_kwargs_unless_unset() -> None:
    kw = m.template_kwargs({"chat_template_kwargs": {"add_generation_prompt": False, "x": 1, "y": "auto"}},
                           {"x": 0, "z": 2}, None, is_tokenize=False)
    assert kw["add_generation_prompt"] is True  # the top-level default wins (build_chat_params)
    assert kw["x"] == 1 and kw["z"] == 2 and "y" not in kw and kw["tokenize"] is False
    kw = m.template_kwargs({"reasoning_effort": "none"}, None, None, is_tokenize=False)
    assert kw["enable_thinking"] is False
    assert "documents" not in m.template_kwargs({"documents": [{}]}, None, None, is_tokenize=True)


def test_tools_are_dumped_as_vllm_validates_them() -> None:
    tools = m.normalize_tools([{"type": "function", "extra": 1, "function": {"name": "f", "strict": True}}])
    assert tools == [{"type": "function", "function": {"name": "f", "description": None, "parameters": None,
                                                       "strict": True}}]


def test_conversation_normalisation() -> None:
    conv = m.conversation([
        {"role": "system", "content": [{"type": "text", "text": "x-anthropic-billing-header: 1\nkeep"}]},
        {"role": "user", "content": [{"type": "text", "text": "a"}, "b", {"type": "text", "text": None}]},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "1", "type": "function", "function": {"name": "f", "arguments": "{\"k\": 1}"}},
            {"id": "2", "type": "function", "function": {"name": "g", "arguments": "not json"}},
            {"id": "3", "type": "function", "function": {"name": "h", "arguments": ""}}]},
        {"role": "assistant", "content": "c", "tool_calls": []},
        {"role": "tool", "tool_call_id": "1", "content": [{"type": "text", "text": "r1"}, {"type": "text", "text": "r2"}]},
    ], "string")
    assert conv[0]["content"] == "keep" and conv[1]["content"] == "a\nb"
    assert [c["function"]["arguments"] for c in conv[2]["tool_calls"]] == [{"k": 1}, {}, {}]
    with pytest.raises(m.Inexact):  # the engine's request schema wants arguments as a JSON string
        m.conversation([{"role": "assistant", "tool_calls": [
            {"id": "1", "type": "function", "function": {"name": "f", "arguments": {"k": 1}}}]}], "string")
    assert conv[2]["content"] == "" and "tool_calls" not in conv[3]
    assert conv[4] == {"role": "tool", "content": "r1\nr2", "tool_call_id": "1"}
    assert m.conversation([{"role": "user", "content": "hi"}], "openai")[0]["content"] == [{"type": "text", "text": "hi"}]


def test_developer_messages_join_the_system_message() -> None:
    conv = [{"role": "system", "content": "s"}, {"role": "user", "content": "u"}, {"role": "developer", "content": "d"}]
    assert m.developer_as_system(conv, "{{ messages }}") == [{"role": "system", "content": "s\n\nd"},
                                                             {"role": "user", "content": "u"}]
    assert m.developer_as_system(conv, "{% if r == 'developer' %}{% endif %}") == conv


@pytest.mark.parametrize("template, fmt", [
    ("{% for message in messages %}{{ message.content }}{% endfor %}", "string"),
    ("{% for message in messages %}{% for p in message['content'] %}{{ p.text }}{% endfor %}{% endfor %}", "openai"),
    ("{% set ms = messages[1:] %}{% for x in ms %}{% for p in x.content | list %}{% endfor %}{% endfor %}", "openai"),
    ("{% macro t(c) %}{% for p in c %}{{ p }}{% endfor %}{% endmacro %}"
     "{% for message in messages %}{{ t(message.content) }}{% endfor %}", "openai"),
    ("{% for item in content %}{% endfor %}", "openai"),
    ("{% for %}", "string"),
])
def test_content_format_detection(template: str, fmt: str) -> None:
    assert m.detect_content_format(template) == fmt


def test_the_template_sees_what_vllm_gives_it(echo: RequestTokenizer) -> None:
    body: dict[str, Any] = {"messages": [{"role": "user", "content": "hi", "name": "n"}],
                            "tools": [{"type": "function", "function": {"name": "f"}}],
                            "chat_template_kwargs": {"extra": "E", "not_in_template": 1}}
    text = echo.render(body)
    assert text == ('[{"role": "user", "content": "hi", "name": "n"}]|[{"type": "function", "function": '
                    '{"name": "f", "description": null, "parameters": null}}]|True|E')
    assert echo.render({**body, "tool_choice": "none"}) == text  # tools stay without the exclude flag


@pytest.mark.parametrize("path, body, reason", [
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
     "not supported"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "chat_template": "{{ 1 }}"},
     "trust-request-chat-template"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "continue_final_message": True},
     "continue_final_message"),
    ("/v1/chat/completions", {"messages": "x"}, "invalid request"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "truncate_prompt_tokens": 5},
     "truncate_prompt_tokens"),
    ("/v1/completions", {"prompt": "x", "suffix": "y"}, "suffix"),
    ("/v1/completions", {"prompt": "x", "prompt_embeds": "AAAA"}, "prompt_embeds"),
    ("/v1/completions", {"prompt": [10**9]}, "vocabulary"),
    ("/v1/completions", {"prompt": []}, "no prompt"),
    ("/v1/completions", {"prompt": ["a", [5]]}, "mixes"),
    ("/v1/embeddings", {"input": "x"}, "unsupported path"),
])
def test_what_cannot_be_reproduced_says_so(tok: RequestTokenizer, path: str, body: dict[str, Any], reason: str) -> None:
    out = tok.tokenize(path, body)
    assert not out.exact and out.prompts == [] and reason in out.reason


def test_completion_shapes(tok: RequestTokenizer) -> None:
    bos = tok.encode("", add_special_tokens=True)
    one = tok.completion({"prompt": "router pod"})
    assert one.exact and one.prompts == [tok.encode("router pod", add_special_tokens=True)]
    assert one.token_ids[: len(bos)] == bos
    batch = tok.completion({"prompt": ["a", "b c"], "add_special_tokens": False})
    assert batch.prompts == [tok.encode("a", add_special_tokens=False), tok.encode("b c", add_special_tokens=False)]
    assert tok.completion({"prompt": [[5, 6], [7]]}).prompts == [[5, 6], [7]]
    assert tok.tokenize("/tokenize", {"prompt": "a", "add_special_tokens": False}).prompts == \
        [tok.encode("a", add_special_tokens=False)]
    assert not tok.tokenize("/tokenize", {"prompt": [5, 6]}).exact  # /tokenize takes one text prompt


def test_forwarded_prompt_ids_are_used_as_they_are(tok: RequestTokenizer) -> None:
    body = {"messages": [{"role": "user", "content": "x"}], "kv_transfer_params": {"prompt_token_ids": [4, 5]}}
    assert tok.chat(body).prompts == [[4, 5]]
    assert not tok.chat({**body, "kv_transfer_params": {"prompt_token_ids": [-1]}}).exact


def test_chat_template_values_read_like_the_engine_flag(tmp_path: Path) -> None:
    f = tmp_path / "t.jinja"
    f.write_text("{{ x }}")
    assert load_chat_template(f) == "{{ x }}" and load_chat_template("{{ y }}") == "{{ y }}"
    with pytest.raises(ValueError):
        load_chat_template("no-such-file.jinja")


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 10_000))
def test_generated_corpus_is_exact_and_matches_plain_rendering(model_dir: Path, seed: int) -> None:
    """Every generated case is reproducible; chat ids = encode(apply_chat_template(...)) for plain bodies."""
    tok = _shared(model_dir)
    for path, body in corpus(seed, 5):
        out = tok.tokenize(path, body)
        assert out.exact, out.reason
        if path == "/v1/chat/completions" and "add_special_tokens" not in body:
            assert out.token_ids == tok.encode(tok.render(body), add_special_tokens=False)


_TOKS: dict[Path, RequestTokenizer] = {}


def _shared(model_dir: Path) -> RequestTokenizer:
    if model_dir not in _TOKS:
        _TOKS[model_dir] = RequestTokenizer(model_dir)
    return _TOKS[model_dir]
