"""Scaling connectors: execute the planner's :class:`ScalingCommand` records.

A connector is anything with ``name`` and ``async apply(command) -> int``
(:class:`Connector`) that makes a pool run ``command.target_replicas``:

* :class:`~kvflow.planner.connectors.local.LocalConnector` — worker processes
  of the ``kvflow up`` supervisor;
* :class:`~kvflow.planner.connectors.kubernetes.KubernetesConnector` — the
  ``spec.replicas`` of one Deployment (or StatefulSet) per pool.

:class:`ConnectorService` feeds a connector from the scaling topic:

* **At most once per decision.** A command's offset is committed (group
  ``<namespace>.connector.<name>``) *before* it is applied, and applied
  ``decision_id`` values are remembered, so neither a restart nor a
  republished record applies a decision twice. A command lost to a crash
  mid-apply is not retried; the planner re-issues the target on its next
  tick if the pool still differs.
* **Latest wins, per pool.** Each pool (each role of each worker pool,
  :attr:`ScalingCommand.unit`) has one applier task. A command that
  arrives while an older one is being applied (a scale-down waiting for a
  drain) replaces any command still queued for that pool; commands older
  (``ts_ms``) than the last one accepted for the pool are dropped.
* Shadow decisions (``ScalingCommand.shadow``) are skipped: they are advice.
* Malformed records go to the dead-letter topic; stale commands (older than
  ``max_age_s``) are skipped. Every connector name is its own consumer
  group and reads the whole topic, so with one connector per deployment
  each malformed record is dead-lettered once.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import OrderedDict
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

from aiokafka import TopicPartition

from kvflow.aio import cancel_and_wait
from kvflow.schemas import RecordError, ScalingCommand, WorkerRole, decode, now_ms
from kvflow.settings import Settings
from kvflow.streams.catalog import Catalog
from kvflow.streams.kafka import DeadLetterWriter, make_consumer, make_producer

__all__ = ["Connector", "AppliedCommand", "ConnectorService", "connector_group", "read_scaling_commands"]

log = logging.getLogger(__name__)


@runtime_checkable
class Connector(Protocol):
    """Executes scaling commands for one kind of infrastructure."""

    name: str
    """Short name (``local``, ``kubernetes``); part of the consumer group."""

    async def apply(self, command: ScalingCommand) -> int:
        """Make ``command.pool`` run ``command.target_replicas`` replicas.

        Returns:
            The replica count the infrastructure reports afterwards.

        Raises:
            Exception: any failure; the service logs it and does not retry.
        """
        ...


@dataclass(frozen=True)
class AppliedCommand:
    """One command the service executed: its id, pool, target, what the
    connector reported (``replicas``, ``None`` on failure), the error text, and
    epoch-ms start and end of the apply."""

    decision_id: str
    pool: WorkerRole
    target_replicas: int
    replicas: int | None
    error: str | None
    started_ms: int
    finished_ms: int


def connector_group(settings: Settings, name: str) -> str:
    """Consumer group a connector commits under: ``<namespace>.connector.<name>``."""
    return f"{settings.namespace}.connector.{name}"


class ConnectorService:
    """Consume the scaling topic and hand each new decision to ``connector``.

    Args:
        settings: Kafka settings.
        catalog: topic catalog.
        connector: what executes the commands.
        max_age_s: commands whose ``ts_ms`` is older than this are skipped
            (``None``: never). Defaults to 600.
        remember_ids: applied decision ids kept for de-duplication.
        fetch_max_wait_ms: fetch long-poll, ms.
    """

    def __init__(self, settings: Settings, catalog: Catalog, connector: Connector, *,
                 max_age_s: float | None = 600.0, remember_ids: int = 10_000, fetch_max_wait_ms: int = 50) -> None:
        self.settings, self.catalog, self.connector = settings, catalog, connector
        self.max_age_s = max_age_s
        self.remember_ids = remember_ids
        self.group = connector_group(settings, connector.name)
        self.tp = TopicPartition(catalog.scaling.name, 0)
        if catalog.scaling.partitions != 1:
            raise ValueError("the scaling topic must have one partition (commands are ordered)")
        self.consumer = make_consumer(settings, group_id=self.group, enable_auto_commit=False,
                                      fetch_max_wait_ms=fetch_max_wait_ms)
        self.producer = make_producer(settings)
        self.dlq = DeadLetterWriter(self.producer, catalog, consumer=f"connector-{connector.name}")
        self.applied: list[AppliedCommand] = []
        """Commands executed, oldest first (bounded by ``remember_ids``)."""
        self.skipped: list[tuple[str, str]] = []
        """(decision_id, why) of commands not executed, oldest first (bounded)."""
        self._seen: OrderedDict[str, None] = OrderedDict()
        self._last_ts: dict[tuple[str, WorkerRole], int] = {}
        self._queued: dict[tuple[str, WorkerRole], ScalingCommand] = {}
        self._wakeups: dict[tuple[str, WorkerRole], asyncio.Event] = {}
        self._appliers: dict[tuple[str, WorkerRole], asyncio.Task] = {}
        self._applying: set[asyncio.Task] = set()
        self._task: asyncio.Task | None = None

    async def start(self) -> None:
        """Connect and position: at the committed offset, else at the end of the topic
        (commands published before the first start are history, not orders)."""
        await self.producer.start()
        await self.consumer.start()
        self.consumer.assign([self.tp])
        if await self.consumer.committed(self.tp) is None:
            await self.consumer.seek_to_end(self.tp)
        await self.consumer.position(self.tp)
        self._task = asyncio.create_task(self.run(), name=f"connector-{self.connector.name}")

    @property
    def idle(self) -> bool:
        """True when no accepted command waits for its pool's applier or is being applied."""
        return not self._queued and not self._applying

    async def stop(self, timeout_s: float = 120.0) -> None:
        """Stop reading, let applies in progress finish (up to ``timeout_s``), close clients."""
        await cancel_and_wait(self._task)
        self._task = None
        self._queued.clear()
        for task in self._appliers.values():
            task.cancel()  # ends the wait for work; an apply in progress runs on (shielded)
        await asyncio.gather(*self._appliers.values(), return_exceptions=True)
        self._appliers.clear()
        if self._applying:
            await asyncio.wait(set(self._applying), timeout=timeout_s)
        await self.consumer.stop()
        await self.producer.stop()

    async def run(self) -> None:
        """Consume until cancelled; a broker error is logged and retried after a second."""
        while True:
            try:
                await self._poll()
            except asyncio.CancelledError:
                raise
            except Exception:  # noqa: BLE001 - keep consuming through transient broker errors
                log.exception("scaling consumer error; retrying")
                await asyncio.sleep(1.0)

    async def _poll(self) -> None:
        records = (await self.consumer.getmany(self.tp, timeout_ms=500)).get(self.tp, [])
        if not records:
            return
        commands = []
        for msg in records:
            try:
                commands.append(decode(ScalingCommand, msg.value))
            except RecordError as exc:
                await self.dlq.send(msg, exc)
        accepted = [c for c in commands if self._accept(c)]
        # At most once: the offset is committed before anything is applied
        # (if the commit fails, these commands are dropped, not applied).
        await self.consumer.commit({self.tp: records[-1].offset + 1})
        for command in accepted:
            self._enqueue(command)

    def _skip(self, command: ScalingCommand, why: str) -> bool:
        self.skipped = [*self.skipped[-self.remember_ids + 1:], (command.decision_id, why)]
        log.info("scaling command %s skipped: %s", command.decision_id, why)
        return False

    def _accept(self, command: ScalingCommand) -> bool:
        if command.shadow:
            return self._skip(command, "shadow decision (advisory)")
        if command.decision_id in self._seen:
            return self._skip(command, "decision already applied")
        if self.max_age_s is not None and now_ms() - command.ts_ms > self.max_age_s * 1000:
            return self._skip(command, f"older than {self.max_age_s:g} s")
        if command.ts_ms < self._last_ts.get(command.unit, -1):
            return self._skip(command, "older than a command already accepted for the pool")
        self._seen[command.decision_id] = None
        while len(self._seen) > self.remember_ids:
            self._seen.popitem(last=False)
        self._last_ts[command.unit] = command.ts_ms
        return True

    def _enqueue(self, command: ScalingCommand) -> None:
        pool = command.unit
        superseded = self._queued.get(pool)
        if superseded is not None:
            self._skip(superseded, f"superseded by {command.decision_id} before it was applied")
        self._queued[pool] = command
        if pool not in self._appliers:
            self._wakeups[pool] = asyncio.Event()
            self._appliers[pool] = asyncio.create_task(self._applier(pool),
                                                       name=f"apply-{command.worker_pool}/{command.pool.value}")
        self._wakeups[pool].set()

    async def _applier(self, pool: tuple[str, WorkerRole]) -> None:
        wakeup = self._wakeups[pool]
        while True:
            await wakeup.wait()
            wakeup.clear()
            command = self._queued.pop(pool, None)
            if command is not None:
                # Shielded: stopping the service must not cut a drain short.
                task = asyncio.create_task(self._apply(command), name=f"apply-{command.decision_id}")
                self._applying.add(task)
                task.add_done_callback(self._applying.discard)
                await asyncio.shield(task)

    async def _apply(self, command: ScalingCommand) -> None:
        started = now_ms()
        replicas, error = None, None
        try:
            replicas = await self.connector.apply(command)
            log.info("applied %s: %s -> %d replicas (now %s)", command.decision_id, command.pool.value,
                     command.target_replicas, replicas)
        except Exception as exc:  # noqa: BLE001 - reported, not retried (at most once)
            error = f"{type(exc).__name__}: {exc}"
            log.error("scaling command %s failed: %s", command.decision_id, error)
        self.applied = [*self.applied[-self.remember_ids + 1:], AppliedCommand(
            command.decision_id, command.pool, command.target_replicas, replicas, error, started, now_ms())]


async def read_scaling_commands(settings: Settings, catalog: Catalog | None = None,
                                idle_ms: int = 300) -> list[ScalingCommand]:
    """Every scaling command on the topic, oldest first (for ``kvflow status``).

    Reads from the beginning until ``idle_ms`` pass without a record;
    malformed records are skipped.
    """
    catalog = catalog or Catalog(settings.namespace)
    consumer = make_consumer(settings, fetch_max_wait_ms=50)
    await consumer.start()
    try:
        tp = TopicPartition(catalog.scaling.name, 0)
        consumer.assign([tp])
        await consumer.seek_to_beginning(tp)
        out: list[ScalingCommand] = []
        while True:
            batches = await consumer.getmany(timeout_ms=idle_ms)
            if not batches:
                return out
            for msg in batches.get(tp, []):
                with contextlib.suppress(RecordError):
                    out.append(decode(ScalingCommand, msg.value))
    finally:
        await consumer.stop()
