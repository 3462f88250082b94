"""The router-overhead bench's measuring function runs end to end on a tiny prompt (no timing asserts)."""

from __future__ import annotations

import math
from pathlib import Path

import transformers  # noqa: E402,F401  (the extra kvindex[tokenize]; make test installs it)

from bench.bench_router_overhead import MODES, Rig, fmt_row, proxy_floor, run_sizes  # noqa: E402
from tests.tokenize_model import make_tokenizer_dir  # noqa: E402


def test_the_bench_measures_both_token_sources(tmp_path: Path) -> None:
    rig = Rig(make_tokenizer_dir(tmp_path / "tok"))
    try:
        rows = run_sizes(rig, (300,), reps=10, cold_reps=2)
        floor = proxy_floor(rig, 3)
        sources = {m: {d["token_source"] for d in rig.decisions(m)} for m in MODES}
    finally:
        rig.close()
    assert floor["n"] == 3 and math.isfinite(floor["p50_ms"])
    assert [r["mode"] for r in rows] == list(MODES)
    assert sources == {"library": {"local", "token_ids"}, "whole-render": {"local"}, "/tokenize": {"tokenize"}}
    for r in rows:
        assert r["tokens"] >= 300
        assert r["single"]["n"] == 2 and r["multi"]["n"] == 10
        for part in ("single", "multi"):
            assert all(math.isfinite(r[part][k]) for k in ("p50_ms", "p99_ms", "direct_p50_ms"))
            assert r[part]["direct_p50_ms"] > 0
        assert str(r["tokens"]) in fmt_row(r)
