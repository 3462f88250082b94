"""Prefix scorer: how much of a request's prompt each pod already holds as KV.

Read path: caller tokens -> request keys -> ``index.prefix_match`` -> **prefix
scores** -> picker.  This module turns the per-pod tier masks returned by the
index into a :class:`PrefixScore` per candidate pod.

Scoring rules
-------------
* Longest consecutive prefix match: only blocks 0, 1, ..., k-1 of the request
  count, where block k is the first one the pod does not hold.  A block after a
  gap never counts, even if the pod holds it (the engine's prefix cache cannot
  use it either: vLLM's ``KVCacheManager.get_computed_blocks`` stops at the
  first miss, vllm/v1/core/kv_cache_manager.py, vLLM 0.32).
* Each matched block weighs the best tier the pod holds it in
  (:class:`kvindex.tiers.TierWeights`, default gpu 1.0, cpu 0.8, storage 0.5,
  unknown tiers 0).
* ``coverage = weighted matched blocks / request blocks``, clamped to 0..1.  It
  is *absolute*: it depends only on this pod's match and the request length,
  never on the other candidates.

Difference from llm-d
---------------------
llm-d's precise prefix-cache scorer (llm-d-inference-scheduler,
``indexedScoresToNormalizedScoredPods``) min-max normalises the raw hit counts
over the pods that have *some* hit, and gives pods without a hit 0.  The pod
with the smallest non-zero hit therefore also gets 0: a pod holding 1 of 10
blocks scores exactly like a pod holding none whenever another pod holds more;
and when all pods with hits tie, they all get 1.0 however short the hit.  With
absolute coverage a pod with a shorter (positively weighted) prefix always
scores strictly above a pod with none and strictly below a pod with a longer
prefix in the same tier, and a 1-block hit on a 1,000-block prompt is worth
what it saves, not 1.0.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Collection, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

import msgspec

from kvindex.tiers import TierWeights

if TYPE_CHECKING:  # pragma: no cover - typing only
    import numpy as np

__all__ = [
    "predicted_cached_tokens",
    "reads_prefix_cache",
    "PrefixIndex",
    "PrefixScore",
    "prefix_scores_from_matches",
    "score_prefix",
]


@runtime_checkable
class PrefixIndex(Protocol):
    """What the prefix scorer needs from an index (``kvindex.reference.KVBlockIndex``).

    ``prefix_match(request_keys, pods)`` returns, per pod with at least one
    matched block, the list of tier bit masks of its longest consecutive prefix
    match from block 0; ``pods()`` returns every pod the index knows.
    """

    def prefix_match(
        self,
        request_keys: Sequence[int] | np.ndarray,
        pods: Collection[str] | None = None,
    ) -> dict[str, list[int]]: ...

    def pods(self) -> frozenset[str]: ...


class PrefixScore(msgspec.Struct, frozen=True, kw_only=True, gc=False):
    """Prefix-cache score of one pod for one request.

    Fields:
        pod: pod id.
        matched_blocks: length of the longest consecutive prefix match, in
            blocks (>= 0), whatever the tier weights.
        matched_tokens: ``matched_blocks * block_size`` (tokens).
        weighted_blocks: sum over the matched blocks of the best tier weight
            the pod holds each block in (>= 0).
        coverage: ``weighted_blocks / request_blocks`` clamped to 0..1; 0.0 for
            a request without a full block.
        best_tier: the heaviest tier among all tiers holding any matched block
            (None when nothing matched).  Per-block tiers are not kept.
        hybrid: the match was cut to the engine's hybrid hit rule (several
            KV-cache groups; :mod:`kvindex.hybrid_score`).
        limited_by_group: with ``hybrid``, the KV-cache group that lowered the
            hit (None: the prompt's length bounds it).
    """

    pod: str
    matched_blocks: int = 0
    matched_tokens: int = 0
    weighted_blocks: float = 0.0
    coverage: float = 0.0
    best_tier: str | None = None
    hybrid: bool = False
    limited_by_group: int | None = None


def _check_pods_arg(name: str, pods: Collection[str] | None) -> None:
    if isinstance(pods, (str, bytes)):
        raise TypeError(f"{name} must be a collection of pod ids, not a single {type(pods).__name__}")


def prefix_scores_from_matches(
    matches: dict[str, list[int]],
    request_blocks: int,
    block_size: int,
    candidates: Collection[str] | None,
    weights: TierWeights,
) -> dict[str, PrefixScore]:
    """Turn an index's prefix matches into one :class:`PrefixScore` per candidate.

    Args:
        matches: pod -> tier bit masks of the pod's matched blocks, block 0
            first (the shape of ``KVBlockIndex.prefix_match``).  A mask of 0
            means "not held" and ends the match there (consecutive-prefix
            rule), so a list with gaps scores only its first run.
        request_blocks: number of full blocks of the request (>= 0).
        block_size: tokens per block (>= 1).
        candidates: pods to score; every candidate gets an entry, a zero score
            when absent from ``matches``; pods of ``matches`` outside the
            candidates are ignored.  None = the pods of ``matches``.
        weights: tier weights.

    Returns:
        pod -> PrefixScore, in candidate order (``matches`` order for None).

    Raises:
        ValueError: ``request_blocks < 0``, ``block_size < 1``, or a match longer
            than ``request_blocks`` (an index answering for another request).
        TypeError: ``candidates`` is a single string.
    """
    if request_blocks < 0:
        raise ValueError(f"request_blocks must be >= 0, got {request_blocks}")
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    _check_pods_arg("candidates", candidates)
    pods: Collection[str] = matches.keys() if candidates is None else candidates
    best = weights.best
    out: dict[str, PrefixScore] = {}
    for pod in pods:
        masks = matches.get(pod)
        if not masks:
            out[pod] = PrefixScore(pod=pod)
            continue
        if len(masks) > request_blocks:
            raise ValueError(f"match of pod {pod!r} has {len(masks)} blocks, request has {request_blocks}")
        try:  # consecutive-prefix rule: stop at the first block not held
            n = masks.index(0)
            masks = masks[:n]
        except ValueError:
            n = len(masks)
        if n == 0:
            out[pod] = PrefixScore(pod=pod)
            continue
        first = masks[0]
        if masks.count(first) == n:  # the common case: one tier throughout
            weighted, union = best(first) * n, first
        else:  # few distinct masks per pod: weigh each distinct mask once
            weighted, union = 0.0, 0
            for mask, count in Counter(masks).items():
                weighted += best(mask) * count
                union |= mask
        out[pod] = PrefixScore(
            pod=pod,
            matched_blocks=n,
            matched_tokens=n * block_size,
            weighted_blocks=weighted,
            coverage=min(1.0, weighted / request_blocks),
            best_tier=weights.best_tier(union),
        )
    return out


def score_prefix(
    index: PrefixIndex,
    request_keys: Sequence[int] | np.ndarray,
    pods: Collection[str] | None = None,
    *,
    block_size: int,
    weights: TierWeights | None = None,
) -> dict[str, PrefixScore]:
    """Score the candidate pods for one request against an index.

    Args:
        index: a :class:`PrefixIndex` (``kvindex.reference.KVBlockIndex``).
        request_keys: one request key per full block of the prompt (uint64
            ints or a 1-d numpy array); empty for a prompt shorter than one
            block.
        pods: candidate pods; None = every pod the index knows (plus any pod
            that shows up in the match, should the index change in between).
        block_size: tokens per block (>= 1), for ``matched_tokens``.
        weights: tier weights; None = the defaults of
            :class:`kvindex.tiers.TierWeights`.

    Returns:
        pod -> PrefixScore for every candidate (zero scores for pods without a
        match).  A prompt shorter than one block gets a zero score for every
        candidate and the index is not queried for a match.

    Raises:
        ValueError: ``block_size < 1``.
        TypeError: ``pods`` is a single string.
    """
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    _check_pods_arg("pods", pods)
    w = weights if weights is not None else _DEFAULT_WEIGHTS
    n_blocks = len(request_keys)
    if n_blocks == 0:
        cands: Collection[str] = index.pods() if pods is None else pods
        return {p: PrefixScore(pod=p) for p in cands}
    matches = index.prefix_match(request_keys, pods)
    if pods is None:
        known = index.pods()
        cands = list(known) + [p for p in matches if p not in known]
    else:
        cands = pods
    return prefix_scores_from_matches(matches, n_blocks, block_size, cands, w)


_DEFAULT_WEIGHTS = TierWeights()


def reads_prefix_cache(path: str, body: Mapping[str, Any]) -> bool:
    """Whether vLLM (0.32) looks up its prefix cache for this request body.

    Not when the request computes prompt logprobs: ``SamplingParams.skip_reading_prefix_cache``
    defaults to ``prompt_logprobs is not None`` (vllm/sampling_params.py), and the OpenAI layer
    sets ``prompt_logprobs`` from the body's ``prompt_logprobs``, else, with ``echo``, from
    ``logprobs`` (``/v1/completions``) or ``top_logprobs`` (``/v1/chat/completions``, where it
    defaults to 0, so a chat request with ``echo`` alone skips the cache too); see
    ``to_sampling_params`` in vllm/entrypoints/openai/{completion,chat_completion}/protocol.py.
    Such a request still computes and stores every block of its prompt, so a router should
    score it on load alone and predict 0 cached tokens for it.

    Args:
        path: the OpenAI API path (``/v1/completions`` or ``/v1/chat/completions``).
        body: the request's JSON body.
    """
    if body.get("prompt_logprobs") is not None:
        return False
    if body.get("echo"):
        if path.endswith("/chat/completions"):
            return body.get("top_logprobs", 0) is None
        return body.get("logprobs") is None
    return True


def predicted_cached_tokens(matched_blocks: int, prompt_tokens: int, block_size: int) -> int:
    """Tokens the engine will report as prefix-cache hits for a prompt.

    ``min(matched_blocks, (prompt_tokens - 1) // block_size) * block_size``:
    the index's consecutive prefix match (blocks), capped so that at least one
    prompt token is computed, in whole blocks (mirrors vLLM 0.32
    ``KVCacheManager.get_computed_blocks``: ``max_cache_hit_length =
    request.num_tokens - 1``). 0 for an empty prompt.

    Raises:
        ValueError: negative counts or a block size < 1.
    """
    if matched_blocks < 0 or prompt_tokens < 0 or block_size < 1:
        raise ValueError(f"bad arguments: {matched_blocks=}, {prompt_tokens=}, {block_size=}")
    if prompt_tokens == 0:
        return 0
    return min(matched_blocks, (prompt_tokens - 1) // block_size) * block_size
