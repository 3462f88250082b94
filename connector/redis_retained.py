"""The decode-retained store in Redis: :class:`RedisRetainedStore`, shared by router replicas.

Same interface as :class:`connector.retained.RetainedStore` (conversation_id
-> what the decode pod D retained: D's kv_transfer_params, the tokens whose
KV D holds and their request keys), so turn 2 of a conversation may land on
another router replica and still pull D's KV.  Needs the ``redis`` package
(``kvindex[redis]``); imported when the store is built.

Layout (every key starts with ``key_prefix``):

- ``r:<conversation_id>``: hash ``entry`` -> the :class:`RetainedEntry`
  (msgpack; its conversation_id is the key's, any string, lone surrogates
  included), ``uses`` -> pulls left.  Its key TTL is the entry's TTL plus
  ``grace`` seconds, so the server frees it even when no router is left.
- ``rz``: sorted set conversation_id -> expiry (seconds, the Redis server's
  clock: one clock for every replica).  An entry past its expiry is never
  returned; :meth:`RedisRetainedStore.expire` (also run by put / get / take)
  deletes such entries and takes their keys out of the index.

Every operation is one Lua script, atomic on the server: :meth:`take` hands
an entry to exactly one caller when two replicas take it at once (its use
count goes down, and the entry is deleted with its last use).

Differences from the in-memory store, stated: ``max_entries`` is not
enforced (entries live at most their TTL; the server's memory is the
bound); ``created`` / ``expiry`` of the entries are seconds on the Redis
server's clock; counters in :meth:`stats` are this process's, ``entries``
is the shared count.  An entry the server expired before any router ran
:meth:`expire` (after ``ttl + grace``) leaves its keys in the index's held
tier until the index's own ``held_ttl``.

Outage: when the server cannot be reached or answers with an error (BUSY,
OOM, READONLY), the store answers as an empty one and never raises:
:meth:`get` / :meth:`take` give None (the planner recomputes), :meth:`put`
returns the entry without storing it, :meth:`discard` False, :meth:`expire`
0; each such call counts ``redis_errors`` in :meth:`stats`, and for
``retry_interval`` seconds after an error calls fail fast without asking the
server.  An outage is logged once when it starts (with the server's URL) and
once when it ends (:class:`kvindex.redis_conn.RedisLink`, shared with the
index).  The index mirror follows the same rule (its
:class:`kvindex.contract.IndexUnavailable` is counted, not raised).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from typing import Any

import msgspec
import numpy as np
from prometheus_client.core import CounterMetricFamily
from prometheus_client.registry import Collector

from connector.retained import DEFAULT_TTL, HeldIndex, RetainedEntry, RetainedStats, checked_retained
from connector.params import RemoteKVParams
from kvindex.contract import IndexUnavailable
from kvindex.redis_conn import RedisLink
from kvindex.tiers import DECODE_RETAINED

__all__ = ["RedisRetainedStore", "RetainedStoreMetrics", "DEFAULT_RETAINED_PREFIX"]

#: Key prefix of the store when none is given.
DEFAULT_RETAINED_PREFIX = "kvindex:{retained}:"

#: Longest ttl / grace (s) the store takes (~10 years): the key TTL in ms must fit the server's range.
MAX_TTL = 3.2e8


def _cid(conversation_id: str) -> bytes:
    """The key bytes of a conversation id: UTF-8, lone surrogates kept (aiohttp decodes undecodable
    header bytes to them), so distinct ids stay distinct keys."""
    return conversation_id.encode("utf-8", "surrogatepass")

_COMMON = r"""
local P = ARGV[1]
local RZ = P .. 'rz'
local function rkey(cid) return P .. 'r:' .. cid end
local function server_now()
  local t = redis.call('TIME')
  return tonumber(t[1]) + tonumber(t[2]) / 1000000
end
"""

# ARGV: P, cid, blob, uses, expiry (s), key ttl (ms) -> {old blob or false, old was live 0/1}
_PUT = r"""
local k = rkey(ARGV[2])
local old = redis.call('HGET', k, 'entry')
local live = 0
if old then
  local e = redis.call('ZSCORE', RZ, ARGV[2])
  if e and tonumber(e) > server_now() then live = 1 end
end
redis.call('DEL', k)
redis.call('HSET', k, 'entry', ARGV[3], 'uses', ARGV[4])
redis.call('PEXPIRE', k, ARGV[6])
redis.call('ZADD', RZ, ARGV[5], ARGV[2])
return {old or false, live}
"""

# ARGV: P, cid, consume (0/1) -> false | {blob, uses before, ended 0/1}
_TAKE = r"""
local cid = ARGV[2]
local e = redis.call('ZSCORE', RZ, cid)
if not e or tonumber(e) <= server_now() then return false end
local k = rkey(cid)
local v = redis.call('HMGET', k, 'entry', 'uses')
if not v[1] then
  redis.call('ZREM', RZ, cid)
  return false
end
local uses = tonumber(v[2])
if ARGV[3] ~= '1' then return {v[1], uses, 0} end
if uses <= 1 then
  redis.call('DEL', k)
  redis.call('ZREM', RZ, cid)
  return {v[1], uses, 1}
