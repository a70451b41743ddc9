"""Storing pages: validation of incoming pages, content hashing, and the upsert."""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator
from sqlalchemy import bindparam, func, or_, select, update
from sqlalchemy.dialects.postgresql import insert
from sqlalchemy.orm import Session

from models import Erasure
from models.tables import PAGES
from worker.core.conversation import MAX_PAGE_BODY_BYTES
from worker.core.jsonvalues import nesting_depth, not_json, text_problem
from worker.core.labels import (
    MAX_SOURCE_ID_LENGTH,
    NEW_SOURCE_ID_PATTERN,
    NOT_ONLY_SPACES_PATTERN,
    check_new_source_id,
)
from worker.core.moments import within_a_second
from worker.core.slugs import SLUG_PATTERN, SLUG_RULE, normalize_slug
from worker.extraction.erase import (
    drop_derived,
    erased_slug_digest,
    extracted_types,
    has_derived,
    is_extractable,
    page_body,
)
from worker.jobs.outbox import EXTRACTION, JobRequest, page_subject, request_job

# A page's source id and slug sit together in several B-tree indexes (pages, facts, jobs' subjects,
# checkpoints' page keys), whose entries Postgres caps at 2,704 bytes: 200 + 500 characters of 4-byte
# letters passed that, and the upsert failed (a 500). The margin covers what each index adds beside them.
MAX_PAGE_KEY_BYTES = 2_400


MAX_SLUG_LENGTH = 500  # characters, once normalized
# A slug as sent, before it is normalized (NFC): a decomposed (NFD) spelling of one at the cap is longer
# (a Hangul syllable is three code points, some Greek letters four), and macOS names files in NFD.
MAX_SLUG_INPUT_LENGTH = 4 * MAX_SLUG_LENGTH

# Front matter is a few key: value lines; mappings and lists nested deeper than this (the front matter's
# own mapping is the first level) are refused, whichever way the page came in (webhook, page file).
MAX_FRONT_MATTER_DEPTH = 32


def page_key_bytes(source_id: str, slug: str) -> int:
    return len(source_id.encode("utf-8")) + len(slug.encode("utf-8"))


class PageIn(BaseModel):
    """A page as the webhook, the ingest command and tests hand it over."""

    model_config = ConfigDict(extra="forbid", str_strip_whitespace=False)

    source_id: str = Field(
        default="default",
        min_length=1,
        max_length=MAX_SOURCE_ID_LENGTH,
        json_schema_extra={"pattern": NEW_SOURCE_ID_PATTERN},
    )
    slug: str = Field(
        min_length=1,
        max_length=MAX_SLUG_INPUT_LENGTH,  # the normalized slug's cap is checked in _slug
        description=SLUG_RULE,
        json_schema_extra={"pattern": SLUG_PATTERN},
    )
    type: str = Field(min_length=1, max_length=100, json_schema_extra={"pattern": NOT_ONLY_SPACES_PATTERN})
    title: str = Field(default="", max_length=1000)
    compiled_truth: str = ""
    timeline: str = ""
    frontmatter: dict[str, Any] = Field(default_factory=dict)

    @field_validator("source_id")
    @classmethod
    def _source_id(cls, value: str) -> str:
        return check_new_source_id(value)

    @field_validator("slug")
    @classmethod
    def _slug(cls, value: str) -> str:
        slug = normalize_slug(value)
        # max_length is checked on the slug as sent; NFC can lengthen it ("\u0958" becomes two code
        # points) or shorten it (NFD Hangul), and a stored slug past 500 made a next_after cursor longer
        # than the listing accepts: the pages after it could not be paged to.
        if len(slug) > MAX_SLUG_LENGTH:
            raise ValueError(
                f"must be at most {MAX_SLUG_LENGTH} characters once normalized (NFC), got {len(slug)}"
            )
        return slug

    @field_validator("type")
    @classmethod
    def _type(cls, value: str) -> str:
        page_type = value.strip().lower()
        if not page_type:  # min_length counted the spaces: "   " was stored as a page of type ""
            raise ValueError("must name a page type (such as conversation), not only whitespace")
        return page_type

    @field_validator("frontmatter")
    @classmethod
    def _json_frontmatter(cls, value: dict[str, Any]) -> dict[str, Any]:
        # The API's loader refuses these while parsing; a page file's YAML can hold them too (.inf).
        problem = not_json(value)
        if problem:
            raise ValueError(f"{problem} (front matter is stored as JSON)")
        # One rule for every way in: the webhook took what the request's own depth cap let through (up
        # to 63 levels), while `factmill ingest` refused a page file's from 33.
        if nesting_depth(value) > MAX_FRONT_MATTER_DEPTH:
            raise ValueError(f"front matter nests deeper than {MAX_FRONT_MATTER_DEPTH} levels")
        return value

    @field_validator("type", "title", "compiled_truth", "timeline", mode="before")
    @classmethod
    def _storable(cls, value: object) -> object:
        # The API's loader refuses these while parsing; a page file's YAML escapes can make them.
        if isinstance(value, str) and "\x00" in value:
            raise ValueError("text must not contain NUL characters (is this a binary file?)")
        if isinstance(value, str) and (problem := text_problem(value)):
            raise ValueError(problem)
        return value

    @model_validator(mode="after")
    def _key_fits_an_index(self) -> PageIn:
        size = page_key_bytes(self.source_id, self.slug)
        if size > MAX_PAGE_KEY_BYTES:
            raise ValueError(
                f"source_id and slug together are {size} bytes of UTF-8, over {MAX_PAGE_KEY_BYTES}: "
                "Postgres indexes them together (pages, facts, jobs, checkpoints); shorten either"
            )
        return self

    @model_validator(mode="after")
    def _body_within_the_cap(self) -> PageIn:
        # Stored, it was never extracted (the job skips a body over the cap) while the sender was told
        # it was: a raised FACTMILL_MAX_BODY_BYTES let such a page through the webhook.
        size = self.body_bytes()
        if size > MAX_PAGE_BODY_BYTES:
            raise ValueError(
                f"the page's body (compiled_truth and timeline) is {size} bytes of UTF-8, over the "
                f"{MAX_PAGE_BODY_BYTES}-byte cap extraction takes; split it into pages"
            )
        return self

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


