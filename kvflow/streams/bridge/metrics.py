"""Bridge metrics: Prometheus series for ``/metrics`` and ``RequestMetrics`` records.

Every request to an inference endpoint gets a :class:`RequestObserver`: it
counts the request in flight, times TTFT and ITL from the records as they
arrive, and on :meth:`RequestObserver.finish` records the outcome in
Prometheus and, for requests that reached the pipeline, hands one
:class:`RequestMetrics` record to the publisher (the metrics topic).

Times are measured on the bridge from the moment the HTTP body was read, so
TTFT includes tokenization, Kafka hops, routing and queueing;
``kvflow_bridge_prepare_seconds`` is the part before the request record
exists (parsing, chat template, tokenizing).

Disaggregated serving is read off each successful final response: a request
whose ``kv_transfer`` is set and not ``recomputed`` had its prefill on a
prefill worker (``kvflow_prefill_remote_total``), every other one on the
worker that decoded it (``kvflow_prefill_local_total``); the transfer's size
and duration feed two histograms. :meth:`BridgeMetrics.track_workers` adds a
scrape-time gauge of the prefill pool's queue depth from the bridge's worker
registry. ``kvflow_bridge_cancels_total`` counts the cancel records sent for
requests whose client disconnected before the final response
(:mod:`kvflow.streams.bridge.disconnect`).
``kvflow_bridge_tokenize_chars_total{tokenizer, source}`` counts prompt
characters whose ids came from a tokenizer's chunk cache (``cache``) or were
encoded (``encoded``): the share a resent chat history saves
(:mod:`kvflow.models.chunked_encode`).
``kvflow_bridge_tokenize_jobs_total{path}`` counts the prompts the tokenize
pool took by where they were encoded: ``child``, ``inline`` (a short prompt
encoded in the bridge's process because every child was busy) or
``fallback`` (the pool failed; :mod:`kvflow.streams.bridge.tokenize_pool`).

``kvflow_bridge_outcomes_total{endpoint, outcome, reason}`` gives every
request its one terminal outcome (:func:`outcome`): ``completed`` (reason:
the finish reason, ``stop`` or ``length``), ``aborted`` (``cancelled`` by a
cancel record, or ``client_disconnected``), ``deadline`` (the request's
deadline passed ``before_first_token`` or ``after_first_token``) or
``error`` (reason: the error code, e.g. ``worker_lost``, ``overloaded``,
``invalid_value``). A resumed stream is a request of its own here; it adds
no latency or length samples and publishes no ``RequestMetrics``.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from aiokafka import AIOKafkaProducer
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from kvflow.schemas import (
    DEADLINE_EXCEEDED,
    FinalResponse,
    FinishReason,
    RequestMetrics,
    TokenDelta,
    WorkerRole,
    encode,
    now_ms,
)
from kvflow.streams.catalog import Catalog

if TYPE_CHECKING:
    from kvflow.streams.bridge.worker_registry import WorkerRegistry

__all__ = ["BridgeMetrics", "RequestObserver", "MetricsPublisher", "STATUS_CLIENT_CLOSED", "outcome"]

log = logging.getLogger(__name__)

STATUS_CLIENT_CLOSED = 499
"""Status recorded when the client went away mid-request (nginx's convention)."""

# Bucket edges. Latencies in seconds span a cached short prompt on a GPU
# (ms) to a long CPU generation (minutes); token counts are powers of 2 up
# to 128k, the longest contexts current models take.
_TTFT_BUCKETS_S = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
_ITL_BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28)
_DURATION_BUCKETS_S = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0)
_TOKEN_BUCKETS = tuple(float(2**k) for k in range(4, 18))
# KV transfers: 64 KiB (a few tokens of a small model) to 16 GiB (a 128k
# context of a 70B model) in steps of 4x; durations from a fast NVLink/RDMA
# pull (0.1 ms) to a slow TCP pull of a long context (10 s).
_KV_BYTES_BUCKETS = tuple(float(2**k) for k in range(16, 35, 2))
_KV_SECONDS_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0,
                       2.5, 10.0)


