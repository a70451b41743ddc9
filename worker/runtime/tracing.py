"""Optional OpenTelemetry tracing for one process: off unless FACTMILL_OTEL_ENDPOINT is set, and the only
module that imports OpenTelemetry (the `otel` extra), so a process without it runs as before.

One trace follows a page: the webhook request (FastAPI), the job it creates, the Celery message that
sends it (the Celery instrumentation carries the context in the message headers), the task, the
job's run, each LLM call (the SDKs speak httpx2), each segment's commit, and the SQL under all of
them. The sweeper re-sends jobs long after their request; for those the job's stored traceparent
(jobs.traceparent) is made the current context around the send, so the task still joins the trace.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import logging
import random
import re
import threading
import weakref
from collections.abc import Iterator, Mapping
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field
from typing import Any

from worker.settings import Settings

logger = logging.getLogger(__name__)

TRACES_PATH = "/v1/traces"
TRACEPARENT = "traceparent"
# Probes and scrapes would drown the traces that matter. OpenTelemetry searches each pattern anywhere in
# "<scheme>://<host><path>": unanchored, a page slug holding "metrics" (/v1/pages/default/q3-metrics) or
# a host named metrics-api... lost its traces. One pattern (the list is split on commas).
EXCLUDED_URLS = r"^[a-z]+://[^/]*/(healthz|readyz|metrics)$"
# What the `otel` extra installs (the OTLP exporter depends on opentelemetry-proto).
REQUIRED_MODULES = (
    "opentelemetry.sdk.trace",
    "opentelemetry.exporter.otlp.proto.http.trace_exporter",
    "opentelemetry.instrumentation.celery",
    "opentelemetry.instrumentation.fastapi",
    "opentelemetry.instrumentation.httpx",
    "opentelemetry.instrumentation.sqlalchemy",
)

Attributes = Mapping[str, str | int | float | bool]


class TracingUnavailableError(RuntimeError):
    """FACTMILL_OTEL_ENDPOINT is set but the OpenTelemetry packages (the `otel` extra) are missing."""


@dataclass
class _Tracing:
    service: str
    provider: Any  # opentelemetry.sdk.trace.TracerProvider
    tracer: Any
    instrumentors: list[Any]
    engines: weakref.WeakSet[Any] = field(default_factory=weakref.WeakSet)


_active: _Tracing | None = None
_lock = threading.Lock()


def traces_url(endpoint: str) -> str:
    """The OTLP/HTTP traces URL for an endpoint given as the collector's base URL or the full path."""
    endpoint = endpoint.strip().rstrip("/")
    return endpoint if endpoint.endswith(TRACES_PATH) else endpoint + TRACES_PATH


def wanted(settings: Settings) -> bool:
    return bool(settings.otel_endpoint and settings.otel_endpoint.strip())


def require_packages(settings: Settings) -> None:
    """Raise TracingUnavailableError, with what to do, when tracing is asked for but not installed."""
    if not wanted(settings):
        return
    try:
        for module in REQUIRED_MODULES:
            importlib.import_module(module)
    except ImportError as exc:
        raise TracingUnavailableError(
            f"FACTMILL_OTEL_ENDPOINT is set but OpenTelemetry is not installed ({exc.name} is missing); "
            "install the extra with `pip install 'factmill[otel]'`, or unset FACTMILL_OTEL_ENDPOINT"
        ) from None


def enabled() -> bool:
    return _active is not None


def setup(settings: Settings, service: str, *, exporter: Any = None) -> bool:
    """Turn tracing on for this process (once; later calls keep the first set-up). Returns whether
    tracing is on. ``exporter`` (tests: an in-memory exporter) replaces the OTLP exporter and takes
    spans synchronously, without becoming the global tracer provider."""
    global _active
    if _active is not None:
        return True
    if exporter is None and not wanted(settings):
        return False
    if exporter is None:
        require_packages(settings)
    with _lock:
        if _active is None:
            _active = _start(settings, service, exporter)
            logger.info("tracing on: service %s", service)
    return True


# How long one export (its retries included) and the flush at exit may take: a collector that accepts
# connections and never answers held every process's exit 30 s and more (the SDK's defaults), past a
# worker's grace period and Kubernetes' termination period. Spans left then are dropped.
EXPORT_TIMEOUT_SECONDS = 5


