"""The mocker's engine core: a simulated continuous-batching engine without weights.

:class:`MockerCore` is synchronous, deterministic and has no clock. Each
:meth:`MockerCore.step` schedules one engine iteration, advances every
request's state, and returns how long that iteration *would* take on a GPU
(``StepResult.duration_ms``). The live :mod:`kvflow.workers.engines.mocker`
engine sleeps that long on the wall clock; the offline simulator advances a
simulated clock by it. Both therefore see the same tokens, KV events and
timings.

Scheduling follows vLLM v1 as NVIDIA Dynamo's mocker models it
(ai-dynamo/dynamo ``lib/mocker/src/scheduler/vllm/core.rs``,
``execute_pass_internal``):

1. Running requests, oldest first, each get their next tokens within the
   token budget ``max_num_batched_tokens``: one token for a request in
   decode, the next prompt chunk for one still in prefill. If the KV pool
   cannot hold them, the *newest* running request is preempted (its blocks
   are released, it goes back to the front of the waiting queue and will
   recompute its prompt and generated tokens, mostly from the prefix cache);
   this is vLLM's recompute preemption and Dynamo's default ``Lifo`` mode.
2. If nothing was preempted, waiting requests are admitted first-come
   first-served while ``max_num_seqs``, the token budget and the KV pool
   allow. Prompt blocks already in the prefix cache are reused, not
   recomputed (at least one prompt token is always computed, as in vLLM).
   With chunked prefill a prompt larger than the remaining budget is split
   across steps; without it the prompt waits for a step with room (or runs
   alone, over budget, when nothing else is scheduled).
3. Every request whose tokens are all computed samples one token. The first
   output token of a request therefore comes at the end of the step that
   completes its prefill.

Speculative decoding (``spec_num_draft_tokens`` k > 0): a request in decode
also proposes up to k draft tokens each step (fewer near ``max_tokens``),
which the step verifies with its own token in one pass. KV slots are
allocated for the token and all k drafts (over-allocation; the drafts count
against the token budget too). Draft ``j`` is accepted with probability
``spec_acceptance_rate`` α if drafts ``0..j-1`` were (i.i.d. acceptance, the
model of Leviathan, Kalman and Matias, "Fast Inference from Transformers via
Speculative Decoding", ICML 2023), drawn deterministically from the
request's seed. The step emits the ``a`` accepted drafts plus one token of
the target model (``a + 1`` tokens in one output); only the fed token and
the accepted drafts become computed KV, so only their full blocks are
committed and published as KV events, and the slots of rejected drafts stay
with the request, unused, for its next tokens. A step where some request
drafted costs ``decode_ms(u) · (1 + k · spec_draft_cost_ratio)``: the draft
model's k passes at that fraction of a target pass each, and the
verification of k + 1 tokens at the cost of one memory-bound decode pass
(the paper's cost model; ``spec_draft_cost_ratio`` 0 models prompt lookup,
which runs no model). Expected tokens per pass ``(1 − α^(k+1)) / (1 − α)``.

Step duration (Dynamo: ``prefill_time`` then ``decode_start_ms = now +
prefill_time``, ``end_ms = decode_start_ms + decode_time``, so the two *add*)::

    duration_ms = (prefill_ms(t) + decode_ms(u)) / speedup_ratio
    prefill_ms(t) = a·t² + b·t + c   if t > 0 else 0     (t = uncached prefill tokens this step)
    decode_ms(u)  = max(1, a·u² + b·u + c) if any token is sampled this step else 0
                    (u = used / total KV blocks after this step's allocations, capped at 1)

Coefficients are Dynamo's polynomial perf model
(``lib/mocker/src/common/perf_model.rs``: ``polynomial_prefill_time`` and
``polynomial_decode_time``, decode floored at 1 ms).

Disaggregated serving: :func:`kv_transfer_time_ms` models moving a prompt's
KV from a prefill worker (``latency + tokens · bytes_per_token /
bandwidth``), and ``add_request(..., kv_imported=True)`` admits a request
whose prompt KV arrived that way: its prompt costs no prefill time, its
blocks are allocated (reusing cached ones) and committed as if computed, and
it continues from output token 1 (token 0 is the prefill worker's, which is
the same id because token ids depend only on the request id and ``seed``).
A prefill-only request is an ordinary request with ``max_tokens = 1``.

KV tiers (``kv_host_bytes`` / ``kv_disk_bytes`` > 0): blocks evicted from
the pool (G1) go to a :class:`~kvflow.workers.kv.tiers.TieredStore` (G2
host memory, G3 disk, no contents). At admission, prompt blocks past the
pool's prefix hit that G2/G3 hold are onboarded instead of recomputed: they
count as cached tokens, are committed to the pool at once, and the step
takes :func:`kv_onboard_time_ms` longer (loads are synchronous, before the
forward pass). Offloads and disk writes are asynchronous copies and cost no
step time. The store's reuse frequencies decay on the caller's clock
(``step(now_ms=...)``; default: the sum of step durations so far).

The mocker has no end-of-sequence token: every request produces exactly
``max_tokens`` tokens and finishes with ``length``; ``ignore_eos`` and the
other sampling settings are ignored. Output ids are pseudo-random but
deterministic: token ``i`` of a request is
``xxh3_64(u64le(request_seed) ‖ u64le(i)) mod vocab_size`` with
``request_seed = xxh3_64(f"{config.seed}:{request_id}")``; a migrated
request (``resumed_tokens`` = k) starts at ``i = k``.
"""

