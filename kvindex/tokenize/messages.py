"""What vLLM hands to the chat template: messages, tools and template kwargs.

Pure functions over a /v1/chat/completions (or /tokenize) body, mirroring
vLLM 0.32's preparation step before ``tokenizer.apply_chat_template``:
vllm/renderers/chat_utils.py (``parse_chat_messages``: content parts, tool
calls, tool messages), vllm/renderers/hf.py (content-format detection, the
developer role, kwargs filtering), vllm/renderers/params.py (``merge_kwargs``)
and the ``build_chat_params`` of vllm/entrypoints/openai/chat_completion/
protocol.py. No tokenizer here: the caller renders and encodes.

Anything this module cannot reproduce raises :class:`Inexact` with the reason;
the tokenizer turns it into ``exact=False`` so the caller can fall back.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping
from functools import lru_cache
from typing import Any, Literal

ContentFormat = Literal["string", "openai"]

#: content part types read as text, and the key holding their text (chat_utils.py MM_PARSER_MAP)
TEXT_PARTS: dict[str, str] = {
    "text": "text",
    "input_text": "text",
    "output_text": "text",
    "refusal": "refusal",
    "thinking": "thinking",
}
#: part types skipped, not rejected, when their text is missing (PART_TYPES_TO_SKIP_NONE_CONTENT)
SKIP_WHEN_EMPTY = ("text", "refusal")
#: a system text part starting with this loses its first line (chat_utils.py, Claude Code's header)
BILLING_HEADER = "x-anthropic-billing-header"
#: values that leave a default in place when merging kwargs (params.py merge_kwargs)
UNSET = (None, "auto")


class Inexact(Exception):
    """The request cannot be reproduced exactly; the message says why."""


def merge_kwargs(defaults: Mapping[str, Any] | None, overrides: Mapping[str, Any] | None) -> dict[str, Any]:
    """``defaults`` updated with the ``overrides`` that are not None or "auto" (vLLM's rule)."""
    out = dict(defaults or {})
    out.update({k: v for k, v in (overrides or {}).items() if not _is_unset(v)})
    return out


def _is_unset(value: Any) -> bool:
    return any(value is u or (isinstance(value, str) and value == u) for u in UNSET)


def normalize_tools(tools: Any) -> list[dict[str, Any]] | None:
    """The request's tools as vLLM dumps them (``ChatCompletionToolsParam.model_dump()``).

    Each tool becomes ``{"type": "function", "function": {"name", "description"
    (None when absent), "parameters" (None when absent), <other function keys in
    order>}}``; keys beside ``type`` and ``function`` are dropped.
    """
    if tools is None:
        return None
    if not isinstance(tools, list):
        raise Inexact("invalid request: tools is not a list")
    out = []
    for tool in tools:
        fn = tool.get("function") if isinstance(tool, Mapping) else None
        if not isinstance(fn, Mapping) or not isinstance(fn.get("name"), str):
            raise Inexact("invalid request: a tool without function.name")
        if tool.get("type", "function") != "function":
            raise Inexact(f"unsupported tool type {tool.get('type')!r}")
        norm = {"name": fn["name"], "description": fn.get("description"), "parameters": fn.get("parameters")}
        norm.update({k: v for k, v in fn.items() if k not in norm})
        out.append({"type": "function", "function": norm})
    return out


def template_kwargs(body: Mapping[str, Any], server_defaults: Mapping[str, Any] | None,
                    tools: list[dict[str, Any]] | None, *, is_tokenize: bool) -> dict[str, Any]:
    """The keyword arguments vLLM gives the template renderer for ``body``.

    The request's top-level flags override its ``chat_template_kwargs``, which
    override the server's ``--default-chat-template-kwargs`` and the tools
    (protocol.py ``build_chat_params``, online_renderer.py ``preprocess_chat``).
    POST /tokenize has no ``documents`` or ``reasoning_effort`` fields.
    """
    user = body.get("chat_template_kwargs") or {}
    if not isinstance(user, Mapping):
        raise Inexact("invalid request: chat_template_kwargs is not an object")
    extra: dict[str, Any] = {
        "add_generation_prompt": body.get("add_generation_prompt", True),
        "continue_final_message": body.get("continue_final_message", False),
    }
    if not is_tokenize:
        extra["documents"] = body.get("documents")
        effort = body.get("reasoning_effort")
        extra["reasoning_effort"] = effort
        if effort is not None and "enable_thinking" not in user:
            extra["enable_thinking"] = effort != "none"
    request = merge_kwargs(user, extra)
    defaults = merge_kwargs(server_defaults, {"tools": tools, "tokenize": False})
    return merge_kwargs(defaults, request)


def _text_of(part: Any) -> str | None:
    """The text of a text-like content part; raises Inexact for anything else."""
    if isinstance(part, str):
        return part
    if not isinstance(part, Mapping):
        raise Inexact("invalid request: a content part is not an object")
    kind = part.get("type")
    if kind in TEXT_PARTS and part.get("uuid") is None:
        text = part.get(TEXT_PARTS[kind])
        if text is None and kind in SKIP_WHEN_EMPTY:
            return None
        if not isinstance(text, str):
            raise Inexact(f"invalid request: {kind} part without text")
        return text
    raise Inexact(f"content part of type {kind!r} (multimodal or other non-text content) is not supported")


def _strip_billing_header(parts: list[Any]) -> list[Any]:
    out: list[Any] = []
    for part in parts:
        text = part if isinstance(part, str) else (
            part.get("text") if isinstance(part, Mapping) and part.get("type") == "text" else None)
        if not (isinstance(text, str) and text.startswith(BILLING_HEADER)):
            out.append(part)
            continue
        rest = text.partition("\n")[2]
        if rest:
            out.append(rest if isinstance(part, str) else {**part, "text": rest})
    return out


def _content(role: str, content: Any, fmt: ContentFormat) -> str | list[dict[str, Any]]:
    """A message's content as the template sees it (a string, or text parts in "openai" format)."""
    if isinstance(content, str) and (fmt == "string" or role == "tool") and not (
            role == "system" and content.startswith(BILLING_HEADER)):
        return content  # the common case: one text part, joined
    if content is None:
        parts: list[Any] = []
    elif isinstance(content, str):
        parts = [{"type": "text", "text": content}]
    elif isinstance(content, list):
        parts = list(content)
    else:
        raise Inexact("invalid request: message content is neither a string nor a list")
    if role == "system":
        parts = _strip_billing_header(parts)
    texts = [t for t in (_text_of(p) for p in parts) if t is not None]
    if fmt == "string" or role == "tool":
        return "\n".join(texts)
    wrapped: list[dict[str, Any]] = []
    for p, t in zip((p for p in parts if _text_of(p) is not None), texts):
        keep = ("type", "text", TEXT_PARTS.get(str(p.get("type")), "")) if isinstance(p, Mapping) else ()
        extra = {k: v for k, v in p.items() if k not in keep} if isinstance(p, Mapping) else {}
        if extra:
            raise Inexact("text content parts with extra fields are not supported in the openai content format")
        wrapped.append({"type": "text", "text": t})
    return wrapped


def _tool_calls(calls: Any) -> list[dict[str, Any]] | None:
    """Assistant tool calls with their arguments parsed into objects (chat_utils.py)."""
    if not isinstance(calls, list):
        raise Inexact("invalid request: tool_calls is not a list")
    if not calls:
        return None
    out = []
    for call in calls:
        # the request schema (OpenAI's tool-call param, validated by pydantic) wants all four as given here
        fn = call.get("function") if isinstance(call, Mapping) else None
        if (not isinstance(fn, Mapping) or call.get("type") != "function" or not isinstance(call.get("id"), str)
                or not isinstance(fn.get("name"), str) or not isinstance(fn.get("arguments"), str)):
            raise Inexact("invalid request: a tool call needs id, type function, function.name and "
                          "function.arguments (a JSON string)")
        fn = dict(fn)
        try:
            parsed = json.loads(fn["arguments"]) if fn["arguments"] else {}
        except ValueError:
            parsed = None
        fn["arguments"] = parsed if isinstance(parsed, dict) else {}
        out.append({**call, "function": fn})
    return out


def conversation(messages: Any, fmt: ContentFormat) -> list[dict[str, Any]]:
    """The conversation vLLM renders from the request's messages (``parse_chat_messages``)."""
    if not isinstance(messages, list) or not all(isinstance(m, Mapping) for m in messages):
        raise Inexact("invalid request: messages is not a list of objects")
    out: list[dict[str, Any]] = []
    for msg in messages:
        role = msg.get("role")
        if not isinstance(role, str):
            raise Inexact("invalid request: a message without a role")
        conv: dict[str, Any] = {"role": role, "content": _content(role, msg.get("content"), fmt)}
        if role == "assistant":
            if msg.get("tool_calls") is not None:
                calls = _tool_calls(msg["tool_calls"])
                if calls is not None:
                    conv["tool_calls"] = calls
            if msg.get("reasoning") is not None:
                conv["reasoning"] = conv["reasoning_content"] = msg["reasoning"]
        elif role == "tool" and "tool_call_id" in msg:
            conv["tool_call_id"] = msg["tool_call_id"]
        for key in ("name", "task"):
            if isinstance(msg.get(key), str):
                conv[key] = msg[key]
        if role == "developer":
            conv["tools"] = msg.get("tools")
        out.append(conv)
    return out


def developer_as_system(conv: list[dict[str, Any]], template: str) -> list[dict[str, Any]]:
    """Developer messages become one leading system message when the template has no developer role (hf.py)."""
    if not any(m["role"] == "developer" for m in conv) or "'developer'" in template or '"developer"' in template:
        return conv
    conv = [{**{k: v for k, v in m.items() if k != "tools"}, "role": "system"} if m["role"] == "developer" else m
            for m in conv]
    systems = [i for i, m in enumerate(conv) if m["role"] == "system"]
    if systems in ([], [0]):
        return conv
    texts = []
    for i in systems:
        c = conv[i].get("content", "")
        if isinstance(c, list):
            c = "\n".join(p["text"] if isinstance(p, Mapping) else p for p in c
                          if isinstance(p, str) or (isinstance(p, Mapping) and "text" in p))
        if c:
            texts.append(c)
    return [{"role": "system", "content": "\n\n".join(texts)}] + [m for m in conv if m["role"] != "system"]


# -- the template's content format ("string" or "openai"), read from its syntax tree --

def _refers(node: Any, names: set[str], key: str | None = None) -> bool:
    """``node`` reads one of ``names`` (or its ``key`` field), through filters, tests and slices."""
    from jinja2 import nodes

    while True:
        if isinstance(node, (nodes.Filter, nodes.Test)) and node.node is not None:
            node = node.node
        elif isinstance(node, nodes.Getitem) and isinstance(node.arg, nodes.Slice):
            node = node.node
        else:
            break
    if key is not None:
        if isinstance(node, nodes.Getitem) and isinstance(node.arg, nodes.Const) and node.arg.value == key:
            node = node.node
        elif isinstance(node, nodes.Getattr) and node.attr == key:
            node = node.node
        else:
            return False
    return isinstance(node, nodes.Name) and node.ctx == "load" and node.name in names


def _aliases(root: Any, name: str) -> set[str]:
    """``name`` and every variable assigned from it (or from its items/slices), transitively."""
    from jinja2 import nodes

    found = {name}
    grew = True
    while grew:
        grew = False
        for assign in root.find_all(nodes.Assign):
            target = assign.target
            if isinstance(target, nodes.Name) and target.name not in found and _refers(assign.node, found):
                found.add(target.name)
                grew = True
    return found


def _content_loops(root: Any) -> Iterator[Any]:
    """For-loops over a message's content (or over a macro parameter bound to it)."""
    from jinja2 import nodes

    msgs = _aliases(root, "messages")
    per_message = {loop.target.name for loop in root.find_all(nodes.For)
                   if isinstance(loop.target, nodes.Name) and _refers(loop.iter, msgs)}
    in_macro: set[int] = set()
    bound: dict[int, set[str]] = {}
    for macro in root.find_all(nodes.Macro):
        params = [a.name for a in macro.args]
        got: set[str] = set()
        for call in root.find_all(nodes.Call):
            if isinstance(call.node, nodes.Name) and call.node.name == macro.name:
                got |= {params[i] for i, a in enumerate(call.args)
                        if i < len(params) and _refers(a, per_message, "content")}
                got |= {kw.key for kw in call.kwargs if kw.key in params and _refers(kw.value, per_message, "content")}
        for loop in macro.find_all(nodes.For):
            in_macro.add(id(loop))
            if got:
                bound[id(loop)] = got
    for loop in root.find_all(nodes.For):
        it = loop.iter
        if _refers(it, per_message, "content"):
            yield loop
        elif isinstance(it, nodes.Name) and (it.name in bound.get(id(loop), ()) or (
                id(loop) not in in_macro and it.name == "content")):
            yield loop


@lru_cache(maxsize=32)
def detect_content_format(template: str) -> ContentFormat:
    """"openai" when the template loops over message content parts, else "string" (vLLM's "auto")."""
    from jinja2 import TemplateSyntaxError

    try:
        root = _environment().parse(template)
    except TemplateSyntaxError:
        return "string"
    return "openai" if next(_content_loops(root), None) is not None else "string"


@lru_cache(maxsize=32)
def template_variables(template: str) -> frozenset[str]:
    """Variables the template reads without defining them (what vLLM lets through from the kwargs)."""
    import jinja2.meta

    return frozenset(jinja2.meta.find_undeclared_variables(_environment().parse(template)))


@lru_cache(maxsize=1)
def _environment() -> Any:
    """A jinja2 environment that parses chat templates as transformers compiles them."""
    import jinja2.ext
    import jinja2.sandbox

    return jinja2.sandbox.ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_generation_tag(), jinja2.ext.loopcontrols])


@lru_cache(maxsize=1)
def _generation_tag() -> type:
    import jinja2.ext
    from jinja2 import nodes

    class GenerationTag(jinja2.ext.Extension):
        """Parses ``{% generation %}...{% endgeneration %}`` blocks (rendering is transformers' job)."""

        tags = {"generation"}

        def parse(self, parser: Any) -> Any:
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return nodes.CallBlock(self.call_method("_noop"), [], [], body).set_lineno(lineno)

    return GenerationTag

