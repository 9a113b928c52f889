"""Disaggregated prefill/decode for the ``vllm`` engine through vLLM's KV connector API.

kvflow routes and forwards (:mod:`kvflow.workers.disagg`); vLLM moves the
KV. Both workers run ``AsyncLLM`` with a ``KVTransferConfig`` naming the
same connector (:class:`KvConnectorSpec`); what crosses Kafka is the
prefill's first token and an :class:`~kvflow.schemas.transfer.EngineKvHandoff`
(the connector's ``kv_transfer_params``) inside the ``DecodeStage``.

Two connectors are wired (:data:`CONNECTORS`):

* ``NixlConnector`` (GPU hosts with the ``nixl`` package): the prefill
  request carries ``kv_transfer_params = {"do_remote_decode": True}`` and
  ``max_tokens = 1``; vLLM keeps its blocks and returns, with the output,
  the params that locate them (engine id, side-channel host and port, block
  ids). The decode request carries those params back unchanged
  (``do_remote_prefill`` is then True): vLLM's decode worker reads the
  blocks over NIXL, computes the last prompt position itself and samples
  the first token, so the decode engine's stream starts at token 0 (greedy:
  the same token the prefill sampled). The prefill side runs
  ``kv_role=kv_producer``, the decode side ``kv_consumer`` (vLLM 0.32
  deprecates ``kv_both`` for NIXL).
* ``ExampleConnector`` (every platform, the CPU build included): vLLM's
  reference shared-storage connector. The prefill engine (``kv_producer``)
  writes, for each attention layer, the KV of the prompt's full blocks as a
  safetensors file under ``<store_dir>/<hash of those tokens>/``; the decode
  engine (``kv_consumer``) finds the directory by the same hash and reads
  the blocks into its paged cache. It keys on ``prompt[:-1]``, so the decode
  request is the prompt plus the prefill's first token, asking for one
  token less: vLLM computes only the tail past the last full block (and the
  first token), and its first sampled token is the request's second. Both
  workers must see the same ``store_dir`` (one host, or a shared mount).
  vLLM never deletes these files: the prefill worker removes directories
  older than :data:`STORE_TTL_S` whenever it prefills.

:func:`pick_connector` chooses: NixlConnector where ``nixl`` imports and
CUDA is available, else ExampleConnector.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib.util
import logging
import os
import shutil
import tempfile
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kvflow.schemas import FinishReason, WorkerRole
from kvflow.schemas.transfer import EngineKvHandoff
from kvflow.workers.engines.base import EngineError, EngineOutput, GenerateRequest
from kvflow.workers.kv.handoff import KvHandoff, PrefillResult, TransferStats
from kvflow.workers.kv.transfer import TransferError

if TYPE_CHECKING:
    from kvflow.workers.engines.vllm import VllmEngine

__all__ = [
    "CONNECTORS",
    "STORE_TTL_S",
    "KvConnectorSpec",
    "pick_connector",
    "default_store_dir",
    "connector_for_role",
    "prefill_kv_transfer_params",
    "decode_kv_transfer_params",
    "prefill",
    "generate_from_kv",
    "sweep_store",
]

log = logging.getLogger(__name__)

CONNECTORS = ("NixlConnector", "ExampleConnector")
"""vLLM KV connectors kvflow knows how to drive (names as vLLM registers them)."""

STORE_TTL_S = 600.0
"""ExampleConnector directories older than this are deleted by the prefill
worker that wrote them: a decode reads its KV within seconds of the prefill
(the request is forwarded when the prefill ends), so ten minutes leaves a wide
margin for a backed-up decode queue."""

_NIXL_REQUIRED = ("remote_engine_id", "remote_block_ids", "remote_host", "remote_port", "remote_request_id",
                  "tp_size")
"""Keys vLLM's NIXL decode side needs in ``kv_transfer_params`` (``NixlConnectorScheduler``)."""


