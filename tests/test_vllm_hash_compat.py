"""Engine-hash-compatible request keys reproduce vLLM's own block hashes.

tests/data/vllm_block_hashes.json was recorded by bench/record_vllm_hashes.py
from vLLM 0.32's hashing code (vllm/v1/core/kv_cache_utils.py
get_request_block_hasher); these tests run without vLLM.  A hypothesis test
also compares against a plain restatement of vLLM's formula
(hash_block_tokens: H((parent or NONE_HASH, tuple(tokens), tagged extras))).
"""

from __future__ import annotations

import hashlib
import json
import pickle
from pathlib import Path
from typing import Any

import cbor2
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvindex.keys import TokenProcessor, digest_to_key, extra_keys_from_event
from tests.oracle import from_json

DATA = Path(__file__).parent / "data" / "vllm_block_hashes.json"
CASES: list[dict[str, Any]] = json.loads(DATA.read_text())["cases"]



def _event_extras(case: dict[str, Any]) -> list[tuple[Any, ...] | None] | None:
    """The case's per-block event extras, LoRA name removed (salt kept)."""
    raw = case["event_extra_keys"]
    if raw is None:
        return None
    extras = [None if e is None else from_json(e) for e in raw]
    lora_name = case["lora"][0] if case["lora"] else None
    return extra_keys_from_event(extras, lora_name)


def _without_salt(extras: list[tuple[Any, ...] | None] | None) -> list[tuple[Any, ...] | None] | None:
    if extras is None:
        return None
    out = list(extras)
    if out and out[0] is not None:
        out[0] = tuple(x for x in out[0] if not isinstance(x, str)) or None
    return out


def _processor(case: dict[str, Any], **kw: Any) -> TokenProcessor:
    return TokenProcessor(
        block_size=case["block_size"],
        algorithm="vllm_" + case["algorithm"],
        engine_hash_seed=case["engine_hash_seed"],
        **kw,
    )


def _ids(case: dict[str, Any]) -> str:
    return f"{case['name']}-{case['algorithm']}-{case['engine_hash_seed']}"


def test_recorded_vectors_cover_the_brief() -> None:
    algos = {c["algorithm"] for c in CASES}
    seeds = {c["engine_hash_seed"] for c in CASES}
    sizes = {c["block_size"] for c in CASES}
    assert algos == {"sha256", "sha256_cbor"}
    assert None in seeds and len(seeds) == 2
    assert sizes == {16, 32}
    assert any(c["cache_salt"] for c in CASES)
    assert any(c["lora"] for c in CASES)
    assert any(
        isinstance(x, list) for c in CASES for e in (c["event_extra_keys"] or []) if e for x in e
    )
    assert sum(len(c["block_hashes"]) for c in CASES) > 300


@pytest.mark.parametrize("case", CASES, ids=_ids)
def test_request_keys_equal_recorded_engine_hashes(case: dict[str, Any]) -> None:
    tp = _processor(case)
    lora = tuple(case["lora"]) if case["lora"] else None
    extras = _event_extras(case)
    keys = tp.request_keys(
        case["tokens"],
        lora=lora,
        block_extra_keys=_without_salt(extras),
        cache_salt=case["cache_salt"],
    )
    assert keys.dtype == np.uint64
    assert keys.tolist() == case["block_hashes"]
    digests = tp.engine_digests(
        np.array(case["tokens"], dtype=np.int64),
        lora=lora,
        block_extra_keys=_without_salt(extras),
        cache_salt=case["cache_salt"],
    )
    assert [d.hex() for d in digests] == case["digests_hex"]
    assert [digest_to_key(d) for d in digests] == case["block_hashes"]


@pytest.mark.parametrize("case", CASES, ids=_ids)
def test_chain_from_root_and_from_digest_equals_recorded(case: dict[str, Any]) -> None:
    tp = _processor(case)
    bs = case["block_size"]
    lora = tuple(case["lora"]) if case["lora"] else None
    extras = _event_extras(case)
    n = len(case["block_hashes"])
    toks = case["tokens"][: n * bs]
    assert tp.chain(None, toks, lora=lora, block_extra_keys=extras).tolist() == case["block_hashes"]
    for k in range(1, n):
        parent = bytes.fromhex(case["digests_hex"][k - 1])
        got = tp.chain(
            parent,
            toks[k * bs :],
            lora=lora,
            block_extra_keys=None if extras is None else extras[k:],
        )
        assert got.tolist() == case["block_hashes"][k:]


