"""KV transfer: TCP and NIXL round trips between two real processes, release, expiry, handoff."""

from __future__ import annotations

import asyncio
import json
import os
import sys

import numpy as np
import pytest
import torch

from kvflow.schemas.transfer import TransferDescriptor
from kvflow.workers.kv.handoff import KvHandoff
from kvflow.workers.kv.transfer import KvTransport, TransferConfig, TransferError, buffer_info

SIZE = 8 * 2**20 + 123  # not a multiple of anything convenient
BLOCKS = 7

# The source process: expose a deterministic buffer, print its descriptor,
# wait for the reader's release (or give up), report how it ended.
SOURCE = r"""
import asyncio, json, sys
import numpy as np
from kvflow.workers.kv.transfer import KvTransport, TransferConfig

async def main(backend, size, ttl_s):
    transport = KvTransport("source", TransferConfig(backend=backend, ttl_s=ttl_s))
    await transport.start()
    buf = (np.arange(size, dtype=np.uint64) * 2654435761 % 251).astype(np.uint8)
    desc = await transport.expose("req-1", buf, block_bytes=size // 7, num_blocks=7, num_tokens=100,
                                  dtype="uint8", block_shape=(size // 7,))
    print(json.dumps({"backend": transport.backend, "desc": desc.model_dump(mode="json")}), flush=True)
    for _ in range(3000):
        if not transport.num_exposed:
            break
        await asyncio.sleep(0.01)
    c = transport.counters
    print(json.dumps({"released": c.released, "expired": c.expired, "tcp_bytes": c.bytes_served_tcp}), flush=True)
    await transport.close()

asyncio.run(main(sys.argv[1], int(sys.argv[2]), float(sys.argv[3])))
"""


def expected(size: int) -> np.ndarray:
    return (np.arange(size, dtype=np.uint64) * 2654435761 % 251).astype(np.uint8)


async def json_line(stream: asyncio.StreamReader) -> dict | None:
    """The next stdout line that is a JSON object (NIXL logs to stdout too); None at EOF."""
    while True:
        line = await asyncio.wait_for(stream.readline(), 60)
        if not line:
            return None
        if line.startswith(b"{"):
            return json.loads(line)


class Source:
    """A source process; ``desc`` once it exposed its buffer."""

    def __init__(self, proc: asyncio.subprocess.Process, backend: str, desc: TransferDescriptor) -> None:
        self.proc, self.backend, self.desc = proc, backend, desc

    @classmethod
    async def start(cls, backend: str, ttl_s: float = 60.0) -> Source:
        proc = await asyncio.create_subprocess_exec(sys.executable, "-c", SOURCE, backend, str(SIZE), str(ttl_s),
                                                    stdout=asyncio.subprocess.PIPE)
        first = await json_line(proc.stdout)
        if first is None:
            await proc.wait()
            raise RuntimeError(f"source process exited with {proc.returncode}")
        return cls(proc, first["backend"], TransferDescriptor.model_validate(first["desc"]))

    async def outcome(self) -> dict:
        outcome = await json_line(self.proc.stdout)
        await asyncio.wait_for(self.proc.wait(), 30)
        return outcome


async def reader(backend: str) -> KvTransport:
    transport = KvTransport("reader", TransferConfig(backend=backend))
    await transport.start()
    return transport


async def nixl_reader() -> KvTransport:
    """A NIXL reader, or a clean skip saying why NIXL cannot start here."""
    try:
        return await reader("nixl")
    except TransferError as exc:
        pytest.skip(f"NIXL cannot initialise on this machine: {exc}")


async def test_the_nixl_agent_is_created_with_cuda_ipc_reads_enabled_unless_the_environment_says_otherwise(monkeypatch):
    # UCX reads the variable when the agent's context is created; NIXL pulls with READ,
    # which UCX only serves over cuda_ipc between GPUs without NVLink when it is on.
    monkeypatch.delenv("UCX_CUDA_IPC_ENABLE_GET_ZCOPY", raising=False)
    first = await nixl_reader()
    await first.close()
    assert os.environ["UCX_CUDA_IPC_ENABLE_GET_ZCOPY"] == "on"
    monkeypatch.setenv("UCX_CUDA_IPC_ENABLE_GET_ZCOPY", "auto")
    second = await nixl_reader()
    await second.close()
    assert os.environ["UCX_CUDA_IPC_ENABLE_GET_ZCOPY"] == "auto"


async def test_tcp_round_trip_between_processes():
    source = await Source.start("tcp")
    assert source.backend == "tcp" and source.desc.backend == "tcp" and source.desc.nixl_agent is None
    transport = await reader("tcp")
    try:
        whole = np.zeros(SIZE, np.uint8)
        assert await transport.pull(source.desc, whole) == "tcp"
        assert np.array_equal(whole, expected(SIZE))
        # A byte range, into a torch tensor.
        part = torch.zeros(1_000_003, dtype=torch.uint8)
        await transport.pull(source.desc, part, offset=4_000_000)
        assert np.array_equal(part.numpy(), expected(SIZE)[4_000_000:5_000_003])
        with pytest.raises(TransferError):
            await transport.pull(source.desc, np.zeros(10, np.uint8), offset=SIZE - 5)
        await transport.release(source.desc)
        outcome = await source.outcome()
        assert outcome == {"released": 1, "expired": 0, "tcp_bytes": SIZE + 1_000_003}
    finally:
        await transport.close()


