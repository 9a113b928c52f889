"""Disaggregated prefill/decode with vLLM's KV connector API.

Three layers:

* kvflow's side (no vLLM needed): connector choice and settings, the NIXL
  params check, the store sweep, and the decode's refusals and short cuts;
* kvflow's NIXL params against vLLM's own ``NixlConnector`` scheduler side
  (a prefill request with kvflow's params finishes into params that vLLM's
  decode side accepts for an asynchronous KV load; no GPU or ``nixl`` needed);
* the acceptance run: one prefill and one decode vLLM worker behind the Faust
  router on the embedded broker, SmolLM2-135M, five prompts, greedy output
  identical to an aggregated vLLM engine's, with the KV moved by vLLM's
  ExampleConnector (safetensors files under a shared directory) on this
  CPU build, as :func:`pick_connector` chooses where NIXL is absent.

The vLLM parts skip when vLLM cannot run here, and fail in CI, which installs it
(:func:`vllm_support.require_vllm`).
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import os
import time
from types import SimpleNamespace

import pytest
from deployment import steady
from vllm_support import TEST_KV_CACHE_GB, TEST_MAX_MODEL_LEN, require_vllm

from kvflow.schemas import FinishReason, SamplingParams, WorkerRole
from kvflow.schemas.transfer import EngineKvHandoff, TransferDescriptor
from kvflow.workers.engines.base import EngineOutput, GenerateRequest
from kvflow.workers.engines.vllm_disagg import (
    KvConnectorSpec,
    connector_for_role,
    decode_kv_transfer_params,
    generate_from_kv,
    pick_connector,
    prefill_kv_transfer_params,
    sweep_store,
)
from kvflow.workers.kv.handoff import KvHandoff
from kvflow.workers.kv.transfer import TransferError

# vLLM engines start in ~20 s on a quiet CPU and several times that on a loaded one.
pytestmark = pytest.mark.timeout(900)

MODEL = "SmolLM2-135M-Instruct"
BLOCK = 32  # vLLM's CPU attention needs a multiple of 32

NIXL_PARAMS = {"do_remote_prefill": True, "do_remote_decode": False, "remote_block_ids": ([1, 2],),
               "remote_engine_id": "e", "remote_request_id": "p", "remote_host": "h", "remote_port": 5600,
               "tp_size": 1}


# ---- kvflow's side ------------------------------------------------------------


def test_connector_specs_and_choice(tmp_path):
    assert connector_for_role(WorkerRole.aggregated, "auto", None, "ns") is None
    spec = connector_for_role(WorkerRole.prefill, "ExampleConnector", str(tmp_path), "ns")
    assert (spec.name, spec.kv_role, spec.store_dir) == ("ExampleConnector", "kv_producer", str(tmp_path))
    decode = connector_for_role(WorkerRole.decode, "ExampleConnector", None, "ns")
    assert decode.kv_role == "kv_consumer" and decode.store_dir.endswith(os.path.join("kvflow-vllm-kv", "ns"))
    nixl = KvConnectorSpec("NixlConnector", WorkerRole.decode)
    assert nixl.kv_role == "kv_consumer" and prefill_kv_transfer_params(spec) is None
    assert prefill_kv_transfer_params(nixl)["do_remote_decode"] is True
    if importlib.util.find_spec("nixl") is None:
        assert pick_connector("auto") == "ExampleConnector"
    with pytest.raises(ValueError, match="unknown vLLM KV connector"):
        pick_connector("LMCacheConnectorV1")
    with pytest.raises(ValueError, match="store_dir"):
        KvConnectorSpec("ExampleConnector", WorkerRole.prefill)
    with pytest.raises(ValueError, match="aggregated"):
        KvConnectorSpec("NixlConnector", WorkerRole.aggregated)


def test_nixl_params_are_checked_then_passed_on_unchanged():
    assert decode_kv_transfer_params(NIXL_PARAMS) == NIXL_PARAMS
    with pytest.raises(TransferError, match="no kv_transfer_params"):
        decode_kv_transfer_params(None)
    with pytest.raises(TransferError, match="remote_host"):
        decode_kv_transfer_params({**NIXL_PARAMS, "remote_host": None})
    with pytest.raises(TransferError, match="remote prefill"):
        decode_kv_transfer_params({**NIXL_PARAMS, "do_remote_prefill": False})


def test_sweep_store_removes_only_old_prompt_directories(tmp_path):
    old, new = tmp_path / "old", tmp_path / "new"
    for d in (old, new):
        d.mkdir()
        (d / "model.layers.0.self_attn.attn.safetensors").write_bytes(b"x")
    os.utime(old, (time.time() - 3600, time.time() - 3600))
    assert sweep_store(tmp_path, ttl_s=600) == 1
    assert not old.exists() and new.exists()
    assert sweep_store(tmp_path / "missing") == 0


class FakeEngine:
    """The attributes of VllmEngine that generate_from_kv reads; generate() records its request."""

    block_size = BLOCK

    def __init__(self, spec: KvConnectorSpec | None) -> None:
        self.kv_connector = spec
        self.tokenizer = SimpleNamespace(eos_token_ids={2})
        self.seen: list[GenerateRequest] = []

    async def generate(self, request: GenerateRequest):
        self.seen.append(request)
        yield EngineOutput([11], None, num_cached_tokens=64)
        yield EngineOutput([12], FinishReason.length)


def handoff(connector: str, params=None, first: int = 9) -> KvHandoff:
    desc = TransferDescriptor(transfer_id="r", backend="vllm",
                              engine_kv=EngineKvHandoff(connector=connector, kv_transfer_params=params, num_tokens=70))
    return KvHandoff(first, 70, desc)


async def collect(engine, request, h) -> list[EngineOutput]:
    return [out async for out in generate_from_kv(engine, request, h)]


async def test_decode_requests_per_connector():
    prompt = list(range(70))
    request = GenerateRequest("r", prompt, SamplingParams(max_tokens=3))
    example = FakeEngine(KvConnectorSpec("ExampleConnector", WorkerRole.decode, "/tmp/x"))
    h = handoff("ExampleConnector")
    outs = await collect(example, request, h)
    # the prefill's token first, then vLLM's stream for prompt + that token, one token less
    assert [o.token_ids for o in outs] == [[9], [11], [12]]
    assert outs[0].num_cached_tokens == 64 and outs[1].num_cached_tokens == 0
    assert example.seen[0].prompt_token_ids == [*prompt, 9] and example.seen[0].sampling.max_tokens == 2
    assert (h.stats.backend, h.stats.num_blocks_pulled) == ("vllm", 2)

    nixl = FakeEngine(KvConnectorSpec("NixlConnector", WorkerRole.decode))
    outs = await collect(nixl, request, handoff("NixlConnector", NIXL_PARAMS))
    # vLLM's decode side samples token 0 itself: its stream is the request's stream
    assert [o.token_ids for o in outs] == [[11], [12]]
    assert nixl.seen[0].prompt_token_ids == prompt and nixl.seen[0].kv_transfer_params == NIXL_PARAMS


async def test_decode_refuses_foreign_handoffs_and_short_cuts_a_finished_first_token():
    example = FakeEngine(KvConnectorSpec("ExampleConnector", WorkerRole.decode, "/tmp/x"))
    request = GenerateRequest("r", list(range(70)), SamplingParams(max_tokens=3))
    with pytest.raises(TransferError, match="NixlConnector"):
        await collect(example, request, handoff("NixlConnector", NIXL_PARAMS))
    with pytest.raises(TransferError, match="no vLLM KV connector"):
        await collect(FakeEngine(None), request, handoff("ExampleConnector"))
    with pytest.raises(TransferError, match="remote_engine_id"):
        await collect(FakeEngine(KvConnectorSpec("NixlConnector", WorkerRole.decode)), request,
                      handoff("NixlConnector", {"do_remote_prefill": True}))
    eos = await collect(example, request, handoff("ExampleConnector", first=2))
    one = await collect(example, GenerateRequest("r", list(range(70)), SamplingParams(max_tokens=1)),
                        handoff("ExampleConnector"))
    assert [(o.token_ids, o.finish_reason) for o in eos] == [([2], FinishReason.stop)]
    assert [(o.token_ids, o.finish_reason) for o in one] == [([9], FinishReason.length)]
    assert example.seen == []


# ---- against vLLM's NixlConnector (scheduler side, no GPU) -------------------------


def _nixl_connector(role: WorkerRole):
    import torch
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl import NixlConnector
    from vllm.engine.arg_utils import EngineArgs
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec

    from kvflow.models.resolve import resolve_model

    spec = KvConnectorSpec("NixlConnector", role)
    config = EngineArgs(model=str(resolve_model(MODEL).path), block_size=BLOCK, enforce_eager=True,
                        max_model_len=2048, **spec.engine_args()).create_engine_config()
    layer = FullAttentionSpec(block_size=BLOCK, num_kv_heads=3, head_size=64, dtype=torch.float32)
    kv_cache = KVCacheConfig(num_blocks=64, kv_cache_tensors=[], kv_cache_groups=[KVCacheGroupSpec(["l0"], layer)])
    return spec, NixlConnector(config, KVConnectorRole.SCHEDULER, kv_cache)


@pytest.mark.slow
def test_kvflow_nixl_params_drive_vllms_nixl_connector():
    require_vllm()
    from vllm import SamplingParams as VllmSamplingParams
    from vllm.v1.request import Request, RequestStatus

    prompt = list(range(100, 200))
    p_spec, producer = _nixl_connector(WorkerRole.prefill)
    prefill = Request("p1", prompt, VllmSamplingParams(
        max_tokens=1, extra_args={"kv_transfer_params": prefill_kv_transfer_params(p_spec)}), None)
    prefill.status = RequestStatus.FINISHED_LENGTH_CAPPED
    prefill.num_computed_tokens = len(prompt)
    delay_free, returned = producer.request_finished(prefill, [1, 2, 3, 4])
    assert delay_free  # vLLM keeps the prefill's blocks for the decode to read
    params = decode_kv_transfer_params(returned)
    assert params["remote_block_ids"] == ([1, 2, 3, 4],) and params["remote_request_id"] == "p1"

    _, consumer = _nixl_connector(WorkerRole.decode)
    decode = Request("d1", prompt, VllmSamplingParams(max_tokens=5, extra_args={"kv_transfer_params": params}), None)
    num_external, load_async = consumer.get_num_new_matched_tokens(decode, 0)
    assert num_external > 0 and load_async  # the decode reads the prompt's KV remotely instead of computing it


# ---- acceptance: 1 prefill + 1 decode vLLM worker through kvflow ---------------------------


PROMPTS = [
    "Explain in detail why the sky appears blue during the day and red at sunset.",
    "Write a short story about a lighthouse keeper who finds a message in a bottle.",
    "List the planets of the solar system and one fact about each of them.",
    "Describe how a bicycle works, from the pedals to the wheels, for a child.",
    "What are the main differences between a lake, a river and a sea? Explain.",
]


def _engine(connector: KvConnectorSpec | None):
    """A small float32 engine (eager on CPU by the platform defaults)."""
    from kvflow.workers.engines.base import EngineConfig
    from kvflow.workers.engines.vllm import VllmEngine, VllmOptions

    return VllmEngine(EngineConfig(model=MODEL, block_size=BLOCK, extra={"max_model_len": TEST_MAX_MODEL_LEN}),
                      options=VllmOptions(kv_cache_gb=TEST_KV_CACHE_GB, dtype="float32"), kv_connector=connector)


@pytest.mark.slow
async def test_prefill_and_decode_workers_match_aggregated_greedy_output(kafka, waiter, tmp_path):
    require_vllm()
    from kvflow.router.app import build_router_app
    from kvflow.streams.client import KvflowClient
    from kvflow.workers.worker import Worker, WorkerConfig

    settings, catalog = kafka
    settings = settings.model_copy(update={"disagg_prefill_threshold_tokens": 16})
    sampling = SamplingParams(max_tokens=12, temperature=0.0)
    tokenizer = _engine(None).tokenizer
    # Prompts longer than the threshold and two blocks, so the decode has full blocks to load.
    prompts = [tokenizer.encode_prompt(" ".join([p] * 5)) for p in PROMPTS]
    assert all(len(p) > 2 * BLOCK for p in prompts)

    store = tmp_path / "kv"
    reference = _engine(None)
    prefill_engine = _engine(KvConnectorSpec("ExampleConnector", WorkerRole.prefill, str(store)))
    decode_engine = _engine(KvConnectorSpec("ExampleConnector", WorkerRole.decode, str(store)))
    try:
        # Started together, built one after another (one vLLM build at a time per process).
        await asyncio.gather(reference.start(), prefill_engine.start(), decode_engine.start())
        expected = []
        for i, ids in enumerate(prompts):
            outs = [o async for o in reference.generate(GenerateRequest(f"ref-{i}", ids, sampling))]
            expected.append([t for o in outs for t in o.token_ids])
        params = reference._sampling_params(GenerateRequest("x", [1], sampling, kv_transfer_params={"k": 1}))
        assert params.extra_args == {"kv_transfer_params": {"k": 1}}
    except BaseException:
        await prefill_engine.stop()
        await decode_engine.stop()
        raise
    finally:
        await reference.stop()

    workers = [Worker(steady(settings), WorkerConfig(worker_id="pre-0", slot=0, model=MODEL, role=WorkerRole.prefill),
                      prefill_engine, catalog),
               Worker(steady(settings), WorkerConfig(worker_id="dec-0", slot=0, model=MODEL, role=WorkerRole.decode),
                      decode_engine, catalog)]
    tasks = [asyncio.create_task(w.run()) for w in workers]
    router = build_router_app(settings, catalog, policy="kv")
    await router.app.start()
    client = KvflowClient(settings, catalog, timeout_s=120)
    try:
        await waiter(lambda: len(router.table.workers) == 2, timeout_s=60)
        await client.start()
        finals = []
        for ids in prompts:
            finals.append(await client.complete(client.new_request(MODEL, token_ids=ids, sampling=sampling)))
    finally:
        await client.stop()
        for w in workers:
            w.stop()
        with contextlib.suppress(Exception):
            await asyncio.gather(*tasks)
        await router.app.stop()

    for final, want in zip(finals, expected, strict=True):
        assert final.error is None, final.error
        assert final.token_ids == want
        assert final.worker_id == "dec-0" and final.routing.prefill_worker_id == "pre-0"
        info = final.kv_transfer
        assert info.backend == "vllm" and not info.recomputed and info.prefill_worker_id == "pre-0"
        assert info.num_blocks_pulled >= 2  # the decode engine did not compute the prompt's full blocks
    # What moved the KV: one directory of per-layer safetensors files per prompt (30 attention layers).
    dirs = [d for d in store.iterdir() if d.is_dir()]
    assert len(dirs) >= len(prompts)
    assert all(len(list(d.glob("*.safetensors"))) == 30 for d in dirs if any(d.iterdir()))


def test_engine_handoff_travels_in_the_decode_stage():
    from kvflow.schemas.transfer import DecodeStage, parse_stage

    desc = TransferDescriptor(transfer_id="r", source_worker_id="pre-0", backend="vllm", num_tokens=70,
                              engine_kv=EngineKvHandoff(connector="NixlConnector", kv_transfer_params=NIXL_PARAMS,
                                                        num_tokens=70))
    stage = DecodeStage(prefill_worker_id="pre-0", first_token_id=9, num_prompt_tokens=70, kv=desc)
    back = parse_stage(stage.to_params())
    assert back == DecodeStage.model_validate_json(stage.model_dump_json())
    assert back.kv.engine_kv.kv_transfer_params["remote_block_ids"] == [[1, 2]]  # JSON: tuples become lists
    assert decode_kv_transfer_params(back.kv.engine_kv.kv_transfer_params)["remote_engine_id"] == "e"
