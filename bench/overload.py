"""Overload figures of the write path on real ZMQ sockets: bursts faster than the pool, replay bursts beyond the HWMs.

1. A publisher faster than the pool: one engine sends a burst of pre-encoded
   batches (5k, 20k, 50k) into a pool with the default shard queue (10,000
   messages).  The overflow policy drops what does not fit (counted), marks
   the stream for resync and replays it from the engine's buffer when the
   shard is idle.  Reported: drops, resyncs, the time to send the burst and
   the time from its last message until the stream is complete and the index
   equals the engine's blocks (time to converge).
2. A replay burst beyond the high-water marks: the engine buffered 10,000
   batches (vLLM's default ``buffer_steps``) of 128-token blocks before the
   router started; its ROUTER (ZMQ's default send HWM, 1,000, as vLLM's) drops
   replies it cannot queue, so the start-up replay has holes.  With the
   library's re-ask (a hole inside a replay is asked again from the hole)
   against the behaviour before (``MAX_HOLE_RETRIES = 0``: the hole is taken
   as lost, the stream cleared and rebuilt from what follows), 3 trials each,
   interleaved: holes, time to converge, block copies missing at the end.

Run: ``python bench/overload.py`` (``make overload``).  Writes bench/out/overload.json.
"""

from __future__ import annotations

import json
import logging
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.overload import publisher_burst, replay_burst  # noqa: E402


def main() -> None:
    logging.disable(logging.WARNING)
    rows = []
    print("1. publisher faster than the pool (shard queue 10,000 messages)")
    print(f"{'burst':>7} {'send s':>7} {'dropped':>8} {'resyncs':>8} {'replayed':>9} {'converge s':>11} "
          f"{'complete':>9} {'extra':>6} {'missing':>8}")
    for n in (5_000, 20_000, 50_000):
        o = publisher_burst(n, queue_size=10_000, timeout=300)
        st = o.stats
        rows.append({"scenario": "publisher_burst", "messages": n, "send_seconds": round(o.publish_seconds, 3),
                     "dropped": st.dropped_messages, "resyncs": st.resyncs, "replayed_batches": st.replayed_batches,
                     "converge_seconds": None if o.converge_seconds is None else round(o.converge_seconds, 3),
                     "complete": o.complete, "extra": o.extra, "missing": o.missing})
        r = rows[-1]
        print(f"{n:>7,} {r['send_seconds']:>7} {r['dropped']:>8,} {r['resyncs']:>8} {r['replayed_batches']:>9,} "
              f"{str(r['converge_seconds']):>11} {str(o.complete):>9} {o.extra:>6} {o.missing:>8}")
    print("\n2. replay burst of 10,000 batches beyond the ROUTER's send HWM (1,000) at start-up")
    print(f"{'policy (trial)':<26} {'holes':>6} {'replays':>8} {'unrecovered':>12} {'converge s':>11} {'complete':>9} "
          f"{'extra':>6} {'missing':>8}")
    trials = [(name, retries, t) for t in range(3) for name, retries in
              (("ask again (kvindex)", None), ("hole taken as lost", 0))]  # interleaved, same seeds
    for name, retries, t in trials:
        o = replay_burst(10_000, block_size=128, hole_retries=retries, replay_timeout=2.0, timeout=300, seed=4 + t)
        st = o.stats
        rows.append({"scenario": "replay_burst", "policy": name, "trial": t, "batches": 10_000,
                     "holes": st.replay_holes,
                     "replay_requests": st.replay_requests, "gaps_unrecovered": st.gaps_unrecovered,
                     "converge_seconds": None if o.converge_seconds is None else round(o.converge_seconds, 3),
                     "complete": o.complete, "extra": o.extra, "missing": o.missing})
        r = rows[-1]
        print(f"{name + f' ({t})':<26} {r['holes']:>6} {r['replay_requests']:>8} {r['gaps_unrecovered']:>12} "
              f"{str(r['converge_seconds']):>11} {str(o.complete):>9} {o.extra:>6} {o.missing:>8}")
    out = ROOT / "bench" / "out"
    out.mkdir(parents=True, exist_ok=True)
    (out / "overload.json").write_text(json.dumps(rows, indent=2))
    print(f"wrote {out / 'overload.json'}")


if __name__ == "__main__":
    main()
