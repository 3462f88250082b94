"""An engine's answer as the router relays it: streamed bytes, and the cached tokens it reports."""

from __future__ import annotations

from typing import Any

import aiohttp
import msgspec
from aiohttp import web

__all__ = ["STREAM_TAIL", "answer_cached_tokens", "relay_stream"]


async def relay_stream(up: aiohttp.ClientResponse, resp: web.StreamResponse, tail: bytearray | None = None) -> bool:
    """Copy an engine's streamed answer to the client as it arrives (``resp`` already prepared).

    ``tail``, when given, is left holding the answer's last :data:`STREAM_TAIL`
    bytes (where an SSE stream's usage chunk is). Returns False when the client
    went away: the caller then leaves the upstream response's context, which
    closes it, and the engine aborts the request.
    """
    try:
        async for chunk in up.content.iter_any():
            await resp.write(chunk)
            if tail is not None:
                tail += chunk
                if len(tail) > 2 * STREAM_TAIL:
                    del tail[:-STREAM_TAIL]
        await resp.write_eof()
    except ConnectionResetError:
        return False
    return True


#: bytes of a streamed answer kept to read its final usage chunk
STREAM_TAIL = 16384


def _cached_of(data: Any) -> int | None:
    """``usage.prompt_tokens_details.cached_tokens`` of a decoded answer or chunk, if it has one."""
    usage = data.get("usage") if isinstance(data, dict) else None
    details = usage.get("prompt_tokens_details") if isinstance(usage, dict) else None
    cached = details.get("cached_tokens") if isinstance(details, dict) else None
    return cached if type(cached) is int and cached >= 0 else None


def answer_cached_tokens(answer: bytes, streamed: bool) -> int | None:
    """The engine's cached prompt tokens from its answer (None when it does not say).

    A JSON answer's ``usage.prompt_tokens_details.cached_tokens`` (vLLM with
    ``--enable-prompt-tokens-details``); for a streamed answer (``answer`` its
    last bytes), the last ``data:`` chunk carrying usage (the client asked
    for ``stream_options.include_usage``).
    """
    if not streamed:
        try:
            return _cached_of(msgspec.json.decode(answer))
        except msgspec.DecodeError:
            return None
    for line in reversed(answer.split(b"\n")):
        if line.startswith(b"data: {") and b'"usage"' in line:
            try:
                return _cached_of(msgspec.json.decode(line[6:]))
            except msgspec.DecodeError:
                return None
    return None
