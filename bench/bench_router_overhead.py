"""The reference router's own overhead per request, beside llm-d's published EPP figure.

The reference router (examples/router: ``Router`` and its aiohttp app,
scoring two pods) runs in front of a fake engine that answers at once
(aiohttp); client, routers and engine are three processes. The client sends
each chat request to a router and, paired with it, straight to the fake
engine; the router's added latency is the difference of the two round trips
(receive -> tokens -> score -> forward -> relay the answer, the engine
excluded).

Prompts of about 1k, 8k, 32k and 100k tokens (a ChatML conversation of
~250-token turns, the tokenizer of bench/bench_tokenize.py). Per size:

- ``single``: a cold request (a conversation the router has not seen);
- ``multi``: the conversation's next turn (two new messages) right after the
  previous one, the multi-turn cache warm;

each with the router's own tokenizer (``library``), the same with the
render cache off (``whole-render``: every turn renders the whole
conversation, as before that cache), and with no tokenizer configured
(``/tokenize``: the router asks the engine's POST /tokenize). The
fake engine's /tokenize makes the tokenizer-library calls vLLM makes for it
(transformers' ``apply_chat_template(..., tokenize=False)`` then the fast
tokenizer's encode of the text); its CPU time counts as router overhead, as a
real engine's would. p50 and p99 in milliseconds, with the date, machine,
load average, CPU affinity and the routers' event loop; writes
bench/out/router_overhead.json.

The routers' process runs as the entry point ``python -m examples.router``
does: the collector tuned (``tune_gc``) and the event loop of ``loop_factory``
(uvloop's when installed); ``--router-loop asyncio`` keeps asyncio's for a
comparison.

Reference row: llm-d's EPP, as published (p50 2-3 ms, p95 4.8-6.8 ms at
100k-token prompts, 10 QPS; not measured here).
Run: ``.venv/bin/python bench/bench_router_overhead.py [--reps 200] [--cold-reps 20]``
(``taskset -c 1`` in front pins it to one core).
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import http.client
import json
import os
import platform
import random
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from aiohttp import web  # noqa: E402

from bench.bench_tokenize import WORDS, conversation, tokenizer_dir  # noqa: E402

OUT = ROOT / "bench" / "out" / "router_overhead.json"
TARGETS = (1_000, 8_000, 32_000, 100_000)
TURNS = 10
"""Warm turns per run (each adds ~40 tokens to the prompt)."""
MODEL = "tiny-llama"
LLMD_EPP = {"source": "llm-d EPP, published", "tokens": 100_000, "qps": 10,
            "p50_ms": "2-3", "p95_ms": "4.8-6.8"}
METRICS = "vllm:num_requests_waiting 0\nvllm:num_requests_running 0\n"
ANSWER = {"id": "x", "object": "chat.completion", "model": MODEL,
          "choices": [{"index": 0, "message": {"role": "assistant", "content": "ok"}, "finish_reason": "stop"}],
          "usage": {"prompt_tokens": 0, "completion_tokens": 1, "total_tokens": 1}}


def fake_engine_app(model_dir: Path) -> web.Application:
    """An engine that answers every completion at once and tokenizes as vLLM's /tokenize does."""
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(str(model_dir))

    async def tokenize(request: web.Request) -> web.Response:
        body = await request.json()
        if "messages" in body:
            text = hf.apply_chat_template(body["messages"], tokenize=False,
                                          add_generation_prompt=body.get("add_generation_prompt", True))
            ids = hf(text, add_special_tokens=body.get("add_special_tokens", False))["input_ids"]
        else:
            ids = hf(body["prompt"], add_special_tokens=body.get("add_special_tokens", True))["input_ids"]
        return web.json_response({"tokens": ids, "count": len(ids), "max_model_len": 1 << 20})

    async def complete(request: web.Request) -> web.Response:
        await request.read()
        return web.json_response(ANSWER)

    async def metrics(_: web.Request) -> web.Response:
        return web.Response(text=METRICS)

    async def models(_: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": MODEL, "object": "model"}]})

    app = web.Application(client_max_size=64 * 1024 * 1024)
    app.router.add_post("/tokenize", tokenize)
    app.router.add_post("/v1/chat/completions", complete)
    app.router.add_post("/v1/completions", complete)
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/v1/models", models)
    return app


async def _serve(app: web.Application) -> tuple[web.AppRunner, int]:
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    return runner, int(runner.addresses[0][1])


class Client:
    """A keep-alive HTTP client; :meth:`post` returns the round trip in seconds."""

    def __init__(self, port: int) -> None:
        self._conn = http.client.HTTPConnection("127.0.0.1", port, timeout=600)

    def post(self, path: str, data: bytes) -> float:
        t0 = time.perf_counter()
        self._conn.request("POST", path, body=data, headers={"Content-Type": "application/json"})
        resp = self._conn.getresponse()
        resp.read()
        dt = time.perf_counter() - t0
        if resp.status != 200:
            raise RuntimeError(f"{path} answered {resp.status}")
        return dt

    def close(self) -> None:
        self._conn.close()


MODES = ("library", "whole-render", "/tokenize")
"""The routers measured: the library tokenizer, the same without the render cache, the /tokenize fallback."""


async def _serve_routers(engine_port: int, tok_dir: Path) -> dict[str, Any]:
    from examples.router.app import EngineSpec, RouterConfig, TokenizerSpec
    from examples.router.serve import RunningRouter

    url = f"http://127.0.0.1:{engine_port}"
    engines = [EngineSpec(pod=p, url=url, endpoint=f"tcp://127.0.0.1:{1 + i}") for i, p in enumerate(("pod-a", "pod-b"))]
    routers = {}
    for mode in MODES:
        spec = TokenizerSpec(model_dir=str(tok_dir)) if mode != "/tokenize" else None
        rr = RunningRouter(RouterConfig(engines=engines, model=MODEL, port=0, load_interval=3600.0, tokenizer=spec))
        await rr.__aenter__()
        if mode == "whole-render":
            rr.router.tokenizer.renders = None  # every turn renders the whole conversation (before the render cache)
        routers[mode] = rr
    return routers


def router_loop(choice: str) -> Callable[[], asyncio.AbstractEventLoop]:
    """The routers' event-loop factory: ``entry`` the entry point's (:func:`examples.router.serve.loop_factory`)."""
    from examples.router.serve import loop_factory

    return loop_factory() if choice == "entry" else asyncio.new_event_loop


def serve(role: str, tok_dir: Path, engine_port: int, loop: str = "entry") -> None:
    """Serve the fake engine or the routers until stdin closes; print their ports as one JSON line."""
    async def main() -> None:
        if role == "engine":
            runner, port = await _serve(fake_engine_app(tok_dir))
            ports, closers = {"direct": port}, [runner.cleanup]
        else:
            routers = await _serve_routers(engine_port, tok_dir)
            ports = {m: int(rr.url.rsplit(":", 1)[1]) for m, rr in routers.items()}
            ports["loop"] = type(asyncio.get_running_loop()).__module__
            closers = [lambda rr=rr: rr.__aexit__(None, None, None) for rr in routers.values()]
            from examples.router.serve import tune_gc

            tune_gc()  # as the router's entry point does (python -m examples.router)
        print(json.dumps(ports), flush=True)
        await asyncio.get_running_loop().run_in_executor(None, sys.stdin.read)
        for close in closers:
            await close()
        gc.unfreeze()

    if role == "engine":
        asyncio.run(main())
    else:  # as the router's entry point (python -m examples.router) runs it
        with asyncio.Runner(loop_factory=router_loop(loop)) as runner:
            runner.run(main())


class Rig:
    """A fake engine and the routers of :data:`MODES` in front of it, each in its own process."""

    def __init__(self, tok_dir: Path, loop: str = "entry") -> None:
        from kvindex.tokenize import RequestTokenizer

        self.tokenizer = RequestTokenizer(tok_dir)
        self._procs: list[subprocess.Popen[str]] = []
        self.ports = self._start("engine", tok_dir, 0, loop)
        routers = self._start("routers", tok_dir, self.ports["direct"], loop)
        self.loop = str(routers.pop("loop"))  # the routers' event loop's module: uvloop or asyncio.unix_events
        self.ports.update(routers)
        self.clients = {m: Client(p) for m, p in self.ports.items()}

    def _start(self, role: str, tok_dir: Path, engine_port: int, loop: str) -> dict[str, Any]:
        proc = subprocess.Popen([sys.executable, __file__, "--serve", role, "--tok-dir", str(tok_dir),
                                 "--engine-port", str(engine_port), "--router-loop", loop],
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        self._procs.append(proc)
        assert proc.stdout is not None
        line = proc.stdout.readline()
        if not line:
            self.close()
            raise RuntimeError(f"the {role} process did not start")
        return {k: v if k == "loop" else int(v) for k, v in json.loads(line).items()}

    def overhead(self, mode: str, body: dict[str, Any], path: str = "/v1/chat/completions") -> tuple[float, float]:
        """(router round trip, direct round trip) for one body, seconds."""
        data = json.dumps({"model": MODEL, **body}).encode()
        routed = self.clients[mode].post(path, data)
        direct = self.clients["direct"].post(path, data)
        return routed, direct

    def decisions(self, mode: str) -> list[dict[str, Any]]:
        """The router's ``GET /decisions``."""
        conn = http.client.HTTPConnection("127.0.0.1", self.ports[mode], timeout=30)
        try:
            conn.request("GET", "/decisions?limit=1000")
            return list(json.loads(conn.getresponse().read()))
        finally:
            conn.close()

    def close(self) -> None:
        for c in getattr(self, "clients", {}).values():
            c.close()
        for proc in reversed(self._procs):
            if proc.stdin is not None:
                proc.stdin.close()
            try:
                proc.wait(20)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def summary(pairs: list[tuple[float, float]]) -> dict[str, float]:
    """p50/p99 of the added latency (routed - direct, paired), milliseconds."""
    added = [1000 * (r - d) for r, d in pairs]
    return {"n": len(added), "p50_ms": statistics.median(added), "p99_ms": pct(added, 0.99),
            "direct_p50_ms": 1000 * statistics.median(d for _, d in pairs)}


def measure(rig: Rig, msgs: list[dict[str, str]], mode: str, reps: int, cold_reps: int,
            seed: int) -> dict[str, dict[str, float]]:
    """Cold and warm added latency of ``mode`` for conversation ``msgs``.

    Warm: runs of :data:`TURNS` turns, each run on a new variant of the
    conversation sent once unmeasured, so the prompt stays near its size.
    """
    rng = random.Random(seed)

    def variant(tag: str) -> list[dict[str, str]]:  # a new first message: a conversation the router has not seen
        return [{**msgs[0], "content": f"{mode} {seed} {tag} " + msgs[0]["content"]}, *msgs[1:]]

    cold = [rig.overhead(mode, {"messages": variant(str(i))}) for i in range(cold_reps)]
    warm = []
    for run in range(max(1, reps // TURNS)):
        conv = variant(f"warm {run}")
        rig.overhead(mode, {"messages": conv})
        for i in range(TURNS):
            conv = conv + [{"role": "assistant", "content": f"answer {i}"},
                           {"role": "user", "content": " ".join(rng.choice(WORDS) for _ in range(20))}]
            warm.append(rig.overhead(mode, {"messages": conv}))
    return {"single": summary(cold), "multi": summary(warm)}


def proxy_floor(rig: Rig, reps: int) -> dict[str, float]:
    """The added latency of a completion given as 16 token ids: proxying and scoring, nothing to tokenize."""
    return summary([rig.overhead("library", {"prompt": list(range(16)), "max_tokens": 1}, "/v1/completions")
                    for _ in range(reps)])


def run_sizes(rig: Rig, targets: tuple[int, ...], reps: int, cold_reps: int,
              modes: tuple[str, ...] = MODES,
              on_row: Callable[[dict[str, Any]], None] | None = None) -> list[dict[str, Any]]:
    """One row per (size, mode): prompt tokens and the single / multi summaries."""
    tok = rig.tokenizer
    rows = []
    for target in targets:
        msgs = conversation(random.Random(target), tok, target)
        n = len(tok.chat({"messages": msgs}).token_ids)
        for mode in modes:
            row = {"target": target, "tokens": n, "mode": mode,
                   **measure(rig, msgs, mode, reps if mode != "/tokenize" else max(TURNS, cold_reps),
                             cold_reps, target)}
            rows.append(row)
            if on_row:
                on_row(row)
    return rows


def fmt_row(r: dict[str, Any]) -> str:
    s, m = r["single"], r["multi"]
    return (f"{r['tokens']:>8} {r['mode']:>10} {s['p50_ms']:>11.2f} {s['p99_ms']:>9.2f} {s['n']:>4} "
            f"{m['p50_ms']:>10.2f} {m['p99_ms']:>9.2f} {m['n']:>4} {m['direct_p50_ms']:>10.2f}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--reps", type=int, default=200, help="warm turns per size with the library tokenizer")
    p.add_argument("--cold-reps", type=int, default=20, help="cold requests per size and mode")
    p.add_argument("--sizes", type=int, nargs="*", default=list(TARGETS))
    p.add_argument("--model-dir", type=Path, default=Path.home() / ".cache" / "kvindex" / "models" / MODEL)
    p.add_argument("--serve", choices=("engine", "routers"), help=argparse.SUPPRESS)
    p.add_argument("--tok-dir", type=Path, help=argparse.SUPPRESS)
    p.add_argument("--engine-port", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--router-loop", choices=("entry", "asyncio"), default="entry",
                   help="the routers' event loop: the entry point's (uvloop when installed; default) or asyncio's")
    args = p.parse_args()
    if args.serve:
        return serve(args.serve, args.tok_dir, args.engine_port, args.router_loop)
    with tempfile.TemporaryDirectory() as tmp:
        if (args.model_dir / "tokenizer.json").is_file():
            rig = Rig(tokenizer_dir(args.model_dir, Path(tmp)), args.router_loop)
        else:  # no generated test model here: the tokenization tests' tokenizer (ChatML, special tokens)
            from tests.tokenize_model import make_tokenizer_dir

            print(f"{args.model_dir} holds no tokenizer: using tests/tokenize_model.py's")
            rig = Rig(make_tokenizer_dir(Path(tmp) / "tok"), args.router_loop)
        try:
            load = os.getloadavg()
            cpus = sorted(os.sched_getaffinity(0))
            print(f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}  {platform.platform()}  "
                  f"{platform.processor() or platform.machine()}  cpus {cpus}  load {load[0]:.2f}  "
                  f"router loop {rig.loop}")
            print("added latency per request (router round trip - direct round trip), ms")
            print(f"{'tokens':>8} {'tokens via':>10} {'single p50':>11} {'p99':>9} {'n':>4} "
                  f"{'multi p50':>10} {'p99':>9} {'n':>4} {'direct p50':>10}")
            floor = proxy_floor(rig, args.reps)
            print(f"{16:>8} {'token ids':>10} {floor['p50_ms']:>11.2f} {floor['p99_ms']:>9.2f} {floor['n']:>4}"
                  f"{'':>26} {floor['direct_p50_ms']:>10.2f}   (the proxying floor)", flush=True)
            rows = run_sizes(rig, tuple(args.sizes), args.reps, args.cold_reps,
                             on_row=lambda r: print(fmt_row(r), flush=True))
        finally:
            rig.close()
    print(f"{'~100000':>8} {'llm-d EPP':>10} {'(published) p50 2-3, p95 4.8-6.8 at 10 QPS':>44}")
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(json.dumps({
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "machine": platform.platform(),
        "cpus": cpus, "router_loop": rig.loop, "load_before": load, "load_after": os.getloadavg(),
        "proxy_floor": floor, "rows": rows,
        "reference": LLMD_EPP}, indent=2))
    print(f"wrote {OUT}")


if __name__ == "__main__":
    main()
