"""Load vLLM's KV-event structs and pure block-hashing functions from an unpacked wheel.

Used by bench/record_vllm_captures.py only (never by the library or the tests).
vLLM is not installed and not imported as a package: the named classes and
functions are read with ``ast`` from the wheel's own files and executed in a
small namespace (msgspec, cbor2, hashlib, pickle and stand-ins for vLLM's
``Request``, logger and envs), so the captures and hashes come from the
released code itself:

* vllm/distributed/kv_events.py: ``EventBatch``, ``KVCacheEvent``,
  ``BlockStored``, ``BlockRemoved``, ``AllBlocksCleared``, ``KVEventBatch``;
* vllm/v1/core/kv_cache_utils.py: ``init_none_hash`` and its seed helpers,
  ``hash_block_tokens``, ``get_request_block_hasher``, the extra-key
  generators, ``to_event_extra_keys``, ``maybe_convert_block_hash``;
* vllm/utils/hashing.py: ``sha256``, ``sha256_cbor``;
* vllm/v1/token_buffer.py (0.34): ``token_slice``.

Get a source tree with ``pip download --no-deps vllm==0.33.0 -d DIR`` and
``unzip DIR/vllm-0.33.0-*.whl 'vllm/*.py' -d SRC``.
"""

from __future__ import annotations

import __future__
import ast
import hashlib
import os
import pickle
import types
from array import array
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any, NewType

import cbor2
import msgspec

EVENT_CLASSES = ("EventBatch", "KVCacheEvent", "BlockStored", "BlockRemoved", "AllBlocksCleared", "KVEventBatch")
HASH_NAMES = (
    "DEFAULT_NONE_HASH_SEED",
    "resolve_none_hash_seed",
    "init_none_hash",
    "maybe_convert_block_hash",
    "_gen_mm_extra_hash_keys",
    "_gen_lora_extra_hash_keys",
    "_gen_prompt_embeds_extra_hash_keys",
    "generate_block_hash_extra_keys",
    "generate_lookahead_block_hash_extra_keys",
    "to_event_extra_keys",
    "hash_block_tokens",
    "get_request_block_hasher",
)


def _defs(path: Path, names: Iterable[str]) -> tuple[ast.Module, dict[str, int]]:
    """The top-level classes, functions and assignments called ``names``, and their line numbers."""
    tree = ast.parse(path.read_text(), str(path))
    wanted = set(names)
    body: list[ast.stmt] = []
    lines: dict[str, int] = {}
    for node in tree.body:
        if isinstance(node, (ast.ClassDef, ast.FunctionDef)) and node.name in wanted:
            name = node.name
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            hit = [t.id for t in targets if isinstance(t, ast.Name) and t.id in wanted]
            if not hit or getattr(node, "value", None) is None:
                continue
            name = hit[0]
        else:
            continue
        body.append(node)
        lines[name] = node.lineno
    missing = wanted - set(lines)
    if missing:
        raise SystemExit(f"{path}: not found: {sorted(missing)}")
    return ast.Module(body=body, type_ignores=[]), lines


def load_event_structs(src: Path) -> tuple[types.SimpleNamespace, dict[str, int]]:
    """vLLM's event structs, as defined in ``src``/vllm/distributed/kv_events.py."""
    path = src / "vllm" / "distributed" / "kv_events.py"
    mod, lines = _defs(path, EVENT_CLASSES)
    ns: dict[str, Any] = {"__name__": "vllm_kv_events_capture", "msgspec": msgspec, "Any": Any,
                          "ExternalBlockHash": bytes | int}
    exec(compile(mod, str(path), "exec", dont_inherit=True), ns)
    return types.SimpleNamespace(**{n: ns[n] for n in EVENT_CLASSES}), lines


class _Envs:
    VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES = True


class _Logger:
    def warning(self, *a: Any, **k: Any) -> None:
        pass


def _no_window(*a: Any, **k: Any) -> Any:
    raise NotImplementedError("incremental multimodal hashing is not recorded")


def load_hashing(src: Path) -> tuple[types.SimpleNamespace, dict[str, int]]:
    """vLLM's hashing functions from ``src``; ``ns.envs`` switches int / bytes event hashes."""
    ns: dict[str, Any] = {
        "__name__": "vllm_hashing_capture", "os": os, "hashlib": hashlib, "pickle": pickle, "cbor2": cbor2,
        "Any": Any, "Callable": Callable, "Sequence": Sequence, "Iterable": Iterable,
        "BlockHash": NewType("BlockHash", bytes), "envs": _Envs(), "logger": _Logger(),
        "_NON_CRYPTO_HASH_FUNCTIONS": frozenset(), "_NONE_HASH_SEED": None,
        "get_mm_features_in_window": _no_window, "array": array,
    }
    flags = __future__.annotations.compiler_flag
    hpath = src / "vllm" / "utils" / "hashing.py"
    hmod, hlines = _defs(hpath, ("sha256", "sha256_cbor"))
    exec(compile(hmod, str(hpath), "exec", flags=flags, dont_inherit=True), ns)
    tb = src / "vllm" / "v1" / "token_buffer.py"
    if tb.exists():
        tmod, _ = _defs(tb, ("token_slice",))
        exec(compile(tmod, str(tb), "exec", flags=flags, dont_inherit=True), ns)
    kpath = src / "vllm" / "v1" / "core" / "kv_cache_utils.py"
    kmod, klines = _defs(kpath, HASH_NAMES)
    exec(compile(kmod, str(kpath), "exec", flags=flags, dont_inherit=True), ns)
    out = types.SimpleNamespace(**{k: v for k, v in ns.items() if not k.startswith("__")})
    out.globals = ns
    return out, {**{f"hashing.py:{k}": v for k, v in hlines.items()},
                 **{f"kv_cache_utils.py:{k}": v for k, v in klines.items()}}


class MMPosition:
    def __init__(self, offset: int, length: int) -> None:
        self.offset = offset
        self.length = length


class MMFeature:
    def __init__(self, identifier: str, offset: int, length: int) -> None:
        self.identifier = identifier
        self.mm_position = MMPosition(offset, length)


class LoRA:
    def __init__(self, name: str, path: str, adapter_id: int = 1) -> None:
        self.lora_name = self.name = name
        self.lora_path = path
        self.adapter_id = adapter_id


class Request:
    """The attributes of vllm/v1/request.py ``Request`` that the hashing code reads."""

    def __init__(self, tokens: list[int], mm: list[MMFeature] | None = None, lora: LoRA | None = None,
                 cache_salt: str | None = None) -> None:
        self._all_token_ids = list(tokens)
        self.mm_features = mm or []
        self.lora_request = lora
        self.cache_salt = cache_salt
        self.prompt_embeds = None
        self._prompt_embeds_per_block_hashes: dict[tuple[int, int], bytes] = {}
        self.block_hashes: list[bytes] = []

    @property
    def all_token_ids(self) -> list[int]:
        return self._all_token_ids

    @property
    def num_tokens(self) -> int:
        return len(self._all_token_ids)
