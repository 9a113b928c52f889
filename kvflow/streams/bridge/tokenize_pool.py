"""Prompt tokenizing in child processes, away from the bridge's interpreter lock.

The bridge shares its process with the router in ``kvflow up``, and its event
loop streams every token of every response, so its interpreter lock is busy
under load. Tokenizing in threads of that process makes them wait for the
lock, and the router's hops wait behind them: on the synthetic long-prompt
trace under AIPerf on a busy 2-core host (docs/benchmarks.md, "2026-11-28,
later: paced mocker steps, tokenizing in processes of their own") TTFT p99
was 1,483 ms with threads and 1,010 ms with two child processes, the bridge →
router hop's p99 193 and 64 ms; on a calmer host the two were level and the
children cost some CPU (their encoding and the pipes).

A :class:`TokenizePool` runs the chat template and the encoding in
``processes`` children (:mod:`kvflow.streams.bridge.tokenize_worker`, started
with ``python -m``, so nothing of the bridge's main module, threads or
sockets is inherited). A child holds one job at a time; the others wait in
the bridge, in arrival order, for the first child that answers. A short
prompt (``INLINE_CHARS`` or fewer characters) that finds every child busy is
encoded at once in a thread of the bridge's own process instead of waiting.
Bursts mix sizes: on the Mooncake slice up to 16 prompts of 900 to 120,000
tokens arrive at once, and when each job went straight to the child with the
fewest characters in flight, 67 of 93 prompts under 20,000 characters found
a job ahead of them in their child and waited 171 ms for an answer (median)
where their own encoding took 7 (docs/benchmarks.md, "Short prompts do not
wait for long ones").
Jobs and answers travel as frames on the children's stdin and stdout, read by
one asyncio task per child: no thread of the bridge is involved. Only Hugging
Face tokenizers go there (:func:`pooled`): the byte tokenizer of the mocker
is cheaper than the trip.

Each child loads a spec the first time a job names it (:meth:`TokenizePool.warm`
sends every child a load ahead of requests) and keeps its own chunk cache
(:mod:`kvflow.models.chunked_encode`); the characters each answer took from
that cache and encoded are counted in :attr:`TokenizePool.chunk_chars`. A
chat template that rejects a conversation raises :class:`jinja2.TemplateError`
in the caller, as it would in a thread. Any other failure (a child that died or
cannot start, an error inside it) makes the caller tokenize in a thread of
its own process, so no request is lost to the pool; after a child died the
pool is left alone for ``RETRY_AFTER_S``.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import math
import pickle
import sys
import time
from array import array
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from kvflow.aio import wait_or_kill
from kvflow.streams.bridge.tokenize_worker import HEADER, frame

__all__ = ["TokenizePool", "pooled", "job_chars", "RETRY_AFTER_S", "INLINE_CHARS", "TokenizePoolError"]

log = logging.getLogger(__name__)

RETRY_AFTER_S = 30.0
"""After a child of the pool dies (or cannot start), prompts are tokenized in
the bridge's own process for this long before new children are started, so a
pool that cannot start does not cost a process start per request."""


INLINE_CHARS = 16_384
"""Prompts of at most this many characters (~4,000 tokens of English, ~5 ms
of encoding with ``tokenizers``, ~1.5 with ``tiktoken``) are encoded in a
thread of the bridge's process when no child is free, rather than waiting
for a child to finish a long prompt."""


class TokenizePoolError(RuntimeError):
    """A job the pool could not answer (its child died, or failed inside)."""


def pooled(spec: str) -> bool:
    """Whether a :class:`TokenizePool` serves ``spec`` (every spec but the byte tokenizer)."""
    return spec != "bytes"


@dataclass
class _Child:
    proc: asyncio.subprocess.Process
    pending: dict[int, asyncio.Future] = field(default_factory=dict)
    reader: asyncio.Task | None = None


@dataclass
class _Job:
    job_id: int
    work: tuple[str, str, Any]
    """(spec, kind, payload), as the child reads them."""
    future: asyncio.Future


def job_chars(kind: str, payload: Any) -> int:
    """Prompt characters of one job (``kind`` ``"chat"``: the turns' contents;
    ``"prompt"``: the text; anything else 0), the pool's measure of its work."""
    if kind == "prompt":
        return len(payload)
    if kind == "chat":
        return sum(len(c) if isinstance(c := turn.get("content"), str) else len(str(c or "")) for turn in payload)
    return 0


