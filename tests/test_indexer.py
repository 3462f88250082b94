"""The facade: config loading, score() on the read path, route() bookkeeping."""

from __future__ import annotations

import json

import msgspec
import pytest

from kvindex.facade import Config, Indexer, load_config
from kvindex.tiers import CPU, GPU
from scorer.load import LoadSnapshot

BS = 4
TOKENS = list(range(1, 41))  # 10 blocks


def indexer(**scorer) -> Indexer:
    return Indexer(Config.from_dict({"model_name": "m", "token_processor_config": {"block_size": BS},
                                     "scorer_config": scorer}))


def store(ix: Indexer, pod: str, blocks: int, tier: str = GPU) -> None:
    base = ord(pod[0]) * 1000
    ix.index.block_stored(pod, 0, list(range(base, base + blocks)), None,
                          TOKENS[: blocks * BS], tier, block_size=BS, model="m")


def test_config_json_yaml_roundtrip(tmp_path):
    cfg = Config.from_dict({"model_name": "x", "token_processor_config": {"block_size": 32, "hash_seed": "s"},
                            "kv_events_config": {"engines": [{"pod": "a", "endpoint": "tcp://h:1", "dp_size": 2}]}})
    p = tmp_path / "c.json"
    p.write_bytes(cfg.to_json())
    assert load_config(p) == cfg
    y = tmp_path / "c.yaml"
    y.write_text("model_name: x\ntoken_processor_config: {block_size: 32, hash_seed: s}\n"
                 "kv_events_config:\n  engines:\n    - {pod: a, endpoint: 'tcp://h:1', dp_size: 2}\n")
    assert load_config(y) == cfg
    assert cfg.kv_events_config.engines[0].ranks()[1] == (1, "tcp://h:2", None)


@pytest.mark.parametrize("bad", [
    {"token_processor_config": {"block_sise": 16}},
    {"token_processor_config": {"block_size": 0}},
    {"token_processor_config": {"algorithm": "md5"}},
    {"kv_events_config": {"engines": [{"endpoint": "tcp://h:1"}]}},
    {"kv_events_config": {"engines": [{"pod": "a", "endpoint": "tcp://h:1", "dp_size": 0}]}},
    {"scorer_config": {"weights": {"prefix": -1}}},
    {"scorer_config": {"picker": "fastest"}},
    {"scorer_config": {"kv_pressure": -1}},
    {"scorer_config": {"kv_pressure": float("nan")}},
])
def test_config_rejects_bad_values(bad):
    with pytest.raises((msgspec.ValidationError, ValueError)):
        Indexer(Config.from_dict(bad))


def test_config_yaml_must_be_mapping():
    with pytest.raises(ValueError):
        Config.from_yaml("- a\n- b\n")
    assert Config.from_yaml("") == Config()
    assert Config.from_json(json.dumps({"model_name": "q"})).model_name == "q"


def test_score_prefers_longer_prefix_and_explains():
    ix = indexer()
    store(ix, "a", 3)
    store(ix, "b", 7)
    r = ix.score(TOKENS + [99, 98])
    assert r.request_blocks == 10
    assert r.pod == "b"
    assert r.prefix["b"].matched_tokens == 28 and r.prefix["a"].matched_tokens == 12
    assert r.prefix["a"].coverage == pytest.approx(0.3)
    assert "chosen=b" in r.explain()


def test_score_tier_weight_and_load():
    ix = indexer()
    store(ix, "a", 5, tier=CPU)
    store(ix, "b", 5)
    assert ix.score(TOKENS).pod == "b"  # same blocks, gpu beats cpu
    ix.update_load("b", LoadSnapshot(kv_usage=0.95, waiting=30))
    ix.update_load("a", LoadSnapshot(kv_usage=0.1, waiting=0))
    r = ix.score(TOKENS)
    assert r.pod == "a"
    assert r.choice.explanation["b"].waiting == 30


