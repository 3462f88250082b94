"""kv_transfer_params of the four legs of a P/D turn: types, validation, parsing, builders.

Mirrors vLLM 0.32's NixlConnector (vllm/distributed/kv_transfer/kv_connector/
v1/nixl_connector.py, bidirectional transfer from vLLM PR #32553).  A turn has
four legs:

1. **P request** (:class:`PrefillRequestParams`): the router asks the prefill
   pod P to compute the prompt and keep its KV for D: ``do_remote_decode``
   true, ``do_remote_prefill`` false, the ``remote_*`` fields null.  On the
   next turn of a conversation the P request carries instead the decode pod's
   retained blocks (leg 4's params, clipped by :mod:`connector.guard`): P then
   pulls them.
2. **P response** (:class:`RemoteKVParams` with ``do_remote_prefill`` true):
   where D can read P's blocks.
3. **D request**: leg 2's params, forwarded unchanged with the same prompt.
4. **D response** (:class:`RemoteKVParams` with ``do_remote_decode`` true,
   bidirectional only): where P can read D's retained blocks on the next turn;
   ``remote_num_tokens`` = prompt + generated - 1 tokens whose KV D holds;
   ``remote_blocks_expiry_time`` is D's own ``time.perf_counter()`` deadline,
   never comparable with the router's clock.

Unknown fields are kept (``extra``) and passed through unchanged, so a newer
engine's additions survive the round trip.  Invalid params (missing engine
id, block ids, host or port; wrong types; block ids not one list of
non-negative ints per KV-cache group) are rejected with a reason that is
counted in :data:`REJECTS` and logged once per reason; they are never
forwarded.  Parsing network input never raises: it returns None.
"""

from __future__ import annotations

import logging
import threading
from collections import Counter
from collections.abc import Iterable, Mapping
from typing import Any

import msgspec

__all__ = [
    "InvalidParams",
    "PrefillRequestParams",
    "RemoteKVParams",
    "RejectCounter",
    "REJECTS",
    "parse_params",
    "params_from_json_body",
    "params_from_sse",
    "prefill_request_params",
    "decode_request_params",
]

log = logging.getLogger(__name__)


class InvalidParams(ValueError):
    """kv_transfer_params that must not be forwarded; ``reason`` is a short stable tag."""

    def __init__(self, reason: str, detail: str = "") -> None:
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason = reason


