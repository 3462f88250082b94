"""Request keys (kvindex.keys, algorithm "xxh3_chain").

The oracle below restates the module docstring's specification with Python
ints and one loop iteration per block; hypothesis drives it and the vectorised
TokenProcessor with the same inputs.
"""

from __future__ import annotations

import warnings
from typing import Any

import msgspec
import numpy as np
import pytest
import xxhash
from hypothesis import given, settings
from hypothesis import strategies as st

from kvindex.keys import ALGORITHMS, TokenProcessor, extra_keys_from_event

M64 = (1 << 64) - 1


# --- oracle --------------------------------------------------------------------


def _fmix(x: int) -> int:
    x ^= x >> 33
    x = x * 0xFF51AFD7ED558CCD & M64
    x ^= x >> 33
    x = x * 0xC4CEB9FE1A85EC53 & M64
    return x ^ (x >> 33)


def _stream(seed: int, count: int) -> list[int]:
    out, s = [], seed
    for _ in range(count):
        s = (s + 0x9E3779B97F4A7C15) & M64
        z = s
        z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9 & M64
        z = (z ^ (z >> 27)) * 0x94D049BB133111EB & M64
        out.append(z ^ (z >> 31))
    return out


def oracle_keys(
    tokens: list[int],
    bs: int,
    seed: int | str,
    model: str | None,
    lora: str | None,
    extras: list[list[Any] | None] | None,
    salt: str | None,
    parent_state: int | None = None,
) -> list[int]:
    """Plain per-block evaluation of the xxh3_chain recurrence."""
    s0 = seed if isinstance(seed, int) else xxhash.xxh3_64_intdigest(seed.encode())
    A, E, D, *K = _stream(s0, 3 + bs)
    A |= 1
    E |= 1
    K = [k | 1 for k in K]
    if parent_state is None:
        scope = msgspec.msgpack.encode([model, lora])
        state = _fmix(D ^ xxhash.xxh3_64_intdigest(scope))
    else:
        state = parent_state
    n = len(tokens) // bs
    per_block = [list(e) if e else [] for e in (extras or [None] * n)][:n]
    per_block += [[] for _ in range(n - len(per_block))]
    if salt and n:
        b0 = per_block[0]
        pos = next((i for i, x in enumerate(b0) if isinstance(x, bytes)), len(b0))
        per_block[0] = b0[:pos] + [salt] + b0[pos:]
    keys = []
    for i in range(n):
        u = sum(tokens[i * bs + t] * K[t] for t in range(bs))
        if per_block[i]:
            u += E * xxhash.xxh3_64_intdigest(msgspec.msgpack.encode(per_block[i]))
        v = _fmix(u & M64)
        state = (A * state + v) & M64
        keys.append(state)
    return keys


# --- strategies ------------------------------------------------------------------

names = st.one_of(st.none(), st.text(max_size=8))
salts = st.one_of(st.none(), st.text(max_size=6))
seeds = st.one_of(st.integers(0, M64), st.text(max_size=10))
token_ids = st.integers(0, 2**32)
extra_item = st.one_of(
    st.tuples(st.text(min_size=1, max_size=8), st.integers(-300, 300)),
    st.binary(min_size=1, max_size=32),
)
block_extra = st.one_of(st.none(), st.lists(extra_item, max_size=3).map(tuple))


@st.composite
def prompts(draw: st.DrawFn, max_blocks: int = 12) -> tuple[int, list[int]]:
    bs = draw(st.integers(1, 40))
    n_tokens = draw(st.integers(0, bs * max_blocks + bs - 1))
    return bs, draw(st.lists(token_ids, min_size=n_tokens, max_size=n_tokens))


# --- tests -----------------------------------------------------------------------


@settings(max_examples=150, deadline=None)
@given(prompt=prompts(), seed=seeds, model=names, lora=names, salt=salts, data=st.data())
def test_equals_scalar_oracle(
    prompt: tuple[int, list[int]],
    seed: int | str,
    model: str | None,
    lora: str | None,
    salt: str | None,
    data: st.DataObject,
) -> None:
    bs, tokens = prompt
    n = len(tokens) // bs
    extras = data.draw(st.one_of(st.none(), st.lists(block_extra, min_size=n, max_size=n)))
    tp = TokenProcessor(block_size=bs, hash_seed=seed)
    got = tp.request_keys(tokens, model=model, lora=lora, block_extra_keys=extras, cache_salt=salt)
    assert got.dtype == np.uint64 and got.shape == (n,)
    assert got.tolist() == oracle_keys(tokens, bs, seed, model, lora, extras, salt)


