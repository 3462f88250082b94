"""Does an engine's configuration match ours?  Checked from its stream's events.

A wrong setting on either side leaves the index useless without any error:
an engine whose block size differs from ``token_processor_config.block_size``
has every BlockStored refused; in engine-hash mode (``vllm_*`` algorithms)
an engine hashing with another algorithm or seed stores keys no prompt ever
produces; a topic model other than the one scored (``model_name``) scopes the
blocks where no score looks.  :class:`StreamCheck` finds each of these on one
publisher stream (pod, model, DP rank) and names it (:data:`REASONS`); the
pool then reports the stream as not complete, with the reason, and the
problem is logged once per stream with the setting to change.

Cost: a stream is looked at until its first BlockStored with tokens (and, in
engine-hash mode, its first sequence start) has confirmed the settings; after
that only batches the index refused something of, or after a clear.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any, NamedTuple

from kvevents.events import BlockStored
from kvindex.hybrid import FULL_KINDS
from kvindex.keys import TokenProcessor

__all__ = ["BLOCK_SIZE", "HASH_ALGORITHM", "KV_CACHE_GROUPS", "MODEL_NAME", "REASONS", "Misconfig", "ConfigCheck", "StreamCheck"]

log = logging.getLogger("kvevents.misconfig")

BLOCK_SIZE = "block_size"
"""The engine's BlockStored events carry another block size than the token processor's."""
HASH_ALGORITHM = "hash_algorithm"
"""Engine-hash mode: the engine's block hashes are not what our algorithm computes for its tokens."""
MODEL_NAME = "model_name"
"""The stream's model (from its topic) is not the model the indexer scores for."""
KV_CACHE_GROUPS = "kv_cache_groups"
"""The engine publishes sliding-window / Mamba KV-cache groups (a hybrid model) to a backend that keeps none."""
REASONS = (BLOCK_SIZE, HASH_ALGORITHM, MODEL_NAME, KV_CACHE_GROUPS)

_COMPAT_ALGOS = {"vllm_sha256_cbor": "sha256_cbor", "vllm_sha256": "sha256"}


class Misconfig(NamedTuple):
    """One problem of one stream: a reason of :data:`REASONS` and what to set."""

    reason: str
    message: str


class ConfigCheck:
    """What every engine is checked against: our token processor and the model scored.

    Args:
        token_processor: the index's (block size, algorithm, engine hash seed);
            None checks nothing but the model.
        model_name: the model scores use by default (``Config.model_name``);
            None: no model is expected.  An engine entry that names its own
            model (``EngineEndpoint.model``) is expected to publish that one.
        keeps_groups: the index keeps KV-cache groups
            (:class:`kvindex.contract.GroupAware`); when False, a store of a
            sliding-window or Mamba group names the stream misconfigured
            (:data:`KV_CACHE_GROUPS`).
    """

    def __init__(
        self, token_processor: TokenProcessor | None, model_name: str | None = None, *, keeps_groups: bool = True
    ) -> None:
        self.token_processor = token_processor
        self.model_name = model_name
        self.keeps_groups = keeps_groups
        self._alternatives: list[tuple[TokenProcessor, str]] | None = None

    def stream(
        self, pod: str, model: str | None, dp_rank: int, configured_model: str | None = None, engine: str = "vllm"
    ) -> StreamCheck:
        """The check of a new stream (its model problem, if any, is found and logged now).

        ``engine``: the wire format.  vLLM's ``block_size`` is the engine's
        block size in every event, so every store is evidence; SGLang's is its
        page's length, so a store shorter than one of our blocks (a radix
        node's short last page) is not.
        """
        return StreamCheck(self, pod, model, dp_rank, configured_model, short_events_count=engine != "sglang")

    def alternatives(self) -> list[tuple[TokenProcessor, str]]:
        """Engine-hash processors of the other algorithm / default seed, with the setting that names each."""
        if self._alternatives is None:
            tp = self.token_processor
            out: list[tuple[TokenProcessor, str]] = []
            assert tp is not None
            for algo in _COMPAT_ALGOS:
                for seed in dict.fromkeys([tp.engine_hash_seed, None]):
                    if algo == tp.algorithm and seed == tp.engine_hash_seed:
                        continue
                    alt = TokenProcessor(tp.block_size, algorithm=algo, engine_hash_seed=seed,
                                         hash_lookahead_tokens=tp.hash_lookahead_tokens)
                    out.append((alt, f"algorithm: {algo}, engine_hash_seed: {seed!r}"))
            self._alternatives = out
        return self._alternatives


