"""The `factmill` command line: database, ingest, extract, config, facts, simulator, demo."""

from __future__ import annotations

import json
import logging
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table
from sqlalchemy import select
from sqlalchemy.orm import Session, sessionmaker

from worker import db
from worker.cli_calibration import calibration_app
from worker.cli_compaction import compact_command, transcripts_app
from worker.cli_search import embed_command, search_command
from worker.config_store import get_config, list_config, set_config
from worker.extraction import (
    PER_SEGMENT_SOURCE_PREFIX,
    ExtractionCounters,
    ExtractionDisabledError,
    ExtractOptions,
    PageReport,
    run_extract_conversation_facts,
)
from worker.settings import Settings, get_settings

app = typer.Typer(
    help="Factmill: turn conversations into durable, trustworthy facts.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
)
db_app = typer.Typer(help="Database schema and the embedded server.", no_args_is_help=True)
config_app = typer.Typer(help="Runtime configuration: kill switches and tunables.", no_args_is_help=True)
facts_app = typer.Typer(help="Read extracted facts.", no_args_is_help=True)
app.add_typer(db_app, name="db")
app.add_typer(config_app, name="config")
app.add_typer(facts_app, name="facts")
jobs_app = typer.Typer(help="Jobs: the outbox and its history.", no_args_is_help=True)
app.add_typer(jobs_app, name="jobs")
app.add_typer(calibration_app, name="calibration")
app.command("search")(search_command)
app.command("embed")(embed_command)
app.add_typer(transcripts_app, name="transcripts")
app.command("compact")(compact_command)

out = Console(soft_wrap=True)
err = Console(stderr=True, soft_wrap=True)
REPO_ROOT = Path(__file__).resolve().parent.parent
EXAMPLES_DIR = REPO_ROOT / "examples"


def fail(message: str, code: int = 1) -> typer.Exit:
    err.print(f"[bold red]error:[/] {message}")
    return typer.Exit(code)


def _database_url(settings: Settings) -> str:
    try:
        return db.database_url(settings)
    except Exception as exc:
        raise fail(str(exc)) from exc


def _describe_database(settings: Settings) -> str:
    if settings.database_url:
        return "Postgres: FACTMILL_DATABASE_URL"
    return f"Postgres: embedded (pgserver) under {(settings.data_dir / 'pg').resolve()}"


def _factory(settings: Settings, *, migrate: bool = False) -> sessionmaker[Session]:
    url = _database_url(settings)
    if migrate:
        db.upgrade(url)
    else:
        current, heads = db.schema_state(url)
        if current != heads:
            state = f"is at {sorted(current)}, not {sorted(heads)}" if current else "has no Factmill schema"
            raise fail(f"the database {state}; run `factmill db upgrade` first")
    return db.session_factory(url)


# ---------------------------------------------------------------------------
# db
# ---------------------------------------------------------------------------


@db_app.command("upgrade")
def db_upgrade(revision: str = "head") -> None:
    """Build or update the schema with the migrations."""
    settings = get_settings()
    url = _database_url(settings)
    db.upgrade(url, revision)
    out.print(f"schema at revision {db.current_revision(url)} ({_describe_database(settings)})")


@db_app.command("current")
def db_current() -> None:
    """Show the schema revision."""
    out.print(db.current_revision(_database_url(get_settings())) or "no schema")


@db_app.command("stop")
def db_stop() -> None:
    """Stop the embedded Postgres (it keeps running between commands otherwise)."""
    from worker.embedded import stop_embedded_postgres

    settings = get_settings()
    if settings.database_url:
        raise fail("FACTMILL_DATABASE_URL is set; there is no embedded server to stop")
    out.print("stopped" if stop_embedded_postgres(settings.data_dir) else "not running")


# ---------------------------------------------------------------------------
# ingest / extract
# ---------------------------------------------------------------------------


