"""Recompute-threshold advisor: when is pulling retained KV cheaper than recomputing it?

Pulling ``n`` tokens of KV costs ``latency + n * kv_bytes_per_token / bytes_per_s``
(one NIXL transfer); recomputing them costs ``n * prefill_s_per_token``.  The
pull wins once ``n`` exceeds the **break-even** token count

    n* = latency / (prefill_s_per_token - kv_bytes_per_token / bytes_per_s)

(infinite when moving a token's KV costs more than computing it).  The
recommended ``kv_recompute_threshold`` (vLLM 0.32 NixlConnector, tokens; the
engines and :class:`connector.planner.PDPlanner` must agree on it) is the
break-even times a margin (default 1.5: a pull also costs a handshake and
the decode pod's scheduling; a marginal pull is not worth the risk), rounded
up to whole blocks.

The transfer cost comes from measurements (``bench/bench_nixl.py`` measures a
NIXL READ between two processes): :func:`fit_transfer_cost` fits
``time = latency + bytes / bytes_per_s`` by least squares.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import msgspec
import numpy as np

__all__ = ["ModelKV", "TransferCost", "Advice", "fit_transfer_cost", "advise", "prefill_cost_per_token"]


class ModelKV(msgspec.Struct, frozen=True, kw_only=True):
    """A model's KV footprint per token.

    Fields:
        name: label.
        layers: attention layers holding KV.
        kv_heads: KV heads per layer (GQA); ignored when ``latent_dim`` is set.
        head_dim: per-head dimension; ignored when ``latent_dim`` is set.
        dtype_bytes: bytes per KV element (2 for bf16, 1 for fp8).
        latent_dim: for MLA models, the cached latent per token and layer
            (kv_lora_rank + rope dim), stored once (no separate K and V).
    """

    name: str
    layers: int
    kv_heads: int = 0
    head_dim: int = 0
    dtype_bytes: float = 2.0
    latent_dim: int | None = None

    @property
    def kv_bytes_per_token(self) -> float:
        """Bytes of KV one token takes across all layers: 2 (K and V) x layers x heads x dim x bytes, or layers x latent x bytes."""
        if self.latent_dim is not None:
            return float(self.layers * self.latent_dim * self.dtype_bytes)
        return float(2 * self.layers * self.kv_heads * self.head_dim * self.dtype_bytes)


class TransferCost(msgspec.Struct, frozen=True, kw_only=True):
    """Cost of one KV transfer: ``latency_s + bytes / bytes_per_s`` seconds."""

    latency_s: float
    bytes_per_s: float

    def seconds(self, nbytes: float) -> float:
        """Predicted transfer time of ``nbytes`` (s)."""
        return self.latency_s + nbytes / self.bytes_per_s


class Advice(msgspec.Struct, frozen=True, kw_only=True):
    """The advisor's answer.

    Fields:
        model: the model's label.
        kv_bytes_per_token: bytes.
        prefill_s_per_token: recompute cost (s/token).
        transfer_s_per_token: ``kv_bytes_per_token / bytes_per_s`` (s/token).
        latency_s: fixed transfer cost (s).
        break_even_tokens: ``n*`` (inf when pulling never pays).
        recommended_threshold: tokens (a multiple of the block size), or None
            when pulling never pays (then turn bidirectional pulls off).
    """

    model: str
    kv_bytes_per_token: float
    prefill_s_per_token: float
    transfer_s_per_token: float
    latency_s: float
    break_even_tokens: float
    recommended_threshold: int | None


def fit_transfer_cost(nbytes: Sequence[float], seconds: Sequence[float]) -> TransferCost:
    """Fit ``seconds = latency + nbytes / bytes_per_s`` by least squares on relative errors.

    numpy.polyfit of degree 1 with weights ``1 / seconds``, so that small
    transfers (which carry the latency) count as much as large ones; a
    negative intercept is clipped to 0.

    Raises:
        ValueError: fewer than two distinct sizes, a non-positive time, or a
            non-positive fitted bandwidth.
    """
    x = np.asarray(nbytes, dtype=float)
    y = np.asarray(seconds, dtype=float)
    if x.shape != y.shape or len(np.unique(x)) < 2:
        raise ValueError("need at least two distinct transfer sizes")
    if not np.all(y > 0):
        raise ValueError("transfer times must be > 0")
    slope, intercept = np.polyfit(x, y, 1, w=1.0 / y)
    if not slope > 0:
        raise ValueError(f"fitted time per byte {slope} is not positive")
    return TransferCost(latency_s=max(0.0, float(intercept)), bytes_per_s=float(1.0 / slope))


def prefill_cost_per_token(tokens_a: int, ttft_a_s: float, tokens_b: int, ttft_b_s: float) -> float:
    """Marginal prefill cost (s/token) from two TTFT measurements at two prompt lengths.

    Raises:
        ValueError: equal lengths or a non-positive slope.
    """
    if tokens_a == tokens_b:
        raise ValueError("two different prompt lengths needed")
    c = (ttft_b_s - ttft_a_s) / (tokens_b - tokens_a)
    if not c > 0:
        raise ValueError(f"non-positive prefill cost per token {c}")
    return c


def advise(
    model: ModelKV,
    prefill_s_per_token: float,
    transfer: TransferCost,
    *,
    block_size: int = 16,
    margin: float = 1.5,
) -> Advice:
    """Break-even tokens and a recommended ``kv_recompute_threshold`` for ``model``.

    Raises:
        ValueError: non-positive prefill cost, block size or margin < 1.
    """
    if not prefill_s_per_token > 0 or block_size < 1 or margin < 1:
        raise ValueError("prefill_s_per_token > 0, block_size >= 1 and margin >= 1 required")
    per_tok = model.kv_bytes_per_token / transfer.bytes_per_s
    gain = prefill_s_per_token - per_tok
    if gain <= 0:
        n_star = math.inf
        rec = None
    else:
        n_star = transfer.latency_s / gain
        rec = max(block_size, math.ceil(n_star * margin / block_size) * block_size)
    return Advice(
        model=model.name,
        kv_bytes_per_token=model.kv_bytes_per_token,
        prefill_s_per_token=prefill_s_per_token,
        transfer_s_per_token=per_tok,
        latency_s=transfer.latency_s,
        break_even_tokens=n_star,
        recommended_threshold=rec,
    )
