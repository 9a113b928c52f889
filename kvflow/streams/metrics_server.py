"""Serve Prometheus metrics over HTTP from an asyncio process, and merge scrapes.

Every kvflow process that is not the bridge (workers; the ``kvflow up``
process with its router and planner) exposes its registries with
:func:`serve_metrics`: an aiohttp server on the process's event loop (no
thread, unlike ``prometheus_client.start_http_server``) answering
``GET /metrics`` in the Prometheus text format.

A single-machine deployment has one scrape point: the ``kvflow up``
process's server also fetches its workers' ``/metrics`` at each scrape and
merges them into its answer (:func:`merge_expositions`). Every worker series
carries a ``worker_id`` label, so merged samples never collide.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Iterable, Iterator
from dataclasses import dataclass, field

import httpx
from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.registry import Collector

__all__ = ["MetricsServer", "serve_metrics", "merge_expositions", "render", "metric_names"]

log = logging.getLogger(__name__)

SCRAPE_TIMEOUT_S = 2.0
"""Longest the aggregating server waits for one child's ``/metrics``; a child
that does not answer in time is left out of that scrape (logged)."""


class _Families(Collector):
    """A collector yielding fixed, already-parsed metric families."""

    def __init__(self, families: Iterable[Metric]) -> None:
        self.families = list(families)

    def collect(self) -> Iterator[Metric]:
        yield from self.families


def merge_expositions(texts: Iterable[str]) -> list[Metric]:
    """Parse Prometheus text expositions and merge families of the same name
    (their samples concatenated, HELP and type from the first seen).

    Raises:
        ValueError: a text is not in the Prometheus text format.
    """
    merged: dict[str, Metric] = {}
    for text in texts:
        for family in text_string_to_metric_families(text):
            held = merged.get(family.name)
            if held is None:
                merged[family.name] = family
            else:
                held.samples.extend(family.samples)
    return list(merged.values())


def render(registries: Iterable[CollectorRegistry], extra: Iterable[Metric] = ()) -> bytes:
    """One text exposition of every collector of ``registries`` plus the families ``extra``."""
    combined = CollectorRegistry(auto_describe=False)
    families: list[Metric] = []
    for registry in registries:
        families.extend(registry.collect())
    families.extend(extra)
    # Same-named families from two registries would be two blocks of one name: merge them.
    by_name: dict[str, Metric] = {}
    for family in families:
        if family.name in by_name:
            by_name[family.name].samples.extend(family.samples)
        else:
            by_name[family.name] = family
    combined.register(_Families(by_name.values()))
    return generate_latest(combined)


_SUFFIXES = {"counter": ("_total", "_created"), "histogram": ("_bucket", "_sum", "_count", "_created"),
             "summary": ("_sum", "_count", "_created"), "gauge": ("",), "info": ("_info",),
             "gaugehistogram": ("_bucket", "_gsum", "_gcount"), "stateset": ("",), "unknown": ("",)}


def metric_names(registry: CollectorRegistry) -> set[str]:
    """Every sample name ``registry`` can export (``_total``, ``_bucket`` ... by
    family type), also for labelled families that have no sample yet."""
    return {family.name + suffix for family in registry.collect() for suffix in _SUFFIXES[family.type]}


@dataclass
class MetricsServer:
    """A running ``/metrics`` server (see :func:`serve_metrics`)."""

    runner: web.AppRunner
    host: str
    port: int
    registries: list[CollectorRegistry] = field(default_factory=list)
    children: Callable[[], Iterable[str]] | None = None
    """Returns the ``/metrics`` URLs of processes whose metrics this server merges in."""

    @property
    def url(self) -> str:
        """The scrape URL, ``http://host:port/metrics``."""
        return f"http://{self.host}:{self.port}/metrics"

    async def stop(self) -> None:
        """Close the listening socket and open connections."""
        await self.runner.cleanup()


async def _fetch(http: httpx.AsyncClient, url: str) -> str:
    try:
        answer = await http.get(url, timeout=SCRAPE_TIMEOUT_S)
        answer.raise_for_status()
        return answer.text
    except httpx.HTTPError as exc:
        log.warning("scraping %s failed: %r", url, exc)
        return ""


async def serve_metrics(registries: Iterable[CollectorRegistry], host: str = "127.0.0.1", port: int = 0, *,
                        children: Callable[[], Iterable[str]] | None = None,
                        before_scrape: Callable[[], Awaitable[None]] | None = None) -> MetricsServer:
    """Start serving ``GET /metrics`` for ``registries`` on ``host:port``
    (``port`` 0: a free port, read it from the result).

    ``children``: at each scrape, the ``/metrics`` URLs to fetch and merge in
    (one that fails is left out of that scrape). ``before_scrape``: awaited
    first (refreshes values computed with I/O, such as consumer lag).

    Raises:
        OSError: the address is in use or cannot be bound.
    """
    regs = list(registries)  # the server's own list: append to MetricsServer.registries to add one later
    http = httpx.AsyncClient()

    async def handle(_: web.Request) -> web.Response:
        if before_scrape is not None:
            try:
                await before_scrape()
            except Exception:  # noqa: BLE001 - a failed refresh must not fail the scrape
                log.exception("refreshing metrics before a scrape failed")
        texts = await asyncio.gather(*(_fetch(http, u) for u in (children() if children else ())))
        extra = merge_expositions(t for t in texts if t)
        return web.Response(body=render(regs, extra), headers={"Content-Type": CONTENT_TYPE_LATEST})

    app = web.Application()
    app.router.add_get("/metrics", handle)

    async def close_http(_: web.Application) -> None:
        await http.aclose()

    app.on_cleanup.append(close_http)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, host, port)
    await site.start()
    bound = runner.addresses[0][1]  # the real port when 0 was asked
    return MetricsServer(runner, host, bound, regs, children)
