"""The index contract: what every backend satisfies and the types they share.

:class:`KVIndex` (a typing.Protocol) is the interface the write path
(kvevents' pool), the read path (scorer, the facade) and the connector depend
on.  The optional fast paths a backend may offer are declared as their own
small Protocols (:class:`BatchApply`, :class:`TokenMatch`,
:class:`SharedStore`, :class:`TierStatsSource`) and checked with
``isinstance``, never probed by name.  The result and stats types and
:exc:`IndexUnavailable` live here so that the backends (reference, compiled,
Redis) import only this module and :mod:`kvindex.side_tables`.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterable, Sequence
from typing import TYPE_CHECKING, Any, NamedTuple, Protocol, TypeAlias, runtime_checkable

import msgspec

if TYPE_CHECKING:
    import numpy as np

    from kvindex.hybrid import GroupSpec
    from kvindex.keys import TokenProcessor

#: Request keys as a reader passes them: ints, or a uint64 array (the compiled key chain's output).
RequestKeys: TypeAlias = "Sequence[int] | np.ndarray"

__all__ = [
    "ALL_MODELS",
    "RequestKeys",
    "SharedStore",
    "ApplyResult",
    "BatchApply",
    "RawApply",
    "GroupAware",
    "IndexStats",
    "IndexUnavailable",
    "KVIndex",
    "PodEntry",
    "TierStatsSource",
    "TokenMatch",
]


class IndexUnavailable(RuntimeError):
    """A write could not reach the index's store (the Redis backend during an outage).

    The write was not applied (each write is one atomic server-side script).
    The write path (kvevents' pool) counts it, marks the publisher's stream
    incomplete and rebuilds it from the engine's replay buffer once the store
    answers again.  The read path never raises it: reads degrade to no
    prefix information.
    """


class PodEntry(NamedTuple):
    """One holder of a block: ``pod`` holds it in ``tier`` on DP rank ``dp_rank``.

    ``speculative`` is True for an entry added by
    :meth:`KVBlockIndex.add_speculative` and not yet confirmed by a
    BlockStored (it reports tier ``gpu``).
    """

    pod: str
    tier: str
    dp_rank: int
    speculative: bool = False



class ApplyResult(msgspec.Struct):
    """What :meth:`KVBlockIndex.apply_events` did with one publisher's batch.

    Fields:
        stored_blocks: blocks of the BlockStored events applied (the sum of
            their ``len(block_hashes)``, orphaned ones included).
        removed_blocks: blocks named by the BlockRemoved events applied.
        clears: AllBlocksCleared events applied.
        errors: one message per event refused (ValueError / TypeError of the
            per-event call); the batch's other events are applied, in order.
        unavailable: the message of the
            :class:`~kvindex.contract.IndexUnavailable` that stopped the batch
            (a backend whose store is out of reach), else None.
        left: events not applied because of it (that one and the rest).
        stored_by_tier, removed_by_tier: tier -> blocks carried by the
            BlockStored / BlockRemoved events processed (applied or refused;
            not the ``left`` ones), the sum of their ``len(block_hashes)``
            (what a pool's per-stream counters need, tallied by the index so
            that a batch costs no Python step per event).
    """

    stored_blocks: int = 0
    removed_blocks: int = 0
    clears: int = 0
    errors: list[str] = msgspec.field(default_factory=list)
    unavailable: str | None = None
    left: int = 0
    stored_by_tier: dict[str, int] = msgspec.field(default_factory=dict)
    removed_by_tier: dict[str, int] = msgspec.field(default_factory=dict)


class IndexStats(msgspec.Struct, frozen=True):
    """Counters and sizes of a :class:`KVBlockIndex` (a snapshot).

    keys: request keys held (level 1); entries: (request key, pod, DP rank)
    entries; engine_keys: level-2 engine keys; pods: pods holding >= 1 block;
    evictions: request keys dropped by the capacity bound; stored_blocks /
    removed_blocks: tier copies added / removed by events; unknown_removals:
    BlockRemoved for an engine key the pod was not known to hold;
    unknown_offloads: token-less BlockStored for an unknown engine key;
    orphan_blocks: blocks waiting for their parent now; orphans: blocks that
    ever waited; orphans_attached / orphans_dropped: of those, attached later /
    dropped by the orphan bound or a clear; speculative: live speculative
    entries; speculative_confirmed / speculative_expired: their fates;
    clears: clear() calls that removed something.
    redis_errors: calls that could not reach the Redis server (Redis backend
    only; reads answered without prefix information, writes dropped);
    dropped_writes: of those, write calls not applied.
    group_entries: (block, pod, DP rank) entries of KV-cache groups other
    than each publisher's primary one (hybrid models; :class:`GroupAware`
    backends only); group_unmapped: blocks of such groups' stores dropped
    because their parent was unknown or the store was sparse (own-hash mode);
    group_trimmed: blocks of such groups' re-announce-shaped stores not
    believed during a healing report window; group_evictions: such entries
    forgotten (oldest first) beyond the index's capacity.
    """

    keys: int
    entries: int
    engine_keys: int
    pods: int
    evictions: int
    stored_blocks: int
    removed_blocks: int
    unknown_removals: int
    unknown_offloads: int
    orphan_blocks: int
    orphans: int
    orphans_attached: int
    orphans_dropped: int
    speculative: int
    speculative_confirmed: int
    speculative_expired: int
    clears: int
    redis_errors: int = 0
    dropped_writes: int = 0
    group_entries: int = 0
    group_unmapped: int = 0
    group_trimmed: int = 0
    group_evictions: int = 0


class _AllModels:
    """Type of :data:`ALL_MODELS`."""

    def __repr__(self) -> str:
        return "ALL_MODELS"


#: ``clear(pod, rank, model=ALL_MODELS)`` (the default) clears every model's stream.
ALL_MODELS = _AllModels()


@runtime_checkable
class KVIndex(Protocol):
    """Request key -> pod entries; engine key -> request key; pod -> keys.

    Semantics (events mirror vllm/distributed/kv_events.py, vLLM 0.32) are
    those documented on :class:`kvindex.reference.KVBlockIndex`; a publisher is
    (pod, DP rank, model), and ``model`` of :meth:`clear` /
    :meth:`request_key_of` defaults to :data:`ALL_MODELS`.  Implementations
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
        self, request_keys: RequestKeys, pods: Collection[str] | None = None
    ) -> dict[str, list[int]]: ...

    def lookup(self, request_keys: Iterable[int]) -> list[tuple[PodEntry, ...]]: ...

    def best_dp_rank(self, pod: str, request_keys: Sequence[int]) -> int | None: ...

    def request_key_of(self, engine_key: int, model: Any = ...) -> int | None: ...

    def pods(self) -> frozenset[str]: ...

    def pod_keys(self, pod: str, dp_rank: int | None = None) -> set[int]: ...

    def models(self) -> frozenset[str | None]: ...

    def stats(self) -> IndexStats: ...

    def __len__(self) -> int: ...


