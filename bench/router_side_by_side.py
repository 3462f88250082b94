"""The reference router's warm-turn overhead, two or more source trees side by side.

Each tree (a git worktree, with the Python that runs it) gets its own rig of
bench/bench_router_overhead.py (fake engine and routers, in its processes);
every warm turn (the library tokenizer) goes to all rigs in rotating order.
Per tree and size: the added latency (router - direct round trip) and the
router process's CPU time per request from /proc/<pid>/task/*/schedstat, which
other jobs' preemption does not inflate. The first tree is the base of the
ratios.

Run: ``TREES='{"base": ["python", "/path/base"], "after": ["python", "/path/after"]}'
taskset -c 1 python bench/router_side_by_side.py 8000,100000 200``
"""
import glob
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import bench.bench_router_overhead as bro  # noqa: E402
from bench.bench_tokenize import WORDS, conversation, tokenizer_dir  # noqa: E402


def starter(py: str, tree: str):  # type: ignore[no-untyped-def]
    """A ``Rig._start`` that runs ``tree``'s bench processes with ``py``."""
    def _start(self, role, tok_dir, engine_port, loop):  # type: ignore[no-untyped-def]
        proc = subprocess.Popen([py, f"{tree}/bench/bench_router_overhead.py", "--serve", role, "--tok-dir",
                                 str(tok_dir), "--engine-port", str(engine_port), "--router-loop", loop],
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                                env={**os.environ, "PYTHONPATH": tree})
        self._procs.append(proc)
        return {k: v if k == "loop" else int(v) for k, v in json.loads(proc.stdout.readline()).items()}
    return _start


def cpu_ms(pid: int) -> float:
    """CPU time of every thread of ``pid`` so far, milliseconds."""
    t = 0
    for f in glob.glob(f"/proc/{pid}/task/*/schedstat"):
        try:
            t += int(open(f).read().split()[0])
        except OSError:
            pass
    return t / 1e6


def measure(rigs: dict[str, bro.Rig], pids: dict[str, int], size: int, reps: int
            ) -> dict[str, dict[str, list[float]]]:
    """Per rig: added latencies and router CPU of ``reps`` warm turns at about ``size`` tokens."""
    msgs = conversation(random.Random(size), next(iter(rigs.values())).tokenizer, size)
    rng = random.Random(size)
    data: dict[str, dict[str, list[float]]] = {n: {"added": [], "cpu": []} for n in rigs}
    names = list(rigs)
    for run in range(reps // bro.TURNS):
        conv = [{**msgs[0], "content": f"w {run} " + msgs[0]["content"]}, *msgs[1:]]
        for r in rigs.values():
            r.overhead("library", {"messages": conv})
        for i in range(bro.TURNS):
            conv = conv + [{"role": "assistant", "content": f"answer {i}"},
                           {"role": "user", "content": " ".join(rng.choice(WORDS) for _ in range(20))}]
            k = (run * bro.TURNS + i) % len(names)
            for n in names[k:] + names[:k]:
                r = rigs[n]
                c0 = cpu_ms(pids[n])
                routed, direct = r.overhead("library", {"messages": conv})
                data[n]["cpu"].append(cpu_ms(pids[n]) - c0)
                data[n]["added"].append(1000 * (routed - direct))
    return data


def main() -> None:
    sizes = [int(x) for x in sys.argv[1].split(",")]
    reps = int(sys.argv[2])
    trees = json.loads(os.environ["TREES"])
    tok = tokenizer_dir(Path.home() / ".cache" / "kvindex" / "models" / bro.MODEL, Path(tempfile.mkdtemp()))
    rigs: dict[str, bro.Rig] = {}
    pids: dict[str, int] = {}
    for name, (py, tree) in trees.items():
        bro.Rig._start = starter(py, tree)  # type: ignore[method-assign]
        rigs[name] = bro.Rig(tok)
        pids[name] = rigs[name]._procs[1].pid  # the routers' process
    print(time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "load", os.getloadavg()[0],
          "cpus", sorted(os.sched_getaffinity(0)), flush=True)
    try:
        for size in sizes:
            res: dict[str, dict[str, float]] = {}
            for n, d in measure(rigs, pids, size, reps).items():
                a = sorted(d["added"])
                res[n] = {"p50": statistics.median(a), "p99": a[min(len(a) - 1, int(0.99 * len(a)))],
                          "cpu_p50": statistics.median(d["cpu"]), "cpu_mean": statistics.fmean(d["cpu"])}
                print(f"{size:>7} {n:>6} added p50 {res[n]['p50']:.3f} p99 {res[n]['p99']:.3f} ms | router CPU "
                      f"p50 {res[n]['cpu_p50']:.3f} mean {res[n]['cpu_mean']:.3f} ms", flush=True)
            base = next(iter(res))
            for n in list(res)[1:]:
                print(f"{size:>7} ratio {n}/{base}: p50 {res[n]['p50'] / res[base]['p50']:.3f} "
                      f"cpu_p50 {res[n]['cpu_p50'] / res[base]['cpu_p50']:.3f}", flush=True)
    finally:
        for r in rigs.values():
            r.close()
    print("load end", os.getloadavg()[0])


if __name__ == "__main__":
    main()
