"""P/D mode of the reference router: prefill and decode engines with bidirectional KV reuse.

Built on :class:`connector.planner.PDPlanner` (all decisions) and the router's
plumbing (:class:`examples.router.app.Router`: tokenization, the embedded
indexer fed by both kinds of engines' KV events, load refresh, metrics).

One turn (``POST /v1/completions`` or ``/v1/chat/completions``):

1. **conversation_id**: the ``x-conversation-id`` request header, else a
   top-level ``conversation_id`` body field (removed before forwarding: vLLM
   0.32 accepts unknown fields but logs a warning for each request).  Without
   one, the turn runs P/D without retention.
2. The prompt's token ids (the engines' ``/tokenize``, chat template applied)
   and :meth:`PDPlanner.plan`: which P, which D, pull D's retained KV or
   recompute, and P's ``kv_transfer_params`` (request keys salted with the
   body's ``cache_salt``, as the engines' block hashes are).  A request one P
   prefill cannot serve (:func:`decode_only_reason`: a batch of prompts,
   ``n`` > 1, prompt logprobs) goes to D alone, as the client sent it
   (:meth:`PDPlanner.decode_only`).  With ``decode_alone`` configured
   (:class:`connector.decode_alone.DecodeAloneRule`), a turn that leaves D
   little to prefill, D not busy, also skips P: D gets the plan's
   ``decode_params`` (no remote field; D keeps the turn's KV) and its answer
   refreshes the conversation's entry as in step 4
   (``kvindex_router_pd_decode_alone_total``).
3. **P leg**: the body with ``max_tokens`` 1 (``max_completion_tokens`` 1 for
   chat), ``stream`` false, the planned params, and without the fields that only
   shape P's discarded answer (logprobs, prompt logprobs, echo: see
   :data:`PREFILL_DROPPED_FIELDS`).  If P fails on a pull
   (HTTP 5xx: D's entry expired on D's clock and P declined it under the
   default ``kv_load_failure_policy`` "fail", or the D holding the blocks is
   unreachable: P answers 500 after ~5 s), P is asked once more without
   remote params; the fallback is counted
   (``kvindex_router_pd_fallbacks_total{cause}``).  When P does not answer
   at all (connection refused or timed out: e.g. restarting), D serves the
   turn alone (cause ``prefill_unreachable``).
4. **D leg**: the body with P's answer params, ``stream`` false and
   ``return_token_ids`` true (the router needs the generated ids to know which
   tokens D retains).  D's answer carries the next turn's params
   (bidirectional only, and only in non-streaming answers in vLLM 0.32);
   :meth:`PDPlanner.decode_answered` refreshes the conversation's entry.
   If D fails (HTTP 5xx) with P's params, e.g. because P went away before D
   read its blocks, D is asked once more without them (cause
   ``decode_http_<status>``).
5. The client gets D's answer without ``kv_transfer_params`` and without the
   token-id fields it did not ask for.

Streaming clients (``"stream": true``): with ``pd_stream="buffer"`` (the
default) D is called non-streaming and its whole answer is re-emitted as
server-sent events (one content chunk, a usage chunk when asked, ``[DONE]``):
the next turn can reuse D's KV, at the price of time-to-first-token equal to
the whole answer's time.  With ``pd_stream="passthrough"`` D streams to the
client as it generates and the conversation's retained entry is dropped (vLLM
0.32 streams no kv_transfer_params; vLLM PR #40186).

Response headers: ``x-kvindex-prefill-pod``, ``x-kvindex-decode-pod``,
``x-kvindex-pd-action`` (pull / recompute / decode_only), ``x-kvindex-pulled-tokens``
(predicted), ``x-kvindex-decision``.  ``GET /pd/decisions`` lists the turns.
"""

from __future__ import annotations

import itertools
import logging
import time
from typing import TYPE_CHECKING, Any

import aiohttp
import msgspec
from aiohttp import web
from prometheus_client import Counter

from connector.params import RejectCounter, params_from_json_body
from connector.planner import PDPlanner, TurnPlan
from connector.retained import RetainedStore
from examples.router.answers import relay_stream
from examples.router.app import Router, RouterConfig
from examples.router.upstream import HOP_BY_HOP
from examples.router.upstream import post_upstream
from kvindex.facade import Indexer
from scorer.prefix import reads_prefix_cache

