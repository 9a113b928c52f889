"""The Grafana dashboard and the Prometheus scrape config in infra/ match what the processes export.

Exported names come from the real registries of a bridge, a worker (mocker
engine), a router app, a planner loop after a real tick (real chDB) and the
consumer-lag collector, never from a hand-written list.
"""

import json
import re
from pathlib import Path

import pytest
import yaml

from kvflow.planner.core import PlannerConfig, PlannerMode
from kvflow.planner.loop import PlannerLoop, load_profile
from kvflow.planner.prometheus import planner_registry
from kvflow.planner.service import open_shared_clickhouse
from kvflow.router.app import build_router_app
from kvflow.schemas import WorkerRole
from kvflow.streams.bridge.metrics import BridgeMetrics
from kvflow.streams.broker import broker_process_registry
from kvflow.streams.bridge.worker_registry import WorkerRegistry
from kvflow.streams.lag import ConsumerLag
from kvflow.streams.metrics_server import metric_names
from kvflow.workers.engines.mocker import MockerEngine
from kvflow.workers.engines.mocker_core import MockerConfig
from kvflow.workers.worker import Worker, WorkerConfig

INFRA = Path(__file__).resolve().parent.parent / "infra"
METRIC = re.compile(r"\bkvflow_[a-zA-Z0-9_:]+")


@pytest.fixture
async def exported(broker, kafka, tmp_path) -> set[str]:
    settings, catalog = kafka
    worker = Worker(settings, WorkerConfig(worker_id="w0", slot=0, model="m"),
                    MockerEngine(MockerConfig(), worker_id="w0", model_name="m"), catalog)
    router = build_router_app(settings, catalog, policy="kv")
    clickhouse = await open_shared_clickhouse(settings, tmp_path / "chdb")
    loop = PlannerLoop(settings, catalog, clickhouse, PlannerConfig(mode=PlannerMode.aggregated), load_profile(None),
                       lambda: {WorkerRole.aggregated: 1}, settle_s=0)
    await loop.start(run=False)
    try:
        await loop.tick()  # the planner exports its per-tick series only once it has ticked
        bridge = BridgeMetrics()
        bridge.track_workers(WorkerRegistry())  # the bridge app always does (the prefill pool's gauges)
        registries = [bridge.registry, worker.prom.registry, router.prom.registry,
                      planner_registry(loop), ConsumerLag(settings, catalog).registry,
                      broker_process_registry(broker)]
        yield set().union(*(metric_names(r) for r in registries))
    finally:
        await loop.stop()
        clickhouse.close()
        await worker.producer.stop()  # built, never started
        await worker.consumer.stop()


def panel_queries(dashboard: dict) -> list[tuple[str, str]]:
    """``(panel title, expr)`` of every target of every panel (rows' nested panels included)."""
    found = []
    for panel in dashboard["panels"]:
        for inner in [panel, *panel.get("panels", [])]:
            for target in inner.get("targets", []):
                found.append((inner["title"], target["expr"]))
    return found


async def test_every_dashboard_query_names_exported_metrics(exported):
    dashboard = json.loads((INFRA / "grafana" / "kvflow.json").read_text())
    graphs = [p for p in dashboard["panels"] if p["type"] != "row"]
    assert graphs and all(p.get("targets") for p in graphs), "every graph panel has a query"
    queries = panel_queries(dashboard)
    unknown = {(title, name) for title, expr in queries for name in METRIC.findall(expr) if name not in exported}
    assert not unknown, f"panels query metrics no process exports: {sorted(unknown)}"
    assert all(METRIC.search(expr) for _, expr in queries), "every query names a kvflow metric"
    # Every process kind has at least one panel.
    used = {name for _, expr in queries for name in METRIC.findall(expr)}
    for prefix in ("kvflow_bridge_", "kvflow_worker_", "kvflow_router_", "kvflow_planner_", "kvflow_consumer_lag",
                   "kvflow_broker_"):
        assert any(n.startswith(prefix) for n in used), prefix
    # Prometheus conventions: counters end in _total, no name carries a unit other than base units.
    assert not any(re.search(r"_(milliseconds|ms|bytes_total_bytes)$", n) for n in exported)


def test_scrape_config_names_the_kvflow_job():
    config = yaml.safe_load((INFRA / "prometheus" / "prometheus.yml").read_text())
    jobs = {job["job_name"]: job for job in config["scrape_configs"]}
    assert jobs["kvflow"]["metrics_path"] == "/metrics"
    assert jobs["kvflow"]["static_configs"][0]["targets"]
