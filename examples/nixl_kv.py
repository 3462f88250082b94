"""Two NIXL agents in two processes moving "KV blocks" the way a P/D pair does (UCX, DRAM).

A decode-side process (:func:`_decode_main`, started by :class:`DecodeProcess`)
owns a pool of KV blocks in NIXL-registered memory, shaped
``(regions, num_blocks, block_bytes)`` like an engine's per-layer K and V
caches: block id ``b`` of region ``r`` lives at
``base + (r * num_blocks + b) * block_bytes``.  When asked to *retain* a token
sequence it allocates block ids (non-contiguous, like a real block pool),
writes each block's "KV" and answers with kv_transfer_params shaped like
vLLM 0.32's decode answer (``do_remote_decode`` true, ``remote_block_ids``,
``remote_num_tokens``, ...).

The prefill side (:class:`PrefillAgent`, in the calling process) reads exactly
the blocks the params name with one NIXL READ (one descriptor per region and
block) and checks the bytes against the KV it expects for its own prompt.

A block's "KV" is a function of every token up to the block's end (as real
KV is: attention mixes the whole prefix), via :func:`block_content`, so
reading a block retained for other tokens is detected byte for byte.

NIXL must be installed with ``pip install --no-deps nixl nixl-cu12`` (CPU
only: the UCX backend moves DRAM; ``make test`` does this).
"""

from __future__ import annotations

import multiprocessing as mp
import os
import random
import time
from collections.abc import Sequence

import numpy as np
import xxhash

__all__ = ["block_content", "DecodeProcess", "PrefillAgent", "nixl_available"]


def nixl_available() -> bool:
    """True when the ``nixl`` package imports (with its UCX plugin)."""
    try:
        from nixl._api import nixl_agent  # noqa: F401
    except Exception:
        return False
    return True


