"""Chat media parts through the bridge's HTTP route: accepted media become
media items of the request record (bytes, content hash, placeholder run);
every refusal of the safe fetcher reaches the client as a 400 with an
OpenAI-style error body, and nothing is sent. The media come from a real
HTTP server on the loopback interface, allow-listed for the positive cases
as an operator would an internal image store; the response source is a
stand-in that records what the bridge sends (the pipeline through the
broker is tested in tests/test_multimodal_live.py)."""

from __future__ import annotations

import base64
import io
import wave

import httpx
import numpy as np
import pytest
from PIL import Image
from starlette.applications import Starlette
from starlette.responses import RedirectResponse, Response
from starlette.routing import Route

from deployment import serve_app
from kvflow.schemas import (
    FinalResponse,
    FinishReason,
    InferenceRequest,
    MediaKind,
    ReplyTo,
    Usage,
    WorkerHeartbeat,
    WorkerRole,
    now_ms,
)
from kvflow.schemas.media import MEDIA_MARKER, PLACEHOLDER_TOKEN_ID, media_content_hash
from kvflow.settings import Settings
from kvflow.streams.bridge import build_app_for_state
from kvflow.streams.bridge.state import BridgeState
from kvflow.streams.bridge.worker_registry import WorkerRegistry

MODEL = "vlm"
MEDIA_TOKENS = 4
LIMIT = 4096


def _png(color) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (24, 24), color).save(buf, "PNG")
    return buf.getvalue()


PNG = _png((200, 30, 30))


