"""`factmill compact` (force a compaction) and `factmill transcripts` (tokens before/after, erasure)."""

from __future__ import annotations

import json
import sys
from typing import Annotated

import typer
from rich.table import Table

from models.reads import one_snapshot, read_only
from worker.calibration import ThresholdCache, describe_tau
from worker.cli.console import YES_OPTION_HELP, confirmed, fail, fields, folding_table, out, print_json, when
from worker.cli.processes import stops_on_signals
from worker.cli.sessions import checked_factory
from worker.compaction import (
    CompactionDisabledError,
    CompactionOutcome,
    TranscriptNotFoundError,
    TranscriptStats,
    compact_transcript,
    list_compactions,
    recent_transcripts,
    request_compaction,
    transcript_stats,
)
from worker.compaction.erase import erase_transcript, no_transcript_to_erase
from worker.config_store import COMPACTION_ENABLED, ConfigReader
from worker.core.jsonvalues import BIGINT_MAX
from worker.jobs.outbox import COMPACTION
from worker.jobs.sending import enqueue
from worker.llm.errors import BudgetExhaustedError, LLMError, account_exhausted
from worker.runtime import Runtime
from worker.settings import get_settings

transcripts_app = typer.Typer(
    help="Agent transcripts: settings, tokens before/after compaction, compactions.", no_args_is_help=True
)

COMPACTION_FIELDS = (
    "id",
    "status",
    "cut_seq",
    "previous_id",
    "tokens_before",
    "tokens_after",
    "coverage",
    "density",
    "threshold_tau",
    "threshold_version",
    "attempts",
    "missed_terms",
    "error",
    "job_id",
    "created_at",
    "summary",
)


def _tau(value: float | None, version: int | None) -> str:
    if value is None:
        return "—"
    return f"{describe_tau(value)} {'v' + str(version) if version is not None else 'fallback'}"


def _number(value: float | None, digits: int = 3) -> str:
    return "—" if value is None else f"{value:.{digits}f}"


def _print_outcome(outcome: CompactionOutcome) -> None:
    name = f"compaction {outcome.compaction_id}" if outcome.compaction_id is not None else "compaction"
    out.print(f"{name} of {outcome.transcript_id}: {outcome.status}")
    table = folding_table(
        "compaction", "status", "cut seq", "tokens before → after", "saved", "coverage", "τ", "attempts"
    )
    table.add_row(
        str(outcome.compaction_id) if outcome.compaction_id is not None else "—",
        outcome.status,
        str(outcome.cut_seq) if outcome.cut_seq is not None else "—",
        f"{outcome.tokens_before if outcome.tokens_before is not None else '—'} → "
        f"{outcome.tokens_after if outcome.tokens_after is not None else '—'}",
        str(outcome.tokens_saved),
        _number(outcome.coverage),
        _tau(outcome.threshold_tau, outcome.threshold_version),
        str(outcome.attempts),
    )
    out.print(table)
    if outcome.missed_terms:
        out.print(f"missed terms: {', '.join(outcome.missed_terms)}")
    if outcome.detail:
        out.print(outcome.detail)
    if outcome.coverage is not None and outcome.compaction_id is not None:
        # In full (a table folds it): a label of the compaction carries exactly it.
        said = f"a label of compaction {outcome.compaction_id} carries it"
        out.print(f"measured coverage {outcome.coverage!r} ({said})")


def _what_to_do(exc: LLMError) -> str:
    """What a user does about a summarizer call that failed, by whose fault it was."""
    if account_exhausted(exc):
        return "the provider's account is out of credit or quota: top it up, then run it again"
    if exc.deployment_fault and exc.status in (401, 404):
        return (
            "fix the provider's key, model or URL (OPENAI_API_KEY / ANTHROPIC_API_KEY, "
            "FACTMILL_LLM_MODEL, FACTMILL_LLM_BASE_URL), then run it again"
        )
    if exc.deployment_fault:  # an organization on hold, a workspace's policy, a parameter refused
        return "the provider refuses this account's or settings' requests (its message says why)"
    return "try again later"


