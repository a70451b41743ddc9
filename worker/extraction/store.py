"""Extraction's reads and writes; each method owns its transaction (per segment: facts, audit, checkpoint).

Writes go through ``factory.begin()`` opened here; llm_calls rows go through the accounting Ledger.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Literal

from sqlalchemy import Table, delete, func, insert, select, update
from sqlalchemy.dialects.postgresql import insert as pg_insert
from sqlalchemy.orm import Session, sessionmaker

from models import ExtractionAudit, Fact, OpCheckpoint, Page
from worker.accounting import Ledger, LLMCallRecord
from worker.core.checkpoint import CheckpointState, PrefixHasher, encode_checkpoint_entry, page_key
from worker.core.conversation import Segment, parse_conversation_messages
from worker.core.facts import ExtractedFact
from worker.extraction.erase import page_body
from worker.extraction.options import (
    OP_NAME,
    PER_SEGMENT_SOURCE_PREFIX,
    TERMINAL_AUDIT_SOURCE,
    CheckpointConflictError,
    PageChangedError,
    iso_to_datetime,
)
from worker.extraction.prompts import LLM_PURPOSE
from worker.extraction.segments import Attempt

_FACTS: Table = Fact.__table__  # type: ignore[assignment]
_AUDIT: Table = ExtractionAudit.__table__  # type: ignore[assignment]
_CHECKPOINTS: Table = OpCheckpoint.__table__  # type: ignore[assignment]
# One statement object, so SQLAlchemy compiles it once; rows go in executemany form (one round trip).
_INSERT_FACTS = (
    pg_insert(_FACTS)
    .on_conflict_do_nothing(
        index_elements=[_FACTS.c.source_id, _FACTS.c.source_markdown_slug, _FACTS.c.row_num]
    )
    .returning(_FACTS.c.row_num)
)
_INSERT_AUDIT = insert(_AUDIT)
_SWAP_CHUNK = 1000
# The terminal audit row: a page's marker of a complete extraction, on a row number no fact can take.
TERMINAL_AUDIT_FACT = "EXTRACTION_COMPLETE"
TERMINAL_ROW_NUM = -1

# What a segment commit does to the page's terminal audit row: set it (the page's last segment), clear it
# (the first segment of appended messages: the page is incomplete again), or leave it.
Terminal = Literal["set", "clear", "keep"]


@dataclass(frozen=True)
class PageRef:
    """A page to consider, as listed: its id, slug and body size in bytes."""

    page_id: int
    slug: str
    size: int


@dataclass(frozen=True)
class StoredPage:
    body: str
    label: str
    checkpoint: CheckpointState | None
    content_hash: str


@dataclass(frozen=True)
class PageVersion:
    """The page as a run planned it: a commit stores facts only while the page still says what they
    were drawn from (erased, emptied or edited since: PageChangedError, nothing stored)."""

    page_id: int
    content_hash: str
    types: tuple[str, ...]  # the page types the run extracts


@dataclass(frozen=True)
class SegmentPlace:
    """Where a segment's attempts belong: the job, the page and the segment."""

    job_id: int | None
    source_id: str
    slug: str
    index: int
    segment: Segment


