"""A thin vLLM 0.32 KV-event encoder for the simulated pods.

Mirrors vllm/distributed/kv_events.py (vLLM 0.32): a batch is the msgpack
array ``[ts, events, data_parallel_rank]``; each event is a msgpack map tagged
``"type"``; fields holding their default are left out (msgspec
``omit_defaults``).  The three ZMQ frames are the topic ``kv@<pod>@<model>``,
the sequence number (8 bytes big-endian, from 0) and the payload.  The
library's decoder (:func:`kvevents.wire.decode_vllm_batch`) reads these; this
module only writes them.
"""

from __future__ import annotations

import msgspec

__all__ = ["BlockRemoved", "BlockStored", "encode_batch", "topic"]


class BlockStored(msgspec.Struct, tag_field="type", tag="BlockStored", omit_defaults=True):
    """Blocks newly stored in the pod's prefix cache (hashes: unsigned 64-bit ints).

    token_ids covers exactly the stored blocks (``block_size * len(block_hashes)``);
    parent_block_hash is the hash of the block before the first one (None at
    the start of a sequence).
    """

    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None = None
    medium: str | None = None
    lora_name: str | None = None


class BlockRemoved(msgspec.Struct, tag_field="type", tag="BlockRemoved", omit_defaults=True):
    """Blocks evicted from the pod's prefix cache."""

    block_hashes: list[int]
    medium: str | None = None


_ENC = msgspec.msgpack.Encoder()


def encode_batch(ts: float, events: list[BlockStored | BlockRemoved], dp_rank: int = 0) -> bytes:
    """The payload frame of one KV-event batch (``ts``: the engine's clock, seconds)."""
    return _ENC.encode((ts, events, dp_rank))


def topic(pod: str, model: str) -> bytes:
    """The topic frame vLLM publishes under: ``kv@<pod>@<model>``."""
    return f"kv@{pod}@{model}".encode()
