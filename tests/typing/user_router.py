"""A small router written against kvindex's public API; `mypy --strict` must accept it."""

from __future__ import annotations

import numpy as np

import kvindex
from connector import PDPlanner, RetainedStore, TurnPlan
from kvevents import StreamState
from kvindex import Config, Indexer, IndexerStats, LoadSnapshot, Score, TokenProcessor
from scorer import PrefixScore, parse_vllm_metrics

METRICS = """\
vllm:num_requests_waiting{engine="0",model_name="m"} 2.0
vllm:num_requests_running{engine="0",model_name="m"} 5.0
vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.25
"""


def make_config() -> Config:
    return Config.from_dict({
        "model_name": "m",
        "token_processor_config": {"block_size": 16},
        "kv_block_index_config": {"backend": "python"},
    })


def route_one(ix: Indexer, prompt: list[int], pods: list[str]) -> str | None:
    load: LoadSnapshot = parse_vllm_metrics(METRICS, model_name="m")
    ix.update_load(pods[0], load)
    result: Score = ix.route(prompt, pods, model="m", cache_salt=None)
    best: PrefixScore = result.prefix[pods[0]]
    print(best.matched_tokens, best.coverage, result.request_blocks, result.predicted_cached_tokens())
    print(result.explain())
    if result.pod is not None:
        ix.request_prefilled(result.pod, len(prompt))
        ix.request_finished(result.pod)
    return result.pod


def main() -> None:
    pods = ["pod-a", "pod-b"]
    prompt = list(range(100))
    with Indexer(make_config()) as ix:
        chosen = route_one(ix, prompt, pods)
        ix.request_started(pods[1], prefill_tokens=64)
        score = ix.score(np.arange(64, dtype=np.int64), pods)
        stats: IndexerStats = ix.stats()
        streams: list[StreamState] = ix.completeness()
        print(chosen, score.pod, stats.index.keys, stats.events.messages, [s.complete for s in streams])
    ix2 = Indexer(make_config()).start()
    ix2.stop()

    tp = TokenProcessor(block_size=16, hash_seed="fleet")
    keys: np.ndarray = tp.request_keys(prompt, model="m")
    index = kvindex.make_index("python", tp)
    planner = PDPlanner(index, tp, RetainedStore(index, ttl=60.0), recompute_threshold=32, model="m")
    plan: TurnPlan = planner.plan("conv-1", prompt, ["p0"], ["d0"])
    print(kvindex.__version__, len(keys), index.stats().keys, plan.action, plan.explain())


if __name__ == "__main__":
    main()
