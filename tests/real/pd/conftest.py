"""The P/D pair this package's modules share, started once.

``pd_fleet`` (package): a prefill and a decode engine with NixlConnector and
bidirectional KV transfer (examples/vllm_fleet/pd.py), D's
``decoder_kv_blocks_ttl`` = ``D_TTL``; killed after the package's last test.
Both engines spin a core each (NIXL): nothing else runs beside them.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Iterator
from typing import Any

import pytest

from examples.vllm_fleet.fleet import FleetEnv
from examples.vllm_fleet.pd import PDFleet
from tests.real.conftest import running


#: s: D's decoder_kv_blocks_ttl (P declines when less than 5 s are left). Turn 1 and the wait for
#: its events take 10-40 s on a loaded 2-core machine, and P's NIXL worker stalled 60-100 s before
#: reading D's blocks when its model thread shared D's core (PDFleet.pin_workers now prevents
#: that): an entry that expires first makes turn 2 recompute; test_pd's "expired" case waits this
#: long on purpose.
D_TTL = 120


@pytest.fixture(scope="package")
def pd_fleet(vllm_env: FleetEnv, tmp_path_factory: pytest.TempPathFactory, vllm_timings: dict[str, float]) -> Iterator[PDFleet]:
    """A running P/D pair (NixlConnector, bidirectional); torn down after the package."""
    fleet = PDFleet(
        venv=vllm_env.venv, model_dir=vllm_env.model_dir, log_dir=tmp_path_factory.mktemp("pd-logs"), blocks_ttl=D_TTL
    )
    yield from running(fleet, "P/D engines start-up (NixlConnector)", vllm_timings)


def timed_scenario(
    scenario: Callable[[PDFleet], Awaitable[dict[str, Any]]], fleet: PDFleet, label: str, timings: dict[str, float]
) -> dict[str, Any]:
    """Run a module's P/D scenario once; its seconds go to ``timings[label]``."""
    t0 = time.monotonic()
    result = asyncio.run(scenario(fleet))
    timings[label] = time.monotonic() - t0
    return result
