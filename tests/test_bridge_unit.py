"""Unit tests of the HTTP bridge's layers that need no Kafka.

What runs for real here: request parsing and validation, the OpenAI error
bodies, the body → :class:`InferenceRequest` mapping with the real byte
tokenizer, SSE/JSON response shaping (checked against the ``openai``
package's own response models), the live-worker projection, metrics, and
the FastAPI app (TestClient, or uvicorn for the disconnect test).

The response source is replaced by ``ScriptedSource``, which answers each
request with records computed from it. Those tests check the bridge's HTTP
shaping only; the pipeline through a real broker is tested end to end
elsewhere.
"""

from __future__ import annotations

import asyncio
import json

import httpx
import openai
import pytest
from deployment import serve_app
from fastapi.testclient import TestClient
from openai.types import Completion
from openai.types.chat import ChatCompletion, ChatCompletionChunk

from kvflow.models.tokenizer import ByteTokenizer
from kvflow.schemas import (
    ChatMessage,
    ErrorInfo,
    FinalResponse,
    FinishReason,
    InferenceRequest,
    ReplyTo,
    RequestKind,
    RequestMetrics,
    RoutingDecision,
    TokenDelta,
    Usage,
    WorkerHeartbeat,
    WorkerStatus,
    decode,
    encode,
)
from kvflow.schemas.openai import ChatCompletionRequest, CompletionRequest
from kvflow.settings import Settings
from kvflow.streams.bridge import build_app_for_state
from kvflow.streams.bridge.errors import BridgeError, request_timeout
from kvflow.streams.bridge.metrics import BridgeMetrics, RequestObserver
from kvflow.streams.bridge.openai_format import (
    ResponseMeta,
    chat_completion,
    chat_messages,
    check_supported,
    chat_text_chunk,
    completion_text_chunk,
    sampling_params,
    to_inference_request,
)
from kvflow.streams.bridge.sse import DONE, chat_sse, completion_sse, sse_event, text_events
from kvflow.streams.bridge.state import BridgeState
from kvflow.streams.bridge.worker_registry import ModelState, WorkerRegistry
from kvflow.streams.client import RequestTimeout

MODEL = "tiny-model"
REPLY_TO = ReplyTo(topic="ns.responses", partition=3)
NOW_MS = 1_700_000_000_000


def heartbeat(worker_id: str = "w0", model: str = MODEL, ts_ms: int = NOW_MS, **kw) -> WorkerHeartbeat:
    """A heartbeat record as a worker would publish it."""
    fields = dict(worker_id=worker_id, model=model, engine="mocker", tokenizer="bytes", block_size=16,
                  kv_total_blocks=100, queue_topic="ns.queue.aggregated", queue_partition=0, ts_ms=ts_ms,
                  ttl_ms=5000)
    fields.update(kw)
    return WorkerHeartbeat(**fields)


class Clock:
    """A settable epoch-ms clock for the registry."""

    def __init__(self, ms: int = NOW_MS) -> None:
        self.ms = ms

    def __call__(self) -> int:
        return self.ms


def routing(worker_id: str = "w0") -> RoutingDecision:
    return RoutingDecision(worker_id=worker_id, policy="kv", overlap_blocks=3, cost=1.5, router_id="r0")


