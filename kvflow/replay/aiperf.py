"""Drive NVIDIA AIPerf (``pip install aiperf``) against a kvflow deployment.

AIPerf is an external load generator that speaks the OpenAI HTTP API: it
replays a Mooncake trace (``--custom-dataset-type mooncake_trace``) at its
recorded timestamps and measures TTFT, ITL, request latency and token
throughput from the streamed answers. kvflow does not import it; it runs as
a separate program (best in its own virtual environment: it pins its own
transformers, pandas and aiohttp).

Three things are needed to run it offline, and this module builds them:

* :func:`make_hf_cache` — AIPerf tokenizes with a Hugging Face tokenizer
  and, for trace datasets, forces the Hub into offline mode, so a tokenizer
  given as a plain local directory is not found. It is found when laid out
  as a Hub cache entry (``hub/models--ORG--NAME/snapshots/<rev>/`` plus
  ``refs/main``) under ``HF_HOME``; this writes that layout from a local
  model directory (tokenizer files only, no weights).
* :func:`write_trace_slice` — the first N requests of a Mooncake trace, the
  file AIPerf reads with ``--input-file``.
* :func:`aiperf_command` / :func:`aiperf_env` — the command line and
  environment of one ``aiperf profile`` run.

:func:`find_aiperf` locates the executable: ``$KVFLOW_AIPERF``, then
``aiperf`` on ``PATH``, then :data:`DEFAULT_AIPERF_VENV`.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from collections.abc import Sequence
from pathlib import Path

__all__ = [
    "AIPERF_ENV_VAR",
    "DEFAULT_AIPERF_VENV",
    "DEFAULT_REPO_ID",
    "TOKENIZER_FILES",
    "aiperf_command",
    "aiperf_env",
    "find_aiperf",
    "make_hf_cache",
    "write_trace_slice",
]

DEFAULT_REPO_ID = "HuggingFaceTB/SmolLM2-135M-Instruct"
"""Hub id of kvflow's default model; the cache entry is filed under it."""

DEFAULT_AIPERF_VENV = Path("/tmp/aiperfvenv")
"""Virtual environment :func:`find_aiperf` tries last (``bin/aiperf`` inside it)."""

AIPERF_ENV_VAR = "KVFLOW_AIPERF"
"""Environment variable naming the ``aiperf`` executable to use."""

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja",
                   "config.json", "generation_config.json", "tokenizer.model", "vocab.json", "merges.txt")
"""Files copied into the cache entry when the model directory has them.

``config.json`` is included because ``AutoTokenizer`` reads the model type
from it when ``tokenizer_config.json`` names no tokenizer class; weights are
never copied (the tokenizer does not need them)."""


