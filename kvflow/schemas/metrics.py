"""Records on the metrics topic: one per finished request, and worker snapshots."""

from __future__ import annotations

from typing import Annotated, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, computed_field

from kvflow.schemas.base import Record

__all__ = ["KvTierMetrics", "RequestMetrics", "WorkerMetrics", "MetricRecord"]


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


class KvTierMetrics(BaseModel):
    """A worker's KV tier counters (G2 host memory, G3 disk), cumulative since it started.

    Directions: ``offloaded_*`` device -> host (blocks evicted from engine
    memory), ``demoted_*`` host -> disk, ``onboarded_host_*`` host ->
    device and ``onboarded_disk_*`` disk -> device (prefix hits loaded back
    instead of recomputed). Blocks are the engine's KV blocks; bytes as they
    take in that tier (disk: file sizes). ``*_hit_rate``: fraction of the
    prompt blocks looked up that each tier served (the three sum to the
    worker's block hit rate). ``disk_corrupt_blocks``: disk blocks found
    missing or failing their checksum (recomputed, never served).
    ``onboard_ms``: time spent loading blocks back (measured by hf, modelled
    by the mocker). ``host_used_bytes``/``disk_used_bytes``: held now.
    """

    model_config = ConfigDict(frozen=True)
    offloaded_blocks: int = 0
    offloaded_bytes: int = 0
    demoted_blocks: int = 0
    demoted_bytes: int = 0
    onboarded_host_blocks: int = 0
    onboarded_host_bytes: int = 0
    onboarded_disk_blocks: int = 0
    onboarded_disk_bytes: int = 0
    disk_corrupt_blocks: int = 0
    device_hit_rate: float = 0.0
    host_hit_rate: float = 0.0
    disk_hit_rate: float = 0.0
    onboard_ms: float = 0.0
    host_used_bytes: int = 0
    disk_used_bytes: int = 0


class SpecDecodeMetrics(BaseModel):
    """A worker's speculative decoding counters, cumulative since it started.

    ``draft_tokens``: draft tokens proposed; ``accepted_tokens``: those the
    target model accepted; ``verify_steps``: target passes that verified
    drafts (one per request per step). ``acceptance_rate`` =
    accepted / draft tokens; ``mean_accepted_length`` = 1 + accepted /
    verify steps, the tokens one target pass yields on average (the
    accepted drafts plus the target's own token; 1 = no gain).
    """

    model_config = ConfigDict(frozen=True)
    draft_tokens: int = Field(default=0, ge=0)
    accepted_tokens: int = Field(default=0, ge=0)
    verify_steps: int = Field(default=0, ge=0)

    @computed_field
    @property
    def acceptance_rate(self) -> float:
        """Accepted / draft tokens (0 before any draft)."""
        return self.accepted_tokens / self.draft_tokens if self.draft_tokens else 0.0

    @computed_field
    @property
    def mean_accepted_length(self) -> float:
        """Tokens per verifying target pass: 1 + accepted / verify steps (1 before any)."""
        return 1.0 + self.accepted_tokens / self.verify_steps if self.verify_steps else 1.0


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
    kv_tiers: KvTierMetrics | None = None
    """KV tier counters; None when the worker has no host or disk tier."""
    spec_decode: SpecDecodeMetrics | None = None
    """Speculative decoding counters; None when the engine does not speculate."""


MetricRecord = Annotated[Union[RequestMetrics, WorkerMetrics], Field(discriminator="type")]
