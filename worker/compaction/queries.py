"""Transcript reads and writes inside the caller's transaction: every function takes a Session, never commits.

The API and the CLI call these inside their own transaction (an append shares it with its webhook
delivery row; its compaction job is sent after the commit); TranscriptStore wraps them for the service.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from sqlalchemy import Row, bindparam, case, func, literal, select, true, update
from sqlalchemy.dialects.postgresql import insert
from sqlalchemy.orm import Session

from models import Job, Transcript
from models.bulk import BulkInsert
from models.tables import COMPACTIONS, TRANSCRIPT_MESSAGES, TRANSCRIPTS
from worker.compaction.waits import compaction_wait
from worker.core.compaction import TranscriptMessage, estimate_tokens, should_compact
from worker.core.compaction_gate import QUESTION_CHAR_LIMIT
from worker.core.timeline import AppliedSummary, Timeline, applied_timeline
from worker.core.transcripts import (
    ToolUnit,
    TranscriptError,
    TranscriptSettings,
    check_transcript_id,
    clean_settings,
    link_tool_results,
    stored_message,
    tool_calls_json,
)
from worker.jobs.leases import NEXT_RUN, options_for_its_next_run
from worker.jobs.outbox import COMPACTION, PENDING, JobRequest, request_job


class TranscriptNotFoundError(LookupError):
    def __init__(self, transcript_id: str) -> None:
        super().__init__(f"no transcript {transcript_id!r}; append messages to it first")
        self.transcript_id = transcript_id


# A transcript's settings columns (TranscriptSettings), read with its row lock or without.
_SETTINGS = (
    TRANSCRIPTS.c.context_window,
    TRANSCRIPTS.c.reserve_tokens,
    TRANSCRIPTS.c.keep_recent_tokens,
    TRANSCRIPTS.c.tool_result_limit,
    TRANSCRIPTS.c.instructions,
)
_READ_SETTINGS = select(*_SETTINGS, TRANSCRIPTS.c.created_at).where(TRANSCRIPTS.c.id == bindparam("id"))
_LOCK = _READ_SETTINGS.with_for_update()
# Created on first use and touched, the row locked either way: ON CONFLICT DO UPDATE locks the row it
# finds, as SELECT ... FOR UPDATE does. Core statements built once: an append runs on every agent turn.
_OPEN = (
    insert(TRANSCRIPTS)
    .values(id=bindparam("id"))
    .on_conflict_do_update(index_elements=[TRANSCRIPTS.c.id], set_={"updated_at": func.now()})
    .returning(*_SETTINGS)
)


def lock_transcript(session: Session, transcript_id: str, *, create: bool) -> TranscriptSettings:
    """The transcript's settings, its row locked for this transaction (appends and applies serialize
    on it); with ``create``, the transcript is created first if it is new, and touched."""
    connection = session.connection()
    row = connection.execute(_OPEN if create else _LOCK, {"id": transcript_id}).one_or_none()
    if row is None:
        raise TranscriptNotFoundError(transcript_id)
    return TranscriptSettings.of(row)


def transcript_settings(session: Session, transcript_id: str) -> TranscriptSettings:
    return TranscriptSettings.of(settings_row(session, transcript_id))


def settings_row(session: Session, transcript_id: str) -> Row[*tuple[Any, ...]]:
    row = session.connection().execute(_READ_SETTINGS, {"id": transcript_id}).one_or_none()
    if row is None:
        raise TranscriptNotFoundError(transcript_id)
    return row


def transcript_created_at(session: Session, transcript_id: str, *, lock: bool = False) -> datetime | None:
    """When the transcript of this id was created (None: there is none), its row locked with ``lock``."""
    row = session.connection().execute(_LOCK if lock else _READ_SETTINGS, {"id": transcript_id}).one_or_none()
    return None if row is None else row.created_at


def _change_settings(session: Session, transcript_id: str, changes: Mapping[str, Any]) -> TranscriptSettings:
    """Apply cleaned settings to a transcript this transaction has locked; its settings after. Raises
    TranscriptError (the caller rolls back) when they leave no room for a compaction threshold."""
    changed = update(TRANSCRIPTS).where(TRANSCRIPTS.c.id == transcript_id).values(dict(changes))
    settings = TranscriptSettings.of(session.connection().execute(changed.returning(*_SETTINGS)).one())
    settings.check_room()
    return settings


def get_transcript(session: Session, transcript_id: str) -> Transcript:
    row = session.get(Transcript, transcript_id)
    if row is None:
        raise TranscriptNotFoundError(transcript_id)
    return row


# The applied summary: the newest accepted compaction of the transcript :id.
_APPLIED = (
    select(COMPACTIONS.c.id, COMPACTIONS.c.cut_seq, COMPACTIONS.c.summary)
    .where(COMPACTIONS.c.transcript_id == bindparam("id"), COMPACTIONS.c.status == "accepted")
    .order_by(COMPACTIONS.c.id.desc())
    .limit(1)
    .subquery("applied")
)
_SELECT_APPLIED = select(_APPLIED)


def _applied(summary_id: Any, cut_seq: Any, text: Any) -> AppliedSummary | None:
    """The applied summary of a row of _APPLIED's columns (all None: there is none)."""
    return None if text is None else AppliedSummary(int(summary_id), int(cut_seq), str(text))