def _revision(files: Sequence[Path]) -> str:
    """40-hex snapshot revision: SHA-1 over the copied files' names and bytes,
    so the same tokenizer always lands in the same snapshot."""
    digest = hashlib.sha1()
    for path in files:
        digest.update(path.name.encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()


def make_hf_cache(model_dir: str | Path, cache_root: str | Path,
                  repo_id: str = DEFAULT_REPO_ID) -> tuple[Path, str]:
    """Lay out the tokenizer of ``model_dir`` as a Hugging Face Hub cache entry.

    Writes ``cache_root/hub/models--ORG--NAME/snapshots/<rev>/`` holding
    copies of the :data:`TOKENIZER_FILES` present in ``model_dir``, and
    ``refs/main`` containing ``<rev>`` (a 40-hex SHA-1 of those files, so
    re-running with the same tokenizer is a no-op and a changed tokenizer
    gets a new snapshot). This is the layout ``huggingface_hub`` resolves
    offline (``HF_HUB_OFFLINE=1``) when asked for ``repo_id``.

    Args:
        model_dir: a local Hugging Face model directory, e.g.
            ``kvflow.models.resolve.resolve_model("SmolLM2-135M-Instruct").path``.
        cache_root: directory to use as ``HF_HOME`` (created if missing).
        repo_id: ``ORG/NAME`` to file the tokenizer under; pass the same id
            to ``aiperf --tokenizer``.

    Returns:
        ``(hf_home, repo_id)``: set ``HF_HOME=hf_home`` for the tokenizer's user.

    Raises:
        FileNotFoundError: ``model_dir`` has no ``tokenizer.json`` nor
            ``tokenizer.model`` nor ``vocab.json``.
        ValueError: ``repo_id`` is not of the form ``ORG/NAME``.
    """
    model_dir, hf_home = Path(model_dir), Path(cache_root)
    org, sep, name = repo_id.partition("/")
    if not (sep and org and name) or "/" in name:
        raise ValueError(f"repo_id must be ORG/NAME, not {repo_id!r}")
    files = [model_dir / f for f in TOKENIZER_FILES if (model_dir / f).is_file()]
    if not any(f.name in ("tokenizer.json", "tokenizer.model", "vocab.json") for f in files):
        raise FileNotFoundError(f"no tokenizer files in {model_dir}")
    rev = _revision(files)
    entry = hf_home / "hub" / f"models--{org}--{name}"
    snapshot = entry / "snapshots" / rev
    if not (entry / "refs" / "main").is_file() or (entry / "refs" / "main").read_text() != rev \
            or not snapshot.is_dir():
        # Build the snapshot aside and rename it in, so a reader never sees half of it.
        tmp = entry / "snapshots" / f".{rev}.{os.getpid()}"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        for f in files:
            shutil.copyfile(f, tmp / f.name)
        shutil.rmtree(snapshot, ignore_errors=True)
        tmp.rename(snapshot)
        (entry / "refs").mkdir(exist_ok=True)
        (entry / "refs" / "main").write_text(rev)  # no trailing newline, as the Hub client writes it
    return hf_home, repo_id


def write_trace_slice(src: str | Path, dst: str | Path, limit: int, *, max_input_length: int | None = None) -> int:
    """Copy the first ``limit`` requests of a Mooncake JSONL trace to ``dst``.

    Args:
        src: a Mooncake trace (one JSON object per line with ``timestamp``
            in ms, ``input_length``, ``output_length``, ``hash_ids``).
        dst: file to write (parent directories are created).
        limit: most requests to keep (>= 1).
        max_input_length: skip requests whose ``input_length`` (tokens) is
            above this before counting; ``None`` keeps all.

    Returns:
        The number of requests written.

    Raises:
        ValueError: ``limit < 1``, or a line is not a JSON object with an
            integer ``input_length``.
    """
    if limit < 1:
        raise ValueError(f"limit must be >= 1, not {limit}")
    kept: list[str] = []
    with open(src, encoding="utf-8") as fh:
        for lineno, line in enumerate(fh, 1):
            if not line.strip():
                continue
            row = json.loads(line)
            if not isinstance(row, dict) or not isinstance(row.get("input_length"), int):
                raise ValueError(f"{src}:{lineno}: not a Mooncake record")
            if max_input_length is not None and row["input_length"] > max_input_length:
                continue
            kept.append(line.rstrip("\n"))  # verbatim: AIPerf reads the same bytes as the source
            if len(kept) == limit:
                break
    Path(dst).parent.mkdir(parents=True, exist_ok=True)
    Path(dst).write_text("".join(k + "\n" for k in kept), encoding="utf-8")
    return len(kept)


def find_aiperf() -> str | None:
    """Path of the ``aiperf`` executable: ``$KVFLOW_AIPERF``, else ``aiperf``
    on ``PATH``, else ``DEFAULT_AIPERF_VENV/bin/aiperf``; ``None`` if none exists."""
    from kvflow.settings import Settings

    explicit = Settings().aiperf  # $KVFLOW_AIPERF
    if explicit:
        return explicit if Path(explicit).is_file() else shutil.which(explicit)
    found = shutil.which("aiperf")
    if found:
        return found
    venv = DEFAULT_AIPERF_VENV / "bin" / "aiperf"
    return str(venv) if venv.is_file() else None


def aiperf_env(hf_home: str | Path, scratch_dir: str | Path | None = None,
               base: dict[str, str] | None = None) -> dict[str, str]:
    """Environment for an ``aiperf`` run that must not touch the network.

    ``base`` (default: ``os.environ``) plus ``HF_HOME=hf_home`` and the Hub
    and transformers offline switches. ``HF_HUB_CACHE``/``HUGGINGFACE_HUB_CACHE``
    are dropped so the cache under ``hf_home`` is the one read. With
    ``scratch_dir``, AIPerf's memory-mapped dataset files
    (``AIPERF_DATASET_MMAP_BASE_PATH``, default the system temp directory,
    left behind after the run) and its dataset cache
    (``AIPERF_DATASET_MMAP_CACHE_DIR``, default ``~/.cache/aiperf``) go there.
    """
    env = dict(os.environ if base is None else base)
    for key in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE", "TRANSFORMERS_CACHE"):
        env.pop(key, None)
    env.update(HF_HOME=str(hf_home), HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", HF_HUB_DISABLE_TELEMETRY="1")
    if scratch_dir is not None:
        env.update(AIPERF_DATASET_MMAP_BASE_PATH=str(scratch_dir),
                   AIPERF_DATASET_MMAP_CACHE_DIR=str(Path(scratch_dir) / "dataset_cache"))
    return env


def aiperf_command(input_file: str | Path, *, url: str, model: str, artifact_dir: str | Path,
                   tokenizer: str = DEFAULT_REPO_ID, aiperf: str = "aiperf", endpoint_type: str = "chat",
                   streaming: bool = True, server_token_count: bool = True, server_metrics: bool = False,
                   extra_args: Sequence[str] = ()) -> list[str]:
    """Argument vector of one ``aiperf profile`` run replaying a Mooncake trace.

    The trace is replayed on its own timestamps (AIPerf switches trace
    datasets to a fixed schedule), every request streamed so TTFT and ITL
    are measured. With ``server_token_count`` AIPerf takes input and output
    token counts from the ``usage`` the bridge reports (it then asks for
    ``stream_options.include_usage``) instead of re-tokenizing text: the
    mocker emits one letter per token, which the model's tokenizer would
    count as about 40% fewer tokens than were generated. The input count is
    then the workers' own: UTF-8 bytes for the mocker (about 4.3 per SmolLM2
    token of AIPerf's synthetic text), the model's tokens for ``hf``. GPU telemetry is off (AIPerf
    looks for a DCGM exporter on localhost); so is scraping the bridge's
    Prometheus ``/metrics`` unless ``server_metrics``: AIPerf reports the
    change between its scrapes (every 333 ms), which misses what happened
    before its first scrape in runs a few seconds long.

    Args:
        input_file: Mooncake JSONL trace (see :func:`write_trace_slice`).
        url: the bridge's base URL, e.g. ``http://127.0.0.1:8000``.
        model: served model name (``kvflow up --model``).
        artifact_dir: where AIPerf writes ``profile_export_aiperf.{json,csv}``.
        tokenizer: Hub id present in the cache of :func:`make_hf_cache`.
        aiperf: the executable (see :func:`find_aiperf`).
        endpoint_type: ``chat`` (``/v1/chat/completions``) or ``completions``.
        streaming: stream answers (needed for TTFT and ITL).
        server_token_count: count tokens from the server's ``usage``.
        server_metrics: let AIPerf scrape ``url/metrics``
            (``server_metrics_export.{json,csv}`` in ``artifact_dir``).
        extra_args: appended as given (e.g. ``["--request-count", "5"]``).

    Returns:
        The argument vector, ``[aiperf, "profile", ...]``.

    Raises:
        ValueError: ``endpoint_type`` is neither ``chat`` nor ``completions``.
    """
    if endpoint_type not in ("chat", "completions"):
        raise ValueError(f"endpoint_type must be chat or completions, not {endpoint_type!r}")
    cmd = [
        aiperf, "profile",
        "--model", model, "--url", url, "--endpoint-type", endpoint_type,
        "--tokenizer", tokenizer,
        "--custom-dataset-type", "mooncake_trace", "--input-file", str(input_file),
        "--fixed-schedule", "--fixed-schedule-auto-offset",
        "--output-artifact-dir", str(artifact_dir),
        "--no-gpu-telemetry", "--ui-type", "none",
    ]
    if not server_metrics:
        cmd.append("--no-server-metrics")
    if streaming:
        cmd.append("--streaming")
    if server_token_count:
        cmd.append("--use-server-token-count")
    cmd.extend(extra_args)
    return cmd
