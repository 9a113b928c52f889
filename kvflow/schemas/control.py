"""Commands to workers: request cancels (cancels topic) and engine admin (control topic).

A cancel is a command (imperative name, like :class:`KvDumpRequest`): the
producer does not know which worker holds the request, so every worker reads
every cancel and acts only on the request ids it holds.

The control topic carries engine lifecycle commands addressed to one worker
(:class:`AdminCommand`: sleep, wake, clear its KV cache) and the worker's
answer to each (:class:`AdminCommandApplied`), keyed by worker id. Every
worker reads the whole topic from its end at start-up and acts only on
commands naming it; ``kvflow admin`` produces a command and waits for the
answer with the same ``command_id``. What each action does is documented on
:class:`AdminAction`.
"""

from __future__ import annotations

from enum import Enum
from typing import Annotated, Literal, Union

from pydantic import Field

from kvflow.schemas.base import Record

__all__ = ["CancelReason", "CancelRequest", "AdminAction", "AdminCommand", "AdminCommandApplied", "ControlRecord"]


class CancelReason(str, Enum):
    """Why a request is cancelled.

    ``client_disconnected``: the HTTP client closed its connection before the
    final response (sent by the bridge). ``client_cancelled``: a client asked
    explicitly (``KvflowClient.cancel``). ``deadline_exceeded``: the
    request's ``deadline_ms`` passed before its final response (sent by the
    client or bridge that gave up on it); the worker ends it with a
    ``deadline_exceeded`` error instead of ``abort``.
    """

    client_disconnected = "client_disconnected"
    client_cancelled = "client_cancelled"
    deadline_exceeded = "deadline_exceeded"


class CancelRequest(Record):
    """Stop generating ``request_id`` and free its KV blocks.

    The worker holding the request aborts it in its engine and publishes a
    :class:`~kvflow.schemas.responses.FinalResponse` with ``finish_reason``
    ``abort`` to the request's ``reply_to``; every other worker ignores it.
    A cancel of an unknown or finished request changes nothing.

    ``requested_by`` names the producer (``bridge:<slot>``,
    ``client:<slot>``); ``ts_ms`` is when it was produced (epoch ms).
    """

    request_id: str = Field(min_length=1, max_length=256)
    reason: CancelReason
    requested_by: str = Field(min_length=1, max_length=256)
    ts_ms: int = Field(ge=0)


class AdminAction(str, Enum):
    """An engine lifecycle action on one worker.

    ``sleep``: the worker stops being routable (its heartbeats say
    ``sleeping``), finishes the requests it holds, then puts its engine to
    sleep, releasing the KV cache (an ``AllBlocksCleared`` KV event follows,
    so routers drop its blocks) and, where the engine can, the weights
    (``level`` 2; level 1 keeps them in host memory). ``wake``: the engine
    reloads what sleep released and the worker is routable again.
    ``clear_kv``: the engine drops every cached KV block (prefix cache
    reset) and emits ``AllBlocksCleared``; it is refused while requests hold
    blocks, as vLLM's prefix-cache reset is.
    ``load_lora``: fetch the LoRA adapter at ``lora_uri`` and load it as
    ``lora_name`` (:mod:`kvflow.workers.lora`); the worker's heartbeats then
    list it, requests whose ``model`` is ``lora_name`` become routable to it,
    and every worker that reads the command remembers the URI, so one picked
    for an adapter it lacks loads it on demand. ``unload_lora``: drop
    ``lora_name`` (refused while requests use it). ``list_lora``: change
    nothing. All three answer with the worker's loaded adapters.
    """

    sleep = "sleep"
    wake = "wake"
    clear_kv = "clear_kv"
    load_lora = "load_lora"
    unload_lora = "unload_lora"
    list_lora = "list_lora"


class AdminCommand(Record):
    """Apply ``action`` to worker ``worker_id``.

    ``command_id`` is chosen by the producer and echoed in the
    :class:`AdminCommandApplied` answer. ``level`` is the sleep level (1:
    drop the KV cache and move the weights to host memory, 2: drop both; vLLM's
    sleep levels), ignored by other actions. ``lora_name``/``lora_uri`` name
    the adapter of ``load_lora`` (both) and ``unload_lora`` (the name).
    ``requested_by`` names the
    producer (``cli:<host>:<pid>``); ``ts_ms`` is when it was produced (epoch ms).
    """

    type: Literal["command"] = "command"
    command_id: str = Field(min_length=1, max_length=256)
    worker_id: str = Field(min_length=1, max_length=256)
    action: AdminAction
    level: int = Field(default=1, ge=1, le=2)
    lora_name: str | None = Field(default=None, min_length=1, max_length=256)
    lora_uri: str | None = Field(default=None, min_length=1, max_length=4096)
    requested_by: str = Field(default="", max_length=256)
    ts_ms: int = Field(ge=0)


class AdminCommandApplied(Record):
    """A worker's answer to :class:`AdminCommand` ``command_id``.

    ``ok`` is False when the worker could not apply it; ``detail`` says what
    happened in either case (for sleep/wake: what the engine released or
    reloaded; for a refused ``clear_kv``: why). ``duration_ms`` is the time
    from receiving the command to this answer; ``ts_ms`` epoch ms.
    ``lora_adapters``: the worker's loaded LoRA adapters after a LoRA
    action (None for the others).
    """

    type: Literal["applied"] = "applied"
    command_id: str = Field(min_length=1, max_length=256)
    worker_id: str = Field(min_length=1, max_length=256)
    action: AdminAction
    ok: bool
    detail: str = ""
    lora_adapters: list[str] | None = None
    duration_ms: int = Field(default=0, ge=0)
    ts_ms: int = Field(ge=0)


ControlRecord = Annotated[Union[AdminCommand, AdminCommandApplied], Field(discriminator="type")]
"""Any record of the control topic, told apart by ``type``."""
