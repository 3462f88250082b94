"""Engine-hash request keys with vLLM 0.33's lookahead hashing equal the engine's own hashes.

tests/data/vllm_lookahead_block_hashes.json was recorded by
bench/record_vllm_captures.py with 0.33's hashing code loaded from the released
wheel (vllm/v1/core/kv_cache_utils.py get_request_block_hasher l.953-1036,
generate_lookahead_block_hash_extra_keys l.1039; equal under 0.34); the
captures in tests/data/vllm033_capture_events.json carry those hashes.  These
tests run without vLLM.
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

from kvevents.misconfig import HASH_ALGORITHM, ConfigCheck
from kvevents.wire import decode_vllm_batch
from kvindex import Config, Indexer
from kvindex.keys import TokenProcessor, digest_to_key, extra_keys_from_event
from tests.oracle import from_json

DATA = Path(__file__).parent / "data"
CASES: list[dict[str, Any]] = json.loads((DATA / "vllm_lookahead_block_hashes.json").read_text())["cases"]
CAPTURES = {m["name"]: m for m in json.loads((DATA / "vllm033_capture_events.json").read_text())["messages"]}



def _extras(case: dict[str, Any]) -> list[tuple[Any, ...] | None] | None:
    """The case's per-block event extras without the LoRA name and the salt (given on their own)."""
    raw = case["event_extra_keys"]
    if raw is None:
        return None
    extras = extra_keys_from_event([None if e is None else from_json(e) for e in raw],
                                   case["lora"][0] if case["lora"] else None)
    if extras and extras[0] is not None:
        extras[0] = tuple(x for x in extras[0] if not isinstance(x, str)) or None
    return extras


def _processor(case: dict[str, Any], la: int | None = None) -> TokenProcessor:
    return TokenProcessor(block_size=case["block_size"], algorithm="vllm_" + case["algorithm"],
                          engine_hash_seed=case["engine_hash_seed"],
                          hash_lookahead_tokens=case["lookahead"] if la is None else la)


def _ids(case: dict[str, Any]) -> str:
    return f"{case['name']}-{case['algorithm']}-{case['engine_hash_seed']}"


def test_recorded_vectors_cover_the_brief() -> None:
    assert {c["lookahead"] for c in CASES} == {0, 1, 2, 3}
    assert {c["algorithm"] for c in CASES} == {"sha256", "sha256_cbor"}
    assert {c["engine_hash_seed"] for c in CASES} == {None, "4242"}
    assert any(c["lora"] for c in CASES) and any(c["cache_salt"] for c in CASES)
    # a multimodal item starting in the lookahead tokens is part of the block before them
    mm3 = next(c for c in CASES if c["name"] == "mm_bs16_L3")
    assert mm3["event_extra_keys"][1] == [["img-7f3a9c", -11], ["img-11be02", 16]]


@pytest.mark.parametrize("case", CASES, ids=_ids)
def test_request_keys_equal_recorded_engine_hashes(case: dict[str, Any]) -> None:
    tp = _processor(case)
    kw = {"lora": tuple(case["lora"]) if case["lora"] else None, "block_extra_keys": _extras(case),
          "cache_salt": case["cache_salt"]}
    keys = tp.request_keys(case["tokens"], **kw)
    assert keys.dtype == np.uint64 and keys.tolist() == case["block_hashes"]
    # the engine hashes a block once the lookahead tokens after it exist
    assert len(keys) == max(len(case["tokens"]) - case["lookahead"], 0) // case["block_size"]
    digests = tp.engine_digests(np.array(case["tokens"], dtype=np.int64), **kw)
    assert [d.hex() for d in digests] == case["digests_hex"]
    assert [digest_to_key(d) for d in digests] == case["block_hashes"]


@pytest.mark.parametrize("case", [c for c in CASES if c["lookahead"]], ids=_ids)
def test_lookahead_keys_differ_from_plain_keys(case: dict[str, Any]) -> None:
    plain = _processor(case, 0).request_keys(case["tokens"], lora=tuple(case["lora"]) if case["lora"] else None,
                                             cache_salt=case["cache_salt"])
    assert not set(plain.tolist()) & set(case["block_hashes"])


def test_default_is_no_lookahead_bit_for_bit() -> None:
    for case in (c for c in CASES if c["lookahead"] == 0 and not c["event_extra_keys"]):
        tp = TokenProcessor(block_size=case["block_size"], algorithm="vllm_" + case["algorithm"],
                            engine_hash_seed=case["engine_hash_seed"])
        assert tp.hash_lookahead_tokens == 0
        assert tp.request_keys(case["tokens"]).tolist() == case["block_hashes"]


def test_option_checks_and_chain_refusal() -> None:
    with pytest.raises(ValueError):
        TokenProcessor(hash_lookahead_tokens=-1)
    with pytest.raises(TypeError):
        TokenProcessor(hash_lookahead_tokens=True)  # type: ignore[arg-type]
    with pytest.raises(NotImplementedError):
        TokenProcessor(4, algorithm="vllm_sha256_cbor", hash_lookahead_tokens=1).chain(None, list(range(8)))
    # own keys: the option leaves out the tail blocks and changes no key
    own, own_la = TokenProcessor(4), TokenProcessor(4, hash_lookahead_tokens=3)
    toks = list(range(18))
    assert own_la.request_keys(toks).tolist() == own.request_keys(toks[:15]).tolist()
    assert own_la.chain(None, toks[:16]).tolist() == own.chain(None, toks[:16]).tolist()
    with pytest.raises(ValueError):
        Config.from_dict({"token_processor_config": {"hash_lookahead_tokens": -2}})


