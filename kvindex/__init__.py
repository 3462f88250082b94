"""kvindex: which KV-cache blocks every pod of a vLLM/SGLang fleet holds, and where to send a request.

The entry point is the facade: ``from kvindex import Indexer, Config``
(:mod:`kvindex.facade`: configuration -> index + event pool + subscriber +
scorer).  Below it, the ground: :class:`TokenProcessor` (:mod:`kvindex.keys`,
token ids -> chained request keys, our keyed hash or vLLM's block hashes),
the index contract (:mod:`kvindex.contract`), the backends (the compiled
core :mod:`kvindex.native`, the pure-Python reference
:mod:`kvindex.reference`, Redis :mod:`kvindex.redis_index`), one factory
(:func:`make_index`) and the tiers (:mod:`kvindex.tiers`).  The ground opens
no sockets and starts no threads; the facade's names are imported lazily, so
importing the ground never pulls the upper floors.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from kvindex.contract import ALL_MODELS, IndexStats, IndexUnavailable, KVIndex, PodEntry
from kvindex.factory import BACKENDS, make_index
from kvindex.keys import ALGORITHMS, TokenProcessor
from kvindex.reference import KVBlockIndex
from kvindex.tiers import CPU, DECODE_RETAINED, GPU, STORAGE, TierWeights

__version__ = "0.2.0"

if TYPE_CHECKING:
    from kvindex.facade import (
        AsyncIndexer,
        Config,
        EngineEndpoint,
        HealingPolicy,
        Indexer,
        IndexerStats,
        KVIndexMetrics,
        LoadSnapshot,
        Score,
        load_config,
    )

# the facade's names, handed out on first use (PEP 562)
_FACADE = frozenset(
    {"AsyncIndexer", "Config", "EngineEndpoint", "HealingPolicy", "Indexer", "IndexerStats", "KVIndexMetrics", "LoadSnapshot",
     "Score", "load_config"}
)


def __getattr__(name: str) -> Any:
    if name in _FACADE:
        from kvindex import facade

        value = getattr(facade, name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'kvindex' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | _FACADE)


__all__ = [
    "ALGORITHMS",
    "ALL_MODELS",
    "BACKENDS",
    "CPU",
    "Config",
    "DECODE_RETAINED",
    "EngineEndpoint",
    "GPU",
    "HealingPolicy",
    "IndexStats",
    "IndexUnavailable",
    "Indexer",
    "IndexerStats",
    "KVBlockIndex",
    "KVIndex",
    "KVIndexMetrics",
    "LoadSnapshot",
    "PodEntry",
    "STORAGE",
    "Score",
    "TierWeights",
    "TokenProcessor",
    "load_config",
    "make_index",
]