class ScriptedSource:
    """Answers each request with deltas spelling ``reply``, then a final record.

    ``mode``: "ok" normal; "error" a final record carrying an ErrorInfo;
    "timeout" raises RequestTimeout like KvflowClient. ``delay_s`` between
    records. Keeps every request it was sent and counts closed streams.
    """

    def __init__(self, reply: str = "Hi there", mode: str = "ok", delay_s: float = 0.0,
                 error: ErrorInfo | None = None) -> None:
        self.reply, self.mode, self.delay_s, self.error = reply, mode, delay_s, error
        self.requests: list[InferenceRequest] = []
        self.closed = 0
        self.tokenizer = ByteTokenizer()

    @property
    def reply_to(self) -> ReplyTo:
        return REPLY_TO

    async def stream(self, request: InferenceRequest):
        self.requests.append(request)
        try:
            if self.mode == "timeout":
                raise RequestTimeout(request.request_id)
            if self.mode == "error":
                yield FinalResponse(request_id=request.request_id, finish_reason=FinishReason.error,
                                    error=self.error, worker_id="w0")
                return
            ids = self.tokenizer.encode_prompt(self.reply)
            for i, ch in enumerate(self.reply):
                await asyncio.sleep(self.delay_s)
                yield TokenDelta(request_id=request.request_id, index=i, token_ids=self.tokenizer.encode_prompt(ch),
                                 text=ch, worker_id="w0")
            yield FinalResponse(
                request_id=request.request_id, text=self.reply, token_ids=ids, finish_reason=FinishReason.length,
                usage=Usage(prompt_tokens=len(request.token_ids or []), completion_tokens=len(ids), cached_tokens=32),
                worker_id="w0", routing=routing(),
            )
        finally:
            self.closed += 1


def make_state(source=None, *, workers=(heartbeat(),), clock=None, published=None, **settings_kw) -> BridgeState:
    registry = WorkerRegistry(clock=clock or Clock())
    for hb in workers:
        registry.apply(hb)
    return BridgeState(settings=Settings(**settings_kw), source=source or ScriptedSource(), registry=registry,
                       publish_metrics=published.append if published is not None else None)


def client_for(state: BridgeState) -> TestClient:
    return TestClient(build_app_for_state(state), raise_server_exceptions=False)


def chat_body(**kw) -> dict:
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Hello"}]}
    body.update(kw)
    return body


def sse_payloads(raw: bytes) -> list:
    """Split an SSE body into its data payloads (``[DONE]`` kept as a string)."""
    events = [e for e in raw.split(b"\n\n") if e]
    assert all(e.startswith(b"data: ") for e in events), raw
    return [e[6:].decode() if e == DONE.strip() else json.loads(e[6:]) for e in events]


async def collect(agen) -> bytes:
    return b"".join([chunk async for chunk in agen])


async def records(*items):
    for item in items:
        if isinstance(item, Exception):
            raise item
        yield item


# ---------------------------------------------------------------- request mapping


def test_chat_body_maps_to_inference_request():
    body = ChatCompletionRequest.model_validate(chat_body(
        max_tokens=10, max_completion_tokens=7, temperature=0.0, top_p=0.5, seed=42, stop="\n\n", priority=2,
        messages=[{"role": "system", "content": "Be brief."},
                  {"role": "user", "content": [{"type": "text", "text": "Hel"}, {"type": "text", "text": "lo"}]}]))
    messages = chat_messages(body)
    assert messages == [ChatMessage(role="system", content="Be brief."), ChatMessage(role="user", content="Hello")]
    ids = ByteTokenizer().encode_chat(messages)
    req = to_inference_request(body, request_id="chatcmpl-1", reply_to=REPLY_TO, token_ids=ids,
                               created_ms=NOW_MS, timeout_s=30, messages=messages)
    assert req.kind is RequestKind.chat and req.messages == messages and req.prompt is None
    assert req.token_ids == ids and req.reply_to == REPLY_TO and req.priority == 2
    assert req.deadline_ms == NOW_MS + 30_000
    s = req.sampling
    assert (s.max_tokens, s.temperature, s.top_p, s.seed, s.stop) == (7, 0.0, 0.5, 42, ["\n\n"])


def test_completion_body_with_token_prompt_maps_to_token_ids_only():
    body = CompletionRequest.model_validate({"model": MODEL, "prompt": [5, 6, 7], "max_tokens": 3,
                                             "stop": ["a", "b"], "ignore_eos": True})
    req = to_inference_request(body, request_id="cmpl-1", reply_to=REPLY_TO, token_ids=[5, 6, 7],
                               created_ms=NOW_MS, timeout_s=1)
    assert req.kind is RequestKind.completion and req.prompt is None and req.messages is None
    assert req.token_ids == [5, 6, 7]
    assert (req.sampling.max_tokens, req.sampling.stop, req.sampling.ignore_eos) == (3, ["a", "b"], True)


