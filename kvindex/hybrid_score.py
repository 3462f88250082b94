"""A pod's prefix match bounded by its engine's hybrid hit rule (indexes that keep KV-cache groups).

``prefix_match`` walks the primary (full-attention) group only. For a pod whose
engine publishes other groups too (sliding window, Mamba), the engine serves
from cache only what :func:`kvindex.hybrid.predict_hit` finds over every group;
:func:`bound_matches` cuts each such pod's match to that many blocks, so
coverage, the pick and ``predicted_cached_tokens`` follow the engine's rule.
Plain pods (one full-attention group, or no grouped store yet) are untouched.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from kvindex.hybrid import predict_hit

__all__ = ["bound_matches"]


def bound_matches(
    index: Any, matches: dict[str, list[int]], keys: Sequence[int], block_size: int, prompt_tokens: int,
    model: str | None,
) -> tuple[dict[str, list[int]], dict[str, int | None]]:
    """Each hybrid pod's match cut to its engine's hit; and the group that limited it.

    Args:
        index: a :class:`~kvindex.contract.GroupAware` index.
        matches: pod -> tier masks from ``prefix_match(keys, ...)``.
        keys: the request keys (one per full block of ``block_size`` tokens).
        prompt_tokens: the prompt's length.
        model: the publishers' model name (the streams' scope).

    Returns:
        ``(matches, limited_by)``: a new dict (lists of hybrid pods replaced,
        the others shared) and, per hybrid pod, the group index that lowered
        its hit (None: the prompt's length bounds it). A group whose block
        size is not the index's is not modelled: the pod is left as matched.
    """
    out = dict(matches)
    limited: dict[str, int | None] = {}
    for pod, masks in matches.items():
        ranks = index.grouped_ranks(pod, model=model)  # cheap: plain pods stop here
        if not ranks:
            continue
        rank = ranks[0] if len(ranks) == 1 else (index.best_dp_rank(pod, keys) or 0)
        specs = index.group_specs(pod, rank, model=model)
        if not specs or any(s.block_size != block_size for s in specs.values()):
            continue  # a group of another block size is not modelled
        groups = index.group_match(keys, pod, rank, model=model)

        def present(g: int, end: int, groups: dict[int, list[int]] = groups) -> bool:
            # a group missing here was cleared since its spec was read (or the store was out of reach)
            masks = groups.get(g)
            return bool(masks and masks[end // block_size - 1])

        hit = predict_hit(list(specs.values()), present, prompt_tokens)
        out[pod] = masks[: hit.tokens // block_size]
        limited[pod] = hit.limited_by
    return out, limited

