"""The compiled core (kvindex._native) is built by the package's own build and importable."""

from __future__ import annotations


def test_native_extension_imports():
    from kvindex import _native

    assert _native.ABI_VERSION == 1
