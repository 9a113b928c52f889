"""A worker of one image stage: consume its slot of ``queue.<role>``, run
the stage on each record, send the stage's output record.

Data flow: ``queue.conditioning[slot]`` → :class:`~kvflow.workers.images.stages.ConditioningStage`
→ ``queue.diffusion[request.diffusion_partition]``, and
``queue.diffusion[slot]`` → :class:`~kvflow.workers.images.stages.DiffusionStage`
→ the request's ``reply_to`` on the responses topic. The worker heartbeats
on the workers topic with its stage's role (the bridge picks workers among
these; routers never route generation requests to them).

Records are served one at a time, in queue order, the model's work in a
thread so heartbeats keep flowing. Delivery is at least once, as for the
other workers: the queue position is committed under
``<namespace>.worker.<role>.<slot>`` after each batch's outputs are sent,
and a drain (SIGTERM) serves what was queued before it. A record that does
not decode goes to the dead-letter topic and the worker goes on.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Protocol

from aiokafka import ConsumerRecord

from kvflow.schemas import Record, WorkerRole, encode
from kvflow.settings import Settings
from kvflow.streams.catalog import Catalog
from kvflow.streams.fetch_wait import produced
from kvflow.workers.images.stages import Output
from kvflow.workers.queue_slot import QueueSlot

__all__ = ["Stage", "StageWorkerConfig", "StageWorker", "ENGINE_NAME"]

ENGINE_NAME = "diffusers"
"""``engine`` of an image stage worker's heartbeats."""


class Stage(Protocol):
    """One stage: the schema of its input records and the (blocking) step from one to its output."""

    input_schema: type[Record]

    def run(self, record: Record) -> Output:
        """The output of one input record (errors become error records, never exceptions)."""


@dataclass
class StageWorkerConfig:
    """Identity of one stage worker: its ``role`` (stage) and ``slot`` (queue
    partition), the served ``model``, the ``tokenizer`` it advertises (the
    text stage's; ``""`` for the image stage) and ``context_length`` (the
    text stage's longest encoded prompt, tokens; None for the image stage);
    ``max_records`` caps the records taken per poll."""

    worker_id: str
    role: WorkerRole
    slot: int
    model: str
    tokenizer: str = ""
    context_length: int | None = None
    max_records: int = 4


@dataclass(eq=False)
class StageWorker:
    """Adapts a :class:`Stage` to Kafka: ``slot`` (a
    :class:`~kvflow.workers.queue_slot.QueueSlot`) feeds it records and
    heartbeats for it; ``await worker.slot.run()`` until drained or stopped.
    """

    settings: Settings
    config: StageWorkerConfig
    stage: Stage
    catalog: Catalog | None = None

    def __post_init__(self) -> None:
        config = self.config
        self.slot = QueueSlot(settings=self.settings, catalog=self.catalog, config=config, role=config.role,
                              engine=ENGINE_NAME, schema=self.stage.input_schema, handle=self._serve,
                              heartbeat_fields=lambda: {"tokenizer": config.tokenizer,
                                                        "context_length": config.context_length})

    async def _serve(self, record: Record, _message: ConsumerRecord) -> None:
        output = await asyncio.to_thread(self.stage.run, record)
        await self.slot.producer.send_and_wait(output.topic, encode(output.record), key=output.key.encode(),
                                               partition=output.partition)
        produced(output.topic)
