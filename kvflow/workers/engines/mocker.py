"""The ``mocker`` engine: :class:`MockerCore` run live on the event loop.

One asyncio task owns the core and loops: ``core.step()``, sleep the step's
simulated duration, then hand each request its tokens and the step's KV
events to :meth:`Engine.emit_kv_events`. Tokens thus arrive at the times a
real engine with Dynamo's timing model would produce them. Requests added
during a sleep join at the next step, as they would on a GPU busy with the
current batch. ``sleep`` is injectable so tests can run faster than real time.

On the wall clock, back-to-back steps are paced by :class:`StepClock`: a
step ends its modelled duration after the previous step's end, so the
core's own Python time and the event loop's lateness (the worker also
decodes fetches, detokenizes and produces deltas on that loop) do not add
to every step. A real engine's steps do not wait for the worker's loop
either (vLLM's engine core runs in its own process).

With ``output_interval_s`` > 0 (a worker passes its delta flush period) the
engine instead wakes for first tokens, finishes, arrivals, aborts and ticks
of that period, computing the steps in between when it wakes
(:mod:`kvflow.workers.engines.mocker_delivery`): first tokens and finishes
keep their times, other tokens reach the worker up to one interval late
and merged, and the loop wakes about once per interval instead of once per
step.

Disaggregated serving: :meth:`MockerEngine.prefill` runs a request with
``max_tokens = 1`` and reports the KV size a real transfer would move
(``ISL × kv_bytes_per_token``); no bytes exist. :meth:`MockerEngine.generate_from_kv`
sleeps the simulated transfer of the prompt tokens not in its own prefix
cache (:func:`~kvflow.workers.engines.mocker_core.kv_transfer_time_ms`,
divided by ``speedup_ratio``), streams the prefill's first token, then
decodes in the core from token 1 (``kv_imported``).

Admin: :meth:`MockerEngine.clear_kv_cache` resets the block pool when no
request holds blocks (``AllBlocksCleared``); :meth:`MockerEngine.sleep` does
the same and then refuses requests until :meth:`MockerEngine.wake_up` (the
mocker has no weights to release).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import importlib
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import fields

from kvflow.aio import cancel_and_wait
from kvflow.schemas import FinishReason, KvEvent, KvTierMetrics, SpecDecodeMetrics
from kvflow.workers.engines.base import (
    Engine,
    EngineConfig,
    EngineError,
    EngineOutput,
    GenerateRequest,
    KvStats,
)
from kvflow.workers.engines.mocker_core import MockerConfig, MockerCore, StepResult, kv_transfer_time_ms
from kvflow.workers.engines.mocker_delivery import StepDelivery
from kvflow.workers.kv.handoff import KvHandoff, PrefillResult
from kvflow.workers.kv.tiers import tier_metrics

__all__ = ["MockerEngine", "StepClock", "MAX_CATCH_UP_S"]

Sleep = Callable[[float], Awaitable[None]]

MAX_CATCH_UP_S = 0.02
"""Most lateness of the event loop a step makes up, seconds. A longer stall
(a GC pause, a starved process) is not made up in a burst of short steps:
the next step starts when it is computed. 20 ms is about two decode steps
of the default timing model. A request that arrives while the loop is late
joins the step that makes up the lateness, so it may gain up to this much
on a real engine, where it would wait for the following step."""


@dataclasses.dataclass
class StepClock:
    """Wall-clock pacing of a mocker's back-to-back steps.

    A modelled step starts where the previous one ended, as a GPU's next
    step would, unless the step is computed more than ``max_catch_up_s``
    after that end or the engine was idle in between; then it starts when
    computed. Times are :func:`time.monotonic` seconds.
    """

    max_catch_up_s: float = MAX_CATCH_UP_S
    end_s: float | None = None
    """End of the last step; None after :meth:`idle` (nothing to follow)."""

    def next_end(self, computed_s: float, duration_s: float) -> float:
        """End of a step of ``duration_s`` seconds computed at ``computed_s``."""
        start = computed_s
        if self.end_s is not None and computed_s - self.end_s <= self.max_catch_up_s:
            start = self.end_s
        self.end_s = start + duration_s
        return self.end_s

    def idle(self) -> None:
        """The engine ran out of work: the next step starts when computed."""
        self.end_s = None


def _load_bytes_tokenizer():
    """The byte-level tokenizer if :mod:`kvflow.models.tokenizer` exists, else None."""
    try:
        module = importlib.import_module("kvflow.models.tokenizer")
    except ImportError:
        return None
    return module.load_tokenizer("bytes")


class MockerEngine(Engine):
    """Simulated engine: real scheduling, KV blocks and KV events; no weights.

    Args:
        config: simulation settings; defaults to :class:`MockerConfig` defaults.
        worker_id: name handed to the core.
        model_name: reported model name.
        tokenizer: tokenizer spec (``bytes``, or a local HF model directory
            for prompt lengths and output text in that model's tokens).
        sleep: awaited with each step's duration in seconds; None (the
            default) sleeps on the wall clock, steps paced by a :class:`StepClock`.
        output_interval_s: with ``sleep`` None, > 0 wakes the engine for first
            tokens, finishes, arrivals and ticks of this period only
            (:class:`~kvflow.workers.engines.mocker_delivery.StepDelivery`);
            0 (the default) delivers every step at its end.

    Raises:
        ValueError: ``output_interval_s`` < 0.

    ``tokenizer`` is the byte-level tokenizer from
    ``kvflow.models.tokenizer.load_tokenizer("bytes")``, or None when that
    module is absent. Media items (:attr:`GenerateRequest.media`) are taken
    for their block hashes only: their embeddings are not read.
    """

    name = "mocker"
    accepts_media = True

    def __init__(
        self,
        config: MockerConfig | None = None,
        *,
        worker_id: str = "mocker",
        model_name: str = "mocker",
        sleep: Sleep | None = None,
        tokenizer: str = "bytes",
        output_interval_s: float = 0.0,
    ) -> None:
        if output_interval_s < 0:
            raise ValueError(f"output_interval_s must be >= 0, got {output_interval_s}")
        self.config = config or MockerConfig()
        self.core = MockerCore(self.config, worker_id)
        self._delivery = StepDelivery(self.core, output_interval_s) if output_interval_s > 0 and sleep is None \
            else None
        self.block_size = self.config.block_size
        self.model_name = model_name
        if tokenizer == "bytes":
            self.tokenizer = _load_bytes_tokenizer()
            # Served output must decode to readable text with the byte tokenizer:
            # core ids are folded onto the ids of lowercase letters and space.
            self._text_ids = (self.tokenizer.encode_prompt("abcdefghijklmnopqrstuvwxyz ")
                              if self.tokenizer is not None else None)
        else:
            # A real model's tokenizer: prompt lengths match the model's, and
            # output ids are folded into its vocabulary (they decode to words).
            from kvflow.models.tokenizer import load_tokenizer

            self.tokenizer = load_tokenizer(tokenizer)
            self._text_ids = range(min(self.config.vocab_size, self.tokenizer.vocab_size))
        self._sleep = sleep
        self._clock = StepClock()
        self._queues: dict[str, asyncio.Queue[EngineOutput]] = {}
        self._wake = asyncio.Event()
        self._task: asyncio.Task | None = None
        self._in_flight: StepResult | None = None  # the step being slept through
        self.asleep = False  # admin sleep: requests are refused until wake_up()

    @classmethod
    def from_engine_config(cls, config: EngineConfig, **kwargs) -> MockerEngine:
        """Build from the common :class:`EngineConfig`.

        ``block_size``, ``num_kv_blocks``, ``max_batch_size`` (as
        ``max_num_seqs``) and ``max_num_batched_tokens`` carry over; keys of
        ``config.extra`` named like :class:`MockerConfig` fields override the
        rest. Unless ``extra`` sets ``vocab_size``, it is the byte
        tokenizer's vocabulary size (when that tokenizer exists), so every
        output id decodes to text. Other keyword arguments go to the
        constructor.

        Raises:
            ValueError: an ``extra`` key is not a MockerConfig field, or a value is invalid.
        """
        known = {f.name for f in fields(MockerConfig)}
        unknown = set(config.extra) - known
        if unknown:
            raise ValueError(f"unknown mocker settings: {sorted(unknown)}")
        values = {
            "block_size": config.block_size,
            "num_kv_blocks": config.num_kv_blocks,
            "max_num_seqs": config.max_batch_size,
            "max_num_batched_tokens": config.max_num_batched_tokens,
            **config.extra,
        }
        tokenizer = _load_bytes_tokenizer()
        if "vocab_size" not in values and tokenizer is not None:
            values["vocab_size"] = tokenizer.vocab_size
        kwargs.setdefault("model_name", config.model)
        return cls(MockerConfig(**values), **kwargs)

    # ---- lifecycle -------------------------------------------------------

    async def start(self) -> None:
        """Start the step loop (idempotent)."""
        if self._task is None or self._task.done():
            loop = self._step_loop() if self._delivery is None else self._delivery_loop(self._delivery)
            self._task = asyncio.create_task(loop, name="mocker-step-loop")

    async def stop(self) -> None:
        """Stop the step loop; pending generations end with ``abort``."""
        await cancel_and_wait(self._task)
        self._task = None
        if self._delivery is not None:
            self._delivery.clear()
        for request_id in list(self._queues):
            self.core.abort(request_id)
            self._queues.pop(request_id).put_nowait(EngineOutput([], FinishReason.abort))

    async def _step_loop(self) -> None:
        core = self.core
        while True:
            if not core.has_work():
                await self._idle()
                continue
            # The wall clock ages the KV tiers' reuse frequencies (idle time included).
            computed_s = time.monotonic()
            result = core.step(now_ms=computed_s * 1000.0)
            if not result.outputs and result.duration_ms == 0.0:
                # Nothing could be scheduled; wait for a new request or an abort.
                await self._idle()
                continue
            self._in_flight = result
            try:
                if self._sleep is None:
                    end_s = self._clock.next_end(computed_s, result.duration_ms / 1000.0)
                    await asyncio.sleep(max(0.0, end_s - time.monotonic()))
                else:
                    await self._sleep(result.duration_ms / 1000.0)
            finally:
                self._in_flight = None
            self._hand_over((result.outputs, result.kv_events))

    def _hand_over(self, delivered: tuple[dict[str, EngineOutput], list[KvEvent]]) -> None:
        """Put each output on its request's queue (dropped if the request is gone), then emit the KV events."""
        outputs, events = delivered
        for request_id, output in outputs.items():
            queue = self._queues.get(request_id)
            if queue is not None:
                queue.put_nowait(output)
                if output.finish_reason is not None:
                    del self._queues[request_id]
        self.emit_kv_events(events)

    async def _idle(self) -> None:
        self._clock.idle()
        self._wake.clear()
        await self._wake.wait()

    async def _delivery_loop(self, delivery: StepDelivery) -> None:
        loop = asyncio.get_running_loop()
        while True:
            self._hand_over(delivery.advance(time.monotonic()))
            wake_at = delivery.next_wake()
            self._wake.clear()
            timer = None
            if wake_at is not None:  # from the clock now: handing over takes a while
                timer = loop.call_later(max(0.0, wake_at - time.monotonic()), self._wake.set)
            try:
                await self._wake.wait()  # the timer, or a request entering or leaving
            finally:
                if timer is not None:
                    timer.cancel()

    # ---- requests ------------------------------------------------------

    async def generate(self, request: GenerateRequest) -> AsyncIterator[EngineOutput]:
        """Serve ``request``: one output per step, the last with ``finish_reason``.

        Leaving the iteration early aborts the request.

        Raises:
            EngineError: the engine is not started, or the core rejects the
                request (empty prompt, duplicate id, larger than the KV pool).
        """
        self._check_new(request)
        async with contextlib.aclosing(self._relay(request, kv_imported=False)) as outputs:
            async for output in outputs:
                yield output

    def _check_new(self, request: GenerateRequest) -> None:
        if self._task is None or self._task.done():
            raise EngineError("mocker engine is not started")
        if self.asleep:
            raise EngineError("mocker engine is asleep")
        if request.request_id in self._queues:
            raise EngineError(f"request {request.request_id} is already in flight")

    async def prefill(self, request: GenerateRequest) -> PrefillResult:
        """Prefill only (disaggregated serving): run ``request`` for one token.

        Returns the first token (as served, i.e. mapped to text ids), the
        prefix-cache hit, and ``num_kv_bytes = ISL × kv_bytes_per_token``
        (``kv`` is None: the mocker has no KV bytes).

        Raises:
            EngineError: as :meth:`generate`, or the request was aborted.
        """
        one = dataclasses.replace(request, sampling=request.sampling.model_copy(update={"max_tokens": 1}))
        outputs = [out async for out in self.generate(one)]
        last = outputs[-1]
        if last.finish_reason is FinishReason.abort or not last.token_ids:
            raise EngineError(f"{request.request_id}: aborted before its prefill ran")
        num_prompt = len(request.prompt_token_ids)
        return PrefillResult(first_token_id=last.token_ids[0], num_prompt_tokens=num_prompt,
                             num_cached_tokens=outputs[0].num_cached_tokens,
                             num_kv_bytes=num_prompt * self.config.kv_bytes_per_token)

    async def generate_from_kv(self, request: GenerateRequest, handoff: KvHandoff) -> AsyncIterator[EngineOutput]:
        """Decode ``request`` after a (simulated) KV transfer from a prefill worker.

        Sleeps the modelled transfer of the prompt tokens not cached here,
        records it in ``handoff.stats``, releases the source, yields
        ``handoff.first_token_id`` (reporting the reused tokens as
        ``num_cached_tokens``), then the core's tokens 1, 2, ... Leaving the
        iteration early aborts the request.

        Raises:
            EngineError: as :meth:`generate`.
        """
        self._check_new(request)
        cfg = self.config
        num_prompt = len(request.prompt_token_ids)
        reused = self.core.cached_prompt_tokens(request)
        moved = num_prompt - reused
        duration_ms = kv_transfer_time_ms(cfg, moved) / cfg.speedup_ratio
        await (self._sleep or asyncio.sleep)(duration_ms / 1000.0)
        num_blocks = -(-num_prompt // cfg.block_size)
        handoff.record_simulated(moved * cfg.kv_bytes_per_token, duration_ms,
                                 num_blocks - reused // cfg.block_size, reused // cfg.block_size)
        await handoff.release()
        if request.sampling.max_tokens <= 1:
            yield EngineOutput([handoff.first_token_id], FinishReason.length, reused)
            return
        self._check_new(request)
        yield EngineOutput([handoff.first_token_id], None, reused)
        async with contextlib.aclosing(self._relay(request, kv_imported=True)) as outputs:
            async for output in outputs:
                yield output

    async def _relay(self, request: GenerateRequest, *, kv_imported: bool) -> AsyncIterator[EngineOutput]:
        """Add ``request`` to the core and yield its outputs (token ids mapped to text ids)."""
        if self._delivery is None:
            self.core.add_request(request, kv_imported=kv_imported)
        else:
            self._hand_over(self._delivery.add(request, time.monotonic(), kv_imported=kv_imported))
        queue: asyncio.Queue[EngineOutput] = asyncio.Queue()
        self._queues[request.request_id] = queue
        self._wake.set()
        finished = False
        try:
            while not finished:
                output = await queue.get()
                finished = output.finish_reason is not None
                if self._text_ids is not None:
                    output.token_ids = [self._text_ids[t % len(self._text_ids)] for t in output.token_ids]
                yield output
        finally:
            if not finished:
                self._queues.pop(request.request_id, None)
                self._abort_in_core(request.request_id)

    async def abort(self, request_id: str) -> None:
        """Stop ``request_id``; its iterator ends with an ``abort`` output."""
        queue = self._queues.pop(request_id, None)
        if queue is not None:
            queue.put_nowait(EngineOutput([], FinishReason.abort))
        self._abort_in_core(request_id)
        self._wake.set()

    def _abort_in_core(self, request_id: str) -> None:
        if self._delivery is None:
            self.core.abort(request_id)
        else:  # catches up first; held outputs of request_id are dropped (its queue is gone)
            self._hand_over(self._delivery.abort(request_id, time.monotonic()))

    def kv_stats(self) -> KvStats:
        """KV usage and queue lengths from the core; prefill work counts the step in flight."""
        if self._delivery is not None:
            now = time.monotonic()
            self._hand_over(self._delivery.advance(now))
            return self.core.stats(self._delivery.in_flight(now))
        return self.core.stats(self._in_flight)

    def dump_kv_events(self) -> list[KvEvent]:
        """``BlockStored`` events for every cached block, every tier (for a KV resync).

        With ``output_interval_s``, steps computed but not delivered yet emit
        their KV events first, so none follows the snapshot that covers it."""
        if self._delivery is not None:
            self._hand_over(self._delivery.advance(time.monotonic()))
            self.emit_kv_events(self._delivery.take_held_events())
        return self.core.dump_kv_events()

    def kv_tier_metrics(self) -> KvTierMetrics | None:
        """The core's modelled G2/G3 counters (None without tiers)."""
        return tier_metrics(self.core.tiers) if self.core.tiers is not None else None

    def spec_decode_metrics(self) -> SpecDecodeMetrics | None:
        """The core's modelled draft and accepted tokens (None when ``spec_num_draft_tokens`` is 0)."""
        core = self.core
        if not core.config.spec_num_draft_tokens:
            return None
        return SpecDecodeMetrics(draft_tokens=core.spec_draft_tokens, accepted_tokens=core.spec_accepted_tokens,
                                 verify_steps=core.spec_verify_steps)

    # ---- admin -----------------------------------------------------------

    def _busy(self) -> str | None:
        """Why the pool cannot be reset now, or None: requests hold blocks, or
        a step is being slept through (its KV events are not emitted yet)."""
        if self.core.has_work():
            return f"{len(self._queues) or 'some'} request(s) hold KV blocks"
        if self._in_flight is not None or (self._delivery is not None and self._delivery.holding):
            return "a step is running"
        return None

    def _reset_pool(self) -> int:
        """Drop every cached block now, host and disk tiers too (``AllBlocksCleared`` covers
        every tier). Returns the device blocks dropped."""
        dropped = self.core.pool.num_cached_blocks
        self.core.pool.reset()
        if self.core.tiers is not None:
            self.core.tiers.clear()
            self.core.tiers.take_events()  # AllBlocksCleared already tells consumers
        self.emit_kv_events(self.core.pool.take_events())
        return dropped

    async def clear_kv_cache(self) -> tuple[bool, str]:
        """Reset the prefix cache (``AllBlocksCleared``) unless requests hold blocks."""
        busy = self._busy()
        if busy is not None:
            return False, f"refused: {busy}"
        return True, f"dropped {self._reset_pool()} cached KV block(s)"

    async def sleep(self, level: int) -> str:
        """Drop the KV cache (``AllBlocksCleared``) and refuse requests until :meth:`wake_up`.

        Raises:
            EngineError: requests hold blocks or a step is running.
        """
        busy = self._busy()
        if busy is not None:
            raise EngineError(f"cannot sleep: {busy}")
        dropped = self._reset_pool()
        self.asleep = True
        return f"level {level}: dropped {dropped} cached KV block(s); the mocker holds no weights"

    async def wake_up(self) -> str:
        """Serve requests again (the KV cache starts empty)."""
        self.asleep = False
        return "serving again with an empty KV cache"
