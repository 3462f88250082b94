"""Soak of the write path: model engines at volume with random faults; does the index converge?

The engine model of tests/test_engine_model.py (tests/engine_model.py: blocks
per tier, seq from 0 per process, a replay buffer served on a real ZMQ ROUTER
socket) drives the real EventPool and KVBlockIndex with a few hundred thousand
messages and, from a seeded generator, faults: message loss, duplicate
delivery, reordering, bursts beyond the pool's queue bound, replay buffers too
short for some gaps, engine restarts seen (disconnect + reconnect) and unseen,
malformed events, hostile messages (unreadable, huge or backward seq).

It reports the messages and faults by kind, the pool's resyncs, replays,
restarts and clears, the ingest rate, the time from the last message until
every stream is current and complete where it can be (convergence), and the
final divergence per stream: block copies the index holds that the engine
does not (must be 0), and copies it misses on streams it reports complete
(must be 0).  Writes bench/out/soak_writepath.json.

Run: ``python bench/soak_writepath.py [--messages N] [--seed S]`` (``make soak``).
"""

from __future__ import annotations

import argparse
import json
import logging
import random
import sys
import time
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from kvevents.pool import EventPool, RawMessage, Source  # noqa: E402
from kvindex.reference import KVBlockIndex  # noqa: E402
from kvindex.keys import TokenProcessor  # noqa: E402
from tests.engine_model import MALFORMED_EVENT, ModelEngine, Paths, ReplayServer, index_view  # noqa: E402
from tests.oracle import batch_payload, seq_frame, stored_event  # noqa: E402

