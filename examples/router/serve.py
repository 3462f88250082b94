"""Serving a router in the current event loop: :func:`make_router` and :class:`RunningRouter`."""

from __future__ import annotations

import asyncio
import gc
from collections.abc import Callable

from aiohttp import web

from examples.router.app import Router, RouterConfig
from examples.router.pd import PDRouter

__all__ = ["GC_THRESHOLDS", "RunningRouter", "loop_factory", "make_router", "tune_gc"]


GC_THRESHOLDS = (100_000, 50, 100)
"""The router process's garbage-collector thresholds (:func:`tune_gc`)."""


def tune_gc(thresholds: tuple[int, int, int] = GC_THRESHOLDS) -> None:
    """Make the cyclic garbage collector cheap for a router process; call once, after start-up.

    A request allocates thousands of objects (the decoded body, token-id
    lists), nearly all freed by reference counting; with the default
    thresholds the collector runs every few hundred allocations and its
    older generations traverse everything start-up left (tokenizer, index,
    aiohttp). This collects once, moves the survivors to the permanent
    generation (:func:`gc.freeze`) and raises the thresholds. Process-wide:
    for a router's entry point (``python -m examples.router``), not a library.
    Call :func:`gc.unfreeze` at shutdown, so that the frozen objects' cycles
    are collected before the interpreter exits.
    """
    gc.collect()
    gc.freeze()
    gc.set_threshold(*thresholds)


def loop_factory() -> Callable[[], asyncio.AbstractEventLoop]:
    """The router process's event-loop factory: uvloop's when it is installed, else asyncio's.

    uvloop comes with the ``router`` extra (``pip install 'kvindex[router]'``);
    without it the router runs on asyncio's default loop, unchanged. For a
    router's entry point (``python -m examples.router``), which owns its loop;
    the router itself runs on any loop (tests use asyncio's).
    """
    try:
        import uvloop
    except ImportError:
        return asyncio.new_event_loop
    return uvloop.new_event_loop


def make_router(config: RouterConfig) -> Router:
    """A :class:`PDRouter` when the config names prefill or decode pods, else a :class:`Router`."""
    if config.prefill or config.decode:
        return PDRouter(config)
    return Router(config)


class RunningRouter:
    """Serve a :class:`Router` (a :class:`examples.router.pd.PDRouter` when the
    config names prefill and decode pods) in the current event loop (tests, demos).

    ``async with RunningRouter(config) as rr: rr.url`` -> ``http://host:port``;
    port 0 in the config picks a free port.
    """

    def __init__(self, config: RouterConfig) -> None:
        self.router = make_router(config)
        self._runner: web.AppRunner | None = None
        self.url = ""

    async def __aenter__(self) -> RunningRouter:
        self._runner = web.AppRunner(self.router.app(), access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.router.config.host, self.router.config.port)
        await site.start()
        host, port = self._runner.addresses[0][:2]
        self.url = f"http://{host}:{port}"
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None
