"""One simulated vLLM engine: :class:`kvevents.testing.FakeEngine` with the simulator's defaults.

The engine itself ships with the library (kvevents.testing); ``SimEngine`` keeps
the simulator's defaults: model ``sim-model``, hash seed ``sim`` (also for
:func:`block_digests` here), no replay endpoint unless one is given, and
vLLM's bind-or-connect rule for the PUB endpoint.
"""

from __future__ import annotations

from typing import Any

from kvevents.testing import block_digests as _block_digests
from kvevents.testing import (
    END_SEQ,
    EngineStats,
    FakeEngine,
    HashAlgo,
    digest_to_uint64,
    is_bind_endpoint,
    none_hash,
    validate_engine_args,
    wire_hash,
)

__all__ = [
    "END_SEQ",
    "EngineStats",
    "SimEngine",
    "block_digests",
    "digest_to_uint64",
    "is_bind_endpoint",
    "none_hash",
    "validate_engine_args",
    "wire_hash",
]

SIM_SEED = "sim"


class SimEngine(FakeEngine):
    """A :class:`~kvevents.testing.FakeEngine` with the simulator's defaults (see the module doc)."""

    def __init__(
        self,
        *,
        pod: str,
        endpoint: str,
        capacity_blocks: int,
        model: str = "sim-model",
        replay_endpoint: str | None = None,
        hash_seed: str = SIM_SEED,
        pub_bind: bool | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(
            pod=pod, endpoint=endpoint, capacity_blocks=capacity_blocks, model=model,
            replay_endpoint=replay_endpoint, hash_seed=hash_seed, pub_bind=pub_bind, **kwargs,
        )


def block_digests(tokens: Any, block_size: int, seed: str = SIM_SEED, algo: HashAlgo = "sha256") -> list[bytes]:
    """:func:`kvevents.testing.block_digests` with the simulator's default seed."""
    return _block_digests(tokens, block_size, seed, algo)
