"""The bridge's deadlines, outcome metrics, SSE event ids and resume path, without Kafka.

``LogSource`` stands in for the Kafka response source: it appends every
record it answers to one in-memory log (a responses partition) and replays
the log from a cursor, as :meth:`KvflowClient.resume` replays the topic.
The live Kafka path is tested in tests/test_resume.py.
"""

from __future__ import annotations

import asyncio
import json

import pytest
from fastapi.testclient import TestClient

from kvflow.schemas import (
    FinalResponse,
    FinishReason,
    InferenceRequest,
    ReplyTo,
    TokenDelta,
    Usage,
    deadline_exceeded,
)
from kvflow.settings import Settings
from kvflow.streams.bridge import build_app_for_state
from kvflow.streams.bridge.attachments import Attachments
from kvflow.streams.bridge.event_ids import EventId
from kvflow.streams.bridge.state import BridgeState
from kvflow.streams.bridge.worker_registry import WorkerRegistry
from kvflow.streams.client import ResponseStream, StreamCursor, StreamNotFound
from kvflow.streams.deadlines import default_timeout_s

from test_bridge_unit import MODEL, Clock, heartbeat

REPLY_TO = ReplyTo(topic="ns.responses", partition=3)


class LogSource:
    """Answers each request with one delta per character of ``reply`` then a final record
    (``deadline``: the final is a deadline error after ``deadline`` deltas, as the client answers)."""

    def __init__(self, reply: str = "Hello, world", deadline: int | None = None) -> None:
        self.reply, self.deadline = reply, deadline
        self.log: list[TokenDelta | FinalResponse] = [TokenDelta(request_id="other", index=0, token_ids=[1])]
        self.requests: list[InferenceRequest] = []

    @property
    def reply_to(self) -> ReplyTo:
        return REPLY_TO

    def records(self, request: InferenceRequest) -> list[TokenDelta | FinalResponse]:
        rid = request.request_id
        chars = self.reply if self.deadline is None else self.reply[:self.deadline]
        out: list = [TokenDelta(request_id=rid, index=i, token_ids=[ord(c)], text=c) for i, c in enumerate(chars)]
        if self.deadline is not None:
            return out + [FinalResponse(request_id=rid, finish_reason=FinishReason.error, text=chars,
                                        error=deadline_exceeded("late"))]
        return out + [FinalResponse(request_id=rid, finish_reason=FinishReason.stop, text=chars,
                                    token_ids=[ord(c) for c in chars],
                                    usage=Usage(prompt_tokens=5, completion_tokens=len(chars)))]

    def stream(self, request: InferenceRequest) -> ResponseStream:
        self.requests.append(request)
        handle = ResponseStream(request.request_id, REPLY_TO.partition)

        async def gen():
            for record in self.records(request):
                self.log.append(record)
                handle.seen(len(self.log) - 1)
                yield record

        handle.attach(gen())
        return handle

    def resume(self, request: InferenceRequest, cursor: StreamCursor) -> ResponseStream:
        self.requests.append(request)
        handle = ResponseStream(request.request_id, cursor.partition, skip=cursor.delivered)

        async def gen():
            found = [(i, r) for i, r in enumerate(self.log)
                     if r.request_id == request.request_id and i >= cursor.first_offset]
            if not found or found[0][0] != cursor.first_offset:
                raise StreamNotFound(request.request_id)
            for offset, record in found:
                handle.seen(offset)
                yield record

        handle.attach(gen())
        return handle


def make_client(source, **settings_kw) -> TestClient:
    registry = WorkerRegistry(clock=Clock())
    registry.apply(heartbeat())
    state = BridgeState(settings=Settings(**settings_kw), source=source, registry=registry)
    return TestClient(build_app_for_state(state), raise_server_exceptions=False)


def events(raw: bytes) -> list[tuple[str | None, str]]:
    """``(id or None, data)`` of each SSE event of ``raw``."""
    out = []
    for block in raw.decode().split("\n\n"):
        if not block:
            continue
        fields = dict(line.split(": ", 1) for line in block.split("\n"))
        out.append((fields.get("id"), fields["data"]))
    return out


def body(kind: str, **kw) -> dict:
    if kind == "chat":
        return {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "stream": True, **kw}
    return {"model": MODEL, "prompt": "Hi", "stream": True, **kw}


PATHS = {"chat": "/v1/chat/completions", "completions": "/v1/completions"}


@pytest.mark.parametrize("kind", ["chat", "completions"])
def test_stream_events_carry_ids_and_a_resume_replays_the_rest_exactly(kind):
    source = LogSource()
    with make_client(source) as c:
        full = c.post(PATHS[kind], json=body(kind, stream_options={"include_usage": True}))
        assert full.status_code == 200
        got = events(full.content)
        assert got[-1] == (None, "[DONE]")
        ids = [EventId.parse(i) for i, _ in got[:-1]]
        request = source.requests[0]
        assert [i.seq for i in ids] == list(range(len(ids)))
        assert {(i.request_id, i.partition, i.first_offset, i.created_ms) for i in ids} == {
            (request.request_id, 3, 1, request.created_ms)}  # offset 0 of the log is another request's
        for k in (0, 4, len(ids) - 2, len(ids) - 1):
            resumed = c.post(PATHS[kind], json=body(kind, stream_options={"include_usage": True}),
                             headers={"Last-Event-ID": str(ids[k])})
            assert resumed.status_code == 200, resumed.text
            assert events(resumed.content) == got[k + 1:], k
        again = source.requests[-1]
        assert again.request_id == request.request_id and again.deadline_ms == request.deadline_ms
        assert again.reply_to == request.reply_to
    assert len(source.log) == 1 + len(source.records(request))  # answered once, replayed after


