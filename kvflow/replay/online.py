"""Online replay: send a trace's requests to a running deployment at their arrival times.

Two transports, one report shape (:class:`~kvflow.replay.report.Report`,
``mode="online"``):

* **Kafka** (default): :class:`~kvflow.streams.client.KvflowClient` puts each
  :class:`~kvflow.schemas.InferenceRequest` on the requests topic and reads
  its :class:`~kvflow.schemas.TokenDelta` records, then its
  :class:`~kvflow.schemas.FinalResponse` (cached tokens, worker id, timings).
* **HTTP** (``url``): any OpenAI-compatible server, streaming with httpx.
  Text prompts go to ``/v1/chat/completions``; synthetic token prompts to
  ``/v1/completions`` with ``prompt`` as a token id list. Each non-empty
  streamed chunk counts as one token arrival for ITL; output and cached
  tokens come from the final ``usage`` chunk (``stream_options.include_usage``)
  when the server sends one, the worker id from kvflow's ``kvflow`` field.

A request's prompt length in the report is the server's own count
(``usage.prompt_tokens``) when it reports one, so text prompts are measured
with the served model's tokenizer rather than the trace reader's stand-in.

Open loop: a request is sent at its arrival time whether or not earlier ones
finished (``max_in_flight`` caps that if asked). Times are measured with
``time.perf_counter`` from the replay start. The queue delay online is
``arrival + (FinalResponse.timings.started_ms − sent epoch ms)``, so it
assumes the worker's clock agrees with this machine's; HTTP gives none.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from array import array
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kvflow.replay.report import Report, RequestRecord, TimelineSample, build_report
from kvflow.replay.traces import Trace, TraceRequest, read_trace
from kvflow.schemas import ChatMessage, FinalResponse, SamplingParams, TokenDelta, now_ms

if TYPE_CHECKING:
    from kvflow.settings import Settings

__all__ = ["run_online", "run_online_async", "DEFAULT_MODEL"]

DEFAULT_MODEL = "SmolLM2-135M-Instruct"
"""Model name sent with each request when none is given (the default engine model)."""


@dataclass
class _Live:
    """Shared state of one online replay."""

    t0: float
    records: dict[str, RequestRecord]
    itl: array = field(default_factory=lambda: array("d"))
    in_flight: int = 0
    window: list[int] = field(default_factory=lambda: [0, 0, 0])
    bar: Any = None
    policies: set[str] = field(default_factory=set)
    """Routing policies named by the responses' routing decisions."""

    def now_ms(self) -> float:
        return (time.perf_counter() - self.t0) * 1000.0

    def token(self, rec: RequestRecord, n: int) -> None:
        """Record ``n`` tokens arriving now for ``rec``."""
        if n <= 0:
            return
        t = self.now_ms()
        if rec.first_token_ms is None:
            rec.first_token_ms = t
            n -= 1
        else:
            self.itl.append(t - rec.last_token_ms)
            n -= 1
        if n > 0:
            self.itl.extend([0.0] * n)
        rec.last_token_ms = t


def _sampling(req: TraceRequest) -> SamplingParams:
    return SamplingParams(max_tokens=req.osl, ignore_eos=True, temperature=0.0)


async def _kafka_one(client: Any, live: _Live, req: TraceRequest, rec: RequestRecord, model: str,
                     run_tag: str) -> None:
    if req.messages is not None or req.text is not None:
        msgs = req.messages or ({"role": "user", "content": req.text},)
        request = client.new_request(model, messages=[ChatMessage(**m) for m in msgs], sampling=_sampling(req),
                                     request_id=f"{req.request_id}-{run_tag}",
                                     token_ids=list(req.token_ids) if req.token_ids is not None else None)
    else:
        request = client.new_request(model, token_ids=req.prompt_token_ids(), sampling=_sampling(req),
                                     request_id=f"{req.request_id}-{run_tag}")
    sent_epoch_ms = request.created_ms
    n_tokens = 0
    # One partition key per run: the router sees requests in trace order, as
    # the offline simulator does (keys by request id would interleave partitions).
    async for ev in client.stream(request, key=run_tag):
        if isinstance(ev, TokenDelta):
            live.token(rec, len(ev.token_ids))
            n_tokens += len(ev.token_ids)
        elif isinstance(ev, FinalResponse):
            missing = len(ev.token_ids) - n_tokens
            if missing > 0:  # tokens only in the final record: they arrive now
                live.token(rec, missing)
            rec.finish_ms = rec.last_token_ms if rec.last_token_ms is not None else live.now_ms()
            rec.output_tokens = max(n_tokens, ev.usage.completion_tokens, len(ev.token_ids))
            rec.cached_tokens = ev.usage.cached_tokens
            rec.worker_id = ev.worker_id or (ev.routing.worker_id if ev.routing else "")
            if ev.routing is not None:
                live.policies.add(ev.routing.policy)
            if ev.usage.prompt_tokens:
                rec.isl = ev.usage.prompt_tokens
            if ev.timings.started_ms:
                rec.scheduled_ms = rec.arrival_ms + max(0, ev.timings.started_ms - sent_epoch_ms)
            if ev.error is not None or ev.finish_reason.value in ("error", "abort"):
                rec.error = ev.error.message if ev.error is not None else f"finished with {ev.finish_reason.value}"


