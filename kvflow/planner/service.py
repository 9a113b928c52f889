"""Run the SLA planner live: one process owns ClickHouse, the metrics sink and the loop.

Topology (all in the process that calls :meth:`PlannerServices.start`, which
is the ``kvflow up`` supervisor)::

    [metrics] ─► SinkService ─► ClickHouse ◄─ PlannerLoop ─► [scaling] ─► ConnectorService ─► Connector

Why one process: embedded chDB hosts one engine directory per process, and two
processes must never open the same directory. The sink writes and the planner
reads the same tables, so they share one :class:`SharedClickHouse`: a single
client whose calls all run on one dedicated thread. That thread keeps the
blocking client off the event loop (like ``asyncio.to_thread``) and, being a
single thread, also serializes the calls, so the sink's inserts and the
planner's queries never overlap on the client. A lock file beside the chDB
directory makes a second process fail fast instead of corrupting it.

The connector reads the scaling topic like any other consumer, so the same
planner can drive a Kubernetes connector running elsewhere.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import functools
import logging
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any, TypeVar

from clickhouse_connect.driver.client import Client

from kvflow.planner.clickhouse import ensure_schema, open_client
from kvflow.planner.connectors import Connector, ConnectorService
from kvflow.planner.core import PlannerConfig
from kvflow.planner.loop import HeldRequests, LoadSignals, PlannerLoop, ReplicaCounter
from kvflow.planner.profile import Profile
from kvflow.planner.sink_service import SinkService
from kvflow.settings import Settings
from kvflow.streams.catalog import Catalog

__all__ = ["SharedClickHouse", "ClickHouseLocked", "open_shared_clickhouse", "chdb_dir", "PlannerServices"]

log = logging.getLogger(__name__)
T = TypeVar("T")


class ClickHouseLocked(RuntimeError):
    """Another process already owns this embedded chDB directory."""


@dataclass
class SharedClickHouse:
    """One ClickHouse client shared by the sink and the planner of a process.

    Every call goes through :meth:`run`, which executes it on the single
    ``clickhouse`` thread: off the event loop and one call at a time.
    """

    client: Client
    location: str
    """``chdb:///dir`` or the server URL (for logs)."""
    _executor: ThreadPoolExecutor = field(default_factory=lambda: ThreadPoolExecutor(1, "clickhouse"), repr=False)
    _lock_file: IO[str] | None = field(default=None, repr=False)

    async def run(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """Run ``fn(*args, **kwargs)`` on the ClickHouse thread and return its result.

        ``fn`` is any blocking callable using :attr:`client` (a query, an
        insert, :meth:`MetricsSink.flush <kvflow.planner.sink.MetricsSink.flush>`).
        Its exceptions propagate unchanged.
        """
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._executor, functools.partial(fn, *args, **kwargs))

    def close(self) -> None:
        """Close the client (releasing the chDB directory) and the lock file."""
        with contextlib.suppress(Exception):
            self._executor.submit(self.client.close).result(timeout=30)
        self._executor.shutdown(wait=False)
        if self._lock_file is not None:
            self._lock_file.close()  # closing drops the flock
            self._lock_file = None


def chdb_dir(settings: Settings) -> Path:
    """Embedded chDB directory of a deployment: ``<data_dir>/chdb/<namespace>``."""
    return Path(settings.data_dir).expanduser().resolve() / "chdb" / settings.namespace


def _lock(directory: Path) -> IO[str]:
    """Hold an exclusive flock on ``<directory>.lock`` for as long as the file stays open.

    Raises:
        ClickHouseLocked: another process holds it.
    """
    directory.parent.mkdir(parents=True, exist_ok=True)
    handle = open(directory.with_name(directory.name + ".lock"), "a+", encoding="utf-8")  # noqa: SIM115
    try:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        handle.close()
        raise ClickHouseLocked(f"{directory} is in use by another kvflow process "
                               "(chDB allows one owner per directory)") from None
    return handle