from __future__ import annotations

import struct
from collections import deque
from dataclasses import dataclass

import xxhash

from kvflow.schemas import FinishReason, KvEvent, KvTier
from kvflow.schemas.block_hash import (
    block_seed,
    compute_block_hashes,
    local_block_hash,
    next_sequence_hash,
    tokens_to_bytes,
)
from kvflow.workers.engines.base import EngineError, EngineOutput, GenerateRequest, KvStats
from kvflow.workers.kv.blocks import BlockPool, NoFreeBlocks
from kvflow.workers.kv.tiers import OffloadedBlock, TierConfig, TieredStore

__all__ = ["MockerConfig", "StepResult", "MockerCore", "prefill_time_ms", "decode_time_ms", "kv_transfer_time_ms",
           "kv_onboard_time_ms", "min_step_ms"]

_xxh3 = xxhash.xxh3_64_intdigest
_pack_pair = struct.Struct("<QQ").pack
_SPEC_SALT = 0x5BEC_DEC0_DE5B_EC00  # separates draft acceptance draws from output token draws


@dataclass
class MockerConfig:
    """Settings of the simulated engine.

    Defaults are Dynamo mocker's ``MockEngineArgs`` defaults
    (ai-dynamo/dynamo ``lib/mocker``: ``num_gpu_blocks`` 16384, ``block_size``
    64, ``max_num_seqs`` 256, ``max_num_batched_tokens`` 8192, prefix caching
    and chunked prefill on, ``speedup_ratio`` 1.0) and its polynomial perf
    model coefficients (``perf_model.rs``).

    Attributes:
        block_size: tokens per KV block. Defaults to ``64``.
        num_kv_blocks: KV blocks in the pool. Defaults to ``16384``.
        max_num_seqs: most requests running at once. Defaults to ``256``.
        max_num_batched_tokens: token budget of one step (prefill chunks plus
            one token per decoding request). Defaults to ``8192``.
        enable_prefix_caching: reuse cached prompt blocks and publish KV
            events. Defaults to ``True``.
        enable_chunked_prefill: split prompts across steps. Defaults to ``True``.
        speedup_ratio: simulated durations are divided by this (> 0).
            Defaults to ``1.0``.
        seed: seeds the output token ids. Defaults to ``0``.
        prefill_coeffs: ``(a, b, c)`` of prefill ms = a·t² + b·t + c, t = new
            tokens in the step. Defaults to Dynamo's
            ``(4.209989e-07, 1.518344e-02, 16.50142)``.
        decode_coeffs: ``(a, b, c)`` of decode ms = a·u² + b·u + c, u = KV
            block usage in [0, 1]. Defaults to ``(-25.74, 54.01, 5.74)``.
        vocab_size: output ids are drawn from ``[0, vocab_size)``. Defaults
            to ``49152`` (the SmolLM2 vocabulary).
        kv_bytes_per_token: KV bytes of one token, for simulated transfers.
            Defaults to ``131072`` (Llama-3.1-8B in bf16: 32 layers × 8 KV
            heads × 128 head dim × 2 (K and V) × 2 bytes).
        kv_transfer_bytes_per_s: bandwidth of simulated KV transfers.
            Defaults to ``50e9`` (one 400 Gb/s RDMA NIC at line rate).
        kv_transfer_latency_ms: fixed cost of one simulated transfer
            (descriptor exchange, first byte). Defaults to ``1.0`` (kvflow's
            choice).
        kv_host_bytes: G2 (host memory) budget for blocks evicted from the
            pool, bytes; 0 = no host tier. Defaults to ``0``.
        kv_disk_bytes: G3 (disk) budget, bytes; 0 = no disk tier. Defaults to ``0``.
        kv_host_bytes_per_s: host -> device copy bandwidth. Defaults to
            ``25e9``: PCIe 4.0 x16 carries 31.5 GB/s per direction (16 GT/s
            x 16 lanes, 128b/130b coding; PCI-SIG PCIe 4.0 base
            specification); kvflow assumes pinned-memory copies reach about
            80% of that line rate.
        kv_host_latency_ms: fixed cost of one host -> device load (copy
            set-up and synchronisation). Defaults to ``0.05`` (kvflow's choice).
        kv_disk_bytes_per_s: disk -> host read bandwidth. Defaults to
            ``7e9``: one PCIe 4.0 NVMe SSD's sequential read (e.g. Samsung
            990 PRO data sheet: 7,450 MB/s).
        kv_disk_latency_ms: fixed cost of one disk read. Defaults to ``0.1``
            (kvflow's choice: the order of a NAND flash page read).
        kv_tier_half_life_s: half-life of a block's reuse frequency, which
            decides G2 -> G3 demotion (:class:`~kvflow.workers.kv.tiers.TierConfig`).
            Defaults to ``600``.
        spec_num_draft_tokens: draft tokens proposed per request per decode
            step (speculative decoding, module docstring); 0 = off. Defaults to ``0``.
        spec_acceptance_rate: probability α that a draft token is accepted
            (given the ones before it were), in [0, 1]. Defaults to ``0.7``
            (kvflow's choice, within the 0.6–0.9 the paper above reports for
            its draft/target pairs).
        spec_draft_cost_ratio: one draft pass's cost as a fraction of a
            target decode pass (the paper's ``c``; 0 for prompt lookup).
            Defaults to ``0.0``.

    Raises:
        ValueError: a size is < 1, ``speedup_ratio`` or the transfer
            bandwidth <= 0, the transfer latency < 0, or a speculative
            decoding setting out of range.
    """

    block_size: int = 64
    num_kv_blocks: int = 16384
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    enable_prefix_caching: bool = True
    enable_chunked_prefill: bool = True
    speedup_ratio: float = 1.0
    seed: int = 0
    prefill_coeffs: tuple = (4.209989e-07, 1.518344e-02, 16.50142)
    decode_coeffs: tuple = (-25.74, 54.01, 5.74)
    vocab_size: int = 49152
    kv_bytes_per_token: int = 131072
    kv_transfer_bytes_per_s: float = 50e9
    kv_transfer_latency_ms: float = 1.0
    kv_host_bytes: int = 0
    kv_disk_bytes: int = 0
    kv_host_bytes_per_s: float = 25e9
    kv_host_latency_ms: float = 0.05
    kv_disk_bytes_per_s: float = 7e9
    kv_disk_latency_ms: float = 0.1
    kv_tier_half_life_s: float = 600.0
    spec_num_draft_tokens: int = 0
    spec_acceptance_rate: float = 0.7
    spec_draft_cost_ratio: float = 0.0

    def __post_init__(self) -> None:
        for name in ("block_size", "num_kv_blocks", "max_num_seqs", "max_num_batched_tokens", "vocab_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if not self.speedup_ratio > 0:
            raise ValueError(f"speedup_ratio must be > 0, got {self.speedup_ratio}")
        if self.kv_bytes_per_token < 1:
            raise ValueError(f"kv_bytes_per_token must be >= 1, got {self.kv_bytes_per_token}")
        if not self.kv_transfer_bytes_per_s > 0 or self.kv_transfer_latency_ms < 0:
            raise ValueError("kv_transfer_bytes_per_s must be > 0 and kv_transfer_latency_ms >= 0")
        if not self.kv_host_bytes_per_s > 0 or not self.kv_disk_bytes_per_s > 0:
            raise ValueError("kv_host_bytes_per_s and kv_disk_bytes_per_s must be > 0")
        if min(self.kv_host_latency_ms, self.kv_disk_latency_ms) < 0:
            raise ValueError("kv_host_latency_ms and kv_disk_latency_ms must be >= 0")
        TierConfig(self.kv_host_bytes, self.kv_disk_bytes, self.kv_tier_half_life_s)  # validates the tier budgets
        if len(self.prefill_coeffs) != 3 or len(self.decode_coeffs) != 3:
            raise ValueError("prefill_coeffs and decode_coeffs take three coefficients (a, b, c)")
        if not 0 <= self.spec_num_draft_tokens <= 255 or not 0.0 <= self.spec_acceptance_rate <= 1.0 \
                or self.spec_draft_cost_ratio < 0:
            raise ValueError("need spec_num_draft_tokens in [0, 255], spec_acceptance_rate in [0, 1] and "
                             "spec_draft_cost_ratio >= 0")


def prefill_time_ms(config: MockerConfig, num_tokens: int) -> float:
    """Simulated prefill time (ms, before speedup) of ``num_tokens`` new tokens in one step.

    ``a·t² + b·t + c`` with ``config.prefill_coeffs``, floored at 0; 0 when
    no tokens are prefilled (Dynamo ``polynomial_prefill_time``).
    """
    if num_tokens <= 0:
        return 0.0
    a, b, c = config.prefill_coeffs
    return max(0.0, a * num_tokens * num_tokens + b * num_tokens + c)


def decode_time_ms(config: MockerConfig, usage: float) -> float:
    """Simulated decode time (ms, before speedup) at KV usage ``usage`` (fraction, capped at 1).

    ``max(1, a·u² + b·u + c)`` with ``config.decode_coeffs`` (Dynamo
    ``polynomial_decode_time``).
    """
    u = min(max(usage, 0.0), 1.0)
    a, b, c = config.decode_coeffs
    return max(1.0, a * u * u + b * u + c)


def _least_on(coeffs: tuple, lo: float, hi: float) -> float:
    """Least value of ``a·x² + b·x + c`` for ``x`` in ``[lo, hi]`` (``hi`` may be ``inf``)."""
    a, b, c = coeffs
    points = [lo] + ([hi] if hi != float("inf") else [])
    if a > 0 and lo < -b / (2 * a) < hi:
        points.append(-b / (2 * a))
    if hi == float("inf") and (a < 0 or (a == 0 and b < 0)):
        return float("-inf")
    return min(a * x * x + b * x + c for x in points)


def min_step_ms(config: MockerConfig) -> float:
    """Least simulated duration (ms, after speedup) of a step that computes anything.

    A step that samples a token costs at least the least of
    :func:`decode_time_ms` over KV usage in [0, 1]; one that only prefills
    costs at least the least of :func:`prefill_time_ms` over one token or
    more. The smaller of the two, 0 when the coefficients allow a free step.
    The live engine uses it to bound when a step it has not computed yet can
    end (:meth:`MockerCore.quiet_steps`).
    """
    decode = max(1.0, _least_on(config.decode_coeffs, 0.0, 1.0))
    prefill = max(0.0, _least_on(config.prefill_coeffs, 1.0, float("inf")))
    return min(decode, prefill) / config.speedup_ratio


def kv_transfer_time_ms(config: MockerConfig, num_tokens: int) -> float:
    """Simulated time (ms, before speedup) to move the KV of ``num_tokens`` tokens between workers.

    ``kv_transfer_latency_ms + num_tokens · kv_bytes_per_token / kv_transfer_bytes_per_s``;
    0 when nothing moves.
    """
    if num_tokens <= 0:
        return 0.0
    seconds = num_tokens * config.kv_bytes_per_token / config.kv_transfer_bytes_per_s
    return config.kv_transfer_latency_ms + seconds * 1000


def kv_onboard_time_ms(config: MockerConfig, host_blocks: int, disk_blocks: int) -> float:
    """Simulated time (ms, before speedup) to load blocks from G2 and G3 into the pool.

    With ``B = block_size · kv_bytes_per_token`` bytes a block::

        host: kv_host_latency_ms + host_blocks · B / kv_host_bytes_per_s
        disk: kv_disk_latency_ms + disk_blocks · B / kv_disk_bytes_per_s   (read into host memory)
              + kv_host_latency_ms + disk_blocks · B / kv_host_bytes_per_s (then copied to the device)

    summed (one request's loads run one after the other); each part is 0
    when its count is 0.
    """
    block_bytes = config.block_size * config.kv_bytes_per_token
    ms = 0.0
    to_device = host_blocks + disk_blocks
    if to_device > 0:
        ms += config.kv_host_latency_ms + to_device * block_bytes / config.kv_host_bytes_per_s * 1000
    if disk_blocks > 0:
        ms += config.kv_disk_latency_ms + disk_blocks * block_bytes / config.kv_disk_bytes_per_s * 1000
    return ms


@dataclass
class StepResult:
    """What one engine iteration did.

    Attributes:
        duration_ms: simulated wall time of the step, already divided by
            ``speedup_ratio``; 0 when nothing was scheduled.
        outputs: ``request_id -> EngineOutput`` for every request that
            sampled a token this step (one token each).
        kv_events: KV cache events of the step, in order.
        prefill_tokens: prompt (or recompute) tokens computed this step,
            excluding prefix-cache hits — the ``t`` of the prefill formula.
        decode_tokens: tokens computed by requests in decode (one each).
        onboard_ms: part of ``duration_ms`` spent loading blocks from G2/G3
            (already divided by ``speedup_ratio``).
    """

    duration_ms: float
    outputs: dict[str, EngineOutput]
    kv_events: list[KvEvent]
    prefill_tokens: int
    decode_tokens: int
    onboard_ms: float = 0.0


class _Seq:
    """Working state of one request inside the core."""

    __slots__ = (
        "rid", "tokens", "prompt_len", "max_tokens", "num_generated", "num_computed", "num_cached",
        "hashes", "hash_seed", "lora_name", "mm_hashes", "token_seed", "token_offset", "cap", "committed", "running",
        "imported", "num_host_cached", "num_disk_cached", "draft",
    )

    def __init__(self, request: GenerateRequest, config: MockerConfig) -> None:
        self.rid = request.request_id
        self.tokens = list(request.prompt_token_ids)  # prompt, then generated ids
        self.prompt_len = len(self.tokens)
        self.max_tokens = request.sampling.max_tokens
        self.num_generated = 0
        self.num_computed = 0  # tokens whose KV is computed
        self.num_cached = 0  # prompt tokens served from the prefix cache at admission
        self.lora_name = request.lora_name
        self.mm_hashes = request.mm_hashes(config.block_size)  # media content hashes of the blocks they cover
        self.hash_seed = block_seed(request.lora_name)
        self.hashes = (
            compute_block_hashes(self.tokens, config.block_size, request.lora_name, self.mm_hashes)
            if config.enable_prefix_caching
            else []
        )
        self.token_seed = _xxh3(f"{config.seed}:{self.rid}".encode())
        self.token_offset = request.resumed_tokens  # output ids already produced elsewhere (migration)
        self.cap = 0  # tokens the allocated blocks can hold
        self.committed = 0  # blocks committed to the pool
        self.running = False
        self.imported = False  # prompt KV came from a remote prefill (see MockerCore.add_request)
        self.num_host_cached = 0  # of num_cached: prompt tokens onboarded from G2
        self.num_disk_cached = 0  # ... and from G3
        self.draft = 0  # draft tokens scheduled this step (speculative decoding)

    def hash_last_block(self, block_size: int) -> None:
        """Append the sequence hash of the block just completed by a generated token
        (a block the prompt's media reach keeps their content hashes)."""
        index = len(self.tokens) // block_size - 1
        block = tokens_to_bytes(self.tokens[index * block_size:])
        mm = [h for b, h in self.mm_hashes or () if b == index]
        local = local_block_hash(block, self.hash_seed, mm) if mm else _xxh3(block, self.hash_seed)
        self.hashes.append(next_sequence_hash(self.hashes[-1] if self.hashes else None, local))

    def import_first_token(self, config: MockerConfig) -> None:
        """Append output token 0 (what the prefill worker sampled) and extend the block hashes."""
        token = _xxh3(_pack_pair(self.token_seed, self.token_offset)) % config.vocab_size
        self.tokens.append(token)
        self.num_generated = 1
        self.imported = True
        if config.enable_prefix_caching:
            self.hashes = compute_block_hashes(self.tokens, config.block_size, self.lora_name, self.mm_hashes)


class MockerCore:
    """Deterministic, clock-free simulated engine core (see the module docstring).

    Args:
        config: engine settings.
        worker_id: name of the worker this core simulates (informational).

    Not thread-safe; drive it from one task or loop.
    """

    def __init__(self, config: MockerConfig, worker_id: str = "mocker") -> None:
        self.config = config
        self.worker_id = worker_id
        tiers = TierConfig(config.kv_host_bytes, config.kv_disk_bytes, config.kv_tier_half_life_s)
        self.tiers: TieredStore | None = (TieredStore(tiers) if tiers.enabled and config.enable_prefix_caching
                                          else None)
        self._block_bytes = config.block_size * config.kv_bytes_per_token
        self.pool = BlockPool(config.num_kv_blocks, config.block_size, config.enable_prefix_caching,
                              on_evict=self._offload if self.tiers is not None else None)
        self._waiting: deque[_Seq] = deque()
        self._running: list[_Seq] = []  # admission order, oldest first
        self._seqs: dict[str, _Seq] = {}
        self.num_preemptions = 0
        self.prefill_tokens_total = 0
        self.decode_tokens_total = 0
        self.now_s = 0.0  # the clock reuse frequencies decay on (see step)
        self._onboard_ms = 0.0  # of the step being scheduled
        # Per request, counted at its first output token: prompt tokens, and those served per tier.
        self.first_token_prompt_tokens = 0
        self.cached_tokens_by_tier = {KvTier.device.value: 0, KvTier.host.value: 0, KvTier.disk.value: 0}
        # Recompute accounting (set by the offline simulator, shared by every worker): hashes of every
        # prompt block computed so far; a prefill that computes one of them again adds its tokens to
        # recomputed_prefill_tokens.
        self.computed_blocks: set[int] | None = None
        self.recomputed_prefill_tokens = 0
        # Speculative decoding: draft tokens proposed and accepted, and the verification passes.
        self.spec_draft_tokens = 0
        self.spec_accepted_tokens = 0
        self.spec_verify_steps = 0
        self._drafted = False  # some request drafted in the step being scheduled

    def _offload(self, block_hash: int, parent_hash: int | None) -> None:
        """The pool evicted a cached block: hand it to G2 (or the disk filter)."""
        self.tiers.offload([OffloadedBlock(block_hash, parent_hash, None, self._block_bytes)], self.now_s)

    # ---- requests ------------------------------------------------------

    def add_request(self, request: GenerateRequest, *, kv_imported: bool = False) -> None:
        """Queue ``request`` (FCFS) for the next :meth:`step`.

        With ``kv_imported`` the prompt's KV comes from a remote prefill
        (disaggregated decode): output token 0 counts as already produced
        and the prompt is admitted without prefill work; the first output of
        :meth:`step` for it is token 1. ``max_tokens`` must then be >= 2.

        Raises:
            EngineError: empty prompt, duplicate in-flight ``request_id``, or
                prompt + output larger than the whole KV pool.
        """
        if not request.prompt_token_ids:
            raise EngineError(f"request {request.request_id}: empty prompt")
        if request.request_id in self._seqs:
            raise EngineError(f"request {request.request_id} is already in flight")
        # KV slots held at the last step: the final sampled token is never fed back.
        footprint = self.pool.blocks_for_tokens(len(request.prompt_token_ids) + request.sampling.max_tokens - 1)
        if footprint > self.config.num_kv_blocks:
            raise EngineError(
                f"request {request.request_id} needs {footprint} KV blocks, the pool has {self.config.num_kv_blocks}"
            )
        if kv_imported and request.sampling.max_tokens < 2:
            raise EngineError(f"request {request.request_id}: an imported-KV request needs max_tokens >= 2")
        try:
            seq = _Seq(request, self.config)
        except ValueError as exc:
            raise EngineError(f"request {request.request_id}: {exc}") from exc
        if kv_imported:
            seq.import_first_token(self.config)
        self._seqs[seq.rid] = seq
        self._waiting.append(seq)

    def abort(self, request_id: str) -> None:
        """Drop ``request_id`` wherever it is and release its blocks (no-op if unknown)."""
        seq = self._seqs.pop(request_id, None)
        if seq is None:
            return
        if seq.running:
            self._running.remove(seq)
        else:
            self._waiting.remove(seq)
        self.pool.free(seq.rid)

    def cached_prompt_tokens(self, request: GenerateRequest) -> int:
        """Prompt tokens of ``request`` whose blocks this core's prefix cache holds now
        (full blocks only; no side effects). A disaggregated decode pulls only the rest."""
        if not self.config.enable_prefix_caching:
            return 0
        hashes = compute_block_hashes(list(request.prompt_token_ids), self.config.block_size, request.lora_name,
                                      request.mm_hashes(self.config.block_size))
        return self.pool.lookup(hashes) * self.config.block_size

    def has_work(self) -> bool:
        """Whether any request is waiting or running."""
        return bool(self._seqs)

    def quiet_steps(self) -> int:
        """How many of the next steps certainly emit no first token and finish
        no request, if no request is added or aborted meanwhile (0: the next
        step may).

        A lower bound from each request's state: a prompt (or a preempted
        request's recompute) needs at least ``ceil(left / max_num_batched_tokens)``
        steps before it samples; a request in decode samples at most
        ``1 + spec_num_draft_tokens`` tokens a step, so it finishes no sooner
        than ``ceil((max_tokens - generated) / (1 + k))`` steps from now. A
        waiting request may be admitted with a short uncached remainder and
        sample in the next step, so any waiting request makes it 0.
        Preemption only delays a request, so it cannot break the bound.
        O(running requests).
        """
        if self._waiting:
            return 0
        budget = self.config.max_num_batched_tokens
        per_step = 1 + self.config.spec_num_draft_tokens
        quiet = None
        for seq in self._running:
            left = len(seq.tokens) - seq.num_computed
            to_finish = seq.max_tokens - seq.num_generated
            if seq.num_generated == 0 or left > 1:  # a prompt or a recompute: no token until it is computed
                until_token = -(-left // budget)
                steps = until_token if seq.num_generated == 0 else until_token + -(-(to_finish - 1) // per_step)
            else:
                steps = -(-to_finish // per_step)
            if quiet is None or steps - 1 < quiet:
                quiet = max(0, steps - 1)
        return quiet if quiet is not None else 0

    # ---- the step --------------------------------------------------------

    def step(self, now_ms: float | None = None) -> StepResult:
        """Run one iteration: schedule, compute, sample; see the module docstring.

        Args:
            now_ms: the caller's clock (ms), used only to decay the KV tiers'
                reuse frequencies; None advances an internal clock by each
                step's duration instead.

        Returns:
            The step's simulated duration, outputs, KV events and token counts.
        """
        if now_ms is not None:
            self.now_s = now_ms / 1000.0
        self._onboard_ms = 0.0
        self._drafted = False
        budget = self.config.max_num_batched_tokens
        scheduled: list[tuple[_Seq, int]] = []
        budget, preempted = self._schedule_running(scheduled, budget)
        if not preempted:  # vLLM admits nothing in a step that had to preempt
            self._admit_waiting(scheduled, budget)
        usage = self.pool.num_used_blocks / self.config.num_kv_blocks
        outputs, prefill_tokens, decode_tokens = self._execute(scheduled)

        cfg = self.config
        duration = prefill_time_ms(cfg, prefill_tokens) + self._onboard_ms
        if outputs:
            decode_ms = decode_time_ms(cfg, usage)
            if self._drafted:  # the draft model's passes (Leviathan et al.: 1 + k·c target passes)
                decode_ms *= 1.0 + cfg.spec_num_draft_tokens * cfg.spec_draft_cost_ratio
            duration += decode_ms
        self.prefill_tokens_total += prefill_tokens
        self.decode_tokens_total += decode_tokens
        events = self.pool.take_events()
        if self.tiers is not None:
            events += self.tiers.take_events()
            self.tiers.stats.onboard_ms += self._onboard_ms / cfg.speedup_ratio
        if now_ms is None:
            self.now_s += duration / cfg.speedup_ratio / 1000.0
        return StepResult(
            duration_ms=duration / cfg.speedup_ratio,
            outputs=outputs,
            kv_events=events,
            prefill_tokens=prefill_tokens,
            decode_tokens=decode_tokens,
            onboard_ms=self._onboard_ms / cfg.speedup_ratio,
        )

    def _schedule_running(self, scheduled: list[tuple[_Seq, int]], budget: int) -> tuple[int, bool]:
        """Give running requests their next tokens; preempt the newest on KV shortage."""
        running, pool, bs = self._running, self.pool, self.config.block_size
        k = self.config.spec_num_draft_tokens
        preempted = False
        i = 0
        while i < len(running) and budget > 0:
            seq = running[i]
            n = min(len(seq.tokens) - seq.num_computed, budget)
            seq.draft = 0
            if k and n == 1 and seq.num_generated:  # in decode: propose drafts, never past max_tokens
                seq.draft = max(0, min(k, seq.max_tokens - seq.num_generated - 1, budget - 1))
            target = seq.num_computed + n + seq.draft  # KV slots for the drafts too
            if target > seq.cap:
                while True:
                    try:
                        pool.allocate(seq.rid, target)
                        break
                    except NoFreeBlocks:
                        victim = running.pop()  # newest; never one already scheduled (those are older)
                        self._preempt(victim)
                        preempted = True
                        if victim is seq:
                            break
                if not seq.running:
                    continue  # seq itself was preempted; it was the last one
                seq.cap = pool.num_seq_blocks(seq.rid) * bs
            scheduled.append((seq, n))
            budget -= n + seq.draft
            i += 1
        return budget, preempted

    def _admit_waiting(self, scheduled: list[tuple[_Seq, int]], budget: int) -> None:
        """Admit waiting requests FCFS while seats, budget and KV blocks allow."""
        cfg, pool, waiting, running = self.config, self.pool, self._waiting, self._running
        bs = cfg.block_size
        while waiting and len(running) < cfg.max_num_seqs and budget > 0:
            seq = waiting[0]
            total = len(seq.tokens)
            # Leave at least one token to compute, as vLLM does, so a full hit still samples.
            hit_hashes = seq.hashes[: (total - 1) // bs] if cfg.enable_prefix_caching else ()
            hits = pool.lookup(hit_hashes)
            tiers = self.tiers
            lower = tiers.lookup(hit_hashes[hits:]) if tiers is not None and not seq.imported else ()
            cached_tokens = (hits + len(lower)) * bs
            n = total - cached_tokens
            if seq.imported:  # prompt KV arrived from a remote prefill: only the decode token is work
                cached_tokens, n = total - 1, 1
            if n > budget:
                if cfg.enable_chunked_prefill:
                    n = budget
                elif scheduled:
                    break  # waits for a step with room
                # else: nothing else runs this step, so it runs alone over budget
            try:
                pool.allocate(seq.rid, cached_tokens + n, hit_hashes[:hits])
            except NoFreeBlocks:
                break
            committed, on_host, on_disk = hits, 0, 0
            if tiers is not None and not seq.imported:
                tiers.stats.lookup_blocks += len(hit_hashes)
                tiers.stats.device_hit_blocks += hits
                tiers.record_hits(hit_hashes[:hits], self.now_s)
            if lower:
                got = tiers.onboard(hit_hashes[hits:hits + len(lower)], self.now_s)
                on_host = sum(1 for o in got if o.tier is KvTier.host)
                on_disk = len(got) - on_host
                self._onboard_ms += kv_onboard_time_ms(cfg, on_host, on_disk)
                committed = hits + len(got)
                if got:
                    pool.commit(seq.rid, seq.hashes[:committed], seq.lora_name)
                if len(got) < len(lower):  # pushed out of G2 by this allocation: compute the rest
                    cached_tokens = committed * bs
                    cap = pool.num_seq_blocks(seq.rid) * bs
                    n = min(total, cap) - cached_tokens
                    if cfg.enable_chunked_prefill:
                        n = min(n, budget)
            waiting.popleft()
            running.append(seq)
            seq.running = True
            seq.num_computed = cached_tokens
            seq.committed = committed
            seq.cap = pool.num_seq_blocks(seq.rid) * bs
            if seq.num_generated == 0:
                seq.num_cached = cached_tokens
                seq.num_host_cached, seq.num_disk_cached = on_host * bs, on_disk * bs
            scheduled.append((seq, n))
            budget -= n

    def _preempt(self, seq: _Seq) -> None:
        """Send a running request back to the front of the queue, releasing its blocks."""
        self.pool.free(seq.rid)
        seq.running = False
        seq.num_computed = 0
        seq.cap = 0
        seq.committed = 0
        seq.imported = False  # the transferred KV is gone: recompute like any preempted request
        seq.draft = 0
        self._waiting.appendleft(seq)
        self.num_preemptions += 1

    def _execute(self, scheduled: list[tuple[_Seq, int]]) -> tuple[dict[str, EngineOutput], int, int]:
        """Advance scheduled requests: commit full blocks, sample tokens, finish requests."""
        cfg, pool = self.config, self.pool
        bs, vocab, caching = cfg.block_size, cfg.vocab_size, cfg.enable_prefix_caching
        outputs: dict[str, EngineOutput] = {}
        prefill_tokens = decode_tokens = 0
        finished = False
        for seq, n in scheduled:
            tokens = seq.tokens
            if seq.draft and seq.running:
                decode_tokens += 1 + seq.draft
                if self._execute_spec(seq, outputs):
                    finished = True
                continue
            if n == 1 and seq.num_generated and seq.num_computed == len(tokens) - 1:
                decode_tokens += 1
            else:
                prefill_tokens += n
            seq.num_computed += n
            if caching and seq.num_computed // bs > seq.committed:
                if self.computed_blocks is not None and not seq.imported:
                    self._count_recomputed(seq.hashes[seq.committed:min(seq.num_computed, seq.prompt_len) // bs])
                seq.committed = seq.num_computed // bs
                pool.commit(seq.rid, seq.hashes[: seq.committed], seq.lora_name)
            if seq.num_computed < len(tokens):
                continue  # prefill chunk: no token yet
            index = seq.num_generated
            token = _xxh3(_pack_pair(seq.token_seed, seq.token_offset + index)) % vocab
            tokens.append(token)
            seq.num_generated = index + 1
            if caching and len(tokens) % bs == 0:
                seq.hash_last_block(bs)
            cached = seq.num_cached if index == 0 else 0
            if index == 0:
                self._count_first_token(seq)
            if seq.num_generated >= seq.max_tokens:
                outputs[seq.rid] = EngineOutput([token], FinishReason.length, cached)
                self._finish(seq)
                finished = True
            else:
                outputs[seq.rid] = EngineOutput([token], None, cached)
        if finished:
            self._running = [s for s in self._running if s.running]
        return outputs, prefill_tokens, decode_tokens

    def _execute_spec(self, seq: _Seq, outputs: dict[str, EngineOutput]) -> bool:
        """Verify one request's drafts (module docstring): emit the accepted drafts and
        the target's token, compute the KV of the fed token and the accepted drafts,
        commit their full blocks. Returns whether the request finished."""
        cfg, d = self.config, seq.draft
        seq.draft = 0
        self._drafted = True
        accepted = 0
        while accepted < d and self._accept(seq, accepted):
            accepted += 1
        self.spec_draft_tokens += d
        self.spec_accepted_tokens += accepted
        self.spec_verify_steps += 1
        tokens, bs, caching = seq.tokens, cfg.block_size, cfg.enable_prefix_caching
        emitted = []
        for _ in range(accepted + 1):
            index = seq.num_generated
            token = _xxh3(_pack_pair(seq.token_seed, seq.token_offset + index)) % cfg.vocab_size
            tokens.append(token)
            emitted.append(token)
            seq.num_generated = index + 1
            if caching and len(tokens) % bs == 0:
                seq.hash_last_block(bs)
        seq.num_computed += 1 + accepted  # the fed token and the accepted drafts; the last emitted is pending
        if caching and seq.num_computed // bs > seq.committed:
            seq.committed = seq.num_computed // bs
            self.pool.commit(seq.rid, seq.hashes[: seq.committed], seq.lora_name)
        done = seq.num_generated >= seq.max_tokens
        outputs[seq.rid] = EngineOutput(emitted, FinishReason.length if done else None, 0)
        if done:
            self._finish(seq)
        return done

    def _accept(self, seq: _Seq, j: int) -> bool:
        """Whether draft ``j`` of this step is accepted (probability ``spec_acceptance_rate``,
        drawn from the request's seed and position)."""
        draw = _xxh3(_pack_pair(seq.token_seed ^ _SPEC_SALT, (seq.num_generated << 8) | j))
        return draw < self.config.spec_acceptance_rate * 2.0**64

    def _count_recomputed(self, hashes: list[int]) -> None:
        """Prompt blocks just computed: those computed before (anywhere) were recomputed."""
        seen, bs = self.computed_blocks, self.config.block_size
        for h in hashes:
            if h in seen:
                self.recomputed_prefill_tokens += bs
            else:
                seen.add(h)

    def _count_first_token(self, seq: _Seq) -> None:
        """A request's first output token: count its prompt and cached tokens per tier."""
        self.first_token_prompt_tokens += seq.prompt_len
        by_tier = self.cached_tokens_by_tier
        by_tier["host"] += seq.num_host_cached
        by_tier["disk"] += seq.num_disk_cached
        by_tier["device"] += seq.num_cached - seq.num_host_cached - seq.num_disk_cached

    def _finish(self, seq: _Seq) -> None:
        self.pool.free(seq.rid)
        seq.running = False
        del self._seqs[seq.rid]

    # ---- introspection ---------------------------------------------------

    def stats(self, in_flight: StepResult | None = None) -> KvStats:
        """Current KV usage, queue lengths and token totals.

        ``active_prefill_tokens`` counts prompt/recompute tokens not yet
        computed, over waiting and running requests (O(requests)), plus the
        prefill tokens of ``in_flight``: the step the owner is still running
        (its outputs not yet delivered). :meth:`step` computes a step at once,
        so without it a worker in the middle of a long prefill would report
        no prefill work, although a request routed to it waits for that step
        to end: a load-aware router would then pile arrivals onto it.

        Args:
            in_flight: the step now running, or None between steps.
        """
        pending = in_flight.prefill_tokens if in_flight is not None else 0
        for seq in self._seqs.values():
            left = len(seq.tokens) - seq.num_computed
            if not (seq.num_generated and left == 1):  # requests in decode have one token pending
                pending += left
        return KvStats(
            block_size=self.config.block_size,
            total_blocks=self.config.num_kv_blocks,
            used_blocks=self.pool.num_used_blocks,
            active_requests=len(self._running),
            waiting_requests=len(self._waiting),
            active_prefill_tokens=pending,
            prefill_tokens_total=self.prefill_tokens_total,
            decode_tokens_total=self.decode_tokens_total,
        )

    def dump_kv_events(self) -> list[KvEvent]:
        """``BlockStored`` events for every block now cached, in every tier (resync snapshot)."""
        return self.pool.dump() + (self.tiers.dump() if self.tiers is not None else [])
