"""The index interface: :class:`KVIndex`, a typing.Protocol, and :func:`make_index`.

Every index implementation satisfies :class:`KVIndex`: the pure-Python
reference :class:`kvindex.index.KVBlockIndex` (the oracle in tests), the
compiled :class:`kvindex.native.NativeKVBlockIndex` and the shared
:class:`kvindex.redis_index.RedisKVBlockIndex` (several router replicas on
one Redis).  The write path
(kvevents' pool), the read path (scorer, indexer) and the facade depend only
on this Protocol; the configuration names the implementation explicitly
(``kv_block_index_config.backend``) and there is no silent fallback.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterable, Sequence
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

if TYPE_CHECKING:
    from kvindex.index import IndexStats, PodEntry
    from kvindex.keys import TokenProcessor

__all__ = ["BACKENDS", "IndexUnavailable", "KVIndex", "make_index"]

#: Index implementations :func:`make_index` builds.
BACKENDS = ("python", "native", "redis")


class IndexUnavailable(RuntimeError):
    """A write could not reach the index's store (the Redis backend during an outage).

    The write was not applied (each write is one atomic server-side script).
    The write path (kvevents' pool) counts it, marks the publisher's stream
    incomplete and rebuilds it from the engine's replay buffer once the store
    answers again.  The read path never raises it: reads degrade to no
    prefix information.
    """


@runtime_checkable
class KVIndex(Protocol):
    """Request key -> pod entries; engine key -> request key; pod -> keys.

    Semantics (events mirror vllm/distributed/kv_events.py, vLLM 0.32) are
    those documented on :class:`kvindex.index.KVBlockIndex`; a publisher is
    (pod, DP rank, model), and ``model`` of :meth:`clear` /
    :meth:`request_key_of` defaults to :data:`kvindex.index.ALL_MODELS`.  Implementations
    are safe for one writer per pod at a time plus concurrent readers.
    """

    token_processor: TokenProcessor
    block_size: int

    # write path
    def block_stored(
        self,
        pod: str,
        dp_rank: int,
        engine_keys: Sequence[int],
        parent_engine_key: int | None,
        token_ids: Sequence[int] | None,
        tier: str,
        *,
        block_size: int | None = None,
        extra_keys: Sequence[Sequence | None] | None = None,
        lora_name: str | None = None,
        model: str | None = None,
    ) -> int: ...

    def block_removed(
        self, pod: str, dp_rank: int, engine_keys: Iterable[int], tier: str, *, model: str | None = None
    ) -> int: ...

    def clear(self, pod: str, dp_rank: int | None = None, *, model: Any = ...) -> int: ...

    def add_speculative(self, request_keys: Iterable[int], pod: str, ttl: float, dp_rank: int = 0) -> None: ...

    # router-held entries by request key (the connector's decode-retained tier)
    def add_held(self, pod: str, request_keys: Iterable[int], tier: str) -> None: ...

    def remove_held(self, pod: str, request_keys: Iterable[int], tier: str) -> int: ...

    # read path
    def prefix_match(
        self, request_keys: Sequence[int], pods: Collection[str] | None = None
    ) -> dict[str, list[int]]: ...

    def lookup(self, request_keys: Iterable[int]) -> list[tuple[PodEntry, ...]]: ...

    def best_dp_rank(self, pod: str, request_keys: Sequence[int]) -> int | None: ...

    def request_key_of(self, engine_key: int, model: Any = ...) -> int | None: ...

    def pods(self) -> frozenset[str]: ...

    def pod_keys(self, pod: str, dp_rank: int | None = None) -> set[int]: ...

    def models(self) -> frozenset[str | None]: ...

    def stats(self) -> IndexStats: ...

    def __len__(self) -> int: ...


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

    ``"python"``: :class:`kvindex.index.KVBlockIndex`; ``"native"``:
    :class:`kvindex.native.NativeKVBlockIndex` (ImportError if the compiled
    core was not built: no fallback); ``"redis"``:
    :class:`kvindex.redis_index.RedisKVBlockIndex` on ``redis_client`` or
    ``redis_url`` under ``key_prefix`` (needs the ``redis`` package: the
    ``kvindex[redis]`` extra).  Other arguments as the classes'.

    Raises:
        ValueError: unknown backend, or bad bounds.
    """
    kw = {} if clock is None else {"clock": clock}
    if backend == "python":
        from kvindex.index import KVBlockIndex

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
