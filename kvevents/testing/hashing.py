"""vLLM's prefix-cache block hashes, as a fake engine computes them.

Mirrors vllm/v1/core/kv_cache_utils.py ``hash_block_tokens`` and
vllm/utils/hashing.py (vLLM 0.32) for blocks without extra keys:
``h_i = sha256(serialise((h_{i-1} or NONE_HASH, tuple(block_tokens), None)))``
with ``NONE_HASH = sha256(serialise(seed))``; ``serialise`` is pickle protocol
5 (``sha256``) or canonical CBOR (``sha256_cbor``).  Written independently of
:mod:`kvindex.keys`, so each checks the other.
"""

from __future__ import annotations

import hashlib
import pickle
from collections.abc import Sequence
from typing import Literal

import cbor2

__all__ = ["HashAlgo", "HashForm", "VLLM_SEED", "block_digests", "digest_to_uint64", "none_hash", "wire_hash"]

HashForm = Literal["uint64", "int64", "bytes"]
HashAlgo = Literal["sha256", "sha256_cbor"]

#: vLLM's NONE_HASH seed string when PYTHONHASHSEED is unset.
VLLM_SEED = "vllm-none-hash"

HASH_FORMS = ("uint64", "int64", "bytes")
HASH_ALGOS = ("sha256", "sha256_cbor")
_U64 = 1 << 64
_I64_MIN = 1 << 63


def _serialise(obj: object, algo: str) -> bytes:
    if algo == "sha256":
        return pickle.dumps(obj, protocol=5)
    return cbor2.dumps(obj, canonical=True)


def none_hash(seed: str = VLLM_SEED, algo: HashAlgo = "sha256") -> bytes:
    """Return the 32-byte root digest of every block chain (vLLM's NONE_HASH) for ``seed``.

    Raises:
        ValueError: unknown algo.
    """
    if algo not in HASH_ALGOS:
        raise ValueError(f"algo must be one of {HASH_ALGOS}, got {algo!r}")
    return hashlib.sha256(_serialise(seed, algo)).digest()


def block_digests(
    tokens: Sequence[int],
    block_size: int,
    seed: str = VLLM_SEED,
    algo: HashAlgo = "sha256",
) -> list[bytes]:
    """Return the chained 32-byte digests of the full blocks of ``tokens`` (a partial tail gets none).

    Args:
        tokens: token ids.
        block_size: tokens per block, >= 1.
        seed: NONE_HASH seed string (vLLM: PYTHONHASHSEED if set, else "vllm-none-hash").
        algo: "sha256" or "sha256_cbor".

    Raises:
        ValueError: block_size < 1 or unknown algo.
    """
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    parent = none_hash(seed, algo)
    toks = [int(t) for t in tokens]
    out: list[bytes] = []
    for start in range(0, len(toks) - block_size + 1, block_size):
        block = tuple(toks[start : start + block_size])
        parent = hashlib.sha256(_serialise((parent, block, None), algo)).digest()
        out.append(parent)
    return out


def digest_to_uint64(digest: bytes) -> int:
    """Return the unsigned 64-bit block hash of a digest: its last 8 bytes, big-endian."""
    return int.from_bytes(digest[-8:], "big")


def wire_hash(digest: bytes, form: HashForm) -> int | bytes:
    """Return ``digest`` in a wire form of vLLM's events.

    Args:
        digest: a 32-byte block digest.
        form: "uint64" (0 <= h < 2**64; values >= 2**63 occur), "int64" (the
            same 8 bytes as a signed integer, as older consumers met) or
            "bytes" (the raw digest, ``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0``).

    Raises:
        ValueError: unknown form.
    """
    if form == "bytes":
        return digest
    value = digest_to_uint64(digest)
    if form == "uint64":
        return value
    if form == "int64":
        return value - _U64 if value >= _I64_MIN else value
    raise ValueError(f"form must be one of {HASH_FORMS}, got {form!r}")
