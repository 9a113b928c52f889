"""Bodies of the OpenAI Responses API (``POST /v1/responses``) as kvflow serves it.

Fields follow the OpenAI Responses API reference, text only: ``input`` is a
string or a list of message items whose content is text; the answer is one
assistant ``message`` item with one ``output_text`` part. Unknown request
fields are ignored; fields asking for what kvflow does not do (tools,
non-text formats, non-text content) are rejected by the bridge.

Streaming sends the API's typed events, each as an SSE ``event:`` line
naming its ``type`` and a ``data:`` line with the JSON object, numbered by
``sequence_number`` from 0: ``response.created``, ``response.in_progress``,
``response.output_item.added``, ``response.content_part.added``,
``response.output_text.delta`` (one per piece of text),
``response.output_text.done``, ``response.content_part.done``,
``response.output_item.done``, then ``response.completed`` (or
``response.incomplete`` when cut by ``max_output_tokens``, or
``response.failed``).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, SerializerFunctionWrapHandler, model_serializer

from kvflow.schemas.requests import MAX_TIMEOUT_S, MAX_TOKENS_LIMIT

__all__ = [
    "InputTextPart",
    "InputMessage",
    "ResponsesRequest",
    "OutputText",
    "OutputMessage",
    "InputTokensDetails",
    "OutputTokensDetails",
    "ResponseUsage",
    "ResponseError",
    "IncompleteDetails",
    "ResponseObject",
    "ResponseStreamEvent",
]


class InputTextPart(BaseModel):
    """A text content part of an input message (``input_text``; ``output_text``
    in an assistant message given back as history)."""

    model_config = ConfigDict(extra="ignore")
    type: Literal["input_text", "output_text", "text"]
    text: str


class InputMessage(BaseModel):
    """One message item of ``input``: a role and text content."""

    model_config = ConfigDict(extra="ignore")
    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: str | list[InputTextPart]

    def text(self) -> str:
        """The content as plain text (parts joined)."""
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)


class ResponsesRequest(BaseModel):
    """POST /v1/responses body.

    ``instructions`` becomes a leading system message of this request only
    (not carried to a response chained after it, as in the OpenAI API).
    ``previous_response_id`` continues the conversation of a stored response
    (its input and output come before ``input``). ``store`` false keeps the
    response out of the responses log, so nothing can chain from it.
    ``max_output_tokens`` caps output tokens.
    """

    model_config = ConfigDict(extra="ignore")
    model: str = Field(min_length=1)
    input: str | list[InputMessage] = Field(min_length=1)
    instructions: str | None = None
    previous_response_id: str | None = Field(default=None, min_length=1, max_length=256)
    max_output_tokens: int | None = Field(default=None, ge=1, le=MAX_TOKENS_LIMIT)
    temperature: float = Field(default=1.0, ge=0.0, le=2.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    stream: bool = False
    store: bool = True
    metadata: dict[str, str] | None = None
    user: str | None = None
    tools: list[dict[str, Any]] | None = None
    """Only empty: kvflow serves no tool calls."""
    timeout_s: float | None = Field(default=None, gt=0, le=MAX_TIMEOUT_S)
    """kvflow extension: seconds from arrival to the request's deadline (as
    on chat completions; also the ``X-Request-Timeout`` header)."""


class OutputText(BaseModel):
    """The ``output_text`` content part of the answer."""

    type: Literal["output_text"] = "output_text"
    text: str
    annotations: list[Any] = Field(default_factory=list)


class OutputMessage(BaseModel):
    """The answer's one output item: an assistant message."""

    type: Literal["message"] = "message"
    id: str
    status: Literal["in_progress", "completed", "incomplete"]
    role: Literal["assistant"] = "assistant"
    content: list[OutputText]


class InputTokensDetails(BaseModel):
    """``cached_tokens``: prompt tokens served from the engine's prefix cache."""

    cached_tokens: int = 0


class OutputTokensDetails(BaseModel):
    """``reasoning_tokens``: always 0 (no reasoning models)."""

    reasoning_tokens: int = 0


class ResponseUsage(BaseModel):
    """Token counts of one response (``input_tokens`` counts the whole
    conversation sent to the model, chained history included)."""

    input_tokens: int
    input_tokens_details: InputTokensDetails = Field(default_factory=InputTokensDetails)
    output_tokens: int
    output_tokens_details: OutputTokensDetails = Field(default_factory=OutputTokensDetails)
    total_tokens: int


class ResponseError(BaseModel):
    """Why a response failed (status ``failed``)."""

    code: str
    message: str


class IncompleteDetails(BaseModel):
    """Why a response is ``incomplete``: ``max_output_tokens`` or ``cancelled``."""

    reason: str


class ResponseObject(BaseModel):
    """A ``response`` object: the non-streaming answer, and the snapshot
    carried by the lifecycle events of a stream. ``created_at`` is epoch
    seconds."""

    id: str
    object: Literal["response"] = "response"
    created_at: int
    status: Literal["in_progress", "completed", "incomplete", "failed"]
    model: str
    output: list[OutputMessage] = Field(default_factory=list)
    instructions: str | None = None
    previous_response_id: str | None = None
    max_output_tokens: int | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    store: bool = True
    metadata: dict[str, str] = Field(default_factory=dict)
    user: str | None = None
    usage: ResponseUsage | None = None
    error: ResponseError | None = None
    incomplete_details: IncompleteDetails | None = None
    parallel_tool_calls: bool = False
    tool_choice: str = "none"
    tools: list[Any] = Field(default_factory=list)
    text: dict[str, Any] = Field(default_factory=lambda: {"format": {"type": "text"}})


class ResponseStreamEvent(BaseModel):
    """One streamed event: ``type``, ``sequence_number`` and the members its
    type has (``response``; ``item``, ``output_index``; ``item_id``,
    ``content_index``, ``part``; ``delta``; ``text``). Members a type does
    not have are left out of its JSON."""

    model_config = ConfigDict(extra="forbid")
    type: str
    sequence_number: int
    response: ResponseObject | None = None
    output_index: int | None = None
    item: OutputMessage | None = None
    item_id: str | None = None
    content_index: int | None = None
    part: OutputText | None = None
    delta: str | None = None
    text: str | None = None
    logprobs: list[Any] | None = None

    @model_serializer(mode="wrap")
    def _drop_absent(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        # Only this level: the nested response keeps its null members.
        return {k: v for k, v in handler(self).items() if v is not None}
