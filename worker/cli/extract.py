"""`factmill extract`: extract facts from conversation pages, online or as a provider batch."""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Annotated

import typer
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from sqlalchemy.orm import Session, sessionmaker

from models import page_id_of
from models.reads import read_only
from worker.cli.console import err, fail, folding_table, out, print_json, source_option, styled
from worker.cli.processes import stopped_by_signals
from worker.cli.sessions import checked_factory
from worker.core.slugs import stored_form
from worker.extraction import (
    ExtractionCounters,
    ExtractionDisabledError,
    ExtractOptions,
    PageReport,
    run_extract_conversation_facts,
)
from worker.extraction.batch import BatchExtractionCounters, run_batch_extraction
from worker.llm.batches import open_batch_client
from worker.llm.errors import LLMError
from worker.llm.gateway import LLMConfigurationError, describe
from worker.runtime import build_runtime
from worker.settings import Settings, get_settings


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
    columns = (
        TextColumn("{task.description}", markup=False),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
    )
    with Progress(*columns, console=err, transient=True) as progress:
        yield RichProgress(progress)


def print_counters(counters: ExtractionCounters, seconds: float | None = None) -> None:
    table = folding_table(title="extraction", show_header=False)
    for key, value in counters.as_dict(with_pages=False).items():
        table.add_row(key, str(value))
    if seconds is not None:
        table.add_row("seconds", f"{seconds:.2f}")
    out.print(table)
    for report in counters.pages:
        if report.status in ("failed", "skipped_too_large", "incomplete") or (
            report.status == "skipped" and report.reason and "nothing new" not in report.reason
        ):
            err.print(styled((report.status, "yellow"), f" {report.slug}: {report.reason}"))
        if report.skipped:
            err.print(
                styled(
                    ("skipped segments", "yellow"),
                    f" {report.slug}: {report.skipped} failed permanently too often (outcome skipped "
                    "in its audit rows); `factmill extract --skipped` (or its job's `factmill jobs "
                    "retry ID --skipped`) re-extracts them",
                )
            )


def run_extraction(
    settings: Settings,
    factory: sessionmaker[Session],
    options: ExtractOptions,
    show_progress: bool,
    batch_poll_seconds: float | None = None,
) -> ExtractionCounters:
    """Run an extraction online, or (``batch_poll_seconds`` set) through the provider's batch API.
    SIGTERM and SIGHUP end it as Ctrl-C does, so what is in flight is recorded: online, Python died at
    once, and the spend of the calls answered but not yet committed was lost (budgets counted low)."""
    with stopped_by_signals():
        return _run_extraction(settings, factory, options, show_progress, batch_poll_seconds)


