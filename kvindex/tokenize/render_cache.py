"""Multi-turn rendering: render only a conversation's new messages.

A chat template is *message-local* when its output is ``H + B(m_1) + ... +
B(m_n) + S``: a head and a tail that do not depend on the messages, and one
piece per message that depends on that message alone. :func:`message_local`
proves it from the template's syntax tree (one top-level ``for`` over
``messages``, the only use of ``messages``; no ``loop`` variable, namespace
writes, calls other than methods and ``raise_exception``, or state read from
outside the loop). For such a template, with the request's kwargs fixed, the
head and tail are found once from two probe conversations (any split both
agree on gives the same text: :func:`find_split`), and a conversation's next turn renders as the
cached text of its previous messages plus the pieces of its new ones.

The previous messages are matched by their JSON text: the new request's must
start with the cached one's up to its last message, followed by a comma. The
text is the request's own (``enc``: the bytes of its ``messages`` array as
received, any formatting, no second encoding) or else msgspec's encoding of
the decoded messages. Equal JSON bytes decode to equal values, and a JSON value
ends where its bytes say, so an equal prefix of the text proves equal
messages. With ``limit`` the call renders only a warm turn (:class:`Cold`
otherwise), so that a caller can do it inline. Anything unproven (a
template that is not message-local, kwargs that do not encode, an ambiguous
split, developer messages, a render that raises) renders the whole
conversation. tests/test_tokenize_render.py holds the result to a full render.
"""

from __future__ import annotations

import sys
import threading
from collections import OrderedDict
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

import msgspec

ANCHOR_BYTES = 256
"""Conversations are looked up by the first bytes of their messages' JSON encoding."""

PROBES = ({"role": "user", "content": "kvindex probe one"},
          {"role": "assistant", "content": "the second probe"})

JSON_SPACE = b" \t\r\n"

Prepare = Callable[[list[Any]], list[dict[str, Any]]]


class Cold(Exception):
    """The request is not a warm turn within the caller's limit (see ``limit``)."""
Apply = Callable[[list[dict[str, Any]]], str]


@lru_cache(maxsize=32)
def message_local(template: str) -> bool:
    """True when the template's output is provably head + one piece per message + tail."""
    from jinja2 import TemplateSyntaxError, nodes

    from kvindex.tokenize.messages import _environment

    try:
        root = _environment().parse(template)
    except TemplateSyntaxError:
        return False
    uses = [n for n in root.find_all(nodes.Name) if n.name == "messages"]
    loops = [n for n in root.body if isinstance(n, nodes.For) and uses and n.iter is uses[0]]
    if len(uses) != 1 or len(loops) != 1 or any(
            isinstance(n, (nodes.Include, nodes.Import, nodes.FromImport, nodes.Extends, nodes.Block))
            for n in root.find_all(nodes.Node)):
        return False
    loop = loops[0]
    if loop.else_ or loop.test is not None or loop.recursive or not isinstance(loop.target, nodes.Name):
        return False
    body = _walk(loop.body)
    outer = {t.name for a in root.find_all((nodes.Assign, nodes.AssignBlock)) if not any(a is n for n in body)
             for t in a.find_all(nodes.Name) if t.ctx == "store"}
    inner = {n.name for n in body if isinstance(n, nodes.Name) and n.ctx in ("store", "param")}
    inner.add(loop.target.name)
    for n in body:
        if isinstance(n, (nodes.NSRef, nodes.Macro, nodes.CallBlock, nodes.FilterBlock, nodes.Scope,
                          nodes.OverlayScope, nodes.ScopedEvalContextModifier)):
            return False
        if isinstance(n, nodes.Name) and (n.name == "loop" or (n.name in outer and n.name not in inner)):
            return False
        if isinstance(n, nodes.Call) and not (isinstance(n.node, nodes.Getattr) or (
                isinstance(n.node, nodes.Name) and n.node.name == "raise_exception")):
            return False
        if isinstance(n, nodes.Filter) and n.name == "random":
            return False
        if isinstance(n, nodes.Call) and isinstance(n.node, nodes.Getattr) and _refers_outer(n.node, outer, inner):
            return False
    return True


