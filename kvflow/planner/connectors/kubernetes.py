"""The Kubernetes connector: set ``spec.replicas`` of one workload per pool.

**Untested against a live cluster.** The tests drive the official
``kubernetes`` client end to end (request building, serialization, response
decoding, error mapping) against recorded API exchanges
(``tests/data/k8s_*.json``) with only the HTTP connection replaced; no
API server has been involved. Treat it as a starting point for a real
deployment, and try it on a test cluster first.

Each command becomes one JSON merge patch ``{"spec": {"replicas": N}}`` of the
pool's workload (``PATCH /apis/apps/v1/namespaces/<ns>/deployments/<name>``,
``Content-Type: application/merge-patch+json``). The workload names per pool
are configuration; the kind is ``Deployment`` (default) or ``StatefulSet``.

Draining on scale-down: the connector only lowers ``spec.replicas``; the
controller then deletes pods. Deleting a pod sends SIGTERM to its container,
and a kvflow worker treats SIGTERM as *drain*
(:meth:`kvflow.workers.worker.Worker.drain`: ``draining`` heartbeat, keep
consuming for two heartbeat periods, finish in-flight requests, ``stopped``).
For that to lose no request the pod spec must:

* run the worker as PID 1 in exec form (``command: [python, -m, kvflow, worker, ...]``),
  so SIGTERM reaches Python; no ``preStop`` hook is needed (one that sleeps
  would only delay the drain);
* set ``terminationGracePeriodSeconds`` above the longest drain: two
  heartbeat periods plus the worker's ``drain_timeout_s`` (60 s by default),
  e.g. 90; SIGKILL comes after it and aborts what is left.

A worker consumes one queue partition, its *slot*, so each replica needs a
distinct, stable slot. A StatefulSet gives that (pod ordinal = slot, via the
``apps.kubernetes.io/pod-index`` label and the downward API, and scale-down
removes the highest ordinals first); ``infra/k8s/workers.yaml`` shows it, and
``kind="StatefulSet"`` makes this connector patch it. A Deployment's pods
have no ordinal: use one only if something else hands out slots.

RBAC: ``patch`` (and ``get``) on ``deployments`` or ``statefulsets`` in the namespace.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from typing import Any

from kvflow.schemas import ScalingCommand, WorkerRole

__all__ = ["KubernetesConnector", "WORKLOAD_KINDS", "load_apps_api"]

WORKLOAD_KINDS = ("Deployment", "StatefulSet")
"""Workload kinds whose ``spec.replicas`` the connector patches."""

_MERGE_PATCH = "application/merge-patch+json"


def load_apps_api(in_cluster: bool | None = None, context: str | None = None) -> Any:
    """An ``AppsV1Api`` configured from the pod's service account or a kubeconfig.

    Args:
        in_cluster: ``True`` for the service account, ``False`` for
            ``~/.kube/config`` (``context`` selects one), ``None`` to try the
            service account first.

    Raises:
        kubernetes.config.ConfigException: no usable configuration.
    """
    from kubernetes import client, config

    if in_cluster is None:
        try:
            config.load_incluster_config()
        except config.ConfigException:
            config.load_kube_config(context=context)
    elif in_cluster:
        config.load_incluster_config()
    else:
        config.load_kube_config(context=context)
    return client.AppsV1Api()


class KubernetesConnector:
    """Sets the replicas of one workload per pool through the Kubernetes API.

    Args:
        apps_api: a ``kubernetes.client.AppsV1Api`` (see :func:`load_apps_api`).
        namespace: the Kubernetes namespace of the workloads.
        workloads: workload name per pool, e.g. ``{WorkerRole.decode: "kvflow-decode"}``.
        kind: ``"Deployment"`` or ``"StatefulSet"``.
        field_manager: recorded by the API server as the writer of ``spec.replicas``.
        request_timeout_s: per API call, s.

    Raises:
        ValueError: unknown ``kind`` or no workloads.
    """

    name = "kubernetes"

    def __init__(self, apps_api: Any, namespace: str, workloads: Mapping[WorkerRole | str, str], *,
                 kind: str = "Deployment", field_manager: str = "kvflow-planner",
                 request_timeout_s: float = 10.0) -> None:
        if kind not in WORKLOAD_KINDS:
            raise ValueError(f"kind must be one of {WORKLOAD_KINDS}, not {kind!r}")
        if not workloads:
            raise ValueError("no workloads: map at least one pool to a workload name")
        self.apps = apps_api
        self.namespace = namespace
        self.workloads = {WorkerRole(pool): name for pool, name in workloads.items()}
        self.kind = kind
        self.field_manager = field_manager
        self.request_timeout_s = request_timeout_s

    def _patch(self, workload: str, replicas: int) -> Any:
        patch = (self.apps.patch_namespaced_deployment if self.kind == "Deployment"
                 else self.apps.patch_namespaced_stateful_set)
        return patch(workload, self.namespace, {"spec": {"replicas": replicas}}, field_manager=self.field_manager,
                     _content_type=_MERGE_PATCH, _request_timeout=self.request_timeout_s)

    def _read(self, workload: str) -> Any:
        read = (self.apps.read_namespaced_deployment if self.kind == "Deployment"
                else self.apps.read_namespaced_stateful_set)
        return read(workload, self.namespace, _request_timeout=self.request_timeout_s)

    async def replicas(self, pool: WorkerRole) -> int:
        """``spec.replicas`` of ``pool``'s workload now.

        Raises:
            KeyError: no workload is configured for ``pool``.
            kubernetes.client.ApiException: the API call failed (404: no such workload).
        """
        workload = self.workloads[WorkerRole(pool)]
        obj = await asyncio.to_thread(self._read, workload)
        return int(obj.spec.replicas or 0)

    async def apply(self, command: ScalingCommand) -> int:
        """Patch the pool's workload to ``command.target_replicas``.

        The blocking client runs on a worker thread.

        Returns:
            ``spec.replicas`` in the object the API server returned.

        Raises:
            KeyError: no workload is configured for ``command.pool``.
            ValueError: the command names a worker pool other than the default
                one (workloads are configured per role only).
            kubernetes.client.ApiException: the API server refused (404 no
                such workload, 403 RBAC, 422 invalid, ...).
            RuntimeError: the returned object does not carry the new target.
        """
        if command.worker_pool:
            raise ValueError(f"workloads are configured per role of the default worker pool, not for worker pool "
                             f"{command.worker_pool!r}")
        workload = self.workloads[command.pool]
        obj = await asyncio.to_thread(self._patch, workload, command.target_replicas)
        replicas = int(obj.spec.replicas or 0)
        if replicas != command.target_replicas:
            raise RuntimeError(f"{self.kind} {self.namespace}/{workload} has spec.replicas={replicas} "
                               f"after patching it to {command.target_replicas}")
        return replicas
