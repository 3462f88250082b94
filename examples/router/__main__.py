"""Command line of the reference router.

``python -m examples.router --engine [POD@]URL=ZMQ[,REPLAY] ... [--model NAME]
[--block-size 32] [--host H] [--port P] [--policy kvindex|round_robin]
[--load-interval S] [--config FILE]``

Each ``--engine`` names one vLLM engine: its HTTP base URL, its KV-event
publisher endpoint and, after a comma, its replay endpoint. The pod id is
``POD`` when given, else the URL's ``host:port``; it must be the pod part of
the engine's ``--kv-events-config`` topic ``kv@<pod>@<model>``. Example::

    python -m examples.router --port 8080 \\
        --engine pod-0@http://10.0.0.5:8000=tcp://10.0.0.5:5557,tcp://10.0.0.5:5558 \\
        --engine pod-1@http://10.0.0.6:8000=tcp://10.0.0.6:5557,tcp://10.0.0.6:5558

P/D mode (:mod:`examples.router.pd`): ``--prefill`` and ``--decode`` name
the prefill and decode engines (NixlConnector with bidirectional KV transfer)
in the same format; a request's conversation is its ``x-conversation-id``
header (or a ``conversation_id`` body field)::

    python -m examples.router --port 8080 \\
        --prefill prefill-0@http://127.0.0.1:8100=tcp://127.0.0.1:5557 \\
        --decode decode-0@http://127.0.0.1:8200=tcp://127.0.0.1:5567

``--config FILE`` reads a :class:`examples.router.app.RouterConfig` (YAML, or
JSON for ``.json``); engines given on the command line are added to the
file's, and the other options given on the command line override it.
"""

from __future__ import annotations

import argparse
import gc
import logging
import sys

import msgspec
from aiohttp import web

from examples.router.app import RouterConfig, load_router_config, parse_engine_arg
from examples.router.serve import loop_factory, make_router, tune_gc


