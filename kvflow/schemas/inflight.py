"""Records on the inflight topic: a worker took a request, a worker ended one.

Every worker publishes one :class:`RequestAdmitted` when it takes a request
from its queue and one :class:`RequestFinished` when the request ends on it
(finished, stopped, failed or cancelled: whatever ends it), keyed by worker
id. Every router replica reads the whole topic and folds it into exact
per-worker in-flight load (:mod:`kvflow.router.inflight`), instead of
waiting for the worker's next heartbeat to learn that a request ended.

``seq`` numbers a worker incarnation's records (both kinds) from 0 in the
order it publishes them; the worker's heartbeat carries the next ``seq``
(``WorkerHeartbeat.lifecycle_seq``), so a router knows which records a
heartbeat's load figures already include. ``started_ms`` names the
incarnation (the heartbeat's ``started_ms``). All times are epoch ms.
"""

from __future__ import annotations

from typing import Annotated, Literal, Union

from pydantic import Field

from kvflow.schemas.base import Record

__all__ = ["InflightRecord", "RequestAdmitted", "RequestFinished"]


class RequestAdmitted(Record):
    """``worker_id`` took ``request_id`` from its queue (it now holds it).

    ``prompt_tokens`` is the prompt length when the producer tokenized it
    (0 when not known); ``prefill_tokens`` the prompt tokens the worker is
    expected to compute: ``prompt_tokens`` minus the routing decision's
    cached overlap (``overlap_blocks × block_size``), the whole prompt for
    a remote prefill, 0 for a decode stage (its KV comes from the prefill
    worker). ``max_tokens`` is the most output tokens the worker will decode
    for it (the request's ``sampling.max_tokens``; 0 for a remote prefill,
    which decodes none, and when unknown): the router weighs how much a new
    prefill on this worker would stretch the request's inter-token latency
    by it (:mod:`kvflow.router.kv_policy`, ``stall_exposure``).
    """

    type: Literal["admitted"] = "admitted"
    worker_id: str = Field(min_length=1)
    started_ms: int = Field(ge=0)
    seq: int = Field(ge=0)
    request_id: str = Field(min_length=1)
    prompt_tokens: int = Field(ge=0, default=0)
    prefill_tokens: int = Field(ge=0, default=0)
    max_tokens: int = Field(ge=0, default=0)
    ts_ms: int = Field(ge=0)


class RequestFinished(Record):
    """``request_id`` ended on ``worker_id`` (any outcome; ``cancelled`` when a
    cancel record ended it).

    ``kv_event_id``: the worker had published its KV event batches with ids
    below this one before this record (the request's own KV events
    included), so a router whose KV index has applied batch
    ``kv_event_id - 1`` of this worker knows the cache the request left.
    """

    type: Literal["finished"] = "finished"
    worker_id: str = Field(min_length=1)
    started_ms: int = Field(ge=0)
    seq: int = Field(ge=0)
    request_id: str = Field(min_length=1)
    cancelled: bool = False
    kv_event_id: int = Field(ge=0, default=0)
    ts_ms: int = Field(ge=0)


InflightRecord = Annotated[Union[RequestAdmitted, RequestFinished], Field(discriminator="type")]
"""Either record on the inflight topic, told apart by ``type``."""