class BridgeMetrics:
    """The bridge's Prometheus series, in their own registry (one per app, so
    several apps can live in one process). Names are prefixed
    ``kvflow_bridge_``; latencies are in seconds, lengths in tokens.
    """

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("kvflow_bridge_requests", "Finished HTTP inference requests.",
                                ["endpoint", "status"], registry=r)
        self.in_flight = Gauge("kvflow_bridge_requests_in_flight", "Inference requests being served.",
                               ["endpoint"], registry=r)
        self.ttft = Histogram("kvflow_bridge_ttft_seconds", "Time to first token, from body read.",
                              ["model"], buckets=_TTFT_BUCKETS_S, registry=r)
        self.prepare = Histogram("kvflow_bridge_prepare_seconds",
                                 "Body read to request record built (parsing, chat template, tokenizing).",
                                 ["model"], buckets=_TTFT_BUCKETS_S, registry=r)
        self.itl = Histogram("kvflow_bridge_itl_seconds", "Inter-token latency (one sample per token).",
                             ["model"], buckets=_ITL_BUCKETS_S, registry=r)
        self.duration = Histogram("kvflow_bridge_request_duration_seconds", "Request duration, body read to end.",
                                  ["endpoint"], buckets=_DURATION_BUCKETS_S, registry=r)
        self.isl = Histogram("kvflow_bridge_isl_tokens", "Input sequence length.", ["model"],
                             buckets=_TOKEN_BUCKETS, registry=r)
        self.osl = Histogram("kvflow_bridge_osl_tokens", "Output sequence length.", ["model"],
                             buckets=_TOKEN_BUCKETS, registry=r)
        self.outcomes = Counter("kvflow_bridge_outcomes", "Terminal outcome of each inference request "
                                "(completed, aborted, deadline, error) and its reason.",
                                ["endpoint", "outcome", "reason"], registry=r)
        self.cancels = Counter("kvflow_bridge_cancels",
                               "Cancel records published for requests whose client left before the final "
                               "response (result: sent, failed).", ["endpoint", "result"], registry=r)
        self.prefill_remote = Counter("kvflow_prefill_remote", "Requests whose prefill ran on a prefill worker.",
                                      ["model"], registry=r)
        self.prefill_local = Counter("kvflow_prefill_local", "Requests prefilled by the worker that decoded them.",
                                     ["model"], registry=r)
        self.kv_recomputed = Counter("kvflow_kv_transfer_recomputed",
                                     "Remote prefills whose KV could not be used; the decode worker recomputed.",
                                     ["model"], registry=r)
        self.kv_bytes = Histogram("kvflow_kv_transfer_bytes", "KV bytes pulled per remote prefill.", ["backend"],
                                  buckets=_KV_BYTES_BUCKETS, registry=r)
        self.kv_seconds = Histogram("kvflow_kv_transfer_seconds", "Duration of the KV pull of a remote prefill.",
                                    ["backend"], buckets=_KV_SECONDS_BUCKETS, registry=r)
        self._tracking: WorkerRegistry | None = None
        self._tracking_tokenizers = False

    def track_workers(self, workers: WorkerRegistry) -> None:
        """Expose ``kvflow_prefill_queue_depth`` (per model: waiting requests
        summed over live prefill workers, as of their last heartbeats) and
        ``kvflow_prefill_workers``, computed from ``workers`` at each scrape.
        Call once per registry; later calls are ignored."""
        if self._tracking is None:
            self._tracking = workers
            self.registry.register(_PrefillPoolCollector(workers))

    def track_tokenizers(self, chunk_chars: Callable[[], dict[str, tuple[int, int]]],
                         pool_jobs: Callable[[], dict[str, int]] | None = None) -> None:
        """Expose ``kvflow_bridge_tokenize_chars_total{tokenizer, source}``:
        prompt characters taken from a tokenizer's chunk cache
        (``source="cache"``) or encoded (``"encoded"``), read at each scrape
        from ``chunk_chars() -> {spec: (cache, encoded)}``
        (:meth:`~kvflow.streams.bridge.tokenizers.TokenizerCache.chunk_chars`;
        see :mod:`kvflow.models.chunked_encode`), and with ``pool_jobs``
        ``kvflow_bridge_tokenize_jobs_total{path}`` from ``pool_jobs() -> {path: count}``
        (:meth:`~kvflow.streams.bridge.tokenizers.TokenizerCache.pool_jobs`).
        Call once; later calls are ignored."""
        if not self._tracking_tokenizers:
            self._tracking_tokenizers = True
            self.registry.register(_ChunkCacheCollector(chunk_chars, pool_jobs or dict))

    def observe_final(self, model: str, final: FinalResponse) -> None:
        """Count where a successful request's prefill ran and how its KV moved."""
        transfer = final.kv_transfer
        if transfer is not None and transfer.recomputed:
            self.kv_recomputed.labels(model).inc()
        if transfer is None or transfer.recomputed:
            self.prefill_local.labels(model).inc()
            return
        self.prefill_remote.labels(model).inc()
        self.kv_bytes.labels(transfer.backend).observe(transfer.num_bytes)
        self.kv_seconds.labels(transfer.backend).observe(transfer.transfer_ms / 1000)


