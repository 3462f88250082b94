"""Engine-neutral domain events of the write path.

Every engine adapter (:mod:`kvevents.wire` for vLLM, :mod:`kvevents.sglang`
for SGLang) turns the bytes of one published message into one
:class:`EventBatch` of these events; the pool applies them to the index.

All structs are frozen (immutable, hashable, safe to share between threads)
and hold only tuples, ints, strings and None.  Block hashes are *engine keys*
normalised to unsigned 64-bit ints (``0 <= h < 2**64``, see
:func:`kvevents.wire.normalize_block_hash`), whatever form the engine sent.
"""

from __future__ import annotations

import msgspec

__all__ = ["AllBlocksCleared", "BlockRemoved", "BlockStored", "Event", "EventBatch"]


class BlockStored(msgspec.Struct, frozen=True, gc=False):
    """A pod stored ``len(block_hashes)`` consecutive full blocks in one tier.

    Mirrors vllm/distributed/kv_events.py ``BlockStored`` (vLLM 0.32; 0.33
    and 0.34 add ``lookahead_token_ids``) and SGLang's python/sglang/srt/disaggregation/kv_events.py ``BlockStored``.

    Attributes:
        block_hashes: engine keys of the stored blocks, in sequence order, as
            uint64 ints.
        parent_block_hash: uint64 engine key of the block just before the
            first stored one; None when the first block starts a sequence.
        token_ids: the stored blocks' tokens, ``block_size`` per block
            (``len == block_size * len(block_hashes)``), or ``()`` for a
            token-less store (vLLM's CPU offloading connector publishes engine
            hashes and a medium but no tokens).  A sliding-window or Mamba
            group's store under vLLM's default sparse retention covers more
            whole blocks than it names (``block_hashes`` skips the blocks the
            group does not keep, without saying which: vLLM #44451); see
            :attr:`sparse`.
        block_size: tokens per block (>= 1).
        tier: where the pod holds the blocks: ``"gpu"``, ``"cpu"``,
            ``"storage"`` or another lower-case name
            (from vLLM's ``medium`` via :func:`kvindex.tiers.tier_from_medium`).
        lora_id: vLLM's deprecated numeric adapter id / SGLang's lora_id.
        lora_name: LoRA adapter name the blocks were computed with (vLLM).
        extra_keys: per block, the engine's untagged extra hash inputs (LoRA
            name, (mm_identifier, offset) pairs, cache salt, prompt-embedding
            digests) or None; nested lists turned into tuples.  None when the
            engine sent none.  When given, ``len == len(block_hashes)``.
        group_idx: KV-cache group index (hybrid models), None if unsent.
        kv_cache_spec_kind: the group's KV-cache spec kind, e.g.
            ``"full_attention"`` or ``"sliding_window"`` (vLLM).
        kv_cache_spec_sliding_window: the group's window in tokens, if any.
        locality: ``"LOCAL"`` / ``"REMOTE"`` relative to the publisher, None
            when unspecified (vLLM, verbatim).
        ownership: secondary offloading tier identifier, None if unsent (vLLM).
        session_id: session that triggered the store or reuse report.
        cache_salt: the request's cache salt when the engine sends it as its
            own field (SGLang's BlockStored metadata); vLLM puts the salt in
            ``extra_keys`` instead and leaves this None.
        lookahead_token_ids: per block, the tokens after it that its hash also
            covers (vLLM 0.33+ lookahead hashing, EAGLE-style speculative
            decoding), one tuple per ``block_hashes`` entry; None when the
            engine hashes without lookahead (vLLM 0.32, or the option off).
    """

    block_hashes: tuple[int, ...]
    parent_block_hash: int | None
    token_ids: tuple[int, ...]
    block_size: int
    tier: str
    lora_id: int | None = None
    lora_name: str | None = None
    extra_keys: tuple[tuple | None, ...] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    locality: str | None = None
    ownership: str | None = None
    session_id: str | None = None
    cache_salt: str | None = None
    lookahead_token_ids: tuple[tuple[int, ...], ...] | None = None

    @property
    def sparse(self) -> bool:
        """More tokens than named blocks: a sparse sliding-window / Mamba store (which chunk each hash is, unknown)."""
        return len(self.token_ids) > self.block_size * len(self.block_hashes)


class BlockRemoved(msgspec.Struct, frozen=True, gc=False):
    """A pod dropped these blocks from one tier.

    Mirrors vllm/distributed/kv_events.py ``BlockRemoved`` (vLLM 0.32) and
    SGLang's ``BlockRemoved``.

    Attributes:
        block_hashes: uint64 engine keys of the removed blocks.
        tier: the tier they left (see :class:`BlockStored`).
        group_idx: KV-cache group index, None if unsent.
        locality: ``"LOCAL"`` / ``"REMOTE"``, None when unspecified.
        ownership: secondary offloading tier identifier, None if unsent.
    """

    block_hashes: tuple[int, ...]
    tier: str
    group_idx: int | None = None
    locality: str | None = None
    ownership: str | None = None


class AllBlocksCleared(msgspec.Struct, frozen=True, gc=False):
    """The pod (this DP rank) dropped every block in every tier.

    Mirrors vllm/distributed/kv_events.py ``AllBlocksCleared`` (vLLM 0.32):
    sent after a prefix-cache reset, followed by fresh BlockStored events and
    no per-block BlockRemoved.
    """


Event = BlockStored | BlockRemoved | AllBlocksCleared
"""Any one domain event."""


class EventBatch(msgspec.Struct, frozen=True, gc=False):
    """The events of one published message, in engine order.

    Mirrors the payload ``[ts, events, data_parallel_rank]`` of vLLM 0.32's
    ``KVEventBatch`` (SGLang: ``[ts, events, attn_dp_rank]``).

    Attributes:
        ts: engine wall-clock time of the batch, seconds since the epoch
            (never compare it with this process's clocks).
        events: the decoded events, in order.
        dp_rank: data-parallel rank of the publisher; None when the engine
            did not send one.
        skipped_events: events of a type this library does not know (a newer
            engine's), left out of ``events``; count them, they are not errors.
        bad_events: the :class:`~kvevents.wire.PayloadError` kind of each
            event of a known type that was malformed and left out of
            ``events`` (the batch's other events are kept, in order); errors.
    """

    ts: float
    events: tuple[Event, ...]
    dp_rank: int | None
    skipped_events: int = 0
    bad_events: tuple[str, ...] = ()
