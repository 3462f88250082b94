"""Token ids and request keys as 1-D uint64 arrays, checked: what the key functions take in."""

from __future__ import annotations

import array
from collections.abc import Sequence
from typing import Any, Final

import numpy as np

__all__: list[str] = []

_EMPTY: Final = np.empty(0, dtype=np.uint64)


def _keys_to_u64(keys: Any, what: str) -> np.ndarray:
    """1-D uint64 array of request keys: a uint64 array as is, an int64 one viewed (the same bits),
    a list/tuple of ints in [0, 2**64). TypeError for other dtypes or non-int items, ValueError for
    an int out of range or another shape."""
    if isinstance(keys, np.ndarray):
        if keys.ndim != 1:
            raise ValueError(f"{what} must be 1-D, got shape {keys.shape}")
        if keys.size == 0 and keys.dtype.kind in "uif":
            return _EMPTY.copy()
        if keys.dtype == np.uint64:
            return keys
        if keys.dtype == np.int64:
            return keys.view(np.uint64)
        if keys.dtype != object:
            raise TypeError(f"{what} must be a uint64 array (or int64 of the same bits) or ints, got {keys.dtype}")
        keys = keys.tolist()
    if isinstance(keys, (str, bytes, bytearray, memoryview)) or not isinstance(keys, (list, tuple, Sequence)):
        raise TypeError(f"{what} must be a uint64 array or a list of ints, got {type(keys).__name__}")
    try:
        buf = array.array("Q", keys)
    except OverflowError as e:
        raise ValueError(f"{what} must be in [0, 2**64)") from e
    except TypeError as e:
        raise TypeError(f"{what} must be ints: {e}") from e
    return np.frombuffer(buf, dtype=np.uint64)


def _tokens_to_u64(tokens: Any) -> np.ndarray:
    """1-D uint64 array of token ids (a view where possible, never a Python loop)."""
    if isinstance(tokens, np.ndarray):
        if tokens.ndim != 1:
            raise ValueError(f"tokens must be 1-D, got shape {tokens.shape}")
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
    if isinstance(tokens, (str, bytes, bytearray, memoryview)) or not isinstance(
        tokens, (list, tuple, range, Sequence)
    ):
        raise TypeError(
            f"tokens must be a list/tuple of ints or a 1-D integer numpy array, "
            f"got {type(tokens).__name__}"
        )
    try:
        buf = array.array("Q", tokens)
    except OverflowError as e:
        raise ValueError("token ids must be in [0, 2**64)") from e
    except TypeError as e:
        raise TypeError(f"tokens must be ints: {e}") from e
    return np.frombuffer(buf, dtype=np.uint64)