class ExtractionStore:
    """Owns its transactions: every method opens its own session (``factory.begin()`` for writes)."""

    def __init__(self, factory: sessionmaker[Session], ledger: Ledger) -> None:
        self._factory = factory
        self._ledger = ledger

    def list_pages(self, source_id: str, types: Sequence[str], slug: str | None = None) -> list[PageRef]:
        size = func.octet_length(Page.compiled_truth) + func.octet_length(Page.timeline)
        query = select(Page.id, Page.slug, size).where(Page.source_id == source_id, Page.type.in_(types))
        if slug is not None:
            query = query.where(Page.slug == slug)
        with self._factory() as session:
            return [
                PageRef(row[0], row[1], int(row[2])) for row in session.execute(query.order_by(Page.slug))
            ]

    def load_page(
        self, page_id: int, fingerprint: str, source_id: str, slug: str, *, with_checkpoint: bool
    ) -> StoredPage | None:
        """The page's body and label (None when it was deleted), and its checkpoint when asked for."""
        with self._factory() as session:
            page = session.get(Page, page_id)
            if page is None:
                return None
            body = page_body(page.compiled_truth, page.timeline)
            label = f"{page.type}: {page.title}" if page.title else slug
            checkpoint = None
            if with_checkpoint:
                row = session.get(OpCheckpoint, (OP_NAME, fingerprint, page_key(source_id, slug)))
                if row is not None:
                    checkpoint = CheckpointState(row.messages_done, row.prefix_hash, row.next_row_num)
        return StoredPage(body, label, checkpoint, page.content_hash)

    def record_attempts(
        self, place: SegmentPlace, attempts: Sequence[Attempt], note: str | None = None
    ) -> None:
        """A segment's attempts alone (it failed, its facts wait for the swap, or they were discarded)."""
        with self._factory.begin() as session:
            self._write_attempts(session, place, attempts, note)

    def commit_segment(
        self,
        place: SegmentPlace,
        attempts: Sequence[Attempt],
        facts: Sequence[ExtractedFact],
        *,
        fingerprint: str,
        expected: CheckpointState | None,
        new: CheckpointState,
        terminal: Terminal,
        page: PageVersion | None = None,
    ) -> int:
        """One transaction: the attempts, the facts (rows from ``expected.next_row_num``), the checkpoint
        moved from ``expected`` to ``new`` (or CheckpointConflictError, rolling back all of it), the
        terminal row. Returns how many facts went in. With ``page``, the page row is held ``FOR SHARE``
        and checked first (see ``_check_page``)."""
        first_row = expected.next_row_num if expected else 0
        with self._spend_kept_on_page_change(place, attempts), self._factory.begin() as session:
            if page is not None:
                _check_page(session, page, place.slug, new)
            self._write_attempts(session, place, attempts)
            inserted = _insert_facts(session, _fact_rows(facts, place, first_row))
            self._advance_checkpoint(session, fingerprint, place, expected, new)
            if terminal == "set":
                _upsert_terminal(session, place.source_id, place.slug)
            elif terminal == "clear":
                _delete_terminal(session, place.source_id, place.slug)
        return inserted

    def replace_page(
        self,
        fingerprint: str,
        last: SegmentPlace,
        segment_facts: Sequence[tuple[SegmentPlace, Sequence[ExtractedFact]]],
        new: CheckpointState,
        page: PageVersion | None = None,
    ) -> int:
        """Swap the page's facts for a full re-extraction in one transaction, with the checkpoint row
        locked so a concurrent run cannot interleave; returns how many facts went in."""
        source_id, slug = last.source_id, last.slug
        rows: list[dict[str, Any]] = []
        for place, facts in segment_facts:
            rows += _fact_rows(facts, place, len(rows))
        with self._factory.begin() as session:
            if page is not None:
                _check_page(session, page, slug, new)
            current = session.execute(
                select(OpCheckpoint)
                .where(
                    OpCheckpoint.op == OP_NAME,
                    OpCheckpoint.fingerprint == fingerprint,
                    OpCheckpoint.page_key == page_key(source_id, slug),
                )
                .with_for_update()
            ).scalar_one_or_none()
            session.execute(
                delete(Fact).where(
                    Fact.source_id == source_id,
                    Fact.source_markdown_slug == slug,
                    Fact.source.in_((PER_SEGMENT_SOURCE_PREFIX, TERMINAL_AUDIT_SOURCE)),
                )
            )
            inserted = 0
            for chunk_start in range(0, len(rows), _SWAP_CHUNK):
                inserted += _insert_facts(session, rows[chunk_start : chunk_start + _SWAP_CHUNK])
            expected = None
            if current is not None:
                expected = CheckpointState(current.messages_done, current.prefix_hash, current.next_row_num)
            self._advance_checkpoint(session, fingerprint, last, expected, new)
            _upsert_terminal(session, source_id, slug)
        return inserted

    @contextmanager
    def _spend_kept_on_page_change(self, place: SegmentPlace, attempts: Sequence[Attempt]) -> Iterator[None]:
        """When a commit is refused because the page changed, its LLM calls were still paid for: keep
        their llm_calls rows (no audit rows: the page they describe may be gone)."""
        try:
            yield
        except PageChangedError:
            with self._factory.begin() as session:
                self._ledger.record_many(session, _call_records(place, attempts))
            raise

    def _write_attempts(
        self, session: Session, place: SegmentPlace, attempts: Sequence[Attempt], note: str | None = None
    ) -> None:
        """The llm_calls rows (through the ledger, one statement) and the audit rows pointing at them."""
        if not attempts:
            return
        errors = _errors(attempts, note)
        call_ids = iter(self._ledger.record_many(session, _call_records(place, attempts, note)))
        rows = [
            {
                "job_id": place.job_id,
                "source_id": place.source_id,
                "page_slug": place.slug,
                "segment_index": place.index,
                "segment_start": place.segment.start_iso,
                "segment_end": place.segment.end_iso,
                "attempt": number,
                "outcome": a.outcome,
                "facts_count": len(a.facts),
                "error": error,
                "llm_call_id": next(call_ids) if a.called else None,
            }
            for number, (a, error) in enumerate(zip(attempts, errors, strict=True), start=1)
        ]
        session.execute(_INSERT_AUDIT, rows)

    def _advance_checkpoint(
        self,
        session: Session,
        fingerprint: str,
        place: SegmentPlace,
        expected: CheckpointState | None,
        new: CheckpointState,
    ) -> None:
        """Move the checkpoint from ``expected`` to ``new`` or raise: the guard against two runs on a page."""
        key = page_key(place.source_id, place.slug)
        values = {
            "completed_key": encode_checkpoint_entry(place.source_id, place.slug, place.segment.end_iso),
            "messages_done": new.messages_done,
            "prefix_hash": new.prefix_hash,
            "next_row_num": new.next_row_num,
        }
        table = _CHECKPOINTS
        if expected is None:
            inserted = session.execute(
                pg_insert(table)
                .values(op=OP_NAME, fingerprint=fingerprint, page_key=key, **values)
                .on_conflict_do_nothing()
                .returning(table.c.op)
            )
            moved = len(inserted.all())  # SQLAlchemy reports no rowcount for INSERT here
        else:
            updated = session.execute(
                update(table)
                .where(
                    table.c.op == OP_NAME,
                    table.c.fingerprint == fingerprint,
                    table.c.page_key == key,
                    table.c.messages_done == expected.messages_done,
                    table.c.prefix_hash == expected.prefix_hash,
                    table.c.next_row_num == expected.next_row_num,
                )
                .values(**values, updated_at=func.now())
            )
            moved = updated.rowcount  # type: ignore[attr-defined]
        if moved != 1:
            raise CheckpointConflictError(f"another run advanced the checkpoint of {place.slug!r} first")


