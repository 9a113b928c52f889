"""A small CLIP-style media encoder projected into a language model's embedding space.

No pretrained vision-language weights are needed to run the media path: the
encoder is built here with plain torch, its weights drawn from a seeded
generator, so every encode worker of a deployment built with the same seed,
sizes and hidden size computes the same embeddings for the same bytes.

* :class:`VisionTower` — a CLIP ViT image encoder (Radford et al. 2021,
  "Learning Transferable Visual Models From Natural Language Supervision";
  ViT: Dosovitskiy et al. 2021): a strided convolution cuts the image into
  ``patch_size`` squares, a class token and learned positions are added,
  then a pre-LayerNorm, pre-norm transformer blocks and a final LayerNorm.
  It returns the patch features (class token dropped), as LLaVA feeds them
  to its language model.
* :class:`Projector` — LLaVA-1.5's two-layer GELU MLP ("mlp2x_gelu"; Liu et
  al. 2023, "Improved Baselines with Visual Instruction Tuning") from the
  tower's width to the language model's ``hidden_size``.

:meth:`MediaEncoder.encode` turns media bytes into ``[media_tokens, hidden]``
float32 rows, ``media_tokens = (image_size / patch_size)²``:

* **image** — decoded by Pillow, converted to RGB, resized (bicubic) to
  ``image_size`` square, normalized with CLIP's per-channel mean and std;
* **video** — up to ``video_frames`` frames taken evenly from an animated
  GIF, WebP or PNG (Pillow's decoders; no video container decoder is
  bundled), each encoded as an image, averaged over time;
* **audio** — WAV (PCM) read with the standard library, mixed to mono, a
  log-magnitude STFT (25 ms windows, 10 ms hop: Whisper's framing, Radford
  et al. 2022) resized to ``image_size`` square and standardized, then a
  one-channel tower: a spectrogram seen as an image, as AST does (Gong,
  Chung and Glass 2021, "AST: Audio Spectrogram Transformer").

Media that cannot be decoded raise :class:`MediaDecodeError` (answered 400).
"""

from __future__ import annotations

import io
import wave
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from kvflow.schemas import MediaKind

__all__ = ["CLIP_MEAN", "CLIP_STD", "TowerConfig", "VisionTower", "Projector", "MediaEncoder", "MediaDecodeError",
           "build_media_encoder"]

CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
"""Per-channel RGB mean of CLIP's image preprocessing (OpenAI CLIP ``_transform``)."""

CLIP_STD = (0.26862954, 0.26130258, 0.27577711)
"""Per-channel RGB standard deviation of CLIP's image preprocessing."""

MAX_PIXELS = 50_000_000
"""Largest decoded image (pixels) taken; larger ones are refused before decoding (decompression bombs)."""


class MediaDecodeError(ValueError):
    """Media bytes the encoder cannot decode (corrupt, or a format it has no decoder for)."""


@dataclass(frozen=True)
class TowerConfig:
    """Sizes of the towers. ``image_size``/``patch_size`` in pixels (square),
    ``width`` the transformer width, ``layers`` its blocks, ``heads`` its
    attention heads; ``video_frames`` the most frames a video is encoded from."""

    image_size: int = 64
    patch_size: int = 16
    width: int = 128
    layers: int = 2
    heads: int = 4
    video_frames: int = 4

    @property
    def num_patches(self) -> int:
        """Patches per image: the rows an encoded media item has."""
        return (self.image_size // self.patch_size) ** 2


class VisionTower(nn.Module):
    """CLIP ViT: ``[B, in_channels, image_size, image_size]`` pixels → ``[B, num_patches, width]``."""

    def __init__(self, config: TowerConfig, in_channels: int = 3) -> None:
        super().__init__()
        width, scale = config.width, config.width ** -0.5
        self.patch = nn.Conv2d(in_channels, width, kernel_size=config.patch_size, stride=config.patch_size,
                               bias=False)
        self.cls = nn.Parameter(scale * torch.randn(width))
        self.pos = nn.Parameter(scale * torch.randn(config.num_patches + 1, width))
        self.ln_pre = nn.LayerNorm(width)
        block = nn.TransformerEncoderLayer(width, config.heads, 4 * width, dropout=0.0, activation="gelu",
                                           batch_first=True, norm_first=True)
        self.blocks = nn.TransformerEncoder(block, config.layers, enable_nested_tensor=False)
        self.ln_post = nn.LayerNorm(width)

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        """Patch features of ``pixels`` (see the class doc for shapes)."""
        x = self.patch(pixels).flatten(2).transpose(1, 2)  # [B, P, width]
        cls = self.cls.expand(x.shape[0], 1, -1)
        x = self.ln_pre(torch.cat([cls, x], dim=1) + self.pos)
        return self.ln_post(self.blocks(x))[:, 1:]


class Projector(nn.Module):
    """``[..., width]`` → ``[..., hidden_size]``: Linear, GELU, Linear."""

    def __init__(self, width: int, hidden_size: int) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(width, hidden_size), nn.GELU(), nn.Linear(hidden_size, hidden_size))

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        """Projected features."""
        return self.net(features)


def _image(data: bytes) -> Any:
    """The Pillow image of ``data`` (not decoded yet: Pillow decodes lazily)."""
    from PIL import Image, UnidentifiedImageError

    try:
        img = Image.open(io.BytesIO(data))
        if img.width * img.height > MAX_PIXELS:
            raise MediaDecodeError(f"the image has {img.width}x{img.height} pixels; at most {MAX_PIXELS} are taken")
        return img
    except (UnidentifiedImageError, OSError, Image.DecompressionBombError, ValueError) as exc:
        if isinstance(exc, MediaDecodeError):
            raise
        raise MediaDecodeError(f"the media cannot be decoded as an image: {exc}") from None