@app.command()
def ingest(
    paths: Annotated[list[Path], typer.Argument(help="Markdown files or directories (walked recursively).")],
    source_id: Annotated[str, typer.Option(help="Source the pages belong to.")] = "default",
    enqueue: Annotated[
        bool, typer.Option(help="Hand the extraction jobs to the broker now (else the sweeper sends them).")
    ] = True,
    as_json: Annotated[bool, typer.Option("--json", help="Print a JSON report.")] = False,
) -> None:
    """Store page files (front matter: slug, type, title); queue an extraction job per changed page."""
    from worker.ingest import ingest_paths
    from worker.jobs.outbox import enqueue as send_jobs

    factory = _factory(get_settings())
    report = ingest_paths(factory, paths, source_id)
    sent = send_jobs(factory, report.jobs) if enqueue and report.jobs else 0
    if as_json:
        out.print_json(
            data={
                "ingested": report.ingested,
                "unchanged": report.unchanged,
                "jobs": [job_id for job_id, _ in report.jobs],
                "enqueued": sent,
                "errors": [{"path": p, "reason": r} for p, r in report.errors],
            }
        )
    else:
        out.print(
            f"ingested {len(report.ingested)} page(s), {len(report.unchanged)} unchanged, "
            f"{len(report.errors)} error(s); {len(report.jobs)} extraction job(s) queued"
        )
        for path, reason in report.errors:
            err.print(f"[yellow]skipped[/] {path}: {reason}")
    if report.errors and not report.ingested and not report.unchanged:
        raise typer.Exit(1)


class RichProgress:
    """Extraction progress on stderr: a bar over pages, a counter of segments."""

    def __init__(self, progress: Progress) -> None:
        self.progress = progress
        self.pages = progress.add_task("pages", total=None)
        self.segments = progress.add_task("segments", total=0)

    def pages_listed(self, count: int) -> None:
        self.progress.update(self.pages, total=count)

    def page_started(self, slug: str, segments: int) -> None:
        task = self.progress.tasks[self.segments]
        self.progress.update(
            self.segments, total=(task.total or 0) + segments, description=f"segments · {slug}"
        )

    def segment_finished(self, slug: str, outcome: str) -> None:
        self.progress.advance(self.segments)

    def page_finished(self, report: PageReport) -> None:
        self.progress.advance(self.pages)


@contextmanager
def extraction_progress(enabled: bool) -> Iterator[RichProgress | None]:
    if not enabled:
        yield None
        return
    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    with Progress(*columns, console=err, transient=True) as progress:
        yield RichProgress(progress)


def print_counters(counters: ExtractionCounters, seconds: float | None = None) -> None:
    table = Table(title="extraction", show_header=False)
    for key, value in counters.as_dict(with_pages=False).items():
        table.add_row(key, str(value))
    if seconds is not None:
        table.add_row("seconds", f"{seconds:.2f}")
    out.print(table)
    for report in counters.pages:
        if report.status in ("failed", "skipped_too_large", "incomplete") or (
            report.status == "skipped" and report.reason and "nothing new" not in report.reason
        ):
            err.print(f"[yellow]{report.status}[/] {report.slug}: {report.reason}")


def run_extraction(
    settings: Settings,
    factory: sessionmaker[Session],
    options: ExtractOptions,
    show_progress: bool,
    batch_poll_seconds: float | None = None,
) -> ExtractionCounters:
    """Run an extraction online, or (``batch_poll_seconds`` set) through the provider's batch API."""
    from worker.llm.errors import LLMError
    from worker.llm.gateway import LLMConfigurationError
    from worker.runtime import build_runtime

    try:
        if batch_poll_seconds is not None and not options.dry_run:
            from worker.batch import run_batch_extraction
            from worker.llm.batches import open_batch_client

            with open_batch_client(settings) as client, extraction_progress(show_progress) as progress:
                return run_batch_extraction(
                    factory, client, options, poll_seconds=batch_poll_seconds, progress=progress
                )
        if options.dry_run:
            with extraction_progress(show_progress) as progress:
                return run_extract_conversation_facts(factory, None, options, progress=progress)
        rt = build_runtime(settings, factory)
        with extraction_progress(show_progress) as progress:
            try:
                return run_extract_conversation_facts(
                    factory, rt.llm, options, config=rt.config, budget=rt.budget, progress=progress
                )
            finally:
                rt.close()
    except ExtractionDisabledError as exc:
        raise fail(str(exc), code=3) from exc
    except (ValueError, LLMConfigurationError) as exc:
        raise fail(str(exc), code=2) from exc
    except LLMError as exc:  # only batch management calls get here (online calls are per-page outcomes)
        raise fail(f"the batch could not be submitted or read: {exc}", code=5) from exc