def test_sampling_defaults_when_no_max_tokens_given():
    body = CompletionRequest.model_validate({"model": MODEL, "prompt": "x"})
    params = sampling_params(body)
    assert params.max_tokens == type(params)().max_tokens
    assert params.stop == [] and params.temperature == 1.0


def test_unknown_content_part_is_rejected_with_400_and_media_parts_leave_a_marker():
    body = ChatCompletionRequest.model_validate(chat_body(messages=[
        {"role": "user", "content": [{"type": "file", "file": {"file_id": "f"}}]}]))
    with pytest.raises(BridgeError) as exc:
        chat_messages(body)
    assert exc.value.status == 400 and exc.value.param == "messages.0.content"
    body = ChatCompletionRequest.model_validate(chat_body(messages=[
        {"role": "user", "content": [{"type": "text", "text": "What is this? "},
                                     {"type": "image_url", "image_url": {"url": "http://x/y.png"}}]}]))
    assert chat_messages(body)[0].content == "What is this? \ufffc"


@pytest.mark.parametrize("kind,raw,rejected", [
    (RequestKind.chat, {"tools": [{"type": "function"}]}, "tools"),
    (RequestKind.chat, {"logprobs": True}, "logprobs"),
    (RequestKind.chat, {"response_format": {"type": "json_object"}}, "response_format"),
    (RequestKind.completion, {"best_of": 3}, "best_of"),
    (RequestKind.chat, {"tools": [], "logprobs": False, "response_format": {"type": "text"}}, None),
    (RequestKind.completion, {"best_of": 1, "logprobs": None, "suffix": ""}, None),
])
def test_unsupported_features_are_rejected_and_defaults_pass(kind, raw, rejected):
    if rejected is None:
        check_supported(kind, raw)
        return
    with pytest.raises(BridgeError) as exc:
        check_supported(kind, raw)
    assert exc.value.status == 400 and exc.value.param == rejected


# ---------------------------------------------------------------- response shaping