@runtime_checkable
class BatchApply(Protocol):
    """A backend that applies one publisher's decoded batch in one call (the pool uses it when present)."""

    def apply_events(
        self, pod: str, dp_rank: int, events: Sequence[Any], *, model: str | None = None,
        kinds: tuple[type, type, type],
    ) -> ApplyResult: ...


@runtime_checkable
class RawApply(Protocol):
    """A backend that applies a batch read without Python objects per token (the compiled index).

    ``raw`` is a ``kvindex._native.RawBatch`` (see :mod:`kvevents.fastwire`);
    ``events()`` returns the same batch decoded the reference way, asked only
    for the events the backend does not take natively.  Same result, state
    and counters as :meth:`BatchApply.apply_events` of those events.
    """

    def apply_raw(
        self, pod: str, dp_rank: int, raw: Any, events: Callable[[], Sequence[Any]], *, model: str | None = None,
        kinds: tuple[type, type, type],
    ) -> ApplyResult: ...


@runtime_checkable
class GroupAware(Protocol):
    """A backend that keeps presence per KV-cache group (hybrid models; see :mod:`kvindex.groups`).

    Its ``block_stored`` takes ``group=`` (a :class:`kvindex.hybrid.GroupSpec`,
    from the event's group fields) and its ``block_removed`` takes
    ``group_idx=``; the write path passes them only to such a backend.  A
    removal of one group never drops another group's entry.  The reference,
    compiled and Redis backends are all GroupAware (Redis keeps the groups in
    the server, shared by router replicas).
    """

    def group_specs(self, pod: str, dp_rank: int = 0, *, model: str | None = None) -> dict[int, GroupSpec]: ...

    def distrust_reports(
        self, pod: str, dp_rank: int = 0, *, model: str | None = None, seconds: float = 30.0
    ) -> None: ...

    def group_match(
        self, request_keys: Sequence[int], pod: str, dp_rank: int = 0, *, model: str | None = None
    ) -> dict[int, list[int]]: ...


@runtime_checkable
class TokenMatch(Protocol):
    """A backend that chains request keys and walks the index in one call.

    Returns (request keys as a uint64 array, pod -> (matched blocks, weighted
    score, first unmatched block)); ``dp_ranks`` receives pod -> DP rank for
    the pods whose match one rank holds.  Only for ``xxh3_chain`` keys
    without extra keys.
    """

    def match_tokens(
        self,
        tokens: Any,
        pods: Collection[str] | None,
        weights: Sequence[float],
        *,
        model: str | None = None,
        lora: str | tuple[str, str] | None = None,
        dp_ranks: dict[str, int] | None = None,
    ) -> tuple[Any, dict[str, tuple[int, float, int]]]: ...


@runtime_checkable
class SharedStore(Protocol):
    """A backend whose store lives outside the process (Redis): it can be out of reach or lose everything.

    ``writable()``: True when writes go through now.  ``generation``: changes
    when the store lost its data; the pool then rebuilds every stream from the
    engines' replay buffers.
    """

    generation: int

    def writable(self) -> bool: ...


@runtime_checkable
class TierStatsSource(Protocol):
    """A backend that counts, per tier, the keys and entries it holds (for metrics)."""

    def tier_stats(self) -> dict[str, tuple[int, int]]: ...

