"""A simulated vLLM pod: prefix-cached paged KV, continuous batching, chunked prefill.

Mirrors the parts of vLLM 0.32's V1 engine that decide time to first token
under prefix-heavy load:

* KV cache of ``capacity_tokens // block_size`` blocks (vllm/v1/core/block_pool.py):
  a full, computed block gets its hash and enters the prefix cache; a request's
  blocks go back to the free queue when it finishes, in reverse order (tail
  blocks are evicted first); allocation takes the head of the free queue and
  evicts the cached block it held (one ``BlockRemoved``).  Usage, as the
  engine's ``vllm:kv_cache_usage_perc``, counts referenced blocks only.
* Scheduler (vllm/v1/core/sched/scheduler.py): per step a token budget
  (``max_num_batched_tokens``, 8,192 on H100 for the API server); running
  requests first (one token per decoding request, then chunks of partial
  prefills), then waiting requests in arrival order while budget, sequence
  slots and free blocks last.  A new request's longest cached prefix is reused
  (at most ``(tokens - 1) // block_size`` blocks, as
  ``KVCacheManager.get_computed_blocks``).  A decoding request that needs a
  block when none is free preempts the last running request, which goes back to
  the front of the waiting queue and is recomputed (its own cached blocks may
  still hit).
* Step time from :class:`CostModel`.

Every step's cache changes are published at the step's end as one vLLM KV-event
batch (:mod:`bench.sim.wire`).  Decoding requests are advanced in O(1) per step
(a heap holds the step at which each one next fills a block or finishes).
"""

from __future__ import annotations

import heapq
from collections import OrderedDict, deque

import msgspec
import numpy as np
import xxhash

from bench.sim.wire import BlockRemoved, BlockStored

__all__ = ["CostModel", "SimPod", "SimRequest", "chain_hashes"]

_MASK = (1 << 64) - 1


