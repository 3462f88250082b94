"""KV-cache groups of the Redis backend (hybrid models): the methods of :class:`RedisGroupsMixin`.

The semantics are the reference's (:mod:`kvindex.groups`); the state lives
in Redis, so router replicas on one server share it (docs/operations.md,
"Hybrid models on Redis"):

- ``gs:<mid>:<rank>:<pod>`` (hash): the stream's learned specs,
  ``<group>`` -> ``kind|block size|window``, and ``p`` -> the primary group
  (the first full-attention one; its blocks live in the main tables, so a
  plain model costs nothing more per block);
- ``gr:<mid>:<rank>:<group>:<pod>`` (hash): a non-primary group's blocks,
  request key -> tier mask; in own-hash mode also ``ge:...`` (engine key ->
  ``<rk>:<mask>``);
- ``gps:<pod>`` (set) the pod's streams with specs, ``gh`` (set) the hybrid
  streams, ``gl`` (zset) every non-primary entry by store order (the
  capacity bound: the oldest go first), ``gd:<mid>:<rank>:<pod>`` the
  stream's report window (a key with a server-side expiry).

In this process only: stores of a non-primary group waiting for their
parent (own-hash mode; as the orphans, see :mod:`kvindex.redis_index`), and
which streams are hybrid as :meth:`grouped_ranks` last read it (at most
:data:`HYBRID_REFRESH` seconds old when another replica made a stream
hybrid; this process's own writes refresh it at once).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

from kvindex import redis_batch
from kvindex.contract import IndexUnavailable
from kvindex.groups import MAX_WAITING, Stream
from kvindex.hybrid import GroupSpec
from kvindex.redis_batch import BatchOps, check_group_tokens, from_k8, group_head, is_sparse, k8, k8s
from kvindex.side_tables import _Orphan, checked_store

__all__ = ["HYBRID_REFRESH", "RedisGroupsMixin"]

#: Seconds a process keeps its view of which streams are hybrid (read by score() for every matched pod).
HYBRID_REFRESH = 1.0


class _Waiting(NamedTuple):
    group: GroupSpec
    parent: int
    eks: list[int]
    token_ids: Sequence[int]
    bit: int
    extras: list | None
    lora: str | None
    gone: set[int]  # engine keys a BlockRemoved took away while waiting


_words = k8s


def _spec(g: int, value: bytes) -> GroupSpec:
    kind, bs, window = value.decode().split("|")
    return GroupSpec(g, kind, int(bs), int(window) if window else None)


class RedisGroupsMixin:
    """Per-group writes and reads of :class:`kvindex.redis_index.RedisKVBlockIndex` (module doc)."""

    _lock: Any
    _c: dict[str, int]
    _compat: bool
    _compat_arg: str
    _orphans: Any
    _orphan_by_ek: Any
    _model_ids: dict[str | None, int]
    _model_names: dict[int, str | None]
    block_size: int
    token_processor: Any
    _run: Callable[..., Any]
    _mid: Callable[..., int | None]
    _send: Callable[..., tuple[int, int, list[int], list[int]]]
    _add_orphan: Callable[..., None]
    _store_checked: Callable[..., int]

    def _init_groups(self) -> None:
        self._gwaiting: dict[Stream, list[_Waiting]] = {}
        self._hybrid: tuple[float, dict[tuple[str, int], list[int]]] | None = None

    def _forget_groups(self) -> None:
        """The server lost its data (or a clear): waiting stores go, the hybrid view is read again."""
        for items in self._gwaiting.values():
            self._c["group_unmapped"] += sum(len(w.eks) for w in items)
        self._gwaiting.clear()
        self._hybrid = None

    # ------------------------------------------------------------------ write

    def _store_group(
        self, pod: str, rank: int, eks: list[int], parent: int | None, token_ids: Sequence[int] | None, bit: int,
        block_size: int | None, extra_keys: Any, lora_name: str | None, model: str | None, group: GroupSpec,
    ) -> int:
        """A BlockStored of KV-cache group ``group`` (under the index's lock)."""
        mid = self._mid(model, create=True)
        assert mid is not None
        head = group_head(group)
        full = group.rule == "full"
        ops = BatchOps()
        if not token_ids:
            ops.add(0, (*head, "T", bit, "", "", _words(eks), ""), len(eks), grouped=True)
            return self._send(pod, rank, mid, model, ops)[1]
        if not full and not self._compat and is_sparse(self.block_size, len(eks), len(token_ids)):
            ops.add(0, (*head, "L", bit, "", "", "", ""), 0, grouped=True, unmapped=len(eks))
            self._send(pod, rank, mid, model, ops)
            return 0
        if self._compat:
            if full:
                checked_store(self.block_size, len(eks), token_ids, block_size, extra_keys, lora_name)
            else:
                check_group_tokens(self.block_size, len(eks), len(token_ids), block_size)
            pek, star = ("", "") if parent is None else (k8(parent), "*")
            ops.tokens = full  # a full-attention group: the main tables, likely (the models seen)
            ops.add(0, (*head, "S", bit, pek, star, _words(eks), _words(eks)), len(eks), grouped=True)
            return self._send(pod, rank, mid, model, ops)[1]
        extras, lora = checked_store(self.block_size, len(eks), token_ids, block_size, extra_keys, lora_name)
        main, prk = 0, None
        if full or parent is not None:  # learn the route (and resolve the parent) before chaining
            main, got, hybrid = self._run("glearn", pod, rank, mid, group.group_idx, head[2], head[3],
                                          "" if parent is None else k8(parent), self._compat_arg, write=True,
                                          model=model)
            prk = from_k8(got) if got else None
            if hybrid:
                self._hybrid = None  # which streams are hybrid: read again
        stream = (pod, rank, model)
        if main:  # the primary group: the main tables, as a store without a group
            item = _Orphan(pod, rank, tuple(eks), token_ids, bit, extras, lora, model, set())
            n = self._store_checked(pod, rank, mid, model, eks, parent, item)
            if self._gwaiting.get(stream):
                self._release_waiting(stream, mid)
            return n
        if parent is not None and prk is None:
            self._wait(stream, _Waiting(group, parent, eks, token_ids, bit, extras, lora, set()))
            return 0
        rks = self.token_processor.chain(prk, token_ids, model=model, lora=lora, block_extra_keys=extras).tolist()
        pek, prk_arg = ("", "") if parent is None else (k8(parent), "*")
        ops.add(0, (*head, "S", bit, pek, prk_arg, _words(eks), _words(rks)), len(eks), grouped=True)
        return self._send(pod, rank, mid, model, ops)[1]

    def _wait(self, stream: Stream, item: _Waiting) -> None:
        """Hold a store whose parent is unknown; the oldest beyond :data:`MAX_WAITING` is dropped (unmapped)."""
        waiting = self._gwaiting.setdefault(stream, [])
        waiting.append(item)
        if len(waiting) > MAX_WAITING:
            self._c["group_unmapped"] += len(waiting.pop(0).eks)

    def _release_waiting(self, stream: Stream, mid: int) -> None:
        """Store the stream's waiting stores whose parent is now known (after a primary store)."""
        waiting = self._gwaiting.pop(stream, None)
        pod, rank, model = stream
        progress = True
        while waiting and progress:
            progress = False
            for item in list(waiting):
                head = group_head(item.group)
                _main, prk, _hybrid = self._run("glearn", pod, rank, mid, item.group.group_idx, head[2],
                                                head[3], k8(item.parent), self._compat_arg, write=True,
                                                model=model)
                if not prk:
                    continue
                waiting.remove(item)
                rks = self.token_processor.chain(from_k8(prk), item.token_ids, model=model, lora=item.lora,
                                                 block_extra_keys=item.extras).tolist()
                pairs = [(ek, rk) for ek, rk in zip(item.eks, rks) if ek not in item.gone]
                ops = BatchOps()
                ops.add(0, (*head, "S", item.bit, k8(item.parent), "*", _words([p[0] for p in pairs]),
                            _words([p[1] for p in pairs])), len(pairs), grouped=True)
                self._send(pod, rank, mid, model, ops)
                progress = True
        if waiting:
            self._gwaiting[stream] = waiting

    def _remove_group(self, pod: str, rank: int, mid: int, model: str | None, keys: list[int], bit: int,
                      group_idx: int) -> int:
        """A BlockRemoved of KV-cache group ``group_idx`` (under the index's lock); removed copies."""
        ops = BatchOps()
        ops.add(0, redis_batch.removal_args(group_idx, bit, keys), len(keys), grouped=True)
        _done, _stored, hits, routes = self._send(pod, rank, mid, model, ops, count_removals=False)
        main = not routes or routes[0]
        removed = 0
        for ek, hit in zip(keys, hits):
            hit = bool(hit)
            if main:  # the block may also wait in a store whose parent is unknown
                for w in self._orphan_by_ek.get((pod, rank, model, ek), ()) if self._orphan_by_ek else ():
                    if w.tier & bit and ek not in w.removed:
                        w.removed.add(ek)
                        hit = True
            else:
                for w in self._gwaiting.get((pod, rank, model), ()):
                    if w.group.group_idx == group_idx and w.bit == bit and ek in w.eks:
                        w.gone.add(ek)
                        hit = True
            if hit:
                removed += 1
            else:
                self._c["unknown_removals"] += 1
        self._c["removed_blocks"] += removed
        return removed

    def distrust_reports(self, pod: str, dp_rank: int = 0, *, model: str | None = None, seconds: float = 30.0) -> None:
        """For ``seconds`` from now, believe a parent-nil store of the stream's non-primary groups only for
        the blocks they surely hold at its end (as the reference); 0 ends the window.

        The window is a key with a server-side expiry: every replica ingesting
        the stream applies it.  During an outage it is not opened (counted).
        """
        with self._lock:
            try:
                mid = self._mid(model, create=True)
                self._run("distrust", pod, int(dp_rank), mid, max(0, int(seconds * 1000)), write=True, model=model)
            except IndexUnavailable:
                return

    # ------------------------------------------------------------------- read

    def group_specs(self, pod: str, dp_rank: int = 0, *, model: str | None = None) -> dict[int, GroupSpec]:
        """group_idx -> spec learned from the stores of publisher (pod, rank, model); {} before any grouped
        store (or with Redis unreachable)."""
        mid = self._mid(model, create=False)
        res = None if mid is None else self._run("group_specs", pod, int(dp_rank), mid, write=False)
        if not res:
            return {}
        specs = {int(g): v for g, v in zip(res[::2], res[1::2]) if g != b"p"}
        return {g: _spec(g, specs[g]) for g in sorted(specs)}

    def group_match(
        self, request_keys: Sequence[int], pod: str, dp_rank: int = 0, *, model: str | None = None
    ) -> dict[int, list[int]]:
        """group_idx -> tier mask per request key (0: absent), for every learned group (as the reference)."""
        keys = request_keys.tolist() if hasattr(request_keys, "tolist") else [int(k) for k in request_keys]
        mid = self._mid(model, create=False)
        if mid is None or not keys:
            return {}
        res = self._run("group_match", pod, int(dp_rank), mid, _words(keys), write=False)
        if res is None:
            return {}
        return {int(res[i]): [int(m) for m in res[i + 1]] for i in range(0, len(res), 2)}

    def grouped_ranks(self, pod: str, *, model: str | None = None) -> list[int]:
        """DP ranks of ``pod`` (under ``model``) with a hybrid stream, sorted; [] for a plain model."""
        mid = self._model_ids.get(model)
        if mid is None:
            mid = self._mid(model, create=False)
            if mid is None:
                return []
        view = self._hybrid
        if view is None or time.monotonic() >= view[0]:
            res = self._run("grouped", write=False)
            seen: dict[tuple[str, int], list[int]] = {}
            for member in res or ():
                m, r, p = member.decode().split(":", 2)
                seen.setdefault((p, int(m)), []).append(int(r))
            view = self._hybrid = (time.monotonic() + HYBRID_REFRESH, {k: sorted(v) for k, v in seen.items()})
        return view[1].get((pod, mid), [])
