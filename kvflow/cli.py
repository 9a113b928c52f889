"""The ``kvflow`` command: up, worker, status, produce, replay, profile."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import signal
from pathlib import Path
from typing import Annotated, Optional

import typer

from kvflow.schemas import WorkerRole
from kvflow.settings import Settings

app = typer.Typer(help="kvflow: LLM inference serving as an event-sourced pipeline on Kafka.", no_args_is_help=True)

STATE_FILE = Path(os.environ.get("KVFLOW_STATE_FILE", Path.home() / ".cache" / "kvflow" / "up.json"))

BootstrapOpt = Annotated[Optional[str], typer.Option("--bootstrap-servers", "-b", envvar="KVFLOW_BOOTSTRAP_SERVERS",
                                                     help="Kafka bootstrap servers; default: the embedded broker.")]
NamespaceOpt = Annotated[str, typer.Option(envvar="KVFLOW_NAMESPACE", help="Topic name prefix.")]


def _logging(verbose: bool) -> None:
    logging.basicConfig(level=logging.INFO if verbose else logging.WARNING,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")


def _settings(bootstrap: str | None, namespace: str, embedded: bool | None = None, **kw: object) -> Settings:
    """Settings for commands that join a running deployment (state file as fallback)."""
    if bootstrap is None and STATE_FILE.exists():
        state = json.loads(STATE_FILE.read_text())
        bootstrap, embedded = state["bootstrap_servers"], state["embedded_broker"]
        namespace = state.get("namespace", namespace)
    if bootstrap is None:
        raise typer.BadParameter("no running deployment found: start one with `kvflow up` or pass --bootstrap-servers")
    return Settings(bootstrap_servers=bootstrap, namespace=namespace, embedded_broker=bool(embedded), **kw)


@app.command()
def up(
    engine: Annotated[str, typer.Option(help="mocker | hf | vllm")] = "hf",
    workers: Annotated[int, typer.Option(min=0, help="Aggregated workers to start.")] = 1,
    model: Annotated[str, typer.Option(help="Model name or local HF directory.")] = "SmolLM2-135M-Instruct",
    host: str = "127.0.0.1",
    port: int = 8000,
    bootstrap_servers: BootstrapOpt = None,
    namespace: NamespaceOpt = "kvflow",
    policy: Annotated[str, typer.Option(help="Routing policy.")] = "least_loaded",
    verbose: bool = False,
) -> None:
    """Start broker (embedded unless -b), router, workers and the HTTP bridge; Ctrl-C stops all."""
    from kvflow.supervisor import Supervisor, WorkerSpec

    _logging(verbose)
    settings = Settings(bootstrap_servers=bootstrap_servers, namespace=namespace, routing_policy=policy)

    async def main() -> None:
        sup = Supervisor(settings, WorkerSpec(engine=engine, model=model), host=host, port=port)
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        try:
            await sup.start()
            STATE_FILE.parent.mkdir(parents=True, exist_ok=True)
            STATE_FILE.write_text(json.dumps({"bootstrap_servers": sup.settings.bootstrap_servers,
                                              "embedded_broker": sup.settings.embedded_broker,
                                              "namespace": namespace, "url": sup.url, "pid": os.getpid()}))
            typer.echo(f"kafka: {sup.settings.bootstrap_servers}{' (embedded Tansu)' if sup.broker else ''}")
            for _ in range(workers):
                await sup.start_worker(WorkerRole.aggregated)
            typer.echo(f"waiting for {workers} {engine} worker(s) to load {model} ...")
            ready = asyncio.create_task(sup.wait_workers_ready(workers))
            stopped = asyncio.create_task(stop.wait())
            await asyncio.wait({ready, stopped}, return_when=asyncio.FIRST_COMPLETED)
            if ready.done():
                ready.result()
                typer.echo(f"kvflow is serving {model} at {sup.url}/v1  (Ctrl-C to stop)")
                await stop.wait()
            ready.cancel()
        finally:
            typer.echo("stopping ...")
            await sup.stop()
            with contextlib.suppress(OSError):
                STATE_FILE.unlink()

    asyncio.run(main())


@app.command()
def worker(
    slot: Annotated[int, typer.Option(help="Queue partition this worker consumes.")],
    engine: str = "mocker",
    model: str = "SmolLM2-135M-Instruct",
    role: WorkerRole = WorkerRole.aggregated,
    worker_id: Annotated[Optional[str], typer.Option()] = None,
    block_size: Annotated[Optional[int], typer.Option(help="KV block size in tokens (engine default if unset).")] = None,
    num_kv_blocks: Annotated[Optional[int], typer.Option(help="KV blocks (engine default if unset).")] = None,
    speedup_ratio: Annotated[float, typer.Option(help="mocker: divide simulated time by this.")] = 1.0,
    device: str = "cpu",
    bootstrap_servers: BootstrapOpt = None,
    namespace: NamespaceOpt = "kvflow",
    embedded_broker: bool = False,
    verbose: bool = False,
) -> None:
    """Run one worker process (normally started by `kvflow up`)."""
    from kvflow.workers.main import run_worker

    _logging(verbose)
    settings = _settings(bootstrap_servers, namespace, embedded_broker or None)
    asyncio.run(run_worker(settings, slot=slot, engine=engine, model=model, role=role, worker_id=worker_id,
                           block_size=block_size, num_kv_blocks=num_kv_blocks, speedup_ratio=speedup_ratio,
                           device=device))


@app.command()
def status(
    bootstrap_servers: BootstrapOpt = None,
    namespace: NamespaceOpt = "kvflow",
    as_json: Annotated[bool, typer.Option("--json")] = False,
) -> None:
    """List live workers and their queue depths."""
    from kvflow.streams.status import collect_status, render_status

    settings = _settings(bootstrap_servers, namespace)
    rows = asyncio.run(collect_status(settings))
    typer.echo(json.dumps(rows, indent=2) if as_json else render_status(rows))


@app.command()
def produce(
    text: Annotated[str, typer.Argument(help="User message.")],
    model: str = "SmolLM2-135M-Instruct",
    max_tokens: int = 64,
    temperature: float = 0.0,
    bootstrap_servers: BootstrapOpt = None,
    namespace: NamespaceOpt = "kvflow",
) -> None:
    """Send one chat request straight to the requests topic and stream the reply (no HTTP)."""
    from kvflow.streams.produce import produce_chat

    settings = _settings(bootstrap_servers, namespace)
    code = asyncio.run(produce_chat(settings, text, model=model, max_tokens=max_tokens, temperature=temperature))
    raise typer.Exit(code)


if __name__ == "__main__":  # pragma: no cover
    app()
