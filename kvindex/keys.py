"""Token processor: prompt tokens -> one request key per full block.

A request key is an unsigned 64-bit integer naming a block of ``block_size``
tokens *together with everything before it* (keys are chained), inside one
scope (model name, LoRA adapter).  The read path turns a prompt into request
keys and asks the index which pods hold them; the write path continues a chain
from an event's parent block (:meth:`TokenProcessor.chain`).

Three algorithms (:data:`ALGORITHMS`):

``"xxh3_chain"`` (default) -- our own fast keyed hash, specified below.
    Deterministic across processes, machines and releases (a golden vector in
    tests/test_keys.py pins it), vectorised with numpy: no Python loop per token
    or per block (only per block that carries extra keys).  Not cryptographic:
    it separates honest prompts, it does not resist a caller who crafts
    collisions while knowing ``hash_seed``.

``"vllm_sha256_cbor"`` and ``"vllm_sha256"`` -- engine-hash-compatible mode.
    Request keys ARE vLLM's own prefix-cache block hashes (its
    ``--prefix-caching-hash-algo`` ``sha256_cbor`` and ``sha256``) in the uint64
    form vLLM publishes in KV events, so the index needs no engine key ->
    request key map.  Mirrors vllm/v1/core/kv_cache_utils.py
    (``hash_block_tokens``, ``init_none_hash``, ``generate_block_hash_extra_keys``,
    ``maybe_convert_block_hash``) and vllm/utils/hashing.py (``sha256``,
    ``sha256_cbor``), vLLM 0.32.  Costs one SHA-256 per block (a Python loop
    per block).  Specified in :ref:`compat` below.

Extra keys
----------
``block_extra_keys`` carries per-block extras in the *untagged* form vLLM's KV
events publish (vllm/v1/core/kv_cache_utils.py ``to_event_extra_keys``), one
entry per block, ``None`` (or an empty sequence) for none, else a sequence of:

* ``(mm_identifier: str, offset: int)`` -- a multimodal item in the block; the
  offset is where the item starts relative to the block's first token
  (negative when it started in an earlier block);
* ``salt: str`` -- the cache salt (only ever on a sequence's first block);
* ``digest: bytes`` -- a prompt-embedding digest.

The LoRA adapter name, which vLLM's events put first in every block's extras,
must NOT be included: pass it as ``lora`` (see
:func:`extra_keys_from_event`, which strips it).  ``cache_salt=`` of
:meth:`TokenProcessor.request_keys` is placed into block 0's extras where vLLM
puts it: after the multimodal pairs, before any prompt-embedding digest.
An empty salt counts as no salt (vLLM tests the salt for truth).

Specification of ``"xxh3_chain"``
---------------------------------
All arithmetic is on unsigned 64-bit integers modulo 2**64.  ``xxh3_64(b)`` is
XXH3-64 of bytes ``b`` with seed 0.  ``msgpack(x)`` is the MessagePack encoding
with the smallest width for every integer and string length (what
``msgspec.msgpack.encode`` produces; tuples and lists are both arrays, str is
str, bytes is bin).

1. Seed: an int ``hash_seed`` in [0, 2**64) is used as is; a str seed becomes
   ``xxh3_64(seed.encode("utf-8"))``.
2. Constants from a splitmix64 stream started at the seed::

       next(): state = state + 0x9E3779B97F4A7C15
               z = (state ^ (state >> 30)) * 0xBF58476D1CE4E5B9
               z = (z ^ (z >> 27)) * 0x94D049BB133111EB
               return z ^ (z >> 31)

   drawn in this order: ``A = next() | 1``, ``E = next() | 1``,
   ``D = next()``, then ``K[t] = next() | 1`` for ``t = 0 .. block_size - 1``.
3. ``fmix64(x)`` (MurmurHash3's finaliser, a bijection)::

       x ^= x >> 33; x *= 0xFF51AFD7ED558CCD
       x ^= x >> 33; x *= 0xC4CEB9FE1A85EC53
       x ^= x >> 33

4. Chain root of a scope: ``R = fmix64(D ^ xxh3_64(msgpack([model, lora])))``
   where ``model`` and ``lora`` are the str names or nil.
5. Block ``i`` with tokens ``x[i*bs .. i*bs+bs-1]`` and extras ``X_i``::

       u_i = sum_t x[i*bs+t] * K[t]   (+ E * xxh3_64(msgpack(X_i)) if X_i is non-empty)
       v_i = fmix64(u_i)
       key_{-1} = R;   key_i = A * key_{i-1} + v_i

   where ``X_i`` is the list of block i's extras as given (a multimodal pair is
   a 2-element array ``[identifier, offset]``), with the salt already placed in
   block 0.

The recurrence is evaluated without a loop: with ``Ainv = A**-1 mod 2**64``,
``key_i = A**i * (A*R + sum_{j<=i} v_j * Ainv**j)`` (a cumulative sum and two
power tables grown on demand).  The key is the whole chain state, so
:meth:`TokenProcessor.chain` continues from an event's parent key without
knowing its position.

Why this is enough: ``u_i`` is a seed-keyed linear hash of the block (two
given blocks that differ collide only if ``sum_t (x_t - x'_t) * K[t]`` is 0
mod 2**64, which for seed-derived odd multipliers happens with probability
about 2**-64, times 2**k when every difference is a multiple of 2**k);
``fmix64`` turns it into a well-mixed, *nonlinear* value, so the linear chain
cannot line differences of several blocks up; and the chain step
``k -> A*k + v`` is a bijection of the previous key for fixed block content:
two sequences whose keys differ at block ``i-1`` and that share block ``i``
also differ at block ``i``, and two scopes differ at every depth
(``A**(i+1) * (R - R')`` is never 0).  A finaliser on the output would add no
collision resistance (it would be a bijection) and cost about a quarter of the
time, since at these sizes the cost is numpy calls, not data.

.. _compat:

Specification of the engine-compatible algorithms
-------------------------------------------------
``H(obj)`` is ``sha256(pickle.dumps(obj, protocol=5))`` for ``"vllm_sha256"``
and ``sha256(cbor2.dumps(obj, canonical=True))`` for ``"vllm_sha256_cbor"``.

* ``NONE_HASH = H(seed)`` where ``seed`` is the engines' ``PYTHONHASHSEED``
  value (``engine_hash_seed``), or ``"vllm-none-hash"`` when they run without
  it.  (vLLM's ``xxhash`` algorithms use a random per-process seed and are not
  offered.)
* ``h_i = H((h_{i-1} or NONE_HASH, tuple(block_i_tokens), extras_i))``: a
  32-byte digest; ``extras_i`` is ``None`` when the block has no extra keys,
  else a tuple of *tagged* keys in vLLM's order: ``("lora", name, path)``,
  then ``("mm", identifier, offset)`` per item, then ``("cache_salt", salt)``
  (block 0), then ``("prompt_embeds", digest)``.
* Published key: the last 8 bytes of ``h_i`` read big-endian.
* Lookahead (``hash_lookahead_tokens`` L > 0; vLLM 0.33+ with EAGLE-style
  speculative decoding, vllm/v1/core/kv_cache_utils.py
  ``get_request_block_hasher``): block i is hashed only once the L tokens after
  it exist, and its hash input becomes ``(h_{i-1} or NONE_HASH,
  tuple(block_i_tokens), (extras_i, *next_L_tokens))`` (``extras_i`` may be
  None).  A prompt of N tokens gets ``(N - L) // block_size`` keys.  Each
  block's extras then cover the block and its L lookahead tokens, as the
  engine's events carry them (a multimodal item starting within those tokens
  belongs to the block, its offset counted from the block's start).  With
  ``"xxh3_chain"`` the option only drops the tail blocks (own keys cannot see
  the lookahead tokens).

``hash_seed`` and ``model`` play no part (vLLM's hash has neither).  LoRA: the
engine hashes the adapter *path* as well as its name, and events carry only the
name, so a LoRA-scoped engine key needs the path: pass ``lora`` as a
``(name, path)`` tuple, or as a name listed in the ``lora_paths`` mapping given
to the processor; a bare name without a known path raises ValueError.

``"vllm_sha256"`` pickles Python objects, and pickle shares equal objects that
are the *same* object.  We pickle every caller string as its own object and the
tag strings as shared constants, which is what the engine does unless one
block's extras hold one string object twice (e.g. the same image twice inside
one block with one identifier object); such a block may hash differently.
``"vllm_sha256_cbor"`` has no such ambiguity and is the better choice.

The uint64 key keeps 64 of the digest's 256 bits, so the parent digest cannot
be recovered from an event's parent key: in compat mode :meth:`chain` continues
only from the root (``parent_key=None``) or from a full 32-byte digest
(engines started with ``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0``); from a uint64
parent it raises NotImplementedError.  The index uses engine keys directly in
this mode, so the event path never needs it.
"""

