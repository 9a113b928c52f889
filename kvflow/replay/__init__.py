"""Traffic replay: trace readers, the offline simulator, online replay and reports.

Entry points (what the ``kvflow replay`` command calls):

* :func:`run_offline` — simulate a trace on N mocker engines with the real
  routing code and a simulated clock; returns a :class:`Report`.
* :func:`run_online` / :func:`run_online_async` — send a trace to a running
  deployment (Kafka or OpenAI HTTP) at its arrival times; same report shape.
* :func:`compare_reports` — side-by-side markdown table of JSON reports.
"""

from kvflow.replay.compare import compare, compare_reports
from kvflow.replay.offline import run_offline
from kvflow.replay.online import run_online, run_online_async
from kvflow.replay.report import Report, build_report, load_report, render_markdown
from kvflow.replay.simulator import SimConfig, Simulation, simulate
from kvflow.replay.traces import Trace, TraceFormatError, TraceRequest, read_trace

__all__ = [
    "Report", "SimConfig", "Simulation", "Trace", "TraceFormatError", "TraceRequest", "build_report", "compare",
    "compare_reports", "load_report", "read_trace", "render_markdown", "run_offline", "run_online",
    "run_online_async", "simulate",
]
