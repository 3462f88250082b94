"""OpenAI request bodies -> the token ids a vLLM engine prefills.

Mirrors vLLM 0.32's OpenAI server for Hugging Face tokenizers:

- chat (/v1/chat/completions, and /tokenize with ``messages``): the template
  is the server's ``--chat-template`` (a file or the template text), else the
  tokenizer's (vllm/renderers/hf.py ``resolve_chat_template``); the messages,
  tools and kwargs are prepared as in :mod:`kvindex.tokenize.messages`;
  transformers' ``apply_chat_template(..., tokenize=False)`` renders the text,
  which is then encoded with ``add_special_tokens`` from the request (default
  False for chat);
- completions (/v1/completions, /tokenize with ``prompt``): a text prompt is
  encoded with ``add_special_tokens`` (default True: BOS etc.), token ids are
  taken as given, a list of prompts is a batch (one entry per prompt), as
  vllm/renderers/inputs/preprocess.py ``prompt_to_seq``; /tokenize takes one
  text prompt only (vllm/entrypoints/serve/tokenize/protocol.py).

Not reproduced (the result says ``exact=False`` and why, and carries no ids):
multimodal or other non-text content parts, ``prompt_embeds``, ``suffix``,
``truncate_prompt_tokens``, a request chat template the server would refuse,
Mistral and other non-Hugging-Face tokenizers, the Harmony format (gpt-oss),
processor chat templates of multimodal models, and requests the engine rejects.
"""

from __future__ import annotations

import json
import os
import threading
from functools import lru_cache
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

import msgspec

from kvindex.tokenize import messages as msgs
from kvindex.tokenize.messages import ContentFormat, Inexact
from kvindex.tokenize.prefix_cache import CacheStats, Memo, PrefixCache
from kvindex.tokenize.render_cache import Cold, RenderCache

CHAT_PATHS = ("/v1/chat/completions",)
COMPLETION_PATHS = ("/v1/completions",)
TOKENIZE_PATHS = ("/tokenize",)


class TokenizedRequest(msgspec.Struct, frozen=True):
    """The token ids of a request, or why they cannot be given exactly.

    ``prompts``: one list of ids per prompt the engine prefills (one for chat
    and /tokenize; a completions batch gives one per prompt); empty when
    ``exact`` is False. ``reason``: why not
    exact. ``reused_tokens``: ids taken from the multi-turn cache (the rest
    were encoded for this request). ``reused_memo``: the cache's
    :class:`~kvindex.tokenize.prefix_cache.Memo` of the text those ids came
    from; ``memo``: the one kept with these ids (None: not cached).
    """

    prompts: list[list[int]]
    exact: bool
    reason: str = ""
    reused_tokens: int = 0
    reused_memo: Memo | None = None
    memo: Memo | None = None

    def __eq__(self, other: object) -> bool:
        """Equal ids, exactness, reason and reuse (the memos are cache slots, not part of the result)."""
        if type(other) is not TokenizedRequest:
            return NotImplemented
        return (self.prompts == other.prompts and self.exact == other.exact and self.reason == other.reason
                and self.reused_tokens == other.reused_tokens)

    __hash__ = None  # type: ignore[assignment]  # the prompts are lists

    @property
    def token_ids(self) -> list[int]:
        """The first prompt's ids (the only one except for completion batches); [] when not exact."""
        return self.prompts[0] if self.prompts else []


class _RawMessages(msgspec.Struct):
    """A body's ``messages`` array as its JSON text (the other fields skipped)."""

    messages: msgspec.Raw = msgspec.Raw(b"")


_RAW_MESSAGES = msgspec.json.Decoder(_RawMessages)

WARM_LIMIT = 16_384
"""Bytes of new messages (JSON) and characters of new text :meth:`RequestTokenizer.tokenize_warm` takes on."""


def _inexact(reason: str) -> TokenizedRequest:
    return TokenizedRequest(prompts=[], exact=False, reason=reason)


