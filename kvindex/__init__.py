"""kvindex: tokens -> request keys, and the two-level KV block index.

:class:`TokenProcessor` (:mod:`kvindex.keys`) turns a prompt's token ids into
one chained uint64 request key per full block, with our own fast keyed hash or
vLLM's own block hashes.  :class:`KVBlockIndex` (:mod:`kvindex.index`) keeps
request key -> (pod, tier, DP rank) and engine key -> request key, bounded in
memory.  :mod:`kvindex.tiers` names the tiers and their weights.  No sockets,
no HTTP, no threads of its own.
"""

from kvindex.index import IndexStats, KVBlockIndex, PodEntry
from kvindex.keys import ALGORITHMS, TokenProcessor
from kvindex.tiers import CPU, DECODE_RETAINED, GPU, STORAGE, TierWeights

__all__ = [
    "ALGORITHMS",
    "CPU",
    "DECODE_RETAINED",
    "GPU",
    "STORAGE",
    "IndexStats",
    "KVBlockIndex",
    "PodEntry",
    "TierWeights",
    "TokenProcessor",
]
