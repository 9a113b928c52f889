"""What engines exchange in disaggregated serving: the prefill's result and the decode's handoff.

Engines know nothing of Kafka or sockets. A prefill engine returns a
:class:`PrefillResult` (first token, and the prompt's KV packed as
:class:`KvPayload` blocks); the worker exposes the payload through
:class:`~kvflow.workers.kv.transfer.KvTransport`. A decode engine receives a
:class:`KvHandoff`: the first token plus :meth:`KvHandoff.fetch`, which pulls
the blocks it lacks, and records how the pull went in
:attr:`KvHandoff.stats`.

Block layout: the KV of ``num_tokens`` tokens is ``num_blocks =
ceil(num_tokens / block_size)`` blocks, each a contiguous
``KvLayout.block_shape`` array (hf: ``[layers, 2, kv_heads, block_size,
head_dim]``, the same shape as one prefix-cache block), stored back to back;
the tail of the last block is zero padding. A reader that already caches the
first ``k`` blocks pulls only bytes ``[k · block_bytes, total)``.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Any

from kvflow.schemas.transfer import EngineKvHandoff, TransferBackend, TransferDescriptor
from kvflow.workers.kv.transfer import KvTransport, TransferError

__all__ = ["DTYPE_BYTES", "KvLayout", "KvPayload", "PrefillResult", "TransferStats", "KvHandoff"]

DTYPE_BYTES = {"float64": 8, "float32": 4, "float16": 2, "bfloat16": 2, "float8_e4m3fn": 1, "float8_e5m2": 1,
               "int8": 1, "uint8": 1}
"""Bytes per element of the KV dtypes kvflow moves (torch dtype names)."""


@dataclass(frozen=True)
class KvLayout:
    """Element type and shape of one KV block.

    Raises:
        ValueError: unknown dtype or a non-positive dimension.
    """

    dtype: str
    block_shape: tuple[int, ...]

    def __post_init__(self) -> None:
        if self.dtype not in DTYPE_BYTES:
            raise ValueError(f"unsupported KV dtype {self.dtype!r}")
        if not self.block_shape or min(self.block_shape) < 1:
            raise ValueError(f"bad KV block shape {self.block_shape}")

    @property
    def block_bytes(self) -> int:
        """Bytes of one block: product of ``block_shape`` × element size."""
        return math.prod(self.block_shape) * DTYPE_BYTES[self.dtype]

    @classmethod
    def of(cls, desc: TransferDescriptor) -> KvLayout | None:
        """The layout a descriptor announces, or None when it has none (simulated transfers)."""
        if not desc.dtype or not desc.block_shape:
            return None
        return cls(desc.dtype, tuple(desc.block_shape))


@dataclass
class KvPayload:
    """A prompt's KV, packed for transfer: ``buffer`` is contiguous
    ``[num_blocks, *layout.block_shape]`` (torch tensor or numpy array, host or GPU)."""

    buffer: Any
    layout: KvLayout
    num_blocks: int
    num_tokens: int


@dataclass
class PrefillResult:
    """What a prefill-only engine call produced.

    ``first_token_id`` was sampled from the last prompt position;
    ``num_cached_tokens`` of the ISL ``num_prompt_tokens`` came from the
    prefix cache. ``kv`` is the prompt's KV, or None when the engine has no
    real KV (mocker): ``num_kv_bytes`` is then the modelled size.
    ``sampler_state`` is the random generator state after the first draw
    (None for greedy requests). ``engine_kv`` is set instead of ``kv`` when
    the engine's own KV connector moves the KV (vLLM).
    """

    first_token_id: int
    num_prompt_tokens: int
    num_cached_tokens: int = 0
    kv: KvPayload | None = None
    num_kv_bytes: int = 0
    sampler_state: bytes | None = None
    engine_kv: EngineKvHandoff | None = None


@dataclass
class TransferStats:
    """How a decode worker obtained the prompt KV (filled by :class:`KvHandoff`).

    ``transfer_ms`` is wall time of the pull (or the simulated duration).
    """

    backend: TransferBackend = "none"
    num_bytes: int = 0
    transfer_ms: float = 0.0
    num_blocks_pulled: int = 0
    num_blocks_reused: int = 0


@dataclass
class KvHandoff:
    """A remote prefill, as a decode engine sees it.

    The engine streams ``first_token_id`` as its first output, then decodes
    from the KV of the ``num_tokens`` prompt tokens, which it gets from its
    own prefix cache (leading blocks) and :meth:`fetch` (the rest).
    ``descriptor`` is None when the prefill worker exposed no KV.
    """

    first_token_id: int
    num_tokens: int
    descriptor: TransferDescriptor | None = None
    transport: KvTransport | None = None
    sampler_state: bytes | None = None
    stats: TransferStats = field(default_factory=TransferStats)
    released: bool = False

    @property
    def layout(self) -> KvLayout | None:
        """The transferred block layout (None when nothing can be pulled)."""
        return KvLayout.of(self.descriptor) if self.descriptor is not None else None

    @property
    def num_blocks(self) -> int:
        """Blocks the source holds."""
        return self.descriptor.num_blocks if self.descriptor is not None else 0

    async def fetch(self, first_block: int = 0, device: Any = "cpu") -> Any:
        """Pull blocks ``[first_block, num_blocks)`` into a new uint8 torch tensor on
        ``device`` (shape ``[(num_blocks − first_block) · block_bytes]``), then release
        the source buffer. Records the pull in :attr:`stats`.

        Raises:
            TransferError: nothing to pull from (no descriptor, simulated
                source, no transport), ``first_block`` out of range, or the pull failed.
        """
        import torch

        desc = self.descriptor
        if desc is None or self.transport is None or desc.backend not in ("nixl", "tcp") or not desc.block_bytes:
            raise TransferError("this handoff carries no pullable KV")
        if not 0 <= first_block <= desc.num_blocks:
            raise TransferError(f"first_block {first_block} outside [0, {desc.num_blocks}]")
        dest = torch.empty((desc.num_blocks - first_block) * desc.block_bytes, dtype=torch.uint8, device=device)
        started = time.perf_counter()
        try:
            backend = await self.transport.pull(desc, dest, first_block * desc.block_bytes)
        finally:
            await self.release()
        self.stats = TransferStats(backend=backend, num_bytes=dest.numel(),
                                   transfer_ms=(time.perf_counter() - started) * 1000,
                                   num_blocks_pulled=desc.num_blocks - first_block, num_blocks_reused=first_block)
        return dest

    def record_simulated(self, num_bytes: int, transfer_ms: float, num_blocks_pulled: int,
                         num_blocks_reused: int) -> None:
        """Record a modelled transfer (the mocker sleeps it instead of moving bytes)."""
        self.stats = TransferStats("simulated", num_bytes, transfer_ms, num_blocks_pulled, num_blocks_reused)

    async def release(self) -> None:
        """Let the source free its buffer (idempotent, never raises)."""
        if self.released:
            return
        self.released = True
        if self.descriptor is not None and self.transport is not None and self.descriptor.backend in ("nixl", "tcp"):
            await self.transport.release(self.descriptor)
