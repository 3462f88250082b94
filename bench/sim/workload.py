"""Seed 002's workloads (llm-d precise prefix-cache benchmark), as simulated requests.

Each customer has a shared context (a system prompt and documents); each of its
users asks the same question every time, so a user's whole prompt is a
reusable prefix.  Requests pick a (customer, user) uniformly; arrivals are
Poisson, the rate stepping through ``qps_stages`` (``stage_seconds`` each).
"""

from __future__ import annotations

import msgspec
import numpy as np

from bench.sim.engine import SimRequest, chain_hashes

__all__ = ["ApproxConfig", "Workload", "SEED002_73", "SEED002_37", "build_requests", "quick"]


class ApproxConfig(msgspec.Struct, frozen=True, kw_only=True):
    """The settings seed 002 gave llm-d's approximate ("estimated") prefix-cache scheduler.

    block_tokens: tokens per hashed block (the scorer hashes ``hashBlockSize``
    characters of prompt text; at 4 characters per token, the scorer's own
    sizing assumption, 64 characters = 16 tokens); lru_entries: the per-pod
    history (``lruCapacityPerServer``, entries); max_blocks:
    ``maxPrefixBlocksToMatch``; weights: (prefix, kv usage, load) scorer
    weights; load_scorer: "queue" (min-max of the engines' waiting queues) or
    "active-request" (the router's own in-flight count, (max - n) / max).
    Defaults: the published 73-capacity configuration (64 characters, 31,250
    entries, 256 blocks, 1 : 1 : 1 with the queue scorer).
    """

    block_tokens: int = 16
    lru_entries: int = 31_250
    max_blocks: int = 256
    weights: tuple[float, float, float] = (1.0, 1.0, 1.0)
    load_scorer: str = "queue"


class Workload(msgspec.Struct, frozen=True, kw_only=True):
    """One seed-002 workload.

    pods / capacity_tokens: the fleet (KV tokens per pod).  customers x
    users_per_customer users; shared_tokens of context per customer,
    question_tokens per user, output_tokens per request.  ``resident_fraction``
    is (every customer's context + every user's question) / fleet KV.
    ``approximate``: how seed 002 configured the approximate scheduler for it.
    """

    name: str
    pods: int
    capacity_tokens: int
    customers: int
    users_per_customer: int
    shared_tokens: int
    question_tokens: int
    output_tokens: int
    qps_stages: tuple[float, ...] = (3.0, 10.0, 20.0, 30.0, 40.0, 50.0, 60.0)
    stage_seconds: float = 10.0
    vocab: int = 150_000
    approximate: ApproxConfig = ApproxConfig()

    @property
    def resident_fraction(self) -> float:
        c = self.customers
        total = c * self.shared_tokens + c * self.users_per_customer * self.question_tokens
        return total / (self.pods * self.capacity_tokens)


#: 8 pods of 307,328 KV tokens, 150 customers x 5 users, 6,000 + 1,200 tokens in, 1,000 out (73 % resident).
SEED002_73 = Workload(name="seed002-73", pods=8, capacity_tokens=307_328, customers=150, users_per_customer=5,
                      shared_tokens=6_000, question_tokens=1_200, output_tokens=1_000)
#: 4 pods of 461,376 KV tokens, 83 customers x 3 users, 8,000 + 1,000 tokens in, 1,000 out.
#: Its approximate scheduler as published: 256-character blocks, 2,200 entries per pod, prefix 2 : kv 1 :
#: active-request 1.
SEED002_37 = Workload(name="seed002-37", pods=4, capacity_tokens=461_376, customers=83, users_per_customer=3,
                      shared_tokens=8_000, question_tokens=1_000, output_tokens=1_000,
                      approximate=ApproxConfig(block_tokens=64, lru_entries=2_200, weights=(2.0, 1.0, 1.0),
                                               load_scorer="active-request"))


def quick(w: Workload) -> Workload:
    """A scaled-down copy for tests (seconds to simulate): every token count a
    quarter (same resident fraction; the approximate scheduler's hashed block
    too, so its window and history cover the same share of a prompt), the same
    users, a shorter load ramp."""
    return msgspec.structs.replace(
        w,
        name=w.name + "-quick",
        capacity_tokens=w.capacity_tokens // 4,
        shared_tokens=w.shared_tokens // 4,
        question_tokens=w.question_tokens // 4,
        output_tokens=w.output_tokens // 4,
        approximate=msgspec.structs.replace(w.approximate, block_tokens=max(1, w.approximate.block_tokens // 4)),
        qps_stages=tuple(q * 4 for q in w.qps_stages[::3]),
        stage_seconds=4.0,
    )


def build_requests(w: Workload, seed: int, block_size: int) -> list[SimRequest]:
    """The request sequence of one run: same ``seed`` -> the same prompts, arrivals and outputs."""
    rng = np.random.default_rng(seed)
    users = []
    for c in range(w.customers):
        shared = rng.integers(1, w.vocab, size=w.shared_tokens, dtype=np.int32)
        for u in range(w.users_per_customer):
            q = rng.integers(1, w.vocab, size=w.question_tokens, dtype=np.int32)
            prompt = np.concatenate((shared, q))
            users.append((c, prompt, chain_hashes(prompt, block_size)))
    reqs: list[SimRequest] = []
    t = 0.0
    for stage, qps in enumerate(w.qps_stages):
        end = (stage + 1) * w.stage_seconds
        t = max(t, stage * w.stage_seconds)
        while True:
            t += rng.exponential(1.0 / qps)
            if t >= end:
                t = end
                break
            c, prompt, hashes = users[int(rng.integers(len(users)))]
            out = rng.integers(1, w.vocab, size=w.output_tokens, dtype=np.int32)
            reqs.append(SimRequest(len(reqs), t, prompt, hashes, out, group=c, meta=stage))
    return reqs
