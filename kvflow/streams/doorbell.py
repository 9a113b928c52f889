"""Cross-process wake-ups for consumers of the embedded broker.

The embedded broker holds a fetch for its whole long-poll even when records
arrive (see :mod:`kvflow.streams.fetch_wait`), so an idle consumer parked in
a long poll learns of a record only when the poll runs out. Inside one
process :func:`kvflow.streams.fetch_wait.produced` cuts such a poll short.
This module carries the same signal between processes on one host: each
process with an adaptive consumer binds a UDP socket on 127.0.0.1 and lists
its port in a directory named after the broker's address; a producer that
has just written to a topic "rings" every listed process with the topic and
partition, and each process wakes its own consumers of that partition.

A ringer keeps its list of peers until the directory changes (one ``stat``
per ring instead of a listing and a read per peer; ``bench/doorbell_ring.py``).
The ring carries no data (the record itself is only ever read from Kafka);
a lost datagram costs at most one idle wait, as without this module. Rings
for one partition are sent at most once per ``RING_GAP_S``: a woken consumer
polls fast for ``fetch_active_window_s`` (2 s by default) anyway. A real
Kafka cluster answers long polls when records arrive and uses none of this
(no adaptive policy is installed there, so no doorbell is opened).
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import logging
import os
import re
import socket
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from kvflow.deployments import pid_alive

__all__ = ["open_doorbell", "ring", "close_doorbell", "directory_for", "RING_GAP_S"]

log = logging.getLogger(__name__)

RING_GAP_S = 0.5
"""Least time between two rings of one (topic, partition), seconds: below the
time a woken consumer keeps polling fast (2 s; 0.75 s for a consumer every
writer rings, :data:`kvflow.streams.kafka.RUNG_ACTIVE_WINDOW_S`), so a skipped
ring never finds it parked."""


def directory_for(bootstrap: str) -> Path:
    """The doorbell directory of the broker at ``bootstrap`` (one per broker
    address, under the system temp directory)."""
    return Path(tempfile.gettempdir()) / "kvflow-doorbells" / re.sub(r"[^A-Za-z0-9_.-]", "_", bootstrap)


@dataclass
class _Doorbell:
    sock: socket.socket
    loop: asyncio.AbstractEventLoop
    port: int
    on_ring: Callable[[str, int | None], None]
    dirs: set[Path] = field(default_factory=set)
    last_ring: dict[tuple[str, int | None], float] = field(default_factory=dict)
    peers: dict[Path, tuple[int, float, list[int]]] = field(default_factory=dict)
    """Per directory: (its mtime in ns, monotonic time of the scan, the peers' ports)."""

    def receive(self) -> None:
        while True:
            try:
                data = self.sock.recv(512)
            except (BlockingIOError, InterruptedError):
                return
            except OSError:
                return
            topic, _, part = data.decode("utf-8", "replace").partition("\n")
            with contextlib.suppress(Exception):  # a stray datagram must not stop the reader
                self.on_ring(topic, int(part) if part else None)

    def close(self) -> None:
        if not self.loop.is_closed():
            with contextlib.suppress(Exception):
                self.loop.remove_reader(self.sock.fileno())
        self.sock.close()
        for d in self.dirs:
            with contextlib.suppress(OSError):
                (d / str(os.getpid())).unlink()


_bell: _Doorbell | None = None
_atexit_registered: list[bool] = []


def open_doorbell(bootstrap: str, on_ring: Callable[[str, int | None], None]) -> int:
    """Make this process ringable for the broker at ``bootstrap``; returns the UDP port.

    Must be called from a running event loop; the socket is read on it and
    ``on_ring(topic, partition)`` runs there for every ring (``partition``
    None: any partition of ``topic``). One socket serves the process; a
    call from another loop after the first loop closed opens a new one.
    Idempotent per broker address.

    Raises:
        RuntimeError: no running event loop.
        OSError: the socket or the directory entry cannot be created.
    """
    global _bell
    loop = asyncio.get_running_loop()
    if _bell is not None and (_bell.loop.is_closed() or _bell.loop is not loop and not _bell.loop.is_running()):
        _bell.close()
        _bell = None
    if _bell is None:
        sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        sock.bind(("127.0.0.1", 0))
        sock.setblocking(False)
        _bell = _Doorbell(sock, loop, sock.getsockname()[1], on_ring)
        loop.add_reader(sock.fileno(), _bell.receive)
        if not _atexit_registered:
            atexit.register(close_doorbell)
            _atexit_registered.append(True)
    directory = directory_for(bootstrap)
    if directory not in _bell.dirs:
        directory.mkdir(parents=True, exist_ok=True)
        entry = directory / str(os.getpid())
        tmp = entry.with_suffix(".tmp")
        tmp.write_text(str(_bell.port))
        tmp.replace(entry)  # ringers never read a half-written port
        _bell.dirs.add(directory)
    return _bell.port


def close_doorbell() -> None:
    """Close this process's doorbell and remove its directory entries (no-op if none)."""
    global _bell
    if _bell is not None:
        _bell.close()
        _bell = None


PEERS_MAX_AGE_S = 10.0
"""Longest a ringer reuses its list of a directory's peers, seconds. The list
is read again sooner when the directory changes (a process opened or closed
its doorbell); this bound only prunes the entries of processes that were
killed, which the directory does not show."""

_SETTLED_NS = 50_000_000
"""A directory changed less than this before a scan (ns) is scanned again at
the next ring: its mtime may not have moved for a change in the same clock
tick (file timestamps advance in coarse ticks of a few ms)."""


def _cached_peers(bell: _Doorbell, directory: Path, me: int, now: float) -> list[int]:
    """The peers' ports in ``directory``: read again only when it has changed
    since the last scan, or that scan is older than :data:`PEERS_MAX_AGE_S`
    (a ring then costs one ``stat`` instead of a scan and a read per peer)."""
    try:
        mtime = os.stat(directory).st_mtime_ns
    except OSError:
        return []
    cached = bell.peers.get(directory)
    if cached is not None and cached[0] == mtime and now - cached[1] < PEERS_MAX_AGE_S:
        return cached[2]
    scanned_wall_ns = time.time_ns()
    ports = _peers(directory, me)
    if scanned_wall_ns - mtime >= _SETTLED_NS:
        bell.peers[directory] = (mtime, now, ports)
    else:
        bell.peers.pop(directory, None)
    return ports


def _peers(directory: Path, me: int) -> list[int]:
    ports = []
    with contextlib.suppress(OSError):
        for entry in os.scandir(directory):
            if not entry.name.isdigit() or int(entry.name) == me:
                continue
            if not pid_alive(int(entry.name)):
                with contextlib.suppress(OSError):
                    os.unlink(entry.path)  # left by a process that was killed
                continue
            try:
                ports.append(int(Path(entry.path).read_text()))
            except (OSError, ValueError):
                continue
    return ports


def ring(topic: str, partition: int | None = None, now: float | None = None) -> int:
    """Tell the other ringable processes that a record was just written to
    ``topic`` (``partition``, or None for any); returns datagrams sent.

    Sends nothing when this process has no doorbell (not on the embedded
    broker) or when the same partition was rung less than ``RING_GAP_S`` ago.
    Never raises: a ring is only a hint.
    """
    bell = _bell
    if bell is None or not bell.dirs:
        return 0
    now = time.monotonic() if now is None else now
    key = (topic, partition)
    if now - bell.last_ring.get(key, -1e9) < RING_GAP_S:
        return 0
    bell.last_ring[key] = now
    payload = f"{topic}\n{'' if partition is None else partition}".encode()
    sent = 0
    me = os.getpid()
    for directory in bell.dirs:
        for port in _cached_peers(bell, directory, me, now):
            with contextlib.suppress(OSError):
                bell.sock.sendto(payload, ("127.0.0.1", port))
                sent += 1
    return sent


async def _listen(bootstrap: str) -> None:
    """Print ``ready``, then each ring received as ``topic partition``, until killed."""
    def show(topic: str, partition: int | None) -> None:
        print(topic, "" if partition is None else partition, flush=True)

    open_doorbell(bootstrap, show)
    print("ready", flush=True)
    await asyncio.Event().wait()


if __name__ == "__main__":  # python -m kvflow.streams.doorbell HOST:PORT: watch the rings of one broker's host
    import sys

    if len(sys.argv) != 2:
        sys.exit("usage: python -m kvflow.streams.doorbell BOOTSTRAP (e.g. 127.0.0.1:9092)")
    asyncio.run(_listen(sys.argv[1]))
