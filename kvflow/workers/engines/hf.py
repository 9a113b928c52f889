"""The ``hf`` engine: a real model on transformers + torch, continuously batched.

One asyncio task runs the step loop. Each step (:meth:`HfEngine._step`):

1. **prefill** every newly admitted request, one at a time, reusing the KV of
   its longest cached prompt prefix (see *prefix cache* below), and sample
   its first token;
2. merge it into the **running batch** and drop aborted requests;
3. run **one batched decode forward pass** over all running requests: input
   ``[B, 1]`` (each request's last token), ``position_ids`` ``[B, 1]`` (each
   request's own position), attention mask ``[B, T + 1]``; sample one token
   per request; finish those that hit EOS, ``max_tokens`` or a stop string.

Requests are admitted between steps, so a new request joins while others are
mid-generation (continuous batching). The running batch keeps its KV per layer
as ``[B, kv_heads, T, head_dim]`` tensors, **left-padded** to a common length
``T``: request ``i``'s ``n_i`` real tokens are the last ``n_i`` columns, the
mask zeroes the padding, and RoPE positions come from ``position_ids``, so
padding changes neither positions nor attention weights. The batch is
re-padded only when a request joins or leaves.

Prefix cache: the KV of every full ``block_size``-token block of a sequence
(prompt and generated tokens) is copied into a bounded LRU keyed by the
block's chained sequence hash (:func:`kvflow.schemas.block_hash.compute_block_hashes`).
A new request whose prompt starts with cached blocks skips their prefill and
reports the reused token count as ``num_cached_tokens`` on its first output.
Stores and evictions are reported as :class:`~kvflow.schemas.BlockStored` /
:class:`~kvflow.schemas.BlockRemoved` KV events, once per step.

KV tiers (``kv_host_gb`` / ``kv_disk_gb`` extras,
:mod:`kvflow.workers.kv.tiers`): a block the prefix cache (G1) evicts is
offloaded to host memory (G2: the tensor itself on CPU, a host copy on an
accelerator) and, if reused at least twice, on to local disk (G3: one
safetensors file a block, written atomically and checksummed by
:class:`~kvflow.workers.kv.disk.FileDisk`). A prompt whose prefix continues
past G1's hit in G2/G3 loads those blocks back into G1 instead of
recomputing them; they count in ``num_cached_tokens``, and a disk block
whose file is missing or corrupt is recomputed, never used. The KV bytes
are the ones computed, so greedy output is the same as without tiers.

Stop strings: the engine detokenizes each request that has stop strings and
holds back output tokens whose text could begin a stop string. When one
matches, the request finishes with ``stop`` and the tokens it has sent in all
(``token_ids`` summed over its outputs) are the longest token prefix whose text
ends before the stop string: the stop string and everything after it are not
sent. A token whose text straddles the start of the stop string is dropped too,
so its text before the stop string is lost (rare with byte-level BPE, whose
pre-tokenizer splits at word and punctuation boundaries). On EOS the EOS token
is the last token sent (decoding skips it).

Disaggregated serving (:mod:`kvflow.workers.kv.handoff`): :meth:`HfEngine.prefill`
runs only the prefill of a request inside the same step loop (same forward
pass, same sampling, prefix cache and KV events as an aggregated request)
and returns its first token with the prompt KV packed as blocks
``[num_blocks, layers, 2, kv_heads, block_size, head_dim]``;
:meth:`HfEngine.generate_from_kv` takes the leading blocks it already caches
from its prefix cache, pulls the rest, rebuilds per-layer ``[1, kv_heads,
ISL, head_dim]`` KV, streams the prefill's first token and joins the running
batch exactly where an aggregated request would after its prefill. The KV
bytes are the prefill's own, so greedy output is token for token that of
aggregated serving.

Speculative decoding (``extra["spec_ngram_tokens"]`` k > 0): while exactly
one request decodes and it is greedy (temperature 0), each step proposes up
to k draft tokens by prompt lookup (:func:`~kvflow.workers.engines.ngram.propose_ngram`)
and verifies them in one forward pass over ``[1, 1 + d]`` tokens: drafts are
accepted while each equals the argmax the model gives at its position, and
the argmax after the last accepted one is emitted too, so the output is the
greedy output token for token (up to floating-point differences between the
one-token and the multi-token forward pass, which change an argmax only on
near-ties). The KV of rejected drafts is cut off the cache; only accepted
tokens reach the prefix cache and its KV events. A batch of several
requests, or a sampled one, decodes one token a step as before.

LoRA adapters (:meth:`HfEngine.load_lora`, through ``peft``): the first
adapter wraps the model in a ``PeftModel``; every forward pass then names
each row's adapter (``adapter_names``, ``"__base__"`` for a request without
one), so requests of different adapters and of the base model share one
batch. A request names its adapter by ``lora_name``; its block hashes are
salted with that name (:func:`~kvflow.schemas.block_hash.block_seed`), so
the prefix cache never hands one adapter's KV to another or to the base
model. Loads and unloads run between steps; unloading the last adapter
restores the plain model.

Media (:attr:`~kvflow.workers.engines.base.GenerateRequest.media`): a
prompt's media items stand at runs of placeholder ids; prefill feeds the
model's own embedding rows with each item's embeddings (``[num_tokens,
hidden]``, from an encode worker) in place of its run, and the blocks a run
covers are hashed with the item's content hash, so a cached prefix is reused
only for the same media at the same place.

Supported models: decoder-only transformers models whose cache layers are all
full attention (Llama, Qwen2 without sliding window, ...). Sliding-window
layers would break the left-padded layout and are refused at start.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import dataclasses
import logging
import math
import os
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from kvflow.models.resolve import resolve_model
from kvflow.models.tokenizer import IncrementalDetokenizer, Tokenizer, load_tokenizer
from kvflow.schemas import BlockRemoved, BlockStored, FinishReason, KvEvent, KvTierMetrics, SpecDecodeMetrics
from kvflow.schemas.block_hash import compute_block_hashes
from kvflow.workers.engines.base import Engine, EngineConfig, EngineError, EngineOutput, GenerateRequest, KvStats
from kvflow.workers.engines.ngram import propose_ngram
from kvflow.workers.kv.disk import FileDisk
from kvflow.workers.kv.handoff import KvHandoff, KvLayout, KvPayload, PrefillResult
from kvflow.workers.kv.tiers import OffloadedBlock, TierConfig, TieredStore, TierStats, tier_metrics
from kvflow.workers.kv.transfer import TransferError
from kvflow.workers.stops import StopChecker

__all__ = ["HfEngine"]

log = logging.getLogger(__name__)

LayerKv = list[tuple[torch.Tensor, torch.Tensor]]
"""Per-layer (keys, values); each ``[batch, kv_heads, tokens, head_dim]``."""

_DEFAULT_KV_CACHE_MB = 1024


@dataclass(eq=False)
class _Sequence:
    """Working state of one request (owned by the step loop)."""

    request: GenerateRequest
    outputs: asyncio.Queue
    token_ids: list[int]  # prompt + output so far
    num_prompt_tokens: int
    generator: torch.Generator | None
    stop_checker: StopChecker | None = None
    detok: IncrementalDetokenizer | None = None
    char_ends: list[int | None] = field(default_factory=list)  # text length after each output token
    safe_chars: int = 0  # output text length that cannot be part of a stop string
    num_sent: int = 0  # output tokens already sent
    num_cached_tokens: int = 0
    num_stored_blocks: int = 0  # leading full blocks already offered to the prefix cache
    sent_first: bool = False
    finished: bool = False
    abort_requested: bool = False
    prefill_only: bool = False  # disaggregated prefill: stop after the first token, hand back the KV
    imported: tuple[list[torch.Tensor], torch.Tensor] | None = None  # (reused cache blocks, pulled bytes)
    first_token: int | None = None  # the remote prefill's first token (with ``imported``)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def num_kv_tokens(self) -> int:
        """Tokens whose KV is computed: all but the last sampled token."""
        return len(self.token_ids) - 1


class _PrefixCache:
    """Bounded LRU of KV blocks keyed by chained block hash.

    A block is one tensor ``[layers, 2, kv_heads, block_size, head_dim]``
    (index 0 of dim 1 = keys, 1 = values), a copy independent of any running
    batch. Chains are touched leaf-first so a prefix's root is always more
    recently used than its descendants and is evicted last.
    """

    def __init__(self, capacity_blocks: int) -> None:
        self.capacity_blocks = capacity_blocks
        self._blocks: collections.OrderedDict[int, torch.Tensor] = collections.OrderedDict()
        self._parents: dict[int, int | None] = {}

    def __len__(self) -> int:
        return len(self._blocks)

    def __contains__(self, block_hash: int) -> bool:
        return block_hash in self._blocks

    def match(self, block_hashes: list[int]) -> list[torch.Tensor]:
        """Blocks of the longest cached prefix of ``block_hashes``, in order; marks them recently used."""
        found = self.peek(block_hashes)
        self.touch(block_hashes[: len(found)])
        return found

    def peek(self, block_hashes: list[int]) -> list[torch.Tensor]:
        """Blocks of the longest cached prefix of ``block_hashes``, without touching the LRU order.

        Safe to call from the event-loop thread while a step runs in its
        worker thread: each ``dict.get`` is atomic under the GIL, and the
        caller holds references to the returned tensors, so an eviction
        racing with it cannot free them.
        """
        found: list[torch.Tensor] = []
        for h in block_hashes:
            block = self._blocks.get(h)
            if block is None:
                break
            found.append(block)
        return found

    def insert(self, block_hash: int, block: torch.Tensor, parent_hash: int | None = None) -> None:
        self._blocks[block_hash] = block
        self._parents[block_hash] = parent_hash

    def get(self, block_hash: int) -> torch.Tensor | None:
        """The block of ``block_hash`` (None if not cached), without touching the LRU order."""
        return self._blocks.get(block_hash)

    def touch(self, chain: list[int]) -> None:
        """Mark a chain used, leaf first, so the root ends most recent."""
        for h in reversed(chain):
            if h in self._blocks:
                self._blocks.move_to_end(h)

    def evict_overflow(self) -> list[tuple[int, torch.Tensor, int | None]]:
        """Drop least recently used blocks down to capacity; return ``(hash, block, parent hash)`` of each."""
        removed = []
        while len(self._blocks) > self.capacity_blocks:
            h, block = self._blocks.popitem(last=False)
            removed.append((h, block, self._parents.pop(h, None)))
        return removed


class _Batch:
    """KV of the running sequences, left-padded to a common length ``T``.

    ``kv[l]`` is layer ``l``'s (keys, values), each ``[B, kv_heads, T,
    head_dim]``; ``mask`` is ``[B, T]`` (1 = real token). Row ``i`` holds
    ``seqs[i].num_kv_tokens`` real tokens in its last columns.
    """

    def __init__(self) -> None:
        self.seqs: list[_Sequence] = []
        self.kv: LayerKv = []
        self.mask: torch.Tensor | None = None

    def add(self, seq: _Sequence, kv: LayerKv) -> None:
        """Append ``seq`` whose own KV is ``kv`` (batch size 1, no padding)."""
        n = kv[0][0].shape[2]
        ones = torch.ones(1, n, dtype=torch.long, device=kv[0][0].device)
        if not self.seqs:
            self.seqs, self.kv, self.mask = [seq], list(kv), ones
            return
        t = self.mask.shape[1]
        width = max(t, n)
        old = [(F.pad(k, (0, 0, width - t, 0)), F.pad(v, (0, 0, width - t, 0))) for k, v in self.kv]
        new = [(F.pad(k, (0, 0, width - n, 0)), F.pad(v, (0, 0, width - n, 0))) for k, v in kv]
        self.kv = [(torch.cat((ok, nk)), torch.cat((ov, nv))) for (ok, ov), (nk, nv) in zip(old, new)]
        self.mask = torch.cat((F.pad(self.mask, (width - t, 0)), F.pad(ones, (width - n, 0))))
        self.seqs.append(seq)

    def remove(self, gone: list[_Sequence]) -> None:
        """Drop the rows of ``gone`` and any padding columns no row needs."""
        if not gone:
            return
        keep = [i for i, s in enumerate(self.seqs) if s not in gone]
        if not keep:
            self.seqs, self.kv, self.mask = [], [], None
            return
        self.seqs = [self.seqs[i] for i in keep]
        idx = torch.tensor(keep, device=self.mask.device)
        trim = self.mask.shape[1] - max(s.num_kv_tokens for s in self.seqs)
        self.kv = [(k.index_select(0, idx)[:, :, trim:], v.index_select(0, idx)[:, :, trim:]) for k, v in self.kv]
        self.mask = self.mask.index_select(0, idx)[:, trim:]

    def row_kv(self, i: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Row ``i``'s real KV per layer, each ``[kv_heads, n_i, head_dim]`` (views)."""
        n = self.seqs[i].num_kv_tokens
        return [(k[i, :, -n:], v[i, :, -n:]) for k, v in self.kv]


