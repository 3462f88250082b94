"""Recompute-threshold advisor: break-even against a brute-force search over token counts."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from connector.advisor import ModelKV, TransferCost, advise, fit_transfer_cost, prefill_cost_per_token


def test_kv_bytes_per_token():
    qwen = ModelKV(name="qwen3-32b-like", layers=64, kv_heads=8, head_dim=128, dtype_bytes=2)
    assert qwen.kv_bytes_per_token == 2 * 64 * 8 * 128 * 2 == 262144
    mla = ModelKV(name="mla", layers=10, latent_dim=576, dtype_bytes=1)
    assert mla.kv_bytes_per_token == 5760


@given(
    st.floats(1e-4, 0.1),  # latency s
    st.floats(1e8, 1e11),  # bytes/s
    st.floats(1e-6, 1e-3),  # prefill s/token
    st.integers(1000, 500_000),  # kv bytes/token
)
@settings(max_examples=300)
def test_break_even_matches_brute_force(lat, bw, c, kvb):
    m = ModelKV(name="m", layers=1, latent_dim=kvb, dtype_bytes=1)
    a = advise(m, c, TransferCost(latency_s=lat, bytes_per_s=bw), block_size=16)

    def pull_wins(n: int) -> bool:
        return lat + n * kvb / bw < n * c

    if a.recommended_threshold is None:
        assert math.isinf(a.break_even_tokens)
        assert not pull_wins(10**9)
    else:
        n = math.floor(a.break_even_tokens)
        assert not pull_wins(max(n - 1, 0)) or n == 0
        assert pull_wins(n + 2)
        assert a.recommended_threshold % 16 == 0 and a.recommended_threshold >= a.break_even_tokens


def test_fit_recovers_a_line():
    sizes = [1e5, 1e6, 4e6, 1.6e7]
    secs = [0.002 + s / 5e9 for s in sizes]
    t = fit_transfer_cost(sizes, secs)
    assert t.latency_s == pytest.approx(0.002, rel=1e-6) and t.bytes_per_s == pytest.approx(5e9, rel=1e-6)
    with pytest.raises(ValueError):
        fit_transfer_cost([1, 1], [1, 2])
    assert prefill_cost_per_token(2000, 0.158, 24000, 0.778) == pytest.approx(0.62 / 22000)
    with pytest.raises(ValueError):
        prefill_cost_per_token(5, 1, 5, 2)
