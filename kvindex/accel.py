"""The compiled core (``kvindex._native``) when it is installed, else None.

kvindex installs without a C++ compiler: the build then skips the core and
every fast path falls back to its pure-Python reference (same results).
"""

from __future__ import annotations

import logging
from types import ModuleType

__all__ = ["AVAILABLE", "native", "note_fallback"]

log = logging.getLogger("kvindex")

try:
    from kvindex import _native as _mod

    native: ModuleType | None = _mod
except ImportError:  # built without a compiler
    native = None

#: True when the compiled core is importable.
AVAILABLE = native is not None

_noted = False


def note_fallback() -> None:
    """Log, once per process, that the pure-Python reference stands in for the compiled core."""
    global _noted
    if not _noted:
        _noted = True
        log.warning(
            "kvindex: compiled core not installed (built only where a C++ compiler is); "
            "using the pure-Python reference index: same results, slower"
        )
