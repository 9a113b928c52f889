"""The conditional-disaggregation rule and the router's routing step around it (pure, no broker)."""

from __future__ import annotations

import pytest

from kvflow.router.core import Arrival, Decision, RouterCore
from kvflow.router.disagg import DisaggConfig, decide_prefill, place, prefill_queue_depth, routed_record
from kvflow.router.policies import NoWorkerAvailable, RouteRequest
from kvflow.router.table import RoutingTable, apply_heartbeat
from kvflow.schemas import DecisionOutcome, InferenceRequest, ReplyTo, RoutingDecision, WorkerHeartbeat, WorkerRole
from kvflow.schemas.transfer import PrefillStage, parse_stage
from kvflow.settings import Settings
from kvflow.streams.catalog import Catalog

MODEL = "m"
CATALOG = Catalog("rule")
BLOCK = 16


def heartbeat(worker_id: str, role: WorkerRole, slot: int, *, waiting: int = 0, model: str = MODEL) -> WorkerHeartbeat:
    return WorkerHeartbeat(worker_id=worker_id, role=role, model=model, engine="mocker", block_size=BLOCK,
                           kv_total_blocks=1000, queue_topic=CATALOG.queue(role).name, queue_partition=slot,
                           waiting_requests=waiting, ts_ms=1_000)


def table_of(*heartbeats: WorkerHeartbeat) -> RoutingTable:
    table = RoutingTable()
    for hb in heartbeats:
        apply_heartbeat(table, hb)
    return table


def disagg_table(prefill_waiting: int = 0) -> RoutingTable:
    return table_of(heartbeat("d0", WorkerRole.decode, 0), heartbeat("d1", WorkerRole.decode, 1),
                    heartbeat("p0", WorkerRole.prefill, 0, waiting=prefill_waiting))


DISAGG_HEARTBEATS = (heartbeat("d0", WorkerRole.decode, 0), heartbeat("d1", WorkerRole.decode, 1),
                     heartbeat("p0", WorkerRole.prefill, 0))


def route_req(isl: int, request_id: str = "r1") -> RouteRequest:
    return RouteRequest(request_id=request_id, model=MODEL, isl=isl)


def request(request_id: str, isl: int, **fields) -> InferenceRequest:
    return InferenceRequest(request_id=request_id, model=MODEL, token_ids=list(range(isl)),
                            reply_to=ReplyTo(topic="resp", partition=3), **fields)


CFG = DisaggConfig()  # 1000 tokens, 2 per prefill worker


def test_short_prompt_prefills_on_the_decode_worker():
    table = disagg_table()
    placement = place("round_robin", route_req(1000), table, CFG)
    assert placement.decision.worker_id in {"d0", "d1"}
    assert not placement.plan.remote and placement.plan.reason == "short_prompt"
    assert placement.decision.prefill_worker_id is None
    assert placement.plan.uncached_tokens == 1000


def test_long_prompt_prefills_remotely():
    table = disagg_table()
    placement = place("round_robin", route_req(1001), table, CFG)
    assert placement.plan.remote and placement.plan.reason == "remote"
    assert placement.decision.worker_id in {"d0", "d1"}
    assert placement.decision.prefill_worker_id == "p0" == placement.plan.prefill.worker_id


def test_full_prefill_queue_keeps_prefill_local():
    table = disagg_table(prefill_waiting=2)  # limit = 2 per prefill worker x 1 worker
    placement = place("round_robin", route_req(5000), table, CFG)
    assert not placement.plan.remote and placement.plan.reason == "prefill_queue_full"
    assert placement.plan.queue_depth == 2
    assert placement.decision.prefill_worker_id is None


def test_no_prefill_workers_means_local():
    table = table_of(heartbeat("d0", WorkerRole.decode, 0))
    placement = place("least_loaded", route_req(50_000), table, CFG)
    assert placement.decision.worker_id == "d0"
    assert not placement.plan.remote and placement.plan.reason == "no_prefill_workers"


def test_no_decode_workers_falls_back_to_the_aggregated_pool():
    table = table_of(heartbeat("a0", WorkerRole.aggregated, 0), heartbeat("p0", WorkerRole.prefill, 0))
    placement = place("least_loaded", route_req(3000), table, CFG)
    assert placement.decision.worker_id == "a0"
    assert placement.plan.remote and placement.decision.prefill_worker_id == "p0"


def test_no_decode_or_aggregated_worker_is_unavailable():
    table = table_of(heartbeat("p0", WorkerRole.prefill, 0))
    with pytest.raises(NoWorkerAvailable):
        place("least_loaded", route_req(3000), table, CFG)


def test_cached_prefix_on_the_decode_worker_counts_against_the_threshold():
    table = disagg_table()
    # 1200 tokens, 20 blocks (320 tokens) already cached on d0: 880 uncached -> local.
    cached = RoutingDecision(worker_id="d0", policy="kv", overlap_blocks=20)
    plan = decide_prefill("round_robin", route_req(1200), cached, table, CFG)
    assert not plan.remote and plan.uncached_tokens == 1200 - 20 * BLOCK
    # Same prompt, nothing cached on d1: remote.
    cold = RoutingDecision(worker_id="d1", policy="kv", overlap_blocks=0)
    assert decide_prefill("round_robin", route_req(1200), cold, table, CFG).remote