from __future__ import annotations

import array
import hashlib
import pickle
import threading
from collections.abc import Mapping, Sequence
from operator import mul as _imul
from typing import Any, Final

import cbor2
import msgspec
import numpy as np
import xxhash

from kvindex.accel import native
from kvindex.id_arrays import _EMPTY, _check_ids, _keys_to_u64, _tokens_to_u64
from kvindex.key_extras import _fresh, _normalise_extras

__all__ = [
    "ALGORITHMS",
    "DEFAULT_ENGINE_HASH_SEED",
    "TokenProcessor",
    "digest_to_key",
    "extra_keys_from_event",
]

#: Names accepted by :class:`TokenProcessor` ``algorithm``.
ALGORITHMS: Final = ("xxh3_chain", "vllm_sha256_cbor", "vllm_sha256")

#: Seed string vLLM hashes into NONE_HASH when PYTHONHASHSEED is unset
#: (vllm/v1/core/kv_cache_utils.py DEFAULT_NONE_HASH_SEED, vLLM 0.32).
DEFAULT_ENGINE_HASH_SEED: Final = "vllm-none-hash"

_M64: Final = (1 << 64) - 1
_FMIX_M1: Final = 0xFF51AFD7ED558CCD
_FMIX_M2: Final = 0xC4CEB9FE1A85EC53
_U33: Final = np.uint64(33)
_NP_M1: Final = np.uint64(_FMIX_M1)
_NP_M2: Final = np.uint64(_FMIX_M2)
_rshift: Final = np.right_shift
_xor: Final = np.bitwise_xor
_mul: Final = np.multiply
_ENCODER: Final = msgspec.msgpack.Encoder()
_INITIAL_POWERS: Final = 1024
#: chain() of up to this many blocks given as a list/tuple runs on Python ints
_SCALAR_MAX_BLOCKS: Final = 4
_MAX_ROOTS: Final = 4096

