"""Seed 000: TTFT of growing agentic conversations on prefill (P) and decode (D) pods.

Each turn is decided by the connector's real code: :class:`connector.planner.PDPlanner`
over a real :class:`kvindex.reference.KVBlockIndex` chooses P and D and pull or
recompute (the engines' ``kv_recompute_threshold`` rule, the prompt guard, the
decode-retained store fed by D's simulated answers); P and D publish vLLM
KV-event batches (:mod:`bench.sim.wire`) that go through the library's decoder
and event pool into that index.  The time of the turn then follows from what
the plan says P computes, pulls and hands to D.

Cost model (seconds; tokens; KV of ``kv_bytes_per_token`` bytes a token):

* prefill(n | c) = alpha x (n + k x (n c + n^2 / 2)): ``n`` tokens computed
  after ``c`` tokens whose KV P already has (local or pulled), linear work
  plus attention of the new tokens over the whole context.  k = attention
  FLOPs per token pair / linear FLOPs per token, from the architecture:
  (4 x 64 layers x 64 heads x 128) / (2 x 32.8e9) = 3.2e-5 for Qwen3-32B;
  0 for GLM-5 (its sparse attention reads a bounded number of selected
  tokens per query, so its prefill stays linear in the tokens computed).
* xfer(T) = latency + T x kv_bytes_per_token / bandwidth, one NIXL READ of T
  tokens (0 when T = 0).  Its form and latency are the fit of ``make
  bench-nixl`` on this machine (17 us + bytes / 6.7 GB/s, UCX, DRAM); the
  bandwidth is the seed's link: its reported pull times (30 ms at 2k, 130 ms
  at 24k tokens of Qwen3-32B KV) rise by 100 ms for 22,000 tokens x 256 KiB,
  i.e. 57.7 GB/s (8.6 x the DRAM copy here, about one 400 Gb/s RDMA NIC).
  The seed's 21 ms intercept is not a transfer cost (it is common to both
  curves and lands in c0).  Each READ also pays the preparation of its
  descriptors (:func:`nixl_prep`, measured here: vLLM's per-request
  ``make_prepped_xfer`` over regions x blocks descriptors), which NIXL's
  transfer telemetry, hence the seed's published transfer times, leaves out.
* A turn: TTFT = c0 + xfer(pulled) + prefill(L - local - pulled | local +
  pulled) + xfer(L - D's cached tokens).  c0 = fixed overheads common to
  both curves (router legs, D's first step); P's local and pulled tokens come
  from the plan; D pulls from P only what its own prefix cache lacks (vLLM
  0.32 NixlConnector counts D's local hits first; D keeps the previous turn).

Calibration: c0 and alpha are fitted exactly on the seed's off curve (P
without prefix cache, no bidirectional transfer) for each model.  Turns: the
seed's published conversations (:data:`SEED_TURNS`: 500 shared + the
point's own prefix tokens, 5 user turns of 150 tokens, answers of 300; a
point's TTFT is the mean over the turns), with nothing fitted on an on curve;
or, as before, a fixed share ``f`` of each turn's context as new tokens,
fitted on on-curves (:func:`fit_new_fraction`; :func:`cross_fit` fits it on
one model and predicts the other; :data:`FITTED_NEW_FRACTION` is the fit on
both, used by the quick mode and the tests).

Policies: ``off`` (no bidirectional transfer: D answers without params),
``on`` (the seed: one P without prefix cache, D's retained KV pulled when
the planner says so), ``ours`` (several P pods with prefix caching on, their
KV events in the index; the planner picks the P holding the longest prefix
and pulls from D only what D holds beyond it, by the threshold rule with the
threshold :mod:`connector.advisor` recommends for the model and link).
"""

from __future__ import annotations

import heapq
import itertools
from collections import deque
from collections.abc import Sequence

import msgspec
import numpy as np

from bench.sim.engine import SimPod, SimRequest, chain_hashes
from bench.sim.wire import BlockStored, encode_batch, topic
from connector.advisor import ModelKV, TransferCost, advise
from connector.decode_alone import DecodeAloneRule
from connector.params import RemoteKVParams
from connector.planner import PDPlanner
from connector.retained import RetainedStore
from kvindex.facade import Config, Indexer
from kvevents.pool import RawMessage, Source
from kvindex.reference import KVBlockIndex
from kvindex.keys import TokenProcessor
from scorer.load import LoadSnapshot

__all__ = [
    "BenchClients",
    "BenchPoint",
    "BenchRecord",
    "BenchResult",
    "SEED_CLIENTS",
    "StepCost",
    "bench_mean",
    "bench_sweep",
    "bench_table",
    "calibrate_bench",
    "plot_bench",
    "run_benchmark",
    "PDModel",
    "PDPoint",
    "PDResult",
    "PDSim",
    "QWEN3_32B",
    "GLM5_FP8",
    "PUBLISHED",
    "SEED_TURNS",
    "TurnStructure",
    "calibrate",
    "cross_fit",
    "fit_new_fraction",
    "sweep",
    "table",
    "plot",
]

MODEL = "seed000-model"
#: NIXL READ cost measured here (bench/bench_nixl.py fit, UCX over DRAM): latency in seconds.
NIXL_LATENCY_S = 17e-6
#: The seed's link: (130 - 30) ms for 22,000 tokens of 262,144 bytes.
SEED_LINK_BYTES_PER_S = 22_000 * 262_144 / 0.100
#: NIXL descriptor preparation per READ measured here (``bench/bench_nixl.py`` ``prep_rows``: vLLM's per-request
#: ``make_prepped_xfer`` over 128 regions of 4 KiB blocks; 2026-12-02, the median over ten runs of each run's 15-rep
#: median, bench/sim/README.md; at 204,800 descriptors the runs gave 6.2-17.0 ms): (descriptors, seconds).  CPU work
#: of the loading engine's worker, outside NIXL's transfer telemetry (timed from the post), so not in the seed's
#: published transfer times; taken 1:1 for the seed's CPUs (both Sapphire Rapids class Xeons: this machine's cores
#: report AMX and AVX512-FP16; a p5en.48xlarge has Xeon Platinum 8488C).
NIXL_PREP_S = ((0, 0.0), (2_048, 0.065e-3), (8_192, 0.251e-3), (32_768, 0.998e-3), (65_536, 1.860e-3),
               (131_072, 6.16e-3), (204_800, 9.94e-3))


def nixl_prep(descriptors: int) -> float:
    """Seconds to prepare one READ of ``descriptors`` descriptors: :data:`NIXL_PREP_S` interpolated linearly, past
    its last row at that row's seconds per descriptor."""
    if descriptors <= 0:
        return 0.0
    for (n0, t0), (n1, t1) in itertools.pairwise(NIXL_PREP_S):
        if descriptors <= n1:
            return t0 + (t1 - t0) * (descriptors - n0) / (n1 - n0)
    n, t = NIXL_PREP_S[-1]
    return t * descriptors / n


class SeedCurves(msgspec.Struct, frozen=True):
    """One model's published seed-000 curves: TTFT seconds by context tokens, and its KV shape.

    transfer: the seed's published D -> P KV-transfer time (s) at its first and
    last point (the P node's "KV Transfer metrics" averages).  nixl_regions /
    engine_block: the NIXL regions a tensor-parallel rank registers (vLLM's
    NixlConnector: K and V of every layer, or one per layer for MLA) and the
    engine's block size in tokens; a READ of b blocks has regions x b
    descriptors."""

    name: str
    off: dict[int, float]
    on: dict[int, float]
    kv_bytes_per_token: float
    attention_ratio: float
    transfer: dict[int, float] = {}
    nixl_regions: int = 0
    engine_block: int = 16


#: Qwen3-32B, 1P1D, prefix caching off on P: 64 layers x 8 KV heads x 128 x bf16 x K,V; vLLM's CUDA default
#: block of 16 tokens; 128 NIXL regions (K and V per layer).
QWEN3_32B = SeedCurves("Qwen3-32B", {2000: 0.158, 24000: 0.778}, {2000: 0.122, 24000: 0.460},
                       262_144.0, 4 * 64 * 64 * 128 / (2 * 32.8e9), {2000: 0.030, 24000: 0.130},
                       nixl_regions=128, engine_block=16)
#: GLM-5-FP8: MLA latent 512 + 64 per layer, 78 layers, FP8 (the advisor's assumption); sparse attention; MLA's
#: 64-token blocks, one NIXL region per layer (assumed; its indexer cache not counted).
GLM5_FP8 = SeedCurves("GLM-5-FP8", {2000: 0.500, 20000: 2.334}, {2000: 0.358, 20000: 0.702},
                      78 * 576 * 1.0, 0.0, {2000: 0.029, 20000: 0.110}, nixl_regions=78, engine_block=64)