@app.command()
def extract(
    slug: Annotated[str | None, typer.Option(help="Only this page.")] = None,
    source_id: Annotated[str, typer.Option(help="Source to extract.")] = "default",
    dry_run: Annotated[
        bool, typer.Option(help="Count pages and segments; write nothing, call no LLM.")
    ] = False,
    force: Annotated[bool, typer.Option(help="Re-extract and replace the pages' facts.")] = False,
    since: Annotated[str | None, typer.Option(help="Only messages strictly after this ISO time.")] = None,
    override_disabled: Annotated[
        bool, typer.Option(help="Run even if facts.extraction_enabled is off.")
    ] = False,
    max_facts: Annotated[int | None, typer.Option(min=1, max=25, help="Facts per segment (1-25).")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print the counters as JSON.")] = False,
    batch: Annotated[
        bool,
        typer.Option(
            help="Send the pending segments as one OpenAI/Anthropic batch (half price, results within "
            "24 h); waits for it, then commits like an online run. For backfills."
        ),
    ] = False,
    poll_seconds: Annotated[float, typer.Option(min=0.0, help="With --batch: seconds between polls.")] = 30.0,
) -> None:
    """Extract facts from conversation pages, resuming where the last run stopped."""
    settings = get_settings()
    factory = _factory(settings)
    options = ExtractOptions(
        source_id=source_id,
        slug=slug,
        dry_run=dry_run,
        force=force,
        since_iso=since,
        override_disabled=override_disabled,
        max_facts=max_facts,
        max_output_tokens=settings.llm_max_output_tokens,
    )
    if not as_json and not dry_run:
        from worker.llm.gateway import describe

        err.print(describe(settings))
    started = time.perf_counter()
    counters = run_extraction(
        settings,
        factory,
        options,
        show_progress=not as_json,
        batch_poll_seconds=poll_seconds if batch else None,
    )
    if as_json:
        sys.stdout.write(json.dumps(counters.as_dict(), indent=2) + "\n")
    else:
        print_counters(counters, time.perf_counter() - started)
    if counters.pages_failed:
        raise typer.Exit(4)


# ---------------------------------------------------------------------------
# config / facts
# ---------------------------------------------------------------------------


@config_app.command("get")
def config_get(key: str) -> None:
    """Print one config value (nothing set prints the default meaning)."""
    with _factory(get_settings())() as session:
        value = get_config(session, key)
    out.print(value if value is not None else "(not set)")


@config_app.command("set")
def config_set(
    key: str, value: str, by: Annotated[str, typer.Option(help="Who made the change (recorded).")] = "cli"
) -> None:
    """Set a config value; kill switches take effect in running workers within seconds."""
    factory = _factory(get_settings())
    from worker.jobs.outbox import enqueue, resume_for_config_change

    try:
        with factory.begin() as session:
            stored = set_config(session, key, value, updated_by=by)
            resumed = resume_for_config_change(session, key, stored)
    except ValueError as exc:
        raise fail(str(exc), code=2) from exc
    enqueue(factory, resumed)
    out.print(f"{key} = {stored}" + (f" ({len(resumed)} paused job(s) resumed)" if resumed else ""))


@config_app.command("list")
def config_list() -> None:
    """Every config value with who set it and when."""
    with _factory(get_settings())() as session:
        rows = list_config(session)
    table = Table("key", "value", "updated_by", "updated_at")
    for row in rows:
        table.add_row(row.key, row.value, row.updated_by or "", row.updated_at.isoformat(timespec="seconds"))
    out.print(table)


def _facts_for(session: Session, slug: str, source_id: str) -> list[dict[str, Any]]:
    from models import Fact

    rows = session.scalars(
        select(Fact)
        .where(
            Fact.source_id == source_id,
            Fact.source_markdown_slug == slug,
            Fact.source == PER_SEGMENT_SOURCE_PREFIX,
        )
        .order_by(Fact.row_num)
    )
    return [
        {
            "row_num": f.row_num,
            "fact": f.fact,
            "kind": f.kind,
            "entity": f.entity_slug,
            "confidence": f.confidence,
            "notability": f.notability,
            "context": f.context,
            "metric": f.claim_metric,
            "value": f.claim_value,
            "unit": f.claim_unit,
            "period": f.claim_period,
        }
        for f in rows
    ]


@facts_app.command("list")
def facts_list(
    slug: Annotated[str, typer.Option(help="The page whose facts to list.")],
    source_id: Annotated[str, typer.Option()] = "default",
    as_json: Annotated[bool, typer.Option("--json")] = False,
) -> None:
    """The facts extracted from one page, in row order."""
    with _factory(get_settings())() as session:
        facts = _facts_for(session, slug, source_id)
    if as_json:
        sys.stdout.write(json.dumps(facts, indent=2, ensure_ascii=False) + "\n")
        return
    table = Table("#", "kind", "fact", "entity", "conf", title=slug)
    for f in facts:
        table.add_row(str(f["row_num"]), f["kind"], f["fact"], f["entity"] or "", f"{f['confidence']:.2f}")
    out.print(table)


@app.command()
def costs(
    since: Annotated[str | None, typer.Option(help="ISO date/time; default: the last 30 days.")] = None,
    by: Annotated[str, typer.Option(help="Group by model, purpose or day.")] = "model",
    as_json: Annotated[bool, typer.Option("--json")] = False,
) -> None:
    """LLM spend from llm_calls: calls, tokens, the cached share of input tokens, and USD."""
    from datetime import UTC, datetime, timedelta

    from worker.accounting import reports

    if by not in reports.GROUPS:
        raise fail(f"--by must be one of {', '.join(reports.GROUPS)}", code=2)
    try:
        start = datetime.fromisoformat(since.replace("Z", "+00:00")) if since else None
    except ValueError as exc:
        raise fail(f"--since must be an ISO date such as 2026-11-01, got {since!r}", code=2) from exc
    start = start or datetime.now(UTC) - timedelta(days=30)
    if start.tzinfo is None:
        start = start.replace(tzinfo=UTC)
    with _factory(get_settings())() as session:
        rows = reports.spend(session, by=by, since=start)
    if as_json:
        sys.stdout.write(json.dumps([r.as_dict() for r in rows], indent=2) + "\n")
        return
    title = f"LLM spend since {start.date().isoformat()}"
    table = Table(by, "calls", "input tokens", "cached", "output tokens", "USD", title=title)
    for r in [*rows, reports.total(rows)]:
        table.add_row(
            r.key,
            str(r.calls),
            str(r.input_tokens),
            f"{r.cached_share:.0%}",
            str(r.output_tokens),
            f"{r.cost_usd:.4f}",
        )
    out.print(table)


# ---------------------------------------------------------------------------
# service processes: serve, worker, beat, flower
# ---------------------------------------------------------------------------


@app.command()
def serve(
    host: Annotated[str, typer.Option()] = "127.0.0.1",
    port: Annotated[int, typer.Option()] = 8000,
    workers: Annotated[int, typer.Option(min=1, help="uvicorn worker processes.")] = 1,
) -> None:
    """Run the HTTP API (webhooks, jobs, facts, config, health, metrics)."""
    import uvicorn

    settings = get_settings()
    settings.check_production_secrets()
    _factory(settings)  # fail early, with a clear message, if the schema is missing
    uvicorn.run(
        "worker.api.app:create_app", factory=True, host=host, port=port, workers=workers, log_level="info"
    )


@app.command()
def worker(
    queues: Annotated[
        str, typer.Option(help="Comma-separated queues to consume.")
    ] = "extraction,maintenance",
    concurrency: Annotated[int, typer.Option(min=1, help="Tasks in flight (threads or processes).")] = 64,
    pool: Annotated[str, typer.Option(help="threads (I/O-bound LLM calls) or prefork.")] = "threads",
    loglevel: Annotated[str, typer.Option()] = "info",
    hostname: Annotated[str | None, typer.Option(help="Celery node name (default factmill@<host>).")] = None,
) -> None:
    """Run a Celery worker for the given queues."""
    from worker.jobs.registry import queues as known_queues

    QUEUES = known_queues()
    from worker.celery_app import app as celery

    unknown = sorted(set(q.strip() for q in queues.split(",")) - set(QUEUES))
    if unknown:
        raise fail(f"unknown queue(s) {', '.join(unknown)}; choose from {', '.join(QUEUES)}", code=2)
    if pool not in ("threads", "prefork", "solo"):
        raise fail("--pool must be threads, prefork or solo", code=2)
    argv = [
        "worker",
        "-Q",
        queues,
        "-c",
        str(concurrency),
        "-P",
        pool,
        "-l",
        loglevel,
        "-E",
        "--without-gossip",
        "--without-mingle",
    ]
    if hostname:
        argv += ["-n", hostname]
    celery.worker_main(argv)


@app.command()
def beat(loglevel: Annotated[str, typer.Option()] = "info") -> None:
    """Run Celery beat (the sweeper every 30 s, and later schedules)."""
    from worker.celery_app import app as celery

    settings = get_settings()
    settings.data_dir.mkdir(parents=True, exist_ok=True)
    celery.start(["beat", "-l", loglevel, "-s", str(settings.data_dir / "celerybeat-schedule")])


@app.command()
def flower(port: Annotated[int, typer.Option()] = 5555) -> None:
    """Run Flower on the same broker to watch workers, queues and tasks."""
    from worker.celery_app import app as celery

    celery.start(["flower", f"--port={port}"])


# ---------------------------------------------------------------------------
# jobs
# ---------------------------------------------------------------------------


def _job_dict(job: Any) -> dict[str, Any]:
    return {
        "id": job.id,
        "kind": job.kind,
        "subject": job.subject,
        "status": job.status,
        "attempts": job.attempts,
        "last_error": job.last_error,
        "counters": job.counters,
        "created_at": job.created_at.isoformat(),
        "updated_at": job.updated_at.isoformat(),
        "heartbeat_at": job.heartbeat_at.isoformat() if job.heartbeat_at else None,
        "finished_at": job.finished_at.isoformat() if job.finished_at else None,
    }


@jobs_app.command("list")
def jobs_list(
    status: Annotated[str | None, typer.Option(help="queued, running, paused, succeeded or failed.")] = None,
    kind: Annotated[str | None, typer.Option()] = None,
    limit: Annotated[int, typer.Option(min=1, max=10_000)] = 50,
    as_json: Annotated[bool, typer.Option("--json")] = False,
) -> None:
    """Recent jobs, newest first."""
    from models import JOB_STATUSES
    from worker.jobs import queries

    if status is not None and status not in JOB_STATUSES:
        raise fail(f"--status must be one of {', '.join(JOB_STATUSES)}", code=2)
    with _factory(get_settings())() as session:
        jobs = [_job_dict(j) for j in queries.list_jobs(session, status=status, kind=kind, limit=limit)]
    if as_json:
        sys.stdout.write(json.dumps(jobs, indent=2) + "\n")
        return
    table = Table("id", "kind", "subject", "status", "attempts", "last_error")
    for j in jobs:
        table.add_row(
            str(j["id"]),
            j["kind"],
            j["subject"],
            j["status"],
            str(j["attempts"]),
            (j["last_error"] or "")[:60],
        )
    out.print(table)


@jobs_app.command("show")
def jobs_show(job_id: int) -> None:
    """One job with its counters and last error."""
    from models import Job

    with _factory(get_settings())() as session:
        job = session.get(Job, job_id)
        if job is None:
            raise fail(f"no job {job_id}")
        sys.stdout.write(json.dumps(_job_dict(job), indent=2) + "\n")


@jobs_app.command("retry")
def jobs_retry(job_id: int) -> None:
    """Queue a failed or paused job again."""
    from worker.jobs import queries
    from worker.jobs.outbox import enqueue as send_jobs

    factory = _factory(get_settings())
    try:
        with factory.begin() as session:
            job = queries.retry(session, job_id)
            pair = (job.id, job.kind)
    except queries.JobNotFoundError as exc:
        raise fail(str(exc)) from exc
    except (queries.JobNotRetryableError, queries.JobAlreadyPendingError) as exc:
        raise fail(str(exc), code=2) from exc
    send_jobs(factory, [pair])
    out.print(f"job {job_id} queued")


# ---------------------------------------------------------------------------
# simulator / demo
# ---------------------------------------------------------------------------


@app.command()
def simulator(
    port: Annotated[int, typer.Option(help="Port to listen on.")] = 8089,
    host: Annotated[str, typer.Option()] = "127.0.0.1",
    latency_ms: Annotated[int, typer.Option(min=0)] = 0,
    jitter_ms: Annotated[int, typer.Option(min=0)] = 0,
    error_rate: Annotated[float, typer.Option(min=0.0, max=1.0, help="Spread over every fault class.")] = 0.0,
    seed: Annotated[int, typer.Option()] = 0,
) -> None:
    """Run the LLM simulator (OpenAI and Anthropic wire formats; not a real model)."""
    from worker.simulator import SimulatorConfig, serve

    config = SimulatorConfig.with_error_rate(
        error_rate, latency_ms=latency_ms, jitter_ms=jitter_ms, seed=seed
    )
    err.print(f"LLM simulator (not a real model) on http://{host}:{port}/v1")
    serve(config, host=host, port=port)


@app.command()
def demo(
    examples: Annotated[Path, typer.Option(help="Directory of example pages.")] = EXAMPLES_DIR,
    show: Annotated[int, typer.Option(help="Facts to print per page.")] = 3,
    concurrency: Annotated[int, typer.Option(min=1, help="Worker threads.")] = 16,
) -> None:
    """Boot the service (API, worker, beat) on the embedded default, post the examples as signed
    webhooks, follow the jobs, and print the facts with a summary."""
    from worker.demo import DemoError, run_demo

    try:
        code = run_demo(get_settings(), examples, out, err, show=show, concurrency=concurrency)
    except DemoError as exc:
        raise fail(str(exc)) from exc
    raise typer.Exit(code)


def main() -> None:
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    app()


if __name__ == "__main__":
    main()