def test_score_short_prompt_and_no_candidates():
    ix = indexer()
    r = ix.score([1, 2, 3])
    assert r.request_blocks == 0 and r.pod is None and r.prefix == {}
    assert "no candidate" in r.explain()
    r = ix.score([1, 2, 3], pods=["a", "b"])
    assert r.pod == "a" and r.prefix["b"].matched_blocks == 0
    with pytest.raises(TypeError):
        ix.score(TOKENS, pods="ab")


def test_route_counts_in_flight_and_speculates():
    ix = indexer(speculative_ttl=30.0)
    r = ix.route(TOKENS, pods=["a", "b"])
    assert ix.loads()[r.pod].in_flight == 1
    # the same prompt again: the speculative blocks make the chosen pod hold the whole prefix
    again = ix.score(TOKENS, pods=["a", "b"])
    assert again.prefix[r.pod].matched_blocks == 10
    ix.request_finished(r.pod)
    ix.request_finished(r.pod)
    assert ix.loads()[r.pod].in_flight == 0


def test_scoring_a_model_the_events_never_named_warns_once(caplog):
    ix = indexer()
    store(ix, "a", 3)  # events name model "m"
    with caplog.at_level("WARNING", logger="indexer"):
        assert ix.score(TOKENS, model="other").prefix["a"].matched_blocks == 0
        ix.score(TOKENS, model="other")
        assert ix.score(TOKENS).prefix["a"].matched_blocks == 3
    warnings = [r for r in caplog.records if "scoped by model" in r.getMessage()]
    assert len(warnings) == 1 and "'other'" in warnings[0].getMessage()
    assert ix.index.models() == {"m"}


def test_score_predicts_what_the_engine_will_report():
    ix = indexer()
    store(ix, "a", 10)  # the whole 40-token prompt
    r = ix.score(TOKENS, pods=["a", "b"])
    assert r.prompt_tokens == 40
    assert r.predicted_cached_tokens() == 36  # the engine recomputes the last block
    assert r.predicted_cached_tokens("b") == 0
    assert ix.score(TOKENS + [7]).predicted_cached_tokens("a") == 40


def test_choice_names_the_dp_rank_holding_the_prefix():
    ix = indexer()
    ix.index.block_stored("a", 0, [1, 2], None, TOKENS[:8], "gpu", block_size=BS, model="m")
    ix.index.block_stored("a", 3, [1, 2, 3], None, TOKENS[:12], "gpu", block_size=BS, model="m")
    r = ix.score(TOKENS, pods=["a"])
    assert r.choice.dp_rank == 3 and r.prefix["a"].matched_blocks == 3
    assert ix.score(TOKENS, pods=["b"]).choice.dp_rank is None


def test_ttft_picker_and_router_side_prefill_tokens():
    ix = indexer(picker="ttft")
    assert ix.picker.name == "ttft"
    store(ix, "a", 8)  # a holds 32 of the 40 tokens
    assert ix.loads() == {}
    r = ix.score(TOKENS, ["a", "b"])
    assert r.pod == "a" and r.choice.picker == "ttft"
    assert r.choice.explanation["a"].uncached_tokens == 8 and r.choice.explanation["b"].uncached_tokens == 40
    # untracked: loads carry no prefill_tokens; tracked once a router passes them
    ix.request_started("a")
    assert ix.loads()["a"].prefill_tokens is None
    ix.request_started("a", 100)
    ix.request_started("b", 30)
    assert ix.loads()["a"].prefill_tokens == 100 and ix.loads()["b"].prefill_tokens == 30
    # a now has 100 tokens of prefill queued: 100 + 8 > 30 + 40, b wins
    assert ix.score(TOKENS, ["a", "b"]).pod == "b"
    ix.request_prefilled("a", 100)
    ix.request_finished("b", 30)
    loads = ix.loads()
    assert loads["a"].prefill_tokens == 0 and loads["b"].prefill_tokens == 0
    assert (loads["a"].in_flight, loads["b"].in_flight) == (2, 0)
    assert ix.score(TOKENS, ["a", "b"]).pod == "a"
