"""Multi-turn tokenization: reuse the ids of a cached text's prefix, encode only the rest.

A conversation's next turn renders to a text that starts with the previous
turn's text, but a tokenizer is not prefix-stable at every character: BPE can
merge across the cut. It is stable at the start of an added special token
(e.g. ``<|im_start|>``): Hugging Face ``tokenizers`` splits the text on added
tokens before normalizing, pre-tokenizing and running the model, and every
piece between them is encoded on its own. So for a cut at the start of such a
token, ``encode(a + b) == encode(a) + encode(b)`` (without the post-processor's
BOS/EOS). Tokens that eat neighbouring spaces (``lstrip``), match only whole
words or after normalization are not used as cuts; nor is any token whose text
sits inside a longer added token, nor any token when special tokens are
encoded as plain text (``encode_special_tokens``).

The cache keeps the last texts it encoded (bounded by entries and tokens),
each with its ids and the cut points it contains, found by the first
:data:`ANCHOR_CHARS` characters of the text. A new text reuses the ids up to
the last cut point inside its common prefix with a cached text, and encodes
the rest. tests/test_tokenize_prefix.py holds the result to a full encoding.
"""

from __future__ import annotations

import sys
import threading
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

import msgspec

from kvindex.tokenize.render_cache import Cold

ANCHOR_CHARS = 256
"""A text is looked up by its first characters; shorter texts are encoded whole."""


class Memo(msgspec.Struct, dict=True):
    """A slot kept with a cached text's ids for what a caller derives from them.

    ``value``: None until the caller sets it (e.g. the router: the index's
    request keys of those ids, with what they depend on). An attribute, not a
    field: a memo encodes as ``{}`` whatever it holds, so results that carry
    one still encode. Dropped with the cached text; the cache's bounds do not
    count it.
    """

    def __post_init__(self) -> None:
        self.value: Any = None


@dataclass
class _Entry:
    text: str
    ids: list[int]  # the token ids (shared with the lists handed out: no copy per request; see _store)
    cut_chars: list[int]  # char offsets of the cut points, ascending
    cut_tokens: list[int]  # index in ids of the token starting at each cut
    memo: Memo = field(default_factory=Memo)


@dataclass
class CacheStats:
    """Counters of the cache (since creation)."""

    lookups: int = 0
    hits: int = 0
    reused_tokens: int = 0
    encoded_tokens: int = 0
    entries: int = 0
    tokens_held: int = 0
    disabled_reason: str = field(default="")


def cut_token_ids(backend: Any) -> dict[int, str]:
    """Added tokens at whose start a text can be cut without changing its encoding: id -> text."""
    if getattr(backend, "encode_special_tokens", False):
        return {}
    added = backend.get_added_tokens_decoder()
    texts = {i: t.content for i, t in added.items()}
    out: dict[int, str] = {}
    for i, tok in added.items():
        if tok.lstrip or tok.single_word or tok.normalized or not tok.content:
            continue
        if any(tok.content in other and other != tok.content for other in texts.values()):
            continue
        out[i] = tok.content
    return out