if TYPE_CHECKING:
    from connector.redis_retained import RedisRetainedStore

__all__ = [
    "PDRouter",
    "PDTurn",
    "PREFILL_DROPPED_FIELDS",
    "answer_as_events",
    "conversation_id_of",
    "decode_only_reason",
    "prefill_body",
]

log = logging.getLogger("kvindex.router.pd")

CONVERSATION_HEADER = "x-conversation-id"
CONVERSATION_FIELD = "conversation_id"


def conversation_id_of(headers: Any, body: dict[str, Any]) -> str | None:
    """The request's conversation_id: the ``x-conversation-id`` header, else the body's ``conversation_id``.

    Removes the body field (whatever its value).  Empty or non-string values
    mean none.
    """
    field = body.pop(CONVERSATION_FIELD, None)
    cid = headers.get(CONVERSATION_HEADER) if headers is not None else None
    if isinstance(cid, str) and cid:
        return cid
    return field if isinstance(field, str) and field else None


class PDTurn(msgspec.Struct, kw_only=True):
    """One P/D turn as logged in ``GET /pd/decisions``.

    plan: the planner's decisions (pods, action, reasons, predicted tokens).
    prefill_status / decode_status: HTTP statuses (None: not reached).
    prefill_cached_tokens: ``remote_prefill_cached_tokens`` of P's answer
        (engine-confirmed: P's local hits plus what it pulled).
    retained_tokens: D's ``remote_num_tokens`` for the next turn (0: none).
    prefill_ms, decode_ms, total_ms: leg durations; ttft_ms = the time until
        P answered (the first token is P's).
    fallback_error: the start of P's error answer (at most 500 bytes) when
        a pull failed and was recomputed ("" otherwise).
    """

    id: int
    conversation_id: str | None
    plan: TurnPlan
    prefill_status: int | None = None
    decode_status: int | None = None
    prefill_cached_tokens: int | None = None
    retained_tokens: int = 0
    prefill_ms: float = 0.0
    decode_ms: float = 0.0
    total_ms: float = 0.0
    ttft_ms: float = 0.0
    fallback_error: str = ""


def make_retained_store(indexer: Indexer, ttl: float) -> RetainedStore | RedisRetainedStore:
    """D's retained KV per conversation, kept where the router's index is.

    With the index in Redis (``kv_block_index_config.backend: redis``) router
    replicas share it, so they share the retained entries too
    (:class:`connector.redis_retained.RedisRetainedStore` on the same server,
    keys under the index's prefix + ``retained:``): turn 2 may land on another
    replica and still pull D's KV, and an entry is taken once.  Otherwise the
    in-memory :class:`connector.retained.RetainedStore`.  ``ttl`` in seconds.
    """
    ix_cfg = indexer.config.kv_block_index_config
    if ix_cfg.backend == "redis":
        from connector.redis_retained import RedisRetainedStore

        return RedisRetainedStore(indexer.index, ttl=ttl, url=ix_cfg.redis_config.url,
                                  key_prefix=ix_cfg.redis_config.key_prefix + "retained:")
    return RetainedStore(indexer.index, ttl=ttl)