PUBLISHED = {c.name: c for c in (QWEN3_32B, GLM5_FP8)}


class TurnStructure(msgspec.Struct, frozen=True, kw_only=True):
    """The seed's published conversations (vLLM's multi-turn benchmark as its sweep script sets it).

    A conversation at published point ``x`` starts with ``common_prefix`` tokens
    shared by every conversation, then ``x`` tokens of its own, then the first
    user message; each of its ``user_turns`` user messages has ``user_tokens``
    tokens and each answer ``output_tokens``.  Turn k (1-based) sends
    common_prefix + x + k x user_tokens + (k - 1) x output_tokens tokens.  The
    published TTFT at ``x`` is the mean over every turn of the conversations
    at that point (turn 1 included: nothing is retained yet, so it recomputes
    in both modes).
    """

    common_prefix: int = 500
    user_tokens: int = 150
    output_tokens: int = 300
    user_turns: int = 5

    def contexts(self, prefix: int) -> list[int]:
        """Prompt tokens of each user turn of a conversation with ``prefix`` tokens of its own."""
        return [self.common_prefix + prefix + k * self.user_tokens + (k - 1) * self.output_tokens
                for k in range(1, self.user_turns + 1)]


#: Seed 000's sweep (vLLM blog 2026-10-12, run_multiturn_sweep.sh): NUM_TURNS 10 (user and assistant
#: messages: 5 user turns), INPUT_TOKENS 150, OUTPUT_TOKENS 300, prefix_num_tokens = the point;
#: common_prefix_num_tokens 500 from the benchmark's generate_multi_turn.json, which the sweep keeps.
SEED_TURNS = TurnStructure()


