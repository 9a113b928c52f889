"""What-if replay from a deployment's own log (``kvflow replay --from-topics``).

The topics hold everything needed to replay past traffic: the requests
topic has each request as sent (arrival ``created_ms``, prompt, token ids
when the producer tokenized, ``max_tokens``), the routing-decisions topic
what the router decided, the responses topic each request's final response
(worker, timings, prompt and cached tokens), and the workers topic the
workers' KV geometry (block size, blocks) and tokenizer.

:func:`read_recorded` reads them for requests created in ``[since_ms,
until_ms)``. :func:`write_trace` writes those requests as a ``kvflow``
trace (:mod:`kvflow.replay.traces`), each prompt as the token ids its
worker saw (tokenized here with the worker's own tokenizer when the
producer sent text), so an offline replay hashes the same blocks.
:func:`recorded_report` turns the recorded final responses into a
:class:`~kvflow.replay.report.Report` for ``kvflow replay compare``
(times on the workers' clocks, relative to the first arrival; ITL is each
request's mean, (finish − first token) / (tokens − 1), as the log holds no
per-token times).
"""

from __future__ import annotations

import json
import logging
import statistics
from dataclasses import dataclass, field
from pathlib import Path

from kvflow.replay.report import Report, RequestRecord, build_report
from kvflow.schemas import (
    DecisionOutcome,
    DecisionRecord,
    FinalResponse,
    InferenceRequest,
    RecordError,
    ResponseEvent,
    WorkerHeartbeat,
    decode,
)
from kvflow.settings import Settings
from kvflow.streams.catalog import Catalog
from kvflow.streams.history import read_topic

__all__ = ["RecordedRun", "read_recorded", "write_trace", "recorded_report"]

log = logging.getLogger(__name__)


@dataclass
class RecordedRun:
    """What a deployment's topics recorded for requests created in ``[since_ms, until_ms)``.

    ``requests`` are in arrival order; ``decisions`` and ``finals`` map
    request id to the last routed decision and the final response of the
    last attempt; ``workers`` maps worker id to its latest heartbeat.
    """

    since_ms: int
    until_ms: int
    requests: list[InferenceRequest] = field(default_factory=list)
    decisions: dict[str, DecisionRecord] = field(default_factory=dict)
    finals: dict[str, FinalResponse] = field(default_factory=dict)
    workers: dict[str, WorkerHeartbeat] = field(default_factory=dict)

    @property
    def routed_workers(self) -> list[str]:
        """Workers the recorded decisions routed to, sorted."""
        return sorted({d.worker_id for d in self.decisions.values() if d.worker_id})

    def hop_ms(self) -> float:
        """One hop through the broker as this run paid it, in ms: the median of
        the request hop (the router's ``decided_ms`` − the request's
        ``created_ms``) and the queue hop (the worker's ``queued_ms`` − the
        decision's ``decided_ms``) over every routed request with a final
        response, both hops pooled; 0.0 when none. Both ends of each hop are
        epoch ms of two processes, so this assumes their clocks agree (one
        host, or NTP-synchronised hosts, where skew adds to it). Each hop
        includes the consumer's own processing before it stamps the record.
        The offline simulator delays records by it (``SimConfig.hop_ms``).
        """
        hops: list[int] = []
        for req in self.requests:
            decision = self.decisions.get(req.request_id)
            final = self.finals.get(req.request_id)
            if decision is None or final is None or not final.timings.queued_ms:
                continue
            hops.append(max(0, decision.decided_ms - req.created_ms))
            hops.append(max(0, final.timings.queued_ms - decision.decided_ms))
        return float(statistics.median(hops)) if hops else 0.0

    def geometry(self) -> tuple[int | None, int | None]:
        """``(block_size, kv_total_blocks)`` of the routed workers (the first one's; None unknown)."""
        for wid in self.routed_workers or sorted(self.workers):
            hb = self.workers.get(wid)
            if hb is not None:
                return hb.block_size, hb.kv_total_blocks
        return None, None