def chain_hashes(tokens: np.ndarray, block_size: int, parent: int | None = None) -> list[int]:
    """Engine block hashes of the full blocks of ``tokens`` (int32 array).

    h_i = xxh3_64(h_{i-1} as 8 bytes || block tokens as int32 bytes), h_{-1} =
    ``parent`` or 0.  Stands in for vLLM's sha256 chain: the index never
    recomputes engine hashes, it maps them to its own keys from the tokens.
    """
    out: list[int] = []
    h = parent or 0
    data = np.ascontiguousarray(tokens, dtype=np.int32)
    for i in range(len(data) // block_size):
        h = xxhash.xxh3_64_intdigest(h.to_bytes(8, "big") + data[i * block_size:(i + 1) * block_size].tobytes())
        out.append(h)
    return out


class CostModel(msgspec.Struct, frozen=True, kw_only=True):
    """Step time of one pod: ``overhead + max(compute, memory)`` seconds.

    compute = (2 x params x tokens + 4 x layers x q_heads x head_dim x attention pairs)
    / (gpus x peak_flops x mfu); memory = (weight bytes + KV bytes read) /
    (gpus x hbm_bandwidth x bandwidth_efficiency).  Attention pairs: for a
    prefill chunk of c tokens starting at context s, c x s + c (c + 1) / 2; for a
    decoding request at context n, n.  Defaults: Qwen3-32B (64 layers, 64 query
    heads, 8 KV heads, head dim 128, 32.8 B parameters, bf16) with tensor
    parallelism over 2 x H100 SXM (989 TFLOP/s dense bf16 and 3.35 TB/s HBM3
    each); see bench/sim/README.md for the sources and the efficiencies.
    """

    params: float = 32.8e9
    layers: int = 64
    q_heads: int = 64
    kv_heads: int = 8
    head_dim: int = 128
    dtype_bytes: int = 2
    gpus: int = 2
    peak_flops: float = 989e12
    hbm_bandwidth: float = 3.35e12
    mfu: float = 0.5
    bandwidth_efficiency: float = 0.7
    overhead: float = 0.003

    @property
    def kv_bytes_per_token(self) -> int:
        """Bytes of K and V for one token over all layers (Qwen3-32B: 262,144)."""
        return 2 * self.layers * self.kv_heads * self.head_dim * self.dtype_bytes

    def step_time(self, tokens: int, attention_pairs: float, kv_tokens_read: float) -> float:
        """Seconds for one engine step computing ``tokens`` tokens."""
        compute = (2.0 * self.params * tokens + 4.0 * self.layers * self.q_heads * self.head_dim * attention_pairs) / (
            self.gpus * self.peak_flops * self.mfu
        )
        memory = (self.params * self.dtype_bytes + kv_tokens_read * self.kv_bytes_per_token) / (
            self.gpus * self.hbm_bandwidth * self.bandwidth_efficiency
        )
        return self.overhead + max(compute, memory)

    def prefill_time(self, tokens: int, context: int = 0) -> float:
        """Seconds to prefill ``tokens`` new tokens after ``context`` cached ones, alone in one step."""
        pairs = tokens * context + tokens * (tokens + 1) / 2
        return self.step_time(tokens, pairs, context + tokens)


class SimRequest:
    """One request: prompt tokens and block hashes, output length, and its progress.

    Times are simulated seconds.  ``generated`` counts sampled tokens (the first
    comes with the end of prefill); ``num_computed`` counts tokens whose KV is
    in the pod's cache.
    """

    __slots__ = (
        "rid", "arrival", "prompt", "hashes", "out_len", "out_tokens", "group", "meta",
        "pod", "num_computed", "generated", "blocks", "first_token", "finish", "cached_tokens",
        "c0", "g0", "k0", "version", "predicted_uncached", "preemptions", "external",
    )

    def __init__(self, rid: int, arrival: float, prompt: np.ndarray, hashes: list[int], out_tokens: np.ndarray,
                 group: int = 0, meta: object = None) -> None:
        self.rid = rid
        self.arrival = arrival
        self.prompt = prompt
        self.hashes = list(hashes)
        self.out_tokens = out_tokens
        self.out_len = len(out_tokens)
        self.group = group
        self.meta = meta
        self.pod: str | None = None
        self.num_computed = 0
        self.generated = 0
        self.blocks: list[int] = []
        self.first_token: float | None = None
        self.finish: float | None = None
        self.cached_tokens = -1  # prefix hit at first admission
        self.c0 = self.g0 = self.k0 = 0
        self.version = 0
        self.predicted_uncached = 0
        self.preemptions = 0
        self.external = 0  # tokens whose KV arrives from elsewhere before admission (a connector's load)

    def target(self) -> int:
        """Tokens to prefill: prompt plus outputs already sampled (after a preemption)."""
        return len(self.prompt) + self.generated

    def tokens(self, start: int, end: int) -> np.ndarray:
        """Token ids of positions [start, end) of prompt + output."""
        p = len(self.prompt)
        if end <= p:
            return self.prompt[start:end]
        if start >= p:
            return self.out_tokens[start - p:end - p]
        return np.concatenate((self.prompt[start:], self.out_tokens[: end - p]))


class _BlockPool:
    """Paged KV blocks with a prefix cache and an LRU free queue (vllm/v1/core/block_pool.py)."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.ref = [0] * n
        self.hash: list[int | None] = [None] * n
        self.cached: dict[int, int] = {}
        self.free: OrderedDict[int, None] = OrderedDict.fromkeys(range(n))

    def lookup(self, hashes: list[int], max_blocks: int) -> list[int]:
        out = []
        cached = self.cached
        for h in hashes[:max_blocks]:
            b = cached.get(h)
            if b is None:
                break
            out.append(b)
        return out

    def touch(self, blocks: list[int]) -> None:
        ref, free = self.ref, self.free
        for b in blocks:
            if ref[b] == 0:
                del free[b]
            ref[b] += 1

    def unreferenced(self, blocks: list[int]) -> int:
        return sum(1 for b in blocks if self.ref[b] == 0)

    def alloc(self, k: int, evicted: list[int]) -> list[int]:
        out = []
        for _ in range(k):
            b, _ = self.free.popitem(last=False)
            h = self.hash[b]
            if h is not None:
                if self.cached.get(h) == b:
                    del self.cached[h]
                    evicted.append(h)
                self.hash[b] = None
            self.ref[b] = 1
            out.append(b)
        return out

    def release(self, blocks: list[int]) -> None:
        ref, free = self.ref, self.free
        for b in reversed(blocks):
            ref[b] -= 1
            if ref[b] == 0:
                free[b] = None

    def cache(self, b: int, h: int) -> bool:
        if h in self.cached or self.hash[b] is not None:
            return False
        self.cached[h] = b
        self.hash[b] = h
        return True


class SimPod:
    """One simulated vLLM engine (see the module doc).

    ``prefix_caching=False`` is vLLM's ``--no-enable-prefix-caching``: no
    lookups, no hashes kept, no KV events.  A request's ``external`` tokens
    (KV a connector loaded before the request was added, as vLLM's
    ``WAITING_FOR_REMOTE_KVS`` requests) count as computed on admission, at
    most all but the last prompt token (the engine recomputes that one to
    sample, as vLLM's scheduler does after a full remote hit).

    Drive it with :meth:`add` (a routed request arrives), :meth:`plan_step`
    (start a step at ``now``; returns its duration or None when idle) and
    :meth:`end_step` (apply the step at its end time; returns the requests that
    got their first token and those that finished).  :meth:`take_events` hands
    over the KV events of the steps ended since the last call.
    """

    def __init__(self, name: str, capacity_tokens: int, *, block_size: int = 64, cost: CostModel | None = None,
                 max_num_batched_tokens: int = 8192, max_num_seqs: int = 1024, prefix_caching: bool = True) -> None:
        if capacity_tokens < block_size or block_size < 1:
            raise ValueError("capacity must hold at least one block")
        self.name = name
        self.block_size = block_size
        self.num_blocks = capacity_tokens // block_size
        self.cost = cost or CostModel()
        self.max_batched = max_num_batched_tokens
        self.max_seqs = max_num_seqs
        self.prefix_caching = prefix_caching
        self.pool = _BlockPool(self.num_blocks)
        self.waiting: deque[SimRequest] = deque()
        self.running: dict[int, SimRequest] = {}
        self.prefilling: list[SimRequest] = []
        self.n_dec = 0
        self.dec_base = 0  # sum over decoding requests of (c0 - k0)
        self.heap: list[tuple[int, int, int, SimRequest]] = []
        self.k = 0
        self.busy = False
        self._chunks: list[tuple[SimRequest, int, int]] = []
        self._events: list[BlockStored | BlockRemoved] = []
        self._evicted: list[int] = []
        # engine counters (as vllm:prefix_cache_queries_total / hits_total etc.)
        self.prefix_queries = 0
        self.prefix_hits = 0
        self.preemptions = 0
        self.output_tokens = 0
        self.prefill_tokens = 0
        self.busy_time = 0.0

    # -- load signals (what /metrics would show)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def kv_usage(self) -> float:
        return 1.0 - len(self.pool.free) / self.num_blocks

    # -- driving

    def add(self, req: SimRequest) -> None:
        """A request routed to this pod joins the waiting queue."""
        req.pod = self.name
        self.waiting.append(req)

    def plan_step(self) -> float | None:
        """Schedule the next step; its duration in seconds, or None (idle)."""
        bs = self.block_size
        pool = self.pool
        budget = self.max_batched - self.n_dec
        chunks = self._chunks = []
        evicted = self._evicted
        pairs = float(self.dec_base + self.n_dec * self.k) + self.n_dec
        kv_read = pairs
        for r in self.prefilling:
            if budget <= 0:
                break
            n = min(r.target() - r.num_computed, budget)
            need = -(-(r.num_computed + n) // bs) - len(r.blocks)
            if need > len(pool.free):
                continue
            if need > 0:
                r.blocks.extend(pool.alloc(need, evicted))
            chunks.append((r, r.num_computed, n))
            budget -= n
        while self.waiting and budget > 0 and len(self.running) < self.max_seqs:
            r = self.waiting[0]
            target = r.target()
            hit = pool.lookup(r.hashes, (target - 1) // bs) if self.prefix_caching else []
            hit_tok = len(hit) * bs
            start = max(hit_tok, min(r.external, target - 1))
            n = min(target - start, budget)
            need = -(-(start + n) // bs) - len(hit)
            if need > len(pool.free) - pool.unreferenced(hit):
                break
            pool.touch(hit)
            r.blocks = hit + pool.alloc(need, evicted)
            r.num_computed = start
            self.waiting.popleft()
            self.running[r.rid] = r
            self.prefilling.append(r)
            self.prefix_queries += target
            self.prefix_hits += hit_tok
            if r.cached_tokens < 0:
                r.cached_tokens = hit_tok
            chunks.append((r, start, n))
            budget -= n
        tokens = self.n_dec
        for _, s, n in chunks:
            tokens += n
            pairs += n * s + n * (n + 1) / 2
            kv_read += s + n
        if evicted:
            self._events.append(BlockRemoved(block_hashes=evicted, medium="GPU"))
            self._evicted = []
        if tokens == 0:
            self.busy = False
            return None
        self.busy = True
        dt = self.cost.step_time(tokens, pairs, kv_read)
        self.busy_time += dt
        return dt

    def end_step(self, now: float) -> tuple[list[SimRequest], list[SimRequest]]:
        """Apply the planned step at its end time ``now``: (first-token requests, finished requests)."""
        k = self.k
        bs = self.block_size
        firsts: list[SimRequest] = []
        done: list[SimRequest] = []
        self.output_tokens += self.n_dec
        for r, s, n in self._chunks:
            if r.pod is None or r.rid not in self.running or r.num_computed != s:
                continue  # preempted meanwhile
            self.prefill_tokens += n
            r.num_computed = s + n
            self._cache_full(r, s // bs, r.num_computed // bs)
            if r.num_computed == r.target():
                self.prefilling.remove(r)
                r.generated += 1
                self.output_tokens += 1
                if r.first_token is None:
                    r.first_token = now
                    firsts.append(r)
                if r.generated >= r.out_len:
                    self._finish(r, now, done)
                else:
                    r.c0, r.g0, r.k0 = r.num_computed, r.generated, k + 1
                    self.n_dec += 1
                    self.dec_base += r.c0 - r.k0
                    self._next_block_or_event(r, now, done)
        heap = self.heap
        while heap and heap[0][0] == k:
            _, _, ver, r = heapq.heappop(heap)
            if ver != r.version:
                continue
            steps = k + 1 - r.k0
            self.dec_base -= r.c0 - r.k0
            self.n_dec -= 1
            r.num_computed = r.c0 + steps
            r.generated = r.g0 + steps
            if r.generated >= r.out_len:
                self._finish(r, now, done)
                continue
            j = r.num_computed // bs
            self._cache_full(r, j - 1, j)
            r.c0, r.g0, r.k0 = r.num_computed, r.generated, k + 1
            self.n_dec += 1
            self.dec_base += r.c0 - r.k0
            self._next_block_or_event(r, now, done)
        if self._evicted:
            self._events.append(BlockRemoved(block_hashes=self._evicted, medium="GPU"))
            self._evicted = []
        self._chunks = []
        self.k = k + 1
        return firsts, done

    def take_events(self) -> list[BlockStored | BlockRemoved]:
        """KV events since the last call, in the order they happened."""
        ev, self._events = self._events, []
        return ev

    # -- internals

    def _cache_full(self, r: SimRequest, j0: int, j1: int) -> None:
        """Give blocks j0..j1-1 of ``r`` (now full and computed) their hashes; one BlockStored per run."""
        if not self.prefix_caching:
            return
        bs = self.block_size
        run: list[int] = []
        run_start = j0
        for j in range(j0, j1):
            if j >= len(r.hashes):  # an output block: hash it now
                parent = r.hashes[j - 1] if j > 0 else None
                r.hashes.extend(chain_hashes(r.tokens(j * bs, (j + 1) * bs), bs, parent))
            if self.pool.cache(r.blocks[j], r.hashes[j]):
                if not run:
                    run_start = j
                run.append(r.hashes[j])
            elif run:
                self._stored(r, run_start, run)
                run = []
        if run:
            self._stored(r, run_start, run)

    def _stored(self, r: SimRequest, j0: int, hashes: list[int]) -> None:
        bs = self.block_size
        self._events.append(BlockStored(
            block_hashes=hashes,
            parent_block_hash=r.hashes[j0 - 1] if j0 > 0 else None,
            token_ids=r.tokens(j0 * bs, (j0 + len(hashes)) * bs).tolist(),
            block_size=bs,
            medium="GPU",
        ))

    def _next_block_or_event(self, r: SimRequest, now: float, done: list[SimRequest]) -> None:
        """A decoding request whose last block is full gets a new one (preempting if needed); push its next event."""
        bs = self.block_size
        while r.num_computed >= len(r.blocks) * bs:
            if self.pool.free:
                r.blocks.extend(self.pool.alloc(1, self._evicted))
                break
            victim = next(reversed(self.running.values()))
            self._preempt(victim, now, done)
            if victim is r:
                return
        to_boundary = len(r.blocks) * bs - r.c0
        to_finish = r.out_len - r.g0
        r.version += 1
        heapq.heappush(self.heap, (r.k0 + min(to_boundary, to_finish) - 1, r.rid, r.version, r))

    def _preempt(self, r: SimRequest, now: float, done: list[SimRequest]) -> None:
        if r in self.prefilling:
            self.prefilling.remove(r)
        else:
            # decoding: materialise its progress up to the step just ended
            steps = self.k + 1 - r.k0
            self.dec_base -= r.c0 - r.k0
            self.n_dec -= 1
            r.num_computed = r.c0 + steps
            r.generated = r.g0 + steps
            r.version += 1
            if r.generated >= r.out_len:  # it finished in this very step: nothing to preempt
                self._finish(r, now, done)
                return
        self.preemptions += 1
        r.preemptions += 1
        del self.running[r.rid]
        self.pool.release(r.blocks)
        r.blocks = []
        r.num_computed = 0
        r.c0 = r.g0 = r.k0 = 0
        self.waiting.appendleft(r)

    def _finish(self, r: SimRequest, now: float, done: list[SimRequest]) -> None:
        r.finish = now
        r.version += 1
        del self.running[r.rid]
        self.pool.release(r.blocks)
        r.blocks = []
        done.append(r)
