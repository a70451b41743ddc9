"""Webhook deliveries by Idempotency-Key, so a repeated delivery replays the original answer."""

from __future__ import annotations

import json
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import Index, Text, text
from sqlalchemy.dialects.postgresql import JSONB
from sqlalchemy.orm import Mapped, Session, mapped_column

from models.base import Base, utcnow_column


class WebhookDelivery(Base):
    __tablename__ = "webhook_deliveries"
    __table_args__ = (
        # The oldest answers first, for forget_deliveries.
        Index("ix_webhook_deliveries_created_at", "created_at"),
        # The answers naming a page, for forget_page_in_deliveries.
        Index(
            "ix_webhook_deliveries_response",
            "response",
            postgresql_using="gin",
            postgresql_ops={"response": "jsonb_path_ops"},
        ),
    )

    # sha256 (hex) of route, subject and the sender's key (worker.api.deliveries.scoped_key), never the
    # key itself: it may name a person.
    idempotency_key: Mapped[str] = mapped_column(Text, primary_key=True)
    # sha256 of the body: the same key with a different body is a client bug, answered with 422.
    body_hash: Mapped[str]
    response: Mapped[dict[str, Any]] = mapped_column(JSONB, nullable=False)
    created_at: Mapped[datetime] = utcnow_column()


# Oldest first, so a backlog shrinks from its old end; SKIP LOCKED, so two sweeps never wait on each other.
# By ctid (a TID scan of the rows found and locked): by key, the planner scanned the whole table to
# match them (0.24 s a batch at a million rows, bench/forget_deliveries.py).
_FORGET = text(
    "DELETE FROM webhook_deliveries WHERE ctid = ANY(ARRAY("
    " SELECT ctid FROM webhook_deliveries WHERE created_at < now() - :kept"
    " ORDER BY created_at LIMIT :limit FOR UPDATE SKIP LOCKED))"
)


# The lists of a kept answer that name pages, each entry {"source_id", "slug", ...}: the answer of the
# page webhook (worker.api.routes.pages; tests/integration/test_erasure.py holds the two to each other).
PAGE_LISTS = ("jobs", "unchanged")
# An erased page's entries keep their place and their other fields; the slug becomes what stands for
# it after the erasure. Found by containment, which the GIN index answers (bench/forget_deliveries.py).
_FORGET_PAGE = text(
    """
    UPDATE webhook_deliveries SET response = (
        SELECT jsonb_object_agg(k, CASE WHEN k = ANY(CAST(:lists AS text[])) AND jsonb_typeof(v) = 'array'
        THEN (
            SELECT coalesce(jsonb_agg(CASE WHEN e @> CAST(:page AS jsonb)
                THEN e || jsonb_build_object('slug', CAST(:name AS text)) ELSE e END ORDER BY n), '[]'::jsonb)
            FROM jsonb_array_elements(v) WITH ORDINALITY AS x(e, n)) ELSE v END)
        FROM jsonb_each(response) AS t(k, v))
    WHERE response @> ANY(CAST(:listed AS jsonb[]))
    """
)


def forget_page_in_deliveries(session: Session, source_id: str, slug: str, name: str) -> int:
    """Replace the page's slug by ``name`` in every stored answer that lists it, in the caller's
    transaction; returns how many answers changed. A repeated delivery still gets its answer (and so
    does not bring the erased page back), naming the page as the erasure left it."""
    page = {"source_id": source_id, "slug": slug}
    listed = [json.dumps({key: [page]}) for key in PAGE_LISTS]
    return session.execute(  # type: ignore[attr-defined]
        _FORGET_PAGE, {"page": json.dumps(page), "name": name, "listed": listed, "lists": list(PAGE_LISTS)}
    ).rowcount


# The answers of a transcript append and of a settings change name their transcript at the top
# ({"transcript_id": ..., ...}); a settings answer also echoes the summarizer's instructions, a user's
# own words (``settings.instructions``; no change where the answer has none).
_FORGET_TRANSCRIPT = text(
    "UPDATE webhook_deliveries SET response = jsonb_set("
    " jsonb_set(response, '{transcript_id}', to_jsonb(CAST(:name AS text))),"
    " '{settings,instructions}', 'null'::jsonb, false) "
    "WHERE response @> jsonb_build_object('transcript_id', CAST(:transcript_id AS text))"
)


def forget_transcript_in_deliveries(session: Session, transcript_id: str, name: str) -> int:
    """Replace the transcript's id by ``name`` (and its instructions by null) in every stored answer
    that names it, in the caller's transaction; returns how many changed. A repeated append or settings
    change is still answered (and so brings nothing back), naming the transcript as the erasure left
    it."""
    return session.execute(  # type: ignore[attr-defined]
        _FORGET_TRANSCRIPT, {"transcript_id": transcript_id, "name": name}
    ).rowcount


def forget_deliveries(session: Session, kept: timedelta, limit: int) -> int:
    """Delete up to ``limit`` stored answers older than ``kept``, oldest first, in the caller's
    transaction; returns how many went. A key delivered again after that is a new delivery."""
    return session.execute(_FORGET, {"kept": kept, "limit": limit}).rowcount  # type: ignore[attr-defined]
