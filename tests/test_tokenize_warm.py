"""A warm turn tokenized on the event loop equals the full tokenization (kvindex.tokenize).

``RequestTokenizer.tokenize_warm`` answers only when both multi-turn caches
hold a conversation's previous turn and the new part is within its limit;
the render cache then proves the earlier messages on the request's own JSON
text (``raw``), whatever its formatting. Hypothesis grows, edits and
branches conversations sent in several JSON formattings and holds every
answer (warm or not) to a tokenizer without caches.
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import transformers  # noqa: E402,F401  (the extra kvindex[tokenize]; make test installs it)

from kvindex.tokenize import RequestTokenizer  # noqa: E402
from kvindex.tokenize.render_cache import _Entry, _longest_prefix  # noqa: E402
from tests.test_tokenize_render import HEAD_TAIL, TOOLS, messages  # noqa: E402
from tests.tokenize_model import CHATML, make_tokenizer_dir  # noqa: E402

CHAT = "/v1/chat/completions"


def _dump(body: dict[str, Any], style: int) -> bytes:
    """``body`` as JSON text in one of several formattings a client may use."""
    if style == 0:
        return msgspec.json.encode(body)
    if style == 1:
        return json.dumps(body).encode()  # ", " and ": " separators
    if style == 2:
        return json.dumps(body, indent=2).encode()
    if style == 3:
        return json.dumps(body, separators=(",", ":"), ensure_ascii=False).encode()
    return json.dumps(body, indent="\t", ensure_ascii=False).encode() + b"\n "


def conversation_bodies(turns: list[list[dict[str, Any]]], edit: int | None,
                        extra: dict[str, Any]) -> list[dict[str, Any]]:
    """A conversation's chat bodies turn by turn; ``edit``: then a rewritten history and a branch."""
    conv: list[dict[str, Any]] = [{"role": "system", "content": "a shared system prompt " * 12}]
    bodies = []
    for new in turns:
        conv = conv + new
        bodies.append({"model": "m", "messages": conv, **extra})
    if edit is not None:  # a rewritten message of the history, then a branch from the original
        edited = [dict(m) for m in conv]
        edited[edit % len(edited)]["content"] = "rewritten"
        bodies += [{"messages": edited, **extra}, {"messages": conv[:-1], **extra}]
    return bodies


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tokenizer_dir(tmp_path_factory.mktemp("tok"))


@pytest.fixture(scope="module")
def pairs(model_dir: Path) -> dict[str, tuple[RequestTokenizer, RequestTokenizer]]:
    return {t: (RequestTokenizer(model_dir, chat_template=t, cache_entries=6),
                RequestTokenizer(model_dir, chat_template=t, cache_entries=0)) for t in (CHATML, HEAD_TAIL)}


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(template=st.sampled_from([CHATML, HEAD_TAIL]),
       turns=st.lists(st.lists(messages(), min_size=1, max_size=3), min_size=1, max_size=5),
       styles=st.lists(st.integers(0, 4), min_size=8, max_size=8), edit=st.one_of(st.none(), st.integers(0, 20)),
       gen=st.booleans(), tools=st.booleans(), limit=st.sampled_from([40, 400, 16_384]))
def test_warm_turns_equal_full_tokenization(pairs, template, turns, styles, edit, gen, tools,  # type: ignore[no-untyped-def]
                                            limit) -> None:
    tok, oracle = pairs[template]
    extra: dict[str, Any] = {"add_generation_prompt": gen, **({"tools": TOOLS} if tools else {})}
    bodies = conversation_bodies(turns, edit, extra)
    for i, body in enumerate(bodies):
        raw = _dump(body, styles[i % len(styles)])
        sent = json.loads(raw)
        want = oracle.chat(sent)
        got = tok.tokenize_warm(CHAT, sent, raw=raw, limit=limit)
        if got is None:
            got = tok.tokenize(CHAT, sent, raw=raw)
        assert got.exact == want.exact and got.reason == want.reason
        assert got.prompts == want.prompts


def test_a_next_turn_is_warm_and_a_new_conversation_is_not(model_dir: Path) -> None:
    tok = RequestTokenizer(model_dir)
    oracle = RequestTokenizer(model_dir, cache_entries=0)
    rng = random.Random(7)
    conv = [{"role": "system", "content": "the system prompt " * 200}]
    body = {"messages": conv}
    assert tok.tokenize_warm(CHAT, body, raw=json.dumps(body).encode()) is None  # cold
    tok.tokenize(CHAT, body, raw=json.dumps(body).encode())
    for i in range(5):
        conv = conv + [{"role": "assistant", "content": f"answer {i}"},
                       {"role": "user", "content": " ".join(rng.choice(["pod", "block", "<|im_end|>"]) for _ in range(9))}]
        body = {"messages": conv}
        got = tok.tokenize_warm(CHAT, body, raw=json.dumps(body).encode())
        assert got is not None and got.reused_tokens > 0
        assert got.prompts == oracle.chat(body).prompts
    big = {"messages": conv + [{"role": "user", "content": "x " * 20_000}]}
    assert tok.tokenize_warm(CHAT, big, raw=json.dumps(big).encode()) is None  # beyond the limit
    assert tok.tokenize_warm("/v1/completions", {"prompt": "hi"}) is None


def test_the_prefix_proof_reads_json_text_of_any_formatting() -> None:
    def entry(text: bytes) -> _Entry:
        return _Entry(text, len(json.loads(text)), "")

    spaced = entry(b'[ {"a": 1} ,\n {"b" : [2]}\n ]')
    longer = b'[ {"a": 1} ,\n {"b" : [2]}\n , {"c": 3}]'
    assert _longest_prefix([spaced], longer, 3) == (spaced, longer.index(b'{"c') - 1)  # just after the comma
    assert _longest_prefix([spaced], spaced.enc, 2) == (spaced, len(spaced.enc))  # nothing new
    assert _longest_prefix([spaced], b'[ {"a": 1} ,\n {"b" : [2, 3]}, {"c": 3}]', 3) == (None, 0)
    number = entry(b"[1]")
    assert _longest_prefix([number], b"[12, 3]", 2) == (None, 0)  # 12 is not 1
    assert _longest_prefix([number], b"[1.5,3]", 2) == (None, 0)
    assert _longest_prefix([number], b"[1 ,3]", 2) == (number, 4)
    assert _longest_prefix([entry(b'["a"]')], b'["ab", "c"]', 2) == (None, 0)
