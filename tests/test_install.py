"""Installing kvindex as a user does: with a C++ compiler the compiled core is built; without one,
``pip install`` still succeeds and the pure-Python reference serves (logged once)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

USER_SCRIPT = textwrap.dedent(
    """
    import logging
    logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")
    from kvevents.testing import FakeEngine
    from kvindex import Config, Indexer, accel
    from kvindex.reference import KVBlockIndex

    with FakeEngine(pod="pod-a", model="m") as engine:
        engine.serve(list(range(256)))
        cfg = Config.from_dict({"model_name": "m", "kv_events_config": {"engines": [engine.engine_entry()]}})
        with Indexer(cfg) as ix:
            assert ix.flush(60)
            result = ix.score(list(range(300)))
            print(accel.AVAILABLE, type(ix.index) is KVBlockIndex, result.pod, result.prefix["pod-a"].matched_tokens)
    """
)


def _source_copy(dest: Path) -> Path:
    """The tracked files of the checkout (no build tree, no venv: a clean source as pip gets it)."""
    files = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True).stdout
    for name in files.decode().split("\0"):
        if name and (ROOT / name).is_file():
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / name, dest / name)
    return dest


def test_install_without_a_compiler_scores_with_the_reference(tmp_path: Path) -> None:
    src = _source_copy(tmp_path / "src")
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    py = venv / "bin" / "python"
    # no compiler: CMake finds none it can run, whatever is on PATH
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env.update(CC="/bin/false", CXX="/bin/false")
    pip = subprocess.run(
        [str(py), "-m", "pip", "install", "-q", str(src)], env=env, capture_output=True, text=True, timeout=1200
    )
    assert pip.returncode == 0, pip.stdout[-3000:] + pip.stderr[-3000:]
    site = subprocess.run(
        [str(py), "-c", "import kvindex, pathlib; print(pathlib.Path(kvindex.__file__).parent)"],
        cwd=tmp_path, env=env, capture_output=True, text=True, check=True,
    ).stdout.strip()
    assert not list(Path(site).glob("_native*")), "a compiled core was installed without a compiler"
    (tmp_path / "user.py").write_text(USER_SCRIPT)
    run = subprocess.run([str(py), "user.py"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.stdout.split() == ["False", "True", "pod-a", "256"]
    assert run.stderr.count("compiled core not installed") == 1, run.stderr[-3000:]


def test_the_compiled_core_is_built_where_a_compiler_is() -> None:
    """This checkout's install (make test builds it with the machine's g++) has the compiled core."""
    from kvindex import accel
    from kvindex.factory import make_index
    from kvindex.native import NativeKVBlockIndex

    compiler = shutil.which(os.environ.get("CXX", "c++")) or shutil.which("g++")
    assert compiler is not None, "no C++ compiler on this machine: CI installs g++"
    assert accel.AVAILABLE
    assert isinstance(make_index("auto"), NativeKVBlockIndex)