def load_chat_template(value: str | os.PathLike[str] | None) -> str | None:
    """A ``--chat-template`` value as vLLM reads it: a readable file's text, else the value itself."""
    if value is None:
        return None
    try:
        return Path(value).read_text()
    except OSError:
        if isinstance(value, os.PathLike) or not any(c in str(value) for c in "{}\n"):
            raise ValueError(f"chat template {value!s} is neither a readable file nor template text") from None
        return str(value)


class RequestTokenizer:
    """Tokenizes OpenAI request bodies exactly as a vLLM 0.32 engine serving ``model_dir`` does.

    Args:
        model_dir: the engine's ``--model`` folder (or ``--tokenizer``): tokenizer
            files and ``tokenizer_config.json`` with the chat template.
        chat_template: the engine's ``--chat-template`` (a file path or the template text).
        content_format: the engine's ``--chat-template-content-format``
            ("auto" detects it from the template as vLLM does).
        default_chat_template_kwargs: the engine's ``--default-chat-template-kwargs``.
        trust_request_chat_template: the engine's ``--trust-request-chat-template``.
        exclude_tools_when_tool_choice_none: the engine's flag of that name.
        cache_entries, cache_tokens: bounds of the multi-turn caches (0 entries: none): the
            encoded texts (:attr:`cache`) and the rendered conversations (:attr:`renders`).

    Raises ValueError when the folder holds no Hugging Face fast tokenizer
    (transformers must be installed: ``pip install 'kvindex[tokenize]'``).
    Thread-safe; each call costs about the request's new tokens when the
    multi-turn cache holds its conversation's previous turn.
    """

    def __init__(
        self,
        model_dir: str | os.PathLike[str],
        *,
        chat_template: str | os.PathLike[str] | None = None,
        content_format: Literal["auto", "string", "openai"] = "auto",
        default_chat_template_kwargs: Mapping[str, Any] | None = None,
        trust_request_chat_template: bool = False,
        exclude_tools_when_tool_choice_none: bool = False,
        cache_entries: int = 128,
        cache_tokens: int = 4_000_000,
    ) -> None:
        if content_format not in ("auto", "string", "openai"):
            raise ValueError(f"content_format must be auto, string or openai, got {content_format!r}")
        try:
            from transformers import AutoTokenizer
        except ImportError as e:  # pragma: no cover - depends on the install
            raise ValueError("request tokenization needs the extra: pip install 'kvindex[tokenize]'") from e
        self.model_dir = Path(model_dir)
        self._hf = AutoTokenizer.from_pretrained(str(self.model_dir))
        if not getattr(self._hf, "is_fast", False):
            raise ValueError(f"{model_dir}: only fast (tokenizers) tokenizers are supported")
        self._backend = self._hf.backend_tokenizer
        self._server_template = load_chat_template(chat_template)
        self._content_format = content_format
        self._defaults = dict(default_chat_template_kwargs or {})
        self._trust_template = trust_request_chat_template
        self._exclude_tools_none = exclude_tools_when_tool_choice_none
        self._vocab = len(self._hf)
        self._render_lock = threading.Lock()  # transformers' template cache is not documented thread-safe
        self.cache: PrefixCache | None = (
            PrefixCache(self._backend, max_entries=cache_entries, max_tokens=cache_tokens)
            if cache_entries > 0 else None
        )
        self.renders: RenderCache | None = RenderCache(max_entries=cache_entries) if cache_entries > 0 else None
        self._processor_files = [n for n in ("processor_config.json", "preprocessor_config.json")
                                 if (self.model_dir / n).is_file()]

    # -- public entry points -------------------------------------------------

    def tokenize(self, path: str, body: Any, *, raw: bytes | None = None) -> TokenizedRequest:
        """Tokenize a body sent to ``path`` (/v1/chat/completions, /v1/completions or /tokenize).

        ``raw``: the JSON text ``body`` was decoded from, when the caller has it
        (the multi-turn cache then proves a conversation's earlier messages on
        it instead of encoding them again); it must decode to ``body``.
        """
        if not isinstance(body, Mapping):
            return _inexact("invalid request: the body is not a JSON object")
        try:
            if path in CHAT_PATHS:
                return self._chat(body, is_tokenize=False, raw=raw)
            if path in COMPLETION_PATHS:
                return self._completion(body)
            if path in TOKENIZE_PATHS:
                if "messages" in body:
                    return self._chat(body, is_tokenize=True, raw=raw)
                if not isinstance(body.get("prompt"), str):
                    raise Inexact("invalid request: /tokenize takes one text prompt")
                return self._completion(body)
        except Inexact as e:
            return _inexact(str(e))
        return _inexact(f"unsupported path {path!r}")

    def tokenize_warm(self, path: str, body: Any, *, raw: bytes | None = None,
                      limit: int = WARM_LIMIT, messages_json: bytes | None = None) -> TokenizedRequest | None:
        """:meth:`tokenize`'s result for a conversation's next turn, or None when it is not one.

        Not None only when both multi-turn caches hold the conversation's
        previous turn and at most ``limit`` bytes of new messages (their JSON)
        and ``limit`` characters of new text are left to render and encode: a
        cost of about the new tokens plus a compare of the rest, short enough
        to run on an event loop. None: call :meth:`tokenize` (off the loop).
        ``messages_json``: the JSON text of the request's ``messages``, which
        ``body`` then leaves out (every other field decoded): the caller need
        not decode the messages, as only the new ones are.
        """
        if path not in CHAT_PATHS or not isinstance(body, Mapping) or self.cache is None or self.renders is None:
            return None
        if messages_json is not None and "messages" in body:
            raise ValueError("messages_json is for a body without its messages")
        try:
            return self._chat(body, is_tokenize=False, raw=raw, limit=limit, messages_json=messages_json)
        except (Cold, Inexact):
            return None

    def chat(self, body: Mapping[str, Any]) -> TokenizedRequest:
        """Tokenize a /v1/chat/completions body."""
        return self.tokenize(CHAT_PATHS[0], body)

    def completion(self, body: Mapping[str, Any]) -> TokenizedRequest:
        """Tokenize a /v1/completions body (one prompt list per prompt of a batch)."""
        return self.tokenize(COMPLETION_PATHS[0], body)

    def render(self, body: Mapping[str, Any], *, is_tokenize: bool = False) -> str:
        """The chat template's text for a chat body; raises :class:`Inexact` when not reproducible."""
        template, conv, kwargs = self._prepare_chat(body, is_tokenize=is_tokenize)
        return self._apply_template(template, conv, kwargs)

    def encode(self, text: str, *, add_special_tokens: bool) -> list[int]:
        """Encode text as the engine does (``tokenizer(text, add_special_tokens=...)``)."""
        return self._backend.encode(text, add_special_tokens=add_special_tokens).ids

    def cache_stats(self) -> CacheStats | None:
        """The multi-turn cache's counters (None without a cache)."""
        return self.cache.stats if self.cache is not None else None

    # -- chat ----------------------------------------------------------------

    def _chat(self, body: Mapping[str, Any], *, is_tokenize: bool, raw: bytes | None = None,
              limit: int | None = None, messages_json: bytes | None = None) -> TokenizedRequest:
        """A chat body's ids; ``limit``: raise :class:`Cold` unless a warm turn (see :meth:`tokenize_warm`)."""
        _reject_unsupported(body)
        if limit is not None and body.get("kv_transfer_params") is not None:
            raise Cold("forwarded ids are checked off the loop")
        reused = _forwarded_ids(body, self._vocab) if not is_tokenize else None
        if reused is not None:
            return TokenizedRequest(prompts=[reused], exact=True)
        add_special = body.get("add_special_tokens", False)
        if limit is not None and (add_special or self.cache is None):
            raise Cold("no multi-turn cache for this request")
        text = self._chat_text(body, is_tokenize=is_tokenize, raw=raw, limit=limit, messages_json=messages_json)
        if not isinstance(add_special, bool):
            raise Inexact("invalid request: add_special_tokens is not a boolean")
        if add_special or self.cache is None:
            return TokenizedRequest(prompts=[self.encode(text, add_special_tokens=add_special)], exact=True)
        ids, reused_n, source, memo = self.cache.encode_memo(text, limit=limit)
        return TokenizedRequest(prompts=[ids], exact=True, reused_tokens=reused_n, reused_memo=source, memo=memo)

    def _template_for(self, body: Mapping[str, Any], tools: list[dict[str, Any]] | None) -> str:
        kwargs = body.get("chat_template_kwargs") or {}
        requested = body.get("chat_template")
        if requested is None and isinstance(kwargs, Mapping):
            requested = kwargs.get("chat_template")
        if requested is not None and not self._trust_template:
            raise Inexact("the engine refuses a request chat template without --trust-request-chat-template")
        if requested is None and self._server_template is None and tools is None and self._processor_files:
            raise Inexact(f"the model has {self._processor_files[0]}: its processor's chat template is not supported")
        choice = requested if requested is not None else self._server_template
        try:
            return str(self._hf.get_chat_template(choice, tools=tools))
        except ValueError as e:
            raise Inexact(f"no chat template: {e}") from None

    def _chat_text(self, body: Mapping[str, Any], *, is_tokenize: bool, raw: bytes | None = None,
                   limit: int | None = None, messages_json: bytes | None = None) -> str:
        """The rendered text; only the new messages are rendered when the render cache proves the rest.

        ``messages_json`` (with ``limit``): the messages' JSON text, not decoded into ``body``.
        """
        template, fmt, kwargs = self._chat_params(body, is_tokenize=is_tokenize)
        messages = body.get("messages") if messages_json is None else None
        if messages_json is not None and (limit is None or self.renders is None):
            raise Cold("undecoded messages: warm turns only")
        if self.renders is not None and not body.get("continue_final_message"):
            enc = messages_json if messages_json is not None else _messages_text(raw)
            text = self.renders.render(messages, template, fmt, kwargs, lambda ms: msgs.conversation(ms, fmt),
                                       lambda conv: self._apply_template(template, conv, kwargs),
                                       enc=enc, limit=limit)
            if text is not None:
                return text
        if limit is not None:
            raise Cold("the conversation must be rendered whole")
        conv = msgs.developer_as_system(msgs.conversation(messages, fmt), template)
        return self._apply_template(template, conv, kwargs)

    def _prepare_chat(self, body: Mapping[str, Any], *, is_tokenize: bool
                      ) -> tuple[str, list[dict[str, Any]], dict[str, Any]]:
        template, fmt, kwargs = self._chat_params(body, is_tokenize=is_tokenize)
        conv = msgs.developer_as_system(msgs.conversation(body.get("messages"), fmt), template)
        return template, conv, kwargs

    def _chat_params(self, body: Mapping[str, Any], *, is_tokenize: bool
                     ) -> tuple[str, ContentFormat, dict[str, Any]]:
        """The template, content format and template kwargs of a chat body (everything but the messages)."""
        if body.get("continue_final_message") and body.get("add_generation_prompt"):
            raise Inexact("invalid request: continue_final_message with add_generation_prompt")
        tools = msgs.normalize_tools(body.get("tools"))
        if not is_tokenize and self._exclude_tools_none and body.get("tool_choice") == "none":
            tools = None
        kwargs = msgs.template_kwargs(body, self._defaults, tools, is_tokenize=is_tokenize)
        kwargs.pop("tokenize", None)
        kwargs.pop("chat_template", None)
        tools = kwargs.pop("tools", None)
        template = self._template_for(body, tools)
        fmt: ContentFormat = (msgs.detect_content_format(template) if self._content_format == "auto"
                              else self._content_format)
        accepted = msgs.template_variables(template) | _apply_params(type(self._hf))
        kwargs = {k: v for k, v in kwargs.items() if k in accepted}
        kwargs["tools"] = tools
        return template, fmt, kwargs

    def _apply_template(self, template: str, conv: list[dict[str, Any]], kwargs: dict[str, Any]) -> str:
        try:
            with self._render_lock:
                out = self._hf.apply_chat_template(
                    conv, chat_template=template, tokenize=False, return_dict=False, **kwargs)
        except Exception as e:  # the template raised: the engine answers 400
            raise Inexact(f"the chat template rejects the request: {e}") from None
        if not isinstance(out, str):
            raise Inexact("the chat template did not render to text")
        return out

    # -- completions ---------------------------------------------------------

    def _completion(self, body: Mapping[str, Any]) -> TokenizedRequest:
        _reject_unsupported(body)
        if body.get("prompt_embeds") is not None:
            raise Inexact("prompt_embeds are not supported")
        if body.get("suffix") is not None:
            raise Inexact("suffix (fill-in-the-middle rendering) is not supported")
        add_special = body.get("add_special_tokens", True)
        if not isinstance(add_special, bool):
            raise Inexact("invalid request: add_special_tokens is not a boolean")
        out = []
        for prompt in _prompt_list(body.get("prompt")):
            if isinstance(prompt, str):
                out.append(self.encode(prompt, add_special_tokens=add_special))
            else:
                if any(t >= self._vocab for t in prompt):
                    raise Inexact("invalid request: a token id beyond the vocabulary")
                out.append(list(prompt))
        return TokenizedRequest(prompts=out, exact=True)


