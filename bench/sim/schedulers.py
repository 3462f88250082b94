"""Routing policies compared in the simulator.

Each reads what a real router would: the engines' scraped load
(``LoadSnapshot``: waiting, running, KV usage, refreshed every
``metrics_interval``), the router's own counts (in flight, predicted prefill
tokens), and, for the KV-aware ones, the library's real index through the real
prefix scorer (:func:`scorer.prefix.score_prefix` / ``Indexer.score``).

* ``random``: uniform draw.
* ``load``: llm-d's load-only profile: 2 x kv-usage score + 2 x queue score.
* ``approximate``: llm-d's estimated prefix-cache scorer as seed 002 ran it: a
  routing-history index (the hashed blocks of every prompt routed to a pod,
  recorded at dispatch, LRU per pod), score = matched / chain length, with
  the published weights (73 %: 1 : 1 : 1 with kv-usage and queue); it never
  learns of evictions.  See :class:`ApproximateScheduler`.
* ``precise``: llm-d-precise-equivalent: the index's longest prefix per pod,
  min-max normalised over the pods with a hit (pods without one score 0; all
  hit pods tie at 1 when equal), 3 x prefix + 2 x (1 - kv usage) + 2 x queue
  (min-max normalised waiting queue, inverted), argmax with random ties.
* ``dynamo``: NVIDIA Dynamo's own selector (``SelectionService`` of
  ai-dynamo-runtime 1.6.1, run in process and fed the pods' KV events over
  ZMQ): :class:`bench.sim.dynamo_peer.DynamoSelector`.
* ``kvindex-weighted``: the library's WeightedPicker (absolute coverage, queue
  = waiting + in flight).
* ``kvindex``: the library's default picker (``Indexer()``'s configuration).
"""

from __future__ import annotations

import random
from collections import OrderedDict
from collections.abc import Sequence

from bench.sim.engine import SimRequest, chain_hashes
from bench.sim.workload import ApproxConfig
from kvindex.facade import Indexer
from scorer.load import LoadSnapshot
from scorer.picker import RandomPicker
from scorer.prefix import score_prefix

__all__ = ["SCHEDULERS", "Scheduler", "View", "make_scheduler"]


class View:
    """What a router sees at decision time (filled in by the cluster loop).

    pods: candidate pod ids; loads: pod -> LoadSnapshot (engine metrics as of
    the last scrape, plus the router's in_flight and prefill_tokens); ix: the
    Indexer whose index the KV events feed.
    """

    def __init__(self, pods: Sequence[str], ix: Indexer) -> None:
        self.pods = list(pods)
        self.ix = ix
        self.loads: dict[str, LoadSnapshot] = {}
        self.now = 0.0


class Scheduler:
    """Base: ``choose`` returns (pod, predicted uncached prompt tokens on it)."""

    name = "base"
    reads_index = False
    #: True for a scheduler fed the pods' KV events itself (a peer with its own indexer): ``deliver`` / ``settle``
    peer_events = False

    def __init__(self, seed: int) -> None:
        self.rng = random.Random(seed)

    def attach(self, pods: Sequence[str], *, model: str, block_size: int, total_kv_blocks: int,
               max_num_batched_tokens: int) -> None:
        """Called once before the run with the fleet's shape."""

    def deliver(self, pod: str, payload: bytes) -> None:
        """A KV-event batch of ``pod`` reaches the router (``peer_events`` schedulers only)."""

    def settle(self) -> None:
        """Apply everything delivered so far before the next decision (``peer_events`` schedulers only)."""

    def first_token(self, req: SimRequest, pod: str) -> None:
        """``req`` got its first token on ``pod``."""

    def finished(self, req: SimRequest, pod: str) -> None:
        """``req`` finished on ``pod``."""

    def close(self) -> None:
        """Release what the scheduler holds (sockets, threads)."""

    def choose(self, req: SimRequest, view: View) -> tuple[str, int]:
        raise NotImplementedError

    def routed(self, req: SimRequest, pod: str, view: View) -> None:
        """Called once the request is sent to ``pod``."""


def _argmax_random(totals: dict[str, float], rng: random.Random) -> str:
    best = max(totals.values())
    tied = sorted(p for p, t in totals.items() if t >= best - 1e-12)
    return tied[0] if len(tied) == 1 else rng.choice(tied)


