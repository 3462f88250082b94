"""The decode-retained tier: what each conversation's decode pod still holds for the next turn.

With bidirectional KV transfer (vLLM 0.32 NixlConnector, ``bidirectional_kv_xfer``)
the decode pod D keeps a request's KV (prompt + generated tokens) for
``decoder_kv_blocks_ttl`` seconds (480 s by default, counted from when D
finished, never extended) and answers with the params a prefill pod needs to
pull it.  :class:`RetainedStore` remembers, per conversation_id, D's answer and
the tokens whose KV D holds, until:

- the router's TTL runs out (default 450 s after the answer arrived, below
  vLLM's 480 s because D's countdown starts before the router sees the
  answer).  Expiry is on the router's monotonic clock (injectable);
  ``remote_blocks_expiry_time`` in D's params is D's perf_counter and is never
  compared with it;
- the entry has been used ``max_uses`` times (default once: D frees or reuses
  the blocks after a pull, and a second pull would read freed blocks);
- a fresh turn of the same conversation replaces it;
- the store is full (``max_entries``): the least recently used entry goes.

Each live entry is mirrored in the index: the request keys of D's whole
blocks are held by D's pod under tier ``decode_retained``
(:meth:`kvindex.reference.KVBlockIndex.add_held`), so the prefix scorer and picker
see pullable KV beside local KV; they are removed with the entry.

Thread-safe (one lock).
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Protocol

import msgspec
import numpy as np
from sortedcontainers import SortedList

from connector.params import RemoteKVParams
from kvindex.tiers import DECODE_RETAINED

__all__ = ["HeldIndex", "RetainedEntry", "RetainedStats", "RetainedStore", "DEFAULT_TTL", "checked_retained"]

#: Router-side TTL of an entry (s): below vLLM's default decoder_kv_blocks_ttl of 480 s.
DEFAULT_TTL = 450.0


class HeldIndex(Protocol):
    """What the store needs from an index (``kvindex.reference.KVBlockIndex``)."""

    def add_held(self, pod: str, request_keys: Sequence[int], tier: str) -> None: ...

    def remove_held(self, pod: str, request_keys: Sequence[int], tier: str) -> int: ...


class RetainedEntry(msgspec.Struct, frozen=True, kw_only=True):
    """One conversation's retained KV on a decode pod.

    Fields:
        conversation_id: the router's conversation key.
        decode_pod: the pod id of D (as the router names it).
        params: D's answer (``do_remote_decode`` true): engine id, request id,
            host, port, block ids per KV-cache group, tp/dcp/pp sizes.
        tokens: the token ids whose KV D holds, block order (length
            ``params.remote_num_tokens``): prompt + generated - 1.
        request_keys: request keys of the whole blocks of ``tokens``
            (``len(tokens) // block_size`` of them).
        created: router monotonic time the answer arrived (s).
        expiry: ``created + ttl`` (s, router monotonic clock).
        uses_left: pulls still allowed.
    """

    conversation_id: str
    decode_pod: str
    params: RemoteKVParams
    tokens: tuple[int, ...]
    request_keys: tuple[int, ...]
    created: float
    expiry: float
    uses_left: int

    @property
    def num_tokens(self) -> int:
        """Tokens whose KV D holds."""
        return len(self.tokens)


class RetainedStats(msgspec.Struct, frozen=True):
    """Counters of a :class:`RetainedStore`: live entries and each way entries ended.

    ``redis_errors``: calls of a shared store (:mod:`connector.redis_retained`)
    that found its server unreachable or failing and answered as an empty
    store (always 0 in memory).
    """

    entries: int
    stored: int
    replaced: int
    used_up: int
    expired: int
    evicted: int
    discarded: int
    redis_errors: int = 0


def checked_retained(
    params: RemoteKVParams, tokens: Sequence[int] | np.ndarray, request_keys: Sequence[int] | np.ndarray
) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Check what a store is asked to retain; return (tokens whose KV D holds, request keys).

    The tokens are cut to ``params.remote_num_tokens`` (D's count) when more
    are given.

    Raises:
        ValueError: params not from D (``do_remote_decode`` false), fewer
            tokens than ``remote_num_tokens``, or more request keys than
            tokens.
    """
    if not params.do_remote_decode:
        raise ValueError("retained params must be D's answer (do_remote_decode true)")
    toks = [int(t) for t in (tokens.tolist() if hasattr(tokens, "tolist") else tokens)]
    n = params.remote_num_tokens if params.remote_num_tokens is not None else len(toks)
    if n > len(toks):
        raise ValueError(f"remote_num_tokens {n} > {len(toks)} tokens given")
    keys = tuple(int(k) for k in (request_keys.tolist() if hasattr(request_keys, "tolist") else request_keys))
    if len(keys) > n:
        raise ValueError(f"{len(keys)} request keys for {n} tokens")
    return tuple(toks[:n]), keys


class RetainedStore:
    """conversation_id -> :class:`RetainedEntry`, with TTL, LRU bound and use count.

    Args:
        index: where the entries are mirrored (tier ``tier``); None = nowhere.
        ttl: seconds an entry lives after D's answer arrived (0 < ttl).
        max_entries: bound on live entries (>= 1); beyond it the least
            recently used (stored or read) entry is evicted.
        max_uses: pulls per entry (>= 1; default 1 = use once).
        clock: monotonic seconds (``time.monotonic``; inject a fake in tests).
        tier: the index tier of the mirrored keys (default ``decode_retained``).

    Raises:
        ValueError: a non-positive ttl, max_entries or max_uses.
    """

    def __init__(
        self,
        index: HeldIndex | None = None,
        *,
        ttl: float = DEFAULT_TTL,
        max_entries: int = 100_000,
        max_uses: int = 1,
        clock: Callable[[], float] = time.monotonic,
        tier: str = DECODE_RETAINED,
    ) -> None:
        if not ttl > 0:
            raise ValueError(f"ttl must be > 0 s, got {ttl}")
        if max_entries < 1:
            raise ValueError(f"max_entries must be >= 1, got {max_entries}")
        if max_uses < 1:
            raise ValueError(f"max_uses must be >= 1, got {max_uses}")
        self.index = index
        self.ttl = float(ttl)
        self.max_entries = max_entries
        self.max_uses = max_uses
        self.tier = tier
        self._clock = clock
        self._lock = threading.RLock()
        self._entries: OrderedDict[str, RetainedEntry] = OrderedDict()  # LRU order: oldest first
        self._order: SortedList = SortedList()  # (expiry, seq, conversation_id)
        self._seq: dict[str, int] = {}
        self._next = 0
        self._c = dict.fromkeys(("stored", "replaced", "used_up", "expired", "evicted", "discarded"), 0)

    # ------------------------------------------------------------------ write

    def put(
        self,
        conversation_id: str,
        decode_pod: str,
        params: RemoteKVParams,
        tokens: Sequence[int] | np.ndarray,
        request_keys: Sequence[int] | np.ndarray,
    ) -> RetainedEntry:
        """Store D's answer for ``conversation_id``, replacing any older entry.

        Args:
            params: D's kv_transfer_params (``do_remote_decode`` true).
            tokens: the tokens whose KV D holds (prompt + output tokens, cut to
                ``params.remote_num_tokens`` when the caller passes more).
            request_keys: request keys of ``tokens``' whole blocks, block order.

        Raises:
            ValueError: params not from D, fewer tokens than
                ``remote_num_tokens``, or more request keys than whole blocks
                would allow for any block size >= 1.
        """
        toks, keys = checked_retained(params, tokens, request_keys)
        with self._lock:
            now = self._clock()
            self._expire(now)
            if conversation_id in self._entries:
                self._drop(conversation_id)
                self._c["replaced"] += 1
            entry = RetainedEntry(
                conversation_id=conversation_id,
                decode_pod=decode_pod,
                params=params,
                tokens=toks,
                request_keys=keys,
                created=now,
                expiry=now + self.ttl,
                uses_left=self.max_uses,
            )
            self._entries[conversation_id] = entry
            self._next += 1
            self._seq[conversation_id] = self._next
            self._order.add((entry.expiry, self._next, conversation_id))
            if self.index is not None and keys:
                self.index.add_held(decode_pod, keys, self.tier)
            self._c["stored"] += 1
            while len(self._entries) > self.max_entries:
                oldest = next(iter(self._entries))
                self._drop(oldest)
                self._c["evicted"] += 1
            return entry

    def take(self, conversation_id: str) -> RetainedEntry | None:
        """Use the entry once (for a pull): returns it, or None if absent or expired.

        The entry ends when its uses are spent; otherwise it stays with one
        use less (and counts as recently used).
        """
        with self._lock:
            self._expire(self._clock())
            entry = self._entries.get(conversation_id)
            if entry is None:
                return None
            if entry.uses_left <= 1:
                self._drop(conversation_id)
                self._c["used_up"] += 1
            else:
                self._entries[conversation_id] = msgspec.structs.replace(entry, uses_left=entry.uses_left - 1)
                self._entries.move_to_end(conversation_id)
            return entry

    def discard(self, conversation_id: str) -> bool:
        """Forget the entry (e.g. the guard found nothing reusable); True if there was one."""
        with self._lock:
            if conversation_id not in self._entries:
                return False
            self._drop(conversation_id)
            self._c["discarded"] += 1
            return True

    def expire(self) -> int:
        """Drop every entry whose expiry has passed; returns how many."""
        with self._lock:
            return self._expire(self._clock())

    # ------------------------------------------------------------------- read

    def get(self, conversation_id: str) -> RetainedEntry | None:
        """The live entry (counts as recently used; spends no use), or None."""
        with self._lock:
            self._expire(self._clock())
            entry = self._entries.get(conversation_id)
            if entry is not None:
                self._entries.move_to_end(conversation_id)
            return entry

    def __len__(self) -> int:
        with self._lock:
            self._expire(self._clock())
            return len(self._entries)

    def __contains__(self, conversation_id: object) -> bool:
        return isinstance(conversation_id, str) and self.get(conversation_id) is not None

    def conversations(self) -> list[str]:
        """Live conversation ids, least recently used first."""
        with self._lock:
            self._expire(self._clock())
            return list(self._entries)

    def stats(self) -> RetainedStats:
        """Counters snapshot (see :class:`RetainedStats`)."""
        with self._lock:
            self._expire(self._clock())
            return RetainedStats(entries=len(self._entries), **self._c)

    # -------------------------------------------------------------- internals

    def _drop(self, conversation_id: str) -> None:
        entry = self._entries.pop(conversation_id)
        self._order.discard((entry.expiry, self._seq.pop(conversation_id), conversation_id))
        if self.index is not None and entry.request_keys:
            self.index.remove_held(entry.decode_pod, entry.request_keys, self.tier)

    def _expire(self, now: float) -> int:
        n = 0
        order = self._order
        while order and order[0][0] <= now:
            _expiry, _seq, cid = order[0]
            self._drop(cid)
            self._c["expired"] += 1
            n += 1
        return n
