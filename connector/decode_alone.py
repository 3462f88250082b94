"""Conditional disaggregation: when the decode pod D serves a turn alone, without a prefill leg.

In a multi-turn conversation D already holds the history's KV (its retained
blocks stay in its prefix cache, and D's KV events put them in the index), so
a turn that adds a few tokens leaves D little to prefill.  Through a prefill
pod P the same turn costs a queue on P, a pull of D's blocks into P and a
pull of P's blocks back into D; alone, D computes only what its prefix cache
lacks.  :func:`decode_alone_verdict` weighs the predicted tokens of each path
(:class:`PathTokens`, from the index) against a :class:`DecodeAloneRule`.

What D computes alone delays the decode steps of the requests D is running
(vLLM mixes prefill chunks into decode steps), hence the bound on the tokens
and the checks of D's load.
"""

from __future__ import annotations

import msgspec

from scorer.load import LoadSnapshot

__all__ = ["DecodeAloneRule", "PathTokens", "decode_alone_params", "decode_alone_verdict"]


class DecodeAloneRule(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """When a turn skips P (all must hold).

    Fields:
        max_tokens: D's predicted prefill (prompt tokens - D's prefix hit in
            the index) is at most this many tokens.  Default 512: in the
            seed-000 benchmark simulation (docs/benchmarks.md) every turn
            after the first leaves D 150-165 tokens and gains from skipping
            P at every context length; 256-2,048 make the same choices, while
            from 4,096 whole first prompts land in D's decode steps (worst
            step 56-138 ms against 10-12 ms) for no TTFT gain.
        max_waiting: D's queue (``vllm:num_requests_waiting``) is at most this
            (default 0: D schedules everything it has).
        max_kv_usage: D's ``vllm:kv_cache_usage_perc`` is below this (default
            0.9: D is not close to preempting).
        max_pending_tokens: when D still has prompt tokens to prefill that
            the router sent it (``LoadSnapshot.prefill_tokens``, when the
            router tracks it), those plus this turn's are at most this many
            (default 1,024: two short turns at once, not a pile-up of them).

    Raises:
        ValueError: a negative bound, or ``max_kv_usage`` outside (0, 1].
    """

    max_tokens: int = 512
    max_waiting: float = 0.0
    max_kv_usage: float = 0.9
    max_pending_tokens: int = 1024

    def __post_init__(self) -> None:
        if self.max_tokens < 0 or self.max_waiting < 0 or self.max_pending_tokens < 0:
            raise ValueError(f"decode-alone bounds must be >= 0: {self}")
        if not 0.0 < self.max_kv_usage <= 1.0:
            raise ValueError(f"max_kv_usage must be in (0, 1], got {self.max_kv_usage}")


class PathTokens(msgspec.Struct, frozen=True):
    """Predicted prompt tokens left to compute for one turn on each path.

    decode_alone: prompt - D's prefix hit (D's own cache, retained blocks included).
    pull: prompt - P's local hit - what P would pull from D (= recompute when
        no pull is possible).
    recompute: prompt - P's local hit.
    """

    decode_alone: int
    pull: int
    recompute: int

    def describe(self) -> str:
        return f"left to prefill: D alone {self.decode_alone}, via P with pull {self.pull}, " \
            f"via P recomputing {self.recompute}"


def decode_alone_verdict(rule: DecodeAloneRule, paths: PathTokens, load: LoadSnapshot | None) -> tuple[bool, str]:
    """(True when D serves the turn alone, why).  ``load``: D's (None: idle)."""
    n = paths.decode_alone
    if n > rule.max_tokens:
        return False, f"D would prefill {n} > {rule.max_tokens} tokens"
    if load is not None:
        if load.waiting > rule.max_waiting:
            return False, f"D is busy: {load.waiting:g} waiting > {rule.max_waiting:g}"
        if load.kv_usage >= rule.max_kv_usage:
            return False, f"D is busy: KV usage {load.kv_usage:.2f} >= {rule.max_kv_usage:.2f}"
        pending = load.prefill_tokens
        if pending is not None and pending > 0 and pending + n > rule.max_pending_tokens:
            return False, f"D is busy: {pending} pending + {n} prompt tokens > {rule.max_pending_tokens}"
    return True, f"D would prefill {n} <= {rule.max_tokens} tokens and is not busy"


def decode_alone_params() -> dict[str, bool]:
    """D's ``kv_transfer_params`` for a turn it serves alone: nothing to load, but keep the KV for the next turn.

    A non-empty dict with both flags false: vLLM 0.32's NixlConnector loads
    nothing for it (``get_num_new_matched_tokens`` needs ``do_remote_prefill``
    or the ``remote_*`` fields), and when the request finishes a bidirectional
    D treats it as a decode request (``request_finished``: not
    ``do_remote_decode``), retains its blocks and answers with the params of
    the next turn.  No ``remote_*`` field: nothing of another pod reaches D.
    """
    return {"do_remote_prefill": False, "do_remote_decode": False}
