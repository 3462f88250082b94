"""The reference KV-aware router: an OpenAI-compatible HTTP proxy embedding kvindex.

Read path per request (``POST /v1/completions`` and ``POST /v1/chat/completions``):

1. Token ids. With ``tokenizer`` configured (the engines' model folder and
   chat-template flags), the router renders and tokenizes the request itself
   with :class:`kvindex.tokenize.RequestTokenizer` (exactly as the engine will;
   a conversation's next turn, which the multi-turn caches cover but for its
   new tokens, on the event loop, anything else off it); when the library says it cannot reproduce a request
   exactly (e.g. multimodal content), or without ``tokenizer``, the prompt is
   rendered by asking an engine's ``POST /tokenize`` (vLLM 0.32,
   vllm/entrypoints/serve/tokenize/protocol.py): a completion's text prompt is
   sent as ``{"model", "prompt", "add_special_tokens"}`` (the engine prepends
   BOS as it does for ``/v1/completions``), a chat request as ``{"model",
   "messages", "add_generation_prompt", "continue_final_message",
   "add_special_tokens", "chat_template", "chat_template_kwargs", "tools",
   ...}`` (the engine applies the model's chat template); the answer's
   ``tokens`` field holds the ids. A prompt given as token ids (a list of
   ints) is used as is. A batched completion prompt (a list of prompts) is
   scored on its first prompt. When no engine can tokenize, the request is
   routed on load alone.
2. :meth:`kvindex.Indexer.score` over the healthy pods: prefix coverage from
   the index (fed by the engines' KV events over ZMQ) mixed with load (each
   engine's ``/metrics``, fetched every ``load_interval`` seconds with
   :func:`scorer.fetch_load`, plus the router's own in-flight counts via
   ``request_started`` / ``request_finished``). Pods with equal totals take
   turns (the picker alone would always prefer the smaller pod id). With
   ``policy="round_robin"``
   the pods take turns instead (the score is still computed and recorded, as
   a baseline).
3. The request body is forwarded byte for byte to the chosen engine and the
   answer (JSON or server-sent events) is passed back unchanged, with these
   headers added: ``x-kvindex-pod``, ``x-kvindex-predicted-cached-tokens``,
   ``x-kvindex-prompt-tokens`` and ``x-kvindex-decision`` (the id of the
   decision in ``GET /decisions``).

Predicted cached tokens (what the chosen engine will add to its
``vllm:prefix_cache_hits_total`` for the request): the longest consecutive
prefix of full blocks the index holds on that pod, capped so that at least one
prompt token is computed, in whole blocks::

    predicted = min(matched_blocks, (prompt_tokens - 1) // block_size) * block_size

This mirrors vllm/v1/core/kv_cache_manager.py ``get_computed_blocks``
(vLLM 0.32): the cache lookup is limited to ``num_tokens - 1`` tokens
because the last prompt token must be recomputed to get logits, and a hit is
always whole blocks. So a fully cached prompt of 128 tokens (block size 32)
reports 96 hit tokens; one of 130 tokens reports 128.

Other endpoints: ``GET /metrics`` (Prometheus text from the router's own
``CollectorRegistry``: requests, predicted and engine-reported cached tokens
per pod, engine load, and the library's metrics from :mod:`kvindex.facade.metrics`:
index size per tier, events ingested per stream, errors by kind, gaps,
replays, drops, score latency, ...), ``GET /health``
(200 while at least one engine's ``/metrics`` answered at the last refresh,
503 otherwise), ``GET /decisions?limit=N`` (the bounded in-memory log of
routing decisions, newest last) and ``GET /v1/models`` (from one engine).

Pod ids must equal the pod part of each engine's KV-event topic
``kv@<pod>@<model>``: the index keys blocks by the topic's pod. A pod id seen
in events but not configured is logged once.
"""

from __future__ import annotations

import asyncio
import collections
import itertools
import logging
import time
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import aiohttp
import msgspec
from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from examples.router.answers import answer_cached_tokens, relay_stream
from examples.router.bodies import decode_all_but_messages, decode_body
from examples.router.collector import IndexerCollector
from examples.router.config import (
    EngineSpec,
    RouterConfig,
    TokenizerSpec,
    load_router_config,
    parse_engine_arg,
)
from examples.router.engine_tokenizer import adopt_engine_tokenizer, engine_model_root
from examples.router.turn_keys import turn_request_keys
from examples.router.upstream import HOP_BY_HOP, engine_session, post_upstream
from kvindex.facade import Indexer
from kvindex.facade.healing import HealingPolicy, with_full_report
from scorer.load import fetch_load
from scorer.prefix import predicted_cached_tokens, reads_prefix_cache

