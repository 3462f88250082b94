"""kv_transfer_params: round trips, passthrough of unknown fields, rejection reasons, body/SSE parsing, fuzz."""

from __future__ import annotations

import json

import msgspec
from hypothesis import given, settings
from hypothesis import strategies as st

from connector.params import (
    PrefillRequestParams,
    RejectCounter,
    RemoteKVParams,
    decode_request_params,
    params_from_json_body,
    params_from_sse,
    parse_params,
    prefill_request_params,
)

# D's answer as vLLM 0.32 sends it (FACTS: real engines, 2026-12-01)
D_ANSWER = {
    "do_remote_prefill": False,
    "do_remote_decode": True,
    "remote_block_ids": [[3, 4, 5]],
    "remote_engine_id": "e-d",
    "remote_request_id": "cmpl-1",
    "remote_host": "127.0.0.1",
    "remote_port": 5600,
    "tp_size": 1,
    "dcp_size": 1,
    "pp_size": 1,
    "remote_num_tokens": 70,
    "remote_blocks_expiry_time": 12345.5,
    "transfer_mode": "pull",
}
P_ANSWER = {**D_ANSWER, "do_remote_prefill": True, "do_remote_decode": False, "remote_blocks_expiry_time": None,
            "remote_prefill_cached_tokens": 0}

ident = st.text(st.characters(min_codepoint=33, max_codepoint=126), min_size=1, max_size=12)
json_scalar = st.none() | st.booleans() | st.integers(-10, 10**6) | st.floats(allow_nan=False, allow_infinity=False) | st.text(max_size=8)
extra_fields = st.dictionaries(ident.filter(lambda k: k not in D_ANSWER), json_scalar, max_size=4)


@st.composite
def remote_params(draw):
    groups = draw(st.integers(1, 3))
    blocks = draw(st.integers(0, 20))
    d = dict(D_ANSWER)
    d["remote_block_ids"] = [draw(st.lists(st.integers(0, 2**31), min_size=blocks, max_size=blocks)) for _ in range(groups)]
    d["remote_engine_id"] = draw(ident)
    d["remote_request_id"] = draw(ident)
    d["remote_host"] = draw(ident)
    d["remote_port"] = draw(st.integers(1, 65535))
    d["remote_num_tokens"] = draw(st.integers(0, 10**6))
    d["remote_blocks_expiry_time"] = draw(st.floats(0, 1e9))
    if draw(st.booleans()):
        d["do_remote_prefill"], d["do_remote_decode"] = True, False
    d.update(draw(extra_fields))
    return d


@given(remote_params())
@settings(max_examples=200)
def test_round_trip_keeps_every_field(d):
    rej = RejectCounter()
    p = parse_params(d, rejects=rej)
    assert p is not None, rej.counts
    assert p.to_dict() == d
    # and through JSON bytes, as a body and as an SSE chunk
    body = json.dumps({"id": "x", "choices": [], "kv_transfer_params": d}).encode()
    assert params_from_json_body(body, rejects=rej).to_dict() == d
    sse = [b"data: " + json.dumps({"choices": []}).encode(), b"", b"data: " + body, b"", b"data: [DONE]"]
    assert params_from_sse(sse, rejects=rej).to_dict() == d
    assert rej.total() == 0


def test_first_leg_and_decode_leg_builders():
    assert prefill_request_params().to_dict() == {
        "do_remote_decode": True,
        "do_remote_prefill": False,
        "remote_engine_id": None,
        "remote_block_ids": None,
        "remote_host": None,
        "remote_port": None,
    }
    p = parse_params({**P_ANSWER, "future_field": [1, 2]})
    d = decode_request_params(p)
    assert d.to_dict() == {**P_ANSWER, "future_field": [1, 2]}
    assert d is not p and d.extra is not p.extra
    try:
        decode_request_params(parse_params(D_ANSWER))
    except ValueError:
        pass
    else:
        raise AssertionError("D's answer is not a P answer")


def test_known_field_wins_over_extra():
    p = parse_params(D_ANSWER)
    p.extra["remote_port"] = 1
    assert p.to_dict()["remote_port"] == 5600