class StreamCheck:
    """The configuration checks of one publisher stream (updated by its shard worker only).

    ``problems`` (read by any thread) is replaced, never changed in place.
    """

    __slots__ = ("_owner", "pod", "model", "dp_rank", "_size_ok", "_hash_ok", "problems", "short_events_count")

    def __init__(
        self, owner: ConfigCheck, pod: str, model: str | None, dp_rank: int, configured_model: str | None,
        *, short_events_count: bool = False,
    ) -> None:
        self._owner = owner
        self.pod = pod
        self.model = model
        self.dp_rank = dp_rank
        tp = owner.token_processor
        self._size_ok = tp is None
        self._hash_ok = tp is None or not tp.engine_compatible
        self.problems: tuple[Misconfig, ...] = ()
        self.short_events_count = short_events_count  # a store shorter than one of our blocks tells the block size
        expected = configured_model if configured_model is not None else owner.model_name
        # engine-hash keys do not depend on the model name: any model matches there
        if expected is not None and model != expected and not (tp is not None and tp.engine_compatible):
            # an entry's model filled in from model_name (the facade does) is model_name's
            own = configured_model is not None and configured_model != owner.model_name
            where = "its engine entry's model" if own else "model_name"
            if model is None:
                todo = f"name the model in the engine's topic (kv@{pod}@{expected}) or in its engine entry's model"
                said = "engine's topic names no model"
            else:
                todo = (f"set model_name: {model} (or pass model={model!r} to score; one indexer for "
                        "several models: name each engine entry's model)")
                said = f"engine publishes model {model!r} (topic kv@{pod}@{model})"
            self._set(MODEL_NAME, f"{pod}: {said}, config {where} {expected!r}: {todo}")

    @property
    def watching(self) -> bool:
        """Whether the next batch's events are still to be looked at."""
        return not (self._size_ok and self._hash_ok)

    def rearm(self) -> None:
        """Look again from the next batch on (the stream was cleared: the engine may have restarted)."""
        tp = self._owner.token_processor
        if tp is not None:
            self._size_ok = False
            self._hash_ok = not tp.engine_compatible

    def events(self, events: Sequence[Any]) -> None:
        """Look at a batch's BlockStored events with tokens: block size, then (engine-hash mode) hashes."""
        tp = self._owner.token_processor
        if tp is None:
            return
        bs = tp.block_size
        sizes: set[int] = set()
        if not self._owner.keeps_groups:
            self._groups(events)
        for ev in events:
            if type(ev) is not BlockStored or not ev.token_ids:
                continue
            if len(ev.token_ids) < bs and not self.short_events_count:
                continue  # shorter than one of our blocks: SGLang's short last page of a node, not evidence
            sizes.add(ev.block_size)
            if ev.block_size == bs and not self._hash_ok and _hashable(ev, bs):
                self._hashes(tp, ev)
        if not sizes:
            return
        wrong = sorted(sizes - {bs})
        if wrong:
            self._size_ok = False
            self._set(BLOCK_SIZE, (
                f"{self.pod}: engine block size {wrong[0]}, config {bs}: "
                f"set token_processor_config.block_size: {wrong[0]} (every BlockStored is refused until then)"
            ))
        else:
            self._size_ok = True
            self._clear(BLOCK_SIZE)

    def _groups(self, events: Sequence[Any]) -> None:
        """A hybrid model's group store reaching an index that merges groups: say so (once)."""
        if any(p.reason == KV_CACHE_GROUPS for p in self.problems):
            return
        for ev in events:
            kind = ev.kv_cache_spec_kind if type(ev) is BlockStored else None
            if kind is not None and kind not in FULL_KINDS:
                self._set(KV_CACHE_GROUPS, (
                    f"{self.pod}: the engine publishes a {kind} KV-cache group (a hybrid model) and this index "
                    "backend keeps no groups, so it claims blocks the engine will not serve: set "
                    "kv_block_index_config.backend: native, python or redis, with a vllm_* algorithm (docs/hybrid.md)"
                ))
                return

    def _hashes(self, tp: TokenProcessor, ev: BlockStored) -> None:
        """Compare the engine's hash of a sequence's first block with ours for the same tokens
        (and the lookahead tokens vLLM 0.33+ hashed with it)."""
        ahead = tuple(ev.lookahead_token_ids[0]) if ev.lookahead_token_ids else ()
        if len(ahead) != tp.hash_lookahead_tokens:
            self._set(HASH_ALGORITHM, (
                f"{self.pod}: the engine hashes each block with the {len(ahead)} tokens after it "
                f"(lookahead_token_ids), token_processor_config.hash_lookahead_tokens is "
                f"{tp.hash_lookahead_tokens}, so no prompt matches: set "
                f"token_processor_config.hash_lookahead_tokens: {len(ahead)}"
            ))
            return
        first = tuple(ev.token_ids[: tp.block_size]) + ahead
        want = ev.block_hashes[0]
        if int(tp.request_keys(first)[0]) == want:
            self._hash_ok = True
            self._clear(HASH_ALGORITHM)
            return
        fix = next((name for alt, name in self._owner.alternatives() if int(alt.request_keys(first)[0]) == want), None)
        if fix is not None:
            todo = f"set token_processor_config {fix}"
        else:
            todo = (
                "set token_processor_config.algorithm to the engines' --prefix-caching-hash-algo "
                "(sha256_cbor: vllm_sha256_cbor, sha256: vllm_sha256; vLLM's xxhash algorithms cannot be "
                "reproduced) and engine_hash_seed to their PYTHONHASHSEED, or use algorithm: xxh3_chain"
            )
        self._set(HASH_ALGORITHM, (
            f"{self.pod}: engine block hashes differ from token_processor_config.algorithm {tp.algorithm} "
            f"(engine_hash_seed {tp.engine_hash_seed!r}) for the same tokens, so no prompt matches: {todo}"
        ))

    def _set(self, reason: str, message: str) -> None:
        old = next((p for p in self.problems if p.reason == reason), None)
        if old is not None and old.message == message:
            return
        self.problems = tuple(sorted(
            [p for p in self.problems if p.reason != reason] + [Misconfig(reason, message)],
            key=lambda p: REASONS.index(p.reason),
        ))
        log.warning("kvevents: misconfigured: %s", message)

    def _clear(self, reason: str) -> None:
        if any(p.reason == reason for p in self.problems):
            self.problems = tuple(p for p in self.problems if p.reason != reason)
            log.warning("kvevents: %s (rank %s, model %r): %s matches now", self.pod, self.dp_rank, self.model, reason)


def _hashable(ev: BlockStored, bs: int) -> bool:
    """A sequence start whose first block's hash depends on its tokens alone (no LoRA, salt or extras)."""
    return (
        ev.parent_block_hash is None
        and bool(ev.block_hashes)
        and len(ev.token_ids) >= bs
        and not ev.sparse  # a sparse store's first hash need not be its first chunk's
        and ev.lora_name is None
        and not ev.lora_id
        and ev.cache_salt is None
        and (ev.extra_keys is None or ev.extra_keys[0] is None or not ev.extra_keys[0])
    )
