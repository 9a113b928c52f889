"""The bridge's view of live workers, built from the workers topic.

The bridge answers ``/v1/models``, 404 (unknown model) and 503 (no live
worker) without asking the router: it folds every heartbeat into the same
workers projection the router and ``kvflow status`` use
(:class:`kvflow.streams.workers.Workers`), whose views carry each worker's
advertised tokenizer spec and context length, and remembers every model
seen. :func:`~kvflow.streams.workers.follow_workers` is the consumer loop
that feeds it. A LoRA adapter listed by a live worker is served as a model
of its own name (:meth:`WorkerRegistry.lora_base` gives its base model), as
vLLM serves adapters.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from enum import Enum

from kvflow.schemas import GENERATION_ROLES, IMAGE_ROLES, WorkerHeartbeat, WorkerRole, now_ms
from kvflow.streams.workers import Workers, WorkerView

__all__ = ["ModelState", "WorkerRegistry"]


class ModelState(str, Enum):
    """Whether the bridge can send a request for a model right now.

    ``serving``: at least one serving worker. ``unavailable``: the model was
    seen (some worker served it since this bridge started) but none serves it
    now → 503. ``unknown``: never seen → 404.
    """

    serving = "serving"
    unavailable = "unavailable"
    unknown = "unknown"


@dataclass
class WorkerRegistry:
    """Live workers (:attr:`workers`) and every model seen.

    ``clock`` returns epoch ms; workers silent longer than their ``ttl_ms``
    are expired lazily on every read, so answers never rely on a timer task.
    ``models_seen`` maps model → epoch seconds of its first heartbeat (the
    ``created`` field of ``/v1/models``).
    """

    clock: Callable[[], int] = now_ms
    workers: Workers = field(default_factory=Workers)
    models_seen: dict[str, int] = field(default_factory=dict)
    last_tokenizer: dict[str, str] = field(default_factory=dict)
    """Model → the tokenizer spec its generation workers last advertised (kept
    after they stop: a pool scaled to zero is tokenized as it was served)."""

    def apply(self, hb: WorkerHeartbeat) -> None:
        """Fold one heartbeat in (stale ones are ignored, ``stopped`` removes)."""
        self.workers.apply(hb)
        self.models_seen.setdefault(hb.model, hb.ts_ms // 1000)
        if hb.role is not WorkerRole.embedding and hb.tokenizer:
            self.last_tokenizer[hb.model] = hb.tokenizer

    def live_workers(self) -> list[WorkerView]:
        """Serving workers after expiring the silent ones, sorted by id."""
        self.workers.expire(self.clock())
        return self.workers.serving()

    def models(self) -> list[str]:
        """Models and LoRA adapters with at least one live serving worker, sorted."""
        live = self.live_workers()
        return sorted({w.model for w in live} | {a for w in live for a in w.lora_adapters})

    def lora_base(self, name: str) -> str | None:
        """The base model of LoRA adapter ``name`` when a live worker lists it and no live
        worker serves ``name`` as a model of its own; else None."""
        live = self.live_workers()
        if any(w.model == name for w in live):
            return None
        return self.workers.lora_base(name)

    def model_state(self, model: str, *, embedding: bool = False, image: bool = False) -> ModelState:
        """See :class:`ModelState`; ``serving`` counts generation workers, or
        embedding workers with ``embedding``, or with ``image`` a live worker
        of each image stage (conditioning and diffusion)."""
        live = [w for w in self.live_workers() if w.model == model]
        if image:
            serving = {w.role for w in live} >= IMAGE_ROLES
        else:
            serving = any(w.role is WorkerRole.embedding if embedding else w.role in GENERATION_ROLES for w in live)
        if serving:
            return ModelState.serving
        return ModelState.unavailable if model in self.models_seen else ModelState.unknown

    def embedding_only(self, model: str) -> bool:
        """Whether ``model`` is served, by embedding workers only (no text generation)."""
        roles = {w.role for w in self.live_workers() if w.model == model}
        return WorkerRole.embedding in roles and not any(role.generates for role in roles)

    def media_tokens(self, model: str) -> int | None:
        """Placeholder tokens per media item of ``model``'s requests: what its live
        encode workers advertise (the lowest worker id wins if they disagree);
        None when no encode worker serves it (the model takes no media)."""
        for w in self.live_workers():
            if w.model == model and w.role is WorkerRole.encode and w.media_tokens:
                return w.media_tokens
        return None

    def image_only(self, model: str) -> bool:
        """Whether ``model`` is served, by image stage workers only (no text generation)."""
        roles = {w.role for w in self.live_workers() if w.model == model}
        return bool(roles) and roles <= IMAGE_ROLES

    def embedding_workers(self, model: str) -> list[WorkerView]:
        """Live embedding workers of ``model``, sorted by id."""
        return [w for w in self.live_workers() if w.model == model and w.role is WorkerRole.embedding]

    def stage_workers(self, model: str, role: WorkerRole) -> list[WorkerView]:
        """Live workers of ``model`` in image stage ``role``, sorted by id."""
        return [w for w in self.live_workers() if w.model == model and w.role is role]

    def image_models(self) -> list[str]:
        """Models with a live worker in every image stage, sorted."""
        live = self.live_workers()
        return sorted(m for m in {w.model for w in live}
                      if {w.role for w in live if w.model == m} >= IMAGE_ROLES)

    def tokenizer_spec(self, model: str) -> str | None:
        """The tokenizer spec advertised by ``model``'s live generation workers
        (the lowest worker id wins if they disagree), or None if none is live."""
        for w in self.live_workers():
            if w.model == model and w.role.generates:
                return w.tokenizer
        return None

    def context_length(self, model: str) -> int | None:
        """The context length (tokens) a request for ``model`` must fit: the
        smallest one its live serving workers advertise (the router may pick
        any of them), or None if none advertises one."""
        lengths = [w.context_length for w in self.live_workers()
                   if w.model == model and w.context_length is not None and w.role.generates]
        return min(lengths, default=None)
