"""Optional engine capabilities, as small runtime-checkable protocols.

Every engine implements :class:`~kvflow.workers.engines.base.Engine`; some
can do more. The worker asks ``isinstance(engine, Capability)`` instead of
probing for attributes:

* :class:`DumpsKvEvents` — re-announce every cached block (KV dump requests);
* :class:`HasTokenizer` — carries the tokenizer the worker uses for prompts;
* :class:`ExposesKvLayout` — holds real KV bytes of a known block layout, so
  a prefill or decode worker sets up a KV transport for it;
* :class:`PrefillsAlone` — prefills a prompt and hands back its KV
  (disaggregated prefill stage);
* :class:`DecodesFromKv` — decodes from KV pulled from a prefill worker
  (disaggregated decode stage);
* :class:`Sleeps` — releases its KV cache (and weights, where it can) and
  reloads them (admin ``sleep``/``wake``, :mod:`kvflow.workers.admin`);
* :class:`ClearsKvCache` — drops every cached KV block (admin ``clear_kv``);
* :class:`ServesLora` — loads and unloads LoRA adapters that requests name
  (:mod:`kvflow.workers.lora`).

On Python 3.11 ``isinstance`` against a protocol with a property
(:class:`HasTokenizer`, :class:`ExposesKvLayout`) reads that property, so
check those on a started engine.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Protocol, runtime_checkable

if TYPE_CHECKING:
    from pathlib import Path

    from kvflow.schemas import KvEvent
    from kvflow.workers.engines.base import EngineOutput, GenerateRequest
    from kvflow.workers.kv.handoff import KvHandoff, KvLayout, PrefillResult
    from kvflow.models.tokenizer import Tokenizer

__all__ = ["DumpsKvEvents", "HasTokenizer", "ExposesKvLayout", "PrefillsAlone", "DecodesFromKv", "Sleeps",
           "ClearsKvCache", "ServesLora"]


@runtime_checkable
class DumpsKvEvents(Protocol):
    """An engine that can list its whole KV cache as events."""

    def dump_kv_events(self) -> list[KvEvent]:
        """A ``BlockStored`` event for every cached block, parents first."""
        ...


@runtime_checkable
class HasTokenizer(Protocol):
    """An engine that carries a tokenizer wrapper (:mod:`kvflow.models.tokenizer`).

    ``tokenizer`` may be None (the mocker without a tokenizer module); the
    worker then loads its configured tokenizer itself.
    """

    @property
    def tokenizer(self) -> Tokenizer | None:
        """The tokenizer wrapper, or None."""
        ...


@runtime_checkable
class ExposesKvLayout(Protocol):
    """An engine holding real KV bytes that can be transferred between workers."""

    @property
    def kv_layout(self) -> KvLayout:
        """Shape and dtype of one transferred KV block."""
        ...


@runtime_checkable
class PrefillsAlone(Protocol):
    """An engine that can run a prefill stage on its own (disaggregated serving)."""

    async def prefill(self, request: GenerateRequest) -> PrefillResult:
        """Prefill ``request`` only: its first token and its KV."""
        ...


@runtime_checkable
class DecodesFromKv(Protocol):
    """An engine that can decode from KV prefilled by another worker."""

    def generate_from_kv(self, request: GenerateRequest, handoff: KvHandoff) -> AsyncIterator[EngineOutput]:
        """Decode ``request`` from ``handoff``'s KV; yields outputs as ``generate``."""
        ...


@runtime_checkable
class Sleeps(Protocol):
    """An engine that can sleep: release its KV cache (emitting
    ``AllBlocksCleared``) and, at ``level`` 2 or where the platform can, its
    weights; and wake: reload them. The worker calls :meth:`sleep` only with
    no request in flight, and serves nothing until :meth:`wake_up`."""

    async def sleep(self, level: int) -> str:
        """Fall asleep; returns what was released, in words.

        Raises:
            kvflow.workers.engines.base.EngineError: requests are still running, or the engine failed.
        """
        ...

    async def wake_up(self) -> str:
        """Wake up; returns what was reloaded, in words."""
        ...


@runtime_checkable
class ClearsKvCache(Protocol):
    """An engine that can drop every cached KV block on request (prefix-cache reset)."""

    async def clear_kv_cache(self) -> tuple[bool, str]:
        """Drop every cached block and emit ``AllBlocksCleared``; returns
        ``(done, detail)``. Refused (``done`` False, nothing dropped) while
        requests hold blocks."""
        ...


@runtime_checkable
class ServesLora(Protocol):
    """An engine that serves LoRA adapters on its base model, named per request (``lora_name``)."""

    async def load_lora(self, name: str, path: Path) -> None:
        """Load the adapter directory ``path`` (``adapter_config.json`` + weights) as ``name``."""
        ...

    async def unload_lora(self, name: str) -> None:
        """Drop adapter ``name``; refused while requests use it."""
        ...
