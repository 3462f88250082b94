"""Where the reference router's warm turn goes, without HTTP: body fields -> tokens -> decision.

Builds the router (examples/router, the library tokenizer, two pods with no
KV events) in this process and feeds it a conversation's next turns as raw
request bytes, as its handler gets them, timing each step per turn
(milliseconds, median): decoding every field but the messages
(``decode_all_but_messages``), the warm tokenization
(``RequestTokenizer.tokenize_warm``) and the decision (``Router.choose``:
the turn's keys, the score, the metrics). ``--detail`` also times the
tokenizer's and the keys' inner steps (each wrapped with a timer, which adds
about a microsecond a call). The previous turn's result is dropped before the
next, as the router's handler drops it. The HTTP side (aiohttp's server and
client) is bench/bench_router_overhead.py's. Run pinned:
``taskset -c 1 python bench/profile_warm_turn.py [--tokens 100000] [--turns 200] [--detail]``.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import json
import random
import statistics
import sys
import tempfile
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench.bench_router_overhead import MODEL, TURNS  # noqa: E402
from bench.bench_tokenize import WORDS, conversation, tokenizer_dir  # noqa: E402

CHAT = "/v1/chat/completions"
TIMES: dict[str, list[float]] = defaultdict(list)


def timed(owner: Any, name: str) -> None:
    """Replace ``owner.name`` with a wrapper that records each call's time in :data:`TIMES`."""
    inner: Callable[..., Any] = getattr(owner, name)
    label = f"{getattr(owner, '__name__', owner)}.{name}"

    @functools.wraps(inner)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        t0 = time.perf_counter()
        try:
            return inner(*args, **kwargs)
        finally:
            TIMES[label].append(1000 * (time.perf_counter() - t0))

    setattr(owner, name, wrapper)


def time_inner_steps() -> None:
    """Wrap the steps of a warm turn that are worth seeing one by one."""
    import examples.router.app as app
    from kvindex.facade.indexer import Indexer
    from kvindex.keys import TokenProcessor
    from kvindex.tokenize.prefix_cache import PrefixCache
    from kvindex.tokenize.render_cache import RenderCache
    from kvindex.tokenize.tokenizer import RequestTokenizer

    for owner, name in ((RenderCache, "_render_warm_json"), (RenderCache, "_middle"),
                        (RequestTokenizer, "_chat_text"), (PrefixCache, "encode_memo"),
                        (PrefixCache, "_encode_from"), (PrefixCache, "_best_cut"), (PrefixCache, "_store"),
                        (app, "turn_request_keys"), (TokenProcessor, "_continue_keys"), (Indexer, "score")):
        timed(owner, name)


async def run(tokens: int, turns: int) -> dict[str, float]:
    """Median milliseconds per step over ``turns`` warm turns of a ~``tokens``-token conversation."""
    from examples.router.app import EngineSpec, RouterConfig, TokenizerSpec
    from examples.router.bodies import decode_all_but_messages
    from examples.router.serve import RunningRouter

    tok_dir = tokenizer_dir(Path.home() / ".cache" / "kvindex" / "models" / MODEL, Path(tempfile.mkdtemp()) / "tok")
    engines = [EngineSpec(pod=p, url="http://127.0.0.1:9", endpoint=f"tcp://127.0.0.1:{1 + i}")
               for i, p in enumerate(("pod-a", "pod-b"))]
    config = RouterConfig(engines=engines, model=MODEL, port=0, load_interval=3600.0,
                          tokenizer=TokenizerSpec(model_dir=str(tok_dir)))
    steps: dict[str, list[float]] = {"fields": [], "tokenize_warm": [], "choose": [], "turn": []}
    async with RunningRouter(config) as rr:
        router, tok = rr.router, rr.router.tokenizer
        assert tok is not None
        msgs = conversation(random.Random(tokens), tok, tokens)
        rng = random.Random(1)
        for run_ in range(max(1, turns // TURNS)):
            conv = [{**msgs[0], "content": f"run {run_} " + msgs[0]["content"]}, *msgs[1:]]
            raw = json.dumps({"model": MODEL, "messages": conv}).encode()
            ids, source, local = await router._prompt_ids(CHAT, json.loads(raw), raw)
            router.finish(router.choose(CHAT, ids, source, local=local), 200, 0.0)
            del ids, local
            for i in range(TURNS):
                conv = conv + [{"role": "assistant", "content": f"answer {i}"},
                               {"role": "user", "content": " ".join(rng.choice(WORDS) for _ in range(20))}]
                raw = json.dumps({"model": MODEL, "messages": conv}).encode()
                t0 = time.perf_counter()
                split = decode_all_but_messages(raw)
                assert split is not None
                t1 = time.perf_counter()
                warm = tok.tokenize_warm(CHAT, split[0], raw=raw, messages_json=split[1])
                assert warm is not None and warm.exact, "not a warm turn"
                t2 = time.perf_counter()
                decision = router.choose(CHAT, warm.token_ids, "local", local=warm)
                t3 = time.perf_counter()
                router.finish(decision, 200, 0.0)
                del warm, decision, split  # as the handler drops them
                for k, dt in zip(steps, (t1 - t0, t2 - t1, t3 - t2, t3 - t0)):
                    steps[k].append(1000 * dt)
    return {k: statistics.median(v) for k, v in steps.items()}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, default=100_000, help="about this many prompt tokens")
    p.add_argument("--turns", type=int, default=200, help="warm turns timed")
    p.add_argument("--detail", action="store_true", help="also time the inner steps")
    args = p.parse_args()
    if args.detail:
        time_inner_steps()
    medians = asyncio.run(run(args.tokens, args.turns))
    print(time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), f"~{args.tokens} tokens, {args.turns} warm turns,",
          "median ms per turn")
    for k, v in medians.items():
        print(f"  {k:<40} {v:8.3f}")
    for label, xs in sorted(TIMES.items()):
        print(f"  {label:<40} {statistics.median(xs):8.3f}  ({len(xs)} calls)")


if __name__ == "__main__":
    main()