@lru_cache(maxsize=8)
def _apply_params(cls: type) -> frozenset[str]:
    """Named parameters of ``apply_chat_template`` (vLLM lets these kwargs through too)."""
    import inspect

    sig = inspect.signature(getattr(cls, "apply_chat_template"))
    return frozenset(n for n, p in sig.parameters.items()
                     if p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL) and n != "self")


def _messages_text(raw: bytes | None) -> bytes | None:
    """The JSON text of a raw body's ``messages`` array (None: no raw body, or none in it)."""
    if raw is None:
        return None
    try:
        text = bytes(_RAW_MESSAGES.decode(raw).messages)
    except msgspec.DecodeError:
        return None
    return text if text.startswith(b"[") else None


def _reject_unsupported(body: Mapping[str, Any]) -> None:
    if body.get("truncate_prompt_tokens") is not None:
        raise Inexact("truncate_prompt_tokens is not supported")
    if body.get("mm_processor_kwargs") or body.get("multi_modal_data") or body.get("mm_payload"):
        raise Inexact("multimodal inputs are not supported")


def _forwarded_ids(body: Mapping[str, Any], vocab: int) -> list[int] | None:
    """Ids a prefill stage forwarded in kv_transfer_params, which the engine uses as they are."""
    kv = body.get("kv_transfer_params")
    if not isinstance(kv, Mapping) or kv.get("prompt_token_ids") is None or body.get("echo"):
        return None
    ids = kv["prompt_token_ids"]
    if not isinstance(ids, list) or not ids or any(type(t) is not int or not 0 <= t < vocab for t in ids):
        raise Inexact("invalid request: kv_transfer_params.prompt_token_ids")
    return list(ids)