class RejectCounter:
    """Thread-safe counts of rejected params by reason; logs the first of each reason.

    ``counts``: a snapshot ``Counter`` reason -> number rejected.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._c: Counter[str] = Counter()

    def reject(self, err: InvalidParams, where: str) -> None:
        """Count ``err``; log it at WARNING the first time its reason is seen."""
        with self._lock:
            first = err.reason not in self._c
            self._c[err.reason] += 1
        if first:
            log.warning("rejected kv_transfer_params from %s: %s (further ones counted, not logged)", where, err)

    @property
    def counts(self) -> Counter[str]:
        with self._lock:
            return Counter(self._c)

    def total(self) -> int:
        """All rejections so far."""
        with self._lock:
            return sum(self._c.values())


#: Process-wide rejection counter used when callers pass none.
REJECTS = RejectCounter()


class _Params(msgspec.Struct, kw_only=True):
    """Base: the known fields plus ``extra`` (unknown fields, passed through)."""

    extra: dict[str, Any] = msgspec.field(default_factory=dict)
    #: known fields the parsed object did not have; left out again while None
    absent: frozenset[str] = frozenset()

    def to_dict(self) -> dict[str, Any]:
        """The JSON object to put under ``kv_transfer_params`` (unknown fields included).

        Known fields win over an ``extra`` entry of the same name; a known
        field absent from the parsed input stays absent while it is None.
        """
        out = dict(self.extra)
        for name in self.__struct_fields__:
            if name in ("extra", "absent"):
                continue
            v = getattr(self, name)
            if v is None and name in self.absent:
                continue
            out[name] = v
        return out


class PrefillRequestParams(_Params, kw_only=True):
    """Leg 1 of a fresh turn: ask P to prefill and keep the KV for a remote decode.

    Mirrors the request side of NixlConnector (vLLM 0.32): the toy proxy of
    vLLM's P/D example sends exactly these values to P with ``max_tokens`` 1
    and ``stream`` false.
    """

    do_remote_decode: bool = True
    do_remote_prefill: bool = False
    remote_engine_id: None = None
    remote_block_ids: None = None
    remote_host: None = None
    remote_port: None = None


class RemoteKVParams(_Params, kw_only=True):
    """Params naming KV blocks another engine can read (legs 2, 3, 4 and the next-turn P request).

    Fields (vLLM 0.32 NixlConnector; D's answer when ``bidirectional_kv_xfer``):
        do_remote_prefill: true in P's answer (D must pull from P).
        do_remote_decode: true in D's answer (the next P may pull from D).
        remote_block_ids: one list of block ids per KV-cache group; block i of
            a group holds tokens ``[i*block_size, (i+1)*block_size)``.
        remote_engine_id, remote_request_id, remote_host, remote_port: where
            the blocks are (the engine's NIXL side channel).
        tp_size, dcp_size, pp_size: the holder's parallel sizes.
        remote_num_tokens: tokens whose KV the holder has (D: prompt +
            generated - 1).
        remote_blocks_expiry_time: D's ``time.perf_counter()`` deadline (its
            own clock; never compare it with the router's).
        transfer_mode: "pull".
        remote_prefill_cached_tokens: in P's answer, tokens P pulled or found
            cached (absent from D's answer).
    """

    do_remote_prefill: bool = False
    do_remote_decode: bool = False
    remote_block_ids: list[list[int]]
    remote_engine_id: str
    remote_request_id: str | None = None
    remote_host: str
    remote_port: int
    tp_size: int = 1
    dcp_size: int = 1
    pp_size: int = 1
    remote_num_tokens: int | None = None
    remote_blocks_expiry_time: float | None = None
    transfer_mode: str | None = None
    remote_prefill_cached_tokens: int | None = None

    def validate(self) -> RemoteKVParams:
        """Check values msgspec's types cannot; returns self.

        Raises:
            InvalidParams: empty engine id / host / request id, a port outside
                1..65535, no KV-cache group, a negative block id, sizes < 1,
                a negative token count, or neither direction set.
        """
        if not self.remote_engine_id:
            raise InvalidParams("missing_engine_id")
        if not self.remote_host:
            raise InvalidParams("missing_host")
        if not 1 <= self.remote_port <= 65535:
            raise InvalidParams("bad_port", str(self.remote_port))
        if self.do_remote_decode and not self.remote_request_id:
            raise InvalidParams("missing_request_id")
        if not self.remote_block_ids:
            raise InvalidParams("no_block_groups")
        for g in self.remote_block_ids:
            if any(b < 0 for b in g):
                raise InvalidParams("negative_block_id")
        if min(self.tp_size, self.dcp_size, self.pp_size) < 1:
            raise InvalidParams("bad_parallel_size")
        if self.remote_num_tokens is not None and self.remote_num_tokens < 0:
            raise InvalidParams("negative_num_tokens")
        if self.do_remote_prefill == self.do_remote_decode:
            raise InvalidParams("bad_direction", "exactly one of do_remote_prefill/do_remote_decode must be true")
        return self


_KNOWN = frozenset(RemoteKVParams.__struct_fields__) - {"extra", "absent"}
_REQUIRED = ("remote_block_ids", "remote_engine_id", "remote_host", "remote_port")


def parse_params(obj: Any, *, where: str = "engine", rejects: RejectCounter | None = None) -> RemoteKVParams | None:
    """Turn a decoded ``kv_transfer_params`` JSON object into :class:`RemoteKVParams`.

    Args:
        obj: the decoded JSON value (normally a dict); None means "no params".
        where: names the source in the log line (e.g. "prefill pod p0").
        rejects: counter for rejections (default :data:`REJECTS`).

    Returns:
        The params (unknown fields in ``extra``), or None when ``obj`` is None
        or invalid (then the reason is counted and logged once).  Never raises.
    """
    if obj is None:
        return None
    rejects = rejects if rejects is not None else REJECTS
    try:
        if not isinstance(obj, Mapping):
            raise InvalidParams("not_an_object", type(obj).__name__)
        for name in _REQUIRED:
            if obj.get(name) is None:
                raise InvalidParams(f"missing_{name.removeprefix('remote_')}")
        known = {k: v for k, v in obj.items() if k in _KNOWN}
        extra = {k: v for k, v in obj.items() if k not in _KNOWN}
        try:
            p = msgspec.convert(known, RemoteKVParams, strict=True)
        except msgspec.ValidationError as e:
            reason = "bad_block_ids" if "remote_block_ids" in str(e) else "bad_type"
            raise InvalidParams(reason, str(e)) from None
        p.extra = extra
        p.absent = _KNOWN - obj.keys()
        return p.validate()
    except InvalidParams as e:
        rejects.reject(e, where)
        return None


class _Body(msgspec.Struct):
    kv_transfer_params: Any = None


_body_decoder = msgspec.json.Decoder(_Body)


def params_from_json_body(
    body: bytes | str, *, where: str = "engine", rejects: RejectCounter | None = None
) -> RemoteKVParams | None:
    """Params at the top level of a non-streaming OpenAI response body (JSON bytes).

    Returns None when the body has none, is not a JSON object, or the params
    are invalid (counted).  Never raises.
    """
    try:
        b = _body_decoder.decode(body)
    except (msgspec.DecodeError, msgspec.ValidationError):
        (rejects if rejects is not None else REJECTS).reject(InvalidParams("bad_body"), where)
        return None
    return parse_params(b.kv_transfer_params, where=where, rejects=rejects)


def params_from_sse(
    lines: Iterable[bytes | str], *, where: str = "engine", rejects: RejectCounter | None = None
) -> RemoteKVParams | None:
    """Params from a server-sent-events stream of OpenAI chunks.

    ``lines``: the stream split into lines (``data: {...}``, blank lines,
    ``data: [DONE]``, comments).  The last chunk carrying a non-null top-level
    ``kv_transfer_params`` wins; a stream without one gives None (vLLM 0.32
    streams none, vLLM PR #40186).  Undecodable chunks are counted
    (``bad_sse_chunk``) and skipped.  Never raises.
    """
    found: RemoteKVParams | None = None
    for line in lines:
        if isinstance(line, str):
            line = line.encode()
        line = line.strip()
        if not line.startswith(b"data:"):
            continue
        data = line[5:].strip()
        if not data or data == b"[DONE]":
            continue
        try:
            chunk = _body_decoder.decode(data)
        except (msgspec.DecodeError, msgspec.ValidationError):
            (rejects if rejects is not None else REJECTS).reject(InvalidParams("bad_sse_chunk"), where)
            continue
        if chunk.kv_transfer_params is not None:
            p = parse_params(chunk.kv_transfer_params, where=where, rejects=rejects)
            if p is not None:
                found = p
    return found


def prefill_request_params() -> PrefillRequestParams:
    """Leg 1 of a turn without reuse: P prefills and keeps its KV for D."""
    return PrefillRequestParams()


def decode_request_params(prefill_answer: RemoteKVParams) -> RemoteKVParams:
    """Leg 3: D's params are P's answer, forwarded unchanged (unknown fields included).

    Raises:
        ValueError: ``prefill_answer`` is not P's answer (``do_remote_prefill`` false).
    """
    if not prefill_answer.do_remote_prefill:
        raise ValueError("D's params must come from P's answer (do_remote_prefill true)")
    return msgspec.structs.replace(prefill_answer, extra=dict(prefill_answer.extra))
