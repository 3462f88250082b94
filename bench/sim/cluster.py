"""One simulated run: a workload, a fleet of :class:`SimPod`, one scheduler, simulated time.

The loop takes the earliest of the next arrival and the next step end of any
pod.  A step's KV-event batch is published at its end and reaches the router
``event_delay`` seconds later: before each routing decision every batch due
by then is handed to the library's write path (``EventPool.submit`` in
process, or ZMQ PUB sockets the library's ``Subscriber`` reads with
``transport="zmq"``) and applied (``flush`` / ``wait_for``); batches not yet
due are not, so the index is as stale as a real one.  Engine metrics are
scraped every ``metrics_interval`` seconds of simulated time.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Callable

import msgspec
import numpy as np
import zmq

from bench.sim.engine import CostModel, SimPod, SimRequest
from bench.sim.schedulers import Scheduler, View, make_scheduler
from bench.sim.wire import encode_batch, topic
from bench.sim.workload import Workload, build_requests
from kvindex.facade import Config, Indexer
from kvevents.pool import RawMessage, Source
from kvindex.reference import KVBlockIndex
from kvindex.keys import TokenProcessor
from scorer.load import LoadSnapshot

__all__ = ["RunOptions", "RunResult", "StageResult", "run"]

MODEL = "Qwen/Qwen3-32B"


class RunOptions(msgspec.Struct, frozen=True, kw_only=True):
    """Simulation knobs: block size (tokens), event delay and metrics scrape interval
    (seconds), engine limits, cost model, and the event transport (``inproc`` or ``zmq``)."""

    block_size: int = 64
    event_delay: float = 0.005
    metrics_interval: float = 0.05
    max_num_batched_tokens: int = 8192
    max_num_seqs: int = 1024
    cost: CostModel = msgspec.field(default_factory=CostModel)
    transport: str = "inproc"


class StageResult(msgspec.Struct, frozen=True, kw_only=True):
    """Per load stage (requests by arrival stage): offered QPS, TTFT p90 / mean (s), requests."""

    qps: float
    requests: int
    ttft_p90: float
    ttft_mean: float
    output_tok_s: float


class RunResult(msgspec.Struct, frozen=True, kw_only=True):
    """Outcome of one run.

    output_tok_s: output tokens / (last finish - first arrival); ttft_*:
    seconds over all requests; waiting_mean: engines' waiting queue, mean over
    pods as seen by Poisson arrivals (= its time average); hit_rate: prefix
    cache hit tokens / queried tokens summed over the engines (as
    vllm:prefix_cache_hits_total / queries_total, re-admissions after a preemption
    included); first_hit_rate: the prefix hit at each request's first admission
    / its prompt tokens, summed over requests; requests / finished;
    preemptions; events: KV-event batches and blocks stored / removed that
    went through the library's write path (published_*: what the pods sent); index_errors: its decode errors.
    """

    workload: str
    scheduler: str
    seed: int
    requests: int
    finished: int
    output_tok_s: float
    ttft_p90: float
    ttft_mean: float
    ttft_p50: float
    waiting_mean: float
    hit_rate: float
    preemptions: int
    makespan: float
    batches: int
    blocks_stored: int
    blocks_removed: int
    published_stored: int
    published_removed: int
    index_errors: int
    stages: list[StageResult]
    first_hit_rate: float = 0.0


class _Transport:
    """Hands event batches to the library's write path, in process or over ZMQ."""

    def __init__(self, kind: str, ix: Indexer, pods: list[str]) -> None:
        self.kind = kind
        self.ix = ix
        self.seq = dict.fromkeys(pods, 0)
        self.sent = 0
        self.dirty = False
        self.sources = {p: Source(pod=p, model=MODEL) for p in pods}
        self.socks: dict[str, zmq.Socket] = {}
        if kind == "zmq":
            ctx = zmq.Context.instance()
            for p in pods:
                s = ctx.socket(zmq.XPUB)
                s.setsockopt(zmq.SNDHWM, 0)
                port = s.bind_to_random_port("tcp://127.0.0.1")
                self.socks[p] = s
                ix.add_engine(_endpoint(p, f"tcp://127.0.0.1:{port}"))
            for p, s in self.socks.items():  # wait for each subscription, so nothing is lost
                if not s.poll(10_000):
                    raise RuntimeError(f"no subscriber joined pod {p}'s publisher")
                s.recv()
        elif kind != "inproc":
            raise ValueError(f"transport must be 'inproc' or 'zmq', got {kind!r}")

    def send(self, pod: str, payload: bytes) -> None:
        seq = self.seq[pod]
        self.seq[pod] = seq + 1
        frames = (topic(pod, MODEL), seq.to_bytes(8, "big"), payload)
        if self.kind == "zmq":
            self.socks[pod].send_multipart(frames)
        else:
            while not self.ix.pool.submit(RawMessage(self.sources[pod], *frames)):
                self.ix.flush()
        self.sent += 1
        self.dirty = True

    def settle(self) -> None:
        if not self.dirty:
            return
        ok = self.ix.wait_for(self.sent, 600.0) if self.kind == "zmq" else self.ix.flush(600.0)
        if not ok:
            raise RuntimeError("the write path did not apply the events in time")
        self.dirty = False

    def close(self) -> None:
        for s in self.socks.values():
            s.close(0)


