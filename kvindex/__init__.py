"""kvindex: tokens -> request keys, and the two-level KV block index.

:class:`TokenProcessor` (:mod:`kvindex.keys`) turns a prompt's token ids into
one chained uint64 request key per full block, with our own fast keyed hash or
vLLM's own block hashes.  :class:`KVBlockIndex` (:mod:`kvindex.index`) keeps
request key -> (pod, tier, DP rank) and engine key -> request key, bounded in
memory; :class:`KVIndex` (:mod:`kvindex.protocol`) is the interface it and
the compiled :class:`kvindex.native.NativeKVBlockIndex` share, and
:func:`make_index` builds either.  :mod:`kvindex.tiers` names the tiers and
their weights.  No sockets,
no HTTP, no threads of its own.
"""

from kvindex.index import IndexStats, KVBlockIndex, PodEntry
from kvindex.keys import ALGORITHMS, TokenProcessor
from kvindex.protocol import BACKENDS, KVIndex, make_index
from kvindex.tiers import CPU, DECODE_RETAINED, GPU, STORAGE, TierWeights

__all__ = [
    "ALGORITHMS",
    "BACKENDS",
    "CPU",
    "DECODE_RETAINED",
    "GPU",
    "STORAGE",
    "IndexStats",
    "KVBlockIndex",
    "KVIndex",
    "PodEntry",
    "TierWeights",
    "TokenProcessor",
    "make_index",
]
