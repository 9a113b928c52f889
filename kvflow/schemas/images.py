"""Records of the multi-stage image pipeline (``/v1/images/generations``).

Two stages, each a pool of workers reading its own queue topic (partition
= worker slot), connected by records:

1. ``queue.conditioning`` holds :class:`ImageRequest` records. A
   *conditioning* worker (the text stage) tokenizes and encodes the prompt
   and writes one :class:`ImageConditioning` to the diffusion slot the
   request names.
2. ``queue.diffusion`` holds :class:`ImageConditioning` records. A
   *diffusion* worker (the image stage) runs the denoising loop and writes
   one :class:`~kvflow.schemas.responses.ImageResult` (base64 PNGs) to the
   request's ``reply_to`` on the responses topic.

Every input a stage needs is in its input record, the seed included, so a
stage can be re-run alone from its recorded inputs and give the same
images (:mod:`kvflow.replay.images`).
"""

from __future__ import annotations

from pydantic import Field

from kvflow.schemas.base import Record
from kvflow.schemas.prompt_embeds import PromptEmbeds
from kvflow.schemas.requests import ReplyTo

__all__ = ["MAX_IMAGES_PER_REQUEST", "MAX_IMAGE_SIDE", "IMAGE_SIDE_MULTIPLE", "MAX_IMAGE_PROMPT_CHARS",
           "MAX_SEED", "MAX_INFERENCE_STEPS", "ImageRequest", "ImageConditioning"]

MAX_IMAGES_PER_REQUEST = 10
"""Most images one request may ask for (``n``; the OpenAI Images API's limit)."""

MAX_IMAGE_SIDE = 2048
"""Largest width or height of an image, pixels."""

IMAGE_SIDE_MULTIPLE = 8
"""Widths and heights are multiples of this (a Stable Diffusion VAE downsamples by 8)."""

MAX_IMAGE_PROMPT_CHARS = 32000
"""Longest prompt, characters (the OpenAI Images API's limit for its largest model)."""

MAX_SEED = 2**63 - 1
"""Largest seed (``torch.Generator.manual_seed`` takes any signed 64-bit value; kvflow keeps to non-negative ones)."""

MAX_INFERENCE_STEPS = 500
"""Most denoising steps one request may ask for."""


class ImageRequest(Record):
    """One image generation request: the record on ``queue.conditioning``.

    The producer (the HTTP bridge) picks both stages' workers from their
    heartbeats: the conditioning worker by the partition it writes this
    record to, the diffusion worker by ``diffusion_partition``, which the
    conditioning worker writes its output to.

    ``width``/``height`` are pixels (None: the model's own size);
    ``num_inference_steps``/``guidance_scale`` None take the model's
    defaults. ``seed`` seeds the initial noise of all ``n`` images (one
    generator, drawn in order), so equal inputs give equal images. Times are
    epoch ms; a stage drops a request already past ``deadline_ms``.
    """

    request_id: str = Field(min_length=1, max_length=256)
    model: str = Field(min_length=1)
    prompt: str = Field(min_length=1, max_length=MAX_IMAGE_PROMPT_CHARS)
    n: int = Field(default=1, ge=1, le=MAX_IMAGES_PER_REQUEST)
    width: int | None = Field(default=None, ge=IMAGE_SIDE_MULTIPLE, le=MAX_IMAGE_SIDE, multiple_of=IMAGE_SIDE_MULTIPLE)
    height: int | None = Field(default=None, ge=IMAGE_SIDE_MULTIPLE, le=MAX_IMAGE_SIDE,
                               multiple_of=IMAGE_SIDE_MULTIPLE)
    seed: int = Field(ge=0, le=MAX_SEED)
    num_inference_steps: int | None = Field(default=None, ge=1, le=MAX_INFERENCE_STEPS)
    guidance_scale: float | None = Field(default=None, ge=0.0, le=100.0)
    diffusion_partition: int = Field(ge=0)
    reply_to: ReplyTo
    created_ms: int = 0
    deadline_ms: int | None = None


class ImageConditioning(Record):
    """The text stage's output for one request: the record on ``queue.diffusion``.

    ``request`` is the :class:`ImageRequest` as the text stage read it.
    ``prompt_embeds`` is the text encoder's output for the prompt,
    ``[seq_len, hidden]`` (the denoiser's cross-attention input);
    ``negative_prompt_embeds`` the same for the empty prompt, set when the
    model uses classifier-free guidance. ``prompt_tokens`` counts the
    prompt's tokens before padding or truncation. ``worker_id`` is the
    conditioning worker and ``encoded_ms`` (epoch ms) when it finished.
    """

    request: ImageRequest
    prompt_embeds: PromptEmbeds
    negative_prompt_embeds: PromptEmbeds | None = None
    prompt_tokens: int = Field(default=0, ge=0)
    worker_id: str = ""
    encoded_ms: int = 0

    @property
    def request_id(self) -> str:
        """The request's id (the record's Kafka key)."""
        return self.request.request_id
