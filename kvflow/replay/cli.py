"""``kvflow replay``: offline simulation, online replay, and report comparison.

    kvflow replay TRACE --mode offline [--workers N] [--router POLICY] [--seed S] [--json PATH]
    kvflow replay TRACE --mode online  [--bootstrap-servers ... | --url http://...]
    kvflow replay compare a.json b.json ...
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

__all__ = ["replay"]


def replay(
    targets: Annotated[list[str], typer.Argument(help="TRACE file, or `compare` followed by JSON reports.")],
    mode: Annotated[str, typer.Option(help="offline (simulated clock, no broker) | online (live deployment)")] = "offline",
    workers: Annotated[int, typer.Option(min=1, help="offline: simulated aggregated workers")] = 8,
    router: Annotated[str, typer.Option("--router", help="routing policy")] = "round_robin",
    seed: int = 0,
    speedup: Annotated[float, typer.Option(help="divide trace inter-arrival times by this")] = 1.0,
    start_ms: Optional[float] = None,
    end_ms: Optional[float] = None,
    limit: Annotated[Optional[int], typer.Option(help="replay only the first N requests")] = None,
    rate: Annotated[Optional[float], typer.Option(help="override arrivals: Poisson at this many req/s")] = None,
    json_path: Annotated[Optional[Path], typer.Option("--json", help="write the JSON report here")] = None,
    markdown: Annotated[Optional[Path], typer.Option(help="write the markdown report here")] = None,
    plots: Annotated[Optional[Path], typer.Option(help="write PNG plots into this directory")] = None,
    sla_ttft_ms: float = 500.0,
    sla_itl_ms: float = 50.0,
    bootstrap_servers: Annotated[Optional[str], typer.Option("--bootstrap-servers", "-b")] = None,
    url: Annotated[Optional[str], typer.Option(help="online: an OpenAI-compatible base URL instead of Kafka")] = None,
    model: Annotated[str, typer.Option(help="online: model name to request")] = "SmolLM2-135M-Instruct",
    namespace: str = "kvflow",
    progress: bool = True,
) -> None:
    """Replay a traffic trace and report TTFT, ITL, throughput, goodput and prefix hit rate."""
    from kvflow.replay import compare_reports, render_markdown, run_offline, run_online

    if targets[0] == "compare":
        if len(targets) < 2:
            raise typer.BadParameter("compare needs at least one JSON report")
        typer.echo(compare_reports(targets[1:]))
        return
    if len(targets) != 1:
        raise typer.BadParameter("give one trace file (or `compare a.json b.json ...`)")
    trace = Path(targets[0])
    common = dict(start_ms=start_ms, end_ms=end_ms, limit=limit, json_path=json_path, markdown_path=markdown,
                  plot_dir=plots, progress=progress, sla_ttft_ms=sla_ttft_ms, sla_itl_ms=sla_itl_ms)
    if mode == "offline":
        report = run_offline(trace, workers=workers, policy=router, seed=seed, speedup=speedup, rate=rate, **common)
    elif mode == "online":
        from kvflow.cli import _settings

        settings = None if url else _settings(bootstrap_servers, namespace)
        report = run_online(trace, settings, url=url, model=model, speedup=speedup, rate=rate, seed=seed, **common)
    else:
        raise typer.BadParameter("--mode must be offline or online")
    typer.echo(render_markdown(report))
