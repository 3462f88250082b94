"""The router's entry point runs on uvloop's event loop when installed, on asyncio's when not
(examples/router/serve.py ``loop_factory``, examples/router/__main__.py)."""

from __future__ import annotations

import asyncio
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import uvloop  # the extra kvindex[router]; make test installs it
from aiohttp import web

from examples.router.serve import loop_factory

ROOT = Path(__file__).resolve().parent.parent
BLOCK_UVLOOP = "import sys; sys.modules['uvloop'] = None; import runpy; runpy.run_module('examples.router', run_name='__main__')"
"""``python -m examples.router`` where ``import uvloop`` fails, as without the extra."""


def test_the_factory_makes_uvloop_loops_when_installed() -> None:
    loop = loop_factory()()
    try:
        assert isinstance(loop, uvloop.Loop)
    finally:
        loop.close()


def test_the_factory_falls_back_to_asyncio(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "uvloop", None)  # import uvloop raises ImportError
    assert loop_factory() is asyncio.new_event_loop
    loop = loop_factory()()
    try:
        assert not isinstance(loop, uvloop.Loop)
        assert loop.run_until_complete(asyncio.sleep(0, "ran")) == "ran"
    finally:
        loop.close()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


async def _proxy_once(cmd: list[str]) -> tuple[dict[str, object], list[dict[str, object]], str]:
    """Start the router's entry point with ``cmd`` in front of a fake engine; send one completion."""
    import aiohttp

    seen: list[dict[str, object]] = []

    async def complete(request: web.Request) -> web.Response:
        seen.append(await request.json())
        return web.json_response({"id": "x", "object": "text_completion", "choices": [{"index": 0, "text": "ok"}]})

    async def metrics(_: web.Request) -> web.Response:
        return web.Response(text="vllm:num_requests_waiting 0\nvllm:num_requests_running 0\n")

    app = web.Application()
    app.router.add_post("/v1/completions", complete)
    app.router.add_get("/metrics", metrics)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    engine = "http://%s:%d" % runner.addresses[0][:2]
    port = _free_port()
    args = ["--engine", f"pod-a@{engine}=tcp://127.0.0.1:{_free_port()}", "--model", "m",
            "--port", str(port), "--no-auto-tokenizer"]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = await asyncio.create_subprocess_exec(*cmd, *args, cwd=ROOT, env=env, stderr=subprocess.PIPE)
    try:
        async with aiohttp.ClientSession() as s:
            deadline = time.monotonic() + 60
            while True:
                try:
                    body = {"model": "m", "prompt": list(range(40)), "max_tokens": 1}
                    async with s.post(f"http://127.0.0.1:{port}/v1/completions", json=body) as r:
                        assert r.status == 200, await r.text()
                        answer = json.loads(await r.read())
                        break
                except aiohttp.ClientConnectorError:
                    assert proc.returncode is None and time.monotonic() < deadline, "the router did not start"
                    await asyncio.sleep(0.2)
    finally:
        proc.terminate()
        _, err = await proc.communicate()
        await runner.cleanup()
    return answer, seen, err.decode()


@pytest.mark.parametrize(("cmd", "loop"), [
    ([sys.executable, "-m", "examples.router"], "uvloop"),
    ([sys.executable, "-c", BLOCK_UVLOOP], "asyncio"),
])
def test_the_entry_point_proxies_on_its_loop(cmd: list[str], loop: str) -> None:
    answer, seen, err = asyncio.run(_proxy_once(cmd))
    assert answer["choices"] == [{"index": 0, "text": "ok"}]
    assert [b["prompt"] for b in seen] == [list(range(40))]
    assert f"event loop: {loop}\n" in err, err[-3000:]
