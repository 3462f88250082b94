"""The simulator against NVIDIA Dynamo run as a peer (ai-dynamo-runtime 1.6.1, installed by
``make test``): its real selector as a scheduler, and its own simulator (the mocker) on the
same trace.  Simulated outcomes only (simulated seconds), never wall-clock timings."""

from __future__ import annotations

import pytest

import dynamo._core  # noqa: E402,F401  (ai-dynamo-runtime; make test installs it)

from bench.sim.cluster import run  # noqa: E402
from bench.sim.dynamo_peer import DynamoSelector  # noqa: E402
from bench.sim.mocker import cross_check, cross_table, trace_records  # noqa: E402
from bench.sim.workload import Workload, build_requests  # noqa: E402

TINY = Workload(name="tiny", pods=3, capacity_tokens=64 * 60, customers=6, users_per_customer=2,
                shared_tokens=700, question_tokens=150, output_tokens=40, qps_stages=(4.0, 30.0), stage_seconds=2.0)
#: seed 002's 73 % shape in miniature (4 pods, 16 customers x 3 users): seconds to run in both simulators
SMALL = Workload(name="small-73", pods=4, capacity_tokens=64 * 206, customers=16, users_per_customer=3,
                 shared_tokens=1500, question_tokens=300, output_tokens=60, qps_stages=(10.0, 80.0),
                 stage_seconds=3.0)


class _Watched(DynamoSelector):
    """Records Dynamo's own view of the load when the run ends (before the service shuts down)."""

    def close(self) -> None:
        self.final_loads = self.service.loads(model_name=self.model)
        self.workers = self.service.list_workers()
        super().close()


def test_dynamo_selector_sees_the_pods_events_and_frees_every_reservation():
    sel = _Watched(3)
    r = run(TINY, sel, seed=3)
    assert r.requests == r.finished > 0
    assert sel.settle_polls > 0 and len(sel.workers) == TINY.pods
    # every reservation was freed: Dynamo tracks no load once the pods are idle
    (model,) = sel.final_loads
    assert model["pending_count"] == 0
    for w in model["loads"]:
        assert w["active_requests"] == 0 and w["potential_prefill_tokens"] == 0 and w["potential_decode_blocks"] == 0
    # it routes by what the pods hold: more prefix hits than a random choice on the same requests
    assert r.hit_rate > run(TINY, "random", seed=3).hit_rate + 0.1


def test_trace_has_one_id_per_block_and_equal_ids_for_equal_prefixes():
    recs = trace_records(TINY, 1, 64)
    reqs = build_requests(TINY, 1, 64)
    assert len(recs) == len(reqs)
    for rec, req in zip(recs, reqs):
        assert rec["input_length"] == len(req.prompt) and rec["output_length"] == req.out_len
        assert len(rec["hash_ids"]) == -(-len(req.prompt) // 64)
    by_group: dict[int, list[list[int]]] = {}
    for rec, req in zip(recs, reqs):
        by_group.setdefault(req.group, []).append(rec["hash_ids"])
    shared = TINY.shared_tokens // 64
    for ids in by_group.values():  # one customer: the context's blocks are the same ids
        assert all(x[:shared] == ids[0][:shared] for x in ids)
    firsts = {ids[0][0] for ids in by_group.values()}
    assert len(firsts) == len(by_group)  # different customers: different ids


def test_mocker_and_simulator_agree_on_the_ordering():
    """On the same requests, Dynamo's mocker (kv_router vs round_robin, with its engine speed and
    with ours) and our simulator (Dynamo's selector vs random) order the routers the same way."""
    cc = cross_check(SMALL, seed=1)
    print(cross_table(cc))
    pairs = [(cc.mocker["kv_router"], cc.mocker["round_robin"]),
             (cc.mocker_matched["kv_router"], cc.mocker_matched["round_robin"])]
    for aware, blind in pairs:
        assert aware.completed == blind.completed == cc.requests
        assert aware.reuse > 1.5 * blind.reuse
        assert aware.ttft_mean < 0.6 * blind.ttft_mean and aware.ttft_p90 < 0.6 * blind.ttft_p90
        assert aware.output_tok_s > 1.2 * blind.output_tok_s
    dyn, rnd = cc.ours["dynamo"], cc.ours["random"]
    assert dyn.finished == rnd.finished == cc.requests
    assert dyn.hit_rate > 1.5 * rnd.hit_rate
    assert dyn.ttft_mean < 0.6 * rnd.ttft_mean and dyn.ttft_p90 < 0.6 * rnd.ttft_p90
    assert dyn.output_tok_s > 1.2 * rnd.output_tok_s
    # the KV-blind rows are the same engines under the same load: reuse within 0.1 of each other
    assert abs(rnd.hit_rate - cc.mocker["round_robin"].reuse) < 0.1
