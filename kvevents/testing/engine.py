"""A fake vLLM engine for tests: a prefix cache that publishes real KV events over ZMQ.

The engine side of vLLM 0.32's KV-event protocol (vllm/distributed/kv_events.py
``ZmqEventPublisher``), written independently of the library's decoders (it
imports nothing from kvevents' wire code or kvindex), so a router's tests meet
the frames a real engine sends:

- PUB socket, three frames per message: topic (``kv@<pod>@<model>`` by
  default), seq (8 bytes, big-endian, from 0 per engine process), payload
  ``[ts, events, data_parallel_rank]`` (msgpack; the rank left out when None).
- Events as maps tagged by ``"type"`` (``encoding="map"``, current vLLM) or
  positional arrays (``encoding="array"``, vLLM before PR #42892).
- Replay ROUTER: ``[b"", start_seq]`` in; one reply per buffered batch with
  seq >= start_seq (``[b"", topic, seq, payload]``, or ``[b"", seq, payload]``
  as engines before vLLM PR #45177), then the end marker (seq eight 0xFF
  bytes, empty payload).

Threading: one engine thread owns both sockets and the cache; public methods
queue a command, wake the thread and wait (bounded) for its result, so any
thread may call them.
"""

from __future__ import annotations

import queue
import socket
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, Literal

import msgspec
import zmq

from kvevents.testing.hashing import (
    HASH_ALGOS,
    HASH_FORMS,
    VLLM_SEED,
    HashAlgo,
    HashForm,
    block_digests,
    digest_to_uint64,
    wire_hash,
)

__all__ = ["END_SEQ", "LOOPBACK_ANY", "Encoding", "EngineStats", "FakeEngine", "is_bind_endpoint", "validate_engine_args"]

Encoding = Literal["map", "array"]

#: Seq frame of the replay end marker: 8 bytes of 0xFF.
END_SEQ: bytes = b"\xff" * 8

_ENCODINGS = ("map", "array")

#: Loopback with a port the system picks (bound; see :attr:`FakeEngine.endpoint`).
LOOPBACK_ANY = "tcp://127.0.0.1:*"


def is_bind_endpoint(endpoint: str) -> bool:
    """Return True if vLLM would bind ``endpoint`` (wildcard, ``::``, ipc or inproc), else it connects."""
    return "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))


def validate_engine_args(
    *,
    pod: str,
    capacity_blocks: int,
    dp_rank: int | None = 0,
    block_size: int = 16,
    encoding: str = "map",
    hash_form: str = "uint64",
    buffer_steps: int = 10_000,
    hash_algo: str = "sha256",
    **_ignored: Any,
) -> None:
    """Check :class:`FakeEngine` arguments without creating sockets (other keywords are ignored).

    Raises:
        ValueError: an argument is out of range or unknown.
    """
    if not pod:
        raise ValueError("pod must be a non-empty string")
    if encoding not in _ENCODINGS:
        raise ValueError(f"encoding must be one of {_ENCODINGS}, got {encoding!r}")
    if hash_form not in HASH_FORMS:
        raise ValueError(f"hash_form must be one of {HASH_FORMS}, got {hash_form!r}")
    if hash_algo not in HASH_ALGOS:
        raise ValueError(f"hash_algo must be one of {HASH_ALGOS}, got {hash_algo!r}")
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    if capacity_blocks < 1:
        raise ValueError(f"capacity_blocks must be >= 1, got {capacity_blocks}")
    if buffer_steps < 1:
        raise ValueError(f"buffer_steps must be >= 1, got {buffer_steps}")
    if dp_rank is not None and dp_rank < 0:
        raise ValueError(f"dp_rank must be >= 0 or None, got {dp_rank}")


