"""Sleep, wake and KV-cache reset for the ``vllm`` engine (kvflow's admin commands).

They map onto ``AsyncLLM``'s own calls:

* sleep → ``AsyncLLM.sleep(level)``: vLLM pauses its scheduler, resets the
  prefix cache (its KV event publisher emits ``AllBlocksCleared``, which
  the engine's subscriber forwards) and asks its workers to sleep. With
  sleep mode on (``enable_sleep_mode``, which :func:`sleep_mode_args` sets
  where vLLM's platform supports it: CUDA, ROCm, XPU), level 1 moves the
  weights to host memory and discards the KV cache, level 2 discards both.
  vLLM's CPU platform has no sleep mode: its worker ignores the call, so
  on a CPU host sleep pauses the scheduler and empties the prefix cache but
  the weights and the KV tensor stay allocated (the closest vLLM offers
  there; the reply says so).
* wake → ``AsyncLLM.wake_up()``: reload (sleep mode) and resume scheduling.
* clear KV → ``AsyncLLM.reset_prefix_cache()``: vLLM refuses (returns
  False) while running requests hold blocks; on success its publisher emits
  ``AllBlocksCleared``.

vLLM queues the ``AllBlocksCleared`` of a reset with the events of its next
engine step, which an idle or sleeping engine does not take; so after a
reset (and a sleep) the engine announces the clear itself at once
(:func:`announce_cleared`). The later copy from vLLM clears nothing more.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

from kvflow.workers.engines.base import EngineError
from kvflow.workers.engines.vllm_kv_events import VllmAllBlocksCleared, VllmEventBatch

if TYPE_CHECKING:
    from kvflow.workers.engines.vllm import VllmEngine

__all__ = ["sleep_mode_args", "sleep", "wake_up", "clear_kv_cache", "announce_cleared"]


def sleep_mode_args() -> dict[str, Any]:
    """``{"enable_sleep_mode": True}`` where vLLM's platform supports sleep mode, else ``{}``
    (vLLM refuses the flag on other platforms). Needs vLLM importable."""
    from vllm.platforms import current_platform

    return {"enable_sleep_mode": True} if current_platform.is_sleep_mode_available() else {}


def announce_cleared(engine: VllmEngine) -> None:
    """Emit ``AllBlocksCleared`` now, through the engine's KV event translator
    (which forgets its blocks too, so a resync dump is empty)."""
    if engine.kv_subscriber is None:
        return
    batch = VllmEventBatch(ts=time.time(), events=(VllmAllBlocksCleared(),))
    engine.emit_kv_events(engine.kv_subscriber.translator.translate(batch))


def _llm(engine: VllmEngine) -> Any:
    if engine.llm is None:
        raise EngineError("vllm engine is not started")
    return engine.llm


def _sleep_mode(llm: Any) -> bool:
    return bool(getattr(llm.vllm_config.model_config, "enable_sleep_mode", False))


async def sleep(engine: VllmEngine, level: int) -> str:
    """``AsyncLLM.sleep(level)``; returns what was released (see the module docstring).

    Raises:
        EngineError: the engine is not started.
    """
    llm = _llm(engine)
    await llm.sleep(level)
    announce_cleared(engine)
    if _sleep_mode(llm):
        released = ("weights moved to host memory, KV cache discarded" if level == 1
                    else "weights and KV cache discarded")
    else:
        released = "weights and KV memory stay allocated: vLLM has no sleep mode on this platform"
    return f"vLLM sleep level {level}: scheduler paused, prefix cache reset; {released}"


async def wake_up(engine: VllmEngine) -> str:
    """``AsyncLLM.wake_up()``; returns what was reloaded.

    Raises:
        EngineError: the engine is not started, or vLLM did not wake fully.
    """
    llm = _llm(engine)
    if not await llm.wake_up():
        raise EngineError("vLLM did not wake up fully")
    return "vLLM awake: " + ("weights and KV cache reloaded, " if _sleep_mode(llm) else "") + "scheduler resumed"


async def clear_kv_cache(engine: VllmEngine) -> tuple[bool, str]:
    """``AsyncLLM.reset_prefix_cache()``: ``(True, ...)`` when vLLM reset it, ``(False, ...)`` when it refused.

    Raises:
        EngineError: the engine is not started.
    """
    if await _llm(engine).reset_prefix_cache():
        announce_cleared(engine)
        return True, "vLLM prefix cache reset"
    return False, "refused by vLLM: running requests hold KV blocks"
