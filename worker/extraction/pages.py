"""Storing pages: validation of incoming pages, content hashing, and the upsert."""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, field_validator
from sqlalchemy import func, select
from sqlalchemy.dialects.postgresql import insert
from sqlalchemy.orm import Session

from models import Page
from worker.core.conversation import MAX_PAGE_BODY_BYTES
from worker.core.slugs import normalize_slug
from worker.extraction.erase import (
    drop_derived,
    extracted_types,
    has_derived,
    is_extractable,
    page_body,
)
from worker.jobs.outbox import EXTRACTION, JobRequest, page_subject, request_job


class PageIn(BaseModel):
    """A page as the webhook, the ingest command and tests hand it over."""

    model_config = ConfigDict(extra="forbid", str_strip_whitespace=False)

    source_id: str = Field(default="default", min_length=1, max_length=200)
    slug: str = Field(min_length=1, max_length=500)
    type: str = Field(min_length=1, max_length=100)
    title: str = Field(default="", max_length=1000)
    compiled_truth: str = ""
    timeline: str = ""
    frontmatter: dict[str, Any] = Field(default_factory=dict)

    @field_validator("source_id")
    @classmethod
    def _source_id(cls, value: str) -> str:
        if "|" in value or value != value.strip():
            raise ValueError("source_id must not contain '|' or surrounding whitespace")
        return value

    @field_validator("slug")
    @classmethod
    def _slug(cls, value: str) -> str:
        return normalize_slug(value)

    @field_validator("type")
    @classmethod
    def _type(cls, value: str) -> str:
        return value.strip().lower()

    @field_validator("title", "compiled_truth", "timeline")
    @classmethod
    def _no_nul(cls, value: str) -> str:
        if "\x00" in value:
            raise ValueError("text must not contain NUL characters (is this a binary file?)")
        return value

    def body_bytes(self) -> int:
        return len(self.compiled_truth.encode("utf-8")) + len(self.timeline.encode("utf-8"))


def content_hash(page: PageIn) -> str:
    digest = hashlib.sha256()
    for part in (page.type, page.title, page.compiled_truth, page.timeline):
        digest.update(part.encode("utf-8"))
        digest.update(b"\x1f")
    digest.update(json.dumps(page.frontmatter, sort_keys=True, ensure_ascii=False).encode("utf-8"))
    return digest.hexdigest()


@dataclass(frozen=True)
class UpsertResult:
    page_id: int
    changed: bool  # False when the stored content already had this hash


def upsert_page(session: Session, page: PageIn) -> UpsertResult:
    """Insert or update a page; an unchanged page (same content hash) is left alone."""
    digest = content_hash(page)
    existing = session.execute(
        select(Page.id, Page.content_hash).where(Page.source_id == page.source_id, Page.slug == page.slug)
    ).one_or_none()
    if existing is not None and existing.content_hash == digest:
        return UpsertResult(existing.id, changed=False)
    values = page.model_dump() | {"content_hash": digest}
    stmt = insert(Page).values(**values)
    page_id = session.execute(
        stmt.on_conflict_do_update(
            index_elements=[Page.source_id, Page.slug],
            set_={
                k: stmt.excluded[k]
                for k in ("type", "title", "compiled_truth", "timeline", "frontmatter", "content_hash")
            }
            | {"updated_at": func.now()},
        ).returning(Page.id)
    ).scalar_one()
    return UpsertResult(page_id, changed=True)


def store_page(session: Session, page: PageIn) -> JobRequest | None:
    """The outbox step shared by the webhook and `factmill ingest`: upsert the page and, when its content
    changed, request its extraction job in the same transaction. None when nothing changed.

    A page that now has nothing to extract (no segment, or a type extraction does not read) loses its
    facts, their embeddings and its checkpoints in this same transaction: what it said before is no
    longer what it says, so nothing drawn from it may stay searchable. The job is still requested (it
    finds nothing and says so), so the answer lists the page like any other change.
    """
    if not upsert_page(session, page).changed:
        return None
    if has_derived(session, page.source_id, page.slug) and not is_extractable(
        page.type, page_body(page.compiled_truth, page.timeline), extracted_types(session)
    ):
        drop_derived(session, page.source_id, page.slug)
    return request_job(session, EXTRACTION, page_subject(page.source_id, page.slug))


__all__ = ["MAX_PAGE_BODY_BYTES", "PageIn", "UpsertResult", "content_hash", "store_page", "upsert_page"]