async def open_shared_clickhouse(settings: Settings, data_dir: Path | str | None = None) -> SharedClickHouse:
    """Open ClickHouse for this process and create kvflow's tables.

    ``settings.clickhouse_url`` selects a server; otherwise embedded chDB in
    ``data_dir`` (default :func:`chdb_dir`), locked against other processes.

    Raises:
        ClickHouseLocked: another process owns the chDB directory.
        clickhouse_connect.driver.exceptions.ProgrammingError: this process
            already has a different chDB directory open.
        clickhouse_connect.driver.exceptions.OperationalError: the server is unreachable.
    """
    executor = ThreadPoolExecutor(1, "clickhouse")
    loop = asyncio.get_running_loop()
    lock_file = None
    if settings.clickhouse_url:
        location = settings.clickhouse_url.split("@")[-1]  # never log credentials
        client = await loop.run_in_executor(executor, open_client, settings.clickhouse_url)
    else:
        directory = Path(data_dir).expanduser().resolve() if data_dir is not None else chdb_dir(settings)
        lock_file = _lock(directory)
        location = f"chdb://{directory}"
        try:
            client = await loop.run_in_executor(executor, functools.partial(open_client, data_dir=directory))
        except Exception:
            lock_file.close()
            executor.shutdown(wait=False)
            raise
    shared = SharedClickHouse(client, location, executor, lock_file)
    try:
        await shared.run(ensure_schema, client)
    except Exception:
        shared.close()
        raise
    return shared


@dataclass
class PlannerServices:
    """The sink, the planner loop and a connector, started and stopped together.

    Args:
        settings: Kafka and ClickHouse settings (``bootstrap_servers`` set).
        config: the planner's settings.
        profile: the engine profile the planner sizes pools with, or several at
            different mean OSLs (an OSL family, see :class:`~kvflow.planner.loop.PlannerLoop`).
        current_replicas: returns replicas running now, per pool.
        connector: executes scaling commands; ``None`` runs no connector
            (commands are only published).
        catalog: topic catalog (default: the settings' namespace).
        model: plan for this model's requests only (``None``: all).
        data_dir: chDB directory override (tests).
        flush_interval_s: sink flush period, s.
        settle_s: how far behind the tick the planner's window ends, s.
        shadow: shadow mode: decisions are published marked advisory and no
            connector runs, so nothing scales.
        fast_interval_s: seconds between the loop's fast-path checks (None: none).
        load_signals: the workers' waiting load for the fast path (None: not used).
        held_requests: the router's held requests for the fast path (None: not used).
    """

    settings: Settings
    config: PlannerConfig
    profile: Profile | list[Profile]
    current_replicas: ReplicaCounter
    connector: Connector | None = None
    catalog: Catalog | None = None
    model: str | None = None
    data_dir: Path | str | None = None
    flush_interval_s: float = 1.0
    settle_s: float = 1.0
    shadow: bool = False
    fast_interval_s: float | None = 2.0
    load_signals: LoadSignals | None = None
    held_requests: HeldRequests | None = None
    clickhouse: SharedClickHouse | None = field(default=None, init=False)
    sink: SinkService | None = field(default=None, init=False)
    loop: PlannerLoop | None = field(default=None, init=False)
    connector_service: ConnectorService | None = field(default=None, init=False)

    async def start(self) -> None:
        """Open ClickHouse, then start connector, sink and loop (in that order, so
        no command is published before its consumer is positioned).

        Raises:
            ClickHouseLocked: another process owns the chDB directory.
        """
        catalog = self.catalog or Catalog(self.settings.namespace)
        self.clickhouse = await open_shared_clickhouse(self.settings, self.data_dir)
        log.info("planner metrics store: %s", self.clickhouse.location)
        try:
            if self.connector is not None and not self.shadow:
                self.connector_service = ConnectorService(self.settings, catalog, self.connector)
                await self.connector_service.start()
            self.sink = SinkService(self.settings, catalog, self.clickhouse, flush_interval_s=self.flush_interval_s)
            await self.sink.start()
            self.loop = PlannerLoop(self.settings, catalog, self.clickhouse, self.config, self.profile,
                                    self.current_replicas, model=self.model, settle_s=self.settle_s,
                                    before_query=self.sink.flush, shadow=self.shadow,
                                    fast_interval_s=self.fast_interval_s, load_signals=self.load_signals,
                                    held_requests=self.held_requests)
            await self.loop.start()
        except Exception:
            await self.stop()
            raise

    async def stop(self) -> None:
        """Stop the loop, the sink (final flush and commit), the connector, then ClickHouse."""
        for service in (self.loop, self.sink, self.connector_service):
            if service is not None:
                with contextlib.suppress(Exception):
                    await service.stop()
        if self.clickhouse is not None:
            self.clickhouse.close()
            self.clickhouse = None
