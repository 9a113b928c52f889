"""OpenAI-compatible HTTP bodies served by the bridge.

Fields follow the OpenAI Chat Completions and Completions API references;
unknown request fields are ignored (clients send many optional ones).
Request bodies carry their static bounds (ranges, counts, lengths), so a
body that validates can always be turned into a request record and the
OpenAPI schema states the bounds; limits that depend on the deployment
(configured maxima, the model's context length) are checked by the bridge
(:mod:`kvflow.streams.bridge.bounds`).
"""

from __future__ import annotations

from typing import Annotated, Any, ClassVar, Literal, Union

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    SerializerFunctionWrapHandler,
    TypeAdapter,
    ValidationError,
    field_validator,
    model_serializer,
    model_validator,
)

from kvflow.schemas.requests import MAX_EMBEDDING_INPUTS, MAX_STOP_SEQUENCES, MAX_TIMEOUT_S, MAX_TOKENS_LIMIT

__all__ = [
    "MAX_STOP_CHARS",
    "INT64_MIN",
    "INT64_MAX",
    "INT32_MIN",
    "INT32_MAX",
    "StreamOptions",
    "TextPart",
    "ImageUrl",
    "ImageUrlPart",
    "InputAudio",
    "InputAudioPart",
    "VideoUrl",
    "VideoUrlPart",
    "ContentPart",
    "ChatCompletionRequest",
    "CompletionRequest",
    "ErrorBody",
    "ErrorResponse",
    "PromptTokensDetails",
    "UsageBody",
    "KvflowInfo",
    "AssistantMessage",
    "ChatChoice",
    "ChatCompletionResponse",
    "ChatDelta",
    "ChatChunkChoice",
    "ChatCompletionChunk",
    "CompletionChoice",
    "CompletionResponse",
    "ModelCard",
    "ModelList",
    "EmbeddingsRequest",
    "EmbeddingObject",
    "EmbeddingsUsage",
    "EmbeddingsResponse",
]


MAX_STOP_CHARS = 256
"""Longest stop string accepted (characters). Workers hold back up to this
much streamed text while it could still become a stop string."""

INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
"""Range of ``seed`` (OpenAI: a 64-bit integer)."""

INT32_MIN, INT32_MAX = -(2**31), 2**31 - 1
"""Range of ``priority`` and of prompt token ids."""

_STOP_SCHEMA: dict[str, Any] = {"anyOf": [
    {"type": "string", "maxLength": MAX_STOP_CHARS},
    {"type": "array", "items": {"type": "string", "maxLength": MAX_STOP_CHARS}, "maxItems": MAX_STOP_SEQUENCES},
    {"type": "null"},
]}

MaxTokens = Annotated[int | None, Field(default=None, ge=1, le=MAX_TOKENS_LIMIT)]


class StreamOptions(BaseModel):
    """``include_usage``: send a last chunk with ``usage`` and no choices."""

    model_config = ConfigDict(extra="ignore")
    include_usage: bool = False


class TextPart(BaseModel):
    """A ``text`` content part."""

    model_config = ConfigDict(extra="ignore")
    type: Literal["text"]
    text: str


class ImageUrl(BaseModel):
    """``url``: an ``http(s)://`` URL or a ``data:<type>;base64,`` URL of the image
    (``file://`` under the bridge's allowed roots). ``detail`` is accepted and ignored."""

    model_config = ConfigDict(extra="ignore")
    url: str = Field(min_length=1)
    detail: Literal["auto", "low", "high"] | None = None


class ImageUrlPart(BaseModel):
    """An ``image_url`` content part (OpenAI chat completions)."""

    model_config = ConfigDict(extra="ignore")
    type: Literal["image_url"]
    image_url: ImageUrl


class InputAudio(BaseModel):
    """``data``: the audio bytes, base64; ``format``: ``wav`` or ``mp3``."""

    model_config = ConfigDict(extra="ignore")
    data: str = Field(min_length=1)
    format: Literal["wav", "mp3"]


class InputAudioPart(BaseModel):
    """An ``input_audio`` content part (OpenAI chat completions)."""

    model_config = ConfigDict(extra="ignore")
    type: Literal["input_audio"]
    input_audio: InputAudio


