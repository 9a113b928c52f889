"""The two stages of image generation, one input record → one output record each.

:class:`ConditioningStage` (text stage): :class:`~kvflow.schemas.ImageRequest`
→ :class:`~kvflow.schemas.ImageConditioning` for the diffusion slot the
request names. :class:`DiffusionStage` (image stage):
:class:`~kvflow.schemas.ImageConditioning` →
:class:`~kvflow.schemas.ImageResult` for the request's ``reply_to``. A
request that fails in either stage is answered at once with an error
result on its ``reply_to`` (it goes no further). No Kafka here: the stage
worker (:mod:`kvflow.workers.images.stage_worker`) sends what :meth:`run`
returns, and a replay calls :meth:`DiffusionStage.render` directly.

``run`` is blocking (a model forward pass): call it in a thread.
"""

from __future__ import annotations

import base64
import logging
from dataclasses import dataclass
from typing import ClassVar

import numpy as np

from kvflow.schemas import (
    ErrorInfo,
    ImageConditioning,
    ImageRequest,
    ImageResult,
    Record,
    Timings,
    deadline_exceeded,
    now_ms,
)
from kvflow.schemas.prompt_embeds import PromptEmbeds
from kvflow.workers.images.models import Denoiser, Encoded, GenerationParams, ImageModelError, TextEncoder, to_png

