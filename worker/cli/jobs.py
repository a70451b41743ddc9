"""`factmill jobs`: list, show and retry jobs (the outbox and its history)."""

from __future__ import annotations

from typing import Annotated

import typer

from models import JOB_STATUSES, Job
from models.reads import one_snapshot
from worker.accounting.reports import job_spend
from worker.cli.console import fail, fields, folding_table, id_argument, out, print_json
from worker.cli.sessions import checked_factory
from worker.jobs import queries
from worker.jobs.registry import kind_names
from worker.jobs.sending import enqueue as send_jobs

jobs_app = typer.Typer(help="Jobs: the outbox and its history.", no_args_is_help=True)

JOB_FIELDS = (
    "id",
    "kind",
    "subject",
    "status",
    "attempts",
    "worker_losses",
    "provider_outage_since",
    "pause_reason",
    "last_error",
    "counters",
    "created_at",
    "updated_at",
    "heartbeat_at",
    "finished_at",
)


@jobs_app.command("list")
def jobs_list(
    status: Annotated[str | None, typer.Option(help="queued, running, paused, succeeded or failed.")] = None,
    kind: Annotated[str | None, typer.Option(help="extraction, compaction, consolidation, ...")] = None,
    limit: Annotated[int, typer.Option(min=1, max=10_000)] = 50,
    as_json: Annotated[bool, typer.Option("--json")] = False,
) -> None:
    """Recent jobs, newest first."""
    if status is not None and status not in JOB_STATUSES:
        raise fail(f"--status must be one of {', '.join(JOB_STATUSES)}", code=2)
    if kind is not None and kind not in kind_names():
        raise fail(f"--kind must be one of {', '.join(kind_names())}", code=2)
    with checked_factory()() as session:
        jobs = [
            fields(j, JOB_FIELDS) for j in queries.list_jobs(session, status=status, kind=kind, limit=limit)
        ]
    if as_json:
        print_json(jobs)
        return
    table = folding_table("id", "kind", "subject", "status", "attempts", "worker losses", "last_error")
    for j in jobs:
        table.add_row(
            str(j["id"]),
            j["kind"],
            j["subject"],
            j["status"],
            str(j["attempts"]),
            str(j["worker_losses"]),
            (j["last_error"] or "")[:60],
        )
    out.print(table)


@jobs_app.command("show")
def jobs_show(job_id: Annotated[int, id_argument("The job id (`factmill jobs list` shows them).")]) -> None:
    """One job with its counters, last error, and LLM spend (tokens, cached tokens, USD)."""
    with one_snapshot(checked_factory()) as session:  # the job and its spend agree
        job = session.get(Job, job_id)
        if job is None:
            raise fail(f"no job {job_id}")
        print_json(fields(job, JOB_FIELDS) | {"spend": job_spend(session, job_id).as_dict()})


@jobs_app.command("retry")
def jobs_retry(
    job_id: Annotated[int, id_argument("The job to queue again: failed, paused or succeeded.")],
    skipped: Annotated[
        bool,
        typer.Option(
            "--skipped",
            help="Re-extract the page's skipped (poison) segments, in page order, each committed once.",
        ),
    ] = False,
) -> None:
    """Queue a failed, paused or succeeded job again (attempts and worker losses start over)."""
    factory = checked_factory()
    try:
        with factory.begin() as session:
            job = queries.retry(session, job_id, skipped=skipped)
            pair = (job.id, job.kind)
    except queries.JobNotFoundError as exc:
        raise fail(str(exc)) from exc
    except (
        queries.JobNotRetryableError,
        queries.JobAlreadyPendingError,
        queries.JobHasNoSegmentsError,
        queries.JobSubjectGoneError,
    ) as exc:
        raise fail(str(exc), code=2) from exc
    send_jobs(factory, [pair])
    out.print(f"job {job_id} queued" + (" to re-extract its skipped segments" if skipped else ""))