def _endpoint(pod: str, url: str):
    from kvevents.subscriber import EngineEndpoint

    return EngineEndpoint(pod=pod, endpoint=url, model=MODEL)


def run(
    workload: Workload,
    scheduler: str | Scheduler,
    *,
    seed: int = 0,
    options: RunOptions | None = None,
    picker: str | None = None,
    scorer_config: dict | None = None,
    on_decision: Callable[[SimRequest, str, View], None] | None = None,
    requests_out: list[SimRequest] | None = None,
) -> RunResult:
    """Simulate ``workload`` routed by ``scheduler`` (a name from
    :data:`bench.sim.schedulers.SCHEDULERS` or an instance); deterministic for
    a seed (the pool's threads only change when, never what, is applied:
    everything due is applied before each decision).  Schedulers that do not
    read the index (random, load, approximate) run without the event stream."""
    opt = options or RunOptions()
    bs = opt.block_size
    sched = make_scheduler(scheduler, seed, bs, workload.approximate) if isinstance(scheduler, str) else scheduler
    reqs = build_requests(workload, seed, bs)
    if requests_out is not None:
        requests_out.extend(reqs)
    names = [f"pod-{i}" for i in range(workload.pods)]
    pods = {
        n: SimPod(n, workload.capacity_tokens, block_size=bs, cost=opt.cost,
                  max_num_batched_tokens=opt.max_num_batched_tokens, max_num_seqs=opt.max_num_seqs)
        for n in names
    }
    sc: dict = dict(scorer_config or {})
    chosen_picker = picker or getattr(sched, "config_picker", None)
    if chosen_picker:
        sc["picker"] = chosen_picker
    cfg = Config.from_dict({
        "model_name": MODEL,
        "token_processor_config": {"block_size": bs},
        "kv_block_index_config": {"in_memory_config": {"size": 4 * workload.pods * pods[names[0]].num_blocks + 1000}},
        "kv_events_config": {"concurrency": 1, "queue_size": 100_000},
        "scorer_config": sc,
    })
    view = View(names, None)  # type: ignore[arg-type]
    tpc = cfg.token_processor_config
    index = KVBlockIndex(
        TokenProcessor(block_size=tpc.block_size, hash_seed=tpc.hash_seed, algorithm=tpc.algorithm),
        capacity=cfg.kv_block_index_config.in_memory_config.size,
        clock=lambda: view.now,  # speculative entries expire on simulated time
    )
    ix = Indexer(cfg, index=index)
    view.ix = ix
    ix.start()
    transport = _Transport(opt.transport, ix, names)
    try:
        sched.attach(names, model=MODEL, block_size=bs, total_kv_blocks=pods[names[0]].num_blocks,
                     max_num_batched_tokens=opt.max_num_batched_tokens)
        return _loop(workload, sched, seed, opt, reqs, pods, ix, transport, view, on_decision)
    finally:
        sched.close()
        transport.close()
        ix.stop()


