"""The EPLB job publishes an expert placement on its topic (real embedded broker)."""

from __future__ import annotations

import asyncio
import json

import numpy as np
import pytest
from aiokafka import TopicPartition

from kvflow.planner.eplb_job import EplbJob, read_expert_loads, run_eplb_job
from kvflow.schemas import ExpertPlacementMap, decode
from kvflow.streams.kafka import make_consumer


async def read_all(settings, topic: str, n: int, timeout_s: float = 15.0) -> list:
    consumer = make_consumer(settings, auto_offset_reset="earliest")
    await consumer.start()
    consumer.assign([TopicPartition(topic, 0)])
    out: list = []
    try:
        async with asyncio.timeout(timeout_s):
            while len(out) < n:
                for records in (await consumer.getmany(timeout_ms=200)).values():
                    out.extend(records)
    finally:
        await consumer.stop()
    return out


async def test_job_publishes_a_balanced_map_once_per_change(kafka, tmp_path):
    settings, catalog = kafka
    rng = np.random.default_rng(0)
    weights = 1 / np.arange(1, 33) ** 1.2
    load = np.stack([rng.multinomial(100_000, weights / weights.sum()) for _ in range(2)])
    path = tmp_path / "loads.json"
    path.write_text(json.dumps({"load": load.tolist()}))
    job = EplbJob(model="moe", loads_path=str(path), num_gpus=4, slots_per_gpu=10, interval_s=0.05)
    stop = asyncio.Event()
    task = asyncio.create_task(run_eplb_job(settings, job, catalog=catalog, stop=stop))
    [msg] = await read_all(settings, catalog.expert_placement.name, 1)
    rec = decode(ExpertPlacementMap, msg.value)
    assert msg.key == b"moe" and rec.num_gpus == 4 and len(rec.physical_to_logical[0]) == 40
    assert max(rec.imbalance) <= 1.1
    await asyncio.sleep(0.3)  # several intervals with the same loads: nothing new
    stop.set()
    assert await task == 1


def test_load_files_are_checked(tmp_path):
    good = tmp_path / "l.npy"
    np.save(good, np.ones((2, 8)))
    assert read_expert_loads(good).shape == (2, 8)
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"load": [[1, -2]]}))
    with pytest.raises(ValueError):
        read_expert_loads(bad)
    with pytest.raises(ValueError):
        ExpertPlacementMap(model="m", ts_ms=0, num_gpus=1, slots_per_gpu=2, physical_to_logical=[[0, 5]],
                           replicas=[[1, 1]], imbalance=[1.0])
