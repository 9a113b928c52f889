"""Media inputs (images, audio, video) on the wire, and how they join block hashes.

A chat request's media parts travel in its :class:`~kvflow.schemas.InferenceRequest`
as :class:`MediaItem` records. Each item stands at a run of ``num_tokens``
placeholder tokens in the prompt's ``token_ids``, starting at ``offset``
(the producer writes :data:`PLACEHOLDER_TOKEN_ID` there); the engine feeds
the item's embeddings, ``[num_tokens, hidden]``, at those positions in place
of the embedding lookup.

An item is first carried with its bytes (``data``); an encode worker turns
the bytes into embeddings, and the record the language-model worker gets
carries the embeddings instead (``embeds``), so each hop holds only what it
needs. :data:`MAX_MEDIA_ITEMS` bounds the items of a request; producers
bound their bytes (the bridge: ``Settings.media_max_request_bytes``).

Block hashes: the placeholder ids are the same for every image, so they
alone would make two prompts with different images look alike. Every block
that covers a placeholder of an item gets the item's ``content_hash`` (xxh3-64
of its bytes) appended to its bytes before hashing
(:func:`~kvflow.schemas.block_hash.compute_block_hashes`' ``mm_hashes``, the
multimodal rule of Dynamo's block hashes); the chain carries it to every
later block. So the router's KV index sees image reuse: the same image at the
same place gives the same hashes, any other image different ones.
"""

from __future__ import annotations

import base64
from collections.abc import Iterable
from enum import Enum

import xxhash
from pydantic import BaseModel, ConfigDict, Field, model_validator

from kvflow.schemas.prompt_embeds import PromptEmbeds

__all__ = [
    "MAX_MEDIA_ITEMS",
    "MAX_CONTENT_TYPE_CHARS",
    "MEDIA_MARKER",
    "PLACEHOLDER_TOKEN_ID",
    "MediaKind",
    "MediaItem",
    "EncodeForward",
    "media_content_hash",
    "media_block_hashes",
]

MAX_MEDIA_ITEMS = 16
"""Most media items one request may carry."""

MAX_CONTENT_TYPE_CHARS = 128
"""Longest media type a media item may name (characters)."""

MEDIA_MARKER = "\ufffc"
"""Where a media item stands in a chat message's text (U+FFFC OBJECT
REPLACEMENT CHARACTER, Unicode's mark for an embedded object); the bridge
refuses text that contains it."""

PLACEHOLDER_TOKEN_ID = 0
"""Token id written at each media position. The engine replaces those rows
by the media's embeddings, so the id never reaches the model; 0 exists in
every vocabulary."""


class MediaKind(str, Enum):
    """What a media item is: from an ``image_url``, ``input_audio`` or ``video_url`` content part."""

    image = "image"
    audio = "audio"
    video = "video"


class EncodeForward(BaseModel):
    """The worker queue partition an encode worker sends a request to once its
    media is encoded (the router's choice of language-model worker)."""

    model_config = ConfigDict(frozen=True)
    topic: str = Field(min_length=1)
    partition: int = Field(ge=0)


class MediaItem(BaseModel):
    """One media input of a request.

    ``offset``/``num_tokens``: the placeholder run it fills in ``token_ids``
    (tokens). ``content_hash``: xxh3-64 of its bytes (:func:`media_content_hash`),
    which salts the block hashes it covers. ``data``: the bytes, base64 (until
    encoded); ``embeds``: its ``[num_tokens, hidden]`` embeddings (once
    encoded); at least one of the two is set. ``from_cache``: the encode
    worker found the embeddings in its cache.

    Raises (validation): neither ``data`` nor ``embeds``; ``embeds`` with a
    row count other than ``num_tokens``.
    """

    model_config = ConfigDict(frozen=True, extra="ignore")
    kind: MediaKind
    content_type: str = Field(min_length=1, max_length=MAX_CONTENT_TYPE_CHARS)
    content_hash: int = Field(ge=0, lt=1 << 64)
    offset: int = Field(ge=0)
    num_tokens: int = Field(ge=1)
    data: str | None = Field(default=None, repr=False)
    embeds: PromptEmbeds | None = None
    from_cache: bool = False

    @model_validator(mode="after")
    def _has_content(self) -> "MediaItem":
        if self.data is None and self.embeds is None:
            raise ValueError("a media item carries its data or its embeddings")
        if self.embeds is not None and self.embeds.seq_len != self.num_tokens:
            raise ValueError(f"embeddings of {self.embeds.seq_len} rows for {self.num_tokens} placeholder tokens")
        return self

    @property
    def span(self) -> tuple[int, int, int]:
        """``(offset, num_tokens, content_hash)``: what block hashing reads."""
        return self.offset, self.num_tokens, self.content_hash

    def raw(self) -> bytes:
        """The media bytes.

        Raises:
            ValueError: the item carries embeddings only.
        """
        if self.data is None:
            raise ValueError("this media item carries embeddings, not bytes")
        return base64.b64decode(self.data)

    @classmethod
    def of(cls, kind: MediaKind, data: bytes, content_type: str, offset: int, num_tokens: int) -> "MediaItem":
        """An item carrying ``data`` (its content hash computed here)."""
        return cls(kind=kind, content_type=content_type, content_hash=media_content_hash(data), offset=offset,
                   num_tokens=num_tokens, data=base64.b64encode(data).decode("ascii"))


def media_content_hash(data: bytes) -> int:
    """The content hash of media bytes: xxh3-64, seed 0 (a u64)."""
    return xxhash.xxh3_64_intdigest(data)


def media_block_hashes(spans: Iterable[tuple[int, int, int]], block_size: int) -> list[tuple[int, int]]:
    """``(block_index, content_hash)`` for every block a media span covers.

    ``spans`` are ``(offset, num_tokens, content_hash)`` (:attr:`MediaItem.span`);
    the pairs go to :func:`~kvflow.schemas.block_hash.compute_block_hashes` as
    ``mm_hashes``.

    Raises:
        ValueError: ``block_size < 1``.
    """
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    pairs: list[tuple[int, int]] = []
    for offset, num_tokens, content_hash in spans:
        first, last = offset // block_size, (offset + num_tokens - 1) // block_size
        pairs.extend((block, content_hash) for block in range(first, last + 1))
    return pairs