class PDRouter(Router):
    """The router in P/D mode (see the module docstring).

    ``config.prefill`` / ``config.decode`` name the pods of each role (every
    one must be among ``config.engines``).

    Raises:
        ValueError: no prefill or no decode pod, or a role naming an unknown pod.
    """

    def __init__(self, config: RouterConfig) -> None:
        super().__init__(config)
        if not config.prefill or not config.decode:
            raise ValueError("P/D mode needs at least one --prefill and one --decode engine")
        unknown = [p for p in [*config.prefill, *config.decode] if p not in self.engines]
        if unknown:
            raise ValueError(f"P/D roles name unknown pods: {unknown}")
        self.planner: PDPlanner | None = None
        self.rejects = RejectCounter()
        self.turns: list[PDTurn] = []
        self._turn_ids = itertools.count(1)
        r = self.registry
        self.m_pd_turns = Counter("kvindex_router_pd_turns", "P/D turns, by action.", ["action"], registry=r)
        self.m_pd_fallbacks = Counter(
            "kvindex_router_pd_fallbacks", "Pulls that failed and were recomputed, by cause.", ["cause"], registry=r
        )
        self.m_pd_pulled = Counter(
            "kvindex_router_pd_pulled_tokens", "Predicted tokens P pulled from D, summed.", registry=r
        )
        self.m_pd_errors = Counter(
            "kvindex_router_pd_errors", "Turns that failed, by leg.", ["leg"], registry=r
        )
        self.m_pd_decode_alone = Counter(
            "kvindex_router_pd_decode_alone", "Turns D served alone because little was left to prefill.", registry=r
        )

    async def start(self) -> None:
        """Start the router, then build the planner over its index."""
        await super().start()
        assert self.indexer is not None
        cfg = self.config
        store = make_retained_store(self.indexer, cfg.retained_ttl)
        self.planner = PDPlanner(
            self.indexer.index,
            self.indexer.token_processor,
            store,
            recompute_threshold=cfg.recompute_threshold,
            tier_weights=self.indexer.tier_weights,
            guard=cfg.guard,
            model=self.model,
            decode_alone=cfg.decode_alone,
        )

    def app(self) -> web.Application:
        app = super().app()
        app.router.add_get("/pd/decisions", self.handle_pd_decisions)
        return app

    def _role_candidates(self, pods: list[str]) -> list[str]:
        up = [p for p in pods if self.healthy.get(p)]
        return up or list(pods)

    async def _post(self, pod: str, path: str, body: dict[str, Any], headers: dict[str, str]) -> tuple[int, bytes]:
        """POST ``body`` to ``pod``; (status, raw body); status 502 when unreachable."""
        status, raw, _ = await self._post_reached(pod, path, body, headers)
        return status, raw

    async def _post_reached(
        self, pod: str, path: str, body: dict[str, Any], headers: dict[str, str]
    ) -> tuple[int, bytes, bool]:
        """:meth:`_post`, and whether the engine answered at all (False: no answer, status 502)."""
        assert self._session is not None
        try:
            async with post_upstream(
                self._session, self.engines[pod].url + path, attempts=self.config.connect_attempts,
                data=msgspec.json.encode(body), headers=headers,
            ) as up:
                return up.status, await up.read(), True
        except (aiohttp.ClientError, TimeoutError) as e:
            log.warning("P/D router: %s unreachable: %r", pod, e)
            return 502, msgspec.json.encode({"error": {"message": f"engine {pod} failed: {e!r}", "code": 502}}), False

    async def handle_completion(self, request: web.Request) -> web.StreamResponse:
        """One P/D turn (see the module docstring)."""
        assert self.planner is not None and self.indexer is not None
        started = time.perf_counter()
        raw = await request.read()
        try:
            body = msgspec.json.decode(raw)
        except msgspec.DecodeError:
            body = None
        if not isinstance(body, dict):
            return web.json_response({"error": {"message": "body must be a JSON object", "code": 400}}, status=400)
        cid = conversation_id_of(request.headers, body)
        path = request.path
        tokens, _source = await self.prompt_token_ids(path, body, raw)
        tokens = tokens or []
        chat = path.endswith("/chat/completions")
        salt = body.get("cache_salt")
        salt = salt if isinstance(salt, str) and salt else None
        alone = decode_only_reason(body, chat)
        if alone is not None:
            plan = self.planner.decode_only(
                cid, tokens, self._role_candidates(self.config.decode), self.indexer.loads(), reason=alone,
                cache_salt=salt,
            )
        else:
            plan = self.planner.plan(
                cid,
                tokens,
                self._role_candidates(self.config.prefill),
                self._role_candidates(self.config.decode),
                self.indexer.loads(),
                cache_salt=salt,
            )
        turn = PDTurn(id=next(self._turn_ids), conversation_id=cid, plan=plan)
        headers = {
            k: v
            for k, v in request.headers.items()
            if k.lower() not in HOP_BY_HOP and k.lower() != CONVERSATION_HEADER
        }
        headers["Content-Type"] = "application/json"
        stream = bool(body.get("stream"))

        if alone is not None:
            return self._done(turn, started, await self._decode_alone(request, turn, body, headers))

        if plan.decode_params is not None:
            # the decode-alone rule: no P leg; D prefills what its cache lacks and keeps the KV for the next turn
            self.m_pd_turns.labels(plan.action).inc()
            self.m_pd_decode_alone.inc()
            d_params: dict[str, Any] | None = plan.decode_params
        else:
            done, d_params = await self._prefill_leg(request, turn, body, path, headers, chat)
            if done is not None:
                return self._done(turn, started, done)
            plan = turn.plan

        # -- D leg
        d_body = dict(body)
        d_body["kv_transfer_params"] = d_params
        want_ids = bool(body.get("return_token_ids"))
        passthrough = stream and self.config.pd_stream == "passthrough"
        if passthrough:
            if plan.decode_params is not None:
                d_body.pop("kv_transfer_params")  # a streamed answer offers no next turn: nothing to retain
            self.planner.decode_answered(plan, None, tokens)
            return self._done(turn, started, await self._stream_decode(request, plan, d_body, headers, turn))
        d_body["stream"] = False
        d_body.pop("stream_options", None)
        d_body["return_token_ids"] = True
        t1 = time.perf_counter()
        d_status, d_raw, reached = await self._post_reached(plan.decode_pod, path, d_body, headers)
        if d_status >= 500 and reached and d_body["kv_transfer_params"] is not None:
            # D could not load P's KV (e.g. P went away after answering: D answers 500 under the
            # default kv_load_failure_policy "fail"): D once more without remote params, prefilling itself
            cause = f"decode_http_{d_status}"
            turn.fallback_error = d_raw[:500].decode("utf-8", "replace")
            self.m_pd_fallbacks.labels(cause).inc()
            turn.plan = plan = msgspec.structs.replace(
                plan, reasons=[*plan.reasons, f"D failed to load P's KV ({cause}): D prefills the request itself"]
            )
            d_body["kv_transfer_params"] = None
            d_status, d_raw = await self._post(plan.decode_pod, path, d_body, headers)
        turn.decode_ms = (time.perf_counter() - t1) * 1000.0
        turn.decode_status = d_status
        if d_status != 200:
            self.m_pd_errors.labels("decode").inc()
            self.planner.decode_answered(plan, None, tokens)
            return self._done(turn, started, self._error(turn, d_status, d_raw))
        try:
            answer = msgspec.json.decode(d_raw)
        except msgspec.DecodeError:
            answer = None
        if not isinstance(answer, dict):
            self.m_pd_errors.labels("decode").inc()
            return self._done(turn, started, self._error(turn, 502, d_raw))
        d_params = params_from_json_body(d_raw, where=f"decode pod {plan.decode_pod}", rejects=self.rejects)
        output = _output_token_ids(answer)
        if d_params is not None and output is not None and tokens:
            entry = self.planner.decode_answered(plan, d_params, list(tokens) + output)
            turn.retained_tokens = entry.num_tokens if entry is not None else 0
        else:
            self.planner.decode_answered(plan, None, tokens)
        _strip_answer(answer, keep_ids=want_ids)
        extra = self._pd_headers(turn)
        if stream:
            return self._done(turn, started, await self._emit_sse(request, answer, chat, body, extra))
        return self._done(
            turn, started, web.Response(status=200, body=msgspec.json.encode(answer), content_type="application/json", headers=extra)
        )

    async def _prefill_leg(
        self, request: web.Request, turn: PDTurn, body: dict[str, Any], path: str, headers: dict[str, str], chat: bool
    ) -> tuple[web.StreamResponse | None, dict[str, Any] | None]:
        """The P leg of ``turn`` (a failed pull retried once as a recompute; D alone when no P answers).

        Returns (the client's response when the turn ends here, else None; D's params from P's answer).
        """
        t0 = time.perf_counter()
        plan = turn.plan
        p_status, p_raw, reached = await self._prefill(plan, body, path, headers, chat)
        if p_status >= 500 and plan.action == "pull" and reached:
            cause = f"prefill_http_{p_status}"
            plan = self.planner.fallback(plan, cause)
            turn.plan = plan
            turn.fallback_error = p_raw[:500].decode("utf-8", "replace")
            self.m_pd_fallbacks.labels(cause).inc()
            p_status, p_raw, reached = await self._prefill(plan, body, path, headers, chat)
        if not reached:
            # no prefill pod answered (e.g. restarting): D prefills the request itself
            turn.prefill_status = p_status
            turn.prefill_ms = (time.perf_counter() - t0) * 1000.0
            turn.fallback_error = p_raw[:500].decode("utf-8", "replace")
            self.m_pd_fallbacks.labels("prefill_unreachable").inc()
            turn.plan = self.planner.fallback(plan, "prefill_unreachable", decode_only=True)
            return await self._decode_alone(request, turn, body, headers), None
        turn.prefill_status = p_status
        turn.prefill_ms = turn.ttft_ms = (time.perf_counter() - t0) * 1000.0
        self.m_pd_turns.labels(plan.action).inc()
        self.m_pd_pulled.inc(plan.pulled_tokens)
        if p_status != 200:
            self.m_pd_errors.labels("prefill").inc()
            return self._error(turn, p_status, p_raw), None
        p_params = params_from_json_body(p_raw, where=f"prefill pod {plan.prefill_pod}", rejects=self.rejects)
        if p_params is not None:
            turn.prefill_cached_tokens = p_params.remote_prefill_cached_tokens
        return None, self.planner.decode_params(p_params)

    async def _prefill(
        self, plan: TurnPlan, body: dict[str, Any], path: str, headers: dict[str, str], chat: bool
    ) -> tuple[int, bytes, bool]:
        return await self._post_reached(plan.prefill_pod, path, prefill_body(body, plan.prefill_params, chat), headers)

    async def _decode_alone(
        self, request: web.Request, turn: PDTurn, body: dict[str, Any], headers: dict[str, str]
    ) -> web.StreamResponse:
        """D serves the client's request as it is (streamed when asked), without remote params: nothing to retain."""
        self.m_pd_turns.labels(turn.plan.action).inc()
        d_body = {k: v for k, v in body.items() if k != "kv_transfer_params"}
        if body.get("stream"):
            return await self._stream_decode(request, turn.plan, d_body, headers, turn)
        t1 = time.perf_counter()
        status, raw = await self._post(turn.plan.decode_pod, request.path, d_body, headers)
        turn.decode_ms = (time.perf_counter() - t1) * 1000.0
        turn.decode_status = status
        try:
            answer = msgspec.json.decode(raw) if status == 200 else None
        except msgspec.DecodeError:
            answer = None
        if not isinstance(answer, dict):
            if status == 200:
                status = 502  # garbage from the engine
            self.m_pd_errors.labels("decode").inc()
            return self._error(turn, status, raw)
        answer.pop("kv_transfer_params", None)  # the same shape as a P/D answer
        return web.Response(
            status=200, body=msgspec.json.encode(answer), content_type="application/json", headers=self._pd_headers(turn)
        )

    async def _stream_decode(
        self, request: web.Request, plan: TurnPlan, d_body: dict[str, Any], headers: dict[str, str], turn: PDTurn
    ) -> web.StreamResponse:
        assert self._session is not None
        t1 = time.perf_counter()
        try:
            async with post_upstream(
                self._session, self.engines[plan.decode_pod].url + request.path,
                attempts=self.config.connect_attempts, data=msgspec.json.encode(d_body), headers=headers,
            ) as up:
                turn.decode_status = up.status
                if up.status != 200:
                    self.m_pd_errors.labels("decode").inc()
                resp = web.StreamResponse(status=up.status, headers={"Content-Type": up.headers.get("Content-Type", "text/event-stream"), **self._pd_headers(turn)})
                await resp.prepare(request)
                if not await relay_stream(up, resp):
                    log.debug("P/D router: client of turn %s disconnected", turn.id)
                return resp
        except (aiohttp.ClientError, TimeoutError) as e:
            turn.decode_status = 502
            self.m_pd_errors.labels("decode").inc()
            err = {"error": {"message": f"engine {plan.decode_pod} failed: {e!r}", "code": 502}}
            return self._error(turn, 502, msgspec.json.encode(err))
        finally:
            turn.decode_ms = (time.perf_counter() - t1) * 1000.0

    async def _emit_sse(
        self, request: web.Request, answer: dict[str, Any], chat: bool, body: dict[str, Any], extra: dict[str, str]
    ) -> web.StreamResponse:
        """Re-emit a whole non-streaming answer as server-sent events (see :func:`answer_as_events`)."""
        resp = web.StreamResponse(status=200, headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache", **extra})
        await resp.prepare(request)
        include_usage = bool((body.get("stream_options") or {}).get("include_usage"))
        for event in answer_as_events(answer, chat, include_usage=include_usage):
            await resp.write(b"data: " + msgspec.json.encode(event) + b"\n\n")
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp

    def _error(self, turn: PDTurn, status: int, raw: bytes) -> web.Response:
        """An engine's (or the router's) error answer, with the turn's headers."""
        return web.Response(status=status, body=raw, content_type="application/json", headers=self._pd_headers(turn))

    def _pd_headers(self, turn: PDTurn) -> dict[str, str]:
        p = turn.plan
        return {
            "x-kvindex-prefill-pod": p.prefill_pod,
            "x-kvindex-decode-pod": p.decode_pod,
            "x-kvindex-pd-action": p.action,
            "x-kvindex-pulled-tokens": str(p.pulled_tokens),
            "x-kvindex-decision": str(turn.id),
        }

    def _done(self, turn: PDTurn, started: float, resp: web.StreamResponse) -> web.StreamResponse:
        turn.total_ms = (time.perf_counter() - started) * 1000.0
        self.turns.append(turn)
        del self.turns[: -self.config.decision_log_size]
        return resp

    async def handle_pd_decisions(self, request: web.Request) -> web.Response:
        """``GET /pd/decisions?limit=N``: the last N P/D turns (default 100), oldest first."""
        try:
            limit = int(request.query.get("limit", "100"))
        except ValueError:
            return web.Response(status=400, text="limit must be an integer")
        items = self.turns[-max(0, limit) :] if limit > 0 else []
        return web.Response(body=msgspec.json.encode(items), content_type="application/json")


def _output_token_ids(answer: dict[str, Any]) -> list[int] | None:
    """Generated token ids of the first choice (vLLM's ``return_token_ids``), or None."""
    choices = answer.get("choices")
    if not isinstance(choices, list) or not choices or not isinstance(choices[0], dict):
        return None
    ids = choices[0].get("token_ids")
    if isinstance(ids, list) and all(type(t) is int for t in ids):
        return ids
    return None


#: Request fields that only shape P's answer, which the router discards (it keeps P's
#: ``kv_transfer_params``; the client gets D's answer).  Logprobs cost P a sampling pass
#: (in vLLM 0.32 the first request asking for them also compiles the logprob kernel:
#: ``Sampler.gather_logprobs`` under torch.compile, tens of seconds on a small CPU host), and
#: ``prompt_logprobs`` makes vLLM skip reading the prefix cache for the request
#: (``SamplingParams.skip_reading_prefix_cache`` defaults to ``prompt_logprobs is not None``),
#: which would defeat the local hits the plan counts on.  ``echo`` returns the prompt (with
#: its logprobs when asked).
PREFILL_DROPPED_FIELDS = ("logprobs", "top_logprobs", "prompt_logprobs", "echo", "min_tokens", "stream_options")


def prefill_body(body: dict[str, Any], params: dict[str, Any], chat: bool) -> dict[str, Any]:
    """The P leg's request body: ``body`` (the client's, unchanged) with P's ``kv_transfer_params``,
    one output token, no streaming and none of :data:`PREFILL_DROPPED_FIELDS`.

    Args:
        body: the client's JSON body (``/v1/completions`` or ``/v1/chat/completions``).
        params: the planned ``kv_transfer_params`` for P (a pull from D, or a plain prefill).
        chat: whether the body is a chat completion (``max_completion_tokens`` is capped too).
    """
    p_body = {k: v for k, v in body.items() if k not in PREFILL_DROPPED_FIELDS}
    p_body["kv_transfer_params"] = params
    p_body["stream"] = False
    p_body["max_tokens"] = 1
    if chat and "max_completion_tokens" in p_body:
        p_body["max_completion_tokens"] = 1
    return p_body


def _count(value: Any) -> int | None:
    """An integer request field as the engine's validation reads it (None: absent or not a number)."""
    if isinstance(value, bool) or value is None:
        return None
    try:
        return int(value)
    except (TypeError, ValueError):
        return None


def decode_only_reason(body: dict[str, Any], chat: bool) -> str | None:
    """Why one P prefill cannot serve this request (then D serves it alone), or None.

    The P leg hands D the ``kv_transfer_params`` of one prefilled prompt, and
    vLLM 0.32 gives every engine request made from the body those same params:

    - a batch of prompts (``/v1/completions``, ``prompt`` a list of several
      strings or token lists): P returns the params of the first prompt only
      (``request_output_to_completion_response`` takes
      ``final_res_batch[0].kv_transfer_params``), so D would load the first
      prompt's KV for every other prompt;
    - ``n`` > 1 (or ``use_beam_search``): D's parallel samples each read P's
      blocks, P frees them after the first read (its ``_get_new_notifs`` logs
      "Potentially invalid KV blocks ... retrieved" for the others), and D's
      answer carries the params of one sample, not necessarily choice 0's;
    - prompt logprobs (:func:`scorer.prefix.reads_prefix_cache` is False:
      ``prompt_logprobs``, or ``echo`` with ``logprobs``, or ``echo`` on chat):
      vLLM sets ``skip_reading_prefix_cache`` and its scheduler drops the
      external load for such a request (``vllm/v1/core/sched/scheduler.py``),
      so D recomputes the prompt and P's prefill would be wasted.
    """
    if not chat:
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) > 1 and isinstance(prompt[0], (list, str)):
            return f"a batch of {len(prompt)} prompts (one P prefill gives D the params of the first only)"
    n = _count(body.get("n"))
    if n is not None and n > 1:
        return f"n={n} (each sample would read P's blocks, which P frees after the first read)"
    if body.get("use_beam_search"):
        return "beam search (several sequences per request)"
    if not reads_prefix_cache("/v1/chat/completions" if chat else "/v1/completions", body):
        return "prompt logprobs (vLLM recomputes the prompt instead of loading P's KV)"
    return None


