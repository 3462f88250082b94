"""A real ``redis-server`` on a free loopback port, for tests and benches.

:class:`RedisServer` starts Debian's ``redis-server`` binary (``apt-get install
redis-server``; ``.ci/run`` installs it) in a temporary directory with
persistence off (``--save "" --appendonly no``), waits until it answers PING,
and stops it.  It can be stopped and started again on the same port, to test a
Redis outage and the recovery after it.

A missing binary is an error, never a skip: the Redis backend is part of the
suite.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import tempfile
import time

__all__ = ["RedisServer", "free_port"]


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RedisServer:
    """One ``redis-server`` process on ``127.0.0.1:port``.

    Args:
        port: the port (default: a free one).
        binary: path or name of the server binary (default ``redis-server`` on PATH).

    Raises:
        RuntimeError: the binary is missing, or the server did not answer
            PING within ``timeout`` seconds of :meth:`start`.
    """

    def __init__(self, port: int | None = None, binary: str = "redis-server") -> None:
        path = shutil.which(binary)
        if path is None:
            raise RuntimeError(
                f"{binary!r} not found on PATH: install Debian's redis-server package "
                "(apt-get install -y redis-server; .ci/run does it)"
            )
        self.binary = path
        self.port = port or free_port()
        self.dir = tempfile.mkdtemp(prefix="kvindex-redis-")
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        """``redis://127.0.0.1:<port>/0``."""
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self, timeout: float = 30.0) -> RedisServer:
        """Start the server and wait for PING (a no-op if it runs)."""
        if self.proc is not None and self.proc.poll() is None:
            return self
        self.proc = subprocess.Popen(
            [self.binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
             "--dir", self.dir, "--protected-mode", "yes", "--logfile", os.path.join(self.dir, "redis.log")],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=self.dir,
        )
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"redis-server exited with {self.proc.returncode}; log: {self._log()}")
            if self.ping():
                return self
            time.sleep(0.02)
        self.stop()
        raise RuntimeError(f"redis-server on port {self.port} did not answer PING in {timeout} s")

    def ping(self) -> bool:
        """True when the server answers ``PING`` with ``+PONG`` (raw RESP, no client library)."""
        try:
            with socket.create_connection(("127.0.0.1", self.port), timeout=0.5) as s:
                s.sendall(b"PING\r\n")
                return s.recv(16).startswith(b"+PONG")
        except OSError:
            return False

    def stop(self) -> None:
        """Stop the server (SIGTERM, then SIGKILL after 10 s); a no-op if it is not running."""
        proc, self.proc = self.proc, None
        if proc is None or proc.poll() is not None:
            return
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)

    def close(self) -> None:
        """Stop the server and remove its directory."""
        self.stop()
        shutil.rmtree(self.dir, ignore_errors=True)

    def _log(self) -> str:
        try:
            with open(os.path.join(self.dir, "redis.log")) as f:
                return f.read()[-2000:]
        except OSError:
            return "(no log)"

    def __enter__(self) -> RedisServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()
