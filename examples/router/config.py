"""The reference router's configuration: engines, the tokenizer section, :class:`RouterConfig` and its loaders."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal
from urllib.parse import urlsplit

import msgspec
import yaml

from connector.decode_alone import DecodeAloneRule
from kvevents.subscriber import EngineEndpoint
from kvindex.facade import Config

if TYPE_CHECKING:
    from kvindex.tokenize import RequestTokenizer

__all__ = ["ENGINE_KEEPALIVE", "EngineSpec", "RouterConfig", "TokenizerSpec", "load_router_config", "parse_engine_arg"]


# -- configuration -------------------------------------------------------------


#: seconds an idle connection to a vLLM engine is kept (its HTTP server closes one idle for 5 s)
ENGINE_KEEPALIVE = 2.0


class EngineSpec(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """One engine as the router sees it.

    pod: pod id; must equal the pod in the engine's KV-event topic
        ``kv@<pod>@<model>``.
    url: HTTP base URL of the engine's OpenAI server, e.g. ``http://10.0.0.5:8000``.
    endpoint: ZMQ address of its KV-event publisher, e.g. ``tcp://10.0.0.5:5557``.
    replay_endpoint: ZMQ address of its replay ROUTER socket, or None.
    """

    pod: str
    url: str
    endpoint: str
    replay_endpoint: str | None = None

    def __post_init__(self) -> None:
        if not self.pod:
            raise ValueError("engine pod id must be non-empty")
        parts = urlsplit(self.url)
        if parts.scheme not in ("http", "https") or not parts.netloc:
            raise ValueError(f"engine url must be http(s)://host:port, got {self.url!r}")


class TokenizerSpec(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Local request tokenization (:class:`kvindex.tokenize.RequestTokenizer`, extra ``kvindex[tokenize]``).

    model_dir: the engines' ``--model`` (or ``--tokenizer``) folder: tokenizer files and chat template.
    chat_template, content_format, default_chat_template_kwargs,
    trust_request_chat_template, exclude_tools_when_tool_choice_none: the
    engines' flags of those names (``content_format`` is
    ``--chat-template-content-format``); they must match the engines'.
    cache_entries: conversations kept for incremental multi-turn tokenization (0: none).
    """

    model_dir: str
    chat_template: str | None = None
    content_format: Literal["auto", "string", "openai"] = "auto"
    default_chat_template_kwargs: dict[str, Any] = msgspec.field(default_factory=dict)
    trust_request_chat_template: bool = False
    exclude_tools_when_tool_choice_none: bool = False
    cache_entries: int = 128

    def build(self) -> RequestTokenizer:
        """The tokenizer (raises ValueError when the folder holds no usable tokenizer)."""
        from kvindex.tokenize import RequestTokenizer

        return RequestTokenizer(
            self.model_dir, chat_template=self.chat_template, content_format=self.content_format,
            default_chat_template_kwargs=self.default_chat_template_kwargs,
            trust_request_chat_template=self.trust_request_chat_template,
            exclude_tools_when_tool_choice_none=self.exclude_tools_when_tool_choice_none,
            cache_entries=self.cache_entries,
        )


class RouterConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Everything the router needs (YAML/JSON file or command line).

    engines: the engines to route to (at least one).
    model: served model name (the model part of the engines' topics and the
        label of their metrics); None = ask the first engine's ``/v1/models``.
    block_size: tokens per block; must equal the engines' ``--block-size``.
    host, port: where the router listens.
    policy: ``kvindex`` (prefix + load picker) or ``round_robin`` (baseline).
    load_interval: seconds between two refreshes of every engine's ``/metrics``.
    decision_log_size: routing decisions kept for ``GET /decisions``.
    upstream_timeout: seconds an engine may stay silent while answering.
    connect_timeout: seconds to open a connection to an engine.
    connect_attempts: tries to connect before an engine counts as unreachable
        for a request (a request never sent is safe to send again;
        :func:`examples.router.upstream.post_upstream`).
    upstream_keepalive: seconds an idle connection to an engine is kept for
        reuse.  Below the engines' own idle limit (vLLM's HTTP server closes
        a connection idle for ``VLLM_HTTP_TIMEOUT_KEEP_ALIVE``, 5 s): a
        request sent on a connection the server is closing at that moment
        fails with "server disconnected" before the engine ever sees it.
    indexer: extra :class:`kvindex.Config` fields (e.g. ``scorer_config``,
        ``token_processor_config.algorithm``); the router fills in
        ``model_name``, ``token_processor_config.block_size`` and
        ``kv_events_config.engines`` from the fields above.
    prefill, decode: P/D mode (:mod:`examples.router.pd`): the pod ids of the
        prefill and of the decode engines (both empty: the plain router).
    recompute_threshold: P/D: the engines' ``kv_recompute_threshold`` (tokens).
    retained_ttl: P/D: seconds a decode pod's retained KV is offered for the
        next turn (below the engines' ``decoder_kv_blocks_ttl``, 480 s).
    guard: P/D: clip next-turn params to the prompt's common prefix with the
        retained tokens (off only for comparisons).
    decode_alone: P/D: conditional disaggregation, a turn whose prefill left
        on D is small and whose D is not busy skips P (None: never).
    pd_stream: P/D, clients asking to stream: ``buffer`` (D answers
        non-streaming, re-emitted as events; KV reuse kept) or ``passthrough``
        (D streams; the conversation's retained KV is not reused).
    healing: add ``vllm_xargs.kv_cache_report_mode = "full"`` to requests sent
        to a pod whose index state is incomplete, until
        :class:`kvindex.facade.healing.HealingPolicy` judges it healed.
    heal_quiet_requests, heal_max_requests: the policy's ``quiet_requests``
        and ``max_requests``.
    tokenizer: tokenize requests in the router (:class:`TokenizerSpec`);
        None: see ``auto_tokenizer``.
    auto_tokenizer: with no ``tokenizer``, tokenize in the router from the
        engines' own model folder when it reproduces the engine's ids on
        start-up probes (:mod:`examples.router.engine_tokenizer`); otherwise,
        and when off, ask an engine's ``/tokenize`` for every request.
    """

    engines: list[EngineSpec] = msgspec.field(default_factory=list)
    model: str | None = None
    block_size: int = 32
    host: str = "127.0.0.1"
    port: int = 8080
    policy: Literal["kvindex", "round_robin"] = "kvindex"
    load_interval: float = 1.0
    decision_log_size: int = 1000
    upstream_timeout: float = 600.0
    connect_timeout: float = 10.0
    connect_attempts: int = 3
    upstream_keepalive: float = ENGINE_KEEPALIVE
    indexer: dict[str, Any] = msgspec.field(default_factory=dict)
    prefill: list[str] = msgspec.field(default_factory=list)
    decode: list[str] = msgspec.field(default_factory=list)
    recompute_threshold: int = 64
    retained_ttl: float = 450.0
    guard: bool = True
    decode_alone: DecodeAloneRule | None = None
    pd_stream: Literal["buffer", "passthrough"] = "buffer"
    healing: bool = True
    heal_quiet_requests: int = 8
    heal_max_requests: int = 256
    tokenizer: TokenizerSpec | None = None
    auto_tokenizer: bool = True

    def __post_init__(self) -> None:
        if self.block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {self.block_size}")
        if not self.load_interval > 0:
            raise ValueError(f"load_interval must be > 0, got {self.load_interval}")
        if self.decision_log_size < 1:
            raise ValueError(f"decision_log_size must be >= 1, got {self.decision_log_size}")
        if not self.connect_timeout > 0:
            raise ValueError(f"connect_timeout must be > 0, got {self.connect_timeout}")
        if self.connect_attempts < 1:
            raise ValueError(f"connect_attempts must be >= 1, got {self.connect_attempts}")
        if not self.upstream_keepalive >= 0:
            raise ValueError(f"upstream_keepalive must be >= 0, got {self.upstream_keepalive}")
        pods = [e.pod for e in self.engines]
        if len(set(pods)) != len(pods):
            raise ValueError(f"duplicate pod ids in {pods}")

    def indexer_config(self, model: str | None) -> Config:
        """The :class:`kvindex.Config` for these engines, model and block size.

        Raises:
            ValueError: the ``indexer`` section sets engines itself, or a block
                size different from ``block_size``; or it fails validation.
        """
        data = msgspec.to_builtins(self.indexer)
        events = dict(data.get("kv_events_config") or {})
        if events.get("engines") or events.get("zmq_endpoint"):
            raise ValueError("the indexer section must not list engines: use the router's engines")
        tpc = dict(data.get("token_processor_config") or {})
        if tpc.get("block_size", self.block_size) != self.block_size:
            raise ValueError(
                f"indexer block_size {tpc['block_size']} differs from the router's {self.block_size}"
            )
        tpc["block_size"] = self.block_size
        events["engines"] = [
            msgspec.to_builtins(
                EngineEndpoint(endpoint=e.endpoint, pod=e.pod, replay_endpoint=e.replay_endpoint, model=model)
            )
            for e in self.engines
        ]
        data.update(model_name=model, token_processor_config=tpc, kv_events_config=events)
        return Config.from_dict(data)


def parse_engine_arg(text: str) -> EngineSpec:
    """Parse ``[POD@]URL=ZMQ[,REPLAY]`` into an :class:`EngineSpec`.

    Without ``POD@`` the pod id is the URL's ``host:port`` (e.g.
    ``10.0.0.5:8000``); the engine's topic must then be ``kv@10.0.0.5:8000@<model>``.
    Example: ``pod-0@http://127.0.0.1:8000=tcp://127.0.0.1:5557,tcp://127.0.0.1:5558``.

    Raises:
        ValueError: the text does not have that shape.
    """
    left, sep, right = text.partition("=")
    if not sep or not left or not right:
        raise ValueError(f"engine must be [POD@]URL=ZMQ[,REPLAY], got {text!r}")
    pod = ""
    head, at, tail = left.partition("@")
    if at and "://" not in head:
        pod, url = head, tail
    else:
        url = left
    zmq_parts = [p.strip() for p in right.split(",")]
    if len(zmq_parts) > 2 or not zmq_parts[0] or (len(zmq_parts) == 2 and not zmq_parts[1]):
        raise ValueError(f"engine ZMQ part must be ENDPOINT[,REPLAY_ENDPOINT], got {right!r}")
    if not pod:
        pod = urlsplit(url).netloc
    return EngineSpec(
        pod=pod,
        url=url.rstrip("/"),
        endpoint=zmq_parts[0],
        replay_endpoint=zmq_parts[1] if len(zmq_parts) == 2 else None,
    )


def load_router_config(path: str | Path) -> RouterConfig:
    """Load a :class:`RouterConfig` from a ``.json`` file or a YAML file (anything else).

    Raises:
        msgspec.ValidationError / ValueError: bad content.
    """
    p = Path(path)
    text = p.read_text()
    if p.suffix == ".json":
        return msgspec.json.decode(text, type=RouterConfig)
    data = yaml.safe_load(text) or {}
    if not isinstance(data, dict):
        raise ValueError(f"{p}: the configuration must be a mapping")
    return msgspec.convert(data, RouterConfig)