__all__ = ["Output", "ConditioningStage", "DiffusionStage", "embeds_record", "embeds_array"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Output:
    """Where a stage's output record goes: ``topic`` and ``partition``; its key is the request id."""

    topic: str
    partition: int
    record: Record

    @property
    def key(self) -> str:
        """The record's Kafka key: its request id."""
        return self.record.request_id  # type: ignore[attr-defined]


def embeds_record(array: np.ndarray) -> PromptEmbeds:
    """A ``[seq_len, hidden]`` float32 array as a record field (little-endian bytes, base64)."""
    a = np.ascontiguousarray(array, dtype="<f4")
    return PromptEmbeds.of(a.tobytes(), (a.shape[0], a.shape[1]), "float32")


def embeds_array(embeds: PromptEmbeds) -> np.ndarray:
    """The ``[seq_len, hidden]`` float32 array of a record field."""
    dtype = {"float32": "<f4", "float16": "<f2"}.get(embeds.dtype)
    if dtype is None:
        raise ImageModelError(f"conditioning of dtype {embeds.dtype} is not supported")
    return np.frombuffer(embeds.raw(), dtype=dtype).reshape(embeds.shape).astype(np.float32)


def _failed(request: ImageRequest, model: str, worker_id: str, exc: BaseException) -> ImageResult:
    """The error result of a request that raised ``exc`` in a stage."""
    if isinstance(exc, ImageModelError):
        error = ErrorInfo(message=str(exc), type="invalid_request_error", code="invalid_value", status=400,
                          param=exc.param)
    else:
        log.error("image request %s failed: %r", request.request_id, exc, exc_info=exc)
        error = ErrorInfo(message=f"internal error: {exc!r}", code="worker_error")
    return ImageResult(request_id=request.request_id, model=model, worker_id=worker_id, error=error)


def _refused(request: ImageRequest, model: str, worker_id: str) -> ImageResult | None:
    """The error result of a request this worker must not serve (another
    model, or past its deadline), else None."""
    base = {"request_id": request.request_id, "model": model, "worker_id": worker_id}
    if request.model != model:
        return ImageResult(**base, error=ErrorInfo(
            message=f"this worker serves {model}, not {request.model}", type="invalid_request_error",
            code="model_not_found", status=404))
    if request.deadline_ms is not None and now_ms() >= request.deadline_ms:
        return ImageResult(**base, error=deadline_exceeded(
            f"Request {request.request_id} reached its worker after its deadline."))
    return None


@dataclass
class ConditioningStage:
    """The text stage: encode the prompt, send the conditioning on to the image stage.

    ``diffusion_topic`` is the image stage's queue topic and
    ``diffusion_partitions`` its partition count (a request naming a
    partition beyond it is refused); ``model`` the served model name
    (requests naming another are refused).
    """

    encoder: TextEncoder
    model: str
    worker_id: str
    diffusion_topic: str
    diffusion_partitions: int
    input_schema: ClassVar[type[Record]] = ImageRequest

    def run(self, request: ImageRequest) -> Output:
        """The conditioning for ``request.diffusion_partition``, or an error result for ``request.reply_to``."""
        reply = (request.reply_to.topic, request.reply_to.partition)
        refused = _refused(request, self.model, self.worker_id)
        if refused is None and request.diffusion_partition >= self.diffusion_partitions:
            refused = _failed(request, self.model, self.worker_id, ImageModelError(
                f"diffusion_partition {request.diffusion_partition} is not a partition of {self.diffusion_topic} "
                f"({self.diffusion_partitions})", param="diffusion_partition"))
        if refused is not None:
            return Output(*reply, refused)
        try:
            encoded = self.encoder.encode(request.prompt)
        except Exception as exc:  # noqa: BLE001 - answer the request, never kill the worker
            return Output(*reply, _failed(request, self.model, self.worker_id, exc))
        negative = encoded.negative_prompt_embeds
        record = ImageConditioning(
            request=request, prompt_embeds=embeds_record(encoded.prompt_embeds),
            negative_prompt_embeds=None if negative is None else embeds_record(negative),
            prompt_tokens=encoded.prompt_tokens, worker_id=self.worker_id, encoded_ms=now_ms())
        return Output(self.diffusion_topic, request.diffusion_partition, record)


@dataclass
class DiffusionStage:
    """The image stage: denoise the request's images and answer with them as PNGs."""

    denoiser: Denoiser
    model: str
    worker_id: str
    input_schema: ClassVar[type[Record]] = ImageConditioning

    def params(self, request: ImageRequest) -> GenerationParams:
        """``request``'s settings with the denoiser's defaults for those it leaves unset."""
        d = self.denoiser
        return GenerationParams(
            n=request.n, width=request.width or d.default_size[0], height=request.height or d.default_size[1],
            steps=request.num_inference_steps or d.default_steps,
            guidance_scale=d.default_guidance_scale if request.guidance_scale is None else request.guidance_scale,
            seed=request.seed)

    def render(self, conditioning: ImageConditioning) -> ImageResult:
        """The images of one recorded conditioning, whatever its deadline (a
        replay calls this); failures become an error result, never an exception."""
        request = conditioning.request
        started = now_ms()
        try:
            params = self.params(request)
            negative = conditioning.negative_prompt_embeds
            encoded = Encoded(prompt_embeds=embeds_array(conditioning.prompt_embeds),
                              negative_prompt_embeds=None if negative is None else embeds_array(negative),
                              prompt_tokens=conditioning.prompt_tokens)
            pixels = self.denoiser.generate(encoded, params)
        except Exception as exc:  # noqa: BLE001 - answer the request, never kill the worker
            return _failed(request, self.model, self.worker_id, exc)
        images = [base64.b64encode(to_png(p)).decode("ascii") for p in pixels]
        return ImageResult(request_id=request.request_id, model=self.model, images=images, width=params.width,
                           height=params.height, seed=params.seed, num_inference_steps=params.steps,
                           prompt_tokens=conditioning.prompt_tokens, worker_id=self.worker_id,
                           timings=Timings(queued_ms=conditioning.encoded_ms, started_ms=started,
                                           finished_ms=now_ms()))

    def run(self, conditioning: ImageConditioning) -> Output:
        """The result of ``conditioning`` (or its refusal) for the request's ``reply_to``."""
        request = conditioning.request
        reply = (request.reply_to.topic, request.reply_to.partition)
        refused = _refused(request, self.model, self.worker_id)
        return Output(*reply, refused if refused is not None else self.render(conditioning))