@dataclass(frozen=True)
class KvConnectorSpec:
    """One worker's KV connector: vLLM connector ``name``, the kvflow ``role``
    (prefill or decode) and, for ExampleConnector, the shared ``store_dir``.

    Raises:
        ValueError: unknown connector, an aggregated role, or ExampleConnector without ``store_dir``.
    """

    name: str
    role: WorkerRole
    store_dir: str | None = None

    def __post_init__(self) -> None:
        if self.name not in CONNECTORS:
            raise ValueError(f"unknown vLLM KV connector {self.name!r}; kvflow drives {', '.join(CONNECTORS)}")
        if self.role is WorkerRole.aggregated:
            raise ValueError("aggregated workers run no KV connector")
        if self.name == "ExampleConnector" and not self.store_dir:
            raise ValueError("ExampleConnector needs a store_dir both workers share")

    @property
    def kv_role(self) -> str:
        """vLLM's ``kv_role``: ``kv_producer`` on a prefill worker, ``kv_consumer`` on a decode worker."""
        return "kv_producer" if self.role is WorkerRole.prefill else "kv_consumer"

    def engine_args(self) -> dict[str, Any]:
        """Keyword arguments for ``vllm.AsyncEngineArgs``: ``{"kv_transfer_config": KVTransferConfig(...)}``.

        Raises:
            ImportError: vLLM is not installed.
        """
        from vllm.config import KVTransferConfig

        extra = {"shared_storage_path": self.store_dir} if self.name == "ExampleConnector" else {}
        return {"kv_transfer_config": KVTransferConfig(kv_connector=self.name, kv_role=self.kv_role,
                                                       kv_connector_extra_config=extra)}


def pick_connector(requested: str = "auto") -> str:
    """``requested`` itself, or for ``auto``: NixlConnector when the ``nixl``
    package imports and torch sees a CUDA device, else ExampleConnector.

    Raises:
        ValueError: an unknown connector name.
    """
    if requested != "auto":
        if requested not in CONNECTORS:
            raise ValueError(f"unknown vLLM KV connector {requested!r}; choose auto or {', '.join(CONNECTORS)}")
        return requested
    if importlib.util.find_spec("nixl") is not None:
        import torch

        if torch.cuda.is_available():
            return "NixlConnector"
    return "ExampleConnector"


def default_store_dir(namespace: str) -> str:
    """ExampleConnector's directory when none is configured: ``<tmp>/kvflow-vllm-kv/<namespace>``
    (shared by every worker of the deployment on this host)."""
    return str(Path(tempfile.gettempdir()) / "kvflow-vllm-kv" / namespace)


def connector_for_role(role: WorkerRole, requested: str, store_dir: str | None,
                       namespace: str) -> KvConnectorSpec | None:
    """The connector a vLLM worker of ``role`` runs: None for aggregated workers.

    Raises:
        ValueError: an unknown connector name.
    """
    if role is WorkerRole.aggregated:
        return None
    name = pick_connector(requested)
    store = (store_dir or default_store_dir(namespace)) if name == "ExampleConnector" else None
    return KvConnectorSpec(name, role, store)


def prefill_kv_transfer_params(spec: KvConnectorSpec) -> dict[str, Any] | None:
    """``kv_transfer_params`` of the prefill request: NIXL's ask to keep the
    blocks for a remote decode; None for ExampleConnector (its producer stores
    every new prompt)."""
    if spec.name != "NixlConnector":
        return None
    return {"do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
            "remote_block_ids": None, "remote_host": None, "remote_port": None}


def decode_kv_transfer_params(prefill_params: dict[str, Any] | None) -> dict[str, Any]:
    """``kv_transfer_params`` of the NIXL decode request, from those vLLM
    returned with the prefill's output (passed on unchanged once checked).

    Raises:
        TransferError: the prefill returned none, or they lack a key the
            NIXL decode side needs (:data:`_NIXL_REQUIRED`), or do not ask for
            a remote prefill (the prefill did not keep its blocks).
    """
    if not prefill_params:
        raise TransferError("the prefill returned no kv_transfer_params")
    missing = [k for k in _NIXL_REQUIRED if prefill_params.get(k) is None]
    if missing:
        raise TransferError(f"kv_transfer_params lack {missing}")
    if not prefill_params.get("do_remote_prefill"):
        raise TransferError("kv_transfer_params do not ask for a remote prefill")
    return dict(prefill_params)


def sweep_store(store_dir: str | os.PathLike, ttl_s: float = STORE_TTL_S, *, now: float | None = None) -> int:
    """Delete ExampleConnector prompt directories under ``store_dir`` last
    modified more than ``ttl_s`` seconds before ``now`` (default: the clock);
    returns how many. Never raises (a concurrent sweep may win a race)."""
    now = time.time() if now is None else now
    removed = 0
    with contextlib.suppress(FileNotFoundError):
        for entry in os.scandir(store_dir):
            with contextlib.suppress(OSError):
                if entry.is_dir(follow_symlinks=False) and now - entry.stat().st_mtime > ttl_s:
                    shutil.rmtree(entry.path)
                    removed += 1
    return removed


