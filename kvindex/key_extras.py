"""Per-block extra keys of the token processor: validation, salt placement, distinct strings.

The untagged per-block form vLLM's KV events publish (vllm/v1/core/kv_cache_utils.py
``to_event_extra_keys``); see :mod:`kvindex.keys` for how each algorithm hashes them.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any


def _check_extra_item(item: Any) -> None:
    if isinstance(item, (str, bytes)):
        return
    if isinstance(item, (tuple, list)) and len(item) == 2:
        ident, offset = item
        if isinstance(ident, str) and isinstance(offset, int) and not isinstance(offset, bool):
            return
    raise TypeError(
        "an extra key is (mm_identifier: str, offset: int), a salt str or a digest bytes; "
        f"got {item!r}"
    )


def _block_extras(entry: Any) -> tuple[Any, ...] | None:
    """Validate one block's extras; None for no extras."""
    if entry is None:
        return None
    if isinstance(entry, (str, bytes)) or not isinstance(entry, (tuple, list)):
        raise TypeError(f"a block's extra keys must be None or a list/tuple, got {entry!r}")
    for item in entry:
        _check_extra_item(item)
    return tuple(entry) or None


def _with_salt(extras: tuple[Any, ...] | None, salt: str) -> tuple[Any, ...]:
    """Insert the salt where vLLM puts it: after mm pairs, before embeds digests."""
    items = list(extras or ())
    if any(isinstance(x, str) for x in items):
        raise ValueError("block 0's extra keys already hold a salt and cache_salt was given")
    pos = next((k for k, x in enumerate(items) if isinstance(x, bytes)), len(items))
    items.insert(pos, salt)
    return tuple(items)


def _normalise_extras(
    block_extra_keys: Any,
    n_blocks: int,
    n_allowed: tuple[int, ...],
    cache_salt: str | None,
) -> list[tuple[Any, ...] | None] | None:
    """Per-block extras for the first ``n_blocks`` blocks, or None if no block has any."""
    if cache_salt is not None and not isinstance(cache_salt, str):
        raise TypeError(f"cache_salt must be str or None, got {type(cache_salt).__name__}")
    if block_extra_keys is None:
        if not cache_salt or n_blocks == 0:
            return None
        out: list[tuple[Any, ...] | None] = [None] * n_blocks
    else:
        if isinstance(block_extra_keys, (str, bytes)) or not isinstance(
            block_extra_keys, Sequence
        ):
            raise TypeError("block_extra_keys must be a sequence with one entry per block")
        if len(block_extra_keys) not in n_allowed:
            raise ValueError(
                f"block_extra_keys has {len(block_extra_keys)} entries, expected "
                + " or ".join(str(k) for k in sorted(set(n_allowed)))
            )
        out = [_block_extras(e) for e in block_extra_keys[:n_blocks]]
        for e in block_extra_keys[n_blocks:]:
            _block_extras(e)
    if cache_salt and n_blocks:
        out[0] = _with_salt(out[0], cache_salt)
    if all(e is None for e in out):
        return None
    return out


def _fresh(x: Any) -> Any:
    """An equal str/bytes that is a distinct object (pickle memoises by identity)."""
    if isinstance(x, (str, bytes)) and len(x) > 1:
        return x[:1] + x[1:]
    return x
