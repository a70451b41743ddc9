"""`factmill backfill`: extract many pages through provider batches (half price), on the queue."""

from __future__ import annotations

from datetime import timedelta
from typing import Annotated

import typer
from sqlalchemy.orm import Session, sessionmaker

from models.backfill import BACKFILL_STATUSES
from worker.cli.console import (
    err,
    fail,
    fields,
    folding_table,
    id_argument,
    out,
    print_json,
    source_option,
    when,
)
from worker.cli.extract import SINCE_HELP
from worker.cli.sessions import checked_factory
from worker.extraction.backfill_admin import backfill_report, cancel_backfill, list_backfills
from worker.extraction.backfill_request import (
    BATCH_EXTRACTION,
    MAX_BACKFILL_SEGMENTS,
    BackfillSelection,
    NothingToBackfillError,
    request_backfill,
)
from worker.extraction.provider_copies import SWEEP_LIMIT, ProviderCopies, sweep_provider_copies
from worker.jobs.sending import enqueue as send_jobs
from worker.llm.batches import batch_unavailable
from worker.llm.gateway import LLMConfigurationError
from worker.settings import get_settings

backfill_app = typer.Typer(
    help=(
        "Backfills: pending segments of many pages through provider batches (half price), on the queue."
        "\n\nStart one by naming a selection: --source (`--source default` for every page of the default "
        "source), --since, --slug-prefix or --max-segments."
    ),
    invoke_without_command=True,
)


@backfill_app.callback()
def backfill(
    ctx: typer.Context,
    source: Annotated[str, source_option(help="The source whose pages to extract.")] = "default",
    since: Annotated[str | None, typer.Option(help=SINCE_HELP)] = None,
    slug_prefix: Annotated[str | None, typer.Option(help="Only pages whose slug starts with this.")] = None,
    max_segments: Annotated[
        int | None, typer.Option(min=1, max=MAX_BACKFILL_SEGMENTS, help="At most this many requests.")
    ] = None,
    as_json: Annotated[bool, typer.Option("--json")] = False,
) -> None:
    """Start a backfill: a batch_extraction job plans the pages, stores and sends its batches, and
    commits their results as they end (`factmill backfill show ID` follows it). Returns at once."""
    selection_options = ("source", "since", "slug_prefix", "max_segments")
    # By name: typer (0.29) carries a click of its own, whose ParameterSource is not click's.
    given = [
        n
        for n in (*selection_options, "as_json")
        if getattr(ctx.get_parameter_source(n), "name", None) != "DEFAULT"
    ]
    if ctx.invoked_subcommand is not None:
        if given:  # `backfill --json list` printed the table, `backfill --source a list` every source's
            flags = ", ".join("--" + ("json" if n == "as_json" else n.replace("_", "-")) for n in given)
            raise fail(
                f"{flags} start a backfill; put a command's own options after it (`backfill list --json`)",
                code=2,
            )
        return
    if not [n for n in given if n != "as_json"]:
        # Typed to see the subcommands, it queued a paid backfill of every page of the default source.
        if as_json:  # a script asked for a backfill's JSON: no help text and exit 0 for it
            raise fail("name a selection to start a backfill (e.g. --source default)", code=2)
        out.print(ctx.get_help(), highlight=False)
        raise typer.Exit(0)
    unavailable = batch_unavailable(get_settings())
    if unavailable:
        raise fail(unavailable, code=2)
    selection = BackfillSelection(source, since, slug_prefix, max_segments)
    factory = checked_factory()
    try:
        with factory.begin() as session:
            backfill_id, job_id = request_backfill(session, selection, created_by="cli")
    except NothingToBackfillError as exc:
        raise fail(str(exc)) from exc
    except ValueError as exc:
        raise fail(str(exc), code=2) from exc
    send_jobs(factory, [(job_id, BATCH_EXTRACTION)])
    if as_json:
        print_json({"id": backfill_id, "job_id": job_id})
        return
    out.print(
        f"backfill {backfill_id} queued (job {job_id}); follow it with `factmill backfill show {backfill_id}`"
    )


@backfill_app.command("list")
def backfill_list(
    status: Annotated[str | None, typer.Option(help="planning, running, done or cancelled.")] = None,
    limit: Annotated[int, typer.Option(min=1, max=10_000)] = 50,
    as_json: Annotated[bool, typer.Option("--json")] = False,
) -> None:
    """Recent backfills, newest first, with their job's status (`backfill show ID` for one's progress)."""
    if status is not None and status not in BACKFILL_STATUSES:
        raise fail(f"--status must be one of {', '.join(BACKFILL_STATUSES)}", code=2)
    with checked_factory()() as session:
        found = list_backfills(session, status=status, limit=limit)
    if as_json:
        print_json(found)
        return
    table = folding_table("id", "source", "selection", "status", "left", "job", "created", "finished")
    for b in found:
        selection = ", ".join(f"{k}={v}" for k, v in b["filters"].items() if v is not None and v is not False)
        job = f"{b['job_id']} {b['job_status']}" if b["job_id"] is not None else "-"
        table.add_row(
            str(b["id"]), str(b["source_id"]), selection or "every page", str(b["status"]),
            str(b["pages_left_to_others"] or "-"), job,
            when(b["created_at"]), when(b["finished_at"]),
        )  # fmt: skip
    out.print(table)