@settings(max_examples=100, deadline=None)
@given(prompt=prompts(), seed=seeds, model=names, lora=names, salt=salts, data=st.data())
def test_chain_continues_request_keys_at_every_split(
    prompt: tuple[int, list[int]],
    seed: int | str,
    model: str | None,
    lora: str | None,
    salt: str | None,
    data: st.DataObject,
) -> None:
    bs, tokens = prompt
    n = len(tokens) // bs
    extras = data.draw(st.one_of(st.none(), st.lists(block_extra, min_size=n, max_size=n)))
    tp = TokenProcessor(block_size=bs, hash_seed=seed)
    full = tp.request_keys(tokens, model=model, lora=lora, block_extra_keys=extras, cache_salt=salt)
    # what the event path sees: per-block extras with the salt already in block 0
    ev = [list(e) if e else [] for e in (extras or [None] * n)]
    if salt and n:
        pos = next((i for i, x in enumerate(ev[0]) if isinstance(x, bytes)), len(ev[0]))
        ev[0].insert(pos, salt)
    ev_extras = [tuple(e) or None for e in ev]
    root = tp.chain(None, tokens[: n * bs], model=model, lora=lora, block_extra_keys=ev_extras)
    assert root.tolist() == full.tolist()
    for k in range(1, n + 1):
        prefix = tp.request_keys(
            tokens[: k * bs],
            model=model,
            lora=lora,
            block_extra_keys=None if extras is None else extras[:k],
            cache_salt=salt,
        )
        assert prefix.tolist() == full[:k].tolist()  # prefix stability
        rest = tp.chain(
            int(prefix[-1]),
            tokens[k * bs : n * bs],
            model="ignored with a parent",
            block_extra_keys=ev_extras[k:],
        )
        assert rest.tolist() == full[k:].tolist()
        assert rest.tolist() == oracle_keys(
            tokens[k * bs : n * bs], bs, seed, None, None, ev_extras[k:], None,
            parent_state=int(prefix[-1]),
        )


@settings(max_examples=100, deadline=None)
@given(prompt=prompts(max_blocks=6), seed=seeds)
def test_list_tuple_and_numpy_inputs_agree(prompt: tuple[int, list[int]], seed: int | str) -> None:
    bs, tokens = prompt
    tp = TokenProcessor(block_size=bs, hash_seed=seed)
    ref = tp.request_keys(tokens)
    assert tp.request_keys(tuple(tokens)).tolist() == ref.tolist()
    assert tp.request_keys(np.array(tokens, dtype=np.int64)).tolist() == ref.tolist()
    assert tp.request_keys(np.array(tokens, dtype=np.uint64)).tolist() == ref.tolist()
    if all(t < 2**31 for t in tokens):
        assert tp.request_keys(np.array(tokens, dtype=np.int32)).tolist() == ref.tolist()
    strided = np.array([x for t in tokens for x in (t, 7)], dtype=np.int64)[::2]
    assert tp.request_keys(strided).tolist() == ref.tolist()


