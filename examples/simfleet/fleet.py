"""A fleet of simulated vLLM engines, each in its own process.

Each engine is a :class:`~examples.simfleet.engine.SimEngine` running in a
process started with multiprocessing's spawn context and controlled over a
pipe.  Engine processes are daemonic, stop on :meth:`SimFleet.close`, and stop
by themselves when the parent process goes away (the pipe closes or the parent
is no longer alive).  Scripts that start a fleet must guard their entry point
with ``if __name__ == "__main__":`` (spawn re-imports the main module).

Example::

    with SimFleet([EngineConfig(pod="pod-a", replay=True), {"pod": "pod-b"}]) as fleet:
        sub.connect(fleet.endpoint("pod-a"))
        fleet.serve("pod-a", list(range(64)))
"""

from __future__ import annotations

import atexit
import multiprocessing
import multiprocessing.connection
import socket
import threading
import weakref
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, fields
from typing import Any

from examples.simfleet.engine import EngineStats, SimEngine, validate_engine_args

#: Endpoint used when a config names neither an endpoint nor a port: a bound,
#: OS-chosen loopback port (the resolved address is reported back).
LOOPBACK_ANY = "tcp://127.0.0.1:*"


def free_tcp_port(host: str = "127.0.0.1") -> int:
    """Return a TCP port on ``host`` that was free a moment ago.

    Another process may take it before it is used; prefer endpoints like
    ``tcp://127.0.0.1:*`` (the default of :class:`EngineConfig`) where possible.
    """
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        port: int = s.getsockname()[1]
        return port


@dataclass(frozen=True)
class EngineConfig:
    """Configuration of one engine of a :class:`SimFleet`.

    Attributes:
        pod: pod id (topic ``kv@<pod>@<model>``).
        name: the fleet's handle for this engine; defaults to ``pod`` (set it when
            several DP ranks share a pod).
        model: model name in the topic.
        endpoint: PUB endpoint (bound or connected as vLLM does, see SimEngine);
            None -> ``tcp://127.0.0.1:<pub_port>`` bound, or a free loopback port.
        pub_port: loopback port to bind the PUB socket on when ``endpoint`` is None.
        replay: give the engine a replay ROUTER.
        replay_endpoint: ROUTER endpoint when ``replay``; None -> loopback
            ``replay_port`` or a free loopback port.
        replay_port: loopback port for the ROUTER when ``replay_endpoint`` is None.
        dp_rank, block_size, capacity_blocks, encoding, hash_form, buffer_steps,
        hash_seed, hash_algo, replay_with_topic: as in SimEngine.
    """

    pod: str
    name: str | None = None
    model: str = "sim-model"
    endpoint: str | None = None
    pub_port: int | None = None
    replay: bool = False
    replay_endpoint: str | None = None
    replay_port: int | None = None
    dp_rank: int | None = 0
    block_size: int = 16
    capacity_blocks: int = 1024
    encoding: str = "map"
    hash_form: str = "uint64"
    buffer_steps: int = 10_000
    hash_seed: str = "sim"
    hash_algo: str = "sha256"
    replay_with_topic: bool = True

    @property
    def key(self) -> str:
        """The fleet's handle for this engine: ``name`` or else ``pod``."""
        return self.name or self.pod

    def engine_kwargs(self) -> dict[str, Any]:
        """Return the keyword arguments of the SimEngine this config describes."""
        if self.endpoint is not None:
            endpoint = self.endpoint
        elif self.pub_port is not None:
            endpoint = f"tcp://127.0.0.1:{self.pub_port}"
        else:
            endpoint = LOOPBACK_ANY
        replay_endpoint: str | None = None
        if self.replay:
            if self.replay_endpoint is not None:
                replay_endpoint = self.replay_endpoint
            elif self.replay_port is not None:
                replay_endpoint = f"tcp://127.0.0.1:{self.replay_port}"
            else:
                replay_endpoint = LOOPBACK_ANY
        return {
            "pod": self.pod,
            "model": self.model,
            "endpoint": endpoint,
            "replay_endpoint": replay_endpoint,
            "dp_rank": self.dp_rank,
            "block_size": self.block_size,
            "capacity_blocks": self.capacity_blocks,
            "encoding": self.encoding,
            "hash_form": self.hash_form,
            "buffer_steps": self.buffer_steps,
            "hash_seed": self.hash_seed,
            "hash_algo": self.hash_algo,
            "replay_with_topic": self.replay_with_topic,
            "pub_bind": True if self.endpoint is None else None,
        }


