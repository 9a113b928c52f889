"""The SLA planner's Prometheus series (``kvflow_planner_*``), read at each scrape.

All values come from the planner loop's latest tick report
(:class:`~kvflow.planner.loop.TickReport`) and its configuration, so the
series change once per adjustment interval:

- the SLA targets and the latencies observed over the last window (mean
  and p99 TTFT and ITL, seconds), and the window's request rate;
- the load predicted for the next interval (request rate, ISL, OSL, KV hit rate);
- per pool: replicas running, needed by the load, and the target the
  planner set (after anti-flapping and the GPU budget), and the pool's
  predicted token demand;
- the correction factors (observed / profiled latency) and the tick counts.

No series is exported for a value the planner has not computed yet (before
the first tick, or a window without requests).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

if TYPE_CHECKING:
    from kvflow.planner.loop import PlannerLoop

__all__ = ["planner_registry"]


def planner_registry(loop: PlannerLoop) -> CollectorRegistry:
    """A registry exporting ``loop``'s state at each scrape."""
    registry = CollectorRegistry()
    registry.register(_PlannerCollector(loop))
    return registry


def _gauge(name: str, doc: str, value: float | None, labels: dict[str, str] | None = None) -> GaugeMetricFamily:
    family = GaugeMetricFamily(name, doc, labels=list(labels or {}))
    if value is not None:
        family.add_metric(list((labels or {}).values()), float(value))
    return family


def _s(ms: float | None) -> float | None:
    return None if ms is None else ms / 1000


class _PlannerCollector(Collector):
    def __init__(self, loop: PlannerLoop) -> None:
        self.loop = loop

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        loop = self.loop
        config = loop.config
        yield _gauge("kvflow_planner_sla_ttft_seconds", "TTFT target (SLA).", config.ttft_ms / 1000)
        yield _gauge("kvflow_planner_sla_itl_seconds", "ITL target (SLA).", config.itl_ms / 1000)
        ticks = CounterMetricFamily("kvflow_planner_ticks", "Planner ticks by result (ok, failed).",
                                    labels=["result"])
        ticks.add_metric(["ok"], float(loop.num_ticks))
        ticks.add_metric(["failed"], float(loop.failed_ticks))
        yield ticks
        report = loop.reports[-1] if loop.reports else None
        if report is None:
            return
        agg, effects = report.aggregates, report.effects
        observed = GaugeMetricFamily("kvflow_planner_observed_latency_seconds", "Latency observed over the "
                                     "last window, by metric (ttft, itl) and statistic (mean, p50, p99).",
                                     labels=["metric", "statistic"])
        for metric, stat, ms in (("ttft", "mean", agg.mean_ttft_ms), ("ttft", "p50", agg.p50_ttft_ms),
                                 ("ttft", "p99", agg.p99_ttft_ms), ("itl", "mean", agg.mean_itl_ms),
                                 ("itl", "p50", agg.p50_itl_ms), ("itl", "p99", agg.p99_itl_ms)):
            if ms is not None:
                observed.add_metric([metric, stat], ms / 1000)
        yield observed
        yield _gauge("kvflow_planner_observed_requests_per_second", "Finished requests per second over the last window.",
                     agg.request_rate_per_s)
        prediction = effects.prediction
        yield _gauge("kvflow_planner_predicted_requests_per_second", "Requests per second predicted for the next "
                     "interval.", prediction.request_rate_per_s)
        yield _gauge("kvflow_planner_predicted_isl_tokens", "Mean ISL predicted for the next interval.",
                     prediction.isl)
        yield _gauge("kvflow_planner_predicted_osl_tokens", "Mean OSL predicted for the next interval.",
                     prediction.osl)
        yield _gauge("kvflow_planner_predicted_kv_hit_ratio", "Fraction of prompt tokens expected from the "
                     "KV cache.", prediction.kv_hit_rate)
        correction = GaugeMetricFamily("kvflow_planner_correction_ratio", "Observed / profiled latency the "
                                       "planner corrects by, per phase.", labels=["phase"])
        correction.add_metric(["prefill"], effects.prefill_correction)
        correction.add_metric(["decode"], effects.decode_correction)
        yield correction
        replicas = GaugeMetricFamily("kvflow_planner_replicas", "Replicas per pool: running at the tick, "
                                     "needed by the load, and the target set.", labels=["pool", "kind"])
        demand = GaugeMetricFamily("kvflow_planner_demand_tokens_per_second", "Predicted token load per pool.",
                                   labels=["pool"])
        for d in effects.decisions:
            pool = d.pool.value
            replicas.add_metric([pool, "current"], float(d.current_replicas))
            replicas.add_metric([pool, "needed"], float(d.needed_replicas))
            replicas.add_metric([pool, "target"], float(d.target_replicas))
            demand.add_metric([pool], d.demand_tokens_per_s)
        yield replicas
        yield demand