def _wav(data: bytes) -> tuple[np.ndarray, int]:
    """Mono float samples in [-1, 1] and the sample rate of WAV ``data``."""
    try:
        with wave.open(io.BytesIO(data)) as w:
            width, channels, rate = w.getsampwidth(), w.getnchannels(), w.getframerate()
            frames = w.readframes(w.getnframes())
    except (wave.Error, EOFError) as exc:
        raise MediaDecodeError(f"the audio is not PCM WAV: {exc}") from None
    kinds = {1: ("u1", 128.0, 128.0), 2: ("<i2", 0.0, 32768.0), 4: ("<i4", 0.0, 2147483648.0)}
    if width not in kinds or channels < 1:
        raise MediaDecodeError(f"WAV of {width * 8}-bit samples is not decoded (8, 16 or 32-bit PCM)")
    dtype, offset, scale = kinds[width]
    samples = (np.frombuffer(frames, dtype=dtype).astype(np.float32) - offset) / scale
    if samples.size < channels:
        raise MediaDecodeError("the audio holds no samples")
    return samples[: samples.size // channels * channels].reshape(-1, channels).mean(axis=1), rate


@dataclass
class MediaEncoder:
    """The towers and projector of one deployment (:func:`build_media_encoder`)."""

    config: TowerConfig
    hidden_size: int
    image_tower: VisionTower
    audio_tower: VisionTower
    projector: Projector

    @property
    def media_tokens(self) -> int:
        """Rows of every encoded media item (placeholder tokens per item)."""
        return self.config.num_patches

    @torch.no_grad()
    def encode(self, kind: MediaKind, data: bytes) -> torch.Tensor:
        """``[media_tokens, hidden_size]`` float32 embeddings of media bytes.

        Blocking (decoding and a forward pass): call it off the event loop.

        Raises:
            MediaDecodeError: the bytes do not decode as ``kind`` (see the module doc).
        """
        if kind is MediaKind.audio:
            features = self.audio_tower(self._spectrogram(data).unsqueeze(0))[0]
        elif kind is MediaKind.video:
            features = self.image_tower(self._frames(data)).mean(dim=0)
        else:
            features = self.image_tower(self._pixels(_image(data)).unsqueeze(0))[0]
        return self.projector(features).float().contiguous()

    def _pixels(self, img: Any) -> torch.Tensor:
        """``[3, image_size, image_size]`` CLIP-normalized pixels of Pillow image ``img``."""
        from PIL import Image

        size = self.config.image_size
        try:
            rgb = img.convert("RGB").resize((size, size), Image.Resampling.BICUBIC)
        except (OSError, ValueError) as exc:
            raise MediaDecodeError(f"the image cannot be decoded: {exc}") from None
        pixels = torch.from_numpy(np.asarray(rgb, dtype=np.float32) / 255.0).permute(2, 0, 1)
        return (pixels - torch.tensor(CLIP_MEAN).view(3, 1, 1)) / torch.tensor(CLIP_STD).view(3, 1, 1)

    def _frames(self, data: bytes) -> torch.Tensor:
        """``[frames, 3, image_size, image_size]`` pixels of up to ``video_frames`` evenly spaced frames."""
        try:
            img = _image(data)
        except MediaDecodeError:
            raise MediaDecodeError("the video cannot be decoded: only animated GIF, WebP and PNG frames are "
                                   "decoded here") from None
        count = max(1, int(getattr(img, "n_frames", 1)))
        picks = sorted({round(i * (count - 1) / max(1, self.config.video_frames - 1))
                        for i in range(min(count, self.config.video_frames))})
        frames = []
        for index in picks:
            try:
                img.seek(index)
            except EOFError:
                break
            frames.append(self._pixels(img))
        return torch.stack(frames)

    def _spectrogram(self, data: bytes) -> torch.Tensor:
        """``[1, image_size, image_size]`` standardized log-magnitude STFT of WAV ``data``."""
        samples, rate = _wav(data)
        window, hop = max(16, rate * 25 // 1000), max(4, rate * 10 // 1000)
        signal = torch.from_numpy(np.pad(samples, (0, max(0, window - samples.size))))
        spec = torch.stft(signal, n_fft=window, hop_length=hop, window=torch.hann_window(window),
                          return_complex=True).abs().log1p()  # [freq, frames]
        size = self.config.image_size
        image = F.interpolate(spec[None, None], size=(size, size), mode="bilinear", align_corners=False)[0]
        return (image - image.mean()) / (image.std() + 1e-5)


def build_media_encoder(hidden_size: int, *, seed: int = 0, config: TowerConfig | None = None) -> MediaEncoder:
    """A :class:`MediaEncoder` into ``hidden_size`` with weights drawn from ``seed``
    (the same arguments give the same weights in every process; the global
    torch generator is left as it was).

    Raises:
        ValueError: ``image_size`` is not a multiple of ``patch_size``, or a size is < 1.
    """
    config = config or TowerConfig()
    if min(config.image_size, config.patch_size, config.width, config.layers, config.heads, hidden_size,
           config.video_frames) < 1 or config.image_size % config.patch_size or config.width % config.heads:
        raise ValueError(f"bad encoder sizes {config} (hidden {hidden_size})")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        encoder = MediaEncoder(config, hidden_size, VisionTower(config, 3), VisionTower(config, 1),
                               Projector(config.width, hidden_size))
    for module in (encoder.image_tower, encoder.audio_tower, encoder.projector):
        module.eval()
    return encoder
