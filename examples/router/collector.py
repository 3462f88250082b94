"""The router's Prometheus collector of its embedded indexer's library metrics."""

from __future__ import annotations

from typing import TYPE_CHECKING

from prometheus_client.registry import Collector

if TYPE_CHECKING:
    from examples.router.app import Router

__all__ = ["IndexerCollector"]


class IndexerCollector(Collector):
    """Serves the embedded indexer's library metrics (:mod:`kvindex.facade.metrics`), read at scrape time.

    A proxy rather than registering ``indexer.metrics`` itself, because the
    indexer is built in :meth:`Router.start`, after the registry.
    """

    def __init__(self, router: Router) -> None:
        self._router = router

    def collect(self):  # type: ignore[no-untyped-def]
        """The indexer's families (nothing before :meth:`Router.start`)."""
        ix = self._router.indexer
        if ix is None:
            return
        yield from ix.metrics.collect()

    def describe(self):  # type: ignore[no-untyped-def]
        """No fixed description: families are produced at scrape time."""
        return []
