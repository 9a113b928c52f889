"""``kvflow admin``: send one engine admin command to a worker and wait for its answer.

The command (:class:`~kvflow.schemas.control.AdminCommand`) goes to the
control topic, keyed by the worker id; the worker answers there with an
:class:`~kvflow.schemas.control.AdminCommandApplied` of the same
``command_id``. The reader is positioned at the topic's end *before* the
command is sent, so the answer cannot be missed.
"""

from __future__ import annotations

import asyncio
import os
import socket
import uuid

from aiokafka import TopicPartition

from kvflow.schemas import (
    AdminAction,
    AdminCommand,
    AdminCommandApplied,
    ControlRecord,
    RecordError,
    decode,
    encode,
    now_ms,
)
from kvflow.settings import Settings
from kvflow.streams.catalog import Catalog
from kvflow.streams.fetch_wait import produced
from kvflow.streams.kafka import open_doorbell, make_consumer, make_producer

__all__ = ["AdminTimeout", "send_admin_command"]


class AdminTimeout(TimeoutError):
    """No answer from the worker in time (unknown worker id, worker gone, or a sleep still waiting for requests)."""


async def send_admin_command(settings: Settings, worker_id: str, action: AdminAction | str, *, level: int = 1,
                             timeout_s: float = 120.0, catalog: Catalog | None = None,
                             lora_name: str | None = None, lora_uri: str | None = None) -> AdminCommandApplied:
    """Send ``action`` to ``worker_id`` and return its answer.

    ``level`` is the sleep level (1 or 2; see
    :class:`~kvflow.schemas.control.AdminCommand`); ``lora_name`` and
    ``lora_uri`` name the adapter of ``load_lora``/``unload_lora``. ``timeout_s`` bounds the
    wait for the answer; a sleep waits for the worker's in-flight requests
    first, so give it at least the worker's drain timeout.

    Raises:
        AdminTimeout: no answer within ``timeout_s``.
        ValueError: unknown action or bad level.
    """
    catalog = catalog or Catalog(settings.namespace)
    command = AdminCommand(command_id=uuid.uuid4().hex, worker_id=worker_id, action=AdminAction(action),
                           level=level, lora_name=lora_name, lora_uri=lora_uri,
                           requested_by=f"cli:{socket.gethostname()}:{os.getpid()}", ts_ms=now_ms())
    tp = TopicPartition(catalog.control.name, 0)
    consumer = make_consumer(settings)
    producer = make_producer(settings)
    await consumer.start()
    try:
        consumer.assign([tp])
        await consumer.seek_to_end(tp)
        await consumer.position(tp)
        await producer.start()
        try:
            await producer.send_and_wait(catalog.control.name, encode(command), key=worker_id.encode())
            open_doorbell(settings)
            produced(catalog.control.name, 0)  # an idle worker may be parked in a long poll
        finally:
            await producer.stop()
        deadline = asyncio.get_running_loop().time() + timeout_s
        while asyncio.get_running_loop().time() < deadline:
            batches = await consumer.getmany(tp, timeout_ms=500)
            for msg in batches.get(tp, []):
                try:
                    record = decode(ControlRecord, msg.value)
                except RecordError:
                    continue
                if isinstance(record, AdminCommandApplied) and record.command_id == command.command_id:
                    return record
        raise AdminTimeout(f"no answer from worker {worker_id!r} to {command.action.value} within {timeout_s:g} s")
    finally:
        await consumer.stop()