class _ChunkCacheCollector(Collector):
    """Scrape-time counters of the tokenizers' chunk caches."""

    def __init__(self, chunk_chars: Callable[[], dict[str, tuple[int, int]]],
                 pool_jobs: Callable[[], dict[str, int]]) -> None:
        self.chunk_chars = chunk_chars
        self.pool_jobs = pool_jobs

    def collect(self) -> Iterator[CounterMetricFamily]:
        chars = CounterMetricFamily("kvflow_bridge_tokenize_chars",
                                    "Prompt characters tokenized, by whether their chunk came from the cache.",
                                    labels=["tokenizer", "source"])
        for spec, (hit, miss) in sorted(self.chunk_chars().items()):
            chars.add_metric([spec, "cache"], float(hit))
            chars.add_metric([spec, "encoded"], float(miss))
        yield chars
        jobs = CounterMetricFamily("kvflow_bridge_tokenize_jobs",
                                   "Prompts the tokenize pool took, by where they were encoded "
                                   "(child, inline: every child busy, fallback: the pool failed).",
                                   labels=["path"])
        for path, count in sorted(self.pool_jobs().items()):
            jobs.add_metric([path], float(count))
        yield jobs


class _PrefillPoolCollector(Collector):
    """Scrape-time gauges of the prefill pool, read from the bridge's worker registry."""

    def __init__(self, workers: WorkerRegistry) -> None:
        self.workers = workers

    def collect(self) -> Iterator[GaugeMetricFamily]:
        depth = GaugeMetricFamily("kvflow_prefill_queue_depth",
                                  "Requests waiting on live prefill workers (sum of heartbeat waiting_requests).",
                                  labels=["model"])
        count = GaugeMetricFamily("kvflow_prefill_workers", "Live serving prefill workers.", labels=["model"])
        per_model: dict[str, list[int]] = {}
        for w in self.workers.live_workers():
            if w.role == WorkerRole.prefill:
                per_model.setdefault(w.model, []).append(w.waiting_requests)
        for model, waiting in sorted(per_model.items()):
            depth.add_metric([model], float(sum(waiting)))
            count.add_metric([model], float(len(waiting)))
        yield depth
        yield count


def outcome(status: int, code: str | None, final: FinalResponse | None, saw_token: bool) -> tuple[str, str]:
    """``(outcome, reason)`` of a request answered with HTTP ``status``:
    ``code`` is the error code of its error answer (None: none), ``final``
    its final record (None: none arrived), ``saw_token`` whether a token
    reached the bridge. See the module doc for the values."""
    if status == STATUS_CLIENT_CLOSED:
        return "aborted", "client_disconnected"
    if code is None and final is not None and final.error is not None:
        code = final.error.code or final.error.type
    if code == DEADLINE_EXCEEDED:
        return "deadline", "after_first_token" if saw_token else "before_first_token"
    if status >= 400 or code is not None:
        return "error", code or f"http_{status}"
    if final is not None and final.finish_reason is FinishReason.abort:
        return "aborted", "cancelled"
    return "completed", final.finish_reason.value if final is not None else "stop"


