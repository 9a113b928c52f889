"""Entry point of one worker process: build the engine, run a :class:`Worker`.

SIGTERM and SIGINT drain the worker (no request lost); a second signal stops it.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import uuid
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kvflow.schemas import IMAGE_ROLES, WorkerRole
from kvflow.settings import Settings
from kvflow.workers.engines import ENGINES, make_engine
from kvflow.workers.engines.base import Engine
from kvflow.workers.worker import Worker, WorkerConfig

__all__ = ["build_engine", "mocker_output_interval_s", "run_worker", "run_embedding_worker", "run_encode_worker",
           "encode_target", "DEFAULT_MEDIA_HIDDEN_SIZE", "MEDIA_ENCODER_SEED", "build_image_stage", "run_image_stage_worker"]

if TYPE_CHECKING:
    from kvflow.streams.catalog import TopicSpec
    from kvflow.workers.images.stage_worker import StageWorkerConfig

DEFAULT_MEDIA_HIDDEN_SIZE = 64
"""Width media embeddings are projected to for a model without a ``config.json``
(the mocker's, which reads only their hashes)."""

MEDIA_ENCODER_SEED = 0
"""Seed of every encode worker's weights, so all of a deployment's agree."""

log = logging.getLogger(__name__)


def build_engine(engine: str, model: str, *, block_size: int | None = None, num_kv_blocks: int | None = None,
                 speedup_ratio: float = 1.0, device: str = "cpu", worker_id: str = "worker",
                 tokenizer: str | None = None, kv_cache_gb: float | None = None, dtype: str = "auto",
                 compiled: bool | None = None, kv_connector: Any = None, kv_host_gb: float = 0.0,
                 kv_disk_gb: float = 0.0, kv_disk_dir: str | None = None,
                 mocker_spec: tuple[int, float, float] = (0, 0.7, 0.0),
                 mocker_output_interval_s: float = 0.0,
                 hf_spec_ngram_tokens: int = 0,
                 vllm_speculative_config: dict | None = None,
                 vllm_lora: tuple[int, int] = (0, 16)) -> tuple[Engine, str, str]:
    """Build an engine from CLI-level options.

    ``kv_host_gb``/``kv_disk_gb`` size the G2/G3 KV tiers of the mocker and
    hf engines (:mod:`kvflow.workers.kv.tiers`; the mocker models them, hf
    keeps real tensors, its disk files under ``kv_disk_dir``). On the vllm
    engine ``kv_host_gb`` turns on vLLM's own offloading to host memory (CUDA
    and XPU GPUs only; its tier events reach the router like any other).

    Raises:
        ValueError: options the engine cannot take (``kv_disk_gb`` on vllm,
            ``kv_host_gb`` with a vLLM KV connector, ...).

    ``kv_cache_gb``, ``dtype`` and ``compiled`` are the vllm engine's
    (:class:`~kvflow.workers.engines.vllm.VllmOptions`); other engines ignore them.
    ``kv_connector``: the vLLM KV connector of a prefill or decode worker
    (:func:`~kvflow.workers.engines.vllm_disagg.connector_for_role`); vllm only.
    ``mocker_spec``: the mocker's speculative decoding (draft tokens, acceptance
    rate, draft cost ratio; :class:`~kvflow.workers.engines.mocker_core.MockerConfig`);
    ``mocker_output_interval_s``: the mocker's ``output_interval_s`` (0: it wakes every step);
    ``hf_spec_ngram_tokens``: the hf engine's prompt-lookup draft tokens (0 = off);
    ``vllm_speculative_config``: vLLM's ``speculative_config``, passed through;
    ``vllm_lora``: vLLM's ``(max_loras, max_lora_rank)`` (``max_loras`` 0: no LoRA).

    Returns ``(engine, served_model_name, tokenizer_spec)``.

    Raises:
        ValueError: unknown engine (not in :data:`~kvflow.workers.engines.ENGINES`).
    """
    if engine not in ENGINES:
        raise ValueError(f"unknown engine {engine!r}; choose one of {', '.join(ENGINES)}")
    if engine == "mocker":
        from kvflow.workers.engines.mocker_core import MockerConfig

        kw = {"speedup_ratio": speedup_ratio}
        if block_size:
            kw["block_size"] = block_size
        if num_kv_blocks:
            kw["num_kv_blocks"] = num_kv_blocks
        kw["kv_host_bytes"], kw["kv_disk_bytes"] = int(kv_host_gb * 2**30), int(kv_disk_gb * 2**30)
        kw["spec_num_draft_tokens"], kw["spec_acceptance_rate"], kw["spec_draft_cost_ratio"] = mocker_spec
        spec = "bytes"
        if tokenizer and tokenizer != "bytes":
            from kvflow.models.resolve import resolve_model

            spec = str(resolve_model(tokenizer).path)
        engine_obj = make_engine("mocker", config=MockerConfig(**kw), worker_id=worker_id, model_name=model,
                                 tokenizer=spec, output_interval_s=mocker_output_interval_s)
        return engine_obj, model, spec
    if engine == "hf":
        from kvflow.models.resolve import resolve_model

        resolved = resolve_model(model)
        kw = {"block_size": block_size} if block_size else {}
        if num_kv_blocks:
            kw["num_kv_blocks"] = num_kv_blocks
        if kv_host_gb or kv_disk_gb:
            kw["extra"] = {"kv_host_gb": kv_host_gb, "kv_disk_gb": kv_disk_gb, "kv_disk_dir": kv_disk_dir}
        if hf_spec_ngram_tokens:
            kw.setdefault("extra", {})["spec_ngram_tokens"] = hf_spec_ngram_tokens
        return make_engine("hf", model=str(resolved.path), device=device, **kw), resolved.name, str(resolved.path)
    if engine == "vllm" and kv_disk_gb:
        raise ValueError("--kv-disk-gb: the vllm engine offloads KV to host memory only (--kv-host-gb, "
                         "vLLM's own OffloadingConnector)")
    if engine == "vllm" and kv_host_gb and kv_connector is not None:
        raise ValueError("--kv-host-gb: vLLM's KV offloading replaces the KV connector of a prefill or decode "
                         "worker; use it on aggregated vLLM workers")
    if engine == "vllm":
        from kvflow.workers.engines.vllm import VllmOptions
        from kvflow.models.resolve import resolve_model

        resolved = resolve_model(model)
        kw = {"block_size": block_size} if block_size else {}
        options = VllmOptions(kv_cache_gb=kv_cache_gb, dtype=dtype, compiled=compiled,
                              speculative_config=vllm_speculative_config, kv_offload_gb=kv_host_gb or None,
                              max_loras=vllm_lora[0], max_lora_rank=vllm_lora[1])
        return (make_engine("vllm", model=str(resolved.path), options=options,
                             kv_connector=kv_connector, **kw), resolved.name,
                str(resolved.path))
    raise ValueError(f"engine {engine!r} is registered but has no worker options here")


def mocker_output_interval_s(settings: Settings) -> float:
    """The mocker's output interval in seconds: ``settings.mocker_output_interval_ms``,
    or ``stream_flush_ms`` when that is None."""
    ms = settings.mocker_output_interval_ms
    return (settings.stream_flush_ms if ms is None else ms) / 1000.0


async def run_worker(settings: Settings, *, slot: int, engine: str, model: str,
                     role: WorkerRole = WorkerRole.aggregated, worker_id: str | None = None,
                     block_size: int | None = None, num_kv_blocks: int | None = None,
                     speedup_ratio: float = 1.0, device: str = "cpu", tokenizer: str | None = None,
                     kv_cache_gb: float | None = None, dtype: str = "auto", compiled: bool | None = None) -> None:
    """Run a worker until it is drained (SIGTERM/SIGINT) or stopped (engine options: :func:`build_engine`;
    KV tiers from ``settings.kv_host_gb``/``kv_disk_gb``, disk files in
    ``<kv_disk_dir or data_dir/kv-disk>/<worker id>``).

    Role ``embedding`` runs :func:`run_embedding_worker` on ``model``, role
    ``encode`` :func:`run_encode_worker` for ``engine``'s ``model``, and roles
    ``conditioning`` and ``diffusion`` run :func:`run_image_stage_worker`
    (other engine options are ignored; ``tokenizer`` is the tiny image
    pipeline's).
    """
    worker_id = worker_id or f"{role.value[:3]}-{slot}-{uuid.uuid4().hex[:6]}"
    if role is WorkerRole.embedding:
        await run_embedding_worker(settings, slot=slot, model=model, worker_id=worker_id, device=device)
        return
    if role is WorkerRole.encode:
        await run_encode_worker(settings, slot=slot, engine=engine, model=model, worker_id=worker_id)
        return
    if role in IMAGE_ROLES:
        await run_image_stage_worker(settings, role=role, slot=slot, model=model, worker_id=worker_id,
                                     device=device, tokenizer=tokenizer)
        return
    connector = None
    if engine == "vllm":
        from kvflow.workers.engines.vllm_disagg import connector_for_role

        connector = connector_for_role(role, settings.vllm_kv_connector, settings.vllm_kv_store_dir,
                                       settings.namespace)
    disk_dir = None
    if settings.kv_disk_gb:
        disk_dir = str(Path(settings.kv_disk_dir or Path(settings.data_dir) / "kv-disk") / worker_id)
    eng, served_name, tokenizer = build_engine(engine, model, block_size=block_size, num_kv_blocks=num_kv_blocks,
                                               speedup_ratio=speedup_ratio, device=device, worker_id=worker_id,
                                               tokenizer=tokenizer, kv_cache_gb=kv_cache_gb, dtype=dtype,
                                               compiled=compiled, kv_connector=connector,
                                               kv_host_gb=settings.kv_host_gb, kv_disk_gb=settings.kv_disk_gb,
                                               mocker_spec=(settings.mocker_spec_num_draft_tokens,
                                                            settings.mocker_spec_acceptance_rate,
                                                            settings.mocker_spec_draft_cost_ratio),
                                               mocker_output_interval_s=mocker_output_interval_s(settings),
                                               hf_spec_ngram_tokens=settings.hf_spec_ngram_tokens,
                                               vllm_speculative_config=settings.vllm_speculative_config,
                                               vllm_lora=(settings.vllm_max_loras, settings.vllm_max_lora_rank),
                                               kv_disk_dir=disk_dir)
    worker = Worker(settings, WorkerConfig(worker_id=worker_id, slot=slot, model=served_name,
                                           tokenizer=tokenizer, role=role, pool=settings.worker_pool), eng)
    _drain_on_signals(worker)
    await worker.run()


async def run_embedding_worker(settings: Settings, *, slot: int, model: str, worker_id: str,
                               device: str = "cpu") -> None:
    """Load the encoder ``model`` (:func:`kvflow.models.embedding.resolve_embedding_model`)
    and serve ``queue.embedding[slot]`` until drained (SIGTERM/SIGINT) or stopped.

    Raises:
        kvflow.models.resolve.ModelNotFoundError: ``model`` cannot be resolved.
    """
    from kvflow.models.embedding import resolve_embedding_model
    from kvflow.workers.embedding_worker import EmbeddingWorker, EmbeddingWorkerConfig
    from kvflow.workers.encoder import load_encoder

    resolved = resolve_embedding_model(model)
    encoder = await asyncio.to_thread(load_encoder, resolved.path, device)
    worker = EmbeddingWorker(settings, EmbeddingWorkerConfig(worker_id=worker_id, slot=slot, model=resolved.name,
                                                             tokenizer=str(resolved.path)), encoder)
    _drain_on_signals(worker.slot)
    await worker.slot.run()


def encode_target(engine: str, model: str) -> tuple[str, int]:
    """``(served model name, hidden size)`` an encode worker projects media into:
    the name ``engine``'s workers serve ``model`` under and the ``hidden_size``
    of its ``config.json`` (a vision-language config's ``text_config``); for a
    model without one (the mocker's) the name as given and
    :data:`DEFAULT_MEDIA_HIDDEN_SIZE`.

    Raises:
        kvflow.models.resolve.ModelNotFoundError: a non-mocker ``model`` cannot be resolved.
        ValueError: its ``config.json`` gives no hidden size.
    """
    import json

    from kvflow.models.resolve import ModelNotFoundError, resolve_model

    try:
        resolved = resolve_model(model)
    except ModelNotFoundError:
        if engine != "mocker":
            raise
        return model, DEFAULT_MEDIA_HIDDEN_SIZE
    config = json.loads((resolved.path / "config.json").read_text())
    hidden = config.get("hidden_size") or (config.get("text_config") or {}).get("hidden_size")
    if not isinstance(hidden, int) or hidden < 1:
        raise ValueError(f"{resolved.path}/config.json gives no hidden_size")
    return (model if engine == "mocker" else resolved.name), hidden


async def run_encode_worker(settings: Settings, *, slot: int, engine: str, model: str, worker_id: str) -> None:
    """Build the media encoder for ``engine``'s ``model`` (:func:`encode_target`,
    seed :data:`MEDIA_ENCODER_SEED`) and serve ``queue.encode[slot]`` until
    drained (SIGTERM/SIGINT) or stopped.

    Raises:
        kvflow.models.resolve.ModelNotFoundError: as :func:`encode_target`.
    """
    from kvflow.workers.encode_worker import EncodeWorker, EncodeWorkerConfig
    from kvflow.workers.media_encoder import build_media_encoder

    name, hidden = await asyncio.to_thread(encode_target, engine, model)
    encoder = build_media_encoder(hidden, seed=MEDIA_ENCODER_SEED)
    worker = EncodeWorker(settings, EncodeWorkerConfig(worker_id=worker_id, slot=slot, model=name), encoder)
    _drain_on_signals(worker.slot)
    await worker.slot.run()


def build_image_stage(role: WorkerRole, model: str, *, worker_id: str, diffusion_topic: TopicSpec,
                      device: str = "cpu", tokenizer: str | None = None) -> tuple[Any, StageWorkerConfig]:
    """Load the model of image stage ``role`` (``conditioning``: the text encoder,
    ``diffusion``: the denoiser; :mod:`kvflow.workers.images.models`) and build the
    stage; returns ``(stage, config without a slot)``, the config's ``slot`` 0.
    ``diffusion_topic`` is the image stage's queue (where the text stage sends its output).

    Raises:
        ValueError: ``role`` is not an image stage.
        kvflow.models.resolve.ModelNotFoundError: ``model`` cannot be resolved.
        ImportError: diffusers is not installed (``pip install 'kvflow[images]'``).
    """
    from kvflow.models.image import resolve_image_model
    from kvflow.workers.images.models import load_denoiser, load_text_encoder
    from kvflow.workers.images.stage_worker import StageWorkerConfig
    from kvflow.workers.images.stages import ConditioningStage, DiffusionStage

    name = resolve_image_model(model).name
    if role is WorkerRole.conditioning:
        encoder = load_text_encoder(model, device=device, tokenizer=tokenizer)
        return (ConditioningStage(encoder, name, worker_id, diffusion_topic.name, diffusion_topic.partitions),
                StageWorkerConfig(worker_id=worker_id, role=role, slot=0, model=name, tokenizer=encoder.tokenizer,
                                  context_length=encoder.max_tokens))
    if role is WorkerRole.diffusion:
        return (DiffusionStage(load_denoiser(model, device=device), name, worker_id),
                StageWorkerConfig(worker_id=worker_id, role=role, slot=0, model=name))
    raise ValueError(f"{role.value} is not an image stage")


async def run_image_stage_worker(settings: Settings, *, role: WorkerRole, slot: int, model: str, worker_id: str,
                                 device: str = "cpu", tokenizer: str | None = None) -> None:
    """Load image stage ``role``'s model (:func:`build_image_stage`) and serve
    ``queue.<role>[slot]`` until drained (SIGTERM/SIGINT) or stopped.

    Raises:
        kvflow.models.resolve.ModelNotFoundError: ``model`` cannot be resolved.
        ImportError: diffusers is not installed.
    """
    from kvflow.streams.catalog import Catalog
    from kvflow.workers.images.stage_worker import StageWorker

    catalog = Catalog(settings.namespace)
    stage, config = await asyncio.to_thread(build_image_stage, role, model, worker_id=worker_id,
                                            diffusion_topic=catalog.queue(WorkerRole.diffusion),
                                            device=device, tokenizer=tokenizer)
    config.slot = slot
    worker = StageWorker(settings, config, stage, catalog)
    _drain_on_signals(worker.slot)
    await worker.slot.run()


def _drain_on_signals(worker: Any) -> None:
    """SIGINT/SIGTERM: the first drains ``worker``, a second stops it."""
    loop = asyncio.get_running_loop()
    signals = {"n": 0}

    def on_signal() -> None:
        signals["n"] += 1
        if signals["n"] == 1:
            asyncio.ensure_future(worker.drain())
        else:
            worker.stop()

    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, on_signal)
