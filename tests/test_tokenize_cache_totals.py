"""The multi-turn caches' running totals (entries, tokens or characters held) equal a recount.

Both caches of kvindex.tokenize keep their size as running totals instead of
walking every entry per store; hypothesis drives them with growing, branching
and unrelated texts under small bounds, so that they evict, and recounts.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import transformers  # noqa: E402,F401  (the extra kvindex[tokenize]; make test installs it)

from kvindex.tokenize import RequestTokenizer  # noqa: E402
from tests.tokenize_model import make_tokenizer_dir  # noqa: E402

CHAT = "/v1/chat/completions"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tokenizer_dir(tmp_path_factory.mktemp("tok"))


def _recount(tok: RequestTokenizer) -> None:
    pc, rc = tok.cache, tok.renders
    assert pc is not None and rc is not None
    assert pc.stats.entries == sum(len(b) for b in pc._by_anchor.values())
    assert pc.stats.tokens_held == sum(len(e.ids) for b in pc._by_anchor.values() for e in b)
    assert rc.stats.entries == sum(len(b) for b in rc._by_anchor.values())
    assert rc.stats.chars_held == sum(len(e.middle) + len(e.enc) for b in rc._by_anchor.values() for e in b)
    assert pc.stats.entries <= 3 and rc.stats.entries <= 3  # bounded as configured


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(steps=st.lists(st.tuples(st.integers(0, 3), st.integers(0, 4), st.sampled_from(["pod", "block <|im_end|>"])),
                      min_size=1, max_size=25),
       clear_at=st.one_of(st.none(), st.integers(0, 25)))
def test_running_totals_equal_a_recount(model_dir: Path, steps, clear_at) -> None:  # type: ignore[no-untyped-def]
    tok = RequestTokenizer(model_dir, cache_entries=3)
    convs: list[list[dict[str, str]]] = [[{"role": "system", "content": f"prompt {c} " * 60}] for c in range(4)]
    for i, (c, cut, word) in enumerate(steps):
        if i == clear_at:
            tok.cache.clear()  # type: ignore[union-attr]
            tok.renders.clear()  # type: ignore[union-attr]
        conv = convs[c][: max(1, len(convs[c]) - cut)]  # a branch from an earlier turn, or the next turn
        conv = conv + [{"role": "assistant", "content": f"a {i}"}, {"role": "user", "content": f"{word} {i}"}]
        convs[c] = conv
        body = {"messages": conv}
        tok.tokenize(CHAT, body)
        _recount(tok)