META = ResponseMeta(id="chatcmpl-abc", model=MODEL, created=NOW_MS // 1000)


def final(text: str = "Hi", **kw) -> FinalResponse:
    fields = dict(request_id="r", text=text, finish_reason=FinishReason.stop, worker_id="w0", routing=routing(),
                  usage=Usage(prompt_tokens=10, completion_tokens=2, cached_tokens=4))
    fields.update(kw)
    return FinalResponse(**fields)


async def test_chat_sse_chunks_follow_openai_stream_shape():
    raw = await collect(chat_sse(META, records(
        TokenDelta(request_id="r", index=0, token_ids=[1], text="H"),
        TokenDelta(request_id="r", index=1, token_ids=[2], text=""),  # incomplete UTF-8: no chunk
        TokenDelta(request_id="r", index=2, token_ids=[3], text="i"),
        final(),
    ), include_usage=True))
    payloads = sse_payloads(raw)
    assert payloads[-1] == "[DONE]"
    chunks = [ChatCompletionChunk.model_validate(p) for p in payloads[:-1]]
    assert chunks[0].choices[0].delta.role == "assistant"
    assert [c.choices[0].delta.content for c in chunks[1:3]] == ["H", "i"]
    finish = payloads[3]
    assert finish["choices"][0]["finish_reason"] == "stop" and finish["choices"][0]["delta"] == {}
    assert finish["kvflow"] == {"worker_id": "w0", "policy": "kv", "overlap_blocks": 3, "cost": 1.5,
                                "router_id": "r0"}
    assert chunks[4].choices == [] and chunks[4].usage.prompt_tokens_details.cached_tokens == 4
    assert chunks[4].usage.total_tokens == 12 and len(chunks) == 5
    assert all(c.id == META.id and c.object == "chat.completion.chunk" for c in chunks)


@pytest.mark.parametrize("chunk", [chat_text_chunk, completion_text_chunk])
@pytest.mark.parametrize("text", ["Hello", " wörld ✓", 'quote " back\\slash', "line\nfeed\ttab\x01", "\u2028", ""])
def test_spliced_text_events_are_the_bytes_of_the_dumped_chunk(chunk, text):
    meta = ResponseMeta(id="chatcmpl-1", model="org/model-\u00e9", created=123)
    assert text_events(lambda t: chunk(meta, t))(text) == sse_event(chunk(meta, text))


async def test_sse_without_include_usage_has_no_usage_chunk():
    payloads = sse_payloads(await collect(chat_sse(META, records(final()))))
    assert len(payloads) == 3 and all("usage" not in p for p in payloads[:-1])


async def test_sse_errors_after_start_become_error_events():
    err_final = final(finish_reason=FinishReason.error, error=ErrorInfo(message="engine OOM", status=500))
    payloads = sse_payloads(await collect(chat_sse(META, records(
        TokenDelta(request_id="r", index=0, token_ids=[1], text="H"), err_final))))
    assert payloads[-2] == {"error": {"message": "engine OOM", "type": "server_error", "param": None, "code": None}}
    assert payloads[-1] == "[DONE]"
    payloads = sse_payloads(await collect(completion_sse(META, records(request_timeout("r", 5.0)))))
    assert payloads[0]["error"]["code"] == "request_timeout" and payloads[-1] == "[DONE]"


async def test_completion_sse_echoes_prompt_first():
    payloads = sse_payloads(await collect(completion_sse(META, records(
        TokenDelta(request_id="r", index=0, token_ids=[1], text=" world"), final()), echo_text="Hello")))
    texts = [p["choices"][0]["text"] for p in payloads[:-1]]
    assert texts == ["Hello", " world", ""]
    assert [p["choices"][0]["finish_reason"] for p in payloads[:-1]] == [None, None, "stop"]
    # openai's Completion type (non-null finish_reason) fits the finishing chunk.
    assert Completion.model_validate(payloads[2]).object == "text_completion"


def test_chat_completion_object_validates_as_openai():
    obj = ChatCompletion.model_validate_json(chat_completion(final("Hello!"), META).model_dump_json())
    assert obj.choices[0].message.content == "Hello!" and obj.choices[0].finish_reason == "stop"
    assert obj.usage.prompt_tokens_details.cached_tokens == 4
    assert obj.model_extra["kvflow"]["worker_id"] == "w0"


# ---------------------------------------------------------------- worker projection


def test_registry_tracks_models_expiry_and_tokenizer():
    clock = Clock()
    reg = WorkerRegistry(clock=clock)
    reg.apply(heartbeat("w1", tokenizer="/models/tiny"))
    reg.apply(heartbeat("w2", model="other", ts_ms=NOW_MS + 1000))
    assert reg.models() == sorted([MODEL, "other"])
    assert reg.tokenizer_spec(MODEL) == "/models/tiny" and reg.tokenizer_spec("nope") is None
    assert reg.model_state("nope") is ModelState.unknown
    reg.apply(heartbeat("w1", ts_ms=NOW_MS - 10, tokenizer="stale"))  # older: ignored
    assert reg.tokenizer_spec(MODEL) == "/models/tiny"
    clock.ms = NOW_MS + 5001  # w1's TTL passed, w2's not
    assert reg.models() == ["other"]
    assert reg.model_state(MODEL) is ModelState.unavailable and reg.tokenizer_spec(MODEL) is None
    reg.apply(heartbeat("w2", model="other", ts_ms=NOW_MS + 2000, status=WorkerStatus.stopped))
    assert reg.live_workers() == [] and reg.model_state("other") is ModelState.unavailable


def test_registry_context_length_is_the_smallest_live_one():
    clock = Clock()
    reg = WorkerRegistry(clock=clock)
    assert reg.context_length(MODEL) is None
    reg.apply(heartbeat("w1", context_length=8192))
    reg.apply(heartbeat("w2", context_length=4096, ts_ms=NOW_MS + 3000))
    reg.apply(heartbeat("w3"))  # advertises none: does not lower the bound
    reg.apply(heartbeat("w4", model="other", context_length=100))
    assert reg.context_length(MODEL) == 4096 and reg.context_length("other") == 100
    reg.apply(heartbeat("w2", context_length=None, ts_ms=NOW_MS + 3001))  # stopped advertising it
    assert reg.context_length(MODEL) == 8192
    reg.apply(heartbeat("w2", context_length=2048, ts_ms=NOW_MS + 3002))
    clock.ms = NOW_MS + 5001  # w1, w3 and w4 expired
    assert reg.context_length(MODEL) == 2048 and reg.context_length("other") is None
    assert [w.worker_id for w in reg.live_workers()] == ["w2"]


def test_heartbeat_without_context_length_decodes_as_unknown():
    old = heartbeat().model_dump(exclude={"context_length"})
    assert decode(WorkerHeartbeat, json.dumps(old)).context_length is None
    hb = heartbeat(context_length=8192)
    assert decode(WorkerHeartbeat, encode(hb)).context_length == 8192


def test_draining_worker_does_not_count_as_serving():
    reg = WorkerRegistry(clock=Clock())
    reg.apply(heartbeat("w1", status=WorkerStatus.draining))
    assert reg.models() == [] and reg.model_state(MODEL) is ModelState.unavailable


# ---------------------------------------------------------------- metrics


class StepClock:
    """Monotonic seconds advanced by hand."""

    def __init__(self) -> None:
        self.s = 100.0

    def __call__(self) -> float:
        return self.s


def test_observer_times_ttft_itl_and_publishes_request_metrics():
    metrics, clock, published = BridgeMetrics(), StepClock(), []
    obs = RequestObserver(metrics, "chat", published.append, clock=clock)
    assert metrics.registry.get_sample_value("kvflow_bridge_requests_in_flight", {"endpoint": "chat"}) == 1
    obs.submitted("chatcmpl-1", MODEL, isl=50)
    clock.s += 0.2
    obs.on_event(TokenDelta(request_id="r", index=0, token_ids=[1], text="a"))
    clock.s += 0.05
    obs.on_event(TokenDelta(request_id="r", index=1, token_ids=[2, 3], text="bc"))  # 2 tokens in 50 ms
    clock.s += 0.01
    obs.on_event(final(usage=Usage(prompt_tokens=50, completion_tokens=3, cached_tokens=16)))
    obs.finish(200)
    obs.finish(499)  # ignored: already finished
    (rec,) = published
    assert isinstance(rec, RequestMetrics)
    assert (rec.request_id, rec.model, rec.worker_id, rec.isl, rec.osl, rec.cached_tokens, rec.ok) == \
        ("chatcmpl-1", MODEL, "w0", 50, 3, 16, True)
    assert rec.ttft_ms == pytest.approx(200.0)
    assert rec.itl_ms == pytest.approx(25.0)  # 50 ms decode span / 2 tokens after the first
    assert rec.e2e_ms == pytest.approx(260.0)
    get = metrics.registry.get_sample_value
    assert get("kvflow_bridge_requests_in_flight", {"endpoint": "chat"}) == 0
    assert get("kvflow_bridge_requests_total", {"endpoint": "chat", "status": "200"}) == 1
    assert get("kvflow_bridge_requests_total", {"endpoint": "chat", "status": "499"}) is None
    assert get("kvflow_bridge_itl_seconds_count", {"model": MODEL}) == 2
    assert get("kvflow_bridge_itl_seconds_sum", {"model": MODEL}) == pytest.approx(0.05)
    assert get("kvflow_bridge_ttft_seconds_sum", {"model": MODEL}) == pytest.approx(0.2)
    assert get("kvflow_bridge_osl_tokens_sum", {"model": MODEL}) == 3


def test_observer_does_not_publish_requests_rejected_before_the_pipeline():
    metrics, published = BridgeMetrics(), []
    RequestObserver(metrics, "completions", published.append).finish(400)
    assert published == []
    assert metrics.registry.get_sample_value(
        "kvflow_bridge_requests_total", {"endpoint": "completions", "status": "400"}) == 1


# ---------------------------------------------------------------- HTTP errors


def assert_openai_error(resp: httpx.Response, status: int, code: str | None = None) -> dict:
    assert resp.status_code == status, resp.text
    body = resp.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}
    assert body["error"]["message"]
    if code is not None:
        assert body["error"]["code"] == code
    return body["error"]