def _llmd_load_terms(view: View) -> tuple[dict[str, float], dict[str, float]]:
    """llm-d's kv-cache-utilization score (1 - usage) and queue score (min-max of waiting, inverted)."""
    kv = {p: 1.0 - view.loads[p].kv_usage for p in view.pods}
    w = {p: view.loads[p].waiting for p in view.pods}
    lo, hi = min(w.values()), max(w.values())
    q = {p: 1.0 if hi == lo else (hi - w[p]) / (hi - lo) for p in view.pods}
    return kv, q


class RandomScheduler(Scheduler):
    name = "random"

    def __init__(self, seed: int) -> None:
        super().__init__(seed)
        self.picker = RandomPicker(seed)

    def choose(self, req: SimRequest, view: View) -> tuple[str, int]:
        return self.picker.pick({}, view.loads, view.pods).pod, len(req.prompt)


class LoadScheduler(Scheduler):
    name = "load"

    def choose(self, req: SimRequest, view: View) -> tuple[str, int]:
        kv, q = _llmd_load_terms(view)
        return _argmax_random({p: 2 * kv[p] + 2 * q[p] for p in view.pods}, self.rng), len(req.prompt)


class PreciseScheduler(Scheduler):
    """llm-d-precise-equivalent (see the module doc)."""

    name = "precise"
    reads_index = True

    def choose(self, req: SimRequest, view: View) -> tuple[str, int]:
        ix = view.ix
        keys = ix.request_keys(req.prompt)
        scores = score_prefix(ix.index, keys, view.pods, block_size=ix.token_processor.block_size)
        raw = {p: scores[p].matched_blocks for p in view.pods}
        hits = [v for v in raw.values() if v > 0]
        pref: dict[str, float] = dict.fromkeys(view.pods, 0.0)
        if hits:
            lo, hi = min(hits), max(hits)
            for p, v in raw.items():
                if v > 0:
                    pref[p] = 1.0 if hi == lo else (v - lo) / (hi - lo)
        kv, q = _llmd_load_terms(view)
        pod = _argmax_random({p: 3 * pref[p] + 2 * kv[p] + 2 * q[p] for p in view.pods}, self.rng)
        return pod, len(req.prompt) - scores[pod].matched_tokens


class ApproximateScheduler(Scheduler):
    """llm-d's estimated prefix-cache scorer on routing history, as its seed-002 run used it.

    What the scorer does (the gateway-api-inference-extension ``prefix-cache-scorer``
    of 2025, which llm-d's "estimated" / "approximate" scheduling configures):

    * it hashes the prompt *text* in blocks of ``hashBlockSize`` characters
      (64), a chain whose first entry is the model name, keeping at most
      ``maxPrefixBlocksToMatch`` (256) blocks: the first 16,384 characters;
    * a pod's score is the number of leading chain entries some pod holds in the
      history that this pod also holds, divided by the chain's length (model
      entry included), so every pod that ever served the model scores at least
      1 / 257;
    * the chosen pod's chain is added to that pod's history when the request is
      dispatched (``PreRequest``), not after it completes, and the history is an
      LRU of ``lruCapacityPerServer`` (31,250) entries per pod that never hears
      of the engine's evictions;
    * weights and settings as seed 002 published them per workload
      (:class:`bench.sim.workload.ApproxConfig`): 73 %: prefix 1 : kv-usage 1 :
      queue 1; 37 %: 256-character blocks, 2,200 entries, prefix 2 : kv-usage 1
      : active-request 1; max score wins with random ties.

    The simulator has token ids, not text: a character block is modelled as
    ``ApproxConfig.block_tokens`` tokens (64 characters / 4 per token = 16, the
    scorer's own sizing comment), so the 73 % window is 4,096 tokens.
    ``weights`` (prefix, kv, load) overrides the configuration's.
    """

    name = "approximate"

    def __init__(self, seed: int, config: ApproxConfig | None = None, *,
                 weights: tuple[float, float, float] | None = None, name: str | None = None) -> None:
        super().__init__(seed)
        cfg = config or ApproxConfig()
        self.tokens_per_block = cfg.block_tokens
        self.capacity = cfg.lru_entries
        self.max_blocks = cfg.max_blocks
        self.weights = weights or cfg.weights
        if cfg.load_scorer not in ("queue", "active-request"):
            raise ValueError(f"unknown load scorer {cfg.load_scorer!r}")
        self.load_scorer = cfg.load_scorer
        if name:
            self.name = name
        self.history: dict[str, OrderedDict[int, None]] = {}
        self._chains: dict[int, list[int]] = {}

    def _chain(self, req: SimRequest) -> list[int]:
        key = id(req.prompt)
        chain = self._chains.get(key)
        if chain is None:
            window = req.prompt[: self.tokens_per_block * self.max_blocks]
            # entry 0 stands for the model name (one model here); block hashes chain on it
            chain = [0, *chain_hashes(window, self.tokens_per_block, parent=0x6D6F64656C)]
            self._chains[key] = chain
        return chain

    def choose(self, req: SimRequest, view: View) -> tuple[str, int]:
        chain = self._chain(req)
        matched = dict.fromkeys(view.pods, 0)
        for h in chain:
            holders = [p for p in view.pods if h in self.history.get(p, ())]
            if not holders:
                break
            for p in holders:
                matched[p] += 1
        n = len(chain)
        wp, wk, wq = self.weights
        kv, q = _llmd_load_terms(view)
        if self.load_scorer == "active-request":  # the router's in-flight count, (max - n) / max
            top = max(view.loads[p].in_flight for p in view.pods)
            q = {p: 1.0 if top == 0 else (top - view.loads[p].in_flight) / top for p in view.pods}
        pod = _argmax_random({p: wp * matched[p] / n + wk * kv[p] + wq * q[p] for p in view.pods}, self.rng)
        req.meta = (req.meta, chain)
        predicted = max(0, matched[pod] - 1) * self.tokens_per_block
        return pod, len(req.prompt) - predicted

    def routed(self, req: SimRequest, pod: str, view: View) -> None:
        stage, chain = req.meta
        req.meta = stage
        h = self.history.setdefault(pod, OrderedDict())
        for k in chain:
            h[k] = None
            h.move_to_end(k)
        while len(h) > self.capacity:
            h.popitem(last=False)


