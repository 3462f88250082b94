"""An asyncio face for routers built on asyncio: :class:`AsyncIndexer`.

A thin wrapper: what can wait (start, stop, connection and flush waits,
request tokenization) runs in a worker thread so the event loop keeps
serving; :meth:`AsyncIndexer.score` and :meth:`AsyncIndexer.route` run inline,
because a score is short and CPU-bound (a thread hop would cost more than it
saves), so they hold the loop for exactly the score's own time.
"""

from __future__ import annotations

import asyncio
from collections.abc import Collection, Mapping, Sequence
from types import TracebackType
from typing import TYPE_CHECKING, Any

import numpy as np

from kvindex.facade.config import Config
from kvindex.facade.indexer import Indexer, Score
from scorer.load import LoadSnapshot

if TYPE_CHECKING:
    from kvindex.tokenize import RequestTokenizer, TokenizedRequest


class AsyncIndexer:
    """:class:`Indexer` for asyncio code; ``async with AsyncIndexer(cfg) as ix:`` starts and stops it.

    Args:
        config: the indexer's configuration (or pass ``indexer``).
        indexer: an existing :class:`Indexer` to wrap (not started here if already started).
        tokenizer: an optional :class:`kvindex.tokenize.RequestTokenizer` for :meth:`tokenize`.
    """

    def __init__(self, config: Config | None = None, *, indexer: Indexer | None = None,
                 tokenizer: RequestTokenizer | None = None) -> None:
        if config is not None and indexer is not None:
            raise ValueError("pass config or indexer, not both")
        self.indexer = indexer if indexer is not None else Indexer(config)
        self.tokenizer = tokenizer

    async def start(self) -> AsyncIndexer:
        """Start the write path (sockets, pool workers) without blocking the loop."""
        await asyncio.to_thread(self.indexer.start)
        return self

    async def stop(self) -> None:
        """Stop the write path without blocking the loop."""
        await asyncio.to_thread(self.indexer.stop)

    async def wait_connected(self, timeout: float = 10.0) -> bool:
        """:meth:`Indexer.wait_connected`, awaited."""
        return await asyncio.to_thread(self.indexer.wait_connected, timeout)

    async def flush(self, timeout: float = 10.0) -> bool:
        """:meth:`Indexer.flush`, awaited."""
        return await asyncio.to_thread(self.indexer.flush, timeout)

    async def tokenize(self, path: str, body: Mapping[str, Any]) -> TokenizedRequest:
        """The request's token ids (:meth:`RequestTokenizer.tokenize`) in a worker thread.

        Raises ValueError when no tokenizer was given.
        """
        if self.tokenizer is None:
            raise ValueError("AsyncIndexer was created without a tokenizer")
        return await asyncio.to_thread(self.tokenizer.tokenize, path, body)

    def score(self, tokens: Sequence[int] | np.ndarray, pods: Collection[str] | None = None, *,
              model: str | None = None, lora: str | None = None,
              block_extra_keys: Sequence[Sequence | None] | None = None, cache_salt: str | None = None,
              loads: Mapping[str, LoadSnapshot] | None = None, keys: np.ndarray | None = None) -> Score:
        """:meth:`Indexer.score`, inline (safe on the loop: it never waits)."""
        return self.indexer.score(tokens, pods, model=model, lora=lora, block_extra_keys=block_extra_keys,
                                  cache_salt=cache_salt, loads=loads, keys=keys)

    def route(self, tokens: Sequence[int] | np.ndarray, pods: Collection[str] | None = None, *,
              model: str | None = None, lora: str | None = None,
              block_extra_keys: Sequence[Sequence | None] | None = None, cache_salt: str | None = None,
              loads: Mapping[str, LoadSnapshot] | None = None, keys: np.ndarray | None = None) -> Score:
        """:meth:`Indexer.route`, inline; call :meth:`request_finished` when the request ends."""
        return self.indexer.route(tokens, pods, model=model, lora=lora, block_extra_keys=block_extra_keys,
                                  cache_salt=cache_salt, loads=loads, keys=keys)

    def request_finished(self, pod: str, prefill_tokens: int = 0) -> None:
        """:meth:`Indexer.request_finished`."""
        self.indexer.request_finished(pod, prefill_tokens)

    def report_cached(self, pod: str, predicted: int, confirmed: int) -> None:
        """:meth:`Indexer.report_cached`."""
        self.indexer.report_cached(pod, predicted, confirmed)

    async def __aenter__(self) -> AsyncIndexer:
        return await self.start()

    async def __aexit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                        tb: TracebackType | None) -> None:
        await self.stop()
