"""Pages: the conversations (and other documents) Factmill extracts facts from."""

from __future__ import annotations

from datetime import datetime
from typing import Any

from sqlalchemy import BigInteger, CheckConstraint, DateTime, Index, UniqueConstraint, func, select, text
from sqlalchemy.dialects.postgresql import JSONB
from sqlalchemy.orm import Mapped, Session, mapped_column

from models.base import Base, utcnow_column


class Page(Base):
    __tablename__ = "pages"
    __table_args__ = (
        UniqueConstraint("source_id", "slug"),
        # '|' joins a source and a slug in the keys of jobs, checkpoints and erasures (migration 0037).
        CheckConstraint("strpos(source_id, '|') = 0", name="source_id"),
        # `factmill ingest`: the page a file was stored as, found before it is stored as another.
        Index("ix_pages_origin", "source_id", "origin", postgresql_where=text("origin IS NOT NULL")),
    )

    id: Mapped[int] = mapped_column(BigInteger, primary_key=True)
    source_id: Mapped[str]
    slug: Mapped[str]
    type: Mapped[str] = mapped_column(index=True)
    title: Mapped[str] = mapped_column(server_default="")
    compiled_truth: Mapped[str] = mapped_column(server_default="")
    timeline: Mapped[str] = mapped_column(server_default="")
    frontmatter: Mapped[dict[str, Any]] = mapped_column(JSONB, nullable=False, server_default="{}")
    # sha256 of type, title, compiled_truth, timeline and frontmatter: unchanged content creates no job.
    content_hash: Mapped[str]
    # The signed timestamp of the delivery that stored this content: an older delivery is refused.
    delivered_at: Mapped[datetime | None]
    # The file `factmill ingest` stored this page from (its real path; None for the API's pages): a
    # later ingest of another file that makes the same slug is refused while this one is still there.
    origin: Mapped[str | None]
    created_at: Mapped[datetime] = utcnow_column()
    updated_at: Mapped[datetime] = mapped_column(
        DateTime(timezone=True), server_default=func.now(), onupdate=func.now(), nullable=False
    )


def page_id_of(session: Session, source_id: str, slug: str) -> int | None:
    """The id of the page ``slug`` of ``source_id``, or None when there is none."""
    found = session.execute(select(Page.id).where(Page.source_id == source_id, Page.slug == slug))
    return found.scalar_one_or_none()
