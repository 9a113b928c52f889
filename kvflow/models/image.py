"""The image model: resolve a spec to the built-in tiny pipeline or a local
diffusers directory.

``tiny-diffusion`` is built at start from fixed seeds, with no files and no
download (:mod:`kvflow.workers.images.tiny`): its images are noise shaped by
a randomly initialised network, which is what tests and a CPU-only
deployment need to exercise the whole pipeline. Any other spec must be a
local directory in diffusers' layout (``model_index.json``; a Stable
Diffusion 1.x/2.x pipeline: ``tokenizer/``, ``text_encoder/``, ``unet/``,
``vae/``, ``scheduler/``). Nothing here touches the network.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from kvflow.models.resolve import ModelNotFoundError

__all__ = ["TINY_IMAGE_MODEL", "ResolvedImageModel", "resolve_image_model"]

TINY_IMAGE_MODEL = "tiny-diffusion"
"""Served name (and spec) of the built-in tiny pipeline."""


@dataclass(frozen=True)
class ResolvedImageModel:
    """An image model spec resolved: the served ``name``, and ``path`` of the
    diffusers directory (None for the tiny pipeline)."""

    name: str
    path: Path | None

    @property
    def tiny(self) -> bool:
        """Whether this is the built-in tiny pipeline."""
        return self.path is None


def resolve_image_model(spec: str) -> ResolvedImageModel:
    """Resolve ``spec``: :data:`TINY_IMAGE_MODEL` (case-insensitive), or the
    path of a local diffusers pipeline directory (its basename becomes the
    served name).

    Raises:
        ModelNotFoundError: ``spec`` is neither, or the directory has no
            ``model_index.json``.
    """
    if spec.lower() == TINY_IMAGE_MODEL:
        return ResolvedImageModel(TINY_IMAGE_MODEL, None)
    path = Path(spec).expanduser()
    if not (path / "model_index.json").is_file():
        raise ModelNotFoundError(f"image model {spec!r} is neither {TINY_IMAGE_MODEL!r} nor a local diffusers "
                                 "pipeline directory (with model_index.json)")
    path = path.resolve()
    return ResolvedImageModel(path.name, path)
