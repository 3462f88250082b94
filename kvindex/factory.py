"""One factory for the index backends: :func:`make_index` and :data:`BACKENDS`.

The configuration names the backend explicitly
(``kv_block_index_config.backend``); ``"auto"`` takes the compiled core when
it is installed and the pure-Python reference otherwise (logged once).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kvindex.contract import KVIndex
    from kvindex.keys import TokenProcessor

__all__ = ["BACKENDS", "make_index"]

#: Index implementations :func:`make_index` builds (``auto``: ``native`` when the compiled core is installed,
#: else ``python``).
BACKENDS = ("auto", "python", "native", "redis")


def make_index(
    backend: str,
    token_processor: TokenProcessor | None = None,
    *,
    capacity: int = 1_000_000,
    max_orphan_blocks: int = 100_000,
    clock: Callable[[], float] | None = None,
    redis_url: str | None = None,
    redis_client: Any = None,
    key_prefix: str | None = None,
) -> KVIndex:
    """Build the index implementation named ``backend`` (one of :data:`BACKENDS`).

    ``"auto"``: the compiled core when installed, else the reference;
    ``"python"``: :class:`kvindex.reference.KVBlockIndex`; ``"native"``:
    :class:`kvindex.native.NativeKVBlockIndex` (ImportError if the compiled
    core was not built: no fallback); ``"redis"``:
    :class:`kvindex.redis_index.RedisKVBlockIndex` on ``redis_client`` or
    ``redis_url`` under ``key_prefix`` (needs the ``redis`` package: the
    ``kvindex[redis]`` extra).  Other arguments as the classes'.

    Raises:
        ValueError: unknown backend, or bad bounds.
    """
    kw: dict[str, Any] = {} if clock is None else {"clock": clock}
    if backend == "auto":
        from kvindex import accel

        backend = "native" if accel.AVAILABLE else "python"
        if backend == "python":
            accel.note_fallback()
    if backend == "python":
        from kvindex.reference import KVBlockIndex

        return KVBlockIndex(token_processor, capacity=capacity, max_orphan_blocks=max_orphan_blocks, **kw)
    if backend == "native":
        from kvindex.native import NativeKVBlockIndex

        return NativeKVBlockIndex(token_processor, capacity=capacity, max_orphan_blocks=max_orphan_blocks, **kw)
    if backend == "redis":
        from kvindex.redis_index import RedisKVBlockIndex

        if key_prefix is not None:
            kw["key_prefix"] = key_prefix
        return RedisKVBlockIndex(
            token_processor, capacity=capacity, max_orphan_blocks=max_orphan_blocks,
            url=redis_url, client=redis_client, **kw,
        )
    raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
