"""The multi-turn cache (kvindex.tokenize.prefix_cache) always equals a full encoding.

Hypothesis drives conversations that grow turn by turn, branch, and edit their
history, in texts full of special-token text, odd spacing and non-ASCII; every
cached encoding is compared with encoding the whole text at once (the oracle).
"""

from __future__ import annotations

import sys
import threading
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import transformers  # noqa: E402,F401  (the extra kvindex[tokenize]; make test installs it)

from kvindex.tokenize import PrefixCache, RequestTokenizer  # noqa: E402
from kvindex.tokenize.prefix_cache import ANCHOR_CHARS, cut_token_ids  # noqa: E402
from tests.tokenize_corpus import ODD, WORDS  # noqa: E402
from tests.tokenize_model import make_tokenizer_dir  # noqa: E402


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tokenizer_dir(tmp_path_factory.mktemp("tok"))


@pytest.fixture(scope="module")
def backend(model_dir: Path):  # type: ignore[no-untyped-def]
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(model_dir)).backend_tokenizer


pieces = st.sampled_from(WORDS + ODD + ["<|im_start|>", "<|im_end|>", "<|im_end|>!", "<|lstrip|>", " <|lstrip|>"])
texts = st.lists(pieces, min_size=0, max_size=30).map(lambda p: " ".join(p))
turn = st.tuples(st.sampled_from(["user", "assistant", "system", "tool"]), texts)


def render(turns: list[tuple[str, str]], gen: bool) -> str:
    """A ChatML-like rendering, long enough to be looked up by its anchor."""
    head = "<|im_start|>system\n" + "shared system prompt " * 14 + "<|im_end|>\n"
    body = "".join(f"<|im_start|>{r}\n{t}<|im_end|>\n" for r, t in turns)
    return head + body + ("<|im_start|>assistant\n" if gen else "")


def _held(cache: PrefixCache) -> int:
    """The token ids the cache's entries hold, recounted."""
    return sum(len(e.ids) for b in cache._by_anchor.values() for e in b)


def test_cut_points_leave_out_unsafe_tokens(backend) -> None:  # type: ignore[no-untyped-def]
    cuts = set(cut_token_ids(backend).values())
    assert "<|im_start|>" in cuts and "<s>" in cuts
    assert "<|lstrip|>" not in cuts  # eats the spaces before it
    assert "<|im_end|>" not in cuts  # its text sits inside "<|im_end|>!"


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(conv=st.lists(turn, min_size=1, max_size=8), edits=st.lists(st.tuples(st.integers(0, 7), texts), max_size=3),
       gen=st.booleans())
def test_cached_encoding_equals_full_encoding(backend, conv, edits, gen) -> None:  # type: ignore[no-untyped-def]
    cache = PrefixCache(backend, max_entries=4, max_tokens=100_000)
    history: list[tuple[str, str]] = []
    for t in conv:  # the conversation grows turn by turn
        history.append(t)
        text = render(history, gen)
        ids, reused = cache.encode(text)
        assert ids == backend.encode(text, add_special_tokens=False).ids
        assert 0 <= reused <= len(ids)
    for i, new_text in edits:  # then the client rewrites a turn of its history
        if history:
            edited = list(history)
            k = i % len(edited)
            edited[k] = (edited[k][0], new_text)
            text = render(edited, gen)
            ids, _ = cache.encode(text)
            assert ids == backend.encode(text, add_special_tokens=False).ids


def test_a_next_turn_reuses_the_previous_turns_tokens(backend) -> None:  # type: ignore[no-untyped-def]
    cache = PrefixCache(backend)
    turns = [("user", "the router keeps a cache " * 20)]
    first = render(turns, True)
    _, reused0 = cache.encode(first)
    turns += [("assistant", "the pod holds the block"), ("user", "and then?")]
    second = render(turns, True)
    ids, reused1 = cache.encode(second)
    assert reused0 == 0
    full = backend.encode(second, add_special_tokens=False).ids
    assert ids == full
    # everything before the last cut inside the first text (its "<|im_start|>assistant") is reused
    first_ids = backend.encode(first, add_special_tokens=False).ids
    last_cut = max(i for i, t in enumerate(first_ids) if t == backend.token_to_id("<|im_start|>"))
    assert reused1 == last_cut
    assert cache.stats.hits == 1 and cache.stats.reused_tokens == reused1


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(steps=st.lists(st.tuples(turn, st.booleans(), st.integers(0, 3)), min_size=1, max_size=10), gen=st.booleans())
def test_results_a_caller_keeps_never_change(backend, steps, gen) -> None:  # type: ignore[no-untyped-def]
    """A next turn extends the previous turn's ids list in place only when no caller holds it."""
    cache = PrefixCache(backend, max_entries=4, max_tokens=100_000)
    history: list[tuple[str, str]] = []
    kept: list[tuple[list[int], list[int]]] = []  # (a result the caller holds, a copy of it)
    for t, keep, back in steps:
        history = history[: max(0, len(history) - back)] if back == 3 else history  # now and then, a branch
        history = history + [t]
        text = render(history, gen)
        ids, _ = cache.encode(text)
        assert ids == backend.encode(text, add_special_tokens=False).ids
        if keep:
            kept.append((ids, list(ids)))
        del ids
        for held, copy in kept:
            assert held == copy
    assert cache.stats.tokens_held == _held(cache)


