"""Worker start-up time per engine: from spawning a worker process to the router routing to it.

The SLA planner's lead time, and the start-up delay the offline simulator
gives every worker the planner starts (``kvflow replay --worker-startup-s``,
``bench/planner_eval.py --worker-startup-s``), should be what a real worker
takes. This measures it the way ``kvflow up``'s local connector starts
workers: :meth:`kvflow.supervisor.Supervisor.start_worker` spawns ``kvflow
worker`` (interpreter start, imports, engine and model load, Kafka
connection, first heartbeat) and the clock stops when the router's table
lists the worker as serving. The worker is then drained and the next one
started, ``--repeats`` times per engine, on an embedded broker.

    python bench/worker_startup.py --engines mocker,hf --repeats 5

The ``hf`` engine loads the default model (SmolLM2-135M-Instruct, CPU);
a GPU engine adds the weights' transfer and, for vLLM, graph capture, so
its start-up is longer (tens of seconds to minutes).

Last stdout line: one JSON object, engine → samples and their mean, median and max (s).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # this checkout's kvflow, not an installed copy

from kvflow.schemas import WorkerStatus  # noqa: E402
from kvflow.settings import Settings  # noqa: E402
from kvflow.supervisor import Supervisor, WorkerSpec  # noqa: E402


async def measure(engine: str, repeats: int, timeout_s: float) -> list[float]:
    """Start and drain ``repeats`` workers of ``engine`` one after another; seconds from spawn to serving each.

    Raises:
        TimeoutError: a worker did not register within ``timeout_s``.
        RuntimeError: a worker process exited during start-up.
    """
    sup = Supervisor(Settings(namespace=f"startup{engine}", heartbeat_interval_ms=200), WorkerSpec(engine=engine),
                     bridge=False)
    await sup.start()
    samples = []
    try:
        for _ in range(repeats):
            t0 = time.perf_counter()
            worker_id = await sup.start_worker()
            child = sup.children[worker_id]
            while True:
                view = sup.router.table.workers.get(worker_id)
                if view is not None and view.status is WorkerStatus.serving:
                    break
                if child.process.returncode is not None:
                    raise RuntimeError(f"worker {worker_id} exited with code {child.process.returncode}")
                if time.perf_counter() - t0 > timeout_s:
                    raise TimeoutError(f"worker {worker_id} did not register within {timeout_s} s")
                await asyncio.sleep(0.01)
            samples.append(time.perf_counter() - t0)
            await sup.stop_worker(worker_id)
    finally:
        await sup.stop()
    return samples


def main() -> None:
    """Parse arguments, measure each engine, print one JSON line."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--engines", default="mocker", help="comma-separated: mocker, hf, vllm")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--timeout-s", type=float, default=600.0)
    args = ap.parse_args()
    out = {}
    for engine in [e for e in args.engines.split(",") if e]:
        samples = asyncio.run(measure(engine, args.repeats, args.timeout_s))
        out[engine] = {"samples_s": [round(s, 2) for s in samples], "mean_s": round(statistics.mean(samples), 2),
                       "median_s": round(statistics.median(samples), 2), "max_s": round(max(samples), 2)}
        print(json.dumps({engine: out[engine]}), file=sys.stderr, flush=True)
    print(json.dumps({"startup": out}))


if __name__ == "__main__":
    main()
