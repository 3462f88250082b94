"""The sequencer's vocabulary: the batch it is fed and the actions it returns.

See :mod:`kvevents.sequencer`: the shard performs each :data:`Action` in order
(apply a batch, clear the stream, ask the replay endpoint for a replay or a
check, count, note a completeness change) and feeds the answers back.
"""

from __future__ import annotations

from typing import Any, NamedTuple

__all__ = ["Action", "Apply", "Batch", "Clear", "Complete", "Confirm", "Count", "Replay"]


class Batch(NamedTuple):
    """One decoded batch as the sequencer sees it.

    seq: the engine's sequence number (0 .. 2**64 - 2).
    ts: the engine's wall-clock timestamp (only compared for equality).
    resets: the batch carries AllBlocksCleared (the engine state is known after it).
    lossy: one of its events could not be decoded (the state is no longer exact).
    body: opaque for the sequencer (the pool's decoded batch), returned in :class:`Apply`.
    """

    seq: int
    ts: float
    resets: bool = False
    lossy: bool = False
    body: Any = None


class Apply(NamedTuple):
    """Apply ``batch`` to the index (``replayed``: it came from a replay)."""

    batch: Batch
    replayed: bool = False


class Clear(NamedTuple):
    """Forget every block of the stream in the index (why: a label for logs)."""

    why: str


class Replay(NamedTuple):
    """Ask the replay endpoint for every buffered batch with seq >= ``start``."""

    start: int


class Confirm(NamedTuple):
    """Ask the replay endpoint for the batch at ``seq``; answer with :meth:`Sequencer.confirmed`
    whether it is there with engine timestamp ``ts`` (the batch we applied at ``seq``)."""

    seq: int
    ts: float | None


class Count(NamedTuple):
    """Add ``n`` to the counter ``name`` (a :class:`kvevents.pool.PoolStats` field)."""

    name: str
    n: int = 1


class Complete(NamedTuple):
    """The stream's completeness changed to ``complete`` (``why``: what made it so)."""

    complete: bool
    why: str


Action = Apply | Clear | Replay | Confirm | Count | Complete
