"""HealingPolicy over real ZMQ: simulated vLLM engines publish before the index listens, then heal.

The oracle is the engine's own cache (``SimEngine.cached_blocks``): after the
router joins late, the index misses blocks the engine holds; requests sent
with ``kv_cache_report_mode: "full"`` make the engine re-announce its reused
prefixes (as vLLM's ``get_computed_blocks`` does), and the index then holds
exactly the engine's cache.  The same requests without the full report leave
the index short.  Rig, prompts and views come from the write-path tests.
"""

from __future__ import annotations

import copy
from collections.abc import Callable

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvindex.facade.healing import FULL_REPORT_XARGS, HealingPolicy, with_full_report
from tests.test_zmq_writepath import BS, MODEL, MODES, Prompts, Rig, make_rig, wait_until  # noqa: F401 (fixture)

POD = "pod-a"


def send(rig: Rig, heal: HealingPolicy | None, e, tokens: list[int]) -> bool:
    """One request through a router that asks ``heal`` (None: never the full report); waits for its events."""
    full = heal is not None and heal.wants_full_report(e.pod, 0, MODEL)
    if full:
        heal.full_report_sent(e.pod, 0, MODEL)
    rig.served.setdefault(e.pod, []).append(tokens)
    e.serve(tokens, report_mode="full" if full else "incremental")
    rig.sync(e)
    if full:
        heal.full_report_done(e.pod, 0, MODEL)
    return full


def joined_late(rig: Rig, n: int = 12, seed: int = 11, **engine_kw) -> tuple[object, list[list[int]]]:
    """An engine that served ``n`` prompts (3-batch replay buffer) before the index subscribed."""
    e = rig.engine(POD, capacity=engine_kw.pop("capacity", 1000), buffer_steps=3, **engine_kw)
    prompts = Prompts(seed)
    served = [prompts.next() for _ in range(n)]
    for t in served:
        rig.serve(e, t)
    rig.subscribe([e])
    rig.sync(e)
    return e, served


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("healing", [True, False])
def test_a_late_join_heals_with_full_reports_only(make_rig: Callable[..., Rig], mode: str, healing: bool) -> None:
    rig = make_rig(mode)
    e, served = joined_late(rig)
    (state,) = rig.pool.completeness(POD)
    assert not state.complete  # the buffer no longer reached seq 0: the sequencer marks the late join
    engine = rig.engine_view(e)
    missing = set(engine) - set(rig.index_view(POD))
    assert missing and set(rig.index_view(POD)) <= set(engine)
    heal = HealingPolicy(rig.pool, quiet_requests=4, max_requests=100) if healing else None
    attached = rig.index.stats().orphans_attached
    sent = [send(rig, heal, e, t) for t in served]  # the same prompts again
    if not healing:
        assert not any(sent)
        assert set(engine) - set(rig.index_view(POD)) == missing  # incremental reports teach nothing
        return
    assert rig.index_view(POD) == rig.engine_view(e)  # every block the engine holds is known
    s = heal.stats()
    # each re-announced unknown block counted once; in chain mode the buffered batches whose parent
    # was unknown waited as orphans and attach under the re-announced parents (not re-announced)
    attached = rig.index.stats().orphans_attached - attached
    assert s.learned_blocks + attached == len(missing) and (attached == 0) == (mode == "compat")
    assert all(sent)  # ... and the discoveries kept it healing
    # the last 3 prompts' batches were in the replay buffer: their full reports taught nothing
    (h,) = heal.states()
    assert (h.healing, h.quiet, h.discoveries) == (True, 3, 9)
    assert rig.pool.observers_of(POD, 0, MODEL) == (heal._on_stored,)  # observed while healing
    assert send(rig, heal, e, served[0])  # known now: the 4th quiet request in a row ends the episode
    assert not heal.wants_full_report(POD, 0, MODEL)
    (h,) = heal.states()
    assert (h.healing, h.why, h.quiet, h.learned_blocks) == (False, "quiet", 4, s.learned_blocks)
    assert heal.stats().healed_quiet == 1 and heal.stats().healing_streams == 0
    assert rig.pool.observers_of(POD, 0, MODEL) == ()  # healed: batches apply whole again
    assert not send(rig, heal, e, served[5])
    assert rig.pool.stats().decode_errors == 0


def test_unrelated_prompts_end_by_the_cap(make_rig: Callable[..., Rig]) -> None:
    rig = make_rig("compat")
    e, _ = joined_late(rig, n=6)
    heal = HealingPolicy(rig.pool, quiet_requests=2, max_requests=5)
    fresh = Prompts(99)
    sent = [send(rig, heal, e, fresh.tokens(3 * BS + 5)) for _ in range(7)]
    # a prompt with no cached prefix is stored with a parent-nil BlockStored too: each counts as a
    # discovery, so the quiet rule never fires and the cap ends the episode after 5 full reports
    assert sent == [True] * 5 + [False] * 2
    (h,) = heal.states()
    assert (h.healing, h.why, h.sent, h.discoveries) == (False, "cap", 5, 4)  # the 5th ended it when sent
    assert heal.stats().healed_cap == 1


