"""connector imports kvindex and scorer, never kvevents (DESIGN.md floors)."""

from __future__ import annotations

import subprocess
import sys


def test_connector_never_imports_kvevents():
    code = (
        "import sys, connector, connector.params, connector.retained, connector.guard, "
        "connector.planner, connector.advisor\n"
        "bad = sorted(m for m in sys.modules if m == 'kvevents' or m.startswith('kvevents.') or m.startswith('kvindex.facade'))\n"
        "print(','.join(bad))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == ""
