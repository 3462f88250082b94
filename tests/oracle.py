"""Plain, obviously correct models used as oracles by the tests, and a vLLM-format encoder.

The encoder writes what an engine sends (msgspec.msgpack of plain lists and
dicts), independently of the library's decoders.
"""

from __future__ import annotations

import hashlib
import time
from dataclasses import dataclass, field

import msgspec

from kvindex.keys import TokenProcessor

MEDIUM = {"gpu": "GPU", "cpu": "CPU", "storage": "STORAGE"}


def engine_hash(tokens: tuple[int, ...], salt: str = "engine") -> int:
    """A stand-in engine block hash: uint64 of sha256 over the whole token path."""
    d = hashlib.sha256(salt.encode() + b"|" + ",".join(map(str, tokens)).encode()).digest()
    return int.from_bytes(d[-8:], "big")


def from_json(x: object) -> object:
    """A recorded vLLM value back from JSON: ``{"bytes_hex": ...}`` -> bytes, lists -> tuples."""
    if isinstance(x, dict):
        return bytes.fromhex(x["bytes_hex"])
    if isinstance(x, list):
        return tuple(from_json(y) for y in x)
    return x


def stored_event(hashes, parent, tokens, block_size, tier="gpu", form="map", **extra) -> object:
    """A vLLM BlockStored event as the engine encodes it (map = vLLM 0.32, array = older)."""
    medium = MEDIUM.get(tier, tier.upper())
    if form == "map":
        ev = {"type": "BlockStored", "block_hashes": list(hashes), "parent_block_hash": parent,
              "token_ids": list(tokens), "block_size": block_size, "medium": medium}
        ev.update(extra)
        return ev
    return ["BlockStored", list(hashes), parent, list(tokens), block_size, None, medium]


def removed_event(hashes, tier="gpu", form="map") -> object:
    medium = MEDIUM.get(tier, tier.upper())
    if form == "map":
        return {"type": "BlockRemoved", "block_hashes": list(hashes), "medium": medium}
    return ["BlockRemoved", list(hashes), medium]


def cleared_event(form="map") -> object:
    return {"type": "AllBlocksCleared"} if form == "map" else ["AllBlocksCleared"]


def batch_payload(events, dp_rank: int | None = 0, ts: float | None = None) -> bytes:
    """msgpack ``[ts, events, dp_rank]`` as vLLM's publisher sends it."""
    return msgspec.msgpack.encode([time.time() if ts is None else ts, list(events), dp_rank])


def seq_frame(seq: int) -> bytes:
    return seq.to_bytes(8, "big")


@dataclass
class Universe:
    """Token paths an engine could cache: block i of a path has an engine key that
    depends on all tokens up to it (as vLLM's chained hash does)."""

    block_size: int
    paths: list[tuple[int, ...]]
    tp: TokenProcessor
    model: str | None = None

    def n_blocks(self, p: int) -> int:
        return len(self.paths[p]) // self.block_size

    def ek(self, p: int, i: int) -> int:
        return engine_hash(self.paths[p][: (i + 1) * self.block_size])

    def tokens(self, p: int, i: int, j: int) -> tuple[int, ...]:
        return self.paths[p][i * self.block_size : j * self.block_size]

    def request_keys(self, p: int) -> list[int]:
        return [int(k) for k in self.tp.request_keys(list(self.paths[p]), model=self.model)]

    def rk_of_ek(self) -> dict[int, int]:
        out = {}
        for p in range(len(self.paths)):
            for i, rk in enumerate(self.request_keys(p)):
                out[self.ek(p, i)] = rk
        return out


@dataclass
class Oracle:
    """What the index should hold: per (pod, rank) engine key -> tiers, plus waiting orphans."""

    held: dict[tuple[str, int], dict[int, set[str]]] = field(default_factory=dict)
    # waiting stores: (pod, rank, engine keys, parent, tier, engine keys removed while waiting)
    pending: list[tuple[str, int, tuple[int, ...], int, str, set]] = field(default_factory=list)

    def known(self, ek: int) -> bool:
        return any(ek in m for m in self.held.values())

    def store(self, pod, rank, eks, parent, tier) -> None:
        if parent is not None and not self.known(parent):
            self.pending.append((pod, rank, tuple(eks), parent, tier, set()))
            return
        work = [(pod, rank, tuple(eks), tier, set())]
        while work:
            pod_, rank_, eks_, tier_, gone = work.pop()
            m = self.held.setdefault((pod_, rank_), {})
            for ek in eks_:
                if ek not in gone:
                    m.setdefault(ek, set()).add(tier_)
            released = [w for w in self.pending if w[3] in eks_]
            self.pending = [w for w in self.pending if w[3] not in eks_]
            work.extend((w[0], w[1], w[2], w[4], w[5]) for w in released)

    def offload(self, pod, rank, eks, tier) -> None:
        for ek in eks:
            if self.known(ek):
                self.held.setdefault((pod, rank), {}).setdefault(ek, set()).add(tier)

    def remove(self, pod, rank, eks, tier) -> None:
        m = self.held.get((pod, rank), {})
        for ek in eks:
            t = m.get(ek)
            if t is None:  # a block still waiting for its parent is dropped from its store
                for w in self.pending:
                    if w[0] == pod and w[1] == rank and w[4] == tier and ek in w[2]:
                        w[5].add(ek)
            if t is not None:
                t.discard(tier)
                if not t:
                    del m[ek]

    def clear(self, pod, rank=None) -> None:
        for key in [k for k in self.held if k[0] == pod and (rank is None or k[1] == rank)]:
            del self.held[key]
        self.pending = [w for w in self.pending if not (w[0] == pod and (rank is None or w[1] == rank))]

    def holders(self, ek: int) -> set[tuple[str, str, int]]:
        """{(pod, tier, rank)} holding engine key ek."""
        return {(pod, t, rank) for (pod, rank), m in self.held.items() for t in m.get(ek, ())}

    def prefix(self, eks: list[int]) -> dict[str, list[frozenset[str]]]:
        """pod -> tiers (union over ranks) of each block of its consecutive prefix."""
        pods = {pod for (pod, _r) in self.held}
        out = {}
        for pod in pods:
            tiers = []
            for ek in eks:
                t = set()
                for (p, _r), m in self.held.items():
                    if p == pod:
                        t |= m.get(ek, set())
                if not t:
                    break
                tiers.append(frozenset(t))
            if tiers:
                out[pod] = tiers
        return out


def same_on_both(ixs: list, name: str, *args: object, **kw: object) -> tuple:
    """Call method ``name`` on both indexes (the reference, then the compiled one) and assert the
    same outcome: ("ok", result), or ("err", exception type) for a ValueError / TypeError."""
    out = []
    for ix in ixs:
        try:
            out.append(("ok", getattr(ix, name)(*args, **kw)))
        except (ValueError, TypeError) as exc:
            out.append(("err", type(exc)))
    assert out[0] == out[1], (name, args, kw, out)
    return out[0]