@stops_on_signals
def compact_command(
    transcript_id: Annotated[str, typer.Argument(help="The transcript to compact.")],
    now: Annotated[
        bool, typer.Option("--now", help="Compact in this process instead of queueing a job.")
    ] = False,
    as_json: Annotated[bool, typer.Option("--json", help="Print the outcome as JSON.")] = False,
) -> None:
    """Force a compaction of TRANSCRIPT_ID, even under its threshold: queue a job, or run it --now."""
    factory = checked_factory()
    if not now:
        try:
            with factory.begin() as session:
                job = request_compaction(session, transcript_id, force=True, trigger="manual")
        except TranscriptNotFoundError as exc:
            raise fail(str(exc)) from exc
        sent = enqueue(factory, [(job.job_id, COMPACTION)]) if job.created else 0
        if as_json:
            sys.stdout.write(json.dumps({"job_id": job.job_id, "created": job.created, "sent": sent}) + "\n")
        elif job.created:
            out.print(f"compaction job {job.job_id} queued for transcript {transcript_id}")
        else:
            out.print(  # a running one takes it at its next run (queued when this one ends)
                f"compaction job {job.job_id} was already pending for {transcript_id}; it is now forced "
                "(if it is running, its next run is)"
            )
        return

    settings = get_settings()
    config = ConfigReader(factory, ttl=0)
    if not config.enabled(COMPACTION_ENABLED):
        raise fail(  # 3, as every command a kill switch stops (a script tells "off" from "failed")
            f"{COMPACTION_ENABLED} is off, so nothing is compacted; "
            f"turn it on with `factmill config set {COMPACTION_ENABLED} true`",
            code=3,
        )
    runtime = Runtime(settings=settings, factory=factory, config=config)
    try:
        outcome = compact_transcript(
            factory,
            runtime.llm,
            transcript_id,
            threshold=ThresholdCache(factory, ttl=0).get,
            force=True,
            enabled=lambda: config.enabled(COMPACTION_ENABLED),
            max_output_tokens=settings.compaction_max_output_tokens,
            intent_messages=settings.compaction_intent_messages,
            max_input_tokens=settings.compaction_max_input_tokens,
        )
    except TranscriptNotFoundError as exc:
        raise fail(str(exc)) from exc
    except CompactionDisabledError as exc:
        raise fail(str(exc), code=3) from exc
    except BudgetExhaustedError as exc:
        raise fail(str(exc)) from exc
    except LLMError as exc:  # no compaction stored (its calls are in llm_calls)
        raise fail(
            f"the summarizer call failed: {exc}; no compaction was stored, {_what_to_do(exc)}"
        ) from exc
    finally:
        runtime.close()
    if as_json:
        print_json(outcome.as_dict())
    else:
        _print_outcome(outcome)
        if outcome.head_capped:
            out.print(
                "the history before the cut is over the summarizer's input (FACTMILL_COMPACTION_MAX_INPUT_"
                "TOKENS), so only its oldest part was summarized; run this again for the rest"
            )
    if outcome.status == "failed" and not outcome.superseded:  # superseded: another summary was applied
        raise typer.Exit(1)
    if outcome.status == "rejected":  # paid for, and nothing applied: a script must not read it as done
        raise typer.Exit(5)


def _token_table(stats: TranscriptStats) -> Table:
    table = folding_table("", "messages", "tokens", title=f"transcript {stats.transcript_id}")
    table.add_row("full history", str(stats.messages), f"{stats.history_tokens:,}")
    if stats.compaction_id is not None:
        kept = stats.messages - (stats.cut_seq or 0)
        table.add_row(
            f"context now: summary of compaction {stats.compaction_id} + messages from seq {stats.cut_seq}",
            f"1 + {kept}",
            f"{stats.context_tokens:,} ({stats.summary_tokens:,} summary)",
        )
    else:
        table.add_row("context now: not compacted", str(stats.messages), f"{stats.context_tokens:,}")
    saved = stats.saved_tokens
    share = f" ({saved / stats.history_tokens:.0%})" if stats.history_tokens else ""
    table.add_row("saved", "", f"{saved:,}{share}")
    trigger = stats.settings.trigger_tokens
    table.add_row(
        "compacts above",
        "",
        "never (no context window)" if trigger is None else f"{trigger:,} (window − reserve)",
    )
    return table


