"""Engine overhead: kvflow with one vLLM worker against vLLM's ``AsyncLLM`` alone.

Both sides run in one process tree and one run, side by side:

* **vLLM alone**: ``AsyncLLM`` in this process, streaming (``DELTA`` outputs,
  vLLM's own detokenization), with exactly the engine arguments kvflow's
  ``vllm`` engine derives for this platform (:func:`vllm_engine_args`: block
  size, KV cache size, dtype, eager or compiled), less kvflow's KV event
  publisher;
* **kvflow**: `kvflow up`'s supervisor (embedded broker, router in this
  process, no HTTP bridge) with one ``vllm`` worker process, driven by the
  Kafka-native client (requests → router → worker queue → worker → responses).

Each round sends the same ``--streams`` requests (8 by default, all in flight
at once) to each side: the same prompt token ids (``--isl`` tokens, distinct
per request and per round, so neither side gets prefix-cache hits the other
does not), greedy, ``--max-tokens`` output tokens each (``ignore_eos``).
Output tokens/s of a round = output tokens / (last answer − first submit).
The sides alternate which goes first each round; a warm-up round per side is
not counted.

CPU placement is the same for both sides: vLLM's CPU build binds its model
threads to ``--model-cpus`` (``VLLM_CPU_OMP_THREADS_BIND``, set once here and
inherited by both engines; default: every CPU this process may use but the
last), and with ``--pin`` (the default) every other thread of the process
tree — this process (vLLM-alone's front end, kvflow's router and client), the
broker, the kvflow worker, vLLM's engine-core processes — is pinned to the
remaining CPUs once both sides are up, so the pipeline's own work competes
with the model's threads no more than vLLM's front end does. An idle engine
uses no CPU. On a GPU host the binding variable is ignored by vLLM.

    python bench/engine_overhead.py [--streams 8] [--rounds 5] [--isl 256] [--max-tokens 128]
                                    [--kv-cache-gb 1] [--dtype auto] [--model-cpus 0] [--no-pin]

Last stdout line: one JSON object with the figures (``ratio`` = kvflow / vLLM
output tokens/s, medians over rounds).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import os
import statistics
import time
import uuid


def round_prompts(tokenizer, round_no: int, streams: int, isl: int) -> list[list[int]]:
    """``streams`` distinct prompts of exactly ``isl`` token ids for round ``round_no``.

    Raises:
        ValueError: the text is too short for ``isl`` tokens.
    """
    prompts = []
    for i in range(streams):
        words = " ".join(f"r{round_no}s{i}w{k}x{(round_no * 7919 + i * 104729 + k * 31) % 99991}"
                         for k in range(isl))
        ids = tokenizer.encode_prompt(f"Request {round_no}-{i}. Summarise: {words}")[:isl]
        if len(ids) < isl:
            raise ValueError(f"prompt of {len(ids)} tokens, wanted {isl}")
        prompts.append(ids)
    return prompts


async def vllm_batch(engine, prompts: list[list[int]], max_tokens: int) -> tuple[int, float]:
    """All ``prompts`` at once through ``AsyncLLM``; returns (output tokens, seconds)."""
    from vllm import SamplingParams
    from vllm.inputs import tokens_input
    from vllm.sampling_params import RequestOutputKind

    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True,
                            output_kind=RequestOutputKind.DELTA)

    async def one(ids: list[int]) -> int:
        n = 0
        async for out in engine.generate(tokens_input(ids), params, f"v-{uuid.uuid4().hex}"):
            n += len(out.outputs[0].token_ids)
        return n

    t0 = time.perf_counter()
    counts = await asyncio.gather(*(one(p) for p in prompts))
    return sum(counts), time.perf_counter() - t0


async def kvflow_batch(client, model: str, prompts: list[list[int]], max_tokens: int) -> tuple[int, float]:
    """All ``prompts`` at once through kvflow's Kafka-native client; returns (output tokens, seconds).

    Raises:
        RuntimeError: a request ended with an error.
    """
    from kvflow.schemas import FinalResponse, SamplingParams

    sampling = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)

    async def one(ids: list[int]) -> int:
        request = client.new_request(model, token_ids=ids, sampling=sampling)
        async for event in client.stream(request):
            if isinstance(event, FinalResponse):
                if event.error is not None:
                    raise RuntimeError(f"kvflow request failed: {event.error.message}")
                return event.usage.completion_tokens
        raise RuntimeError("kvflow stream ended without a final response")

    t0 = time.perf_counter()
    counts = await asyncio.gather(*(one(p) for p in prompts))
    return sum(counts), time.perf_counter() - t0


def tree_cpu_s() -> dict[str, float]:
    """CPU seconds (user + system) used so far by this process and each live descendant, by role.

    Roles: ``bench`` (this process: vLLM-alone's front end, kvflow's router and
    client), ``broker``, ``kvflow_worker`` (the worker process, vLLM's front end
    inside it), ``engine_core`` and ``model_worker`` (vLLM's two engine
    processes, one pair per engine), ``other``.
    """
    import psutil

    me = psutil.Process()
    out: dict[str, float] = {}
    for proc in [me, *me.children(recursive=True)]:
        try:
            times = proc.cpu_times()
            name, cmd = proc.name(), " ".join(proc.cmdline())
        except psutil.Error:
            continue
        if proc.pid == me.pid:
            role = "bench"
        elif "tansu" in cmd:
            role = "broker"
        elif "kvflow" in cmd and " worker" in cmd:
            role = "kvflow_worker"
        elif "EngineCore" in name or "EngineCore" in cmd:
            role = "engine_core"
        elif "VLLM::Worker" in name or "VLLM::Worker" in cmd:
            role = "model_worker"
        else:
            role = "other"
        out[role] = out.get(role, 0.0) + times.user + times.system
    return out


def pin_tree(model_cpus: set[int], other_cpus: set[int]) -> dict[str, list[int]]:
    """Pin every thread of this process tree: vLLM model workers to ``model_cpus``, the rest to
    ``other_cpus`` (per thread, through ``/proc/<pid>/task``, because an affinity call moves
    one thread only). Returns ``{role: sorted CPUs}`` as applied.
    """
    import psutil

    me = psutil.Process()
    applied: dict[str, list[int]] = {}
    for proc in [me, *me.children(recursive=True)]:
        try:
            model = "VLLM::Worker" in proc.name() or "VLLM::Worker" in " ".join(proc.cmdline())
            cpus = model_cpus if model else other_cpus
            for tid in os.listdir(f"/proc/{proc.pid}/task"):
                try:
                    os.sched_setaffinity(int(tid), cpus)
                except OSError:  # a thread that just ended
                    pass
        except (psutil.Error, OSError):
            continue
        applied["model_worker" if model else "others"] = sorted(cpus)
    return applied


async def main(args: argparse.Namespace) -> dict:
    from vllm import AsyncEngineArgs
    from vllm.platforms import current_platform
    from vllm.v1.engine.async_llm import AsyncLLM

    from kvflow.cli_options import vllm_worker_args
    from kvflow.schemas import WorkerRole
    from kvflow.settings import Settings
    from kvflow.streams.client import KvflowClient
    from kvflow.supervisor import Supervisor, WorkerSpec
    from kvflow.workers.engines.base import EngineConfig
    from kvflow.workers.engines.vllm import VllmOptions, vllm_engine_args
    from kvflow.models.resolve import resolve_model
    from kvflow.models.tokenizer import load_tokenizer

    load_before = os.getloadavg()[0]
    allowed = sorted(os.sched_getaffinity(0))
    model_cpus = ({int(c) for c in args.model_cpus.split(",")} if args.model_cpus
                  else set(allowed[:-1] if len(allowed) > 1 else allowed))
    other_cpus = set(allowed) - model_cpus or set(allowed)
    bind = ",".join(str(c) for c in sorted(model_cpus))
    os.environ["VLLM_CPU_OMP_THREADS_BIND"] = bind  # inherited by both engines' processes
    resolved = resolve_model(args.model)
    tokenizer = load_tokenizer(str(resolved.path))
    device = str(current_platform.device_type)
    options = VllmOptions(kv_cache_gb=args.kv_cache_gb, dtype=args.dtype, compiled=args.compile)
    engine_args, env = vllm_engine_args(EngineConfig(), options, device_type=device,
                                        arg_names={f.name for f in dataclasses.fields(AsyncEngineArgs)})
    os.environ.update(env)

    t0 = time.perf_counter()
    alone = AsyncLLM.from_engine_args(AsyncEngineArgs(model=str(resolved.path), tokenizer=str(resolved.path),
                                                      served_model_name=resolved.name, **engine_args))
    startup_vllm = time.perf_counter() - t0

    settings = Settings(namespace=f"overhead{uuid.uuid4().hex[:8]}")
    spec = WorkerSpec(engine="vllm", model=args.model,
                      extra_args=vllm_worker_args(args.kv_cache_gb, args.dtype, args.compile))
    sup = Supervisor(settings, spec, bridge=False)
    rounds: list[dict] = []
    pinned: dict[str, list[int]] = {}
    try:
        t0 = time.perf_counter()
        await sup.start()
        await sup.start_worker(WorkerRole.aggregated)
        await sup.wait_workers_ready(1, timeout_s=600)
        startup_kvflow = time.perf_counter() - t0
        async with KvflowClient(sup.settings, sup.catalog, timeout_s=600) as client:
            cpu: dict[str, dict[str, float]] = {"vllm": {}, "kvflow": {}}
            out_tokens = {"vllm": 0, "kvflow": 0}

            async def run(side: str, prompts: list[list[int]], counted: bool = True) -> tuple[int, float]:
                before = tree_cpu_s()
                if side == "vllm":
                    tokens, seconds = await vllm_batch(alone, prompts, args.max_tokens)
                else:
                    tokens, seconds = await kvflow_batch(client, resolved.name, prompts, args.max_tokens)
                if counted:
                    after = tree_cpu_s()
                    for role, used in after.items():
                        cpu[side][role] = cpu[side].get(role, 0.0) + used - before.get(role, 0.0)
                    out_tokens[side] += tokens
                return tokens, seconds

            warm = round_prompts(tokenizer, -1, args.streams, args.isl)
            for side in ("vllm", "kvflow"):
                await run(side, warm, counted=False)
            pinned = pin_tree(model_cpus, other_cpus) if args.pin else {}
            for r in range(args.rounds):
                prompts = round_prompts(tokenizer, r, args.streams, args.isl)
                row: dict = {"round": r, "first": "vllm" if r % 2 == 0 else "kvflow"}
                for side in (("vllm", "kvflow") if r % 2 == 0 else ("kvflow", "vllm")):
                    tokens, seconds = await run(side, prompts)
                    row[f"{side}_tokens"] = tokens
                    row[f"{side}_tok_s"] = round(tokens / seconds, 1)
                rounds.append(row)
                print(json.dumps(row), flush=True)
    finally:
        await sup.stop()
        alone.shutdown()
        alone = None  # not left to AsyncLLM.__del__ at interpreter exit

    vllm_tps = statistics.median(r["vllm_tok_s"] for r in rounds)
    kvflow_tps = statistics.median(r["kvflow_tok_s"] for r in rounds)
    return {
        "bench": "engine_overhead", "model": resolved.name, "device": device, "model_cpus": bind,
        "pinned": pinned,
        # the machine's 1-minute load average before and after: other work skews both sides
        "loadavg_1m": [round(load_before, 2), round(os.getloadavg()[0], 2)],
        "streams": args.streams, "isl": args.isl, "max_tokens": args.max_tokens, "rounds": args.rounds,
        "engine_args": {k: v for k, v in engine_args.items() if k != "kv_cache_memory_bytes"}
        | ({"kv_cache_gib": engine_args["kv_cache_memory_bytes"] / 2**30}
           if "kv_cache_memory_bytes" in engine_args else {}),
        "startup_s": {"vllm": round(startup_vllm, 1), "kvflow": round(startup_kvflow, 1)},
        "vllm_tok_s": vllm_tps, "kvflow_tok_s": kvflow_tps,
        "ratio": round(kvflow_tps / vllm_tps, 3),
        "ratio_per_round": [round(r["kvflow_tok_s"] / r["vllm_tok_s"], 3) for r in rounds],
        # CPU seconds per 1,000 output tokens, by process role, over the counted rounds (whole
        # process tree: the idle side's processes use none).
        "cpu_s_per_1k_tokens": {side: {role: round(used * 1000 / out_tokens[side], 3)
                                       for role, used in sorted(cpu[side].items()) if used > 0.005}
                                for side in cpu},
    }


def parse_args() -> argparse.Namespace:
    """Command-line options (see the module docstring)."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="SmolLM2-135M-Instruct")
    ap.add_argument("--streams", type=int, default=8, help="concurrent requests per side and round")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--isl", type=int, default=256, help="prompt tokens per request")
    ap.add_argument("--max-tokens", type=int, default=128, help="output tokens per request")
    ap.add_argument("--kv-cache-gb", type=float, default=None)
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--compile", action=argparse.BooleanOptionalAction, default=None)
    ap.add_argument("--model-cpus", default=None,
                    help="CPUs of vLLM's model threads, e.g. 0 or 0,1 (default: all but the last allowed CPU)")
    ap.add_argument("--pin", action=argparse.BooleanOptionalAction, default=True,
                    help="pin every other thread of both sides to the remaining CPUs")
    return ap.parse_args()


if __name__ == "__main__":  # the guard matters: vLLM spawns its engine processes
    print(json.dumps(asyncio.run(main(parse_args()))))