def test_bad_json_and_schema_violations_are_400_not_422():
    source = ScriptedSource()
    with client_for(make_state(source)) as c:
        err = assert_openai_error(c.post("/v1/chat/completions", content=b"{not json",
                                         headers={"content-type": "application/json"}), 400, "invalid_json")
        assert err["type"] == "invalid_request_error"
        assert_openai_error(c.post("/v1/chat/completions", content=b"[1, 2]"), 400, "invalid_json")
        err = assert_openai_error(c.post("/v1/chat/completions", json={"model": MODEL}), 400)
        assert err["param"] == "messages"
        err = assert_openai_error(c.post("/v1/chat/completions", json=chat_body(temperature=3)), 400)
        assert err["param"] == "temperature"
        err = assert_openai_error(c.post("/v1/chat/completions", json=chat_body(n=2)), 400, "unsupported")
        assert "n=1" in err["message"]
        assert_openai_error(c.post("/v1/chat/completions", json=chat_body(messages=[
            {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}])), 400, "unsupported")
        assert_openai_error(c.post("/v1/completions", json={"model": MODEL, "prompt": [1, 99999]}), 400)
        assert_openai_error(c.post("/v1/completions", json={"model": MODEL, "prompt": ""}), 400)
        assert_openai_error(c.get("/v1/nothing-here"), 404)
        assert_openai_error(c.get("/v1/chat/completions"), 405)
    assert source.requests == []


