"""A simulated fleet of vLLM engines that publish KV-cache events over real ZMQ.

The engine is :class:`kvevents.testing.FakeEngine` (shipped with the library):
an independent implementation of the engine side of vLLM 0.32's KV-event
protocol (vllm/distributed/kv_events.py): three-frame PUB messages, msgpack
batches ``[ts, events, data_parallel_rank]``, events as maps (current vLLM) or
positional arrays (older vLLM), three block-hash wire forms and the replay
ROUTER.  It does not use the library's decoders or key functions, so those are
checked against a peer that was written separately.

- :class:`SimEngine` - one engine (one pod, one DP rank) in this process.
- :class:`SimFleet` - several engines, each in its own process.
"""

from examples.simfleet.engine import (
    END_SEQ,
    EngineStats,
    SimEngine,
    block_digests,
    digest_to_uint64,
    is_bind_endpoint,
    none_hash,
    validate_engine_args,
    wire_hash,
)
from examples.simfleet.fleet import LOOPBACK_ANY, EngineConfig, SimFleet, free_tcp_port

__all__ = [
    "END_SEQ",
    "LOOPBACK_ANY",
    "EngineConfig",
    "EngineStats",
    "SimEngine",
    "SimFleet",
    "block_digests",
    "digest_to_uint64",
    "free_tcp_port",
    "is_bind_endpoint",
    "none_hash",
    "validate_engine_args",
    "wire_hash",
]
