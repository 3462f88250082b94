"""The Redis connection rules shared by the Redis-backed stores.

Used by :class:`kvindex.redis_index.RedisKVBlockIndex` and
:class:`connector.redis_retained.RedisRetainedStore`: one client per store
with a short socket timeout, one immediate retry after a connection error
and none after a timeout; after an error calls fail fast for
``retry_interval`` seconds; every failed call is counted; an outage is
logged once when it starts (with the server's URL, at most once per
``log_interval`` when the server flaps) and once when it ends.  Needs the
``redis`` package, imported when a :class:`RedisLink` is built.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any
from urllib.parse import urlsplit, urlunsplit

__all__ = ["LAYOUT", "LayoutMismatch", "RedisLink", "layout_error", "redacted_url"]

#: Version of the Redis index's data layout, kept in its key ``layout`` (version 1 had no such key).
LAYOUT = b"3"


class LayoutMismatch(RuntimeError):
    """The server holds the index's prefix in another data layout (an older or newer kvindex wrote it).

    Raised by every call of :class:`kvindex.redis_index.RedisKVBlockIndex` until the keys are deleted
    (its ``drop_all()``, or by hand) or another ``key_prefix`` is used: two layouts would misread each other.
    """


def layout_error(client: Any, prefix: str, url: str) -> LayoutMismatch | None:
    """Check the layout of the index under ``prefix`` (marking a fresh one as :data:`LAYOUT`); the error or None.

    The index writes ``layout`` before its ``epoch`` key, so an ``epoch`` without ``layout`` is version 1.
    """
    had_epoch = client.exists(prefix + "epoch")
    cur = client.get(prefix + "layout")
    if cur is None and not had_epoch:
        cur = client.set(prefix + "layout", LAYOUT, nx=True, get=True) or LAYOUT
    if cur == LAYOUT:
        return None
    return LayoutMismatch(
        f"Redis at {url} holds the kvindex index {prefix!r} in layout {(cur or b'1').decode(errors='replace')}, "
        f"this kvindex reads layout {LAYOUT.decode()}: delete its keys (RedisKVBlockIndex.drop_all()) and let "
        "the routers rebuild it from the engines' replay buffers, or use another key_prefix")

log = logging.getLogger("kvindex.redis")


def redacted_url(url: str) -> str:
    """``url`` with its password (if any) replaced by ``***``, fit for logs."""
    try:
        parts = urlsplit(url)
        if parts.password is None:
            return url
        user = parts.username or ""
        host = parts.hostname or ""
        if ":" in host:
            host = f"[{host}]"
        netloc = f"{user}:***@{host}" + (f":{parts.port}" if parts.port else "")
        return urlunsplit(parts._replace(netloc=netloc))
    except ValueError:
        return "<unparseable url>"


def _client_url(client: Any) -> str:
    """A URL naming a given client's server (for logs)."""
    try:
        kw = client.connection_pool.connection_kwargs
        if "path" in kw:
            return f"unix://{kw['path']}"
        return f"redis://{kw.get('host', '?')}:{kw.get('port', '?')}/{kw.get('db', 0)}"
    except AttributeError:
        return repr(client)


def _no_retry_after_timeout(redis: Any) -> Any:
    """One immediate retry after a connection error, none after a timeout.

    A call that timed out may still run on a slow server; sent again, a
    script that is not idempotent (``add_held`` counts references,
    ``take`` spends a use) would run twice.
    """
    return redis.retry.Retry(redis.backoff.NoBackoff(), 1, supported_errors=(redis.exceptions.ConnectionError,))


class RedisLink:
    """A Redis client and its outage state.

    Args:
        what: the store's name in log lines (e.g. ``"kvindex index"``).
        url / client: the server (a given client is used as is).
        socket_timeout: seconds per call (with ``url``).
        retry_interval: seconds calls fail fast after an error (>= 0).
        log_interval: at most one outage line per this many seconds.

    Raises ValueError with neither url nor client.
    """

    def __init__(
        self,
        what: str,
        *,
        url: str | None = None,
        client: Any = None,
        socket_timeout: float = 2.0,
        retry_interval: float = 0.5,
        log_interval: float = 60.0,
    ) -> None:
        import redis  # the optional dependency: only the Redis-backed stores need it

        # a server that answers with an error instead of data is unavailable too: BUSY (another client's
        # script ran past busy-reply-threshold), OOM (maxmemory reached), READONLY (a replica after a
        # failover), LOADING, or a script that failed midway (a script's writes are not rolled back)
        self.errors: tuple[type[BaseException], ...] = (
            redis.exceptions.ConnectionError, redis.exceptions.TimeoutError, redis.exceptions.ResponseError,
        )
        if client is None:
            if url is None:
                raise ValueError(f"the {what} needs a Redis url or client")
            client = redis.Redis.from_url(
                url, socket_timeout=socket_timeout, socket_connect_timeout=min(socket_timeout, 0.5),
                retry=_no_retry_after_timeout(redis), health_check_interval=0,
            )
        self.client = client
        self.what = what
        self.url = redacted_url(url) if url is not None else _client_url(client)
        self.retry_interval = retry_interval
        self.log_interval = log_interval
        self.error_count = 0  # failed calls (including those failed fast)
        self.outages = 0  # outages seen (a success after failures ends one)
        self._down_until = 0.0
        self._in_outage = False
        self._outage_errors = 0
        self._logged_at: float | None = None
        self._start_logged = False
        self._lock = threading.Lock()

    def down(self) -> bool:
        """True while calls fail fast (``retry_interval`` after an error)."""
        return time.monotonic() < self._down_until

    def failed(self, exc: BaseException | None = None) -> None:
        """Count one failed call; with ``exc`` (the server failed just now) fail fast for a while and
        log the outage's start (once per outage, at most once per ``log_interval``)."""
        now = time.monotonic()
        with self._lock:
            self.error_count += 1
            if self._in_outage:
                self._outage_errors += 1
            if exc is None:
                return
            self._down_until = now + self.retry_interval
            if self._in_outage:
                return
            self._in_outage = True
            self._outage_errors = 1
            self.outages += 1
            self._start_logged = self._logged_at is None or now - self._logged_at >= self.log_interval
            if not self._start_logged:
                return
            self._logged_at = now
        log.warning(
            "%s: Redis at %s unreachable (%s: %s); answering without it and asking again every %.3g s",
            self.what, self.url, type(exc).__name__, exc, self.retry_interval,
        )

    def succeeded(self) -> None:
        """A call got its answer: ends an outage (its end is logged when its start was)."""
        if not self._in_outage:
            return
        with self._lock:
            if not self._in_outage:
                return
            self._in_outage = False
            n, logged = self._outage_errors, self._start_logged
        if logged:
            log.warning("%s: Redis at %s reachable again (%d failed calls during the outage)", self.what, self.url, n)

    def call(self, fn: Any, default: Any = None) -> Any:
        """``fn()``'s answer, or ``default`` (counted) when the server is unreachable or failing."""
        if self.down():
            self.failed()
            return default
        try:
            out = fn()
        except self.errors as exc:
            self.failed(exc)
            return default
        self.succeeded()
        return out
