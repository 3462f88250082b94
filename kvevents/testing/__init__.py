"""Testing support shipped with the library: a fake vLLM engine that publishes real KV events.

:class:`FakeEngine` speaks vLLM 0.32's KV-event protocol over real ZMQ sockets
(PUB with three frames per message, the replay ROUTER with its end marker),
with vLLM-compatible block hashes; a router's own tests point an
:class:`kvindex.Indexer` at it (see docs/testing.md)::

    from kvevents.testing import FakeEngine

    with FakeEngine(pod="pod-a", model="m") as engine:
        engine.serve(list(range(64)))
"""

from kvevents.testing.engine import (
    END_SEQ,
    LOOPBACK_ANY,
    Encoding,
    EngineStats,
    FakeEngine,
    is_bind_endpoint,
    validate_engine_args,
)
from kvevents.testing.hashing import (
    VLLM_SEED,
    HashAlgo,
    HashForm,
    block_digests,
    digest_to_uint64,
    none_hash,
    wire_hash,
)

__all__ = [
    "END_SEQ",
    "LOOPBACK_ANY",
    "VLLM_SEED",
    "Encoding",
    "EngineStats",
    "FakeEngine",
    "HashAlgo",
    "HashForm",
    "block_digests",
    "digest_to_uint64",
    "is_bind_endpoint",
    "none_hash",
    "validate_engine_args",
    "wire_hash",
]
