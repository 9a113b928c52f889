"""Records on the requests topic and the worker queue topics."""

from __future__ import annotations

from enum import Enum
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from kvflow.schemas.base import Record
from kvflow.schemas.decisions import CandidateCost
from kvflow.schemas.media import MAX_MEDIA_ITEMS, EncodeForward, MediaItem, media_block_hashes
from kvflow.schemas.prompt_embeds import PromptEmbeds

__all__ = [
    "MAX_TOKENS_LIMIT",
    "MAX_TIMEOUT_S",
    "MAX_STOP_SEQUENCES",
    "ChatMessage",
    "SamplingParams",
    "ReplyTo",
    "RoutingDecision",
    "RequestKind",
    "InferenceRequest",
    "MAX_EMBEDDING_INPUTS",
    "EmbeddingRequest",
]


MAX_TOKENS_LIMIT = 1_000_000
"""Largest ``max_tokens`` a request record may carry (output tokens)."""

MAX_STOP_SEQUENCES = 16
"""Most stop strings a request record may carry."""

MAX_TIMEOUT_S = 86400.0
"""Longest timeout (seconds from arrival to deadline) a caller may ask for: one day."""


class ChatMessage(BaseModel):
    """One chat turn. ``content`` is plain text."""

    model_config = ConfigDict(frozen=True, extra="ignore")
    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str


