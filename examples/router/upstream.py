"""HTTP client side of the router: sessions to the engines and a POST that retries unsent requests.

A connection that was never made (refused, or not made within the connect
timeout) means the engine never saw the request, so sending it again is safe
for any method. The router retries those, and only those: once a request is
written, a failure is reported to the client as it is.

A connect timeout also fires when the router's own event loop was held up
for longer than the timeout (a busy or overloaded host): the connection was
made, but the timer ran first. The retry covers that case too.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import aiohttp

from examples.router.config import ENGINE_KEEPALIVE

__all__ = ["HOP_BY_HOP", "NOT_SENT", "engine_session", "post_upstream"]

log = logging.getLogger("kvindex.router")

HOP_BY_HOP = frozenset(
    h.lower()
    for h in (
        "Connection",
        "Keep-Alive",
        "Proxy-Authenticate",
        "Proxy-Authorization",
        "TE",
        "Trailer",
        "Transfer-Encoding",
        "Upgrade",
        "Host",
        "Content-Length",
    )
)
"""Headers never copied between the client and the engine (RFC 9110 section 7.6.1, plus
Host and Content-Length, which aiohttp sets for each side)."""

#: client errors that mean the request was not sent (no connection was made)
NOT_SENT: tuple[type[BaseException], ...] = (aiohttp.ClientConnectorError, aiohttp.ConnectionTimeoutError)


def engine_session(timeout: aiohttp.ClientTimeout, keepalive: float = ENGINE_KEEPALIVE, **kwargs: Any) -> aiohttp.ClientSession:
    """An HTTP client session for talking to vLLM engines (``kwargs`` go to :class:`aiohttp.ClientSession`).

    Idle connections are dropped after ``keepalive`` seconds, below the
    engine's own limit (``VLLM_HTTP_TIMEOUT_KEEP_ALIVE``, 5 s, in vLLM's
    uvicorn server): a request written on a connection the server is closing
    at that moment fails with ``ServerDisconnectedError`` before the engine
    ever reads it.
    """
    return aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(keepalive_timeout=keepalive), **kwargs)


@asynccontextmanager
async def post_upstream(
    session: aiohttp.ClientSession, url: str, *, attempts: int = 3, backoff: float = 0.2, **kwargs: Any
) -> AsyncIterator[aiohttp.ClientResponse]:
    """``session.post(url, **kwargs)``, connecting up to ``attempts`` times (>= 1).

    Waits ``backoff`` seconds, doubling, between attempts. Raises the last
    :data:`NOT_SENT` error when no attempt connected, and any other client
    error at once (the request may have reached the engine).
    """
    for attempt in range(1, max(1, attempts) + 1):
        try:
            resp = await session.post(url, **kwargs)
            break
        except NOT_SENT as e:
            if attempt >= attempts:
                raise
            log.warning("router: %s not reached (attempt %d of %d): %r", url, attempt, attempts, e)
            await asyncio.sleep(backoff * 2 ** (attempt - 1))
    async with resp:
        yield resp
