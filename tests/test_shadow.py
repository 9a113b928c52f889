"""The shadow router on a live pipeline (real embedded broker): a round-robin live router, a kv shadow
that sees every request, decides it without acting, and is compared with the live decision records."""

import asyncio

import pytest

from kvflow.router.shadow import ShadowRouter
from kvflow.schemas import SamplingParams
from kvflow.workers.engines.mocker_core import MockerConfig

from deployment import in_process_cluster

MODEL = "mock-shadow"


@pytest.fixture
async def cluster(kafka, waiter):
    settings, catalog = kafka
    mocker = MockerConfig(speedup_ratio=50.0, block_size=16, num_kv_blocks=1024)
    async with in_process_cluster(settings, catalog, waiter, model=MODEL, mocker=mocker,
                                  policy="round_robin") as (router, workers, client):
        yield settings, catalog, router, workers, client


async def test_kv_shadow_of_a_round_robin_router(cluster, waiter):
    settings, catalog, router, workers, client = cluster
    shadow = ShadowRouter(settings, "kv", catalog)
    task = asyncio.create_task(shadow.run())
    try:
        await asyncio.wait_for(shadow.ready.wait(), 30)
        tokenizer = workers[0].tokenizer
        n = 0
        for wave in range(4):  # three prompt groups, one request each per wave, sequential
            for group in range(3):
                ids = tokenizer.encode_prompt(f"group {group} shared prompt " * 12 + f"wave {wave}")
                final = await client.complete(client.new_request(MODEL, token_ids=ids,
                                                                 sampling=SamplingParams(max_tokens=3)))
                assert final.error is None
                n += 1
        await waiter(lambda: shadow.tally.compared == n, timeout_s=30)
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
    summary = shadow.tally.summary()
    print(summary)
    assert summary["compared"] == n and summary["shadow_unrouted"] == 0
    assert 0 <= summary["agreement"] <= 1
    # Round-robin over two workers moves each of the three groups to the other worker every wave, so
    # its choices miss the group's prefix; the kv shadow goes where the prefix already is.
    assert summary["shadow_predicted_hit_ratio"] > summary["live_predicted_hit_ratio"]
    scraped = {s.name: s.value for f in shadow.registry.collect() for s in f.samples if s.name.endswith("_total")
               and s.labels.get("router", "shadow") == "shadow"}
    assert scraped["kvflow_shadow_overlap_blocks_total"] == shadow.tally.shadow_overlap_blocks