def _sampler() -> Any:
    """The SDK's own sampler (OTEL_TRACES_SAMPLER and its argument still apply; by default every span
    a parent's sampling allows), but a client span (a statement, an HTTP call) with no parent is not
    sampled: each was a trace of its own, and the scrapes', probes' and heartbeats' statements (25 a
    scrape, 6 a second for a busy extraction pod) buried the traces an operator looks for.

    A request's server span is sampled as a root even when the request carried a traceparent: the
    header is the sender's, whoever it is (unsigned requests are traced too), and its flag decided the
    whole pipeline: ``-00`` kept a page's run and its LLM calls out of every trace, ``-01`` traced each
    such request under a 1% ratio. The span still joins the sender's trace; our decision rides on."""
    from opentelemetry.context import Context
    from opentelemetry.sdk.trace import sampling
    from opentelemetry.trace import SpanKind, get_current_span

    configured = getattr(sampling, "_get_from_env_or_default", lambda: sampling.DEFAULT_ON)()

    class NoOrphanClients(sampling.Sampler):
        def should_sample(
            self, parent_context: Any, trace_id: int, name: str, kind: Any = None, *args: Any, **kw: Any
        ) -> Any:
            parent = get_current_span(parent_context).get_span_context()
            if kind == SpanKind.CLIENT and not parent.is_valid:
                return sampling.SamplingResult(sampling.Decision.DROP)
            if kind == SpanKind.SERVER and parent.is_remote:
                # Decided as a root (an empty context: None reads the current one, where the ASGI
                # middleware attached the sender's), on a trace id of our own (a ratio sampler reads
                # its bits, and the sender chose them); the span keeps the sender's trace id.
                parent_context, trace_id = Context(), random.getrandbits(128)
            return configured.should_sample(parent_context, trace_id, name, kind, *args, **kw)

        def get_description(self) -> str:
            return f"NoOrphanClients{{{configured.get_description()}}}"

    return NoOrphanClients()


def _start(settings: Settings, service: str, exporter: Any) -> _Tracing:
    from opentelemetry import trace
    from opentelemetry.instrumentation.celery import CeleryInstrumentor
    from opentelemetry.instrumentation.httpx import HTTPXClientInstrumentor
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor, SimpleSpanProcessor

    provider = TracerProvider(resource=Resource.create({"service.name": service}), sampler=_sampler())
    if exporter is None:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

        assert settings.otel_endpoint is not None  # wanted() checked it
        otlp = OTLPSpanExporter(traces_url(settings.otel_endpoint), timeout=EXPORT_TIMEOUT_SECONDS)
        provider.add_span_processor(
            BatchSpanProcessor(_scrubbing(otlp), export_timeout_millis=EXPORT_TIMEOUT_SECONDS * 1000)
        )
        trace.set_tracer_provider(provider)  # for any other library that traces through the global one
    else:
        provider.add_span_processor(SimpleSpanProcessor(_scrubbing(exporter)))
    # SQLAlchemy is traced per engine (instrument_engine): its global instrumentor also wraps the
    # asyncio engine, which needs greenlet, and it misses engines made through an imported name.
    instrumentors: list[Any] = [CeleryInstrumentor(), HTTPXClientInstrumentor()]
    if importlib.util.find_spec("httpx2") is not None:  # what the openai/anthropic SDKs now ride on
        from opentelemetry.instrumentation.httpx import HTTPX2ClientInstrumentor

        instrumentors.append(HTTPX2ClientInstrumentor())
    for instrumentor in instrumentors:
        instrumentor.instrument(tracer_provider=provider)
    return _Tracing(service, provider, provider.get_tracer("factmill"), instrumentors)


class _Scrubbed:
    """An exporter that sends each span without what an exception's message quotes: a span's status
    keeps the error's class, and its exception events their type (no message, no stack trace). Our
    errors name slugs (PageChangedError), and the SQLAlchemy instrumentation sets the driver's message,
    DETAIL and all (``Key (kind, subject)=(extraction, source|slug)``), which no erasure can take out of
    a trace store, and which hide_parameters keeps out of the logs only."""

    def __init__(self, inner: Any) -> None:
        self._inner = inner

    def export(self, spans: Any) -> Any:
        return self._inner.export([_scrubbed(span) for span in spans])

    def shutdown(self) -> None:
        self._inner.shutdown()

    def force_flush(self, timeout_millis: int = 30_000) -> bool:
        return bool(self._inner.force_flush(timeout_millis))


def _scrubbing(inner: Any) -> Any:
    """``inner`` behind ``_Scrubbed`` (typed Any: the SDK's processors take any exporter-shaped object,
    and the SDK is imported only once tracing is on)."""
    return _Scrubbed(inner)


_ERROR_CLASS = re.compile(r"\(?([A-Za-z_][\w.]*)(?:\)|:|$)")


def _scrubbed(span: Any) -> Any:
    from opentelemetry.sdk.trace import Event, ReadableSpan
    from opentelemetry.trace import Status

    exceptions = [event for event in span.events if event.name == "exception"]
    if span.status.description is None and not exceptions:
        return span
    found = _ERROR_CLASS.match(span.status.description or "")
    status = Status(span.status.status_code, found.group(1) if found else None)
    events = [
        Event("exception", {"exception.type": event.attributes.get("exception.type", "")}, event.timestamp)
        if event.name == "exception"
        else event
        for event in span.events
    ]
    return ReadableSpan(
        name=span.name,
        context=span.context,
        parent=span.parent,
        resource=span.resource,
        attributes=span.attributes,
        events=events,
        links=span.links,
        kind=span.kind,
        status=status,
        start_time=span.start_time,
        end_time=span.end_time,
        instrumentation_scope=span.instrumentation_scope,
    )