@dataclass
class RequestObserver:
    """Timing and outcome of one HTTP inference request.

    Call :meth:`submitted` once the request record exists, :meth:`on_event`
    for each response record, and :meth:`finish` exactly when the answer is
    complete (later calls are ignored). ``clock`` is monotonic seconds.
    """

    metrics: BridgeMetrics
    endpoint: str
    publish: Callable[[RequestMetrics], None] | None = None
    clock: Callable[[], float] = time.perf_counter
    started_s: float = -1.0
    request_id: str = ""
    model: str = ""
    isl: int = 0
    osl_seen: int = 0
    first_token_s: float | None = None
    last_token_s: float | None = None
    final: FinalResponse | None = None
    finished: bool = field(default=False)
    on_finish: Callable[[], None] | None = None
    """Called once when the request finishes (the bridge's in-flight count)."""
    replay: bool = False
    """A resumed stream: its records are replayed, so no latency, length or
    ``RequestMetrics`` is recorded (the original request's were)."""

    def __post_init__(self) -> None:
        if self.started_s < 0:
            self.started_s = self.clock()
        self.metrics.in_flight.labels(self.endpoint).inc()

    def submitted(self, request_id: str, model: str, isl: int) -> None:
        """The request record was built: from now on a :class:`RequestMetrics` is published."""
        self.request_id, self.model, self.isl = request_id, model, isl
        if not self.replay:
            self.metrics.isl.labels(model).observe(isl)
            self.metrics.prepare.labels(model).observe(self.clock() - self.started_s)

    def on_event(self, event: TokenDelta | FinalResponse) -> None:
        """Account for one response record as it arrives."""
        if isinstance(event, FinalResponse):
            self.final = event
            return
        n = len(event.token_ids)
        if n == 0:
            return
        if self.replay:
            self.first_token_s = self.first_token_s or self.clock()
            return
        now = self.clock()
        if self.first_token_s is None:
            self.first_token_s = now
            self.metrics.ttft.labels(self.model).observe(now - self.started_s)
            itl_samples = n - 1  # tokens after the first in the same delta came with it
            gap = 0.0
        else:
            itl_samples = n
            gap = (now - self.last_token_s) / n  # type: ignore[operator]
        for _ in range(itl_samples):
            self.metrics.itl.labels(self.model).observe(gap)
        self.last_token_s = now
        self.osl_seen += n

    def finish(self, status: int, code: str | None = None) -> None:
        """Record the outcome (HTTP ``status``; 499 = client went away;
        ``code``: the error code of an error answer, see :func:`outcome`)."""
        if self.finished:
            return
        self.finished = True
        if self.on_finish is not None:
            self.on_finish()
        now = self.clock()
        self.metrics.in_flight.labels(self.endpoint).dec()
        self.metrics.requests.labels(self.endpoint, str(status)).inc()
        self.metrics.outcomes.labels(self.endpoint, *outcome(status, code, self.final,
                                                             self.first_token_s is not None)).inc()
        self.metrics.duration.labels(self.endpoint).observe(now - self.started_s)
        if not self.request_id or self.replay:
            return  # rejected before it reached the pipeline, or a replay
        osl = self.final.usage.completion_tokens if self.final is not None else self.osl_seen
        if status == 200:
            self.metrics.osl.labels(self.model).observe(osl)
            if self.final is not None:
                self.metrics.observe_final(self.model, self.final)
        if self.publish is not None:
            self.publish(self._record(status, now, osl))

    def _record(self, status: int, now: float, osl: int) -> RequestMetrics:
        ttft_ms = (self.first_token_s - self.started_s) * 1000 if self.first_token_s is not None else 0.0
        itl_ms = 0.0
        if self.first_token_s is not None and self.osl_seen > 1:
            # Mean ITL = decode span / (tokens after the first).
            itl_ms = (self.last_token_s - self.first_token_s) * 1000 / (self.osl_seen - 1)  # type: ignore[operator]
        final = self.final
        return RequestMetrics(
            ts_ms=now_ms(), request_id=self.request_id, model=self.model,
            worker_id=final.worker_id if final is not None else "", isl=self.isl, osl=osl,
            ttft_ms=ttft_ms, itl_ms=itl_ms, e2e_ms=(now - self.started_s) * 1000,
            cached_tokens=final.usage.cached_tokens if final is not None else 0,
            ok=status == 200 and (final is None or final.error is None), source="bridge",
        )


class MetricsPublisher:
    """Produces :class:`RequestMetrics` to the metrics topic, fire-and-forget.

    :meth:`publish` never raises and never waits: each send runs as its own
    task; failures are logged. :meth:`drain` waits for the sends in flight
    (call before stopping the producer).
    """

    def __init__(self, producer: AIOKafkaProducer, catalog: Catalog) -> None:
        self.producer = producer
        self.topic = catalog.metrics.name
        self._tasks: set[asyncio.Task] = set()

    def publish(self, record: RequestMetrics) -> None:
        """Queue ``record`` for the metrics topic (key: worker id)."""
        try:
            task = asyncio.get_running_loop().create_task(self._send(record))
        except RuntimeError:
            log.warning("no event loop; dropping metrics of %s", record.request_id)
            return
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _send(self, record: RequestMetrics) -> None:
        try:
            await self.producer.send_and_wait(self.topic, encode(record), key=record.worker_id.encode())
        except Exception:  # noqa: BLE001 - metrics must never fail a request
            log.warning("could not publish metrics of %s", record.request_id, exc_info=True)

    async def drain(self, timeout_s: float = 5.0) -> None:
        """Wait up to ``timeout_s`` for sends in flight."""
        if self._tasks:
            await asyncio.wait(set(self._tasks), timeout=timeout_s)
