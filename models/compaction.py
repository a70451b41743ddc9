"""Agent transcripts, their messages (never deleted), and the compactions that summarize their heads."""

from __future__ import annotations

from datetime import datetime
from typing import Any

from sqlalchemy import (
    BigInteger,
    CheckConstraint,
    DateTime,
    ForeignKey,
    Index,
    Text,
    UniqueConstraint,
    func,
    text,
)
from sqlalchemy.dialects.postgresql import JSONB
from sqlalchemy.orm import Mapped, mapped_column

from models.base import Base, count_column, utcnow_column

MESSAGE_ROLES = ("user", "assistant", "tool")
COMPACTION_STATUSES = ("accepted", "rejected", "failed")
MAX_TRANSCRIPT_ID_LENGTH = 200


def _in(column: str, values: tuple[str, ...]) -> str:
    return f"{column} IN ({', '.join(repr(v) for v in values)})"


class Transcript(Base):
    """One agent conversation, by the client's own id, with the settings its compactions use."""

    __tablename__ = "transcripts"
    __table_args__ = (
        CheckConstraint(f"length(id) BETWEEN 1 AND {MAX_TRANSCRIPT_ID_LENGTH}", name="id_length"),
        CheckConstraint("context_window IS NULL OR context_window > 0", name="context_window"),
        CheckConstraint("reserve_tokens >= 0", name="reserve_tokens"),
        CheckConstraint("keep_recent_tokens >= 0", name="keep_recent_tokens"),
        CheckConstraint("tool_result_limit >= 0", name="tool_result_limit"),
    )

    id: Mapped[str] = mapped_column(Text, primary_key=True)
    # None: the window is unknown, and nothing is ever compacted automatically (should_compact).
    context_window: Mapped[int | None]
    reserve_tokens: Mapped[int] = mapped_column(server_default="16384")
    keep_recent_tokens: Mapped[int] = mapped_column(server_default="20000")
    tool_result_limit: Mapped[int] = mapped_column(server_default="2000")
    # Steers the summarizer; quoted below its headings as data (summarizer_system_prompt).
    instructions: Mapped[str | None]
    created_at: Mapped[datetime] = utcnow_column()
    updated_at: Mapped[datetime] = mapped_column(
        DateTime(timezone=True), server_default=func.now(), onupdate=func.now(), nullable=False
    )


class TranscriptMessageRow(Base):
    """One message as the client appended it; `seq` counts from 0 per transcript.

    (Named ...Row so it does not clash with worker.core.compaction.TranscriptMessage, the value
    the pure core works on.)
    """

    __tablename__ = "transcript_messages"
    __table_args__ = (
        UniqueConstraint("transcript_id", "seq"),
        CheckConstraint(_in("role", MESSAGE_ROLES), name="role"),
        CheckConstraint("seq >= 0", name="seq"),
        CheckConstraint("tokens >= 0", name="tokens"),
    )

    id: Mapped[int] = mapped_column(BigInteger, primary_key=True)
    transcript_id: Mapped[str] = mapped_column(
        ForeignKey("transcripts.id", ondelete="CASCADE"), nullable=False
    )
    seq: Mapped[int]
    role: Mapped[str]
    text: Mapped[str] = mapped_column(server_default="")
    # [{"id", "name", "arguments" (JSON text)}], assistant messages only.
    tool_calls: Mapped[list[dict[str, Any]]] = mapped_column(JSONB, nullable=False, server_default="[]")
    tool_call_id: Mapped[str | None]
    tool_name: Mapped[str | None]
    # estimate_tokens at append time, so a context's size is one SUM, not a re-read of its text.
    tokens: Mapped[int]
    created_at: Mapped[datetime] = utcnow_column()


class Compaction(Base):
    """One compaction run: a summary of a transcript's head, and whether the quality gate let it stand.

    ``accepted``: the summary stands in for every message before ``cut_seq`` in the context view.
    ``rejected``: its coverage stayed below the threshold after one retry; stored, never applied.
    ``failed``: no usable summary (an LLM error, an empty reply, a refusal); nothing changed.
    """

    __tablename__ = "compactions"
    __table_args__ = (
        CheckConstraint(_in("status", COMPACTION_STATUSES), name="status"),
        CheckConstraint("coverage IS NULL OR (coverage >= 0 AND coverage <= 1)", name="coverage"),
        CheckConstraint(
            "status <> 'accepted' OR (summary IS NOT NULL AND tokens_after IS NOT NULL)",
            name="accepted_has_summary",
        ),
        Index("ix_compactions_transcript_id_id", "transcript_id", "id"),
        # The rows ON DELETE SET NULL looks for when a transcript's compactions are erased.
        Index("ix_compactions_previous_id", "previous_id", postgresql_where=text("previous_id IS NOT NULL")),
    )

    id: Mapped[int] = mapped_column(BigInteger, primary_key=True)
    transcript_id: Mapped[str] = mapped_column(
        ForeignKey("transcripts.id", ondelete="CASCADE"), nullable=False
    )
    status: Mapped[str]
    # The first message kept verbatim: everything before it (and the previous summary) was summarized.
    cut_seq: Mapped[int]
    # The accepted compaction whose summary this one folded in (None: the head began at message 0).
    previous_id: Mapped[int | None] = mapped_column(
        BigInteger, ForeignKey("compactions.id", ondelete="SET NULL")
    )
    summary: Mapped[str | None]
    # Estimated tokens of the context view before, and (accepted or rejected) with the summary in place.
    tokens_before: Mapped[int]
    tokens_after: Mapped[int | None]
    # The last attempt's quality signals and the threshold it was gated on (version None: fallback τ).
    coverage: Mapped[float | None]
    density: Mapped[float | None]
    threshold_tau: Mapped[float | None]
    threshold_version: Mapped[int | None]
    attempts: Mapped[int] = count_column()
    # Query terms of the transcript's intent the last attempt dropped.
    missed_terms: Mapped[list[str]] = mapped_column(JSONB, nullable=False, server_default="[]")
    # Every attempt: coverage, density, threshold, missed terms, llm_calls id, outcome.
    attempt_log: Mapped[list[dict[str, Any]]] = mapped_column(JSONB, nullable=False, server_default="[]")
    error: Mapped[str | None]
    job_id: Mapped[int | None] = mapped_column(
        BigInteger, ForeignKey("jobs.id", ondelete="SET NULL"), index=True
    )
    created_at: Mapped[datetime] = utcnow_column()