def _prompt_list(prompt: Any) -> list[str | list[int]]:
    """The prompts of a completions body (a text, ids, or a batch of either)."""
    if isinstance(prompt, str):
        return [prompt]
    if isinstance(prompt, list) and prompt and all(type(t) is int for t in prompt):
        return [_ids(prompt)]
    if isinstance(prompt, list) and prompt:
        if not (all(isinstance(p, str) for p in prompt) or all(isinstance(p, list) for p in prompt)):
            raise Inexact("invalid request: a batch mixes text and token-id prompts")
        out: list[str | list[int]] = []
        for p in prompt:
            if isinstance(p, str):
                out.append(p)
            elif isinstance(p, list) and p and all(type(t) is int for t in p):
                out.append(_ids(p))
            else:
                raise Inexact("invalid request: a prompt is neither text nor token ids")
        return out
    raise Inexact("invalid request: no prompt")


def _ids(ids: list[int]) -> list[int]:
    if any(t < 0 for t in ids):
        raise Inexact("invalid request: a negative token id")
    return ids


def dumps_for_debug(result: TokenizedRequest) -> str:
    """One-line JSON of a result (logs)."""
    return json.dumps({"exact": result.exact, "reason": result.reason,
                       "tokens": [len(p) for p in result.prompts], "reused": result.reused_tokens})
