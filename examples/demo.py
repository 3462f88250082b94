"""`make demo`: a simulated fleet feeding a live index, and a router scoring a shared-prefix workload.

Four simulated vLLM engines (separate processes) publish vLLM-format KV events
over real ZMQ on loopback; pod-0 also serves replays.  Their caches are small
enough to evict.  The indexer subscribes to all four; a router loop scores
each request, picks a pod, sends the request there, and prints what it
predicted against what the engine reports it really had cached.  Midway,
pod-0 loses messages (a gap the indexer replays) and pod-3 restarts.

Run: ``python -m examples.demo [--requests N] [--seed S]``.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time

import numpy as np

from examples.simfleet.fleet import EngineConfig, SimFleet
from kvindex.facade import Config, Indexer
from kvevents.pool import RawMessage, Source
from kvindex.reference import KVBlockIndex
from scorer.load import LoadSnapshot

BLOCK = 16
MODEL = "sim-model"


def build_fleet() -> SimFleet:
    engines = [
        EngineConfig(pod="pod-0", model=MODEL, replay=True, capacity_blocks=400, encoding="map"),
        EngineConfig(pod="pod-1", model=MODEL, capacity_blocks=400, encoding="array"),
        EngineConfig(pod="pod-2", model=MODEL, capacity_blocks=400, hash_form="bytes"),
        EngineConfig(pod="pod-3", model=MODEL, capacity_blocks=400, hash_form="int64"),
    ]
    return SimFleet(engines)


def workload(rng: random.Random, n: int) -> list[tuple[str, list[int]]]:
    """Customers share a long system prompt; each user's turns extend the previous prompt."""
    customers = [[rng.randrange(1, 30_000) for _ in range(rng.choice([512, 768, 1024]))] for _ in range(6)]
    convs: dict[tuple[int, int], list[int]] = {}
    out = []
    for _ in range(n):
        if rng.random() < 0.1:
            out.append(("unrelated", [rng.randrange(1, 30_000) for _ in range(rng.randrange(64, 600))]))
            continue
        c, u = rng.randrange(len(customers)), rng.randrange(4)
        prompt = convs.get((c, u))
        if prompt is None:
            prompt = customers[c] + [rng.randrange(1, 30_000) for _ in range(rng.randrange(100, 300))]
        else:  # next turn: previous prompt + the answer + a new question
            prompt = prompt + [rng.randrange(1, 30_000) for _ in range(rng.randrange(60, 200))]
        convs[(c, u)] = prompt
        out.append((f"cust{c}/user{u}", prompt))
    return out


def wait_caught_up(ix: Indexer, pod: str, seq: int, timeout: float = 0.5) -> bool:
    """Wait (bounded) until the indexer has applied ``pod``'s batch ``seq``.

    A batch lost on the way (dropped, or published before a restarted engine's
    socket was reconnected) is not waited for beyond the timeout.
    """
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if any(p == pod and last == seq for p, _r, last in ix.pool.streams()):
            return ix.pool.flush(1.0)
        time.sleep(0.002)
    return False


def ping_until_received(fleet: SimFleet, ix: Indexer, timeout: float = 10.0) -> None:
    """ZMQ subscriptions take a moment: publish harmless clears until each pod's arrive."""
    deadline = time.monotonic() + timeout
    for pod in fleet.names:
        while time.monotonic() < deadline:
            before = ix.stats().events.clears
            fleet.reset(pod)
            t = time.monotonic() + 0.2
            while time.monotonic() < t and ix.stats().events.clears == before:
                time.sleep(0.005)
            if ix.stats().events.clears > before:
                break
        else:
            raise SystemExit(f"no events from {pod} within {timeout}s")


