"""Records on the kv-events topic: what each worker's KV cache stored and evicted.

A worker publishes one :class:`KvEventBatch` per engine step that changed its
cache, keyed by worker id, with a per-worker monotonic ``event_id`` so that a
consumer can detect duplicates (id <= last seen) and gaps (id > last + 1).
Block hashes are the chained sequence hashes of :mod:`kvflow.router.hashing`.
"""

from __future__ import annotations

from enum import Enum
from typing import Annotated, Literal, Union

from pydantic import BaseModel, ConfigDict, Field

from kvflow.schemas.base import Record

__all__ = ["KvTier", "BlockHash", "BlockStored", "BlockRemoved", "AllBlocksCleared", "KvEvent", "KvEventBatch", "KvDumpRequest"]


class KvTier(str, Enum):
    """Where a cached block lives: GPU/accelerator memory, host RAM, or disk."""

    device = "device"
    host = "host"
    disk = "disk"


BlockHash = Annotated[int, Field(ge=0, lt=2**64)]
"""A chained sequence block hash: XXH3-64, so an unsigned 64-bit int (:mod:`kvflow.router.hashing`)."""


class BlockStored(BaseModel):
    """Blocks now cached, in sequence order, continuing from ``parent_block_hash``."""

    model_config = ConfigDict(frozen=True)
    type: Literal["stored"] = "stored"
    parent_block_hash: BlockHash | None = None
    block_hashes: list[BlockHash]
    tier: KvTier = KvTier.device
    lora_name: str | None = None


class BlockRemoved(BaseModel):
    """Blocks evicted from ``tier``."""

    model_config = ConfigDict(frozen=True)
    type: Literal["removed"] = "removed"
    block_hashes: list[BlockHash]
    tier: KvTier = KvTier.device


class AllBlocksCleared(BaseModel):
    """The worker dropped its whole cache (restart, reset)."""

    model_config = ConfigDict(frozen=True)
    type: Literal["cleared"] = "cleared"


KvEvent = Annotated[Union[BlockStored, BlockRemoved, AllBlocksCleared], Field(discriminator="type")]


class KvEventBatch(Record):
    """Ordered KV events of one worker. ``dump`` marks a full resync snapshot
    (consumers replace that worker's state with it)."""

    worker_id: str
    event_id: int = Field(ge=0)
    block_size: int = Field(ge=1)
    ts_ms: int
    events: list[KvEvent]
    dump: bool = False


class KvDumpRequest(Record):
    """Asks ``worker_id`` to publish a full dump of its cached blocks."""

    worker_id: str
    requested_by: str
    ts_ms: int
