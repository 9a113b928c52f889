"""``kvflow up``: run a whole kvflow deployment on one machine.

Starts, in order: the embedded broker (unless ``bootstrap_servers`` points at
a real cluster), the topic catalog, the router (Faust app, in this process),
N worker processes (children, one per queue slot) and the HTTP bridge (in
this process). Stops them in reverse order. Worker children are started in
this process's session and are killed with it: Ctrl-C leaves no orphans.

The :class:`Supervisor` also executes scaling commands for the ``local``
connector: :meth:`Supervisor.scale` starts workers or drains them (SIGTERM,
which the worker handles by draining: no request is lost). With
:meth:`Supervisor.start_planner` it also hosts the SLA planner: metrics sink,
planner loop and local connector (:mod:`kvflow.planner.service`), in this
process because it owns the embedded chDB directory; it reads the in-process
router's held requests, so a pool at ``--min-workers 0`` starts a worker for
the first request the router holds (``--shed-mode queue
--shed-cold-start-hold-s``).

Metrics: with ``settings.metrics_port`` set, :meth:`Supervisor.start` serves
one Prometheus scrape point for the whole deployment
(:attr:`Supervisor.metrics_url`): the router's, the planner's, the bridge's
and the consumer-lag series of this process, plus each worker's own
``/metrics`` (every worker is started with a free ``--metrics-port``, listed
in :attr:`Supervisor.worker_metrics_urls`), fetched and merged at each scrape.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import sys
from dataclasses import dataclass, field

from kvflow.aio import wait_or_kill
from kvflow.schemas import IMAGE_ROLES, WorkerRole, WorkerStatus, now_ms
from kvflow.settings import Settings, settings_env
from kvflow.streams.broker import EmbeddedBroker, broker_process_registry, free_port
from kvflow.streams.catalog import QUEUE_SLOTS, Catalog
from kvflow.streams.kafka import create_topics

__all__ = ["WorkerSpec", "Supervisor", "BRIDGE_KEEP_ALIVE_S"]

BRIDGE_KEEP_ALIVE_S = 75
"""Idle keep-alive of the bridge's HTTP connections, seconds: above common
client pool timeouts (aiohttp 15 s, httpx 5 s), as load balancers do (60 s+)."""

log = logging.getLogger(__name__)


@dataclass
class WorkerSpec:
    """How to start workers: engine name, model spec and extra CLI args of
    generation workers (encode workers encode media for that model); the
    encoder model of embedding workers; the image model of both image stages
    (``tiny-diffusion`` or a local diffusers directory,
    :func:`kvflow.models.image.resolve_image_model`)."""

    engine: str = "mocker"
    model: str = "SmolLM2-135M-Instruct"
    extra_args: list[str] = field(default_factory=list)
    embedding_model: str = "all-MiniLM-L6-v2"
    image_model: str = "tiny-diffusion"


@dataclass
class _Child:
    worker_id: str
    role: WorkerRole
    slot: int
    process: asyncio.subprocess.Process
    metrics_url: str | None = None


class Supervisor:
    """Owns the broker, router, bridge and worker processes of one deployment."""

    def __init__(self, settings: Settings, spec: WorkerSpec, *, host: str = "127.0.0.1", port: int = 8000,
                 bridge: bool = True) -> None:
        self.settings = settings
        self.spec = spec
        self.host, self.port, self.with_bridge = host, port, bridge
        self.broker: EmbeddedBroker | None = None
        self.catalog = Catalog(settings.namespace)
        self.children: dict[str, _Child] = {}
        self.router = None
        self._uvicorn = None
        self._bridge_task: asyncio.Task | None = None
        self._counter = 0
        self._draining: dict[str, _Child] = {}  # SIGTERM sent, not exited: their slots stay taken
        self.planner = None  # kvflow.planner.service.PlannerServices, once started
        self.metrics = None  # kvflow.streams.metrics_server.MetricsServer, once started
        self.lag = None  # kvflow.streams.lag.ConsumerLag, with the metrics server

    async def start(self) -> None:
        """Start broker (if embedded), topics, router and bridge (no workers yet)."""
        if not self.settings.bootstrap_servers:
            self.broker = EmbeddedBroker()
            await self.broker.start()
            self.settings = self.settings.model_copy(
                update={"bootstrap_servers": self.broker.bootstrap_servers, "embedded_broker": True})
        await create_topics(self.settings, self.catalog)
        from kvflow.router.app import build_router_app

        self.router = build_router_app(self.settings, self.catalog)
        await self.router.app.start()
        if self.with_bridge:
            import uvicorn

            from kvflow.streams.bridge.app import build_app
            from kvflow.streams.bridge.server import BridgeServer

            # Keep-alive longer than HTTP clients' pool idle timeouts (aiohttp: 15 s): with
            # uvicorn's 5 s default, a client reusing a connection the server is closing
            # loses the request ("Cannot write to closing transport"; 2 of 300 AIPerf
            # requests on a CPU-saturated machine).
            config = uvicorn.Config(build_app(self.settings, self.catalog), host=self.host, port=self.port,
                                    log_level="warning", lifespan="on", timeout_keep_alive=BRIDGE_KEEP_ALIVE_S)
            self._uvicorn = BridgeServer(config)
            self._uvicorn.install_signal_handlers = lambda: None  # the supervisor owns signals
            self._bridge_task = asyncio.create_task(self._uvicorn.serve(), name="bridge")
            while not self._uvicorn.started:
                if self._bridge_task.done():
                    self._bridge_task.result()
                await asyncio.sleep(0.02)
        if self.settings.metrics_port is not None:
            await self._serve_metrics()

    async def _serve_metrics(self) -> None:
        from kvflow.streams.lag import ConsumerLag
        from kvflow.streams.metrics_server import serve_metrics

        self.lag = ConsumerLag(self.settings, self.catalog)
        await self.lag.start()
        registries = [self.router.prom.registry, self.lag.registry]
        if self.broker is not None:  # its memory grows with the traffic served (no retention)
            registries.append(broker_process_registry(self.broker))
        bridge_state = getattr(self._uvicorn.config.app.state, "bridge", None) if self._uvicorn else None
        if bridge_state is not None:
            registries.append(bridge_state.metrics.registry)
        self.metrics = await serve_metrics(registries, self.settings.metrics_host, self.settings.metrics_port,
                                           children=self.worker_metrics_urls, before_scrape=self.lag.refresh)
        log.info("deployment metrics at %s", self.metrics.url)

    @property
    def metrics_url(self) -> str | None:
        """The deployment's one scrape point (``None``: not served)."""
        return self.metrics.url if self.metrics is not None else None

    def worker_metrics_urls(self) -> list[str]:
        """``/metrics`` URLs of the running workers (merged into :attr:`metrics_url`)."""
        return [c.metrics_url for c in self.children.values() if c.metrics_url and c.process.returncode is None]

    @property
    def url(self) -> str:
        """The bridge's base URL."""
        return f"http://{self.host}:{self.port}"

    def _free_slot(self, role: WorkerRole) -> int:
        # A draining worker still consumes its partition: never hand its slot out again before it exits.
        used = {c.slot for c in (*self.children.values(), *self._draining.values()) if c.role == role}
        slots = self.catalog.queue(role).partitions
        for slot in range(slots):
            if slot not in used:
                return slot
        raise RuntimeError(f"all {slots} {role.value} slots are in use")

    async def start_worker(self, role: WorkerRole = WorkerRole.aggregated) -> str:
        """Spawn one worker process; returns its worker id."""
        slot = self._free_slot(role)
        self._counter += 1
        worker_id = f"{role.value[:3]}-{slot}-{os.getpid()}-{self._counter}"
        if role is WorkerRole.embedding:
            what = ["--model", self.spec.embedding_model]
        elif role is WorkerRole.encode:  # the media encoder of the generation workers' model
            what = ["--engine", self.spec.engine, "--model", self.spec.model]
        elif role in IMAGE_ROLES:
            what = ["--model", self.spec.image_model]
        else:
            what = ["--engine", self.spec.engine, "--model", self.spec.model, *self.spec.extra_args]
        args = [
            sys.executable, "-m", "kvflow", "worker", *what,
            "--role", role.value, "--slot", str(slot), "--worker-id", worker_id,
            "--bootstrap-servers", str(self.settings.bootstrap_servers), "--namespace", self.settings.namespace,
            *(["--embedded-broker"] if self.settings.embedded_broker else []),
        ]
        metrics_url = None
        if self.settings.metrics_port is not None:
            # Picked here so the aggregated scrape knows it; the port is free now, not reserved.
            metrics_port = free_port()
            args += ["--metrics-port", str(metrics_port), "--metrics-host", self.settings.metrics_host]
            metrics_url = f"http://{self.settings.metrics_host}:{metrics_port}/metrics"
        proc = await asyncio.create_subprocess_exec(*args, stdin=asyncio.subprocess.DEVNULL,
                                                    env=self._worker_env())
        self.children[worker_id] = _Child(worker_id, role, slot, proc, metrics_url)
        log.info("started worker %s (pid %d, slot %d)", worker_id, proc.pid, slot)
        return worker_id

    def _worker_env(self) -> dict[str, str]:
        """This process's environment with this deployment's settings in it
        (:func:`~kvflow.settings.settings_env`): a worker beats as often, announces
        the TTL and flushes its streams as this deployment's settings say, whether
        they came from the environment or from code. The bridge's API keys stay out:
        workers serve no HTTP."""
        env = settings_env(self.settings.model_copy(update={"api_keys": ()}), os.environ)
        env.pop("KVFLOW_API_KEYS", None)
        return env

    async def stop_worker(self, worker_id: str, timeout_s: float = 90.0) -> None:
        """Drain one worker (SIGTERM → it finishes in-flight work) and reap it."""
        child = self.children.pop(worker_id, None)
        if child is None or child.process.returncode is not None:
            return
        self._draining[worker_id] = child
        try:
            child.process.send_signal(signal.SIGTERM)
            await wait_or_kill(child.process, timeout_s)
        finally:
            self._draining.pop(worker_id, None)

    def replicas(self, role: WorkerRole = WorkerRole.aggregated) -> int:
        """Running worker processes of ``role``."""
        return sum(1 for c in self.children.values() if c.role == role and c.process.returncode is None)

    async def scale(self, role: WorkerRole, target: int) -> None:
        """Start or drain workers of ``role`` until ``target`` run (newest drained first).

        Workers that exited on their own are forgotten first (and replaced if
        ``target`` asks for them). Returns once drained workers have exited.

        Raises:
            RuntimeError: every queue slot of ``role`` is in use.
        """
        for child in [c for c in self.children.values() if c.role == role and c.process.returncode is not None]:
            log.warning("worker %s exited with code %s", child.worker_id, child.process.returncode)
            del self.children[child.worker_id]
        while self.replicas(role) < target:
            await self.start_worker(role)
        excess = self.replicas(role) - target
        if excess > 0:
            victims = [c.worker_id for c in self.children.values() if c.role == role][-excess:]
            await asyncio.gather(*(self.stop_worker(w) for w in victims))

    async def wait_workers_ready(self, count: int, timeout_s: float = 300.0) -> None:
        """Wait until ``count`` workers are serving in the router's table (a draining
        or sleeping worker does not count).

        Raises:
            TimeoutError: they did not register in time.
            RuntimeError: a worker process exited during start-up.
        """
        deadline = asyncio.get_running_loop().time() + timeout_s
        while self._serving() < count:
            for child in self.children.values():
                if child.process.returncode is not None:
                    raise RuntimeError(f"worker {child.worker_id} exited with code {child.process.returncode}")
            if asyncio.get_running_loop().time() > deadline:
                raise TimeoutError(f"only {self._serving()}/{count} workers serving")
            await asyncio.sleep(0.1)

    def _serving(self) -> int:
        return sum(w.status == WorkerStatus.serving for w in self.router.table.workers.values())

    async def start_planner(self, config, profile, *, model: str | None = None,
                            data_dir: str | None = None, shadow: bool = False) -> None:
        """Start the SLA planner in this process: metrics sink, planner loop and the
        local connector, which scales this supervisor's workers.

        Args:
            config: a :class:`kvflow.planner.core.PlannerConfig`; its pools
                must be ones this supervisor runs.
            profile: the engine :class:`kvflow.planner.profile.Profile`.
            model: plan on this model's requests only (``None``: all).
            data_dir: chDB directory (default: per namespace under ``settings.data_dir``).
            shadow: publish decisions marked advisory and scale nothing
                (no connector runs).

        Raises:
            kvflow.planner.service.ClickHouseLocked: another process owns the chDB directory.
        """
        from kvflow.planner.connectors.local import LocalConnector
        from kvflow.planner.service import PlannerServices

        self.planner = PlannerServices(
            self.settings, config, profile, current_replicas=lambda: {p: self.replicas(p) for p in config.pools},
            connector=LocalConnector(self, max_replicas=QUEUE_SLOTS), catalog=self.catalog, model=model,
            data_dir=data_dir, shadow=shadow, held_requests=lambda: self.router.core.held(now_ms()))
        await self.planner.start()
        if self.metrics is not None:
            from kvflow.planner.prometheus import planner_registry

            self.metrics.registries.append(planner_registry(self.planner.loop))

    async def stop(self) -> None:
        """Stop everything: metrics server, planner, bridge, workers (drained), router, broker.

        On a Kafka cluster (no embedded broker) the requests the router still
        held go back to the requests topic for the next router to route
        (:func:`kvflow.router.serve.hand_back_held`)."""
        if self.metrics is not None:
            with contextlib.suppress(Exception):
                await self.metrics.stop()
        if self.lag is not None:
            await self.lag.stop()
        if self.planner is not None:
            with contextlib.suppress(Exception):
                await self.planner.stop()
        if self._uvicorn is not None:
            self._uvicorn.should_exit = True
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._bridge_task, 10)
        await asyncio.gather(*(self.stop_worker(w, timeout_s=30) for w in list(self.children)))
        if self.router is not None:
            with contextlib.suppress(Exception):
                await self.router.app.stop()
            if self.broker is None:  # the cluster outlives this deployment: another router routes them
                from kvflow.router.serve import hand_back_held

                with contextlib.suppress(Exception):
                    await hand_back_held(self.router)
        if self.broker is not None:
            await self.broker.stop()