async def read_recorded(settings: Settings, since_ms: int, until_ms: int,
                        catalog: Catalog | None = None, *, progress: bool = False) -> RecordedRun:
    """Read the requests, routing-decisions, responses and workers topics for
    requests created in ``[since_ms, until_ms)`` (epoch ms). Malformed records
    are skipped. ``progress``: report records read on stderr.

    Raises:
        aiokafka.errors.KafkaError: the broker cannot be reached.
        TimeoutError: a topic could not be read whole.
    """
    catalog = catalog or Catalog(settings.namespace)
    run = RecordedRun(since_ms, until_ms)
    seen: dict[str, InferenceRequest] = {}
    for msg in await read_topic(settings, catalog.requests, progress=progress):
        try:
            req = decode(InferenceRequest, msg.value)
        except RecordError:
            continue
        if since_ms <= req.created_ms < until_ms and req.request_id not in seen:
            seen[req.request_id] = req  # a resubmitted attempt keeps the first arrival
    run.requests = sorted(seen.values(), key=lambda r: (r.created_ms, r.request_id))
    for msg in await read_topic(settings, catalog.routing_decisions, progress=progress):
        if msg.key is None or msg.key.decode(errors="replace") not in seen:
            continue
        try:
            rec = decode(DecisionRecord, msg.value)
        except RecordError:
            continue
        if rec.outcome is DecisionOutcome.routed:
            run.decisions[rec.request_id] = rec
    for msg in await read_topic(settings, catalog.responses, progress=progress):
        if msg.key is None or msg.key.decode(errors="replace") not in seen:
            continue
        try:
            event = decode(ResponseEvent, msg.value)
        except RecordError:
            continue
        if isinstance(event, FinalResponse):
            held = run.finals.get(event.request_id)
            if held is None or event.attempt >= held.attempt:
                run.finals[event.request_id] = event
    for msg in await read_topic(settings, catalog.workers, progress=progress):
        try:
            hb = decode(WorkerHeartbeat, msg.value)
        except RecordError:
            continue
        held_hb = run.workers.get(hb.worker_id)
        if held_hb is None or hb.ts_ms >= held_hb.ts_ms:
            run.workers[hb.worker_id] = hb
    return run


def _prompt_ids(run: RecordedRun, req: InferenceRequest, tokenizers: dict) -> list[int] | None:
    """The prompt's token ids as its worker saw them: the record's own, else its
    worker's tokenizer applied to the text (None when that worker is unknown)."""
    if req.token_ids is not None:
        return list(req.token_ids)
    decision = run.decisions.get(req.request_id)
    hb = run.workers.get(decision.worker_id) if decision is not None and decision.worker_id else None
    if hb is None:
        hb = next(iter(run.workers.values()), None)
    if hb is None:
        return None
    from kvflow.models.tokenizer import load_tokenizer

    tok = tokenizers.get(hb.tokenizer) or tokenizers.setdefault(hb.tokenizer, load_tokenizer(hb.tokenizer))
    return tok.encode_chat(req.messages) if req.messages is not None else tok.encode_prompt(req.prompt or "")


def write_trace(run: RecordedRun, path: str | Path) -> int:
    """Write ``run``'s requests as a ``kvflow`` trace (JSONL of InferenceRequest,
    prompts as token ids) to ``path``; returns the number written."""
    tokenizers: dict = {}
    with Path(path).open("w") as out:
        for req in run.requests:
            ids = _prompt_ids(run, req, tokenizers)
            if ids is not None and req.token_ids is None:
                req = req.model_copy(update={"token_ids": ids})
            out.write(json.dumps(req.model_dump(mode="json", exclude_none=True)) + "\n")
    return len(run.requests)


def recorded_report(run: RecordedRun, *, trace: str = "topics", sla_ttft_ms: float = 500.0,
                    sla_itl_ms: float = 50.0) -> Report:
    """The recorded run as a :class:`Report` (see the module doc for its clock)."""
    t0 = min((r.created_ms for r in run.requests), default=0)
    records, itl_gaps = [], []
    for req in run.requests:
        final = run.finals.get(req.request_id)
        rec = RequestRecord(request_id=req.request_id, arrival_ms=float(req.created_ms - t0),
                            isl=len(req.token_ids) if req.token_ids is not None else 0,
                            osl=req.sampling.max_tokens or 0)
        if final is None:
            rec.error = "no final response recorded"
        else:
            t = final.timings
            rec.worker_id = final.worker_id
            rec.isl = final.usage.prompt_tokens
            rec.cached_tokens = final.usage.cached_tokens
            rec.output_tokens = final.usage.completion_tokens
            if final.error is not None:
                rec.error = final.error.code or final.error.type
            if t.started_ms:
                rec.scheduled_ms = float(t.started_ms - t0)
            if t.first_token_ms:
                rec.first_token_ms = float(t.first_token_ms - t0)
            if t.finished_ms:
                rec.finish_ms = rec.last_token_ms = float(t.finished_ms - t0)
            n = final.usage.completion_tokens
            if t.first_token_ms and t.finished_ms and n > 1:
                itl_gaps.extend([(t.finished_ms - t.first_token_ms) / (n - 1)] * (n - 1))
        records.append(rec)
    policies = sorted({d.policy for d in run.decisions.values()})
    block_size, blocks = run.geometry()
    workers = run.routed_workers
    return build_report(records, itl_gaps, mode="online", trace=trace, trace_format="topics",
                        policy=",".join(policies) or "unknown", workers=workers, seed=0, sla_ttft_ms=sla_ttft_ms,
                        sla_itl_ms=sla_itl_ms, block_size=block_size,
                        total_kv_blocks=blocks * len(workers) if blocks else None,
                        options={"since_ms": run.since_ms, "until_ms": run.until_ms, "recorded": True})