BS = 4
PUBLISHERS = [(f"pod-{p}", m, r) for p in range(4) for m in ("m1", "m2") for r in (0, 1)]
# per message: probability of each fault (the rest are delivered as published)
FAULTS = {
    "lose": 0.004, "dup": 0.004, "reorder": 0.004, "bad_event": 0.001,
    "hostile": 0.0005, "restart_seen": 0.0002, "restart_unseen": 0.0002, "burst": 0.0005,
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--messages", type=int, default=300_000)
    ap.add_argument("--seed", type=int, default=6)
    ap.add_argument("--queue-size", type=int, default=512)
    args = ap.parse_args()
    logging.disable(logging.WARNING)  # the pool logs every fault it handles; the counters say it all

    rnd = random.Random(args.seed)
    paths = Paths.make(args.seed, block_size=BS, n_paths=40, n_blocks=8)
    tp = TokenProcessor(block_size=BS, hash_seed=args.seed)
    rk2ek = {m: paths.rk_to_ek(tp, m) for m in ("m1", "m2")}
    # most buffers hold vLLM's default; a quarter are short, so some gaps cannot be replayed
    engines = [
        ModelEngine(pod, model, rank, paths, buffer_steps=10_000 if i % 4 else 64, capacity=64)
        for i, (pod, model, rank) in enumerate(PUBLISHERS)
    ]
    for e in engines:
        e.clear_p = 0.0005  # prefix-cache resets are rare in a fleet
    server = ReplayServer(engines)
    index = KVBlockIndex(tp)
    pool = EventPool(index, concurrency=4, queue_size=args.queue_size, replay_timeout=3.0)
    pool.start()
    sources = {id(e): Source(pod=e.pod, replay=server.endpoint(e), model=e.model) for e in engines}
    faults: Counter[str] = Counter()
    held: dict[int, tuple[bytes, bytes, bytes]] = {}
    sent = 0

    def send(e: ModelEngine, frames: tuple[bytes, bytes, bytes]) -> None:
        nonlocal sent
        sent += 1
        if not pool.submit(RawMessage(sources[id(e)], *frames)):
            faults["dropped_by_pool"] += 1

    kinds, weights = list(FAULTS), list(FAULTS.values())
    t0 = time.perf_counter()
    published = 0
    while published < args.messages:
        e = engines[rnd.randrange(len(engines))]
        r = rnd.random()
        fault = None
        acc = 0.0
        for k, w in zip(kinds, weights):
            acc += w
            if r < acc:
                fault = k
                break
        if fault == "burst":
            faults["burst"] += 1
            for _ in range(rnd.randint(args.queue_size, 4 * args.queue_size)):
                send(e, e.publish(e.random_events(rnd, 1)))
                published += 1
            continue
        if fault == "restart_seen":
            faults[fault] += 1
            pool.disconnected(e.pod, e.dp_rank)
            e.restart()
            pool.reconnected(e.pod, e.dp_rank)
            continue
        if fault == "restart_unseen":
            faults[fault] += 1
            e.restart()
            fault = None  # its first batch is delivered (see tests/test_engine_model.py)
        if fault == "hostile":
            faults[fault] += 1
            ev = stored_event([paths.ek(0, 0)], None, paths.tokens(0, 0, 1), BS)
            seq = rnd.choice([2**64 - 2, max(0, e.next_seq - 2), e.next_seq + 500])
            payload = b"\x93\xc1junk" if rnd.random() < 0.3 else batch_payload([ev], dp_rank=e.dp_rank, ts=1.0)
            send(e, (e.topic, seq_frame(seq), payload))
            continue
        events = e.random_events(rnd, rnd.randint(1, 3))
        if fault == "bad_event":
            faults[fault] += 1
            frames = e.publish(events, extra_raw=[(0, MALFORMED_EVENT)])
            e.bad_event_batches += 1
        else:
            frames = e.publish(events)
        published += 1
        if fault == "lose":
            faults[fault] += 1
            continue
        if fault == "reorder":
            faults[fault] += 1
            held[id(e)] = frames
            continue
        send(e, frames)
        if fault == "dup":
            faults[fault] += 1
            send(e, frames)
        h = held.pop(id(e), None)
        if h is not None:
            send(e, h)
    for e in engines:
        h = held.pop(id(e), None)
        if h is not None:
            send(e, h)
    t_last = time.perf_counter()

    # settle: the queues drain, one more message per engine, then every stream is current
    assert pool.flush(600)
    for e in engines:
        while not pool.submit(RawMessage(sources[id(e)], *e.publish([]))):
            pool.flush(60)
    assert pool.flush(600)
    t_conv = time.perf_counter()

    states = {(s.pod, s.model, s.dp_rank): s for s in pool.completeness()}
    streams = []
    extra_total = missing_complete = missing_total = 0
    for e in engines:
        got, want = index_view(index, e, rk2ek[e.model]), e.view()
        s = states[(e.pod, e.model, e.dp_rank)]
        extra, missing = len(got - want), len(want - got)
        extra_total += extra
        missing_total += missing
        missing_complete += missing if s.complete else 0
        streams.append({
            "stream": f"{e.pod}/{e.model}/{e.dp_rank}", "buffer_steps": e.buffer_steps, "complete": s.complete,
            "engine_blocks": len(want), "index_blocks": len(got), "extra": extra, "missing": missing,
        })
    ps = pool.stats()
    result = {
        "seed": args.seed,
        "messages_published": published,
        "messages_submitted": sent,
        "faults": dict(sorted(faults.items())),
        "pool": {k: getattr(ps, k) for k in (
            "messages", "batches", "gaps", "gaps_unrecovered", "replay_requests", "replayed_batches",
            "duplicates", "stale", "unconfirmed", "restarts", "resyncs", "clears", "dropped_messages",
            "replay_failures", "decode_errors", "incomplete_streams")},
        "ingest_messages_per_s": round(sent / (t_last - t0)),
        "publish_seconds": round(t_last - t0, 2),
        "converge_seconds": round(t_conv - t_last, 3),
        "streams": streams,
        "streams_complete": sum(1 for s in streams if s["complete"]),
        "divergence_extra": extra_total,
        "divergence_missing_where_complete": missing_complete,
        "missing_where_incomplete": missing_total - missing_complete,
    }
    pool.stop()
    server.close()

    print(f"soak: {published:,} messages published, {sent:,} submitted, seed {args.seed}")
    print("faults injected: " + ", ".join(f"{k} {v:,}" for k, v in result["faults"].items()))
    print("pool: " + ", ".join(f"{k} {v:,}" for k, v in result["pool"].items()))
    print(f"ingest {result['ingest_messages_per_s']:,} msg/s over {result['publish_seconds']} s; "
          f"converged {result['converge_seconds']} s after the last message")
    print(f"{'stream':<16} {'buffer':>7} {'complete':>8} {'engine':>7} {'index':>6} {'extra':>6} {'missing':>8}")
    for s in streams:
        print(f"{s['stream']:<16} {s['buffer_steps']:>7} {str(s['complete']):>8} {s['engine_blocks']:>7} "
              f"{s['index_blocks']:>6} {s['extra']:>6} {s['missing']:>8}")
    print(f"divergence: {extra_total} extra copies, {missing_complete} missing on complete streams "
          f"({result['missing_where_incomplete']} missing on incomplete ones)")
    out = ROOT / "bench" / "out"
    out.mkdir(parents=True, exist_ok=True)
    (out / "soak_writepath.json").write_text(json.dumps(result, indent=2))
    print(f"wrote {out / 'soak_writepath.json'}")
    if extra_total or missing_complete:
        sys.exit(1)


if __name__ == "__main__":
    main()
