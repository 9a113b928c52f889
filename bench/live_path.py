"""The live path under load: `kvflow up` (mocker workers) driven by AIPerf at trace timing.

Starts `kvflow up --engine mocker` (embedded broker, router, bridge, N worker
processes) as a child process group, then:

1. idle: CPU seconds of every kvflow process and the broker over ``--idle-s``
   with no traffic (after a settle period), and their wake-ups per second
   (Linux), a figure that host noise moves far less;
2. load: the first ``--requests`` of a Mooncake trace replayed with AIPerf
   (fixed schedule, streaming chat, server token counts: the same command the
   Dynamo comparison uses), measuring answered requests, TTFT/ITL and CPU
   seconds per process group per 1,000 output tokens (and, within
   ``bridge_router``, the bridge's tokenize children's:
   ``tokenize_cpu_s_per_1k_output_tokens``), and their wake-ups per 1,000
   output tokens (``wakeups_per_1k_output_tokens``);
3. stages: read back from the topics, per request, where the time before the
   first token went: bridge → router (``routing.decided_ms − created_ms``),
   router → worker (``queued_ms − decided_ms``), worker queue
   (``started_ms − queued_ms``), engine to first token
   (``first_token_ms − started_ms``), the worker's own per-request ITL
   (``engine_itl``: first token to finished over the tokens after the first,
   to set beside AIPerf's, which adds the delivery of the last record), and
   records on the responses topic;
   from the router's /metrics its decision time (``router_decision_ms``, KV
   catch-up waits included) and how many decisions waited for KV events
   (``router_events``);
   and from the bridge's /metrics its own TTFT and the time from body read to
   request record built (``bridge_prepare_ms``: parsing, chat template, tokenizing)
   and the share of prompt characters the tokenizer's chunk cache served
   (``tokenize_chars_from_cache``);
4. the CPU per 1,000 output tokens per ``--window-s`` window of the load, to
   show a cost that grows as the run goes on (e.g. the broker's with its log).

    python bench/live_path.py [--requests 300] [--workers 4] [--trace FILE] [--idle-s 60]
    python bench/live_path.py --requests 0 --settle-s 30     # the idle window only (no AIPerf needed)
        [--py-spy-dir DIR]   # also record py-spy flame graphs of bridge+router, a worker and ...
        [--stages-out FILE]  # also write each answered request's stages (ms), one JSON line each

AIPerf comes from ``$KVFLOW_AIPERF`` or ``.venv-aiperf/bin/aiperf`` (docs/aiperf.md).
Last stdout line: one JSON object with the figures.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import psutil

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_TRACE = ROOT / "examples" / "traces" / "mooncake_conversation_first40min.jsonl"


def pct(values: list[float], q: float) -> float | None:
    """Nearest-rank percentile ``q`` (0..100) of ``values`` (None when empty)."""
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q / 100 * len(ordered)) - 1))]


def groups(up: psutil.Process) -> dict[str, list[psutil.Process]]:
    """The deployment's processes by role: ``broker``, ``bridge_router`` (the
    `kvflow up` process itself and its other children, e.g. the bridge's
    tokenize pool), ``workers``."""
    out: dict[str, list[psutil.Process]] = {"broker": [], "bridge_router": [up], "workers": []}
    for child in up.children(recursive=True):
        try:
            cmd = " ".join(child.cmdline())
        except psutil.Error:
            continue
        if "tansu" in cmd:
            out["broker"].append(child)
        elif "kvflow worker" in cmd:
            out["workers"].append(child)
        else:
            out["bridge_router"].append(child)
    return out


def cpu_seconds(up: psutil.Process) -> dict[str, float]:
    """User + system CPU seconds so far, per group of :func:`groups`, found
    anew at each call: a process started since the last call (a restarted
    tokenize pool child) counts whole, one that exited since is lost."""
    out = {}
    for name, members in groups(up).items():
        total = 0.0
        for p in members:
            try:
                t = p.cpu_times()
                total += t.user + t.system
            except psutil.Error:
                pass
        out[name] = total
    return out


def tokenizer_cpu_seconds(up: psutil.Process) -> float:
    """User + system CPU seconds so far of the bridge's tokenize pool children
    (a part of ``bridge_router`` in :func:`groups`): the share of the
    bridge's CPU that tokenizing prompts takes, which Dynamo's frontend pays
    too."""
    total = 0.0
    for p in groups(up)["bridge_router"][1:]:
        try:
            if "tokenize_worker" in " ".join(p.cmdline()):
                t = p.cpu_times()
                total += t.user + t.system
        except psutil.Error:
            pass
    return total


def wakeups(up: psutil.Process) -> dict[str, int] | None:
    """Times each group's threads were put on a CPU so far (Linux
    ``/proc/<pid>/task/<tid>/schedstat``, third field), per group of
    :func:`groups`; None where that file does not exist.

    Wake-ups depend far less than CPU seconds on how loaded or cold the
    host is: on a shared 2-core VM the idle CPU of the same deployment
    differed 8x between windows an hour apart, its wake-ups 1.3x (1.7x
    at most for one group of processes)
    (docs/benchmarks.md, "Idle wake-ups").
    """
    out = {}
    for name, members in groups(up).items():
        total = 0
        for p in members:
            try:
                for tid in os.listdir(f"/proc/{p.pid}/task"):
                    with open(f"/proc/{p.pid}/task/{tid}/schedstat") as f:
                        total += int(f.read().split()[2])
            except (OSError, IndexError, ValueError):
                if not os.path.exists("/proc/self/schedstat"):
                    return None
        out[name] = total
    return out


def delta(a: dict[str, float], b: dict[str, float]) -> dict[str, float]:
    """``b − a`` per key, rounded to 0.01 s."""
    return {k: round(b[k] - a[k], 2) for k in a}


def wait_healthy(url: str, proc: subprocess.Popen, timeout_s: float = 600.0) -> None:
    """Wait until the bridge's /health answers 200.

    Raises:
        RuntimeError: `kvflow up` exited or did not become healthy in time.
    """
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"kvflow up exited with {proc.returncode}")
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise RuntimeError("kvflow up did not become healthy")


def find_aiperf() -> str | None:
    """The aiperf executable: ``$KVFLOW_AIPERF``, else the repo's ``.venv-aiperf``."""
    exe = os.environ.get("KVFLOW_AIPERF")
    if exe and Path(exe).exists():
        return exe
    local = ROOT / ".venv-aiperf" / "bin" / "aiperf"
    return str(local) if local.exists() else None