class TokenizePool:
    """``processes`` child processes that tokenize prompts for one bridge.

    The children start on the first job or :meth:`warm`. Call :meth:`close`
    when the bridge stops.

    Raises:
        ValueError: ``processes`` < 1.
    """

    def __init__(self, processes: int = 1) -> None:
        if processes < 1:
            raise ValueError(f"a tokenize pool needs at least one process, not {processes}")
        self.processes = processes
        self._children: list[_Child] = []
        self._starting: asyncio.Task | None = None
        self._ids = itertools.count()
        self.chunk_chars: dict[str, list[int]] = {}
        """Per spec, [characters from the children's chunk caches, characters encoded]."""
        self.fallbacks = 0
        """Jobs tokenized in the caller's process instead: the pool failed them,
        or a child had died less than ``RETRY_AFTER_S`` before."""
        self.inline = 0
        """Short prompts encoded in the caller's process because every child was busy."""
        self.answered = 0
        """Jobs a child answered with ids (loads not counted)."""
        self._waiting: deque[_Job] = deque()
        self._broken_until = -math.inf

    def pids(self) -> list[int]:
        """Process ids of the running children."""
        return [c.proc.pid for c in self._children if c.proc.returncode is None]

    async def _start(self) -> None:
        for _ in range(self.processes - len(self._children)):
            proc = await asyncio.create_subprocess_exec(
                sys.executable, "-m", "kvflow.streams.bridge.tokenize_worker",
                stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE)
            child = _Child(proc)
            child.reader = asyncio.create_task(self._read(child), name=f"kvflow-tokenize-{proc.pid}")
            self._children.append(child)

    async def _ready(self) -> list[_Child]:
        if len(self._children) < self.processes:
            if self._starting is None or self._starting.done():
                self._starting = asyncio.create_task(self._start())
            await asyncio.shield(self._starting)
        return self._children

    async def _read(self, child: _Child) -> None:
        """Resolve ``child``'s jobs from its answers; when it ends, fail the rest."""
        stream = child.proc.stdout
        try:
            while True:
                head = await stream.readexactly(HEADER.size)
                job_id, status, value, hit, miss = pickle.loads(await stream.readexactly(HEADER.unpack(head)[0]))
                future = child.pending.pop(job_id, None)
                if future is not None and not future.done():
                    future.set_result((status, value, hit, miss))
                self._dispatch()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass  # the child exited
        finally:
            self._lost(child)

    def _lost(self, child: _Child) -> None:
        if child in self._children:
            self._children.remove(child)
            self._broken_until = time.monotonic() + RETRY_AFTER_S
            log.warning("tokenize pool: child %d ended (exit code %s); tokenizing in the bridge's process "
                        "for %.0f s", child.proc.pid, child.proc.returncode, RETRY_AFTER_S)
        for future in child.pending.values():
            if not future.done():
                future.set_exception(TokenizePoolError(f"tokenize child {child.proc.pid} ended"))
        child.pending.clear()
        if not self._children:  # nobody left to take the waiting jobs: their callers tokenize them
            waiting, self._waiting = self._waiting, deque()
            for job in waiting:
                if not job.future.done():
                    job.future.set_exception(TokenizePoolError("no tokenize child is running"))
        else:
            self._dispatch()

    def _free(self) -> list[_Child]:
        """The running children that hold no job."""
        return [c for c in self._children if not c.pending and c.proc.returncode is None]

    def _next_job(self) -> _Job | None:
        """Take the oldest waiting job whose caller still waits; None if none does."""
        while self._waiting:
            job = self._waiting.popleft()
            if not job.future.done():  # else its caller was cancelled (e.g. the client left)
                return job
        return None

    def _dispatch(self) -> None:
        """Give each free child the next waiting job."""
        for child in self._free():
            job = self._next_job()
            if job is None:
                return
            self._send(child, job.job_id, job.work, job.future)

    def _send(self, child: _Child, job_id: int, work: tuple[str, str, Any], future: asyncio.Future) -> None:
        child.pending[job_id] = future
        try:
            # One job per child, so what the pipe does not take at once stays in the
            # transport's buffer (one prompt) and goes out as the child reads.
            child.proc.stdin.write(frame((job_id, *work)))
        except (ConnectionError, RuntimeError):  # the child is gone; its reader may not know yet
            self._lost(child)

    async def _run(self, spec: str, kind: str, payload: Any, child: _Child | None = None) -> tuple[str, Any, int, int]:
        """Answer of one job: on ``child`` now (a load), else on the next free child.

        Raises:
            TokenizePoolError: no child runs, or the child died with the job.
        """
        job_id = next(self._ids)
        future = asyncio.get_running_loop().create_future()
        if child is not None:
            self._send(child, job_id, (spec, kind, payload), future)
            return await future
        if not await self._ready():
            raise TokenizePoolError("no tokenize child is running")
        self._waiting.append(_Job(job_id, (spec, kind, payload), future))
        self._dispatch()
        return await future

    async def warm(self, spec: str) -> bool:
        """Start the children if they are not running and load ``spec`` in
        each. Returns False, doing nothing, for ``RETRY_AFTER_S`` after a child died.

        Raises:
            TokenizePoolError: a child could not load ``spec``, or died.
        """
        if time.monotonic() < self._broken_until:
            return False
        children = await self._ready()
        answers = await asyncio.gather(*(self._run(spec, "warm", None, child=c) for c in children))
        for status, value, _, _ in answers:
            if status != "ok":
                raise TokenizePoolError(f"cannot load tokenizer {spec!r} in the tokenize pool: {value}")
        return True

    async def encode_chat(self, spec: str, messages: Sequence[Any], local: Any) -> list[int]:
        """Ids (shape [ISL]) of the chat ``messages`` (objects with ``role``
        and ``content``, or such dicts) rendered by ``spec``'s chat template.
        ``local`` is the bridge's own tokenizer of ``spec``, used if the pool fails.

        Raises:
            jinja2.TemplateError: the chat template rejects the conversation.
        """
        turns = [m if isinstance(m, dict) else {"role": m.role, "content": m.content} for m in messages]
        return await self._encode(spec, "chat", turns, lambda: local.encode_chat(turns))

    async def encode_prompt(self, spec: str, text: str, local: Any) -> list[int]:
        """Ids (shape [ISL]) of a plain text prompt, as ``local.encode_prompt(text)``."""
        return await self._encode(spec, "prompt", text, lambda: local.encode_prompt(text))

    async def _encode(self, spec: str, kind: str, payload: Any, in_process: Callable[[], list[int]]) -> list[int]:
        if time.monotonic() < self._broken_until:
            self.fallbacks += 1
            return await asyncio.to_thread(in_process)
        if self._children and not self._free() and job_chars(kind, payload) <= INLINE_CHARS:
            self.inline += 1
            return await asyncio.to_thread(in_process)
        try:
            status, value, hit, miss = await self._run(spec, kind, payload)
        except (TokenizePoolError, OSError) as exc:  # the pool must not lose the request
            self.fallbacks += 1
            log.warning("tokenize pool failed (%s); tokenizing in the bridge's process", exc)
            return await asyncio.to_thread(in_process)
        if status == "template_error":
            from jinja2 import TemplateError

            raise TemplateError(value)
        if status != "ok":  # an error inside the child: the bridge's own tokenizer says what it is
            self.fallbacks += 1
            log.warning("tokenize pool: %s; tokenizing in the bridge's process", value)
            return await asyncio.to_thread(in_process)
        self.answered += 1
        counts = self.chunk_chars.setdefault(spec, [0, 0])
        counts[0] += hit
        counts[1] += miss
        ids = array("I")
        ids.frombytes(value)
        return ids.tolist()

    async def close(self, timeout_s: float = 10.0) -> None:
        """Stop the children: end their stdin, wait ``timeout_s`` for each, then kill it.

        Never raises for a child that has already exited."""
        if self._starting is not None and not self._starting.done():
            with contextlib.suppress(Exception):
                await self._starting
        children, self._children = self._children, []
        for child in children:
            with contextlib.suppress(Exception):
                child.proc.stdin.close()
        for child in children:
            await wait_or_kill(child.proc, timeout_s)
            if child.reader is not None:
                await child.reader
