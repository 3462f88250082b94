"""Several router replicas (separate processes) share one index in a real Redis.

Three simulated vLLM engines (real ZMQ PUB + replay ROUTER sockets,
examples/simfleet) serve prompts with shared prefixes; two replica processes
(tests/redis_replica.py) run an Indexer with ``backend: redis`` on one key
prefix:

- mode ``both_ingest``: both subscribe to every engine and write the same
  events into the shared index (idempotent writes);
- mode ``one_ingests``: replica 0 subscribes, replica 1 only scores.

Before the replicas start, the engines have served part of the workload
(the replicas rebuild it from the engines' replay buffers); then more is
served live, with evictions.  After each phase both replicas answer the same
prefix scores for every prompt, equal to the engines' own cached prefixes.
"""

from __future__ import annotations

import itertools
import random
import subprocess
import sys

import msgspec
import pytest

from examples.simfleet.engine import SimEngine

PODS = ["pod-a", "pod-b", "pod-c"]
BS = 16
_prefixes = itertools.count()


class Replica:
    """A replica process speaking tests/redis_replica.py's line protocol."""

    def __init__(self, config: dict) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tests.redis_replica", msgspec.json.encode(config).decode()],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
        )

    def read(self) -> dict:
        line = self.proc.stdout.readline()  # type: ignore[union-attr]
        assert line, f"replica exited with {self.proc.poll()}"
        return msgspec.json.decode(line)

    def ask(self, **cmd) -> dict:
        self.proc.stdin.write(msgspec.json.encode(cmd).decode() + "\n")  # type: ignore[union-attr]
        self.proc.stdin.flush()  # type: ignore[union-attr]
        return self.read()

    def close(self) -> None:
        try:
            self.ask(cmd="quit") if self.proc.poll() is None else None
        except (AssertionError, BrokenPipeError, OSError):
            pass
        try:
            self.proc.wait(15)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(5)


def prompts(rnd: random.Random, n: int) -> list[list[int]]:
    """Prompts of 3-12 blocks over 4 shared prefixes of 2-6 blocks."""
    bases = [[rnd.randrange(1, 30_000) for _ in range(BS * k)] for k in (2, 3, 5, 6)]
    out = []
    for _ in range(n):
        base = rnd.choice(bases)
        out.append(base + [rnd.randrange(1, 30_000) for _ in range(BS * rnd.randint(1, 6) + rnd.randrange(BS))])
    return out


def engine_prefix(e: SimEngine, tokens: list[int]) -> int:
    """The oracle: leading full blocks of ``tokens`` the engine holds (any tier)."""
    cached = e.cached_blocks()
    n = 0
    for h in e.hashes(tokens):
        if h not in cached:
            break
        n += 1
    return n


@pytest.mark.parametrize("mode", ["both_ingest", "one_ingests"])
def test_replicas_answer_the_same_scores(redis_url, mode):
    rnd = random.Random(7 if mode == "both_ingest" else 8)
    engines = [
        SimEngine(pod=p, endpoint="tcp://127.0.0.1:*", replay_endpoint="tcp://127.0.0.1:*", capacity_blocks=40,
                  block_size=BS)
        for p in PODS
    ]
    replicas: list[Replica] = []
    try:
        work = prompts(rnd, 60)
        for tokens in work[:20]:
            rnd.choice(engines).serve(tokens)
        base = {
            "model_name": "sim-model",
            "token_processor_config": {"block_size": BS},
            "kv_block_index_config": {
                "backend": "redis", "redis_config": {"url": redis_url, "key_prefix": f"rep{next(_prefixes)}:"},
            },
        }
        engines_cfg = {"engines": [{"pod": e.stats().pod, "endpoint": e.endpoint, "replay_endpoint": e.replay_endpoint}
                                   for e in engines]}
        for i in range(2):
            ingest = mode == "both_ingest" or i == 0
            replicas.append(Replica({**base, "kv_events_config": engines_cfg if ingest else {}}))
        for r in replicas:
            assert r.read() == {"ready": True}

        def check(phase: str) -> None:
            seqs = {e.stats().pod: e.stats().next_seq - 1 for e in engines}
            for r in replicas:
                assert r.ask(cmd="sync", seqs=seqs) == {"ok": True}, phase
            answers = [r.ask(cmd="score", prompts=work, pods=PODS)["scores"] for r in replicas]
            assert answers[0] == answers[1], phase
            for tokens, got in zip(work, answers[0]):
                want = {e.stats().pod: engine_prefix(e, tokens) for e in engines}
                assert got["matched"] == want, phase

        check("after replay")
        for tokens in work[20:]:
            rnd.choice(engines).serve(tokens)  # evictions too: 40 blocks per engine
        assert sum(e.stats().blocks_removed for e in engines) > 0
        check("after live events")
    finally:
        for r in replicas:
            r.close()
        for e in engines:
            e.close()
