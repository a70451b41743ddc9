"""The transcripts store for the compaction service: each method opens and commits its own transaction.

Methods take no Session: a write runs in ``factory.begin()`` and is committed when the method returns,
a read runs in a plain session. Callers that must share a transaction with other rows (the API's
webhook deliveries) use the Session-level functions of ``worker.compaction.queries`` instead.
Every llm_calls row goes through the Ledger, so the live ``llm.prices`` override costs it.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from datetime import datetime
from typing import Any

from sqlalchemy.orm import Session, sessionmaker

from models.reads import one_snapshot
from worker.accounting import Ledger, LLMCallRecord
from worker.compaction import queries, records
from worker.compaction.queries import AppendResult, TriggerCheck
from worker.compaction.records import CompactionRecord, SavedCompaction
from worker.compaction.stored_plan import CompactionInput, StoredContext, plan_stored, stored_context
from worker.core.compaction import TranscriptMessage
from worker.core.timeline import NothingToCompactError
from worker.core.transcripts import TranscriptSettings
from worker.jobs.outbox import JobRequest


class TranscriptStore:
    """What the compaction service reads and writes: a transcript's timeline, its messages and settings,
    its compaction rows and their LLM calls. The API, CLI and MCP reads are in ``views``."""

    def __init__(self, factory: sessionmaker[Session], ledger: Ledger) -> None:
        self._factory = factory
        self._ledger = ledger

    # -- reads --------------------------------------------------------------

    def compaction_input(
        self,
        transcript_id: str,
        *,
        wanted: Callable[[StoredContext], bool],
        intent_messages: int,
        max_head_tokens: int | None,
    ) -> CompactionInput:
        """The transcript's context totals and, when ``wanted`` says so, its compaction plan and the
        latest user texts: in one snapshot, reading no more of the history than the plan needs."""
        with one_snapshot(self._factory) as session:
            context = stored_context(session, transcript_id)
            if not wanted(context):
                return CompactionInput(context)
            try:
                plan = plan_stored(
                    session,
                    context,
                    tool_result_limit=context.settings.tool_result_limit,
                    max_head_tokens=max_head_tokens,
                )
            except NothingToCompactError as exc:
                return CompactionInput(context, unplanned=str(exc))
            user_texts = queries.latest_user_texts(session, transcript_id, intent_messages)
            return CompactionInput(context, plan, user_texts=user_texts)

    # -- writes -------------------------------------------------------------

    def append(
        self,
        transcript_id: str,
        messages: Sequence[TranscriptMessage],
        *,
        settings: Mapping[str, Any] | None = None,
        retrigger_seconds: float = 0.0,
    ) -> AppendResult:
        """Append and check the trigger; send ``result.pending_jobs()`` (committed by now) to the broker."""
        with self._factory.begin() as session:
            return queries.append_messages(
                session, transcript_id, messages, settings=settings, retrigger_seconds=retrigger_seconds
            )

    def update_settings(
        self, transcript_id: str, changes: Mapping[str, Any], *, retrigger_seconds: float = 0.0
    ) -> tuple[TranscriptSettings, TriggerCheck]:
        with self._factory.begin() as session:
            return queries.update_settings(
                session, transcript_id, changes, retrigger_seconds=retrigger_seconds
            )

    def request_compaction(
        self, transcript_id: str, *, force: bool = False, trigger: str = "manual"
    ) -> JobRequest:
        with self._factory.begin() as session:
            return queries.request_compaction(session, transcript_id, force=force, trigger=trigger)

    def record_llm_call(self, call: LLMCallRecord) -> int:
        """One llm_calls row, costed by the Ledger (list prices plus the live override); its id."""
        with self._factory.begin() as session:
            return self._ledger.record(session, call)

    def save_compaction(
        self, record: CompactionRecord, read_from: datetime | None = None, continue_forced: bool | None = None
    ) -> SavedCompaction:
        """The compaction row; an accepted summary computed from a replaced timeline is stored as failed,
        and nothing when the transcript created at ``read_from`` was erased meanwhile. With
        ``continue_forced``, an accepted one requests the next part's compaction with it."""
        with self._factory.begin() as session:
            return records.save_compaction(session, record, read_from, continue_forced)
