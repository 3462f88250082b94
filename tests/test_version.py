"""One version: kvindex.__version__ is what the installed distribution says (pyproject reads it from there)."""

from __future__ import annotations

import re
from importlib.metadata import version

import kvindex


def test_version_is_single_sourced() -> None:
    assert re.fullmatch(r"\d+\.\d+\.\d+(?:[.-]?\w+)*", kvindex.__version__)
    assert version("kvindex") == kvindex.__version__