async def _sse_events(response: Any) -> AsyncIterator[dict[str, Any]]:
    async for line in response.aiter_lines():
        if not line.startswith("data:"):
            continue
        data = line[5:].strip()
        if data == "[DONE]":
            return
        try:
            yield json.loads(data)
        except json.JSONDecodeError:
            continue


async def _http_one(http: Any, url: str, live: _Live, req: TraceRequest, rec: RequestRecord, model: str) -> None:
    common: dict[str, Any] = {"model": model, "max_tokens": req.osl, "stream": True, "temperature": 0.0,
                              "ignore_eos": True, "stream_options": {"include_usage": True}}
    if req.messages is not None or req.text is not None:
        msgs = list(req.messages or ({"role": "user", "content": req.text},))
        endpoint, body = "/v1/chat/completions", {**common, "messages": msgs}
    else:
        endpoint, body = "/v1/completions", {**common, "prompt": req.prompt_token_ids()}
    chunks = 0
    usage: dict[str, Any] | None = None
    async with http.stream("POST", url.rstrip("/") + endpoint, json=body) as response:
        if response.status_code >= 400:
            text = (await response.aread()).decode(errors="replace")[:300]
            rec.error = f"HTTP {response.status_code}: {text}"
            return
        async for chunk in _sse_events(response):
            if "error" in chunk:
                rec.error = str(chunk["error"])[:300]
                return
            for choice in chunk.get("choices") or ():
                piece = (choice.get("delta") or {}).get("content") if "delta" in choice else choice.get("text")
                if piece:
                    live.token(rec, 1)
                    chunks += 1
            if chunk.get("usage"):
                usage = chunk["usage"]
            info = chunk.get("kvflow")
            if isinstance(info, dict) and info.get("worker_id"):
                rec.worker_id = info["worker_id"]
    rec.finish_ms = rec.last_token_ms if rec.last_token_ms is not None else live.now_ms()
    rec.output_tokens = chunks
    if usage:
        rec.output_tokens = max(chunks, int(usage.get("completion_tokens") or 0))
        rec.isl = int(usage.get("prompt_tokens") or rec.isl)
        details = usage.get("prompt_tokens_details") or {}
        rec.cached_tokens = int(details.get("cached_tokens") or 0)


async def _sampler(live: _Live, interval_ms: float, out: list[TimelineSample]) -> None:
    while True:
        await asyncio.sleep(interval_ms / 1000.0)
        p, c, a = live.window
        out.append(TimelineSample(live.now_ms(), [live.in_flight], [], p, c, a))
        live.window = [0, 0, 0]


