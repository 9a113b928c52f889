"""The router: a Faust app that routes requests to worker queues.

Agents (one projection each):

- ``track_workers`` folds worker heartbeats into the ``routing-table``
  GlobalTable (changelogged, so a restarted router recovers it) and the
  in-memory :class:`~kvflow.router.table.RoutingTable` derived from it.
- ``route_requests`` decodes each request, asks the configured policy for a
  worker (:func:`~kvflow.router.policies.select_worker`), and forwards the
  request, with its :class:`~kvflow.schemas.RoutingDecision`, to that
  worker's queue partition. With no worker it answers the caller directly
  with an error :class:`~kvflow.schemas.FinalResponse` (HTTP 503 semantics).

Malformed records go to the dead-letter topic; no agent dies of one.
"""

from __future__ import annotations

import logging
import tempfile
import uuid
from dataclasses import dataclass, field

import faust

from kvflow.router.disagg import DisaggConfig, route_and_forward
from kvflow.router.policies import NoWorkerAvailable, RouteRequest
from kvflow.router.table import RoutingTable, apply_heartbeat, expire_workers
from kvflow.schemas import (
    DeadLetter,
    ErrorInfo,
    FinalResponse,
    FinishReason,
    InferenceRequest,
    RecordError,
    WorkerHeartbeat,
    WorkerRole,
    decode,
    encode,
    now_ms,
)
from kvflow.settings import Settings
from kvflow.streams.catalog import Catalog
from kvflow.streams.kafka import bootstrap
from kvflow.streams.tansu_compat import patch_faust_fetch_wait

__all__ = ["RouterApp", "build_router_app"]

log = logging.getLogger(__name__)


@dataclass
class RouterApp:
    """A built router: the Faust app plus the state its agents maintain."""

    app: faust.App
    table: RoutingTable
    settings: Settings
    catalog: Catalog
    router_id: str
    policy: str
    counters: dict[str, int] = field(default_factory=lambda: {"routed": 0, "rejected": 0, "dead_lettered": 0})