def _walk(body: list[Any]) -> list[Any]:
    """Every node of ``body`` and their descendants."""
    from jinja2 import nodes

    out: list[Any] = []
    for node in body:
        out.append(node)
        out.extend(node.find_all(nodes.Node))
    return out


def _refers_outer(node: Any, outer: set[str], inner: set[str]) -> bool:
    from jinja2 import nodes

    while isinstance(node, (nodes.Getattr, nodes.Getitem)):
        node = node.node
    return isinstance(node, nodes.Name) and node.name in outer and node.name not in inner


@dataclass
class _Entry:
    enc: bytes  # JSON text of the messages
    n: int  # how many messages
    middle: str  # their pieces, concatenated


@dataclass
class RenderStats:
    """Counters of the render cache (since creation)."""

    lookups: int = 0
    hits: int = 0
    reused_messages: int = 0
    rendered_messages: int = 0
    full_renders: int = 0
    entries: int = 0
    chars_held: int = 0


class RenderCache:
    """Bounded, thread-safe cache of rendered conversations (by entries and characters held)."""

    def __init__(self, *, max_entries: int = 128, max_chars: int = 32_000_000) -> None:
        if max_entries < 1 or max_chars < 1:
            raise ValueError("max_entries and max_chars must be >= 1")
        self._max_entries, self._max_chars = max_entries, max_chars
        self._splits: OrderedDict[tuple[str, str, bytes], tuple[str, str] | None] = OrderedDict()
        self._by_anchor: OrderedDict[tuple[Any, ...], list[_Entry]] = OrderedDict()
        self._held = self._count = 0  # characters and entries in _by_anchor
        self._lock = threading.Lock()
        self.stats = RenderStats()

    def render(self, messages: Any, template: str, fmt: str, kwargs: Mapping[str, Any],
               prepare: Prepare, apply: Apply, *, enc: bytes | None = None,
               limit: int | None = None) -> str | None:
        """The template's text for ``messages`` (``apply(prepare(messages))``), or None: render it whole.

        ``prepare``: messages -> the conversation the template sees, message by
        message (no developer merging); ``apply``: conversation -> text with ``kwargs``.
        ``enc``: the JSON text ``messages`` was decoded from (else encoded here).
        ``limit``: raise :class:`Cold` instead of rendering more than ``limit``
        bytes of new messages' JSON, or instead of returning None.
        ``messages`` None (with ``enc`` and ``limit``): the caller did not decode
        them; only a warm turn renders, decoding just its new messages from ``enc``.
        """
        if messages is None:
            if enc is None or limit is None:
                raise ValueError("messages None needs their JSON text (enc) and a limit")
            return self._render_warm_json(enc, template, fmt, kwargs, prepare, apply, limit)
        key = self._key(messages, template, fmt, kwargs)
        if key is None or not message_local(template):
            return self._whole(limit)
        if enc is None:
            try:
                enc = msgspec.json.encode(messages)
            except (TypeError, msgspec.EncodeError):  # not JSON (a caller's own objects): no proof of a prefix
                return self._whole(limit)
        if limit is not None and key not in self._splits:
            raise Cold("no split found yet for this template")
        split = self._split(key, prepare, apply)
        if split is None:
            return self._whole(limit)
        head, tail = split
        anchor = (key, enc[:ANCHOR_BYTES])
        with self._lock:
            entry = _longest_prefix(self._by_anchor.get(anchor, []), enc, len(messages))[0]
        if limit is not None and (entry is None or len(enc) - len(entry.enc) > limit):
            raise Cold("no cached turn of this conversation, or too much new")
        with self._lock:
            self.stats.lookups += 1
        start = entry.n if entry is not None else 0
        middle = self._middle(messages[start:], split, prepare, apply) if start < len(messages) else ""
        if middle is None:
            return self._whole(limit)
        if entry is not None:
            middle = entry.middle + middle
            with self._lock:
                self.stats.hits += 1
                self.stats.reused_messages += start
        with self._lock:
            self.stats.rendered_messages += len(messages) - start
        self._store(anchor, _Entry(enc, len(messages), middle), entry)
        return "".join((head, middle, tail))

    def _render_warm_json(self, enc: bytes, template: str, fmt: str, kwargs: Mapping[str, Any],
                          prepare: Prepare, apply: Apply, limit: int) -> str:
        """:meth:`render` of a warm turn given only its messages' JSON text (:class:`Cold` otherwise).

        The cached entry proves the first messages byte for byte (as in
        :meth:`render`); the rest of ``enc`` after the comma is decoded alone.
        """
        key = self._key([None], template, fmt, kwargs)  # the messages' part of the key: a non-empty list
        if key is None or not message_local(template) or not enc.startswith(b"["):
            raise Cold("the conversation must be rendered whole")
        with self._lock:
            split = self._splits.get(key)
            anchor = (key, enc[:ANCHOR_BYTES])
            entry, start = _longest_prefix(self._by_anchor.get(anchor, []), enc, sys.maxsize)
        if split is None or entry is None or len(enc) - len(entry.enc) > limit:
            raise Cold("no split or cached turn for this conversation, or too much new")
        new: Any = []
        if start < len(enc):
            try:
                new = msgspec.json.decode(b"[" + enc[start:])
            except msgspec.DecodeError:
                raise Cold("the new messages do not decode") from None
            if not isinstance(new, list) or not new:
                raise Cold("no new messages after the comma")
        with self._lock:
            self.stats.lookups += 1
        middle = self._middle(new, split, prepare, apply) if new else ""
        if middle is None:
            raise Cold("the conversation must be rendered whole")
        with self._lock:
            self.stats.hits += 1
            self.stats.reused_messages += entry.n
            self.stats.rendered_messages += len(new)
        middle = entry.middle + middle
        self._store(anchor, _Entry(enc, entry.n + len(new), middle), entry)
        return "".join((split[0], middle, split[1]))  # one copy of the long middle, not three

    def _key(self, messages: Any, template: str, fmt: str, kwargs: Mapping[str, Any]) -> tuple[str, str, bytes] | None:
        if not isinstance(messages, list) or not messages:
            return None
        try:
            return template, fmt, msgspec.json.encode(dict(kwargs))
        except (TypeError, msgspec.EncodeError):
            return None

    def _whole(self, limit: int | None = None) -> None:
        if limit is not None:
            raise Cold("the conversation must be rendered whole")
        with self._lock:
            self.stats.full_renders += 1
        return None

    def _middle(self, messages: list[Any], split: tuple[str, str], prepare: Prepare, apply: Apply) -> str | None:
        """The pieces of ``messages`` (None when they cannot be taken apart)."""
        from kvindex.tokenize.messages import Inexact

        try:
            conv = prepare(messages)
            if any(m.get("role") == "developer" for m in conv):
                return None
            text = apply(conv)
        except Inexact:
            return None
        head, tail = split
        if len(text) < len(head) + len(tail) or not text.startswith(head) or not text.endswith(tail):
            return None
        return text[len(head):len(text) - len(tail)]

    def _split(self, key: tuple[str, str, bytes], prepare: Prepare, apply: Apply) -> tuple[str, str] | None:
        """The head and tail for these template and kwargs (None: not found unambiguously)."""
        with self._lock:
            if key in self._splits:
                return self._splits[key]
        split = find_split(prepare, apply)
        with self._lock:
            self._splits[key] = split
            while len(self._splits) > 64:
                self._splits.popitem(last=False)
        return split

    def _store(self, anchor: tuple[Any, ...], entry: _Entry, replaced: _Entry | None) -> None:
        with self._lock:
            before = self._by_anchor.pop(anchor, [])
            bucket = [e for e in before if e is not replaced and e.enc != entry.enc]
            bucket.append(entry)
            del bucket[:-4]  # a few branches of one conversation
            self._by_anchor[anchor] = bucket
            held = self._held - _chars(before) + _chars(bucket)  # running totals: no walk over every entry
            count = self._count - len(before) + len(bucket)
            while self._by_anchor and (count > self._max_entries or held > self._max_chars):
                _, old = self._by_anchor.popitem(last=False)
                held -= _chars(old)
                count -= len(old)
            self._held, self._count = held, count
            self.stats.entries, self.stats.chars_held = count, held

    def clear(self) -> None:
        """Forget every cached conversation and split."""
        with self._lock:
            self._by_anchor.clear()
            self._splits.clear()
            self._held = self._count = 0
            self.stats.entries = self.stats.chars_held = 0


