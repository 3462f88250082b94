"""A P/D pair serving the sliding-window hybrid, started once for the package.

``hybrid_pd_fleet`` (package): prefill and decode engines with NixlConnector
and bidirectional KV transfer (examples/vllm_fleet/pd.py) serving the
generated model as a hybrid (examples/vllm_fleet/hybrid_model.py: layer 0
sliding-window attention of ``WINDOW`` tokens, layer 1 full attention; two
KV-cache groups of block size 32), vLLM's default retention (sparse
sliding-window events). Both engines spin a core each (NIXL): nothing else
runs beside them.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from examples.vllm_fleet.fleet import FleetEnv
from examples.vllm_fleet.hybrid_model import sliding_window_variant
from examples.vllm_fleet.pd import PDFleet
from tests.real.conftest import running

WINDOW = 64
D_TTL = 300  # s: D's decoder_kv_blocks_ttl; the scenario's turns follow each other within seconds


@pytest.fixture(scope="package")
def hybrid_pd_fleet(vllm_env: FleetEnv, tmp_path_factory: pytest.TempPathFactory,
                    vllm_timings: dict[str, float]) -> Iterator[PDFleet]:
    """A running hybrid P/D pair (module doc); torn down after the package."""
    model = sliding_window_variant(vllm_env.model_dir, tmp_path_factory.mktemp("hybrid-pd-model"), WINDOW)
    fleet = PDFleet(venv=vllm_env.venv, model_dir=model, log_dir=tmp_path_factory.mktemp("hybrid-pd-logs"),
                    blocks_ttl=D_TTL)
    yield from running(fleet, "hybrid P/D engines start-up (NixlConnector)", vllm_timings)
