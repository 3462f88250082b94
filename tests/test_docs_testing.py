"""docs/testing.md's example runs as written: its code block is executed and each test in it called."""

from __future__ import annotations

import re
from pathlib import Path

DOC = Path(__file__).resolve().parent.parent / "docs" / "testing.md"


def test_the_testing_guide_example_runs() -> None:
    blocks = re.findall(r"```python\n(.*?)```", DOC.read_text(), flags=re.S)
    assert len(blocks) == 1
    namespace: dict[str, object] = {"__name__": "testing_guide"}
    exec(compile(blocks[0], str(DOC), "exec"), namespace)
    tests = [fn for name, fn in namespace.items() if name.startswith("test_") and callable(fn)]
    assert len(tests) == 1
    for fn in tests:
        fn()
