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


def test_command_line_redis_url_selects_the_shared_index():
    c = build_config(["--engine", "p@http://127.0.0.1:1=tcp://127.0.0.1:2", "--redis-url", "redis://127.0.0.1:7/0"])
    kbi = c.indexer_config("m").kv_block_index_config
    assert kbi.backend == "redis" and kbi.redis_config.url == "redis://127.0.0.1:7/0"


def test_replicas_on_one_redis_share_the_retained_entries(redis_url):
    """Two P/D router replicas on one Redis: turn 1's entry (stored by A) is taken by B, once."""
    from connector.redis_retained import RedisRetainedStore
    from connector.retained import RetainedStore
    from examples.router.pd import make_retained_store
    from kvindex.facade import Config, Indexer
    from tests.test_connector_retained import d_params

    def replica(backend: str) -> Indexer:
        return Indexer(Config.from_dict({
            "model_name": "m",
            "token_processor_config": {"block_size": 16},
            "kv_block_index_config": {"backend": backend, "redis_config": {"url": redis_url,
                                                                            "key_prefix": "pdunit:{r}:"}},
        }))

    with replica("redis") as a_ix, replica("redis") as b_ix, replica("native") as local:
        a, b = make_retained_store(a_ix, 30.0), make_retained_store(b_ix, 30.0)
        assert isinstance(a, RedisRetainedStore) and isinstance(make_retained_store(local, 30.0), RetainedStore)
        tokens = list(range(1, 50))
        keys = a_ix.token_processor.request_keys(tokens).tolist()
        put = a.put("conv-r", "decode-0", d_params(len(tokens), "req-1"), tokens, keys)
        got = b.take("conv-r")
        assert got == put and a.take("conv-r") is None


@pytest.mark.parametrize("chat", [False, True])
def test_prefill_leg_drops_what_only_shapes_the_discarded_answer(chat):
    """P's answer is thrown away (only its kv_transfer_params are kept): logprobs, prompt logprobs
    (which make vLLM skip reading P's prefix cache) and echo are not sent to P; the client's body
    is left as it was, for the D leg."""
    from examples.router.pd import PREFILL_DROPPED_FIELDS, prefill_body

    body = {
        "model": "m", "prompt": [1, 2, 3], "max_tokens": 50, "min_tokens": 10, "temperature": 0.0,
        "stream": True, "stream_options": {"include_usage": True}, "logprobs": True if chat else 5,
        "top_logprobs": 5, "prompt_logprobs": 1, "echo": True, "seed": 7,
    }
    if chat:
        body["max_completion_tokens"] = 50
    before = dict(body)
    params = {"do_remote_decode": True}
    p = prefill_body(body, params, chat)
    assert body == before
    assert not set(PREFILL_DROPPED_FIELDS) & set(p)
    assert p["kv_transfer_params"] is params and p["stream"] is False and p["max_tokens"] == 1
    assert p.get("max_completion_tokens", 1) == 1 and ("max_completion_tokens" in p) == chat
    assert {k: p[k] for k in ("model", "prompt", "temperature", "seed")} == {
        k: body[k] for k in ("model", "prompt", "temperature", "seed")
    }


@pytest.mark.parametrize(
    ("chat", "body", "alone"),
    [
        (False, {"prompt": [1, 2, 3]}, False),
        (False, {"prompt": "one prompt"}, False),
        (False, {"prompt": [[1, 2, 3]]}, False),  # a batch of one: one set of params fits
        (False, {"prompt": ["a", "b"]}, True),
        (False, {"prompt": [[1, 2], [3, 4]]}, True),
        (False, {"prompt": [1, 2], "n": 2}, True),
        (False, {"prompt": [1, 2], "n": "3"}, True),  # the engine's validation coerces it
        (False, {"prompt": [1, 2], "n": 1}, False),
        (False, {"prompt": [1, 2], "use_beam_search": True}, True),
        (False, {"prompt": [1, 2], "prompt_logprobs": 0}, True),
        (False, {"prompt": [1, 2], "echo": True, "logprobs": 1}, True),
        (False, {"prompt": [1, 2], "echo": True}, False),
        (False, {"prompt": [1, 2], "logprobs": 5}, False),
        (True, {"messages": [{"role": "user", "content": "x"}]}, False),
        (True, {"messages": [], "n": 2}, True),
        (True, {"messages": [], "prompt_logprobs": 1}, True),
        (True, {"messages": [], "echo": True}, True),  # chat's top_logprobs defaults to 0: prompt logprobs
        (True, {"messages": [], "logprobs": True, "top_logprobs": 3}, False),
    ],
)
def test_requests_one_prefill_cannot_serve_go_to_decode_alone(chat, body, alone):
    """A batch of prompts would make D load the first prompt's KV for the others; n > 1 makes every
    sample read P's blocks (freed after the first read); prompt logprobs make D recompute anyway."""
    from examples.router.pd import decode_only_reason

    reason = decode_only_reason(dict(body), chat)
    assert (reason is not None) == alone, reason


def test_buffered_stream_keeps_what_a_stream_carries():
    """A whole answer re-emitted as events keeps what vLLM's stream chunks carry: the reasoning
    text, stop_reason, tool calls with their index, and token ids the client asked for."""
    from examples.router.pd import answer_as_events

    usage = {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5}
    chat = {
        "id": "c1", "created": 1, "model": "m", "usage": usage, "prompt_token_ids": [1, 2, 3],
        "choices": [{
            "index": 0, "finish_reason": "stop", "stop_reason": "END", "logprobs": None, "token_ids": [7, 8],
            "message": {"role": "assistant", "content": "hi", "reasoning": "because",
                        "tool_calls": [{"id": "t1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]},
        }],
    }
    first, last = answer_as_events(chat, True, include_usage=True)
    c = first["choices"][0]
    assert first["object"] == "chat.completion.chunk" and first["prompt_token_ids"] == [1, 2, 3]
    assert c["delta"]["content"] == "hi" and c["delta"]["reasoning"] == "because"
    assert c["delta"]["tool_calls"][0]["index"] == 0 and c["delta"]["tool_calls"][0]["id"] == "t1"
    assert c["stop_reason"] == "END" and c["token_ids"] == [7, 8]
    assert last["choices"] == [] and last["usage"] == usage
    comp = {
        "id": "x", "created": 1, "model": "m", "usage": usage,
        "choices": [{"index": 0, "text": "ab", "finish_reason": "stop", "stop_reason": 13, "logprobs": None,
                     "token_ids": [7, 8], "prompt_token_ids": [1, 2, 3]}],
    }
    (only,) = answer_as_events(comp, False, include_usage=False)
    assert only["object"] == "text_completion"
    assert only["choices"] == [comp["choices"][0]]
    # token ids the client did not ask for were stripped from the answer before: none appear
    del comp["choices"][0]["token_ids"], comp["choices"][0]["prompt_token_ids"]
    (only,) = answer_as_events(comp, False, include_usage=False)
    assert "token_ids" not in only["choices"][0] and "prompt_token_ids" not in only["choices"][0]


def test_command_line_decode_alone_rule():
    from connector.decode_alone import DecodeAloneRule

    engines = ["--prefill", "p@http://127.0.0.1:1=tcp://127.0.0.1:2", "--decode", "d@http://127.0.0.1:3=tcp://127.0.0.1:4"]
    assert build_config(engines).decode_alone is None
    c = build_config([*engines, "--decode-alone", "256"])
    assert c.decode_alone == DecodeAloneRule(max_tokens=256)
    with pytest.raises(SystemExit):
        build_config([*engines, "--decode-alone", "-1"])