def test_unknown_model_404_and_no_live_worker_503():
    clock = Clock()
    source = ScriptedSource()
    state = make_state(source, clock=clock, worker_ttl_ms=3000)
    with client_for(state) as c:
        err = assert_openai_error(c.post("/v1/chat/completions", json=chat_body(model="gpt-9")), 404,
                                  "model_not_found")
        assert err["param"] == "model"
        clock.ms = NOW_MS + 60_000  # the only worker stopped heartbeating long ago
        resp = c.post("/v1/completions", json={"model": MODEL, "prompt": "hi"})
        assert_openai_error(resp, 503, "no_live_workers")
        assert resp.headers["retry-after"] == "3"
        assert c.get("/health").status_code == 503
        assert c.get("/v1/models").json() == {"object": "list", "data": []}
    assert source.requests == []


def test_a_model_scaled_to_zero_is_sent_on_when_the_router_holds_requests_for_a_cold_start():
    clock = Clock()
    source = ScriptedSource()
    state = make_state(source, clock=clock, worker_ttl_ms=3000, shed_mode="queue", shed_cold_start_hold_s=60)
    with client_for(state) as c:
        clock.ms = NOW_MS + 60_000  # its last worker is gone: the pool is at zero
        assert c.post("/v1/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": 1}).status_code == 200
        # tokenized as its workers advertised; an unknown model is still 404
        assert len(source.requests) == 1 and source.requests[0].token_ids
        assert_openai_error(c.post("/v1/chat/completions", json=chat_body(model="gpt-9")), 404, "model_not_found")


def test_prompt_and_body_size_limits_are_413():
    with client_for(make_state(max_prompt_tokens=20)) as c:
        err = assert_openai_error(c.post("/v1/completions", json={"model": MODEL, "prompt": "x" * 21}), 413)
        assert "21 tokens" in err["message"]
        assert c.post("/v1/completions", json={"model": MODEL, "prompt": "x" * 20, "max_tokens": 1}).status_code == 200
    state = make_state()
    state.max_body_bytes = 200
    with client_for(state) as c:
        assert_openai_error(c.post("/v1/chat/completions", json=chat_body(messages=[
            {"role": "user", "content": "y" * 300}])), 413, "payload_too_large")

        def chunked():
            yield json.dumps(chat_body(messages=[{"role": "user", "content": "z" * 300}])).encode()

        assert_openai_error(c.post("/v1/chat/completions", content=chunked()), 413)


