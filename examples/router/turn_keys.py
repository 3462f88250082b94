"""A conversation's request keys, carried from turn to turn with the tokenizer's cache.

A warm turn's first ``reused_tokens`` ids are those of a text the tokenizer's
multi-turn cache holds (:class:`kvindex.tokenize.TokenizedRequest`). The keys
of that text's ids are kept in its cache memo, so the keys of the whole blocks
of the reused ids are taken from there and only the blocks after them are
hashed: ``xxh3_chain`` keys chain, key i depending on blocks 0..i only. The
memo lives and dies with the cache entry: 8 bytes per block of the cached ids
(at the default bounds, 4 M tokens and 16-token blocks, at most 2 MB).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from kvindex.facade import Indexer
    from kvindex.tokenize import TokenizedRequest

__all__ = ["turn_request_keys"]


def turn_request_keys(indexer: Indexer, ids: list[int], salt: str | None,
                      local: TokenizedRequest) -> np.ndarray | None:
    """The request keys of ``ids`` (tokenized as ``local``), kept in ``local``'s memo for the next turn.

    None when the tokenizer kept no memo for them (the score then hashes the ids).
    """
    if local.memo is None:
        return None
    tp = indexer.token_processor
    tag = (tp, indexer.config.model_name, salt)  # what the keys depend on besides the ids
    kept = local.reused_memo.value if local.reused_memo is not None else None
    prefix = kept[1][: local.reused_tokens // tp.block_size] if kept is not None and kept[0] == tag else None
    keys = indexer.request_keys(ids, cache_salt=salt, prefix_keys=prefix)
    local.memo.value = (tag, keys)
    return keys