end
redis.call('HINCRBY', k, 'uses', -1)
return {v[1], uses, 0}
"""

# ARGV: P, cid -> blob or false
_DISCARD = r"""
local k = rkey(ARGV[2])
local old = redis.call('HGET', k, 'entry')
redis.call('DEL', k)
local live = redis.call('ZREM', RZ, ARGV[2])
if live == 0 then return false end
return old or false
"""

# ARGV: P, limit -> {blob or false, ...} of the entries that expired (deleted now)
_EXPIRE = r"""
local cids = redis.call('ZRANGEBYSCORE', RZ, '-inf', server_now(), 'LIMIT', 0, tonumber(ARGV[2]))
local out = {}
for _, cid in ipairs(cids) do
  local k = rkey(cid)
  out[#out + 1] = redis.call('HGET', k, 'entry') or false
  redis.call('DEL', k)
  redis.call('ZREM', RZ, cid)
end
return out
"""

# ARGV: P -> {live entries, conversation ids by expiry...}
_LIVE = r"""
local ids = redis.call('ZRANGEBYSCORE', RZ, '(' .. server_now(), '+inf')
return ids
"""


class RedisRetainedStore:
    """conversation_id -> :class:`RetainedEntry` in Redis, shared by router replicas.

    Args:
        index: where the entries are mirrored (tier ``tier``; usually the
            shared :class:`kvindex.redis_index.RedisKVBlockIndex`); None = nowhere.
        ttl: seconds an entry lives after D's answer was stored (0 < ttl;
            default 450, below vLLM's decoder_kv_blocks_ttl of 480).
        max_uses: pulls per entry (>= 1; default 1 = use once).
        url / client: the Redis server (a ``redis.Redis`` client is shared).
        key_prefix: prefix of the store's keys.
        grace: seconds the server keeps an entry's key past its expiry, so
            that :meth:`expire` can still take its keys out of the index.
        tier: the index tier of the mirrored keys (default ``decode_retained``).
        socket_timeout: seconds per call before it counts as an error (with ``url``).
        retry_interval: seconds during which calls fail fast after an error.

    Raises:
        ValueError: a non-positive ttl or max_uses, or neither url nor client.
        (Never a Redis error: see the module docstring, "Outage".)
    """

    def __init__(
        self,
        index: HeldIndex | None = None,
        *,
        ttl: float = DEFAULT_TTL,
        max_uses: int = 1,
        url: str | None = None,
        client: Any = None,
        key_prefix: str = DEFAULT_RETAINED_PREFIX,
        grace: float = 60.0,
        tier: str = DECODE_RETAINED,
        socket_timeout: float = 2.0,
        retry_interval: float = 0.5,
    ) -> None:
        if not 0 < ttl <= MAX_TTL:
            raise ValueError(f"ttl must be in (0, {MAX_TTL:g}] s, got {ttl}")
        if max_uses < 1:
            raise ValueError(f"max_uses must be >= 1, got {max_uses}")
        if not 0 <= grace <= MAX_TTL:
            raise ValueError(f"grace must be in [0, {MAX_TTL:g}] s, got {grace}")
        self.link = RedisLink(
            "retained store", url=url, client=client, socket_timeout=socket_timeout, retry_interval=retry_interval
        )
        self.retry_interval = retry_interval
        self.client = client = self.link.client
        self.index = index
        self.ttl = float(ttl)
        self.max_uses = max_uses
        self.key_prefix = key_prefix
        self.grace = float(grace)
        self.tier = tier
        self._scripts = {
            name: client.register_script(_COMMON + body)
            for name, body in (("put", _PUT), ("take", _TAKE), ("discard", _DISCARD), ("expire", _EXPIRE),
                               ("live", _LIVE))
        }
        self._encode = msgspec.msgpack.Encoder().encode
        self._decode = msgspec.msgpack.Decoder(RetainedEntry).decode
        self._lock = threading.Lock()
        self._c = dict.fromkeys(
            ("stored", "replaced", "used_up", "expired", "evicted", "discarded"), 0
        )

    # ------------------------------------------------------------------ plumbing

    def _call(self, fn: Any, default: Any) -> Any:
        """``fn()``'s answer, or ``default`` (counted; an outage logged once) when the server is unreachable."""
        return self.link.call(fn, default)

    def _script(self, name: str, *args: Any, default: Any = None) -> Any:
        return self._call(lambda: self._scripts[name](args=(self.key_prefix, *args)), default)

    # ------------------------------------------------------------------ write

    def put(
        self,
        conversation_id: str,
        decode_pod: str,
        params: RemoteKVParams,
        tokens: Sequence[int] | np.ndarray,
        request_keys: Sequence[int] | np.ndarray,
    ) -> RetainedEntry:
        """Store D's answer for ``conversation_id``, replacing any older entry (every replica sees it).

        Raises ValueError as :meth:`connector.retained.RetainedStore.put`.
        """
        toks, keys = checked_retained(params, tokens, request_keys)
        self.expire()
        server_time = self._call(self.client.time, None)
        now = time.time() if server_time is None else server_time[0] + server_time[1] / 1e6
        entry = RetainedEntry(
            conversation_id=conversation_id, decode_pod=decode_pod, params=params, tokens=toks,
            request_keys=keys, created=now, expiry=now + self.ttl, uses_left=self.max_uses,
        )
        if server_time is None:
            return entry  # not stored: the next turn recomputes
        # held first: a reader never sees the entry without its index mirror
        mirrored = False
        if self.index is not None and keys:
            try:
                self.index.add_held(decode_pod, keys, self.tier)
                mirrored = True
            except IndexUnavailable:
                self.link.failed()  # counted; the entry is stored without its mirror
        res = self._script(
            "put", _cid(conversation_id), self._blob(entry), self.max_uses, repr(entry.expiry),
            int((self.ttl + self.grace) * 1000),
        )
        if res is None:
            if mirrored:
                self._unmirror(entry)
            return entry  # not stored
        old, live = res
        with self._lock:
            self._c["stored"] += 1
            if old:
                self._c["replaced" if live else "expired"] += 1
        if old:
            self._unmirror(self._decode(old))
        return entry

    def take(self, conversation_id: str) -> RetainedEntry | None:
        """Use the entry once (for a pull): returns it, or None if absent, expired or already used up.

        Atomic on the server: of several replicas taking the same entry at
        once, exactly as many as it has uses get it.
        """
        self.expire()
        res = self._script("take", _cid(conversation_id), "1")
        if not res:
            return None
        blob, uses, ended = res
        entry = msgspec.structs.replace(self._decode(blob), conversation_id=conversation_id, uses_left=int(uses))
        if ended:
            with self._lock:
                self._c["used_up"] += 1
            self._unmirror(entry)
        return entry

    def discard(self, conversation_id: str) -> bool:
        """Forget the entry (e.g. the guard found nothing reusable); True if there was a live one."""
        old = self._script("discard", _cid(conversation_id))
        if not old:
            return False
        with self._lock:
            self._c["discarded"] += 1
        self._unmirror(self._decode(old))
        return True

    def expire(self, limit: int = 1000) -> int:
        """Delete up to ``limit`` entries whose expiry has passed (any replica's); returns how many."""
        blobs = self._script("expire", limit, default=[])
        for blob in blobs:
            if blob:
                self._unmirror(self._decode(blob))
        with self._lock:
            self._c["expired"] += len(blobs)
        return len(blobs)

    # ------------------------------------------------------------------- read

    def get(self, conversation_id: str) -> RetainedEntry | None:
        """The live entry (spends no use), or None."""
        res = self._script("take", _cid(conversation_id), "0")
        if not res:
            return None
        return msgspec.structs.replace(self._decode(res[0]), conversation_id=conversation_id, uses_left=int(res[1]))

    def __len__(self) -> int:
        return len(self.conversations())

    def __contains__(self, conversation_id: object) -> bool:
        return isinstance(conversation_id, str) and self.get(conversation_id) is not None

    def conversations(self) -> list[str]:
        """Live conversation ids, soonest to expire first."""
        return [c.decode("utf-8", "surrogatepass") for c in self._script("live", default=[])]

    def metrics(self, namespace: str | None = None) -> RetainedStoreMetrics:
        """A Prometheus collector of the store's Redis errors (register it where the router's metrics are)."""
        return RetainedStoreMetrics(self, namespace)

    def stats(self) -> RetainedStats:
        """This process's counters and the shared number of live entries (see :class:`RetainedStats`)."""
        n = len(self)
        with self._lock:
            return RetainedStats(entries=n, redis_errors=self.link.error_count, **self._c)

    # -------------------------------------------------------------- internals

    def _blob(self, entry: RetainedEntry) -> bytes:
        # the conversation id is the key (it may hold lone surrogates, which msgpack cannot encode)
        return self._encode(msgspec.structs.replace(entry, conversation_id=""))

    def _unmirror(self, entry: RetainedEntry) -> None:
        if self.index is not None and entry.request_keys:
            try:
                self.index.remove_held(entry.decode_pod, entry.request_keys, self.tier)
            except IndexUnavailable:
                self.link.failed()  # counted; the index's held_ttl ends the mirror


class RetainedStoreMetrics(Collector):
    """``kvindex_retained_redis_errors_total``: the store's calls that could not reach its Redis server
    (answered as an empty store), read at scrape time.  ``namespace`` prefixes the name, as
    :class:`kvindex.facade.metrics.KVIndexMetrics` does."""

    def __init__(self, store: RedisRetainedStore, namespace: str | None = None) -> None:
        self._store = store
        self._name = "kvindex_retained_redis_errors" if namespace is None else f"{namespace}_kvindex_retained_redis_errors"

    def describe(self) -> list[CounterMetricFamily]:
        return [CounterMetricFamily(self._name, "Retained-store calls that could not reach Redis.")]

    def collect(self) -> list[CounterMetricFamily]:
        f = CounterMetricFamily(self._name, "Retained-store calls that could not reach Redis.")
        f.add_metric([], self._store.link.error_count)
        return [f]
