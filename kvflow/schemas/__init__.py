"""The contract of every Kafka topic and HTTP body in kvflow.

Nothing outside this package defines a record's shape. Every record is a
frozen pydantic model with a ``schema_version``; :func:`encode` and
:func:`decode` are the only wire (de)serializers, except that the router's
hot path reads kv-events records with :func:`decode_kv_frame` (same checks,
no pydantic object per event).
"""

from kvflow.schemas.base import Record, RecordError, decode, encode, now_ms
from kvflow.schemas.control import (
    AdminAction,
    AdminCommand,
    AdminCommandApplied,
    CancelReason,
    CancelRequest,
    ControlRecord,
)
from kvflow.schemas.dead_letter import DeadLetter
from kvflow.schemas.decisions import CandidateCost, DecisionOutcome, DecisionRecord
from kvflow.schemas.inflight import InflightRecord, RequestAdmitted, RequestFinished
from kvflow.schemas.kv_events import (
    KV_WIRE_VERSION,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KvDumpRequest,
    KvEvent,
    KvEventBatch,
    KvTier,
    KvWireBatch,
    decode_kv_frame,
    encode_kv_batch,
)
from kvflow.schemas.eplb import ExpertPlacementMap
from kvflow.schemas.media import EncodeForward, MediaItem, MediaKind
from kvflow.schemas.images import ImageConditioning, ImageRequest
from kvflow.schemas.metrics import KvTierMetrics, MetricRecord, RequestMetrics, SpecDecodeMetrics, WorkerMetrics
from kvflow.schemas.requests import (
    ChatMessage,
    EmbeddingRequest,
    InferenceRequest,
    ReplyTo,
    RequestKind,
    RoutingDecision,
    SamplingParams,
)
from kvflow.schemas.responses import (
    DEADLINE_EXCEEDED,
    EmbeddingResult,
    ErrorInfo,
    FinalResponse,
    FinishReason,
    ImageResult,
    ResponseEvent,
    Timings,
    TokenDelta,
    Usage,
    deadline_exceeded,
)
from kvflow.schemas.responses_log import StoredResponse
from kvflow.schemas.scaling import ScalingCommand
from kvflow.schemas.workers import GENERATION_ROLES, IMAGE_ROLES, WorkerHeartbeat, WorkerRole, WorkerStatus

__all__ = [
    "AdminAction", "AdminCommand", "AdminCommandApplied", "ControlRecord",
    "AllBlocksCleared", "BlockRemoved", "BlockStored", "CancelReason", "CancelRequest", "CandidateCost",
    "ChatMessage", "DEADLINE_EXCEEDED", "EncodeForward", "MediaItem", "MediaKind", "DeadLetter", "DecisionOutcome", "DecisionRecord", "EmbeddingRequest", "ExpertPlacementMap",
    "EmbeddingResult", "ErrorInfo", "GENERATION_ROLES", "IMAGE_ROLES", "ImageConditioning", "ImageRequest",
    "ImageResult",
    "FinalResponse", "FinishReason", "InferenceRequest", "InflightRecord", "KV_WIRE_VERSION", "KvDumpRequest",
    "KvEvent", "KvEventBatch", "KvTier", "KvWireBatch", "MetricRecord", "Record", "RecordError", "ReplyTo",
    "RequestAdmitted", "RequestFinished", "RequestKind", "RequestMetrics",
    "ResponseEvent", "RoutingDecision", "SamplingParams", "ScalingCommand", "StoredResponse", "Timings",
    "TokenDelta", "Usage", "WorkerHeartbeat", "WorkerMetrics", "KvTierMetrics", "SpecDecodeMetrics", "WorkerRole",
    "WorkerStatus",
    "deadline_exceeded", "decode",
    "decode_kv_frame",
    "encode", "encode_kv_batch", "now_ms",
]