def _child_main(conn: multiprocessing.connection.Connection, kwargs: dict[str, Any]) -> None:
    """Engine process entry point: build the engine, then answer commands from the pipe."""
    try:
        engine = SimEngine(**kwargs)
    except BaseException as exc:
        try:
            conn.send(("err", f"{type(exc).__name__}: {exc}"))
        finally:
            conn.close()
        return
    conn.send(("ok", (engine.endpoint, engine.replay_endpoint)))
    parent = multiprocessing.parent_process()
    try:
        while True:
            if not conn.poll(0.5):
                if parent is not None and not parent.is_alive():
                    break
                continue
            try:
                method, args = conn.recv()
            except (EOFError, OSError):
                break
            if method == "close":
                break
            try:
                result = getattr(engine, method)(*args)
            except (ValueError, TypeError) as exc:
                conn.send((type(exc).__name__, str(exc)))
            except BaseException as exc:
                conn.send(("err", f"{type(exc).__name__}: {exc}"))
            else:
                conn.send(("ok", result))
    except (EOFError, OSError, BrokenPipeError):
        pass
    finally:
        engine.close()
        conn.close()


_ALLOWED = frozenset(
    {"serve", "lookup", "offload", "reset_prefix_cache", "restart", "drop_next",
     "stats", "cached_blocks", "hashes"}
)


class _Handle:
    """Parent-side handle of one engine process."""

    def __init__(self, cfg: EngineConfig, proc: Any, conn: multiprocessing.connection.Connection) -> None:
        self.cfg = cfg
        self.proc = proc
        self.conn = conn
        self.lock = threading.Lock()
        self.endpoint: str = ""
        self.replay_endpoint: str | None = None


