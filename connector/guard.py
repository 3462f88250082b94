"""The prompt-extends-retained check: never let P load KV computed for other tokens.

vLLM 0.32's NixlConnector trusts that a next-turn prompt starts with exactly
the tokens whose KV the decode pod retained: the prefill pod loads
``min(remote_num_tokens, prompt tokens)`` tokens of remote KV without looking
at them (vllm/distributed/kv_transfer/kv_connector/v1/nixl_connector.py; vLLM
issue #43094 shows a client that strips reasoning from the history getting
silently wrong answers).  :func:`clip_to_prompt` compares the new prompt with
the retained tokens and keeps only what matches:

- Block ``i`` of every KV-cache group holds tokens
  ``[i*block_size, (i+1)*block_size)`` of the retained sequence.
- When the prompt starts with all ``remote_num_tokens`` retained tokens (and
  the request keys of their whole blocks agree, so the key scope - model,
  LoRA, cache salt - is the same), the params go out unchanged.
- Otherwise they are clipped to the longest common *whole-block* prefix ``k``:
  ``remote_num_tokens = k * block_size`` and each group's
  ``remote_block_ids[:k]``.  ``k = 0`` means no remote params at all.
- Hybrid models: a group naming fewer blocks than the retained tokens fill is
  a *tail* group (vLLM 0.32's NixlConnector sends a sliding-window group's
  in-window tail and a Mamba group's state slot only:
  nixl/base_scheduler.py ``get_exchange_clipped_blocks``).  Its blocks hold
  the state at the end of the retained sequence, so they can be reused only
  whole: with a tail group, anything short of the full extension sends no
  remote params.

The result never names a block holding a token that differs from the prompt's
token at the same position (property-tested in tests/test_connector_guard.py).
"""

from __future__ import annotations

from collections.abc import Sequence

import msgspec
import numpy as np

from connector.params import RemoteKVParams

__all__ = ["GuardResult", "common_prefix_len", "clip_to_prompt"]


class GuardResult(msgspec.Struct, frozen=True, kw_only=True):
    """Outcome of :func:`clip_to_prompt`.

    Fields:
        params: the params to send to P (clipped or unchanged), or None.
        common_tokens: length of the common token prefix of the retained
            tokens and the prompt (capped at the retained length).
        reusable_tokens: ``params.remote_num_tokens`` (0 when params is None).
        blocks: block ids kept per group (0 when params is None).
        clipped: True when the params were cut (or dropped) by the check.
        reason: one line for the explanation.
    """

    params: RemoteKVParams | None
    common_tokens: int
    reusable_tokens: int
    blocks: int
    clipped: bool
    reason: str


def common_prefix_len(a: Sequence[int] | np.ndarray, b: Sequence[int] | np.ndarray) -> int:
    """Length of the longest common prefix of two token (or key) sequences."""
    n = min(len(a), len(b))
    if n == 0:
        return 0
    x = np.asarray(a[:n], dtype=np.uint64) if not isinstance(a, np.ndarray) else a[:n].astype(np.uint64, copy=False)
    y = np.asarray(b[:n], dtype=np.uint64) if not isinstance(b, np.ndarray) else b[:n].astype(np.uint64, copy=False)
    diff = np.flatnonzero(x != y)
    return int(diff[0]) if diff.size else n


def clip_to_prompt(
    params: RemoteKVParams,
    retained_tokens: Sequence[int],
    retained_keys: Sequence[int],
    prompt_tokens: Sequence[int] | np.ndarray,
    prompt_keys: Sequence[int] | np.ndarray,
    block_size: int,
) -> GuardResult:
    """Clip D's retained-block params to the part the new prompt really extends.

    Args:
        params: D's answer (``do_remote_decode`` true) for the previous turn.
        retained_tokens: the tokens whose KV D holds (``remote_num_tokens`` of them).
        retained_keys: request keys of their whole blocks.
        prompt_tokens: the new prompt's token ids.
        prompt_keys: request keys of the new prompt's whole blocks (same
            token processor, model, LoRA and salt as ``retained_keys``).
        block_size: tokens per block of the engines (>= 1).

    Returns:
        A :class:`GuardResult`; its ``params`` is a new object (the input is
        never modified), unknown fields kept.

    Raises:
        ValueError: block_size < 1, or no group of the params names as many
            blocks as the retained tokens fill (D's answer and the tokens do
            not belong together).
    """
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    n = len(retained_tokens)
    need = -(-n // block_size)
    tails = _tail_groups(params, n, block_size)
    common = common_prefix_len(retained_tokens, prompt_tokens)
    key_blocks = common_prefix_len(retained_keys, prompt_keys)
    full_blocks = n // block_size
    if common >= n and key_blocks >= min(full_blocks, len(retained_keys)) and n > 0:
        return GuardResult(
            params=msgspec.structs.replace(params, extra=dict(params.extra)),
            common_tokens=n,
            reusable_tokens=n,
            blocks=need,
            clipped=False,
            reason=f"prompt extends all {n} retained tokens",
        )
    k = min(common // block_size, key_blocks)
    if tails and k > 0:
        return _nothing(common, f"prompt extends {k * block_size} of {n} retained tokens; KV-cache group(s) {tails} "
                                "hold only the retained sequence's tail (sliding window / state): no partial reuse")
    if k == 0:
        why = "key scope differs" if common >= block_size else f"first difference at token {common}"
        return _nothing(common, f"no whole block in common ({why})")
    clipped = msgspec.structs.replace(
        params,
        remote_block_ids=[list(g[:k]) for g in params.remote_block_ids],
        remote_num_tokens=k * block_size,
        extra=dict(params.extra),
    )
    return GuardResult(
        params=clipped,
        common_tokens=common,
        reusable_tokens=k * block_size,
        blocks=k,
        clipped=True,
        reason=f"prompt differs from the retained tokens at token {common}: clipped to {k} blocks "
        f"({k * block_size} of {n} tokens)",
    )


def _tail_groups(params: RemoteKVParams, n: int, block_size: int) -> list[int]:
    """Groups naming fewer blocks than ``n`` tokens fill (a sliding-window tail, a state slot).

    Raises ValueError when every group does (D's answer and the tokens do not belong together).
    """
    need = -(-n // block_size)
    tails = [i for i, g in enumerate(params.remote_block_ids) if len(g) < need]
    if len(tails) == len(params.remote_block_ids):
        raise ValueError(f"no KV-cache group names the {need} blocks of {n} tokens of block size {block_size} "
                         f"(the first names {len(params.remote_block_ids[0])})")
    return tails


def _nothing(common: int, why: str) -> GuardResult:
    """No remote params: P recomputes."""
    return GuardResult(params=None, common_tokens=common, reusable_tokens=0, blocks=0, clipped=True,
                       reason=f"{why}; no remote params")
