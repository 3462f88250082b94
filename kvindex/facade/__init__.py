"""kvindex.facade: the facade that wires kvindex, kvevents and scorer together.

:class:`Indexer` takes one :class:`Config` (JSON or YAML), starts the write
path (ZMQ subscriber -> sharded pool -> index) and answers ``score(tokens,
pods)`` on the read path.  It sits above kvevents and scorer, which never
import each other.
"""

from kvindex.facade.aio import AsyncIndexer
from kvindex.facade.config import Config, load_config
from kvindex.facade.flush import FlushReport
from kvindex.facade.healing import HealingPolicy, HealingState, HealingStats, with_full_report
from kvindex.facade.indexer import Indexer, IndexerStats, Score
from kvindex.facade.metrics import KVIndexMetrics
from kvevents.subscriber import EngineEndpoint
from scorer.load import LoadSnapshot

__all__ = [
    "AsyncIndexer", "Config", "EngineEndpoint", "FlushReport", "HealingPolicy", "HealingState", "HealingStats", "Indexer", "IndexerStats",
    "KVIndexMetrics", "LoadSnapshot", "Score", "load_config", "with_full_report",
]