def test_complete_and_unseen_streams(make_rig: Callable[..., Rig]) -> None:
    rig = make_rig("compat")
    e = rig.engine(POD, capacity=100)
    rig.subscribe([e])
    rig.join(e)
    heal = HealingPolicy(rig.pool)
    assert not heal.wants_full_report("pod-unseen")  # published nothing: nothing to re-announce
    prompts = Prompts(5)
    for _ in range(3):
        assert not send(rig, heal, e, prompts.next())  # complete from seq 0: never asked
    assert [s.complete for s in rig.pool.completeness(POD)] == [True]
    assert not heal.wants_full_report(POD, 0, None) and not heal.wants_full_report(POD, 0, MODEL)
    assert not heal.wants_full_report(POD, 1, MODEL) and not heal.wants_full_report(POD, None, None)
    assert heal.states() == [] and heal.stats().episodes == 0
    assert rig.pool.observers_of(POD, 0, MODEL) == ()  # a complete stream keeps the whole-batch apply


def test_a_new_loss_starts_a_new_episode(make_rig: Callable[..., Rig]) -> None:
    rig = make_rig("compat")
    e, served = joined_late(rig, n=8)
    heal = HealingPolicy(rig.pool, quiet_requests=1, max_requests=50)
    for t in served + served[:1]:
        send(rig, heal, e, t)
    assert not heal.wants_full_report(POD, 0, MODEL)
    losses = rig.pool.completeness(POD)[0].losses
    e.drop_next(4)  # 4 lost batches, 3 buffered: an unrecoverable gap on an already incomplete stream
    prompts = Prompts(77)
    for _ in range(5):
        rig.serve(e, prompts.next())
    rig.sync(e)
    state = rig.pool.completeness(POD)[0]
    assert not state.complete and state.losses > losses
    assert heal.wants_full_report(POD, 0, MODEL)
    assert heal.stats().episodes == 2
    for t in served + rig.served[POD][-5:]:
        send(rig, heal, e, t)
    assert rig.index_view(POD) == rig.engine_view(e)


def test_a_failing_observer_is_counted_and_the_event_still_applies(make_rig: Callable[..., Rig]) -> None:
    rig = make_rig("compat")
    e = rig.engine(POD, capacity=100)
    rig.subscribe([e])
    rig.join(e)

    def boom(*_: object) -> None:
        raise RuntimeError("observer bug")

    rig.pool.add_store_observer(boom)
    send(rig, None, e, Prompts(3).next())
    assert rig.pool.stats().errors_by_kind.get("observer") == 1
    assert rig.index_view(POD) == rig.engine_view(e)
    rig.pool.remove_store_observer(boom)
    send(rig, None, e, Prompts(4).next())
    assert rig.pool.stats().errors_by_kind.get("observer") == 1


@pytest.mark.parametrize("window", [60.0, 0.0])
def test_a_full_report_opens_the_index_report_window(make_rig: Callable[..., Rig], window: float) -> None:
    """On a group-keeping index, each full-report request opens (or extends) its stream's report window."""
    rig = make_rig("compat")
    e, served = joined_late(rig)
    heal = HealingPolicy(rig.pool, report_window=window)
    assert send(rig, heal, e, served[0])
    streams = set(rig.index._groups.distrust)
    assert streams == ({(POD, 0, MODEL)} if window else set())
    with pytest.raises(ValueError):
        HealingPolicy(rig.pool, report_window=-1.0)


def test_policy_bounds_are_checked(make_rig: Callable[..., Rig]) -> None:
    rig = make_rig("compat")
    with pytest.raises(ValueError):
        HealingPolicy(rig.pool, quiet_requests=0)
    with pytest.raises(ValueError):
        HealingPolicy(rig.pool, quiet_requests=8, max_requests=4)
    heal = HealingPolicy(rig.pool)
    heal.close()
    assert rig.pool.store_observers == ()


json_scalars = st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=5)
json_values = st.recursive(json_scalars, lambda c: st.lists(c, max_size=3) | st.dictionaries(st.text(max_size=5), c, max_size=3), max_leaves=8)


@given(
    body=st.dictionaries(st.text(max_size=8), json_values, max_size=6),
    xargs=st.none() | st.dictionaries(st.text(max_size=8), json_values, max_size=4) | json_scalars,
)
def test_with_full_report_merges_and_never_drops_keys(body: dict, xargs: object) -> None:
    if xargs is not None or "vllm_xargs" in body:
        body = {**body, "vllm_xargs": xargs}
    before = copy.deepcopy(body)
    out = with_full_report(body)
    assert body == before  # the caller's body is not modified
    assert {k: v for k, v in out.items() if k != "vllm_xargs"} == {k: v for k, v in body.items() if k != "vllm_xargs"}
    given_xargs = body.get("vllm_xargs")
    if given_xargs is None or isinstance(given_xargs, dict):
        merged = out["vllm_xargs"]
        assert merged["kv_cache_report_mode"] == FULL_REPORT_XARGS["kv_cache_report_mode"]
        assert {k: v for k, v in merged.items() if k != "kv_cache_report_mode"} == {
            k: v for k, v in (given_xargs or {}).items() if k != "kv_cache_report_mode"
        }
    else:
        assert out == body  # not an object: left for the engine to reject


