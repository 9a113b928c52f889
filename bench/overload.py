"""Overload: twice the sustainable rate against `kvflow up`, live.

Starts ``kvflow up --engine mocker`` (embedded broker, router, bridge, N
mocker workers) with the bridge's in-flight bound set to ``--max-inflight``,
then:

1. probe: ``--probe-concurrency`` clients in a closed loop for
   ``--probe-s`` seconds; the completed requests per second are the
   sustainable rate;
2. overload: requests sent open-loop at ``--factor`` x that rate (evenly
   spaced) for ``--overload-s`` seconds, each a non-streaming chat
   completion; every answer is classified (200, 503 with/without
   ``Retry-After``, other status, no answer within ``--timeout-s``);
3. the bridge process's RSS is sampled every 0.5 s throughout.

Every request the bridge admits must complete; the rest must get 503 with
``Retry-After``. Last stdout line: one JSON object with the figures.

    python bench/overload.py [--workers 2] [--max-inflight 64] [--factor 2] [--overload-s 30]
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import psutil

MODEL = "SmolLM2-135M-Instruct"


def body(i: int, max_tokens: int) -> dict:
    """A chat request whose prompt differs per ``i`` (a few hundred tokens)."""
    words = " ".join(f"w{(i * 7919 + k) % 5000}" for k in range(200))
    return {"model": MODEL, "messages": [{"role": "user", "content": words}], "max_tokens": max_tokens}


async def wait_healthy(url: str, proc: subprocess.Popen, timeout_s: float = 180) -> None:
    """Poll ``/health`` and ``/v1/models`` until the model is served.

    Raises:
        RuntimeError: the deployment exited or did not serve the model in time.
    """
    deadline = time.monotonic() + timeout_s
    async with httpx.AsyncClient(base_url=url, timeout=5) as http:
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise RuntimeError(f"kvflow up exited with {proc.returncode}")
            try:
                models = (await http.get("/v1/models")).json().get("data", [])
                if any(m["id"] == MODEL for m in models):
                    return
            except (httpx.HTTPError, ValueError):
                pass
            await asyncio.sleep(0.5)
    raise RuntimeError("deployment not healthy in time")


async def probe(http: httpx.AsyncClient, concurrency: int, seconds: float, max_tokens: int) -> float:
    """Closed loop: completed requests per second with ``concurrency`` clients."""
    done = 0
    end = time.monotonic() + seconds

    async def client(c: int) -> None:
        nonlocal done
        i = c
        while time.monotonic() < end:
            r = await http.post("/v1/chat/completions", json=body(i, max_tokens))
            if r.status_code == 200:
                done += 1
            i += concurrency

    t0 = time.monotonic()
    await asyncio.gather(*(client(c) for c in range(concurrency)))
    return done / (time.monotonic() - t0)


async def overload(http: httpx.AsyncClient, rate: float, seconds: float, max_tokens: int,
                   timeout_s: float) -> collections.Counter:
    """Open loop at ``rate`` req/s for ``seconds``; returns outcome counts."""
    outcomes: collections.Counter = collections.Counter()

    async def one(i: int) -> None:
        try:
            r = await http.post("/v1/chat/completions", json=body(10_000_000 + i, max_tokens), timeout=timeout_s)
        except httpx.TimeoutException:
            outcomes["no_answer"] += 1
            return
        except httpx.HTTPError as exc:
            outcomes[f"transport_error:{type(exc).__name__}"] += 1
            return
        if r.status_code == 200:
            ok = r.json()["choices"][0]["finish_reason"] in ("stop", "length")
            outcomes["completed" if ok else "200_unfinished"] += 1
        elif r.status_code == 503:
            outcomes["503_retry_after" if r.headers.get("Retry-After") else "503_no_retry_after"] += 1
        else:
            outcomes[f"status_{r.status_code}"] += 1

    tasks = []
    n = int(rate * seconds)
    t0 = time.monotonic()
    for i in range(n):
        await asyncio.sleep(max(0.0, t0 + i / rate - time.monotonic()))
        tasks.append(asyncio.create_task(one(i)))
    outcomes["sent"] = n
    await asyncio.gather(*tasks)
    return outcomes


async def sample_rss(proc: psutil.Process, out: list[float], stop: asyncio.Event) -> None:
    """Append the process's RSS (MiB) every 0.5 s until ``stop``."""
    while not stop.is_set():
        try:
            out.append(proc.memory_info().rss / 2**20)
        except psutil.Error:
            return
        await asyncio.sleep(0.5)


async def run(args: argparse.Namespace) -> dict:
    work = Path(tempfile.mkdtemp(prefix="kvflow-overload-"))
    env = {**os.environ, "KVFLOW_STATE_FILE": str(work / "up.json"), "KVFLOW_DATA_DIR": str(work / "data"),
           "KVFLOW_BRIDGE_MAX_INFLIGHT_REQUESTS": str(args.max_inflight)}
    kvflow = str(Path(sys.executable).parent / "kvflow")
    up = subprocess.Popen([kvflow, "up", "--engine", "mocker", "--workers", str(args.workers),
                           "--mocker-tokenizer", MODEL, "--port", str(args.port)],
                          env=env, stdout=open(work / "up.log", "w"), stderr=subprocess.STDOUT,
                          stdin=subprocess.DEVNULL, start_new_session=True)
    url = f"http://127.0.0.1:{args.port}"
    rss: list[float] = []
    stop = asyncio.Event()
    try:
        await wait_healthy(url, up)
        sampler = asyncio.create_task(sample_rss(psutil.Process(up.pid), rss, stop))
        limits = httpx.Limits(max_connections=4 * args.max_inflight, max_keepalive_connections=args.max_inflight)
        async with httpx.AsyncClient(base_url=url, timeout=args.timeout_s, limits=limits) as http:
            sustainable = await probe(http, args.probe_concurrency, args.probe_s, args.max_tokens)
            rss_before = rss[-1] if rss else None
            outcomes = await overload(http, args.factor * sustainable, args.overload_s, args.max_tokens,
                                      args.timeout_s)
            after = await http.post("/v1/chat/completions", json=body(-1, args.max_tokens))
        stop.set()
        await sampler
        admitted = outcomes["sent"] - outcomes["503_retry_after"] - outcomes["503_no_retry_after"]
        return {
            "workers": args.workers, "max_inflight": args.max_inflight, "max_tokens": args.max_tokens,
            "sustainable_rps": round(sustainable, 2), "offered_rps": round(args.factor * sustainable, 2),
            "overload_s": args.overload_s, "outcomes": dict(outcomes), "admitted": admitted,
            "admitted_completed": outcomes["completed"], "lost": admitted - outcomes["completed"],
            "status_after": after.status_code,
            "bridge_rss_mib": {"before_overload": round(rss_before, 1) if rss_before else None,
                               "max": round(max(rss), 1) if rss else None,
                               "end": round(rss[-1], 1) if rss else None},
            "work_dir": str(work),
        }
    finally:
        stop.set()
        os.killpg(up.pid, signal.SIGINT)
        try:
            up.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(up.pid, signal.SIGKILL)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--max-inflight", type=int, default=64, help="the bridge's in-flight bound")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--probe-concurrency", type=int, default=32)
    ap.add_argument("--probe-s", type=float, default=20.0)
    ap.add_argument("--factor", type=float, default=2.0)
    ap.add_argument("--overload-s", type=float, default=30.0)
    ap.add_argument("--timeout-s", type=float, default=300.0)
    ap.add_argument("--port", type=int, default=8340)
    args = ap.parse_args()
    print(json.dumps(asyncio.run(run(args))))


if __name__ == "__main__":
    main()
