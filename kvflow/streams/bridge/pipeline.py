"""The request path shared by ``/v1/chat/completions`` and ``/v1/completions``.

Steps, in order: read the body (size limit) → parse and validate → check the
model against the live-worker projection (404/503) → fetch a chat's media
parts and put their placeholder runs in its prompt
(:mod:`kvflow.streams.bridge.media`; 400 when refused) → pre-tokenize with the
workers' tokenizer (413 over ``max_prompt_tokens``) → settle the output cap
against the configured maximum and the model's context length (400,
:mod:`kvflow.streams.bridge.bounds`) → build the :class:`InferenceRequest` → send it through the response source and wait for
the first record → answer with one JSON object or an SSE stream.

Waiting for the first record before answering means failures that happen
before any token (a worker error, a timeout) get their real HTTP status
instead of a 200 followed by an error event.

If the client disconnects before the final record (while the bridge waits
for it, or mid-stream) the bridge stops reading the request's records,
answers 499 in its metrics and publishes one cancel record, so the worker
aborts the request and frees its KV blocks
(:mod:`kvflow.streams.bridge.disconnect`); for a stream that had started,
after ``Settings.stream_resume_grace_s`` unless the client resumed it.

Deadlines: every request gets one (:mod:`kvflow.streams.bridge.deadline`);
the response source ends it there with error ``deadline_exceeded`` (504, or
an error event then ``[DONE]`` once a stream has started).

Resuming: the events of a stream carry ids
(:mod:`kvflow.streams.bridge.event_ids`); the same request sent again with a
``Last-Event-ID`` header naming one of them is not submitted again: its
records are replayed from the responses topic and the stream goes on after
that event, on this bridge or any other.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from aiokafka.errors import KafkaError, MessageSizeTooLargeError
from fastapi import Request, Response
from opentelemetry import trace

from kvflow.schemas import (
    ChatMessage,
    FinalResponse,
    InferenceRequest,
    MediaItem,
    ReplyTo,
    RequestKind,
    TokenDelta,
    now_ms,
)
from kvflow.schemas.openai import ChatCompletionRequest, CompletionRequest
from kvflow.streams.bridge.attachments import Attachment
from kvflow.streams.bridge.body import read_body
from kvflow.streams.bridge.bounds import output_budget
from kvflow.streams.bridge.deadline import timeout_for
from kvflow.streams.bridge.disconnect import ClientDisconnected, cancel_upstream, unless_disconnected
from kvflow.streams.bridge.errors import (
    BridgeError,
    broker_unavailable,
    error_response,
    from_error_info,
    invalid_request,
    model_not_found,
    no_live_workers,
    overloaded,
    payload_too_large,
    request_timeout,
)
from kvflow.streams.bridge.event_ids import EventId
from kvflow.streams.bridge.media import MediaRef, encode_chat_media, fetch_all, media_items, media_refs
from kvflow.streams.bridge.metrics import STATUS_CLIENT_CLOSED, RequestObserver
from kvflow.streams.bridge.openai_format import (
    ResponseMeta,
    chat_completion,
    chat_messages,
    check_supported,
    parse_body,
    text_completion,
    to_inference_request,
)
from kvflow.streams.bridge.prompt_embeds import decode_prompt_embeds
from kvflow.streams.bridge.serving_class import serving_class
from kvflow.streams.bridge.sse import EventStreamResponse, chat_sse, completion_sse, with_ids
from kvflow.streams.bridge.state import BridgeState, admit, release
from kvflow.streams.bridge.tokenize_worker import template_errors
from kvflow.streams.bridge.tokenizers import encode_chat, encode_prompt
from kvflow.streams.bridge.worker_registry import ModelState
from kvflow.streams.client import RequestTimeout, StreamCursor, StreamNotFound
from kvflow.streams.tracing import TRACE_ID_HEADER, trace_id_hex, tracer

__all__ = ["ENDPOINTS", "LAST_EVENT_ID", "Prepared", "prepare", "prepare_parsed", "serve", "next_record"]

log = logging.getLogger(__name__)

ENDPOINTS = {RequestKind.chat: "chat", RequestKind.completion: "completions"}
"""Endpoint label of each request kind (Prometheus ``endpoint``)."""

_ID_PREFIX = {RequestKind.chat: "chatcmpl-", RequestKind.completion: "cmpl-"}

LAST_EVENT_ID = "Last-Event-ID"
"""Request header naming the last SSE event a resuming client received."""

Body = ChatCompletionRequest | CompletionRequest
Events = AsyncIterator[TokenDelta | FinalResponse]


@dataclass(frozen=True)
class Prepared:
    """A validated body and the request record built from it.

    ``echo_text`` is the prompt text to prepend (completions with ``echo``).
    """

    body: Body
    request: InferenceRequest
    meta: ResponseMeta
    echo_text: str = ""


def _tokenizer_spec(state: BridgeState, model: str) -> str:
    status = state.registry.model_state(model)
    if status is ModelState.unknown:
        raise model_not_found(model)
    if status is not ModelState.serving and state.registry.embedding_only(model):
        raise invalid_request(f"The model `{model}` is an embedding model; use /v1/embeddings.", param="model",
                              code="model_not_supported")
    if status is not ModelState.serving and state.registry.image_only(model):
        raise invalid_request(f"The model `{model}` is an image model; use /v1/images/generations.",
                              param="model", code="model_not_supported")
    spec = state.registry.tokenizer_spec(model) if status is ModelState.serving else None
    if spec is None and state.settings.shed_cold_start_hold_s is not None:
        # A pool scaled to zero: the router holds the request while a worker starts.
        spec = state.registry.last_tokenizer.get(model)
    if spec is None:
        raise no_live_workers(model, state.retry_after_s)
    return spec


async def _load_tokenizer(state: BridgeState, spec: str) -> Any:
    try:
        return await state.tokenizers.get(spec)
    except Exception as exc:  # noqa: BLE001 - any loader failure is a server-side problem
        log.error("cannot load tokenizer %r: %s", spec, exc)
        raise BridgeError(500, f"The bridge cannot load the tokenizer `{spec}` its workers advertise.",
                          "server_error", code="tokenizer_unavailable") from None


async def _tokenize(body: Body, messages: list[ChatMessage] | None, tokenizer: Any, state: BridgeState,
                    spec: str) -> tuple[list[int], str]:
    """Prompt ids (shape [ISL]) and the echo text of ``body``, encoded by
    ``state.tokenizers.pool`` when it serves ``spec``.

    Raises:
        BridgeError: 400 when the model's chat template rejects the
            conversation (e.g. roles that do not alternate), or a prompt
            token id is outside the vocabulary.
    """
    if messages is not None:
        try:
            return await encode_chat(tokenizer, messages, pool=state.tokenizers.pool, spec=spec), ""
        except template_errors() as exc:
            raise invalid_request(f"The model's chat template rejects these messages: {exc}",
                                  param="messages") from None
    assert isinstance(body, CompletionRequest)
    if isinstance(body.prompt, str):
        ids = await encode_prompt(tokenizer, body.prompt, pool=state.tokenizers.pool, spec=spec)
        return ids, body.prompt if body.echo else ""
    vocab = getattr(tokenizer, "vocab_size", None)
    bad = [t for t in body.prompt if t < 0 or (vocab is not None and t >= vocab)]
    if bad:
        raise invalid_request(f"prompt token id {bad[0]} is outside the vocabulary [0, {vocab}).", param="prompt")
    return list(body.prompt), tokenizer.decode(body.prompt) if body.echo else ""


async def _place_media(state: BridgeState, model: str, spec: str, messages: list[ChatMessage],
                       refs: list[MediaRef]) -> tuple[list[int], list[MediaItem]]:
    """Prompt ids with each media part's placeholder run, and the media items
    (:mod:`kvflow.streams.bridge.media`).

    Raises:
        BridgeError: 400 when no encode worker serves ``model`` (it takes no
            media) or a media part is refused; 500 tokenizer cannot be loaded.
    """
    media_tokens = state.registry.media_tokens(model)
    if media_tokens is None and state.refresh_workers is not None:
        await state.refresh_workers(model)  # an encode worker may have just started
        media_tokens = state.registry.media_tokens(model)
    if media_tokens is None:
        raise invalid_request(f"The model `{model}` takes no media inputs: no encode worker serves it.",
                              param="messages", code="unsupported")
    fetched = await fetch_all(refs, state.settings)
    token_ids, offsets = await encode_chat_media(await _load_tokenizer(state, spec), messages, len(refs),
                                                 media_tokens)
    return token_ids, media_items(refs, fetched, offsets, media_tokens)


async def prepare(state: BridgeState, http_request: Request, kind: RequestKind,
                  resume: EventId | None = None) -> Prepared:
    """Read, validate and tokenize one HTTP request into an :class:`InferenceRequest`.

    With ``resume`` (a stream resumed from that event) the record is the one
    the request was first sent as: its id, arrival time (so its deadline)
    and responses partition come from the event id.

    Raises:
        BridgeError: 400 bad body/unsupported feature/output cap over a
            limit/bad timeout/media refused or not served, 404 unknown model, 413 body or prompt too
            large, 503 no live worker, 500 tokenizer cannot be loaded.
    """
    raw = await read_body(http_request, state.max_body_bytes)
    body, data = parse_body(raw, ChatCompletionRequest if kind is RequestKind.chat else CompletionRequest)
    check_supported(kind, data)
    messages = chat_messages(body) if kind is RequestKind.chat else None
    return await prepare_parsed(state, http_request, body, messages, resume=resume)


async def prepare_parsed(state: BridgeState, http_request: Request, body: Body, messages: list[ChatMessage] | None,
                         *, resume: EventId | None = None, request_id: str | None = None) -> Prepared:
    """:func:`prepare` from a validated ``body`` on: model check, tokenizing,
    output cap, deadline, the request record. ``messages`` (chat bodies) are
    the conversation as :class:`ChatMessage` records; ``request_id``
    overrides the generated id (ignored when resuming).

    Raises:
        BridgeError: as :func:`prepare`, but for the body's own validation.
    """
    kind = RequestKind.chat if messages is not None else RequestKind.completion
    model, lora_name = body.model, None
    if state.registry.model_state(model) is not ModelState.serving and state.registry.lora_base(model) is None:
        if state.refresh_workers is not None:
            await state.refresh_workers(model)  # a worker may have just started
    base = state.registry.lora_base(model)
    if base is not None:  # `model` names a LoRA adapter: run its base model with it
        model, lora_name = base, body.model
    limit = state.settings.max_prompt_tokens
    spec = _tokenizer_spec(state, model)
    embeds, media = None, None
    refs = media_refs(body) if isinstance(body, ChatCompletionRequest) and messages is not None else []
    if refs:
        token_ids, media = await _place_media(state, model, spec, messages, refs)
        echo_text, isl = "", len(token_ids)
    elif isinstance(body, CompletionRequest) and body.prompt_embeds is not None:
        if body.echo:
            raise invalid_request("`echo` is not supported with prompt_embeds.", param="echo", code="unsupported")
        embeds = decode_prompt_embeds(body.prompt_embeds, limit)
        token_ids, echo_text, isl = None, "", embeds.seq_len
    else:
        token_ids, echo_text = await _tokenize(body, messages, await _load_tokenizer(state, spec), state, spec)
        isl = len(token_ids)
    prompt_param = "messages" if messages is not None else "prompt"
    if isl > limit:
        raise payload_too_large(f"The prompt has {isl} tokens; the limit is {limit}.", param=prompt_param)
    if not isl:
        raise invalid_request("The prompt is empty.", param="prompt")
    max_tokens = output_budget(body, isl, max_output_tokens=state.settings.max_output_tokens,
                               context_length=state.registry.context_length(model), prompt_param=prompt_param)
    timeout_s = timeout_for(state.settings, http_request.headers, body, max_tokens)
    reply_to = state.source.reply_to
    if resume is None:
        request_id, created_ms = request_id or _ID_PREFIX[kind] + uuid.uuid4().hex, now_ms()
    else:
        request_id, created_ms = resume.request_id, resume.created_ms
        reply_to = ReplyTo(topic=reply_to.topic, partition=resume.partition)
    served_as = serving_class(http_request.headers, body.priority if "priority" in body.model_fields_set else None,
                              body.session_id)
    request = to_inference_request(body, request_id=request_id, reply_to=reply_to,
                                   token_ids=token_ids, created_ms=created_ms,
                                   timeout_s=timeout_s, messages=messages,
                                   max_tokens=max_tokens, prompt_embeds=embeds, priority=served_as.priority,
                                   tenant=served_as.tenant, session_id=served_as.session_id, media=media)
    if lora_name is not None:
        request = request.model_copy(update={"model": model, "lora_name": lora_name})
    return Prepared(body, request, ResponseMeta(id=request_id, model=body.model, created=created_ms // 1000),
                    echo_text)


async def next_record(events: Events, state: BridgeState, request_id: str) -> TokenDelta | FinalResponse:
    """The next response record, with transport failures as :class:`BridgeError`."""
    try:
        return await events.__anext__()
    except RequestTimeout:
        raise request_timeout(request_id, state.settings.request_timeout_s) from None
    except StreamNotFound:
        raise BridgeError(404, f"No stream of request {request_id} at the position {LAST_EVENT_ID} names.",
                          "invalid_request_error", code="stream_not_found", param=LAST_EVENT_ID) from None
    except StopAsyncIteration:
        raise BridgeError(502, f"The response stream of {request_id} ended without a final record.",
                          "server_error", code="incomplete_response") from None
    except MessageSizeTooLargeError:
        # The request record exceeds the Kafka message size limit: retrying cannot help, so not a 503.
        raise payload_too_large(f"Request {request_id} is too large for one Kafka record; send a shorter "
                                "prompt (or lower KVFLOW_MAX_PROMPT_TOKENS).") from None
    except KafkaError as exc:
        raise broker_unavailable(exc, state.retry_after_s) from None


def _outcome(observer: RequestObserver, stream_error: BridgeError | None) -> tuple[int, str | None]:
    """HTTP status and error code of a finished stream."""
    if stream_error is not None:
        return stream_error.status, stream_error.code
    final = observer.final
    if final is not None and final.error is not None:
        return from_error_info(final.error).status, final.error.code
    return 200, None


async def _close(*gens: Any) -> None:
    for gen in gens:
        with contextlib.suppress(Exception):
            await gen.aclose()


async def _wait_records(state: BridgeState, p: Prepared, events: Events,
                        observer: RequestObserver) -> TokenDelta | FinalResponse:
    """The first record (streaming) or the final record (otherwise), observing each."""
    record = await next_record(events, state, p.request.request_id)
    observer.on_event(record)
    while not p.body.stream and not isinstance(record, FinalResponse):
        record = await next_record(events, state, p.request.request_id)
        observer.on_event(record)
    return record


def _first_event_id(p: Prepared, events: Events, resume: EventId | None) -> EventId | None:
    """The id of event 0 of this stream (None: the source cannot place its records)."""
    if resume is not None:
        return resume.at(0)
    first_offset = getattr(events, "first_offset", None)
    if first_offset is None:
        return None
    return EventId(p.request.request_id, 0, p.request.reply_to.partition, first_offset, p.request.created_ms)


def _stream(state: BridgeState, p: Prepared, first: TokenDelta | FinalResponse, events: Events,
            observer: RequestObserver, *, attachment: Attachment, resume: EventId | None = None) -> Response:
    stream_error: list[BridgeError] = []

    async def records() -> Events:
        record = first
        yield record
        while not isinstance(record, FinalResponse):
            try:
                record = await next_record(events, state, p.request.request_id)
            except BridgeError as err:
                stream_error.append(err)
                raise
            observer.on_event(record)
            yield record

    include_usage = bool(p.body.stream_options and p.body.stream_options.include_usage)
    recs = records()
    if isinstance(p.body, ChatCompletionRequest):
        sse = chat_sse(p.meta, recs, include_usage)
    else:
        sse = completion_sse(p.meta, recs, include_usage, p.echo_text)
    numbered = with_ids(sse, _first_event_id(p, events, resume), 0 if resume is None else resume.seq + 1)

    async def body() -> AsyncIterator[bytes]:
        async for chunk in numbered:
            yield chunk
        observer.finish(*_outcome(observer, stream_error[0] if stream_error else None))

    stream_body = body()
    rid = p.request.request_id

    async def on_close() -> None:
        # Runs after completion, a disconnect, or a resumed stream taking
        # over: releases the response-source subscription; an unfinished
        # stream counts as 499 and, unless it failed on the pipeline's side
        # or is read by another stream, is cancelled upstream once the
        # resume grace has passed.
        await _close(stream_body, numbered, sse, recs, events)
        state.attachments.detach(attachment)
        observer.finish(STATUS_CLIENT_CLOSED)
        if observer.final is None and not stream_error and state.cancel is not None:
            await state.attachments.cancel_later(rid, functools.partial(
                cancel_upstream, state.cancel, state.metrics, observer.endpoint, rid))

    response = EventStreamResponse(stream_body, on_close, headers={"X-Request-Id": rid})
    attachment.close = response.close
    return response


def _resume_id(http_request: Request, kind: RequestKind) -> EventId | None:
    """The event a resuming client names in ``Last-Event-ID`` (None: not a resume).

    Raises:
        BridgeError: 400 when the header is not an event id of this endpoint.
    """
    raw = http_request.headers.get(LAST_EVENT_ID)
    if raw is None:
        return None
    try:
        event_id = EventId.parse(raw)
    except ValueError as exc:
        raise invalid_request(str(exc), param=LAST_EVENT_ID, code="invalid_value") from None
    if not event_id.request_id.startswith(_ID_PREFIX[kind]):
        raise invalid_request(f"{LAST_EVENT_ID} names a request of another endpoint ({event_id.request_id}).",
                              param=LAST_EVENT_ID, code="invalid_value")
    return event_id


def _open(state: BridgeState, p: Prepared, resume: EventId | None) -> Events:
    """The response records of ``p.request``: sent now, or replayed from ``resume``.

    Raises:
        BridgeError: 400 resuming a request that does not stream, or through
            a source that cannot resume.
    """
    if resume is None:
        return state.source.stream(p.request)
    if not p.body.stream:
        raise invalid_request(f"Only streamed answers can be resumed ({LAST_EVENT_ID} with stream: false).",
                              param="stream", code="unsupported")
    resume_from = getattr(state.source, "resume", None)
    if resume_from is None:
        raise invalid_request("This bridge cannot resume streams.", param=LAST_EVENT_ID, code="unsupported")
    return resume_from(p.request, StreamCursor(p.request.request_id, resume.partition, resume.first_offset))


async def serve(state: BridgeState, http_request: Request, kind: RequestKind) -> Response:
    """Answer one inference request: JSON object, SSE stream, or OpenAI error.

    The request's trace (:mod:`kvflow.streams.tracing`) starts here: its
    span is current while the request record is sent (so the record carries
    its ``traceparent``), ends when the answer is complete (a stream: at its
    last event), and its trace id is returned in the ``X-Trace-Id`` header.

    Never raises for client mistakes; unexpected exceptions propagate to the
    app's last-resort handler (500).
    """
    span = tracer().start_span(f"bridge {ENDPOINTS[kind]}")  # under the HTTP server's span, if it makes one
    with trace.use_span(span, end_on_exit=False, record_exception=False):
        response = await _serve(state, http_request, kind, span)
    trace_id = trace_id_hex(span)
    if trace_id is not None:
        response.headers[TRACE_ID_HEADER] = trace_id
    return response


async def _serve(state: BridgeState, http_request: Request, kind: RequestKind, span: trace.Span) -> Response:
    def finished() -> None:
        release(state)
        span.end()

    if not admit(state):
        observer = RequestObserver(state.metrics, ENDPOINTS[kind], state.publish_metrics, on_finish=span.end)
        observer.finish(503, "overloaded")
        return error_response(overloaded(1.0))
    observer = RequestObserver(state.metrics, ENDPOINTS[kind], state.publish_metrics, on_finish=finished)
    events: Events | None = None
    request_id = ""
    attachment: Attachment | None = None
    try:
        resume = _resume_id(http_request, kind)
        observer.replay = resume is not None
        p = await prepare(state, http_request, kind, resume)
        request_id = p.request.request_id
        span.set_attribute("kvflow.request_id", request_id)
        span.set_attribute("gen_ai.request.model", p.body.model)
        embeds = p.request.prompt_embeds
        observer.submitted(request_id, p.body.model, embeds.seq_len if embeds else len(p.request.token_ids or ()))
        if resume is not None and p.body.stream:
            # One reader per request on this bridge: streams of it still attached stop now.
            attachment = state.attachments.attach(request_id)
            state.attachments.supersede(attachment)
        events = _open(state, p, resume)
        record = await unless_disconnected(http_request, _wait_records(state, p, events, observer))
        if isinstance(record, FinalResponse) and record.error is not None and resume is None:
            raise from_error_info(record.error)
        if p.body.stream:
            attachment = attachment or state.attachments.attach(request_id)
            return _stream(state, p, record, events, observer, attachment=attachment, resume=resume)
        assert isinstance(record, FinalResponse)
        await _close(events)
        obj = chat_completion(record, p.meta) if kind is RequestKind.chat else text_completion(record, p.meta, p.echo_text)
        observer.finish(200)
        return Response(obj.model_dump_json(), media_type="application/json", headers={"X-Request-Id": request_id})
    except ClientDisconnected:
        # Nobody reads the answer: stop waiting, and stop the worker (once:
        # this path returns before a stream, whose on_close would cancel, exists).
        # A client resuming a stream may come back again: its cancel waits for that.
        observer.finish(STATUS_CLIENT_CLOSED)
        await _close(events)
        cancel = functools.partial(cancel_upstream, state.cancel, state.metrics, observer.endpoint, request_id)
        if attachment is not None:
            state.attachments.detach(attachment)
            if state.cancel is not None:
                await state.attachments.cancel_later(request_id, cancel)
        elif request_id:
            await cancel()
        return Response(status_code=STATUS_CLIENT_CLOSED)
    except BridgeError as err:
        observer.finish(err.status, err.code)
        if attachment is not None:
            state.attachments.detach(attachment)
        if events is not None:
            await _close(events)
        response = error_response(err)
        if request_id:
            response.headers["X-Request-Id"] = request_id
        return response
    except BaseException:
        observer.finish(500)
        if attachment is not None:
            state.attachments.detach(attachment)
        if events is not None:
            await _close(events)
        raise
