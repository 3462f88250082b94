"""Hybrid models: KV-cache group specs and the engine's prefix-cache hit rule over per-group presence.

A hybrid model (sliding-window or Mamba/linear-attention layers beside full
attention) has one KV-cache group per kind of layer; vLLM publishes one
BlockStored per group with the same block hashes and a different
``group_idx``.  :class:`GroupSpec` is what a consumer learns about a group
from its stores (BlockRemoved carries no kind); :func:`predict_hit` is vLLM
0.32's rule for how many prompt tokens a pod serves from cache, given which
blocks each group holds (mirrors vllm/v1/core/kv_cache_coordinator.py
``HybridKVCacheCoordinator.find_longest_cache_hit`` and the per-kind finders
of vllm/v1/core/single_type_kv_cache_manager.py).  docs/hybrid.md explains
the rule.  Not modelled: fine-grained partial hits (``--prefix-match-unit``
below a group's block size) and 0.33's lookahead hashing.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from math import gcd, lcm
from typing import NamedTuple

import msgspec

__all__ = [
    "FULL_KINDS",
    "MAMBA_KINDS",
    "SLIDING_KINDS",
    "GroupSpec",
    "held_at_hit_end",
    "HitPrediction",
    "Presence",
    "predict_hit",
    "spec_from_store",
]

#: vLLM ``KVCacheSpecKind`` values whose spec is a FullAttentionSpec (vllm/v1/kv_cache_interface.py).
FULL_KINDS = frozenset({"full_attention", "mla_attention", "sink_full_attention"})
#: Kinds handled by vLLM's SlidingWindowManager.
SLIDING_KINDS = frozenset({"sliding_window", "sliding_window_mla"})
#: Kinds handled by vLLM's MambaManager (Mamba1/2, GDN / linear attention, short conv).
MAMBA_KINDS = frozenset({"mamba"})

#: ``present(group_idx, end_token)``: the pod holds that group's block whose last token is
#: ``end_token`` (the entry keyed by the chain hash at that token).
Presence = Callable[[int, int], bool]


class GroupSpec(msgspec.Struct, frozen=True):
    """One KV-cache group as the hit rule needs it.

    Fields:
        group_idx: vLLM's KV-cache group index (``BlockStored.group_idx``; 0 when absent).
        kind: vLLM's ``kv_cache_spec_kind`` string (e.g. ``"full_attention"``,
            ``"sliding_window"``, ``"mamba"``).
        block_size: tokens per block of this group (``BlockStored.block_size``).
        window: the sliding window in tokens (``kv_cache_spec_sliding_window``), else None.
        eagle: the group drops its last hit block for EAGLE/MTP speculative
            decoding (engine config, not in events; vLLM 0.32 behaviour).
    """

    group_idx: int
    kind: str
    block_size: int
    window: int | None = None
    eagle: bool = False

    @property
    def rule(self) -> str:
        """Which finder applies: ``"full"``, ``"sliding_window"``, ``"mamba"`` or ``"none"`` (never hits)."""
        if self.kind in FULL_KINDS:
            return "full"
        if self.kind in SLIDING_KINDS:
            return "sliding_window" if self.window is not None and self.window >= 2 else "none"
        if self.kind in MAMBA_KINDS:
            return "mamba"
        return "none"


def held_at_hit_end(spec: GroupSpec) -> int | None:
    """Blocks ending at a hit's end that a group surely holds after serving it (None: every block).

    What a ``kv_cache_report_mode: "full"`` re-announce of blocks ``0 .. n-1``
    can be believed for: full attention all of them; a sliding-window group
    the trailing window (``ceil((window - 1) / block_size)``, one more with
    EAGLE); a Mamba group the state block at the end; other kinds none (vLLM
    0.32 reports every group's hashes although most of a sliding-window or
    Mamba group's hit blocks are null: block_pool.py ``emit_cached_block_events``).
    """
    rule = spec.rule
    if rule == "full":
        return None
    if rule == "sliding_window":
        assert spec.window is not None
        return -(-(spec.window - 1) // spec.block_size) + (1 if spec.eagle else 0)
    return 1 if rule == "mamba" else 0


def spec_from_store(
    group_idx: int | None, kind: str | None, block_size: int, window: int | None
) -> GroupSpec:
    """The spec a BlockStored's fields say (``group_idx``, ``kv_cache_spec_kind``, ``block_size``, window).

    An event without a kind (engines before vLLM PR #40984) is taken as full
    attention, the only kind such engines publish for a plain model.

    Raises:
        ValueError: block_size < 1 or a negative group index.
    """
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    g = 0 if group_idx is None else group_idx
    if g < 0:
        raise ValueError(f"group_idx must be >= 0, got {group_idx}")
    return GroupSpec(g, kind or "full_attention", block_size, window)


class HitPrediction(NamedTuple):
    """What :func:`predict_hit` found.

    tokens: prompt tokens the engine serves from cache (a multiple of the
    alignment, <= prompt tokens - 1).  limited_by: group index of the group
    that last lowered the hit (the first of its spec group), None when the
    prompt length alone bounds it.  longest: the longest hit one group
    accepted on the way (vLLM's ``longest_hit_length``; ``longest - tokens``
    is the shared prefix a sparse-retention group has not cached yet).
    """

    tokens: int
    limited_by: int | None
    longest: int


class _SpecGroup(NamedTuple):
    rule: str
    block_size: int
    window: int
    eagle: bool
    members: tuple[int, ...]


def _spec_groups(groups: Sequence[GroupSpec]) -> list[_SpecGroup]:
    """Groups with equal (kind, block size, window) batched; full attention first, then group order."""
    batched: dict[tuple[str, int, int | None], list[GroupSpec]] = {}
    for g in sorted(groups, key=lambda g: g.group_idx):
        batched.setdefault((g.kind, g.block_size, g.window), []).append(g)
    out = [
        _SpecGroup(m[0].rule, m[0].block_size, m[0].window or 0, any(g.eagle for g in m),
                   tuple(g.group_idx for g in m))
        for m in batched.values()
    ]
    out.sort(key=lambda sg: sg.rule != "full")  # stable
    return out


def predict_hit(
    groups: Sequence[GroupSpec], present: Presence, prompt_tokens: int, *, hash_block_size: int | None = None
) -> HitPrediction:
    """Tokens of a ``prompt_tokens``-token prompt the engine serves from its prefix cache.

    Args:
        groups: the model's prefix-cacheable KV-cache groups (one for a plain model).
        present: ``present(group_idx, end_token)`` (see :data:`Presence`); asked
            only for ``end_token <= prompt_tokens - 1``.
        prompt_tokens: the request's prompt length (>= 0).
        hash_block_size: the engine's hash block size; default the GCD of the
            block sizes (vLLM's default).  Only EAGLE groups use it.

    Returns:
        :class:`HitPrediction`.  One group: vLLM's UnitaryKVCacheCoordinator
        (alignment = its block size); several: the fixed point of
        HybridKVCacheCoordinator (alignment = LCM of the block sizes).

    Raises:
        ValueError: no group, duplicate group indexes, or prompt_tokens < 0.
    """
    if prompt_tokens < 0:
        raise ValueError(f"prompt_tokens must be >= 0, got {prompt_tokens}")
    if not groups or len({g.group_idx for g in groups}) != len(groups):
        raise ValueError("groups must be non-empty with distinct group indexes")
    sizes = [g.block_size for g in groups]
    align = lcm(*sizes)
    unit = hash_block_size or gcd(*sizes)
    hash_tokens = prompt_tokens // unit * unit  # tokens covered by block hashes
    bound = max(prompt_tokens - 1, 0)  # the last prompt token is always computed
    sgs = _spec_groups(groups)
    return _fixed_point(sgs, present, bound, align, hash_tokens)


def _fixed_point(
    sgs: list[_SpecGroup], present: Presence, bound: int, align: int, hash_tokens: int
) -> HitPrediction:
    """Lower the candidate length group by group until every group accepts it."""
    single_pass = len(sgs) == 1 or (len(sgs) == 2 and sgs[0].rule == "full")
    length, last, longest = bound, None, 0
    full_len: dict[int, int] = {}
    verified: set[int] = set()  # EAGLE spec groups whose drop is applied at this length

    def has(sg: _SpecGroup, end: int) -> bool:
        return all(present(g, end) for g in sg.members)

    while True:
        cur = length
        for j, sg in enumerate(sgs):
            if j in full_len:  # full attention is downward-closed: found once, then only min-ed
                if full_len[j] < cur:
                    cur, last = full_len[j], sg.members[0]
                continue
            drop = sg.eagle and j not in verified
            lim = cur
            if drop and sg.rule != "mamba":  # look one block further, then drop it
                lim = min(cur + sg.block_size, hash_tokens)
            new = _FINDERS[sg.rule](sg, has, lim, align, drop)
            if drop:
                verified.add(j)
            elif new < cur:
                verified.clear()
            if new < cur:
                last = sg.members[0]
            cur = new
            if sg.rule == "full":
                full_len[j] = new
            longest = max(longest, cur)
        if cur >= length:
            break
        length = cur
        if single_pass:
            break
    tokens = min(length, cur)
    if tokens == bound - bound % align:
        last = None
    return HitPrediction(tokens, last, max(longest, tokens))


_Has = Callable[[_SpecGroup, int], bool]


def _full_hit(sg: _SpecGroup, has: _Has, lim: int, align: int, drop: bool) -> int:
    """Contiguous blocks from the first (chained hashes: a miss ends the prefix)."""
    b = sg.block_size
    n = 0
    while (n + 1) * b <= lim and has(sg, (n + 1) * b):
        n += 1
    hit = n * b
    if drop and hit:
        hit -= b
    return hit - hit % align


def _sliding_hit(sg: _SpecGroup, has: _Has, lim: int, align: int, drop: bool) -> int:
    """The rightmost run of ``need`` blocks ending on an aligned boundary (the trailing window)."""
    b = sg.block_size
    need = -(-(sg.window - 1) // b) + (1 if drop else 0)
    run = 0
    n = -1
    for i in range(lim // b - 1, -1, -1):
        if not has(sg, (i + 1) * b):
            run = 0
            continue
        if run == 0 and b != align and ((i if drop else i + 1) * b) % align:
            continue  # a window must end on an aligned boundary
        run += 1
        if run >= need:
            n = i + run
            break
    if n < 0:  # no whole window: a run from block 0 still counts
        n = run
        while b != align and (n * b) % align:
            n -= 1
    if drop and n:
        n -= 1
        while b != align and (n * b) % align:
            n -= 1
    return n * b


def _mamba_hit(sg: _SpecGroup, has: _Has, lim: int, align: int, drop: bool) -> int:
    """The state exactly at the boundary: the rightmost held block ending on an aligned token."""
    b = sg.block_size
    for i in range(lim // b - 1, -1, -1):
        end = (i + 1) * b
        if end % align == 0 and has(sg, end):
            return end
    return 0


def _no_hit(sg: _SpecGroup, has: _Has, lim: int, align: int, drop: bool) -> int:
    """A kind the rule does not model (chunked local, cross attention, unknown): predict no hit."""
    return 0


_FINDERS: dict[str, Callable[[_SpecGroup, _Has, int, int, bool], int]] = {
    "full": _full_hit,
    "sliding_window": _sliding_hit,
    "mamba": _mamba_hit,
    "none": _no_hit,
}