class VideoUrl(BaseModel):
    """``url`` of the video, as :class:`ImageUrl`'s."""

    model_config = ConfigDict(extra="ignore")
    url: str = Field(min_length=1)


class VideoUrlPart(BaseModel):
    """A ``video_url`` content part (the extension vLLM and SGLang serve)."""

    model_config = ConfigDict(extra="ignore")
    type: Literal["video_url"]
    video_url: VideoUrl


ContentPart = Annotated[Union[TextPart, ImageUrlPart, InputAudioPart, VideoUrlPart], Field(discriminator="type")]
"""One part of a message's ``content`` list."""

_PARTS: TypeAdapter = TypeAdapter(list[ContentPart])


class _Message(BaseModel):
    model_config = ConfigDict(extra="ignore")
    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | list[dict[str, Any]] | None = None

    def parts(self) -> list[TextPart | ImageUrlPart | InputAudioPart | VideoUrlPart]:
        """The content as typed parts (a string is one text part).

        Raises:
            ValueError: a part of an unknown type or shape; the message
                names the part's index (``content.<i>``) and the field.
        """
        if self.content is None:
            return []
        if isinstance(self.content, str):
            return [TextPart(type="text", text=self.content)]
        try:
            return _PARTS.validate_python(self.content)
        except ValidationError as exc:
            first = exc.errors(include_url=False)[0]
            loc = list(first["loc"])
            del loc[1:2]  # the union's tag (the part's type), repeated by pydantic
            where = ".".join(str(p) for p in loc)
            raise ValueError(f"content.{where}: {first['msg']} (content parts served: text, image_url, "
                             "input_audio, video_url)") from None

    def text(self) -> str:
        """The message content as plain text (text parts joined)."""
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        parts = []
        for part in self.content:
            if part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise ValueError("only text content parts are supported")
            parts.append(part["text"])
        return "".join(parts)