# Tags vLLM puts inside its hash (shared constant objects, like vLLM's literals).
_TAG_LORA: Final = "lora"
_TAG_MM: Final = "mm"
_TAG_SALT: Final = "cache_salt"
_TAG_EMBEDS: Final = "prompt_embeds"


# ---------------------------------------------------------------------------
# scalar helpers


def _splitmix64(state: int) -> tuple[int, int]:
    """One splitmix64 step: returns (new state, output)."""
    state = (state + 0x9E3779B97F4A7C15) & _M64
    z = ((state ^ (state >> 30)) * 0xBF58476D1CE4E5B9) & _M64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _M64
    return state, z ^ (z >> 31)


def _fmix64(x: int) -> int:
    """MurmurHash3 fmix64 on a Python int in [0, 2**64)."""
    x ^= x >> 33
    x = (x * _FMIX_M1) & _M64
    x ^= x >> 33
    x = (x * _FMIX_M2) & _M64
    return x ^ (x >> 33)


def _fmix64_inplace(x: np.ndarray, tmp: np.ndarray | None = None) -> np.ndarray:
    """Vectorised fmix64 of a uint64 array, in place (wraps mod 2**64).

    ``tmp``: optional scratch array of x's shape and dtype (saves allocations).
    """
    if tmp is None:
        tmp = np.empty_like(x)
    _rshift(x, _U33, out=tmp)
    _xor(x, tmp, out=x)
    _mul(x, _NP_M1, out=x)
    _rshift(x, _U33, out=tmp)
    _xor(x, tmp, out=x)
    _mul(x, _NP_M2, out=x)
    _rshift(x, _U33, out=tmp)
    _xor(x, tmp, out=x)
    return x


def digest_to_key(digest: bytes) -> int:
    """uint64 form of an engine block hash: its last 8 bytes, big-endian.

    Mirrors vllm/v1/core/kv_cache_utils.py ``maybe_convert_block_hash``
    (vLLM 0.32), the form KV events carry by default.  Raises ValueError for
    fewer than 8 bytes.
    """
    if len(digest) < 8:
        raise ValueError(f"a block hash digest has at least 8 bytes, got {len(digest)}")
    return int.from_bytes(digest[-8:], "big")


def int_lora_scope(extra_keys: Sequence[Sequence[Any] | None] | None) -> str | None:
    """The LoRA scope of an old engine's event whose extras start with an integer adapter id.

    vLLM engines older than the ``lora_name`` event field put the request's
    numeric LoRA id (``lora_int_id``) first in every block's extras.  The
    router cannot know which adapter name that id stands for, so such blocks
    are scoped by the pseudo LoRA name ``"lora_int_id:<n>"``: they are kept
    (and their children chain from them) but never match a base-model or a
    named-LoRA request.  Returns that name, or None when the first block's
    extras do not start with an int (bool excluded).
    """
    if not extra_keys:
        return None
    first = extra_keys[0]
    if first is None or len(first) == 0:
        return None
    head = first[0]
    if type(head) is int:
        return f"lora_int_id:{head}"
    return None