def build_router_app(settings: Settings, catalog: Catalog | None = None, *, policy: str | None = None,
                     router_id: str | None = None, app_id: str | None = None) -> RouterApp:
    """Build (not start) the router Faust app.

    ``app_id`` is the Faust app id = consumer group; router replicas that
    split the request stream share one id. Start it with
    ``await router.app.start()`` (or ``faust worker`` style via the CLI).

    Raises:
        KeyError: ``policy`` is not a registered policy.
    """
    from kvflow.router.policies import POLICIES

    catalog = catalog or Catalog(settings.namespace)
    policy = policy or settings.routing_policy
    if policy not in POLICIES:
        raise KeyError(f"unknown routing policy {policy!r}; known: {sorted(POLICIES)}")
    router_id = router_id or f"router-{uuid.uuid4().hex[:8]}"
    if settings.embedded_broker:
        patch_faust_fetch_wait(settings.fetch_max_wait_ms)

    app = faust.App(
        app_id or f"{settings.namespace}-router",
        broker=f"kafka://{bootstrap(settings)}",
        store="memory://",
        datadir=tempfile.mkdtemp(prefix="kvflow-router-"),  # Faust writes here; keep it out of the cwd
        web_enabled=False,
        autodiscover=False,
        producer_linger_ms=0,
        producer_acks=1,
        broker_session_timeout=settings.session_timeout_ms / 1000,
        broker_heartbeat_interval=max(0.1, settings.session_timeout_ms / 6000),
        broker_request_timeout=max(40.0, settings.session_timeout_ms / 1000 + 5),
        consumer_auto_offset_reset="latest",
        topic_allow_declare=True,
        topic_disable_leader=True,
        table_cleanup_interval=3600.0,
        stream_wait_empty=False,
    )
    state = RouterApp(app=app, table=RoutingTable(), settings=settings, catalog=catalog,
                      router_id=router_id, policy=policy)
    disagg_config = DisaggConfig.from_settings(settings)

    raw = dict(key_type=bytes, value_type=bytes, key_serializer="raw", value_serializer="raw")
    requests_topic = app.topic(catalog.requests.name, partitions=catalog.requests.partitions, **raw)
    workers_topic = app.topic(catalog.workers.name, partitions=catalog.workers.partitions, **raw)
    routing_table = app.GlobalTable(
        "routing-table", key_type=str, value_type=bytes,
        partitions=catalog.workers.partitions, help="worker id -> last heartbeat record",
    )

    async def dead_letter(event: faust.EventT, error: str) -> None:
        state.counters["dead_lettered"] += 1
        msg = event.message
        value = msg.value if isinstance(msg.value, bytes) else str(msg.value).encode()
        record = DeadLetter(
            source_topic=msg.topic, partition=msg.partition, offset=msg.offset,
            key=msg.key.decode("utf-8", "replace") if isinstance(msg.key, bytes) else None,
            value=value.decode("utf-8", "replace"), error=error[:4000], consumer=router_id, ts_ms=now_ms(),
        )
        log.warning("dead-lettering %s@%d: %s", msg.topic, msg.offset, error[:200])
        await app.producer.send(catalog.dead_letter.name, msg.topic.encode(), encode(record), None, None, None)

    @app.agent(workers_topic, name="track_workers")
    async def track_workers(stream: faust.StreamT) -> None:
        async for event in stream.events():
            try:
                hb = decode(WorkerHeartbeat, event.value)
            except RecordError as exc:
                await dead_letter(event, str(exc))
                continue
            routing_table[hb.worker_id] = event.value
            apply_heartbeat(state.table, hb)

    @app.agent(requests_topic, name="route_requests")
    async def route_requests(stream: faust.StreamT) -> None:
        async for event in stream.events():
            try:
                request = decode(InferenceRequest, event.value)
            except RecordError as exc:
                await dead_letter(event, str(exc))
                continue
            try:
                await route_one(request)
            except Exception as exc:  # noqa: BLE001 - one bad request must not stop the router
                log.exception("routing %s failed", request.request_id)
                await dead_letter(event, f"routing failed: {exc!r}")

    async def route_one(request: InferenceRequest) -> None:
        now = now_ms()
        if not state.table.workers:
            restore_from_changelog()
        expire_workers(state.table, now)
        route_req = RouteRequest(
            request_id=request.request_id, model=request.model,
            isl=len(request.token_ids) if request.token_ids else 0, role=WorkerRole.aggregated,
            lora_name=request.lora_name,
        )
        try:
            await route_and_forward(state.policy, request, route_req, state.table, disagg_config, send_record,
                                    router_id=router_id, now_ms=now)
        except NoWorkerAvailable as exc:
            state.counters["rejected"] += 1
            await reply_error(request, str(exc), status=503, code="no_workers")
            return
        state.counters["routed"] += 1

    async def send_record(topic: str, partition: int, key: bytes, value: bytes) -> None:
        await app.producer.send(topic, key, value, partition, None, None)

    async def reply_error(request: InferenceRequest, message: str, *, status: int, code: str) -> None:
        final = FinalResponse(
            request_id=request.request_id, finish_reason=FinishReason.error,
            error=ErrorInfo(message=message, type="service_unavailable" if status == 503 else "server_error",
                            code=code, status=status),
        )
        await app.producer.send(request.reply_to.topic, request.request_id.encode(), encode(final),
                                request.reply_to.partition, None, None)

    def restore_from_changelog() -> None:
        # After recovery the changelogged table holds the last heartbeat of
        # every worker; seed the in-memory view from it (expiry drops the dead).
        for value in list(routing_table.values()):
            try:
                apply_heartbeat(state.table, decode(WorkerHeartbeat, value))
            except RecordError:
                continue

    return state
