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

out = Console()
err = Console(stderr=True)
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
        from alembic.script import ScriptDirectory

        head = ScriptDirectory.from_config(db.alembic_config(url)).get_current_head()
        current = db.current_revision(url)
        if current != head:
            state = "has no Factmill schema" if current is None else f"is at revision {current}, not {head}"
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
    as_json: Annotated[bool, typer.Option("--json", help="Print a JSON report.")] = False,
) -> None:
    """Store page files (YAML front matter: slug, type, title) as pages."""
    from worker.ingest import ingest_paths

    factory = _factory(get_settings())
    report = ingest_paths(factory, paths, source_id)
    if as_json:
        out.print_json(
            data={
                "ingested": report.ingested,
                "unchanged": report.unchanged,
                "errors": [{"path": p, "reason": r} for p, r in report.errors],
            }
        )
    else:
        out.print(
            f"ingested {len(report.ingested)} page(s), {len(report.unchanged)} unchanged, "
            f"{len(report.errors)} error(s)"
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
        if report.status in ("failed", "skipped_too_large") or (
            report.status == "skipped" and report.reason and "nothing new" not in report.reason
        ):
            err.print(f"[yellow]{report.status}[/] {report.slug}: {report.reason}")


def run_extraction(
    settings: Settings, factory: sessionmaker[Session], options: ExtractOptions, show_progress: bool
) -> ExtractionCounters:
    from worker.llm.gateway import LLMConfigurationError, open_llm_client

    try:
        if options.dry_run:
            with extraction_progress(show_progress) as progress:
                return run_extract_conversation_facts(factory, None, options, progress=progress)
        with open_llm_client(settings) as llm, extraction_progress(show_progress) as progress:
            return run_extract_conversation_facts(factory, llm, options, progress=progress)
    except ExtractionDisabledError as exc:
        raise fail(str(exc), code=3) from exc
    except (ValueError, LLMConfigurationError) as exc:
        raise fail(str(exc), code=2) from exc


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
    counters = run_extraction(settings, factory, options, show_progress=not as_json)
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
    try:
        with factory.begin() as session:
            stored = set_config(session, key, value, updated_by=by)
    except ValueError as exc:
        raise fail(str(exc), code=2) from exc
    out.print(f"{key} = {stored}")


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
    from worker.llm.simulator import SimulatorConfig, serve

    config = SimulatorConfig.with_error_rate(
        error_rate, latency_ms=latency_ms, jitter_ms=jitter_ms, seed=seed
    )
    err.print(f"LLM simulator (not a real model) on http://{host}:{port}/v1")
    serve(config, host=host, port=port)


@app.command()
def demo(
    examples: Annotated[Path, typer.Option(help="Directory of example pages.")] = EXAMPLES_DIR,
    show: Annotated[int, typer.Option(help="Facts to print per page.")] = 3,
) -> None:
    """Migrate, ingest the bundled examples, extract their facts and print them."""
    from worker.ingest import ingest_paths
    from worker.llm.gateway import describe

    settings = get_settings()
    err.print(f"[bold]Factmill demo[/] · {_describe_database(settings)} · {describe(settings)}")
    started = time.perf_counter()
    factory = _factory(settings, migrate=True)
    report = ingest_paths(factory, [examples])
    err.print(f"ingested {len(report.ingested)} page(s) ({len(report.unchanged)} unchanged) from {examples}")
    for path, reason in report.errors:
        err.print(f"[yellow]skipped[/] {path}: {reason}")
    counters = run_extraction(
        settings,
        factory,
        ExtractOptions(max_output_tokens=settings.llm_max_output_tokens),
        show_progress=True,
    )
    with factory() as session:
        for page in counters.pages:
            if page.status != "processed":
                continue
            facts = _facts_for(session, page.slug, "default")
            out.print(f"\n[bold]{page.slug}[/] · {len(facts)} facts")
            for fact in facts[:show]:
                out.print(f"  [dim]{fact['kind']:<10}[/] {fact['fact']}")
    print_counters(counters, time.perf_counter() - started)
    if counters.pages_processed == 0:
        err.print("nothing new to extract: rerun with `factmill extract --force` to extract again")


def main() -> None:
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    app()


if __name__ == "__main__":
    main()
