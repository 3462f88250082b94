"""Soak under churn: one hour of a busy 16-pod fleet's KV events, replayed as fast as the pool sustains.

"Busy" comes from seed 002 (FACTS.md; bench/sim/workload.py SEED002_73) at
its peak load: 60 QPS over 8 pods = 7.5 requests per second per pod; each
request carries a customer's 6,000-token shared context (150 customers), a
1,200-token question and 1,000 output tokens; each pod caches 307,328 tokens
(19,208 blocks of 16 tokens).  Each request's customer is drawn at random
(as a router that ignores the cache would send them: the most churn; seed
002's precise routing would hit more).  Per pod and request the engine model stores
the context blocks it misses plus 75 question blocks in its prefill batch
(evicting least recently used blocks, with BlockRemoved) and 62 output
blocks over 4 decode batches; so about 37 batches and ~3,000 blocks stored
and as many removed per pod per second in steady state.  On top, per pod and
hour: 2 prefix-cache resets (AllBlocksCleared) and 1 engine restart (seq
back to 0, cache empty), spread over the hour.  One simulated hour of 16
such pods is ~2.2 M messages and ~180 M blocks stored.

A separate process plays the 16 engines on a real ZMQ PUB socket (topics
``kv@pod-i@m``, the subscriber binds); it runs ahead of the pool by at most
a window of messages (credit from the main process), so the rate is the
fastest the pool sustains without dropping.  The main process runs the
library's Subscriber + EventPool + compiled index with a capacity bound
below the fleet's resident set (so eviction works all along) and samples,
every second: RSS (VmRSS), request keys, entries, orphan blocks, messages
applied.

Checks (exit 1 otherwise): request keys never exceed the configured
capacity; orphan blocks never exceed their bound; RSS after the index first
fills stays within 25 % of its value then (memory follows the bound, not
the traffic); throughput is stable: once the index has reached its bound
(steady state), the last decile of messages is applied at 0.7-1.3x the
first's rate in messages per CPU-second of this process (CPU time, not wall
time, so that other work on the machine does not move the figure; wall-time
rates are reported too); no message dropped; at the end every pod's blocks in
the index are a subset of the engine model's (nothing stale survives churn).

Run: ``python bench/soak_churn.py [--hours H] [--pods N] [--max-seconds S]`` (``make soak-churn``).
Writes bench/out/soak_churn.json and bench/out/soak_churn.png.
"""

from __future__ import annotations

import argparse
import json
import logging
import multiprocessing as mp
import sys
import threading
import time
from collections import OrderedDict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402

BS = 16
POD_BLOCKS = 307_328 // BS  # 19,208
CUSTOMERS = 150
CONTEXT_BLOCKS = 6000 // BS  # 375
QUESTION_BLOCKS = 1200 // BS  # 75
OUTPUT_BLOCKS = 1000 // BS  # 62
DECODE_BATCHES = 4
REQ_PER_POD_S = 60 / 8
CLEARS_PER_POD_H = 2
RESTARTS_PER_POD_H = 1


def rss_bytes() -> tuple[int, int]:
    """(VmRSS, VmHWM) of this process in bytes, from /proc (Linux)."""
    rss = hwm = 0
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                rss = int(line.split()[1]) * 1024
            elif line.startswith("VmHWM:"):
                hwm = int(line.split()[1]) * 1024
    return rss, hwm


# -- the fleet (child process) ---------------------------------------------------------------


