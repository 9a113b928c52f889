"""The same end-to-end request against a real Apache Kafka (testcontainers).

Needs a Docker engine; skipped with the reason when there is none.
"""

import asyncio
import uuid

import pytest


def _docker_reason() -> str | None:
    try:
        import docker

        docker.from_env(timeout=3).ping()
    except Exception as exc:  # noqa: BLE001 - any failure means no usable engine
        return f"no Docker engine reachable ({type(exc).__name__}: {str(exc)[:120]})"
    return None


pytestmark = [pytest.mark.docker]


@pytest.fixture(scope="module")
def kafka_container():
    reason = _docker_reason()
    if reason:
        pytest.skip(reason)
    from testcontainers.kafka import KafkaContainer

    with KafkaContainer() as container:
        yield container.get_bootstrap_server()


async def test_end_to_end_on_apache_kafka(kafka_container):
    from kvflow.router.app import build_router_app
    from kvflow.schemas import SamplingParams
    from kvflow.settings import Settings
    from kvflow.streams.catalog import Catalog
    from kvflow.streams.client import KvflowClient
    from kvflow.streams.kafka import create_topics
    from kvflow.workers.engines.mocker import MockerEngine
    from kvflow.workers.engines.mocker_core import MockerConfig
    from kvflow.workers.worker import Worker, WorkerConfig

    settings = Settings(bootstrap_servers=kafka_container, namespace=f"k{uuid.uuid4().hex[:8]}",
                        session_timeout_ms=6000)
    catalog = Catalog(settings.namespace)
    await create_topics(settings, catalog)
    router = build_router_app(settings, catalog)
    await router.app.start()
    engine = MockerEngine(MockerConfig(speedup_ratio=100.0, block_size=16, num_kv_blocks=256), model_name="m")
    worker = Worker(settings, WorkerConfig(worker_id="w0", slot=0, model="m"), engine, catalog)
    task = asyncio.create_task(worker.run())
    try:
        for _ in range(300):
            if router.table.workers:
                break
            await asyncio.sleep(0.1)
        async with KvflowClient(settings, catalog, timeout_s=60) as client:
            final = await client.complete(client.new_request("m", prompt="hi", sampling=SamplingParams(max_tokens=4)))
        assert final.error is None and final.usage.completion_tokens == 4 and final.worker_id == "w0"
    finally:
        worker.stop()
        await task
        await router.app.stop()