class StaleDeliveryError(ValueError):
    """A delivery older than the one that stored the page: it must not roll the page back."""

    def __init__(
        self,
        source_id: str,
        slug: str,
        delivered_at: datetime,
        stored_at: datetime | None,
        *,
        erased: bool = False,
    ) -> None:
        super().__init__(source_id, slug, delivered_at, stored_at, erased)
        self.source_id, self.slug, self.stored_at, self.erased = source_id, slug, stored_at, erased
        self.delivered_at = delivered_at
        # Erased, or stored by another delivery, in the second it was signed in: a signature is dated to
        # the second, so which came first is not known (moments.SAME_SECOND_HINT and
        # STORED_IN_ITS_SECOND_HINT, for a signed delivery: sign it again a second later). Taken as newer,
        # a signed delivery's retry, or one that waited on the row, replaced content stored after it.
        self.in_its_second = stored_at is not None and within_a_second(delivered_at, stored_at)

    def described(self, *, signed: bool = False) -> str:
        """What to tell the sender. A ``signed`` delivery dated to the second of the stored one's is not
        known to be older (a keyed one is dated to the microsecond: it is)."""
        stored = self.stored_at.isoformat() if self.stored_at is not None else "a later time"
        newer = f"the page's erasure ({stored})" if self.erased else f"the stored one ({stored})"
        unknown = signed and self.in_its_second and not self.erased
        than = "not known to be newer than" if unknown else "older than"
        return (
            f"page {self.slug!r} in source {self.source_id!r}: this delivery (signed at "
            f"{self.delivered_at.isoformat()}) is {than} {newer}; send the newest content with a fresh "
            "signature"
        )

    def __str__(self) -> str:
        return self.described()


# Built once (Core, on the table): a webhook runs them for every page, and building an ORM statement
# per call was most of the API's SQLAlchemy time (py-spy of `factmill serve` under bench/load.py).
_STORED = select(PAGES.c.id, PAGES.c.content_hash, PAGES.c.delivered_at).where(
    PAGES.c.source_id == bindparam("source_id"), PAGES.c.slug == bindparam("slug")
)
_INSERT = insert(PAGES)
_UPSERT = _INSERT.on_conflict_do_update(
    index_elements=[PAGES.c.source_id, PAGES.c.slug],
    set_={
        **{
            name: _INSERT.excluded[name]
            for name in ("type", "title", "compiled_truth", "timeline", "frontmatter", "content_hash")
        },
        "updated_at": func.now(),
        "delivered_at": func.coalesce(_INSERT.excluded.delivered_at, PAGES.c.delivered_at),
    },
    where=or_(
        _INSERT.excluded.delivered_at.is_(None),
        PAGES.c.delivered_at.is_(None),
        PAGES.c.delivered_at <= _INSERT.excluded.delivered_at,
    ),
).returning(PAGES.c.id)


# An erasure is the newest thing said of a page: a delivery signed before it (late on the network, or a
# sender's retry of one that never arrived) stored the erased content again, its page row (and the time
# it held) gone with the erasure.
_ERASED_SINCE = select(func.max(Erasure.erased_at)).where(
    Erasure.slug_sha256 == bindparam("digest"), Erasure.erased_at > bindparam("at")
)

# Only while the page still holds the content this delivery found: an older delivery with other content
# could commit in between (the row is read unlocked), and the newer time stamped on it kept it.
_DELIVERED = (
    update(PAGES)
    .where(
        PAGES.c.id == bindparam("page_id"),
        PAGES.c.content_hash == bindparam("digest"),
        or_(PAGES.c.delivered_at.is_(None), PAGES.c.delivered_at < bindparam("at")),
    )
    .values(delivered_at=bindparam("at"))
    .returning(PAGES.c.id)
)


