"""A sentence encoder on transformers + torch: inputs in, normalized vectors out.

Pooling follows the sentence-transformers recipe of all-MiniLM-L6-v2
(``1_Pooling/config.json``: ``pooling_mode_mean_tokens``; ``2_Normalize``):
the mean of the last hidden states over the non-padding tokens, then L2
normalization. ``dimensions`` below the model's width keeps the first
components and normalizes again, as the OpenAI API's ``dimensions`` does;
only a Matryoshka-trained model (Kusupati et al., 2022, "Matryoshka
Representation Learning") keeps its meaning that way, so only models whose
``config.json`` says so (``is_matryoshka``, or a ``matryoshka_dimensions``
list, the keys vLLM reads) take it. all-MiniLM-L6-v2 is not one of them.

Token-id inputs are ids of the encoder's own tokenizer without special
tokens (what ``tokenizer.encode(text, add_special_tokens=False)`` gives);
the encoder adds ``[CLS]``/``[SEP]`` as it does for text, so a text and its
ids give the same vector.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from kvflow.models.embedding import max_seq_length

__all__ = ["EncoderError", "Encoder", "load_encoder"]

log = logging.getLogger(__name__)


class EncoderError(ValueError):
    """An input the encoder cannot take (a token id outside its vocabulary,
    ``dimensions`` it does not serve); the request is answered 400.
    ``param`` names the request field at fault (``input`` or ``dimensions``)."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


@dataclass
class Encoder:
    """A loaded encoder. ``dim`` is the vector width; ``max_tokens`` the
    longest input encoded (longer ones are truncated, as sentence-transformers
    does); ``batch_size`` the most inputs per forward pass. ``matryoshka``:
    the model may be asked for fewer dimensions (``matryoshka_dims``: only
    these; empty: any up to ``dim``)."""

    tokenizer: Any
    model: Any
    dim: int
    max_tokens: int
    device: str = "cpu"
    batch_size: int = 64
    matryoshka: bool = False
    matryoshka_dims: tuple[int, ...] = ()

    def embed(self, texts: list[str] | None = None, token_ids: list[list[int]] | None = None,
              dimensions: int | None = None) -> tuple[list[list[float]], int]:
        """Vectors ``[num_inputs][dimensions or dim]`` of ``texts`` or ``token_ids``
        (exactly one given), and the number of tokens encoded.

        Blocking (one forward pass per ``batch_size`` inputs): call it off the event loop.

        Raises:
            EncoderError: ``dimensions`` the model does not take (see
                :attr:`matryoshka`), or a token id outside the vocabulary.
        """
        if dimensions == self.dim:
            dimensions = None
        if dimensions is not None:
            self._check_dimensions(dimensions)
        sequences = self._tokenize(texts) if texts is not None else self._wrap(token_ids or [])
        vectors: list[list[float]] = []
        for start in range(0, len(sequences), self.batch_size):
            vectors.extend(self._forward(sequences[start:start + self.batch_size], dimensions))
        return vectors, sum(len(s) for s in sequences)

    def _check_dimensions(self, dimensions: int) -> None:
        if dimensions > self.dim:
            raise EncoderError(f"dimensions {dimensions} exceeds the model's {self.dim}", "dimensions")
        if not self.matryoshka:
            raise EncoderError(f"this model gives {self.dim} dimensions only: it is not Matryoshka-trained, so "
                               "`dimensions` must be left out or equal that", "dimensions")
        if self.matryoshka_dims and dimensions not in self.matryoshka_dims:
            raise EncoderError(f"dimensions must be one of {', '.join(map(str, self.matryoshka_dims))}",
                               "dimensions")

    def _tokenize(self, texts: list[str]) -> list[list[int]]:
        return [list(ids) for ids in self.tokenizer(texts, truncation=True, max_length=self.max_tokens)["input_ids"]]

    def _wrap(self, token_ids: list[list[int]]) -> list[list[int]]:
        vocab = len(self.tokenizer)
        bad = next((t for ids in token_ids for t in ids if t >= vocab), None)
        if bad is not None:
            raise EncoderError(f"token id {bad} is outside the vocabulary [0, {vocab})", "input")
        cls, sep = self.tokenizer.cls_token_id, self.tokenizer.sep_token_id
        head, tail = ([cls], [sep]) if cls is not None and sep is not None else ([], [])
        room = self.max_tokens - len(head) - len(tail)
        return [head + list(ids[:room]) + tail for ids in token_ids]

    @torch.inference_mode()
    def _forward(self, sequences: list[list[int]], dimensions: int | None) -> list[list[float]]:
        width = max(len(s) for s in sequences)
        pad = self.tokenizer.pad_token_id or 0
        ids = torch.tensor([s + [pad] * (width - len(s)) for s in sequences], device=self.device)
        mask = torch.tensor([[1] * len(s) + [0] * (width - len(s)) for s in sequences], device=self.device)
        hidden = self.model(input_ids=ids, attention_mask=mask).last_hidden_state  # [B, T, dim]
        weights = mask.unsqueeze(-1).to(hidden.dtype)
        pooled = (hidden * weights).sum(1) / weights.sum(1).clamp(min=1e-9)  # [B, dim]
        pooled = F.normalize(pooled, dim=-1)
        if dimensions is not None:
            pooled = F.normalize(pooled[:, :dimensions], dim=-1)
        return pooled.float().cpu().tolist()


def load_encoder(model_dir: Path, device: str = "cpu") -> Encoder:
    """Load tokenizer and encoder weights from ``model_dir`` (local files only).

    Raises:
        OSError: the directory lacks the model's files.
    """
    from transformers import AutoModel, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(model_dir), local_files_only=True)
    model = AutoModel.from_pretrained(str(model_dir), local_files_only=True).to(device).eval()
    limit = min(max_seq_length(model_dir, tokenizer.model_max_length),
                getattr(model.config, "max_position_embeddings", 512))
    dims = tuple(int(d) for d in getattr(model.config, "matryoshka_dimensions", None) or ())
    return Encoder(tokenizer, model, dim=int(model.config.hidden_size), max_tokens=limit, device=device,
                   matryoshka=bool(getattr(model.config, "is_matryoshka", False) or dims), matryoshka_dims=dims)