def stage_breakdown(bootstrap: str, namespace: str, per_request: Path | None = None) -> dict:
    """Per-stage latency percentiles (ms) from the requests and responses topics, and the records
    each topic of the namespace holds (``topic_records``). With ``per_request``, also writes one
    JSON line per answered request there (its id, ISL, worker and stages, ms), to find which
    requests make a tail."""
    import asyncio

    from aiokafka import AIOKafkaConsumer, TopicPartition

    async def read_all(topic: str) -> list:
        c = AIOKafkaConsumer(bootstrap_servers=bootstrap, enable_auto_commit=False, fetch_max_wait_ms=500)
        await c.start()
        try:
            parts = c.partitions_for_topic(topic) or set()
            tps = [TopicPartition(topic, p) for p in parts]
            c.assign(tps)
            await c.seek_to_beginning(*tps)
            out, empty = [], 0
            while empty < 3:
                batch = await c.getmany(timeout_ms=1000, max_records=20000)
                empty = 0 if batch else empty + 1
                for recs in batch.values():
                    out.extend(recs)
            return out
        finally:
            await c.stop()

    async def main() -> dict:
        created = {}
        for msg in await read_all(f"{namespace}.requests"):
            try:
                rec = json.loads(msg.value)
                created[rec["request_id"]] = rec.get("created_ms", 0)
            except (ValueError, KeyError, TypeError):
                pass
        responses = await read_all(f"{namespace}.responses")
        stages: dict[str, list[float]] = {"bridge_to_router": [], "router_to_worker": [], "worker_queue": [],
                                          "engine_to_first_token": [], "created_to_first_token": [],
                                          "engine_itl": []}
        deltas = finals = 0
        rows = []
        for msg in responses:
            try:
                rec = json.loads(msg.value)
            except ValueError:
                continue
            if rec.get("type") == "delta":
                deltas += 1
                continue
            finals += 1
            t, r = rec.get("timings") or {}, rec.get("routing") or {}
            c = created.get(rec.get("request_id"))
            if not c or not t.get("first_token_ms") or not r.get("decided_ms"):
                continue
            stages["bridge_to_router"].append(r["decided_ms"] - c)
            stages["router_to_worker"].append(t["queued_ms"] - r["decided_ms"])
            stages["worker_queue"].append(t["started_ms"] - t["queued_ms"])
            stages["engine_to_first_token"].append(t["first_token_ms"] - t["started_ms"])
            stages["created_to_first_token"].append(t["first_token_ms"] - c)
            tokens = (rec.get("usage") or {}).get("completion_tokens", 0)
            if tokens > 1 and t.get("finished_ms"):  # the worker's view of AIPerf's per-request ITL
                stages["engine_itl"].append(round((t["finished_ms"] - t["first_token_ms"]) / (tokens - 1), 2))
            if per_request is not None:
                rows.append({"request_id": rec.get("request_id"), "created_ms": c,
                             "isl": (rec.get("usage") or {}).get("prompt_tokens"), "osl": tokens,
                             "worker_id": rec.get("worker_id"),
                             **{k: v[-1] for k, v in stages.items() if k != "engine_itl" and v}})
        if per_request is not None:
            rows.sort(key=lambda row: row["created_ms"])
            per_request.write_text("".join(json.dumps(row) + "\n" for row in rows))
        out = {k: {"p50": pct(v, 50), "p99": pct(v, 99), "mean": round(statistics.fmean(v), 1) if v else None}
               for k, v in stages.items()}
        out["responses_records"] = {"deltas": deltas, "finals": finals}
        out["topic_records"] = await topic_records()
        return out

    async def topic_records() -> dict[str, int]:
        # Records per topic of the namespace (end offsets summed over partitions): what the broker carried.
        c = AIOKafkaConsumer(bootstrap_servers=bootstrap, enable_auto_commit=False)
        await c.start()
        try:
            counts = {}
            for topic in sorted(await c.topics()):
                if not topic.startswith(f"{namespace}."):
                    continue
                tps = [TopicPartition(topic, p) for p in c.partitions_for_topic(topic) or ()]
                ends = await c.end_offsets(tps) if tps else {}
                counts[topic.removeprefix(f"{namespace}.")] = sum(ends.values())
            return {k: v for k, v in counts.items() if v}
        finally:
            await c.stop()

    return asyncio.run(main())


