"""Storage tiers of a KV block and the weight each tier carries in scoring.

A tier is where a pod holds a block: ``gpu``, ``cpu``, ``storage`` (vLLM's
``medium`` field of BlockStored/BlockRemoved: "GPU", "CPU", "STORAGE", nil
meaning GPU) and, for P/D disaggregation, the decode-retained tier.  Inside the
index the tiers a pod holds a block in are kept as a bit mask (``int``), one bit
per tier name, so that the read path never allocates sets.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Mapping

GPU = "gpu"
CPU = "cpu"
STORAGE = "storage"
DECODE_RETAINED = "decode_retained"

#: Default weight per tier: a block in GPU memory saves all of its prefill, one
#: in CPU memory most of it (it must be copied back), one in storage less.  A
#: decode-retained block (P/D disaggregation: the decode pod keeps a
#: conversation's KV for the next turn's prefill pod to pull over NIXL) weighs
#: 0.7: a pull saved 87 % of a turn-2 prefill on the CPU engines measured here
#: and 41-70 % of TTFT in vLLM PR #32553's GPU figures, and it crosses the
#: network, so it ranks below a CPU-tier copy (0.8) and above storage (0.5).
DEFAULT_TIER_WEIGHTS: dict[str, float] = {GPU: 1.0, CPU: 0.8, STORAGE: 0.5, DECODE_RETAINED: 0.7}

_MEDIUM_TO_TIER = {"GPU": GPU, "CPU": CPU, "STORAGE": STORAGE, "DISK": STORAGE}


def tier_from_medium(medium: str | None) -> str:
    """Map vLLM's ``medium`` string to a tier name.

    Mirrors vllm/distributed/kv_events.py (BlockStored.medium, vLLM 0.32):
    ``None`` -> ``"gpu"`` (engines that predate the field, and CPU-only engines,
    mean their main KV cache), ``"GPU"``/``"CPU"``/``"STORAGE"`` -> lower case.
    Any other string is lower-cased and kept as its own tier (weight 0 unless
    configured).
    """
    if medium is None:
        return GPU
    return _MEDIUM_TO_TIER.get(medium.upper(), medium.lower())


class _TierRegistry:
    """Process-wide, append-only mapping tier name <-> bit position."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._bits: dict[str, int] = {}
        self._names: list[str] = []
        for name in (GPU, CPU, STORAGE, DECODE_RETAINED):
            self.bit(name)

    def bit(self, tier: str) -> int:
        """Bit mask (a single set bit) for ``tier``, registering it on first use."""
        b = self._bits.get(tier)
        if b is not None:
            return b
        with self._lock:
            b = self._bits.get(tier)
            if b is None:
                if len(self._names) >= 62:
                    raise ValueError("too many distinct tiers (at most 62)")
                b = 1 << len(self._names)
                self._names.append(tier)
                self._bits[tier] = b
            return b

    def __len__(self) -> int:
        """Number of tiers registered (bits 0 .. len - 1 are in use)."""
        return len(self._names)

    def names(self, mask: int) -> tuple[str, ...]:
        """Tier names whose bits are set in ``mask``, in registration order."""
        return tuple(n for i, n in enumerate(self._names) if mask >> i & 1)


TIERS = _TierRegistry()


def tier_bit(tier: str) -> int:
    """Single-bit mask of ``tier`` (see :data:`TIERS`)."""
    return TIERS.bit(tier)


def tier_names(mask: int) -> tuple[str, ...]:
    """Names of the tiers set in ``mask``."""
    return TIERS.names(mask)


class TierWeights:
    """Weight of a block by the best tier a pod holds it in.

    ``weights`` maps tier name -> weight (>= 0); defaults to
    :data:`DEFAULT_TIER_WEIGHTS` (gpu 1.0, cpu 0.8, storage 0.5,
    decode_retained 0.7).  A tier not
    in the mapping weighs 0.  ``best(mask)`` is the largest weight among the
    tiers in ``mask`` (0.0 for an empty mask); results are memoised per mask so
    the read path pays one dict lookup per block.

    Raises ValueError for a negative or non-finite weight.
    """

    __slots__ = ("_weights", "_memo")

    def __init__(self, weights: Mapping[str, float] | None = None) -> None:
        w = dict(DEFAULT_TIER_WEIGHTS if weights is None else weights)
        for name, value in w.items():
            if not isinstance(name, str):
                raise TypeError(f"tier name must be str, got {type(name).__name__}")
            value = float(value)
            if not value >= 0.0 or value == float("inf"):
                raise ValueError(f"tier weight for {name!r} must be finite and >= 0, got {value}")
            w[name] = value
            TIERS.bit(name)
        self._weights = w
        self._memo: dict[int, float] = {0: 0.0}

    @property
    def weights(self) -> dict[str, float]:
        """A copy of the tier -> weight mapping."""
        return dict(self._weights)

    def weight(self, tier: str) -> float:
        """Weight of one tier (0.0 when not configured)."""
        return self._weights.get(tier, 0.0)

    def best(self, mask: int) -> float:
        """Largest weight among the tiers set in ``mask``."""
        v = self._memo.get(mask)
        if v is None:
            v = max((self._weights.get(n, 0.0) for n in TIERS.names(mask)), default=0.0)
            self._memo[mask] = v
        return v

    def best_tier(self, mask: int) -> str | None:
        """Name of the heaviest tier in ``mask`` (ties: registration order), or None."""
        best_name, best_w = None, -1.0
        for n in TIERS.names(mask):
            w = self._weights.get(n, 0.0)
            if w > best_w:
                best_name, best_w = n, w
        return best_name

    @classmethod
    def of(cls, weights: TierWeights | Mapping[str, float] | None) -> TierWeights:
        """Coerce a mapping (or None for the defaults) into TierWeights."""
        return weights if isinstance(weights, TierWeights) else cls(weights)

    def __repr__(self) -> str:
        return f"TierWeights({self._weights!r})"


def mask_of(tiers: Iterable[str]) -> int:
    """Bit mask of several tiers."""
    m = 0
    for t in tiers:
        m |= TIERS.bit(t)
    return m
