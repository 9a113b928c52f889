"""Records of disaggregated serving: what travels in ``InferenceRequest.disaggregated_params``.

A remote-prefill request crosses two queues (data flows one way)::

    router ──[queue.prefill]──► prefill worker ──[queue.decode]──► decode worker ──► reply_to

On the first hop ``disaggregated_params`` holds a :class:`PrefillStage`
(where to send the request once its KV exists); on the second a
:class:`DecodeStage` (the prefill's first token, timings, and a
:class:`TransferDescriptor` saying where the decode worker pulls the KV
from). Only this metadata goes through Kafka; the KV bytes go over NIXL or
TCP (:mod:`kvflow.workers.kv.transfer`), or through the engine's own KV
connector (vLLM's, described by an :class:`EngineKvHandoff`).
:meth:`PrefillStage.to_params` /
:func:`parse_stage` convert to and from the plain dict the request carries.

:class:`KvTransferInfo` is echoed on the final response so the bridge can
count remote prefills and chart transfer size and latency.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, ValidationError

__all__ = [
    "TransferBackend",
    "KvRegion",
    "EngineKvHandoff",
    "TransferDescriptor",
    "PrefillStage",
    "DecodeStage",
    "DisaggStage",
    "KvTransferInfo",
    "parse_stage",
]

TransferBackend = Literal["nixl", "tcp", "simulated", "vllm", "none"]
"""How KV bytes move: NIXL (UCX underneath), kvflow's TCP fallback, a
simulated transfer (mocker: a sleep of the modelled duration), vLLM's own KV
connector (:class:`EngineKvHandoff`), or not at all (the decode worker
prefilled itself)."""


class KvRegion(BaseModel):
    """One registered memory region of the source: ``address`` (virtual
    address in the source process), ``num_bytes`` and ``device_id`` (GPU index,
    0 for host memory), as NIXL descriptors name them."""

    model_config = ConfigDict(frozen=True)
    address: int = Field(ge=0)
    num_bytes: int = Field(ge=0)
    device_id: int = Field(default=0, ge=0)


class EngineKvHandoff(BaseModel):
    """KV that the engine moves itself, through vLLM's KV connector API.

    ``connector`` is the vLLM connector class both workers run
    (``NixlConnector``: the decode engine reads the prefill engine's paged
    blocks over NIXL; ``ExampleConnector``: the prefill engine writes each
    layer's KV of the prompt's full blocks as files under a directory both
    workers share, and the decode engine reads them back).
    ``kv_transfer_params`` are the ``kv_transfer_params`` vLLM returned with
    the prefill's output (NixlConnector: ``remote_engine_id``,
    ``remote_host``/``remote_port`` of its side channel, ``remote_block_ids``,
    ``remote_request_id``, ``tp_size``, ...), handed unchanged to the decode
    request; None for connectors that find the KV by the prompt's tokens
    (ExampleConnector). ``num_tokens`` is the prompt length.
    """

    model_config = ConfigDict(frozen=True, extra="ignore")
    connector: str = Field(min_length=1)
    kv_transfer_params: dict[str, Any] | None = None
    num_tokens: int = Field(default=0, ge=0)


class TransferDescriptor(BaseModel):
    """Where and how a decode worker pulls one request's KV.

    The source buffer is ``num_blocks`` KV blocks of ``block_bytes`` bytes
    each, back to back (block ``i`` starts at byte ``i * block_bytes``), so
    a reader may pull any block range, e.g. only the blocks it does not
    already cache. Each block is a ``block_shape`` array of ``dtype``
    (hf: ``[layers, 2, kv_heads, block_size, head_dim]``); the last block is
    zero-padded past ``num_tokens``.

    Every descriptor offers TCP (``tcp_host``/``tcp_port``); a NIXL-capable
    source also fills the ``nixl_*`` fields: the agent name, its metadata
    (base64 of ``nixl_agent.get_agent_metadata()``), the memory type
    (``DRAM`` or ``VRAM``) and the regions. ``expires_ms`` (epoch ms) is when
    the source frees the buffer if no reader released it.

    Backend ``vllm``: kvflow moves nothing; ``engine_kv`` says how the
    decode engine's KV connector finds the prefill's KV.
    """

    model_config = ConfigDict(frozen=True, extra="ignore")
    transfer_id: str = Field(min_length=1)
    source_worker_id: str = ""
    backend: TransferBackend = "tcp"
    total_bytes: int = Field(default=0, ge=0)
    block_bytes: int = Field(default=0, ge=0)
    num_blocks: int = Field(default=0, ge=0)
    num_tokens: int = Field(default=0, ge=0)
    dtype: str = ""
    block_shape: list[int] = Field(default_factory=list)
    tcp_host: str | None = None
    tcp_port: int | None = None
    nixl_agent: str | None = None
    nixl_metadata_b64: str | None = None
    nixl_mem_type: Literal["DRAM", "VRAM"] = "DRAM"
    regions: list[KvRegion] = Field(default_factory=list)
    expires_ms: int = 0
    engine_kv: EngineKvHandoff | None = None


class PrefillStage(BaseModel):
    """First hop: the prefill worker computes the KV, then forwards the request
    to ``decode_queue_topic[decode_queue_partition]`` (worker ``decode_worker_id``)."""

    model_config = ConfigDict(frozen=True, extra="ignore")
    stage: Literal["prefill"] = "prefill"
    decode_worker_id: str
    decode_queue_topic: str
    decode_queue_partition: int = Field(ge=0)

    def to_params(self) -> dict[str, Any]:
        """The plain dict stored in ``InferenceRequest.disaggregated_params``."""
        return self.model_dump(mode="json", exclude_none=True)


class DecodeStage(BaseModel):
    """Second hop: the decode worker pulls the KV described by ``kv`` and decodes.

    ``first_token_id`` is the token the prefill sampled (the decode worker
    streams it as the first output). ``sampler_state_b64`` is the prefill's
    random generator state after that draw (seeded sampling continues the
    same stream; absent for greedy). ``num_cached_tokens`` is the prefill
    worker's prefix-cache hit. ``kv`` is None when the prefill worker could
    not expose its KV: the decode worker then prefills itself. Times are epoch ms.
    """

    model_config = ConfigDict(frozen=True, extra="ignore")
    stage: Literal["decode"] = "decode"
    prefill_worker_id: str
    first_token_id: int = Field(ge=0)
    num_prompt_tokens: int = Field(ge=0)
    num_cached_tokens: int = Field(default=0, ge=0)
    prefill_received_ms: int = 0
    prefill_started_ms: int = 0
    prefill_finished_ms: int = 0
    sampler_state_b64: str | None = None
    kv: TransferDescriptor | None = None

    def to_params(self) -> dict[str, Any]:
        """The plain dict stored in ``InferenceRequest.disaggregated_params``."""
        return self.model_dump(mode="json", exclude_none=True)


DisaggStage = Annotated[Union[PrefillStage, DecodeStage], Field(discriminator="stage")]
"""Either stage record, told apart by ``stage``."""

_STAGE_ADAPTER: TypeAdapter = TypeAdapter(DisaggStage)


def parse_stage(params: dict[str, Any] | None) -> PrefillStage | DecodeStage | None:
    """The stage record in a request's ``disaggregated_params``; None when
    ``params`` is None or has no ``stage`` key (aggregated serving).

    Raises:
        ValueError: ``stage`` is present but the record does not validate.
    """
    if not params or "stage" not in params:
        return None
    try:
        return _STAGE_ADAPTER.validate_python(params)
    except ValidationError as exc:
        raise ValueError(f"bad disaggregated_params: {exc.errors(include_url=False)[:3]}") from exc


class KvTransferInfo(BaseModel):
    """How a remote prefill went, echoed on :class:`~kvflow.schemas.FinalResponse`.

    ``num_bytes`` were pulled in ``transfer_ms`` (wall time of the pull on the
    decode worker, or the simulated duration); ``num_blocks_reused`` blocks
    came from the decode worker's own prefix cache instead. ``recomputed``
    is true when the pull failed and the decode worker prefilled the prompt
    itself. Times are epoch ms.
    """

    model_config = ConfigDict(frozen=True)
    backend: TransferBackend = "none"
    prefill_worker_id: str = ""
    num_bytes: int = 0
    transfer_ms: float = 0.0
    num_blocks_pulled: int = 0
    num_blocks_reused: int = 0
    prefill_started_ms: int = 0
    prefill_finished_ms: int = 0
    recomputed: bool = False
