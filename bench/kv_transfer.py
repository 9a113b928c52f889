"""KV transfer bandwidth: NIXL and TCP between two processes, against a memcpy.

A source process (this script with ``--serve``) exposes one host buffer per
size through :class:`kvflow.workers.kv.transfer.KvTransport`; this process
pulls each buffer repeatedly with its own transport, exactly as a decode
worker does (``KvTransport.pull``: NIXL READ with per-pull registration of
the destination, or the TCP fallback). In the same run it times a
single-process ``numpy.copyto`` of the same size (memcpy) and reports each
transport's bandwidth as a fraction of it.

    python bench/kv_transfer.py [--sizes-mib 1 16 64 256] [--reps 5] [--backends nixl tcp] [--device cuda]

``--device cuda`` puts both buffers in GPU memory (torch CUDA tensors, which
the transport registers with NIXL as ``VRAM``; TCP stages through host
memory) and compares against a device-to-device ``Tensor.copy_``.

Bandwidth = bytes / median seconds of ``reps`` pulls into a reused, pre-faulted
destination, after one warm-up pull (which also checks the bytes).
``fresh_dest_gbps`` is one pull into a newly allocated destination, as the hf
engine does per request (page faults included). Last stdout line: one JSON object.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import time

import numpy as np

from kvflow.schemas.transfer import TransferDescriptor
from kvflow.workers.kv.transfer import KvTransport, TransferConfig, TransferError

MIB = 2**20


def payload(size: int) -> np.ndarray:
    """Deterministic pseudo-random bytes (both processes can rebuild them)."""
    return np.random.default_rng(size).integers(0, 256, size, dtype=np.uint8)


def on_device(buf: np.ndarray, device: str):
    """``buf`` itself (``cpu``), or a torch tensor copy of it on ``device``."""
    if device == "cpu":
        return buf
    import torch

    return torch.from_numpy(buf).to(device)


def empty_like_on(size: int, device: str, fill: bool = True):
    """A destination of ``size`` bytes on ``device`` (pre-faulted when ``fill``)."""
    if device == "cpu":
        dest = np.empty(size, np.uint8)
    else:
        import torch

        dest = torch.empty(size, dtype=torch.uint8, device=device)
    if fill:
        dest.fill(1) if device == "cpu" else dest.fill_(1)
    return dest


def same_bytes(dest, size: int) -> bool:
    """Whether ``dest`` (host array or device tensor) holds :func:`payload` of ``size``."""
    host = dest if isinstance(dest, np.ndarray) else dest.cpu().numpy()
    return bool(np.array_equal(host, payload(size)))


def sync(device: str) -> None:
    """Wait for the device's queued work (no-op on the CPU)."""
    if device != "cpu":
        import torch

        torch.cuda.synchronize()


async def serve(backend: str, sizes: list[int], device: str = "cpu") -> None:
    """Source side: expose one buffer per size, print descriptors, wait for a line on stdin."""
    transport = KvTransport("bench-source", TransferConfig(backend=backend, ttl_s=3600))
    await transport.start()
    buffers = [on_device(payload(s), device) for s in sizes]
    descs = [await transport.expose(f"bench-{s}", b) for s, b in zip(sizes, buffers)]
    print(json.dumps({"backend": transport.backend, "nixl_error": transport.nixl_error,
                      "descs": [d.model_dump(mode="json") for d in descs]}), flush=True)
    await asyncio.get_running_loop().run_in_executor(None, sys.stdin.readline)
    await transport.close()


async def json_line(stream: asyncio.StreamReader) -> dict:
    while True:
        line = await asyncio.wait_for(stream.readline(), 120)
        if not line:
            raise RuntimeError("source process exited")
        if line.startswith(b"{"):
            return json.loads(line)


def memcpy_gbps(size: int, reps: int, device: str = "cpu") -> float:
    src = on_device(payload(size), device)
    dst = empty_like_on(size, device)  # fault the pages in before timing
    copy = (lambda: np.copyto(dst, src)) if device == "cpu" else (lambda: dst.copy_(src))
    copy()
    sync(device)
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        copy()
        sync(device)
        times.append(time.perf_counter() - t0)
    return size / statistics.median(times) / 1e9