def test_threshold_and_queue_limit_are_configurable():
    table = disagg_table(prefill_waiting=3)
    loose = DisaggConfig(prefill_threshold_tokens=100, max_prefill_queue_per_worker=4)
    assert place("round_robin", route_req(101), table, loose).plan.remote
    assert not place("round_robin", route_req(100), table, loose).plan.remote
    assert not place("round_robin", route_req(101), table, DisaggConfig(100, 3)).plan.remote


def test_queue_limit_scales_with_the_prefill_pool():
    table = table_of(heartbeat("d0", WorkerRole.decode, 0), heartbeat("p0", WorkerRole.prefill, 0, waiting=2),
                     heartbeat("p1", WorkerRole.prefill, 1, waiting=1))
    assert prefill_queue_depth(table.candidates(MODEL, WorkerRole.prefill)) == 3
    placement = place("least_loaded", route_req(4000), table, CFG)  # 3 < 2 x 2 workers
    assert placement.plan.remote and placement.decision.prefill_worker_id == "p1"  # least loaded prefill worker


def test_config_validation_and_settings_defaults():
    assert DisaggConfig.from_settings(Settings()) == DisaggConfig(1000, 2)
    with pytest.raises(ValueError):
        DisaggConfig(prefill_threshold_tokens=-1)
    with pytest.raises(ValueError):
        DisaggConfig(max_prefill_queue_per_worker=0)


def test_local_decisions_do_not_advance_the_prefill_round_robin():
    table = table_of(heartbeat("d0", WorkerRole.decode, 0), heartbeat("p0", WorkerRole.prefill, 0),
                     heartbeat("p1", WorkerRole.prefill, 1))
    place("round_robin", route_req(10), table, CFG)
    assert (MODEL, "prefill") not in table.rr_cursor
    first = place("round_robin", route_req(2000), table, CFG).decision.prefill_worker_id
    second = place("round_robin", route_req(2000), table, CFG).decision.prefill_worker_id
    assert [first, second] == ["p0", "p1"]


def core_of(*heartbeats: WorkerHeartbeat) -> RouterCore:
    core = RouterCore("round_robin", disagg=CFG, router_id="router-x")
    for hb in heartbeats:
        core.on_heartbeat(hb)
    return core


def routed(core: RouterCore, req: InferenceRequest, now_ms: int = 123) -> tuple[Decision, InferenceRequest]:
    """The router's routing step: the core's decision and the record sent to ``decision.target``'s queue."""
    decision = core.route(Arrival.of(req), now_ms)
    assert decision.outcome is DecisionOutcome.routed
    placement = decision.placement
    return decision, routed_record(req, placement.decision, decision.decode_worker, placement.plan.remote)


def test_remote_goes_to_the_prefill_queue_with_the_decode_target():
    core = core_of(*DISAGG_HEARTBEATS)
    req = request("long-1", 2000)
    decision, record = routed(core, req)
    assert (decision.target.queue_topic, decision.target.queue_partition) == (
        CATALOG.queue(WorkerRole.prefill).name, 0)
    stage = parse_stage(record.disaggregated_params)
    decode_worker = decision.decode_worker
    assert stage == PrefillStage(decode_worker_id=decode_worker.worker_id,
                                 decode_queue_topic=CATALOG.queue(WorkerRole.decode).name,
                                 decode_queue_partition=decode_worker.queue_partition)
    assert record.routing.prefill_worker_id == "p0"
    assert (record.routing.router_id, record.routing.decided_ms) == ("router-x", 123)
    assert record.token_ids is req.token_ids and record.reply_to == req.reply_to  # shared, not copied
    # Both the prefill and the decode worker count the request until their next heartbeat.
    assert core.table.workers["p0"].routed_since_heartbeat == 1
    assert core.table.workers[decode_worker.worker_id].routed_since_heartbeat == 1


def test_local_goes_to_the_decode_queue_and_strips_client_params():
    core = core_of(*DISAGG_HEARTBEATS)
    sneaky = request("short-1", 10, disaggregated_params={"stage": "decode", "prefill_worker_id": "evil",
                                                           "first_token_id": 1, "num_prompt_tokens": 10})
    decision, record = routed(core, sneaky)
    assert decision.target is decision.decode_worker
    assert decision.target.queue_topic == CATALOG.queue(WorkerRole.decode).name
    assert record.disaggregated_params is None
    assert core.table.workers["p0"].routed_since_heartbeat == 0


def test_requests_routed_since_the_heartbeat_fill_the_prefill_queue():
    core = core_of(*DISAGG_HEARTBEATS)
    remote = [routed(core, request(f"r{i}", 3000))[0].placement.plan.remote for i in range(4)]
    # Limit 2 on one prefill worker: two go remote, then the queue counts as full until a heartbeat.
    assert remote == [True, True, False, False]
    core.on_heartbeat(heartbeat("p0", WorkerRole.prefill, 0).model_copy(update={"ts_ms": 2_000}))
    assert routed(core, request("r9", 3000))[0].placement.plan.remote
