"""`factmill ingest`: store page files and queue an extraction job per changed page."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from worker.cli.console import err, out
from worker.cli.sessions import checked_factory
from worker.extraction.ingest import ingest_paths
from worker.jobs.outbox import enqueue as send_jobs


def ingest(
    paths: Annotated[list[Path], typer.Argument(help="Markdown files or directories (walked recursively).")],
    source_id: Annotated[str, typer.Option(help="Source the pages belong to.")] = "default",
    enqueue: Annotated[
        bool, typer.Option(help="Hand the extraction jobs to the broker now (else the sweeper sends them).")
    ] = True,
    as_json: Annotated[bool, typer.Option("--json", help="Print a JSON report.")] = False,
) -> None:
    """Store page files (front matter: slug, type, title); queue an extraction job per changed page."""
    factory = checked_factory()
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