def samples(url: str, name: str) -> list:
    """The samples of the metric family ``name`` on ``url``'s /metrics (``url``
    itself when it ends in /metrics; empty when absent)."""
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(url if url.endswith("/metrics") else f"{url}/metrics", timeout=10).text
    return [sample for fam in text_string_to_metric_families(text) if fam.name == name for sample in fam.samples]


def histogram_ms(url: str, name: str = "kvflow_bridge_ttft_seconds") -> dict:
    """Mean and bucket-estimated p50/p99 (ms) of a latency histogram (seconds)
    on ``url``'s /metrics: by default the bridge's own TTFT (body read → first
    token written); ``kvflow_bridge_prepare_seconds`` is body read → request
    record built (parsing, chat template, tokenizing)."""
    buckets: dict[float, float] = {}
    total = count = 0.0
    for sample in samples(url, name):
        if sample.name.endswith("_bucket"):
            le = float(sample.labels["le"])
            buckets[le] = buckets.get(le, 0.0) + sample.value
        elif sample.name.endswith("_sum"):
            total += sample.value
        elif sample.name.endswith("_count"):
            count += sample.value

    def quantile(q: float) -> float | None:
        for le in sorted(buckets):
            if count and buckets[le] >= q * count:
                return le * 1000
        return None

    return {"mean": round(1000 * total / count, 1) if count else None, "p50_le": quantile(0.5),
            "p99_le": quantile(0.99)}


def output_tokens_so_far(url: str) -> float:
    """Output tokens of the requests the bridge finished so far (its OSL histogram's sum)."""
    try:
        found = samples(url, "kvflow_bridge_osl_tokens")
    except httpx.HTTPError:
        return 0.0
    return sum(sample.value for sample in found if sample.name.endswith("_sum"))


def counter_totals(url: str, name: str, label: str) -> dict[str, float]:
    """Sum of the ``name`` counter's samples on ``url``'s /metrics by the value
    of ``label`` (e.g. ``kvflow_bridge_tokenize_chars`` by ``source``)."""
    out: dict[str, float] = {}
    for sample in samples(url, name):
        if sample.name.endswith("_total") and label in sample.labels:
            out[sample.labels[label]] = out.get(sample.labels[label], 0.0) + sample.value
    return out


