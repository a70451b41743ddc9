"""Tracing across processes: `factmill serve`, `worker` (and `beat`) export OTLP/HTTP to a small
collector this test runs, and one posted page gives one connected trace from the webhook request to
every LLM call and segment commit, whether the request or the sweeper sent the job."""

from __future__ import annotations

import gzip
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)
from opentelemetry.proto.common.v1.common_pb2 import AnyValue
from sqlalchemy import select
from sqlalchemy.orm import Session, sessionmaker

from factmill_client import Client
from models import Job
from tests.e2e.test_service_e2e import SECRET
from tests.service import ServiceProcess, free_port, running, service_env, start_beat, start_worker, wait_for
from tests.tracing_helpers import (
    SpanRecord,
    ancestors,
    committed_segments,
    llm_calls,
    names,
    one_trace,
    segments_processed,
)

# Three service processes a test: more than the other e2e modules need on a loaded machine.
pytestmark = [pytest.mark.e2e, pytest.mark.timeout(480)]

DEAD_BROKER = "redis://127.0.0.1:1/0"


def conversation(days: int) -> str:
    lines = []
    for day in range(1, days + 1):
        lines.append(f"**Alice Example** (2024-04-{day:02d} 9:00 AM): I moved to office {day} today.")
        lines.append(f"**Bob Demo** (2024-04-{day:02d} 9:05 AM): Noted, office {day} it is.")
    return "\n".join(lines)


def page(slug: str) -> dict[str, Any]:
    return {"slug": slug, "type": "conversation", "title": slug, "compiled_truth": conversation(3)}


def _value(value: AnyValue) -> Any:
    kind = value.WhichOneof("value")
    return (
        getattr(value, kind) if kind in ("string_value", "int_value", "double_value", "bool_value") else None
    )


class Collector:
    """An OTLP/HTTP traces endpoint (POST /v1/traces, protobuf) that keeps every span it is sent."""

    def __init__(self) -> None:
        self.spans: list[SpanRecord] = []
        self._lock = threading.Lock()
        collector = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length", "0")))
                if self.headers.get("Content-Encoding") == "gzip":
                    body = gzip.decompress(body)
                request = ExportTraceServiceRequest()
                request.ParseFromString(body)
                collector.add(request)
                reply = ExportTraceServiceResponse().SerializeToString()
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", str(len(reply)))
                self.end_headers()
                self.wfile.write(reply)

            def log_message(self, format: str, *args: Any) -> None:  # quiet
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"

    def add(self, request: ExportTraceServiceRequest) -> None:
        records = []
        for resource_spans in request.resource_spans:
            resource = {kv.key: _value(kv.value) for kv in resource_spans.resource.attributes}
            for scope_spans in resource_spans.scope_spans:
                for span in scope_spans.spans:
                    records.append(
                        SpanRecord(
                            trace_id=span.trace_id.hex(),
                            span_id=span.span_id.hex(),
                            parent_id=span.parent_span_id.hex() or None,
                            name=span.name,
                            service=str(resource.get("service.name", "")),
                            attributes={kv.key: _value(kv.value) for kv in span.attributes},
                        )
                    )
        with self._lock:
            self.spans.extend(records)

    def snapshot(self) -> list[SpanRecord]:
        with self._lock:
            return list(self.spans)

    def webhook_root(self, job_id: int) -> SpanRecord | None:
        """The API's server span of the request that queued job ``job_id`` (found through its commits;
        spans name no slug)."""
        spans = self.snapshot()
        roots = {s.span_id: s for s in spans if is_request_root(s)}
        for span in spans:
            if span.name == "segment commit" and span.attributes.get("factmill.job.id") == job_id:
                for candidate in roots.values():
                    if candidate.trace_id == span.trace_id:
                        return candidate
        return None


def is_request_root(span: SpanRecord) -> bool:
    """The API's server span of a page delivery (it has no parent: the webhook starts the trace)."""
    return span.name.startswith("POST /v1/pages") and span.parent_id is None


@pytest.fixture
def collector() -> Iterator[Collector]:
    found = Collector()
    thread = threading.Thread(target=found.server.serve_forever, daemon=True)
    thread.start()
    try:
        yield found
    finally:
        found.server.shutdown()
        found.server.server_close()


def traced_env(
    database_url: str, broker_url: str, simulator: Any, collector: Collector, **extra: Any
) -> dict[str, str]:
    env = service_env(
        database_url,
        broker_url,
        simulator.base_url,
        otel_endpoint=collector.url,
        embed_after_extraction="false",
        job_requeue_after_seconds="60",  # one send per job: the sweeper re-sends only what is lost
        **extra,
    )
    env["OTEL_BSP_SCHEDULE_DELAY"] = "200"  # the SDK's batch delay (ms): spans reach the collector soon
    return env


def only_job(factory: sessionmaker[Session]) -> Job:
    """The page's extraction job (its success also requests consolidation jobs, not traced here)."""
    with factory() as session:
        [job] = session.scalars(select(Job).where(Job.kind == "extraction")).all()
        return job


TASK_SPAN = "run/tasks.extraction.extract_page"
PUBLISH_SPAN = "apply_async/tasks.extraction.extract_page"