def shutdown() -> None:
    """Flush, remove the instrumentation and turn tracing off (tests; a process normally keeps it)."""
    global _active
    with _lock:
        active, _active = _active, None
    if active is None:
        return
    for instrumentor in active.instrumentors:
        instrumentor.uninstrument()
    if active.engines:
        from opentelemetry.instrumentation.sqlalchemy import EngineTracer

        EngineTracer.remove_all_event_listeners()
    active.provider.shutdown()


def instrument_app(app: Any) -> None:
    """Trace a FastAPI app's requests (a server span each, the root of a page's trace)."""
    if _active is None:
        return
    from opentelemetry.instrumentation.fastapi import FastAPIInstrumentor

    FastAPIInstrumentor.instrument_app(
        app,
        tracer_provider=_active.provider,
        excluded_urls=EXCLUDED_URLS,
        exclude_spans=["receive", "send"],  # one span per request, not one per ASGI message
        server_request_hook=_name_the_route_not_the_path,
    )


# The request attributes that hold the path or the query as sent: a page's slug (which can name a person
# and which no erasure can take out of a trace store), a search's words. Old and stable conventions.
_PATH_ATTRIBUTES = ("http.target", "url.path")
_URL_ATTRIBUTES = ("http.url", "url.full")


def _name_the_route_not_the_path(span: Any, scope: dict[str, Any]) -> None:
    """A server span names the route's template (``/v1/pages/{source_id}/{slug:text}``, or
    "unmatched"), never the path or the query, as the API's access log does."""
    if not span.is_recording():
        return
    attributes = getattr(span, "attributes", None) or {}
    route = attributes.get("http.route") or "unmatched"
    for key in _PATH_ATTRIBUTES:
        if key in attributes:
            span.set_attribute(key, route)
    for key in _URL_ATTRIBUTES:
        if key in attributes:
            span.set_attribute(
                key, f"{scope.get('scheme', 'http')}://{attributes.get('http.host', '')}{route}"
            )
    if "url.query" in attributes:
        span.set_attribute("url.query", "")


def instrument_engine(bind: Any) -> None:
    """Trace the statements of an engine (or of a connection's engine), once per engine: the runtime's
    engine, whenever it was made."""
    active = _active
    engine = getattr(bind, "engine", None)
    if active is None or engine is None or engine in active.engines:
        return
    from opentelemetry.instrumentation.sqlalchemy import EngineTracer
    from opentelemetry.metrics import get_meter

    counter = get_meter("factmill").create_up_down_counter("db.client.connections.usage")
    EngineTracer(active.provider.get_tracer("opentelemetry.instrumentation.sqlalchemy"), engine, counter)
    active.engines.add(engine)


def span(name: str, attributes: Attributes | None = None, *, parent: str | None = None) -> Any:
    """A span around a block (a context manager yielding the span, or None when tracing is off).

    ``parent`` (a traceparent) is used only when the current span continues no trace (``continues``),
    e.g. a job whose message came from a process that did not trace: the Celery instrumentation's run
    span for it is a root of its own."""
    active = _active
    if active is None:
        return nullcontext()
    context = _extract(parent) if parent and not continues() else None
    return active.tracer.start_as_current_span(name, context=context, attributes=attributes)


def continues() -> bool:
    """Whether the current span continues a trace: it has a parent (a remote one a message or a
    request carried, or an enclosing span here). False when nothing is traced here, or the current
    span is a root this process began (Celery's run span for a message sent without a trace: the CLI
    does not trace, so a job it re-sent lost its request's trace)."""
    if _active is None:
        return False
    from opentelemetry import trace

    current = trace.get_current_span()
    return current.get_span_context().is_valid and getattr(current, "parent", None) is not None


def annotate(key: str, value: str | int | float | bool) -> None:
    """Set an attribute on the current span (a job's outcome, a commit's row count)."""
    if _active is None:
        return
    from opentelemetry import trace

    trace.get_current_span().set_attribute(key, value)


def current_traceparent() -> str | None:
    """The W3C traceparent of the current span, to store with a job (None when not tracing)."""
    if _active is None:
        return None
    from opentelemetry.propagate import inject

    carrier: dict[str, str] = {}
    inject(carrier)
    return carrier.get(TRACEPARENT)


def resumed(traceparent: str | None) -> AbstractContextManager[None]:
    """Make a stored traceparent the current context for a block (the sweeper's sends)."""
    if _active is None or not traceparent:
        return nullcontext()
    return _attached(traceparent)


@contextlib.contextmanager
def _attached(traceparent: str) -> Iterator[None]:
    from opentelemetry import context

    token = context.attach(_extract(traceparent))
    try:
        yield
    finally:
        context.detach(token)


def _extract(traceparent: str) -> Any:
    from opentelemetry.propagate import extract

    return extract({TRACEPARENT: traceparent})