def test_turns_encoded_at_once_from_threads_equal_full_encodings(backend) -> None:  # type: ignore[no-untyped-def]
    """Threads continuing one conversation at once (each its own branch) all get the full encoding."""
    cache = PrefixCache(backend, max_entries=8, max_tokens=1_000_000)
    base = [("user", "the router keeps a cache " * 30)]
    cache.encode(render(base, True))
    errors: list[str] = []

    def worker(w: int) -> None:
        history = list(base)
        for i in range(40):
            history = history + [("assistant", f"answer {w} {i}"), ("user", f"question {w} {i} " * (i % 5 + 1))]
            text = render(history, True)
            ids, _ = cache.encode(text)
            if ids != backend.encode(text, add_special_tokens=False).ids:
                errors.append(f"worker {w} turn {i}")

    threads = [threading.Thread(target=worker, args=(w,)) for w in range(4)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert errors == []
    assert cache.stats.tokens_held == _held(cache)


def test_a_result_is_held_from_the_moment_it_is_stored(backend) -> None:  # type: ignore[no-untyped-def]
    """Thread A stops at every step after its turn's ids are stored and the cache's lock released
    (a line tracer, as a thread switch could); meanwhile B encodes the next turn of A's text and
    drops it. A's ids must still be A's text's: B extends a list in place only when nothing but
    the cache holds it, and A holds its list from the moment it is stored."""
    cache = PrefixCache(backend)
    stopped, go_on = threading.Event(), threading.Event()
    stored = [False]

    def local(frame, event, arg):  # type: ignore[no-untyped-def]
        if frame.f_code.co_name == "_store" and event == "return":
            stored[0] = True
        elif stored[0] and event == "line" and not stopped.is_set():
            stopped.set()  # the first step after the store: let B run
            go_on.wait(10)
        return local

    def run_a() -> None:
        sys.settrace(lambda frame, event, arg: local if frame.f_code.co_name in ("encode_memo", "_store") else None)
        try:
            got["A"] = cache.encode(render(a_turn, True))[0]
        finally:
            sys.settrace(None)

    first = [("user", "the router keeps a cache " * 20)]
    kept = cache.encode(render(first, True))[0]  # held: A's turn copies into a list only its entry holds
    a_turn = first + [("assistant", "one"), ("user", "two")]
    b_turn = a_turn + [("assistant", "three"), ("user", "four " * 5)]
    got: dict[str, list[int]] = {}
    a = threading.Thread(target=run_a)
    a.start()
    assert stopped.wait(10)
    cache.encode(render(b_turn, True))  # the result dropped at once
    go_on.set()
    a.join(10)
    assert got["A"] == backend.encode(render(a_turn, True), add_special_tokens=False).ids
    assert kept == backend.encode(render(first, True), add_special_tokens=False).ids


def test_bounds_hold(backend) -> None:  # type: ignore[no-untyped-def]
    cache = PrefixCache(backend, max_entries=3, max_tokens=10_000)
    for i in range(10):
        cache.encode(f"{i} " + "x" * ANCHOR_CHARS + "<|im_start|>tail")
    assert cache.stats.entries <= 3 and cache.stats.tokens_held <= 10_000
    with pytest.raises(ValueError):
        PrefixCache(backend, max_entries=0)


def test_the_request_tokenizer_uses_the_cache_across_turns(model_dir: Path) -> None:
    tok = RequestTokenizer(model_dir)
    nocache = RequestTokenizer(model_dir, cache_entries=0)
    msgs = [{"role": "system", "content": "shared " * 60}, {"role": "user", "content": "first question"}]
    r1 = tok.chat({"messages": msgs})
    msgs += [{"role": "assistant", "content": "an answer"}, {"role": "user", "content": "second"}]
    r2 = tok.chat({"messages": msgs})
    assert r1.exact and r2.exact
    assert r2.prompts == nocache.chat({"messages": msgs}).prompts
    assert r2.reused_tokens > len(r1.token_ids) // 2
