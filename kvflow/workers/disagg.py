"""The worker's disaggregated request paths: prefill stage and decode stage.

:class:`~kvflow.workers.worker.Worker` dispatches on the stage record in
``InferenceRequest.disaggregated_params`` (:mod:`kvflow.schemas.transfer`):

* :func:`serve_prefill` (``PrefillStage``, on a prefill worker): prefill
  the prompt (``engine.prefill``), expose its KV through the worker's
  :class:`~kvflow.workers.kv.transfer.KvTransport`, and forward the request,
  now carrying a ``DecodeStage`` (first token, timings, transfer
  descriptor) and its prompt token ids, to the decode worker's queue
  partition. Nothing goes to the client from here except an error, or the
  ``abort`` of a request cancelled while its KV was being exposed (the
  buffer is then withdrawn at once).
* :func:`serve_decode` (``DecodeStage``, on a decode or aggregated worker):
  hand the engine a :class:`~kvflow.workers.kv.handoff.KvHandoff`
  (``engine.generate_from_kv``), which pulls the KV the engine lacks and
  decodes, and stream every token, the prefill's first token included, to
  ``reply_to``. The final response carries a
  :class:`~kvflow.schemas.transfer.KvTransferInfo`.

Failure handling keeps requests alive: if the prefill worker cannot expose
its KV, the decode stage carries no descriptor; if the decode engine cannot
use or pull the KV (no ``generate_from_kv``, layout mismatch, source gone,
buffer expired), the decode worker prefills the prompt itself and reports
``recomputed``. A decode worker that ends a request without pulling its
KV (cancelled or past its deadline on arrival) tells the source to free it
(:func:`release_unpulled`). An engine without ``prefill`` forwards the
request unchanged to the decode worker, which then prefills locally.

vLLM moves the KV itself, through its KV connector API
(:mod:`kvflow.workers.engines.vllm_disagg`): its prefill returns an
:class:`~kvflow.schemas.transfer.EngineKvHandoff` (the connector's
``kv_transfer_params``), which travels in the ``DecodeStage`` descriptor
(backend ``vllm``) to the decode engine; kvflow's transport is not used.
"""

from __future__ import annotations

import base64
import logging
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING

from kvflow.schemas import InferenceRequest, now_ms
from kvflow.schemas.transfer import DecodeStage, KvTransferInfo, PrefillStage, TransferDescriptor, parse_stage
from kvflow.workers.engines.base import EngineOutput, GenerateRequest
from kvflow.workers.engines.capabilities import DecodesFromKv, PrefillsAlone
from kvflow.workers.kv.handoff import KvHandoff, PrefillResult
from kvflow.workers.kv.transfer import TransferError

if TYPE_CHECKING:
    from kvflow.workers.worker import Worker

__all__ = ["serve_prefill", "serve_decode", "expose_kv", "release_unpulled"]

log = logging.getLogger(__name__)

PULLABLE = ("nixl", "tcp")
"""Descriptor backends whose source holds a buffer until released (``simulated`` holds none)."""


def _generate_request(request: InferenceRequest, prompt_ids: list[int]) -> GenerateRequest:
    return GenerateRequest(request_id=request.request_id, prompt_token_ids=prompt_ids,
                           sampling=request.sampling, lora_name=request.lora_name,
                           resumed_tokens=request.resumed_tokens)


async def expose_kv(worker: Worker, request: InferenceRequest, result: PrefillResult) -> TransferDescriptor | None:
    """Make ``result``'s KV pullable and describe it; None if that failed (logged).

    An engine without KV bytes (mocker) gets a ``simulated`` descriptor that
    only states the modelled size; an engine whose own connector moves the KV
    (vLLM) a ``vllm`` descriptor carrying the connector's handoff.
    """
    if result.engine_kv is not None:
        return TransferDescriptor(transfer_id=request.request_id, source_worker_id=worker.config.worker_id,
                                  backend="vllm", num_tokens=result.num_prompt_tokens, engine_kv=result.engine_kv)
    if result.kv is None:
        return TransferDescriptor(transfer_id=request.request_id, source_worker_id=worker.config.worker_id,
                                  backend="simulated", total_bytes=result.num_kv_bytes,
                                  num_tokens=result.num_prompt_tokens)
    kv = result.kv
    try:
        transport = await worker.kv_transport()
        return await transport.expose(request.request_id, kv.buffer, block_bytes=kv.layout.block_bytes,
                                      num_blocks=kv.num_blocks, num_tokens=kv.num_tokens, dtype=kv.layout.dtype,
                                      block_shape=kv.layout.block_shape)
    except Exception as exc:  # noqa: BLE001 - the decode worker can still prefill itself
        log.warning("cannot expose the KV of %s (%s); the decode worker will prefill it", request.request_id, exc)
        return None