def ingest_rate(n_batches: int = 4000) -> tuple[float, float]:
    """Blocks/s and batches/s through pool + index (no sockets): 4 pods, 4-block events."""
    import msgspec

    from kvevents.pool import EventPool

    rng = random.Random(1)
    index = KVBlockIndex()
    payloads = []
    parents: dict[int, int | None] = {}
    for i in range(n_batches):
        pod = i % 4
        toks = [rng.randrange(30_000) for _ in range(4 * BLOCK)]
        hashes = [rng.getrandbits(64) for _ in range(4)]
        ev = {"type": "BlockStored", "block_hashes": hashes, "parent_block_hash": parents.get(pod),
              "token_ids": toks, "block_size": BLOCK, "medium": "GPU", "lora_id": None, "lora_name": None}
        parents[pod] = hashes[-1]
        payloads.append((f"kv@pod-{pod}@{MODEL}".encode(), (i // 4).to_bytes(8, "big"),
                         msgspec.msgpack.encode([time.time(), [ev], 0])))
    pool = EventPool(index, concurrency=4)
    pool.start()
    src = Source()
    t0 = time.perf_counter()
    for topic, seq, payload in payloads:
        while not pool.submit(RawMessage(src, topic, seq, payload)):
            time.sleep(0.001)
    pool.flush(60)
    dt = time.perf_counter() - t0
    pool.stop()
    return index.stats().stored_blocks / dt, n_batches / dt


def score_latency(ix_cfg: Config, pods: int = 4, tokens: int = 8192, reps: int = 200) -> dict[str, float]:
    """Median microseconds of request_keys, prefix match and full score() for an 8,192-token prompt."""
    ix = Indexer(ix_cfg)
    rng = np.random.default_rng(0)
    prompt = rng.integers(1, 30_000, size=tokens).tolist()
    n_blocks = tokens // BLOCK
    for p in range(pods):
        held = n_blocks * (p + 1) // pods  # pod p holds the first (p+1)/pods of the prompt
        ix.index.block_stored(f"pod-{p}", 0, list(range(p * 10**6, p * 10**6 + held)), None,
                              prompt[: held * BLOCK], "gpu", block_size=BLOCK, model=MODEL)
    cands = [f"pod-{p}" for p in range(pods)]
    out = {}
    for name, fn in (
        ("request_keys", lambda: ix.request_keys(prompt)),
        ("score", lambda: ix.score(prompt, cands)),
    ):
        ts = []
        for _ in range(reps):
            t0 = time.perf_counter()
            fn()
            ts.append(time.perf_counter() - t0)
        out[name] = statistics.median(ts) * 1e6
    keys = ix.request_keys(prompt)
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        ix.index.prefix_match(keys, cands)
        ts.append(time.perf_counter() - t0)
    out["prefix_match"] = statistics.median(ts) * 1e6
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=120)
    ap.add_argument("--seed", type=int, default=7)
    args = ap.parse_args(argv)
    rng = random.Random(args.seed)

    print("starting 4 simulated engines (pod-0 with a replay endpoint) ...", flush=True)
    with build_fleet() as fleet:
        cfg = Config.from_dict(
            {
                "model_name": MODEL,
                "token_processor_config": {"block_size": BLOCK, "hash_seed": "demo"},
                "kv_events_config": {
                    "engines": [
                        {"pod": p, "endpoint": fleet.endpoint(p), "replay_endpoint": fleet.replay_endpoint(p), "model": MODEL}
                        for p in fleet.names
                    ]
                },
            }
        )
        with Indexer(cfg) as ix:
            ping_until_received(fleet, ix)
            pods = list(fleet.names)
            reqs = workload(rng, args.requests)
            print(f"\n{'#':>3}  {'conversation':<14} {'tokens':>6}  {'pod':<6} {'predicted':>9} {'engine hit':>10} {'coverage':>8}")
            pred_total = hit_total = exact = confirmed = 0
            for i, (conv, prompt) in enumerate(reqs):
                if i == len(reqs) // 3:
                    fleet.drop_next("pod-0", 2)
                    print("    -- pod-0 will lose its next 2 event batches (the indexer replays them) --")
                if i == 2 * len(reqs) // 3:
                    fleet.restart("pod-3")
                    print("    -- pod-3 restarts with an empty cache (seq back to 0) --")
                for p in pods:
                    s = fleet.stats(p)
                    ix.update_load(p, LoadSnapshot(kv_usage=s.gpu_blocks / s.capacity_blocks))
                result = ix.score(prompt, pods)
                pod = result.pod
                predicted = result.prefix[pod].matched_tokens
                hit = fleet.serve(pod, prompt)
                pred_total += predicted
                hit_total += hit
                exact += predicted == hit
                confirmed += min(predicted, hit)
                print(f"{i:>3}  {conv:<14} {len(prompt):>6}  {pod:<6} {predicted:>9} {hit:>10} {result.prefix[pod].coverage:>8.2f}")
                # let the write path catch up with the batch this request produced
                wait_caught_up(ix, pod, fleet.stats(pod).next_seq - 1)

            st = ix.stats()
            precision = confirmed / pred_total if pred_total else 1.0
            recall = confirmed / hit_total if hit_total else 1.0
            print(f"\nrequests {len(reqs)}: predicted cached tokens {pred_total}, engine-reported hits {hit_total}")
            print(f"exact predictions {exact}/{len(reqs)}; precision {precision:.3f}, recall {recall:.3f}")
            print(
                f"index: {st.index.keys} keys, {st.index.entries} entries, {st.index.pods} pods, "
                f"evictions {st.index.evictions}, orphans {st.index.orphans} (attached {st.index.orphans_attached})"
            )
            e = st.events
            print(
                f"events: {st.received_messages} messages, {e.batches} batches, {e.blocks_stored} blocks stored, "
                f"{e.blocks_removed} removed, gaps {e.gaps} (unrecovered {e.gaps_unrecovered}), "
                f"replays {e.replay_requests} ({e.replayed_batches} batches), restarts {e.restarts}, "
                f"decode errors {e.decode_errors}"
            )
            last = reqs[-1][1]
            print("\nthe last prompt, scored again now that its pod holds it:\n" + ix.score(last, pods).explain())

    blocks_s, batches_s = ingest_rate()
    print(f"\ningest (pool + index, 4 shards, 4-block events): {blocks_s:,.0f} blocks/s, {batches_s:,.0f} batches/s")
    lat = score_latency(cfg)
    print(
        "read path, 8,192-token prompt, 4 candidate pods (median): "
        f"request_keys {lat['request_keys']:.0f} us, prefix_match {lat['prefix_match']:.0f} us, "
        f"score() {lat['score']:.0f} us"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