def _loop(workload, sched, seed, opt, reqs, pods, ix, transport, view, on_decision) -> RunResult:
    names = list(pods)
    steps: list[tuple[float, int, str]] = []  # (end time, tie, pod)
    tie = 0
    deliveries: list[tuple[float, int, str, bytes]] = []
    dseq = 0
    in_flight = dict.fromkeys(names, 0)
    prefill = dict.fromkeys(names, 0)
    last_scrape = -math.inf
    scraped: dict[str, LoadSnapshot] = {}
    waiting_samples: list[float] = []
    ai = 0
    stats = {"batches": 0, "stored": 0, "removed": 0}

    def start_step(pod: SimPod, now: float) -> None:
        nonlocal tie
        dt = pod.plan_step()
        if dt is not None:
            tie += 1
            heapq.heappush(steps, (now + dt, tie, pod.name))

    wants_events = sched.reads_index or sched.peer_events

    def deliver(name: str, payload: bytes) -> None:
        if sched.reads_index:
            transport.send(name, payload)
        if sched.peer_events:
            sched.deliver(name, payload)

    while ai < len(reqs) or steps:
        t_arr = reqs[ai].arrival if ai < len(reqs) else math.inf
        if steps and steps[0][0] <= t_arr:
            now, _, name = heapq.heappop(steps)
            pod = pods[name]
            firsts, done = pod.end_step(now)
            for r in firsts:
                prefill[name] -= r.predicted_uncached
                sched.first_token(r, name)
            for r in done:
                in_flight[name] -= 1
                sched.finished(r, name)
            events = pod.take_events()
            if events and wants_events:
                dseq += 1
                heapq.heappush(deliveries, (now + opt.event_delay, dseq, name, encode_batch(now, events)))
                stats["batches"] += 1
                for e in events:
                    if type(e).__name__ == "BlockStored":
                        stats["stored"] += len(e.block_hashes)
                    else:
                        stats["removed"] += len(e.block_hashes)
            start_step(pod, now)
            continue
        now = t_arr
        req = reqs[ai]
        ai += 1
        if wants_events:
            while deliveries and deliveries[0][0] <= now:
                _, _, name, payload = heapq.heappop(deliveries)
                deliver(name, payload)
            transport.settle()
            sched.settle()
        if now - last_scrape >= opt.metrics_interval:
            last_scrape = now
            scraped = {n: LoadSnapshot(waiting=p.num_waiting, running=p.num_running, kv_usage=p.kv_usage,
                                       kv_capacity_tokens=float(p.num_blocks * p.block_size))
                       for n, p in pods.items()}
        waiting_samples.append(sum(p.num_waiting for p in pods.values()) / len(pods))
        view.now = now
        view.loads = {
            n: msgspec.structs.replace(scraped[n], in_flight=in_flight[n], prefill_tokens=float(prefill[n]))
            for n in names
        }
        name, uncached = sched.choose(req, view)
        sched.routed(req, name, view)
        if on_decision is not None:
            on_decision(req, name, view)
        req.predicted_uncached = max(0, uncached)
        in_flight[name] += 1
        prefill[name] += req.predicted_uncached
        pod = pods[name]
        pod.add(req)
        if not pod.busy:
            start_step(pod, now)
    while deliveries:  # the rest of the stream, for the counters
        _, _, name, payload = heapq.heappop(deliveries)
        deliver(name, payload)
    transport.settle()
    sched.settle()
    return _result(workload, sched, seed, reqs, pods, waiting_samples, ix, stats)


def _result(workload, sched, seed, reqs, pods, waiting_samples, ix, stats) -> RunResult:
    finished = [r for r in reqs if r.finish is not None]
    ttft = np.array([r.first_token - r.arrival for r in reqs if r.first_token is not None])
    out_tokens = sum(p.output_tokens for p in pods.values())
    t0 = reqs[0].arrival if reqs else 0.0
    t1 = max((r.finish for r in finished), default=t0)
    queries = sum(p.prefix_queries for p in pods.values())
    hits = sum(p.prefix_hits for p in pods.values())
    stages = []
    for i, qps in enumerate(workload.qps_stages):
        rs = [r for r in reqs if r.meta == i and r.first_token is not None]
        tt = np.array([r.first_token - r.arrival for r in rs]) if rs else np.zeros(1)
        span = workload.stage_seconds
        toks = sum(r.out_len for r in rs)
        stages.append(StageResult(qps=qps, requests=len(rs), ttft_p90=float(np.percentile(tt, 90)),
                                  ttft_mean=float(tt.mean()), output_tok_s=toks / span))
    es = ix.stats().events
    return RunResult(
        workload=workload.name,
        scheduler=sched.name,
        seed=seed,
        requests=len(reqs),
        finished=len(finished),
        output_tok_s=out_tokens / (t1 - t0) if t1 > t0 else 0.0,
        ttft_p90=float(np.percentile(ttft, 90)) if len(ttft) else math.nan,
        ttft_mean=float(ttft.mean()) if len(ttft) else math.nan,
        ttft_p50=float(np.percentile(ttft, 50)) if len(ttft) else math.nan,
        waiting_mean=float(np.mean(waiting_samples)) if waiting_samples else 0.0,
        hit_rate=hits / queries if queries else 0.0,
        preemptions=sum(p.preemptions for p in pods.values()),
        makespan=t1 - t0,
        batches=es.batches,
        blocks_stored=es.blocks_stored,
        blocks_removed=es.blocks_removed,
        published_stored=stats["stored"],
        published_removed=stats["removed"],
        index_errors=es.decode_errors,
        stages=stages,
        first_hit_rate=(sum(max(r.cached_tokens, 0) for r in reqs) / sum(len(r.prompt) for r in reqs)) if reqs else 0.0,
    )
