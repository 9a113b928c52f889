"""Faust's monitor sensor without its once-a-second sampler.

Faust adds a :class:`faust.sensors.Monitor` to every app. Besides counting
messages and events as they pass (bounded deques and counters), it runs a
sampler task that wakes every second to turn those counts into rates and
averages for Faust's web views. The router app runs with Faust's web server
off and reads none of those rates, so the sampler is an idle wake-up that
buys nothing: one of the ~17 wake-ups a second of an idle ``kvflow up``
(docs/benchmarks.md, "Idle wake-ups"). The counters themselves stay, so
anything that reads the monitor's totals still works.
"""

from __future__ import annotations

from faust.sensors import Monitor
from mode import Service

__all__ = ["QuietMonitor"]


class QuietMonitor(Monitor):
    """:class:`faust.sensors.Monitor` whose rate sampler never runs.

    Pass as ``faust.App(..., Monitor=QuietMonitor)``. Totals
    (``messages_received_total``, ``events_total``, ...) are kept as by
    Faust's monitor; the sampled rates (``events_s``, ``messages_s``,
    ``events_runtime_avg``) stay at their initial values.
    """

    @Service.task
    async def _sampler(self) -> None:
        # mode starts every task its classes declare, by name: a task that returns at once
        # replaces the parent's loop.
        return
