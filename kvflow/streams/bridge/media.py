"""The media of a chat request: found in its content parts, fetched safely, placed in its prompt.

For a chat body with ``image_url``, ``input_audio`` or ``video_url`` parts
the request path (:mod:`kvflow.streams.bridge.pipeline`), once the model is
known to have encode workers, calls in order:

1. :func:`media_refs` — each media part, in message and part order, with
   the request field named by its errors (``messages.0.content.1.image_url.url``);
2. :func:`fetch_all` — its bytes: URLs through the safe fetcher
   (:mod:`kvflow.streams.bridge.media_fetch`: ``image/*`` for images;
   ``video/*`` and animated image types for videos), ``input_audio``
   decoded from base64 (``wav`` → ``audio/wav``, ``mp3`` → ``audio/mpeg``),
   at most ``Settings.media_max_bytes`` each and
   ``Settings.media_max_request_bytes`` together (400 above);
3. :func:`encode_chat_media` — the prompt ids with a run of
   ``media_tokens`` :data:`~kvflow.schemas.media.PLACEHOLDER_TOKEN_ID`
   where each media part stood (``media_tokens``: what the model's encode
   workers advertise), and where each run starts;
4. :func:`media_items` — the :class:`~kvflow.schemas.MediaItem` records
   (bytes and content hash) the request record carries to the router.

Every refusal is a 400 with an OpenAI-style error body.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from kvflow.schemas import ChatMessage, MediaItem, MediaKind
from kvflow.schemas.media import MAX_CONTENT_TYPE_CHARS, MAX_MEDIA_ITEMS, MEDIA_MARKER, PLACEHOLDER_TOKEN_ID
from kvflow.schemas.openai import ChatCompletionRequest, ImageUrlPart, InputAudioPart, VideoUrlPart
from kvflow.settings import Settings
from kvflow.streams.bridge.errors import BridgeError, invalid_request
from kvflow.streams.bridge.media_fetch import FetchedMedia, MediaPolicy, fetch_media

__all__ = ["MediaRef", "AUDIO_TYPES", "VIDEO_TYPES", "media_refs", "fetch_all", "encode_chat_media", "media_items"]

AUDIO_TYPES = {"wav": "audio/wav", "mp3": "audio/mpeg"}
"""Media type of each ``input_audio`` format."""

VIDEO_TYPES = ("video/", "image/gif", "image/webp", "image/png", "image/apng")
"""Media types a ``video_url`` may have: video containers, and animated
images (GIF, WebP, APNG), whose frames are the video."""


@dataclass(frozen=True)
class MediaRef:
    """One media part of a request: its kind, the field its errors name, and
    where its bytes are (``url``) or the bytes themselves (``audio``: base64, ``audio_format``)."""

    kind: MediaKind
    param: str
    url: str | None = None
    audio: str | None = None
    audio_format: str | None = None


def media_refs(body: ChatCompletionRequest) -> list[MediaRef]:
    """The media parts of ``body``, in order.

    Raises:
        BridgeError: 400 with more than :data:`~kvflow.schemas.media.MAX_MEDIA_ITEMS`
            parts; a part of unknown shape (as
            :func:`~kvflow.streams.bridge.openai_format.chat_messages`).
    """
    refs: list[MediaRef] = []
    for i, message in enumerate(body.messages):
        try:
            parts = message.parts()
        except ValueError as exc:
            raise invalid_request(f"messages[{i}].{exc}", param=f"messages.{i}.content", code="unsupported") from None
        for j, part in enumerate(parts):
            where = f"messages.{i}.content.{j}"
            if isinstance(part, ImageUrlPart):
                refs.append(MediaRef(MediaKind.image, f"{where}.image_url.url", url=part.image_url.url))
            elif isinstance(part, VideoUrlPart):
                refs.append(MediaRef(MediaKind.video, f"{where}.video_url.url", url=part.video_url.url))
            elif isinstance(part, InputAudioPart):
                refs.append(MediaRef(MediaKind.audio, f"{where}.input_audio.data", audio=part.input_audio.data,
                                     audio_format=part.input_audio.format))
    if len(refs) > MAX_MEDIA_ITEMS:
        raise invalid_request(f"A request may carry at most {MAX_MEDIA_ITEMS} media parts, not {len(refs)}.",
                              param="messages", code="too_many_media")
    return refs


def _refused(message: str, param: str) -> BridgeError:
    return BridgeError(400, message, "invalid_request_error", code="media_fetch_refused", param=param)


def _audio(ref: MediaRef, policy: MediaPolicy) -> FetchedMedia:
    data = ref.audio or ""
    if len(data) * 3 // 4 > policy.max_bytes + 2:
        raise _refused(f"the audio is larger than {policy.max_bytes} bytes", ref.param)
    try:
        raw = base64.b64decode(data, validate=True)
    except (binascii.Error, ValueError):
        raise _refused("input_audio.data is not valid base64", ref.param) from None
    if len(raw) > policy.max_bytes:
        raise _refused(f"the audio is larger than {policy.max_bytes} bytes", ref.param)
    return FetchedMedia(raw, AUDIO_TYPES[ref.audio_format or "wav"], "input_audio")


async def _fetch(ref: MediaRef, policy: MediaPolicy) -> FetchedMedia:
    if ref.kind is MediaKind.audio:
        return _audio(ref, policy)
    types = ("image/",) if ref.kind is MediaKind.image else VIDEO_TYPES
    media = await fetch_media(ref.url or "", dataclasses.replace(policy, content_types=types), param=ref.param)
    if len(media.content_type) > MAX_CONTENT_TYPE_CHARS:  # a record field is bounded; so is what fills it
        raise _refused(f"the media's content type is longer than {MAX_CONTENT_TYPE_CHARS} characters", ref.param)
    return media


async def fetch_all(refs: Sequence[MediaRef], settings: Settings) -> list[FetchedMedia]:
    """The bytes of every ref (fetched concurrently), in order.

    Raises:
        BridgeError: 400 ``media_fetch_refused`` for the first ref (in
            order) the fetcher refused or whose audio is not base64 or too
            large; 400 ``media_too_large`` when all together exceed
            ``settings.media_max_request_bytes``.
    """
    policy = MediaPolicy.from_settings(settings)
    results = await asyncio.gather(*(_fetch(ref, policy) for ref in refs), return_exceptions=True)
    for result in results:
        if isinstance(result, BaseException):
            raise result
    total = sum(len(r.data) for r in results)
    if total > settings.media_max_request_bytes:
        raise invalid_request(f"The request's media take {total} bytes; at most {settings.media_max_request_bytes} "
                              "are accepted.", param="messages", code="media_too_large")
    return list(results)


def _placed(parts: list[list[int]], media_tokens: int) -> tuple[list[int], list[int]]:
    ids: list[int] = list(parts[0])
    offsets: list[int] = []
    for part in parts[1:]:
        offsets.append(len(ids))
        ids += [PLACEHOLDER_TOKEN_ID] * media_tokens
        ids += part
    return ids, offsets


async def encode_chat_media(tokenizer: Any, messages: Sequence[ChatMessage], num_media: int,
                            media_tokens: int) -> tuple[list[int], list[int]]:
    """Prompt ids (shape [ISL]) of a chat whose media parts stand as
    :data:`~kvflow.schemas.media.MEDIA_MARKER` in ``messages``, with
    ``media_tokens`` placeholder ids in each marker's place, and the offset
    of each run (``num_media`` of them). Tokenizes in a thread.

    Raises:
        BridgeError: 400 when the model's chat template drops or repeats a
            media part (the marker count differs from ``num_media``).
    """
    parts = await asyncio.to_thread(tokenizer.encode_chat_parts, list(messages), MEDIA_MARKER)
    if len(parts) != num_media + 1:
        raise invalid_request(f"The model's chat template kept {len(parts) - 1} of {num_media} media parts.",
                              param="messages", code="unsupported")
    return _placed(parts, media_tokens)


def media_items(refs: Sequence[MediaRef], fetched: Sequence[FetchedMedia], offsets: Sequence[int],
                media_tokens: int) -> list[MediaItem]:
    """The request record's media items: each ref's bytes at its placeholder run."""
    return [MediaItem.of(ref.kind, media.data, media.content_type, offset, media_tokens)
            for ref, media, offset in zip(refs, fetched, offsets, strict=True)]
