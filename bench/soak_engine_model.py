"""Soak of the engine-model state machines: tests/test_engine_model.py run far harder than ``make test``.

Runs EngineMachine, OutageEngineMachine and ZmqEngineMachine (the hypothesis
state machines whose model is a set of vLLM engines: blocks, seqs, a replay
buffer on real ZMQ ROUTER sockets, restarts, and the faults listed in that
module) with many examples and long step sequences, on the python or native
index, with a chosen hypothesis seed.  A failure prints hypothesis' shrunk
reproduction (the steps) and exits non-zero; the run's example counts and
wall time go to stdout as one JSON line per machine.

Run one process at a time (it uses one core and real sockets):
``python bench/soak_engine_model.py --machine engine --index native --examples 2000 --steps 80 --seed 1``.
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

from hypothesis import HealthCheck, Phase, settings  # noqa: E402
from hypothesis.stateful import run_state_machine_as_test  # noqa: E402

from kvindex.reference import KVBlockIndex  # noqa: E402
from kvindex.native import NativeKVBlockIndex  # noqa: E402
from tests import test_engine_model as tem  # noqa: E402

MACHINES = {
    "engine": tem.EngineMachine,
    "outage": tem.OutageEngineMachine,
    "zmq": tem.ZmqEngineMachine,
}
INDEXES = {
    "python": lambda tp: KVBlockIndex(tp, capacity=1_000_000),
    "native": lambda tp: NativeKVBlockIndex(tp, capacity=1_000_000),
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--machine", choices=sorted(MACHINES), default="engine")
    ap.add_argument("--index", choices=sorted(INDEXES), default="native")
    ap.add_argument("--examples", type=int, default=1000)
    ap.add_argument("--steps", type=int, default=80)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--no-shrink", action="store_true",
        help="report the first failure as found (a timing-dependent failure may not replay while shrinking)",
    )
    args = ap.parse_args()
    logging.disable(logging.WARNING)
    examples = 0

    class Machine(MACHINES[args.machine]):  # type: ignore[misc, valid-type]
        index_factory = staticmethod(INDEXES[args.index])

        def __init__(self) -> None:
            nonlocal examples
            examples += 1
            super().__init__()

    Machine._hypothesis_internal_use_seed = args.seed  # what @seed sets; stateful runs read it from the class
    t0 = time.monotonic()
    ok = True
    try:
        run_state_machine_as_test(
            Machine,
            settings=settings(
                max_examples=args.examples, stateful_step_count=args.steps, deadline=None,
                suppress_health_check=list(HealthCheck), derandomize=False, database=None,
                phases=[Phase.generate] if args.no_shrink else list(Phase),
            ),
        )
    except BaseException as exc:  # noqa: BLE001 - report and exit non-zero
        ok = False
        import traceback

        traceback.print_exc()
        print(f"FAILED: {type(exc).__name__}: {exc}", flush=True)
    print(json.dumps({"machine": args.machine, "index": args.index, "seed": args.seed, "steps": args.steps,
                      "max_examples": args.examples, "machines_built": examples, "ok": ok,
                      "seconds": round(time.monotonic() - t0, 1)}), flush=True)
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
