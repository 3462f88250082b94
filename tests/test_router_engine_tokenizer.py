"""The router's default tokenizer: the engines' model folder, adopted only when it agrees with the engine.

The engine here is an aiohttp app serving ``GET /v1/models`` (``root``) and
``POST /tokenize``; its tokenization is the library's own from the same folder
(an engine that agrees) or that with one id changed (an engine with another
template). The agreement with real vLLM engines is checked in
tests/real/hybrid/test_tokenize_equality.py and tests/real/fleet/test_router.py.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp import web

import transformers  # noqa: F401  (the extra kvindex[tokenize]; make test installs it)

from examples.router.app import EngineSpec, Router, RouterConfig
from examples.router.engine_tokenizer import PROBES, adopt_engine_tokenizer, engine_model_root
from kvindex.tokenize import RequestTokenizer
from tests.tokenize_model import make_tokenizer_dir


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tokenizer_dir(tmp_path_factory.mktemp("tok"))


def _engine(root: Any, tokens: Callable[[dict[str, Any]], list[int]]) -> web.Application:
    async def models(_: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": "m", "root": root}]})

    async def tokenize(request: web.Request) -> web.Response:
        return web.json_response({"tokens": tokens(await request.json())})

    async def metrics(_: web.Request) -> web.Response:
        return web.Response(text="")

    app = web.Application()
    app.router.add_get("/v1/models", models)
    app.router.add_post("/tokenize", tokenize)
    app.router.add_get("/metrics", metrics)
    return app


def _like(ref: RequestTokenizer, shift: int = 0) -> Callable[[dict[str, Any]], list[int]]:
    def tokens(req: dict[str, Any]) -> list[int]:
        path = "/v1/chat/completions" if "messages" in req else "/v1/completions"
        ids = ref.tokenize(path, req).token_ids or []
        return ids[:-1] + [ids[-1] + shift] if ids else ids
    return tokens


async def _with_engine(app: web.Application, go: Callable[[str], Awaitable[Any]]) -> Any:
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    try:
        return await go(f"http://127.0.0.1:{port}")
    finally:
        await runner.cleanup()


def _router_on(url: str, **kw: Any) -> Router:
    engine = EngineSpec(pod="pod-0", url=url, endpoint="tcp://127.0.0.1:9")
    return Router(RouterConfig(engines=[engine], model="m", **kw))


async def _adopted(url: str) -> tuple[bool, str]:
    router = _router_on(url)
    router._session = aiohttp.ClientSession()
    try:
        router.healthy["pod-0"] = True
        await router._adopt_engine_tokenizer()
        return router.tokenizer is not None, router.tokenizer_source
    finally:
        await router._session.close()


def test_an_engine_that_agrees_lends_its_folder(model_dir: Path) -> None:
    ref = RequestTokenizer(model_dir, cache_entries=0)
    adopted, source = asyncio.run(_with_engine(_engine(str(model_dir), _like(ref)), _adopted))
    assert adopted and source == f"engine model folder {model_dir}"


def test_an_engine_with_another_template_keeps_the_router_on_tokenize(model_dir: Path) -> None:
    ref = RequestTokenizer(model_dir, cache_entries=0)
    adopted, source = asyncio.run(_with_engine(_engine(str(model_dir), _like(ref, shift=1)), _adopted))
    assert not adopted and "tokenizes differently" in source and source.startswith("engine /tokenize")


@pytest.mark.parametrize("root", [None, 7, "", "Qwen/Qwen3-8B", "/nonexistent/model"])
def test_a_root_that_is_no_readable_folder_is_not_used(root: Any, model_dir: Path) -> None:
    ref = RequestTokenizer(model_dir, cache_entries=0)
    adopted, source = asyncio.run(_with_engine(_engine(root, _like(ref)), _adopted))
    assert not adopted and source.startswith("engine /tokenize (")


def test_a_folder_without_a_tokenizer_is_not_used(tmp_path: Path, model_dir: Path) -> None:
    async def remote(path: str, body: Any) -> list[int] | None:
        raise AssertionError("no probe is sent without a tokenizer")

    tokenizer, why = asyncio.run(adopt_engine_tokenizer(str(tmp_path), remote))
    assert tokenizer is None and "no usable tokenizer" in why


def test_no_engine_answering_tokenize_means_no_adoption(model_dir: Path) -> None:
    async def remote(path: str, body: Any) -> list[int] | None:
        return None

    tokenizer, why = asyncio.run(adopt_engine_tokenizer(str(model_dir), remote))
    assert tokenizer is None and "no engine answered" in why


def test_every_probe_is_reproducible_by_the_library(model_dir: Path) -> None:
    ref = RequestTokenizer(model_dir, cache_entries=0)
    for path, body in PROBES:
        got = ref.tokenize(path, dict(body))
        assert got.exact and got.token_ids, (path, body)


def test_the_model_root_of_garbage_answers_is_none() -> None:
    async def go(url: str) -> str | None:
        async with aiohttp.ClientSession() as s:
            return await engine_model_root(s, url)

    async def bad(_: web.Request) -> web.Response:
        return web.Response(text="{not json")

    app = web.Application()
    app.router.add_get("/v1/models", bad)
    assert asyncio.run(_with_engine(app, go)) is None
    assert asyncio.run(go("http://127.0.0.1:9")) is None  # nothing listens
