"""Scaling connectors: the local one on a real supervisor with worker processes, the
Kubernetes one through the official client against recorded API exchanges."""

from __future__ import annotations

import asyncio
import io
import json
from pathlib import Path
from urllib.parse import parse_qsl, urlsplit

import pytest
from deployment import steady
import urllib3
from kubernetes.client import ApiClient, AppsV1Api, Configuration
from kubernetes.client.exceptions import ApiException

from kvflow.planner.connectors import ConnectorService, read_scaling_commands
from kvflow.planner.connectors.kubernetes import KubernetesConnector
from kvflow.planner.connectors.local import LocalConnector
from kvflow.planner.loop import publish_command
from kvflow.schemas import ScalingCommand, WorkerRole, now_ms
from kvflow.streams.kafka import make_producer
from kvflow.supervisor import Supervisor, WorkerSpec

DATA = Path(__file__).parent / "data"
AGG = WorkerRole.aggregated


def command(decision_id: str, target: int, pool: WorkerRole = AGG, ts_ms: int | None = None) -> ScalingCommand:
    return ScalingCommand(decision_id=decision_id, pool=pool, target_replicas=target, ts_ms=ts_ms or now_ms())


async def publish(settings, catalog, *items: ScalingCommand | bytes) -> None:
    producer = make_producer(settings)
    await producer.start()
    try:
        for item in items:
            if isinstance(item, bytes):
                await producer.send_and_wait(catalog.scaling.name, item, key=b"aggregated")
            else:
                await publish_command(producer, catalog, item)
    finally:
        await producer.stop()


# --- local connector -----------------------------------------------------------


@pytest.fixture
async def supervisor(kafka):
    settings, _ = kafka
    sup = Supervisor(steady(settings),
                     WorkerSpec(engine="mocker", model="mock-model", extra_args=["--speedup-ratio=20"]), bridge=False)
    await sup.start()
    yield sup
    await sup.stop()


async def test_local_connector_applies_each_decision_once(kafka, supervisor, waiter):
    settings, catalog = kafka
    sup = supervisor
    service = ConnectorService(settings, catalog, LocalConnector(sup))
    await service.start()
    try:
        t = now_ms()
        await publish(settings, catalog, command("d1", 2, ts_ms=t))
        await waiter(lambda: len(service.applied) == 1, timeout_s=30)
        assert sup.replicas(AGG) == 2
        await sup.wait_workers_ready(2, timeout_s=30)
        first_two = set(sup.children)

        # d1 again, even with a newer timestamp, is a decision already applied; garbage is dead-lettered.
        await publish(settings, catalog, command("d2", 1, ts_ms=t + 1), b"{not a command",
                      command("d1", 2, ts_ms=t + 2))
        # Every record is handled once the duplicate is skipped; nothing left queued or applying
        # means no third apply can still come.
        await waiter(lambda: len(service.applied) == 2 and service.skipped and service.idle, timeout_s=30)
        assert [(a.decision_id, a.target_replicas, a.replicas, a.error) for a in service.applied] == [
            ("d1", 2, 2, None), ("d2", 1, 1, None)]
        assert service.skipped == [("d1", "decision already applied")]
        assert service.dlq.count == 1
        assert sup.replicas(AGG) == 1 and set(sup.children) < first_two  # the newest was drained
    finally:
        await service.stop()

    # A restarted connector resumes after its committed offset: d1 and d2 are not applied again.
    again = ConnectorService(settings, catalog, LocalConnector(sup))
    await again.start()
    try:
        await publish(settings, catalog, command("d3", 1))
        await waiter(lambda: len(again.applied) == 1 and again.idle, timeout_s=30)
        assert [a.decision_id for a in again.applied] == ["d3"] and again.skipped == []
    finally:
        await again.stop()
    assert [c.decision_id for c in await read_scaling_commands(settings, catalog)] == ["d1", "d2", "d1", "d3"]