# An unchanged page is held (FOR SHARE) until the delivery commits: read unlocked, an erasure committing
# meanwhile could not see the answer the delivery was about to keep (it is written after), and that
# answer, naming the erased page, was replayed to its sender for the key's lifetime. Only the unchanged
# page is held so: two deliveries changing a page, each holding it shared, deadlocked on their writes.
_HELD_UNCHANGED = (
    select(PAGES.c.id)
    .where(PAGES.c.id == bindparam("page_id"), PAGES.c.content_hash == bindparam("digest"))
    .with_for_update(read=True)
)


def upsert_page(session: Session, page: PageIn, delivered_at: datetime | None = None) -> UpsertResult:
    """Insert or update a page; an unchanged page (same content hash) is left alone.

    ``delivered_at`` (the delivery's time) must not be older than the stored one, else
    StaleDeliveryError; the check is part of the upsert statement, so it holds under concurrency. Nor
    older than the page's latest erasure (the caller's transaction then rolls the write back).
    """
    digest = content_hash(page)
    connection = session.connection()
    where = {"source_id": page.source_id, "slug": page.slug}
    existing = connection.execute(_STORED, where).one_or_none()
    if existing is not None and existing.content_hash == digest:
        held = {"page_id": existing.id, "digest": digest}
        if delivered_at is None or (
            existing.delivered_at is not None and existing.delivered_at >= delivered_at
        ):
            if connection.execute(_HELD_UNCHANGED, held).first() is not None:
                return UpsertResult(existing.id, changed=False)
        else:
            # The newest delivery says this content: an older one still in flight must not replace it.
            if connection.execute(_DELIVERED, held | {"at": delivered_at}).first() is not None:
                return UpsertResult(existing.id, changed=False)
            if connection.execute(_HELD_UNCHANGED, held).first() is not None:
                return UpsertResult(existing.id, changed=False)  # a newer delivery dated it meanwhile
        # Another delivery changed the page (or an erasure took it) since it was read: stored as a change.
    values = page.model_dump() | {"content_hash": digest, "delivered_at": delivered_at}
    page_id = connection.execute(_UPSERT, values).scalar_one_or_none()
    if page_id is not None and delivered_at is not None:
        # Asked after the write: an erasure committed while this delivery waited on the row it deleted is
        # seen now (a check before it missed that one, and the insert restored the erased page).
        digest_of_slug = erased_slug_digest(page.source_id, page.slug)
        erased_at = connection.execute(_ERASED_SINCE, {"digest": digest_of_slug, "at": delivered_at}).scalar()
        if erased_at is not None:
            raise StaleDeliveryError(page.source_id, page.slug, delivered_at, erased_at, erased=True)
    if page_id is None:
        assert delivered_at is not None  # only a dated delivery can fail the WHERE
        stored = connection.execute(_STORED, where).one_or_none()
        if stored is not None and stored.content_hash == digest:
            # A later-dated delivery stored this same content meanwhile (both read no page): nothing is
            # older here, and "a later delivery stored this page; not replaced" (409) was said of it.
            held = {"page_id": stored.id, "digest": digest}
            if connection.execute(_HELD_UNCHANGED, held).first() is not None:
                return UpsertResult(stored.id, changed=False)
        raise StaleDeliveryError(
            page.source_id, page.slug, delivered_at, stored.delivered_at if stored is not None else None
        )
    return UpsertResult(page_id, changed=True)


def store_page(session: Session, page: PageIn, delivered_at: datetime | None = None) -> JobRequest | None:
    """The outbox step shared by the webhook and `factmill ingest`: upsert the page and, when its content
    changed, request its extraction job in the same transaction. None when nothing changed.

    A page that now has nothing to extract (no segment, or a type extraction does not read) loses its
    facts, their embeddings and its checkpoints in this same transaction: what it said before is no
    longer what it says, so nothing drawn from it may stay searchable. The job is still requested (it
    finds nothing and says so), so the answer lists the page like any other change.
    """
    if not upsert_page(session, page, delivered_at).changed:
        return None
    return page_changed(session, page)


def page_changed(session: Session, page: PageIn) -> JobRequest:
    """``store_page``'s step after the upsert, for a page whose content changed: what it no longer says
    dropped, its extraction job requested. A delivery of several pages upserts them all (in order)
    before it takes this step for any: this step locks entity checkpoints, which an erasure takes after
    its page, and a page upserted after another page's step deadlocked with an erasure of it."""
    if has_derived(session, page.source_id, page.slug) and not is_extractable(
        page.type, page_body(page.compiled_truth, page.timeline), extracted_types(session)
    ):
        drop_derived(session, page.source_id, page.slug)
    return request_job(session, EXTRACTION, page_subject(page.source_id, page.slug))


__all__ = [
    "MAX_PAGE_BODY_BYTES",
    "PageIn",
    "StaleDeliveryError",
    "UpsertResult",
    "content_hash",
    "page_changed",
    "store_page",
    "upsert_page",
]
