"""The topic catalog is created on the real embedded broker."""

from aiokafka.admin import AIOKafkaAdminClient

from kvflow.schemas import WorkerRole
from kvflow.streams.catalog import QUEUE_SLOTS, Catalog
from kvflow.streams.kafka import create_topics


async def test_catalog_topics_created_with_partitions(kafka):
    settings, catalog = kafka
    admin = AIOKafkaAdminClient(bootstrap_servers=settings.bootstrap_servers)
    await admin.start()
    try:
        names = set(await admin.list_topics())
        for spec in catalog.all():
            assert spec.name in names
        described = await admin.describe_topics([catalog.queue(WorkerRole.decode).name, catalog.responses.name])
        parts = {d["topic"]: len(d["partitions"]) for d in described}
        assert parts[catalog.queue(WorkerRole.decode).name] == QUEUE_SLOTS
        assert parts[catalog.responses.name] == catalog.responses.partitions
    finally:
        await admin.close()
    # creating again is a no-op
    assert await create_topics(settings, catalog) == []


def test_names_are_namespaced_and_unique():
    cat = Catalog("ns1")
    names = [t.name for t in cat.all()]
    assert len(names) == len(set(names))
    assert all(n.startswith("ns1.") for n in names)
    assert cat.queue("prefill").name == "ns1.queue.prefill"