@dataclass(frozen=True, slots=True)
class EngineStats:
    """Counters of one fake engine (all since its last restart unless noted).

    Attributes:
        pod: pod id in the topic.
        model: model name in the topic.
        dp_rank: data-parallel rank written into batches (None = left out).
        next_seq: sequence number the next batch will get.
        batches_published: batches given a sequence number (sent or dropped).
        batches_dropped: batches kept for replay but not sent (``drop_next``).
        events_published: events in those batches.
        blocks_stored: block hashes in GPU BlockStored events.
        blocks_offloaded: block hashes in CPU BlockStored events.
        blocks_removed: block hashes in BlockRemoved events (LRU eviction).
        blocks_cleared: AllBlocksCleared events.
        gpu_blocks: blocks cached in GPU memory now.
        cpu_blocks: blocks with a CPU copy now.
        capacity_blocks: GPU cache size in blocks.
        requests: requests served.
        prefix_cache_queries_total: prompt tokens queried (like vllm:prefix_cache_queries_total).
        prefix_cache_hits_total: prompt tokens found cached (like vllm:prefix_cache_hits_total).
        replay_requests: replay requests answered.
        replay_invalid: malformed replay requests ignored.
        restarts: restarts of this engine (kept across restarts).
    """

    pod: str
    model: str
    dp_rank: int | None
    next_seq: int
    batches_published: int
    batches_dropped: int
    events_published: int
    blocks_stored: int
    blocks_offloaded: int
    blocks_removed: int
    blocks_cleared: int
    gpu_blocks: int
    cpu_blocks: int
    capacity_blocks: int
    requests: int
    prefix_cache_queries_total: int
    prefix_cache_hits_total: int
    replay_requests: int
    replay_invalid: int
    restarts: int


