"""A worker's Prometheus series (``kvflow_worker_*``), one registry per worker.

Two kinds of series:

- read from the worker and its engine at each scrape (:class:`_WorkerCollector`):
  running and waiting requests, requests held, prefill tokens scheduled,
  KV blocks used and total, and the engine's token counters (their
  ``rate()`` is prefill and decode tokens/s);
- counted as requests finish (:class:`RequestTimer`): TTFT and ITL
  histograms, finished requests by finish reason, prompt tokens and
  prefix-cache hit tokens.

Every series carries the label ``worker_id``, so the scrapes of several
workers merge into one exposition (:mod:`kvflow.streams.metrics_server`);
``kvflow_worker_info`` maps a worker id to its role, model and engine.

An encode worker exports ``kvflow_encode_*`` instead (:func:`encode_registry`):
its embedding cache's hits, misses and evictions (counters), its size and
capacity in bytes and entries (gauges), and requests by outcome
(``forwarded``: passed on with embeddings; ``refused``: answered with an error).
TTFT here is measured on the worker, from the moment it took the request off
its queue to the engine's first output: the bridge's
``kvflow_bridge_ttft_seconds`` adds tokenization, Kafka and routing.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

if TYPE_CHECKING:
    from kvflow.workers.encode_worker import EncodeWorker
    from kvflow.workers.worker import Worker

__all__ = ["WorkerExporter", "RequestTimer", "encode_registry"]

# Same edges as the bridge's (kvflow.streams.bridge.metrics), so the two compare bucket by bucket.
_TTFT_BUCKETS_S = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
_ITL_BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28)


class WorkerExporter:
    """The Prometheus registry of one worker: build it with the worker,
    :meth:`track` each request the engine serves."""

    def __init__(self, worker: Worker) -> None:
        self.worker_id = worker.config.worker_id
        self.registry = CollectorRegistry()
        r, labels = self.registry, ["worker_id"]
        self.ttft = Histogram("kvflow_worker_ttft_seconds", "Time to first token on the worker: queue record "
                              "taken to first engine output.", labels, buckets=_TTFT_BUCKETS_S, registry=r)
        self.itl = Histogram("kvflow_worker_itl_seconds", "Inter-token latency on the worker (one sample per "
                             "token after the first).", labels, buckets=_ITL_BUCKETS_S, registry=r)
        self.requests = Counter("kvflow_worker_requests", "Requests the engine finished, by finish reason.",
                                [*labels, "finish_reason"], registry=r)
        self.prompt_tokens = Counter("kvflow_worker_prompt_tokens", "Prompt tokens of requests started.",
                                     labels, registry=r)
        self.prefix_hit_tokens = Counter("kvflow_worker_prefix_hit_tokens",
                                         "Prompt tokens found in the prefix cache (not prefilled).", labels,
                                         registry=r)
        r.register(_WorkerCollector(worker))

    def track(self, clock: Callable[[], float] = time.monotonic) -> RequestTimer:
        """A timer for one request whose outputs are about to stream (``clock``: monotonic seconds)."""
        return RequestTimer(self, clock)


@dataclass
class RequestTimer:
    """Times one request's engine outputs into its worker's histograms.

    Call :meth:`output` for each engine output and :meth:`finish` once.
    ``started_s`` (clock seconds) is when the worker took the request.
    """

    exporter: WorkerExporter
    clock: Callable[[], float] = time.monotonic
    started_s: float = field(default=-1.0)
    last_s: float | None = None

    def __post_init__(self) -> None:
        if self.started_s < 0:
            self.started_s = self.clock()

    def output(self, num_tokens: int, *, prompt_tokens: int = 0, cached_tokens: int = 0) -> None:
        """Account ``num_tokens`` new tokens; on the first output also the
        prompt (``prompt_tokens``) and its prefix-cache hit (``cached_tokens``)."""
        e, wid = self.exporter, self.exporter.worker_id
        now = self.clock()
        if self.last_s is None:
            e.ttft.labels(wid).observe(now - self.started_s)
            e.prompt_tokens.labels(wid).inc(prompt_tokens)
            e.prefix_hit_tokens.labels(wid).inc(cached_tokens)
            samples, gap = num_tokens - 1, 0.0  # tokens after the first in one output came with it
        else:
            samples = num_tokens
            gap = (now - self.last_s) / max(num_tokens, 1)
        for _ in range(max(samples, 0)):
            e.itl.labels(wid).observe(gap)
        if num_tokens or self.last_s is None:
            self.last_s = now

    def finish(self, finish_reason: str) -> None:
        """Count the finished request (``finish_reason``: stop, length, abort, error)."""
        self.exporter.requests.labels(self.exporter.worker_id, finish_reason).inc()


class _WorkerCollector(Collector):
    """Scrape-time gauges and counters read from the worker and its engine."""

    def __init__(self, worker: Worker) -> None:
        self.worker = worker

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        w = self.worker
        wid = w.config.worker_id
        stats = w.engine.kv_stats()
        info = GaugeMetricFamily("kvflow_worker_info", "Worker identity (value 1).",
                                 labels=["worker_id", "role", "model", "engine", "status"])
        info.add_metric([wid, w.config.role.value, w.config.model, w.engine.name, w.status.value], 1.0)
        yield info

        def gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
            family = GaugeMetricFamily(name, doc, labels=["worker_id"])
            family.add_metric([wid], float(value))
            return family

        def counter(name: str, doc: str, value: float) -> CounterMetricFamily:
            family = CounterMetricFamily(name, doc, labels=["worker_id"])
            family.add_metric([wid], float(value))
            return family

        yield gauge("kvflow_worker_running_requests", "Requests the engine is running (in its batch).",
                    stats.active_requests)
        yield gauge("kvflow_worker_waiting_requests", "Requests waiting in the engine's scheduler.",
                    stats.waiting_requests)
        yield gauge("kvflow_worker_inflight_requests", "Requests taken from the queue and not yet answered.",
                    len(w.inflight))
        yield gauge("kvflow_worker_batch_prefill_tokens", "Prompt tokens still to prefill for the requests "
                    "the engine holds.", stats.active_prefill_tokens)
        yield gauge("kvflow_worker_kv_blocks_used", "KV cache blocks in use.", stats.used_blocks)
        yield gauge("kvflow_worker_kv_blocks_total", "KV cache blocks the engine has.", stats.total_blocks)
        yield gauge("kvflow_worker_kv_block_size_tokens", "Tokens per KV block.", stats.block_size)
        yield counter("kvflow_worker_prefill_tokens", "Prompt tokens the engine prefilled (rate: prefill tokens/s).",
                      stats.prefill_tokens_total)
        yield counter("kvflow_worker_generated_tokens", "Tokens the engine decoded (rate: decode tokens/s).",
                      stats.decode_tokens_total)


def encode_registry(worker: EncodeWorker) -> CollectorRegistry:
    """The Prometheus registry of an encode worker (``kvflow_encode_*``, read at each scrape)."""
    registry = CollectorRegistry()
    registry.register(_EncodeCollector(worker))
    return registry


class _EncodeCollector(Collector):
    """Scrape-time series of an encode worker and its embedding cache."""

    def __init__(self, worker: EncodeWorker) -> None:
        self.worker = worker

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        w = self.worker
        wid, cache = w.config.worker_id, w.cache
        for name, doc, value in (
            ("kvflow_encode_cache_hits", "Media items whose embeddings the cache held.", cache.stats.hits),
            ("kvflow_encode_cache_misses", "Media items encoded because the cache did not hold them.",
             cache.stats.misses),
            ("kvflow_encode_cache_evictions", "Cache entries evicted to make room (least recently used first).",
             cache.stats.evictions),
        ):
            family = CounterMetricFamily(name, doc, labels=["worker_id"])
            family.add_metric([wid], float(value))
            yield family
        for name, doc, value in (
            ("kvflow_encode_cache_bytes", "Embedding bytes the cache holds.", cache.size_bytes),
            ("kvflow_encode_cache_capacity_bytes", "Embedding bytes the cache may hold.", cache.capacity_bytes),
            ("kvflow_encode_cache_entries", "Media items the cache holds.", len(cache)),
        ):
            family = GaugeMetricFamily(name, doc, labels=["worker_id"])
            family.add_metric([wid], float(value))
            yield family
        requests = CounterMetricFamily("kvflow_encode_requests", "Requests by outcome: forwarded with their "
                                       "embeddings, or refused with an error.", labels=["worker_id", "outcome"])
        for outcome in ("forwarded", "refused"):
            requests.add_metric([wid, outcome], float(w.outcomes[outcome]))
        yield requests