# ---------------------------------------------------------------- the reference router


class _HttpSimEngine:
    """An OpenAI-style HTTP front for a SimEngine: ``/v1/completions`` with token-id prompts serves
    them (honouring ``vllm_xargs.kv_cache_report_mode``) and records each body; ``/metrics`` answers
    an idle engine."""

    def __init__(self, engine) -> None:
        self.engine = engine
        self.bodies: list[dict] = []

    def app(self):
        from aiohttp import web

        async def completions(request: web.Request) -> web.Response:
            body = await request.json()
            self.bodies.append(body)
            mode = (body.get("vllm_xargs") or {}).get("kv_cache_report_mode", "incremental")
            hit = self.engine.serve(body["prompt"], report_mode=mode)
            return web.json_response({"choices": [{"text": "x"}], "usage": {"cached": hit}})

        async def metrics(_: web.Request) -> web.Response:
            return web.Response(text="vllm:num_requests_waiting 0\nvllm:num_requests_running 0\n")

        app = web.Application()
        app.router.add_post("/v1/completions", completions)
        app.router.add_get("/metrics", metrics)
        return app


@pytest.mark.parametrize("healing", [True, False])
def test_router_adds_the_full_report_while_healing(make_rig: Callable[..., Rig], healing: bool) -> None:
    import asyncio

    import aiohttp
    from aiohttp import web

    from examples.router.app import EngineSpec, RouterConfig
    from examples.router.serve import RunningRouter

    rig = make_rig("compat")
    e = rig.engine(POD, capacity=1000, buffer_steps=3)
    prompts = Prompts(21)
    served = [prompts.next() for _ in range(10)]
    for t in served:
        rig.serve(e, t)
    front = _HttpSimEngine(e)

    def applied(ix) -> int | None:
        return next((x.last_seq for x in ix.completeness(POD)), None)

    async def run() -> tuple[list[bool], str]:
        runner = web.AppRunner(front.app(), access_log=None)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        url = "http://%s:%d" % runner.addresses[0][:2]
        cfg = RouterConfig(
            engines=[EngineSpec(pod=POD, url=url, endpoint=e.endpoint, replay_endpoint=e.replay_endpoint)],
            model=MODEL, block_size=BS, port=0, healing=healing, heal_quiet_requests=3,
            indexer={"token_processor_config": {"algorithm": "vllm_sha256"}},
        )
        full: list[bool] = []
        try:
            async with RunningRouter(cfg) as rr, aiohttp.ClientSession() as s:
                ix = rr.router.indexer
                for t in served + served[:4]:
                    n = e.stats().next_seq  # the seq the engine publishes next, if it does
                    body = {"model": MODEL, "prompt": t, "max_tokens": 1, "vllm_xargs": {"client_key": 7}}
                    async with s.post(rr.url + "/v1/completions", json=body) as r:
                        assert r.status == 200
                    sent = front.bodies[-1]
                    assert sent["vllm_xargs"]["client_key"] == 7 and sent["prompt"] == t
                    full.append(sent["vllm_xargs"].get("kv_cache_report_mode") == "full")
                    if e.stats().next_seq > n:  # the engine published: wait until the index applied it
                        await asyncio.to_thread(wait_until, lambda: applied(ix) == n, f"seq {n} applied")
                async with s.get(rr.url + "/metrics") as r:
                    metrics = await r.text()
                known = set(ix.index.pod_keys(POD))
                assert (known == set(e.cached_blocks())) == healing  # compat keys: request key = engine key
        finally:
            await runner.cleanup()
        return full, metrics

    full, metrics = asyncio.run(run())
    if not healing:
        assert not any(full)
        return
    # 7 of the 10 prompts were cached before the router joined and outside the replay buffer: they
    # discover; the last 3 (buffered) and the repeats are quiet: 3 in a row end the episode.  The router
    # counts a request as ended when its answer is back, which may be before the engine's re-announce
    # of it is applied: the 7th discovery then lands during the 8th request and costs one more request.
    sent = sum(full)
    assert sent in (10, 11) and full == [True] * sent + [False] * (len(full) - sent), full
    assert f'kvindex_router_full_reports_total{{pod="{POD}"}} {sent}.0' in metrics


def test_router_command_line_and_config_healing_options() -> None:
    from examples.router.__main__ import build_config

    engine = ["--engine", "p@http://127.0.0.1:1=tcp://127.0.0.1:2"]
    assert build_config(engine).healing is True
    assert build_config([*engine, "--no-healing"]).healing is False