def applied_summary(session: Session, transcript_id: str) -> AppliedSummary | None:
    row = session.connection().execute(_SELECT_APPLIED, {"id": transcript_id}).first()
    return None if row is None else _applied(*row)


_TIMELINE_MESSAGES = (
    select(
        TRANSCRIPT_MESSAGES.c.seq,
        TRANSCRIPT_MESSAGES.c.role,
        TRANSCRIPT_MESSAGES.c.text,
        TRANSCRIPT_MESSAGES.c.tool_calls,
        TRANSCRIPT_MESSAGES.c.tool_call_id,
        TRANSCRIPT_MESSAGES.c.tool_name,
    )
    .where(
        TRANSCRIPT_MESSAGES.c.transcript_id == bindparam("id"),
        TRANSCRIPT_MESSAGES.c.seq >= bindparam("start"),
    )
    .order_by(TRANSCRIPT_MESSAGES.c.seq)
)


# What a message stores, in bytes, uncompressed: a column Postgres keeps (no message is loaded to be
# measured). pg_column_size of the tool calls was their compressed size: a hundredth of it for
# arguments of one repeated character, and the caps let gigabytes through.
STORED_BYTES = TRANSCRIPT_MESSAGES.c.stored_bytes
_IN_VIEW = (
    TRANSCRIPT_MESSAGES.c.transcript_id == bindparam("id"),
    TRANSCRIPT_MESSAGES.c.seq >= bindparam("start"),
)
# What a message, and a tool call, costs a read beside its stored bytes: its objects and its JSON (about
# 1.8 KB a one-character message, measured). Counted by bytes alone, 11 million one-character messages
# (or tool calls, each given a placeholder result) passed the 32 MiB cap: 200,000 took 361 MB to read.
VIEW_ITEM_BYTES = 1024
_VIEW_SIZE = select(func.coalesce(func.sum(STORED_BYTES), 0), func.count()).where(*_IN_VIEW)
_CALLS = TRANSCRIPT_MESSAGES.c.tool_calls
_VIEW_CALLS = select(
    func.coalesce(
        func.sum(case((func.jsonb_typeof(_CALLS) == "array", func.jsonb_array_length(_CALLS)), else_=0)), 0
    )
).where(*_IN_VIEW)


class ContextTooLargeError(Exception):
    """The context view is past the bytes one read may load; the history is still read in pages."""

    def __init__(self, transcript_id: str, size: int, limit: int) -> None:
        super().__init__(
            f"transcript {transcript_id!r}: its context view is {size:,} bytes (each message and tool call "
            f"counted at {VIEW_ITEM_BYTES:,} bytes beside its text), past the {limit:,} one read returns; "
            "no accepted summary has cut it down (give the transcript a context_window, check "
            "that compaction.enabled is on and see its compactions), or read the history in pages "
            "(GET /v1/transcripts/{id}/messages, or the MCP tool list_transcript_messages)"
        )
        self.transcript_id = transcript_id


