"""P/D router pieces that need no engine: conversation ids, answer clean-up, command line."""

from __future__ import annotations

import pytest

from examples.router.__main__ import build_config
from examples.router.app import EngineSpec, RouterConfig
from examples.router.pd import PDRouter, _output_token_ids, _strip_answer, conversation_id_of


def test_conversation_id_header_wins_and_body_field_is_removed():
    body = {"prompt": "x", "conversation_id": "from-body"}
    assert conversation_id_of({"x-conversation-id": "from-header"}, body) == "from-header"
    assert "conversation_id" not in body
    body = {"conversation_id": "from-body"}
    assert conversation_id_of({}, body) == "from-body" and body == {}
    for bad in (None, "", 5, ["a"]):
        assert conversation_id_of({}, {"conversation_id": bad}) is None
    assert conversation_id_of({"x-conversation-id": ""}, {}) is None


def test_answer_clean_up_and_output_ids():
    ans = {
        "choices": [{"text": "a", "token_ids": [5, 6], "prompt_token_ids": [1]}],
        "prompt_token_ids": [1],
        "kv_transfer_params": {"x": 1},
    }
    assert _output_token_ids(ans) == [5, 6]
    kept = {**ans, "choices": [dict(ans["choices"][0])]}
    _strip_answer(kept, keep_ids=True)
    assert "kv_transfer_params" not in kept and kept["choices"][0]["token_ids"] == [5, 6]
    _strip_answer(ans, keep_ids=False)
    assert ans == {"choices": [{"text": "a"}]}
    assert _output_token_ids({"choices": [{"token_ids": ["a"]}]}) is None
    assert _output_token_ids({"choices": []}) is None


def test_command_line_pd_mode():
    c = build_config(
        [
            "--prefill", "prefill-0@http://127.0.0.1:1=tcp://127.0.0.1:2",
            "--decode", "decode-0@http://127.0.0.1:3=tcp://127.0.0.1:4,tcp://127.0.0.1:5",
            "--recompute-threshold", "128", "--no-guard", "--pd-stream", "passthrough",
        ]
    )
    assert c.prefill == ["prefill-0"] and c.decode == ["decode-0"]
    assert [e.pod for e in c.engines] == ["prefill-0", "decode-0"]
    assert c.recompute_threshold == 128 and c.guard is False and c.pd_stream == "passthrough"
    assert PDRouter(c).config is c


def test_pd_router_needs_both_roles():
    e = [EngineSpec(pod="a", url="http://127.0.0.1:1", endpoint="tcp://127.0.0.1:2")]
    with pytest.raises(ValueError):
        PDRouter(RouterConfig(engines=e, prefill=["a"]))
    with pytest.raises(ValueError):
        PDRouter(RouterConfig(engines=e, prefill=["a"], decode=["zzz"]))
