"""The P/D pair this package's modules share, started once.

``pd_fleet`` (package): a prefill and a decode engine with NixlConnector and
bidirectional KV transfer (examples/vllm_fleet/pd.py), D's
``decoder_kv_blocks_ttl`` = ``D_TTL``; killed after the package's last test.
Both engines spin a core each (NIXL): nothing else runs beside them.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest

from examples.vllm_fleet.fleet import FleetEnv, FleetError
from examples.vllm_fleet.pd import PDFleet


#: s: D's decoder_kv_blocks_ttl (P declines when less than 5 s are left). Turn 1 and the wait for
#: its events take 10-40 s on a loaded 2-core machine, and an entry that expires first makes
#: turn 2 recompute; test_pd's "expired" case waits this long on purpose.
D_TTL = 90


@pytest.fixture(scope="package")
def pd_fleet(vllm_env: FleetEnv, tmp_path_factory: pytest.TempPathFactory, vllm_timings: dict[str, float]) -> Iterator[PDFleet]:
    """A running P/D pair (NixlConnector, bidirectional); torn down after the package."""
    fleet = PDFleet(
        venv=vllm_env.venv, model_dir=vllm_env.model_dir, log_dir=tmp_path_factory.mktemp("pd-logs"), blocks_ttl=D_TTL
    )
    t0 = time.monotonic()
    try:
        fleet.start()
    except FleetError as e:
        pytest.fail(f"P/D engines did not start: {e}", pytrace=False)
    vllm_timings["P/D engines start-up (NixlConnector)"] = time.monotonic() - t0
    try:
        yield fleet
    finally:
        fleet.close()