@backfill_app.command("show")
def backfill_show(backfill_id: Annotated[int, id_argument("The id `factmill backfill` printed.")]) -> None:
    """A backfill's state: its batches, its requests by status, its LLM calls and cost so far."""
    try:
        print_json(backfill_report(checked_factory(), backfill_id))
    except LookupError as exc:
        raise fail(str(exc)) from exc


@backfill_app.command("cancel")
def backfill_cancel(
    backfill_id: Annotated[int, id_argument("The id `factmill backfill` printed.")],
) -> None:
    """Cancel a backfill: unsent batches never go; running ones are cancelled at the provider.

    The results they finished (paid for) are still committed."""
    factory = checked_factory()
    try:
        with factory.begin() as session:
            woken = cancel_backfill(session, backfill_id)
    except LookupError as exc:
        raise fail(str(exc)) from exc
    send_jobs(factory, woken or [])
    out.print(f"backfill {backfill_id} " + ("had already finished" if woken is None else "cancelling"))


@backfill_app.command("copies")
def backfill_copies(
    delete: Annotated[
        bool,
        typer.Option(
            "--delete",
            help="Delete the ended ones at the provider now (one try each, at most "
            f"{SWEEP_LIMIT}), rather than at beat's next poll.",
        ),
    ] = False,
    limit: Annotated[int, typer.Option(min=1, max=10_000, help="List at most this many.")] = 50,
    as_json: Annotated[bool, typer.Option("--json")] = False,
) -> None:
    """Provider batch copies whose delete is owed; --delete deletes the ended ones now.

    A copy holds the pages' text and the facts drawn from it; its delete is owed when it failed, or
    when the batch had not ended as its run gave up on it. Beat's backfill poll deletes them once due."""
    factory = checked_factory()
    if delete:
        _delete_copies(factory, as_json)
        return
    total, held, owed = ProviderCopies(factory).listing(limit)
    if as_json:
        print_json({"owed": total, "held": held, "copies": [fields(copy, copy._fields) for copy in owed]})
        return
    if not total + held:
        out.print("no provider batch copy is owed a delete")
        return
    table = folding_table("provider", "batch", "attempts", "owed since", "last tried", "last error")
    for copy in owed:
        table.add_row(
            copy.provider, copy.batch_id, str(copy.attempts), when(copy.created_at), when(copy.tried_at),
            copy.last_error or "",
        )  # fmt: skip
    out.print(table)
    shown = f" ({len(owed)} shown)" if len(owed) < total + held else ""
    holding = (
        f"; {held} held by the `extract --batch` run that sent it, due once it is collected or at "
        "'last tried' (a run killed outright)"
        if held
        else ""
    )
    err.print(
        f"{total} batch {'copy' if total == 1 else 'copies'} owed a delete{shown}{holding}; "
        "`factmill backfill copies --delete` deletes the ended ones owed now, with the configured provider",
        highlight=False,
    )


def _delete_copies(factory: sessionmaker[Session], as_json: bool) -> None:
    settings = get_settings()
    try:
        swept = sweep_provider_copies(factory, settings, retry_after=timedelta(0))
    except LLMConfigurationError as exc:
        raise fail(f"cannot reach the provider to delete the copies: {exc}", code=2) from exc
    left, _, _ = ProviderCopies(factory).listing(1)  # (not those a run still holds)
    report = {"deleted": swept.deleted, "not_ended": swept.waiting, "failed": swept.failed, "owed": left}
    # None tried, yet some owed: they are another provider's. Exit 1, as a failed delete (a script read 0
    # as "deleted" while the pages' text stayed at the provider).
    elsewhere = left > 0 and not (swept.deleted or swept.waiting or swept.failed)
    if as_json:
        print_json(report)
    else:
        out.print(
            f"{swept.deleted} deleted, {swept.waiting} batch(es) not ended yet, {swept.failed} failed; "
            f"{left} still owed",
            highlight=False,
        )
    if elsewhere:
        err.print(
            f"the copies owed belong to another provider than the configured one "
            f"({settings.resolved_llm()}); run this where FACTMILL_LLM names theirs",
            highlight=False,
        )
        raise typer.Exit(1)
    if swept.failed:
        if not as_json:
            err.print(
                "a delete failed, so the rest were not tried; the provider's answer is in "
                "`factmill backfill copies`, and beat's poll tries again in 5 minutes",
                highlight=False,
            )
        raise typer.Exit(1)
