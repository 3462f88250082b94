"""Request tokenization: OpenAI bodies -> the token ids a vLLM engine will prefill.

Needs the extra ``pip install 'kvindex[tokenize]'`` (transformers, tokenizers,
jinja2, as vLLM uses them). See :class:`RequestTokenizer` and docs/tokenize.md.
"""

from __future__ import annotations

from kvindex.tokenize.messages import Inexact
from kvindex.tokenize.prefix_cache import CacheStats, PrefixCache
from kvindex.tokenize.tokenizer import RequestTokenizer, TokenizedRequest, load_chat_template

__all__ = ["CacheStats", "Inexact", "PrefixCache", "RequestTokenizer", "TokenizedRequest", "load_chat_template"]