def build_config(argv: list[str] | None = None) -> RouterConfig:
    """Parse the command line into a :class:`RouterConfig` (exits with usage on errors)."""
    p = argparse.ArgumentParser(
        prog="python -m examples.router",
        description="An OpenAI-compatible proxy that routes each request to the vLLM engine "
        "holding most of its prompt's KV cache (kvindex), mixed with load.",
        epilog="Example: python -m examples.router --port 8080 "
        "--engine pod-0@http://10.0.0.5:8000=tcp://10.0.0.5:5557,tcp://10.0.0.5:5558 "
        "--engine pod-1@http://10.0.0.6:8000=tcp://10.0.0.6:5557,tcp://10.0.0.6:5558",
    )
    p.add_argument(
        "--engine", action="append", default=[], metavar="[POD@]URL=ZMQ[,REPLAY]",
        help="one engine (repeat for each): HTTP base URL, KV-event endpoint and, after a comma, replay "
        "endpoint; POD (default: the URL's host:port) must be the pod of the engine's topic kv@<pod>@<model>",
    )
    p.add_argument(
        "--prefill", action="append", default=[], metavar="[POD@]URL=ZMQ[,REPLAY]",
        help="P/D mode: a prefill engine (repeat for each; same format as --engine)",
    )
    p.add_argument(
        "--decode", action="append", default=[], metavar="[POD@]URL=ZMQ[,REPLAY]",
        help="P/D mode: a decode engine (repeat for each; same format as --engine)",
    )
    p.add_argument("--recompute-threshold", type=int, help="P/D: the engines' kv_recompute_threshold (default 64)")
    p.add_argument("--retained-ttl", type=float, help="P/D: seconds D's retained KV is offered (default 450)")
    p.add_argument("--no-guard", action="store_true", help="P/D: send D's params unclipped (comparisons only)")
    p.add_argument(
        "--decode-alone", type=int, metavar="TOKENS",
        help="P/D: a turn leaving D at most TOKENS to prefill, D not busy, skips P (see docs/user-guide.md)",
    )
    p.add_argument("--pd-stream", choices=("buffer", "passthrough"), help="P/D: streaming clients (default buffer)")
    p.add_argument(
        "--no-healing", action="store_true",
        help="never add kv_cache_report_mode full to requests for pods whose index state is incomplete",
    )
    p.add_argument("--model", help="served model name (default: ask the first engine's /v1/models)")
    p.add_argument("--block-size", type=int, help="tokens per block, = the engines' --block-size (default 32)")
    p.add_argument("--host", help="listen address (default 127.0.0.1)")
    p.add_argument("--port", type=int, help="listen port (default 8080)")
    p.add_argument("--policy", choices=("kvindex", "round_robin"), help="default kvindex")
    p.add_argument("--load-interval", type=float, help="seconds between /metrics refreshes (default 1)")
    p.add_argument(
        "--tokenizer-dir", metavar="MODEL_DIR",
        help="tokenize requests in the router from the engines' model folder (needs kvindex[tokenize]); "
        "requests it cannot reproduce exactly go to an engine's /tokenize",
    )
    p.add_argument("--chat-template", help="with --tokenizer-dir: the engines' --chat-template (file or text)")
    p.add_argument(
        "--no-auto-tokenizer", action="store_true",
        help="without --tokenizer-dir, always ask an engine's /tokenize (default: tokenize locally from the "
        "engines' model folder when it reproduces the engine's ids on start-up probes)",
    )
    p.add_argument("--config", help="router configuration file (YAML or .json)")
    p.add_argument(
        "--redis-url", metavar="redis://HOST:PORT/DB",
        help="share the index (and, in P/D mode, D's retained KV) with other router replicas in this Redis",
    )
    args = p.parse_args(argv)
    try:
        base = load_router_config(args.config) if args.config else RouterConfig()
        prefill = [parse_engine_arg(e) for e in args.prefill]
        decode = [parse_engine_arg(e) for e in args.decode]
        engines = list(base.engines) + [parse_engine_arg(e) for e in args.engine] + prefill + decode
        overrides = {
            "model": args.model,
            "block_size": args.block_size,
            "host": args.host,
            "port": args.port,
            "policy": args.policy,
            "load_interval": args.load_interval,
        }
        data = msgspec.to_builtins(base)
        data.update({k: v for k, v in overrides.items() if v is not None})
        data["engines"] = [msgspec.to_builtins(e) for e in engines]
        if args.tokenizer_dir:
            data["tokenizer"] = {**(data.get("tokenizer") or {}), "model_dir": args.tokenizer_dir}
        if args.no_auto_tokenizer:
            data["auto_tokenizer"] = False
        if args.chat_template:
            if not data.get("tokenizer"):
                raise ValueError("--chat-template needs --tokenizer-dir (or tokenizer in the config)")
            data["tokenizer"]["chat_template"] = args.chat_template
        data["prefill"] = list(base.prefill) + [e.pod for e in prefill]
        data["decode"] = list(base.decode) + [e.pod for e in decode]
        for key, value in (
            ("recompute_threshold", args.recompute_threshold),
            ("retained_ttl", args.retained_ttl),
            ("pd_stream", args.pd_stream),
        ):
            if value is not None:
                data[key] = value
        if args.no_guard:
            data["guard"] = False
        if args.decode_alone is not None:
            data["decode_alone"] = {**(data.get("decode_alone") or {}), "max_tokens": args.decode_alone}
        if args.no_healing:
            data["healing"] = False
        if args.redis_url:
            ix = data.setdefault("indexer", {})
            kbi = ix.setdefault("kv_block_index_config", {})
            kbi["backend"] = "redis"
            kbi.setdefault("redis_config", {})["url"] = args.redis_url
        config = msgspec.convert(data, RouterConfig)
    except (OSError, ValueError, msgspec.ValidationError) as e:
        p.error(str(e))
    if not config.engines:
        p.error("at least one --engine (or engines in --config) is needed")
    return config


def main(argv: list[str] | None = None) -> int:
    """Run the router until interrupted."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    config = build_config(argv)
    try:
        router = make_router(config)
    except (RuntimeError, ValueError) as e:
        print(f"python -m examples.router: error: {e}", file=sys.stderr)
        return 2
    for spec in config.engines:
        print(f"engine {spec.pod}: {spec.url} events {spec.endpoint} replay {spec.replay_endpoint}", file=sys.stderr)
    app = router.app()

    async def after_start(_: web.Application) -> None:  # after the router's own start-up hook
        tune_gc()

    async def at_cleanup(_: web.Application) -> None:
        gc.unfreeze()

    app.on_startup.append(after_start)
    app.on_cleanup.append(at_cleanup)
    loop = loop_factory()()  # uvloop's when installed (the router extra)
    print(f"event loop: {type(loop).__module__.split('.')[0]}", file=sys.stderr)
    try:
        web.run_app(app, host=config.host, port=config.port, loop=loop, print=lambda s: print(s, file=sys.stderr))
    except (RuntimeError, OSError) as e:  # e.g. no engine answered /v1/models, or the port is taken
        print(f"python -m examples.router: error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