class _Pod:
    """One engine: an LRU cache of engine keys (ordered dict), seq from 0."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.topic = f"kv@{name}@m".encode()
        self.seq = 0
        self.cache: OrderedDict[int, None] = OrderedDict()


def fleet(endpoint: str, pods: int, hours: float, seed: int, credit, applied, window: int, out_q, halt,
          cache_file: str) -> None:
    """Publish the fleet's events for ``hours`` simulated hours (or until ``halt`` is set); send the
    simulated seconds covered and the final engine caches to ``out_q``."""
    import msgspec
    import zmq

    rng = np.random.default_rng(seed)
    ctx = zmq.Context()
    pub = ctx.socket(zmq.PUB)
    pub.setsockopt(zmq.SNDHWM, 0)
    pub.setsockopt(zmq.LINGER, -1)
    pub.connect(endpoint)
    enc = msgspec.msgpack.Encoder()
    P = [_Pod(f"pod-{i:02d}") for i in range(pods)]
    # context block engine keys: shared by every pod (same tokens, same hash); tokens per customer
    ctx_tokens = rng.integers(1, 150_000, size=(CUSTOMERS, CONTEXT_BLOCKS * BS), dtype=np.int64)
    ctx_keys = rng.integers(1, 2**63, size=(CUSTOMERS, CONTEXT_BLOCKS), dtype=np.uint64).tolist()
    next_key = [2**63]  # unique blocks: keys above every context key
    clock = [1.7e9]
    sent = 0

    def send(p: _Pod, events: list) -> None:
        nonlocal sent
        clock[0] += 0.001
        payload = enc.encode([clock[0], events, 0])
        while sent - applied.value > window:  # credit: never more than `window` messages ahead of the pool
            time.sleep(0.0005)
        pub.send_multipart([p.topic, p.seq.to_bytes(8, "big"), payload])
        p.seq += 1
        sent += 1

    def store(p: _Pod, keys: list[int], parent: int | None, tokens: list[int]) -> dict | None:
        removed: list[int] = []
        for k in keys:
            p.cache[k] = None
            p.cache.move_to_end(k)
        while len(p.cache) > POD_BLOCKS:
            removed.append(p.cache.popitem(last=False)[0])
        ev = {"type": "BlockStored", "block_hashes": keys, "parent_block_hash": parent, "token_ids": tokens,
              "block_size": BS, "medium": "GPU"}
        return ev, ({"type": "BlockRemoved", "block_hashes": removed, "medium": "GPU"} if removed else None)

    sim_seconds = hours * 3600
    steps = int(sim_seconds * REQ_PER_POD_S)  # requests per pod
    clear_every = max(1, int(steps / max(1e-9, CLEARS_PER_POD_H * hours))) if CLEARS_PER_POD_H * hours >= 1 else 0
    restart_every = max(1, int(steps / (RESTARTS_PER_POD_H * hours))) if RESTARTS_PER_POD_H * hours >= 1 else 0
    done_steps = 0
    for step in range(steps):
        if halt.value:
            break
        done_steps = step + 1
        for i, p in enumerate(P):
            j = step + i * max(1, steps // pods)  # spread the pods' resets and restarts over the hour
            if restart_every and j % restart_every == restart_every - 1:
                p.seq = 0  # a new engine process: seq from 0, empty cache (no event)
                p.cache.clear()
            if clear_every and j % clear_every == clear_every // 2:
                p.cache.clear()
                send(p, [{"type": "AllBlocksCleared"}])
            c = int(rng.integers(CUSTOMERS))
            # prefill: the context blocks the pod misses (from the first miss on), then the question
            ck = ctx_keys[c]
            first = 0
            while first < CONTEXT_BLOCKS and ck[first] in p.cache:
                p.cache.move_to_end(ck[first])
                first += 1
            q_keys = list(range(next_key[0], next_key[0] + QUESTION_BLOCKS))
            next_key[0] += QUESTION_BLOCKS + OUTPUT_BLOCKS
            q_tokens = rng.integers(1, 150_000, size=QUESTION_BLOCKS * BS).tolist()
            keys = ck[first:] + q_keys
            tokens = ctx_tokens[c, first * BS:].tolist() + q_tokens
            parent = ck[first - 1] if first else None
            ev, rm = store(p, keys, parent, tokens)
            send(p, [rm, ev] if rm else [ev])
            # decode: output blocks in a few batches, each chained to the previous block
            prev = q_keys[-1]
            o0 = q_keys[-1] + 1
            per = OUTPUT_BLOCKS // DECODE_BATCHES
            for d in range(DECODE_BATCHES):
                lo = d * per
                hi = OUTPUT_BLOCKS if d == DECODE_BATCHES - 1 else lo + per
                ok = list(range(o0 + lo, o0 + hi))
                ev, rm = store(p, ok, prev, rng.integers(1, 150_000, size=(hi - lo) * BS).tolist())
                send(p, [rm, ev] if rm else [ev])
                prev = ok[-1]
    # one more message per pod so a restart's first message is confirmed by its successor
    for p in P:
        send(p, [])
    credit.value = sent
    import pickle

    with open(cache_file, "wb") as f:  # read by the main process after its last memory sample
        pickle.dump({p.name: list(p.cache) for p in P}, f)
    out_q.put(done_steps / REQ_PER_POD_S)
    pub.close(linger=30_000)
    ctx.term()


def restarts_published(pods: int, hours: float, covered_s: float) -> int:
    """Engine restarts the fleet process published in ``covered_s`` simulated seconds (same rule as fleet())."""
    steps = int(hours * 3600 * REQ_PER_POD_S)
    done = int(round(covered_s * REQ_PER_POD_S))
    if RESTARTS_PER_POD_H * hours < 1:
        return 0
    every = max(1, int(steps / (RESTARTS_PER_POD_H * hours)))
    phase = max(1, steps // pods)
    return sum(1 for i in range(pods) for step in range(done) if (step + i * phase) % every == every - 1)


# -- the router side (main process) -------------------------------------------------------------


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hours", type=float, default=1.0, help="simulated hours of fleet traffic")
    ap.add_argument("--pods", type=int, default=16)
    ap.add_argument("--seed", type=int, default=2)
    ap.add_argument("--capacity", type=int, default=100_000, help="the index's bound on request keys")
    ap.add_argument("--max-orphans", type=int, default=20_000)
    ap.add_argument("--window", type=int, default=500, help="messages the fleet may run ahead of the pool")
    ap.add_argument("--max-seconds", type=float, default=0, help="stop publishing after this wall time (0: never); "
                    "the report then says how much of the simulated time was covered")
    ap.add_argument("--backend", default="native")
    args = ap.parse_args()
    logging.disable(logging.WARNING)
    import faulthandler

    faulthandler.enable()

    import zmq

    from kvevents.pool import EventPool
    from kvevents.subscriber import Subscriber
    from kvindex.keys import TokenProcessor
    from kvindex.factory import make_index

    tp = TokenProcessor(block_size=BS, hash_seed=args.seed)
    index = make_index(args.backend, tp, capacity=args.capacity, max_orphan_blocks=args.max_orphans)
    pool = EventPool(index, concurrency=2, queue_size=10_000)
    pool.start()
    for attempt in range(20):  # a free port for the subscriber to bind (the fleet dials in)
        probe = zmq.Context.instance().socket(zmq.PUB)
        port = probe.bind_to_random_port("tcp://127.0.0.1")
        probe.close(linger=0)
        sub = Subscriber(pool, bind=f"tcp://127.0.0.1:{port}", rcvhwm=0)
        try:
            sub.start()
            break
        except zmq.ZMQError:
            time.sleep(0.1)
    else:
        raise RuntimeError("no free port to bind")
    rss0, _ = rss_bytes()

    out = ROOT / "bench" / "out"
    out.mkdir(parents=True, exist_ok=True)
    cache_file = out / "soak_churn_caches.pickle"
    applied = mp.Value("q", 0, lock=False)
    halt = mp.Value("b", 0, lock=False)
    total = mp.Value("q", 0, lock=False)
    out_q: mp.Queue = mp.Queue()
    proc = mp.get_context("fork").Process(
        target=fleet, args=(f"tcp://127.0.0.1:{port}", args.pods, args.hours, args.seed, total, applied,
                            args.window, out_q, halt, str(cache_file)), daemon=True)
    samples: list[dict] = []
    stop = threading.Event()

    def index_bytes() -> int:
        mb = getattr(index, "memory_bytes", None)
        return mb() if mb is not None else 0

    def applied_now() -> int:
        return sum(s.c.messages for s in pool._shards)

    def credit_loop() -> None:
        while not stop.is_set():
            applied.value = applied_now()
            time.sleep(0.002)

    def sample_loop() -> None:
        while not stop.is_set():
            st = index.stats()
            rss, _ = rss_bytes()
            samples.append({"t": time.perf_counter() - t0, "cpu": time.process_time() - cpu0,
                            "messages": applied_now(), "rss": rss, "keys": st.keys,
                            "entries": st.entries, "orphan_blocks": st.orphan_blocks, "evictions": st.evictions,
                            "index_bytes": index_bytes()})
            stop.wait(1.0)

    t0 = time.perf_counter()
    cpu0 = time.process_time()
    threads = [threading.Thread(target=credit_loop, daemon=True), threading.Thread(target=sample_loop, daemon=True)]
    for t in threads:
        t.start()
    proc.start()
    if args.max_seconds > 0:
        threading.Timer(args.max_seconds, lambda: setattr(halt, "value", 1)).start()
    covered_s = out_q.get()
    proc.join()
    n_total = total.value
    while sub.received < n_total and time.perf_counter() - t0 < 36_000:
        time.sleep(0.01)
    pool.flush(600)
    elapsed = time.perf_counter() - t0
    stop.set()
    for t in threads:
        t.join()
    st_final = index.stats()
    rss_end, hwm = rss_bytes()
    samples.append({"t": elapsed, "cpu": time.process_time() - cpu0, "messages": applied_now(), "rss": rss_end,
                    "keys": st_final.keys,
                    "entries": st_final.entries, "orphan_blocks": st_final.orphan_blocks,
                    "evictions": st_final.evictions, "index_bytes": index_bytes()})
    ps = pool.stats()
    import pickle

    with open(cache_file, "rb") as f:
        final_caches = pickle.load(f)
    cache_file.unlink()

    # nothing stale: every (pod, key) the index holds is in that engine's cache now
    stale = 0
    for pod, keys in final_caches.items():
        ek_ok = set(keys)
        held = index.pod_keys(pod)
        rk_of = {}
        for ek in keys:
            rk = index.request_key_of(ek, model="m")
            if rk is not None:
                rk_of[rk] = ek
        stale += len(held - set(rk_of))
        del ek_ok
    sub.stop()
    pool.stop()

    # throughput per decile of messages, by wall time and by this process's CPU time (the subscriber and the
    # pool's shards; the fleet runs in its own process): CPU time does not move when other work on the machine
    # takes the cores, so it is the figure the stability check uses.
    msgs = np.array([s["messages"] for s in samples], dtype=float)
    ts = np.array([s["t"] for s in samples])
    cs = np.array([s["cpu"] for s in samples])
    filled = next((s for s in samples if s["keys"] >= 0.99 * args.capacity), None)

    def per_decile(clock: np.ndarray, start: float) -> list[float]:
        rates = []
        for d in range(10):
            lo, hi = start + (n_total - start) * d / 10, start + (n_total - start) * (d + 1) / 10
            c_lo, c_hi = float(np.interp(lo, msgs, clock)), float(np.interp(hi, msgs, clock))
            rates.append((hi - lo) / max(1e-9, c_hi - c_lo))
        return rates

    deciles = per_decile(ts, 0.0)
    # steady state: from the moment the index first reached its bound (eviction engaged) to the end
    steady_from = float(filled["messages"]) if filled is not None else 0.0
    cpu_deciles = per_decile(cs, steady_from)
    rss_after_fill = [s["rss"] for s in samples if filled is not None and s["t"] >= filled["t"]]
    rss_growth = (max(rss_after_fill) / filled["rss"] - 1) if rss_after_fill else float("nan")
    ib_after_fill = [s["index_bytes"] for s in samples if filled is not None and s["t"] >= filled["t"]]
    result = {
        "hours_asked": args.hours, "hours_simulated": round(covered_s / 3600, 4), "pods": args.pods,
        "seed": args.seed,
        "definition": {"requests_per_pod_s": REQ_PER_POD_S, "blocks_per_request_stored":
                       f"missed context + {QUESTION_BLOCKS} + {OUTPUT_BLOCKS}", "pod_cache_blocks": POD_BLOCKS,
                       "batches_per_request": 1 + DECODE_BATCHES, "clears_per_pod_h": CLEARS_PER_POD_H,
                       "restarts_per_pod_h": RESTARTS_PER_POD_H, "source": "seed 002 (FACTS.md), 60 QPS / 8 pods"},
        "messages": n_total, "blocks_stored": ps.blocks_stored, "blocks_removed": ps.blocks_removed,
        "clears": ps.clears, "restarts": ps.restarts, "dropped_messages": ps.dropped_messages,
        "decode_errors": ps.decode_errors, "gaps": ps.gaps,
        "seconds": round(elapsed, 1), "messages_per_s": round(n_total / elapsed),
        "blocks_per_s": round((ps.blocks_stored + ps.blocks_removed) / elapsed),
        "speedup_vs_real_time": round(covered_s / elapsed, 2),
        "decile_messages_per_s": [round(x) for x in deciles],
        "last_vs_first_decile": round(deciles[-1] / deciles[0], 3),
        "steady_state_from_message": int(steady_from),
        "steady_decile_messages_per_cpu_s": [round(x) for x in cpu_deciles],
        "steady_last_vs_first_decile_cpu": round(cpu_deciles[-1] / cpu_deciles[0], 3),
        "cpu_seconds": round(float(cs[-1]), 1),
        "capacity_keys": args.capacity, "max_keys": max(s["keys"] for s in samples),
        "max_orphans_bound": args.max_orphans, "max_orphan_blocks": max(s["orphan_blocks"] for s in samples),
        "evictions": st_final.evictions, "rss_start_mb": round(rss0 / 2**20, 1),
        "rss_when_full_mb": round(filled["rss"] / 2**20, 1) if filled else None,
        "rss_peak_mb": round(hwm / 2**20, 1), "rss_end_mb": round(rss_end / 2**20, 1),
        "rss_growth_after_full": round(rss_growth, 4), "stale_entries_at_end": stale,
        "index_bytes_when_full_mb": round(ib_after_fill[0] / 2**20, 1) if ib_after_fill else None,
        "index_bytes_max_mb": round(max(ib_after_fill) / 2**20, 1) if ib_after_fill else None,
    }
    checks = {
        "keys within capacity": result["max_keys"] <= args.capacity,
        "orphans within bound": result["max_orphan_blocks"] <= args.max_orphans,
        "index filled (bound engaged)": filled is not None,
        "RSS within 25 % of its value when the index filled": filled is not None and rss_growth <= 0.25,
        "throughput stable (messages per CPU-second, steady state: last / first decile in 0.7..1.3)":
            0.7 <= result["steady_last_vs_first_decile_cpu"] <= 1.3,
        "no message dropped": ps.dropped_messages == 0,
        "no stale entry at the end": stale == 0,
        "every restart confirmed": ps.restarts == restarts_published(args.pods, args.hours, covered_s),
    }
    result["checks"] = checks
    result["samples"] = samples

    print(f"soak-churn: {covered_s / 3600:.3f} h (of {args.hours} h asked) of a busy {args.pods}-pod fleet = {n_total:,} messages, "
          f"{ps.blocks_stored:,} blocks stored, {ps.blocks_removed:,} removed, {ps.clears:,} clears, "
          f"{ps.restarts} restarts; {elapsed:.0f} s ({result['speedup_vs_real_time']}x real time)")
    print(f"rate {result['messages_per_s']:,} messages/s, {result['blocks_per_s']:,} blocks/s; per decile "
          f"{result['decile_messages_per_s']} (last/first {result['last_vs_first_decile']})")
    print(f"steady state (from message {int(steady_from):,}, index at its bound): messages per CPU-second per decile "
          f"{result['steady_decile_messages_per_cpu_s']} (last/first {result['steady_last_vs_first_decile_cpu']})")
    print(f"index: max {result['max_keys']:,} keys (bound {args.capacity:,}), {st_final.evictions:,} evictions, "
          f"max {result['max_orphan_blocks']:,} orphan blocks (bound {args.max_orphans:,})")
    samples[-1]["hours"] = covered_s / 3600
    print(f"RSS: start {result['rss_start_mb']} MB, when full {result['rss_when_full_mb']} MB, peak "
          f"{result['rss_peak_mb']} MB, end {result['rss_end_mb']} MB (growth after full "
          f"{100 * rss_growth:.1f} %); stale entries at the end: {stale}")
    for k, v in checks.items():
        print(f"  {'ok  ' if v else 'FAIL'} {k}")
    (out / "soak_churn.json").write_text(json.dumps(result, indent=1))
    plot(samples, args, out / "soak_churn.png")
    print(f"wrote {out / 'soak_churn.json'} and {out / 'soak_churn.png'}")
    if not all(checks.values()):
        sys.exit(1)


def plot(samples: list[dict], args: argparse.Namespace, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    t = [s["t"] for s in samples]
    fig, (a1, a2, a3) = plt.subplots(3, 1, figsize=(8, 9), sharex=True)
    a1.plot(t, [s["rss"] / 2**20 for s in samples], label="RSS (process)")
    a1.plot(t, [s["index_bytes"] / 2**20 for s in samples], label="compiled index structures")
    a1.set_ylabel("MB")
    a1.legend()
    a1.set_title(f"{samples[-1].get('hours', args.hours):.3g} h of a busy {args.pods}-pod fleet (seed-002 rates), replayed as fast as the pool goes")
    a2.plot(t, [s["keys"] for s in samples], label="request keys")
    a2.plot(t, [s["entries"] for s in samples], label="entries (key, pod, rank)")
    a2.axhline(args.capacity, color="k", ls="--", lw=0.8, label=f"capacity bound ({args.capacity:,} keys)")
    a2.plot(t, [s["orphan_blocks"] for s in samples], label="orphan blocks")
    a2.axhline(args.max_orphans, color="r", ls=":", lw=0.8, label=f"orphan bound ({args.max_orphans:,})")
    a2.legend(fontsize=8)
    m = np.array([s["messages"] for s in samples], dtype=float)
    tt = np.array(t)
    rate = np.diff(m) / np.maximum(np.diff(tt), 1e-9)
    a3.plot(tt[1:], rate, lw=0.7)
    a3.set_ylabel("messages / s")
    a3.set_xlabel("seconds")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    main()