async def bench_backend(backend: str, sizes: list[int], reps: int, device: str = "cpu") -> dict:
    proc = await asyncio.create_subprocess_exec(sys.executable, __file__, "--serve", backend,
                                                "--sizes-mib", *(str(s // MIB) for s in sizes),
                                                "--device", device,
                                                stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE)
    reader = KvTransport("bench-reader", TransferConfig(backend=backend))
    try:
        try:
            await reader.start()
        except TransferError as exc:
            return {"backend": backend, "error": str(exc)}
        hello = await json_line(proc.stdout)
        if hello["backend"] != backend:
            return {"backend": backend, "error": f"source fell back to {hello['backend']}: {hello['nixl_error']}"}
        rows = []
        for size, raw in zip(sizes, hello["descs"]):
            desc = TransferDescriptor.model_validate(raw)
            dest = empty_like_on(size, device)
            used = await reader.pull(desc, dest)  # warm-up: connection, first registration
            if used != backend or not same_bytes(dest, size):
                raise RuntimeError(f"{backend} pull of {size} bytes went over {used} or corrupted the data")
            times = []
            for _ in range(reps):
                t0 = time.perf_counter()
                await reader.pull(desc, dest)
                sync(device)
                times.append(time.perf_counter() - t0)
            fresh = empty_like_on(size, device, fill=False)
            t0 = time.perf_counter()
            await reader.pull(desc, fresh)
            sync(device)
            fresh_s = time.perf_counter() - t0
            if not same_bytes(fresh, size):
                raise RuntimeError(f"{backend} pull of {size} bytes into a fresh destination corrupted the data")
            rows.append({"size_mib": size // MIB, "gbps": size / statistics.median(times) / 1e9,
                         "best_gbps": size / min(times) / 1e9, "fresh_dest_gbps": size / fresh_s / 1e9})
        return {"backend": backend, "rows": rows}
    finally:
        await reader.close()
        if proc.returncode is None:
            proc.stdin.write(b"quit\n")
            await proc.stdin.drain()
            try:
                await asyncio.wait_for(proc.wait(), 30)
            except TimeoutError:
                proc.kill()
                await proc.wait()


async def main(args: argparse.Namespace) -> dict:
    sizes = [s * MIB for s in args.sizes_mib]
    results = {b: await bench_backend(b, sizes, args.reps, args.device) for b in args.backends}
    table = []
    for size in sizes:
        memcpy = memcpy_gbps(size, args.reps, args.device)
        row = {"size_mib": size // MIB, "memcpy_gbps": round(memcpy, 2)}
        for backend, result in results.items():
            found = next((r for r in result.get("rows", []) if r["size_mib"] == size // MIB), None)
            if found is None:
                continue
            row[f"{backend}_gbps"] = round(found["gbps"], 2)
            row[f"{backend}_best_gbps"] = round(found["best_gbps"], 2)
            row[f"{backend}_fresh_dest_gbps"] = round(found["fresh_dest_gbps"], 2)
            row[f"{backend}_vs_memcpy"] = round(found["gbps"] / memcpy, 3)
        table.append(row)
        print(" ".join(f"{k}={v}" for k, v in row.items()), file=sys.stderr)
    nixl_ok = [r["nixl_vs_memcpy"] >= 0.5 for r in table if "nixl_vs_memcpy" in r and r["size_mib"] >= 16]
    return {
        "bench": "kv_transfer", "device": args.device, "processes": 2, "cpus": len(os.sched_getaffinity(0)), "reps": args.reps,
        "errors": {b: r["error"] for b, r in results.items() if "error" in r},
        "rows": table,
        "target_nixl_ge_half_memcpy_at_16mib_plus": all(nixl_ok) if nixl_ok else None,
    }


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes-mib", type=int, nargs="+", default=[1, 16, 64, 256])
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--backends", nargs="+", default=["nixl", "tcp"], choices=["nixl", "tcp"])
    ap.add_argument("--device", default="cpu", help="cpu, or a torch CUDA device such as cuda or cuda:0")
    ap.add_argument("--serve", choices=["nixl", "tcp"], help=argparse.SUPPRESS)
    parsed = ap.parse_args()
    if parsed.serve:
        asyncio.run(serve(parsed.serve, [s * MIB for s in parsed.sizes_mib], parsed.device))
    else:
        print(json.dumps(asyncio.run(main(parsed))))
