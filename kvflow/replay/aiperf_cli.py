"""``kvflow aiperf``: replay a slice of a Mooncake trace with NVIDIA AIPerf.

    kvflow aiperf TRACE [--limit 20] [--url http://127.0.0.1:8000] [--model NAME]
                        [--artifact-dir DIR] [--dry-run] [-- EXTRA AIPERF ARGS ...]

Writes the first ``--limit`` requests of TRACE into the artifact directory,
lays out the model's tokenizer as an offline Hugging Face cache entry
(:func:`kvflow.replay.aiperf.make_hf_cache`) and runs ``aiperf profile``
against a running deployment (by default the one ``kvflow up`` recorded:
``--port``/``--state-file`` choose among several). AIPerf itself is not a
kvflow dependency: install it in its own virtual environment and point
``$KVFLOW_AIPERF`` at its ``aiperf``.
"""

from __future__ import annotations

import os
import shlex
import subprocess
from pathlib import Path
from typing import Annotated

import typer

from kvflow.cli_options import DataDirOpt, JoinPortOpt, StateFileOpt, deployment_url

__all__ = ["aiperf"]

_DEFAULT_URL = "http://127.0.0.1:8000"


def aiperf(
    trace: Annotated[Path, typer.Argument(exists=True, dir_okay=False, help="Mooncake JSONL trace.")],
    extra: Annotated[list[str] | None, typer.Argument(
        help="Further `aiperf profile` arguments, after `--` (e.g. -- --goodput time_to_first_token:500).")] = None,
    limit: Annotated[int, typer.Option(min=1, help="Replay the first N requests of the trace.")] = 20,
    max_input_length: Annotated[int | None, typer.Option(
        help="Skip requests longer than this many tokens before taking --limit.")] = None,
    url: Annotated[str | None, typer.Option(
        help="Bridge base URL (default: the running `kvflow up` that --port/--state-file pick, else "
             "http://127.0.0.1:8000).")] = None,
    port: JoinPortOpt = None,
    state_file: StateFileOpt = None,
    data_dir: DataDirOpt = None,
    model: Annotated[str, typer.Option(help="Served model name to request.")] = "SmolLM2-135M-Instruct",
    tokenizer_model: Annotated[str, typer.Option(
        help="kvflow model spec (name or local HF directory) whose tokenizer AIPerf uses.")] = "SmolLM2-135M-Instruct",
    repo_id: Annotated[str, typer.Option(help="Hub id the tokenizer is filed under in the cache.")]
    = "HuggingFaceTB/SmolLM2-135M-Instruct",
    hf_home: Annotated[Path | None, typer.Option(
        help="HF_HOME for AIPerf (default: ~/.cache/kvflow/aiperf-hf).")] = None,
    artifact_dir: Annotated[Path, typer.Option(help="AIPerf output directory.")] = Path("artifacts/aiperf"),
    endpoint_type: Annotated[str, typer.Option(help="chat | completions")] = "chat",
    streaming: Annotated[bool, typer.Option(help="Stream answers (TTFT and ITL need it).")] = True,
    server_token_count: Annotated[bool, typer.Option(
        help="Count tokens from the server's usage (else AIPerf re-tokenizes the text).")] = True,
    server_metrics: Annotated[bool, typer.Option(help="Let AIPerf scrape the bridge's /metrics.")] = False,
    dry_run: Annotated[bool, typer.Option(help="Print the environment and command instead of running it.")]
    = False,
) -> None:
    """Replay the first requests of a Mooncake trace against kvflow with NVIDIA AIPerf."""
    from kvflow.replay.aiperf import aiperf_command, aiperf_env, find_aiperf, make_hf_cache, write_trace_slice
    from kvflow.models.resolve import ModelNotFoundError, resolve_model

    exe = find_aiperf()
    if exe is None and not dry_run:
        raise typer.BadParameter("aiperf not found: `python3 -m venv ~/.venvs/aiperf && "
                                 "~/.venvs/aiperf/bin/pip install aiperf==0.13.0`, then set "
                                 "KVFLOW_AIPERF=~/.venvs/aiperf/bin/aiperf (see docs/aiperf.md)")
    try:
        model_dir = resolve_model(tokenizer_model).path
        home, repo = make_hf_cache(model_dir, hf_home or Path.home() / ".cache" / "kvflow" / "aiperf-hf", repo_id)
        artifact_dir.mkdir(parents=True, exist_ok=True)
        cap = f".max{max_input_length}" if max_input_length is not None else ""
        sliced = artifact_dir / f"{trace.stem}.first{limit}{cap}.jsonl"
        count = write_trace_slice(trace, sliced, limit, max_input_length=max_input_length)
        url = url or deployment_url(port=port, state_file=state_file, data_dir=data_dir, default=_DEFAULT_URL)
        cmd = aiperf_command(sliced, url=url, model=model, artifact_dir=artifact_dir,
                             tokenizer=repo, aiperf=exe or "aiperf", endpoint_type=endpoint_type,
                             streaming=streaming, server_token_count=server_token_count,
                             server_metrics=server_metrics, extra_args=extra or [])
    except (ModelNotFoundError, FileNotFoundError, ValueError) as exc:
        raise typer.BadParameter(str(exc)) from exc
    if count == 0:
        raise typer.BadParameter(f"no request of {trace} is within --max-input-length {max_input_length}")
    env = aiperf_env(home, scratch_dir=artifact_dir / "scratch")
    if dry_run:
        shown = {k: env[k] for k in sorted(env) if k.startswith(("HF_", "TRANSFORMERS_", "AIPERF_"))}
        typer.echo(" ".join(f"{k}={shlex.quote(v)}" for k, v in shown.items()) + " \\\n  " + shlex.join(cmd))
        return
    typer.echo(f"aiperf: {count} request(s) of {trace} -> {artifact_dir}", err=True)
    raise typer.Exit(subprocess.call(cmd, env=env, cwd=os.getcwd()))
