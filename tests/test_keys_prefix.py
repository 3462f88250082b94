"""Request keys continued from an earlier prompt's keys (``request_keys(..., prefix_keys=)``).

The keys of a prompt that extends an earlier one, computed from the earlier
prompt's keys plus the new blocks, must equal the keys of the whole prompt:
for every split point (inside a block too), with extras, salt, LoRA scope,
lookahead and either kind of token container. Also the router's use of it
(examples/router/turn_keys.py) over a tokenizer's multi-turn cache.
"""

from __future__ import annotations

import msgspec
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvindex.facade import Config, Indexer
from kvindex.keys import TokenProcessor
from kvindex.tiers import CPU, GPU


@st.composite
def cases(draw):  # type: ignore[no-untyped-def]
    bs = draw(st.sampled_from([1, 4, 16]))
    ahead = draw(st.sampled_from([0, 0, 3]))
    tokens = draw(st.lists(st.integers(0, 2**32), max_size=12 * bs + 5))
    split = draw(st.integers(0, len(tokens)))
    n = max(len(tokens) - ahead, 0) // bs
    item = st.one_of(st.tuples(st.text(max_size=3), st.integers(0, 9)), st.binary(min_size=1, max_size=4))
    extras = draw(st.one_of(st.none(), st.lists(st.one_of(st.none(), st.lists(item, min_size=1, max_size=2)),
                                                 min_size=n, max_size=n)))
    return bs, ahead, tokens, split, extras


@settings(max_examples=300, deadline=None)
@given(case=cases(), seed=st.integers(0, 2**64 - 1), salt=st.sampled_from([None, "", "salt"]),
       lora=st.sampled_from([None, "adapter", ("adapter", "/p")]), model=st.sampled_from([None, "m"]),
       as_array=st.sampled_from([None, np.uint64, np.int64]), more=st.lists(st.integers(0, 99), max_size=20))
