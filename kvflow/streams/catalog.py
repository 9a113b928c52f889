"""The topic catalog: every Kafka topic kvflow uses, in one place.

Topic names never appear as string literals elsewhere: code asks a
:class:`Catalog` (built for a namespace) for its topics. Partition counts are
fixed at creation; scaling never needs new partitions (the embedded broker
cannot add them): worker queues have one partition per worker *slot* and a
worker consumes exactly its slot, responses have one partition per consumer
slot (a bridge or a Kafka-native client).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from kvflow.schemas import (
    CancelRequest,
    ControlRecord,
    DeadLetter,
    DecisionRecord,
    EmbeddingRequest,
    ExpertPlacementMap,
    GENERATION_ROLES,
    ImageConditioning,
    ImageRequest,
    InferenceRequest,
    InflightRecord,
    KvDumpRequest,
    KvEventBatch,
    MetricRecord,
    ResponseEvent,
    ScalingCommand,
    StoredResponse,
    WorkerHeartbeat,
    WorkerRole,
)

__all__ = ["TopicSpec", "Catalog", "QUEUE_SLOTS", "STAGE_SLOTS", "RESPONSE_SLOTS"]

QUEUE_SLOTS = 64
"""Partitions per worker-queue topic = most workers per pool."""

STAGE_SLOTS = 16
"""Partitions of each image-stage queue = most workers per stage pool (a
diffusion worker is a whole accelerator's work; fewer partitions keep topic
creation cheap)."""

RESPONSE_SLOTS = 32
"""Partitions of the responses topic = most concurrent response consumers."""


@dataclass(frozen=True)
class TopicSpec:
    """One topic: its name, shape and who uses it.

    ``key`` names the record field used as the Kafka key; ``value_schema`` is
    the pydantic model (or discriminated union) of every value.
    """

    name: str
    partitions: int
    key: str
    value_schema: Any
    cleanup_policy: str = "delete"
    retention_ms: int = 24 * 3600 * 1000
    producers: tuple[str, ...] = ()
    consumers: tuple[str, ...] = ()
    description: str = ""


@dataclass(frozen=True)
class Catalog:
    """All topics of one kvflow deployment, names prefixed by ``namespace``."""

    namespace: str = "kvflow"
    topics: dict[str, TopicSpec] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        ns = self.namespace

        def spec(short: str, **kw: Any) -> TopicSpec:
            return TopicSpec(name=f"{ns}.{short}", **kw)

        topics = {
            "requests": spec(
                "requests", partitions=8, key="request_id", value_schema=InferenceRequest,
                producers=("bridge", "client", "replay"), consumers=("router",),
                description="inference requests, before routing",
            ),
            "responses": spec(
                "responses", partitions=RESPONSE_SLOTS, key="request_id", value_schema=ResponseEvent,
                producers=("worker",), consumers=("bridge", "client"),
                description="token deltas and final responses; partition = reply_to slot",
            ),
            # The conversation of every stored /v1/responses answer, keyed by
            # response id; a bridge reads the one partition an id hashes to
            # when a request chains from a response it did not store itself.
            "responses_log": spec(
                "responses-log", partitions=8, key="response_id", value_schema=StoredResponse,
                retention_ms=30 * 24 * 3600 * 1000, producers=("bridge",), consumers=("bridge",),
                description="stored /v1/responses conversations, for previous_response_id",
            ),
            "workers": spec(
                "workers", partitions=4, key="worker_id", value_schema=WorkerHeartbeat,
                cleanup_policy="compact", producers=("worker",), consumers=("router", "bridge", "cli"),
                description="worker registration, heartbeat, drain and stop",
            ),
            "kv_events": spec(
                "kv-events", partitions=8, key="worker_id", value_schema=KvEventBatch,
                producers=("worker",), consumers=("router",),
                description="KV cache stored/removed/cleared events",
            ),
            # Workers publish one record when they take a request and one when it
            # ends; every router replica reads the whole topic (a projection, no
            # group) and so counts the same in-flight load per worker
            # (kvflow.router.inflight). Keyed by worker id: one worker's records
            # stay in order. They matter while their requests live; a router
            # restarting replays the retained hour.
            "inflight": spec(
                "inflight", partitions=8, key="worker_id", value_schema=InflightRecord,
                retention_ms=3600 * 1000, producers=("worker",), consumers=("router",),
                description="requests taken and ended by workers: the router's exact in-flight load",
            ),
            # One record per routing decision (candidates, cost terms, outcome),
            # keyed by request id: every record of a request is in one partition,
            # in order. Nothing in the pipeline consumes it; `kvflow explain`
            # reads it whole. Kept as long as the requests they explain.
            "routing_decisions": spec(
                "routing-decisions", partitions=8, key="request_id", value_schema=DecisionRecord,
                retention_ms=24 * 3600 * 1000, producers=("router",), consumers=("cli",),
                description="the router's decision for each request: candidates, cost terms, outcome",
            ),
            "kv_dump_requests": spec(
                "kv-dump-requests", partitions=1, key="worker_id", value_schema=KvDumpRequest,
                producers=("router",), consumers=("worker",),
                description="asks a worker to republish its whole KV cache (resync after a gap)",
            ),
            "metrics": spec(
                "metrics", partitions=4, key="worker_id", value_schema=MetricRecord,
                producers=("bridge", "worker"), consumers=("planner-sink",),
                description="per-request and per-worker metrics",
            ),
            # Every worker reads the whole cancels topic with its own consumer
            # (no group) and ignores ids it does not hold: the producer cannot
            # know the holder (the router chose it, and a disaggregated request
            # moves from a prefill to a decode worker). One partition is
            # enough at one record per cancelled request. Cancels matter only
            # while their request lives, hence the short retention.
            "cancels": spec(
                "cancels", partitions=1, key="request_id", value_schema=CancelRequest,
                retention_ms=3600 * 1000, producers=("bridge", "client"), consumers=("worker",),
                description="asks the worker holding a request to abort it (client gone or cancelled)",
            ),
            # Engine admin commands (sleep, wake, clear KV) for one worker and
            # that worker's answers, keyed by worker id. Every worker reads it
            # whole from its end (no group) and acts on commands naming it;
            # `kvflow admin` waits here for the answer. One partition: a few
            # records per operator action.
            "control": spec(
                "control", partitions=1, key="worker_id", value_schema=ControlRecord,
                retention_ms=24 * 3600 * 1000, producers=("cli", "worker"), consumers=("worker", "cli"),
                description="engine admin commands to one worker (sleep, wake, clear KV) and its answers",
            ),
            "scaling": spec(
                "scaling", partitions=1, key="pool", value_schema=ScalingCommand,
                producers=("planner",), consumers=("connector",),
                description="replica targets per worker pool",
            ),
            # The planner's EPLB placement per MoE model (kvflow.planner.eplb_job), keyed by
            # model and compacted: a worker starting reads the latest map of its model.
            "expert_placement": spec(
                "expert-placement", partitions=1, key="model", value_schema=ExpertPlacementMap,
                cleanup_policy="compact", producers=("planner",), consumers=("worker",),
                description="expert-parallel placement (physical-to-logical expert map) per MoE model",
            ),
            "dead_letter": spec(
                "dead-letter", partitions=1, key="source_topic", value_schema=DeadLetter,
                retention_ms=7 * 24 * 3600 * 1000, producers=("*",), consumers=("operator",),
                description="records that failed to decode or process",
            ),
        }
        for role in sorted(GENERATION_ROLES, key=list(WorkerRole).index):
            topics[f"queue.{role.value}"] = spec(
                f"queue.{role.value}", partitions=QUEUE_SLOTS, key="request_id", value_schema=InferenceRequest,
                producers=("router",), consumers=(f"{role.value}-worker",),
                description=f"routed requests for {role.value} workers; partition = worker slot",
            )
        # Requests with media the router sends by way of an encode worker, which
        # passes each on to the queue of the worker the router chose (forward_to).
        topics["queue.encode"] = spec(
            "queue.encode", partitions=QUEUE_SLOTS, key="request_id", value_schema=InferenceRequest,
            producers=("router",), consumers=("encode-worker",),
            description="routed requests whose media encode workers turn into embeddings; partition = worker slot",
        )
        # Embeddings skip the router (an encoder holds no KV to route by): the
        # bridge picks a live embedding worker and writes to its slot.
        topics["queue.embedding"] = spec(
            "queue.embedding", partitions=QUEUE_SLOTS, key="request_id", value_schema=EmbeddingRequest,
            producers=("bridge", "client"), consumers=("embedding-worker",),
            description="embeddings requests for embedding workers; partition = worker slot",
        )
        # The image pipeline's stages (kvflow.schemas.images) skip the router too: the
        # bridge picks a worker of each stage and writes to the first one's slot; the
        # text stage writes its output to the slot of the image stage named in the request.
        topics["queue.conditioning"] = spec(
            "queue.conditioning", partitions=STAGE_SLOTS, key="request_id", value_schema=ImageRequest,
            producers=("bridge",), consumers=("conditioning-worker",),
            description="image requests for the text stage (prompt encoding); partition = worker slot",
        )
        topics["queue.diffusion"] = spec(
            "queue.diffusion", partitions=STAGE_SLOTS, key="request_id", value_schema=ImageConditioning,
            producers=("conditioning-worker",), consumers=("diffusion-worker", "replay"),
            description="encoded prompts for the image stage (denoising); partition = worker slot",
        )
        object.__setattr__(self, "topics", topics)

    def __getitem__(self, key: str) -> TopicSpec:
        return self.topics[key]

    @property
    def requests(self) -> TopicSpec:
        """Unrouted inference requests."""
        return self.topics["requests"]

    @property
    def responses(self) -> TopicSpec:
        """Token deltas and final responses."""
        return self.topics["responses"]

    @property
    def responses_log(self) -> TopicSpec:
        """Stored /v1/responses conversations."""
        return self.topics["responses_log"]

    @property
    def workers(self) -> TopicSpec:
        """Worker heartbeats."""
        return self.topics["workers"]

    @property
    def kv_events(self) -> TopicSpec:
        """KV cache events."""
        return self.topics["kv_events"]

    @property
    def inflight(self) -> TopicSpec:
        """Requests taken and ended by workers."""
        return self.topics["inflight"]

    @property
    def routing_decisions(self) -> TopicSpec:
        """Routing decisions, one record per decision."""
        return self.topics["routing_decisions"]

    @property
    def kv_dump_requests(self) -> TopicSpec:
        """KV resync requests."""
        return self.topics["kv_dump_requests"]

    @property
    def metrics(self) -> TopicSpec:
        """Metric records."""
        return self.topics["metrics"]

    @property
    def cancels(self) -> TopicSpec:
        """Request cancellations."""
        return self.topics["cancels"]

    @property
    def control(self) -> TopicSpec:
        """Engine admin commands and answers."""
        return self.topics["control"]

    @property
    def scaling(self) -> TopicSpec:
        """Scaling commands."""
        return self.topics["scaling"]

    @property
    def expert_placement(self) -> TopicSpec:
        """EPLB expert placements, one per MoE model."""
        return self.topics["expert_placement"]

    @property
    def dead_letter(self) -> TopicSpec:
        """Dead letters."""
        return self.topics["dead_letter"]

    def queue(self, role: WorkerRole | str) -> TopicSpec:
        """The queue topic of a worker pool."""
        return self.topics[f"queue.{WorkerRole(role).value}"]

    def all(self) -> list[TopicSpec]:
        """Every topic, in a stable order."""
        return list(self.topics.values())
