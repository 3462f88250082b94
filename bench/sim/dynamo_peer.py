"""NVIDIA Dynamo's own worker selection as a simulator scheduler (the peer, run, not copied).

``dynamo._core.SelectionService`` (ai-dynamo-runtime 1.6.1, ``pip install
--no-deps ai-dynamo-runtime==1.6.1``) is Dynamo's KV router without its
runtime: its radix-tree indexer, its cost function and its load tracking.
Each simulated pod gets a ZMQ PUB socket; the service subscribes to it as it
would to a vLLM engine's publisher (``upsert_worker``) and reads the pods'
real vLLM 0.32 KV-event batches.  A request is routed with
``select_and_reserve`` (which books the request's prefill tokens and blocks
on the chosen worker), marked ``prefill_complete`` at its first token and
``free_reservation`` at its end, as Dynamo's router does in band.

What the stubs do not say (checked with 1.6.1):

* The service takes no ``KvRouterConfig``: its settings come from the
  defaults plus ``DYN_ROUTER_*`` environment variables, read when the first
  worker is added (``KvRouterConfig initialized (DYN_* env overrides applied)``).
* A worker record needs ``endpoint`` (any URL), ``block_size`` and
  ``kv_events_endpoints`` ({dp rank: ZMQ URL}); until then it is listed with
  ``not_schedulable_reasons``.  ``total_kv_blocks`` and
  ``max_num_batched_tokens`` are optional.
* Its answer's cost ("logit", lowest wins) is, with the defaults, the
  request's uncached blocks + the worker's tracked prefill tokens / block
  size + its active blocks, where active blocks are counted once per
  distinct block over the worker's in-flight requests (shared prefixes are
  not added twice); ``prefill_complete`` drops a reservation's prefill
  tokens; ``free_reservation`` its blocks.
* Its indexer applies events on its own threads with no way to ask how far
  it got.  To keep the simulation's staleness exact (everything due before a
  decision, nothing more), :meth:`DynamoSelector.settle` ends each delivery
  with a sentinel block (unique tokens no prompt has, the previous sentinel
  removed in the same batch) and polls ``overlap_scores`` until every pod
  that was sent events shows its sentinel.
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Sequence

import numpy as np
import zmq

from bench.sim.engine import SimRequest
from bench.sim.wire import BlockRemoved, BlockStored, encode_batch, topic

__all__ = ["DynamoSelector", "available"]

os.environ.setdefault("DYN_LOG", "error")  # its INFO log line per selection would swamp the output

try:
    from dynamo._core import SelectionService
except ImportError:  # pragma: no cover - ai-dynamo-runtime not installed
    SelectionService = None

#: Token ids of sentinel blocks start here: above any vocabulary the simulator draws from.
SENTINEL_TOKEN = 1 << 30


def available() -> bool:
    """True when ai-dynamo-runtime (the peer) is importable."""
    return SelectionService is not None


class DynamoSelector:
    """Dynamo 1.6.1's ``SelectionService`` with its default settings (see the module doc).

    A scheduler as :class:`bench.sim.schedulers.Scheduler` defines them (the same methods; not
    a subclass, so that module can build this one by name without an import circle).
    ``indexer_threads``: the service's KV indexer pool (its default is 4; 2
    cores here).  ``env``: ``DYN_ROUTER_*`` overrides, set before the service
    is created (e.g. ``{"DYN_ROUTER_TEMPERATURE": "0.5"}``).
    """

    name = "dynamo"
    reads_index = False
    peer_events = True

    def __init__(self, seed: int, *, indexer_threads: int = 2, env: dict[str, str] | None = None,
                 name: str | None = None) -> None:
        # seed: unused; Dynamo breaks ties with its own, unseeded, random draw
        if SelectionService is None:
            raise RuntimeError("the dynamo scheduler needs ai-dynamo-runtime: "
                               "pip install --no-deps ai-dynamo-runtime==1.6.1")
        if name:
            self.name = name
        for k, v in (env or {}).items():
            os.environ[k] = v
        self.loop = asyncio.new_event_loop()
        self.service = SelectionService(indexer_threads=indexer_threads)
        self.ctx = zmq.Context.instance()
        self.socks: dict[str, zmq.Socket] = {}
        self.worker: dict[str, int] = {}
        self.pod_of: dict[int, str] = {}
        self.seq: dict[str, int] = {}
        self.sentinel: dict[str, int] = {}
        self.dirty: set[str] = set()
        self.gen = 0
        self.model = ""
        self.block_size = 0
        self.settle_polls = 0

    def _call(self, method, *args):
        """Await one of the service's async methods (they need a running loop when called)."""

        async def call():
            return await method(*args)

        return self.loop.run_until_complete(call())

    # -- fleet

    def _register(self, i: int, pod: str, events: str, replay: str | None, *, total_kv_blocks: int | None,
                  max_num_batched_tokens: int | None) -> None:
        record = {"worker_id": i, "model_name": self.model, "endpoint": f"http://{pod}:8000",
                  "kv_events_endpoints": {0: events}, "block_size": self.block_size}
        for k, v in (("replay_endpoint", replay), ("total_kv_blocks", total_kv_blocks),
                     ("max_num_batched_tokens", max_num_batched_tokens)):
            if v is not None:
                record[k] = v
        rec = self._call(self.service.upsert_worker, record)
        if rec.get("not_schedulable_reasons"):
            raise RuntimeError(f"Dynamo rejected worker {pod}: {rec['not_schedulable_reasons']}")
        self.worker[pod], self.pod_of[i] = i, pod

    def _ready(self) -> None:
        state = self.service.ready()
        if not state.get("ready"):
            raise RuntimeError(f"Dynamo's selection service is not ready: {state}")

    def attach(self, pods: Sequence[str], *, model: str, block_size: int, total_kv_blocks: int,
               max_num_batched_tokens: int) -> None:
        """Open a publisher per simulated pod and register each pod as a Dynamo worker subscribed to it."""
        self.model, self.block_size = model, block_size
        for i, pod in enumerate(pods):
            s = self.ctx.socket(zmq.XPUB)
            s.setsockopt(zmq.SNDHWM, 0)
            port = s.bind_to_random_port("tcp://127.0.0.1")
            self.socks[pod], self.seq[pod] = s, 0
            self._register(i, pod, f"tcp://127.0.0.1:{port}", None, total_kv_blocks=total_kv_blocks,
                           max_num_batched_tokens=max_num_batched_tokens)
        for pod, s in self.socks.items():  # wait for each subscription, so nothing is lost
            if not s.poll(10_000):
                raise RuntimeError(f"Dynamo's listener never subscribed to pod {pod}")
            s.recv()
        self._ready()

    def attach_engines(self, engines: dict[str, tuple[str, str | None]], *, model: str, block_size: int,
                       total_kv_blocks: int | None = None) -> None:
        """Register real engines: pod -> (KV-event endpoint, replay endpoint), as vLLM binds them;
        Dynamo subscribes to each itself."""
        self.model, self.block_size = model, block_size
        for i, (pod, (events, replay)) in enumerate(engines.items()):
            self._register(i, pod, events, replay, total_kv_blocks=total_kv_blocks, max_num_batched_tokens=None)
        self._ready()

    def wait_stored(self, pod: str, tokens: list[int], timeout: float = 5.0) -> bool:
        """Wait until Dynamo's index shows ``pod`` holding every full block of ``tokens`` (a real
        engine's events for a request it just served); False on timeout (e.g. evicted at once)."""
        want = len(tokens) // self.block_size

        async def poll() -> bool:
            deadline = time.monotonic() + timeout
            while time.monotonic() < deadline:
                scores = await self.service.overlap_scores({"model_name": self.model, "token_ids": tokens})
                if any(w["worker_id"] == self.worker[pod] and w["device_blocks"] >= want for w in scores["workers"]):
                    return True
                await asyncio.sleep(0.005)
            return False

        return self.loop.run_until_complete(poll())

    def deliver(self, pod: str, payload: bytes) -> None:
        """Publish one KV-event batch of ``pod`` (the vLLM frames: topic, sequence, payload)."""
        seq = self.seq[pod]
        self.seq[pod] = seq + 1
        self.socks[pod].send_multipart((topic(pod, self.model), seq.to_bytes(8, "big"), payload))
        self.dirty.add(pod)

    def settle(self, timeout: float = 120.0) -> None:
        """Return once Dynamo's indexer has applied every batch delivered so far (sentinel blocks)."""
        if not self.dirty:
            return
        self.gen += 1
        tokens = np.full(self.block_size, SENTINEL_TOKEN, dtype=np.int64)
        tokens[0] += self.gen
        h = (1 << 63) | self.gen
        for pod in self.dirty:
            events: list[BlockStored | BlockRemoved] = []
            if pod in self.sentinel:
                events.append(BlockRemoved(block_hashes=[self.sentinel[pod]], medium="GPU"))
            events.append(BlockStored(block_hashes=[h], parent_block_hash=None, token_ids=tokens.tolist(),
                                      block_size=self.block_size, medium="GPU"))
            self.sentinel[pod] = h
            self.deliver(pod, encode_batch(0.0, events))
        want = {self.worker[p] for p in self.dirty}
        self.dirty = set()
        self.loop.run_until_complete(self._wait_sentinel(tokens.tolist(), want, timeout))

    async def _wait_sentinel(self, tokens: list[int], want: set[int], timeout: float) -> None:
        deadline = time.monotonic() + timeout
        request = {"model_name": self.model, "token_ids": tokens}
        while True:
            self.settle_polls += 1
            scores = await self.service.overlap_scores(request)
            seen = {w["worker_id"] for w in scores["workers"] if w["device_blocks"] >= 1}
            if want <= seen:
                return
            if time.monotonic() > deadline:
                raise RuntimeError(f"Dynamo's indexer did not apply the events in {timeout} s")
            await asyncio.sleep(0.0002)

    # -- routing

    def choose(self, req: SimRequest, view: object) -> tuple[str, int]:
        request = {"model_name": self.model, "token_ids": req.prompt.tolist(), "selection_id": f"r{req.rid}"}
        answer = self._call(self.service.select_and_reserve, request)
        pod = self.pod_of[int(answer["worker_id"])]
        matched = int(answer["overlap"].get("gpu", answer["overlap"].get("longest_matched", 0)))
        return pod, len(req.prompt) - matched

    def routed(self, req: SimRequest, pod: str, view: object) -> None:
        """Nothing: ``select_and_reserve`` booked the request already."""

    def first_token(self, req: SimRequest, pod: str) -> None:
        self._call(self.service.prefill_complete, f"r{req.rid}")

    def finished(self, req: SimRequest, pod: str) -> None:
        self._call(self.service.free_reservation, f"r{req.rid}")

    def close(self) -> None:
        self.service.shutdown()
        for s in self.socks.values():
            s.close(0)
        self.socks = {}
        self.loop.close()
