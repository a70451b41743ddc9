"""Resume points of long-running operations, one row per (operation, fingerprint, page)."""

from __future__ import annotations

from datetime import datetime
from typing import Any

from sqlalchemy import DateTime, Index, Text, func, text
from sqlalchemy.dialects.postgresql import JSONB
from sqlalchemy.orm import Mapped, mapped_column

from models.base import Base


class OpCheckpoint(Base):
    """Where an operation stands on one page.

    ``completed_key`` holds the seed's entry ``sourceId|slug|endIso`` (see
    ``worker.extraction.encode_checkpoint_entry``). The original kept every entry of a
    fingerprint in one jsonb list; that row became a hot spot rewritten in full by every
    segment commit of every page of the source, so here each page has its own row.
    ``messages_done`` and ``prefix_hash`` let a run tell "new messages appended" (resume)
    from "messages already extracted were edited" (re-extract the page).
    """

    __tablename__ = "op_checkpoints"
    # Erasure and store_page find a page's checkpoints by page alone, across operations and fingerprints.
    # /metrics sums the skipped segments of the few pages that have any (migration 0016).
    __table_args__ = (
        Index("ix_op_checkpoints_page_key", "page_key"),
        Index("ix_op_checkpoints_skipped", "page_key", postgresql_where=text("skipped <> '[]'::jsonb")),
    )

    op: Mapped[str] = mapped_column(Text, primary_key=True)
    fingerprint: Mapped[str] = mapped_column(Text, primary_key=True)
    page_key: Mapped[str] = mapped_column(Text, primary_key=True)
    completed_key: Mapped[str]
    messages_done: Mapped[int]
    prefix_hash: Mapped[str]
    next_row_num: Mapped[int]
    # Segments the checkpoint moved past without their facts (poison segments), as
    # worker.core.checkpoint.SkippedSegment dicts in page order; `jobs retry --skipped` re-extracts them.
    skipped: Mapped[list[dict[str, Any]]] = mapped_column(JSONB, nullable=False, server_default="[]")
    updated_at: Mapped[datetime] = mapped_column(
        DateTime(timezone=True), server_default=func.now(), onupdate=func.now(), nullable=False
    )