class SamplingParams(BaseModel):
    """Sampling settings, OpenAI semantics.

    ``temperature`` 0 means greedy. ``max_tokens`` counts output tokens (OSL
    cap). ``seed`` makes sampling reproducible per request.
    """

    model_config = ConfigDict(frozen=True, extra="ignore")
    max_tokens: int = Field(default=256, ge=1, le=MAX_TOKENS_LIMIT)
    temperature: float = Field(default=1.0, ge=0.0, le=2.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    seed: int | None = None
    stop: list[str] = Field(default_factory=list, max_length=MAX_STOP_SEQUENCES)
    ignore_eos: bool = False


class ReplyTo(BaseModel):
    """Where a worker sends a request's responses: a topic and a partition.

    Each consumer of responses (a bridge, a Kafka-native client) owns one
    partition of the responses topic, so no consumer group is needed.
    """

    model_config = ConfigDict(frozen=True)
    topic: str
    partition: int = Field(ge=0)


class RoutingDecision(BaseModel):
    """What the router decided for a request, echoed back on the response.

    ``overlap_blocks`` is the number of prompt blocks the chosen worker
    already held (0 for policies that do not look at the KV index);
    ``cost`` is the policy's score of the chosen worker (lower is better).

    ``candidates`` holds the policy's terms for every worker it weighed
    (:class:`~kvflow.schemas.decisions.CandidateCost`, worker-id order), for
    the router's record on the routing-decisions topic. It is never
    serialized: a request or response echoing the decision does not carry
    it, and a decoded decision has none.
    """

    model_config = ConfigDict(frozen=True, extra="ignore")
    worker_id: str
    policy: str
    overlap_blocks: int = 0
    cost: float = 0.0
    router_id: str = ""
    decided_ms: int = 0
    prefill_worker_id: str | None = None
    candidates: tuple[CandidateCost, ...] = Field(default=(), exclude=True)


class RequestKind(str, Enum):
    """Which OpenAI endpoint shape the request came from."""

    chat = "chat"
    completion = "completion"


class InferenceRequest(Record):
    """An inference request: the record on the requests topic and worker queues.

    Exactly one of ``messages`` (chat), ``prompt`` (text completion),
    ``token_ids`` or ``prompt_embeds`` must carry the input; ``token_ids``
    may be present alongside the first two when the producer already
    tokenized (KV-aware routing needs them). A request with
    ``prompt_embeds`` is routed and prefix-cached by their row ids
    (:meth:`~kvflow.schemas.prompt_embeds.PromptEmbeds.row_ids`, see
    :meth:`hash_ids`).

    Times are epoch milliseconds. ``deadline_ms`` (optional) is when the
    caller stops waiting: a worker ends the request then (error
    ``deadline_exceeded``) and drops one already past it. Higher
    ``priority`` is served first where a queue orders by it (the router's
    ``priority`` queue order: class, then ``tenant`` fair share, then
    earliest deadline; a full queue sheds the lowest class first).
    ``tenant`` names who sent the request (the bridge: a digest of the API
    key, never the key); ``session_id`` groups requests of one conversation
    or agent, which the router keeps on one worker while its cost is within
    a margin of the best. ``ttft_target_ms``/``itl_target_ms`` are the
    caller's SLA hints (TTFT and ITL targets, ms); a router with a pool grid
    picks the request's pools by them (:mod:`kvflow.router.pools`).

    Media (:mod:`kvflow.schemas.media`): ``media`` items stand at runs of
    placeholder ids in ``token_ids`` (required with them) and salt the block
    hashes they cover (:meth:`mm_hashes`). Items still carrying bytes
    (:attr:`needs_encoding`) go from the router to an encode worker, with
    ``forward_to`` naming the worker queue partition the router chose; the
    encode worker sends the request on there with the embeddings in place of
    the bytes and ``forward_to`` cleared.

    Migration: ``attempt`` counts resubmissions of the request after its
    worker was lost (0 for the first); a resubmission carries the output
    already delivered appended to ``token_ids``, counted by
    ``resumed_tokens``, with ``sampling.max_tokens`` reduced by as much.
    Workers echo ``attempt`` on every response record, so a client ignores
    records of an earlier attempt.
    """

    request_id: str = Field(min_length=1, max_length=256)
    model: str = Field(min_length=1)
    kind: RequestKind = RequestKind.chat
    messages: list[ChatMessage] | None = None
    prompt: str | None = None
    token_ids: list[int] | None = None
    sampling: SamplingParams = Field(default_factory=SamplingParams)
    reply_to: ReplyTo
    created_ms: int = 0
    deadline_ms: int | None = None
    priority: int = 0
    tenant: str | None = Field(default=None, max_length=64)
    session_id: str | None = Field(default=None, min_length=1, max_length=256)
    ttft_target_ms: float | None = Field(default=None, gt=0)
    itl_target_ms: float | None = Field(default=None, gt=0)
    lora_name: str | None = None
    routing: RoutingDecision | None = None
    disaggregated_params: dict[str, Any] | None = None
    attempt: int = Field(default=0, ge=0, le=1000)
    resumed_tokens: int = Field(default=0, ge=0)
    prompt_embeds: PromptEmbeds | None = None
    media: list[MediaItem] | None = Field(default=None, max_length=MAX_MEDIA_ITEMS)
    forward_to: EncodeForward | None = None

    @model_validator(mode="after")
    def _has_input(self) -> "InferenceRequest":
        if self.prompt_embeds is not None:
            if self.messages is not None or self.prompt is not None or self.token_ids is not None or self.media:
                raise ValueError("prompt_embeds carries the whole prompt: no messages, prompt, token_ids or "
                                 "media with it")
            return self
        if self.messages is None and self.prompt is None and self.token_ids is None:
            raise ValueError("one of messages, prompt, token_ids or prompt_embeds is required")
        if self.messages is not None and len(self.messages) == 0:
            raise ValueError("messages must not be empty")
        if self.media:
            if self.token_ids is None:
                raise ValueError("media needs token_ids holding its placeholder tokens")
            if any(item.offset + item.num_tokens > len(self.token_ids) for item in self.media):
                raise ValueError("a media item's placeholder tokens lie past the end of token_ids")
        return self

    @property
    def needs_encoding(self) -> bool:
        """Whether a media item still carries bytes instead of embeddings."""
        return any(item.embeds is None for item in self.media or ())

    def mm_hashes(self, block_size: int) -> list[tuple[int, int]]:
        """``(block_index, content_hash)`` of the blocks the media covers
        (:func:`~kvflow.schemas.media.media_block_hashes`); empty without media."""
        return media_block_hashes((item.span for item in self.media or ()), block_size)

    def hash_ids(self) -> list[int] | None:
        """The ids a router hashes into KV blocks: ``token_ids``, or the row
        ids of ``prompt_embeds``; None when the producer did not tokenize."""
        if self.prompt_embeds is not None:
            return self.prompt_embeds.row_ids()
        return self.token_ids


MAX_EMBEDDING_INPUTS = 2048
"""Most inputs one embeddings request may carry (the OpenAI API's limit)."""


class EmbeddingRequest(Record):
    """One embeddings request: the record on the ``queue.embedding`` topic.

    An encoder keeps no KV between requests, so embeddings requests skip the
    router: the producer (the HTTP bridge) picks a live embedding worker and
    writes the request to that worker's partition; the worker answers with
    one :class:`~kvflow.schemas.responses.EmbeddingResult` on ``reply_to``.

    Exactly one of ``texts`` and ``token_ids`` is set, one entry per input
    (``[num_inputs]`` strings, or ``[num_inputs][seq_len]`` ids of the
    worker's tokenizer). ``dimensions``: keep the first this many components
    of each vector and re-normalize (the OpenAI API's ``dimensions``; a
    worker takes it only for a Matryoshka-trained model, else only the
    model's own width); None keeps the model's width. Times are
    epoch ms; a worker drops a request already past ``deadline_ms``.
    """

    request_id: str = Field(min_length=1, max_length=256)
    model: str = Field(min_length=1)
    texts: list[str] | None = Field(default=None, min_length=1, max_length=MAX_EMBEDDING_INPUTS)
    token_ids: list[Annotated[list[Annotated[int, Field(ge=0)]], Field(min_length=1)]] | None = Field(
        default=None, min_length=1, max_length=MAX_EMBEDDING_INPUTS)
    dimensions: int | None = Field(default=None, ge=1)
    reply_to: ReplyTo
    created_ms: int = 0
    deadline_ms: int | None = None

    @model_validator(mode="after")
    def _one_input(self) -> "EmbeddingRequest":
        if (self.texts is None) == (self.token_ids is None):
            raise ValueError("exactly one of texts or token_ids is required")
        return self

    @property
    def num_inputs(self) -> int:
        """How many vectors the request asks for."""
        return len(self.texts) if self.texts is not None else len(self.token_ids or ())