def load_timeline(session: Session, transcript_id: str, *, max_bytes: int | None = None) -> Timeline:
    """The applied summary and the messages after its cut. With ``max_bytes``, raises
    ContextTooLargeError when they store more than that, each message and tool call counted at
    VIEW_ITEM_BYTES besides (measured before any message is loaded)."""
    row = settings_row(session, transcript_id)
    settings = TranscriptSettings.of(row)
    summary = applied_summary(session, transcript_id)
    start = summary.cut_seq if summary is not None else 0
    if max_bytes is not None:
        where = {"id": transcript_id, "start": start}
        stored, messages = session.connection().execute(_VIEW_SIZE, where).one()
        size = stored + VIEW_ITEM_BYTES * messages
        size += len(summary.summary.encode()) if summary is not None else 0
        if size <= max_bytes:  # (reads the tool calls: at most max_bytes of them, once that holds)
            size += VIEW_ITEM_BYTES * session.connection().execute(_VIEW_CALLS, where).scalar_one()
        if size > max_bytes:
            raise ContextTooLargeError(transcript_id, size, max_bytes)
    rows = session.connection().execute(_TIMELINE_MESSAGES, {"id": transcript_id, "start": start}).all()
    kept = (
        (seq, stored_message(role, text, calls, call_id, name))
        for seq, role, text, calls, call_id, name in rows
    )
    return applied_timeline(transcript_id, settings, summary, kept, row.created_at)


# The context view holds the applied summary and the messages from its cut on: their tokens (the
# transcript's running total less what the summary stands in for, both kept by triggers: migration
# 0047), in one statement with the summary, reading no message (a sum over them took 240 ms an append at
# a million messages).
_MESSAGE_TOKENS = select(TRANSCRIPTS.c.message_tokens).where(TRANSCRIPTS.c.id == bindparam("id"))
_TOKENS_CUT = select(COMPACTIONS.c.tokens_cut).where(COMPACTIONS.c.id == _APPLIED.c.id)
_CONTEXT = select(
    _APPLIED.c.id,
    _APPLIED.c.cut_seq,
    _APPLIED.c.summary,
    func.coalesce(_MESSAGE_TOKENS.scalar_subquery(), 0) - func.coalesce(_TOKENS_CUT.scalar_subquery(), 0),
).select_from(select(literal(1).label("one")).subquery().outerjoin(_APPLIED, true()))


def context_now(session: Session, transcript_id: str) -> tuple[AppliedSummary | None, int]:
    """(the applied summary, estimated tokens of the context view: summary + messages after its cut)."""
    summary_id, cut_seq, text, tokens = session.connection().execute(_CONTEXT, {"id": transcript_id}).one()
    summary = _applied(summary_id, cut_seq, text)
    return summary, int(tokens) + (estimate_tokens(summary.marker()) if summary is not None else 0)


# The end of a transcript's stored history: its last seq, and its last turn that is not a tool result.
_LAST_TURN = (
    select(TRANSCRIPT_MESSAGES.c.seq, TRANSCRIPT_MESSAGES.c.tool_calls)
    .where(TRANSCRIPT_MESSAGES.c.transcript_id == bindparam("id"), TRANSCRIPT_MESSAGES.c.role != "tool")
    .order_by(TRANSCRIPT_MESSAGES.c.seq.desc())
    .limit(1)
    .subquery("turn")
)
_TAIL = select(
    select(func.max(TRANSCRIPT_MESSAGES.c.seq))
    .where(TRANSCRIPT_MESSAGES.c.transcript_id == bindparam("id"))
    .scalar_subquery(),
    _LAST_TURN.c.seq,
    _LAST_TURN.c.tool_calls,
).select_from(select(literal(1).label("one")).subquery().outerjoin(_LAST_TURN, true()))
_ANSWERED = select(TRANSCRIPT_MESSAGES.c.tool_call_id).where(
    TRANSCRIPT_MESSAGES.c.transcript_id == bindparam("id"), TRANSCRIPT_MESSAGES.c.seq > bindparam("after")
)