class SimFleet:
    """Run several simulated engines, each in its own process, and control them.

    Args:
        engines: one EngineConfig (or a mapping of its fields) per engine; the
            ``key`` (name or pod) of each must be unique.
        start_timeout: seconds to wait for all engine processes to come up.
        call_timeout: seconds to wait for an answer to a command.

    Raises:
        ValueError: no engines, duplicate keys or unknown config fields.
        RuntimeError: an engine process failed to start (the fleet is closed).
    """

    def __init__(
        self,
        engines: Iterable[EngineConfig | Mapping[str, Any]],
        *,
        start_timeout: float = 60.0,
        call_timeout: float = 30.0,
    ) -> None:
        known = {f.name for f in fields(EngineConfig)}
        cfgs: list[EngineConfig] = []
        for e in engines:
            if isinstance(e, EngineConfig):
                cfgs.append(e)
            elif isinstance(e, Mapping):
                unknown = set(e) - known
                if unknown:
                    raise ValueError(f"unknown engine config fields: {sorted(unknown)}")
                cfgs.append(EngineConfig(**e))
            else:
                raise TypeError(f"engine config must be EngineConfig or a mapping, got {type(e).__name__}")
        if not cfgs:
            raise ValueError("a fleet needs at least one engine")
        keys = [c.key for c in cfgs]
        if len(set(keys)) != len(keys):
            raise ValueError(f"engine names must be unique, got {keys}")
        for c in cfgs:  # fail early, in the caller's process, on bad values
            validate_engine_args(**c.engine_kwargs())

        self._call_timeout = call_timeout
        self._closed = False
        self._handles: dict[str, _Handle] = {}
        ctx = multiprocessing.get_context("spawn")
        try:
            for c in cfgs:
                parent_conn, child_conn = ctx.Pipe()
                proc = ctx.Process(
                    target=_child_main,
                    args=(child_conn, c.engine_kwargs()),
                    name=f"simengine-{c.key}",
                    daemon=True,
                )
                proc.start()
                child_conn.close()
                self._handles[c.key] = _Handle(c, proc, parent_conn)
            for h in self._handles.values():
                if not h.conn.poll(start_timeout):
                    raise RuntimeError(f"engine {h.cfg.key!r} did not start within {start_timeout}s")
                status, value = h.conn.recv()
                if status != "ok":
                    raise RuntimeError(f"engine {h.cfg.key!r} failed to start: {value}")
                h.endpoint, h.replay_endpoint = value
        except BaseException:
            self.close()
            raise
        _LIVE.add(self)

    # ----------------------------------------------------------- queries

    @property
    def names(self) -> list[str]:
        """The engines' handles (EngineConfig.key), in config order."""
        return list(self._handles)

    def config(self, name: str) -> EngineConfig:
        """Return the config of engine ``name``."""
        return self._handle(name).cfg

    def endpoint(self, name: str) -> str:
        """Return engine ``name``'s PUB endpoint (resolved if bound)."""
        return self._handle(name).endpoint

    def replay_endpoint(self, name: str) -> str | None:
        """Return engine ``name``'s bound replay ROUTER endpoint, or None."""
        return self._handle(name).replay_endpoint

    def topic(self, name: str) -> bytes:
        """Return engine ``name``'s topic ``kv@<pod>@<model>``."""
        cfg = self._handle(name).cfg
        return f"kv@{cfg.pod}@{cfg.model}".encode()

    def is_alive(self, name: str) -> bool:
        """Return True while engine ``name``'s process runs."""
        return bool(self._handles[name].proc.is_alive())

    # ---------------------------------------------------------- commands

    def serve(self, name: str, tokens: Sequence[int]) -> int:
        """Serve one request on engine ``name`` (SimEngine.serve); returns hit tokens."""
        toks = tokens.tolist() if hasattr(tokens, "tolist") else [int(t) for t in tokens]
        return int(self._call(name, "serve", toks))

    def lookup(self, name: str, tokens: Sequence[int]) -> int:
        """Return the hit tokens engine ``name`` would report for ``tokens``, changing nothing."""
        toks = tokens.tolist() if hasattr(tokens, "tolist") else [int(t) for t in tokens]
        return int(self._call(name, "lookup", toks))

    def hashes(self, name: str, tokens: Sequence[int]) -> list[int]:
        """Return engine ``name``'s uint64 block hashes for the full blocks of ``tokens``."""
        toks = tokens.tolist() if hasattr(tokens, "tolist") else [int(t) for t in tokens]
        return list(self._call(name, "hashes", toks))

    def offload(self, name: str, n_blocks: int) -> list[int]:
        """Offload up to ``n_blocks`` blocks to CPU on engine ``name`` (SimEngine.offload)."""
        return list(self._call(name, "offload", n_blocks))

    def reset(self, name: str) -> None:
        """Reset engine ``name``'s prefix cache (publishes AllBlocksCleared)."""
        self._call(name, "reset_prefix_cache")

    def restart(self, name: str) -> None:
        """Restart engine ``name`` like a new process (seq from 0, empty cache and buffer)."""
        self._call(name, "restart")

    def drop_next(self, name: str, n: int) -> None:
        """Make engine ``name`` withhold its next ``n`` batches from PUB (kept for replay)."""
        self._call(name, "drop_next", n)

    def stats(self, name: str) -> EngineStats:
        """Return engine ``name``'s counters."""
        result: EngineStats = self._call(name, "stats")
        return result

    def cached(self, name: str) -> dict[int, frozenset[str]]:
        """Return engine ``name``'s cached blocks: uint64 hash -> tiers ("gpu", "cpu")."""
        return dict(self._call(name, "cached_blocks"))

    def close(self) -> None:
        """Stop every engine process (politely, then terminate, then kill). Idempotent."""
        if self._closed:
            return
        self._closed = True
        _LIVE.discard(self)
        for h in self._handles.values():
            try:
                with h.lock:
                    h.conn.send(("close", ()))
            except (OSError, ValueError):
                pass
        for h in self._handles.values():
            h.proc.join(timeout=5.0)
            if h.proc.is_alive():
                h.proc.terminate()
                h.proc.join(timeout=5.0)
            if h.proc.is_alive():
                h.proc.kill()
                h.proc.join(timeout=5.0)
            h.conn.close()

    def __enter__(self) -> SimFleet:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---------------------------------------------------------- internals

    def _handle(self, name: str) -> _Handle:
        try:
            return self._handles[name]
        except KeyError:
            raise KeyError(f"no engine named {name!r}; have {list(self._handles)}") from None

    def _call(self, name: str, method: str, *args: Any) -> Any:
        if method not in _ALLOWED:
            raise ValueError(f"unknown engine command {method!r}")
        if self._closed:
            raise RuntimeError("the fleet is closed")
        h = self._handle(name)
        with h.lock:
            h.conn.send((method, args))
            if not h.conn.poll(self._call_timeout):
                raise RuntimeError(f"engine {name!r} did not answer {method} within {self._call_timeout}s")
            status, value = h.conn.recv()
        if status == "ValueError":
            raise ValueError(value)
        if status == "TypeError":
            raise TypeError(value)
        if status != "ok":
            raise RuntimeError(f"engine {name!r} failed {method}: {value}")
        return value


_LIVE: weakref.WeakSet[SimFleet] = weakref.WeakSet()


@atexit.register
def _close_live_fleets() -> None:
    for fleet in list(_LIVE):
        fleet.close()


__all__ = ["LOOPBACK_ANY", "EngineConfig", "SimFleet", "free_tcp_port"]
