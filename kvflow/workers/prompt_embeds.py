"""Embeddings from a request record to tensors an engine can take: prompt
embeddings, and the embeddings of a prompt's media items."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kvflow.schemas import MediaItem
from kvflow.schemas.prompt_embeds import PromptEmbeds
from kvflow.workers.engines.base import EngineError, MediaInput

__all__ = ["to_tensor", "media_inputs"]

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def to_tensor(embeds: PromptEmbeds) -> torch.Tensor:
    """The ``[seq_len, hidden]`` CPU tensor of ``embeds`` (its bytes are read
    as little-endian, the byte order of every platform torch ships for)."""
    raw = bytearray(embeds.raw())  # writable: torch.frombuffer shares it
    return torch.frombuffer(raw, dtype=_DTYPES[embeds.dtype]).reshape(embeds.shape)


def media_inputs(items: Sequence[MediaItem]) -> tuple[MediaInput, ...]:
    """The engine's view of a request's media items, their embeddings as
    ``[num_tokens, hidden]`` CPU tensors.

    Raises:
        EngineError: an item still carries bytes (no encode worker turned it
            into embeddings: the request did not come by way of one).
    """
    if any(item.embeds is None for item in items):
        raise EngineError("the request's media are not encoded (no encode worker passed it on)")
    return tuple(MediaInput(item.offset, item.num_tokens, item.content_hash,
                            to_tensor(item.embeds)) for item in items)
