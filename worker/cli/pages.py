"""`factmill ingest` (store page files, queue an extraction job per changed page) and `factmill pages`
(list and erase stored pages)."""

from __future__ import annotations

import shlex
from pathlib import Path
from typing import Annotated

import typer

from models.reads import read_only
from worker.cli.console import (
    YES_OPTION_HELP,
    confirmed,
    counting_bar,
    err,
    fail,
    folding_table,
    new_source_option,
    out,
    print_json,
    source_option,
    styled,
    when,
)
from worker.cli.sessions import checked_factory, say_where_jobs_go
from worker.core.slugs import stored_form
from worker.extraction.catalog import MAX_LISTED_PAGES, list_pages, page_cursor
from worker.extraction.erase import erase_page, no_page_to_erase
from worker.extraction.ingest import ingest_paths, iter_page_files
from worker.jobs.sending import enqueue as send_jobs
from worker.settings import get_settings


def ingest(
    paths: Annotated[list[Path], typer.Argument(help="Markdown files or directories (walked recursively).")],
    source_id: Annotated[str, new_source_option(help="Source the pages belong to.")] = "default",
    enqueue: Annotated[
        bool, typer.Option(help="Hand the extraction jobs to the broker now (else the sweeper sends them).")
    ] = True,
    replace: Annotated[
        bool,
        typer.Option(
            "--replace",
            help="Store a file over a page another file (still there) stored under the same slug.",
        ),
    ] = False,
    as_json: Annotated[bool, typer.Option("--json", help="Print a JSON report.")] = False,
) -> None:
    """Store page files (front matter: slug, type, title); queue an extraction job per changed page.

    A page's slug is its 'slug:', else its path below the folder named (a file named alone: its name).
    A page another file stored is not replaced while that file is there (--replace does). A file that
    cannot be stored is reported and skipped, the rest stored; the exit code is then 1."""
    factory = checked_factory()
    if enqueue:
        say_where_jobs_go(get_settings())
    files = sum(1 for _ in iter_page_files(paths))
    with counting_bar("page files", files, enabled=not as_json) as advance:
        send = (lambda created: send_jobs(factory, created)) if enqueue else None
        report = ingest_paths(factory, paths, source_id, on_file=advance, send=send, replace=replace)
    sent = report.enqueued
    if as_json:
        print_json(
            {
                "ingested": report.ingested,
                "unchanged": report.unchanged,
                "jobs": [job_id for job_id, _ in report.jobs],
                "enqueued": sent,
                "errors": [{"path": p, "reason": r} for p, r in report.errors],
            },
            ensure_ascii=False,
        )
    else:
        out.print(
            f"ingested {len(report.ingested)} page(s), {len(report.unchanged)} unchanged, "
            f"{len(report.errors)} error(s); {len(report.jobs)} extraction job(s) queued"
        )
        for path, reason in report.errors:
            err.print(styled(("skipped", "yellow"), f" {path}: {reason}"))
    if report.errors:  # the rest is stored, but a script must see that files were skipped
        raise typer.Exit(1)


pages_app = typer.Typer(help="Stored pages: list them, erase one.", no_args_is_help=True)


@pages_app.command("list")
def pages_list(
    source_id: Annotated[str | None, source_option(help="Only pages of this source.")] = None,
    slug_prefix: Annotated[str | None, typer.Option(help="Only pages whose slug starts with this.")] = None,
    limit: Annotated[int, typer.Option(min=1, max=MAX_LISTED_PAGES)] = 100,
    after: Annotated[
        str | None, typer.Option(help="Continue after this source|slug (the last line of a listing).")
    ] = None,
    as_json: Annotated[bool, typer.Option("--json")] = False,
) -> None:
    """Stored pages by source and slug: type, current facts, last job, last update (--json: the title)."""
    try:
        cursor = page_cursor(after)
    except ValueError as exc:
        raise fail(str(exc), code=2) from exc
    with read_only(checked_factory()) as session:
        listed = list_pages(
            session,
            source_ids=[source_id] if source_id else None,
            slug_prefix=slug_prefix,
            limit=limit,
            after=cursor,
        )
    if as_json:
        print_json(listed.model_dump(mode="json"), ensure_ascii=False)
        return
    table = folding_table("source", "slug", "type", "facts", "last job", "updated")
    table.columns[5].no_wrap = True  # the time on one line; the slug takes what is left
    for page in listed.pages:
        job = f"{page.last_job_id} {page.last_job_status}" if page.last_job_id else "—"
        table.add_row(page.source_id, page.slug, page.type, str(page.facts), job, when(page.updated_at))
    out.print(table)
    if listed.next_after:
        out.print(f"more: --after {shlex.quote(listed.next_after)}", highlight=False)


@pages_app.command("erase")
def pages_erase(
    source_id: Annotated[str, typer.Argument(help="The source the page belongs to (e.g. default).")],
    slug: Annotated[str, typer.Argument(help="The page's slug.")],
    as_json: Annotated[bool, typer.Option("--json", help="Print a JSON report.")] = False,
    yes: Annotated[bool, typer.Option("--yes", "-y", help=YES_OPTION_HELP)] = False,
) -> None:
    """Erase a page and everything drawn from it (facts, embeddings, checkpoints, audit rows).

    All in one transaction; its pending jobs fail with "page erased". One content-free row records the
    erasure. At a terminal it asks first (there is no undo)."""
    slug = stored_form(slug)
    factory = checked_factory()
    if not confirmed(f"Erase page {slug!r} of source {source_id!r} and everything drawn from it?", yes):
        raise fail("nothing was erased")
    report = erase_page(factory, source_id, slug, requested_by="cli")
    if report is None:
        raise fail(f"{no_page_to_erase(factory, source_id, slug)}; nothing was erased")
    if report.pending:  # unsent (no broker), the sweeper sends them
        send_jobs(factory, report.pending)
    if as_json:
        print_json({"source_id": source_id, "slug": slug, **report.as_dict()}, ensure_ascii=False)
        return
    out.print(
        f"erased {slug} ({source_id}): {report.facts_removed} fact(s), {report.embeddings_removed} "
        f"embedding(s), {report.checkpoints_removed} checkpoint(s), {report.audit_rows_removed} audit "
        f"row(s); {report.jobs_cancelled} pending job(s) cancelled",
        highlight=False,
    )