def _noise() -> bytes:
    pixels = np.random.default_rng(0).integers(0, 256, (30, 30, 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, "PNG")
    return buf.getvalue()


NOISE = _noise()  # ~2.8 kB: under LIMIT alone, over the request's bound three times


def _gif() -> bytes:
    frames = [Image.new("RGB", (16, 16), (60 * i, 0, 0)) for i in range(3)]
    buf = io.BytesIO()
    frames[0].save(buf, "GIF", save_all=True, append_images=frames[1:])
    return buf.getvalue()


def _wav() -> bytes:
    buf = io.BytesIO()
    with wave.open(buf, "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(8000)
        w.writeframes(b"\x00\x10" * 800)
    return buf.getvalue()


def _media_app() -> Starlette:
    def fixed(body: bytes, media_type: str):
        async def handler(_):
            return Response(body, media_type=media_type)
        return handler

    def redirect(target: str):
        async def handler(_):
            return RedirectResponse(target, status_code=302)
        return handler

    return Starlette(routes=[
        Route("/cat.png", fixed(PNG, "image/png")), Route("/noise.png", fixed(NOISE, "image/png")), Route("/big.png", fixed(b"x" * (LIMIT + 1), "image/png")),
        Route("/page", fixed(b"<html></html>", "text/html")), Route("/long", fixed(PNG, "image/" + "x" * 200)), Route("/clip.gif", fixed(_gif(), "image/gif")),
        Route("/to-private", redirect("http://10.0.0.7/img.png")),
        Route("/to-metadata", redirect("http://169.254.169.254/latest/meta-data/")),
    ])


class RecordingSource:
    """Answers every request with one final record and keeps what it was sent."""

    def __init__(self) -> None:
        self.requests: list[InferenceRequest] = []

    @property
    def reply_to(self) -> ReplyTo:
        return ReplyTo(topic="ns.responses", partition=0)

    async def stream(self, request: InferenceRequest):
        self.requests.append(request)
        yield FinalResponse(request_id=request.request_id, text="ok", token_ids=[5], worker_id="w0",
                            finish_reason=FinishReason.stop, usage=Usage(prompt_tokens=len(request.token_ids),
                                                                         completion_tokens=1))


def _heartbeat(worker_id: str, role: WorkerRole, **kw) -> WorkerHeartbeat:
    return WorkerHeartbeat(worker_id=worker_id, role=role, model=MODEL, engine="mocker", tokenizer="bytes",
                           block_size=16, kv_total_blocks=100, queue_topic=f"ns.queue.{role.value}",
                           queue_partition=0, ts_ms=now_ms(), ttl_ms=10**9, **kw)


def _state(source: RecordingSource, *, encode_workers: bool = True, **settings) -> BridgeState:
    registry = WorkerRegistry()
    registry.apply(_heartbeat("w0", WorkerRole.aggregated))
    if encode_workers:
        registry.apply(_heartbeat("e0", WorkerRole.encode, media_tokens=MEDIA_TOKENS))
    return BridgeState(settings=Settings(**settings), source=source, registry=registry)


@pytest.fixture
async def media():
    async with serve_app(_media_app()) as url:
        yield url


@pytest.fixture
async def bridges(tmp_path):
    """(trusted bridge URL, its source, default bridge URL, its source, media root)."""
    root = tmp_path / "media"
    root.mkdir()
    (root / "local.png").write_bytes(PNG)
    (tmp_path / "secret.png").write_bytes(PNG)
    trusted_source, default_source = RecordingSource(), RecordingSource()
    trusted = _state(trusted_source, media_allow_networks=("127.0.0.1/32",), media_allowed_roots=(str(root),),
                     media_max_bytes=LIMIT, media_fetch_timeout_s=5.0, media_max_request_bytes=LIMIT + 2000)
    async with serve_app(build_app_for_state(trusted), lifespan="off") as t_url, \
            serve_app(build_app_for_state(_state(default_source)), lifespan="off") as d_url:
        yield t_url, trusted_source, d_url, default_source, root


def _chat(*parts: dict, model: str = MODEL) -> dict:
    return {"model": model, "max_tokens": 4,
            "messages": [{"role": "user", "content": [{"type": "text", "text": "What is this?"}, *parts]}]}


def _image(url: str) -> dict:
    return {"type": "image_url", "image_url": {"url": url}}


async def _post(url: str, body: dict) -> httpx.Response:
    async with httpx.AsyncClient(base_url=url, timeout=30) as http:
        return await http.post("/v1/chat/completions", json=body)


async def test_media_parts_become_media_items_of_the_request(bridges, media):
    url, source, _, _, root = bridges
    audio = base64.b64encode(_wav()).decode()
    data_url = "data:image/png;base64," + base64.b64encode(_png((1, 2, 3))).decode()
    reply = await _post(url, _chat(_image(f"{media}/cat.png"), {"type": "text", "text": " and "},
                                   {"type": "input_audio", "input_audio": {"data": audio, "format": "wav"}},
                                   {"type": "video_url", "video_url": {"url": f"{media}/clip.gif"}},
                                   _image(data_url), _image(f"file://{root}/local.png")))
    assert reply.status_code == 200, reply.text
    (request,) = source.requests
    assert request.messages[0].content == f"What is this?{MEDIA_MARKER} and {MEDIA_MARKER * 4}"
    items = request.media
    assert [i.kind for i in items] == [MediaKind.image, MediaKind.audio, MediaKind.video, MediaKind.image,
                                       MediaKind.image]
    assert [i.content_type for i in items] == ["image/png", "audio/wav", "image/gif", "image/png", "image/png"]
    assert items[0].raw() == PNG and items[0].content_hash == media_content_hash(PNG)
    assert items[1].raw() == _wav() and items[4].content_hash == items[0].content_hash
    assert request.needs_encoding and all(i.num_tokens == MEDIA_TOKENS for i in items)
    ids = request.token_ids
    for item in items:
        assert ids[item.offset:item.offset + MEDIA_TOKENS] == [PLACEHOLDER_TOKEN_ID] * MEDIA_TOKENS
    assert items[1].offset - items[0].offset == MEDIA_TOKENS + len(" and ")
    assert items[2].offset == items[1].offset + MEDIA_TOKENS  # adjacent parts, adjacent runs


def _refusal(reply: httpx.Response, param: str | None = "messages.0.content.1.image_url.url",
             code: str = "media_fetch_refused") -> str:
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["type"] == "invalid_request_error"
    assert error["code"] == code and error["param"] == param
    return error["message"]


async def test_every_fetch_refusal_is_a_400_and_sends_nothing(bridges, media, tmp_path):
    url, source, default_url, default_source, root = bridges
    assert "private, loopback or link-local" in _refusal(await _post(default_url, _chat(_image(f"{media}/cat.png"))))
    assert "private, loopback or link-local" in _refusal(await _post(url, _chat(_image("http://127.0.0.2:9/a.png"))))
    for private in ("http://10.1.2.3/img.png", "http://169.254.169.254/latest/meta-data/"):
        assert "private, loopback or link-local" in _refusal(await _post(url, _chat(_image(private))))
    assert "outside the directories" in _refusal(await _post(url, _chat(_image(f"file://{tmp_path}/secret.png"))))
    assert "outside the directories" in _refusal(await _post(url, _chat(_image(f"file://{root}/../secret.png"))))
    assert "larger than" in _refusal(await _post(url, _chat(_image(f"{media}/big.png"))))
    assert "text/html" in _refusal(await _post(url, _chat(_image(f"{media}/page"))))
    assert "content type is longer" in _refusal(await _post(url, _chat(_image(f"{media}/long"))))
    for hop in ("to-private", "to-metadata"):
        assert "private, loopback or link-local" in _refusal(await _post(url, _chat(_image(f"{media}/{hop}"))))
    # A video URL may not name an HTML page either; audio must be base64 of at most the limit.
    _refusal(await _post(url, _chat({"type": "video_url", "video_url": {"url": f"{media}/page"}})),
             "messages.0.content.1.video_url.url")
    audio = "messages.0.content.1.input_audio.data"
    _refusal(await _post(url, _chat({"type": "input_audio", "input_audio": {"data": "@@@", "format": "wav"}})), audio)
    big = base64.b64encode(b"\0" * (LIMIT + 1)).decode()
    _refusal(await _post(url, _chat({"type": "input_audio", "input_audio": {"data": big, "format": "wav"}})), audio)
    # Each part within its limit, too many bytes together.
    assert 2 * len(NOISE) < LIMIT + 2000 < 3 * len(NOISE) and len(NOISE) < LIMIT
    _refusal(await _post(url, _chat(*[_image(f"{media}/noise.png")] * 3)), "messages", "media_too_large")
    assert source.requests == [] and default_source.requests == []


async def test_media_need_an_encode_worker_and_well_formed_parts(media):
    source = RecordingSource()
    async with serve_app(build_app_for_state(_state(source, encode_workers=False)), lifespan="off") as url:
        message = _refusal(await _post(url, _chat(_image(f"{media}/cat.png"))), "messages", "unsupported")
        assert "no encode worker" in message
        _refusal(await _post(url, _chat({"type": "image_url", "image_url": {}})), "messages.0.content", "unsupported")
        _refusal(await _post(url, _chat({"type": "input_audio", "input_audio": {"data": "AA==", "format": "ogg"}})),
                 "messages.0.content", "unsupported")
        marked = _chat(_image(f"{media}/cat.png"))
        marked["messages"][0]["content"][0]["text"] = f"a {MEDIA_MARKER} b"
        _refusal(await _post(url, marked), "messages.0.content", "invalid_value")
        text_only = await _post(url, {"model": MODEL, "messages": [{"role": "user", "content": f"a {MEDIA_MARKER}"}]})
        assert text_only.status_code == 200  # the marker is only reserved in requests with media
    assert len(source.requests) == 1
