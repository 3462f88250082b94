"""The router's Prometheus collector of its embedded indexer's library metrics."""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

from prometheus_client.registry import Collector

if TYPE_CHECKING:
    from kvindex.facade import Indexer


class HasIndexer(Protocol):
    """What the collector reads: the router's indexer (None until the router has started)."""

    indexer: Indexer | None

__all__ = ["IndexerCollector"]


class IndexerCollector(Collector):
    """Serves the embedded indexer's library metrics (:mod:`kvindex.facade.metrics`), read at scrape time.

    A proxy rather than registering ``indexer.metrics`` itself, because the
    indexer is built when the router starts, after the registry.
    """

    def __init__(self, router: HasIndexer) -> None:
        self._router = router

    def collect(self):  # type: ignore[no-untyped-def]
        """The indexer's families (nothing before the router has started)."""
        ix = self._router.indexer
        if ix is None:
            return
        yield from ix.metrics.collect()

    def describe(self):  # type: ignore[no-untyped-def]
        """No fixed description: families are produced at scrape time."""
        return []