async def test_stale_and_superseded_commands_are_not_applied(kafka, waiter):
    settings, catalog = kafka

    class SlowScaler:
        """Records scale calls; each takes a while, like a drain."""

        def __init__(self) -> None:
            self.calls: list[int] = []
            self.n = 1

        async def scale(self, role, target):
            self.calls.append(target)
            await asyncio.sleep(0.5)
            self.n = target

        def replicas(self, role):
            return self.n

    scaler = SlowScaler()
    service = ConnectorService(settings, catalog, LocalConnector(scaler, max_replicas=8), max_age_s=60)
    await service.start()
    try:
        t = now_ms()
        await publish(settings, catalog, command("old", 5, ts_ms=t - 120_000),  # older than max_age_s
                      command("a", 2, ts_ms=t))
        await waiter(lambda: scaler.calls == [2], timeout_s=20)
        # While a is being applied: b is queued, then replaced by c; late is older than c.
        await publish(settings, catalog, command("b", 3, ts_ms=t + 1), command("c", 4, ts_ms=t + 2),
                      command("late", 6, ts_ms=t + 1))
        await waiter(lambda: len(service.applied) == 2, timeout_s=20)
        await publish(settings, catalog, command("big", 9, ts_ms=t + 3))  # refused by max_replicas
        await waiter(lambda: len(service.applied) == 3, timeout_s=20)
    finally:
        await service.stop()
    assert scaler.calls == [2, 4]
    assert [(a.decision_id, a.error is None) for a in service.applied] == [("a", True), ("c", True), ("big", False)]
    assert "max_replicas" in service.applied[-1].error
    reasons = dict(service.skipped)
    assert set(reasons) == {"old", "b", "late"}
    assert "older than 60 s" in reasons["old"] and "superseded by c" in reasons["b"]


async def test_shadow_commands_are_never_applied(kafka, waiter):
    settings, catalog = kafka

    class Scaler:
        def __init__(self) -> None:
            self.calls: list[int] = []

        async def scale(self, role, target):
            self.calls.append(target)

        def replicas(self, role):
            return self.calls[-1] if self.calls else 1

    scaler = Scaler()
    service = ConnectorService(settings, catalog, LocalConnector(scaler, max_replicas=8))
    await service.start()
    try:
        t = now_ms()
        advisory = ScalingCommand(decision_id="s1", pool=AGG, target_replicas=5, ts_ms=t, shadow=True)
        await publish(settings, catalog, advisory, command("a1", 2, ts_ms=t + 1))
        await waiter(lambda: len(service.applied) == 1 and service.skipped, timeout_s=20)
    finally:
        await service.stop()
    assert scaler.calls == [2]
    assert service.skipped == [("s1", "shadow decision (advisory)")]


# --- kubernetes connector --------------------------------------------------------


class RecordedApiServer:
    """Stands in for urllib3's pool manager under the official client.

    Each request must equal one of the recorded exchanges still pending
    (method, path, query, content type, JSON body); the reply is that
    exchange's recorded response. Anything else fails the call.
    """

    def __init__(self, cassette: str) -> None:
        self.pending = json.loads((DATA / cassette).read_text())["interactions"]
        self.calls: list[dict] = []

    def request(self, method, url, body=None, headers=None, fields=None, timeout=None, preload_content=True,
                **kwargs):
        parts = urlsplit(url)
        call = {"method": method, "path": parts.path, "query": dict(parse_qsl(parts.query)),
                "content_type": (headers or {}).get("Content-Type"), "body": json.loads(body) if body else None}
        self.calls.append(call)
        match = next((i for i in self.pending if i["request"] == call), None)
        if match is None:
            raise AssertionError(f"unrecorded Kubernetes API call: {call}")
        self.pending.remove(match)
        resp = match["response"]
        return urllib3.HTTPResponse(body=io.BytesIO(json.dumps(resp["body"]).encode()), headers=resp["headers"],
                                    status=resp["status"], reason=resp["reason"], preload_content=False)

    def clear(self) -> None:
        pass


def recorded_apps_api(cassette: str) -> tuple[AppsV1Api, RecordedApiServer]:
    config = Configuration(host="https://kube.test:6443")
    api_client = ApiClient(config)
    server = RecordedApiServer(cassette)
    api_client.rest_client.pool_manager = server
    return AppsV1Api(api_client), server


WORKLOADS = {WorkerRole.prefill: "kvflow-prefill", WorkerRole.decode: "kvflow-decode"}


