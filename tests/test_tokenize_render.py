"""The render cache (kvindex.tokenize.render_cache) always equals a full render.

Hypothesis grows conversations turn by turn, branches and edits them, with
special-token text, content parts, tool calls and developer messages, under
message-local templates (rendered incrementally) and templates that are not
(rendered whole); every result is compared with a tokenizer without caches
(the oracle: the whole conversation rendered and encoded at once).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import transformers  # noqa: E402,F401  (the extra kvindex[tokenize]; make test installs it)

from kvindex.tokenize import RequestTokenizer  # noqa: E402
from kvindex.tokenize.render_cache import RenderCache, message_local  # noqa: E402
from tests.tokenize_corpus import ODD, WORDS  # noqa: E402
from tests.tokenize_model import CHATML, make_tokenizer_dir  # noqa: E402

HEAD_TAIL = ("{{ bos_token }}{% if tools %}<|im_start|>tools\n{{ tools | tojson }}<|im_end|>\n{% endif %}"
             "{% for m in messages %}{% set c = m.content if m.content is string else m.content | map(attribute='text') "
             "| join(' ') %}<|im_start|>{{ m.role }}\n{{ c | trim }}{% if m.tool_calls %}{{ m.tool_calls | tojson }}"
             "{% endif %}<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
             "{{ eos_token }}")
FIRST_LOOP = ("{% for m in messages %}{% if loop.first %}<s>{% endif %}<|im_start|>{{ m.role }}\n{{ m.content }}"
              "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
NAMESPACE = ("{% set ns = namespace(prev='') %}{% for m in messages %}{% if m.role == ns.prev %}<|im_end|>!{% endif %}"
             "<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% set ns.prev = m.role %}{% endfor %}")
SYSTEM_FIRST = ("{% if messages[0].role == 'system' %}<s>{% endif %}{% for m in messages %}<|im_start|>{{ m.role }}"
                "\n{{ m.content }}<|im_end|>\n{% endfor %}")
TEMPLATES = [CHATML, HEAD_TAIL, FIRST_LOOP, NAMESPACE, SYSTEM_FIRST]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tokenizer_dir(tmp_path_factory.mktemp("tok"))


@pytest.fixture(scope="module")
def pairs(model_dir: Path) -> dict[str, tuple[RequestTokenizer, RequestTokenizer]]:
    """Per template: (tokenizer with small caches, tokenizer without caches)."""
    return {t: (RequestTokenizer(model_dir, chat_template=t, cache_entries=6),
                RequestTokenizer(model_dir, chat_template=t, cache_entries=0)) for t in TEMPLATES}


def test_message_locality_is_read_from_the_template() -> None:
    assert message_local(CHATML) and message_local(HEAD_TAIL)
    assert not message_local(FIRST_LOOP)  # loop.first
    assert not message_local(NAMESPACE)  # state carried from message to message
    assert not message_local(SYSTEM_FIRST)  # messages read outside the loop
    assert not message_local("{% for m in messages %}{{ strftime_now('%d') }}{% endfor %}")
    assert not message_local("{% for m in messages %}{{ m.content }}{% else %}empty{% endfor %}")
    assert not message_local("{% set c = cycler('a', 'b') %}{% for m in messages %}{{ c.next() }}{% endfor %}")
    assert not message_local("{% for m in messages %}")  # does not parse


pieces = st.sampled_from(WORDS + ODD + ["<|im_start|>", "<|im_end|>", "<|im_end|>!", " <|lstrip|>"])
texts = st.lists(pieces, min_size=0, max_size=12).map(lambda p: " ".join(p))


@st.composite
def messages(draw: Any) -> dict[str, Any]:
    role = draw(st.sampled_from(["user", "assistant", "system", "tool", "user", "assistant", "developer"]))
    content: Any = draw(texts)
    if draw(st.integers(0, 5)) == 0:
        content = [{"type": "text", "text": t} for t in draw(st.lists(texts, min_size=1, max_size=3))]
    msg: dict[str, Any] = {"role": role, "content": content}
    if role == "assistant" and draw(st.booleans()):
        msg["tool_calls"] = [{"id": "c1", "type": "function",
                              "function": {"name": "lookup", "arguments": draw(st.sampled_from(['{"q": 1}', "", "x"]))}}]
    return msg


TOOLS = [{"type": "function", "function": {"name": "lookup", "parameters": {"type": "object"}}}]


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(template=st.sampled_from(TEMPLATES), turns=st.lists(st.lists(messages(), min_size=1, max_size=3), min_size=1,
       max_size=5), edit=st.one_of(st.none(), st.tuples(st.integers(0, 20), texts)), gen=st.booleans(),
       tools=st.booleans())
def test_cached_render_equals_full_render(pairs, template, turns, edit, gen, tools) -> None:  # type: ignore[no-untyped-def]
    tok, oracle = pairs[template]
    system = {"role": "system", "content": "a shared system prompt " * 12}
    conv: list[dict[str, Any]] = [system]
    extra: dict[str, Any] = {"add_generation_prompt": gen, **({"tools": TOOLS} if tools else {})}
    bodies = []
    for new in turns:  # the conversation grows turn by turn
        conv = conv + new
        bodies.append({"messages": conv, **extra})
    if edit is not None:  # the client rewrites a message of its history, then branches from the original
        i, text = edit
        edited = [dict(m) for m in conv]
        edited[i % len(edited)]["content"] = text
        bodies += [{"messages": edited, **extra}, {"messages": conv[:-1] + [{"role": "user", "content": text}], **extra}]
    for body in bodies:
        got, want = tok.chat(body), oracle.chat(body)
        assert got.exact == want.exact and got.reason == want.reason
        assert got.prompts == want.prompts


def test_a_next_turn_renders_only_its_new_messages(pairs) -> None:  # type: ignore[no-untyped-def]
    tok, oracle = pairs[HEAD_TAIL]
    assert tok.renders is not None
    conv = [{"role": "system", "content": "the system " * 40}, {"role": "user", "content": "first"}]
    tok.chat({"messages": conv, "tools": TOOLS})
    before = tok.renders.stats.rendered_messages
    conv = conv + [{"role": "assistant", "content": "answer"}, {"role": "user", "content": "second"}]
    body = {"messages": conv, "tools": TOOLS}
    assert tok.chat(body).prompts == oracle.chat(body).prompts
    assert tok.renders.stats.rendered_messages - before == 2 and tok.renders.stats.hits >= 1


def test_templates_that_are_not_message_local_render_whole(pairs) -> None:  # type: ignore[no-untyped-def]
    tok, _ = pairs[FIRST_LOOP]
    assert tok.renders is not None
    hits = tok.renders.stats.hits
    conv = [{"role": "user", "content": "one " * 80}]
    for i in range(3):
        conv = conv + [{"role": "assistant", "content": f"a{i}"}, {"role": "user", "content": f"q{i}"}]
        tok.chat({"messages": conv})
    assert tok.renders.stats.hits == hits


def test_messages_that_do_not_encode_as_json_render_whole(pairs) -> None:  # type: ignore[no-untyped-def]
    tok, oracle = pairs[CHATML]
    body = {"messages": [{"role": "user", "content": "hello " * 60, "extra": {1, 2}}]}
    assert tok.chat(body) == oracle.chat(body)


def test_the_render_cache_is_bounded(model_dir: Path) -> None:
    cache = RenderCache(max_entries=3, max_chars=50_000)
    tok = RequestTokenizer(model_dir, cache_entries=3)
    tok.renders = cache
    for i in range(10):
        tok.chat({"messages": [{"role": "user", "content": f"{i} " + "x " * 300}]})
    assert cache.stats.entries <= 3 and cache.stats.chars_held <= 50_000
    with pytest.raises(ValueError):
        RenderCache(max_entries=0)