class _SamplingBody(BaseModel):
    model_config = ConfigDict(extra="ignore")
    model: str = Field(min_length=1)
    max_tokens: MaxTokens = None
    temperature: float = Field(default=1.0, ge=0.0, le=2.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    seed: int | None = Field(default=None, ge=INT64_MIN, le=INT64_MAX)
    stop: list[str] | None = Field(default=None, json_schema_extra=_STOP_SCHEMA)
    """One string or a list of them; held as a list."""
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = Field(default=1, ge=1, le=1)
    user: str | None = None
    priority: int = Field(default=0, ge=INT32_MIN, le=INT32_MAX)
    """Priority class (higher is served first where the router's queue orders by it);
    also the ``X-Priority`` header when the body leaves it out."""
    session_id: str | None = Field(default=None, min_length=1, max_length=256)
    """kvflow extension: the session (conversation, agent run) the request belongs
    to; the router keeps a session's requests on one worker while its cost is
    close to the best. Also the ``X-Session-Id`` header."""
    ttft_target_ms: float | None = Field(default=None, gt=0, le=MAX_TIMEOUT_S * 1000)
    """kvflow extension (SLA hint): the time to first token the caller
    targets, ms; a router with a pool grid picks the prefill pool by it."""
    itl_target_ms: float | None = Field(default=None, gt=0, le=MAX_TIMEOUT_S * 1000)
    """kvflow extension (SLA hint): the inter-token latency the caller
    targets, ms; a router with a pool grid picks the decode pool by it."""
    ignore_eos: bool = False
    timeout_s: float | None = Field(default=None, gt=0, le=MAX_TIMEOUT_S)
    """kvflow extension: seconds from arrival to the request's deadline, by
    which it is answered (completed, or error ``deadline_exceeded``, 504);
    also the ``X-Request-Timeout`` header (the smaller wins). None: the
    deployment's default (:mod:`kvflow.streams.deadlines`)."""

    @field_validator("stop", mode="before")
    @classmethod
    def _stop_list(cls, v: Any) -> list[str] | None:
        # Checked here rather than by the field type so every stop error
        # names the ``stop`` field itself, whichever form was sent.
        if v is None:
            return None
        stops = [v] if isinstance(v, str) else v
        if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
            raise ValueError("stop must be a string or a list of strings")
        if len(stops) > MAX_STOP_SEQUENCES:
            raise ValueError(f"at most {MAX_STOP_SEQUENCES} stop sequences")
        if any(len(s) > MAX_STOP_CHARS for s in stops):
            raise ValueError(f"a stop sequence may have at most {MAX_STOP_CHARS} characters")
        return stops


class ChatCompletionRequest(_SamplingBody):
    """POST /v1/chat/completions body (text messages only).

    ``max_completion_tokens`` wins over ``max_tokens`` when both are given.
    ``logprobs``/``top_logprobs`` are typed and bounded as OpenAI documents
    them but only their "off" values are served.
    """

    messages: list[_Message] = Field(min_length=1)
    max_completion_tokens: MaxTokens = None
    logprobs: bool | None = None
    top_logprobs: int | None = Field(default=None, ge=0, le=20)


class CompletionRequest(_SamplingBody):
    """POST /v1/completions body: one prompt, as text, token ids or embeddings.

    ``logprobs``, ``best_of`` and ``suffix`` are typed and bounded as OpenAI
    documents them but only their "off" values are served.
    """

    prompt: str | list[Annotated[int, Field(ge=0, le=INT32_MAX)]] | None = None
    prompt_embeds: str | None = None
    """The prompt as embeddings instead: base64 of a ``torch.save``'d
    ``[seq_len, hidden]`` tensor of the model's dtype (then ``prompt`` is
    left out or empty)."""
    echo: bool = False
    logprobs: int | None = Field(default=None, ge=0, le=5)
    best_of: int | None = Field(default=None, ge=1, le=20)
    suffix: str | None = None

    @model_validator(mode="after")
    def _one_prompt(self) -> "CompletionRequest":
        if self.prompt_embeds is not None:
            if self.prompt:
                raise ValueError("send either prompt or prompt_embeds, not both")
        elif self.prompt is None:
            raise ValueError("prompt is required")
        return self


class ErrorBody(BaseModel):
    """OpenAI error object: ``message``, ``type``, ``param``, ``code``."""

    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    """The body of every non-2xx answer: ``{"error": {...}}``."""

    error: ErrorBody


# ---------------------------------------------------------------------------
# Response bodies (non-streaming objects and SSE chunks).
# ---------------------------------------------------------------------------


class _OmitNone(BaseModel):
    """Serializes without the fields named in ``_omit_if_none`` when they are None.

    OpenAI objects keep ``finish_reason: null`` but leave out absent optional
    members (``usage`` on most chunks, ``role`` on later deltas), so a plain
    ``exclude_none`` would be wrong in one direction or the other.
    """

    _omit_if_none: ClassVar[tuple[str, ...]] = ()

    @model_serializer(mode="wrap")
    def _drop_absent(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        data = handler(self)
        for name in self._omit_if_none:
            if data.get(name) is None:
                data.pop(name, None)
        return data


class PromptTokensDetails(BaseModel):
    """``cached_tokens``: prompt tokens served from the engine's prefix cache."""

    cached_tokens: int = 0


class UsageBody(BaseModel):
    """OpenAI ``usage``: token counts of one request."""

    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails = Field(default_factory=PromptTokensDetails)


class KvflowInfo(_OmitNone):
    """Extension field ``kvflow`` on final objects/chunks: the routing decision.

    ``overlap_blocks`` is how many prompt KV blocks the chosen worker already
    held when routed; ``cost`` is the policy's score of it (lower is better).
    """

    _omit_if_none = ("prefill_worker_id",)
    worker_id: str
    policy: str = ""
    overlap_blocks: int = 0
    cost: float = 0.0
    router_id: str = ""
    prefill_worker_id: str | None = None


class AssistantMessage(BaseModel):
    """The generated message of a non-streaming chat completion."""

    role: Literal["assistant"] = "assistant"
    content: str


class ChatChoice(BaseModel):
    """One choice of a ``chat.completion`` (kvflow serves exactly one)."""

    index: int = 0
    message: AssistantMessage
    finish_reason: str | None = None
    logprobs: None = None


class ChatCompletionResponse(_OmitNone):
    """Non-streaming answer of POST /v1/chat/completions."""

    _omit_if_none = ("kvflow",)
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: UsageBody
    kvflow: KvflowInfo | None = None


class ChatDelta(_OmitNone):
    """The new part of the message in one chunk (``role`` only on the first)."""

    _omit_if_none = ("role", "content")
    role: Literal["assistant"] | None = None
    content: str | None = None


class ChatChunkChoice(BaseModel):
    """One choice of a ``chat.completion.chunk``."""

    index: int = 0
    delta: ChatDelta
    finish_reason: str | None = None
    logprobs: None = None


class ChatCompletionChunk(_OmitNone):
    """One SSE event of a streamed chat completion. ``choices`` is empty on
    the usage chunk (``stream_options.include_usage``)."""

    _omit_if_none = ("usage", "kvflow")
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: UsageBody | None = None
    kvflow: KvflowInfo | None = None


class CompletionChoice(BaseModel):
    """One choice of a ``text_completion`` object or chunk."""

    index: int = 0
    text: str
    finish_reason: str | None = None
    logprobs: None = None


class CompletionResponse(_OmitNone):
    """Non-streaming answer of POST /v1/completions; also the shape of each
    streamed chunk (OpenAI uses ``text_completion`` for both)."""

    _omit_if_none = ("usage", "kvflow")
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: UsageBody | None = None
    kvflow: KvflowInfo | None = None


class ModelCard(BaseModel):
    """One entry of GET /v1/models. ``created`` is epoch seconds (first seen)."""

    id: str
    object: Literal["model"] = "model"
    created: int = 0
    owned_by: str = "kvflow"


class ModelList(BaseModel):
    """GET /v1/models body."""

    object: Literal["list"] = "list"
    data: list[ModelCard]


# ---------------------------------------------------------------------------
# Embeddings (POST /v1/embeddings).
# ---------------------------------------------------------------------------

_TokenIds = Annotated[list[Annotated[int, Field(ge=0, le=INT32_MAX)]], Field(min_length=1)]
_Texts = Annotated[list[Annotated[str, Field(min_length=1)]], Field(min_length=1, max_length=MAX_EMBEDDING_INPUTS)]
_IdLists = Annotated[list[_TokenIds], Field(min_length=1, max_length=MAX_EMBEDDING_INPUTS)]


class EmbeddingsRequest(BaseModel):
    """POST /v1/embeddings body.

    ``input`` is one text, a list of texts, one list of token ids, or a list
    of them (ids of the model's own tokenizer, without special tokens), at
    most :data:`~kvflow.schemas.requests.MAX_EMBEDDING_INPUTS` inputs, none
    empty. ``encoding_format`` ``base64`` sends each vector as the base64 of
    its little-endian float32 bytes. ``dimensions`` truncates each vector to
    that many components (re-normalized), on Matryoshka-trained models only;
    other models take only their own width (400 otherwise).
    """

    model_config = ConfigDict(extra="ignore")
    model: str = Field(min_length=1)
    input: Annotated[str, Field(min_length=1)] | _Texts | _TokenIds | _IdLists
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = Field(default=None, ge=1)
    user: str | None = None
    timeout_s: float | None = Field(default=None, gt=0, le=MAX_TIMEOUT_S)
    """kvflow extension: seconds from arrival to the request's deadline, as
    on chat completions (also the ``X-Request-Timeout`` header)."""

    def inputs(self) -> tuple[list[str] | None, list[list[int]] | None]:
        """``(texts, token_ids)``: the inputs as a list, exactly one of the two set."""
        value = self.input
        if isinstance(value, str):
            return [value], None
        if value and isinstance(value[0], str):
            return list(value), None  # type: ignore[arg-type]
        if value and isinstance(value[0], int):
            return None, [list(value)]  # type: ignore[arg-type]
        return None, [list(ids) for ids in value]  # type: ignore[union-attr]


class EmbeddingObject(BaseModel):
    """One vector of an embeddings answer: floats, or a base64 string."""

    object: Literal["embedding"] = "embedding"
    index: int
    embedding: list[float] | str


class EmbeddingsUsage(BaseModel):
    """Token counts of an embeddings request (no completion tokens)."""

    prompt_tokens: int
    total_tokens: int


class EmbeddingsResponse(BaseModel):
    """POST /v1/embeddings answer: one :class:`EmbeddingObject` per input, in order."""

    object: Literal["list"] = "list"
    data: list[EmbeddingObject]
    model: str
    usage: EmbeddingsUsage
