"""The compiled core (kvindex._native) is built by the package's own build and importable."""

from __future__ import annotations


def test_native_extension_imports():
    from kvindex import _native

    assert _native.ABI_VERSION == 1


# -- to_u64: the conversion of a Python sequence of ints to uint64 (every compiled call that takes
# token ids or keys goes through it).  Exact ints of one internal digit are read directly, anything
# else through PyLong_AsUnsignedLongLong; both must give exactly what the values say.

import enum

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st


class _IntSub(int):
    pass


class _Color(enum.IntEnum):
    RED = 7


_EDGES = [0, 1, 2**30 - 1, 2**30, 2**31, 2**32 - 1, 2**32, 2**60, 2**62, 2**63 - 1, 2**63, 2**64 - 2, 2**64 - 1]
_BAD_RANGE = [-1, -(2**30), -(2**30) - 1, -(2**63), 2**64, 2**64 + 1, 2**100, -(2**100)]
_BAD_TYPE = [True, False, 1.0, "1", None, np.int64(3), np.uint64(3), np.float64(1.0)]
_values = st.one_of(
    st.sampled_from(_EDGES + _BAD_RANGE + _BAD_TYPE),
    st.integers(0, 2**64 - 1),
    st.integers(-(2**70), 2**70),
    st.builds(_IntSub, st.integers(0, 2**64 - 1)),
    st.just(_Color.RED),
)


def _expected(values):
    """uint64 array of the values, or the error class of the first value that is not an int in [0, 2**64)."""
    out = []
    for v in values:
        if isinstance(v, bool) or not isinstance(v, int):
            return TypeError
        if not 0 <= v < 2**64:
            return ValueError
        out.append(int(v))
    return np.array(out, dtype=np.uint64)


@settings(max_examples=400, deadline=None)
@given(st.lists(_values, max_size=48), st.sampled_from([list, tuple]))
def test_to_u64_edges_match_the_plain_rule(values, kind):
    """Lists and tuples of ints convert exactly (one-digit ints, 2**30 and up, up to 2**64 - 1, int
    subclasses); bools, floats, strings, None and numpy scalars are TypeError; negatives and
    2**64 and up are ValueError (from the first bad value, in order)."""
    from kvindex import _native

    K = np.ones(1, dtype=np.uint64)  # block size 1: a key per value
    want = _expected(values)
    if isinstance(want, type):
        with pytest.raises(want):
            _native.xxh3_chain(5, kind(values), K, 3, None)
        return
    got = _native.xxh3_chain(5, kind(values), K, 3, None)
    assert got == _native.xxh3_chain(5, want, K, 3, None)
    if len(values):  # the keys depend on every value: a wrong one changes them
        bumped = want.copy()
        bumped[-1] ^= np.uint64(1)
        assert got != _native.xxh3_chain(5, bumped, K, 3, None)