if TYPE_CHECKING:
    from kvindex.tokenize import RequestTokenizer, TokenizedRequest

__all__ = [
    "Decision",
    "EngineSpec",
    "Router",
    "RouterConfig",
    "TokenizerSpec",
    "load_router_config",
    "parse_engine_arg",
]

log = logging.getLogger("kvindex.router")

CHAT_TOKENIZE_FIELDS = (
    "add_generation_prompt",
    "continue_final_message",
    "add_special_tokens",
    "chat_template",
    "chat_template_kwargs",
    "tools",
    "mm_processor_kwargs",
    "media_io_kwargs",
)
"""Chat request fields that change the rendered prompt and that vLLM 0.32's
``TokenizeChatRequest`` accepts; copied into the ``/tokenize`` request."""

CHAT_TEMPLATE_EXTRAS = ("documents", "reasoning_effort")
"""Chat request fields vLLM 0.32 passes to the chat template as keyword
arguments (``ChatCompletionRequest.build_chat_params``); the router hands them
to ``/tokenize`` inside ``chat_template_kwargs``."""

PREDICTED_BUCKETS = (0, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768, 65536, float("inf"))
"""Histogram buckets of predicted cached tokens per request."""




def _ids_given(path: str, body: Mapping[str, Any]) -> bool:
    """A completion whose (first) prompt is token ids: used as is, nothing to tokenize."""
    prompt = body.get("prompt")
    if path.endswith("/chat/completions") or not isinstance(prompt, list) or not prompt:
        return False
    first = prompt[0] if isinstance(prompt[0], list) else prompt
    return bool(first) and all(type(t) is int for t in first)


# -- decisions -----------------------------------------------------------------


class Decision(msgspec.Struct, kw_only=True):
    """One routing decision, as kept in the log and returned by ``GET /decisions``.

    id: increasing number (also the ``x-kvindex-decision`` header).
    path: the API path (``/v1/completions`` or ``/v1/chat/completions``).
    policy: ``kvindex`` or ``round_robin``.
    pod: the chosen pod.
    token_source: ``local`` (the router's tokenizer), ``tokenize`` (engine's
        /tokenize), ``token_ids`` (prompt given as ids) or ``none`` (no tokens:
        routed on load alone).
    prompt_tokens: tokens scored; request_blocks: their full blocks.
    matched_tokens: prefix the index holds on the chosen pod (tokens).
    predicted_cached_tokens: see :func:`predicted_cached_tokens`.
    reads_cache: False when the engine will not read its prefix cache for this request
        (:func:`reads_prefix_cache`: prompt logprobs asked): routed on load alone, nothing
        predicted cached.
    full_report: the request was sent with ``kv_cache_report_mode: "full"`` (healing).
    matched: pod -> matched prefix tokens, for every candidate.
    totals: pod -> picker total, for every candidate.
    stream: the request asked for server-sent events.
    status: the engine's HTTP status (None until it answered; 502 when it
        could not be reached).
    route_ms: milliseconds spent tokenizing and scoring.
    duration_ms: milliseconds until the answer was passed back (None before).
    """

    id: int
    path: str
    policy: str
    pod: str
    token_source: str
    prompt_tokens: int
    request_blocks: int
    matched_tokens: int
    predicted_cached_tokens: int
    reads_cache: bool = True
    matched: dict[str, int]
    full_report: bool = False
    totals: dict[str, float]
    stream: bool
    status: int | None = None
    route_ms: float = 0.0
    duration_ms: float | None = None


# -- the router ----------------------------------------------------------------