def _pack_blocks(kv: LayerKv, block_size: int) -> torch.Tensor:
    """Pack one request's per-layer KV (each ``[1, kv_heads, n, head_dim]``) into
    contiguous blocks ``[ceil(n / block_size), layers, 2, kv_heads, block_size, head_dim]``,
    zero-padding the last block."""
    stacked = torch.stack([torch.stack((k[0], v[0])) for k, v in kv])  # [L, 2, h, n, d]
    layers, _, heads, n, dim = stacked.shape
    num_blocks = -(-n // block_size)
    if num_blocks * block_size > n:
        stacked = F.pad(stacked, (0, 0, 0, num_blocks * block_size - n))
    return stacked.view(layers, 2, heads, num_blocks, block_size, dim).permute(3, 0, 1, 2, 4, 5).contiguous()


def _unpack_blocks(blocks: torch.Tensor, num_tokens: int) -> LayerKv:
    """Inverse of :func:`_pack_blocks`: blocks ``[N, L, 2, h, bs, d]`` → per-layer
    (keys, values), each ``[1, h, num_tokens, d]`` and contiguous."""
    num_blocks, layers, _, heads, block_size, dim = blocks.shape
    flat = blocks.permute(1, 2, 3, 0, 4, 5).reshape(layers, 2, heads, num_blocks * block_size, dim)
    flat = flat[:, :, :, :num_tokens]
    return [(flat[i, 0].unsqueeze(0).contiguous(), flat[i, 1].unsqueeze(0).contiguous()) for i in range(layers)]


def _block_to_bytes(block: torch.Tensor) -> bytes:
    """One KV block as safetensors bytes (the G3 file's payload)."""
    from safetensors.torch import save

    return save({"kv": block.contiguous()})


def _block_from_bytes(data: bytes) -> torch.Tensor:
    """Inverse of :func:`_block_to_bytes`.

    Raises:
        KeyError, safetensors errors: not a block written by :func:`_block_to_bytes`.
    """
    from safetensors.torch import load

    return load(data)["kv"]


def _sample_row(logits: torch.Tensor, temperature: float, top_p: float, generator: torch.Generator | None) -> int:
    """Sample one token id from ``logits`` ``[vocab]`` with temperature and nucleus (top-p) filtering.

    Top-p keeps the smallest set of most likely tokens whose probability mass
    reaches ``top_p`` (Holtzman et al., 2019, "The Curious Case of Neural Text
    Degeneration"); the most likely token is always kept.
    """
    probs = torch.softmax(logits / temperature, dim=-1)
    if top_p < 1.0:
        sorted_probs, order = probs.sort(descending=True)
        keep = (sorted_probs.cumsum(-1) - sorted_probs) < top_p
        choice = torch.multinomial(sorted_probs * keep, 1, generator=generator)
        return int(order[choice])
    return int(torch.multinomial(probs, 1, generator=generator))


class HfEngine(Engine):
    """Serves a Hugging Face causal LM with continuous batching and prefix caching.

    Args:
        config: common engine settings; ``model`` is a spec for
            :func:`kvflow.models.resolve.resolve_model`. ``device`` is
            ``"cpu"`` (default) or ``"cuda"``. ``extra`` keys:
            ``dtype`` (``"float32"`` default, or ``"bfloat16"``/``"float16"``),
            ``torch_threads`` (CPU threads; default: CPUs this process may
            use), ``kv_cache_mb`` (prefix cache budget in MiB, default 1024;
            the cache holds ``min(num_kv_blocks, budget / block bytes)``
            blocks), ``enable_prefix_caching`` (default true; false skips
            the prefix cache and its KV events), ``kv_host_gb`` /
            ``kv_disk_gb`` (G2 / G3 budgets in GiB, default 0 = none; see
            the module docstring), ``kv_disk_dir`` (G3 directory; default a
            new temporary directory), ``kv_disk_min_frequency`` (reuse
            frequency a block needs for G3, default 3; see
            :class:`~kvflow.workers.kv.tiers.TierConfig`), ``spec_ngram_tokens``
            (draft tokens per step of prompt-lookup speculative decoding,
            default 0 = off; see the module docstring), ``spec_ngram_max``
            (longest n-gram looked up, default 3). On CPU,
            :meth:`start` sets torch's (process-wide) intra-op thread count.
        **overrides: ``EngineConfig`` fields replacing those of ``config``.

    After :meth:`start`: :attr:`tokenizer` is the model's tokenizer wrapper,
    :attr:`model_name` the served name, and :attr:`decode_steps_by_batch_size`
    counts decode forward passes by their batch size.
    """

    name = "hf"
    accepts_prompt_embeds = True
    accepts_media = True

    def __init__(self, config: EngineConfig | None = None, **overrides) -> None:
        # Keyword overrides (e.g. ``HfEngine(model=..., device="cuda")``) patch ``config``.
        self.config = dataclasses.replace(config or EngineConfig(), **overrides)
        self.block_size = self.config.block_size
        self.model_name = self.config.model
        self.decode_steps_by_batch_size: collections.Counter[int] = collections.Counter()
        self._tokenizer: Tokenizer | None = None
        self._model = None
        self._device = torch.device(self.config.device)
        self._cache: _PrefixCache | None = None
        self._prefix_caching = bool(self.config.extra.get("enable_prefix_caching", True))
        self._batch = _Batch()
        self._waiting: collections.deque[_Sequence] = collections.deque()
        self._prefilling: list[_Sequence] = []
        self._seqs: dict[str, _Sequence] = {}
        self._wakeup = asyncio.Event()
        self._loop_task: asyncio.Task | None = None
        self._stopping = False
        self._max_model_len = 0
        self._vocab_size = 0
        self._embed_shape: tuple[int, torch.dtype] | None = None  # (hidden size, dtype) of prompt embeddings
        self._prefill_tokens_total = 0
        self._decode_tokens_total = 0
        self._layout: KvLayout | None = None
        self._tiers: TieredStore | None = None
        self._block_bytes = 0
        self._spec_tokens = int(self.config.extra.get("spec_ngram_tokens", 0))
        self._spec_ngram = int(self.config.extra.get("spec_ngram_max", 3))
        if self._spec_tokens < 0 or self._spec_ngram < 1:
            raise ValueError("spec_ngram_tokens must be >= 0 and spec_ngram_max >= 1")
        self._spec_counts = [0, 0, 0]  # draft tokens, accepted tokens, verify passes
        self._peft = None  # the PeftModel wrapping _model once an adapter is loaded
        self._loras: set[str] = set()
        self._model_lock = asyncio.Lock()  # steps and adapter loads take turns on the model

    # ----------------------------------------------------------------- lifecycle

    @property
    def tokenizer(self) -> Tokenizer:
        """The model's tokenizer wrapper (:mod:`kvflow.models.tokenizer`).

        Raises:
            EngineError: the engine is not started.
        """
        if self._tokenizer is None:
            raise EngineError("HfEngine.tokenizer is available after start()")
        return self._tokenizer

    async def start(self) -> None:
        """Resolve and load the model and tokenizer (off the event loop), start the step loop.

        Raises:
            kvflow.models.resolve.ModelNotFoundError: unknown model spec.
            EngineError: the device is unavailable or the model's cache layout
                is not supported.
        """
        if self._loop_task is not None:
            return
        if self._device.type == "cuda" and not torch.cuda.is_available():
            raise EngineError("device 'cuda' requested but torch sees no CUDA device")
        if self._device.type == "cpu":
            threads = int(self.config.extra.get("torch_threads") or len(os.sched_getaffinity(0)))
            torch.set_num_threads(max(1, threads))
        if self._model is None:
            await asyncio.to_thread(self._load)
        self._stopping = False
        self._loop_task = asyncio.create_task(self._run_loop(), name=f"hf-engine-{self.model_name}")

    def _load(self) -> None:
        from transformers import AutoModelForCausalLM, DynamicCache, DynamicLayer

        resolved = resolve_model(self.config.model)
        self.model_name = resolved.name
        self._tokenizer = load_tokenizer(str(resolved.path))
        dtype = getattr(torch, self.config.extra.get("dtype", "float32"))
        model = AutoModelForCausalLM.from_pretrained(str(resolved.path), dtype=dtype, local_files_only=True)
        self._model = model.to(self._device).eval()
        cfg = model.config.get_text_config(decoder=True)
        layers = DynamicCache(config=model.config).layers
        if not layers or any(type(layer) is not DynamicLayer for layer in layers):
            raise EngineError(f"{resolved.name}: only full-attention models are supported by the hf engine")
        self._num_layers = len(layers)
        positions = int(getattr(cfg, "max_position_embeddings", 0) or 0)
        self._max_model_len = positions or 1 << 30
        self.context_length = positions or None
        self._vocab_size = int(cfg.vocab_size)
        self._embed_shape = (int(cfg.hidden_size), self._model.get_input_embeddings().weight.dtype)
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        kv_heads = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
        block_bytes = self._num_layers * 2 * kv_heads * self.block_size * head_dim * dtype.itemsize
        self._layout = KvLayout(str(dtype).removeprefix("torch."),
                                (self._num_layers, 2, int(kv_heads), self.block_size, int(head_dim)))
        budget = float(self.config.extra.get("kv_cache_mb", _DEFAULT_KV_CACHE_MB)) * 2**20
        self._cache = _PrefixCache(max(1, min(self.config.num_kv_blocks, int(budget // block_bytes))))
        self._block_bytes = block_bytes
        self._tiers = self._make_tiers()

    async def load_lora(self, name: str, path) -> None:
        """Load the peft LoRA adapter directory ``path`` as ``name``, between steps.

        Raises:
            EngineError: not started, or ``name`` is already loaded.
            ValueError, OSError: peft could not read the adapter (wrong base model shapes, missing files).
        """
        if self._model is None:
            raise EngineError("HfEngine.load_lora needs a started engine")
        async with self._model_lock:
            if name in self._loras:
                raise EngineError(f"LoRA adapter {name!r} is already loaded")
            await asyncio.to_thread(self._load_lora, name, str(path))
            self._loras.add(name)

    def _load_lora(self, name: str, path: str) -> None:
        from peft import PeftModel

        if self._peft is None:
            self._peft = PeftModel.from_pretrained(self._model, path, adapter_name=name, is_trainable=False).eval()
        else:
            self._peft.load_adapter(path, adapter_name=name, is_trainable=False)

    async def unload_lora(self, name: str) -> None:
        """Drop adapter ``name`` between steps; the last one out restores the plain model.

        Raises:
            EngineError: ``name`` is not loaded, or requests still use it.
        """
        async with self._model_lock:
            if name not in self._loras:
                raise EngineError(f"LoRA adapter {name!r} is not loaded")
            users = [rid for rid, s in self._seqs.items() if s.request.lora_name == name and not s.finished]
            if users:
                raise EngineError(f"LoRA adapter {name!r} is used by {len(users)} running request(s)")
            # Out of the set before the first await: no new request can name it from here on.
            self._loras.discard(name)
            try:
                await asyncio.to_thread(self._unload_lora, name)
            except BaseException:
                self._loras.add(name)
                raise

    def _unload_lora(self, name: str) -> None:
        if not self._loras:
            self._model = self._peft.unload()  # removes the LoRA layers: the base modules are back
            self._peft = None
        else:
            self._peft.delete_adapter(name)

    @property
    def lora_names(self) -> list[str]:
        """Names of the loaded LoRA adapters, sorted."""
        return sorted(self._loras)

    def _make_tiers(self) -> TieredStore | None:
        """The G2/G3 store the ``kv_*`` extras ask for, or None."""
        extra = self.config.extra
        tiers = TierConfig.from_gb(float(extra.get("kv_host_gb") or 0), float(extra.get("kv_disk_gb") or 0),
                                   disk_min_frequency=float(extra.get("kv_disk_min_frequency", 3.0)))
        if not tiers.enabled or not self._prefix_caching:
            return None
        disk = None
        if tiers.disk_bytes:
            import tempfile

            directory = extra.get("kv_disk_dir") or tempfile.mkdtemp(prefix="kvflow-kv-disk-")
            disk = FileDisk(directory, encode=_block_to_bytes, decode=_block_from_bytes)
        return TieredStore(tiers, disk)

    @property
    def tier_stats(self) -> TierStats | None:
        """Offload/onboard counters of the KV tiers (None without tiers)."""
        return self._tiers.stats if self._tiers is not None else None

    def kv_tier_metrics(self) -> KvTierMetrics | None:
        """The G2/G3 counters for the worker's metrics record (None without tiers)."""
        return tier_metrics(self._tiers) if self._tiers is not None else None

    async def stop(self) -> None:
        """Finish the current step, stop the loop, end every open request with ``abort``.

        The host and disk KV tiers are emptied (their disk files deleted):
        nothing would index them after this worker is gone.
        """
        if self._loop_task is None:
            return
        self._stopping = True
        self._wakeup.set()
        await self._loop_task
        self._loop_task = None
        for seq in list(self._seqs.values()):
            if not seq.finished:
                seq.finished = True
                seq.outputs.put_nowait(EngineOutput(token_ids=[], finish_reason=FinishReason.abort))
        self._waiting.clear()
        self._batch = _Batch()
        if self._tiers is not None:
            self._tiers.clear()
            self._tiers.take_events()

    # ----------------------------------------------------------------- requests

    def _new_sequence(self, request: GenerateRequest) -> _Sequence:
        if self._model is None or self._stopping:
            raise EngineError("HfEngine is not running; call start() first")
        prompt = list(request.prompt_token_ids)
        if not prompt:
            raise EngineError(f"{request.request_id}: empty prompt")
        if len(prompt) >= self._max_model_len:
            raise EngineError(
                f"{request.request_id}: prompt of {len(prompt)} tokens >= model max {self._max_model_len}"
            )
        if request.media:
            self._check_media(request)
        if request.prompt_embeds is not None:
            self._check_embeds(request)
        elif min(prompt) < 0 or max(prompt) >= self._vocab_size:
            raise EngineError(f"{request.request_id}: token id outside [0, {self._vocab_size})")
        if request.lora_name and request.lora_name not in self._loras:
            raise EngineError(f"{request.request_id}: LoRA adapter {request.lora_name!r} is not loaded "
                              f"(loaded: {sorted(self._loras)})")
        if request.request_id in self._seqs:
            raise EngineError(f"{request.request_id}: a request with this id is already running")
        sampling = request.sampling
        generator = None
        if sampling.temperature > 0:
            generator = torch.Generator(device=self._device)
            if sampling.seed is not None:
                generator.manual_seed(sampling.seed)
            else:
                generator.seed()
        seq = _Sequence(request, asyncio.Queue(), prompt, len(prompt), generator)
        if any(sampling.stop):
            seq.stop_checker = StopChecker(list(sampling.stop))
            seq.detok = IncrementalDetokenizer(self.tokenizer)
        return seq

    def _check_embeds(self, request: GenerateRequest) -> None:
        """Raises EngineError unless the prompt embeddings are ``[ISL, hidden]`` of the model's dtype."""
        hidden, dtype = self._embed_shape or (0, None)
        embeds = request.prompt_embeds
        want = (len(request.prompt_token_ids), hidden)
        if not isinstance(embeds, torch.Tensor) or tuple(embeds.shape) != want:
            got = tuple(embeds.shape) if isinstance(embeds, torch.Tensor) else type(embeds).__name__
            raise EngineError(f"{request.request_id}: prompt embeddings of shape {got}; this model takes "
                              f"[seq_len, {hidden}]")
        if embeds.dtype != dtype:
            raise EngineError(f"{request.request_id}: prompt embeddings of dtype {str(embeds.dtype).removeprefix('torch.')}; "
                              f"this model takes {str(dtype).removeprefix('torch.')}")

    def _check_media(self, request: GenerateRequest) -> None:
        """Raises EngineError unless each media item lies inside the prompt with
        ``[num_tokens, hidden]`` embeddings (any float dtype: cast to the model's)."""
        hidden = (self._embed_shape or (0, None))[0]
        if request.prompt_embeds is not None:
            raise EngineError(f"{request.request_id}: media and prompt embeddings cannot be combined")
        for item in request.media:
            if item.offset + item.num_tokens > len(request.prompt_token_ids):
                raise EngineError(f"{request.request_id}: a media item lies past the end of the prompt")
            embeds = item.embeds
            if not isinstance(embeds, torch.Tensor) or tuple(embeds.shape) != (item.num_tokens, hidden) \
                    or not embeds.dtype.is_floating_point:
                got = tuple(embeds.shape) if isinstance(embeds, torch.Tensor) else type(embeds).__name__
                raise EngineError(f"{request.request_id}: media embeddings of shape {got}; this model takes "
                                  f"[{item.num_tokens}, {hidden}] floats")

    def _block_hashes(self, token_ids: list[int], request: GenerateRequest) -> list[int]:
        """Chained hashes of the full blocks of ``token_ids``, salted by the request's
        adapter and, where its media reach, their content hashes."""
        return compute_block_hashes(token_ids, self.block_size, request.lora_name,
                                    request.mm_hashes(self.block_size))

    def _spliced_embeds(self, request: GenerateRequest, prompt: list[int], start: int) -> torch.Tensor:
        """Input embeddings ``[ISL - start, hidden]`` of ``prompt[start:]``: the model's
        embedding lookup, with each media item's embeddings at its placeholders."""
        with torch.no_grad():
            table = self._model.get_input_embeddings()
            rows = table(torch.tensor(prompt[start:], device=self._device))
            for item in request.media:
                lo, hi = max(item.offset, start), item.offset + item.num_tokens
                if lo < hi:  # the part of the run after the cached prefix
                    rows[lo - start:hi - start] = item.embeds[lo - item.offset:].to(self._device, rows.dtype)
        return rows

    @property
    def kv_layout(self) -> KvLayout:
        """Shape and dtype of one transferred KV block (``[layers, 2, kv_heads,
        block_size, head_dim]``).

        Raises:
            EngineError: the engine is not started.
        """
        if self._layout is None:
            raise EngineError("HfEngine.kv_layout is available after start()")
        return self._layout

    async def generate(self, request: GenerateRequest) -> AsyncIterator[EngineOutput]:
        """Serve ``request``; yields outputs until one carries a finish reason.

        Leaving the iteration early aborts the request.

        Raises:
            EngineError: not started, empty/too long prompt, token id out of
                range, LoRA adapter not loaded, duplicate request id, or the forward
                pass failed.
        """
        seq = self._new_sequence(request)
        self._seqs[request.request_id] = seq
        async with contextlib.aclosing(self._run_sequence(seq)) as outputs:
            async for out in outputs:
                yield out

    async def prefill(self, request: GenerateRequest) -> PrefillResult:
        """Prefill ``request`` only (disaggregated serving): its first token and its KV.

        The prompt runs through the normal step loop: prefix-cache reuse,
        the same forward pass and sampling as :meth:`generate`, and its full
        blocks are stored in the prefix cache (with KV events). The KV comes
        back as a :class:`~kvflow.workers.kv.handoff.KvPayload` of
        ``ceil(ISL / block_size)`` blocks on this engine's device.

        Raises:
            EngineError: as :meth:`generate`, or the request was aborted
                before its prefill ran.
        """
        seq = self._new_sequence(request)
        seq.prefill_only = True
        self._seqs[request.request_id] = seq
        self._waiting.append(seq)
        self._wakeup.set()
        try:
            item = await seq.outputs.get()
        finally:
            if self._seqs.get(request.request_id) is seq:
                del self._seqs[request.request_id]
            if not seq.finished:
                self._request_abort(seq)
        if isinstance(item, BaseException):
            raise item
        if isinstance(item, PrefillResult):
            return item
        raise EngineError(f"{request.request_id}: aborted before its prefill ran")

    async def generate_from_kv(self, request: GenerateRequest, handoff: KvHandoff) -> AsyncIterator[EngineOutput]:
        """Decode ``request`` from a remote prefill; yields outputs as :meth:`generate`.

        The first output is ``handoff.first_token_id``. Leading prompt blocks
        found in this engine's prefix cache are not pulled
        (``handoff.fetch(first_block=len(reused))``); the first output
        reports them as ``num_cached_tokens``.

        Raises:
            EngineError: as :meth:`generate`.
            TransferError: the handoff's KV layout or length does not match
                this engine and prompt, or the pull failed (before any output,
                so the caller can prefill locally instead).
        """
        seq = self._new_sequence(request)
        prompt = seq.token_ids
        if handoff.layout != self._layout:
            raise TransferError(f"{request.request_id}: KV layout {handoff.layout} does not match {self._layout}")
        if handoff.num_tokens != len(prompt) or handoff.num_blocks != -(-len(prompt) // self.block_size):
            raise TransferError(f"{request.request_id}: KV of {handoff.num_tokens} tokens for a "
                                f"{len(prompt)}-token prompt")
        reused: list[torch.Tensor] = []
        if self._prefix_caching:
            hashes = self._block_hashes(prompt, request)
            reused = self._cache.peek(hashes[: len(prompt) // self.block_size])
        self._seqs[request.request_id] = seq
        try:
            pulled = await handoff.fetch(len(reused), device=self._device)
        except BaseException:
            if self._seqs.get(request.request_id) is seq:
                del self._seqs[request.request_id]
            raise
        seq.imported, seq.first_token = (reused, pulled), handoff.first_token_id
        seq.num_cached_tokens = len(reused) * self.block_size
        if handoff.sampler_state is not None and seq.generator is not None:
            seq.generator.set_state(torch.frombuffer(bytearray(handoff.sampler_state), dtype=torch.uint8))
        async with contextlib.aclosing(self._run_sequence(seq)) as outputs:
            async for out in outputs:
                yield out

    async def _run_sequence(self, seq: _Sequence) -> AsyncIterator[EngineOutput]:
        """Queue a registered ``seq`` for the step loop and relay its outputs."""
        request = seq.request
        self._waiting.append(seq)
        self._wakeup.set()
        try:
            while True:
                item = await seq.outputs.get()
                if isinstance(item, BaseException):
                    raise item
                yield item
                if item.finish_reason is not None:
                    return
        finally:
            if self._seqs.get(request.request_id) is seq:
                del self._seqs[request.request_id]
            if not seq.finished:
                self._request_abort(seq)

    async def abort(self, request_id: str) -> None:
        """Stop ``request_id`` (no-op if unknown or finished); its iterator ends with ``abort``
        within one engine step."""
        seq = self._seqs.get(request_id)
        if seq is not None and not seq.finished:
            self._request_abort(seq)

    def _request_abort(self, seq: _Sequence) -> None:
        if seq in self._waiting:  # never started: finish it right here
            self._waiting.remove(seq)
            seq.finished = True
            seq.outputs.put_nowait(EngineOutput(token_ids=[], finish_reason=FinishReason.abort))
        else:  # running: the step loop drops it before its next decode
            seq.abort_requested = True
            self._wakeup.set()

    def kv_stats(self) -> KvStats:
        """Prefix-cache blocks plus the running requests' blocks not in it.

        ``used_blocks`` = cached blocks + for each running request its blocks
        (``ceil(kv tokens / block_size)``) not yet offered to the cache;
        ``total_blocks`` = prefix cache capacity.
        """
        running = list(self._batch.seqs) + list(self._prefilling)
        cached = len(self._cache) if self._cache is not None else 0
        own = sum(max(0, math.ceil(max(s.num_kv_tokens, 0) / self.block_size) - s.num_stored_blocks) for s in running)
        total = self._cache.capacity_blocks if self._cache is not None else self.config.num_kv_blocks
        return KvStats(
            block_size=self.block_size,
            total_blocks=total,
            used_blocks=cached + own,
            active_requests=len(running),
            waiting_requests=len(self._waiting),
            active_prefill_tokens=sum(s.num_prompt_tokens for s in self._prefilling),
            prefill_tokens_total=self._prefill_tokens_total,
            decode_tokens_total=self._decode_tokens_total,
        )

    # ----------------------------------------------------------------- step loop

    async def _run_loop(self) -> None:
        while not self._stopping:
            if not self._waiting and not self._batch.seqs:
                self._wakeup.clear()
                await self._wakeup.wait()
                continue
            admitted = self._admit()
            self._prefilling = admitted
            try:
                # The forward passes are CPU/GPU-bound for tens of ms; running
                # them in a thread keeps the event loop (Kafka I/O, heartbeats,
                # new requests, aborts) responsive. Only this task touches the
                # model and the batch, so steps never overlap.
                async with self._model_lock:
                    results, events = await asyncio.to_thread(self._step, admitted)
            except Exception as exc:  # a failed forward pass fails the requests in it
                log.exception("hf engine step failed")
                self._fail(list(self._batch.seqs) + admitted, exc)
                self._batch = _Batch()
                continue
            finally:
                self._prefilling = []
            for seq, output in results:
                seq.outputs.put_nowait(output)
            self.emit_kv_events(events)

    def _admit(self) -> list[_Sequence]:
        """Pop waiting requests within ``max_batch_size`` and the prefill token budget."""
        admitted: list[_Sequence] = []
        budget = self.config.max_num_batched_tokens
        room = self.config.max_batch_size - len(self._batch.seqs)
        while self._waiting and len(admitted) < room:
            cost = self._waiting[0].num_prompt_tokens
            if admitted and cost > budget:
                break
            budget -= cost
            admitted.append(self._waiting.popleft())
        return admitted

    def _fail(self, seqs: list[_Sequence], exc: Exception) -> None:
        for seq in seqs:
            if not seq.finished:
                seq.finished = True
                seq.outputs.put_nowait(EngineError(f"{seq.request.request_id}: forward pass failed: {exc}"))

    def _step(self, admitted: list[_Sequence]) -> tuple[list[tuple[_Sequence, EngineOutput]], list[KvEvent]]:
        """One engine step (runs in a worker thread): prefill ``admitted``, then one batched decode.

        Returns the outputs to deliver, in order, and this step's KV events.
        """
        results: list[tuple[_Sequence, EngineOutput]] = []
        events: list[KvEvent] = []
        with torch.inference_mode():
            for seq in admitted:
                if seq.abort_requested:
                    seq.finished = True
                    results.append((seq, EngineOutput(token_ids=[], finish_reason=FinishReason.abort)))
                    continue
                if seq.imported is not None:
                    kv = self._import_kv(seq)
                    out = self._advance(seq, seq.first_token)
                else:
                    kv, logits = self._prefill(seq, events)
                    token = self._sample(logits, [seq])[0]
                    if seq.prefill_only:
                        results.append((seq, self._finish_prefill(seq, token, kv, events)))
                        continue
                    out = self._advance(seq, token)
                events += self._store_blocks(seq, [(k[0], v[0]) for k, v in kv])
                if out is not None:
                    results.append((seq, out))
                if not seq.finished:
                    self._batch.add(seq, kv)
            aborted = [s for s in self._batch.seqs if s.abort_requested]
            for seq in aborted:
                seq.finished = True
                results.append((seq, EngineOutput(token_ids=[], finish_reason=FinishReason.abort)))
            self._batch.remove(aborted)
            if self._batch.seqs:
                drafts = self._drafts()
                results += self._decode_speculative(drafts, events) if drafts else self._decode(events)
        if self._tiers is not None:
            events += self._tiers.take_events()
        return results, events

    def _prefill(self, seq: _Sequence, events: list[KvEvent]) -> tuple[LayerKv, torch.Tensor]:
        """Prefill ``seq``'s prompt after its longest cached prefix (G1, then G2/G3 onboarded
        into G1); return its KV and last logits."""
        prompt = seq.token_ids
        blocks: list[torch.Tensor] = []
        if self._prefix_caching:
            hashes = self._block_hashes(prompt, seq.request)
            # Keep at least one prompt token to compute: its logits give the first output token.
            usable = (len(prompt) - 1) // self.block_size
            blocks = self._cache.match(hashes[:usable])
            if self._tiers is not None:
                blocks += self._onboard(hashes, len(blocks), usable, events, seq.request.lora_name)
        cached = len(blocks) * self.block_size
        past: LayerKv = []
        if blocks:
            joined = torch.cat(blocks, dim=3)  # [layers, 2, kv_heads, cached, head_dim]
            past = [(layer[0].unsqueeze(0), layer[1].unsqueeze(0)) for layer in joined]
        seq.num_cached_tokens = cached
        seq.num_stored_blocks = len(blocks)
        positions = torch.arange(cached, len(prompt), device=self._device).unsqueeze(0)
        embeds = seq.request.prompt_embeds
        if embeds is not None:
            embeds = embeds[cached:]
        elif seq.request.media:  # the lookup's rows with each media item's embeddings in its placeholders' place
            embeds = self._spliced_embeds(seq.request, prompt, cached)
        if embeds is not None:  # rows after the cached prefix, in place of the embedding lookup
            logits, kv = self._forward(None, positions, None, past, embeds.unsqueeze(0).to(self._device),
                                       adapters=[seq])
        else:
            input_ids = torch.tensor([prompt[cached:]], device=self._device)
            logits, kv = self._forward(input_ids, positions, None, past, adapters=[seq])
        self._prefill_tokens_total += len(prompt) - cached
        return kv, logits

    def _onboard(self, hashes: list[int], hits: int, usable: int, events: list[KvEvent],
                 lora_name: str | None = None) -> list[torch.Tensor]:
        """Load ``hashes[hits:usable]``'s leading run held in G2/G3 into G1; return those blocks.

        G1's own hits (``hashes[:hits]``) count as reuse of their blocks. The
        loaded blocks are cached in G1 with ``BlockStored`` events, as if
        computed; the time taken is added to the tier counters' ``onboard_ms``.
        """
        tiers = self._tiers
        now = time.monotonic()
        tiers.stats.lookup_blocks += usable
        tiers.stats.device_hit_blocks += hits
        tiers.record_hits(hashes[:hits], now)
        if hits >= usable:
            return []
        t0 = time.perf_counter()
        loaded = [o.payload.to(self._device) for o in tiers.onboard(hashes[hits:usable], now)]
        tiers.stats.onboard_ms += (time.perf_counter() - t0) * 1000
        if not loaded:
            return []
        for i, block in enumerate(loaded, start=hits):
            self._cache.insert(hashes[i], block, hashes[i - 1] if i else None)
        events.append(BlockStored(parent_block_hash=hashes[hits - 1] if hits else None,
                                  block_hashes=hashes[hits:hits + len(loaded)], lora_name=lora_name))
        self._cache.touch(hashes[:hits + len(loaded)])
        self._evict(events)
        return loaded

    def _evict(self, events: list[KvEvent]) -> None:
        """Evict G1's overflow: ``BlockRemoved`` for the device, offload to G2 when tiers are on."""
        removed = self._cache.evict_overflow()
        if not removed:
            return
        events.append(BlockRemoved(block_hashes=[h for h, _, _ in removed]))
        if self._tiers is not None:
            self._tiers.offload([OffloadedBlock(h, parent, block.to("cpu"), self._block_bytes)
                                 for h, block, parent in removed], time.monotonic())

    def _finish_prefill(self, seq: _Sequence, token: int, kv: LayerKv, events: list[KvEvent]) -> PrefillResult:
        """End a prefill-only sequence: cache its blocks, pack its KV, capture the sampler state."""
        seq.token_ids.append(token)
        seq.finished = True
        events += self._store_blocks(seq, [(k[0], v[0]) for k, v in kv])
        blocks = _pack_blocks(kv, self.block_size)
        num_tokens = seq.num_prompt_tokens
        state = seq.generator.get_state().numpy().tobytes() if seq.generator is not None else None
        return PrefillResult(
            first_token_id=token, num_prompt_tokens=num_tokens, num_cached_tokens=seq.num_cached_tokens,
            kv=KvPayload(blocks, self._layout, blocks.shape[0], num_tokens),
            num_kv_bytes=blocks.numel() * blocks.element_size(), sampler_state=state,
        )

    def _import_kv(self, seq: _Sequence) -> LayerKv:
        """Per-layer KV ``[1, h, ISL, d]`` of an imported sequence: its reused cache blocks, then
        the pulled bytes viewed as blocks."""
        reused, pulled = seq.imported
        parts = [torch.stack(reused)] if reused else []
        if pulled.numel():
            dtype = getattr(torch, self._layout.dtype)
            parts.append(pulled.view(dtype).view(-1, *self._layout.block_shape).to(self._device))
        blocks = parts[0] if len(parts) == 1 else torch.cat(parts)
        seq.num_stored_blocks = len(reused)
        seq.imported = (reused, pulled[:0])  # drop the staging bytes once viewed
        return _unpack_blocks(blocks, seq.num_prompt_tokens)

    def _decode(self, events: list[KvEvent]) -> list[tuple[_Sequence, EngineOutput]]:
        """One decode forward pass over the whole running batch; one token per request."""
        batch = self._batch
        seqs = batch.seqs
        input_ids = torch.tensor([[s.token_ids[-1]] for s in seqs], device=self._device)
        positions = torch.tensor([[s.num_kv_tokens] for s in seqs], device=self._device)
        mask = torch.cat((batch.mask, torch.ones(len(seqs), 1, dtype=batch.mask.dtype, device=self._device)), 1)
        logits, batch.kv = self._forward(input_ids, positions, mask, batch.kv, adapters=seqs)
        batch.mask = mask
        self.decode_steps_by_batch_size[len(seqs)] += 1
        self._decode_tokens_total += len(seqs)
        results = []
        for i, (seq, token) in enumerate(zip(seqs, self._sample(logits, seqs))):
            out = self._advance(seq, token)
            if self._prefix_caching and (seq.num_kv_tokens // self.block_size) > seq.num_stored_blocks:
                events += self._store_blocks(seq, batch.row_kv(i))
            if out is not None:
                results.append((seq, out))
        batch.remove([s for s in seqs if s.finished])
        return results

    def _drafts(self) -> list[int]:
        """Prompt-lookup drafts for the batch's one greedy request, capped so they never pass
        ``max_tokens``; ``[]`` when speculation is off or does not apply (module docstring)."""
        seqs = self._batch.seqs
        if not self._spec_tokens or len(seqs) != 1:
            return []
        seq = seqs[0]
        sampling = seq.request.sampling
        room = min(sampling.max_tokens - seq.num_output_tokens, self._max_model_len - len(seq.token_ids)) - 1
        if sampling.temperature > 0 or room <= 0:
            return []
        return propose_ngram(seq.token_ids, min(self._spec_tokens, room), self._spec_ngram)

    def _decode_speculative(self, drafts: list[int], events: list[KvEvent]) -> list[tuple[_Sequence, EngineOutput]]:
        """Verify ``drafts`` for the batch's one request in one forward pass; emit the accepted
        drafts and the model's next token (module docstring)."""
        batch = self._batch
        seq = batch.seqs[0]
        start, width, q = seq.num_kv_tokens, batch.mask.shape[1], 1 + len(drafts)
        input_ids = torch.tensor([[seq.token_ids[-1], *drafts]], device=self._device)
        positions = torch.arange(start, start + q, device=self._device).unsqueeze(0)
        mask = torch.cat((batch.mask, torch.ones(1, q, dtype=batch.mask.dtype, device=self._device)), 1)
        logits, kv = self._forward(input_ids, positions, mask, batch.kv, num_logits=q, adapters=[seq])
        best = logits[0].argmax(dim=-1).tolist()  # best[j]: the greedy token after input j
        accepted = 0
        while accepted < len(drafts) and drafts[accepted] == best[accepted]:
            accepted += 1
        outs = []
        for token in drafts[:accepted] + [best[accepted]]:
            out = self._advance(seq, token)
            if out is not None:
                outs.append(out)
            if seq.finished:
                break
        keep = width + seq.num_kv_tokens - start  # the fed token and the accepted drafts kept
        batch.kv = [(k[:, :, :keep], v[:, :, :keep]) for k, v in kv]
        batch.mask = mask[:, :keep]
        counts = self._spec_counts
        counts[0] += len(drafts)
        counts[1] += accepted
        counts[2] += 1
        self.decode_steps_by_batch_size[1] += 1
        self._decode_tokens_total += seq.num_kv_tokens - start
        if self._prefix_caching and (seq.num_kv_tokens // self.block_size) > seq.num_stored_blocks:
            events += self._store_blocks(seq, batch.row_kv(0))
        if seq.finished:
            batch.remove([seq])
        if not outs:
            return []
        merged = EngineOutput(token_ids=[t for o in outs for t in o.token_ids], finish_reason=outs[-1].finish_reason,
                              num_cached_tokens=outs[0].num_cached_tokens)
        return [(seq, merged)]

    def spec_decode_metrics(self) -> SpecDecodeMetrics | None:
        """Prompt-lookup draft and accepted tokens and verify passes (None when speculation is off)."""
        if not self._spec_tokens:
            return None
        drafts, accepted, verifies = self._spec_counts
        return SpecDecodeMetrics(draft_tokens=drafts, accepted_tokens=accepted, verify_steps=verifies)

    def _forward(
        self, input_ids: torch.Tensor | None, positions: torch.Tensor, mask: torch.Tensor | None, past: LayerKv,
        inputs_embeds: torch.Tensor | None = None, num_logits: int = 1, adapters: list[_Sequence] = (),
    ) -> tuple[torch.Tensor, LayerKv]:
        """Run the model on ``input_ids`` ``[B, q]`` (or ``inputs_embeds`` ``[B, q, hidden]``)
        after ``past``; return last-position logits ``[B, vocab]`` (float32; with
        ``num_logits`` > 1 the last that many positions, ``[B, num_logits, vocab]``) and the
        grown per-layer KV. ``adapters``: the sequence of each row, whose ``lora_name``
        picks the row's LoRA adapter once any is loaded."""
        from transformers import DynamicCache

        cache = DynamicCache(config=self._model.config)
        for layer, (k, v) in zip(cache.layers, past):
            # Hand our tensors to the cache without the copy its update() would make.
            layer.lazy_initialization(k, v)
            layer.keys, layer.values = k, v
        model, lora = self._model, {}
        if self._peft is not None:
            model = self._peft
            lora = {"adapter_names": [s.request.lora_name or "__base__" for s in adapters]}
        out = model(
            **lora,
            input_ids=input_ids,
            inputs_embeds=inputs_embeds,
            position_ids=positions,
            attention_mask=mask,
            past_key_values=cache,
            use_cache=True,
            logits_to_keep=num_logits,
        )
        kv = [(layer.keys, layer.values) for layer in cache.layers]
        if num_logits > 1:
            return out.logits[:, -num_logits:, :].float(), kv
        return out.logits[:, -1, :].float(), kv

    def _sample(self, logits: torch.Tensor, seqs: list[_Sequence]) -> list[int]:
        """Next token per row of ``logits`` ``[B, vocab]``: argmax at temperature 0, else sampled
        with the request's own generator."""
        tokens = logits.argmax(dim=-1).tolist()
        for i, seq in enumerate(seqs):
            sp = seq.request.sampling
            if sp.temperature > 0:
                tokens[i] = _sample_row(logits[i], sp.temperature, sp.top_p, seq.generator)
        return tokens

    def _advance(self, seq: _Sequence, token: int) -> EngineOutput | None:
        """Append ``token`` to ``seq``, decide whether it finished, and build the output to send."""
        seq.token_ids.append(token)
        sampling = seq.request.sampling
        finish: FinishReason | None = None
        stopped_by_string = False
        if seq.stop_checker is not None:
            delta = seq.detok.add([token])
            seq.char_ends.append(None if seq.detok.has_pending else len(seq.detok.text))
            safe, stopped_by_string = seq.stop_checker.feed(delta)
            seq.safe_chars += len(safe)
            if stopped_by_string:
                finish = FinishReason.stop
        if finish is None and not sampling.ignore_eos and token in self._tokenizer.eos_token_ids:
            finish = FinishReason.stop
        if finish is None and (
            seq.num_output_tokens >= sampling.max_tokens or len(seq.token_ids) >= self._max_model_len
        ):
            finish = FinishReason.length
        if seq.stop_checker is None or (finish is not None and not stopped_by_string):
            upto = seq.num_output_tokens
        else:
            upto = self._tokens_within(seq, seq.safe_chars)
        tokens = seq.token_ids[seq.num_prompt_tokens + seq.num_sent : seq.num_prompt_tokens + upto]
        seq.num_sent = max(seq.num_sent, upto)
        if finish is not None:
            seq.finished = True
        if not tokens and finish is None:
            return None
        out = EngineOutput(token_ids=tokens, finish_reason=finish)
        if not seq.sent_first:
            out.num_cached_tokens = seq.num_cached_tokens
            seq.sent_first = True
        return out

    @staticmethod
    def _tokens_within(seq: _Sequence, limit_chars: int) -> int:
        """Largest output-token count whose text is complete and at most ``limit_chars`` long."""
        upto = seq.num_sent
        for j in range(seq.num_sent, len(seq.char_ends)):
            end = seq.char_ends[j]
            if end is None:
                continue
            if end > limit_chars:
                break
            upto = j + 1
        return upto

    def _store_blocks(self, seq: _Sequence, row_kv: list[tuple[torch.Tensor, torch.Tensor]]) -> list[KvEvent]:
        """Copy ``seq``'s newly completed full blocks into the prefix cache; return KV events.

        ``row_kv`` is the sequence's real KV per layer, each ``[kv_heads, n, head_dim]``.
        """
        num_full = seq.num_kv_tokens // self.block_size
        if num_full <= seq.num_stored_blocks or not self._prefix_caching:
            return []
        lora_name = seq.request.lora_name
        hashes = self._block_hashes(seq.token_ids[: num_full * self.block_size], seq.request)
        events: list[KvEvent] = []
        run: list[int] = []
        run_parent: int | None = None
        for i in range(seq.num_stored_blocks, num_full):
            if hashes[i] in self._cache:
                if run:
                    events.append(BlockStored(parent_block_hash=run_parent, block_hashes=run, lora_name=lora_name))
                    run = []
                continue
            if not run:
                run_parent = hashes[i - 1] if i > 0 else None
            start, end = i * self.block_size, (i + 1) * self.block_size
            block = torch.stack([torch.stack((k[:, start:end], v[:, start:end])) for k, v in row_kv])
            self._cache.insert(hashes[i], block, hashes[i - 1] if i else None)
            run.append(hashes[i])
        if run:
            events.append(BlockStored(parent_block_hash=run_parent, block_hashes=run, lora_name=lora_name))
        seq.num_stored_blocks = num_full
        self._cache.touch(hashes)
        self._evict(events)
        return events