def test_resume_errors():
    source = LogSource()
    with make_client(source) as c:
        got = events(c.post(PATHS["chat"], json=body("chat")).content)
        first = EventId.parse(got[0][0])
        for bad in ("nonsense", "chatcmpl-x:1:2:3", "chatcmpl-x:a:0:0:0", "chatcmpl-x:-1:0:0:0"):
            resp = c.post(PATHS["chat"], json=body("chat"), headers={"Last-Event-ID": bad})
            assert resp.status_code == 400 and resp.json()["error"]["param"] == "Last-Event-ID", bad
        resp = c.post(PATHS["completions"], json=body("completions"), headers={"Last-Event-ID": str(first)})
        assert resp.status_code == 400  # a chat stream's id on the completions endpoint
        resp = c.post(PATHS["chat"], json=body("chat", stream=False), headers={"Last-Event-ID": str(first)})
        assert resp.status_code == 400 and resp.json()["error"]["param"] == "stream"
        wrong = EventId(first.request_id, 0, first.partition, 0, first.created_ms)
        resp = c.post(PATHS["chat"], json=body("chat"), headers={"Last-Event-ID": str(wrong)})
        assert resp.status_code == 404 and resp.json()["error"]["code"] == "stream_not_found"


def test_request_deadline_from_body_header_or_default():
    source = LogSource()
    with make_client(source) as c:
        c.post(PATHS["chat"], json=body("chat", stream=False, max_tokens=10))
        c.post(PATHS["chat"], json=body("chat", stream=False, timeout_s=30), headers={"X-Request-Timeout": "2.5"})
        c.post(PATHS["chat"], json=body("chat", stream=False, timeout_s=1.5))
        for bad in ("soon", "0", "-3", "nan", "1e9"):
            resp = c.post(PATHS["chat"], json=body("chat"), headers={"X-Request-Timeout": bad})
            assert resp.status_code == 400 and resp.json()["error"]["param"] == "X-Request-Timeout", bad
        assert c.post(PATHS["chat"], json=body("chat", timeout_s=0)).status_code == 400
    a, b, d = source.requests
    assert a.deadline_ms - a.created_ms == round(default_timeout_s(Settings(), 10) * 1000) == 122_000
    assert b.deadline_ms - b.created_ms == 2500 and d.deadline_ms - d.created_ms == 1500


def outcome_counts(c: TestClient) -> dict[tuple[str, str], float]:
    out = {}
    for line in c.get("/metrics").text.splitlines():
        if line.startswith("kvflow_bridge_outcomes_total{"):
            labels = dict(kv.split("=") for kv in line[line.index("{") + 1:line.index("}")].split(","))
            key = (labels["outcome"].strip('"'), labels["reason"].strip('"'))
            out[key] = out.get(key, 0.0) + float(line.rsplit(" ", 1)[1])  # summed over endpoints
    return out


def test_deadline_answers_and_outcome_metrics():
    with make_client(LogSource(deadline=0)) as c:
        resp = c.post(PATHS["chat"], json=body("chat"))  # before the first token: a 504, not a stream
        assert resp.status_code == 504 and resp.json()["error"]["code"] == "deadline_exceeded"
        assert outcome_counts(c) == {("deadline", "before_first_token"): 1.0}
    with make_client(LogSource(deadline=3)) as c:
        got = events(c.post(PATHS["chat"], json=body("chat")).content)
        assert json.loads(got[-2][1])["error"]["code"] == "deadline_exceeded" and got[-1] == (None, "[DONE]")
        assert "".join(json.loads(d)["choices"][0]["delta"].get("content", "") for _, d in got[:-2]) == "Hel"
        c.post(PATHS["chat"], json=body("chat", stream=False, model="unknown"))
        assert outcome_counts(c) == {("deadline", "after_first_token"): 1.0, ("error", "model_not_found"): 1.0}
    with make_client(LogSource()) as c:
        c.post(PATHS["chat"], json=body("chat"))
        c.post(PATHS["completions"], json=body("completions", stream=False))
        assert outcome_counts(c) == {("completed", "stop"): 2.0}


async def test_a_disconnected_stream_is_cancelled_after_the_grace_unless_resumed():
    cancelled: list[str] = []

    async def cancel() -> None:
        cancelled.append("r1")

    attachments = Attachments(grace_s=0.05)
    first = attachments.attach("r1")
    attachments.detach(first)
    await attachments.cancel_later("r1", cancel)
    second = attachments.attach("r1")  # a resume within the grace
    await asyncio.sleep(0.15)
    assert cancelled == [] and attachments.pending_cancels() == 0
    closed = []
    second.close = lambda: closed.append("second")
    third = attachments.attach("r1")
    attachments.supersede(third)
    assert closed == ["second"]
    attachments.detach(second)
    attachments.detach(third)
    await attachments.cancel_later("r1", cancel)
    await asyncio.sleep(0.15)
    assert cancelled == ["r1"]
    await Attachments(grace_s=0).cancel_later("r2", cancel)
    assert cancelled == ["r1", "r1"]
