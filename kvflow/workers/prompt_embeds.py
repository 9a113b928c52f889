"""Prompt embeddings from a request record to a tensor an engine can take."""

from __future__ import annotations

import torch

from kvflow.schemas.prompt_embeds import PromptEmbeds

__all__ = ["to_tensor"]

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def to_tensor(embeds: PromptEmbeds) -> torch.Tensor:
    """The ``[seq_len, hidden]`` CPU tensor of ``embeds`` (its bytes are read
    as little-endian, the byte order of every platform torch ships for)."""
    raw = bytearray(embeds.raw())  # writable: torch.frombuffer shares it
    return torch.frombuffer(raw, dtype=_DTYPES[embeds.dtype]).reshape(embeds.shape)
