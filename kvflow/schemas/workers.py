"""Records on the workers topic: registration, heartbeat, drain and exit."""

from __future__ import annotations

from enum import Enum

from pydantic import Field

from kvflow.schemas.base import Record

__all__ = ["WorkerRole", "WorkerStatus", "WorkerHeartbeat", "GENERATION_ROLES", "IMAGE_ROLES"]


class WorkerRole(str, Enum):
    """What a worker does: both phases, prefill only, or decode only; or
    ``embedding``: encodes inputs into vectors (``/v1/embeddings``), never
    routed a generation request; or ``encode``: turns the media of its
    ``model``'s requests into embeddings (:mod:`kvflow.schemas.media`) and
    passes each request on to the worker the router chose; or one stage of
    image generation (``/v1/images/generations``, see
    :mod:`kvflow.schemas.images`): ``conditioning`` encodes prompts (the text
    stage), ``diffusion`` denoises images from them (the image stage). Only
    the :data:`GENERATION_ROLES` are routed generation requests."""

    aggregated = "aggregated"
    prefill = "prefill"
    decode = "decode"
    embedding = "embedding"
    encode = "encode"
    conditioning = "conditioning"
    diffusion = "diffusion"

    @property
    def generates(self) -> bool:
        """Whether workers of this role serve text generation (:data:`GENERATION_ROLES`)."""
        return self in GENERATION_ROLES


GENERATION_ROLES = frozenset({WorkerRole.aggregated, WorkerRole.prefill, WorkerRole.decode})
"""Roles of workers that generate text (the router's candidates)."""

IMAGE_ROLES = frozenset({WorkerRole.conditioning, WorkerRole.diffusion})
"""Roles of the image pipeline's stage workers."""


class WorkerStatus(str, Enum):
    """Lifecycle of a worker as the routing table sees it.

    ``serving`` takes new work; ``draining`` finishes in-flight work and takes
    none; ``sleeping`` takes none until woken (an admin ``sleep``, see
    :class:`~kvflow.schemas.control.AdminAction`; it may still finish the
    requests it held when told to sleep); ``stopped`` is the last record a
    worker writes. Only ``serving`` workers are routed to.
    """

    serving = "serving"
    draining = "draining"
    sleeping = "sleeping"
    stopped = "stopped"


class WorkerHeartbeat(Record):
    """A worker's registration and periodic heartbeat (same record).

    ``queue_topic``/``queue_partition`` is where the router sends this
    worker's requests. ``kv_total_blocks``/``kv_used_blocks`` count KV blocks
    of ``block_size`` tokens. A worker missing heartbeats for ``ttl_ms`` is
    expired from the routing table. ``ts_ms`` is epoch ms.

    ``active_requests``/``waiting_requests``/``active_prefill_tokens`` are
    the engine's figures when the record was built. ``lifecycle_seq`` is
    the ``seq`` of the next record the worker will publish on the inflight
    topic (:mod:`kvflow.schemas.inflight`): the figures include the requests
    of its records with a lower ``seq`` and none of the later ones.
    ``inflight_requests`` counts the requests the worker held (taken from
    its queue, not yet ended). Both are None from a worker that publishes no
    inflight records; the router then counts the requests it routed there
    until the next heartbeat.
    """

    worker_id: str = Field(min_length=1)
    role: WorkerRole = WorkerRole.aggregated
    status: WorkerStatus = WorkerStatus.serving
    model: str
    engine: str
    tokenizer: str = "bytes"
    """Tokenizer spec (``bytes`` or a model name/path for
    :func:`kvflow.models.tokenizer.load_tokenizer`) that producers use to
    pre-tokenize this worker's requests."""
    block_size: int = Field(ge=1)
    context_length: int | None = Field(default=None, ge=1)
    """Longest sequence (prompt plus output tokens) the worker's engine
    accepts; ``None`` when the engine does not say (the bridge then applies
    only its configured limits). Added without a schema version bump: older
    readers ignore it, older workers leave it out."""
    kv_total_blocks: int = Field(ge=0)
    kv_used_blocks: int = Field(ge=0, default=0)
    queue_topic: str
    queue_partition: int = Field(ge=0)
    active_requests: int = 0
    waiting_requests: int = 0
    active_prefill_tokens: int = 0
    ts_ms: int
    ttl_ms: int = 5000
    started_ms: int = 0
    host: str = ""
    lifecycle_seq: int | None = Field(ge=0, default=None)
    inflight_requests: int | None = Field(ge=0, default=None)
    pool: str = Field(default="", max_length=64)
    """The worker pool it belongs to (``""``: the default pool); a router with
    a pool grid routes each request within the pools the grid picks
    (:mod:`kvflow.router.pools`). Added without a schema version bump: older
    readers ignore it, older workers leave it out."""
    lora_adapters: list[str] = Field(default_factory=list)
    """Names of the LoRA adapters loaded on this worker's base ``model``
    (admin ``load_lora``); a request whose ``model`` is one of them runs
    with that adapter, and routers prefer workers listing it. Added without
    a schema version bump: older readers ignore it."""
    media_tokens: int | None = Field(default=None, ge=1)
    """Encode workers: placeholder tokens each media item takes in a prompt
    (the rows of its embeddings); producers write that many
    :data:`~kvflow.schemas.media.PLACEHOLDER_TOKEN_ID` per item. None on
    other roles. Added without a schema version bump: older readers ignore it."""