def test_continued_keys_equal_the_whole_prompts(case, seed, salt, lora, model, as_array, more) -> None:  # type: ignore[no-untyped-def]
    bs, ahead, tokens, split, extras = case
    tp = TokenProcessor(bs, hash_seed=seed, hash_lookahead_tokens=ahead)
    scope = {"model": model, "lora": lora, "cache_salt": salt or None}
    full = tp.request_keys(tokens, block_extra_keys=extras, **scope)
    # the earlier prompt: the first `split` tokens, then other tokens (a different continuation)
    earlier = tokens[:split] + more
    n_earlier = max(len(earlier) - ahead, 0) // bs
    kept = min(split // bs, n_earlier)
    earlier_extras = None
    if extras is not None:  # the same extras on the shared blocks, none after
        earlier_extras = list(extras[:kept])
        earlier_extras += [None] * (n_earlier - len(earlier_extras))
    prefix = tp.request_keys(earlier, block_extra_keys=earlier_extras, **scope)[: split // bs]
    given_tokens = np.array(tokens, dtype=as_array) if as_array else tokens
    got = tp.request_keys(given_tokens, block_extra_keys=extras, prefix_keys=prefix, **scope)
    assert got.dtype == np.uint64 and got.tolist() == full.tolist()
    assert tp.request_keys(given_tokens, block_extra_keys=extras, prefix_keys=[], **scope).tolist() == full.tolist()


def test_continued_keys_check_the_new_tokens_and_the_prefix() -> None:
    tp = TokenProcessor(4)
    prefix = tp.request_keys(list(range(8)))
    with pytest.raises(ValueError):
        tp.request_keys(list(range(8)) + [1, -2, 3, 4], prefix_keys=prefix)
    with pytest.raises(ValueError):
        tp.request_keys(np.array([1, -2, 3, 4] * 3), prefix_keys=[])
    with pytest.raises(TypeError):
        tp.request_keys(list(range(8)) + [1, "x", 3, 4], prefix_keys=prefix)
    with pytest.raises(ValueError):
        tp.request_keys(list(range(12)), prefix_keys=np.zeros((1, 2), dtype=np.uint64))


def test_continued_keys_check_what_the_prefix_does_not_cover() -> None:
    tp = TokenProcessor(4)
    toks = list(range(100, 108))
    prefix = tp.request_keys(toks)
    for tail in ([-1], [1.5], [2**64], ["a"], [None]):  # the trailing part block is checked too
        with pytest.raises((TypeError, ValueError)):
            tp.request_keys(toks + [7, 8] + tail, prefix_keys=prefix)
    for tokens in ("x" * 8, {i: i for i in range(8)}, (t for t in toks)):  # the prefix covering every block
        with pytest.raises(TypeError):
            tp.request_keys(tokens, prefix_keys=prefix)
    with pytest.raises(ValueError):
        tp.request_keys(np.array([toks]), prefix_keys=prefix)


@pytest.mark.parametrize("bad, error", [
    (lambda k: k.astype(float), TypeError), (lambda k: k.astype(np.uint32), TypeError),
    (lambda k: k.astype(bool), TypeError), (lambda k: [float(x) for x in k.tolist()], TypeError),
    (lambda k: [-1] * len(k), ValueError), (lambda k: [2**64] * len(k), ValueError),
    (lambda k: "abc", TypeError), (lambda k: k.reshape(1, -1), ValueError),
])
def test_keys_of_another_type_are_refused(bad, error) -> None:  # type: ignore[no-untyped-def]
    ix = Indexer(Config.from_dict({"model_name": "m", "token_processor_config": {"block_size": 4}}))
    toks = list(range(100, 116))
    keys = ix.request_keys(toks)
    with pytest.raises(error):
        ix.score(toks, ["pod-a"], keys=bad(keys))
    with pytest.raises(error):
        ix.request_keys(toks + [1] * 8, prefix_keys=bad(keys))


def test_keys_as_a_list_or_int64_score_as_the_array() -> None:
    ix = Indexer(Config.from_dict({"model_name": "m", "token_processor_config": {"block_size": 4}}))
    toks = list(range(100, 164))
    ix.index.block_stored("pod-a", 0, list(range(1, 17)), None, toks, "gpu", block_size=4, model="m")
    keys = ix.request_keys(toks)
    # keys on both sides of 2**63: numpy reads a list of them as float64 unless told otherwise
    assert int(keys.max()) >= 2**63 > int(keys.min()) and np.asarray(keys.tolist()).dtype != np.uint64
    want = ix.score(toks, ["pod-a"])
    assert want.prefix["pod-a"].matched_blocks == 16
    for given in (keys, keys.tolist(), keys.view(np.int64), tuple(keys.tolist())):
        assert ix.score(toks, ["pod-a"], keys=given) == want
    with pytest.raises(TypeError):
        ix.score("x" * 16, ["pod-a"], keys=keys)  # tokens are counted, and must be tokens
    routed = ix.route(toks, ["pod-a"], keys=keys.tolist())
    assert routed.pod == "pod-a" and routed.prefix["pod-a"].matched_blocks == 16
    with pytest.raises(ValueError):
        ix.route(toks, ["pod-a"], keys=np.zeros((3, 3), dtype=np.uint64))  # route checks them as score does


def test_compat_mode_ignores_prefix_keys() -> None:
    tp = TokenProcessor(4, algorithm="vllm_sha256_cbor")
    toks = list(range(16))
    assert tp.request_keys(toks, prefix_keys=[1, 2]).tolist() == tp.request_keys(toks).tolist()


def test_score_from_keys_equals_score_from_tokens() -> None:
    ix = Indexer(Config.from_dict({"model_name": "m", "token_processor_config": {"block_size": 4}}))
    toks = list(range(1, 41))
    ix.index.block_stored("pod-a", 0, list(range(100, 106)), None, toks[:24], GPU, block_size=4, model="m")
    ix.index.block_stored("pod-b", 1, list(range(200, 203)), None, toks[:12], CPU, block_size=4, model="m")
    for salt in (None, "s"):
        for pods in (["pod-a", "pod-b"], ["pod-b"], None):
            a = ix.score(toks, pods, cache_salt=salt)
            b = ix.score(toks, pods, cache_salt=salt, keys=ix.request_keys(toks, cache_salt=salt))
            assert a == b
            assert salt or a.prefix["pod-b"].matched_blocks == 3
    assert ix.score(toks, ["pod-a", "pod-b"]).choice.dp_rank == 0
    assert ix.score(toks, ["pod-b"], keys=ix.request_keys(toks)).choice.dp_rank == 1
    with pytest.raises(ValueError):
        ix.score(toks, ["pod-a"], keys=ix.request_keys(toks)[:-1])


@settings(max_examples=25, deadline=None)
@given(turns=st.lists(st.lists(st.text(min_size=1, max_size=80), min_size=1, max_size=3), min_size=2, max_size=5),
       salt=st.sampled_from([None, "s"]), block=st.sampled_from([1, 3, 16]))
def test_the_routers_turn_keys_equal_request_keys(tok_dir, turns, salt, block) -> None:  # type: ignore[no-untyped-def]
    from examples.router.turn_keys import turn_request_keys
    from kvindex.tokenize import RequestTokenizer, TokenizedRequest

    tok = RequestTokenizer(tok_dir)
    ix = Indexer(Config.from_dict({"model_name": "m", "token_processor_config": {"block_size": block}}))
    conv: list[dict[str, str]] = [{"role": "system", "content": "a long enough system prompt " * 12}]
    continued = 0
    for i, texts in enumerate(turns):
        conv = conv + [{"role": "user" if j % 2 == 0 else "assistant", "content": t} for j, t in enumerate(texts)]
        local = tok.chat({"messages": conv})
        ids = local.token_ids
        keys = turn_request_keys(ix, ids, salt, local)
        assert keys is not None and keys.tolist() == ix.request_keys(ids, cache_salt=salt).tolist()
        assert local.memo is not None and local.memo.value[1] is keys
        # the filled memos are not part of the result: it encodes and decodes as before
        back = msgspec.json.decode(msgspec.json.encode(local), type=TokenizedRequest)
        assert back == local and back.token_ids == ids and back.memo is not None and back.memo.value is None
        continued += i > 0 and local.reused_memo is not None and local.reused_tokens >= block
    assert continued >= 1  # later turns reused the earlier turns' ids (and keys)


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory: pytest.TempPathFactory):  # type: ignore[no-untyped-def]
    pytest.importorskip("transformers")
    from tests.tokenize_model import make_tokenizer_dir

    return make_tokenizer_dir(tmp_path_factory.mktemp("tok"))