async def run_online_async(
    trace_path: str | Path | Trace,
    settings: "Settings | None" = None,
    url: str | None = None,
    *,
    model: str = DEFAULT_MODEL,
    speedup: float = 1.0,
    start_ms: float | None = None,
    end_ms: float | None = None,
    limit: int | None = None,
    rate: float | None = None,
    seed: int = 0,
    max_in_flight: int | None = None,
    timeout_s: float = 600.0,
    json_path: str | Path | None = None,
    markdown_path: str | Path | None = None,
    plot_dir: str | Path | None = None,
    progress: bool = True,
    sla_ttft_ms: float = 500.0,
    sla_itl_ms: float = 50.0,
    sample_interval_ms: float = 1000.0,
    client: Any | None = None,
) -> Report:
    """Replay a trace against a live deployment (see the module docstring).

    Args:
        trace_path: a trace file (any format of :mod:`kvflow.replay.traces`)
            or an already read :class:`Trace`.
        settings: Kafka settings for :class:`KvflowClient`; required unless ``url``.
        url: base URL of an OpenAI-compatible server (``http://host:port``);
            when given, HTTP is used instead of Kafka.
        model: model name on every request.
        speedup, start_ms, end_ms, limit, rate, seed: trace options.
        max_in_flight: cap on concurrent requests (None = open loop).
        timeout_s: per-request limit; a request past it is recorded as failed.
        json_path, markdown_path, plot_dir: outputs, as in ``run_offline``.
        progress: progress bar on a TTY.
        sla_ttft_ms, sla_itl_ms: goodput thresholds.
        sample_interval_ms: timeline resolution (wall ms).
        client: an already started :class:`KvflowClient` (or any object with
            its ``new_request``/``stream`` API) to use instead of opening one
            from ``settings``.

    Raises:
        ValueError: neither ``settings``, ``client`` nor ``url``.
        TraceFormatError: malformed trace.
    """
    from kvflow.replay.offline import write_outputs
    from kvflow.replay.simulator import _progress_bar

    if settings is None and url is None and client is None:
        raise ValueError("online replay needs Kafka settings, a client or an HTTP url")
    trace = trace_path if isinstance(trace_path, Trace) else read_trace(
        trace_path, speedup=speedup, start_ms=start_ms, end_ms=end_ms, limit=limit, rate=rate, seed=seed)
    records = {r.request_id: RequestRecord(r.request_id, r.arrival_ms, r.isl, r.osl) for r in trace.requests}
    live = _Live(t0=time.perf_counter(), records=records)
    gate = asyncio.Semaphore(max_in_flight) if max_in_flight else None
    run_tag = uuid.uuid4().hex[:8]
    timeline: list[TimelineSample] = []

    async def one(send: Any, req: TraceRequest) -> None:
        rec = records[req.request_id]
        if gate is not None:
            await gate.acquire()
        live.in_flight += 1
        try:
            await asyncio.wait_for(send(req, rec), timeout_s)
        except asyncio.TimeoutError:
            rec.error = f"timed out after {timeout_s} s"
        except Exception as exc:  # one failed request must not end the replay; it is reported
            rec.error = f"{type(exc).__name__}: {exc}"[:300]
        finally:
            live.in_flight -= 1
            if gate is not None:
                gate.release()
            if rec.ok and rec.first_token_ms is not None:
                live.window[0] += rec.isl
                live.window[1] += rec.cached_tokens
            if live.bar is not None:
                live.bar.update(1)

    async def drive(send: Any) -> None:
        live.t0 = time.perf_counter()
        sampler = asyncio.create_task(_sampler(live, sample_interval_ms, timeline))
        tasks = []
        try:
            for req in trace.requests:
                delay = req.arrival_ms / 1000.0 - (time.perf_counter() - live.t0)
                if delay > 0:
                    await asyncio.sleep(delay)
                live.window[2] += 1
                tasks.append(asyncio.create_task(one(send, req)))
            await asyncio.gather(*tasks)
        finally:
            sampler.cancel()

    wall0, epoch0 = time.perf_counter(), now_ms()
    live.bar = _progress_bar(len(trace.requests), progress, "replaying")
    try:
        if url is not None:
            import httpx

            limits = httpx.Limits(max_connections=max_in_flight or 1000, max_keepalive_connections=100)
            async with httpx.AsyncClient(timeout=httpx.Timeout(timeout_s), limits=limits) as http:
                await drive(lambda req, rec: _http_one(http, url, live, req, rec, model))
            policy = "http"
        elif client is not None:
            await drive(lambda req, rec: _kafka_one(client, live, req, rec, model, run_tag))
            policy = ",".join(sorted(live.policies)) or "unknown"
        else:
            from kvflow.streams.client import KvflowClient

            async with KvflowClient(settings, timeout_s=timeout_s) as kafka_client:
                await drive(lambda req, rec: _kafka_one(kafka_client, live, req, rec, model, run_tag))
            policy = ",".join(sorted(live.policies)) or "unknown"
    finally:
        live.bar.close()
    worker_ids = sorted({r.worker_id for r in records.values() if r.worker_id})
    report = build_report(
        list(records.values()), live.itl, mode="online", trace=trace.name, trace_format=trace.format,
        policy=policy, workers=worker_ids, seed=seed, sla_ttft_ms=sla_ttft_ms, sla_itl_ms=sla_itl_ms,
        timeline=timeline, wall_time_s=time.perf_counter() - wall0,
        options={**trace.options, "transport": "http" if url else "kafka", "url": url, "model": model,
                 "max_in_flight": max_in_flight, "epoch_start_ms": epoch0},
    )
    write_outputs(report, list(records.values()), live.itl, json_path=json_path, markdown_path=markdown_path,
                  plot_dir=plot_dir)
    return report


def run_online(trace_path: str | Path | Trace, settings: "Settings | None" = None, url: str | None = None,
               **kwargs: Any) -> Report:
    """Synchronous wrapper of :func:`run_online_async` (for the CLI); same arguments.

    Raises:
        RuntimeError: called from a running event loop (await
            :func:`run_online_async` there instead).
    """
    return asyncio.run(run_online_async(trace_path, settings, url, **kwargs))