@transcripts_app.command("show")
def transcripts_show(
    transcript_id: str,
    limit: Annotated[int, typer.Option(min=1, max=1000, help="Compactions to list.")] = 10,
    before_id: Annotated[
        int | None,
        typer.Option(min=1, max=BIGINT_MAX, help="Only compactions with a smaller id (the next page)."),
    ] = None,
    as_json: Annotated[bool, typer.Option("--json")] = False,
) -> None:
    """Tokens before and after compaction, the settings, and the newest compactions.

    A page stops at its limit or at 8 MiB of summaries and attempt logs, and says how to go on."""
    with one_snapshot(checked_factory()) as session:  # its figures agree though an agent appends
        try:
            stats = transcript_stats(session, transcript_id)
        except TranscriptNotFoundError as exc:
            raise fail(str(exc)) from exc
        rows, more = list_compactions(session, transcript_id, limit=limit, before_id=before_id)
        compactions = [fields(row, COMPACTION_FIELDS) for row in rows]
    next_before = rows[-1].id if more else None
    if as_json:
        print_json({**stats.as_dict(), "compactions": compactions, "next_before_id": next_before})
        return
    out.print(_token_table(stats))
    s = stats.settings
    out.print(
        f"window {s.context_window if s.context_window is not None else 'unknown'}, "
        f"reserve {s.reserve_tokens:,}, "
        f"keep recent {s.keep_recent_tokens:,}, tool results clipped at {s.tool_result_limit:,} characters"
        + (f"; instructions: {s.instructions!r}" if s.instructions else "")
    )
    if stats.pending_job_id is not None:
        out.print(f"compaction job {stats.pending_job_id} is pending")
    if not compactions:
        out.print("no compactions yet")
        return
    table = folding_table("id", "status", "cut at", "tokens before → after", "coverage", "τ", "tries")
    notes = []
    for c in compactions:
        after = c["tokens_after"]
        table.add_row(
            str(c["id"]),
            c["status"],
            f"seq {c['cut_seq']}",
            f"{c['tokens_before']:,} → {after:,}" if after is not None else f"{c['tokens_before']:,} → —",
            # In full: a label of the compaction (`calibration add --compaction-id`) carries exactly it.
            "—" if c["coverage"] is None else repr(c["coverage"]),
            _tau(c["threshold_tau"], c["threshold_version"]),
            str(c["attempts"]),
        )
        note = c["error"] or (f"missed: {', '.join(c['missed_terms'])}" if c["missed_terms"] else "")
        if note:
            notes.append(f"  {c['id']} ({when(c['created_at'])}): {note}")
    out.print(table)
    for note in notes:
        out.print(note)
    if next_before is not None:
        out.print(
            f"older compactions follow: `factmill transcripts show {transcript_id} --before-id {next_before}`"
        )


@transcripts_app.command("list")
def transcripts_list(
    limit: Annotated[int, typer.Option(min=1, max=10_000)] = 50,
    as_json: Annotated[bool, typer.Option("--json")] = False,
) -> None:
    """Transcripts, most recently changed first, with their message and token counts."""
    with read_only(checked_factory()) as session:
        rows = recent_transcripts(session, limit)
    if as_json:
        print_json(rows)
        return
    table = folding_table("transcript", "window", "messages", "history tokens", "updated")
    for r in rows:
        table.add_row(
            r["transcript_id"],
            str(r["context_window"] or "—"),
            str(r["messages"]),
            f"{r['history_tokens']:,}",
            when(r["updated_at"]),
        )
    out.print(table)


@transcripts_app.command("erase")
def transcripts_erase(
    transcript_id: Annotated[str, typer.Argument(help="The transcript's id.")],
    as_json: Annotated[bool, typer.Option("--json", help="Print a JSON report.")] = False,
    yes: Annotated[bool, typer.Option("--yes", "-y", help=YES_OPTION_HELP)] = False,
) -> None:
    """Erase a transcript: its messages and its compactions (their summaries), as DELETE /v1/transcripts/ID.

    All in one transaction; its pending compaction jobs fail with "transcript erased". One content-free
    row records the erasure. At a terminal it asks first (there is no undo)."""
    factory = checked_factory()
    if not confirmed(f"Erase transcript {transcript_id!r}, its messages and its compactions?", yes):
        raise fail("nothing was erased")
    report = erase_transcript(factory, transcript_id, requested_by="cli")
    if report is None:
        raise fail(f"{no_transcript_to_erase(factory, transcript_id)}; nothing was erased")
    if as_json:
        print_json({"transcript_id": transcript_id, **report.as_dict()}, ensure_ascii=False)
        return
    out.print(
        f"erased transcript {transcript_id}: {report.messages_removed} message(s), "
        f"{report.compactions_removed} compaction(s); {report.jobs_cancelled} pending job(s) cancelled",
        highlight=False,
    )


__all__ = ["compact_command", "transcripts_app"]
