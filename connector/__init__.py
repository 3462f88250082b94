"""connector: bidirectional P/D KV reuse decisions for a router (no HTTP, no sockets).

- :mod:`connector.params`: kv_transfer_params of each leg (msgspec), parsing
  from JSON bodies and SSE streams, validation, builders.
- :mod:`connector.retained`: the decode-retained store (conversation_id ->
  what D holds), mirrored in the index under tier ``decode_retained``.
- :mod:`connector.guard`: the prompt-extends-retained check (clips the params).
- :mod:`connector.planner`: one object per router: choose P and D, pull or
  recompute, params for each leg, explanation.
- :mod:`connector.advisor`: the recompute-threshold advisor.
- :mod:`connector.decode_alone`: conditional disaggregation (when D serves a
  turn alone).

Imports kvindex and scorer, never kvevents.
"""

from connector.advisor import Advice, ModelKV, TransferCost, advise, fit_transfer_cost
from connector.decode_alone import DecodeAloneRule, PathTokens
from connector.guard import GuardResult, clip_to_prompt
from connector.params import (
    REJECTS,
    InvalidParams,
    PrefillRequestParams,
    RemoteKVParams,
    parse_params,
    params_from_json_body,
    params_from_sse,
)
from connector.planner import PDPlanner, TurnPlan
from connector.retained import RetainedEntry, RetainedStore

__all__ = [
    "Advice",
    "DecodeAloneRule",
    "GuardResult",
    "InvalidParams",
    "ModelKV",
    "PDPlanner",
    "PathTokens",
    "PrefillRequestParams",
    "REJECTS",
    "RemoteKVParams",
    "RetainedEntry",
    "RetainedStore",
    "TransferCost",
    "TurnPlan",
    "advise",
    "clip_to_prompt",
    "fit_transfer_cost",
    "params_from_json_body",
    "params_from_sse",
    "parse_params",
]
