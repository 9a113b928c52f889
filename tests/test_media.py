"""The media path's parts that need no broker: the seeded CLIP-style encoder
(images, animated-image video, WAV audio), the byte-bounded LRU embedding
cache, media records and their block hashes, the encode worker choice, and
placeholder runs in tokenized chats."""

from __future__ import annotations

import base64
import io
import wave

import numpy as np
import pytest
import torch
from PIL import Image

from kvflow.models.tokenizer import ByteTokenizer
from kvflow.router.encode import encode_key, pick_encode_worker
from kvflow.schemas import ChatMessage, InferenceRequest, MediaItem, MediaKind, ReplyTo, WorkerRole, WorkerStatus
from kvflow.schemas.block_hash import compute_block_hashes
from kvflow.schemas.media import MEDIA_MARKER, PLACEHOLDER_TOKEN_ID, media_block_hashes, media_content_hash
from kvflow.schemas.prompt_embeds import PromptEmbeds
from kvflow.streams.bridge.media import encode_chat_media
from kvflow.streams.workers import WorkerView
from kvflow.workers.media_cache import EmbeddingCache
from kvflow.workers.media_encoder import MediaDecodeError, TowerConfig, build_media_encoder

REPLY_TO = ReplyTo(topic="ns.responses", partition=0)


def png(color: tuple[int, int, int], size: tuple[int, int] = (48, 40)) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", size, color).save(buf, "PNG")
    return buf.getvalue()


def gif(frames: int = 6) -> bytes:
    images = [Image.new("RGB", (32, 32), (40 * i, 255 - 40 * i, 0)) for i in range(frames)]
    buf = io.BytesIO()
    images[0].save(buf, "GIF", save_all=True, append_images=images[1:])
    return buf.getvalue()


def wav(seconds: float = 0.5, rate: int = 16000) -> bytes:
    t = np.arange(int(seconds * rate)) / rate
    buf = io.BytesIO()
    with wave.open(buf, "wb") as w:
        w.setnchannels(2)
        w.setsampwidth(2)
        w.setframerate(rate)
        tone = (np.sin(2 * np.pi * 440 * t) * 8000).astype("<i2")
        w.writeframes(np.repeat(tone, 2).tobytes())
    return buf.getvalue()


@pytest.fixture(scope="module")
def encoder():
    return build_media_encoder(576, seed=0)


def test_encoder_shapes_and_seeded_weights(encoder):
    assert encoder.media_tokens == TowerConfig().num_patches == 16
    red = encoder.encode(MediaKind.image, png((220, 20, 20)))
    assert red.shape == (16, 576) and red.dtype == torch.float32 and torch.isfinite(red).all()
    again = build_media_encoder(576, seed=0).encode(MediaKind.image, png((220, 20, 20)))
    assert torch.equal(red, again)  # another process with the same seed agrees
    assert not torch.equal(red, build_media_encoder(576, seed=1).encode(MediaKind.image, png((220, 20, 20))))
    assert not torch.allclose(red, encoder.encode(MediaKind.image, png((20, 20, 220))))
    state = torch.random.get_rng_state()
    build_media_encoder(64, seed=3)
    assert torch.equal(state, torch.random.get_rng_state())  # the global generator is left alone
    assert encoder.encode(MediaKind.video, gif()).shape == (16, 576)
    assert encoder.encode(MediaKind.audio, wav()).shape == (16, 576)
    small = build_media_encoder(32, config=TowerConfig(image_size=32, patch_size=8, width=32, heads=2))
    assert small.encode(MediaKind.image, png((1, 2, 3))).shape == (16, 32)
    with pytest.raises(ValueError):
        build_media_encoder(32, config=TowerConfig(image_size=30, patch_size=8))


def test_undecodable_media_raise(encoder):
    with pytest.raises(MediaDecodeError):
        encoder.encode(MediaKind.image, b"not an image")
    with pytest.raises(MediaDecodeError, match="GIF"):
        encoder.encode(MediaKind.video, b"\x00\x00\x00\x18ftypmp42")  # an MP4 header: no decoder here
    with pytest.raises(MediaDecodeError, match="WAV"):
        encoder.encode(MediaKind.audio, b"ID3\x03mp3 frames")


def _embeds(rows: int, hidden: int = 8, fill: float = 1.0) -> PromptEmbeds:
    return PromptEmbeds.of(np.full((rows, hidden), fill, dtype="<f4").tobytes(), (rows, hidden), "float32")


def test_embedding_cache_is_lru_bounded_in_bytes():
    one = _embeds(4)  # 4 * 8 * 4 = 128 bytes
    cache = EmbeddingCache(capacity_bytes=300)
    assert cache.get(MediaKind.image, 1) is None
    cache.put(MediaKind.image, 1, one)
    cache.put(MediaKind.image, 2, one)
    assert cache.get(MediaKind.image, 1) is one  # 1 is now the most recent
    cache.put(MediaKind.image, 3, one)  # 384 > 300: the least recent (2) goes
    assert cache.get(MediaKind.image, 2) is None and cache.get(MediaKind.image, 1) is one
    assert cache.get(MediaKind.audio, 1) is None  # keyed by kind too
    assert (cache.stats.hits, cache.stats.misses, cache.stats.evictions) == (2, 3, 1)
    assert cache.size_bytes == 256 and len(cache) == 2
    cache.put(MediaKind.image, 4, _embeds(16))  # 512 bytes: larger than the whole cache, not kept
    assert cache.get(MediaKind.image, 4) is None and cache.size_bytes == 256
    off = EmbeddingCache(capacity_bytes=0)
    off.put(MediaKind.image, 1, one)
    assert off.get(MediaKind.image, 1) is None


