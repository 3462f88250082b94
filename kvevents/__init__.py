"""kvevents: the write path's front end.

Engine KV-cache events (vLLM, SGLang) arrive over ZMQ as three frames (topic,
sequence number, msgpack payload).  :mod:`kvevents.wire` decodes vLLM's frames
and payloads (both its map and its older positional event encodings),
:mod:`kvevents.sglang` decodes SGLang's payloads, and both produce the
engine-neutral events of :mod:`kvevents.events` that the pool applies to the
index.  Decoders raise :class:`kvevents.wire.PayloadError` and nothing else.
"""

from kvevents.events import AllBlocksCleared, BlockRemoved, BlockStored, EventBatch
from kvevents.pool import EventPool, PoolStats, RawMessage, Source, StreamState
from kvevents.sequencer import Sequencer
from kvevents.sglang import decode_sglang_batch
from kvevents.subscriber import EngineEndpoint, Subscriber
from kvevents.wire import PayloadError, decode_vllm_batch, parse_topic

__all__ = [
    "AllBlocksCleared",
    "BlockRemoved",
    "BlockStored",
    "EngineEndpoint",
    "EventBatch",
    "EventPool",
    "PayloadError",
    "PoolStats",
    "RawMessage",
    "Sequencer",
    "Source",
    "StreamState",
    "Subscriber",
    "decode_sglang_batch",
    "decode_vllm_batch",
    "parse_topic",
]