async def test_nixl_round_trip_between_processes():
    transport = await nixl_reader()
    source = await Source.start("nixl")
    try:
        assert source.backend == "nixl", "the reader initialised NIXL, so the source should too"
        desc = source.desc
        assert desc.backend == "nixl" and desc.nixl_agent and desc.nixl_metadata_b64
        assert desc.nixl_mem_type == "DRAM" and desc.regions[0].num_bytes == SIZE
        whole = np.zeros(SIZE, np.uint8)
        assert await transport.pull(desc, whole) == "nixl"
        assert np.array_equal(whole, expected(SIZE))
        part = torch.zeros(3 * (SIZE // 7), dtype=torch.uint8)
        assert await transport.pull(desc, part, offset=2 * (SIZE // 7)) == "nixl"
        assert np.array_equal(part.numpy(), expected(SIZE)[2 * (SIZE // 7):5 * (SIZE // 7)])
        await transport.release(desc)  # a NIXL notification
        outcome = await source.outcome()
        assert outcome == {"released": 1, "expired": 0, "tcp_bytes": 0}  # no byte went over TCP
    finally:
        await transport.close()


async def test_tcp_reader_pulls_from_a_nixl_source():
    source = await Source.start("auto")
    transport = await reader("tcp")
    try:
        whole = np.zeros(SIZE, np.uint8)
        assert await transport.pull(source.desc, whole) == "tcp"
        assert np.array_equal(whole, expected(SIZE))
        await transport.release(source.desc)
        outcome = await source.outcome()
        assert outcome["released"] == 1 and outcome["tcp_bytes"] == SIZE
    finally:
        await transport.close()


async def test_unreleased_buffer_expires_and_reads_then_fail():
    source = await Source.start("tcp", ttl_s=0.3)
    transport = await reader("tcp")
    try:
        outcome = await source.outcome()  # the source waits for its buffer to go
        assert outcome == {"released": 0, "expired": 1, "tcp_bytes": 0}
    finally:
        await transport.close()


async def test_expired_or_unknown_transfer_is_refused():
    source = KvTransport("src", TransferConfig(backend="tcp", ttl_s=0.2))
    await source.start()
    transport = await reader("tcp")
    try:
        desc = await source.expose("r", np.ones(1000, np.uint8))
        await transport.pull(desc, np.zeros(1000, np.uint8))
        await asyncio.sleep(0.4)
        assert source.num_exposed == 0 and source.counters.expired == 1
        with pytest.raises(TransferError, match="unknown or expired"):
            await transport.pull(desc, np.zeros(1000, np.uint8))
        # The id carries a random suffix: knowing the request id is not enough to read a buffer.
        other = await source.expose("r", np.ones(10, np.uint8))
        assert other.transfer_id.startswith("r.") and other.transfer_id != desc.transfer_id
    finally:
        await transport.close()
        await source.close()


async def test_withdrawn_buffer_is_freed_and_refused():
    source = KvTransport("src", TransferConfig(backend="tcp"))
    await source.start()
    transport = await reader("tcp")
    try:
        desc = await source.expose("w", np.ones(100, np.uint8))
        assert source.withdraw(desc.transfer_id) is True
        assert source.num_exposed == 0 and source.counters.withdrawn == 1
        assert source.withdraw(desc.transfer_id) is False  # already gone
        with pytest.raises(TransferError, match="unknown or expired"):
            await transport.pull(desc, np.zeros(100, np.uint8))
    finally:
        await transport.close()
        await source.close()


async def test_handoff_fetches_only_missing_blocks_and_releases():
    source = KvTransport("src", TransferConfig(backend="tcp"))
    await source.start()
    transport = await reader("tcp")
    try:
        blocks = torch.arange(6 * 32, dtype=torch.float32).view(6, 4, 8)  # 6 blocks of [4, 8] float32
        desc = await source.expose("h", blocks, block_bytes=4 * 8 * 4, num_blocks=6, num_tokens=90,
                                   dtype="float32", block_shape=(4, 8))
        handoff = KvHandoff(first_token_id=5, num_tokens=90, descriptor=desc, transport=transport)
        assert handoff.layout.block_bytes == 128 and handoff.num_blocks == 6
        got = await handoff.fetch(first_block=2)
        assert torch.equal(got.view(torch.float32).view(-1, 4, 8), blocks[2:])
        stats = handoff.stats
        assert (stats.backend, stats.num_bytes, stats.num_blocks_pulled, stats.num_blocks_reused) == ("tcp", 512, 4, 2)
        await asyncio.sleep(0.05)
        assert source.num_exposed == 0 and source.counters.released == 1
        with pytest.raises(TransferError):
            await KvHandoff(first_token_id=5, num_tokens=90).fetch()
    finally:
        await transport.close()
        await source.close()


def test_buffers_must_be_contiguous():
    with pytest.raises(TransferError):
        buffer_info(torch.zeros(4, 4).t())
    with pytest.raises(TransferError):
        buffer_info(np.zeros((4, 4))[:, 1])
    assert buffer_info(torch.zeros(3, dtype=torch.float16))[1:] == (6, "DRAM", 0)


def test_config_rejects_unknown_backend():
    with pytest.raises(ValueError):
        TransferConfig(backend="rdma")
    with pytest.raises(ValueError):
        TransferConfig(ttl_s=0)