def extra_keys_from_event(
    extra_keys: Sequence[Sequence[Any] | None] | None, lora_name: str | None
) -> list[tuple[Any, ...] | None] | None:
    """Per-block extras of a BlockStored event, minus the LoRA name.

    vLLM's events (vllm/v1/core/kv_cache_utils.py ``to_event_extra_keys``,
    vLLM 0.32) put the LoRA name first in every block's extras when the event
    has a ``lora_name``; :meth:`TokenProcessor.chain` takes the LoRA as
    ``lora=`` instead.  Returns one tuple (or None) per block, None for None.
    Raises ValueError when ``lora_name`` is set but a block's extras do not
    start with it.  An old engine's integer LoRA id first in the extras (see
    :func:`int_lora_scope`) is stripped like a name; the caller scopes the
    keys by ``int_lora_scope(extra_keys)``.
    """
    if extra_keys is None:
        return None
    out: list[tuple[Any, ...] | None] = []
    int_id = extra_keys[0][0] if lora_name is None and int_lora_scope(extra_keys) is not None else None  # type: ignore[index]
    for entry in extra_keys:
        if entry is None:
            if lora_name is not None:
                raise ValueError("event extra keys lack the LoRA name on a block")
            out.append(None)
            continue
        items = tuple(entry)
        if lora_name is not None:
            if not items or items[0] != lora_name:
                raise ValueError("event extra keys do not start with the LoRA name")
            items = items[1:]
        elif int_id is not None:
            if not items or type(items[0]) is not int or items[0] != int_id:
                raise ValueError("event extra keys do not start with the same integer LoRA id")
            items = items[1:]
        out.append(items or None)
    return out


# ---------------------------------------------------------------------------
# argument normalisation


# ---------------------------------------------------------------------------


