"""The router's POST to an engine: a request never sent is sent again, a request written is not."""

from __future__ import annotations

import asyncio

import aiohttp
import pytest
from aiohttp import web

from examples.router.config import RouterConfig
from examples.router.upstream import engine_session, post_upstream
from examples.vllm_fleet.fleet import free_port


async def _serve(port: int, handler: web.RequestHandler) -> web.AppRunner:  # type: ignore[type-arg]
    app = web.Application()
    app.router.add_post("/v1/completions", handler)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    return runner


def test_engine_that_starts_listening_late_gets_the_request_once() -> None:
    seen: list[bytes] = []

    async def handler(request: web.Request) -> web.Response:
        seen.append(await request.read())
        return web.json_response({"ok": True})

    async def main() -> tuple[int, dict[str, bool]]:
        port = free_port()
        late = asyncio.get_running_loop().call_later(0.1, lambda: asyncio.ensure_future(_serve(port, handler)))
        async with engine_session(aiohttp.ClientTimeout(total=30)) as session:
            async with post_upstream(
                session, f"http://127.0.0.1:{port}/v1/completions", attempts=6, backoff=0.1, data=b'{"a": 1}'
            ) as resp:
                out = (resp.status, await resp.json())
        late.cancel()
        return out

    assert asyncio.run(main()) == (200, {"ok": True})
    assert seen == [b'{"a": 1}']


def test_nobody_listening_raises_after_the_attempts() -> None:
    async def main() -> None:
        async with engine_session(aiohttp.ClientTimeout(total=30)) as session:
            async with post_upstream(session, f"http://127.0.0.1:{free_port()}/x", attempts=2, backoff=0.01):
                pass

    with pytest.raises(aiohttp.ClientConnectorError):
        asyncio.run(main())


def test_request_written_then_dropped_is_not_sent_again() -> None:
    seen: list[bytes] = []

    async def handler(request: web.Request) -> web.Response:
        seen.append(await request.read())
        assert request.transport is not None
        request.transport.close()  # the engine read the request and went away
        await asyncio.sleep(0.05)
        return web.Response()

    async def main() -> None:
        port = free_port()
        runner = await _serve(port, handler)
        try:
            async with engine_session(aiohttp.ClientTimeout(total=30)) as session:
                async with post_upstream(
                    session, f"http://127.0.0.1:{port}/v1/completions", attempts=5, backoff=0.01, data=b"{}"
                ):
                    pass
        finally:
            await runner.cleanup()

    with pytest.raises(aiohttp.ClientError):
        asyncio.run(main())
    assert seen == [b"{}"]


@pytest.mark.parametrize("field,value", [("connect_timeout", 0.0), ("connect_attempts", 0)])
def test_config_rejects_bad_connect_settings(field: str, value: float) -> None:
    with pytest.raises(ValueError, match=field):
        RouterConfig(**{field: value})  # type: ignore[arg-type]