async def serve_prefill(worker: Worker, request: InferenceRequest, stage: PrefillStage, received_ms: int) -> None:
    """Prefill ``request`` here and forward it to the decode worker named in ``stage``.

    Raises:
        kvflow.workers.engines.base.EngineError: the engine rejected the
            request (the worker answers the client with an error).
    """
    prompt_ids = worker.prompt_ids(request)
    engine = worker.engine
    key = request.request_id.encode()
    if not isinstance(engine, PrefillsAlone):
        log.warning("engine %s cannot prefill alone; %s goes to its decode worker whole", engine.name,
                    request.request_id)
        plain = request.model_copy(update={"disaggregated_params": None, "token_ids": prompt_ids})
        await worker.send_to(stage.decode_queue_topic, stage.decode_queue_partition, key, plain)
        return
    started = now_ms()
    result: PrefillResult = await engine.prefill(_generate_request(request, prompt_ids))
    descriptor = await expose_kv(worker, request, result)
    if worker.is_cancelled(request.request_id):
        # The cancel came after the engine finished (too late for its abort):
        # nobody will pull this KV, and the client gets its abort from here.
        if descriptor is not None and descriptor.backend in PULLABLE:
            (await worker.kv_transport()).withdraw(descriptor.transfer_id)
        await worker.answer_aborted(request, received_ms)
        return
    decode = DecodeStage(
        prefill_worker_id=worker.config.worker_id, first_token_id=result.first_token_id,
        num_prompt_tokens=result.num_prompt_tokens, num_cached_tokens=result.num_cached_tokens,
        prefill_received_ms=received_ms, prefill_started_ms=started, prefill_finished_ms=now_ms(),
        sampler_state_b64=base64.b64encode(result.sampler_state).decode() if result.sampler_state else None,
        kv=descriptor,
    )
    forwarded = request.model_copy(update={"disaggregated_params": decode.to_params(), "token_ids": prompt_ids})
    await worker.send_to(stage.decode_queue_topic, stage.decode_queue_partition, key, forwarded)


async def release_unpulled(worker: Worker, request: InferenceRequest) -> None:
    """Let the prefill worker free the KV it exposed for ``request`` when this
    worker ends the request without pulling it (cancelled, or past its deadline,
    on arrival). A no-op for requests without a pullable descriptor; never
    raises (the source's TTL frees the buffer anyway)."""
    try:
        stage = parse_stage(request.disaggregated_params)
    except ValueError:
        return
    if not isinstance(stage, DecodeStage) or stage.kv is None or stage.kv.backend not in PULLABLE:
        return
    try:
        await (await worker.kv_transport()).release(stage.kv)
    except Exception:  # noqa: BLE001 - best effort, see above
        log.debug("could not release the KV of %s", request.request_id, exc_info=True)


async def _prepend(first: EngineOutput, rest: AsyncIterator[EngineOutput]) -> AsyncIterator[EngineOutput]:
    """``first`` then the items of ``rest``; closing this closes ``rest``."""
    try:
        yield first
        async for item in rest:
            yield item
    finally:
        await rest.aclose()


async def serve_decode(worker: Worker, request: InferenceRequest, stage: DecodeStage, received_ms: int) -> None:
    """Decode ``request`` from the KV its prefill worker exposed; stream to ``reply_to``.

    Falls back to a local prefill (``KvTransferInfo.recomputed``) when the
    KV cannot be used; see the module docstring.

    Raises:
        kvflow.workers.engines.base.EngineError: the engine rejected the request.
    """
    prompt_ids = worker.prompt_ids(request)
    engine = worker.engine
    desc = stage.kv
    pullable = desc is not None and desc.backend in PULLABLE
    transport = await worker.kv_transport() if pullable else None
    sampler_state = base64.b64decode(stage.sampler_state_b64) if stage.sampler_state_b64 else None
    handoff = KvHandoff(stage.first_token_id, stage.num_prompt_tokens, desc, transport, sampler_state)
    gen = _generate_request(request, prompt_ids)
    info = KvTransferInfo(prefill_worker_id=stage.prefill_worker_id, prefill_started_ms=stage.prefill_started_ms,
                          prefill_finished_ms=stage.prefill_finished_ms)
    started = now_ms()
    try:
        try:
            if desc is None or not isinstance(engine, DecodesFromKv):
                raise TransferError("no usable KV handoff for this engine")
            outputs = engine.generate_from_kv(gen, handoff)
            first = await outputs.__anext__()
        except TransferError as exc:
            log.warning("%s: cannot use the KV from %s (%s); prefilling locally", request.request_id,
                        stage.prefill_worker_id, exc)
            await handoff.release()
            await worker.stream_outputs(request, prompt_ids, engine.generate(gen), received_ms, now_ms(),
                                        kv_transfer=info.model_copy(update={"recomputed": True}))
            return
        stats = handoff.stats
        info = info.model_copy(update={
            "backend": stats.backend, "num_bytes": stats.num_bytes, "transfer_ms": stats.transfer_ms,
            "num_blocks_pulled": stats.num_blocks_pulled, "num_blocks_reused": stats.num_blocks_reused})
        await worker.stream_outputs(request, prompt_ids, _prepend(first, outputs), received_ms, started,
                                    cached_tokens=stage.num_cached_tokens, kv_transfer=info)
    finally:
        await handoff.release()
