"""scorer: the read path's scoring half.

Prefix coverage per pod from the index (:mod:`scorer.prefix`), load signals
parsed from engine ``/metrics`` (:mod:`scorer.load`), and pickers that mix
weighted scores and explain their choice (:mod:`scorer.picker`).  It reads the
index only; it never imports kvevents.
"""

from scorer.load import LoadSnapshot, fetch_load, parse_vllm_metrics
from scorer.picker import Choice, LoadPicker, PickerWeights, PodExplanation, RandomPicker, WeightedPicker
from scorer.prefix import (
    PrefixIndex,
    PrefixScore,
    predicted_cached_tokens,
    prefix_scores_from_matches,
    reads_prefix_cache,
    score_prefix,
)

__all__ = [
    "Choice",
    "LoadPicker",
    "LoadSnapshot",
    "PickerWeights",
    "PodExplanation",
    "PrefixIndex",
    "PrefixScore",
    "RandomPicker",
    "WeightedPicker",
    "fetch_load",
    "parse_vllm_metrics",
    "predicted_cached_tokens",
    "reads_prefix_cache",
    "prefix_scores_from_matches",
    "score_prefix",
]
