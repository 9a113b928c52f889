"""Records on the metrics topic: one per finished request, and worker snapshots."""

from __future__ import annotations

from typing import Annotated, Literal, Union

from pydantic import Field

from kvflow.schemas.base import Record

__all__ = ["RequestMetrics", "WorkerMetrics", "MetricRecord"]


class RequestMetrics(Record):
    """One finished request as seen end to end. Latencies in milliseconds.

    ``isl``/``osl`` are input/output sequence lengths in tokens; ``itl_ms`` is
    the mean inter-token latency of the request; ``ok`` is false for failures.
    """

    type: Literal["request"] = "request"
    ts_ms: int
    request_id: str
    model: str
    worker_id: str
    isl: int
    osl: int
    ttft_ms: float
    itl_ms: float
    e2e_ms: float
    cached_tokens: int = 0
    ok: bool = True
    source: str = "bridge"


class WorkerMetrics(Record):
    """A worker's load snapshot, published every few seconds.

    Throughputs are tokens per second over the last snapshot interval.
    """

    type: Literal["worker"] = "worker"
    ts_ms: int
    worker_id: str
    role: str
    active_requests: int
    waiting_requests: int
    kv_used_blocks: int
    kv_total_blocks: int
    queue_depth: int = 0
    prefill_tokens_per_s: float = 0.0
    decode_tokens_per_s: float = 0.0
    aborted_requests: int = Field(default=0, ge=0)
    """Requests this worker aborted on a cancel record since its previous snapshot."""


MetricRecord = Annotated[Union[RequestMetrics, WorkerMetrics], Field(discriminator="type")]