class PDModel(msgspec.Struct, frozen=True, kw_only=True):
    """Calibrated turn-cost model (see the module doc); seconds, tokens, bytes."""

    c0: float
    alpha: float
    k: float
    kv_bytes_per_token: float
    latency: float = NIXL_LATENCY_S
    bandwidth: float = SEED_LINK_BYTES_PER_S
    nixl_regions: int = 0
    engine_block: int = 16

    def prefill(self, n: int, context: int = 0) -> float:
        """Seconds to compute ``n`` tokens after ``context`` tokens whose KV is present."""
        return self.alpha * (n + self.k * (n * context + n * n / 2))

    def xfer(self, tokens: int) -> float:
        """Seconds for one NIXL READ of ``tokens`` tokens of KV (0 for none): its descriptors' preparation
        (:func:`nixl_prep`; none without ``nixl_regions``), then latency + bytes / bandwidth."""
        if tokens <= 0:
            return 0.0
        prep = nixl_prep(self.nixl_regions * -(-tokens // self.engine_block))
        return prep + self.latency + tokens * self.kv_bytes_per_token / self.bandwidth

    def turn(self, prompt: int, local: int, pulled: int, decode_cached: int) -> float:
        """TTFT of one turn: P pulls ``pulled``, computes the rest after ``local + pulled``, D pulls what it lacks."""
        have = local + pulled
        return self.c0 + self.xfer(pulled) + self.prefill(prompt - have, have) + self.xfer(prompt - decode_cached)


class TurnRecord(msgspec.Struct, frozen=True):
    """One simulated turn: its context, the plan's decision and token counts, and TTFT (s)."""

    context: int
    action: str
    prefill_pod: str
    local: int
    pulled: int
    decode_cached: int
    ttft: float


class PDSim:
    """P and D pods, the library's index and the connector's planner, on simulated time.

    Args:
        model: the cost model.
        prefill_pods: number of P pods.
        prefix_caching: P pods cache and publish their blocks (KV events).
        bidirectional: D answers with retained-KV params (the seed's "on").
        block_size: tokens per block (vLLM's GPU default 16).
        threshold: ``kv_recompute_threshold`` of engines and planner (tokens).
        decode_alone: the planner's decode-alone rule (None: every turn has a P leg).
    """

    def __init__(self, model: PDModel, *, prefill_pods: int = 1, prefix_caching: bool = False,
                 bidirectional: bool = True, block_size: int = 16, threshold: int = 64,
                 decode_alone: DecodeAloneRule | None = None) -> None:
        self.model = model
        self.bs = block_size
        self.p_pods = [f"p{i}" for i in range(prefill_pods)]
        self.d_pods = ["d0"]
        self.prefix_caching = prefix_caching
        self.bidirectional = bidirectional
        self.now = 0.0
        cfg = Config.from_dict({
            "model_name": MODEL,
            "token_processor_config": {"block_size": block_size},
            "kv_events_config": {"concurrency": 1, "queue_size": 10_000},
        })
        tpc = cfg.token_processor_config
        index = KVBlockIndex(TokenProcessor(block_size=block_size, hash_seed=tpc.hash_seed, algorithm=tpc.algorithm),
                             clock=lambda: self.now)
        self.ix = Indexer(cfg, index=index).start()
        self.store = RetainedStore(self.ix.index, clock=lambda: self.now)
        self.planner = PDPlanner(self.ix.index, self.ix.token_processor, self.store,
                                 recompute_threshold=threshold, model=MODEL, decode_alone=decode_alone)
        self.cached: dict[str, set[int]] = {p: set() for p in self.p_pods + self.d_pods}  # engine hashes
        self.seq = dict.fromkeys(self.p_pods + self.d_pods, 0)
        self.sources = {p: Source(pod=p, model=MODEL) for p in self.seq}
        self._req = itertools.count()
        self._dirty = False

    def close(self) -> None:
        """Stop the indexer's event pool."""
        self.ix.stop()

    def _publish(self, pod: str, tokens: np.ndarray) -> int:
        """``pod`` now holds ``tokens``' full blocks: publish the new ones as one vLLM batch; returns cached tokens before."""
        hashes = chain_hashes(tokens, self.bs)
        held = self.cached[pod]
        hit = 0
        while hit < len(hashes) and hashes[hit] in held:
            hit += 1
        new = hashes[hit:]
        if new:
            held.update(new)
            ev = BlockStored(block_hashes=new, parent_block_hash=hashes[hit - 1] if hit else None,
                             token_ids=tokens[hit * self.bs:len(hashes) * self.bs].tolist(), block_size=self.bs,
                             medium="GPU")
            seq = self.seq[pod]
            self.seq[pod] = seq + 1
            msg = RawMessage(self.sources[pod], topic(pod, MODEL), seq.to_bytes(8, "big"), encode_batch(self.now, [ev]))
            while not self.ix.pool.submit(msg):
                self.ix.flush()
            self._dirty = True
        return hit * self.bs

    def _settle(self) -> None:
        """Apply every published batch before the next decision (the router is never stale here)."""
        if self._dirty:
            if not self.ix.flush(60.0):
                raise RuntimeError("the write path did not apply the events in time")
            self._dirty = False

    def turn(self, cid: str, prompt: np.ndarray, output: np.ndarray) -> TurnRecord:
        """Plan and time one turn; D answers ``output`` (its params refresh the retained entry when bidirectional)."""
        L = len(prompt)
        plan, local, pulled, d_hit = self.begin(cid, prompt)
        ttft = self.model.turn(L, local, pulled, d_hit)
        self.now += ttft
        if self.prefix_caching:
            self.prefill_done(plan, prompt)
        self.now += 0.02 * len(output)  # D decodes the answer
        self.answered(plan, prompt, output)
        return TurnRecord(L, plan.action, plan.prefill_pod, local, pulled, d_hit, ttft)

    def begin(self, cid: str, prompt: np.ndarray, loads: dict | None = None) -> tuple[object, int, int, int]:
        """The proxy's decision for a turn at ``self.now``: (plan, P's local tokens, tokens P pulls from D,
        tokens D already holds).  P computes at least the last prompt token, so local + pulled <= len - 1.
        ``loads``: pod -> :class:`scorer.load.LoadSnapshot` (None: idle)."""
        L = len(prompt)
        self._settle()
        plan = self.planner.plan(cid, prompt, self.p_pods, self.d_pods, loads)
        local = min(plan.local_tokens, L - 1)
        pulled = max(0, min(plan.pulled_tokens, L - 1 - local))
        d_hit = min(len(self._hits(plan.decode_pod, prompt)) * self.bs, L - 1)
        return plan, local, pulled, d_hit

    def prefill_done(self, plan, prompt: np.ndarray) -> None:
        """P finished the prompt at ``self.now``: with prefix caching it now holds (and publishes) its blocks."""
        if self.prefix_caching:
            self._publish(plan.prefill_pod, prompt)

    def answered(self, plan, prompt: np.ndarray, output: np.ndarray) -> None:
        """D finished the answer at ``self.now``: it holds prompt + answer - 1 tokens (published), and when
        bidirectional its params (``remote_num_tokens`` = that count) refresh the retained entry."""
        L = len(prompt)
        full = np.concatenate((prompt, output))
        self._publish(plan.decode_pod, full[: L + len(output) - 1])
        answer = None
        if self.bidirectional:
            n = L + len(output) - 1
            answer = RemoteKVParams(
                do_remote_decode=True, remote_block_ids=[list(range(-(-n // self.bs)))],
                remote_engine_id=plan.decode_pod, remote_request_id=f"r{next(self._req)}", remote_host="10.0.0.2",
                remote_port=5600, remote_num_tokens=n, remote_blocks_expiry_time=self.now + 480.0,
                transfer_mode="pull",
            )
        self.planner.decode_answered(plan, answer, full)

    def _hits(self, pod: str, prompt: np.ndarray) -> list[int]:
        hashes = chain_hashes(prompt, self.bs)
        held = self.cached[pod]
        out = []
        for h in hashes:
            if h not in held:
                break
            out.append(h)
        return out


def conversation_contexts(target: int, new_fraction: float, output: int, start: int = 1024) -> list[int]:
    """Context lengths of a conversation whose last turn has ``target`` tokens and whose turns each
    bring ``new_fraction`` of their context as new tokens (the rest: previous prompt + D's
    ``output``-token answer), going back to a first turn of at least ``start`` tokens."""
    if not 0.0 < new_fraction < 1.0:
        raise ValueError("new_fraction must be in (0, 1)")
    out = [target]
    while True:
        prev = int(round((1.0 - new_fraction) * out[-1])) - output
        if prev < start:
            break
        out.append(prev)
    return out[::-1]


def _conversation(contexts: Sequence[int], output: int, seed: int) -> list[tuple[np.ndarray, np.ndarray]]:
    """(prompt, answer) per turn: each prompt extends the previous prompt and answer."""
    rng = np.random.default_rng(seed)
    turns = []
    prompt = rng.integers(1, 150_000, size=contexts[0], dtype=np.int32)
    for i, L in enumerate(contexts):
        if i:
            prev, ans = turns[-1]
            grow = L - len(prev) - len(ans)
            prompt = np.concatenate((prev, ans, rng.integers(1, 150_000, size=grow, dtype=np.int32)))
        turns.append((prompt, rng.integers(1, 150_000, size=output, dtype=np.int32)))
    return turns


def _structured_conversation(ts: TurnStructure, prefix: int, seed: int,
                             common: np.ndarray) -> list[tuple[np.ndarray, np.ndarray]]:
    """(prompt, answer) per user turn of one :class:`TurnStructure` conversation."""
    rng = np.random.default_rng(seed)
    turns: list[tuple[np.ndarray, np.ndarray]] = []
    prompt = np.concatenate((common, rng.integers(1, 150_000, size=prefix + ts.user_tokens, dtype=np.int32)))
    for _ in range(ts.user_turns):
        if turns:
            prev, ans = turns[-1]
            prompt = np.concatenate((prev, ans, rng.integers(1, 150_000, size=ts.user_tokens, dtype=np.int32)))
        turns.append((prompt, rng.integers(1, 150_000, size=ts.output_tokens, dtype=np.int32)))
    return turns


def _mean_record(point: int, recs: Sequence[TurnRecord]) -> TurnRecord:
    """One point of a structured sweep: the turns' mean TTFT and token counts (the last turn's action)."""
    n = len(recs)
    return TurnRecord(point, recs[-1].action, recs[-1].prefill_pod, round(sum(r.local for r in recs) / n),
                      round(sum(r.pulled for r in recs) / n), round(sum(r.decode_cached for r in recs) / n),
                      sum(r.ttft for r in recs) / n)


def run_policy(model: PDModel, policy: str, contexts: Sequence[int], *, new_fraction: float | None = None,
               output: int = 200, structure: TurnStructure | None = None, seed: int = 0, block_size: int = 16,
               threshold: int = 64) -> dict[int, TurnRecord]:
    """TTFT at each point of ``contexts`` under ``policy`` (off, on, ours), one conversation per point.

    With ``structure``: the point is the conversation's own prefix and its
    record the mean over the conversation's turns (the seed's measure).
    Otherwise (``new_fraction`` given): the point is the last turn's context,
    each turn bringing ``new_fraction`` of its context as new tokens, and the
    record is that last turn's."""
    if policy not in ("off", "on", "ours"):
        raise ValueError(f"unknown policy {policy!r}")
    if (structure is None) == (new_fraction is None):
        raise ValueError("give exactly one of structure and new_fraction")
    sim = PDSim(model, prefill_pods=2 if policy == "ours" else 1, prefix_caching=policy == "ours",
                bidirectional=policy != "off", block_size=block_size, threshold=threshold)
    out: dict[int, TurnRecord] = {}
    common = np.random.default_rng(seed + 7).integers(1, 150_000, size=structure.common_prefix if structure else 0,
                                                      dtype=np.int32)
    try:
        for j, L in enumerate(contexts):
            if structure is not None:
                turns = _structured_conversation(structure, L, seed * 1000 + j, common)
                out[L] = _mean_record(L, [sim.turn(f"c{j}", prompt, ans) for prompt, ans in turns])
                continue
            assert new_fraction is not None
            turns = _conversation(conversation_contexts(L, new_fraction, output), output, seed * 1000 + j)
            rec = None
            for prompt, ans in turns:
                rec = sim.turn(f"c{j}", prompt, ans)
            assert rec is not None and rec.context == L
            out[L] = rec
    finally:
        sim.close()
    return out


def calibrate(curves: SeedCurves, new_fraction: float | None = None, output: int = 200, *,
              structure: TurnStructure | None = None, block_size: int = 16) -> PDModel:
    """c0 and alpha through the published off points, with the same turns the simulation runs.

    A point's off TTFT is c0 + alpha x G + X (G: prefill work per alpha, X:
    D's pulls, both averaged like the point): G and X come from two probe runs
    (alpha 1 and alpha 0; the plans do not depend on the costs), then the two
    published points give c0 and alpha exactly."""
    probe = PDModel(c0=0.0, alpha=1.0, k=curves.attention_ratio, kv_bytes_per_token=curves.kv_bytes_per_token,
                    nixl_regions=curves.nixl_regions, engine_block=curves.engine_block)
    kw = dict(new_fraction=new_fraction, output=output, structure=structure, block_size=block_size)
    pts = sorted(curves.off)
    one = run_policy(probe, "off", pts, **kw)
    zero = run_policy(msgspec.structs.replace(probe, alpha=0.0), "off", pts, **kw)
    rows = [[1.0, one[L].ttft - zero[L].ttft] for L in pts]
    ys = [curves.off[L] - zero[L].ttft for L in pts]
    c0, alpha = np.linalg.solve(np.array(rows), np.array(ys))
    return msgspec.structs.replace(probe, c0=float(c0), alpha=float(alpha))


def _on_errors(curves: SeedCurves, new_fraction: float | None, output: int, block_size: int,
               structure: TurnStructure | None = None) -> tuple[PDModel, dict[int, float]]:
    m = calibrate(curves, new_fraction, output, structure=structure, block_size=block_size)
    recs = run_policy(m, "on", sorted(curves.on), new_fraction=new_fraction, output=output, structure=structure,
                      block_size=block_size)
    return m, {L: recs[L].ttft / t - 1.0 for L, t in curves.on.items()}


def fit_new_fraction(curves: Sequence[SeedCurves] = (GLM5_FP8,), output: int = 200, block_size: int = 16,
                     lo: float = 0.05, hi: float = 0.5, tol: float = 0.0025) -> float:
    """The share of new tokens per turn that best fits the on points of ``curves`` (least worst
    relative error over all of them; each model calibrated on its own off curve).  Both
    errors grow with the share, so the worst one is unimodal in it: ternary search to ``tol``."""

    def worst(f: float) -> float:
        return max(abs(e) for c in curves for e in _on_errors(c, f, output, block_size)[1].values())

    while hi - lo > tol:
        a, b = lo + (hi - lo) / 3, hi - (hi - lo) / 3
        if worst(a) <= worst(b):
            hi = b
        else:
            lo = a
    return round((lo + hi) / 2, 3)


class CrossFit(msgspec.Struct, frozen=True):
    """The new share fitted on one model's on points and the other's on curve predicted with it."""

    fitted_on: str
    new_fraction: float
    own_error: dict[int, float]
    predicted: str
    predicted_error: dict[int, float]


def cross_fit(output: int = 200, block_size: int = 16) -> list[CrossFit]:
    """Both directions: fit the share on Qwen3-32B and predict GLM-5-FP8, and the reverse."""
    out = []
    for fit, other in ((QWEN3_32B, GLM5_FP8), (GLM5_FP8, QWEN3_32B)):
        f = fit_new_fraction((fit,), output, block_size)
        out.append(CrossFit(fit.name, f, _on_errors(fit, f, output, block_size)[1], other.name,
                            _on_errors(other, f, output, block_size)[1]))
    return out


class PDPoint(msgspec.Struct, frozen=True):
    """One context length: TTFT (s) under each policy, and the turn's decisions."""

    context: int
    off: float
    on: float
    ours: float
    on_pulled: int
    ours_local: int
    ours_pulled: int


class PDResult(msgspec.Struct, frozen=True):
    """A sweep: the calibrated models, the turn structure, the points and the errors at the published points.

    model: Qwen3-32B's; glm_model / glm_on_error: GLM-5-FP8's calibration and
    on-curve errors with the same turn structure.  structure: the seed's
    published conversations (points are a conversation's own prefix, TTFT the
    mean over its turns), or None: then each turn brings ``new_fraction`` of
    its context as new tokens with ``output``-token answers, points are the
    last turn's context, and fit_on names the curves the share was fitted on
    (empty when it was given)."""

    model: PDModel
    glm_model: PDModel
    fit_on: list[str]
    new_fraction: float | None
    output: int
    block_size: int
    threshold: int
    ours_threshold: int
    points: list[PDPoint]
    published_off: dict[int, float]
    published_on: dict[int, float]
    on_error: dict[int, float]
    glm_on_error: dict[int, float]
    structure: TurnStructure | None = None


#: The new share per turn fitted on both models' on points (``fit_new_fraction((GLM5_FP8, QWEN3_32B))``,
#: output 200, block size 16); used by ``--quick`` and the tests.  Fitted on GLM-5-FP8 alone: 0.209;
#: on Qwen3-32B alone: 0.241.
FITTED_NEW_FRACTION = 0.233


def sweep(*, output: int = 200, block_size: int = 16, threshold: int = 64, new_fraction: float | None = None,
          structure: TurnStructure | None = None, fit_curves: Sequence[SeedCurves] = (GLM5_FP8, QWEN3_32B),
          contexts: Sequence[int] = tuple(range(2000, 24001, 2000))) -> PDResult:
    """Calibrate Qwen3-32B on its off curve, predict its on curve, and run the three policies over
    ``contexts``.  Turns: the seed's published ``structure`` if given (nothing fitted on an on
    curve), else a share ``new_fraction`` of new tokens per turn, fitted on ``fit_curves``' on
    points when not given."""
    if structure is not None:
        f = None
        kw: dict = dict(structure=structure, block_size=block_size)
    else:
        f = fit_new_fraction(fit_curves, output, block_size) if new_fraction is None else new_fraction
        kw = dict(new_fraction=f, output=output, block_size=block_size)
    glm_model, glm_err = _on_errors(GLM5_FP8, f, output, block_size, structure)
    m = calibrate(QWEN3_32B, f, output, structure=structure, block_size=block_size)
    xs = sorted(set(contexts) | set(QWEN3_32B.on) | set(QWEN3_32B.off))
    off = run_policy(m, "off", xs, **kw, threshold=threshold)
    on = run_policy(m, "on", xs, **kw, threshold=threshold)
    # ours configures engines and planner with connector.advisor's threshold for this model and link
    adv = advise(ModelKV(name=QWEN3_32B.name, layers=64, kv_heads=8, head_dim=128), m.alpha,
                 TransferCost(latency_s=m.latency, bytes_per_s=m.bandwidth), block_size=block_size)
    ours_threshold = adv.recommended_threshold if adv.recommended_threshold is not None else threshold
    ours = run_policy(m, "ours", xs, **kw, threshold=ours_threshold)
    points = [PDPoint(L, off[L].ttft, on[L].ttft, ours[L].ttft, on[L].pulled, ours[L].local, ours[L].pulled)
              for L in xs]
    err = {L: on[L].ttft / t - 1.0 for L, t in QWEN3_32B.on.items()}
    fit_on = [c.name for c in fit_curves] if structure is None and new_fraction is None else []
    return PDResult(m, glm_model, fit_on, f, output, block_size, threshold, ours_threshold, points,
                    dict(QWEN3_32B.off), dict(QWEN3_32B.on), err, glm_err, structure)


def table(res: PDResult) -> str:
    """Markdown: the calibration, then one row per context."""
    m, g = res.model, res.glm_model
    if res.structure is not None:
        t = res.structure
        head = (f"Turns as the seed published them: {t.common_prefix} shared + the point's own prefix, "
                f"{t.user_turns} user turns of {t.user_tokens} tokens, answers of {t.output_tokens}; a point's "
                "TTFT is the mean over its turns (nothing fitted on an on curve). GLM-5-FP8 with it: on-curve "
                "errors ")
        what, unit = "prefix", "mean pulled"
    else:
        fitted = f"fitted on the on points of {' and '.join(res.fit_on)}" if res.fit_on else "given"
        head = (f"Turn structure: each turn brings {res.new_fraction:.1%} of its context as new tokens, D answers "
                f"{res.output} ({fitted}). GLM-5-FP8 with it: on-curve errors ")
        what, unit = "context", "pulled"
    lines = [
        head + ", ".join(f"{e:+.1%} at {L:,}" for L, e in sorted(res.glm_on_error.items()))
        + f" (its off fit: c0 = {g.c0 * 1e3:.0f} ms, alpha = {g.alpha * 1e6:.1f} us/token, k = 0).",
        f"Qwen3-32B calibration on its off curve: c0 = {m.c0 * 1e3:.1f} ms, alpha = {m.alpha * 1e6:.2f} us/token, "
        f"k = {m.k:.2e}; NIXL READ = {m.latency * 1e6:.0f} us + 256 KiB/token at {m.bandwidth / 1e9:.1f} GB/s; "
        f"block size {res.block_size}, kv_recompute_threshold {res.threshold} (ours: {res.ours_threshold}, "
        "from connector.advisor for this prefill cost and link).",
        "",
        f"| {what} | off ms | on ms (model) | published on ms | error | on: {unit} | ours ms | ours: local / pulled | ours / on |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for p in res.points:
        pub = res.published_on.get(p.context)
        e = res.on_error.get(p.context)
        pubs = f"{pub * 1e3:.0f} | {e:+.1%}" if pub is not None else "- | -"
        lines.append(f"| {p.context:,} | {p.off * 1e3:.0f} | {p.on * 1e3:.0f} | {pubs} | {p.on_pulled:,} | "
                     f"{p.ours * 1e3:.0f} | {p.ours_local:,} / {p.ours_pulled:,} | {p.ours / p.on:.2f} |")
    return "\n".join(lines)


def _plot_ttft(
    path, xs: list[int], curves: list[tuple[list[float], str]], published: tuple[dict, dict], xlabel: str, title: str
) -> None:
    """TTFT curves (seconds, drawn in ms) against ``xs`` and the seed's off/on points (crosses)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for ys, label in curves:
        ax.plot(xs, [y * 1e3 for y in ys], marker="o", label=label)
    for color, name, pts in (("C0", "seed off", published[0]), ("C1", "seed on", published[1])):
        ax.scatter(list(pts), [v * 1e3 for v in pts.values()], marker="x", s=80, color=color, label=name)
    ax.set_xlabel(xlabel)
    ax.set_ylabel("TTFT (ms)")
    ax.set_title(title)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot(res: PDResult, path) -> None:
    """TTFT per context: the three policies (lines) and the seed's points (crosses)."""
    pts = res.points
    _plot_ttft(
        path, [p.context for p in pts],
        [([p.off for p in pts], "off (fitted on the seed's 2 points)"),
         ([p.on for p in pts], "bidirectional on, 1 P (model)"),
         ([p.ours for p in pts], "ours: 2 P with prefix cache + index")],
        (res.published_off, res.published_on),
        "conversation prefix tokens (mean over its turns)" if res.structure is not None else "context tokens of the turn",
        "Seed 000: Qwen3-32B, 1 D",
    )


# --------------------------------------------------------------------------------------------------
# The seed's benchmark as it ran: two clients at once, P and D as continuously batching engines.


class BenchClients(msgspec.Struct, frozen=True, kw_only=True):
    """vLLM's ``benchmarks/multi_turn/benchmark_serving_multi_turn.py`` as seed 000's sweep script runs it.

    Sources: the seed's ``run_multiturn_sweep.sh`` (vllm-project.github.io
    ``assets/repro/2026-10-12-bidirectional-kvxfer-multiturn-agentic-workload/``):
    ``NUM_CLIENTS`` 2, ``MAX_ACTIVE_CONVERSATIONS`` 10, 10 conversations,
    ``--warmup-percentages=0%,20%`` (a report filter; the published TTFT is the
    mean over every record of ``--stats-json-output``), no ``--request-rate``
    (0: no pause between a client's requests), no ``--warmup-step``; its
    ``serve_pd_multiturn.sh``: ``--max-num-seqs 8`` on P and D.  The benchmark
    (``client_main``, ``get_client_config``): each client is a process sending
    one request at a time; it takes up to ``max_active_conversations //
    num_clients`` conversations from a shared queue and serves them round robin
    (``conv_id_queue.pop()``, unfinished ones back with ``appendleft``); when
    one finishes it asks the queue for another and, finding the end marker,
    exits at once, leaving its other conversations unfinished; with the
    default early stop the first client to exit stops the others after their
    request in flight.

    Assumptions (not published): ``tpot`` is D's decode step (seconds; Qwen3-32B
    with tensor parallel 8 on H200, batch <= 8); P's and D's per-step token
    budget is vLLM's default for the API server on large GPUs (8,192);
    ``start_skew`` delays client 1's first request (0: both start together, as
    two processes woken by the same queue).

    ``aligned_loads``: a connector load (P pulling D's retained KV, D pulling
    P's prompt KV) follows the engine's steps as vLLM's V1 scheduler and
    NixlConnector do, instead of starting on arrival and ending the moment the
    bytes are in (False: the previous model).  vLLM 0.29-0.32: the scheduler
    puts a request with remote KV in ``WAITING_FOR_REMOTE_KVS`` at its next
    ``schedule()`` (the end of the engine's current step); the worker starts
    the NIXL READ when it executes that step (``start_load_kv``, right after
    the forward is launched); ``get_finished`` is polled right after each
    step's launch, so a finished read is reported in the output of the first
    step that starts after it, and the request is scheduled for its remaining
    tokens only in the step after that (``_update_from_kv_xfer_finished``, then
    ``_update_waiting_for_remote_kv``).  An idle engine runs empty connector
    steps (``kv_connector_no_forward``), so there the load costs the READ
    alone.

    ``async_scheduling``: vLLM's asynchronous scheduling (on by default on GPUs
    since vLLM 0.14, so in the seed's 0.29; ``EngineCore.step_with_batch_queue``
    with a batch queue of 2): the scheduler plans step n + 1 while step n runs,
    so a request that becomes schedulable during step n (a new arrival, or a
    load reported with step n's output) is planned at step n's end into step
    n + 2 and computed one step later than without it; an engine with nothing
    else to plan takes it at once.  READs still start when the step that carries
    them is launched (the worker picks it up as soon as the previous step is
    launched).  On by default, as in the seed's engines (vLLM 0.32's
    ``VllmConfig`` enables it unless pooling, pipeline parallelism, an executor
    or a speculative method without support rules it out; a KV connector does
    not).
    """

    num_clients: int = 2
    max_active_conversations: int = 10
    num_conversations: int = 10
    early_stop: bool = True
    max_num_seqs: int = 8
    max_num_batched_tokens: int = 8192
    tpot: float = 0.007
    start_skew: float = 0.0
    aligned_loads: bool = True
    async_scheduling: bool = True


#: Seed 000's benchmark clients (see :class:`BenchClients`).
SEED_CLIENTS = BenchClients()


class StepCost(msgspec.Struct, frozen=True):
    """Step time of a P or D engine in the calibrated model: ``overhead + alpha x (tokens + k x pairs)`` seconds.

    Summed over a prefill's chunks this is exactly :meth:`PDModel.prefill` with
    n (n + 1) / 2 for n^2 / 2 (the engine's attention pairs), so a request alone
    on P takes the sequential model's time.  Duck-types :class:`bench.sim.engine.CostModel`."""

    alpha: float
    k: float
    overhead: float = 0.0

    def step_time(self, tokens: int, attention_pairs: float, kv_tokens_read: float) -> float:
        return self.overhead + self.alpha * (tokens + self.k * attention_pairs)


class BenchRecord(msgspec.Struct, frozen=True):
    """One request of the simulated benchmark (times in seconds of simulated time).

    p_queue / d_queue: time the request spent on P / D beyond what it needs
    alone (waiting behind and sharing steps with the other clients' requests);
    always >= 0 (up to rounding)."""

    client: int
    conversation: int
    turn: int
    context: int
    action: str
    prefill_pod: str
    local: int
    pulled: int
    decode_cached: int
    start: float
    ttft: float
    p_queue: float
    d_queue: float


class _Replayed(msgspec.Struct, frozen=True):
    """A recorded decision standing in for the planner's plan (the fields the timing reads)."""

    action: str
    prefill_pod: str
    decode_pod: str


class _Flight:
    """A request in flight through proxy, P and D."""

    __slots__ = ("client", "conv", "turn", "prompt", "output", "plan", "local", "pulled", "d_hit", "start",
                 "p_ready", "p_done", "d_ready", "ttft", "p_alone", "alone")

    def __init__(self, **kw) -> None:
        for k, v in kw.items():
            setattr(self, k, v)


class _Load:
    """A connector load on an engine: request id, arrival, READ seconds, end of the READ (None: not started,
    the engine's current step schedules it), and whether a step's poll has reported it."""

    __slots__ = ("rid", "arrived", "read", "done", "reported")

    def __init__(self, rid: int, arrived: float, read: float) -> None:
        self.rid, self.arrived, self.read = rid, arrived, read
        self.done: float | None = None
        self.reported = False


def _alone(model: PDModel, n: int, c: int) -> float:
    """Seconds an engine of :class:`StepCost` spends computing ``n`` tokens after ``c`` (its chunks summed)."""
    return model.alpha * (n + model.k * (n * c + n * (n + 1) / 2))


def run_benchmark(model: PDModel, policy: str, prefix: int, *, structure: TurnStructure = SEED_TURNS,
                  clients: BenchClients = SEED_CLIENTS, seed: int = 0, block_size: int = 16,
                  threshold: int = 64, replay: Sequence[BenchRecord] | None = None,
                  trace: dict | None = None, decode_alone: DecodeAloneRule | None = None) -> list[BenchRecord]:
    """One point of the seed's sweep as its benchmark runs it: every request's record, in completion order.

    Clients as :class:`BenchClients`; each request goes proxy (``c0``, no
    engine time) -> P (load of the pulled tokens, then P's continuous batching
    with chunked prefill, ``max_tokens`` 1) -> D (load of what D lacks, then
    one step that samples the first token; TTFT ends there) -> D decodes the
    answer (``structure.output_tokens`` steps) -> the client sends its next
    request.  Loads are one NIXL READ each (:meth:`PDModel.xfer`) while the
    engine steps on (vLLM's ``WAITING_FOR_REMOTE_KVS``); with
    ``clients.aligned_loads`` (default) the READ starts with the step that
    schedules the request and the request joins the queue as that engine's
    step polls report it (see :class:`BenchClients`), else the READ starts
    on arrival and the request joins at the first step boundary after it.
    Which turns pull and how much is decided by the connector's planner over
    the library's index, as in :meth:`PDSim.turn`.  ``replay``: the records of
    an earlier run of the same point and policy; their decisions are reused
    instead of asking the planner again (they do not depend on the costs: a
    conversation's next turn is only sent after its previous one finished),
    which the calibration uses to time many cost models quickly.  ``trace``: if given, filled with
    ``steps[engine] = [(start, end), ...]`` (s; every step each engine ran), ``idle[engine]`` (the times it
    found no work of its own) and ``loads = [(engine, arrival, read, admitted), ...]`` (every connector load
    with ``aligned_loads``: when it reached the engine, its READ seconds, when it joined the waiting queue),
    and with ``clients.async_scheduling`` ``joins = [(engine, schedulable, queued), ...]`` (when each request
    could be scheduled and when the engine's planner took it), for checking the step rules against plain oracles.
    ``decode_alone``: the planner's decode-alone rule (conditional disaggregation; D's load is its queue and
    running requests); a turn it gives to D goes there at once and D prefills what its cache lacks in its steps."""
    if policy not in ("off", "on", "ours"):
        raise ValueError(f"unknown policy {policy!r}")
    if clients.num_clients < 1 or clients.max_active_conversations < clients.num_clients:
        raise ValueError("need at least one active conversation per client")
    sim = PDSim(model, prefill_pods=2 if policy == "ours" else 1, prefix_caching=policy == "ours",
                bidirectional=policy != "off", block_size=block_size, threshold=threshold, decode_alone=decode_alone)
    decided = {(r.conversation, r.turn): r for r in replay} if replay is not None else None
    cost_p = StepCost(model.alpha, model.k)
    cost_d = StepCost(model.alpha, model.k, clients.tpot)
    big = 1 << 23  # tokens of KV per engine: the seed's 8 x H200 never run short at 10 conversations
    p_eng = {p: SimPod(p, big, block_size=block_size, cost=cost_p, prefix_caching=False,  # type: ignore[arg-type]
                       max_num_batched_tokens=clients.max_num_batched_tokens, max_num_seqs=clients.max_num_seqs)
             for p in sim.p_pods}
    d_eng = {d: SimPod(d, big, block_size=block_size, cost=cost_d, prefix_caching=False,  # type: ignore[arg-type]
                       max_num_batched_tokens=clients.max_num_batched_tokens, max_num_seqs=clients.max_num_seqs)
             for d in sim.d_pods}
    common = np.random.default_rng(seed + 7).integers(1, 150_000, size=structure.common_prefix, dtype=np.int32)
    convs = [_structured_conversation(structure, prefix, seed * 1000 + j, common)
             for j in range(clients.num_conversations)]
    per_client = clients.max_active_conversations // clients.num_clients
    tasks = deque(range(clients.num_conversations))
    active: list[deque[int]] = [deque() for _ in range(clients.num_clients)]
    turns_done = [0] * clients.num_conversations
    stopped = [False] * clients.num_clients
    stop_all = False
    events: list[tuple[float, int, str, object]] = []
    tie = itertools.count()
    flights: dict[int, _Flight] = {}
    rid = itertools.count()
    out: list[BenchRecord] = []
    stepping: set[str] = set()
    aligned = clients.aligned_loads
    loads: dict[str, list[_Load]] = {name: [] for name in (*p_eng, *d_eng)}
    lag = clients.async_scheduling
    # async scheduling: joins that arrive during a step, and joins a step boundary passed on to the next one
    during: dict[str, list[tuple[int, float, float]]] = {name: [] for name in loads}
    held: dict[str, list[tuple[int, float, float]]] = {name: [] for name in loads}
    if trace is not None:
        trace["steps"] = {name: [] for name in (*p_eng, *d_eng)}
        trace["loads"] = []
        trace["idle"] = {name: [] for name in (*p_eng, *d_eng)}
        trace["joins"] = []

    def push(t: float, kind: str, what: object) -> None:
        heapq.heappush(events, (t, next(tie), kind, what))

    def admit(eng: SimPod, n: int, now: float, ready: float) -> None:
        """Request ``n``'s KV is in at ``now``: it joins ``eng``'s waiting queue (P: to compute the rest of the
        prompt; D: to sample).  ``ready``: when it would have been in had the read started on arrival (the
        reference for the record's queueing)."""
        f = flights[n]
        if eng.name in p_eng:
            f.p_ready = ready
            r = SimRequest(n, now, f.prompt, [], f.output[:1])
            r.external = f.local + f.pulled
        else:
            f.d_ready = ready
            r = SimRequest(n, now, f.prompt, [], f.output)
            r.external = f.d_hit if f.alone else len(f.prompt) - 1
        eng.add(r)

    def admitted(eng: SimPod, ld: _Load, now: float) -> None:
        if trace is not None:
            trace["loads"].append((eng.name, ld.arrived, ld.read, now))
        join(eng, ld.rid, now, ld.arrived + ld.read)

    def join(eng: SimPod, n: int, now: float, ready: float) -> None:
        """Request ``n`` may be scheduled from ``now`` on.  Async scheduling: a busy engine has already
        scheduled its next step, so the request joins the waiting queue at the end of the running step (and is
        scheduled for the step after the next); an idle engine takes it at once."""
        if lag and eng.name in stepping:
            during[eng.name].append((n, now, ready))
        else:
            queued(eng, n, now, now, ready)

    def queued(eng: SimPod, n: int, joined: float, now: float, ready: float) -> None:
        if trace is not None and lag:
            trace["joins"].append((eng.name, joined, now))
        admit(eng, n, now, ready)

    def kick(eng: SimPod, now: float) -> None:
        """Start ``eng``'s next step at ``now`` if it is idle.  A step's start is where the worker polls the
        connector: reads finished by then are reported with this step and join the queue at its end."""
        pending = loads[eng.name]
        while eng.name not in stepping:
            dt = eng.plan_step()
            if dt is not None:
                stepping.add(eng.name)
                push(now + dt, "step", eng)
                if trace is not None:
                    trace["steps"][eng.name].append((now, now + dt))
                for ld in pending:
                    if ld.done is not None and ld.done <= now:
                        ld.reported = True
                return
            if trace is not None:
                trace["idle"][eng.name].append(now)
            if held[eng.name]:  # nothing else to schedule: what waited a boundary is scheduled now
                for n, joined, ready_at in held[eng.name]:
                    queued(eng, n, joined, now, ready_at)
                held[eng.name].clear()
                continue
            ready = [ld for ld in pending if ld.done is not None and ld.done <= now]
            if not ready:
                return
            for ld in ready:  # an idle engine's empty connector steps see the read finish at once
                pending.remove(ld)
                admitted(eng, ld, now)

    def load(eng: SimPod, n: int, now: float, read: float) -> None:
        """Request ``n`` reaches ``eng`` with ``read`` seconds of KV to read: the READ starts at once if the
        engine is idle, else at the end of its current step (the step that schedules it)."""
        ld = _Load(n, now, read)
        loads[eng.name].append(ld)
        if eng.name not in stepping:
            ld.done = now + read
            push(ld.done, "load_done", eng)

    def step_boundary(eng: SimPod, now: float) -> None:
        """``eng``'s step ended: reads reported with it join the queue; reads it scheduled start now."""
        pending = loads[eng.name]
        if lag:  # joins that waited one boundary are scheduled now; those of the step that ended wait one
            for n, joined, ready_at in held[eng.name]:
                queued(eng, n, joined, now, ready_at)
            held[eng.name] = during[eng.name]
            during[eng.name] = []
        for ld in list(pending):
            if ld.reported:
                pending.remove(ld)
                if trace is not None:
                    trace["loads"].append((eng.name, ld.arrived, ld.read, now))
                if lag:
                    held[eng.name].append((ld.rid, now, ld.arrived + ld.read))
                else:
                    admit(eng, ld.rid, now, ld.arrived + ld.read)
            elif ld.done is None:
                ld.done = now + ld.read
                push(ld.done, "load_done", eng)

    def take(c: int) -> bool:
        """The client fills its active set from the shared queue; False when it met the end marker."""
        while len(active[c]) < per_client:
            if not tasks:
                return False
            active[c].append(tasks.popleft())
        return True

    def issue(c: int, now: float) -> None:
        if stopped[c]:
            return
        if stop_all or not take(c) or not active[c]:
            stopped[c] = True
            return
        j = active[c].pop()
        k = turns_done[j]
        prompt, output = convs[j][k]
        if decided is not None:
            d = decided[(j, k + 1)]
            plan: object = _Replayed(d.action, d.prefill_pod, sim.d_pods[0])
            local, pulled, d_hit = d.local, d.pulled, d.decode_cached
        else:
            sim.now = now
            d_loads = {d: LoadSnapshot(waiting=len(e.waiting), running=len(e.running)) for d, e in d_eng.items()}
            plan, local, pulled, d_hit = sim.begin(f"c{j}", prompt, d_loads)
        alone = plan.action == "decode_only"  # type: ignore[attr-defined]
        f = _Flight(client=c, conv=j, turn=k + 1, prompt=prompt, output=output, plan=plan, local=local,
                    pulled=pulled, d_hit=d_hit, start=now, p_ready=0.0, p_done=0.0, d_ready=0.0, ttft=0.0,
                    p_alone=0.0 if alone else _alone(model, len(prompt) - local - pulled, local + pulled), alone=alone)
        n = next(rid)
        flights[n] = f
        if alone:  # no P leg: D prefills what it lacks in its own steps, nothing to load
            push(now + model.c0, "d_ready", n)
        elif aligned and pulled > 0:
            push(now + model.c0, "p_arrive", n)
        else:
            push(now + model.c0 + model.xfer(pulled), "p_ready", n)

    for c in range(clients.num_clients):
        push(c * clients.start_skew, "issue", c)
    try:
        while events:
            now, _, kind, what = heapq.heappop(events)
            if kind == "issue":
                issue(what, now)  # type: ignore[arg-type]
            elif kind in ("p_ready", "d_ready"):  # KV read on arrival, beside the steps (aligned_loads off)
                f = flights[what]  # type: ignore[index]
                eng = p_eng[f.plan.prefill_pod] if kind == "p_ready" else d_eng[f.plan.decode_pod]
                join(eng, what, now, now)  # type: ignore[arg-type]
                kick(eng, now)
            elif kind in ("p_arrive", "d_arrive"):  # aligned_loads: the read follows the engine's steps
                f = flights[what]  # type: ignore[index]
                if kind == "p_arrive":
                    eng, x = p_eng[f.plan.prefill_pod], model.xfer(f.pulled)
                else:
                    eng, x = d_eng[f.plan.decode_pod], model.xfer(len(f.prompt) - f.d_hit)
                load(eng, what, now, x)  # type: ignore[arg-type]
                kick(eng, now)
            elif kind == "load_done":
                kick(what, now)  # type: ignore[arg-type]
            else:  # a step ended
                eng = what  # type: ignore[assignment]
                stepping.discard(eng.name)
                firsts, done = eng.end_step(now)
                if eng.name in p_eng:
                    for r in done:
                        f = flights[r.rid]
                        f.p_done = now
                        if decided is None:
                            sim.now = now
                            sim.prefill_done(f.plan, f.prompt)
                        if aligned:
                            push(now, "d_arrive", r.rid)
                        else:
                            push(now + model.xfer(len(f.prompt) - f.d_hit), "d_ready", r.rid)
                else:
                    for r in firsts:
                        flights[r.rid].ttft = now - flights[r.rid].start
                    for r in done:
                        f = flights.pop(r.rid)
                        if decided is None:
                            sim.now = now
                            sim.answered(f.plan, f.prompt, f.output)
                        L = len(f.prompt)
                        out.append(BenchRecord(
                            f.client, f.conv, f.turn, L, f.plan.action, f.plan.prefill_pod, f.local, f.pulled, f.d_hit, f.start,
                            f.ttft, max(0.0, f.p_done - f.p_ready - f.p_alone),
                            max(0.0, (f.start + f.ttft) - f.d_ready - clients.tpot
                                - (_alone(model, L - f.d_hit, f.d_hit) if f.alone else _alone(model, 1, L - 1)))))
                        j = f.conv
                        turns_done[j] += 1
                        c = f.client
                        if turns_done[j] < len(convs[j]):
                            active[c].appendleft(j)
                        elif not take(c):  # the benchmark's client exits on the end marker
                            stopped[c] = True
                            if clients.early_stop:
                                stop_all = True
                        push(now, "issue", c)
                step_boundary(eng, now)
                kick(eng, now)
    finally:
        sim.close()
    return out


def bench_mean(model: PDModel, policy: str, prefix: int, *, phases: int = 1, span: float = 2.5, **kw) -> float:
    """The published measure at one point: mean TTFT (s) over every request of :func:`run_benchmark`.

    ``phases`` > 1: the average of that mean over client 1 starting ``i x span /
    phases`` seconds after client 0 (i = 0 .. phases - 1; ``span`` about one
    request's round trip), i.e. the expectation over the clients' relative
    phase, which a real run's jitter randomises and a deterministic one locks."""
    clients = kw.pop("clients", SEED_CLIENTS)
    total = 0.0
    for i in range(phases):
        cl = msgspec.structs.replace(clients, start_skew=clients.start_skew + i * span / phases)
        recs = run_benchmark(model, policy, prefix, clients=cl, **kw)
        total += sum(r.ttft for r in recs) / len(recs)
    return total / phases


def published_link(curves: SeedCurves, *, structure: TurnStructure = SEED_TURNS,
                   clients: BenchClients = SEED_CLIENTS, block_size: int = 16) -> tuple[float, float]:
    """(latency s, bandwidth bytes/s) of a NIXL READ such that the model's mean D -> P pull at the seed's first
    and last point takes the seed's published transfer time there (the tokens per pull from the planner's
    decisions in :func:`run_benchmark`; the costs do not change them)."""
    probe = PDModel(c0=0.0, alpha=1e-5, k=curves.attention_ratio, kv_bytes_per_token=curves.kv_bytes_per_token,
                    nixl_regions=curves.nixl_regions, engine_block=curves.engine_block)
    (x1, t1), (x2, t2) = sorted(curves.transfer.items())
    mean = []
    for x in (x1, x2):
        pulls = [r.pulled for r in run_benchmark(probe, "on", x, structure=structure, clients=clients,
                                                 block_size=block_size) if r.pulled > 0]
        mean.append(sum(pulls) / len(pulls))
    per_token = (t2 - t1) / (mean[1] - mean[0])
    return t1 - per_token * mean[0], curves.kv_bytes_per_token / per_token


def calibrate_bench(curves: SeedCurves, *, structure: TurnStructure = SEED_TURNS,
                    clients: BenchClients = SEED_CLIENTS, block_size: int = 16, rtol: float = 1e-5,
                    link: tuple[float, float] | None = None, phases: int = 1) -> PDModel:
    """c0 and alpha through the seed's two off points with the benchmark's clients and queueing in the model.

    c0 (proxy latency, no engine time) shifts every request of both clients alike,
    so a point's mean is c0 + g(alpha, x); g grows with alpha but not linearly
    (decode steps do not scale with it, so the clients' overlap changes), so
    alpha solves g(alpha, x2) - g(alpha, x1) = off(x2) - off(x1) by the secant
    method (bisection as a fallback) to ``rtol``, then c0 follows.  The planner
    runs once per point; the cost models are timed on its recorded decisions.
    ``link``: (latency s, bandwidth bytes/s) of a NIXL READ instead of the
    default (e.g. :func:`published_link`).  ``phases``: as :func:`bench_mean`."""
    seq = calibrate(curves, structure=structure, block_size=block_size)
    probe = msgspec.structs.replace(seq, c0=0.0)
    if link is not None:
        probe = msgspec.structs.replace(probe, latency=link[0], bandwidth=link[1])
    x1, x2 = sorted(curves.off)
    target = curves.off[x2] - curves.off[x1]
    kw = dict(structure=structure, clients=clients, block_size=block_size)
    decided = {x: run_benchmark(probe, "off", x, **kw) for x in (x1, x2)}

    def g(a: float, x: int, c0: float) -> float:
        return bench_mean(msgspec.structs.replace(probe, alpha=a, c0=c0), "off", x, replay=decided[x],
                          phases=phases, **kw)

    def solve_alpha(c0: float, a0: float) -> float:
        """Secant steps; if they do not settle (the clients' overlap makes h step-wise), bisect a bracket."""
        def h(a: float) -> float:
            return g(a, x2, c0) - g(a, x1, c0) - target

        seen: list[tuple[float, float]] = []
        a1 = 0.9 * a0
        h0, h1 = h(a0), h(a1)
        seen += [(a0, h0), (a1, h1)]
        for _ in range(8):
            if abs(h1) <= rtol * target:
                return a1
            a2 = a1 - h1 * (a1 - a0) / (h1 - h0) if h1 != h0 else a1 * 0.9
            if not a2 > 0:
                a2 = a1 / 2
            a0, h0, a1, h1 = a1, h1, a2, h(a2)
            seen.append((a1, h1))
        lo = max((a for a, v in seen if v < 0), default=0.0)
        hi = min((a for a, v in seen if v > 0), default=0.0)
        while hi <= lo:
            hi = 2 * max(hi, lo, a1)
            if h(hi) > 0:
                break
        while hi - lo > rtol * hi:
            mid = (lo + hi) / 2
            v = h(mid)
            if abs(v) <= rtol * target:
                return mid
            lo, hi = (mid, hi) if v < 0 else (lo, mid)
        return (lo + hi) / 2

    def solve_c0(a: float, c0: float) -> float:
        """c0 through the first point by secant steps: the mean moves less than c0 does (a later arrival
        meets D's decode steps and the other client at another phase), so a plain shift undershoots."""
        f0 = g(a, x1, c0) - curves.off[x1]
        c1 = c0 - f0
        for _ in range(8):
            f1 = g(a, x1, c1) - curves.off[x1]
            if abs(f1) <= rtol * curves.off[x1]:
                return c1
            c0, f0, c1 = c1, f1, (c1 - f1 * (c1 - c0) / (f1 - f0) if f1 != f0 else c1 - f1)
        return c1

    # c0 is not exactly a shift (D's step grid, the clients' phase): alternate the two solves until both hold
    c0, alpha = 0.0, seq.alpha
    for _ in range(8):
        alpha = solve_alpha(c0, alpha)
        c0 = solve_c0(alpha, c0)
        if abs(g(alpha, x2, c0) - curves.off[x2]) <= 2 * rtol * curves.off[x2]:
            break
    return msgspec.structs.replace(probe, c0=float(c0), alpha=float(alpha))


class BenchPoint(msgspec.Struct, frozen=True):
    """One prefix of the benchmark sweep: mean TTFT (s) per policy over every request, and what moved it.

    on_p_queue / off_p_queue: mean time a request spent on P beyond its own
    work (s); on_recompute: share of the on leg's requests that recomputed."""

    prefix: int
    requests: int
    off: float
    on: float
    ours: float
    off_p_queue: float
    on_p_queue: float
    on_recompute: float


class BenchResult(msgspec.Struct, frozen=True):
    """The seed's sweep with its benchmark's clients (:func:`run_benchmark`), calibrated per model on its off curve.

    errors[model][point] = model on / published on - 1 at every published on point;
    link_models / link_errors: the same with each model's NIXL READ taken from
    its published transfer times (:func:`published_link`; empty if not run)."""

    clients: BenchClients
    structure: TurnStructure
    models: dict[str, PDModel]
    errors: dict[str, dict[int, float]]
    points: list[BenchPoint]
    ours_threshold: int
    link_models: dict[str, PDModel] = {}
    link_errors: dict[str, dict[int, float]] = {}


def bench_sweep(*, clients: BenchClients = SEED_CLIENTS, structure: TurnStructure = SEED_TURNS,
                contexts: Sequence[int] = tuple(range(2000, 24001, 2000)), block_size: int = 16,
                threshold: int = 64, link_variant: bool = True, rtol: float = 1e-5) -> BenchResult:
    """Calibrate both models on their off points with the benchmark's clients, predict their on points, and run
    off / on / ours for Qwen3-32B over ``contexts`` (nothing fitted on an on curve).  ``link_variant``: also
    predict both on curves with each model's link taken from its published transfer times
    (:func:`published_link`), reported in ``link_errors``.  ``rtol``: the off fit's tolerance
    (:func:`calibrate_bench`; the quick mode uses 1e-3)."""
    models: dict[str, PDModel] = {}
    errors: dict[str, dict[int, float]] = {}
    link_models: dict[str, PDModel] = {}
    link_errors: dict[str, dict[int, float]] = {}
    kw0 = dict(structure=structure, clients=clients, block_size=block_size)
    for cur in (QWEN3_32B, GLM5_FP8):
        m = calibrate_bench(cur, **kw0, rtol=rtol)
        models[cur.name] = m
        errors[cur.name] = {x: bench_mean(m, "on", x, **kw0, threshold=threshold) / t - 1.0
                            for x, t in sorted(cur.on.items())}
        if link_variant:
            lm = calibrate_bench(cur, **kw0, link=published_link(cur, **kw0), rtol=rtol)
            link_models[cur.name] = lm
            link_errors[cur.name] = {x: bench_mean(lm, "on", x, **kw0, threshold=threshold) / t - 1.0
                                     for x, t in sorted(cur.on.items())}
    m = models[QWEN3_32B.name]
    adv = advise(ModelKV(name=QWEN3_32B.name, layers=64, kv_heads=8, head_dim=128), m.alpha,
                 TransferCost(latency_s=m.latency, bytes_per_s=m.bandwidth), block_size=block_size)
    ours_threshold = adv.recommended_threshold if adv.recommended_threshold is not None else threshold
    points = []
    kw = dict(structure=structure, clients=clients, block_size=block_size)
    for x in sorted(set(contexts) | set(QWEN3_32B.on)):
        off = run_benchmark(m, "off", x, **kw, threshold=threshold)
        on = run_benchmark(m, "on", x, **kw, threshold=threshold)
        ours = run_benchmark(m, "ours", x, **kw, threshold=ours_threshold)

        def mean(rs: list[BenchRecord], f) -> float:
            return sum(f(r) for r in rs) / len(rs)

        points.append(BenchPoint(x, len(on), mean(off, lambda r: r.ttft), mean(on, lambda r: r.ttft),
                                 mean(ours, lambda r: r.ttft), mean(off, lambda r: r.p_queue),
                                 mean(on, lambda r: r.p_queue), mean(on, lambda r: r.action == "recompute")))
    return BenchResult(clients, structure, models, errors, points, ours_threshold, link_models, link_errors)


def bench_table(res: BenchResult) -> str:
    """Markdown: the benchmark's clients, both models' calibrations and errors, then one row per prefix."""
    c, q = res.clients, res.models[QWEN3_32B.name]
    lines = [
        f"Benchmark clients as the seed ran them: {c.num_clients} clients, {c.max_active_conversations} active "
        f"conversations, {c.num_conversations} conversations, early stop {'on' if c.early_stop else 'off'}, "
        f"max_num_seqs {c.max_num_seqs}, token budget {c.max_num_batched_tokens:,}, D step {c.tpot * 1e3:.0f} ms, "
        f"connector loads {'aligned to the engine steps' if c.aligned_loads else 'beside the steps'}, "
        f"asynchronous scheduling {'on' if c.async_scheduling else 'off'}.",
        "",
        "| model | c0 ms | alpha us/token | on-curve error at each published point |",
        "|---|---|---|---|",
    ]
    for name, m in res.models.items():
        lines.append(f"| {name} | {m.c0 * 1e3:.1f} | {m.alpha * 1e6:.2f} | "
                     + ", ".join(f"{e:+.1%} at {x:,}" for x, e in sorted(res.errors[name].items())) + " |")
    for name, m in res.link_models.items():
        lines.append(f"| {name}, NIXL READ from the published transfer times ({m.latency * 1e3:.1f} ms + "
                     f"{m.kv_bytes_per_token / m.bandwidth * 1e6:.2f} us/token) | {m.c0 * 1e3:.1f} | "
                     f"{m.alpha * 1e6:.2f} | "
                     + ", ".join(f"{e:+.1%} at {x:,}" for x, e in sorted(res.link_errors[name].items())) + " |")
    lines += [
        "",
        f"Qwen3-32B (c0 {q.c0 * 1e3:.1f} ms, alpha {q.alpha * 1e6:.2f} us/token; ours: 2 P with prefix caching, "
        f"threshold {res.ours_threshold}):",
        "",
        "| prefix | requests | off ms | on ms (model) | published on ms | error | on: recomputed | "
        "P queueing off / on ms | ours ms | ours / on |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    pub = QWEN3_32B.on
    for p in res.points:
        e = res.errors[QWEN3_32B.name].get(p.prefix)
        pubs = f"{pub[p.prefix] * 1e3:.0f} | {e:+.1%}" if e is not None else "- | -"
        lines.append(f"| {p.prefix:,} | {p.requests} | {p.off * 1e3:.0f} | {p.on * 1e3:.0f} | {pubs} | "
                     f"{p.on_recompute:.0%} | {p.off_p_queue * 1e3:.0f} / {p.on_p_queue * 1e3:.0f} | "
                     f"{p.ours * 1e3:.0f} | {p.ours / p.on:.2f} |")
    return "\n".join(lines)


def plot_bench(res: BenchResult, path) -> None:
    """TTFT per prefix with the benchmark's clients: off (fitted), on (predicted), ours, and the seed's points."""
    pts = res.points
    _plot_ttft(
        path, [p.prefix for p in pts],
        [([p.off for p in pts], "off (fitted on the seed's 2 points)"),
         ([p.on for p in pts], "bidirectional on, 1 P (predicted)"),
         ([p.ours for p in pts], "ours: 2 P with prefix cache + index")],
        (QWEN3_32B.off, QWEN3_32B.on),
        "conversation prefix tokens (mean TTFT over the benchmark's requests)",
        f"Seed 000: Qwen3-32B, 1 D, {res.clients.num_clients} benchmark clients",
    )