def block_content(tokens: Sequence[int], upto: int, region: int, block_bytes: int) -> np.ndarray:
    """The bytes of one block's "KV" in one region: a function of ``tokens[:upto]`` and the region.

    uint8 array of ``block_bytes`` (a multiple of 8): the 64-bit words
    ``seed + position`` where ``seed`` = xxh64 of the token prefix and region.
    """
    h = xxhash.xxh64(np.asarray(tokens[:upto], dtype=np.int64).tobytes(), seed=region).intdigest()
    words = np.arange(block_bytes // 8, dtype=np.uint64) + np.uint64(h)
    return words.view(np.uint8)


def _agent(name: str):
    from nixl._api import nixl_agent, nixl_agent_config

    return nixl_agent(name, nixl_agent_config(backends=["UCX"]))


def _decode_main(conn, name: str, num_blocks: int, block_bytes: int, regions: int, port: int) -> None:
    """The decode-side process: serve retain / notifs / stop commands over ``conn``."""
    agent = _agent(name)
    pool = np.zeros((regions, num_blocks, block_bytes), dtype=np.uint8)
    reg = agent.register_memory([(pool.ctypes.data, pool.nbytes, 0, "")], "DRAM")
    free = list(range(num_blocks))
    random.Random(num_blocks).shuffle(free)
    conn.send(
        {
            "metadata": agent.get_agent_metadata(),
            "base": pool.ctypes.data,
            "num_blocks": num_blocks,
            "block_bytes": block_bytes,
            "regions": regions,
        }
    )
    requests = 0
    notifs: list[bytes] = []
    try:
        while True:
            cmd, *args = conn.recv()
            if cmd == "retain":
                tokens, num_tokens, block_size = args
                need = -(-num_tokens // block_size)
                if need > len(free):
                    conn.send(("error", "out of blocks"))
                    continue
                ids = [free.pop() for _ in range(need)]
                for i, b in enumerate(ids):
                    upto = min((i + 1) * block_size, num_tokens)
                    for r in range(regions):
                        pool[r, b] = block_content(tokens, upto, r, block_bytes)
                requests += 1
                conn.send(
                    (
                        "ok",
                        {
                            "do_remote_prefill": False,
                            "do_remote_decode": True,
                            "remote_block_ids": [ids],
                            "remote_engine_id": name,
                            "remote_request_id": f"{name}-req-{requests}",
                            "remote_host": "127.0.0.1",
                            "remote_port": port,
                            "tp_size": 1,
                            "dcp_size": 1,
                            "pp_size": 1,
                            "remote_num_tokens": num_tokens,
                            "remote_blocks_expiry_time": time.perf_counter() + 480.0,
                            "transfer_mode": "pull",
                        },
                    )
                )
            elif cmd == "release":
                free.extend(args[0])
                conn.send(("ok", None))
            elif cmd == "notifs":
                for msgs in agent.get_new_notifs().values():
                    notifs.extend(msgs)
                conn.send(("ok", list(notifs)))
            elif cmd == "stop":
                conn.send(("ok", None))
                break
    finally:
        agent.deregister_memory(reg)


class DecodeProcess:
    """Start the decode-side agent in a child process (spawned); a context manager.

    Args:
        num_blocks, block_bytes (multiple of 8), regions: the pool's shape.
        name: the NIXL agent name (= the params' remote_engine_id).

    Raises:
        RuntimeError: the child did not come up within ``timeout`` seconds.
    """

    def __init__(self, num_blocks: int, block_bytes: int, regions: int = 2, *, name: str = "decode", timeout: float = 120.0):
        if block_bytes % 8:
            raise ValueError("block_bytes must be a multiple of 8")
        ctx = mp.get_context("spawn")
        self._conn, child = ctx.Pipe()
        self.proc = ctx.Process(
            target=_decode_main, args=(child, name, num_blocks, block_bytes, regions, 5600), daemon=True
        )
        self.proc.start()
        if not self._conn.poll(timeout):
            self.close()
            raise RuntimeError("decode-side NIXL agent did not start")
        self.info = self._conn.recv()
        self.name = name

    def _call(self, *cmd, timeout: float = 120.0):
        self._conn.send(cmd)
        if not self._conn.poll(timeout):
            raise RuntimeError(f"decode process did not answer {cmd[0]!r}")
        status, value = self._conn.recv()
        if status != "ok":
            raise RuntimeError(f"decode process: {value}")
        return value

    def retain(self, tokens: Sequence[int], num_tokens: int, block_size: int) -> dict:
        """Write the KV of ``tokens[:num_tokens]`` into fresh blocks; returns D's kv_transfer_params (a dict)."""
        return self._call("retain", list(tokens), num_tokens, block_size)

    def release(self, block_ids: Sequence[int]) -> None:
        """Give blocks back to the free list."""
        self._call("release", list(block_ids))

    def notifs(self) -> list[bytes]:
        """Notifications received so far from readers."""
        return self._call("notifs")

    def close(self) -> None:
        """Stop the child (politely, then by terminate)."""
        try:
            if self.proc.is_alive():
                self._call("stop", timeout=10.0)
        except Exception:
            pass
        self.proc.join(10.0)
        if self.proc.is_alive():
            self.proc.terminate()
            self.proc.join(5.0)

    def __enter__(self) -> DecodeProcess:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class PrefillAgent:
    """The prefill side: a NIXL agent with a local block buffer that READs D's blocks.

    Args:
        decode_info: :attr:`DecodeProcess.info` (D's agent metadata and pool layout:
            what vLLM's NIXL side-channel handshake exchanges).
        max_blocks: local buffer capacity in blocks.
    """

    def __init__(self, decode_info: dict, max_blocks: int, *, name: str = "prefill") -> None:
        self.agent = _agent(name)
        self.block_bytes = decode_info["block_bytes"]
        self.regions = decode_info["regions"]
        self.remote_blocks = decode_info["num_blocks"]
        self.remote_base = decode_info["base"]
        self.buf = np.zeros((self.regions, max_blocks, self.block_bytes), dtype=np.uint8)
        self._reg = self.agent.register_memory([(self.buf.ctypes.data, self.buf.nbytes, 0, "")], "DRAM")
        self.remote = self.agent.add_remote_agent(decode_info["metadata"])
        if isinstance(self.remote, bytes):
            self.remote = self.remote.decode()

    def read(self, block_ids: Sequence[int], notif: bytes = b"", timeout: float = 60.0) -> float:
        """READ D's ``block_ids`` (every region) into local blocks 0..k-1; returns seconds taken.

        Raises:
            RuntimeError: the transfer failed or timed out; ValueError: too many blocks.
        """
        k = len(block_ids)
        if k > self.buf.shape[1]:
            raise ValueError(f"{k} blocks > local capacity {self.buf.shape[1]}")
        bb, nb = self.block_bytes, self.remote_blocks
        lbase, lnb = self.buf.ctypes.data, self.buf.shape[1]
        local = [(lbase + (r * lnb + i) * bb, bb, 0) for r in range(self.regions) for i in range(k)]
        remote = [(self.remote_base + (r * nb + b) * bb, bb, 0) for r in range(self.regions) for b in block_ids]
        t0 = time.perf_counter()
        ld = self.agent.get_xfer_descs(local, "DRAM")
        rd = self.agent.get_xfer_descs(remote, "DRAM")
        h = self.agent.initialize_xfer("READ", ld, rd, self.remote, notif)
        try:
            state = self.agent.transfer(h)
            deadline = t0 + timeout
            while state not in ("DONE", "ERR"):
                if time.perf_counter() > deadline:
                    raise RuntimeError("NIXL READ timed out")
                state = self.agent.check_xfer_state(h)
            if state == "ERR":
                raise RuntimeError("NIXL READ failed")
            return time.perf_counter() - t0
        finally:
            self.agent.release_xfer_handle(h)

    def mismatched_blocks(self, prompt: Sequence[int], num_tokens: int, block_size: int) -> list[int]:
        """Local blocks 0..ceil(num_tokens/block_size)-1 whose bytes differ from the KV of ``prompt``.

        Block i must hold the KV of ``prompt[:min((i+1)*block_size, num_tokens)]``.
        """
        bad = []
        for i in range(-(-num_tokens // block_size)):
            upto = min((i + 1) * block_size, num_tokens)
            for r in range(self.regions):
                if not np.array_equal(self.buf[r, i], block_content(prompt, upto, r, self.block_bytes)):
                    bad.append(i)
                    break
        return bad

    def close(self) -> None:
        try:
            self.agent.remove_remote_agent(self.remote)
        except Exception:
            pass
        self.agent.deregister_memory(self._reg)


if __name__ == "__main__":  # a quick manual check: python -m examples.nixl_kv
    with DecodeProcess(64, 4096) as d:
        toks = list(range(100))
        params = d.retain(toks, 99, 16)
        p = PrefillAgent(d.info, 64)
        dt = p.read(params["remote_block_ids"][0], b"done")
        print(f"read {len(params['remote_block_ids'][0])} blocks in {dt * 1e3:.2f} ms; "
              f"mismatched {p.mismatched_blocks(toks, 99, 16)}; pid {os.getpid()}")
        time.sleep(0.2)
        print("notifs at D:", d.notifs())
        p.close()
