"""A warm turn tokenized from its messages' JSON text alone equals the full tokenization.

``RequestTokenizer.tokenize_warm(..., messages_json=...)`` gets a body whose
``messages`` were left undecoded: the render cache proves the earlier
messages on their bytes and decodes only the new ones. The reference router
(examples/router/app.py ``Router._warm_turn``) takes this path for a
conversation's next turn. Hypothesis holds both to a tokenizer without
caches, over grown, edited and branched conversations in several JSON
formattings, and feeds the lazy path bytes that are not the expected JSON.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import transformers  # noqa: E402,F401  (the extra kvindex[tokenize]; make test installs it)

from examples.router.app import EngineSpec, Router, RouterConfig, TokenizerSpec  # noqa: E402
from kvindex.tokenize import RequestTokenizer  # noqa: E402
from kvindex.tokenize.render_cache import RenderCache  # noqa: E402
from tests.test_tokenize_render import HEAD_TAIL, TOOLS, messages  # noqa: E402
from tests.test_tokenize_warm import _dump, conversation_bodies  # noqa: E402
from tests.tokenize_model import CHATML, make_tokenizer_dir  # noqa: E402

CHAT = "/v1/chat/completions"
_FIELDS = msgspec.json.Decoder(dict[str, msgspec.Raw])
STYLES = st.one_of(st.integers(0, 4).map(lambda s: [s] * 8), st.lists(st.integers(0, 4), min_size=8, max_size=8))
"""The JSON formatting of each request: one per conversation (a real client's), or changing."""


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tokenizer_dir(tmp_path_factory.mktemp("tok"))


@pytest.fixture(scope="module")
def trios(model_dir: Path) -> dict[str, tuple[RequestTokenizer, RequestTokenizer, RequestTokenizer]]:
    """Per template: a tokenizer for the undecoded path, one for the decoded path, one without caches."""
    return {t: (RequestTokenizer(model_dir, chat_template=t, cache_entries=6),
                RequestTokenizer(model_dir, chat_template=t, cache_entries=6),
                RequestTokenizer(model_dir, chat_template=t, cache_entries=0)) for t in (CHATML, HEAD_TAIL)}


def _split(raw: bytes) -> tuple[dict[str, Any], bytes]:
    fields = _FIELDS.decode(raw)
    enc = bytes(fields.pop("messages"))
    return {k: msgspec.json.decode(v) for k, v in fields.items()}, enc


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(template=st.sampled_from([CHATML, HEAD_TAIL]),
       turns=st.lists(st.lists(messages(), min_size=1, max_size=3), min_size=1, max_size=5),
       styles=STYLES, edit=st.one_of(st.none(), st.integers(0, 20)),
       gen=st.booleans(), tools=st.booleans(), limit=st.sampled_from([40, 400, 16_384]))
def test_warm_turns_from_json_text_equal_full_tokenization(trios, template, turns, styles, edit, gen,  # type: ignore[no-untyped-def]
                                                           tools, limit) -> None:
    tok, decoded, oracle = trios[template]
    extra: dict[str, Any] = {"add_generation_prompt": gen, **({"tools": TOOLS} if tools else {})}
    for i, body in enumerate(conversation_bodies(turns, edit, extra)):
        raw = _dump(body, styles[i % len(styles)])
        sent = json.loads(raw)
        want = oracle.chat(sent)
        rest, enc = _split(raw)
        got = tok.tokenize_warm(CHAT, rest, raw=raw, limit=limit, messages_json=enc)
        peer = decoded.tokenize_warm(CHAT, sent, raw=raw, limit=limit)
        assert (got is None) == (peer is None)  # warm exactly when the decoded path is
        if got is None:
            got = tok.tokenize(CHAT, sent, raw=raw)
            decoded.tokenize(CHAT, sent, raw=raw)
        assert got.exact == want.exact and got.reason == want.reason
        assert got.prompts == want.prompts


@settings(max_examples=200, deadline=None)
@given(tail=st.binary(max_size=40), ws=st.sampled_from([b"", b" ", b"\n "]))
def test_bytes_after_a_cached_turn_never_render_wrongly(tail: bytes, ws: bytes) -> None:
    cache = RenderCache()
    prepare = lambda ms: [dict(m) for m in ms]  # noqa: E731

    def apply(conv: list[dict[str, Any]]) -> str:
        return "H" + "".join(f"<{m['role']}:{m['content']}>" for m in conv) + "T"

    first = [{"role": "user", "content": "one"}]
    cache.render(first, "t {% for m in messages %}{{ m.content }}{% endfor %}", "string", {}, prepare, apply)
    enc = msgspec.json.encode(first)[:-1] + ws + b"," + tail
    try:
        got = cache.render(None, "t {% for m in messages %}{{ m.content }}{% endfor %}", "string", {},
                           prepare, apply, enc=enc, limit=1000)
    except Exception as e:  # Cold, or what the caller's own render raises for values it rejects
        assert type(e).__name__ in ("Cold", "KeyError", "TypeError", "ValueError")
        return
    full = msgspec.json.decode(enc)  # it rendered: the text is JSON, and the render is the whole one's
    assert got == apply(prepare(full))


def test_a_body_with_its_messages_is_refused(model_dir: Path) -> None:
    tok = RequestTokenizer(model_dir)
    with pytest.raises(ValueError):
        tok.tokenize_warm(CHAT, {"messages": []}, messages_json=b"[]")


def _router(model_dir: Path, template: str) -> Router:
    engine = EngineSpec(pod="pod-0", url="http://127.0.0.1:9", endpoint="tcp://127.0.0.1:9")
    return Router(RouterConfig(engines=[engine], tokenizer=TokenizerSpec(model_dir=str(model_dir),
                                                                         chat_template=template)))


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(template=st.sampled_from([CHATML, HEAD_TAIL]),
       turns=st.lists(st.lists(messages(), min_size=1, max_size=3), min_size=1, max_size=4),
       styles=STYLES, edit=st.one_of(st.none(), st.integers(0, 20)),
       extra=st.sampled_from([{}, {"stream": True, "cache_salt": "s"}, {"add_generation_prompt": False}]))
def test_the_routers_warm_turns_equal_its_full_path(model_dir, template, turns, styles, edit,  # type: ignore[no-untyped-def]
                                                    extra) -> None:
    router = _router(model_dir, template)
    oracle = RequestTokenizer(model_dir, chat_template=template, cache_entries=0)
    for i, body in enumerate(conversation_bodies(turns, edit, extra)):
        raw = _dump(body, styles[i % len(styles)])
        sent = json.loads(raw)
        warm = router._warm_turn(CHAT, raw)
        if warm is None:
            ids, source = asyncio.run(router.prompt_token_ids(CHAT, sent, raw))
            assert source == "local"
        else:
            rest, ids = warm
            assert rest == {k: v for k, v in sent.items() if k != "messages"}
        assert ids == oracle.chat(sent).token_ids


def test_a_next_turn_is_warm_from_its_json_text_in_the_router(model_dir: Path) -> None:
    router = _router(model_dir, CHATML)
    oracle = RequestTokenizer(model_dir, chat_template=CHATML, cache_entries=0)
    conv = [{"role": "system", "content": "the system prompt " * 200}]
    body = {"model": "m", "messages": conv, "stream": True}
    raw = json.dumps(body).encode()
    assert router._warm_turn(CHAT, raw) is None  # cold: the caches know nothing yet
    asyncio.run(router.prompt_token_ids(CHAT, body, raw))
    for i in range(4):
        conv = conv + [{"role": "assistant", "content": f"answer {i}"}, {"role": "user", "content": f"q {i} <|im_end|>"}]
        body = {"model": "m", "messages": conv, "stream": True}
        warm = router._warm_turn(CHAT, json.dumps(body).encode())
        assert warm is not None
        assert warm[0] == {"model": "m", "stream": True}
        assert warm[1] == oracle.chat(body).token_ids
    assert router._warm_turn(CHAT, b'{"model": "m", "messages": [1, 2') is None  # not JSON: the full path
    good = json.dumps({"model": "m", "messages": conv + [{"role": "user", "content": "X"}], "stream": True}).encode()
    assert router._warm_turn(CHAT, good) is not None
    bad_new = good.replace(b'"X"', b'"\x80"')
    assert b"\x80" in bad_new and router._warm_turn(CHAT, bad_new) is None  # invalid UTF-8 in a new message
    bad_old = good.replace(b"answer 0", b"answer \x80")
    assert b"\x80" in bad_old and router._warm_turn(CHAT, bad_old) is None  # in an earlier one: no proof
    assert router._warm_turn("/v1/completions", b'{"prompt": "x", "messages": []}') is None


JSON = st.recursive(st.none() | st.booleans() | st.integers() | st.text(max_size=5),
                    lambda c: st.lists(c, max_size=3) | st.dictionaries(st.text(max_size=4), c, max_size=3),
                    max_leaves=8)


@settings(max_examples=300, deadline=None)
@given(body=st.dictionaries(st.sampled_from(["model", "messages", "stream", "x"]), JSON, max_size=4),
       style=st.integers(0, 4), junk=st.binary(max_size=12), cut=st.integers(0, 200))
def test_the_router_splits_a_body_as_the_whole_decode_reads_it(body, style, junk, cut) -> None:  # type: ignore[no-untyped-def]
    from examples.router.bodies import decode_all_but_messages, decode_body

    raw = _dump(body, style)
    for data in (raw, raw[:cut] + junk + raw[cut:], junk):
        split = decode_all_but_messages(data)
        if split is None:
            whole = decode_body(data)
            assert "messages" not in whole or data != raw  # only an unreadable body, or one without messages
            continue
        rest, enc = split
        whole = decode_body(data)
        try:
            decoded = msgspec.json.decode(enc)
        except msgspec.DecodeError:  # e.g. invalid UTF-8 in a string: skipped, not checked, by the split
            assert whole == {}  # the whole decode rejects the body; the warm path never decodes these bytes
            continue
        assert whole == {**rest, "messages": decoded}
