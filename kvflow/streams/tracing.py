"""OpenTelemetry tracing across the pipeline, with the trace context in Kafka record headers.

One request is one trace: the bridge's span (``bridge <endpoint>``, from the
HTTP body to the last byte of the answer) is the root; the router's
(``router route``) and the worker's (``worker serve``, with a child
``engine generate``) are its descendants. Between processes the context
travels as a W3C ``traceparent`` (and ``tracestate``) header on the Kafka
records: the request record (client → router), the queue record (router →
worker) and a forwarded disaggregated request (prefill → decode worker).
Records without the header start a new trace.

:func:`setup_tracing` installs the OpenTelemetry SDK's tracer provider in a
process (entry points call it once), so trace ids exist and travel even
when nothing is exported; spans are exported over OTLP/HTTP only when
``settings.otlp_endpoint`` is set. A process that never calls it (a library
user, a test with its own provider) gets whatever provider is installed,
the API's no-op one by default: headers then carry an incoming context
through unchanged.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping, Sequence

from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from kvflow.settings import Settings

__all__ = ["setup_tracing", "tracer", "inject_headers", "extract_context", "trace_id_hex", "TRACE_ID_HEADER"]

log = logging.getLogger(__name__)

TRACE_ID_HEADER = "X-Trace-Id"
"""HTTP response header carrying the request's trace id (32 hex digits)."""

_PROPAGATOR = TraceContextTextMapPropagator()
_INSTALLED = False


def setup_tracing(settings: Settings, service_name: str) -> bool:
    """Install the SDK tracer provider for this process as ``service_name``
    (``kvflow-bridge``, ``kvflow-worker`` ...), exporting to
    ``settings.otlp_endpoint`` when set. Does nothing when a provider is
    already installed (returns False then).

    Raises:
        ImportError: the OTLP exporter package is missing and an endpoint is set.
    """
    global _INSTALLED
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider

    if _INSTALLED or isinstance(trace.get_tracer_provider(), TracerProvider):
        return False
    provider = TracerProvider(resource=Resource.create({"service.name": service_name}))
    if settings.otlp_endpoint:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
        from opentelemetry.sdk.trace.export import BatchSpanProcessor

        provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=settings.otlp_endpoint)))
        log.info("exporting traces of %s to %s", service_name, settings.otlp_endpoint)
    trace.set_tracer_provider(provider)
    _INSTALLED = True
    return True


def tracer() -> trace.Tracer:
    """kvflow's tracer from the provider installed now."""
    return trace.get_tracer("kvflow")


def inject_headers(ctx: otel_context.Context | None = None) -> list[tuple[str, bytes]] | None:
    """Kafka record headers carrying ``ctx`` (default: the current context);
    ``None`` when it holds no valid span (nothing to propagate)."""
    carrier: dict[str, str] = {}
    _PROPAGATOR.inject(carrier, context=ctx)
    return [(k, v.encode()) for k, v in carrier.items()] or None


def extract_context(headers: Sequence[tuple[str, bytes]] | Mapping[str, bytes] | None) -> otel_context.Context:
    """The trace context in a consumed record's headers (an empty context when it has none)."""
    if not headers:
        return otel_context.Context()
    pairs: Iterable[tuple[str, bytes]] = headers.items() if isinstance(headers, Mapping) else headers
    carrier = {k.lower(): (v.decode("latin-1") if isinstance(v, bytes | bytearray) else str(v))
               for k, v in pairs if v is not None}
    return _PROPAGATOR.extract(carrier)


def trace_id_hex(span: trace.Span) -> str | None:
    """``span``'s trace id as 32 hex digits; ``None`` for a non-recording, invalid span."""
    ctx = span.get_span_context()
    return trace.format_trace_id(ctx.trace_id) if ctx.is_valid else None