class TokenProcessor:
    """Turns tokens into request keys, one uint64 per full block.

    ``block_size``: tokens per block (>= 1; must equal the engines' hash block
    size for the compat algorithms).  ``hash_seed``: int in [0, 2**64) or str,
    keys the ``"xxh3_chain"`` algorithm (every router of a fleet must share it;
    unused by the compat algorithms).  ``algorithm``: one of
    :data:`ALGORITHMS`.  ``engine_hash_seed``: for the compat algorithms, the
    engines' ``PYTHONHASHSEED`` value, None meaning unset (NONE_HASH then comes
    from ``"vllm-none-hash"``, vllm/v1/core/kv_cache_utils.py
    ``resolve_none_hash_seed``, vLLM 0.32).  ``lora_paths``: adapter name ->
    adapter path, used by the compat algorithms for a ``lora`` given by name.
    ``hash_lookahead_tokens``: the engines' ``num_hash_lookahead_tokens`` L
    (vLLM 0.33+ config/vllm.py; 0 = no lookahead, the keys of vLLM 0.32): a
    block gets a key only when L tokens follow it, and in compat mode its key
    covers them (module docstring).

    Raises ValueError for ``block_size < 1``, an unknown algorithm or an int
    seed out of range; TypeError for wrongly typed arguments.

    Thread-safe: any number of threads may call the methods concurrently.
    The full specification of every algorithm is in the module docstring.
    """

    block_size: int
    algorithm: str
    engine_compatible: bool

    def __init__(
        self,
        block_size: int = 16,
        hash_seed: int | str = 0,
        algorithm: str = "xxh3_chain",
        engine_hash_seed: str | None = None,
        *,
        lora_paths: Mapping[str, str] | None = None,
        hash_lookahead_tokens: int = 0,
    ) -> None:
        if not isinstance(block_size, int) or isinstance(block_size, bool):
            raise TypeError(f"block_size must be int, got {type(block_size).__name__}")
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        if algorithm not in ALGORITHMS:
            raise ValueError(f"unknown algorithm {algorithm!r}; expected one of {ALGORITHMS}")
        if isinstance(hash_seed, bool) or not isinstance(hash_seed, (int, str)):
            raise TypeError(f"hash_seed must be int or str, got {type(hash_seed).__name__}")
        if isinstance(hash_seed, int) and not 0 <= hash_seed <= _M64:
            raise ValueError(f"an int hash_seed must be in [0, 2**64), got {hash_seed}")
        if engine_hash_seed is not None and not isinstance(engine_hash_seed, str):
            raise TypeError("engine_hash_seed must be a str (a PYTHONHASHSEED value) or None")
        if not isinstance(hash_lookahead_tokens, int) or isinstance(hash_lookahead_tokens, bool):
            raise TypeError(f"hash_lookahead_tokens must be int, got {type(hash_lookahead_tokens).__name__}")
        if hash_lookahead_tokens < 0:
            raise ValueError(f"hash_lookahead_tokens must be >= 0, got {hash_lookahead_tokens}")
        self.hash_lookahead_tokens = hash_lookahead_tokens
        self.block_size = block_size
        self.algorithm = algorithm
        self.engine_compatible = algorithm != "xxh3_chain"
        self.hash_seed = hash_seed
        self.engine_hash_seed = engine_hash_seed
        self._lora_paths = dict(lora_paths or {})

        seed = hash_seed if isinstance(hash_seed, int) else xxhash.xxh3_64_intdigest(
            hash_seed.encode("utf-8")
        )
        draws = []
        state = seed
        for _ in range(3 + block_size):
            state, out = _splitmix64(state)
            draws.append(out)
        self._A = draws[0] | 1
        self._E = draws[1] | 1
        self._D = draws[2]
        self._K = np.array([k | 1 for k in draws[3:]], dtype=np.uint64)
        self._np_E = np.uint64(self._E)
        self._K_list = [int(k) for k in self._K]
        self._Ainv = pow(self._A, -1, 1 << 64)
        self._powers: tuple[np.ndarray, np.ndarray] = self._make_powers(_INITIAL_POWERS)
        self._roots: dict[tuple[str | None, str | None], int] = {}
        self._grow_lock = threading.Lock()

        if self.engine_compatible:
            self._H = _sha256_cbor if algorithm == "vllm_sha256_cbor" else _sha256_pickle
            none_seed = DEFAULT_ENGINE_HASH_SEED if engine_hash_seed is None else engine_hash_seed
            self._none_hash: bytes = self._H(none_seed)

    def __repr__(self) -> str:
        ahead = f", hash_lookahead_tokens={self.hash_lookahead_tokens}" if self.hash_lookahead_tokens else ""
        return (
            f"TokenProcessor(block_size={self.block_size}, algorithm={self.algorithm!r}, "
            f"engine_hash_seed={self.engine_hash_seed!r}{ahead})"
        )

    # -- public API ---------------------------------------------------------

    def request_keys(
        self,
        tokens: Sequence[int] | np.ndarray,
        *,
        model: str | None = None,
        lora: str | tuple[str, str] | None = None,
        block_extra_keys: Sequence[Sequence[Any] | None] | None = None,
        cache_salt: str | None = None,
        prefix_keys: Sequence[int] | np.ndarray | None = None,
    ) -> np.ndarray:
        """Request keys of a prompt: uint64 array, shape ``(len(tokens) // block_size,)``.

        ``tokens``: list/tuple of ints or a 1-D integer numpy array, ids in
        [0, 2**64).  Only full blocks get a key (a prompt shorter than one
        block gives an empty array).  ``model``/``lora`` scope the chain root
        (``"xxh3_chain"``; ``lora`` may be a name or a ``(name, path)`` tuple,
        only the name counts).  ``block_extra_keys``: untagged per-block extras
        (module docstring), one entry per full block, or per block counting a
        trailing partial one (whose entry is then ignored); no LoRA name in
        them.  ``cache_salt`` goes into block 0's extras like vLLM does.

        In compat mode the keys are vLLM's block hashes (uint64 form) for the
        same tokens, extras, salt and LoRA (which then needs its path).  With
        ``hash_lookahead_tokens`` L, only ``(len(tokens) - L) // block_size``
        blocks get a key (the engine hashes no block before L tokens follow it).

        ``prefix_keys``: the keys of a previous prompt (same model, LoRA, salt
        and extras) whose first ``len(prefix_keys) * block_size`` tokens are
        those of ``tokens``; ``"xxh3_chain"`` keeps them and hashes only the
        blocks after them (the caller vouches for the equal prefix: its ids
        are not read). Compat mode ignores them.

        Raises TypeError for wrongly typed tokens/extras, ValueError for
        negative token ids, a wrong number of extras entries, a salt given
        twice, or (compat mode) a LoRA name without a known path.
        """
        if prefix_keys is not None and not self.engine_compatible:
            return self._continue_keys(tokens, prefix_keys, model, lora, block_extra_keys, cache_salt)
        toks = _tokens_to_u64(tokens)
        bs = self.block_size
        n = max(toks.shape[0] - self.hash_lookahead_tokens, 0) // bs
        allowed = (n, toks.shape[0] // bs, -(-toks.shape[0] // bs))
        extras = _normalise_extras(block_extra_keys, n, allowed, cache_salt)
        self._check_scope(model, lora)
        if self.engine_compatible:
            digests = self._engine_digests(None, toks, extras, lora, n)
            return np.array([digest_to_key(d) for d in digests], dtype=np.uint64)
        if n == 0:
            return _EMPTY.copy()
        return self._xxh3_keys(self._root(model, lora), toks, n, extras)

    def _continue_keys(self, tokens: Any, prefix_keys: Any, model: str | None, lora: Any,
                       block_extra_keys: Any, cache_salt: str | None) -> np.ndarray:
        """:meth:`request_keys` of ``tokens`` whose first blocks have ``prefix_keys`` (xxh3_chain)."""
        _check_ids(tokens, "tokens")
        bs, total = self.block_size, len(tokens)
        n = max(total - self.hash_lookahead_tokens, 0) // bs
        extras = _normalise_extras(block_extra_keys, n, (n, total // bs, -(-total // bs)), cache_salt)
        self._check_scope(model, lora)
        head = _keys_to_u64(prefix_keys, "prefix_keys")
        m = min(len(head), n)
        rest = _tokens_to_u64(tokens[m * bs :])  # every id the prefix does not cover is checked
        if m == n:
            return head[:m].copy()
        state = int(head[m - 1]) if m else self._root(model, lora)
        more = extras[m:] if extras is not None and any(e is not None for e in extras[m:]) else None
        if more is None and native is not None:
            new = np.frombuffer(native.xxh3_chain(state, rest, self._K, self._A), dtype=np.uint64)[: n - m]
        else:
            new = self._xxh3_keys(state, rest[: (n - m) * bs], n - m, more)
        return np.concatenate((head[:m], new)) if m else new.copy()

    def chain(
        self,
        parent_key: int | bytes | None,
        tokens: Sequence[int] | np.ndarray,
        *,
        model: str | None = None,
        lora: str | tuple[str, str] | None = None,
        block_extra_keys: Sequence[Sequence[Any] | None] | None = None,
    ) -> np.ndarray:
        """Continue a chain: keys of the blocks of ``tokens`` after ``parent_key``.

        The write path's call for a BlockStored event: ``parent_key`` is the
        request key of the block before the first one (None = the start of a
        sequence in the ``(model, lora)`` scope; with a parent, model and lora
        are already inside the parent key and are ignored by ``"xxh3_chain"``).
        ``len(tokens)`` must be a multiple of ``block_size``.
        ``block_extra_keys`` has exactly one entry per block of ``tokens``
        and already holds the salt if the first block is the sequence's first
        (as in events; strip the LoRA name with :func:`extra_keys_from_event`).
        Returns a uint64 array of shape ``(len(tokens) // block_size,)``.

        For every split point k:
        ``chain(request_keys(t[:k*bs])[-1], t[k*bs:]) == request_keys(t)[k:]``.

        Compat mode: a uint64 parent keeps only 64 bits of the engine's digest,
        so it raises NotImplementedError; ``parent_key=None`` or the full
        32-byte parent digest (bytes) work.  Raises ValueError for a length not
        a multiple of the block size, a parent key out of range or a wrong
        number of extras entries; TypeError for wrong types.
        """
        bs = self.block_size
        scalar = (
            isinstance(tokens, (list, tuple))
            and len(tokens) <= _SCALAR_MAX_BLOCKS * bs
            and not self.engine_compatible
        )
        # the event path's common case, a few blocks given as a list/tuple, runs on Python ints
        toks = tokens if scalar else _tokens_to_u64(tokens)
        if len(toks) % bs:
            raise ValueError(f"chain() needs whole blocks: {len(toks)} tokens is not a multiple of {bs}")
        n = len(toks) // bs
        extras = _normalise_extras(block_extra_keys, n, (n,), None)
        if isinstance(parent_key, bool) or not (
            parent_key is None or isinstance(parent_key, (int, bytes, np.integer))
        ):
            raise TypeError(f"parent_key must be int, bytes or None, got {type(parent_key).__name__}")
        self._check_scope(model, lora)
        if self.engine_compatible:
            if self.hash_lookahead_tokens:
                raise NotImplementedError(
                    f"{self.algorithm} with hash_lookahead_tokens: a block's key covers tokens after "
                    "it, so chain() over whole blocks cannot compute it; use request_keys()"
                )
            if parent_key is None or isinstance(parent_key, bytes):
                if isinstance(parent_key, bytes) and len(parent_key) != 32:
                    raise ValueError(f"a parent digest has 32 bytes, got {len(parent_key)}")
                digests = self._engine_digests(parent_key, toks, extras, lora, n)
                return np.array([digest_to_key(d) for d in digests], dtype=np.uint64)
            raise NotImplementedError(
                f"{self.algorithm}: an engine's uint64 block hash keeps 64 of 256 digest bits, "
                "so the chain cannot continue from it; in this mode the engine keys are the "
                "request keys (pass the 32-byte parent digest to continue)"
            )
        if isinstance(parent_key, bytes):
            raise TypeError("xxh3_chain parent keys are ints")

        if parent_key is None:
            state = self._root(model, lora)
        else:
            pk = int(parent_key)
            if not 0 <= pk <= _M64:
                raise ValueError(f"parent_key must be in [0, 2**64), got {pk}")
            state = pk
        if n == 0:
            return _EMPTY.copy()
        if scalar:
            return self._xxh3_keys_scalar(state, toks, n, extras)
        return self._xxh3_keys(state, toks, n, extras)

    def engine_digests(
        self,
        tokens: Sequence[int] | np.ndarray,
        *,
        lora: str | tuple[str, str] | None = None,
        block_extra_keys: Sequence[Sequence[Any] | None] | None = None,
        cache_salt: str | None = None,
        parent_digest: bytes | None = None,
    ) -> list[bytes]:
        """vLLM's full 32-byte block hashes of the full blocks (compat mode only).

        Same arguments as :meth:`request_keys`; ``parent_digest`` continues
        from a known digest (then ``cache_salt`` is not allowed: the salt
        belongs to a sequence's first block).  ``digest_to_key`` of entry i
        equals ``request_keys(...)[i]``.  Raises NotImplementedError for
        ``"xxh3_chain"``; otherwise as :meth:`request_keys`.
        """
        if not self.engine_compatible:
            raise NotImplementedError("engine_digests() exists only for the vllm_* algorithms")
        if parent_digest is not None and cache_salt:
            raise ValueError("cache_salt applies to a sequence's first block, not after a parent")
        toks = _tokens_to_u64(tokens)
        bs = self.block_size
        n = max(toks.shape[0] - self.hash_lookahead_tokens, 0) // bs
        allowed = (n, toks.shape[0] // bs, -(-toks.shape[0] // bs))
        extras = _normalise_extras(block_extra_keys, n, allowed, cache_salt)
        self._check_scope(None, lora)
        return self._engine_digests(parent_digest, toks, extras, lora, n)

    # -- xxh3_chain internals ------------------------------------------------

    def _make_powers(self, size: int) -> tuple[np.ndarray, np.ndarray]:
        """(A**i, Ainv**i) for i in [0, size), as uint64 arrays."""
        p = np.full(size, self._A, dtype=np.uint64)
        q = np.full(size, self._Ainv, dtype=np.uint64)
        p[0] = 1
        q[0] = 1
        np.cumprod(p, out=p)
        np.cumprod(q, out=q)
        return p, q

    def _powers_for(self, n: int) -> tuple[np.ndarray, np.ndarray]:
        powers = self._powers
        if powers[0].shape[0] >= n:
            return powers
        with self._grow_lock:
            powers = self._powers
            if powers[0].shape[0] < n:
                size = powers[0].shape[0]
                while size < n:
                    size *= 2
                powers = self._make_powers(size)
                self._powers = powers
            return powers

    def _check_scope(self, model: Any, lora: Any) -> None:
        if model is not None and not isinstance(model, str):
            raise TypeError(f"model must be str or None, got {type(model).__name__}")
        if lora is None or isinstance(lora, str):
            return
        if (
            isinstance(lora, tuple)
            and len(lora) == 2
            and isinstance(lora[0], str)
            and isinstance(lora[1], str)
        ):
            return
        raise TypeError(f"lora must be a name, a (name, path) tuple or None, got {lora!r}")

    def _root(self, model: str | None, lora: str | tuple[str, str] | None) -> int:
        name = lora[0] if isinstance(lora, tuple) else lora
        scope = (model, name)
        r = self._roots.get(scope)
        if r is None:
            g = xxhash.xxh3_64_intdigest(_ENCODER.encode([model, name]))
            r = _fmix64(self._D ^ g)
            if len(self._roots) >= _MAX_ROOTS:
                self._roots = {}
            self._roots[scope] = r
        return r

    def _xxh3_keys(
        self,
        state: int,
        toks: np.ndarray,
        n: int,
        extras: list[tuple[Any, ...] | None] | None,
    ) -> np.ndarray:
        bs = self.block_size
        blocks = toks[: n * bs].reshape(n, bs)
        u = blocks @ self._K  # (n,) uint64, wraps mod 2**64
        if extras is not None:
            idx = [i for i, e in enumerate(extras) if e is not None]
            try:
                digs = [xxhash.xxh3_64_intdigest(_ENCODER.encode(extras[i])) for i in idx]
            except (TypeError, OverflowError) as e:
                raise TypeError(f"extra keys cannot be encoded: {e}") from e
            u[idx] += np.array(digs, dtype=np.uint64) * self._np_E
        v = _fmix64_inplace(u)
        p, q = self._powers_for(n)
        _mul(v, q[:n], out=v)
        # fold A*R into the first term (q[0] == 1) instead of a pass over v
        v[0] = (int(v[0]) + self._A * state) & _M64
        np.cumsum(v, out=v)
        return _mul(v, p[:n], out=v)

    def _xxh3_keys_scalar(
        self,
        state: int,
        tokens: Sequence[int],
        n: int,
        extras: list[tuple[Any, ...] | None] | None,
    ) -> np.ndarray:
        """The same recurrence as :meth:`_xxh3_keys`, block by block on Python ints."""
        toks = array.array("Q", tokens)  # validates ints in [0, 2**64) in C
        bs, K, A, E = self.block_size, self._K_list, self._A, self._E
        out = []
        for i in range(n):
            u = sum(map(_imul, toks[i * bs : (i + 1) * bs], K)) & _M64
            if extras is not None and extras[i] is not None:
                try:
                    d = xxhash.xxh3_64_intdigest(_ENCODER.encode(extras[i]))
                except (TypeError, OverflowError) as e:
                    raise TypeError(f"extra keys cannot be encoded: {e}") from e
                u = (u + E * d) & _M64
            state = (A * state + _fmix64(u)) & _M64
            out.append(state)
        return np.array(out, dtype=np.uint64)

    # -- compat internals ------------------------------------------------------

    def _lora_tag(self, lora: str | tuple[str, str] | None) -> tuple[str, str, str] | None:
        if lora is None:
            return None
        if isinstance(lora, tuple):
            name, path = lora
        else:
            name = lora
            path = self._lora_paths.get(lora)  # type: ignore[assignment]
            if path is None:
                raise ValueError(
                    f"{self.algorithm}: vLLM hashes the LoRA adapter path; give lora as "
                    f"(name, path) or list {lora!r} in lora_paths"
                )
        return (_TAG_LORA, _fresh(name), _fresh(path))

    def _engine_digests(
        self,
        parent: bytes | None,
        toks: np.ndarray,
        extras: list[tuple[Any, ...] | None] | None,
        lora: str | tuple[str, str] | None,
        n: int,
    ) -> list[bytes]:
        """Digests of the first ``n`` blocks of ``toks`` (which holds their lookahead tokens too)."""
        bs = self.block_size
        la = self.hash_lookahead_tokens
        rows = toks[: n * bs].reshape(n, bs).tolist()
        ahead = toks[bs : n * bs + la].tolist() if la and n else None
        lora_tag = self._lora_tag(lora)
        H = self._H
        prev = parent or self._none_hash
        out: list[bytes] = []
        for i, row in enumerate(rows):
            tagged: list[Any] = [] if lora_tag is None else [lora_tag]
            if extras is not None and extras[i] is not None:
                for item in extras[i]:  # type: ignore[union-attr]
                    if isinstance(item, str):
                        tagged.append((_TAG_SALT, _fresh(item)))
                    elif isinstance(item, bytes):
                        tagged.append((_TAG_EMBEDS, _fresh(item)))
                    else:
                        tagged.append((_TAG_MM, _fresh(item[0]), item[1]))
            ek = tuple(tagged) if tagged else None
            if ahead is not None:  # (E, *the L tokens after the block), vLLM 0.33 get_request_block_hasher
                ek = (ek, *ahead[i * bs : i * bs + la])
            prev = H((prev, tuple(row), ek))
            out.append(prev)
        return out


def _sha256_pickle(obj: Any) -> bytes:
    """sha256 of pickle protocol 5 (vllm/utils/hashing.py sha256, vLLM 0.32)."""
    return hashlib.sha256(pickle.dumps(obj, protocol=5)).digest()


def _sha256_cbor(obj: Any) -> bytes:
    """sha256 of canonical CBOR (vllm/utils/hashing.py sha256_cbor, vLLM 0.32)."""
    return hashlib.sha256(cbor2.dumps(obj, canonical=True)).digest()
