"""Erasures: the one content-free row an erased page or transcript leaves behind."""

from __future__ import annotations

from datetime import datetime

from sqlalchemy import BigInteger, Index
from sqlalchemy.orm import Mapped, mapped_column

from models.base import Base, count_column, utcnow_column


class Erasure(Base):
    """That a page was erased, when, by which path, and how much went with it; never its text.

    The slug itself can name a person ("therapy/alice"), so only ``slug_sha256`` is kept: sha256 of
    ``source_id|slug`` (see ``worker.extraction.erase.erased_slug_digest``), enough to answer "was this
    page erased?" for a slug one already knows, not to list what was erased.
    """

    __tablename__ = "erasures"
    __table_args__ = (Index("ix_erasures_slug_sha256", "slug_sha256"),)

    id: Mapped[int] = mapped_column(BigInteger, primary_key=True)
    source_id: Mapped[str]
    slug_sha256: Mapped[str]
    requested_by: Mapped[str]  # "cli", or the API key that asked ("api key 7 (ops)", "api admin token")
    facts_removed: Mapped[int] = count_column()
    embeddings_removed: Mapped[int] = count_column()
    checkpoints_removed: Mapped[int] = count_column()
    audit_rows_removed: Mapped[int] = count_column()
    jobs_cancelled: Mapped[int] = count_column()
    erased_at: Mapped[datetime] = utcnow_column()


class TranscriptErasure(Base):
    """That a transcript was erased, when, by which path, and how much went with it; never its text.

    A transcript id is the client's own label and can name a person ("support-chat-alice"), so only
    ``transcript_sha256`` (sha256 of the id, ``worker.compaction.erase.erased_transcript_digest``) is
    kept: enough to answer "was this transcript erased?" for an id one knows, not to list them.
    """

    __tablename__ = "transcript_erasures"
    __table_args__ = (Index("ix_transcript_erasures_transcript_sha256", "transcript_sha256"),)

    id: Mapped[int] = mapped_column(BigInteger, primary_key=True)
    transcript_sha256: Mapped[str]
    requested_by: Mapped[str]  # "cli", or the API key that asked ("api key 7 (ops)", "api admin token")
    messages_removed: Mapped[int] = count_column()
    compactions_removed: Mapped[int] = count_column()
    jobs_cancelled: Mapped[int] = count_column()
    erased_at: Mapped[datetime] = utcnow_column()