class PrefixCache:
    """Bounded, thread-safe cache of encoded texts for incremental encoding.

    ``backend`` is a ``tokenizers.Tokenizer``; encodings are without special
    tokens added by the post-processor (the chat path of vLLM 0.32 encodes the
    rendered template with ``add_special_tokens=False``).
    """

    def __init__(self, backend: Any, *, max_entries: int = 128, max_tokens: int = 4_000_000) -> None:
        if max_entries < 1 or max_tokens < 1:
            raise ValueError("max_entries and max_tokens must be >= 1")
        self._backend = backend
        self._cuts = cut_token_ids(backend)
        self._max_entries = max_entries
        self._max_tokens = max_tokens
        self._by_anchor: OrderedDict[str, list[_Entry]] = OrderedDict()
        self._held = self._count = 0  # token ids and entries in _by_anchor
        self._lock = threading.Lock()
        self.stats = CacheStats(disabled_reason="" if self._cuts else "the tokenizer has no safe cut tokens")

    @property
    def enabled(self) -> bool:
        """False when the tokenizer offers no safe cut point (every text is encoded whole)."""
        return bool(self._cuts)

    def encode(self, text: str, *, limit: int | None = None) -> tuple[list[int], int]:
        """Return (ids of ``text`` without post-processing, how many came from the cache).

        ``limit``: raise :class:`Cold` rather than encode more than ``limit``
        characters of a text longer than that.
        """
        ids, reused, _, _ = self.encode_memo(text, limit=limit)
        return ids, reused

    def encode_memo(self, text: str, *, limit: int | None = None
                    ) -> tuple[list[int], int, Memo | None, Memo | None]:
        """:meth:`encode`, plus the :class:`Memo` of the cached text the reused ids came from
        (None when none were) and the memo kept with ``text``'s ids (None: not cached)."""
        if not self._cuts or len(text) < ANCHOR_CHARS:
            if limit is not None and len(text) > limit:
                raise Cold("the text is encoded whole")
            return self._backend.encode(text, add_special_tokens=False).ids, 0, None, None
        anchor = text[:ANCHOR_CHARS]
        with self._lock:
            best = self._best_cut(text, self._by_anchor.get(anchor, []))
        if limit is not None and len(text) > limit and (
                best is None or len(text) - best[0].cut_chars[best[1]] > limit):
            raise Cold("no cached text covers all but the limit")
        with self._lock:
            self.stats.lookups += 1
        if best is not None:
            entry, k, extends = best
            start, tok_at = entry.cut_chars[k], entry.cut_tokens[k]
            tail, chars, toks = self._encode_from(text, start)
            if tail and tail[0] == entry.ids[tok_at]:  # the expected token at the cut
                with self._lock:
                    self.stats.hits += 1
                    self.stats.reused_tokens += tok_at
                new, ids = self._store(anchor, text, entry.cut_chars[:k] + chars,
                                       entry.cut_tokens[:k] + [t + tok_at for t in toks], entry, tok_at, tail, extends)
                return ids, tok_at, entry.memo, new.memo
            if limit is not None and len(text) > limit:
                raise Cold("the text must be encoded whole")
        ids, chars, toks = self._encode_from(text, 0)
        new, ids = self._store(anchor, text, chars, toks, None, 0, ids, False)
        return ids, 0, None, new.memo

    def _encode_from(self, text: str, start: int) -> tuple[list[int], list[int], list[int]]:
        """Encode ``text[start:]``; its ids, and its cut points shifted by ``start``."""
        enc = self._backend.encode(text[start:], add_special_tokens=False)
        ids = enc.ids
        chars, toks = [], []
        cuts = self._cuts
        for i, (tid, (a, _)) in enumerate(zip(ids, enc.offsets)):
            if tid in cuts and text.startswith(cuts[tid], start + a):
                chars.append(start + a)
                toks.append(i)
        with self._lock:
            self.stats.encoded_tokens += len(ids)
        return ids, chars, toks

    def _best_cut(self, text: str, entries: list[_Entry]) -> tuple[_Entry, int, bool] | None:
        """The cached entry and cut index reaching furthest into ``text``, and whether ``text``
        starts with the entry's text."""
        best: tuple[_Entry, int, bool] | None = None
        for e in entries:
            extends = text.startswith(e.text)
            k = len(e.cut_chars) - 1 if extends and e.cut_chars else self._last_cut_in_common(text, e)
            if k is not None and (best is None or e.cut_chars[k] > best[0].cut_chars[best[1]]):
                best = (e, k, extends)
        return best

    def _last_cut_in_common(self, text: str, e: _Entry) -> int | None:
        """Index of the last cut point of ``e`` whose token lies inside the common prefix with ``text``
        (``text`` not starting with ``e.text``)."""
        def shares(k: int) -> bool:
            end = e.cut_chars[k] + len(self._cuts[e.ids[e.cut_tokens[k]]])
            return end <= len(text) and (text.startswith(e.text) if end == len(e.text) else
                                          text.startswith(e.text[:end]))
        n = len(e.cut_chars)
        if n == 0:
            return None
        lo, hi = 0, n  # shares() holds below lo... find the first k where it fails
        while lo < hi:
            mid = (lo + hi) // 2
            if shares(mid):
                lo = mid + 1
            else:
                hi = mid
        return lo - 1 if lo > 0 else None

    def _store(self, anchor: str, text: str, chars: list[int], toks: list[int], base: _Entry | None,
               reused: int, tail: list[int], extends: bool) -> tuple[_Entry, list[int]]:
        """Cache ``text`` with ids ``base.ids[:reused] + tail`` (``tail`` alone without a base);
        (its entry, its ids). The caller holds the ids from the moment the lock is released: an
        entry whose ids only the entry holds is one another thread may extend in place.

        ``extends``: ``text`` starts with the base's text, and the base is
        replaced. Its ids list is then extended in place when nothing but the
        entry holds it (the previous turn's result dropped by its caller): no
        copy of the reused ids and no freeing of the old list, the cost of a
        long conversation's turn. The ids up to ``reused`` (the cut token
        included) stay as they were, so a reader still holding the old entry
        (to copy its ids up to an earlier cut) reads the same ids.
        """
        with self._lock:
            before = bucket = self._by_anchor.pop(anchor, [])
            held_before = _tokens(before)
            if base is None:
                ids = tail
            elif extends and _sole_holder(base) and any(e is base for e in before):
                ids = base.ids
                ids[reused:] = tail  # one step: a reader outside the lock never sees the list cut short
            else:
                ids = base.ids[:reused]  # the one copy of the reused ids
                ids.extend(tail)
            entry = _Entry(text, ids, chars, toks)
            if extends:
                bucket = [e for e in bucket if e is not base]
            bucket = [e for e in bucket if e.text != text]
            bucket.append(entry)
            del bucket[:-4]  # a few branches of one conversation (or conversations sharing a start)
            self._by_anchor[anchor] = bucket
            self._held += _tokens(bucket) - held_before  # running totals: no walk over every entry
            self._count += len(bucket) - len(before)
            self._evict()
            return entry, ids  # built while this frame still holds ids: never held by the entry alone

    def _evict(self) -> None:
        held, count = self._held, self._count
        while self._by_anchor and (count > self._max_entries or held > self._max_tokens):
            _, bucket = self._by_anchor.popitem(last=False)
            held -= _tokens(bucket)
            count -= len(bucket)
        self._held, self._count = held, count
        self.stats.entries, self.stats.tokens_held = count, held

    def clear(self) -> None:
        """Forget every cached text."""
        with self._lock:
            self._by_anchor.clear()
            self._held = self._count = 0
            self.stats.entries = self.stats.tokens_held = 0


def _id_refs(entry: _Entry) -> int:
    """References to ``entry.ids`` (CPython's count, this call's own included)."""
    return sys.getrefcount(entry.ids)


_FREE_THREADED = not getattr(sys, "_is_gil_enabled", lambda: True)()
_SOLE_REFS = _id_refs(_Entry("", [], [], []))
"""What :func:`_id_refs` counts for an ids list that only its entry holds (on this interpreter)."""


def _sole_holder(entry: _Entry) -> bool:
    """Whether nothing but ``entry`` holds its ids list (False on a free-threaded build, whose counts are not exact)."""
    return not _FREE_THREADED and _id_refs(entry) <= _SOLE_REFS


def _tokens(bucket: list[_Entry]) -> int:
    """Token ids a bucket of entries holds."""
    return sum(len(e.ids) for e in bucket)