class FakeEngine:
    """A fake vLLM engine (one pod, one DP rank) publishing KV events over ZMQ.

    The GPU KV cache holds ``capacity_blocks`` full blocks.  Serving a request
    hits the longest cached prefix of full blocks, stores the rest (evicting the
    least recently used blocks that the request does not use) and publishes one
    batch.  Like vLLM's free-block queue, a request's blocks are queued for
    eviction tail first, so a cached block's parent is always cached too.

    Use as a context manager (or call :meth:`close`)::

        with FakeEngine(pod="pod-a", model="m") as engine:
            engine.serve(list(range(64)))   # publishes one batch: 4 blocks stored

    Deviations from vLLM, on purpose: no batch is published when a call produces
    no events (as vLLM's scheduler does); a prefix hit counts whole blocks, also
    when the whole prompt is cached; CPU copies (``offload``) are unbounded and
    are dropped by ``reset_prefix_cache``; the replay ROUTER has no send
    high-water mark so a long replay is never cut short; endpoints are used as
    given (no port offset by DP rank).

    Args:
        pod: pod id, used in the topic.
        model: model name, used in the topic.
        endpoint: PUB endpoint (``tcp://127.0.0.1:*`` picks a free port; see
            :attr:`endpoint`); bound or connected as ``pub_bind`` says.  vLLM's
            own rule: bound if it contains ``*`` or ``::`` or starts with
            ipc:// or inproc://, else connected to (a router that binds).
        replay_endpoint: ROUTER endpoint (always bound) or None for no replay.
        capacity_blocks: GPU cache size in blocks, >= 1 (LRU eviction beyond).
        dp_rank: data-parallel rank put in each batch; None leaves it out (old engines).
        block_size: tokens per block, >= 1.
        encoding: "map" (event maps, current vLLM) or "array" (positional, old vLLM).
        hash_form: "uint64", "int64" or "bytes" (see :func:`~kvevents.testing.wire_hash`).
        buffer_steps: batches kept for replay, >= 1.
        hash_seed: NONE_HASH seed (the default gives vLLM's default hashes).
        hash_algo: "sha256" or "sha256_cbor".
        replay_with_topic: replay replies ``[b"", topic, seq, payload]`` (vLLM PR
            #45177 and later) if True, else ``[b"", seq, payload]`` (older engines).
        topic: the topic frame; None gives ``kv@<pod>@<model>`` ("" is vLLM's
            default when none is configured).
        pub_bind: True (the default) binds the PUB socket whatever the
            endpoint, as a test engine that a router dials usually should;
            False connects it (a router that binds); None applies vLLM's rule
            above (a host address is connected to).
        call_timeout: seconds a public method waits for the engine thread.

    Raises:
        ValueError: an argument is out of range or unknown.
        zmq.ZMQError: a socket cannot be bound or connected.
    """

    def __init__(
        self,
        *,
        pod: str,
        model: str = "fake-model",
        endpoint: str = LOOPBACK_ANY,
        replay_endpoint: str | None = LOOPBACK_ANY,
        capacity_blocks: int = 1024,
        dp_rank: int | None = 0,
        block_size: int = 16,
        encoding: Encoding = "map",
        hash_form: HashForm = "uint64",
        buffer_steps: int = 10_000,
        hash_seed: str = VLLM_SEED,
        hash_algo: HashAlgo = "sha256",
        replay_with_topic: bool = True,
        topic: str | None = None,
        pub_bind: bool | None = True,
        call_timeout: float = 30.0,
    ) -> None:
        validate_engine_args(
            pod=pod,
            capacity_blocks=capacity_blocks,
            dp_rank=dp_rank,
            block_size=block_size,
            encoding=encoding,
            hash_form=hash_form,
            buffer_steps=buffer_steps,
            hash_algo=hash_algo,
        )
        if call_timeout <= 0:
            raise ValueError(f"call_timeout must be > 0, got {call_timeout}")

        self.pod = pod
        self.model = model
        self.dp_rank = dp_rank
        self.block_size = block_size
        self.capacity_blocks = capacity_blocks
        self.encoding: Encoding = encoding
        self.hash_form: HashForm = hash_form
        self.hash_seed = hash_seed
        self.hash_algo: HashAlgo = hash_algo
        self.buffer_steps = buffer_steps
        self.replay_with_topic = replay_with_topic
        self.topic: bytes = (f"kv@{pod}@{model}" if topic is None else topic).encode()
        self._call_timeout = call_timeout

        self._endpoint = endpoint
        self._pub_bind = is_bind_endpoint(endpoint) if pub_bind is None else pub_bind
        self._replay_endpoint = replay_endpoint
        self._ctx = zmq.Context()
        self._pub: zmq.Socket | None = None
        self._router: zmq.Socket | None = None
        self._encoder = msgspec.msgpack.Encoder()

        # Engine-thread state.
        self._gpu: OrderedDict[bytes, None] = OrderedDict()  # LRU order, oldest first
        self._cpu: dict[bytes, None] = {}
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer_steps)
        self._seq = 0
        self._drop = 0
        self._restarts = 0
        self._replay_requests = 0
        self._replay_invalid = 0
        self._reset_counters()
        self._start_thread()

    def _start_thread(self) -> None:
        """Start the engine thread; it opens the sockets (errors re-raised here)."""
        self._commands: queue.Queue[tuple[Callable[..., Any], tuple[Any, ...], Future[Any]]] = (
            queue.Queue()
        )
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._wake_w.setblocking(False)
        self._closed = False
        self._close_lock = threading.Lock()
        ready: Future[None] = Future()
        self._thread = threading.Thread(
            target=self._run, args=(ready,), name=f"fake-engine-{self.pod}", daemon=True
        )
        self._thread.start()
        try:
            ready.result(timeout=self._call_timeout)
        except BaseException:
            self._closed = True
            self._thread.join(timeout=self._call_timeout)
            self._wake_r.close()
            self._wake_w.close()
            self._ctx.term()
            raise

    # ------------------------------------------------------------------ API

    @property
    def endpoint(self) -> str:
        """The PUB endpoint: the resolved address if bound (``*`` ports resolved), else as given."""
        return self._endpoint

    @property
    def replay_endpoint(self) -> str | None:
        """The bound ROUTER endpoint (``*`` ports resolved), or None without replay."""
        return self._replay_endpoint

    def engine_entry(self) -> dict[str, str]:
        """This engine as a router's ``kv_events_config.engines`` entry (pod, endpoint, replay_endpoint; the PUB bound)."""
        entry = {"pod": self.pod, "endpoint": self._endpoint}
        if self._replay_endpoint is not None:
            entry["replay_endpoint"] = self._replay_endpoint
        return entry

    def hashes(self, tokens: Sequence[int]) -> list[int]:
        """Return the uint64 block hashes this engine computes for the full blocks of ``tokens``."""
        return [digest_to_uint64(d) for d in self._digests(tokens)]

    def serve(self, tokens: Sequence[int], report_mode: str = "incremental") -> int:
        """Simulate the prefill of one request and publish its KV events as one batch.

        Hits the longest prefix of full blocks cached in GPU memory, refreshes
        those blocks in LRU order and stores the following full blocks, evicting
        least recently used blocks not used by this request.  The batch holds a
        BlockRemoved (medium "GPU") for evicted blocks, then one BlockStored for
        the new contiguous blocks (parent = the last hit block or nil, their
        token ids, medium "GPU").  If the request's blocks exceed the capacity,
        only the leading blocks that fit are stored.

        Args:
            tokens: the prompt's token ids.
            report_mode: ``"incremental"`` (vLLM's default) or ``"full"``: the
                request's ``vllm_xargs.kv_cache_report_mode``; with ``"full"``
                the batch starts with a BlockStored re-announcing the hit
                blocks (parent nil, from block 0), as vLLM's
                ``KVCacheManager.get_computed_blocks`` does (vLLM PR #45261).

        Returns:
            Prefix-cache hit in tokens (hit blocks x block_size).

        Raises:
            ValueError: unknown ``report_mode``.
        """
        if report_mode not in ("incremental", "full"):
            raise ValueError(f"report_mode must be 'incremental' or 'full', got {report_mode!r}")
        toks = [int(t) for t in tokens]
        digests = self._digests(toks)
        return int(self._call(self._do_serve, toks, digests, report_mode == "full"))

    def lookup(self, tokens: Sequence[int]) -> int:
        """Return the prefix-cache hit in tokens ``serve`` would report now, changing nothing."""
        return int(self._call(self._do_lookup, self._digests(tokens)))

    def offload(self, n_blocks: int) -> list[int]:
        """Copy up to ``n_blocks`` GPU blocks to CPU and publish a token-less CPU BlockStored.

        Mirrors an offloading connector's event: engine hashes and medium "CPU",
        no token ids, parent nil.  Blocks are chosen least recently used first
        among GPU blocks without a CPU copy.  Nothing is published if none is chosen.

        Returns:
            The uint64 hashes of the offloaded blocks.

        Raises:
            ValueError: n_blocks < 0.
        """
        if n_blocks < 0:
            raise ValueError(f"n_blocks must be >= 0, got {n_blocks}")
        return list(self._call(self._do_offload, n_blocks))

    def reset_prefix_cache(self) -> None:
        """Drop every cached block (GPU and CPU copies) and publish AllBlocksCleared."""
        self._call(self._do_reset)

    def restart(self) -> None:
        """Behave like a new engine process: empty cache, new PUB socket, seq from 0.

        The replay buffer, pending drops and the per-process counters are
        cleared; nothing is published.  A bound PUB socket is rebound to the
        same resolved address, so subscribers reconnect by themselves.
        """
        self._call(self._do_restart)

    def drop_next(self, n: int) -> None:
        """Keep the next ``n`` batches for replay with their seq numbers but do not send them.

        Raises:
            ValueError: n < 0.
        """
        if n < 0:
            raise ValueError(f"n must be >= 0, got {n}")
        self._call(self._do_drop_next, n)

    def cached_blocks(self) -> dict[int, frozenset[str]]:
        """Return uint64 block hash -> tiers ("gpu", "cpu") of every cached block."""
        return dict(self._call(self._do_cached))

    def stats(self) -> EngineStats:
        """Return the engine's counters."""
        result: EngineStats = self._call(self._do_stats)
        return result

    def close(self) -> None:
        """Stop the engine thread and close its sockets; later calls raise RuntimeError."""
        with self._close_lock:
            if self._closed:
                return
            self._closed = True
        stop: Future[None] = Future()
        self._commands.put((self._do_stop, (), stop))
        self._wake()
        self._thread.join(timeout=self._call_timeout)
        self._wake_r.close()
        self._wake_w.close()
        if not self._thread.is_alive():
            self._ctx.term()

    def __enter__(self) -> FakeEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------- caller side

    def _digests(self, tokens: Sequence[int]) -> list[bytes]:
        return block_digests(tokens, self.block_size, self.hash_seed, self.hash_algo)

    def _wake(self) -> None:
        try:
            self._wake_w.send(b"\0")
        except (BlockingIOError, OSError):
            pass  # the reader is already due to wake up, or closing

    def _call(self, fn: Callable[..., Any], *args: Any) -> Any:
        if self._closed or not self._thread.is_alive():
            raise RuntimeError(f"engine {self.pod!r} is closed")
        fut: Future[Any] = Future()
        self._commands.put((fn, args, fut))
        self._wake()
        return fut.result(timeout=self._call_timeout)

    # ------------------------------------------------------ engine thread

    def _run(self, ready: Future[None]) -> None:
        try:
            self._open_pub(self._endpoint)
            if self._replay_endpoint is not None:
                router = self._ctx.socket(zmq.ROUTER)
                router.setsockopt(zmq.LINGER, 0)
                router.setsockopt(zmq.SNDHWM, 0)
                router.bind(self._replay_endpoint)
                self._router = router
                self._replay_endpoint = router.getsockopt_string(zmq.LAST_ENDPOINT)
        except BaseException as exc:
            self._close_sockets()
            ready.set_exception(exc)
            return
        ready.set_result(None)

        poller = zmq.Poller()
        wake_fd = self._wake_r.fileno()
        poller.register(wake_fd, zmq.POLLIN)
        if self._router is not None:
            poller.register(self._router, zmq.POLLIN)
        running = True
        while running:
            ready_socks = dict(poller.poll(500))
            if self._router is not None and self._router in ready_socks:
                self._service_replay()
            if wake_fd in ready_socks:
                try:
                    while self._wake_r.recv(4096):
                        pass
                except (BlockingIOError, OSError):
                    pass
            while True:
                try:
                    fn, args, fut = self._commands.get_nowait()
                except queue.Empty:
                    break
                if fn == self._do_stop:
                    running = False
                try:
                    fut.set_result(fn(*args))
                except BaseException as exc:  # reported to the caller
                    fut.set_exception(exc)
        self._close_sockets()

    def _open_pub(self, endpoint: str) -> None:
        pub = self._ctx.socket(zmq.PUB)
        pub.setsockopt(zmq.LINGER, 0)
        pub.setsockopt(zmq.SNDHWM, 100_000)
        try:
            if self._pub_bind:
                self._bind_retrying(pub, endpoint)
                self._endpoint = pub.getsockopt_string(zmq.LAST_ENDPOINT)
            else:
                pub.connect(endpoint)
                self._endpoint = endpoint
        except BaseException:
            pub.close(linger=0)
            raise
        self._pub = pub

    def _bind_retrying(self, sock: zmq.Socket, endpoint: str) -> None:
        # A just-closed socket releases its port asynchronously: retry briefly.
        deadline = time.monotonic() + 5.0
        while True:
            try:
                sock.bind(endpoint)
                return
            except zmq.ZMQError as exc:
                if exc.errno != zmq.EADDRINUSE or time.monotonic() > deadline:
                    raise
                time.sleep(0.02)

    def _close_sockets(self) -> None:
        for sock in (self._pub, self._router):
            if sock is not None:
                sock.close(linger=0)
        self._pub = None
        self._router = None

    def _do_stop(self) -> None:
        return None

    def _reset_counters(self) -> None:
        self._batches = 0
        self._dropped = 0
        self._events = 0
        self._stored = 0
        self._offloaded = 0
        self._removed = 0
        self._cleared = 0
        self._requests = 0
        self._queries = 0
        self._hits = 0

    def _hit_blocks(self, digests: list[bytes]) -> int:
        hit = 0
        for d in digests:
            if d not in self._gpu:
                break
            hit += 1
        return hit

    def _do_lookup(self, digests: list[bytes]) -> int:
        return self._hit_blocks(digests) * self.block_size

    def _do_serve(self, tokens: list[int], digests: list[bytes], full: bool = False) -> int:
        bs = self.block_size
        hit = self._hit_blocks(digests)
        n_new = min(len(digests), self.capacity_blocks) - hit
        new = digests[hit : hit + max(0, n_new)]
        # Evict least recently used blocks, never one this request uses.
        used = set(digests[: hit + len(new)])
        evicted: list[bytes] = []
        excess = len(self._gpu) + len(new) - self.capacity_blocks
        if excess > 0:
            for d in self._gpu:
                if len(evicted) == excess:
                    break
                if d not in used:
                    evicted.append(d)
            for d in evicted:
                del self._gpu[d]
        # Queue this request's blocks tail first, so the head is freed last.
        for d in reversed(digests[: hit + len(new)]):
            self._gpu[d] = None
            self._gpu.move_to_end(d)

        events: list[Any] = []
        if full and hit:
            events.append(self._block_stored([self._wire(d) for d in digests[:hit]], None, tokens[: hit * bs], "GPU"))
        if evicted:
            events.append(self._block_removed([self._wire(d) for d in evicted], "GPU"))
            self._removed += len(evicted)
        if new:
            parent = self._wire(digests[hit - 1]) if hit > 0 else None
            token_ids = tokens[hit * bs : (hit + len(new)) * bs]
            events.append(
                self._block_stored([self._wire(d) for d in new], parent, token_ids, "GPU")
            )
            self._stored += len(new)
        self._requests += 1
        self._queries += len(tokens)
        self._hits += hit * bs
        self._publish(events)
        return hit * bs

    def _do_offload(self, n_blocks: int) -> list[int]:
        chosen = [d for d in self._gpu if d not in self._cpu][:n_blocks]
        for d in chosen:
            self._cpu[d] = None
        if chosen:
            self._offloaded += len(chosen)
            self._publish([self._block_stored([self._wire(d) for d in chosen], None, [], "CPU")])
        return [digest_to_uint64(d) for d in chosen]

    def _do_reset(self) -> None:
        self._gpu.clear()
        self._cpu.clear()
        self._cleared += 1
        self._publish([self._all_cleared()])

    def _do_restart(self) -> None:
        if self._pub is not None:
            self._pub.close(linger=0)
            self._pub = None
        self._open_pub(self._endpoint)
        self._gpu.clear()
        self._cpu.clear()
        self._buffer.clear()
        self._seq = 0
        self._drop = 0
        self._restarts += 1
        self._reset_counters()

    def _do_drop_next(self, n: int) -> None:
        self._drop = n

    def _do_cached(self) -> dict[int, frozenset[str]]:
        out: dict[int, frozenset[str]] = {}
        for d in self._gpu:
            out[digest_to_uint64(d)] = frozenset({"gpu", "cpu"} if d in self._cpu else {"gpu"})
        for d in self._cpu:
            if d not in self._gpu:
                out[digest_to_uint64(d)] = frozenset({"cpu"})
        return out

    def _do_stats(self) -> EngineStats:
        return EngineStats(
            pod=self.pod,
            model=self.model,
            dp_rank=self.dp_rank,
            next_seq=self._seq,
            batches_published=self._batches,
            batches_dropped=self._dropped,
            events_published=self._events,
            blocks_stored=self._stored,
            blocks_offloaded=self._offloaded,
            blocks_removed=self._removed,
            blocks_cleared=self._cleared,
            gpu_blocks=len(self._gpu),
            cpu_blocks=len(self._cpu),
            capacity_blocks=self.capacity_blocks,
            requests=self._requests,
            prefix_cache_queries_total=self._queries,
            prefix_cache_hits_total=self._hits,
            replay_requests=self._replay_requests,
            replay_invalid=self._replay_invalid,
            restarts=self._restarts,
        )

    # --- wire encoding (plain dicts/lists -> msgspec.msgpack.encode)

    def _wire(self, digest: bytes) -> int | bytes:
        return wire_hash(digest, self.hash_form)

    def _block_stored(
        self,
        hashes: list[int | bytes],
        parent: int | bytes | None,
        token_ids: list[int],
        medium: str,
    ) -> Any:
        # Fields without a default are always present; lora_id and lora_name are nil.
        if self.encoding == "map":
            return {
                "type": "BlockStored",
                "block_hashes": hashes,
                "parent_block_hash": parent,
                "token_ids": token_ids,
                "block_size": self.block_size,
                "lora_id": None,
                "medium": medium,
                "lora_name": None,
            }
        return ["BlockStored", hashes, parent, token_ids, self.block_size, None, medium, None]

    def _block_removed(self, hashes: list[int | bytes], medium: str) -> Any:
        if self.encoding == "map":
            return {"type": "BlockRemoved", "block_hashes": hashes, "medium": medium}
        return ["BlockRemoved", hashes, medium]

    def _all_cleared(self) -> Any:
        if self.encoding == "map":
            return {"type": "AllBlocksCleared"}
        return ["AllBlocksCleared"]

    def _publish(self, events: list[Any]) -> None:
        if not events:
            return
        batch: list[Any] = [time.time(), events]
        if self.dp_rank is not None:
            batch.append(self.dp_rank)
        payload = self._encoder.encode(batch)
        seq = self._seq
        self._seq += 1
        self._buffer.append((seq, payload))
        self._batches += 1
        self._events += len(events)
        if self._drop > 0:
            self._drop -= 1
            self._dropped += 1
            return
        assert self._pub is not None
        self._pub.send_multipart((self.topic, seq.to_bytes(8, "big"), payload))

    def _service_replay(self) -> None:
        assert self._router is not None
        while True:
            try:
                frames = self._router.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            if len(frames) != 3 or frames[1] != b"" or len(frames[2]) != 8:
                self._replay_invalid += 1
                continue
            identity, _, start_bytes = frames
            start = int.from_bytes(start_bytes, "big")
            self._replay_requests += 1
            for seq, payload in self._buffer:
                if seq < start:
                    continue
                seq_bytes = seq.to_bytes(8, "big")
                if self.replay_with_topic:
                    self._router.send_multipart((identity, b"", self.topic, seq_bytes, payload))
                else:
                    self._router.send_multipart((identity, b"", seq_bytes, payload))
            if self.replay_with_topic:
                self._router.send_multipart((identity, b"", b"", END_SEQ, b""))
            else:
                self._router.send_multipart((identity, b"", END_SEQ, b""))