class Router:
    """The proxy: engines, embedded :class:`kvindex.Indexer`, metrics and decision log.

    Use :meth:`app` to get the aiohttp application (its start-up and clean-up
    hooks call :meth:`start` and :meth:`close`), or :class:`examples.router.serve.RunningRouter` to
    serve it in-process. Attributes of interest once started: ``indexer``,
    ``model``, ``registry`` (the router's own Prometheus registry) and
    ``decisions`` (a bounded deque of :class:`Decision`).

    Raises:
        ValueError: a config without engines.
    """

    def __init__(self, config: RouterConfig) -> None:
        if not config.engines:
            raise ValueError("the router needs at least one engine")
        self.config = config
        self.engines: dict[str, EngineSpec] = {e.pod: e for e in config.engines}
        self.model: str | None = config.model
        self.indexer: Indexer | None = None
        self.healing: HealingPolicy | None = None
        self.decisions: collections.deque[Decision] = collections.deque(maxlen=config.decision_log_size)
        self.healthy: dict[str, bool] = dict.fromkeys(self.engines, False)
        self._ids = itertools.count(1)
        self._rr = itertools.cycle(list(self.engines))
        self._ties = itertools.count()
        self._tokenize_rr = itertools.cycle(list(self.engines))
        self.tokenizer: RequestTokenizer | None = config.tokenizer.build() if config.tokenizer else None
        #: where request token ids come from: the configured tokenizer, the engines' folder, or /tokenize and why
        self.tokenizer_source = "configured" if self.tokenizer is not None else "engine /tokenize"
        self._session: aiohttp.ClientSession | None = None
        self._refresh_task: asyncio.Task[None] | None = None
        self._warned_pods: set[str] = set()
        self.registry = CollectorRegistry()
        r = self.registry
        self.m_requests = Counter(
            "kvindex_router_requests", "Requests routed, by pod and API path.", ["pod", "path"], registry=r
        )
        self.m_predicted = Counter(
            "kvindex_router_predicted_cached_tokens",
            "Predicted cached prompt tokens on the chosen pod, summed.",
            ["pod"],
            registry=r,
        )
        self.m_prompt = Counter(
            "kvindex_router_prompt_tokens", "Prompt tokens scored, summed by chosen pod.", ["pod"], registry=r
        )
        self.m_predicted_hist = Histogram(
            "kvindex_router_predicted_cached_tokens_per_request",
            "Predicted cached prompt tokens on the chosen pod per request.",
            buckets=PREDICTED_BUCKETS,
            registry=r,
        )
        self.m_upstream_errors = Counter(
            "kvindex_router_upstream_errors", "Requests the chosen engine could not answer.", ["pod"], registry=r
        )
        self.m_tokenize_errors = Counter(
            "kvindex_router_tokenize_errors", "Prompts no engine could tokenize (routed on load).", registry=r
        )
        self.m_local_tokenize = Counter(
            "kvindex_router_local_tokenize",
            "Requests the router tokenized itself (exact) or handed to an engine's /tokenize (fallback).",
            ["result"],
            registry=r,
        )
        self.m_in_flight = Gauge("kvindex_router_in_flight", "Requests in flight, by pod.", ["pod"], registry=r)
        self._metric_children: dict[tuple[str, str], tuple[Any, Any, Any, Any]] = {}
        self.m_waiting = Gauge("kvindex_router_engine_waiting", "Engine-reported waiting requests.", ["pod"], registry=r)
        self.m_running = Gauge("kvindex_router_engine_running", "Engine-reported running requests.", ["pod"], registry=r)
        self.m_kv_usage = Gauge(
            "kvindex_router_engine_kv_usage", "Engine-reported KV-cache usage (0..1).", ["pod"], registry=r
        )
        self.m_healthy = Gauge(
            "kvindex_router_engine_up", "1 when the engine's /metrics answered at the last refresh.", ["pod"], registry=r
        )
        self.m_full_reports = Counter(
            "kvindex_router_full_reports",
            "Requests sent with kv_cache_report_mode full to heal a pod's incomplete index state, by pod.",
            ["pod"],
            registry=r,
        )
        self.m_scrape_errors = Counter(
            "kvindex_router_engine_scrape_errors", "Failed /metrics refreshes, by pod.", ["pod"], registry=r
        )
        self.m_engine_cached = Counter(
            "kvindex_router_engine_cached_tokens",
            "Engine-reported prefix-cache hit tokens (increase of vllm:prefix_cache_hits_total between "
            "the router's refreshes of the engine's /metrics), by pod; compare with "
            "kvindex_router_predicted_cached_tokens_total.",
            ["pod"],
            registry=r,
        )
        self.m_engine_queried = Counter(
            "kvindex_router_engine_queried_tokens",
            "Engine-reported prompt tokens looked up in the prefix cache (increase of "
            "vllm:prefix_cache_queries_total between refreshes), by pod.",
            ["pod"],
            registry=r,
        )
        self._engine_counters: dict[str, tuple[float, float]] = {}  # pod -> last (hits, queries)
        r.register(IndexerCollector(self))
        for pod in self.engines:
            self.m_in_flight.labels(pod).set(0)
            self.m_healthy.labels(pod).set(0)

    # -- lifecycle

    async def start(self) -> None:
        """Open the HTTP client, learn the model name if needed, start the indexer
        (replaying what the engines still buffer), load the engines' metrics once
        and start the background refresh.

        Raises:
            RuntimeError: the model name was not given and no engine's
                ``/v1/models`` answered.
        """
        if self._session is not None:
            return
        timeout = aiohttp.ClientTimeout(
            total=None, sock_connect=self.config.connect_timeout, sock_read=self.config.upstream_timeout
        )
        self._session = engine_session(timeout, self.config.upstream_keepalive, auto_decompress=False)
        try:
            if self.model is None:
                self.model = await self._discover_model()
            self.indexer = Indexer(self.config.indexer_config(self.model))
            if self.config.healing:
                self.healing = HealingPolicy(
                    self.indexer.pool,
                    quiet_requests=self.config.heal_quiet_requests,
                    max_requests=self.config.heal_max_requests,
                )
            await asyncio.to_thread(self.indexer.start)  # returns once subscribed (bounded)
            await asyncio.to_thread(self.indexer.flush, 10.0)
            await self.refresh_loads()
            if self.tokenizer is None and self.config.auto_tokenizer:
                await self._adopt_engine_tokenizer()
        except BaseException:
            await self.close()
            raise
        self._refresh_task = asyncio.create_task(self._refresh_loop(), name="kvindex-router-load")

    async def close(self) -> None:
        """Stop the background refresh, the indexer and the HTTP client (idempotent)."""
        if self._refresh_task is not None:
            self._refresh_task.cancel()
            try:
                await self._refresh_task
            except asyncio.CancelledError:
                pass
            self._refresh_task = None
        if self.indexer is not None:
            await asyncio.to_thread(self.indexer.stop)
        if self._session is not None:
            await self._session.close()
            self._session = None

    def _count_engine_hits(self, pod: str, hits: float | None, queries: float | None) -> None:
        """Add the increase of the engine's prefix-cache counters since the last refresh.

        The first refresh only sets the baseline (hits before the router
        started are not the router's); a counter that went down means the
        engine restarted, and its new value is the increase.
        """
        if hits is None or queries is None:
            return
        last = self._engine_counters.get(pod)
        self._engine_counters[pod] = (hits, queries)
        if last is None:
            self.m_engine_cached.labels(pod).inc(0)
            self.m_engine_queried.labels(pod).inc(0)
            return
        dh = hits - last[0] if hits >= last[0] else hits
        dq = queries - last[1] if queries >= last[1] else queries
        self.m_engine_cached.labels(pod).inc(dh)
        self.m_engine_queried.labels(pod).inc(dq)

    async def _adopt_engine_tokenizer(self) -> None:
        """Tokenize locally from the engines' model folder if it passes the start-up probes."""
        assert self._session is not None
        spec = self.engines[self.candidates()[0]]
        root = await engine_model_root(self._session, spec.url)
        tokenizer, why = await adopt_engine_tokenizer(root, self.engine_token_ids)
        if tokenizer is None:
            self.tokenizer_source = f"engine /tokenize ({why})"
            log.warning("router: requests are tokenized by the engines' /tokenize: %s", why)
            return
        self.tokenizer, self.tokenizer_source = tokenizer, why
        log.info("router: requests are tokenized locally from the %s", why)

    async def _discover_model(self) -> str:
        assert self._session is not None
        for spec in self.engines.values():
            try:
                async with self._session.get(spec.url + "/v1/models", timeout=aiohttp.ClientTimeout(total=10)) as resp:
                    resp.raise_for_status()
                    data = msgspec.json.decode(await resp.read())
                return str(data["data"][0]["id"])
            except (aiohttp.ClientError, TimeoutError, msgspec.DecodeError, KeyError, IndexError, TypeError) as e:
                log.warning("router: /v1/models of %s failed: %r", spec.pod, e)
        raise RuntimeError("no engine told its model name (pass --model)")

    def app(self) -> web.Application:
        """The aiohttp application serving the router's endpoints."""
        app = web.Application(client_max_size=64 * 1024 * 1024)
        app.router.add_post("/v1/completions", self.handle_completion)
        app.router.add_post("/v1/chat/completions", self.handle_completion)
        app.router.add_get("/v1/models", self.handle_models)
        app.router.add_get("/metrics", self.handle_metrics)
        app.router.add_get("/health", self.handle_health)
        app.router.add_get("/decisions", self.handle_decisions)

        async def on_startup(_: web.Application) -> None:
            await self.start()

        async def on_cleanup(_: web.Application) -> None:
            await self.close()

        app.on_startup.append(on_startup)
        app.on_cleanup.append(on_cleanup)
        return app

    # -- load signals

    async def refresh_loads(self) -> None:
        """Fetch every engine's ``/metrics`` once and feed the indexer's load table."""
        assert self._session is not None and self.indexer is not None
        specs = list(self.engines.values())
        results = await asyncio.gather(
            *(fetch_load(self._session, s.url, timeout=2.0, model_name=self.model) for s in specs),
            return_exceptions=True,
        )
        for spec, res in zip(specs, results):
            if isinstance(res, BaseException):
                if self.healthy.get(spec.pod):
                    log.warning("router: /metrics of %s failed: %r", spec.pod, res)
                self.healthy[spec.pod] = False
                self.m_scrape_errors.labels(spec.pod).inc()
                self.m_healthy.labels(spec.pod).set(0)
                continue
            self.healthy[spec.pod] = True
            self.indexer.update_load(spec.pod, res)
            self.m_healthy.labels(spec.pod).set(1)
            self.m_waiting.labels(spec.pod).set(res.waiting)
            self.m_running.labels(spec.pod).set(res.running)
            self.m_kv_usage.labels(spec.pod).set(res.kv_usage)
            self._count_engine_hits(spec.pod, res.prefix_cache_hits, res.prefix_cache_queries)
        unknown = set(self.indexer.index.pods()) - set(self.engines) - self._warned_pods
        for pod in sorted(unknown):
            log.warning(
                "router: KV events name pod %r, which no engine is configured as; "
                "use POD@URL so pod ids match the engines' topics kv@<pod>@<model>",
                pod,
            )
            self._warned_pods.add(pod)

    async def _refresh_loop(self) -> None:
        while True:
            await asyncio.sleep(self.config.load_interval)
            try:
                await self.refresh_loads()
            except Exception:  # never let the loop die; the next round retries
                log.exception("router: load refresh failed")

    # -- read path

    async def prompt_token_ids(self, path: str, body: Mapping[str, Any],
                               raw: bytes | None = None) -> tuple[list[int] | None, str]:
        """The token ids the engine will see for a request body, and where they came from.

        Returns ``(ids, "token_ids")`` for a completion prompt given as ids (the
        first prompt of a batch), ``(ids, "tokenize")`` when an engine's
        ``/tokenize`` rendered it (chat template applied for chat requests),
        ``(None, "none")`` when there is nothing to tokenize or no engine could;
        ``(ids, "local")`` when the router's tokenizer reproduced the request
        exactly (tried first when configured: a conversation's next turn on the
        event loop, as it costs about its new tokens, anything else off it).
        ``raw``: the JSON text ``body`` was decoded from, if the caller has it.
        """
        ids, source, _ = await self._prompt_ids(path, body, raw)
        return ids, source

    async def _prompt_ids(self, path: str, body: Mapping[str, Any], raw: bytes | None
                          ) -> tuple[list[int] | None, str, TokenizedRequest | None]:
        """:meth:`prompt_token_ids`, plus the local tokenizer's result when its ids are the ones given."""
        if self.tokenizer is not None and not _ids_given(path, body):
            local = self.tokenizer.tokenize_warm(path, body, raw=raw)
            if local is None:
                local = await asyncio.to_thread(self.tokenizer.tokenize, path, dict(body), raw=raw)
            if local.exact and local.token_ids:
                self.m_local_tokenize.labels("exact").inc()
                return local.token_ids, "local", local
            self.m_local_tokenize.labels("fallback").inc()
            log.debug("router: local tokenization not exact (%s): asking /tokenize", local.reason)
        ids, source = await self._engine_or_given_ids(path, body)
        return ids, source, None

    async def engine_token_ids(self, path: str, body: Mapping[str, Any]) -> list[int] | None:
        """The ids an engine's ``/tokenize`` gives for a request body (None when none answered)."""
        ids, source = await self._engine_or_given_ids(path, body)
        return ids if source == "tokenize" else None

    async def _engine_or_given_ids(self, path: str, body: Mapping[str, Any]) -> tuple[list[int] | None, str]:
        """``prompt_token_ids`` without the local tokenizer: ids given, or an engine's ``/tokenize``."""
        if path.endswith("/chat/completions"):
            messages = body.get("messages")
            if not isinstance(messages, list):
                return None, "none"
            req: dict[str, Any] = {"model": self.model, "messages": messages}
            for key in CHAT_TOKENIZE_FIELDS:
                if body.get(key) is not None:
                    req[key] = body[key]
            extras = {k: body[k] for k in CHAT_TEMPLATE_EXTRAS if body.get(k) is not None}
            if extras:
                req["chat_template_kwargs"] = {**extras, **(req.get("chat_template_kwargs") or {})}
        else:
            prompt = body.get("prompt")
            if isinstance(prompt, list) and prompt and isinstance(prompt[0], (list, str)):
                prompt = prompt[0]  # a batch: score its first prompt
            if isinstance(prompt, list) and all(type(t) is int for t in prompt):
                return list(prompt), "token_ids"
            if not isinstance(prompt, str):
                return None, "none"
            req = {"model": self.model, "prompt": prompt}
            if body.get("add_special_tokens") is not None:
                req["add_special_tokens"] = body["add_special_tokens"]
        ids = await self._tokenize(req)
        return (ids, "tokenize") if ids is not None else (None, "none")

    async def _tokenize(self, req: dict[str, Any]) -> list[int] | None:
        """POST ``req`` to ``/tokenize`` of healthy engines in turn until one answers."""
        assert self._session is not None
        order = [next(self._tokenize_rr) for _ in self.engines]
        order.sort(key=lambda p: not self.healthy.get(p, False))  # healthy first, stable
        payload = msgspec.json.encode(req)
        for pod in order:
            try:
                async with self._session.post(
                    self.engines[pod].url + "/tokenize",
                    data=payload,
                    headers={"Content-Type": "application/json"},
                    timeout=aiohttp.ClientTimeout(total=30),
                ) as resp:
                    raw = await resp.read()
                    if resp.status != 200:
                        log.debug("router: /tokenize on %s -> %s %r", pod, resp.status, raw[:200])
                        if 400 <= resp.status < 500:
                            break  # the engine rejects the prompt: another one would too
                        continue
                tokens = msgspec.json.decode(raw)["tokens"]
                if isinstance(tokens, list) and all(type(t) is int for t in tokens):
                    return tokens
            except (aiohttp.ClientError, TimeoutError, msgspec.DecodeError, KeyError, TypeError) as e:
                log.debug("router: /tokenize on %s failed: %r", pod, e)
        self.m_tokenize_errors.inc()
        return None

    def candidates(self) -> list[str]:
        """Pods to route to: those whose ``/metrics`` answered last time (all if none did)."""
        up = [p for p in self.engines if self.healthy.get(p)]
        return up or list(self.engines)

    def choose(
        self,
        path: str,
        tokens: Sequence[int] | None,
        token_source: str,
        *,
        stream: bool = False,
        cache_salt: str | None = None,
        reads_cache: bool = True,
        local: TokenizedRequest | None = None,
    ) -> Decision:
        """Score the candidates, pick a pod, count the request in flight there and log the decision.

        ``reads_cache`` False (see :func:`reads_prefix_cache`): the engine will compute the
        whole prompt wherever it goes, so the pods are scored on load alone.
        ``local``: the tokenizer's result ``tokens`` came from (its cache memos
        carry request keys from turn to turn: examples/router/turn_keys.py).
        The caller must call :meth:`finish` with the decision when the request ends.
        """
        assert self.indexer is not None
        start = time.perf_counter()
        ids = tokens if type(tokens) is list else list(tokens or [])  # not copied: only read here
        candidates = self.candidates()
        salt = cache_salt if isinstance(cache_salt, str) and cache_salt else None
        keys = turn_request_keys(self.indexer, ids, salt, local) if reads_cache and local is not None else None
        result = self.indexer.score(ids if reads_cache else [], candidates, cache_salt=salt, keys=keys)
        assert result.pod is not None
        pod = result.pod
        if self.config.policy == "round_robin":
            pod = next(p for p in self._rr if p in candidates)
        elif result.choice is not None:
            # The picker breaks ties by pod id; the router takes turns among
            # pods with the same total instead, so that idle pods holding
            # nothing of a prompt share such prompts.
            best = result.choice.score
            tied = [p for p, e in result.choice.explanation.items() if abs(e.total - best) <= 1e-9]
            if len(tied) > 1:
                pod = sorted(tied)[next(self._ties) % len(tied)]
        self.indexer.request_started(pod)
        chosen = result.prefix[pod]
        block = result.block_size
        totals = result.choice.explanation if result.choice is not None else {}
        decision = Decision(
            id=next(self._ids),
            path=path,
            policy=self.config.policy,
            pod=pod,
            token_source=token_source,
            prompt_tokens=len(ids),
            request_blocks=len(ids) // result.block_size if not reads_cache else result.request_blocks,
            matched_tokens=chosen.matched_tokens,
            predicted_cached_tokens=predicted_cached_tokens(chosen.matched_blocks, len(ids), block),
            reads_cache=reads_cache,
            matched={p: s.matched_tokens for p, s in result.prefix.items()},
            totals={p: round(e.total, 6) for p, e in totals.items()},
            stream=stream,
            route_ms=(time.perf_counter() - start) * 1000.0,
        )
        self.decisions.append(decision)
        requests, predicted, prompt, in_flight = self._children(pod, path)
        requests.inc()
        predicted.inc(decision.predicted_cached_tokens)
        prompt.inc(len(ids))
        self.m_predicted_hist.observe(decision.predicted_cached_tokens)
        in_flight.inc()
        return decision

    def _children(self, pod: str, path: str) -> tuple[Any, Any, Any, Any]:
        """A routed request's metric children (requests, predicted, prompt, in flight), looked up once."""
        got = self._metric_children.get((pod, path))
        if got is None:
            got = self._metric_children[(pod, path)] = (self.m_requests.labels(pod, path), self.m_predicted.labels(
                pod), self.m_prompt.labels(pod), self.m_in_flight.labels(pod))
        return got

    def finish(self, decision: Decision, status: int, started: float) -> None:
        """Record the end of a routed request (status, duration) and release its in-flight slot."""
        assert self.indexer is not None
        decision.status = status
        decision.duration_ms = (time.perf_counter() - started) * 1000.0
        self.indexer.request_finished(decision.pod)
        if decision.full_report and self.healing is not None:
            self.healing.full_report_done(decision.pod, None, self.model)
        self.m_in_flight.labels(decision.pod).dec()
        if status >= 500:
            self.m_upstream_errors.labels(decision.pod).inc()

    async def wait_indexed(self, tokens: Sequence[int], pod: str, *, timeout: float = 5.0, poll: float = 0.02) -> bool:
        """Wait (bounded) until the index holds every full block of ``tokens`` on ``pod``.

        For tests and demos that must not score the next request before the
        previous one's KV events are applied. Returns False on timeout.  The
        blocks stored, not the hit: a hybrid engine serves less from cache
        than it stores (:func:`kvindex.hybrid.predict_hit`).
        """
        assert self.indexer is not None
        keys = self.indexer.request_keys(list(tokens))
        want = len(keys)
        deadline = time.monotonic() + timeout
        while True:
            got = len(self.indexer.index.prefix_match(keys, [pod]).get(pod, ())) if want else 0
            if got >= want:
                return True
            if time.monotonic() >= deadline:
                return False
            await asyncio.sleep(poll)

    # -- handlers

    async def handle_completion(self, request: web.Request) -> web.StreamResponse:
        """Proxy ``/v1/completions`` and ``/v1/chat/completions`` to the chosen engine."""
        started = time.perf_counter()
        raw = await request.read()
        warm = self._warm_local(request.path, raw)
        tokens: list[int] | None
        if warm is not None:  # a conversation's next turn, its earlier messages never decoded
            body, local = warm
            tokens, source = local.token_ids, "local"
        else:
            body = decode_body(raw)
            tokens, source, local = await self._prompt_ids(request.path, body, raw)
        decision = self.choose(
            request.path, tokens, source, stream=bool(body.get("stream")), cache_salt=body.get("cache_salt"),
            reads_cache=reads_prefix_cache(request.path, body), local=local,
        )
        if (self.healing is not None and (body or warm is not None)
                and self.healing.wants_full_report(decision.pod, None, self.model)):
            body = decode_body(raw) if warm is not None else body
            healed = with_full_report(body)
            if healed is not body and isinstance(healed.get("vllm_xargs"), dict):
                raw = msgspec.json.encode(healed)
                decision.full_report = True
                self.healing.full_report_sent(decision.pod, None, self.model)
                self.m_full_reports.labels(decision.pod).inc()
        status = 502
        try:
            resp = await self._forward(request, raw, decision)
            status = resp.status
            return resp
        finally:
            self.finish(decision, status, started)

    def _warm_turn(self, path: str, raw: bytes) -> tuple[dict[str, Any], list[int]] | None:
        """(the body but its messages, token ids) of a chat request the multi-turn caches cover, else None.

        What :meth:`prompt_token_ids` gives such a request, without decoding the
        messages the caches prove byte for byte (:meth:`RequestTokenizer.tokenize_warm`).
        """
        warm = self._warm_local(path, raw)
        return (warm[0], warm[1].token_ids) if warm is not None else None

    def _warm_local(self, path: str, raw: bytes) -> tuple[dict[str, Any], TokenizedRequest] | None:
        """:meth:`_warm_turn` with the tokenizer's whole result."""
        tok = self.tokenizer
        if tok is None or tok.renders is None or tok.cache is None or not path.endswith("/chat/completions"):
            return None
        split = decode_all_but_messages(raw)
        if split is None:
            return None
        local = tok.tokenize_warm(path, split[0], raw=raw, messages_json=split[1])
        if local is None or not local.exact or not local.token_ids:
            return None
        self.m_local_tokenize.labels("exact").inc()
        return split[0], local

    def _decision_headers(self, decision: Decision) -> dict[str, str]:
        return {
            "x-kvindex-pod": decision.pod,
            "x-kvindex-predicted-cached-tokens": str(decision.predicted_cached_tokens),
            "x-kvindex-prompt-tokens": str(decision.prompt_tokens),
            "x-kvindex-decision": str(decision.id),
        }

    async def _forward(self, request: web.Request, raw: bytes, decision: Decision) -> web.StreamResponse:
        """Send the body unchanged to the chosen engine; pass its answer back unchanged."""
        assert self._session is not None
        url = self.engines[decision.pod].url + request.path_qs
        headers = {k: v for k, v in request.headers.items() if k.lower() not in HOP_BY_HOP}
        extra = self._decision_headers(decision)
        try:
            async with post_upstream(
                self._session, url, attempts=self.config.connect_attempts, data=raw, headers=headers
            ) as up:
                out_headers = {k: v for k, v in up.headers.items() if k.lower() not in HOP_BY_HOP}
                out_headers.update(extra)
                if up.headers.get("Content-Length") is not None:
                    body = await up.read()
                    if up.status == 200:
                        self.report_truth(decision, body)
                    return web.Response(status=up.status, body=body, headers=out_headers)
                resp = web.StreamResponse(status=up.status, headers=out_headers)
                await resp.prepare(request)
                tail = bytearray()
                if not await relay_stream(up, resp, tail):
                    log.debug("router: client of decision %s disconnected", decision.id)
                elif up.status == 200:
                    self.report_truth(decision, bytes(tail), streamed=True)
                return resp
        except (aiohttp.ClientError, TimeoutError) as e:
            log.warning("router: engine %s failed: %r", decision.pod, e)
            err = {"error": {"message": f"engine {decision.pod} failed: {e!r}", "type": "BadGateway", "code": 502}}
            return web.Response(
                status=502, body=msgspec.json.encode(err), content_type="application/json", headers=extra
            )

    def report_truth(self, decision: Decision, answer: bytes, streamed: bool = False) -> None:
        """Hand the engine's cached tokens for a routed request to the indexer (``Indexer.report_cached``).

        Read with :func:`answer_cached_tokens`; answers that do not say are skipped.
        """
        cached = answer_cached_tokens(answer, streamed)
        if self.indexer is not None and cached is not None:
            self.indexer.report_cached(decision.pod, decision.predicted_cached_tokens, cached)

    async def handle_models(self, request: web.Request) -> web.Response:
        """``GET /v1/models`` from the first healthy engine."""
        assert self._session is not None
        pod = self.candidates()[0]
        try:
            async with self._session.get(self.engines[pod].url + "/v1/models") as up:
                return web.Response(status=up.status, body=await up.read(), content_type="application/json")
        except (aiohttp.ClientError, TimeoutError) as e:
            return web.Response(status=502, text=f"engine {pod} failed: {e!r}")

    async def handle_metrics(self, request: web.Request) -> web.Response:
        """``GET /metrics``: the router's registry in the Prometheus text format."""
        return web.Response(body=generate_latest(self.registry), headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def handle_health(self, request: web.Request) -> web.Response:
        """``GET /health``: 200 when at least one engine is up, else 503; JSON per pod."""
        up = any(self.healthy.values())
        body = {"status": "ok" if up else "no engine up", "model": self.model, "engines": self.healthy,
                "tokenizer": self.tokenizer_source}
        return web.Response(
            status=200 if up else 503, body=msgspec.json.encode(body), content_type="application/json"
        )

    async def handle_decisions(self, request: web.Request) -> web.Response:
        """``GET /decisions?limit=N``: the last N routing decisions (default 100), oldest first."""
        try:
            limit = int(request.query.get("limit", "100"))
        except ValueError:
            return web.Response(status=400, text="limit must be an integer")
        items = list(self.decisions)[-max(0, limit) :] if limit > 0 else []
        return web.Response(body=msgspec.json.encode(items), content_type="application/json")
