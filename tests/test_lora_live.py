"""LoRA through the pipeline: admin load/unload on real hf workers, heartbeats, routing to the adapter.

Real embedded broker, the Faust router (kv policy) and two in-process hf
workers (SmolLM2-135M-Instruct on CPU, ``w0`` and ``w1``); the adapter is
trained for a few steps in the test (:func:`test_engine_hf_lora.train_adapter`).
"""

from __future__ import annotations

import asyncio

import pytest
from deployment import steady
from test_engine_hf_lora import QUESTION, train_adapter

from kvflow.schemas import AdminAction, ChatMessage, SamplingParams
from kvflow.streams.admin import send_admin_command
from kvflow.workers.engines.base import EngineConfig

pytestmark = pytest.mark.slow

GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)


@pytest.fixture
async def cluster(kafka, waiter, tmp_path):
    from kvflow.router.app import build_router_app
    from kvflow.streams.client import KvflowClient
    from kvflow.workers.engines.hf import HfEngine
    from kvflow.workers.worker import Worker, WorkerConfig

    settings, catalog = kafka
    router = build_router_app(settings, catalog, policy="kv")
    await router.app.start()
    client = KvflowClient(settings, catalog, timeout_s=120)
    started = []
    try:
        for i in range(2):
            engine = HfEngine(EngineConfig(extra={"torch_threads": 1}))
            await engine.start()
            config = WorkerConfig(worker_id=f"w{i}", slot=i, model=engine.model_name, tokenizer=engine.model_name,
                                  lora_cache_dir=str(tmp_path / f"cache{i}"))
            worker = Worker(steady(settings), config, engine, catalog)
            started.append((worker, asyncio.create_task(worker.run())))
        await waiter(lambda: len(router.table.workers) == 2, timeout_s=60)
        await client.start()
        yield settings, catalog, router, {w.config.worker_id: w for w, _ in started}, client
    finally:
        await client.stop()
        for worker, task in started:
            worker.stop()
            await task
        await router.app.stop()


async def test_loading_an_adapter_on_one_worker_steers_its_requests_there(cluster, waiter, tmp_path):
    settings, catalog, router, workers, client = cluster
    w0 = workers["w0"]
    model = w0.config.model
    prompt = w0.engine.tokenizer.encode_chat([ChatMessage(role="user", content=QUESTION)])
    adapter = await asyncio.to_thread(train_adapter, tmp_path / "bananas", prompt)

    async def ask(lora: str | None = None):
        final = await client.complete(client.new_request(model, token_ids=prompt, sampling=GREEDY, lora_name=lora))
        assert final.error is None, final.error
        return final

    base = await ask()
    answer = await send_admin_command(settings, "w1", AdminAction.load_lora, lora_name="bananas",
                                      lora_uri=adapter.as_uri(), timeout_s=120, catalog=catalog)
    assert answer.ok, answer.detail
    assert answer.lora_adapters == ["bananas"]
    await waiter(lambda: router.table.workers["w1"].lora_adapters == ("bananas",), timeout_s=30)
    listed = await send_admin_command(settings, "w0", "list_lora", timeout_s=30, catalog=catalog)
    assert listed.ok and listed.lora_adapters == []

    tuned = await asyncio.gather(*(ask("bananas") for _ in range(3)))
    assert {f.worker_id for f in tuned} == {"w1"}
    assert {tuple(f.token_ids) for f in tuned} == {tuple(tuned[0].token_ids)}
    assert tuned[0].token_ids != base.token_ids
    assert (await ask()).token_ids == base.token_ids  # base requests keep the base output

    gone = await send_admin_command(settings, "w1", AdminAction.unload_lora, lora_name="bananas", timeout_s=60,
                                    catalog=catalog)
    assert gone.ok and gone.lora_adapters == []
    await waiter(lambda: all(w.lora_adapters == () for w in router.table.workers.values()), timeout_s=30)
    assert (await ask()).token_ids == base.token_ids
    # No worker has it now: the one the router picks loads it on demand from the URI every worker read.
    again = await ask("bananas")
    assert again.token_ids == tuned[0].token_ids
    assert workers[again.worker_id].adapters.names() == ["bananas"]
    await waiter(lambda: router.table.workers[again.worker_id].lora_adapters == ("bananas",), timeout_s=30)