def _capture_event(name: str, i: int = 0) -> Any:
    return decode_vllm_batch(bytes.fromhex(CAPTURES[name]["payload_hex"])).events[i]


def test_keys_from_a_captured_event_equal_its_hashes() -> None:
    # a router that sees only the event: tokens + the last block's lookahead tokens, extras as published
    ev = _capture_event("lookahead_lora_mm_salt")
    la = len(ev.lookahead_token_ids[0])
    tokens = list(ev.token_ids) + list(ev.lookahead_token_ids[-1])
    extras = extra_keys_from_event(ev.extra_keys, ev.lora_name)
    tp = TokenProcessor(ev.block_size, algorithm="vllm_sha256_cbor", hash_lookahead_tokens=la,
                        lora_paths={"chat": "/adapters/chat"})
    assert tp.request_keys(tokens, lora=ev.lora_name, block_extra_keys=extras).tolist() == list(ev.block_hashes)
    hyb = _capture_event("hybrid_groups_lookahead", 1)
    tp2 = TokenProcessor(hyb.block_size, algorithm="vllm_sha256_cbor", hash_lookahead_tokens=2)
    assert tp2.request_keys(list(hyb.token_ids) + list(hyb.lookahead_token_ids[-1])).tolist() == list(hyb.block_hashes)


@pytest.mark.parametrize("configured", [0, 1, 2])
def test_config_check_names_the_lookahead_setting(configured: int) -> None:
    ev = _capture_event("hybrid_groups_lookahead")  # hashed with 2 lookahead tokens, no extras
    tp = TokenProcessor(ev.block_size, algorithm="vllm_sha256_cbor", hash_lookahead_tokens=configured)
    check = ConfigCheck(tp).stream("pod-a", None, 0)
    check.events([ev])
    problems = [p for p in check.problems if p.reason == HASH_ALGORITHM]
    if configured == 2:
        assert problems == []
    else:
        assert len(problems) == 1 and "hash_lookahead_tokens: 2" in problems[0].message


def test_score_leaves_the_prompt_tail_out() -> None:
    cfg = Config.from_dict({"model_name": "m", "token_processor_config": {
        "block_size": 16, "algorithm": "vllm_sha256_cbor", "hash_lookahead_tokens": 3}})
    case = next(c for c in CASES if c["name"] == "short_bs16_L3" and c["algorithm"] == "sha256_cbor"
                and c["engine_hash_seed"] is None)
    with Indexer(cfg) as ix:
        assert ix.token_processor.hash_lookahead_tokens == 3
        assert ix.request_keys(case["tokens"]).tolist() == case["block_hashes"]
        # 34 tokens: block 1 ends at 32, only 2 tokens follow it, so it has no hash yet
        s = ix.score(case["tokens"][:34], ["pod-a"])
        assert s.request_blocks == 1
        assert ix.score(case["tokens"][:35], ["pod-a"]).request_blocks == 2


# --- plain restatement of the lookahead formula, driven by hypothesis ----------


def _h(algorithm: str, obj: Any) -> bytes:
    if algorithm == "vllm_sha256":
        return hashlib.sha256(pickle.dumps(obj, protocol=5)).digest()
    return hashlib.sha256(cbor2.dumps(obj, canonical=True)).digest()


def _oracle(algorithm: str, bs: int, la: int, tokens: list[int], salt: str | None) -> list[int]:
    """H((parent, block tokens, (tagged extras or None, *next la tokens))) for every block la tokens follow."""
    parent = _h(algorithm, "vllm-none-hash")
    out = []
    for i in range((len(tokens) - la) // bs if len(tokens) >= la else 0):
        tagged = (("cache_salt", salt),) if i == 0 and salt else None
        ek = (tagged, *tokens[(i + 1) * bs:(i + 1) * bs + la]) if la else tagged
        parent = _h(algorithm, (parent, tuple(tokens[i * bs:(i + 1) * bs]), ek))
        out.append(int.from_bytes(parent[-8:], "big"))
    return out


@settings(max_examples=60, deadline=None)
@given(algorithm=st.sampled_from(["vllm_sha256_cbor", "vllm_sha256"]), bs=st.integers(1, 6), la=st.integers(0, 7),
       tokens=st.lists(st.integers(0, 2**32), max_size=30), salt=st.none() | st.sampled_from(["s", "tenant-7"]))
def test_lookahead_keys_equal_plain_formula(algorithm: str, bs: int, la: int, tokens: list[int],
                                            salt: str | None) -> None:
    tp = TokenProcessor(bs, algorithm=algorithm, hash_lookahead_tokens=la)
    assert tp.request_keys(tokens, cache_salt=salt).tolist() == _oracle(algorithm, bs, la, tokens, salt)
