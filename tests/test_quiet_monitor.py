"""The router app's Faust monitor keeps its totals but runs no sampler."""

from __future__ import annotations

import asyncio

from kvflow.router.app import build_router_app
from kvflow.router.quiet_monitor import QuietMonitor


async def test_the_router_app_monitor_counts_without_a_sampler(kafka):
    settings, _ = kafka
    app = build_router_app(settings)
    monitor = app.app.monitor
    assert isinstance(monitor, QuietMonitor)
    await monitor.start()
    try:
        # Its sampler task ran and returned; Faust's would still be looping.
        futures = list(monitor._futures)
        for _ in range(50):
            if all(f.done() for f in futures):
                break
            await asyncio.sleep(0.01)
        assert futures and all(f.done() for f in futures)
        monitor.messages_received_total += 1  # the counters are Faust's own, still there
        assert monitor.asdict()["messages_received_total"] == 1
    finally:
        await monitor.stop()
