"""The public API is typed: `mypy --strict` accepts a user's router and flags misuse.

mypy runs in a subprocess from an empty directory, so it reads kvindex as an
installed package (py.typed), as a user's project would.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

USER_SCRIPT = Path(__file__).resolve().parent / "typing" / "user_router.py"

# each line marked "# error" must be reported, and no other
MISUSE = """\
from __future__ import annotations

import kvindex
from kvindex import Config, Indexer, LoadSnapshot
from scorer import parse_vllm_metrics

ix = Indexer(Config.from_dict({"model_name": "m"}))
ix.route([1, 2, 3], ["a"], modle="m")  # error
ix.score([1, 2, 3], ["a"], loads={"a": 0.5})  # error
ix.update_load("a", parse_vllm_metrics(b"vllm:num_requests_waiting 1"))  # error
pod: str = ix.score([1, 2, 3], ["a"]).pod  # error
waiting: int = LoadSnapshot().waiting  # error
kvindex.make_index("python", 16)  # error
"""


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("mypy-cache")


def _mypy(script: Path, cwd: Path, cache: Path) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, "-m", "mypy", "--strict", "--no-error-summary", "--cache-dir", str(cache), str(script)]
    return subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=300)


def test_user_router_passes_mypy_strict(tmp_path: Path, cache_dir: Path) -> None:
    proc = _mypy(USER_SCRIPT, tmp_path, cache_dir)
    assert proc.returncode == 0, f"mypy --strict failed:\n{proc.stdout}{proc.stderr}"


def test_misuse_is_flagged(tmp_path: Path, cache_dir: Path) -> None:
    script = tmp_path / "misuse.py"
    script.write_text(MISUSE)
    proc = _mypy(script, tmp_path, cache_dir)
    expected = {i for i, line in enumerate(MISUSE.splitlines(), 1) if line.endswith("# error")}
    flagged = {int(m) for m in re.findall(r"^misuse\.py:(\d+): error:", proc.stdout, re.MULTILINE)}
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert flagged == expected, proc.stdout


def test_user_router_runs(tmp_path: Path) -> None:
    proc = subprocess.run([sys.executable, str(USER_SCRIPT)], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
