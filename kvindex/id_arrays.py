"""Token ids and request keys as 1-D uint64 arrays, checked: what the key functions take in."""

from __future__ import annotations

import array
from collections.abc import Sequence
from typing import Any, Final

import numpy as np

__all__: list[str] = []

_EMPTY: Final = np.empty(0, dtype=np.uint64)


def _check_ids(values: Any, what: str) -> None:
    """TypeError unless ``values`` is a list/tuple/range/sequence of ids or a numpy array (ValueError
    unless 1-D): the shape every id argument takes."""
    if isinstance(values, np.ndarray):
        if values.ndim != 1:
            raise ValueError(f"{what} must be 1-D, got shape {values.shape}")
        return
    if isinstance(values, (str, bytes, bytearray, memoryview)) or not isinstance(values, (list, tuple, range, Sequence)):
        raise TypeError(f"{what} must be a list/tuple of ints or a 1-D integer numpy array, got {type(values).__name__}")


def _ints_to_u64(values: Any, what: str) -> np.ndarray:
    """A sequence of Python ints as a uint64 array, converted in C (ValueError outside [0, 2**64),
    TypeError for a non-int)."""
    try:
        buf = array.array("Q", values)
    except OverflowError as e:
        raise ValueError(f"{what} must be in [0, 2**64)") from e
    except TypeError as e:
        raise TypeError(f"{what} must be ints: {e}") from e
    return np.frombuffer(buf, dtype=np.uint64)


def _keys_to_u64(keys: Any, what: str) -> np.ndarray:
    """1-D uint64 array of request keys: a uint64 array as is, an int64 one viewed (the same bits),
    a list/tuple of ints in [0, 2**64). TypeError for other dtypes or non-int items, ValueError for
    an int out of range or another shape."""
    _check_ids(keys, what)
    if isinstance(keys, np.ndarray):
        if keys.size == 0 and keys.dtype.kind in "uif":
            return _EMPTY.copy()
        if keys.dtype == np.uint64:
            return keys
        if keys.dtype == np.int64:
            return keys.view(np.uint64)
        if keys.dtype != object:
            raise TypeError(f"{what} must be a uint64 array (or int64 of the same bits) or ints, got {keys.dtype}")
        keys = keys.tolist()
    return _ints_to_u64(keys, what)


def _tokens_to_u64(tokens: Any) -> np.ndarray:
    """1-D uint64 array of token ids (a view where possible, never a Python loop)."""
    _check_ids(tokens, "tokens")
    if isinstance(tokens, np.ndarray):
        kind = tokens.dtype.kind
        if tokens.size == 0 and kind in "uif":
            return _EMPTY.copy()  # np.array([]) is float64: an empty prompt all the same
        if kind == "u":
            return tokens if tokens.dtype == np.uint64 else tokens.astype(np.uint64)
        if kind == "i":
            if tokens.size and tokens.min() < 0:
                raise ValueError("token ids must be >= 0")
            if tokens.dtype == np.int64:
                return tokens.view(np.uint64)
            return tokens.astype(np.uint64)
        raise TypeError(f"tokens must have an integer dtype, got {tokens.dtype}")
    return _ints_to_u64(tokens, "token ids")
