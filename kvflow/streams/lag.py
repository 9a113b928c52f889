"""Consumer lag per topic and consumer group, as Prometheus gauges.

``kvflow_consumer_lag_records{group, topic}``: records in ``topic`` past
``group``'s committed offsets, summed over the partitions the group has
committed on. Groups are those the broker lists whose names start with the
deployment's namespace (the router's ``<ns>-router``, each worker slot's
``<ns>.worker.<role>.<slot>``, the metrics sink, the scaling connector).

Lag needs broker round trips, so it is not read inside a scrape's collect:
:meth:`ConsumerLag.refresh` (awaited before each scrape by the ``kvflow up``
metrics server, at most once per ``min_interval_s``) stores the figures the
collector then reports.

The embedded broker (Tansu) answers OffsetFetch only for listed partitions,
so every catalog partition is asked for explicitly; its end offsets can be
short by up to one batch (:mod:`kvflow.streams.tansu_compat`), so lag there
is a lower bound.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Iterator

from aiokafka import TopicPartition
from aiokafka.admin import AIOKafkaAdminClient
from prometheus_client import CollectorRegistry
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from kvflow.settings import Settings
from kvflow.streams.catalog import Catalog
from kvflow.streams.kafka import bootstrap, make_consumer
from kvflow.streams.kafka_security import client_security

__all__ = ["ConsumerLag"]

log = logging.getLogger(__name__)


class ConsumerLag(Collector):
    """Lag of the namespace's consumer groups; register it in a registry and
    ``await refresh()`` before scraping. Use ``async with`` or :meth:`start`/:meth:`stop`."""

    def __init__(self, settings: Settings, catalog: Catalog | None = None, *, min_interval_s: float = 2.0) -> None:
        self.settings = settings
        self.catalog = catalog or Catalog(settings.namespace)
        self.min_interval_s = min_interval_s
        self.lag: dict[tuple[str, str], int] = {}
        """Lag in records by (group, topic), from the last refresh."""
        self._refreshed_s = float("-inf")
        self._admin: AIOKafkaAdminClient | None = None
        self._consumer = None
        self.registry = CollectorRegistry()
        self.registry.register(self)

    async def start(self) -> None:
        """Connect the admin client and an offsets-only consumer."""
        self._admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap(self.settings), client_id="kvflow-lag",
                                          **client_security(self.settings))
        await self._admin.start()
        self._consumer = make_consumer(self.settings)
        await self._consumer.start()

    async def stop(self) -> None:
        """Close the clients."""
        for client in (self._consumer, self._admin):
            if client is not None:
                with contextlib.suppress(Exception):
                    await (client.close() if client is self._admin else client.stop())
        self._admin = self._consumer = None

    async def __aenter__(self) -> ConsumerLag:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    def _partitions(self) -> list[TopicPartition]:
        return [TopicPartition(t.name, p) for t in self.catalog.all() for p in range(t.partitions)]

    async def refresh(self, *, force: bool = False) -> None:
        """Re-read groups, committed offsets and end offsets (skipped when the
        last refresh is younger than ``min_interval_s``, unless ``force``).

        Raises:
            aiokafka.errors.KafkaError: the broker did not answer.
        """
        if self._admin is None:
            raise RuntimeError("ConsumerLag is not started")
        if not force and time.monotonic() - self._refreshed_s < self.min_interval_s:
            return
        ns = self.settings.namespace
        groups = [g for g, _ in await self._admin.list_consumer_groups() if g.startswith((f"{ns}.", f"{ns}-"))]
        partitions = self._partitions()
        ends = await self._consumer.end_offsets(partitions)
        lag: dict[tuple[str, str], int] = {}
        for group in sorted(groups):
            committed = await self._admin.list_consumer_group_offsets(group, partitions=partitions)
            for tp, meta in committed.items():
                if meta is None or meta.offset < 0:
                    continue  # the group never committed on this partition
                key = (group, tp.topic)
                lag[key] = lag.get(key, 0) + max(0, ends.get(tp, 0) - meta.offset)
        self.lag = lag
        self._refreshed_s = time.monotonic()

    def collect(self) -> Iterator[GaugeMetricFamily]:
        family = GaugeMetricFamily("kvflow_consumer_lag_records", "Records past a consumer group's committed "
                                   "offsets, per topic (a lower bound on the embedded broker).",
                                   labels=["group", "topic"])
        for (group, topic), value in sorted(self.lag.items()):
            family.add_metric([group, topic], float(value))
        yield family
