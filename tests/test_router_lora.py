"""Routing of LoRA requests: adapter-salted block hashes and the preference for workers with the adapter."""

from __future__ import annotations

from kvflow.router.core import Arrival, RouterCore
from kvflow.schemas import BlockStored, KvEventBatch, WorkerHeartbeat
from kvflow.schemas.block_hash import compute_block_hashes
from kvflow.streams.bridge.worker_registry import WorkerRegistry

MODEL = "base"
BS = 16
LONG = list(range(1_000, 1_640))  # 40 blocks


def hb(worker_id: str, slot: int, adapters: list[str] = (), ts_ms: int = 1_000) -> WorkerHeartbeat:
    return WorkerHeartbeat(worker_id=worker_id, model=MODEL, engine="hf", block_size=BS, kv_total_blocks=1_000,
                           queue_topic="q.aggregated", queue_partition=slot, ts_ms=ts_ms, started_ms=1,
                           lora_adapters=list(adapters))


def stored(worker_id: str, event_id: int, tokens: list[int], lora: str | None = None) -> KvEventBatch:
    return KvEventBatch(worker_id=worker_id, event_id=event_id, block_size=BS, ts_ms=1_000,
                        events=[BlockStored(block_hashes=compute_block_hashes(tokens, BS, lora), lora_name=lora)])


def arrival(rid: str, lora: str | None = None) -> Arrival:
    return Arrival(rid, MODEL, len(LONG), token_ids=LONG, lora_name=lora, payload=rid)


def overlaps(decision) -> dict[str, int]:
    return {c.worker_id: c.overlap_blocks for c in decision.placement.decision.candidates}


def test_adapter_and_base_never_share_blocks_in_the_index():
    core = RouterCore("kv", router_id="r0")
    for slot, w in enumerate(("w0", "w1")):
        core.on_heartbeat(hb(w, slot))
    core.on_kv_batch(stored("w0", 0, LONG))  # w0 caches the base model's blocks of the prompt
    base = core.route(arrival("base"), 1_000)
    assert base.target.worker_id == "w0" and overlaps(base)["w0"] == len(LONG) // BS
    tuned = core.route(arrival("tuned", "sql"), 1_000)
    assert set(overlaps(tuned).values()) == {0}  # the same prompt under an adapter matches nothing
    core.on_kv_batch(stored("w1", 0, LONG, "sql"))
    tuned = core.route(arrival("tuned2", "sql"), 1_000)
    assert tuned.target.worker_id == "w1" and overlaps(tuned) == {"w0": 0, "w1": len(LONG) // BS}


def test_adapter_requests_prefer_workers_with_the_adapter_loaded():
    core = RouterCore("kv", router_id="r0")
    for slot, w in enumerate(("w0", "w1", "w2")):
        core.on_heartbeat(hb(w, slot))
    core.on_kv_batch(stored("w0", 0, LONG, "sql"))  # w0 once served the adapter and still caches its blocks
    assert core.route(arrival("a", "sql"), 1_000).target.worker_id == "w0"
    core.on_heartbeat(hb("w2", 2, ["sql"], ts_ms=1_100))  # loaded on w2
    for i in range(4):
        d = core.route(arrival(f"b{i}", "sql"), 1_200)
        assert d.target.worker_id == "w2"
        assert [c.worker_id for c in d.placement.decision.candidates] == ["w2"]
    # Base requests are not restricted: the cached base blocks on w0 still win.
    core.on_kv_batch(stored("w0", 1, LONG))
    assert core.route(arrival("base"), 1_200).target.worker_id == "w0"


def test_bridge_registry_serves_adapters_as_models():
    now = [1_000]
    reg = WorkerRegistry(clock=lambda: now[0])
    reg.apply(hb("w0", 0))
    reg.apply(hb("w1", 1, ["sql"]))
    assert reg.models() == ["base", "sql"]
    assert reg.lora_base("sql") == "base"
    assert reg.lora_base("base") is None and reg.lora_base("nope") is None
    reg.apply(hb("w1", 1, ts_ms=1_100))  # unloaded
    assert reg.lora_base("sql") is None and reg.models() == ["base"]
