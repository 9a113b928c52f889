"""Prompt embeddings on the wire: a ``[seq_len, hidden]`` tensor's raw bytes.

A request may carry its prompt as embeddings instead of token ids (the
OpenAI-compatible ``prompt_embeds`` of ``/v1/completions``): the engine
feeds them to the model in place of its embedding lookup. They travel in
the request record as the tensor's row-major little-endian bytes (base64 in
JSON), with its shape and dtype; only an engine turns them into a tensor.

Routing and prefix caching key KV blocks by token ids; a prompt given as
embeddings has none, so each row stands in for its token by a *row id*: the
low 32 bits of the xxh3-64 of the row's bytes (:meth:`PromptEmbeds.row_ids`).
Block hashes over row ids match exactly when the embedding bytes match, so
the router sees the reuse of a repeated embeddings prompt, and such blocks
never match a prompt of real token ids except by a 32-bit collision on
every row of a block.
"""

from __future__ import annotations

import base64
from typing import Annotated, Literal

import xxhash
from pydantic import BaseModel, ConfigDict, Field, model_validator

__all__ = ["EMBEDS_DTYPES", "PromptEmbeds"]

EMBEDS_DTYPES: dict[str, int] = {"float32": 4, "float16": 2, "bfloat16": 2}
"""Accepted dtypes of prompt embeddings and their sizes in bytes."""


class PromptEmbeds(BaseModel):
    """A prompt as embeddings: ``data`` is the base64 of the row-major
    little-endian bytes of a ``shape`` = ``[seq_len, hidden]`` tensor of ``dtype``.

    Raises (validation): the byte count is not ``seq_len * hidden * itemsize``.
    """

    model_config = ConfigDict(frozen=True, extra="ignore")
    data: str = Field(repr=False)
    shape: tuple[Annotated[int, Field(ge=1)], Annotated[int, Field(ge=1)]]
    dtype: Literal["float32", "float16", "bfloat16"]

    @model_validator(mode="after")
    def _sized(self) -> "PromptEmbeds":
        expected = self.shape[0] * self.shape[1] * EMBEDS_DTYPES[self.dtype]
        # base64: 4 characters per 3 bytes, padded.
        if len(self.data) != 4 * ((expected + 2) // 3):
            raise ValueError(f"data holds the wrong number of bytes for {self.shape} {self.dtype}")
        return self

    @property
    def seq_len(self) -> int:
        """Prompt length (rows = positions)."""
        return self.shape[0]

    def raw(self) -> bytes:
        """The tensor's bytes (``seq_len * hidden * itemsize``)."""
        return base64.b64decode(self.data)

    def row_ids(self) -> list[int]:
        """One id per row standing in for its token in block hashes: the
        low 32 bits of xxh3-64 of the row's bytes (shape [seq_len])."""
        raw = self.raw()
        step = self.shape[1] * EMBEDS_DTYPES[self.dtype]
        return [xxhash.xxh3_64_intdigest(raw[i:i + step]) & 0xFFFFFFFF for i in range(0, len(raw), step)]

    @classmethod
    def of(cls, raw: bytes, shape: tuple[int, int], dtype: str) -> "PromptEmbeds":
        """Wrap a tensor's raw bytes."""
        return cls(data=base64.b64encode(raw).decode("ascii"), shape=shape, dtype=dtype)
