"""What each image stage runs: a :class:`TextEncoder` (text stage) or a
:class:`Denoiser` (image stage), loaded for a model spec
(:func:`kvflow.models.image.resolve_image_model`), and the PNG encoding of
their output.

Two implementations of each: the built-in tiny pipeline
(:mod:`kvflow.workers.images.tiny`) and a local diffusers directory
(:mod:`kvflow.workers.images.pipeline`). Both text encoders give
``[seq_len, hidden]`` float32 arrays and both denoisers give ``[n, height,
width, 3]`` uint8 RGB arrays, so the stages treat them alike.
"""

from __future__ import annotations

import io
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from kvflow.models.image import resolve_image_model

__all__ = ["ImageModelError", "Encoded", "GenerationParams", "TextEncoder", "Denoiser", "to_png",
           "load_text_encoder", "load_denoiser"]


class ImageModelError(ValueError):
    """A request the model cannot serve as asked (the client's mistake: HTTP
    400); ``param`` names the request field at fault."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


@dataclass(frozen=True)
class Encoded:
    """A prompt encoded for the denoiser: ``prompt_embeds`` ``[seq_len,
    hidden]`` float32; ``negative_prompt_embeds`` the same for the empty
    prompt when the model uses classifier-free guidance (else None);
    ``prompt_tokens`` the prompt's tokens before padding or truncation."""

    prompt_embeds: np.ndarray
    negative_prompt_embeds: np.ndarray | None
    prompt_tokens: int


@dataclass(frozen=True)
class GenerationParams:
    """One request's generation settings, defaults already applied: ``n``
    images of ``width`` x ``height`` pixels, ``steps`` denoising steps,
    ``guidance_scale`` (classifier-free guidance weight; ignored by a model
    without guidance), noise from ``seed``."""

    n: int
    width: int
    height: int
    steps: int
    guidance_scale: float
    seed: int


class TextEncoder(Protocol):
    """The text stage's model. ``tokenizer`` names its tokenizer (advertised
    in heartbeats); ``max_tokens`` is the longest prompt it encodes whole."""

    tokenizer: str
    max_tokens: int

    def encode(self, prompt: str) -> Encoded:
        """Encode one prompt (see :class:`Encoded`)."""


class Denoiser(Protocol):
    """The image stage's model, with its defaults for what a request leaves unset:
    ``default_size`` (width, height) in pixels, ``default_steps``, ``default_guidance_scale``."""

    default_size: tuple[int, int]
    default_steps: int
    default_guidance_scale: float

    def generate(self, encoded: Encoded, params: GenerationParams) -> np.ndarray:
        """``params.n`` images as ``[n, height, width, 3]`` uint8 RGB.

        Raises:
            ImageModelError: the size (or another setting) does not suit the model.
        """


def to_png(pixels: np.ndarray) -> bytes:
    """One ``[height, width, 3]`` uint8 RGB image as PNG file bytes (Pillow; no metadata, so
    equal pixels give equal bytes)."""
    from PIL import Image

    buf = io.BytesIO()
    Image.fromarray(np.ascontiguousarray(pixels, dtype=np.uint8)).save(buf, format="PNG")
    return buf.getvalue()


def load_text_encoder(model: str, *, device: str = "cpu", tokenizer: str | None = None) -> TextEncoder:
    """The text stage's model for ``model`` (a spec of
    :func:`~kvflow.models.image.resolve_image_model`). ``tokenizer`` is the
    tiny pipeline's tokenizer spec (:func:`kvflow.models.tokenizer.load_tokenizer`;
    default ``SmolLM2-135M-Instruct``); a diffusers directory uses its own.

    Raises:
        kvflow.models.resolve.ModelNotFoundError: unknown spec.
        ImportError: diffusers (or the tokenizer's files) is not installed.
    """
    resolved = resolve_image_model(model)
    if resolved.tiny:
        from kvflow.workers.images.tiny import TinyTextEncoder

        return TinyTextEncoder.load(tokenizer or "SmolLM2-135M-Instruct")
    from kvflow.workers.images.pipeline import PipelineTextEncoder

    return PipelineTextEncoder.load(resolved.path, device)


def load_denoiser(model: str, *, device: str = "cpu") -> Denoiser:
    """The image stage's model for ``model`` (see :func:`load_text_encoder`).

    Raises:
        kvflow.models.resolve.ModelNotFoundError: unknown spec.
        ImportError: diffusers is not installed (``pip install 'kvflow[images]'``).
    """
    resolved = resolve_image_model(model)
    if resolved.tiny:
        from kvflow.workers.images.tiny import TinyDenoiser

        return TinyDenoiser.build(device)
    from kvflow.workers.images.pipeline import PipelineDenoiser

    return PipelineDenoiser.load(resolved.path, device)