def trace_of(collector: Collector, job_id: int) -> list[SpanRecord]:
    root = collector.webhook_root(job_id)
    return [] if root is None else [s for s in collector.snapshot() if s.trace_id == root.trace_id]


def assert_one_connected_trace(
    collector: Collector, factory: sessionmaker[Session], simulator: Any, via: str
) -> list[SpanRecord]:
    """The webhook's trace holds the task, the job, every LLM call and every segment commit, all
    reachable from the request's span; returns the trace's spans."""

    def succeeded() -> bool:
        return only_job(factory).status == "succeeded"

    wait_for(succeeded, 120, f"the job sent by {via} to succeed")
    job = only_job(factory)
    segments = segments_processed(factory, job.id)
    assert segments == 3

    def complete() -> bool:  # the worker's batch reaches the collector a moment after the job ends
        trace = trace_of(collector, job.id)
        seen = names(trace)
        return (
            len(committed_segments(trace)) == segments
            and seen["job extraction"] >= 1
            and seen[TASK_SPAN] >= 1
        )

    wait_for(
        complete, 60, f"the trace of the page sent by {via}", diagnostics=lambda: str(everything(collector))
    )
    root = collector.webhook_root(job.id)
    assert root is not None and root.service == "factmill-api"
    members = one_trace(collector.snapshot(), root)
    assert {s.service for s in members} == {"factmill-api", "factmill-worker"}
    [job_span] = [
        s
        for s in members
        if s.name == "job extraction" and s.attributes["factmill.job.outcome"] == "succeeded"
    ]
    assert job_span.attributes["factmill.job.id"] == job.id
    [task] = [s for s in members if s.span_id == job_span.parent_id]
    assert task.name == TASK_SPAN and task.service == "factmill-worker"
    calls = [s for s in members if s.is_llm_call(simulator.base_url)]
    commits = [s for s in members if s.name == "segment commit"]
    assert len(calls) == llm_calls(factory, job.id) == segments, names(members)
    assert committed_segments(commits) == list(range(segments))
    for span in [*calls, *commits]:
        assert "job extraction" in ancestors(span, members)
    return members


def everything(collector: Collector) -> dict[str, int]:
    return dict(names(collector.snapshot()))


def test_one_page_gives_one_trace_across_the_api_and_worker_processes(
    database_url: str, factory: sessionmaker[Session], broker_url: str, simulator: Any, collector: Collector
) -> None:
    env = traced_env(database_url, broker_url, simulator, collector)
    port = free_port()
    api = ServiceProcess(
        ["serve", "--port", str(port)], env, ready_marker="Application startup complete", name="api"
    ).start()
    worker = start_worker(env, queues="extraction", concurrency=4)
    slug = "conversations/traced/in-request"
    with (
        running(api, worker),
        Client(f"http://127.0.0.1:{port}", webhook_secret=SECRET, timeout=30) as client,
    ):
        assert client.ingest_page(page(slug)).jobs
        members = assert_one_connected_trace(collector, factory, simulator, "the request")
    # Sent inside the request: the Celery instrumentation's publish span, in the API process.
    [publish] = [s for s in members if s.name == PUBLISH_SPAN]
    assert publish.service == "factmill-api"
    assert only_job(factory).traceparent is not None
    # What a collector received names no slug (which can name a person) in any span of either process.
    assert "traced/in-request" not in repr([s.attributes for s in collector.snapshot()])


def test_a_job_the_sweeper_sends_joins_the_trace_of_its_webhook(
    database_url: str,
    factory: sessionmaker[Session],
    broker_url: str,
    simulator: Any,
    collector: Collector,
    tmp_path: Path,
) -> None:
    """The API cannot reach the broker: the job stays queued with its traceparent, and the sweeper
    (a worker's task, started by beat) sends it long after the request ended."""
    worker_env = traced_env(database_url, broker_url, simulator, collector)
    api_env = {**worker_env, "FACTMILL_BROKER_URL": DEAD_BROKER}
    port = free_port()
    api = ServiceProcess(
        ["serve", "--port", str(port)], api_env, ready_marker="Application startup complete", name="api"
    ).start()
    slug = "conversations/traced/swept"
    with running(api):
        with Client(f"http://127.0.0.1:{port}", webhook_secret=SECRET, timeout=60) as client:
            assert client.ingest_page(page(slug)).jobs
        # The request's span reaches the collector before the API is stopped: on a loaded machine a
        # SIGTERMed API may not finish its exit (which flushes its spans) before `stop` kills it.
        wait_for(
            lambda: any(is_request_root(s) for s in collector.snapshot()),
            60,
            "the API's request span to reach the collector",
            diagnostics=lambda: str(everything(collector)),
        )
    job = only_job(factory)
    assert job.status == "queued" and job.enqueued_at is None and job.traceparent is not None
    worker = start_worker(worker_env, queues="extraction,maintenance", concurrency=4)
    beat = start_beat(worker_env, tmp_path)
    with running(beat, worker):
        members = assert_one_connected_trace(collector, factory, simulator, "the sweeper")
    # The sweep task's send (in the worker), parented on the context the job stored.
    publishes = [s for s in members if s.name == PUBLISH_SPAN]
    assert publishes and {s.service for s in publishes} == {"factmill-worker"}