class IndexerScheduler(Scheduler):
    """The library's own choice: ``Indexer.score`` with the Indexer's picker,
    pods tied on the picker's total taking turns (as the reference router),
    then what ``Indexer.route`` does for the chosen pod (in-flight count, and
    speculative entries when ``speculative_ttl`` > 0).

    ``picker``: None = the library's default configuration; else the
    ``scorer_config.picker`` the cluster configures the Indexer with.
    """

    name = "kvindex"
    reads_index = True

    def __init__(self, seed: int, picker: str | None = None, name: str | None = None) -> None:
        super().__init__(seed)
        self._turn = 0
        self.config_picker = picker
        if name:
            self.name = name

    def choose(self, req: SimRequest, view: View) -> tuple[str, int]:
        ix = view.ix
        result = ix.score(req.prompt, view.pods, loads=view.loads)
        assert result.pod is not None and result.choice is not None
        pod = result.pod
        # as the reference router (examples/router): pods with the same total take turns
        best = result.choice.score
        tied = sorted(p for p, e in result.choice.explanation.items() if abs(e.total - best) <= 1e-9)
        if len(tied) > 1:
            pod = tied[self._turn % len(tied)]
            self._turn += 1
        # then what Indexer.route does for the chosen pod
        ix.request_started(pod)
        if ix.speculative_ttl > 0 and result.request_blocks:
            ix.index.add_speculative(ix.request_keys(req.prompt), pod, ix.speculative_ttl)
        return pod, len(req.prompt) - result.predicted_cached_tokens(pod)


SCHEDULERS = ("random", "load", "approximate", "precise", "dynamo", "kvindex-weighted", "kvindex")


def make_scheduler(name: str, seed: int, block_size: int, approx: ApproxConfig | None = None) -> Scheduler:
    """A scheduler by name (one of :data:`SCHEDULERS`, ``kvindex-<picker>``, or
    ``approximate-322``: the approximate scheduler with precise's 3:2:2 weights);
    ``approx``: the workload's approximate-scheduler settings."""
    if name == "random":
        return RandomScheduler(seed)
    if name == "load":
        return LoadScheduler(seed)
    if name == "approximate":
        return ApproximateScheduler(seed, approx)
    if name == "approximate-322":
        return ApproximateScheduler(seed, approx, weights=(3.0, 2.0, 2.0), name=name)
    if name == "precise":
        return PreciseScheduler(seed)
    if name == "dynamo":  # the real one: Dynamo's SelectionService (ai-dynamo-runtime)
        from bench.sim.dynamo_peer import DynamoSelector

        return DynamoSelector(seed)
    if name == "kvindex":
        return IndexerScheduler(seed)
    if name.startswith("kvindex-"):
        return IndexerScheduler(seed, picker=name.removeprefix("kvindex-"), name=name)
    raise ValueError(f"unknown scheduler {name!r}; known: {', '.join(SCHEDULERS)}")