async def test_kubernetes_connector_patches_spec_replicas():
    apps, server = recorded_apps_api("k8s_scale_deployments.json")
    k8s = KubernetesConnector(apps, "inference", WORKLOADS)
    assert await k8s.apply(command("1-decode", 3, WorkerRole.decode)) == 3
    assert await k8s.apply(command("1-prefill", 1, WorkerRole.prefill)) == 1
    assert server.pending == []
    assert [(c["method"], c["path"], c["content_type"], c["body"]) for c in server.calls] == [
        ("PATCH", "/apis/apps/v1/namespaces/inference/deployments/kvflow-decode", "application/merge-patch+json",
         {"spec": {"replicas": 3}}),
        ("PATCH", "/apis/apps/v1/namespaces/inference/deployments/kvflow-prefill", "application/merge-patch+json",
         {"spec": {"replicas": 1}})]
    with pytest.raises(KeyError):
        await k8s.apply(command("1-agg", 2, AGG))  # no workload configured for the pool


async def test_kubernetes_connector_reports_a_missing_deployment():
    apps, server = recorded_apps_api("k8s_deployment_not_found.json")
    k8s = KubernetesConnector(apps, "inference", WORKLOADS)
    with pytest.raises(ApiException) as err:
        await k8s.apply(command("2-decode", 2, WorkerRole.decode))
    assert err.value.status == 404 and "not found" in err.value.body
    assert server.pending == []


async def test_kubernetes_connector_scales_a_statefulset():
    apps, server = recorded_apps_api("k8s_scale_statefulset.json")
    k8s = KubernetesConnector(apps, "inference", {AGG: "kvflow-workers"}, kind="StatefulSet")
    assert await k8s.replicas(AGG) == 1
    assert await k8s.apply(command("3-agg", 4)) == 4
    assert server.pending == []
    with pytest.raises(ValueError):
        KubernetesConnector(apps, "inference", {AGG: "x"}, kind="ReplicaSet")


async def test_kubernetes_connector_behind_the_scaling_topic(kafka, waiter):
    settings, catalog = kafka
    apps, server = recorded_apps_api("k8s_scale_deployments.json")
    service = ConnectorService(settings, catalog, KubernetesConnector(apps, "inference", WORKLOADS))
    await service.start()
    try:
        t = now_ms()
        decode = command(f"{t}-decode", 3, WorkerRole.decode, ts_ms=t)
        await publish(settings, catalog, decode, command(f"{t}-prefill", 1, WorkerRole.prefill, ts_ms=t), decode)
        await waiter(lambda: len(service.applied) == 2 and service.skipped and service.idle, timeout_s=20)
    finally:
        await service.stop()
    assert sorted((a.pool.value, a.replicas, a.error) for a in service.applied) == [
        ("decode", 3, None), ("prefill", 1, None)]
    assert len(server.calls) == 2 and server.pending == []  # the republished decision made no API call


def test_shipped_manifests_let_a_worker_drain():
    import yaml

    from kvflow.settings import Settings
    from kvflow.workers.worker import WorkerConfig

    root = Path(__file__).resolve().parents[1] / "infra" / "k8s"
    workers = {d["kind"]: d for d in yaml.safe_load_all((root / "workers.yaml").read_text())}
    planner = {d["kind"]: d for d in yaml.safe_load_all((root / "planner.yaml").read_text())}
    pod = workers["StatefulSet"]["spec"]["template"]["spec"]
    worker = pod["containers"][0]
    longest_drain_s = 2 * Settings().heartbeat_interval_ms / 1000 + WorkerConfig("w", 0, "m").drain_timeout_s
    assert pod["terminationGracePeriodSeconds"] > longest_drain_s
    assert worker["command"][:4] == ["python", "-m", "kvflow", "worker"]  # exec form: SIGTERM reaches the worker
    assert "lifecycle" not in worker  # no preStop hook delaying the drain
    env = {e["name"]: e for e in worker["env"]}
    assert "pod-index" in env["KVFLOW_WORKER_SLOT"]["valueFrom"]["fieldRef"]["fieldPath"]
    # The planner patches the StatefulSet the workers file defines, with a Role allowing it.
    args = planner["Deployment"]["spec"]["template"]["spec"]["containers"][0]["command"]
    assert args[args.index("--workload-kind") + 1] == "StatefulSet"
    assert args[args.index("--workload") + 1] == f"aggregated={workers['StatefulSet']['metadata']['name']}"
    rule = planner["Role"]["rules"][0]
    assert "statefulsets" in rule["resources"] and {"get", "patch"} <= set(rule["verbs"])