def _stored_tool_unit(session: Session, transcript_id: str) -> tuple[int, ToolUnit | None]:
    """(next seq, the open tool unit at the end of the stored history, if it ends in one)."""
    connection = session.connection()
    last_seq, turn_seq, turn_calls = connection.execute(_TAIL, {"id": transcript_id}).one()
    if last_seq is None:
        return 0, None
    if turn_seq is None or not turn_calls:
        return last_seq + 1, None
    answered = connection.execute(_ANSWERED, {"id": transcript_id, "after": turn_seq}).scalars()
    unit = ToolUnit({c["id"]: c["name"] for c in turn_calls}, {a for a in answered if a is not None})
    return last_seq + 1, unit


@dataclass(frozen=True)
class TriggerCheck:
    context_tokens: int
    trigger_tokens: int | None
    job: JobRequest | None = None
    note: str | None = None  # why no job was requested although the threshold was passed

    @property
    def over(self) -> bool:
        return self.trigger_tokens is not None and self.context_tokens > self.trigger_tokens


# A job option: this run continues an accepted summary of part of the head (it did not fit the
# summarizer): the wait after a summary that left the context over its threshold does not hold it.
CONTINUATION = "continuation"
# A run's own options, not its rerun's (a forced rerun skipped the wait after each miss: two calls a run).
ONE_RUN_OPTIONS = ("force", CONTINUATION)


def request_compaction(
    session: Session, transcript_id: str, *, force: bool = False, trigger: str = "manual"
) -> JobRequest:
    """Request a compaction job (one pending per transcript) in the caller's transaction.

    A forced request marks a pending job as forced too, so it compacts even under the threshold (a
    running one, its rerun: the run in progress read its options when it began); a "continue" request
    (from the running job itself) marks its rerun as a continuation. The transcript's row is locked
    first, as appends and erasure lock it: a request racing an erasure waits for it and finds no
    transcript (read unlocked, it inserted a job named by the erased id after the erasure's scrub).
    """
    lock_transcript(session, transcript_id, create=False)
    asked = {"force": True} if force else {}
    if trigger == "continue":
        asked[CONTINUATION] = True
    job = request_job(
        session,
        COMPACTION,
        transcript_id,
        options={"force": force, "trigger": trigger, **asked},
        # An operator's forced run starts a job paused for its own budget over ("it is now forced",
        # and it never ran); a continuation is the running job's own.
        renew_spent_budget_after=0.0 if force else None,
    )
    if asked and not job.created:
        session.execute(
            update(Job).where(Job.id == job.job_id).values(options=options_for_its_next_run(**asked))
        )
    return job


# The transcript's pending job continuing a head summarized in part (asked of it, or of its next run).
_PENDING_CONTINUATION = select(Job.id).where(
    Job.kind == COMPACTION,
    Job.subject == bindparam("subject"),
    Job.status.in_(PENDING),
    Job.options.contains({CONTINUATION: True}) | Job.options[NEXT_RUN].contains({CONTINUATION: True}),
)


def check_trigger(
    session: Session, transcript_id: str, settings: TranscriptSettings, retrigger_seconds: float
) -> TriggerCheck:
    """Request a compaction when the context passed window - reserve (inside the caller's transaction)."""
    tokens = context_now(session, transcript_id)[1]
    check = TriggerCheck(tokens, settings.trigger_tokens)
    if not should_compact(tokens, settings.context_window, settings.reserve_tokens):
        return check
    # The rest of a head summarized in parts on its way: no wait (it read the part, accepted with the
    # context still over, as a summary that cannot fit); the request still marks or renews that job.
    continuing = session.scalar(_PENDING_CONTINUATION, {"subject": transcript_id}) is not None
    waiting, misfit = (
        (None, None) if continuing else compaction_wait(session, transcript_id, settings, retrigger_seconds)
    )
    if waiting is not None:
        return TriggerCheck(
            tokens, settings.trigger_tokens, None, waiting + (f"; {misfit}" if misfit else "")
        )
    job = request_job(
        session,
        COMPACTION,
        transcript_id,
        options={"force": False, "trigger": "threshold"},
        renew_spent_budget_after=retrigger_seconds,  # a job paused for its own budget wakes for new content
    )
    return TriggerCheck(tokens, settings.trigger_tokens, job, misfit)


