"""The fleet this package's modules share: two sliding-window hybrid engines, started once.

``hybrid_fleet`` (package): the generated model as a hybrid
(examples/vllm_fleet/hybrid_model.py: layer 0 sliding-window attention of 64
tokens, layer 1 full attention; two KV-cache groups of block size 32),
sha256_cbor block hashes, ``--enable-prompt-tokens-details``:

- pod-0: vLLM's default retention (the sliding-window group keeps only the
  blocks its hit rule can use: sparse events), ``--chat-template`` ChatML-style;
- pod-1: ``--prefix-cache-retention-interval 32`` (every block kept: dense
  events), ``--chat-template`` Llama-3-style.

The tokenization module uses the templates (tokenization does not depend on
the layers); the hybrid module the two retentions.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from examples.vllm_fleet.fleet import FleetEnv, VllmFleet
from examples.vllm_fleet.hybrid_model import sliding_window_variant
from tests.real.conftest import running

TEMPLATES = Path(__file__).resolve().parents[3] / "examples" / "vllm_fleet" / "chat_templates"
STYLES = {0: "chatml_tools.jinja", 1: "llama3_tools.jinja"}
WINDOW = 64
RETENTION = {0: [], 1: ["--prefix-cache-retention-interval", "32"]}


@pytest.fixture(scope="package")
def hybrid_fleet(vllm_env: FleetEnv, tmp_path_factory: pytest.TempPathFactory,
                 vllm_timings: dict[str, float]) -> Iterator[VllmFleet]:
    """Two running hybrid engines (module doc); torn down after the package."""
    model = sliding_window_variant(vllm_env.model_dir, tmp_path_factory.mktemp("hybrid-model"), WINDOW)
    fleet = VllmFleet(
        2, venv=vllm_env.venv, model_dir=model, max_model_len=2048,
        log_dir=tmp_path_factory.mktemp("vllm-logs-hybrid"),
        extra_args=["--enable-prompt-tokens-details"],
        engine_args=[["--chat-template", str(TEMPLATES / STYLES[i]), *RETENTION[i]] for i in range(2)],
    )
    yield from running(fleet, "2 hybrid engines start-up (concurrent)", vllm_timings)
