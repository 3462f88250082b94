"""kvindex.AsyncIndexer: the asyncio face starts, waits and stops without blocking the loop."""

from __future__ import annotations

import asyncio

from kvevents.testing import FakeEngine
from kvindex import AsyncIndexer, Config


def test_async_start_flush_score_stop() -> None:
    async def main() -> tuple[str, int, int]:
        with FakeEngine(pod="pod-a", model="m") as engine:
            engine.serve(list(range(256)))
            cfg = Config.from_dict({"model_name": "m", "kv_events_config": {"engines": [
                {"pod": "pod-a", "endpoint": engine.endpoint, "replay_endpoint": engine.replay_endpoint}]}})
            ticks = 0

            async def ticker() -> None:
                nonlocal ticks
                while True:
                    ticks += 1
                    await asyncio.sleep(0.001)

            t = asyncio.create_task(ticker())
            async with AsyncIndexer(cfg) as ix:
                assert await ix.flush(timeout=10.0)
                res = ix.score(list(range(300)), pods=["pod-a", "pod-b"])
                keys = ix.indexer.request_keys(list(range(300)))
                assert ix.score(list(range(300)), pods=["pod-a", "pod-b"], keys=keys) == res  # keys given
                routed = ix.route(list(range(300)), pods=["pod-a"], keys=keys)
                ix.request_finished(routed.pod)
            t.cancel()
            return res.pod, res.prefix["pod-a"].matched_tokens, ticks

    pod, matched, ticks = asyncio.run(main())
    assert pod == "pod-a" and matched == 256
    assert ticks > 0  # the loop kept running while the indexer started, flushed and stopped
