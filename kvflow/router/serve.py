"""One router replica as its own process (``kvflow router``).

``kvflow up`` runs its router inside the supervisor's process; a production
deployment runs the router as a service of its own, one or more replicas in
front of the workers. Replicas that share a consumer group (``group``, the
Faust app id) split the requests topic's partitions between them; each folds
the whole workers, KV-events and inflight topics itself, so they decide
alike (:mod:`kvflow.router.app`). When a replica stops or dies, the group
hands its partitions to the others.

Stopping (SIGTERM or SIGINT) loses no request: the replica leaves the group
(its offsets committed), then puts each request it still held (``queue``
shedding mode) back on the requests topic, where a remaining replica routes
it. A replica killed outright loses its held requests' places; each of them
still ends at its deadline (the bridge answers ``deadline_exceeded``), and
the requests it had routed finish on their workers as usual.
"""

from __future__ import annotations

import asyncio
import logging
import signal
from collections.abc import Callable

from kvflow.router.app import RouterApp, build_router_app
from kvflow.schemas import InferenceRequest, encode
from kvflow.settings import Settings
from kvflow.streams.catalog import Catalog
from kvflow.streams.fetch_wait import produced
from kvflow.streams.kafka import create_topics, make_producer

__all__ = ["hand_back_held", "serve_router"]

log = logging.getLogger(__name__)


async def hand_back_held(router: RouterApp) -> int:
    """Put every request ``router`` holds back on the requests topic, with a
    producer of its own (the router's app may be stopped already); returns
    how many went back.

    Raises:
        aiokafka.errors.KafkaError: the broker did not take a record (the
            requests still held are then lost to this replica, as on a crash).
    """
    held = router.core.take_held()
    if not held:
        return 0
    producer = make_producer(router.settings)
    await producer.start()
    try:
        for arrival in held:
            request: InferenceRequest = arrival.payload
            await producer.send_and_wait(router.catalog.requests.name, encode(request),
                                         key=request.request_id.encode())
    finally:
        await producer.stop()
    produced(router.catalog.requests.name)  # the other replicas' request readers may be parked
    log.info("router %s handed %d held request(s) back to the requests topic", router.router_id, len(held))
    return len(held)


async def serve_router(settings: Settings, *, policy: str | None = None, router_id: str | None = None,
                       group: str | None = None, catalog: Catalog | None = None, ensure_topics: bool = True,
                       on_ready: Callable[[RouterApp, str | None], None] | None = None) -> None:
    """Run one router replica until SIGINT or SIGTERM, then stop it as the
    module docstring says.

    ``group`` is the consumer group replicas share (default
    ``<namespace>-router``, the group of ``kvflow up``'s own router).
    With ``settings.metrics_port`` set, the replica's Prometheus series are
    served on it; ``on_ready(router, metrics_url)`` is called once it runs.
    ``ensure_topics`` first creates the catalog topics that do not exist
    (:func:`~kvflow.streams.kafka.create_topics`), so a cluster's first
    router replica sets its topics up.

    Raises:
        KeyError: ``policy`` is not a registered routing policy.
        OSError: the metrics port cannot be bound.
        aiokafka.errors.KafkaError: topics cannot be listed or created.
    """
    from kvflow.streams.metrics_server import serve_metrics

    catalog = catalog or Catalog(settings.namespace)
    if ensure_topics:
        await create_topics(settings, catalog)
    router = build_router_app(settings, catalog, policy=policy, router_id=router_id, app_id=group)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    metrics = None
    await router.app.start()
    try:
        if settings.metrics_port is not None:
            metrics = await serve_metrics([router.prom.registry], settings.metrics_host, settings.metrics_port)
        if on_ready is not None:
            on_ready(router, metrics.url if metrics is not None else None)
        await stop.wait()
    finally:
        if metrics is not None:
            await metrics.stop()
        await router.app.stop()
        await hand_back_held(router)
