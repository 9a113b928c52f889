"""Cross-process wake-ups (doorbell) on the embedded broker.

The unit tests ring between real processes over real UDP sockets; the live
test checks that an idle worker parked in a long fetch poll serves a request
routed to it without waiting that poll out.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import textwrap
import time
import uuid

import pytest

from kvflow.streams import doorbell

import httpx

from kvflow.supervisor import WorkerSpec
from deployment import running_deployment

pytestmark = pytest.mark.asyncio

RINGER = textwrap.dedent("""
    import asyncio, sys
    from kvflow.streams import doorbell
    async def main():
        doorbell.open_doorbell(sys.argv[1], lambda topic, partition: None)
        print(doorbell.ring("queue-topic", 3), flush=True)
        doorbell.close_doorbell()
    asyncio.run(main())
""")


def start_peer(bootstrap: str) -> subprocess.Popen:
    """A ringable process for ``bootstrap`` (its stdout says "ready" once it is listed, then
    prints each ring it receives)."""
    return subprocess.Popen([sys.executable, "-m", "kvflow.streams.doorbell", bootstrap], stdout=subprocess.PIPE,
                            text=True)


@pytest.fixture
def bootstrap():
    doorbell.close_doorbell()  # one per process: an earlier test's may still be open, with its own callback
    name = f"test-{uuid.uuid4().hex}:1"
    yield name
    doorbell.close_doorbell()


async def test_a_ring_from_another_process_reaches_this_one(bootstrap):
    rung: asyncio.Queue = asyncio.Queue()
    port = doorbell.open_doorbell(bootstrap, lambda topic, partition: rung.put_nowait((topic, partition)))
    assert (doorbell.directory_for(bootstrap) / str(os.getpid())).read_text() == str(port)
    out = await asyncio.to_thread(subprocess.run, [sys.executable, "-c", RINGER, bootstrap],
                                  capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "1"  # one peer: this process
    assert await asyncio.wait_for(rung.get(), 30) == ("queue-topic", 3)


async def test_rings_of_one_partition_are_spaced(bootstrap):
    doorbell.open_doorbell(bootstrap, lambda *_: None)
    peer = start_peer(bootstrap)
    try:
        assert peer.stdout.readline().strip() == "ready"
        t = time.monotonic()
        assert doorbell.ring("q", 0, now=t) == 1
        assert doorbell.ring("q", 0, now=t + doorbell.RING_GAP_S / 2) == 0  # spaced
        assert doorbell.ring("q", 1, now=t + doorbell.RING_GAP_S / 2) == 1  # another partition
        assert doorbell.ring("q", 0, now=t + doorbell.RING_GAP_S) == 1
    finally:
        peer.kill()
        peer.wait()


async def test_entries_of_dead_processes_are_pruned(bootstrap):
    doorbell.open_doorbell(bootstrap, lambda *_: None)
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    stale = doorbell.directory_for(bootstrap) / dead.stdout.strip()
    stale.write_text("9")
    assert doorbell.ring("q", 0) == 0
    assert not stale.exists()


async def test_a_ringer_reads_its_peers_again_only_when_the_directory_changes(bootstrap, monkeypatch):
    doorbell.open_doorbell(bootstrap, lambda *_: None)
    directory = doorbell.directory_for(bootstrap)
    scans = []
    real_peers = doorbell._peers
    monkeypatch.setattr(doorbell, "_peers", lambda d, me: scans.append(d) or real_peers(d, me))
    past = time.time_ns() - 10**9  # the directory settled a second ago
    os.utime(directory, ns=(past, past))
    t = time.monotonic()
    assert doorbell.ring("q", 0, now=t) == 0  # no peer yet: a scan
    assert doorbell.ring("q", 1, now=t + 0.01) == 0  # unchanged: the list is reused
    assert len(scans) == 1
    peer = start_peer(bootstrap)
    try:
        assert peer.stdout.readline().strip() == "ready"
        assert doorbell.ring("q", 2, now=t + 0.02) == 1  # the peer's entry changed it: read again, rung
        assert len(scans) == 2
        assert (await asyncio.wait_for(asyncio.to_thread(peer.stdout.readline), 30)).split() == ["q", "2"]
        os.utime(directory, ns=(past, past))
        assert doorbell.ring("q", 3, now=t + 0.03) == 1
        assert doorbell.ring("q", 4, now=t + 0.04) == 1 and len(scans) == 3  # settled: reused
        assert doorbell.ring("q", 5, now=t + 0.04 + doorbell.PEERS_MAX_AGE_S) == 1  # too old: read again
        assert len(scans) == 4
        # A directory changed just before the scan (here: stamped later than it) may change again
        # within the same coarse timestamp tick, so such a scan is not reused.
        future = time.time_ns() + 10**10
        os.utime(directory, ns=(future, future))
        assert doorbell.ring("q", 6, now=t + 20) == 1 and doorbell.ring("q", 7, now=t + 20.01) == 1
        assert len(scans) == 6
    finally:
        peer.kill()
        peer.wait()


async def test_without_a_doorbell_ring_sends_nothing():
    doorbell.close_doorbell()
    assert doorbell.ring("q", 0) == 0


async def test_an_idle_worker_in_a_long_poll_is_rung_by_the_router(kafka, monkeypatch):
    """Consumers poll with waits of 1 s, then 2, 8 and 30 s as quiet goes on
    (1 s doubling per quiet second, capped at 30 s). After 14 s of quiet the
    worker is parked in its 30 s poll until ~41 s; a request routed to it is
    served long before that poll runs out: the router's ring cut it short."""
    settings, _ = kafka
    waits = {"fetch_max_wait_ms": 1000, "fetch_idle_wait_ms": 30_000, "fetch_rung_idle_wait_ms": 30_000,
             "fetch_active_window_s": 0.5}
    settings = settings.model_copy(update=waits)
    for name, value in waits.items():  # the worker processes read theirs from the environment
        monkeypatch.setenv(f"KVFLOW_{name.upper()}", str(value))
    spec = WorkerSpec(engine="mocker", model="SmolLM2-135M-Instruct", extra_args=["--speedup-ratio", "20"])
    body = {"model": spec.model, "prompt": "hello there", "max_tokens": 4}
    async with running_deployment(settings, spec, workers=1) as sup:
        async with httpx.AsyncClient(base_url=sup.url, timeout=120) as http:
            async def bridge_sees_the_worker() -> bool:  # its own heartbeat reader polls slowly here too
                models = (await http.get("/v1/models")).json()["data"]
                return any(m["id"] == spec.model for m in models)

            deadline = asyncio.get_running_loop().time() + 120
            while not await bridge_sees_the_worker():
                assert asyncio.get_running_loop().time() < deadline, "the bridge never listed the worker's model"
                await asyncio.sleep(0.2)
            first = await http.post("/v1/completions", json=body)
            assert first.status_code == 200, first.text
            await asyncio.sleep(14)  # the quiet spell is the scenario
            t0 = time.monotonic()
            second = await http.post("/v1/completions", json=body)
            took = time.monotonic() - t0
    assert second.status_code == 200, second.text
    assert took < 15, f"the request waited out the worker's idle poll ({took:.0f} s)"
    print(f"served in {took:.2f} s after the quiet spell")