def _run_extraction(
    settings: Settings,
    factory: sessionmaker[Session],
    options: ExtractOptions,
    show_progress: bool,
    batch_poll_seconds: float | None,
) -> ExtractionCounters:
    try:
        if batch_poll_seconds is not None and not options.dry_run:
            with (
                open_batch_client(settings) as client,
                extraction_progress(show_progress) as progress,
            ):
                return run_batch_extraction(
                    factory,
                    client,
                    options,
                    poll_seconds=batch_poll_seconds,
                    progress=progress,
                    max_bytes=settings.backfill_batch_max_bytes,
                    max_requests=settings.backfill_batch_max_requests,
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


SINCE_HELP = (
    "Only messages strictly after this ISO time; the ones before are passed over for good: the checkpoint "
    "of each page extracted moves past them (only extract --force extracts them again); a page with nothing "
    "to extract after it is left as it was."
)


def extract(
    slug: Annotated[str | None, typer.Option(help="Only this page.")] = None,
    source_id: Annotated[str, source_option(help="Source to extract.")] = "default",
    dry_run: Annotated[
        bool, typer.Option(help="Count pages and segments; write nothing, call no LLM.")
    ] = False,
    force: Annotated[bool, typer.Option(help="Re-extract and replace the pages' facts.")] = False,
    since: Annotated[str | None, typer.Option(help=SINCE_HELP)] = None,
    override_disabled: Annotated[
        bool, typer.Option(help="Run even if facts.extraction_enabled is off.")
    ] = False,
    max_facts: Annotated[int | None, typer.Option(min=1, max=25, help="Facts per segment (1-25).")] = None,
    segment_concurrency: Annotated[
        int,
        typer.Option(
            min=1, max=64, help="LLM calls in flight per page (online); results still commit in page order."
        ),
    ] = 4,
    as_json: Annotated[bool, typer.Option("--json", help="Print the counters as JSON.")] = False,
    batch: Annotated[
        bool,
        typer.Option(
            help="Send the pending segments as one OpenAI/Anthropic batch (half price, results within "
            "24 h); waits for it, then commits like an online run. For backfills."
        ),
    ] = False,
    poll_seconds: Annotated[
        float, typer.Option(min=0.01, max=3600.0, help="With --batch: seconds between polls (at most 3600).")
    ] = 30.0,
    skipped: Annotated[
        bool,
        typer.Option(
            "--skipped", help="First re-extract the pages' skipped (poison) segments, in page order (online)."
        ),
    ] = False,
) -> None:
    """Extract facts from conversation pages, resuming where the last run stopped."""
    if skipped and batch:
        raise fail("--skipped re-extracts segments one by one online; leave out --batch", code=2)
    settings = get_settings()
    factory = checked_factory(settings)
    if slug is not None:
        slug = stored_form(slug)
        with read_only(factory) as session:
            if page_id_of(session, source_id, slug) is None:
                raise fail(f"no page {slug!r} in source {source_id!r}; `factmill ingest` stores pages")
    options = ExtractOptions(
        source_id=source_id,
        slug=slug,
        dry_run=dry_run,
        force=force,
        since_iso=since,
        override_disabled=override_disabled,
        max_facts=max_facts,
        default_max_facts=settings.extraction_max_facts,
        max_output_tokens=settings.llm_max_output_tokens,
        retry_skipped=skipped,
        segment_concurrency=segment_concurrency,
    )
    if not as_json and not dry_run:
        err.print(describe(settings))
    started = time.perf_counter()
    counters = run_extraction(
        settings,
        factory,
        options,
        show_progress=not as_json,
        batch_poll_seconds=poll_seconds if batch else None,
    )
    _report(counters, source_id, as_json, time.perf_counter() - started)
    # A batch that expired, failed or did not end in time ran none of what it was sent: nothing was
    # extracted, and a script read exit 0 as "all committed".
    missing = isinstance(counters, BatchExtractionCounters) and counters.segments_missing > 0
    if counters.pages_failed or missing:
        raise typer.Exit(4)


def _report(
    counters: ExtractionCounters | BatchExtractionCounters, source_id: str, as_json: bool, took: float
) -> None:
    """The run's counters (a table, or JSON), and what a person should know of its batch or source."""
    if as_json:
        print_json(counters.as_dict())
    else:
        print_counters(counters, took)
        if (
            isinstance(counters, BatchExtractionCounters)
            and counters.batch_id
            and not counters.provider_copy_deleted
        ):
            err.print(
                f"batch {counters.batch_id}: its files (the pages' text) are still at the provider: the "
                "delete failed or the batch had not ended. Beat's backfill poll deletes them once due (a "
                "`factmill beat` and a worker on the extraction queue), or `factmill backfill copies "
                "--delete` now; until then `factmill backfill copies` lists them",
                highlight=False,
            )
    if not counters.pages_considered:
        # A source typed wrong ran as a run of nothing; say so (not an error: a new install is empty).
        err.print(
            f"no page in source {source_id!r} to extract: none is stored there, or none is of a type "
            "extraction reads (config extraction.page_types); `factmill ingest` stores pages",
            highlight=False,
        )
