"""The built-in tiny image pipeline: built at start from fixed seeds, no files.

Text stage (:class:`TinyTextEncoder`): the prompt's token ids (a kvflow
tokenizer, SmolLM2's by default), truncated to :data:`TINY_MAX_TOKENS`, look
up rows of a ``[vocab, TINY_HIDDEN]`` table of standard normal values drawn
from :data:`TINY_WEIGHTS_SEED`: a text encoder with no training, but
deterministic, and different prompts give different conditioning.

Image stage (:class:`TinyDenoiser`): a diffusers ``UNet2DConditionModel``
of about 1M parameters, randomly initialised from :data:`TINY_WEIGHTS_SEED`,
denoising directly in RGB pixel space (no VAE), cross-attending to the
conditioning, under a DDIM scheduler (Song et al. 2020, "Denoising Diffusion
Implicit Models", deterministic with eta = 0) over the default 1000
training timesteps. Output is noise shaped by an untrained network, seeded:
equal inputs give equal pixels. No classifier-free guidance.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from kvflow.workers.images.models import Encoded, GenerationParams, ImageModelError

__all__ = ["TINY_HIDDEN", "TINY_MAX_TOKENS", "TINY_WEIGHTS_SEED", "TINY_MAX_SIDE", "TinyTextEncoder",
           "TinyDenoiser"]

TINY_HIDDEN = 32
"""Width of the conditioning (the UNet's cross-attention dimension)."""

TINY_MAX_TOKENS = 77
"""Longest prompt encoded, tokens (the CLIP text encoder's context, which Stable Diffusion uses)."""

TINY_WEIGHTS_SEED = 0
"""Seed of the tiny pipeline's weights (embedding table and UNet)."""

TINY_MAX_SIDE = 256
"""Largest width or height the tiny pipeline renders, pixels (it runs in
pixel space on a CPU: cost grows with the pixel count)."""


@dataclass
class TinyTextEncoder:
    """Token ids → rows of a fixed random table (see module doc).

    ``table`` is ``[vocab, TINY_HIDDEN]`` float32; ``tokenizer`` the spec
    the ids come from; ``encode_ids`` its ``encode_prompt``.
    """

    table: np.ndarray
    tokenizer: str
    encode_ids: Any
    max_tokens: int = TINY_MAX_TOKENS

    @classmethod
    def load(cls, tokenizer: str) -> "TinyTextEncoder":
        """Load ``tokenizer`` (:func:`kvflow.models.tokenizer.load_tokenizer`) and draw the table.

        Raises:
            kvflow.models.resolve.ModelNotFoundError: the tokenizer cannot be found.
        """
        from kvflow.models.tokenizer import load_tokenizer

        tok = load_tokenizer(tokenizer)
        rng = np.random.default_rng(TINY_WEIGHTS_SEED)
        table = rng.standard_normal((tok.vocab_size, TINY_HIDDEN), dtype=np.float32)
        return cls(table=table, tokenizer=tokenizer, encode_ids=tok.encode_prompt)

    def encode(self, prompt: str) -> Encoded:
        """``[min(tokens, TINY_MAX_TOKENS), TINY_HIDDEN]`` rows; a prompt with no tokens gets row 0.

        Ids beyond the table (added special tokens) wrap around.
        """
        ids = list(self.encode_ids(prompt))
        rows = np.asarray(ids[:self.max_tokens] or [0]) % self.table.shape[0]
        return Encoded(prompt_embeds=self.table[rows], negative_prompt_embeds=None, prompt_tokens=len(ids))


@dataclass
class TinyDenoiser:
    """A random ``UNet2DConditionModel`` in RGB pixel space under DDIM (see module doc)."""

    unet: Any
    device: str = "cpu"
    default_size: tuple[int, int] = (64, 64)
    default_steps: int = 3
    default_guidance_scale: float = 1.0

    @classmethod
    def build(cls, device: str = "cpu") -> "TinyDenoiser":
        """Build the UNet from :data:`TINY_WEIGHTS_SEED` (the global torch RNG is left as it was).

        Raises:
            ImportError: diffusers is not installed.
        """
        import torch
        from diffusers import UNet2DConditionModel

        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(TINY_WEIGHTS_SEED)
            unet = UNet2DConditionModel(
                sample_size=64, in_channels=3, out_channels=3, layers_per_block=1, block_out_channels=(32, 64),
                down_block_types=("DownBlock2D", "CrossAttnDownBlock2D"),
                up_block_types=("CrossAttnUpBlock2D", "UpBlock2D"),
                cross_attention_dim=TINY_HIDDEN, attention_head_dim=8, norm_num_groups=32)
        return cls(unet=unet.to(device).eval(), device=device)

    def generate(self, encoded: Encoded, params: GenerationParams) -> np.ndarray:
        """``[n, height, width, 3]`` uint8: DDIM from seeded Gaussian noise, clipped to [-1, 1], scaled to 0..255.

        Raises:
            ImageModelError: a side over :data:`TINY_MAX_SIDE`, or conditioning
                not ``TINY_HIDDEN`` wide (another model's records).
        """
        import torch
        from diffusers import DDIMScheduler

        if max(params.width, params.height) > TINY_MAX_SIDE:
            raise ImageModelError(f"the tiny pipeline renders at most {TINY_MAX_SIDE}x{TINY_MAX_SIDE} pixels, "
                                  f"not {params.width}x{params.height}", param="size")
        cond = torch.from_numpy(np.asarray(encoded.prompt_embeds, dtype=np.float32))
        if cond.ndim != 2 or cond.shape[1] != TINY_HIDDEN:
            raise ImageModelError(f"conditioning of shape {tuple(cond.shape)} is not [seq_len, {TINY_HIDDEN}]")
        scheduler = DDIMScheduler()
        scheduler.set_timesteps(params.steps)
        generator = torch.Generator("cpu").manual_seed(params.seed)
        sample = torch.randn((params.n, 3, params.height, params.width), generator=generator)
        sample = (sample * scheduler.init_noise_sigma).to(self.device)
        context = cond.to(self.device).unsqueeze(0).expand(params.n, -1, -1)
        # One intra-op thread on the CPU: the tensors are too small to split, and on a busy
        # 2-core machine two threads took 10 s for what one did in 0.3 s (spinning workers).
        # The setting is the calling thread's (OpenMP), so it is restored after.
        threads = torch.get_num_threads()
        if self.device == "cpu":
            torch.set_num_threads(1)
        try:
            with torch.inference_mode():
                for t in scheduler.timesteps:
                    noise = self.unet(scheduler.scale_model_input(sample, t), t, encoder_hidden_states=context).sample
                    sample = scheduler.step(noise, t, sample).prev_sample
        finally:
            torch.set_num_threads(threads)
        pixels = ((sample.clamp(-1, 1) + 1) * 127.5).round().to(torch.uint8)
        return pixels.permute(0, 2, 3, 1).cpu().numpy()