def test_worker_error_and_timeout_statuses():
    err = ErrorInfo(message="prompt too long for this engine", type="invalid_request_error", code="ctx", status=400)
    with client_for(make_state(ScriptedSource(mode="error", error=err))) as c:
        body = assert_openai_error(c.post("/v1/chat/completions", json=chat_body()), 400, "ctx")
        assert body["message"] == "prompt too long for this engine"
        assert_openai_error(c.post("/v1/chat/completions", json=chat_body(stream=True)), 400, "ctx")
    with client_for(make_state(ScriptedSource(mode="timeout"), request_timeout_s=7)) as c:
        assert_openai_error(c.post("/v1/completions", json={"model": MODEL, "prompt": "a"}), 504, "request_timeout")


# ---------------------------------------------------------------- HTTP success shaping


def test_chat_request_is_pretokenized_and_answered_in_openai_shape():
    source, published = ScriptedSource("Hello!"), []
    state = make_state(source, published=published)
    with client_for(state) as c:
        resp = c.post("/v1/chat/completions", json=chat_body(max_completion_tokens=9, seed=3))
        assert resp.status_code == 200, resp.text
        obj = ChatCompletion.model_validate(resp.json())
    (req,) = source.requests
    messages = [ChatMessage(role="user", content="Hello")]
    assert req.token_ids == ByteTokenizer().encode_chat(messages) and req.messages == messages
    assert req.sampling.max_tokens == 9 and req.sampling.seed == 3 and req.reply_to == REPLY_TO
    assert obj.id == req.request_id == resp.headers["x-request-id"] and obj.id.startswith("chatcmpl-")
    assert obj.choices[0].message.content == "Hello!" and obj.choices[0].finish_reason == "length"
    assert obj.usage.prompt_tokens == len(req.token_ids) and obj.usage.prompt_tokens_details.cached_tokens == 32
    assert resp.json()["kvflow"]["overlap_blocks"] == 3
    (rec,) = published
    assert rec.request_id == req.request_id and rec.isl == len(req.token_ids) and rec.osl == 6 and rec.ok
    assert source.closed == 1


def test_streaming_through_the_openai_client():
    source = ScriptedSource("abc")
    with client_for(make_state(source)) as c:
        oai = openai.OpenAI(base_url=f"{c.base_url}/v1", api_key="unused", http_client=c, max_retries=0)
        chunks = list(oai.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}],
                                                  stream=True, stream_options={"include_usage": True}))
        assert chunks[0].choices[0].delta.role == "assistant"
        assert "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices) == "abc"
        assert [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1] == "length"
        assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 3
        completion = oai.completions.create(model=MODEL, prompt="Say", max_tokens=3, echo=True)
        assert completion.choices[0].text == "Sayabc" and completion.object == "text_completion"
        assert [m.id for m in oai.models.list()] == [MODEL]
        metrics = c.get("/metrics").text
    assert 'kvflow_bridge_requests_total{endpoint="chat",status="200"} 1.0' in metrics
    assert 'kvflow_bridge_requests_total{endpoint="completions",status="200"} 1.0' in metrics
    assert 'kvflow_bridge_requests_in_flight{endpoint="chat"} 0.0' in metrics
    assert source.requests[1].prompt == "Say" and source.requests[1].kind is RequestKind.completion


