"""What the pool's shards take from their queues: messages, where they come from, control items.

A :class:`RawMessage` is one three-frame ZMQ message as received (topic, seq
frame, payload) with the :class:`Source` (subscription) it came from; the
control items (flush, bootstrap, forget, drop marker, disconnect and
reconnect notices) share the shard's one ordered queue with them.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import NamedTuple

from kvevents.actions import Batch
from kvevents.events import AllBlocksCleared, BlockStored, EventBatch
from kvevents.fastwire import FastBatch
from kvevents.sglang import decode_sglang_batch
from kvevents.wire import decode_vllm_batch

__all__ = ["DECODERS", "RawMessage", "Source", "StoreObserver"]

#: ``fn(pod, dp_rank, model, event)``: called before a BlockStored is applied (see
#: :meth:`kvevents.pool.EventPool.add_store_observer`).
StoreObserver = Callable[[str, int, "str | None", BlockStored], None]

#: payload decoder per ``Source.engine``
DECODERS: dict[str, Callable[[bytes], EventBatch]] = {
    "vllm": decode_vllm_batch,
    "sglang": decode_sglang_batch,
}


class Source(NamedTuple):
    """Where messages come from: one subscription (an engine endpoint, or a bound socket).

    pod: pod id used when the topic carries none (None: the topic must name it).
    engine: "vllm" or "sglang" (selects the payload decoder).
    replay: replay endpoint for this publisher, or a callable (pod, dp_rank)
        -> endpoint | None for bound sockets many publishers dial into.
    dp_rank: DP rank used when the batch carries none.
    model: model name used when the topic carries none.
    """

    pod: str | None = None
    engine: str = "vllm"
    replay: str | Callable[[str, int], str | None] | None = None
    dp_rank: int = 0
    model: str | None = None

    def replay_endpoint(self, pod: str, dp_rank: int) -> str | None:
        """The replay endpoint serving (pod, dp_rank), or None."""
        if self.replay is None or isinstance(self.replay, str):
            return self.replay
        return self.replay(pod, dp_rank)


class RawMessage(NamedTuple):
    """One three-frame KV-event message as received: topic, seq frame, payload."""

    source: Source
    topic: bytes
    seq: bytes
    payload: bytes


class _Flush(NamedTuple):
    done: threading.Event


class _Bootstrap(NamedTuple):
    source: Source
    pod: str
    dp_rank: int


class _Forget(NamedTuple):
    pod: str


class _Dropped(NamedTuple):
    """A message of ``pod`` was dropped here (the queue was full): the drop's place in the order."""

    pod: str


class _Disconnected(NamedTuple):
    pod: str
    dp_rank: int


class _Reconnected(NamedTuple):
    pod: str
    dp_rank: int
    source: Source | None = None  # to bootstrap from when nothing applied is left to check


_STOP = object()


def _as_batch(seq: int, batch: EventBatch | FastBatch) -> Batch:
    """The sequencer's view of a decoded batch."""
    if type(batch) is FastBatch:  # decoded whole (nothing left out): lossy never
        return Batch(seq, batch.ts, batch.raw.resets, False, batch)
    return Batch(seq, batch.ts, AllBlocksCleared in map(type, batch.events), bool(batch.bad_events), batch)

