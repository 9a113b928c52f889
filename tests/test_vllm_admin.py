"""Engine admin on a real vLLM worker: clear-KV, sleep and wake through the control topic.

One aggregated vLLM worker (SmolLM2-135M) behind the Faust router (kv
policy) on the embedded broker. vLLM's own prefix-cache reset and sleep emit
``AllBlocksCleared`` on its KV event stream; the test waits for the router's
index to drop the worker's blocks, for its heartbeats to say ``sleeping``,
and for the same greedy answer after waking. On vLLM's CPU build sleep
releases no memory (vLLM has no sleep mode there); the answer says so.
Skips when vLLM cannot run here, and fails in CI, which installs it
(:func:`vllm_support.require_vllm`).
"""

from __future__ import annotations

import asyncio
import contextlib

import pytest
from deployment import steady
from vllm_support import TEST_KV_CACHE_GB, TEST_MAX_MODEL_LEN, require_vllm

from kvflow.schemas import SamplingParams, WorkerRole, WorkerStatus
from kvflow.streams.admin import send_admin_command

# vLLM engines start in ~20 s on a quiet CPU and several times that on a loaded one.
pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

MODEL = "SmolLM2-135M-Instruct"
BLOCK = 32


def blocks(router, worker_id: str) -> int:
    index = router.table.kv_index
    return 0 if index is None else index.num_blocks(worker_id)


async def test_vllm_worker_clears_sleeps_and_wakes(kafka, waiter):
    require_vllm()
    from kvflow.router.app import build_router_app
    from kvflow.streams.client import KvflowClient
    from kvflow.workers.engines.base import EngineConfig
    from kvflow.workers.engines.vllm import VllmEngine, VllmOptions
    from kvflow.workers.worker import Worker, WorkerConfig

    settings, catalog = kafka
    engine = VllmEngine(EngineConfig(model=MODEL, block_size=BLOCK, extra={"max_model_len": TEST_MAX_MODEL_LEN}),
                        options=VllmOptions(kv_cache_gb=TEST_KV_CACHE_GB, dtype="float32"))
    await engine.start()
    worker = Worker(steady(settings), WorkerConfig(worker_id="w0", slot=0, model=MODEL, role=WorkerRole.aggregated),
                    engine, catalog)
    task = asyncio.create_task(worker.run())
    router = build_router_app(settings, catalog, policy="kv")
    await router.app.start()
    client = KvflowClient(settings, catalog, timeout_s=120)
    ids = engine.tokenizer.encode_prompt("The history of the printing press, told in five sentences. " * 4)
    sampling = SamplingParams(max_tokens=8, temperature=0.0)

    async def ask():
        final = await client.complete(client.new_request(MODEL, token_ids=ids, sampling=sampling))
        assert final.error is None, final.error
        return final

    try:
        await waiter(lambda: "w0" in router.table.workers, timeout_s=60)
        await client.start()
        first = await ask()
        await waiter(lambda: blocks(router, "w0") >= len(ids) // BLOCK)

        answer = await send_admin_command(settings, "w0", "clear_kv", timeout_s=60, catalog=catalog)
        assert answer.ok, answer.detail
        await waiter(lambda: blocks(router, "w0") == 0)  # vLLM's AllBlocksCleared reached the index
        assert (await ask()).usage.cached_tokens == 0  # nothing left to hit
        await waiter(lambda: blocks(router, "w0") > 0)

        answer = await send_admin_command(settings, "w0", "sleep", timeout_s=120, catalog=catalog)
        assert answer.ok, answer.detail
        assert answer.detail.startswith("vLLM sleep level 1")
        await waiter(lambda: router.table.workers["w0"].status is WorkerStatus.sleeping)
        await waiter(lambda: blocks(router, "w0") == 0)
        assert router.table.candidates(MODEL, WorkerRole.aggregated) == []  # unroutable
        assert await engine.llm.is_sleeping()

        answer = await send_admin_command(settings, "w0", "wake", timeout_s=120, catalog=catalog)
        assert answer.ok, answer.detail
        await waiter(lambda: router.table.workers["w0"].status is WorkerStatus.serving)
        again = await ask()
        assert again.token_ids == first.token_ids and again.worker_id == "w0"
    finally:
        await client.stop()
        worker.stop()
        with contextlib.suppress(Exception):
            await task
        await router.app.stop()
