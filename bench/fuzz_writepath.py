"""Fuzz of the write path at volume: bad messages through the real Subscriber and EventPool over real ZMQ.

Model engines (tests/engine_model.py) publish valid batches on their own PUB
sockets and serve replays on real ROUTER sockets; between their batches a
plain seeded generator (tests/fuzzrig.py ``random_bad``) sends bad messages:
random bytes, msgpack of wrong shapes, truncated payloads, array headers
claiming 2**32 items, sequence frames of the wrong length, wrong frame
counts, batches whose events are all malformed (block hashes of every
msgpack type, 10k-100k-item hash arrays, token counts that disagree) or of
unknown types, seq jumps (up to 2**64 - 2) and repeated seqs.

Checked at every checkpoint (and the run fails otherwise): no exception
escaped a worker (no ``internal`` error, every thread alive); every bad
message was counted (the errors by kind equal what the decoder says of each
bad payload; unconfirmed + duplicates + stale equal the jumps and repeats);
every stream of the index holds exactly its engine's block copies (the
engines apply only their valid batches: the oracle).

Run: ``python bench/fuzz_writepath.py [--messages N] [--seed S]`` (``make fuzz``;
N bad messages, default 100,000).  Writes bench/out/fuzz_writepath.json.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.fuzzrig import FuzzRig, random_bad, valid_payload_of  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--messages", type=int, default=100_000, help="bad messages to send")
    ap.add_argument("--seed", type=int, default=11)
    ap.add_argument("--engines", type=int, default=4)
    ap.add_argument("--valid-per-bad", type=float, default=0.5, help="valid batches per bad message")
    ap.add_argument("--checkpoint", type=int, default=10_000, help="bad messages between full checks")
    ap.add_argument("--backend", default="native")
    args = ap.parse_args()
    logging.disable(logging.WARNING)  # every bad message is logged (rate limited); the counters say it all

    rig = FuzzRig(seed=args.seed, n_engines=args.engines, backend=args.backend)
    rnd = rig.rnd
    base = rig.reset_expectations()
    bad = valid = checks = 0
    t0 = time.perf_counter()
    try:
        while bad < args.messages:
            if rnd.random() < args.valid_per_bad / (1 + args.valid_per_bad):
                rig.valid()
                valid += 1
            else:
                i = rnd.randrange(len(rig.engines))
                e = rig.engines[i]
                if rig.bad(random_bad(rnd, lambda: valid_payload_of(e, rnd)), i):
                    bad += 1
                    if bad % 500 == 0:
                        rig.settle()  # pace: the PUB sockets never drop, the pool queues never fill
                    if bad % args.checkpoint == 0:
                        rig.finish()
                        rig.check(base)
                        checks += 1
                        print(f"  {bad:,} bad messages: checked ({time.perf_counter() - t0:.0f} s)", flush=True)
        rig.finish()
        st = rig.check(base)
        checks += 1
        elapsed = time.perf_counter() - t0
    finally:
        rig.close()
    errors = {k: v - base.errors_by_kind.get(k, 0) for k, v in sorted(st.errors_by_kind.items())}
    result = {
        "seed": args.seed,
        "engines": args.engines,
        "bad_messages": bad,
        "bad_by_class": dict(sorted(rig.sent_by_class.items())),
        "valid_batches": rig.valid_batches,
        "messages_sent": rig.sent,
        "messages_received": rig.sub.received,
        "errors_by_kind": {k: v for k, v in errors.items() if v},
        "unconfirmed": st.unconfirmed - base.unconfirmed,
        "duplicates": st.duplicates - base.duplicates,
        "stale": st.stale - base.stale,
        "replay_requests": st.replay_requests - base.replay_requests,
        "exceptions_escaped": 0,
        "index_divergence": 0,
        "checks": checks,
        "seconds": round(elapsed, 1),
        "messages_per_s": round(rig.sent / elapsed),
    }
    print(f"fuzz: {bad:,} bad messages ({', '.join(f'{k} {v:,}' for k, v in result['bad_by_class'].items())}) "
          f"among {rig.valid_batches:,} valid batches, {rig.sent:,} messages over real ZMQ, seed {args.seed}")
    print("errors counted by kind: " + ", ".join(f"{k} {v:,}" for k, v in result["errors_by_kind"].items()))
    print(f"jumps and repeats skipped: unconfirmed {result['unconfirmed']:,}, duplicates {result['duplicates']:,}, "
          f"stale {result['stale']:,} ({result['replay_requests']:,} replays asked)")
    print(f"0 exceptions escaped, 0 index divergence from the engines in {checks} checks; "
          f"{elapsed:.0f} s, {result['messages_per_s']:,} messages/s")
    out = ROOT / "bench" / "out"
    out.mkdir(parents=True, exist_ok=True)
    (out / "fuzz_writepath.json").write_text(json.dumps(result, indent=2))
    print(f"wrote {out / 'fuzz_writepath.json'}")


if __name__ == "__main__":
    main()
