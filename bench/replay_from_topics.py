"""What-if replay from the log: record a live run, replay it offline with two policies.

1. Start ``kvflow up --engine mocker --workers W --policy kv`` (embedded broker,
   HTTP bridge, mocker workers with ``--speedup-ratio``) in a temporary data dir.
2. Send ``--requests`` completions through the bridge: ``--groups`` prompt
   groups, each a long shared system prompt plus a distinct question,
   ``--concurrency`` at a time, groups interleaved in a seeded random order.
   The bridge tokenizes, so the requests topic holds the token ids.
3. ``kvflow replay --from-topics --since T0 --until T1`` with ``--policy kv``
   and with ``--policy round_robin``, same worker count and mocker speed,
   with the broker hop the replay measures from the log (``--hop-ms``
   unset), then ``kv`` once more with ``--hop-ms 0`` (records folded at
   once, as the simulator does without a hop); each writes the recorded
   run's and the replay's JSON reports.

    python bench/replay_from_topics.py [--requests 300] [--workers 2] [--groups 24] [--concurrency 8]
                                       [--speedup-ratio 20] [--num-kv-blocks 1024] [--replay-speedup-ratio R]
                                       [--out DIR]

Last stdout line: one JSON object with the hit rates (recorded, kv replay,
round-robin replay, kv replay without the hop), the kv replays' relative
errors against the recording, the measured hop, and where the reports and
plots are.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

MODEL = "mock-replay"


def free_port() -> int:
    """A TCP port free a moment ago."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def wait_healthy(url: str, timeout_s: float = 120.0) -> None:
    """Wait until the bridge's /health answers 200.

    Raises:
        TimeoutError: it never did.
    """
    deadline = time.monotonic() + timeout_s
    async with httpx.AsyncClient() as http:
        while time.monotonic() < deadline:
            try:
                if (await http.get(f"{url}/health")).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            await asyncio.sleep(0.2)
    raise TimeoutError(f"{url}/health never answered 200")


async def drive(url: str, requests: int, groups: int, concurrency: int, seed: int) -> int:
    """Send the workload; returns the number of 200 answers."""
    rng = random.Random(seed)
    order = [i % groups for i in range(requests)]
    rng.shuffle(order)
    sem = asyncio.Semaphore(concurrency)
    ok = 0

    async def one(http: httpx.AsyncClient, i: int, group: int) -> None:
        nonlocal ok
        prompt = (f"You are assistant number {group}. " + f"Rule {group}: answer briefly and politely. " * 12
                  + f"Question {i}: what is {i} plus {group}?")
        async with sem:
            answer = await http.post(f"{url}/v1/completions",
                                     json={"model": MODEL, "prompt": prompt, "max_tokens": 16})
        ok += answer.status_code == 200

    async with httpx.AsyncClient(timeout=120) as http:
        await asyncio.gather(*(one(http, i, g) for i, g in enumerate(order)))
    return ok


def replay(port: int, data_dir: Path, since: int, until: int, policy: str, workers: int, speedup: float,
           out: Path, hop_ms: float | None = None, label: str | None = None) -> dict:
    """Run ``kvflow replay --from-topics`` against the deployment; its JSON report.
    ``hop_ms``: the simulated broker hop (None: measured from the log)."""
    label = label or policy
    cmd = [sys.executable, "-m", "kvflow", "replay", "--from-topics", "--since", str(since), "--until", str(until),
           "--policy", policy, "--workers", str(workers), "--speedup-ratio", str(speedup), "--no-progress",
           "--json", str(out / f"{label}.json"), "--recorded-json", str(out / "recorded.json"),
           "--plots", str(out / f"plots_{label}"), "--save-trace", str(out / "trace.jsonl"), "--port", str(port), "--data-dir", str(data_dir)]
    if hop_ms is not None:
        cmd += ["--hop-ms", str(hop_ms)]
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    return json.loads((out / f"{label}.json").read_text())


def main() -> None:
    """Run the benchmark (see the module doc)."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=300)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--groups", type=int, default=24)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--speedup-ratio", type=float, default=20.0)
    parser.add_argument("--num-kv-blocks", type=int, default=1024)
    parser.add_argument("--replay-speedup-ratio", type=float, default=None,
                        help="mocker speed of the offline replays (default: --speedup-ratio)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    out = args.out or Path(tempfile.mkdtemp(prefix="kvflow-replay-bench-"))
    out.mkdir(parents=True, exist_ok=True)
    data_dir = out / "data"
    port = free_port()
    up = subprocess.Popen(
        [sys.executable, "-m", "kvflow", "up", "--engine", "mocker", "--workers", str(args.workers),
         "--model", MODEL, "--policy", "kv", "--port", str(port), "--data-dir", str(data_dir),
         "--speedup-ratio", str(args.speedup_ratio), "--num-kv-blocks", str(args.num_kv_blocks)],
        stdout=(out / "up.log").open("w"), stderr=subprocess.STDOUT, start_new_session=True)
    try:
        url = f"http://127.0.0.1:{port}"
        asyncio.run(wait_healthy(url))
        since = int(time.time() * 1000)
        ok = asyncio.run(drive(url, args.requests, args.groups, args.concurrency, args.seed))
        until = int(time.time() * 1000) + 1
        speed = args.replay_speedup_ratio or args.speedup_ratio
        kv = replay(port, data_dir, since, until, "kv", args.workers, speed, out)
        rr = replay(port, data_dir, since, until, "round_robin", args.workers, speed, out)
        kv0 = replay(port, data_dir, since, until, "kv", args.workers, speed, out, hop_ms=0.0, label="kv_no_hop")
        recorded = json.loads((out / "recorded.json").read_text())
    finally:
        os.killpg(up.pid, signal.SIGINT)
        up.wait(timeout=60)
    rec_hit = recorded["prefix_hit_rate"]
    print(json.dumps({
        "requests": args.requests, "answered_200": ok, "workers": args.workers, "groups": args.groups,
        "concurrency": args.concurrency, "num_kv_blocks": args.num_kv_blocks, "speedup_ratio": args.speedup_ratio,
        "replay_speedup_ratio": args.replay_speedup_ratio or args.speedup_ratio, "recorded_hit_rate": round(rec_hit, 4),
        "kv_replay_hit_rate": round(kv["prefix_hit_rate"], 4),
        "round_robin_replay_hit_rate": round(rr["prefix_hit_rate"], 4),
        "kv_replay_relative_error": round(abs(kv["prefix_hit_rate"] - rec_hit) / rec_hit, 4) if rec_hit else None,
        "hop_ms": kv["options"].get("hop_ms"),
        "kv_no_hop_replay_hit_rate": round(kv0["prefix_hit_rate"], 4),
        "kv_no_hop_relative_error": round(abs(kv0["prefix_hit_rate"] - rec_hit) / rec_hit, 4) if rec_hit else None,
        "recorded_ttft_p50_ms": recorded["ttft_ms"]["p50"], "kv_replay_ttft_p50_ms": kv["ttft_ms"]["p50"],
        "kv_no_hop_replay_ttft_p50_ms": kv0["ttft_ms"]["p50"],
        "out": str(out),
    }))


if __name__ == "__main__":
    main()
