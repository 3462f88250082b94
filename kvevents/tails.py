"""Ask engines' replay endpoints how far their streams go: the newest seq each has published.

Client side of vLLM's replay protocol (vllm/distributed/kv_events.py, vLLM
0.32; see :mod:`kvevents.replay`), asked of many endpoints at once: one DEALER
per ask sends ``[b"", start_seq]`` and reads the replies up to the end marker,
keeping only the first and last seq, the first payload and the topic.  Used to learn what an
engine has published that the index has not applied yet.
"""

from __future__ import annotations

import time
from collections.abc import Hashable, Mapping
from typing import NamedTuple, TypeVar

import zmq

from kvevents.replay import END_SEQ_FRAME

__all__ = ["Tail", "ask_tails"]

K = TypeVar("K", bound=Hashable)


class Tail(NamedTuple):
    """What a replay endpoint holds from the asked seq on.

    first / last: the oldest and newest buffered seq >= the asked one (None:
    the buffer holds nothing from there); first_payload: the payload of the
    batch at ``first`` (msgpack, undecoded); topic: the topic frame of the
    replies (None: none came, or the engine sends none, as before vLLM PR
    #45177); malformed: replies that were skipped.
    """

    first: int | None
    last: int | None
    first_payload: bytes | None = None
    topic: bytes | None = None
    malformed: int = 0


class _Ask:
    __slots__ = ("first", "last", "payload", "topic", "malformed")

    def __init__(self) -> None:
        self.first: int | None = None
        self.payload: bytes | None = None
        self.last: int | None = None
        self.topic: bytes | None = None
        self.malformed = 0

    def take(self, frames: list[bytes]) -> bool:
        """Note one reply; True at the end marker."""
        if len(frames) == 4 and frames[0] == b"":
            topic, seq, payload = frames[1], frames[2], frames[3]
        elif len(frames) == 3 and frames[0] == b"":
            topic, seq, payload = None, frames[1], frames[2]
        else:
            self.malformed += 1
            return False
        if seq == END_SEQ_FRAME:
            return True
        if len(seq) != 8:
            self.malformed += 1
            return False
        n = int.from_bytes(seq, "big")
        if self.first is None:
            self.first, self.payload = n, payload
        self.last = n if self.last is None else max(self.last, n)
        if topic:
            self.topic = topic
        return False


def ask_tails(
    context: zmq.Context, asks: Mapping[K, tuple[str, int]], timeout: float
) -> dict[K, Tail | None]:
    """Ask every ``key -> (replay endpoint, start seq)`` at once; answer key -> :class:`Tail`.

    None for an endpoint that did not finish its answer within ``timeout``
    seconds (unreachable, or too slow) or could not be asked (a bad address).
    Bad replies are skipped and counted, never raised.  Raises ValueError for
    a start seq outside 0..2**64-2 (a caller's error).
    """
    for _ep, start in asks.values():
        if not 0 <= start < 2**64 - 1:
            raise ValueError(f"start_seq out of range: {start}")
    out: dict[K, Tail | None] = {key: None for key in asks}
    open_: dict[zmq.Socket, tuple[K, _Ask]] = {}
    poller = zmq.Poller()
    try:
        for key, (endpoint, start) in asks.items():
            sock = context.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            try:
                sock.connect(endpoint)
                sock.send_multipart([b"", start.to_bytes(8, "big")], zmq.NOBLOCK)
            except zmq.ZMQError:
                sock.close(linger=0)
                continue
            open_[sock] = (key, _Ask())
            poller.register(sock, zmq.POLLIN)
        deadline = time.monotonic() + timeout
        while open_:
            left = deadline - time.monotonic()
            if left <= 0:
                break
            for sock, _ev in poller.poll(max(1, int(left * 1000))):
                key, ask = open_[sock]
                while sock in open_:
                    try:
                        frames = sock.recv_multipart(zmq.NOBLOCK)
                    except zmq.Again:
                        break
                    if ask.take(frames):
                        out[key] = Tail(ask.first, ask.last, ask.payload, ask.topic, ask.malformed)
                        poller.unregister(sock)
                        del open_[sock]
                        sock.close(linger=0)
    finally:
        for sock in open_:
            sock.close(linger=0)
    return out
