"""The hf engine split in two processes: prefill in one, decode in another, on SmolLM2-135M (CPU).

The prefill process computes each prompt's aggregated answer (its own
reference), then prefills it again and exposes the KV; this process decodes
from the pulled KV. Greedy and seeded outputs must match the aggregated ones
token for token.
"""

from __future__ import annotations

import asyncio
import base64
import json
import sys

import pytest

from kvflow.schemas import BlockStored, ChatMessage, SamplingParams
from kvflow.schemas.transfer import TransferDescriptor
from kvflow.workers.engines.base import EngineConfig, GenerateRequest
from kvflow.workers.engines.hf import HfEngine
from kvflow.workers.kv.handoff import KvHandoff
from kvflow.workers.kv.transfer import KvTransport, TransferConfig, TransferError

pytestmark = pytest.mark.slow

CONTEXT = " ".join(f"Note {i}: the {w} lighthouse keeper logged {i * 3} ships before dawn."
                   for i, w in enumerate(["old", "tired", "careful", "cheerful", "silent"] * 4))
JOBS = [
    {"id": "long", "user": CONTEXT + " How many ships did note 7 log?",
     "sampling": {"max_tokens": 24, "temperature": 0}},
    # Shares the long context with the first job: the decode process already caches those blocks.
    {"id": "shared", "user": CONTEXT + " Which keeper was silent?", "sampling": {"max_tokens": 24, "temperature": 0}},
    {"id": "seeded", "user": "Write a line about the sea.",
     "sampling": {"max_tokens": 16, "temperature": 0.8, "seed": 11}},
]

PREFILL_PROCESS = r"""
import asyncio, base64, json, sys
from kvflow.schemas import ChatMessage, SamplingParams
from kvflow.workers.engines.base import EngineConfig, GenerateRequest
from kvflow.workers.engines.hf import HfEngine
from kvflow.workers.kv.transfer import KvTransport, TransferConfig

async def main(jobs):
    # No prefix cache: the reference and the disaggregated prefill both compute the whole prompt.
    engine = HfEngine(EngineConfig(extra={"enable_prefix_caching": False}))
    await engine.start()
    transport = KvTransport("prefill", TransferConfig(backend="auto"))
    await transport.start()
    out = []
    for job in jobs:
        prompt = engine.tokenizer.encode_chat([ChatMessage(role="user", content=job["user"])])
        sampling = SamplingParams(**job["sampling"])
        reference = [t async for o in engine.generate(GenerateRequest(job["id"] + "-agg", prompt, sampling))
                     for t in o.token_ids]
        result = await engine.prefill(GenerateRequest(job["id"], prompt, sampling))
        kv = result.kv
        desc = await transport.expose(job["id"], kv.buffer, block_bytes=kv.layout.block_bytes,
                                      num_blocks=kv.num_blocks, num_tokens=kv.num_tokens, dtype=kv.layout.dtype,
                                      block_shape=kv.layout.block_shape)
        out.append({"id": job["id"], "prompt": prompt, "reference": reference, "first": result.first_token_id,
                    "state": base64.b64encode(result.sampler_state).decode() if result.sampler_state else None,
                    "desc": desc.model_dump(mode="json")})
    print(json.dumps({"backend": transport.backend, "jobs": out}), flush=True)
    for _ in range(6000):
        if not transport.num_exposed:
            break
        await asyncio.sleep(0.01)
    print(json.dumps({"released": transport.counters.released, "expired": transport.counters.expired}), flush=True)
    await transport.close()
    await engine.stop()

asyncio.run(main(json.loads(sys.argv[1])))
"""


async def json_line(stream: asyncio.StreamReader, timeout_s: float = 240) -> dict:
    """The next stdout line that is a JSON object (libraries log to stdout too)."""
    while True:
        line = await asyncio.wait_for(stream.readline(), timeout_s)
        if not line:
            raise AssertionError("the prefill process exited early")
        if line.startswith(b"{"):
            return json.loads(line)


