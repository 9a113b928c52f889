"""Records on the responses topic: streamed token deltas and the final response."""

from __future__ import annotations

from enum import Enum
from typing import Annotated, Literal, Union

from pydantic import BaseModel, ConfigDict, Field

from kvflow.schemas.base import Record
from kvflow.schemas.requests import RoutingDecision
from kvflow.schemas.transfer import KvTransferInfo

__all__ = ["DEADLINE_EXCEEDED", "FinishReason", "Usage", "Timings", "ErrorInfo", "TokenDelta", "FinalResponse",
           "EmbeddingResult", "ImageResult", "ResponseEvent", "deadline_exceeded"]

DEADLINE_EXCEEDED = "deadline_exceeded"
"""``ErrorInfo.code`` of a request that passed its ``deadline_ms`` (HTTP 504)."""


class FinishReason(str, Enum):
    """Why generation stopped (OpenAI names, plus ``error`` and ``abort``)."""

    stop = "stop"
    length = "length"
    abort = "abort"
    error = "error"


class Usage(BaseModel):
    """Token counts. ``cached_tokens`` is the engine's real prefix-cache hit."""

    model_config = ConfigDict(frozen=True)
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0

    @property
    def total_tokens(self) -> int:
        """prompt + completion tokens."""
        return self.prompt_tokens + self.completion_tokens


class Timings(BaseModel):
    """Worker-side timestamps (epoch ms) of one request's life on a worker."""

    model_config = ConfigDict(frozen=True)
    queued_ms: int = 0
    started_ms: int = 0
    first_token_ms: int = 0
    finished_ms: int = 0


class ErrorInfo(BaseModel):
    """A failed request: OpenAI-style ``type``/``code`` and a message."""

    model_config = ConfigDict(frozen=True)
    message: str
    type: str = "server_error"
    code: str | None = None
    status: int = 500
    retry_after_s: int | None = None
    """For 503s: seconds after which a retry may succeed (HTTP ``Retry-After``)."""
    param: str | None = None
    """For 4xx: the request field at fault (the OpenAI error's ``param``), when known."""


def deadline_exceeded(message: str) -> ErrorInfo:
    """The error of a request ended by its deadline: HTTP 504, type
    ``timeout_error``, code :data:`DEADLINE_EXCEEDED` (not retryable as is:
    a retry needs a later deadline)."""
    return ErrorInfo(message=message, type="timeout_error", code=DEADLINE_EXCEEDED, status=504)


class TokenDelta(Record):
    """New output tokens of one request, in order (``index`` counts deltas from 0)."""

    type: Literal["delta"] = "delta"
    request_id: str
    index: int = Field(ge=0)
    token_ids: list[int]
    text: str = ""
    worker_id: str = ""
    attempt: int = 0
    """The request's ``attempt`` this record answers (see :class:`~kvflow.schemas.InferenceRequest`)."""


class FinalResponse(Record):
    """The last record of a request: full text, usage, timings and routing.

    ``error`` is set (and ``finish_reason`` is ``error``) when the request failed.
    ``kv_transfer`` is set when the prompt was prefilled on another worker
    (disaggregated serving): which one, and how the KV moved.
    """

    type: Literal["final"] = "final"
    request_id: str
    text: str = ""
    token_ids: list[int] = Field(default_factory=list)
    finish_reason: FinishReason
    usage: Usage = Field(default_factory=Usage)
    timings: Timings = Field(default_factory=Timings)
    worker_id: str = ""
    routing: RoutingDecision | None = None
    error: ErrorInfo | None = None
    kv_transfer: KvTransferInfo | None = None
    attempt: int = 0
    """The request's ``attempt`` this record answers (see :class:`~kvflow.schemas.InferenceRequest`)."""


class EmbeddingResult(Record):
    """The answer to an :class:`~kvflow.schemas.requests.EmbeddingRequest`: one record per request.

    ``embeddings`` holds one L2-normalized vector per input, in input order
    (``[num_inputs][dim]`` floats); ``prompt_tokens`` counts the tokens
    encoded (after truncation to the model's longest input). ``error`` is
    set, and ``embeddings`` empty, when the request failed.
    """

    type: Literal["embedding"] = "embedding"
    request_id: str
    model: str = ""
    embeddings: list[list[float]] = Field(default_factory=list)
    prompt_tokens: int = Field(default=0, ge=0)
    worker_id: str = ""
    error: ErrorInfo | None = None


class ImageResult(Record):
    """The answer to an :class:`~kvflow.schemas.images.ImageRequest`: one
    record per request, written by the diffusion worker.

    ``images`` holds ``n`` PNG files, base64 (standard alphabet), in the
    order the seeded generator drew their noise; ``width``/``height`` are
    their size in pixels, ``seed`` and ``num_inference_steps`` what made
    them. ``timings``: ``queued_ms`` when the request reached the diffusion
    worker's queue (the conditioning record's time), ``started_ms``/
    ``finished_ms`` the denoising loop (epoch ms). ``error`` is set, and
    ``images`` empty, when the request failed.
    """

    type: Literal["image"] = "image"
    request_id: str
    model: str = ""
    images: list[str] = Field(default_factory=list)
    width: int = Field(default=0, ge=0)
    height: int = Field(default=0, ge=0)
    seed: int = 0
    num_inference_steps: int = Field(default=0, ge=0)
    prompt_tokens: int = Field(default=0, ge=0)
    timings: Timings = Field(default_factory=Timings)
    worker_id: str = ""
    error: ErrorInfo | None = None


ResponseEvent = Annotated[Union[TokenDelta, FinalResponse, EmbeddingResult, ImageResult], Field(discriminator="type")]
"""Any record on the responses topic, told apart by ``type``: the token
deltas and final response of a generation request, or the one result of an
embeddings or image request."""
