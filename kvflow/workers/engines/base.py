"""The engine interface: what a worker process needs from an inference engine.

Engines know nothing of Kafka. A worker hands an engine a
:class:`GenerateRequest` and iterates :class:`EngineOutput` items; the engine
reports cache changes through the ``kv_event_sink`` callback and its load
through :meth:`Engine.kv_stats`. Implementations: ``mocker`` (timing model, no
weights), ``hf`` (transformers + torch), ``vllm`` (vLLM's async engine).
"""

from __future__ import annotations

import abc
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

from kvflow.schemas import FinishReason, KvEvent, KvTierMetrics, SamplingParams, SpecDecodeMetrics
from kvflow.schemas.media import media_block_hashes

__all__ = ["MediaInput", "GenerateRequest", "EngineOutput", "KvStats", "KvEventSink", "EngineConfig", "Engine", "EngineError"]


class EngineError(RuntimeError):
    """The engine could not serve a request (bad input for this model, OOM, ...)."""


@dataclass(frozen=True)
class MediaInput:
    """One media item of a prompt (:mod:`kvflow.schemas.media`): the
    ``num_tokens`` placeholder ids from ``offset`` in ``prompt_token_ids``
    stand for it, the blocks they cover are hashed with ``content_hash``,
    and ``embeds`` (a ``[num_tokens, hidden]`` torch tensor, None for
    engines that read only the hashes) replaces their embedding lookup."""

    offset: int
    num_tokens: int
    content_hash: int
    embeds: Any = None

    @property
    def span(self) -> tuple[int, int, int]:
        """``(offset, num_tokens, content_hash)`` for :func:`~kvflow.schemas.media.media_block_hashes`."""
        return self.offset, self.num_tokens, self.content_hash


@dataclass(frozen=True)
class GenerateRequest:
    """One request as an engine sees it: prompt token ids and sampling settings.

    ``prompt_token_ids`` has shape [ISL]. ``lora_name`` salts block hashes.
    ``resumed_tokens``: how many of the last prompt ids are output this
    request already produced on a worker that was lost (a migrated request);
    engines that draw output ids from a request-seeded sequence (the mocker)
    continue it from there, so a migrated request's output equals an
    uninterrupted one. ``kv_transfer_params``: parameters for an engine's
    own KV connector (vLLM's ``kv_transfer_params``, set by
    :mod:`kvflow.workers.engines.vllm_disagg`); other engines ignore them.
    ``prompt_embeds``: the prompt as a ``[ISL, hidden]`` torch tensor fed
    to the model in place of its embedding lookup; ``prompt_token_ids``
    then holds the rows' ids (:meth:`kvflow.schemas.prompt_embeds.PromptEmbeds.row_ids`),
    used only to key KV blocks. Engines that cannot take embeddings raise
    :class:`EngineError`. ``media``: the prompt's media items, whose
    content hashes join its block hashes (:meth:`mm_hashes`) and whose
    embeddings take their placeholders' place (engines with
    ``accepts_media``).
    """

    request_id: str
    prompt_token_ids: list[int]
    sampling: SamplingParams
    lora_name: str | None = None
    resumed_tokens: int = 0
    kv_transfer_params: dict | None = None
    prompt_embeds: Any = None
    media: tuple[MediaInput, ...] = ()

    def mm_hashes(self, block_size: int) -> list[tuple[int, int]] | None:
        """``(block_index, content_hash)`` of the blocks the media cover, for
        :func:`~kvflow.schemas.block_hash.compute_block_hashes`; None without media."""
        return media_block_hashes((m.span for m in self.media), block_size) if self.media else None


@dataclass
class EngineOutput:
    """Tokens produced by one engine step for one request.

    ``token_ids`` are the new tokens (usually one); ``finish_reason`` is set on
    the request's last output. ``num_cached_tokens`` is the prompt prefix the
    engine found in its cache (reported on the first output, 0 elsewhere).
    """

    token_ids: list[int]
    finish_reason: FinishReason | None = None
    num_cached_tokens: int = 0


@dataclass(frozen=True)
class KvStats:
    """Engine load. Blocks hold ``block_size`` tokens each."""

    block_size: int
    total_blocks: int
    used_blocks: int
    active_requests: int
    waiting_requests: int
    active_prefill_tokens: int = 0
    prefill_tokens_total: int = 0
    decode_tokens_total: int = 0


KvEventSink = Callable[[list[KvEvent]], None]
"""Receives the KV events of one engine step, in order. Must not block."""


@dataclass
class EngineConfig:
    """Settings common to engines. ``model`` is a model name or local path."""

    model: str = "SmolLM2-135M-Instruct"
    block_size: int = 16
    num_kv_blocks: int = 4096
    max_batch_size: int = 32
    max_num_batched_tokens: int = 2048
    device: str = "cpu"
    extra: dict = field(default_factory=dict)


class Engine(abc.ABC):
    """An inference engine serving many concurrent requests (continuous batching).

    Lifecycle: ``await start()``, then any number of concurrent
    ``generate()`` iterations, then ``await stop()``.

    ``context_length`` is the longest sequence (prompt plus output tokens)
    the loaded model accepts, known after ``start()``; ``None`` when the
    engine has no such limit or cannot tell. Workers advertise it on their
    heartbeats so the bridge can reject requests that cannot fit.
    ``accepts_prompt_embeds``: whether ``generate`` takes
    :attr:`GenerateRequest.prompt_embeds` (the worker answers 400 otherwise);
    ``accepts_media``: whether it takes :attr:`GenerateRequest.media` (the
    same).
    """

    name: str = "base"
    model_name: str = ""
    block_size: int = 16
    context_length: int | None = None
    accepts_prompt_embeds: bool = False
    accepts_media: bool = False
    kv_event_sink: KvEventSink | None = None

    @abc.abstractmethod
    async def start(self) -> None:
        """Load weights / start the step loop."""

    @abc.abstractmethod
    async def stop(self) -> None:
        """Stop the step loop; pending generations end with ``abort``."""

    @abc.abstractmethod
    def generate(self, request: GenerateRequest) -> AsyncIterator[EngineOutput]:
        """Serve ``request``; yields outputs until one carries a finish reason.

        Raises:
            EngineError: the request cannot be served by this engine.
        """

    @abc.abstractmethod
    async def abort(self, request_id: str) -> None:
        """Stop generating for ``request_id``; its iterator ends with ``abort``."""

    @abc.abstractmethod
    def kv_stats(self) -> KvStats:
        """Current KV cache occupancy and queue lengths."""

    def kv_tier_metrics(self) -> KvTierMetrics | None:
        """Counters of the engine's host/disk KV tiers (:mod:`kvflow.workers.kv.tiers`); None
        when it has none (the default)."""
        return None

    def spec_decode_metrics(self) -> SpecDecodeMetrics | None:
        """Speculative decoding counters (draft, accepted tokens, verify steps); None when
        the engine does not speculate (the default)."""
        return None

    def emit_kv_events(self, events: list[KvEvent]) -> None:
        """Forward one step's KV events to the sink, if one is attached."""
        if events and self.kv_event_sink is not None:
            self.kv_event_sink(events)
