"""Client side of vLLM's KV-event replay protocol.

Mirrors vllm/distributed/kv_events.py ZmqEventPublisher's replay service
(vLLM 0.32): the engine binds a ROUTER socket at ``replay_endpoint``; a DEALER
sends ``[b"", start_seq (8 bytes big-endian)]`` and receives one message per
buffered batch with seq >= start_seq, each ``[b"", topic, seq, payload]``
(engines before vLLM PR #45177 send ``[b"", seq, payload]``), then an end
marker whose seq frame is eight 0xFF bytes and whose payload is empty.  A DEALER
(not REQ) is needed because there are many replies to one request.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator

import zmq

__all__ = ["END_SEQ_FRAME", "ReplayClient", "ReplayCut"]

END_SEQ_FRAME = b"\xff" * 8


class ReplayCut(Exception):
    """A replay was cut off by the client's bounds before its end marker came.

    ``batches``: how many batches it yielded before the cut.  The batches
    after them were not read: the caller asks again from the first one it
    lacks.
    """

    def __init__(self, endpoint: str, batches: int, why: str) -> None:
        super().__init__(f"replay from {endpoint} cut off after {batches} batches ({why})")
        self.batches = batches


class ReplayClient:
    """Replay requests from one thread, one DEALER socket per endpoint.

    Not thread-safe (ZMQ sockets are not): each pool shard owns one.

    Args:
        context: ZMQ context.
        timeout: seconds to wait for each reply before giving up.
        on_error: called with (kind, message) for a malformed reply, which is
            then skipped.
        max_batches: a reply stream longer than this without its end marker is
            cut off (:class:`ReplayCut`; an engine buffers 10,000 batches by default).
        max_seconds: a whole replay taking longer than this is cut off
            (:class:`ReplayCut`; default: 10 x timeout).
    """

    def __init__(
        self,
        context: zmq.Context,
        *,
        timeout: float = 2.0,
        on_error: Callable[[str, str], None] | None = None,
        max_batches: int = 20_000,
        max_seconds: float | None = None,
    ) -> None:
        self._ctx = context
        self._timeout_ms = max(1, int(timeout * 1000))
        self._max_batches = max_batches
        self._max_seconds = 10 * timeout if max_seconds is None else max_seconds
        self._sockets: dict[str, zmq.Socket] = {}
        self.on_error = on_error

    def _socket(self, endpoint: str) -> zmq.Socket:
        sock = self._sockets.get(endpoint)
        if sock is None:
            sock = self._ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            sock.connect(endpoint)
            self._sockets[endpoint] = sock
        return sock

    def _discard(self, endpoint: str) -> None:
        sock = self._sockets.pop(endpoint, None)
        if sock is not None:
            sock.close(linger=0)

    def request(self, endpoint: str, start_seq: int) -> Iterator[tuple[bytes | None, bytes, bytes]]:
        """Yield ``(topic or None, seq frame, payload)`` for each buffered batch from ``start_seq``.

        Stops at the end marker.  Raises TimeoutError when a reply does not
        come within the timeout, :class:`ReplayCut` when a batch arrives
        after ``max_batches`` were yielded or after ``max_seconds`` (a
        stream exactly ``max_batches`` long still ends normally); in both
        cases the socket is discarded so that late replies cannot be mistaken
        for the next request's.  ValueError for a start_seq outside
        0..2**64-2.
        """
        if not 0 <= start_seq < 2**64 - 1:
            raise ValueError(f"start_seq out of range: {start_seq}")
        sock = self._socket(endpoint)
        finished = False
        deadline = time.monotonic() + self._max_seconds
        yielded = 0
        try:
            sock.send_multipart([b"", start_seq.to_bytes(8, "big")])
            while True:
                if time.monotonic() > deadline:
                    raise ReplayCut(endpoint, yielded, f"longer than {self._max_seconds:g} s")
                if not sock.poll(self._timeout_ms, zmq.POLLIN):
                    raise TimeoutError(f"no replay reply from {endpoint}")
                frames = sock.recv_multipart()
                if len(frames) == 4 and frames[0] == b"":
                    topic, seq, payload = frames[1], frames[2], frames[3]
                elif len(frames) == 3 and frames[0] == b"":
                    topic, seq, payload = None, frames[1], frames[2]
                else:
                    if self.on_error is not None:
                        self.on_error("replay_frames", f"replay reply with {len(frames)} frames")
                    continue
                if seq == END_SEQ_FRAME:
                    finished = True
                    return
                if yielded >= self._max_batches:
                    raise ReplayCut(endpoint, yielded, f"more than {self._max_batches} batches")
                yielded += 1
                yield topic, seq, payload
        finally:
            if not finished:
                self._discard(endpoint)

    def close(self) -> None:
        """Close every socket."""
        for ep in list(self._sockets):
            self._discard(ep)