async def prefill(engine: VllmEngine, request: GenerateRequest) -> PrefillResult:
    """Run ``request`` for one token on a prefill worker's engine; its KV stays with the connector.

    Returns the sampled first token, vLLM's prefix-cache hit, and an
    :class:`EngineKvHandoff` (``kv_transfer_params`` of the output for NIXL).

    Raises:
        EngineError: the engine runs no KV connector, is not started, or vLLM
            failed or aborted the request.
    """
    spec = engine.kv_connector
    if spec is None:
        raise EngineError("this vllm engine runs no KV connector (start it as a prefill worker)")
    if spec.store_dir:
        sweep_store(spec.store_dir)
    one = dataclasses.replace(request, sampling=request.sampling.model_copy(update={"max_tokens": 1}),
                              kv_transfer_params=prefill_kv_transfer_params(spec))
    last: Any = None
    async for raw in engine.raw_outputs(one):
        last = raw
    if last is None or not last.outputs or not last.outputs[0].token_ids:
        raise EngineError(f"{request.request_id}: the prefill produced no token")
    completion = last.outputs[0]
    if str(completion.finish_reason).lower() == "abort":
        raise EngineError(f"{request.request_id}: aborted during its prefill")
    handoff = EngineKvHandoff(connector=spec.name, kv_transfer_params=last.kv_transfer_params,
                              num_tokens=len(request.prompt_token_ids))
    return PrefillResult(first_token_id=int(completion.token_ids[0]), num_prompt_tokens=len(request.prompt_token_ids),
                         num_cached_tokens=int(last.num_cached_tokens or 0), engine_kv=handoff)


def _first_token_ends(engine: VllmEngine, request: GenerateRequest, first: int) -> FinishReason | None:
    """The finish reason of a request whose only token is ``first``, or None if it goes on."""
    if request.sampling.max_tokens <= 1:
        return FinishReason.length
    tokenizer = engine.tokenizer
    if not request.sampling.ignore_eos and first in getattr(tokenizer, "eos_token_ids", ()):
        return FinishReason.stop
    return None


async def generate_from_kv(engine: VllmEngine, request: GenerateRequest,
                           handoff: KvHandoff) -> AsyncIterator[EngineOutput]:
    """Decode ``request`` on a decode worker's engine from the KV the prefill's connector holds.

    NixlConnector: the prompt with the prefill's ``kv_transfer_params``;
    vLLM's stream is the request's stream. ExampleConnector: the prompt plus
    ``handoff.first_token_id``, one token less; the prefill's token is
    yielded first. Either way the first output is yielded only after vLLM's
    first step, which loads the KV, and ``handoff.stats`` then says
    ``backend="vllm"`` and how many prompt blocks the decode engine did not
    compute (connector load plus its own prefix cache: vLLM reports them as
    one ``num_cached_tokens``).

    Raises:
        TransferError: before any output, when the handoff does not fit this
            engine (no connector, another connector, unusable NIXL params);
            the worker then prefills locally.
        EngineError: as :meth:`VllmEngine.generate`.
    """
    spec = engine.kv_connector
    desc = handoff.descriptor
    kv = desc.engine_kv if desc is not None else None
    if spec is None or kv is None:
        raise TransferError("no vLLM KV connector handoff for this engine")
    if kv.connector != spec.name:
        raise TransferError(f"the prefill used {kv.connector}, this engine runs {spec.name}")
    first = handoff.first_token_id
    ends = _first_token_ends(engine, request, first)
    if ends is not None:
        handoff.stats = TransferStats(backend="vllm")
        yield EngineOutput([first], ends)
        return
    if spec.name == "NixlConnector":
        decode = dataclasses.replace(request, kv_transfer_params=decode_kv_transfer_params(kv.kv_transfer_params))
        prepend: list[int] = []
    else:
        sampling = request.sampling.model_copy(update={"max_tokens": request.sampling.max_tokens - 1})
        decode = dataclasses.replace(request, prompt_token_ids=[*request.prompt_token_ids, first], sampling=sampling)
        prepend = [first]
    outputs = engine.generate(decode)
    try:
        head = await outputs.__anext__()
        handoff.stats = TransferStats(backend="vllm",
                                      num_blocks_pulled=head.num_cached_tokens // engine.block_size)
        if prepend:
            yield EngineOutput(prepend, None, head.num_cached_tokens)
            head = dataclasses.replace(head, num_cached_tokens=0)
        yield head
        if head.finish_reason is None:
            async for out in outputs:
                yield out
    finally:
        await outputs.aclose()
