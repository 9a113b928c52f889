"""A local diffusers pipeline directory split across the two stages.

The text stage loads only the directory's ``tokenizer/`` and
``text_encoder/`` (their classes named in ``model_index.json``, as diffusers
loads them) and encodes a prompt as Stable Diffusion does: padded to the
tokenizer's ``model_max_length``, truncated there, the text encoder's last
hidden state; the empty prompt likewise, for classifier-free guidance.

The image stage loads the pipeline without its text encoder and tokenizer
(``DiffusionPipeline.from_pretrained(..., text_encoder=None,
tokenizer=None)``) and calls it with ``prompt_embeds`` and
``negative_prompt_embeds``, which Stable Diffusion 1.x/2.x pipelines accept.
Defaults are Stable Diffusion's: 50 steps, guidance 7.5, and the UNet's
sample size times the VAE's scale factor.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from kvflow.workers.images.models import Encoded, GenerationParams

__all__ = ["PipelineTextEncoder", "PipelineDenoiser"]

DEFAULT_STEPS = 50
"""Denoising steps when a request sets none (``StableDiffusionPipeline.__call__``'s default)."""

DEFAULT_GUIDANCE_SCALE = 7.5
"""Classifier-free guidance weight when a request sets none (``StableDiffusionPipeline.__call__``'s default)."""


def _component(path: Path, name: str) -> Any:
    """The class that ``model_index.json`` names for component ``name``.

    Raises:
        ValueError: the directory has no such component.
    """
    index = json.loads((path / "model_index.json").read_text())
    library, class_name = (index.get(name) or [None, None])[:2]
    if library is None or class_name is None:
        raise ValueError(f"{path} has no {name} component (model_index.json)")
    module = __import__(library, fromlist=[class_name])
    return getattr(module, class_name)


@dataclass
class PipelineTextEncoder:
    """The directory's tokenizer and text encoder (see module doc)."""

    tok: Any
    model: Any
    tokenizer: str
    max_tokens: int
    device: str = "cpu"

    @classmethod
    def load(cls, path: Path, device: str = "cpu") -> "PipelineTextEncoder":
        """Load ``path/tokenizer`` and ``path/text_encoder`` (local files only).

        Raises:
            ValueError: a component is missing.
            OSError: its files cannot be read.
        """
        tok = _component(path, "tokenizer").from_pretrained(path / "tokenizer", local_files_only=True)
        model = _component(path, "text_encoder").from_pretrained(path / "text_encoder", local_files_only=True)
        return cls(tok=tok, model=model.to(device).eval(), tokenizer=str(path / "tokenizer"),
                   max_tokens=int(tok.model_max_length), device=device)

    def _embed(self, text: str) -> np.ndarray:
        import torch

        inputs = self.tok(text, padding="max_length", max_length=self.max_tokens, truncation=True,
                          return_tensors="pt")
        mask = inputs.attention_mask if getattr(self.model.config, "use_attention_mask", False) else None
        with torch.inference_mode():
            hidden = self.model(inputs.input_ids.to(self.device),
                                attention_mask=None if mask is None else mask.to(self.device))[0]
        return hidden[0].float().cpu().numpy()

    def encode(self, prompt: str) -> Encoded:
        """``[model_max_length, hidden]`` for the prompt and for the empty prompt."""
        tokens = len(self.tok(prompt).input_ids)
        return Encoded(prompt_embeds=self._embed(prompt), negative_prompt_embeds=self._embed(""),
                       prompt_tokens=tokens)


@dataclass
class PipelineDenoiser:
    """The directory's pipeline without its text side (see module doc)."""

    pipe: Any
    default_size: tuple[int, int]
    device: str = "cpu"
    default_steps: int = DEFAULT_STEPS
    default_guidance_scale: float = DEFAULT_GUIDANCE_SCALE

    @classmethod
    def load(cls, path: Path, device: str = "cpu") -> "PipelineDenoiser":
        """Load the pipeline at ``path`` (local files only) without text encoder and tokenizer.

        Raises:
            ImportError: diffusers is not installed.
            OSError, ValueError: the directory is not a loadable pipeline.
        """
        from diffusers import DiffusionPipeline

        pipe = DiffusionPipeline.from_pretrained(path, text_encoder=None, tokenizer=None, local_files_only=True)
        pipe = pipe.to(device)
        pipe.set_progress_bar_config(disable=True)
        side = int(pipe.unet.config.sample_size) * int(getattr(pipe, "vae_scale_factor", 8))
        return cls(pipe=pipe, default_size=(side, side), device=device)

    def generate(self, encoded: Encoded, params: GenerationParams) -> np.ndarray:
        """``[n, height, width, 3]`` uint8 from the pipeline's ``np`` output (floats in [0, 1])."""
        import torch

        dtype = self.pipe.unet.dtype

        def tensor(a: np.ndarray | None) -> Any:
            return None if a is None else torch.from_numpy(np.asarray(a))[None].to(self.device, dtype)

        out = self.pipe(prompt_embeds=tensor(encoded.prompt_embeds),
                        negative_prompt_embeds=tensor(encoded.negative_prompt_embeds),
                        height=params.height, width=params.width, num_inference_steps=params.steps,
                        guidance_scale=params.guidance_scale, num_images_per_prompt=params.n,
                        generator=torch.Generator("cpu").manual_seed(params.seed), output_type="np")
        return (np.asarray(out.images) * 255).round().clip(0, 255).astype(np.uint8)
