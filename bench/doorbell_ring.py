"""CPU cost of one doorbell ring, with the ringer's cached peer list and with a scan per ring.

A ring (:func:`kvflow.streams.doorbell.ring`) sends one UDP datagram to every
other ringable process of the host. It used to list the doorbell directory
and read every peer's port file on each ring; it now reuses that list until
the directory changes. This bench opens a doorbell, starts ``--peers``
ringable processes (``python -m kvflow.streams.doorbell``) (a ``kvflow up --workers 4`` deployment has the bridge and
router process and four workers), and times rings both ways in alternating
rounds in one process: ``cached`` as shipped, and ``scan`` with
``PEERS_MAX_AGE_S = 0`` (the list is read on every ring, as before). Each
ring names a new partition, so the per-partition gap never skips one.

    python bench/doorbell_ring.py [--peers 5] [--rings 2000] [--rounds 5]

Prints one JSON object on its last line: CPU microseconds per ring (process
CPU time, median over rounds) for each way, and their ratio.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import uuid

from kvflow.streams import doorbell


def time_rings(n: int, start: int) -> float:
    """CPU seconds of ``n`` rings of partitions ``start`` .. ``start + n - 1``."""
    t0 = time.process_time()
    for i in range(start, start + n):
        doorbell.ring("bench", i)
    return time.process_time() - t0


async def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--peers", type=int, default=5)
    ap.add_argument("--rings", type=int, default=2000, help="rings per round and way")
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()

    bootstrap = f"bench-{uuid.uuid4().hex[:8]}:1"
    doorbell.open_doorbell(bootstrap, lambda *_: None)
    # Each peer prints every ring it gets: into a file, so a peer never blocks on a full pipe.
    outs = [tempfile.TemporaryFile() for _ in range(args.peers)]
    peers = [subprocess.Popen([sys.executable, "-m", "kvflow.streams.doorbell", bootstrap], stdout=out)
             for out in outs]
    try:
        deadline = time.monotonic() + 120
        while not all(os.pread(out.fileno(), 6, 0) == b"ready\n" for out in outs):
            if time.monotonic() > deadline:
                sys.exit("the peers did not open their doorbells within 120 s")
            await asyncio.sleep(0.05)
        await asyncio.sleep(0.2)  # let the directory settle (a scan within 50 ms of a change is not reused)
        sent = doorbell.ring("bench-check", 0)
        if sent != args.peers:
            sys.exit(f"expected {args.peers} peers, rang {sent}")
        per_ring: dict[str, list[float]] = {"cached": [], "scan": []}
        cached_age = doorbell.PEERS_MAX_AGE_S
        partition = 1
        for _ in range(args.rounds):
            for way in ("scan", "cached"):
                doorbell.PEERS_MAX_AGE_S = 0.0 if way == "scan" else cached_age
                per_ring[way].append(time_rings(args.rings, partition) / args.rings)
                partition += args.rings
        doorbell.PEERS_MAX_AGE_S = cached_age
    finally:
        for p in peers:
            p.kill()
            p.wait()
        for out in outs:
            out.close()
        doorbell.close_doorbell()
    cached = statistics.median(per_ring["cached"]) * 1e6
    scan = statistics.median(per_ring["scan"]) * 1e6
    result = {"peers": args.peers, "rings_per_round": args.rings, "rounds": args.rounds,
              "cpu_us_per_ring_cached": round(cached, 1), "cpu_us_per_ring_scan": round(scan, 1),
              "scan_over_cached": round(scan / cached, 2)}
    print(f"one ring to {args.peers} peers: {cached:.1f} us cached, {scan:.1f} us with a scan per ring")
    print(json.dumps(result))


if __name__ == "__main__":
    asyncio.run(main())
