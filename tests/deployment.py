"""A whole kvflow deployment (as `kvflow up` runs it) for end-to-end tests."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

import httpx

from kvflow.schemas import WorkerRole
from kvflow.settings import Settings
from kvflow.streams.broker import free_port
from kvflow.supervisor import Supervisor, WorkerSpec


async def wait_bridge_healthy(url: str, timeout_s: float = 10.0) -> None:
    """Wait until the bridge's own projection of the workers topic sees a live worker.

    Raises:
        TimeoutError: ``/health`` did not answer 200 in time.
    """
    async with httpx.AsyncClient(base_url=url) as http:
        deadline = asyncio.get_running_loop().time() + timeout_s
        while (await http.get("/health")).status_code != 200:
            if asyncio.get_running_loop().time() > deadline:
                raise TimeoutError(f"{url}/health never answered 200")
            await asyncio.sleep(0.05)


@contextlib.asynccontextmanager
async def running_deployment(settings: Settings, spec: WorkerSpec, workers: int, *, bridge: bool = True,
                             ready_timeout_s: float = 60.0) -> AsyncIterator[Supervisor]:
    """Router, ``workers`` aggregated worker processes and (optionally) the bridge on ``settings``' broker."""
    sup = Supervisor(settings, spec, port=free_port(), bridge=bridge)
    await sup.start()
    try:
        for _ in range(workers):
            await sup.start_worker(WorkerRole.aggregated)
        await sup.wait_workers_ready(workers, timeout_s=ready_timeout_s)
        if bridge:
            await wait_bridge_healthy(sup.url)
        yield sup
    finally:
        await sup.stop()
