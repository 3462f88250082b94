"""The fleet this package's modules share, started once (one start-up instead of one per module).

``vllm_fleet`` (package): two engines with sha256_cbor block hashes, block size
32, KV events on loopback ZMQ ports, answers carrying
``usage.prompt_tokens_details``; killed after the package's last test,
also when a test fails.  The modules run in the order of ``ORDER``:
test_live_index's last test restarts pod-1 on sha256, which test_engine_smoke
then reads as it is (it restarts pod-1 itself only when run alone); the
modules after the first empty both prefix caches before they start
(``fresh_caches``), so what one module served never shows up as another's
cache hit.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from examples.vllm_fleet.fleet import FleetEnv, VllmFleet
from tests.real.conftest import running


HERE = Path(__file__).resolve().parent
ORDER = ("test_live_index.py", "test_router.py", "test_engine_smoke.py")


def pytest_collection_modifyitems(session: pytest.Session, config: pytest.Config, items: list[pytest.Item]) -> None:
    """Run this package's modules in ``ORDER``, where its first item was collected."""
    mine = [i for i in items if Path(i.path).resolve().parent == HERE]
    if not mine:
        return
    at = items.index(mine[0])
    rest = [i for i in items if Path(i.path).resolve().parent != HERE]
    rank = {name: k for k, name in enumerate(ORDER)}
    mine.sort(key=lambda i: rank.get(Path(i.path).name, len(ORDER)))
    items[:] = rest[:at] + mine + rest[at:]


@pytest.fixture(scope="package")
def vllm_fleet(vllm_env: FleetEnv, tmp_path_factory: pytest.TempPathFactory, vllm_timings: dict[str, float]) -> Iterator[VllmFleet]:
    """Two running engines (sha256_cbor, block size 32); torn down after the package."""
    fleet = VllmFleet(
        2, venv=vllm_env.venv, model_dir=vllm_env.model_dir, log_dir=tmp_path_factory.mktemp("vllm-logs"),
        extra_args=["--enable-prompt-tokens-details"],  # answers say their cached tokens (the router's truth)
    )
    yield from running(fleet, "2 engines start-up (concurrent)", vllm_timings)


@pytest.fixture(scope="module")
def fresh_caches(vllm_fleet: VllmFleet) -> None:
    """Empty every engine's prefix cache (``POST /reset_prefix_cache``) before the module's first test."""
    for engine in vllm_fleet:
        deadline = time.monotonic() + 120
        # vLLM refuses while a request is running (none should be): retry, bounded
        while engine.post_json("/reset_prefix_cache") != {"success": True}:
            assert time.monotonic() < deadline, f"{engine.pod} never reset its prefix cache"
            time.sleep(0.5)