def _errors(attempts: Sequence[Attempt], note: str | None) -> list[str | None]:
    return ["; ".join(part for part in (a.error, note) if part) or None for a in attempts]


def _call_records(
    place: SegmentPlace, attempts: Sequence[Attempt], note: str | None = None
) -> list[LLMCallRecord]:
    return [
        LLMCallRecord(
            purpose=LLM_PURPOSE,
            provider=a.provider,
            model=a.model,
            usage=a.response.usage if a.response else None,
            latency_ms=a.latency_ms,
            outcome=a.outcome,
            job_id=place.job_id,
            error=error,
            batch=a.batch,
        )
        for a, error in zip(attempts, _errors(attempts, note), strict=True)
        if a.called  # refused before any request (budget): an audit row but no llm_calls row
    ]


def _check_page(session: Session, page: PageVersion, slug: str, new: CheckpointState) -> None:
    """Hold the page row ``FOR SHARE`` for the commit and raise PageChangedError unless the facts still
    describe it: unchanged, or changed only past the messages the new checkpoint covers (an append) and
    still of an extracted type. Erasure and ``store_page`` hold the row ``FOR UPDATE`` while they drop
    its facts, so a commit runs wholly before them (and is dropped with the rest) or sees their result."""
    row = session.execute(
        select(Page.content_hash, Page.type, Page.compiled_truth, Page.timeline)
        .where(Page.id == page.page_id)
        .with_for_update(read=True)
    ).one_or_none()
    if row is None:
        raise PageChangedError(f"{slug!r} was erased while it was extracted; its facts were not stored")
    if row.content_hash == page.content_hash:
        return
    messages = parse_conversation_messages(page_body(row.compiled_truth, row.timeline))
    if (
        row.type not in page.types
        or len(messages) < new.messages_done
        or PrefixHasher(messages).digest(new.messages_done) != new.prefix_hash
    ):
        raise PageChangedError(
            f"{slug!r} changed while it was extracted and no longer holds the messages these facts came "
            "from; they were not stored"
        )


def _fact_rows(facts: Sequence[ExtractedFact], place: SegmentPlace, first_row: int) -> list[dict[str, Any]]:
    segment, slug = place.segment, place.slug
    valid_from = iso_to_datetime(segment.start_iso)
    context = f"conversation segment {segment.start_iso} to {segment.end_iso}"
    return [
        {
            "source_id": place.source_id,
            "fact": f.fact,
            "kind": f.kind,
            "entity_slug": f.entity,
            "confidence": f.confidence,
            "notability": f.notability,
            "context": context,
            "valid_from": valid_from,
            "source": PER_SEGMENT_SOURCE_PREFIX,
            "source_session": f"{PER_SEGMENT_SOURCE_PREFIX}:{slug}",
            "source_markdown_slug": slug,
            "row_num": first_row + offset,
            "is_audit": False,
            "claim_metric": f.metric,
            "claim_value": f.value,
            "claim_unit": f.unit,
            "claim_period": f.period,
        }
        for offset, f in enumerate(facts)
    ]


def _insert_facts(session: Session, rows: list[dict[str, Any]]) -> int:
    """Insert facts; returns how many went in (SQLAlchemy gives no INSERT rowcount here)."""
    if not rows:
        return 0
    return len(session.execute(_INSERT_FACTS, rows).all())


def _upsert_terminal(session: Session, source_id: str, slug: str) -> None:
    row = {
        "source_id": source_id,
        "fact": TERMINAL_AUDIT_FACT,
        "kind": "fact",
        "entity_slug": None,
        "confidence": 1.0,
        "notability": "low",
        "context": "",
        "valid_from": None,
        "source": TERMINAL_AUDIT_SOURCE,
        "source_session": f"{TERMINAL_AUDIT_SOURCE}:{slug}",
        "source_markdown_slug": slug,
        "row_num": TERMINAL_ROW_NUM,
        "is_audit": True,
    }
    session.execute(
        pg_insert(Fact)
        .values(row)
        .on_conflict_do_update(
            index_elements=[Fact.source_id, Fact.source_markdown_slug, Fact.row_num],
            set_={"created_at": func.now()},
        )
    )


def _delete_terminal(session: Session, source_id: str, slug: str) -> None:
    session.execute(
        delete(Fact).where(
            Fact.source_id == source_id,
            Fact.source_markdown_slug == slug,
            Fact.row_num == TERMINAL_ROW_NUM,
        )
    )
