"""Serving a router in the current event loop: :func:`make_router` and :class:`RunningRouter`."""

from __future__ import annotations

from aiohttp import web

from examples.router.app import Router, RouterConfig
from examples.router.pd import PDRouter

__all__ = ["RunningRouter", "make_router"]


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