@dataclass(frozen=True)
class AppendResult:
    transcript_id: str
    first_seq: int
    last_seq: int
    trigger: TriggerCheck

    def pending_jobs(self) -> list[tuple[int, str]]:
        """Jobs to hand to the broker after the commit (a newly requested compaction only)."""
        job = self.trigger.job
        return [(job.job_id, COMPACTION)] if job is not None and job.created else []


# One statement however many messages (models.bulk): an executemany ran one INSERT a message, and the
# running totals' statement trigger (migration 0047) updated the transcript's row once each.
_INSERT_MESSAGES = BulkInsert(
    TRANSCRIPT_MESSAGES,
    ("transcript_id", "seq", "role", "text", "tool_calls", "tool_call_id", "tool_name", "tokens"),
)


def append_messages(
    session: Session,
    transcript_id: str,
    messages: Sequence[TranscriptMessage],
    *,
    settings: Mapping[str, Any] | None = None,
    retrigger_seconds: float = 0.0,
) -> AppendResult:
    """Store messages at the end of a transcript (created on first use), in the caller's transaction.

    Tool results must answer a call of the assistant turn right before them, counting what is
    already stored. Optional ``settings`` are applied first. When the context passes its threshold
    a compaction job is requested; send ``result.pending_jobs()`` after the commit.
    """
    check_transcript_id(transcript_id)
    if not messages:
        raise TranscriptError("messages is empty; send at least one message")
    changes = clean_settings(settings or {})
    current = lock_transcript(session, transcript_id, create=True)
    if changes:
        current = _change_settings(session, transcript_id, changes)
    next_seq, unit = _stored_tool_unit(session, transcript_id)
    linked = link_tool_results(messages, unit)
    rows = [
        {
            "transcript_id": transcript_id,
            "seq": next_seq + offset,
            "role": message.role,
            "text": message.text,
            "tool_calls": tool_calls_json(message.tool_calls),
            "tool_call_id": message.tool_call_id,
            "tool_name": message.tool_name,
            "tokens": estimate_tokens(message),
        }
        for offset, message in enumerate(linked)
    ]
    _INSERT_MESSAGES.execute(session, rows)  # (a trigger adds them to the running totals)
    trigger = check_trigger(session, transcript_id, current, retrigger_seconds)
    return AppendResult(transcript_id, next_seq, next_seq + len(rows) - 1, trigger)


def update_settings(
    session: Session, transcript_id: str, changes: Mapping[str, Any], *, retrigger_seconds: float = 0.0
) -> tuple[TranscriptSettings, TriggerCheck]:
    """Create or change a transcript's settings; a smaller window may pass the threshold (checked)."""
    check_transcript_id(transcript_id)
    cleaned = clean_settings(changes)
    current = lock_transcript(session, transcript_id, create=True)
    if cleaned:
        current = _change_settings(session, transcript_id, cleaned)
    return current, check_trigger(session, transcript_id, current, retrigger_seconds)


# Cut in the database as far as the gate reads them (a text QUESTION_CHAR_LIMIT long or longer is no
# question to it, so that many characters tell): read whole, a few pasted files of 25 MiB each were
# loaded for a few characters.
_LATEST_USER_TEXTS = (
    select(func.left(TRANSCRIPT_MESSAGES.c.text, QUESTION_CHAR_LIMIT))
    .where(TRANSCRIPT_MESSAGES.c.transcript_id == bindparam("id"), TRANSCRIPT_MESSAGES.c.role == "user")
    .order_by(TRANSCRIPT_MESSAGES.c.seq.desc())
    .limit(bindparam("n"))
)


def latest_user_texts(session: Session, transcript_id: str, count: int) -> list[str]:
    if count <= 0:
        return []
    texts = session.connection().execute(_LATEST_USER_TEXTS, {"id": transcript_id, "n": count}).scalars()
    return list(reversed(list(texts)))
