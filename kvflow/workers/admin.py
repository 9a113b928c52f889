"""The worker's engine admin: sleep, wake and clear-KV commands from the control topic.

:class:`~kvflow.workers.worker.Worker` hands every
:class:`~kvflow.schemas.control.AdminCommand` naming it to :func:`apply`,
which runs one command at a time and answers with an
:class:`~kvflow.schemas.control.AdminCommandApplied` on the control topic.

Sleep (:func:`sleep_worker`), in order:

1. the worker's heartbeat says ``sleeping``: routers stop sending here
   (only ``serving`` workers are candidates);
2. it keeps taking its queue for two heartbeat periods, so requests routed
   before the routers saw step 1 are served (as a drain does);
3. it stops taking its queue (records that still arrive wait there until
   wake) and waits, up to ``drain_timeout_s``, for the requests it holds
   to finish; if some do not, it serves again and the command fails;
4. the engine sleeps (:class:`~kvflow.workers.engines.capabilities.Sleeps`):
   it drops its KV cache, emitting ``AllBlocksCleared``, so every router
   drops this worker's blocks from its index.

Wake (:func:`wake_worker`) reverses 4, 3 and 1. Clear KV
(:func:`clear_kv`) asks the engine for a prefix-cache reset
(:class:`~kvflow.workers.engines.capabilities.ClearsKvCache`), which emits
``AllBlocksCleared`` and is refused while requests hold blocks.

LoRA (:func:`lora_command`): ``load_lora`` fetches and loads an adapter
through the worker's :class:`~kvflow.workers.lora.AdapterManager`,
``unload_lora`` drops one, ``list_lora`` changes nothing; each answers
with the loaded adapters and publishes a heartbeat, so routers and bridges
see the new list without waiting for the next period.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import TYPE_CHECKING

from kvflow.schemas import AdminAction, AdminCommand, AdminCommandApplied, WorkerStatus, encode, now_ms
from kvflow.workers.engines.capabilities import ClearsKvCache, Sleeps

if TYPE_CHECKING:
    from kvflow.workers.worker import Worker

__all__ = ["apply", "sleep_worker", "wake_worker", "clear_kv", "lora_command"]

_LORA_ACTIONS = (AdminAction.load_lora, AdminAction.unload_lora, AdminAction.list_lora)

log = logging.getLogger(__name__)


async def sleep_worker(worker: Worker, level: int) -> tuple[bool, str]:
    """Steps 1-4 of the module docstring; returns ``(done, detail)``."""
    engine = worker.engine
    if worker.status is WorkerStatus.sleeping:
        return True, "already sleeping"
    if worker.status is not WorkerStatus.serving:
        return False, f"worker is {worker.status.value}"
    if not isinstance(engine, Sleeps):
        return False, f"the {engine.name} engine cannot sleep"
    worker.status = WorkerStatus.sleeping
    await worker.publish_heartbeat()
    await asyncio.sleep(2 * worker.settings.heartbeat_interval_ms / 1000)
    worker.queue_paused = True
    deadline = time.monotonic() + worker.config.drain_timeout_s
    while worker.inflight and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    try:
        if worker.inflight:
            raise RuntimeError(f"{len(worker.inflight)} request(s) still running after "
                               f"{worker.config.drain_timeout_s:g} s")
        detail = await engine.sleep(level)
    except Exception as exc:
        worker.queue_paused = False
        worker.status = WorkerStatus.serving
        await worker.publish_heartbeat()
        return False, f"not asleep: {exc}"
    return True, detail


async def wake_worker(worker: Worker) -> tuple[bool, str]:
    """Wake the engine, take the queue again, heartbeat ``serving``; returns ``(done, detail)``."""
    if worker.status is not WorkerStatus.sleeping:
        return worker.status is WorkerStatus.serving, f"worker is {worker.status.value}, not sleeping"
    detail = await worker.engine.wake_up()  # Sleeps: the worker only sleeps with one
    worker.queue_paused = False
    worker.status = WorkerStatus.serving
    await worker.publish_heartbeat()
    return True, detail


async def clear_kv(worker: Worker) -> tuple[bool, str]:
    """Reset the engine's prefix cache; returns ``(done, detail)``."""
    engine = worker.engine
    if not isinstance(engine, ClearsKvCache):
        return False, f"the {engine.name} engine cannot clear its KV cache"
    return await engine.clear_kv_cache()


async def lora_command(worker: Worker, command: AdminCommand) -> tuple[bool, str]:
    """Load, unload or list LoRA adapters; returns ``(done, detail)``.

    Raises:
        kvflow.workers.lora.AdapterError: the fetch, load or unload failed.
    """
    adapters = worker.adapters
    if adapters is None:
        return False, f"the {worker.engine.name} engine serves no LoRA adapters"
    name = command.lora_name
    if command.action is AdminAction.list_lora:
        return True, f"{len(adapters.names())} adapter(s) loaded"
    if not name:
        return False, f"{command.action.value} needs lora_name"
    if command.action is AdminAction.load_lora:
        if not command.lora_uri:
            return False, "load_lora needs lora_uri"
        worker.adapter_uris[name] = command.lora_uri
        loaded = await adapters.load(name, command.lora_uri)
        detail = f"loaded {name} from {loaded.uri}"
    else:
        if not await adapters.unload(name):
            return True, f"{name} was not loaded"
        detail = f"unloaded {name}"
    await worker.publish_heartbeat()
    return True, detail


async def apply(worker: Worker, command: AdminCommand) -> AdminCommandApplied:
    """Run ``command`` (one at a time per worker) and publish the answer on the control topic.

    An exception from the engine fails the command (its text is the
    ``detail``); it never escapes, so the control listener goes on.
    """
    received = time.monotonic()
    async with worker.admin_lock:
        try:
            if command.action is AdminAction.sleep:
                ok, detail = await sleep_worker(worker, command.level)
            elif command.action is AdminAction.wake:
                ok, detail = await wake_worker(worker)
            elif command.action in _LORA_ACTIONS:
                ok, detail = await lora_command(worker, command)
            else:
                ok, detail = await clear_kv(worker)
        except Exception as exc:  # noqa: BLE001 - reported to the operator, not raised
            log.exception("admin %s failed", command.action.value)
            ok, detail = False, f"{type(exc).__name__}: {exc}"
    log.info("admin %s (%s): %s, %s", command.action.value, command.command_id, "done" if ok else "failed", detail)
    answer = AdminCommandApplied(command_id=command.command_id, worker_id=worker.config.worker_id,
                                 action=command.action, ok=ok, detail=detail,
                                 lora_adapters=(worker.adapters.names() if worker.adapters is not None else [])
                                 if command.action in _LORA_ACTIONS else None,
                                 duration_ms=int((time.monotonic() - received) * 1000), ts_ms=now_ms())
    await worker.producer.send_and_wait(worker.catalog.control.name, encode(answer),
                                        key=worker.config.worker_id.encode())
    return answer
