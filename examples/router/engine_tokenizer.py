"""The router's default tokenizer: the engines' own model folder, checked against the engine.

With no ``tokenizer`` configured (and ``auto_tokenizer`` on), the router asks an
engine's ``GET /v1/models`` for the model's ``root`` (vLLM 0.32 reports the
``--model`` argument there: a folder or a Hugging Face id). When ``root`` is a
folder this process can read, a :class:`kvindex.tokenize.RequestTokenizer` is
built from it with the engines' default flags, and :data:`PROBES` are tokenized
both locally and by the engine's ``POST /tokenize``. The router tokenizes
locally only when every probe gives the same ids: an engine started with its
own ``--chat-template`` or other template flags, a folder that is not the
engine's, or a missing ``kvindex[tokenize]`` extra leaves it on ``/tokenize``,
with the reason logged and shown in ``/health``.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Mapping
from pathlib import Path
from typing import Any

import aiohttp
import msgspec

__all__ = ["PROBES", "adopt_engine_tokenizer", "engine_model_root"]

log = logging.getLogger("kvindex.router")

_CHAT = "/v1/chat/completions"
#: (path, body) pairs rendered both ways before the router tokenizes locally
PROBES: tuple[tuple[str, dict[str, Any]], ...] = (
    (_CHAT, {"messages": [{"role": "user", "content": "Which pod holds this prefix?"}]}),
    (_CHAT, {"messages": [
        {"role": "system", "content": "You answer in one short sentence."},
        {"role": "user", "content": "Name a colour."},
        {"role": "assistant", "content": "Blue."},
        {"role": "user", "content": "And another one, please?"},
    ]}),
    (_CHAT, {"messages": [{"role": "user", "content": "Continue: one, two,"}], "add_generation_prompt": False}),
    ("/v1/completions", {"prompt": "The quick brown fox jumps over the lazy dog."}),
)

#: what a probe's engine side returns: the engine's ids, or None when no engine answered
Remote = Callable[[str, Mapping[str, Any]], Awaitable[list[int] | None]]


async def engine_model_root(session: aiohttp.ClientSession, url: str, timeout: float = 10.0) -> str | None:
    """The first model's ``root`` from ``GET url/v1/models`` (None when the engine does not say)."""
    try:
        async with session.get(url + "/v1/models", timeout=aiohttp.ClientTimeout(total=timeout)) as resp:
            if resp.status != 200:
                return None
            data = msgspec.json.decode(await resp.read())
        root = data["data"][0].get("root")
    except (aiohttp.ClientError, TimeoutError, msgspec.DecodeError, KeyError, IndexError, TypeError, AttributeError):
        return None
    return root if isinstance(root, str) and root else None


async def adopt_engine_tokenizer(root: str | None, remote: Remote) -> tuple[Any | None, str]:
    """A RequestTokenizer for ``root`` if it tokenizes every probe as the engine does.

    Returns ``(tokenizer, "engine model folder <root>")`` when adopted, else
    ``(None, reason)``; never raises for a folder it cannot use.
    """
    if root is None:
        return None, "the engines did not report their model's root (GET /v1/models)"
    folder = Path(root)
    if not folder.is_dir():
        return None, f"the engines' model {root!r} is not a folder this router can read"
    try:
        from kvindex.tokenize import RequestTokenizer
    except ImportError as e:  # the kvindex[tokenize] extra is not installed
        return None, f"local tokenization needs kvindex[tokenize] ({e})"
    try:
        tokenizer = await asyncio.to_thread(RequestTokenizer, folder)
    except Exception as e:  # whatever the folder holds, the router keeps /tokenize
        return None, f"no usable tokenizer in {root}: {e!r}"
    for path, body in PROBES:
        local = await asyncio.to_thread(tokenizer.tokenize, path, dict(body))
        theirs = await remote(path, body)
        if theirs is None:
            return None, "no engine answered POST /tokenize for the start-up check"
        if not local.exact or local.token_ids != theirs:
            return None, (f"{root}: a {path} probe tokenizes differently from the engine "
                          "(engines started with their own --chat-template? configure the router's tokenizer)")
    return tokenizer, f"engine model folder {root}"
