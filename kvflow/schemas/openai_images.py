"""HTTP bodies of ``POST /v1/images/generations`` (the OpenAI Images API).

Request fields follow the OpenAI Images API reference; ``seed``,
``num_inference_steps``, ``guidance_scale`` and ``timeout_s`` are kvflow
extensions. Images are returned as base64 PNG (``b64_json``); a request
for ``response_format: url`` or another ``output_format`` is refused, as
the bridge keeps no files to link to. Fields the API defines for other
models (``quality``, ``style``, ``background``, ...) are ignored.
"""

from __future__ import annotations

import re
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from kvflow.schemas.images import (
    IMAGE_SIDE_MULTIPLE,
    MAX_IMAGE_PROMPT_CHARS,
    MAX_IMAGE_SIDE,
    MAX_IMAGES_PER_REQUEST,
    MAX_INFERENCE_STEPS,
    MAX_SEED,
)
from kvflow.schemas.requests import MAX_TIMEOUT_S

__all__ = ["ImagesRequest", "ImageData", "ImagesKvflowInfo", "ImagesResponse", "parse_size"]

_SIZE = re.compile(r"^([1-9][0-9]{0,4})x([1-9][0-9]{0,4})$")


def parse_size(size: str) -> tuple[int, int] | None:
    """``"WxH"`` → ``(width, height)`` in pixels; ``"auto"`` → None (the model's own size).

    Raises:
        ValueError: not ``WxH`` or ``auto``, or a side outside
            [:data:`IMAGE_SIDE_MULTIPLE`, :data:`MAX_IMAGE_SIDE`] or not a
            multiple of :data:`IMAGE_SIDE_MULTIPLE`.
    """
    if size == "auto":
        return None
    match = _SIZE.match(size)
    if match is None:
        raise ValueError(f"size must be WIDTHxHEIGHT in pixels (e.g. 64x64) or auto, not {size!r}")
    width, height = int(match[1]), int(match[2])
    for side in (width, height):
        if not IMAGE_SIDE_MULTIPLE <= side <= MAX_IMAGE_SIDE or side % IMAGE_SIDE_MULTIPLE:
            raise ValueError(f"size {size}: each side must be a multiple of {IMAGE_SIDE_MULTIPLE} from "
                             f"{IMAGE_SIDE_MULTIPLE} to {MAX_IMAGE_SIDE} pixels")
    return width, height


class ImagesRequest(BaseModel):
    """POST /v1/images/generations body.

    ``model`` may be left out when exactly one image model is served.
    ``size`` is ``WIDTHxHEIGHT`` in pixels (multiples of 8, at most 2048)
    or ``auto`` (the model's own size, also the default). ``seed``
    (extension) makes the images reproducible: equal bodies with equal
    seeds give equal images; without one the bridge draws a seed, which
    the answer's ``kvflow.seed`` reports. ``num_inference_steps`` and
    ``guidance_scale`` (extensions) default to the model's own.
    """

    model_config = ConfigDict(extra="ignore")
    prompt: str = Field(min_length=1, max_length=MAX_IMAGE_PROMPT_CHARS)
    model: str | None = Field(default=None, min_length=1)
    n: int = Field(default=1, ge=1, le=MAX_IMAGES_PER_REQUEST)
    size: str = Field(default="auto", max_length=16, examples=["64x64"])
    response_format: Literal["b64_json", "url"] | None = None
    """Only ``b64_json`` is served (None means it too); ``url`` is refused (400)."""
    output_format: Literal["png", "jpeg", "webp"] | None = None
    """Only ``png`` is served (None means it too); others are refused (400)."""
    user: str | None = None
    seed: int | None = Field(default=None, ge=0, le=MAX_SEED)
    num_inference_steps: int | None = Field(default=None, ge=1, le=MAX_INFERENCE_STEPS)
    guidance_scale: float | None = Field(default=None, ge=0.0, le=100.0)
    timeout_s: float | None = Field(default=None, gt=0, le=MAX_TIMEOUT_S)
    """kvflow extension: seconds from arrival to the request's deadline, as
    on chat completions (also the ``X-Request-Timeout`` header)."""

    @field_validator("size")
    @classmethod
    def _size(cls, value: str) -> str:
        parse_size(value)
        return value

    def dimensions(self) -> tuple[int, int] | None:
        """``(width, height)`` in pixels, or None for the model's own size."""
        return parse_size(self.size)


class ImageData(BaseModel):
    """One generated image: its PNG file, base64."""

    b64_json: str
    revised_prompt: str | None = None


class ImagesKvflowInfo(BaseModel):
    """kvflow extension of the answer: what made the images (``seed``,
    ``num_inference_steps``), their ``width``/``height`` in pixels, and
    the workers of each stage."""

    seed: int
    num_inference_steps: int
    width: int
    height: int
    prompt_tokens: int
    diffusion_worker_id: str


class ImagesResponse(BaseModel):
    """POST /v1/images/generations answer (``created``: epoch seconds)."""

    created: int
    data: list[ImageData]
    output_format: Literal["png"] = "png"
    size: str
    kvflow: ImagesKvflowInfo
