"""OpenTelemetry tracing in one process, with the SDK's in-memory exporter: a webhook request, the job
it stores, its sends (in the request and from the sweeper) and the job's run with its LLM calls and
segment commits make one connected trace; with tracing off nothing is installed."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from typing import Any

import pytest
from fastapi.testclient import TestClient
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from sqlalchemy.orm import Session, sessionmaker

from models import Job
from tests.integration.test_api import Recorder, make_runtime, post
from tests.service import REPO
from tests.tracing_helpers import (
    ancestors,
    committed_segments,
    from_sdk,
    llm_calls,
    names,
    one_trace,
    segments_processed,
)
from worker.api.app import create_app
from worker.config_store import set_config
from worker.jobs.lifecycle import run_job
from worker.jobs.outbox import EXTRACTION, request_job
from worker.jobs.sending import enqueue
from worker.runtime import tracing
from worker.settings import Settings

pytestmark = pytest.mark.integration


def conversation(days: int) -> str:
    """A page of ``days`` segments: two messages a day, a day apart."""
    lines = []
    for day in range(1, days + 1):
        lines.append(f"**Alice Example** (2024-03-{day:02d} 9:00 AM): I moved to office {day} today.")
        lines.append(f"**Bob Demo** (2024-03-{day:02d} 9:05 AM): Noted, office {day} it is.")
    return "\n".join(lines)


PAGE = {
    "slug": "conversations/traced/alice",
    "type": "conversation",
    "title": "Alice and Bob",
    "compiled_truth": conversation(3),
}


class TraceRecorder(Recorder):
    """A sender that also records the trace context each send happened in."""

    def __init__(self, factory: sessionmaker[Session]) -> None:
        super().__init__(factory)
        self.traceparents: list[str | None] = []

    def __call__(self, task_name: str, job_id: int, queue: str) -> None:
        self.traceparents.append(tracing.current_traceparent())
        super().__call__(task_name, job_id, queue)


@pytest.fixture
def exporter() -> Iterator[InMemorySpanExporter]:
    spans = InMemorySpanExporter()
    assert tracing.setup(Settings(), "factmill-test", exporter=spans)
    try:
        yield spans
    finally:
        tracing.shutdown()  # uninstrumented again: later tests run untraced


def job_row(factory: sessionmaker[Session], job_id: int) -> Job:
    with factory() as session:
        job = session.get(Job, job_id)
        assert job is not None
        return job


def trace_id(traceparent: str | None) -> str:
    assert traceparent is not None
    return traceparent.split("-")[1]


def test_one_page_gives_one_connected_trace_through_the_outbox_and_the_run(
    exporter: InMemorySpanExporter, factory: sessionmaker[Session], database_url: str, simulator: Any
) -> None:
    runtime = make_runtime(
        database_url,
        factory,
        llm="simulator",
        simulator_url=simulator.base_url,
        segment_concurrency=4,  # the calls run on pool threads: they must keep the job's context
        embed_after_extraction=False,
    )
    with factory.begin() as session:
        set_config(session, "facts.extraction_enabled", "true")
    in_request = TraceRecorder(factory)
    with TestClient(create_app(runtime, sender=in_request)) as client:
        response = post(client, PAGE)
        # Reads whose path holds the slug and whose query holds a search's words (401: no key; the
        # request is traced all the same).
        client.get(f"/v1/pages/default/{PAGE['slug']}/facts")
        client.get("/v1/search", params={"q": "whispered confidences"})
    assert response.status_code in (200, 202), response.text
    [job_id] = in_request.job_ids
    request_spans = from_sdk(exporter.get_finished_spans())
    [root] = [s for s in request_spans if s.name.startswith("POST /v1/pages") and s.parent_id is None]
    stored = job_row(factory, job_id).traceparent
    # The job carries the request's span; the in-request send happened inside the request's trace.
    assert stored is not None and stored.split("-")[1:3] == [root.trace_id, root.span_id]
    assert trace_id(in_request.traceparents[0]) == root.trace_id

    # The sweeper's send, long after the request and outside any span, joins the same trace.
    assert tracing.current_traceparent() is None
    swept = TraceRecorder(factory)
    assert enqueue(factory, [(job_id, EXTRACTION)], swept) == 1
    assert trace_id(swept.traceparents[0]) == root.trace_id

    # A message without trace headers (a sender that did not trace): the run takes the stored parent.
    try:
        outcome = run_job(runtime, job_id, EXTRACTION)
    finally:
        runtime.close()
    assert outcome.status == "succeeded", outcome
    spans = from_sdk(exporter.get_finished_spans())
    members = one_trace(spans, root)
    [job_span] = [s for s in members if s.name == "job extraction"]
    assert job_span.parent_id == root.span_id
    assert job_span.attributes["factmill.job.id"] == job_id
    assert job_span.attributes["factmill.job.outcome"] == "succeeded"
    calls = [s for s in members if s.is_llm_call(simulator.base_url)]
    commits = [s for s in members if s.name == "segment commit"]
    segments = segments_processed(factory, job_id)
    assert segments == 3
    assert len(calls) == llm_calls(factory, job_id) == segments, names(members)
    assert committed_segments(commits) == [0, 1, 2]  # each segment committed once, by some span
    for span in [*calls, *commits]:
        assert "job extraction" in ancestors(span, members)
    # The SQL under the request and the run is traced too (through the runtime's engine).
    assert any(s.attributes.get("db.system") == "postgresql" for s in members)
    # Spans carry ids and positions, never page text, a slug (which can name a person, and which no
    # erasure can take out of a trace store) or a search's words: the server spans name the route.
    every = json.dumps([s.attributes for s in spans], default=str)
    assert "office" not in every and "traced/alice" not in every and "whispered" not in every
    assert {"/v1/pages/{source_id}/{slug:text}/facts", "/v1/search"} <= {
        s.attributes.get("http.target") for s in spans
    }


def test_a_job_requested_while_tracing_is_off_has_no_traceparent(tx_factory: sessionmaker[Session]) -> None:
    assert not tracing.enabled()
    with tx_factory.begin() as session:
        job_id = request_job(session, EXTRACTION, "default|conversations/untraced").job_id
    assert job_row(tx_factory, job_id).traceparent is None


OFF_PROBE = textwrap.dedent(
    """
    import json, sys
    from fastapi.testclient import TestClient
    from opentelemetry import trace
    from worker.api.app import create_app
    from worker.config_store import ConfigReader
    from worker.db import session_factory
    from worker.runtime import Runtime, tracing
    from worker.settings import Settings

    settings = Settings(database_url=sys.argv[1], webhook_secret="s", admin_token="a",
                        broker_url="redis://127.0.0.1:1/0")
    assert settings.otel_endpoint is None
    factory = session_factory(sys.argv[1])
    app = create_app(Runtime(settings=settings, factory=factory, config=ConfigReader(factory, ttl=0)),
                     sender=lambda *args: None)
    with TestClient(app) as client:
        status = client.get("/healthz").status_code
    print(json.dumps({
        "status": status,
        "enabled": tracing.enabled(),
        "provider": type(trace.get_tracer_provider()).__name__,
        "sdk_tracer_imported": "opentelemetry.sdk.trace" in sys.modules,
        "instrumented": [name for name in sys.modules if name.startswith("opentelemetry.instrumentation")],
        "middleware": [m.cls.__name__ for m in app.user_middleware],
    }))
    """
)


def test_tracing_off_installs_nothing(database_url: str) -> None:
    """Without FACTMILL_OTEL_ENDPOINT the API process sets no tracer provider (so no span processor
    runs in the request path), loads neither the SDK's tracer nor an instrumentation, and adds no
    middleware.
    Its own process: the tests above install tracing in this one."""
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(REPO)}
    probe = subprocess.run(
        [sys.executable, "-c", OFF_PROBE, database_url],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert probe.returncode == 0, probe.stderr
    seen = json.loads(probe.stdout.strip().splitlines()[-1])
    assert seen["status"] == 200
    assert seen["enabled"] is False
    assert seen["provider"] == "ProxyTracerProvider"
    assert seen["sdk_tracer_imported"] is False  # (redis may load the SDK's metrics part: not tracing)
    assert seen["instrumented"] == []
    assert not [name for name in seen["middleware"] if "OpenTelemetry" in name]


def test_endpoint_without_the_extra_is_a_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "opentelemetry.sdk.trace", None)  # as if the extra were missing
    settings = Settings(otel_endpoint="http://127.0.0.1:4318")
    with pytest.raises(tracing.TracingUnavailableError, match=r"pip install 'factmill\[otel\]'"):
        tracing.setup(settings, "factmill-api")
    assert not tracing.enabled()


def test_worker_command_refuses_an_endpoint_without_the_extra() -> None:
    script = (
        "import sys; sys.modules['opentelemetry.sdk.trace'] = None; "
        "sys.argv = ['factmill', 'worker']; from worker.cli import main; main()"
    )
    env = {
        "PATH": "/usr/bin:/bin",
        "PYTHONPATH": str(REPO),
        "FACTMILL_OTEL_ENDPOINT": "http://127.0.0.1:4318",
        "FACTMILL_BROKER_URL": "redis://127.0.0.1:1/0",
    }
    run = subprocess.run(
        [sys.executable, "-c", script], cwd=REPO, env=env, capture_output=True, text=True, timeout=120
    )
    assert run.returncode == 2, run.stdout + run.stderr
    assert "FACTMILL_OTEL_ENDPOINT is set but OpenTelemetry is not installed" in run.stdout + run.stderr
    assert "Traceback" not in run.stdout + run.stderr


def test_traces_url_takes_a_base_or_the_full_path() -> None:
    assert tracing.traces_url("http://collector:4318") == "http://collector:4318/v1/traces"
    assert tracing.traces_url(" http://collector:4318/ ") == "http://collector:4318/v1/traces"
    assert tracing.traces_url("http://collector:4318/v1/traces") == "http://collector:4318/v1/traces"


def test_an_exported_span_names_an_errors_class_never_its_message(exporter: InMemorySpanExporter) -> None:
    """Our errors name slugs (PageChangedError), and the SQLAlchemy instrumentation set the driver's
    message with its DETAIL (a key's values): a trace store keeps them beyond any erasure."""
    from worker.extraction.options import PageChangedError

    with pytest.raises(PageChangedError), tracing.span("segment commit"):
        raise PageChangedError("'people/jane-roe-clinic' changed while it was extracted")
    [span] = exporter.get_finished_spans()
    assert span.status.description == "PageChangedError"
    [event] = [e for e in span.events if e.name == "exception"]
    assert dict(event.attributes or {}) == {"exception.type": "worker.extraction.options.PageChangedError"}
    assert "jane" not in repr(span.to_json())


def test_a_statement_outside_any_span_is_no_trace_of_its_own(
    exporter: InMemorySpanExporter, factory: sessionmaker[Session]
) -> None:
    """A scrape's, a probe's, a heartbeat's statements each became a trace of one span (25 a scrape, 6 a
    second for a busy extraction pod) and buried the traces an operator looks for."""
    from sqlalchemy import text

    tracing.instrument_engine(factory.kw["bind"])
    with factory() as session:
        session.execute(text("SELECT 1"))  # a heartbeat's, a probe's
        with tracing.span("segment commit"):
            session.execute(text("SELECT 2"))
    spans = exporter.get_finished_spans()
    [statement] = [span for span in spans if span.name.startswith("SELECT")]  # the second only
    assert statement.parent is not None and len(spans) == 2, [s.name for s in spans]


def test_the_sdks_sampler_variables_still_apply(monkeypatch: pytest.MonkeyPatch) -> None:
    """A sampler of our own passed to the provider made the SDK ignore OTEL_TRACES_SAMPLER: a deployment
    sampling 10% of its traces kept all of them."""
    monkeypatch.setenv("OTEL_TRACES_SAMPLER", "always_off")
    spans = InMemorySpanExporter()
    assert tracing.setup(Settings(), "factmill-test", exporter=spans)
    try:
        with tracing.span("segment commit"):
            pass
    finally:
        tracing.shutdown()
    assert spans.get_finished_spans() == ()


def test_only_the_probe_and_scrape_routes_are_left_untraced() -> None:
    # The patterns are searched anywhere in the URL: unanchored, any page slug or host holding
    # "metrics" went untraced.
    from opentelemetry.util.http import parse_excluded_urls

    from worker.runtime.tracing import EXCLUDED_URLS

    excluded = parse_excluded_urls(EXCLUDED_URLS)
    for url in ("http://api:8000/healthz", "https://api.example/readyz", "http://10.0.0.1/metrics"):
        assert excluded.url_disabled(url), url
    for url in (
        "http://api:8000/v1/pages/default/q3-metrics",
        "http://metrics-api:8000/v1/search",
        "http://api/v1/pages/default/healthz",
        "http://api/metrics/x",
    ):
        assert not excluded.url_disabled(url), url


def test_a_job_sent_without_a_trace_rejoins_its_request_in_a_traced_worker(
    exporter: InMemorySpanExporter, factory: sessionmaker[Session], database_url: str
) -> None:
    """The CLI does not trace: a job it re-sent (`config set` turning a switch back on, `jobs retry`)
    reached a traced worker without trace headers, the Celery instrumentation began a root span for it,
    and the job's stored traceparent was never read: the page's run was an orphan trace."""
    runtime = make_runtime(database_url, factory)
    with tracing.span("POST /v1/pages"), factory.begin() as session:  # the request that stored the job
        job_id = request_job(session, EXTRACTION, "default|conversations/traced-later").job_id
    stored = job_row(factory, job_id).traceparent
    with factory.begin() as session:
        set_config(session, "facts.extraction_enabled", "false")  # a short run: paused at its switch
    try:
        with tracing.span("run/tasks.extraction.extract_page"):  # Celery's root span for the message
            run_job(runtime, job_id, EXTRACTION)
    finally:
        runtime.close()
    [job_span] = [s for s in exporter.get_finished_spans() if s.name == "job extraction"]
    assert job_span.context is not None and job_span.parent is not None
    assert format(job_span.context.trace_id, "032x") == trace_id(stored)
    assert format(job_span.parent.span_id, "016x") == stored.split("-")[2]


def test_a_rerun_and_an_operators_retry_run_in_the_trace_of_the_request_that_asked(
    exporter: InMemorySpanExporter, factory: sessionmaker[Session]
) -> None:
    """A page posted again while its job ran (trace B) had its rerun, which extracts B's content, sent
    in the first request's trace A (B ended at its database write); an operator's retry ran in the
    job's first trace, weeks old maybe, not the retry request's."""
    from sqlalchemy import update

    from worker.jobs.outbox import retry_job

    subject = "default|conversations/posted-twice"

    def asked_in(name: str) -> tuple[int, str]:
        with tracing.span(name), factory.begin() as session:
            job_id = request_job(session, EXTRACTION, subject).job_id
            return job_id, trace_id(tracing.current_traceparent())

    def set_status(job_id: int, status: str) -> None:
        with factory.begin() as session:
            session.execute(update(Job).where(Job.id == job_id).values(status=status))

    job_id, first = asked_in("POST first")
    set_status(job_id, "running")
    same_job, second = asked_in("POST second")
    assert same_job == job_id
    row = job_row(factory, job_id)
    assert row.rerun_requested and trace_id(row.traceparent) == second != first
    set_status(job_id, "failed")
    with tracing.span("POST retry"), factory.begin() as session:
        retry_job(session, job_id)
        retried = trace_id(tracing.current_traceparent())
    assert trace_id(job_row(factory, job_id).traceparent) == retried not in (first, second)


@pytest.mark.parametrize("flag", ["00", "01"])
def test_a_requests_traceparent_joins_the_trace_but_does_not_decide_its_sampling(
    exporter: InMemorySpanExporter, factory: sessionmaker[Session], database_url: str, flag: str
) -> None:
    """The sender's traceparent flag decided the sampling of the whole pipeline: anyone posting a page
    (unsigned requests are traced too) with `-00` kept its run and LLM calls out of every trace. The
    API decides as for a root and stores its own decision with the job."""
    sender_trace, sender_span = "4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7"
    runtime = make_runtime(database_url, factory)
    sent = TraceRecorder(factory)
    with TestClient(create_app(runtime, sender=sent)) as client:
        response = post(
            client, PAGE, extra_headers={"traceparent": f"00-{sender_trace}-{sender_span}-{flag}"}
        )
    assert response.status_code in (200, 202), response.text
    [root] = [s for s in from_sdk(exporter.get_finished_spans()) if s.name.startswith("POST /v1/pages")]
    assert (root.trace_id, root.parent_id) == (sender_trace, sender_span)
    [job_id] = sent.job_ids
    stored = job_row(factory, job_id).traceparent
    assert stored is not None and stored.endswith("-01") and trace_id(stored) == sender_trace


def test_a_senders_trace_id_does_not_decide_a_ratio_samplers_choice(monkeypatch: pytest.MonkeyPatch) -> None:
    """A ratio sampler reads a trace id's low bits, and a request's traceparent names the trace id its
    sender chose: one ending in zeros was traced every time under a 1% ratio, whatever its flag."""
    from opentelemetry.trace import NonRecordingSpan, SpanContext, SpanKind, TraceFlags, set_span_in_context

    monkeypatch.setenv("OTEL_TRACES_SAMPLER", "parentbased_traceidratio")
    monkeypatch.setenv("OTEL_TRACES_SAMPLER_ARG", "0.01")
    sampler = tracing._sampler()
    chosen = int("4bf92f3577b34da6" + "0" * 16, 16)  # below every ratio's bound
    sampled = 0
    for flags in (TraceFlags.DEFAULT, TraceFlags.SAMPLED) * 100:
        remote = SpanContext(chosen, 0x00F067AA0BA902B7, is_remote=True, trace_flags=TraceFlags(flags))
        parent = set_span_in_context(NonRecordingSpan(remote))
        sampled += sampler.should_sample(
            parent, chosen, "POST /v1/pages", SpanKind.SERVER
        ).decision.is_sampled()
    assert sampled < 20, f"{sampled} of 200 sender-chosen requests sampled at a 1% ratio"


def test_a_retry_is_sent_in_the_jobs_trace(
    exporter: InMemorySpanExporter, database_url: str, tx_factory: sessionmaker[Session]
) -> None:
    """The task sent its retry after the job's span ended, from Celery's run span: for a message that
    came without a trace (the CLI's) that span is a root of its own, so the retry carried an orphan
    trace and every later attempt stayed out of the request's. The outcome carries the job's span."""
    from tests.integration.test_compaction_service import (
        SETTINGS,
        ScriptedLLM,
        append,
        runtime,
        session_messages,
    )
    from worker.jobs.outbox import COMPACTION
    from worker.llm.errors import LLMError

    with tracing.span("POST /v1/transcripts/{transcript_id}/messages"):
        request = append(tx_factory, "traced-retry", session_messages(25), settings=SETTINGS)
    job_id = request.trigger.job.job_id
    stored = job_row(tx_factory, job_id).traceparent
    down = LLMError("HTTP 503: overloaded", retryable=True, status=503)
    with tracing.span("run/tasks.compaction.compact_transcript"):  # Celery's root span for the message
        outcome = run_job(runtime(database_url, tx_factory, ScriptedLLM(down)), job_id, COMPACTION)
    assert outcome.status == "retry" and outcome.retry_in is not None
    [job_span] = [s for s in from_sdk(exporter.get_finished_spans()) if s.name == "job compaction"]
    assert outcome.traceparent is not None and outcome.traceparent.split("-")[1:3] == [
        job_span.trace_id,
        job_span.span_id,
    ]
    assert job_span.trace_id == trace_id(stored)
