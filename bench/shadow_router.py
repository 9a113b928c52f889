"""Shadow router on a live run: a ``kvflow up`` routing with one policy, ``kvflow shadow`` with another.

1. Start ``kvflow up --engine mocker --workers W --policy LIVE`` in a temporary data dir.
2. Start ``kvflow shadow --policy SHADOW`` against it and wait for its first report line.
3. Send the workload of ``bench/replay_from_topics.py`` (prompt groups sharing
   long system prompts, ``--concurrency`` in flight) through the bridge.
4. Stop the shadow (SIGINT); its last line is the report.

    python bench/shadow_router.py [--live round_robin] [--shadow kv] [--requests 200] [--workers 2]
                                  [--groups 24] [--concurrency 8] [--num-kv-blocks 128]

Last stdout line: one JSON object, the shadow's final report (requests
compared, agreement, predicted hit ratio of each router, difference).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from replay_from_topics import MODEL, drive, free_port, wait_healthy  # noqa: E402


def main() -> None:
    """Run the benchmark (see the module doc)."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--live", default="round_robin")
    parser.add_argument("--shadow", default="kv")
    parser.add_argument("--requests", type=int, default=200)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--groups", type=int, default=24)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--speedup-ratio", type=float, default=20.0)
    parser.add_argument("--num-kv-blocks", type=int, default=128)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    out = Path(tempfile.mkdtemp(prefix="kvflow-shadow-bench-"))
    port = free_port()
    join = ["--port", str(port), "--data-dir", str(out / "data")]
    up = subprocess.Popen(
        [sys.executable, "-m", "kvflow", "up", "--engine", "mocker", "--workers", str(args.workers), "--model", MODEL,
         "--policy", args.live, "--speedup-ratio", str(args.speedup_ratio), "--num-kv-blocks",
         str(args.num_kv_blocks), *join],
        stdout=(out / "up.log").open("w"), stderr=subprocess.STDOUT, start_new_session=True)
    shadow = None
    try:
        asyncio.run(wait_healthy(f"http://127.0.0.1:{port}"))
        shadow = subprocess.Popen(
            [sys.executable, "-m", "kvflow", "shadow", "--policy", args.shadow, "--report-interval-s", "1", *join],
            stdout=subprocess.PIPE, stderr=(out / "shadow.log").open("w"), text=True, start_new_session=True)
        shadow.stdout.readline()  # the first report: the shadow is positioned
        started = time.monotonic()
        ok = asyncio.run(drive(f"http://127.0.0.1:{port}", args.requests, args.groups, args.concurrency, args.seed))
        last = {}
        while last.get("compared", 0) < ok and time.monotonic() - started < 300:
            last = json.loads(shadow.stdout.readline())
    finally:
        if shadow is not None:
            os.killpg(shadow.pid, signal.SIGINT)
            shadow.wait(timeout=60)
        os.killpg(up.pid, signal.SIGINT)
        up.wait(timeout=60)
    print(json.dumps({"live": args.live, "workers": args.workers, "requests": args.requests, "answered_200": ok,
                      "num_kv_blocks": args.num_kv_blocks, **last}))


if __name__ == "__main__":
    main()