def _chars(bucket: list[_Entry]) -> int:
    """Characters a bucket of entries holds (their messages' JSON and rendered pieces)."""
    return sum(len(e.middle) + len(e.enc) for e in bucket)


def _longest_prefix(bucket: list[_Entry], enc: bytes, n: int) -> tuple[_Entry | None, int]:
    """The cached entry with the most messages whose messages start ``enc``'s, and where
    ``enc``'s messages after them begin (``len(enc)``: none after them); (None, 0) if no entry does.

    The entry's text up to the end of its last message (its closing bracket
    and the JSON whitespace before it cut off) must start ``enc``, and be
    followed in ``enc`` by JSON whitespace and a comma: then ``enc``'s first
    messages are the entry's, byte for byte.
    """
    best: _Entry | None = None
    start = 0
    for e in bucket:
        if e.n > n or (best is not None and e.n <= best.n):
            continue
        at = len(enc) if enc == e.enc else _new_start(e.enc, enc)
        if at is not None:
            best, start = e, at
    return best, start


def _new_start(cached: bytes, enc: bytes) -> int | None:
    """Where ``enc``'s messages after ``cached``'s begin (just after the comma), or None.

    ``cached``'s text up to the end of its last message must start ``enc``,
    followed in ``enc`` by JSON whitespace and a comma (see :func:`_longest_prefix`).
    """
    cut = len(cached) - 1
    while cut > 0 and cached[cut] in JSON_SPACE:
        cut -= 1
    while cut > 0 and cached[cut - 1] in JSON_SPACE:  # cut: the closing bracket, then the space before it
        cut -= 1
    if cut <= 1 or len(enc) <= cut or not enc.startswith(memoryview(cached)[:cut]):
        return None
    i = cut
    while i < len(enc) and enc[i] in JSON_SPACE:
        i += 1
    return i + 1 if i < len(enc) and enc[i] == 0x2C else None


def find_split(prepare: Prepare, apply: Apply) -> tuple[str, str] | None:
    """Head and tail from renders of one and two copies of each probe (None: no split fits).

    Several splits can fit (ChatML's pieces and tail both start with
    ``<|im_start|>``); each is the true one shifted by a string that the
    tail and every piece start with (or, shifted left, end with), so any of
    them gives the same text as long as every render is checked to start with
    the head and end with the tail, which :meth:`RenderCache.render` does.
    """
    from kvindex.tokenize.messages import Inexact

    found: set[tuple[str, str]] | None = None
    try:
        pieces = []
        for probe in PROBES:
            one = apply(prepare([probe]))
            two = apply(prepare([probe, probe]))
            b = len(two) - len(one)
            if b <= 0:
                return None
            cands = {(one[:h], one[h + b:]) for h in range(len(one) - b + 1) if two == one[:h + b] + one[h:]}
            found = cands if found is None else found & cands
            pieces.append(one)
        if not found:
            return None
        head, tail = min(found, key=lambda split: len(split[0]))
        both = apply(prepare(list(PROBES)))
    except Inexact:
        return None
    if both != head + "".join(t[len(head):len(t) - len(tail)] for t in pieces) + tail:
        return None
    return head, tail