def py_spy(procs: dict[str, list[psutil.Process]], out_dir: Path, seconds: int) -> list[subprocess.Popen]:
    """Start py-spy flame-graph recordings of the bridge+router process and the first worker."""
    out_dir.mkdir(parents=True, exist_ok=True)
    spies = []
    for name, p in (("bridge_router", procs["bridge_router"][0]), ("worker", (procs["workers"] or [None])[0])):
        if p is None:
            continue
        spies.append(subprocess.Popen(["py-spy", "record", "--pid", str(p.pid), "--duration", str(seconds),
                                       "--rate", "50", "--gil", "--output", str(out_dir / f"live_path_{name}.svg")],
                                      stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
    return spies


def main() -> None:
    """Run the bench; prints the figures as JSON on the last line."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--trace", type=Path, default=DEFAULT_TRACE)
    ap.add_argument("--requests", type=int, default=300, help="0: measure the idle window only")
    ap.add_argument("--workers", type=int, default=4)
    ap.add_argument("--speedup-ratio", type=float, default=1.0)
    ap.add_argument("--policy", default="kv")
    ap.add_argument("--port", type=int, default=8300)
    ap.add_argument("--idle-s", type=float, default=60.0)
    ap.add_argument("--settle-s", type=float, default=10.0)
    ap.add_argument("--py-spy-dir", type=Path, default=None)
    ap.add_argument("--py-spy-s", type=int, default=60)
    ap.add_argument("--stages-out", type=Path, default=None,
                    help="Also write each answered request's stages (ms) to this JSONL file")
    ap.add_argument("--max-input-length", type=int, default=None)
    ap.add_argument("--window-s", type=float, default=30.0,
                    help="window of cpu_s_per_1k_output_tokens_by_window (CPU over output tokens finished)")
    ap.add_argument("--aiperf-arg", action="append", default=[],
                    help="Extra `aiperf profile` argument (repeatable), e.g. --aiperf-arg=--request-timeout-seconds=60")
    args = ap.parse_args()

    aiperf = find_aiperf()
    if aiperf is None and args.requests > 0:
        sys.exit("aiperf not found: set KVFLOW_AIPERF (docs/aiperf.md)")
    work = Path(tempfile.mkdtemp(prefix="kvflow-live-path-"))
    url = f"http://127.0.0.1:{args.port}"
    env = {**os.environ, "KVFLOW_STATE_FILE": str(work / "up.json"), "KVFLOW_DATA_DIR": str(work / "data"),
           "KVFLOW_MAX_PROMPT_TOKENS": "200000", "KVFLOW_AIPERF": aiperf or ""}
    kvflow = str(Path(sys.executable).parent / "kvflow")
    up = subprocess.Popen([kvflow, "up", "--engine", "mocker", "--workers", str(args.workers),
                           "--policy", args.policy, "--mocker-tokenizer", "SmolLM2-135M-Instruct",
                           "--speedup-ratio", str(args.speedup_ratio), "--port", str(args.port)],
                          env=env, stdout=open(work / "up.log", "w"), stderr=subprocess.STDOUT,
                          stdin=subprocess.DEVNULL, start_new_session=True)
    result: dict = {"requests": args.requests, "workers": args.workers, "trace": args.trace.name,
                    "speedup_ratio": args.speedup_ratio, "policy": args.policy}
    try:
        wait_healthy(url, up)
        state = json.loads((work / "up.json").read_text())
        time.sleep(args.settle_s)
        up_proc = psutil.Process(up.pid)
        c0, w0 = cpu_seconds(up_proc), wakeups(up_proc)
        time.sleep(args.idle_s)
        idle, w1 = delta(c0, cpu_seconds(up_proc)), wakeups(up_proc)
        procs = groups(up_proc)
        result["processes"] = {name: len(members) for name, members in procs.items()}
        result["idle_cpu_pct_of_one_core"] = round(100 * sum(idle.values()) / args.idle_s, 2)
        result["idle_cpu_s"] = idle
        if w0 is not None and w1 is not None:
            result["idle_wakeups_per_s"] = {k: round((w1[k] - w0.get(k, 0)) / args.idle_s, 1) for k in w1}

        if args.requests > 0:
            spies = py_spy(procs, args.py_spy_dir, args.py_spy_s) if args.py_spy_dir else []
            c0, tok0, lw0 = cpu_seconds(up_proc), tokenizer_cpu_seconds(up_proc), wakeups(up_proc)
            t0 = time.monotonic()
            cmd = [kvflow, "aiperf", str(args.trace), "--limit", str(args.requests), "--url", url,
                   "--artifact-dir", str(work / "aiperf")]
            if args.max_input_length:
                cmd += ["--max-input-length", str(args.max_input_length)]
            if args.aiperf_arg:
                cmd += ["--", *args.aiperf_arg]
            runner = subprocess.Popen(cmd, env=env, stdout=open(work / "aiperf.log", "w"), stderr=subprocess.STDOUT)
            windows = []  # CPU per group per 1,000 output tokens finished in each window: does a cost grow?
            w_cpu, w_tokens = c0, output_tokens_so_far(url)
            while True:
                try:
                    rc = runner.wait(timeout=args.window_s)
                    break
                except subprocess.TimeoutExpired:
                    cpu, tokens = cpu_seconds(up_proc), output_tokens_so_far(url)
                    if tokens > w_tokens:
                        windows.append({k: round(1000 * v / (tokens - w_tokens), 3) for k, v in delta(w_cpu, cpu).items()})
                    w_cpu, w_tokens = cpu, tokens
            load_s = time.monotonic() - t0
            result["cpu_s_per_1k_output_tokens_by_window"] = windows
            load = delta(c0, cpu_seconds(up_proc))
            tokenize_s, lw1 = tokenizer_cpu_seconds(up_proc) - tok0, wakeups(up_proc)
            for spy in spies:
                spy.wait(timeout=args.py_spy_s + 60)
            export = json.loads((work / "aiperf" / "profile_export_aiperf.json").read_text())
            out_tokens = export.get("total_osl", {}).get("avg") or export["output_sequence_length"]["sum"]
            result.update({
                "aiperf_rc": rc, "load_wall_s": round(load_s, 1),
                "answered": int(export["request_count"]["avg"]),
                "errors": int((export.get("error_request_count") or {}).get("avg", 0)),
                "ttft_ms_p50": export["time_to_first_token"]["p50"], "ttft_ms_p99": export["time_to_first_token"]["p99"],
                "itl_ms_p50": export["inter_token_latency"]["p50"], "itl_ms_p99": export["inter_token_latency"]["p99"],
                "output_tokens": out_tokens, "load_cpu_s": load,
                "cpu_s_per_1k_output_tokens": {k: round(1000 * v / out_tokens, 3) for k, v in load.items()},
            })
            result["cpu_s_per_1k_output_tokens"]["total"] = round(sum(result["cpu_s_per_1k_output_tokens"].values()), 3)
            result["tokenize_cpu_s_per_1k_output_tokens"] = round(1000 * tokenize_s / out_tokens, 3)  # within bridge_router
            if lw0 is not None and lw1 is not None:  # steadier than CPU seconds on a noisy host
                result["wakeups_per_1k_output_tokens"] = {k: round(1000 * (lw1[k] - lw0.get(k, 0)) / out_tokens, 1)
                                                          for k in lw1}
            result["bridge_ttft_ms"] = histogram_ms(url)
            result["bridge_prepare_ms"] = histogram_ms(url, "kvflow_bridge_prepare_seconds")
            chars = counter_totals(url, "kvflow_bridge_tokenize_chars", "source")
            result["tokenize_chars_from_cache"] = round(chars.get("cache", 0) / sum(chars.values()), 3) if chars else None
            result["aiperf_ttft_ms_mean"] = export["time_to_first_token"]["avg"]
            if state.get("metrics_url"):  # the router's share of bridge → router: its decisions and KV catch-up waits
                result["router_decision_ms"] = histogram_ms(state["metrics_url"], "kvflow_router_decision_seconds")
                events = counter_totals(state["metrics_url"], "kvflow_router_events", "event")
                result["router_events"] = {k: int(events.get(k, 0)) for k in ("decisions", "kv_waits",
                                                                            "kv_wait_timeouts")}
            result["stages_ms"] = stage_breakdown(state["bootstrap_servers"], state.get("namespace", "kvflow"),
                                                  args.stages_out)
    finally:
        os.killpg(up.pid, signal.SIGINT)
        try:
            up.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(up.pid, signal.SIGKILL)
    result["work_dir"] = str(work)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
