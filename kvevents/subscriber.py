"""ZMQ subscriber: receives KV-event messages from engines and feeds the pool.

Two modes, as vLLM's publisher supports both (vllm/distributed/kv_events.py,
vLLM 0.32: an endpoint with ``*``, ``::``, ``ipc://`` or ``inproc://`` is bound
by the engine, any other is connected to):

- connect mode: one SUB socket per engine endpoint (:class:`EngineEndpoint`),
  the engines bind.  Once the connection to an engine with a replay endpoint
  is up (its ZMTP handshake done, so the subscription is on its way to the
  publisher), the pool is asked to replay from seq 0: an index started after
  its engines rebuilds what they still buffer, and a batch the engine
  published before our subscription took effect is in that replay.  Asking
  before the connection is up would lose such a batch until the engine's
  next message revealed the gap (ZMQ's "slow joiner").  The publisher takes
  the subscription a little after the handshake, so the pool asks the
  engine's buffer again a few times until its first live message arrives
  (``EventPool``'s ``rejoin_checks``); the same after a reconnect.
- bind mode: one SUB socket bound at ``bind``, engines configured with that
  address dial in; the pod comes from each message's topic ``kv@<pod>@<model>``
  and replay endpoints are looked up per pod in ``bind_replay``.

With data parallelism each DP rank of an engine publishes on its own port
(base port + rank, the same for the replay port): ``dp_size`` expands one
endpoint into one subscription per rank.

One thread owns every socket; it only moves frames into the pool (decoding
happens in the pool's shards).  A message without exactly three frames is
counted (``frames``) and dropped.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Mapping, Sequence
from urllib.parse import urlsplit

import msgspec
import zmq
from zmq.utils.monitor import recv_monitor_message

from kvevents.pool import EventPool, RawMessage, Source

__all__ = ["EngineEndpoint", "Subscriber", "offset_port", "endpoint_problem", "check_endpoint", "check_engine"]

log = logging.getLogger("kvevents.subscriber")

# monitor events that end a connection attempt without a handshake
_ATTEMPT_FAILED = (
    zmq.EVENT_CONNECT_RETRIED | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
    | zmq.EVENT_HANDSHAKE_FAILED_AUTH
)


class EngineEndpoint(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """One engine's KV-event publisher, as a router configures it.

    endpoint: ZMQ address the engine publishes on, e.g. ``tcp://10.0.0.5:5557``.
    pod: pod id; used when a topic carries none and for replay bootstrap.
    replay_endpoint: the engine's replay ROUTER address, or None.
    engine: ``vllm`` or ``sglang`` payload format.
    dp_rank: rank of the first endpoint; dp_size: ranks published on
        consecutive ports from ``endpoint`` / ``replay_endpoint``.
    model: model name used when the topic carries none.
    topic: ZMQ subscription prefix (empty: everything).
    """

    endpoint: str
    pod: str
    replay_endpoint: str | None = None
    engine: str = "vllm"
    dp_rank: int = 0
    dp_size: int = 1
    model: str | None = None
    topic: str = ""

    def __post_init__(self) -> None:
        if self.dp_size < 1:
            raise ValueError(f"dp_size must be >= 1, got {self.dp_size}")
        if self.dp_rank < 0:
            raise ValueError(f"dp_rank must be >= 0, got {self.dp_rank}")
        if not self.pod:
            raise ValueError("pod must be a non-empty string")

    def ranks(self) -> list[tuple[int, str, str | None]]:
        """(dp_rank, endpoint, replay endpoint) for each DP rank."""
        return [
            (
                self.dp_rank + r,
                offset_port(self.endpoint, r),
                offset_port(self.replay_endpoint, r) if self.replay_endpoint else None,
            )
            for r in range(self.dp_size)
        ]


ENDPOINT_SCHEMES = ("tcp", "ipc", "inproc")

#: longest ipc:// path ZMQ takes (Linux sockaddr_un.sun_path: 108 bytes with the terminating NUL)
_IPC_PATH_MAX = 107


def endpoint_problem(endpoint: object, *, bind: bool = False) -> str | None:
    """What is wrong with a ZMQ endpoint, or None when it is usable.

    Accepted: ``tcp://host:port`` (host a name, an IPv4 address or a
    bracketed IPv6 one; port 1..65535), ``tcp://*:port`` only where we bind
    (``bind=True``: a wildcard host cannot be connected to), ``ipc://path``
    and ``inproc://name``.
    """
    if not isinstance(endpoint, str):
        return f"must be a str, got {type(endpoint).__name__}"
    scheme, sep, rest = endpoint.partition("://")
    if not sep:
        hint = f" (e.g. tcp://{endpoint})" if ":" in endpoint else ""
        return f"{endpoint!r} has no scheme{hint}: use tcp://host:port, ipc://path or inproc://name"
    if scheme not in ENDPOINT_SCHEMES:
        return f"{endpoint!r}: unknown scheme {scheme!r} (expected one of {', '.join(ENDPOINT_SCHEMES)})"
    if not rest:
        return f"{endpoint!r}: empty address"
    if "\x00" in rest:
        return f"{endpoint!r}: NUL character in the address"
    if scheme == "ipc" and len(rest.encode()) > _IPC_PATH_MAX:
        return f"{endpoint!r}: ipc path longer than {_IPC_PATH_MAX} bytes (the socket address limit)"
    if scheme != "tcp":
        return None
    host, colon, port = rest.rpartition(":")
    if not colon or not host:
        return f"{endpoint!r}: a tcp endpoint needs host:port"
    # ASCII digits only: str.isdigit() also takes other scripts' digits (ZMQ refuses them)
    if not (port.isascii() and port.isdigit()) or not 1 <= int(port) <= 65535:
        return f"{endpoint!r}: port {port!r} is not in 1..65535"
    if not host.isascii() or "@" in host:
        return f"{endpoint!r}: invalid host {host!r} (ASCII name or address, no user part)"
    if host.startswith("["):
        if not host.endswith("]") or len(host) < 3 or "[" in host[1:] or "]" in host[:-1]:
            return f"{endpoint!r}: unbalanced brackets around the IPv6 host"
    elif ":" in host:
        return f"{endpoint!r}: put an IPv6 host in brackets, e.g. tcp://[::1]:{port}"
    if not bind and host in ("*", "[::]"):
        return f"{endpoint!r}: a wildcard host can only be bound; name the engine's host"
    if any(c.isspace() or c in "/;" for c in host):
        return f"{endpoint!r}: invalid host {host!r}"
    return None


def check_endpoint(endpoint: object, field: str, *, bind: bool = False) -> None:
    """Raise ValueError naming ``field`` when :func:`endpoint_problem` finds one."""
    problem = endpoint_problem(endpoint, bind=bind)
    if problem is not None:
        raise ValueError(f"{field}: {problem}")


def check_engine(engine: EngineEndpoint, field: str = "engine") -> None:
    """Raise ValueError naming ``field``.endpoint / .replay_endpoint when one is not usable."""
    check_endpoint(engine.endpoint, f"{field}.endpoint")
    if engine.replay_endpoint is not None:
        check_endpoint(engine.replay_endpoint, f"{field}.replay_endpoint")
    if engine.dp_size > 1:
        for name in ("endpoint", "replay_endpoint"):
            value = getattr(engine, name)
            if value is not None and not value.startswith("tcp://"):
                raise ValueError(f"{field}.{name}: dp_size > 1 needs a tcp endpoint (ranks use port + rank)")
            if value is not None and int(value.rpartition(":")[2]) + engine.dp_size - 1 > 65535:
                raise ValueError(f"{field}.{name}: the last DP rank's port (port + dp_size - 1) is past 65535")


def offset_port(endpoint: str, offset: int) -> str:
    """``tcp://host:port`` with ``offset`` added to the port (vLLM's per-DP-rank ports).

    Raises ValueError when offset != 0 and the endpoint has no numeric port.
    """
    if offset == 0:
        return endpoint
    parts = urlsplit(endpoint)
    if parts.port is None:
        raise ValueError(f"cannot offset the port of {endpoint!r}")
    host = parts.hostname or "*"
    if ":" in host:
        host = f"[{host}]"
    return f"{parts.scheme}://{host}:{parts.port + offset}"


class _Link:
    """One connect-mode subscription as its connection monitor sees it."""

    __slots__ = ("sock", "pod", "rank", "bootstrap", "up", "dropped", "failed")

    def __init__(self, sock: zmq.Socket, pod: str, rank: int, bootstrap: Source | None) -> None:
        self.sock = sock
        self.pod = pod
        self.rank = rank
        self.bootstrap = bootstrap  # the source to replay from once the handshake is done (None: no replay)
        self.up = False  # the handshake has completed at least once
        self.dropped = False  # the connection dropped and is not back yet
        self.failed = False  # a connection attempt ended without a handshake (refused, unresolvable, timed out)


class Subscriber:
    """Receives engine KV events over ZMQ and submits them to an :class:`EventPool`.

    Args:
        pool: where messages go (must be started before the subscriber).
        engines: connect-mode endpoints.
        bind: bind-mode address (e.g. ``tcp://*:5557``), or None.
        bind_replay: bind mode: pod -> replay endpoint of its DP rank 0 (rank r
            uses port + r).
        bind_engine: payload format of the engines dialling into ``bind``.
        bind_model: bind mode: the model of messages whose topic names none.
        context: ZMQ context (default: one of its own, allowing ``max_sockets``).
        max_sockets: socket limit of the default context; each engine DP rank
            takes three (its SUB socket and a connection monitor's pair).
        rcvhwm: receive high-water mark per socket (messages).
        max_message_bytes: a larger message makes ZMQ drop that connection
            (it reconnects; the pool then checks the engine as after any
            disconnect), so one hostile peer cannot exhaust memory.
        connect_timeout: seconds one TCP connection attempt may take before
            it counts as failed and is tried again (ZMQ's CONNECT_TIMEOUT), so
            an address that drops packets settles (:meth:`wait_settled`) like
            one that refuses; 0: the operating system's timeout.
    """

    def __init__(
        self,
        pool: EventPool,
        engines: Sequence[EngineEndpoint] = (),
        *,
        bind: str | None = None,
        bind_replay: Mapping[str, str] | None = None,
        bind_engine: str = "vllm",
        bind_model: str | None = None,
        context: zmq.Context | None = None,
        rcvhwm: int = 100_000,
        max_sockets: int = 65_536,
        max_message_bytes: int = 64 << 20,
        connect_timeout: float = 0.0,
    ) -> None:
        if not 0 <= connect_timeout < 3600:
            raise ValueError(f"connect_timeout must be in [0, 3600) seconds, got {connect_timeout}")
        self._connect_timeout_ms = int(connect_timeout * 1000)
        self._max_msg = max_message_bytes
        self.pool = pool
        self._own_ctx = context is None
        if context is None:
            context = zmq.Context()
            context.set(zmq.MAX_SOCKETS, max_sockets)
        self._ctx = context
        self._engines = list(engines)
        self._bind = bind
        self._bind_replay = dict(bind_replay or {})
        self._bind_engine = bind_engine
        self._bind_model = bind_model
        self._rcvhwm = rcvhwm
        self._commands: queue.Queue = queue.Queue()
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self._monitors: dict[zmq.Socket, _Link] = {}
        self._links_lock = threading.Lock()
        self._pending: dict[str, EngineEndpoint] = {}  # added, not yet opened by the subscriber thread
        self.received = 0
        self.disconnects = 0

    # -- lifecycle

    def start(self, timeout: float = 5.0) -> None:
        """Open the sockets (in the subscriber thread) and start receiving.

        Raises the socket error (e.g. zmq.ZMQError for a bad address or a port
        in use) if the sockets could not be opened.
        """
        if self._thread is not None:
            return
        self._error = None
        self._stop.clear()
        self._thread = threading.Thread(target=self._run, name="kvevents-subscriber", daemon=True)
        self._thread.start()
        self._ready.wait(timeout)
        if self._error is not None:
            self._thread.join(timeout)
            self._thread = None
            raise self._error

    def stop(self, timeout: float = 5.0) -> None:
        """Stop receiving and close every socket."""
        if self._thread is None:
            return
        self._stop.set()
        self._thread.join(timeout)
        self._thread = None
        self._ready.clear()

    def add_engine(self, engine: EngineEndpoint) -> None:
        """Subscribe to one more engine (takes effect within one poll interval; :meth:`wait_connected`
        waits for it too)."""
        if not isinstance(engine, EngineEndpoint):
            raise TypeError(f"add_engine takes an EngineEndpoint, got {type(engine).__name__}")
        check_engine(engine)
        with self._links_lock:
            self._pending[engine.pod] = engine
        self._commands.put(("add", engine))

    def remove_engine(self, pod: str) -> None:
        """Unsubscribe from ``pod`` and remove all its blocks from the index."""
        with self._links_lock:
            self._pending.pop(pod, None)
        self._commands.put(("remove", pod))

    # -- thread

    def _source_for_bind(self) -> Source:
        replay = self._bind_replay

        def lookup(pod: str, rank: int) -> str | None:
            ep = replay.get(pod)
            return offset_port(ep, rank) if ep else None

        return Source(pod=None, engine=self._bind_engine, replay=lookup if replay else None, model=self._bind_model)

    def _open(self, sockets: dict[zmq.Socket, Source], owners: dict[str, list[zmq.Socket]], eng: EngineEndpoint) -> None:
        for rank, endpoint, replay in eng.ranks():
            sock = self._ctx.socket(zmq.SUB)
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.RCVHWM, self._rcvhwm)
            sock.setsockopt(zmq.MAXMSGSIZE, self._max_msg)
            sock.setsockopt(zmq.SUBSCRIBE, eng.topic.encode())
            if self._connect_timeout_ms:
                sock.setsockopt(zmq.CONNECT_TIMEOUT, self._connect_timeout_ms)
            # monitored before connecting, so the first handshake is seen: it starts the stream
            # (bootstrap); a dropped connection may be an engine restart: the pool checks the
            # engine when the connection is back; a failed attempt settles the subscription
            monitor = sock.get_monitor_socket(zmq.EVENT_DISCONNECTED | zmq.EVENT_HANDSHAKE_SUCCEEDED | _ATTEMPT_FAILED)
            try:
                sock.connect(endpoint)
            except zmq.ZMQError:
                sock.disable_monitor()
                monitor.close(linger=0)
                sock.close(linger=0)
                raise
            source = Source(pod=eng.pod, engine=eng.engine, replay=replay, dp_rank=rank, model=eng.model)
            sockets[sock] = source
            owners.setdefault(eng.pod, []).append(sock)
            with self._links_lock:
                self._monitors[monitor] = _Link(sock, eng.pod, rank, source if replay is not None else None)
            owners[eng.pod].append(monitor)

    def _run(self) -> None:
        sockets: dict[zmq.Socket, Source] = {}
        owners: dict[str, list[zmq.Socket]] = {}
        poller = zmq.Poller()
        try:
            try:
                if self._bind is not None:
                    sock = self._ctx.socket(zmq.SUB)
                    sock.setsockopt(zmq.LINGER, 0)
                    sock.setsockopt(zmq.RCVHWM, self._rcvhwm)
                    sock.setsockopt(zmq.MAXMSGSIZE, self._max_msg)
                    sock.setsockopt(zmq.SUBSCRIBE, b"")
                    try:
                        sock.bind(self._bind)
                    except zmq.ZMQError:
                        # closed here: the error kept for start() holds this frame, and a socket left
                        # open in that cycle makes the context's collection block in term()
                        sock.close(linger=0)
                        raise
                    sockets[sock] = self._source_for_bind()
                    for pod in self._bind_replay:
                        self.pool.bootstrap(sockets[sock], pod, 0)
                for eng in self._engines:
                    self._open(sockets, owners, eng)
            except BaseException as exc:  # reported to start()
                self._error = exc
                return
            finally:
                self._ready.set()
            for s in list(sockets) + list(self._monitors):
                poller.register(s, zmq.POLLIN)
            submit = self.pool.submit
            while not self._stop.is_set():
                self._drain_commands(sockets, owners, poller)
                ready = [sock for sock, _ev in poller.poll(50)]
                # connection events first: a DISCONNECTED queued before a restarted engine's
                # first messages must reach the pool before them
                for sock in ready:
                    if sock not in sockets:
                        self._on_monitor(sock)
                for sock in ready:
                    source = sockets.get(sock)
                    if source is None:
                        continue
                    for _ in range(1000):  # bounded burst per socket per poll
                        try:
                            frames = sock.recv_multipart(zmq.NOBLOCK)
                        except zmq.Again:
                            break
                        self.received += 1
                        if len(frames) != 3:
                            self.pool.record_error("frames", f"message with {len(frames)} frames (expected 3)")
                            continue
                        submit(RawMessage(source, frames[0], frames[1], frames[2]))
        finally:
            for mon in list(self._monitors):
                self._close_monitor(mon)
            for s in sockets:
                s.close(linger=0)

    def _on_monitor(self, mon: zmq.Socket) -> None:
        link = self._monitors.get(mon)
        if link is None:
            return
        try:
            while mon.poll(0):
                event = recv_monitor_message(mon, zmq.NOBLOCK)
                if event["event"] & _ATTEMPT_FAILED:
                    link.failed = True
                elif event["event"] == zmq.EVENT_DISCONNECTED:
                    link.failed = True
                    self.disconnects += 1
                    link.dropped = True
                    self.pool.disconnected(link.pod, link.rank)
                elif event["event"] == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                    if not link.up:
                        if link.bootstrap is not None:  # queued before up is seen: a flush after waiting covers it
                            self.pool.bootstrap(link.bootstrap, link.pod, link.rank)
                        link.up = True
                    elif link.dropped:
                        link.dropped = False
                        self.pool.reconnected(link.pod, link.rank, link.bootstrap)
        except zmq.ZMQError as exc:
            log.warning("socket monitor for %s failed: %s", link.pod, exc)

    def _close_monitor(self, mon: zmq.Socket) -> None:
        with self._links_lock:
            sock = self._monitors.pop(mon).sock
        try:
            sock.disable_monitor()
        except zmq.ZMQError:
            pass
        mon.close(linger=0)

    def connected(self) -> dict[tuple[str, int], bool]:
        """(pod, dp_rank) -> whether that connect-mode subscription has been up at least once.

        Up means ZMQ's handshake with the engine's publisher completed; an
        engine added with :meth:`add_engine` counts as not up until then.
        Bind mode has no entry (the engines dial in).
        """
        with self._links_lock:
            out = {(pod, rank): False for pod, eng in self._pending.items() for rank, _ep, _rp in eng.ranks()}
            out.update({(link.pod, link.rank): link.up for link in self._monitors.values()})
            return out

    def wait_connected(self, timeout: float = 10.0, poll: float = 0.01) -> bool:
        """Block until every connect-mode subscription has been up at least once (see :meth:`connected`).

        Returns False after ``timeout`` seconds if some engine's publisher has
        not answered (not started yet, unreachable); the subscriber keeps
        trying in the background either way.  Events an engine publishes
        before its subscription is up reach the index only through its
        replay endpoint (bootstrap) or, without one, not at all: a router can
        wait here before its first request.
        """
        deadline = time.monotonic() + timeout
        while True:
            if all(self.connected().values()):
                return True
            if time.monotonic() >= deadline:
                return False
            time.sleep(poll)

    def settled(self) -> dict[tuple[str, int], bool]:
        """(pod, dp_rank) -> whether that connect-mode subscription's first connection attempt has ended:
        up (see :meth:`connected`), or failed (refused, unresolvable, timed out; retried in the background)."""
        with self._links_lock:
            out = {(pod, rank): False for pod, eng in self._pending.items() for rank, _ep, _rp in eng.ranks()}
            out.update({(link.pod, link.rank): link.up or link.failed for link in self._monitors.values()})
            return out

    def wait_settled(self, timeout: float = 10.0, poll: float = 0.005) -> bool:
        """Block until every connect-mode subscription is up or has failed a connection attempt.

        A reachable engine handshakes and one that refuses fails within
        milliseconds; an address that drops packets fails after the
        ``connect_timeout`` given to the subscriber.  Returns False after
        ``timeout`` seconds otherwise.  An engine up by then has had its
        bootstrap replay queued in the pool.
        """
        deadline = time.monotonic() + timeout
        while True:
            if all(self.settled().values()):
                return True
            if time.monotonic() >= deadline:
                return False
            time.sleep(poll)

    def _drain_commands(
        self, sockets: dict[zmq.Socket, Source], owners: dict[str, list[zmq.Socket]], poller: zmq.Poller
    ) -> None:
        while True:
            try:
                cmd, arg = self._commands.get_nowait()
            except queue.Empty:
                return
            if cmd == "add":
                before = set(sockets) | set(self._monitors)
                try:
                    self._open(sockets, owners, arg)
                except zmq.ZMQError as exc:
                    log.error("cannot subscribe to %s: %s", arg.endpoint, exc)
                finally:
                    with self._links_lock:
                        if self._pending.get(arg.pod) is arg:
                            del self._pending[arg.pod]
                for s in (set(sockets) | set(self._monitors)) - before:
                    poller.register(s, zmq.POLLIN)
            elif cmd == "remove":
                owned = owners.pop(arg, [])
                for s in owned:
                    poller.unregister(s)
                for s in owned:
                    if s in self._monitors:
                        self._close_monitor(s)
                for s in owned:
                    if s in sockets:
                        sockets.pop(s)
                        s.close(linger=0)
                self.pool.forget_pod(arg)