@pytest.mark.parametrize("case", [c for c in CASES if c["lora"]], ids=_ids)
def test_lora_by_name_through_lora_paths(case: dict[str, Any]) -> None:
    name, path = case["lora"]
    tp = _processor(case, lora_paths={name: path})
    keys = tp.request_keys(
        case["tokens"],
        lora=name,
        block_extra_keys=_without_salt(_event_extras(case)),
        cache_salt=case["cache_salt"],
    )
    assert keys.tolist() == case["block_hashes"]
    with pytest.raises(ValueError, match="path"):
        _processor(case).request_keys(case["tokens"], lora=name)
    other = tp.request_keys(
        case["tokens"],
        lora=(name, path + "-v2"),
        block_extra_keys=_without_salt(_event_extras(case)),
        cache_salt=case["cache_salt"],
    )
    assert other.size and other[0] != keys[0]


@pytest.mark.parametrize("algorithm", ["vllm_sha256_cbor", "vllm_sha256"])
def test_compat_chain_cannot_continue_from_uint64(algorithm: str) -> None:
    tp = TokenProcessor(block_size=4, algorithm=algorithm)
    assert tp.engine_compatible
    keys = tp.request_keys(list(range(8)))
    with pytest.raises(NotImplementedError):
        tp.chain(int(keys[0]), [4, 5, 6, 7])
    with pytest.raises(ValueError):
        tp.chain(b"\x00" * 8, [4, 5, 6, 7])


# --- plain restatement of vLLM's formula, driven by hypothesis -----------------


def _h(algorithm: str, obj: Any) -> bytes:
    if algorithm == "vllm_sha256":
        return hashlib.sha256(pickle.dumps(obj, protocol=5)).digest()
    return hashlib.sha256(cbor2.dumps(obj, canonical=True)).digest()


def _own(s: str) -> str:
    """An equal string that is a distinct object, as the engine's independently
    built strings are (pickle shares only identical objects)."""
    return s.encode().decode()


def _oracle(
    algorithm: str,
    seed: str | None,
    bs: int,
    tokens: list[int],
    lora: tuple[str, str] | None,
    mm: list[list[tuple[str, int]]],
    salt: str | None,
) -> list[int]:
    parent = _h(algorithm, "vllm-none-hash" if seed is None else seed)
    out = []
    for i in range(len(tokens) // bs):
        tagged: list[Any] = []
        if lora:
            tagged.append(("lora", _own(lora[0]), _own(lora[1])))
        tagged += [("mm", _own(ident), off) for ident, off in mm[i]]
        if i == 0 and salt:
            tagged.append(("cache_salt", _own(salt)))
        parent = _h(algorithm, (parent, tuple(tokens[i * bs : (i + 1) * bs]), tuple(tagged) or None))
        out.append(int.from_bytes(parent[-8:], "big"))
    return out


_ident = st.text(alphabet="abcdef0123456789-", min_size=2, max_size=12)


@settings(max_examples=80, deadline=None)
@given(
    algorithm=st.sampled_from(["vllm_sha256_cbor", "vllm_sha256"]),
    seed=st.one_of(st.none(), st.text(alphabet="0123456789", min_size=1, max_size=6)),
    bs=st.integers(1, 8),
    tokens=st.lists(st.integers(0, 2**32), max_size=40),
    lora=st.one_of(st.none(), st.tuples(_ident, _ident.map(lambda s: "/a/" + s))),
    salt=st.one_of(st.none(), st.just(""), _ident),
    data=st.data(),
)
def test_compat_keys_equal_plain_formula(
    algorithm: str,
    seed: str | None,
    bs: int,
    tokens: list[int],
    lora: tuple[str, str] | None,
    salt: str | None,
    data: st.DataObject,
) -> None:
    n = len(tokens) // bs
    mm_idents = data.draw(st.lists(_ident, min_size=3, max_size=3, unique=True))
    mm = [
        data.draw(
            st.lists(st.tuples(st.sampled_from(mm_idents), st.integers(-50, 50)), max_size=2,
                     unique_by=lambda p: p[0])
        )
        for _ in range(n)
    ]
    tp = TokenProcessor(block_size=bs, algorithm=algorithm, engine_hash_seed=seed)
    got = tp.request_keys(
        tokens, lora=lora, block_extra_keys=[tuple(b) or None for b in mm], cache_salt=salt
    )
    assert got.tolist() == _oracle(algorithm, seed, bs, tokens, lora, mm, salt)