@pytest.fixture(scope="module")
async def decode_engine():
    """The decode side: the default engine, prefix cache on."""
    engine = HfEngine(EngineConfig())
    events: list = []
    engine.kv_event_sink = events.extend
    await engine.start()
    engine.test_events = events
    yield engine
    await engine.stop()


async def test_prefill_process_and_decode_process_match_aggregated(decode_engine):
    proc = await asyncio.create_subprocess_exec(sys.executable, "-c", PREFILL_PROCESS, json.dumps(JOBS),
                                                stdout=asyncio.subprocess.PIPE)
    transport = KvTransport("decode", TransferConfig(backend="auto"))
    await transport.start()
    try:
        produced = await json_line(proc.stdout)
        assert produced["backend"] == transport.backend  # both sides made the same runtime choice
        stats = {}
        for job in produced["jobs"]:
            desc = TransferDescriptor.model_validate(job["desc"])
            sampling = SamplingParams(**next(j["sampling"] for j in JOBS if j["id"] == job["id"]))
            handoff = KvHandoff(job["first"], len(job["prompt"]), desc, transport,
                                base64.b64decode(job["state"]) if job["state"] else None)
            outputs = [o async for o in decode_engine.generate_from_kv(
                GenerateRequest(job["id"], job["prompt"], sampling), handoff)]
            tokens = [t for o in outputs for t in o.token_ids]
            assert tokens == job["reference"], job["id"]
            assert tokens[0] == job["first"] and len(job["reference"]) >= 2
            assert outputs[-1].finish_reason is not None
            stats[job["id"]] = handoff.stats
        long, shared = stats["long"], stats["shared"]
        assert long.backend == transport.backend and long.num_blocks_reused == 0
        assert long.num_bytes == long.num_blocks_pulled * decode_engine.kv_layout.block_bytes > 0
        # The shared context came from the decode engine's own prefix cache, not over the wire.
        assert shared.num_blocks_reused >= 10 and shared.num_blocks_pulled < long.num_blocks_pulled
        # Imported KV lands in the decode engine's prefix cache and is announced as KV events.
        assert any(isinstance(e, BlockStored) for e in decode_engine.test_events)
        outcome = await json_line(proc.stdout)
        assert outcome == {"released": 3, "expired": 0}
    finally:
        await transport.close()
        if proc.returncode is None:
            proc.kill()
        await proc.wait()


async def test_prefill_only_result_and_mismatched_handoff(decode_engine):
    engine = decode_engine
    prompt = engine.tokenizer.encode_chat([ChatMessage(role="user", content="Name three colors.")])
    result = await engine.prefill(GenerateRequest("p1", prompt, SamplingParams(max_tokens=5, temperature=0)))
    layout = engine.kv_layout
    blocks = -(-len(prompt) // engine.block_size)
    assert result.kv.buffer.shape == (blocks, *layout.block_shape) and result.kv.buffer.is_contiguous()
    assert result.num_kv_bytes == blocks * layout.block_bytes and result.sampler_state is None
    assert engine.kv_stats().active_requests == 0  # a prefill-only request does not stay in the batch
    # The greedy first token is the aggregated first token.
    agg = [o async for o in engine.generate(GenerateRequest("p2", prompt, SamplingParams(max_tokens=1,
                                                                                          temperature=0)))]
    assert agg[0].token_ids == [result.first_token_id]

    # A handoff for a different prompt length is refused before any output; the id stays usable.
    source = KvTransport("src", TransferConfig(backend="tcp"))
    await source.start()
    try:
        kv = result.kv
        desc = await source.expose("p1", kv.buffer, block_bytes=layout.block_bytes, num_blocks=kv.num_blocks,
                                   num_tokens=kv.num_tokens, dtype=layout.dtype, block_shape=layout.block_shape)
        handoff = KvHandoff(result.first_token_id, len(prompt), desc, source)
        with pytest.raises(TransferError):
            await engine.generate_from_kv(GenerateRequest("p3", prompt[:-1], SamplingParams()), handoff).__anext__()
        outs = [o async for o in engine.generate(GenerateRequest("p3", prompt, SamplingParams(max_tokens=2)))]
        assert outs[-1].finish_reason is not None
    finally:
        await source.close()