def test_health_live_and_models():
    with client_for(make_state(workers=[heartbeat("w1"), heartbeat("w2", model="zeta")])) as c:
        health = c.get("/health")
        assert health.status_code == 200
        assert health.json()["live_workers"] == 2 and health.json()["models"] == [MODEL, "zeta"]
        assert c.get("/live").status_code == 200
        cards = c.get("/v1/models").json()["data"]
        assert [(m["id"], m["object"], m["created"]) for m in cards] == [(MODEL, "model", NOW_MS // 1000),
                                                                          ("zeta", "model", NOW_MS // 1000)]
        assert c.get(f"/v1/models/{MODEL}").json()["id"] == MODEL
        assert_openai_error(c.get("/v1/models/zzz"), 404, "model_not_found")


# ---------------------------------------------------------------- disconnect


async def test_client_disconnect_stops_reading_the_stream():
    """Through a real uvicorn server: closing the HTTP stream closes the
    response-source iterator and counts the request as 499."""
    source, published = ScriptedSource("x" * 200, delay_s=0.02), []
    state = make_state(source, published=published)
    async with serve_app(build_app_for_state(state), lifespan="off") as url:
        async with httpx.AsyncClient(base_url=url) as http:
            async with http.stream("POST", "/v1/chat/completions", json=chat_body(stream=True)) as resp:
                assert resp.status_code == 200
                assert resp.headers["content-type"].startswith("text/event-stream")
                received = 0
                async for line in resp.aiter_lines():
                    received += line.startswith("data: ")
                    if received == 3:
                        break
        get = state.metrics.registry.get_sample_value
        for _ in range(200):
            if get("kvflow_bridge_requests_total", {"endpoint": "chat", "status": "499"}):
                break
            await asyncio.sleep(0.01)
        assert get("kvflow_bridge_requests_total", {"endpoint": "chat", "status": "499"}) == 1
        assert get("kvflow_bridge_requests_in_flight", {"endpoint": "chat"}) == 0
        assert source.closed == 1
        (rec,) = published
        assert not rec.ok and rec.osl < 200



def test_serving_class_from_body_headers_and_api_key():
    from starlette.datastructures import Headers

    from kvflow.streams.bridge.errors import BridgeError
    from kvflow.streams.bridge.serving_class import serving_class, tenant_of

    h = Headers({"Authorization": "Bearer sk-one", "X-Priority": "3", "X-Session-Id": "chat-9"})
    c = serving_class(h, None, None)
    assert (c.priority, c.session_id) == (3, "chat-9")
    assert c.tenant == tenant_of("sk-one") and c.tenant.startswith("t-") and "sk-one" not in c.tenant
    assert tenant_of("sk-one") != tenant_of("sk-two")
    body_wins = serving_class(h, 0, "mine")
    assert (body_wins.priority, body_wins.session_id) == (0, "mine")
    assert serving_class(Headers({}), None, None) == type(c)(0, None, None)
    for bad in ({"X-Priority": "high"}, {"X-Priority": str(2**31)}, {"X-Session-Id": "x" * 257}):
        with pytest.raises(BridgeError) as err:
            serving_class(Headers(bad), None, None)
        assert err.value.status == 400


def test_serving_class_reaches_the_request_record():
    body = ChatCompletionRequest.model_validate({"model": "m", "messages": [{"role": "user", "content": "hi"}],
                                                 "priority": 2, "session_id": "s1", "ttft_target_ms": 300,
                                                 "itl_target_ms": 20})
    req = to_inference_request(body, request_id="chatcmpl-1", reply_to=REPLY_TO, token_ids=[1, 2],
                               created_ms=1_000, timeout_s=10.0, messages=chat_messages(body), tenant="t-abc")
    assert (req.priority, req.session_id, req.tenant) == (2, "s1", "t-abc")
    assert (req.ttft_target_ms, req.itl_target_ms) == (300, 20)
    req = to_inference_request(body, request_id="chatcmpl-2", reply_to=REPLY_TO, token_ids=[1, 2],
                               created_ms=1_000, timeout_s=10.0, messages=chat_messages(body), priority=5,
                               session_id="s2")
    assert (req.priority, req.session_id, req.tenant) == (5, "s2", None)


def test_an_adapter_name_as_model_runs_its_base_model_with_the_adapter():
    source = ScriptedSource("Hello!")
    state = make_state(source, workers=(heartbeat("w0"), heartbeat("w1", lora_adapters=["sql"])))
    with client_for(state) as c:
        assert {m["id"] for m in c.get("/v1/models").json()["data"]} == {MODEL, "sql"}
        resp = c.post("/v1/chat/completions", json=chat_body(model="sql"))
        assert resp.status_code == 200, resp.text
        assert resp.json()["model"] == "sql"
        assert c.post("/v1/chat/completions", json=chat_body(model="nope")).status_code == 404
    (req,) = source.requests
    assert (req.model, req.lora_name) == (MODEL, "sql")
