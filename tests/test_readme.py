"""The README's embedding example runs as written and prints what it promises."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_readme_example_runs():
    text = (ROOT / "README.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", text, re.S)
    assert blocks, "README has no python example"
    code = blocks[0]
    assert len([ln for ln in code.splitlines() if ln.strip()]) <= 16
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines()[0] == "pod-a 256"
    assert "chosen=pod-a" in out.stdout


def test_readme_config_block_is_a_valid_config():
    from kvindex.facade import Config

    text = (ROOT / "README.md").read_text()
    yaml_block = re.findall(r"```yaml\n(.*?)```", text, re.S)[0]
    cfg = Config.from_yaml(yaml_block)
    assert cfg.token_processor_config.block_size == 16
    assert cfg.kv_events_config.engines[0].replay_endpoint == "tcp://10.0.0.5:5558"


def test_readme_connector_example_runs():
    text = (ROOT / "README.md").read_text()
    code = next(b for b in re.findall(r"```python\n(.*?)```", text, re.S) if "PDPlanner" in b)
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    first, second = (ln for ln in out.stdout.splitlines() if ln[:2] in ("1 ", "2 "))
    assert "recompute" in first
    # turn 2 extends turn 1's prompt + answer: D's retained tokens (prompt + output - 1) are pulled
    assert "pull: prompt 390, local 0, pullable 339, pulled 339" in second