BAD = [
    ({k: v for k, v in D_ANSWER.items() if k != "remote_engine_id"}, "missing_engine_id"),
    ({**D_ANSWER, "remote_engine_id": ""}, "missing_engine_id"),
    ({k: v for k, v in D_ANSWER.items() if k != "remote_block_ids"}, "missing_block_ids"),
    ({k: v for k, v in D_ANSWER.items() if k != "remote_host"}, "missing_host"),
    ({**D_ANSWER, "remote_port": None}, "missing_port"),
    ({**D_ANSWER, "remote_port": 0}, "bad_port"),
    ({**D_ANSWER, "remote_port": "5600"}, "bad_type"),
    ({**D_ANSWER, "remote_port": 5600.0}, "bad_type"),
    ({**D_ANSWER, "remote_block_ids": [1, 2, 3]}, "bad_block_ids"),
    ({**D_ANSWER, "remote_block_ids": [[1, "2"]]}, "bad_block_ids"),
    ({**D_ANSWER, "remote_block_ids": [[1.5]]}, "bad_block_ids"),
    ({**D_ANSWER, "remote_block_ids": []}, "no_block_groups"),
    ({**D_ANSWER, "remote_block_ids": [[1, -2]]}, "negative_block_id"),
    ({**D_ANSWER, "remote_request_id": None}, "missing_request_id"),
    ({**D_ANSWER, "tp_size": 0}, "bad_parallel_size"),
    ({**D_ANSWER, "remote_num_tokens": -1}, "negative_num_tokens"),
    ({**D_ANSWER, "do_remote_prefill": True}, "bad_direction"),
    ({**D_ANSWER, "do_remote_decode": False}, "bad_direction"),
    ([1, 2], "not_an_object"),
]


def test_invalid_params_are_rejected_with_counted_reasons(caplog):
    rej = RejectCounter()
    for obj, reason in BAD:
        assert parse_params(obj, rejects=rej) is None, reason
        assert rej.counts[reason] >= 1, (reason, rej.counts)
    assert rej.total() == len(BAD)
    # logged once per reason, not once per rejection
    before = len(caplog.records)
    parse_params(BAD[0][0], rejects=rej)
    assert len(caplog.records) == before


def test_bodies_without_params_and_bad_bodies():
    rej = RejectCounter()
    assert params_from_json_body(b'{"choices": []}', rejects=rej) is None
    assert params_from_json_body(b'{"kv_transfer_params": null}', rejects=rej) is None
    assert rej.total() == 0
    assert params_from_json_body(b"not json", rejects=rej) is None
    assert params_from_json_body(b"[1]", rejects=rej) is None
    assert rej.counts["bad_body"] == 2
    assert params_from_sse([b"data: {", b": comment", "data: [DONE]"], rejects=rej) is None
    assert rej.counts["bad_sse_chunk"] == 1


@given(st.binary(max_size=300))
@settings(max_examples=300)
def test_fuzz_body_never_raises(b):
    rej = RejectCounter()
    r = params_from_json_body(b, rejects=rej)
    assert r is None or isinstance(r, RemoteKVParams)
    params_from_sse(b.split(b"\n"), rejects=rej)


json_values = st.recursive(json_scalar, lambda c: st.lists(c, max_size=3) | st.dictionaries(st.text(max_size=5), c, max_size=3), max_leaves=10)


@given(st.dictionaries(st.sampled_from(sorted(D_ANSWER)) | ident, json_values, max_size=14))
@settings(max_examples=120)
def test_fuzz_params_objects(obj):
    """Any JSON object: either rejected (counted) or a valid, round-trippable params object."""
    rej = RejectCounter()
    p = parse_params(obj, rejects=rej)
    if p is None:
        assert rej.total() == 1
    else:
        assert p.to_dict() == obj
        assert all(isinstance(b, int) and b >= 0 for g in p.remote_block_ids for b in g)
        assert p.validate() is p


def test_prefill_request_params_is_msgspec_struct():
    assert isinstance(PrefillRequestParams(), msgspec.Struct)


def test_vllm033_remote_registration_generation_passes_through():
    # vLLM 0.33's NixlConnector adds remote_registration_generation to P's answer (pull_scheduler.py
    # l.291; D reads it with default 0, metadata.py l.343): unknown here, it must reach D unchanged,
    # in a JSON body and on a stream's finish chunk (chat_completion/serving.py l.821)
    answer = {**P_ANSWER, "remote_registration_generation": 3}
    p = parse_params(answer)
    assert p is not None and p.extra == {"remote_registration_generation": 3}
    d = decode_request_params(p)
    assert d.to_dict() == answer
    body = json.dumps({"id": "cmpl-1", "choices": [], "kv_transfer_params": answer})
    assert params_from_json_body(body).to_dict() == answer
    finish = {"id": "c", "choices": [{"index": 0, "delta": {}, "finish_reason": "length"}], "kv_transfer_params": answer}
    lines = ["data: " + json.dumps({"id": "c", "choices": []}), "", "data: " + json.dumps(finish), "", "data: [DONE]"]
    assert decode_request_params(params_from_sse(lines)).to_dict() == answer