def answer_as_events(answer: dict[str, Any], chat: bool, *, include_usage: bool) -> list[dict[str, Any]]:
    """The events of a whole (non-streaming) answer as a stream would carry them, without ``[DONE]``.

    One chunk with every choice (its whole text or message as one delta; the
    fields of vLLM 0.32's stream choices: ``stop_reason``, and ``token_ids`` /
    ``prompt_token_ids`` when the answer kept them, i.e. the client asked with
    ``return_token_ids``), then a usage chunk when ``include_usage``.
    """
    base = {k: answer.get(k) for k in ("id", "created", "model")}
    choices = []
    for c in answer.get("choices") or []:
        if chat:
            msg = c.get("message") or {}
            delta = {"role": msg.get("role", "assistant"), "content": msg.get("content")}
            for key in ("reasoning_content", "reasoning"):
                if msg.get(key) is not None:
                    delta[key] = msg[key]
            if msg.get("tool_calls"):
                # stream deltas name each call's position (clients merge deltas by it)
                delta["tool_calls"] = [
                    {"index": i, **tc} if isinstance(tc, dict) else tc for i, tc in enumerate(msg["tool_calls"])
                ]
            choice = {"index": c.get("index", 0), "delta": delta, "logprobs": c.get("logprobs"),
                      "finish_reason": c.get("finish_reason"), "stop_reason": c.get("stop_reason")}
            if c.get("token_ids") is not None:
                choice["token_ids"] = c["token_ids"]
        else:
            choice = {k: c.get(k) for k in ("index", "text", "logprobs", "finish_reason", "stop_reason")}
            for key in ("prompt_token_ids", "token_ids"):
                if c.get(key) is not None:
                    choice[key] = c[key]
        choices.append(choice)
    obj = "chat.completion.chunk" if chat else "text_completion"
    first: dict[str, Any] = {**base, "object": obj, "choices": choices}
    if chat and answer.get("prompt_token_ids") is not None:
        first["prompt_token_ids"] = answer["prompt_token_ids"]
    events = [first]
    if include_usage and answer.get("usage") is not None:
        events.append({**base, "object": obj, "choices": [], "usage": answer["usage"]})
    return events


def _strip_answer(answer: dict[str, Any], *, keep_ids: bool) -> None:
    """Remove what only the router needed: kv_transfer_params and (unless asked) the token-id fields."""
    answer.pop("kv_transfer_params", None)
    if keep_ids:
        return
    answer.pop("prompt_token_ids", None)
    for c in answer.get("choices") or []:
        if isinstance(c, dict):
            c.pop("token_ids", None)
            c.pop("prompt_token_ids", None)