def test_media_items_salt_the_blocks_they_cover():
    a, b = png((255, 0, 0)), png((0, 255, 0))
    ids = list(range(1, 9)) + [PLACEHOLDER_TOKEN_ID] * 6 + list(range(20, 38))  # 32 tokens, 8 blocks of 4

    def request(data: bytes) -> InferenceRequest:
        return InferenceRequest(request_id="r", model="m", token_ids=ids, reply_to=REPLY_TO,
                                media=[MediaItem.of(MediaKind.image, data, "image/png", 8, 6)])

    ra, rb = request(a), request(b)
    assert ra.media[0].content_hash == media_content_hash(a) and ra.media[0].raw() == a and ra.needs_encoding
    assert ra.mm_hashes(4) == [(2, media_content_hash(a)), (3, media_content_hash(a))]  # tokens 8..13
    ha, hb = (compute_block_hashes(ids, 4, None, r.mm_hashes(4)) for r in (ra, rb))
    plain = compute_block_hashes(ids, 4)
    assert ha[:2] == hb[:2] == plain[:2]  # blocks before the image are shared
    assert all(x != y for x, y in zip(ha[2:], hb[2:]))  # the image's blocks and every later one differ
    assert all(x != y for x, y in zip(ha[2:], plain[2:]))
    assert compute_block_hashes(ids, 4, None, request(a).mm_hashes(4)) == ha  # the same image: the same hashes
    assert media_block_hashes([(0, 1, 7), (15, 2, 9)], 16) == [(0, 7), (0, 9), (1, 9)]

    encoded = ra.media[0].model_copy(update={"data": None, "embeds": _embeds(6)})
    assert not ra.model_copy(update={"media": [encoded]}).needs_encoding
    with pytest.raises(ValueError, match="past the end"):
        InferenceRequest(request_id="r", model="m", token_ids=ids[:10], reply_to=REPLY_TO, media=ra.media)
    with pytest.raises(ValueError, match="token_ids"):
        InferenceRequest(request_id="r", model="m", prompt="x", reply_to=REPLY_TO, media=ra.media)
    with pytest.raises(ValueError, match="rows"):
        MediaItem(kind=MediaKind.image, content_type="image/png", content_hash=1, offset=0, num_tokens=5,
                  embeds=_embeds(6))
    with pytest.raises(ValueError, match="data or its embeddings"):
        MediaItem(kind=MediaKind.image, content_type="image/png", content_hash=1, offset=0, num_tokens=5)


def _view(worker_id: str, role: WorkerRole = WorkerRole.encode, model: str = "m",
          status: WorkerStatus = WorkerStatus.serving) -> WorkerView:
    return WorkerView(worker_id=worker_id, role=role, model=model, block_size=1, kv_total_blocks=0,
                      kv_used_blocks=0, active_requests=0, waiting_requests=0, active_prefill_tokens=0,
                      queue_topic="ns.queue.encode", queue_partition=int(worker_id[1:]), status=status,
                      last_seen_ms=0, ttl_ms=5000)


def test_encode_worker_choice_is_sticky_per_content_hash():
    workers = [_view("e0"), _view("e1"), _view("e2"), _view("g0", WorkerRole.aggregated),
               _view("e3", model="other"), _view("e4", status=WorkerStatus.draining)]
    picks = {key: pick_encode_worker(workers, "m", key).worker_id for key in range(200)}
    assert set(picks.values()) == {"e0", "e1", "e2"}  # spread over the serving encode workers of the model
    assert all(pick_encode_worker(workers, "m", k).worker_id == w for k, w in picks.items())
    fewer = [w for w in workers if w.worker_id != "e2"]
    moved = [k for k, w in picks.items() if w != "e2" and pick_encode_worker(fewer, "m", k).worker_id != w]
    assert not moved  # a worker leaving moves only the media it held
    assert pick_encode_worker(workers, "nope", 1) is None
    item = MediaItem.of(MediaKind.image, b"xyz", "image/png", 0, 1)
    req = InferenceRequest(request_id="r", model="m", token_ids=[0], reply_to=REPLY_TO, media=[item])
    assert encode_key(req) == item.content_hash


async def test_placeholder_runs_stand_where_the_media_parts_were():
    tok = ByteTokenizer()
    messages = [ChatMessage(role="user", content=f"see {MEDIA_MARKER} and {MEDIA_MARKER}!")]
    ids, offsets = await encode_chat_media(tok, messages, 2, 3)
    text_only = tok.encode_chat([ChatMessage(role="user", content="see  and !")])
    assert len(ids) == len(text_only) + 6 and len(offsets) == 2
    for offset in offsets:
        assert ids[offset:offset + 3] == [PLACEHOLDER_TOKEN_ID] * 3
    assert [t for i, t in enumerate(ids) if not any(o <= i < o + 3 for o in offsets)] == text_only
    assert tok.decode(ids[:offsets[0]]).endswith("see ")
    from kvflow.streams.bridge.errors import BridgeError

    with pytest.raises(BridgeError):
        await encode_chat_media(tok, messages, 1, 3)  # the template kept more media than were sent


def test_media_item_bytes_round_trip():
    item = MediaItem.of(MediaKind.audio, wav(0.1), "audio/wav", 3, 16)
    assert base64.b64decode(item.data) == item.raw()
    with pytest.raises(ValueError):
        item.model_copy(update={"data": None, "embeds": _embeds(16)}).raw()