@settings(max_examples=100, deadline=None)
@given(prompt=prompts(max_blocks=6), tail=st.lists(token_ids, max_size=39))
def test_trailing_partial_block_is_ignored(prompt: tuple[int, list[int]], tail: list[int]) -> None:
    bs, tokens = prompt
    whole = tokens[: len(tokens) // bs * bs]
    tp = TokenProcessor(block_size=bs)
    ref = tp.request_keys(whole)
    assert tp.request_keys(whole + tail[: bs - 1]).tolist() == ref.tolist()


@settings(max_examples=100, deadline=None)
@given(
    bs=st.integers(1, 16),
    blocks=st.lists(st.lists(token_ids, min_size=16, max_size=16), min_size=2, max_size=6),
    at=st.integers(0, 5),
    seed=seeds,
    data=st.data(),
)
def test_a_change_changes_keys_from_that_block_on(
    bs: int, blocks: list[list[int]], at: int, seed: int | str, data: st.DataObject
) -> None:
    tokens = [t for b in blocks for t in b[:bs]]
    n = len(blocks)
    at = min(at, n - 1)
    tp = TokenProcessor(block_size=bs, hash_seed=seed)
    ref = tp.request_keys(tokens)
    # one token changed in block `at`
    pos = at * bs + data.draw(st.integers(0, bs - 1))
    changed = list(tokens)
    changed[pos] = (changed[pos] + data.draw(st.integers(1, 2**20))) % 2**32
    got = tp.request_keys(changed)
    assert got[:at].tolist() == ref[:at].tolist()
    assert all(g != r for g, r in zip(got[at:].tolist(), ref[at:].tolist()))
    # an extra key on block `at`
    extras: list[Any] = [None] * n
    extras[at] = (("img", data.draw(st.integers(-bs, bs))),)
    got = tp.request_keys(tokens, block_extra_keys=extras)
    assert got[:at].tolist() == ref[:at].tolist()
    assert all(g != r for g, r in zip(got[at:].tolist(), ref[at:].tolist()))


@settings(max_examples=100, deadline=None)
@given(
    tokens=st.lists(token_ids, min_size=8, max_size=40),
    seed=seeds,
    model=names,
    lora=names,
    salt=st.text(min_size=1, max_size=6),
    other=st.data(),
)
def test_seed_scope_and_salt_separate_everything(
    tokens: list[int],
    seed: int | str,
    model: str | None,
    lora: str | None,
    salt: str,
    other: st.DataObject,
) -> None:
    bs = 4
    tp = TokenProcessor(block_size=bs, hash_seed=seed)
    ref = tp.request_keys(tokens, model=model, lora=lora).tolist()
    seed2 = other.draw(seeds.filter(lambda s: s != seed))
    variants = [
        TokenProcessor(block_size=bs, hash_seed=seed2).request_keys(tokens, model=model, lora=lora),
        tp.request_keys(tokens, model=other.draw(names.filter(lambda m: m != model)), lora=lora),
        tp.request_keys(tokens, model=model, lora=other.draw(names.filter(lambda x: x != lora))),
        tp.request_keys(tokens, model=model, lora=lora, cache_salt=salt),
    ]
    for v in variants:
        assert all(a != b for a, b in zip(v.tolist(), ref))


def test_model_and_lora_are_not_interchangeable() -> None:
    tp = TokenProcessor(block_size=2)
    toks = [1, 2, 3, 4]
    a = tp.request_keys(toks, model="m", lora=None)
    b = tp.request_keys(toks, model=None, lora="m")
    c = tp.request_keys(toks, model="m", lora="")
    assert a[0] != b[0] and a[0] != c[0] and b[0] != c[0]
    # a (name, path) LoRA counts by its name only (events carry the name)
    assert tp.request_keys(toks, lora=("m", "/p")).tolist() == b.tolist()


def test_order_matters() -> None:
    tp = TokenProcessor(block_size=4)
    a, b = [1, 2, 3, 4], [5, 6, 7, 8]
    ab = tp.request_keys(a + b)
    ba = tp.request_keys(b + a)
    assert ab[0] != ba[1] and ab[1] != ba[0] and ab[1] != ba[1]
    # within a block: positions matter, including swaps of equal-count tokens
    assert tp.request_keys([1, 2, 3, 4])[0] != tp.request_keys([2, 1, 3, 4])[0]
    assert tp.request_keys([0, 0, 0, 1])[0] != tp.request_keys([1, 0, 0, 0])[0]
    # the same block at a different depth has a different key
    assert tp.request_keys(a + a)[1] != tp.request_keys(a)[0]
    # extra keys: order within a block matters
    x = tp.request_keys(a, block_extra_keys=[(("i", 0), ("j", 1))])
    y = tp.request_keys(a, block_extra_keys=[(("j", 1), ("i", 0))])
    assert x[0] != y[0]


def test_short_prompts_give_empty_arrays() -> None:
    tp = TokenProcessor(block_size=16)
    for toks in ([], list(range(15)), np.arange(15), np.array([], dtype=np.int64), ()):
        got = tp.request_keys(toks)
        assert got.dtype == np.uint64 and got.shape == (0,)
    assert tp.request_keys(list(range(15)), cache_salt="s").shape == (0,)
    assert tp.chain(None, []).shape == (0,)
    assert tp.chain(123, np.array([], dtype=np.int32)).shape == (0,)


def test_extras_lists_and_tuples_hash_alike() -> None:
    tp = TokenProcessor(block_size=2)
    a = tp.request_keys([1, 2], block_extra_keys=[(("img", 3), b"\x01\x02")])
    b = tp.request_keys([1, 2], block_extra_keys=[[["img", 3], b"\x01\x02"]])
    assert a.tolist() == b.tolist()
    # empty extras are no extras
    assert tp.request_keys([1, 2], block_extra_keys=[()]).tolist() == tp.request_keys([1, 2]).tolist()
    # an entry for the trailing partial block is accepted and ignored
    with_partial = tp.request_keys([1, 2, 3], block_extra_keys=[None, (("i", 0),)])
    assert with_partial.tolist() == tp.request_keys([1, 2]).tolist()
    # the salt goes before a prompt-embeds digest, after mm pairs
    s1 = tp.request_keys([1, 2], block_extra_keys=[(("i", 0), b"\x09\x09")], cache_salt="s")
    s2 = tp.request_keys([1, 2], block_extra_keys=[(("i", 0), "s", b"\x09\x09")])
    assert s1.tolist() == s2.tolist()
    # an empty salt is no salt (as in vLLM)
    assert tp.request_keys([1, 2], cache_salt="").tolist() == tp.request_keys([1, 2]).tolist()


def test_extra_keys_from_event_strips_lora_name() -> None:
    assert extra_keys_from_event(None, "a") is None
    got = extra_keys_from_event([["a", ["img", 3]], ["a"]], "a")
    assert got == [(["img", 3],), None]
    assert extra_keys_from_event([None, ["s"]], None) == [None, ("s",)]
    with pytest.raises(ValueError):
        extra_keys_from_event([["b"]], "a")
    with pytest.raises(ValueError):
        extra_keys_from_event([None], "a")


def test_golden_vector() -> None:
    """Pins the algorithm: these values must never change across releases."""
    toks = list(range(1000, 1000 + 64))
    tp = TokenProcessor(block_size=16, hash_seed=0)
    assert tp.request_keys(toks).tolist() == GOLDEN_DEFAULT
    tp2 = TokenProcessor(block_size=16, hash_seed="fleet-a")
    got = tp2.request_keys(
        toks,
        model="llama-3-8b",
        lora="sql",
        block_extra_keys=[(("img-1", 3),), None, (b"\x00\xff",), None],
        cache_salt="tenant",
    )
    assert got.tolist() == GOLDEN_SCOPED
    # the oracle agrees with the pinned values
    assert oracle_keys(toks, 16, 0, None, None, None, None) == GOLDEN_DEFAULT
    assert (
        oracle_keys(
            toks, 16, "fleet-a", "llama-3-8b", "sql",
            [[("img-1", 3)], None, [b"\x00\xff"], None], "tenant",
        )
        == GOLDEN_SCOPED
    )


GOLDEN_DEFAULT = [7275706357142956423, 7954517790212736179, 13259380328230908460, 4360599755282094664]
GOLDEN_SCOPED = [966504848999467043, 11071803202520941094, 10737557121437773102, 10785350245514432743]


def test_bad_arguments_raise() -> None:
    with pytest.raises(ValueError):
        TokenProcessor(block_size=0)
    with pytest.raises(TypeError):
        TokenProcessor(block_size=16.0)  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        TokenProcessor(algorithm="md5")
    with pytest.raises(ValueError):
        TokenProcessor(hash_seed=-1)
    with pytest.raises(ValueError):
        TokenProcessor(hash_seed=2**64)
    with pytest.raises(TypeError):
        TokenProcessor(hash_seed=1.5)  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        TokenProcessor(engine_hash_seed=5)  # type: ignore[arg-type]
    tp = TokenProcessor(block_size=2)
    with pytest.raises(TypeError):
        tp.request_keys("1234")  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        tp.request_keys([1, 2.5, 3, 4])
    with pytest.raises(TypeError):
        tp.request_keys(np.array([1.0, 2.0]))
    with pytest.raises(TypeError):
        tp.request_keys(np.array([True, False]))
    with pytest.raises(TypeError):
        tp.request_keys({1, 2})  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        tp.request_keys([1, -2])
    with pytest.raises(ValueError):
        tp.request_keys(np.array([1, -2]))
    with pytest.raises(ValueError):
        tp.request_keys([2**64, 1])
    with pytest.raises(ValueError):
        tp.request_keys(np.zeros((2, 2), dtype=np.int64))
    with pytest.raises(ValueError):
        tp.request_keys([1, 2, 3, 4], block_extra_keys=[None])
    with pytest.raises(ValueError):
        tp.request_keys([1, 2, 3, 4], block_extra_keys=[None, None, None])
    with pytest.raises(TypeError):
        tp.request_keys([1, 2], block_extra_keys=[5])  # type: ignore[list-item]
    with pytest.raises(TypeError):
        tp.request_keys([1, 2], block_extra_keys=[(3.5,)])
    with pytest.raises(TypeError):
        tp.request_keys([1, 2], block_extra_keys=[(("img", "x"),)])
    with pytest.raises(TypeError):
        tp.request_keys([1, 2], block_extra_keys="ab")  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        tp.request_keys([1, 2], block_extra_keys=[("salt",)], cache_salt="again")
    with pytest.raises(TypeError):
        tp.request_keys([1, 2], cache_salt=b"x")  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        tp.request_keys([1, 2], model=3)  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        tp.request_keys([1, 2], lora=("a",))  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        tp.chain(None, [1, 2, 3])
    with pytest.raises(ValueError):
        tp.chain(None, [1, 2], block_extra_keys=[None, None])
    with pytest.raises(ValueError):
        tp.chain(2**64, [1, 2])
    with pytest.raises(ValueError):
        tp.chain(-1, [1, 2])
    with pytest.raises(TypeError):
        tp.chain("12", [1, 2])  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        tp.chain(b"\x00" * 32, [1, 2])
    with pytest.raises(NotImplementedError):
        tp.engine_digests([1, 2])


def test_public_attributes() -> None:
    assert ALGORITHMS == ("xxh3_chain", "vllm_sha256_cbor", "vllm_sha256")
    tp = TokenProcessor()
    assert (tp.block_size, tp.algorithm, tp.engine_compatible) == (16, "xxh3_chain", False)
    for algo in ALGORITHMS[1:]:
        assert TokenProcessor(algorithm=algo).engine_compatible is True


def test_no_numpy_warnings_and_inputs_untouched() -> None:
    rng = np.random.default_rng(3)
    toks = rng.integers(0, 2**63 - 1, size=4096, dtype=np.int64)
    before = toks.copy()
    tp = TokenProcessor(block_size=16, hash_seed=2**64 - 1)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with np.errstate(all="raise"):
            keys = tp.request_keys(toks, block_extra_keys=[(("i", 1),)] * 256)
            tp.chain(int(keys[10]), toks[176:])
    assert np.array_equal(toks, before)
    assert len(set(keys.tolist())) == keys.size


def test_power_tables_grow_beyond_initial_size() -> None:
    tp = TokenProcessor(block_size=1, hash_seed=9)
    toks = list(range(5000))
    got = tp.request_keys(toks)
    assert got.tolist() == oracle_keys(toks, 1, 9, None, None, None, None)


def test_concurrent_callers_agree_while_tables_grow() -> None:
    from concurrent.futures import ThreadPoolExecutor

    rng = np.random.default_rng(11)
    sizes = rng.integers(1, 40_000, size=24)
    prompts_ = [rng.integers(0, 150_000, size=int(s), dtype=np.int64) for s in sizes]
    expected = [TokenProcessor(block_size=4, hash_seed=5).request_keys(p).tolist() for p in prompts_]
    shared = TokenProcessor(block_size=4, hash_seed=5)
    with ThreadPoolExecutor(max_workers=4) as ex:
        got = list(ex.map(lambda p: shared.request_keys(p).tolist(), prompts_))
    assert got == expected
