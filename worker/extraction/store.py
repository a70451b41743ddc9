"""Extraction's reads and writes; each method owns its transaction (per segment: facts, audit, checkpoint).

Writes go through ``factory.begin()`` opened here; llm_calls rows go through the accounting Ledger.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from functools import partial
from typing import Any, Literal

from sqlalchemy import delete, func, select
from sqlalchemy.orm import Session, sessionmaker

from models import ExtractionAudit, Fact, LLMCall, OpCheckpoint
from models.bulk import BulkInsert
from models.reads import read_only
from models.tables import EXTRACTION_AUDIT, FACTS
from worker.accounting import Ledger
from worker.consolidation.erasure import REPLACED_REASON, forget_reasons_about, retire_unnamed_keys
from worker.core.checkpoint import (
    CheckpointState,
    SkippedSegment,
    encode_checkpoint_entry,
    page_key,
    segment_hash,
)
from worker.core.errors import error_summary
from worker.core.facts import ExtractedFact
from worker.extraction.erase import page_body
from worker.extraction.options import (
    OP_NAME,
    PER_SEGMENT_SOURCE_PREFIX,
    TERMINAL_AUDIT_SOURCE,
    CheckpointConflictError,
    PageErasedError,
)
from worker.extraction.page_version import PageVersion, check_page, page_erased
from worker.extraction.provider_copies import ProviderCopies
from worker.extraction.rows import (
    AUDIT_COLUMNS,
    FACT_COLUMNS,
    SegmentPlace,
    audit_rows,
    call_records,
    errors_of,
    fact_rows,
    held_note,
    skip_row,
)
from worker.extraction.segments import Attempt
from worker.extraction.statements import (
    CHECKPOINT_FIRST,
    CHECKPOINT_MOVE,
    LIST_ONE_PAGE,
    LIST_PAGES,
    LOAD_PAGE,
    LOAD_PAGE_WITH_CHECKPOINT,
    TERMINAL_ROW_NUM,
    UPSERT_TERMINAL,
)

logger = logging.getLogger(__name__)

# One statement each, whatever the number of rows (see models.bulk).
_INSERT_FACTS = BulkInsert(
    FACTS, FACT_COLUMNS, conflict=("source_id", "source_markdown_slug", "row_num"), returning="row_num"
)
_INSERT_AUDIT = BulkInsert(EXTRACTION_AUDIT, AUDIT_COLUMNS)
_SWAP_CHUNK = 1000
# What a segment commit does to the page's terminal audit row: set it (the page's last segment), clear it
# (the first segment of appended messages: the page is incomplete again), or leave it.
Terminal = Literal["set", "clear", "keep"]


@dataclass(frozen=True)
class SegmentCommit:
    """One segment of a commit: where it belongs, its attempts, its facts (rows from ``first_row``), and
    why it is skipped (None: it succeeded)."""

    place: SegmentPlace
    attempts: Sequence[Attempt]
    facts: Sequence[ExtractedFact]
    first_row: int
    skip: str | None = None


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


class ExtractionStore:
    """Owns its transactions: every method opens its own session (``factory.begin()`` for writes)."""

    # Whether a segment's paid results can be read again after a failed commit (a backfill's, from the
    # provider's batch): then they are collected again, not recorded as spent and discarded.
    results_read_again = False

    def __init__(self, factory: sessionmaker[Session], ledger: Ledger) -> None:
        self._factory = factory
        self._ledger = ledger
        self.provider_copies = ProviderCopies(factory)  # batch copies owed a delete at the provider

    def list_pages(self, source_id: str, types: Sequence[str], slug: str | None = None) -> list[PageRef]:
        query = LIST_PAGES if slug is None else LIST_ONE_PAGE
        params = {"source_id": source_id, "types": list(types), "slug": slug}
        with read_only(self._factory) as session:
            return [PageRef(row[0], row[1], int(row[2])) for row in session.execute(query, params)]

    def load_page(
        self, page_id: int, fingerprint: str, source_id: str, slug: str, *, with_checkpoint: bool
    ) -> StoredPage | None:
        """The page's body and label (None when it was deleted), and its checkpoint when asked for."""
        # One Core statement, the checkpoint joined in: loading ORM objects for this was most of the
        # time a small page spent being planned (py-spy, bench/pipeline.py).
        params: dict[str, Any] = {"page_id": page_id}
        if with_checkpoint:
            params |= {"fingerprint": fingerprint, "page_key": page_key(source_id, slug)}
        with read_only(self._factory) as session:
            page = session.execute(
                LOAD_PAGE_WITH_CHECKPOINT if with_checkpoint else LOAD_PAGE, params
            ).one_or_none()
        if page is None:
            return None
        body = page_body(page.compiled_truth, page.timeline)
        label = f"{page.type}: {page.title}" if page.title else slug
        checkpoint = _state(page) if with_checkpoint and page.messages_done is not None else None
        return StoredPage(body, label, checkpoint, page.content_hash)

    def record_attempts(
        self,
        place: SegmentPlace,
        attempts: Sequence[Attempt],
        note: str | None = None,
        *,
        permanent: bool = False,
        page: PageVersion | None = None,
        incomplete: bool = False,
    ) -> None:
        """A segment's attempts alone (it failed, its facts wait for the swap, or they were discarded);
        ``permanent`` marks the last one as a failure that counts towards skipping the segment. With
        ``page``, its row is held FOR SHARE and, when an erasure took it meanwhile, only the calls are
        recorded (audit rows name the page, and the erasure has deleted its own). ``incomplete``: the
        first segment of messages appended to an extracted page failed, so its terminal row goes (the
        commit of that segment would have taken it out)."""
        with self._factory.begin() as session:
            if page is not None and page_erased(session, page.page_id):
                # Erased meanwhile: the calls, without a provider's message (it may quote the page).
                self._paid(session, discarded=True)
                self._ledger.record_many(session, call_records(place, attempts, note), erased=True)
                return
            self._write_attempts(session, place, attempts, note, permanent=permanent)
            if incomplete:
                _delete_terminal(session, place.source_id, place.slug)

    def hold_attempts(
        self, place: SegmentPlace, attempts: Sequence[Attempt], *, permanent: bool, page: PageVersion | None
    ) -> None:
        """The attempts of a segment whose facts wait for a whole-page swap (``replace_page``). Recorded
        now, in their own transaction: a run that dies before the swap has paid for them all the same.
        A store whose results can be read again (a backfill's, from the provider's batch) keeps them to
        record with the swap instead, so a death in between leaves them to be collected again."""
        self.record_attempts(place, attempts, held_note(attempts), permanent=permanent, page=page)

    def release_held(self) -> None:
        """The swap will not happen (a segment failed, results ran out): record what was held (none here)."""

    def _write_held(self, session: Session) -> None:
        """Write what ``hold_attempts`` kept, in the swap's transaction. Nothing is kept here."""

    def permanent_failures(self, place: SegmentPlace) -> int:
        """How often this segment (by its messages' digest) failed permanently since it last succeeded,
        across attempts, jobs and runs: read from its audit rows, the only record of them."""
        digest = segment_hash(place.segment)
        same = (
            ExtractionAudit.source_id == place.source_id,
            ExtractionAudit.page_slug == place.slug,
            ExtractionAudit.segment_hash == digest,
        )
        last_ok = (
            select(func.max(ExtractionAudit.id))
            .where(*same, ExtractionAudit.outcome == "ok")
            .scalar_subquery()
        )
        query = (
            select(func.count())
            .select_from(ExtractionAudit)
            .where(*same, ExtractionAudit.permanent, ExtractionAudit.id > func.coalesce(last_ok, 0))
        )
        with read_only(self._factory) as session:
            return int(session.scalar(query) or 0)

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
        skip: str | None = None,
    ) -> int:
        """One transaction: the attempts, the facts (rows from ``expected.next_row_num``), the checkpoint
        moved from ``expected`` to ``new`` (or CheckpointConflictError, rolling back all of it), the
        terminal row. Returns how many facts went in. With ``page``, the page row is held ``FOR SHARE``
        and checked first (see ``check_page``). With ``skip`` (the reason), the segment failed
        permanently once too often: its last attempt counts as such, a ``skipped`` audit row says why,
        and ``new`` (which lists it among the skipped) moves the checkpoint past it."""
        first_row = expected.next_row_num if expected else 0
        return self.commit_segments(
            [SegmentCommit(place, attempts, facts, first_row, skip)],
            fingerprint=fingerprint,
            expected=expected,
            new=new,
            terminal=terminal,
            page=page,
        )

    def commit_segments(
        self,
        segments: Sequence[SegmentCommit],
        *,
        fingerprint: str,
        expected: CheckpointState | None,
        new: CheckpointState,
        terminal: Terminal,
        page: PageVersion | None = None,
    ) -> int:
        """Consecutive segments of one page in one transaction, each written as ``commit_segment``
        writes it, and the checkpoint moved once, from ``expected`` (before the first) to ``new``
        (after the last): all of them commit, or none (exactly once, as for one segment)."""
        last = segments[-1].place
        spent = [(s.place, s.attempts) for s in segments]
        committing: list[bool] = []
        written: list[int] = []  # the llm_calls ids this transaction wrote
        reached = partial(self._rows_stored, written)
        with self._spend_kept_on_refusal(spent, committing, reached), self._factory.begin() as session:
            if page is not None:
                check_page(session, page, last.slug, new)
            written += self._write_segment_rows(session, segments)
            # The checkpoint before the facts, as a whole-page swap takes them: facts first, a swap
            # inserting from row 0 waited on this run's rows while this run waited on its checkpoint
            # (a deadlock, 40P01, where a checkpoint conflict was due).
            self._advance_checkpoint(session, fingerprint, last, expected, new)
            rows = [row for s in segments for row in fact_rows(s.facts, s.place, s.first_row)]
            inserted = _insert_facts(session, rows)
            if terminal == "set":
                _upsert_terminal(session, last.source_id, last.slug)
            elif terminal == "clear":
                _delete_terminal(session, last.source_id, last.slug)
            committing.append(True)
        return inserted

    def _write_segment_rows(self, session: Session, segments: Sequence[SegmentCommit]) -> list[int]:
        """The segments' llm_calls rows (one statement) and their audit rows (one statement), in page
        order: each segment's attempts, then its ``skipped`` row if it is skipped. Returns the llm_calls
        ids."""
        records = [call_records(s.place, s.attempts) for s in segments]
        written = list(self._ledger.record_many(session, [r for per in records for r in per]))
        ids = iter(written)
        self._paid(session)
        audit: list[dict[str, Any]] = []
        for s in segments:
            per_attempt = [next(ids) if a.called else None for a in s.attempts]
            errors = errors_of(s.attempts, None)
            audit += audit_rows(s.place, s.attempts, errors, per_attempt, permanent=s.skip is not None)
            if s.skip is not None:
                audit.append(skip_row(s.place, s.attempts, s.skip))
        _INSERT_AUDIT.execute(session, audit)
        return written

    def replace_page(
        self,
        fingerprint: str,
        last: SegmentPlace,
        segment_facts: Sequence[tuple[SegmentPlace, Sequence[ExtractedFact]]],
        new: CheckpointState,
        page: PageVersion | None = None,
        skips: Sequence[tuple[SegmentPlace, Sequence[Attempt], str]] = (),
        *,
        planned: CheckpointState | None,
    ) -> int:
        """Swap the page's facts for a full re-extraction in one transaction, with the checkpoint row
        locked so a concurrent run cannot interleave; returns how many facts went in. ``planned`` is the
        checkpoint the run was planned from: CheckpointConflictError, nothing changed, when another run
        moved it on since (an append extracted by the page's job: the swap took its facts out and moved
        the checkpoint back). ``skips`` are the segments it went past (their attempts are recorded
        already): their ``skipped`` rows go in here, with the checkpoint; and ``hold_attempts``' too."""
        source_id, slug = last.source_id, last.slug
        rows: list[dict[str, Any]] = []
        for place, facts in segment_facts:
            rows += fact_rows(facts, place, len(rows))
        with self._factory.begin() as session:
            if page is not None:  # the page first, as every commit and erasure lock it (page, then rows)
                check_page(session, page, slug, new)
            # Before the checkpoint's check: a refusal there rolls them back with the rest.
            self._write_held(session)
            current = session.execute(
                select(OpCheckpoint)
                .where(
                    OpCheckpoint.op == OP_NAME,
                    OpCheckpoint.fingerprint == fingerprint,
                    OpCheckpoint.page_key == page_key(source_id, slug),
                )
                .with_for_update()
            ).scalar_one_or_none()
            expected = _state(current) if current is not None else None
            if expected != planned:
                raise CheckpointConflictError(
                    f"{slug!r} was extracted by another run while this one re-extracted it; nothing was "
                    "replaced (run it again to re-extract the page as it is now)"
                )
            replaced = (
                Fact.source_id == source_id,
                Fact.source_markdown_slug == slug,
                Fact.source.in_((PER_SEGMENT_SOURCE_PREFIX, TERMINAL_AUDIT_SOURCE)),
            )
            replacing = select(Fact.id).where(*replaced)  # (restart=False: see forget_reasons_about)
            keys = forget_reasons_about(session, replacing, REPLACED_REASON, restart=False)
            session.execute(delete(Fact).where(*replaced))
            inserted = 0
            for chunk_start in range(0, len(rows), _SWAP_CHUNK):
                inserted += _insert_facts(session, rows[chunk_start : chunk_start + _SWAP_CHUNK])
            retire_unnamed_keys(session, keys)
            _INSERT_AUDIT.execute(session, [skip_row(place, tried, why) for place, tried, why in skips])
            self._advance_checkpoint(session, fingerprint, last, expected, new)
            _upsert_terminal(session, source_id, slug)
        return inserted

    @contextmanager
    def _spend_kept_on_refusal(
        self,
        spent: Sequence[tuple[SegmentPlace, Sequence[Attempt]]],
        committing: Sequence[bool] = (),
        reached: Callable[[], bool] | None = None,
    ) -> Iterator[None]:
        """When a commit is refused (the page changed, or another run moved its checkpoint on), its LLM
        calls were still paid for: keep their llm_calls rows (no audit rows: the page they describe may
        be gone). A checkpoint conflict rolled them back unrecorded, and the budgets counted low. So
        did any other failure of the commit (a deadlock, a statement timeout, a dropped connection):
        its spend is recorded as well as the database lets, unless the results can be read again."""
        try:
            yield
        except CheckpointConflictError as exc:
            self.record_spend(spent, erased=isinstance(exc, PageErasedError))
            raise
        except (Exception, SystemExit, KeyboardInterrupt) as exc:
            # A SIGTERM (SystemExit) or Ctrl-C landing in the commit too: the committer counts the spend
            # of every segment handed here as kept, and a batch of 256 went unrecorded. Not once its rows
            # were all written (``committing``): a signal is handled after the COMMIT call returns, so
            # the transaction most likely committed, and its rows would be recorded twice.
            signal = not isinstance(exc, Exception)
            if (
                not self.results_read_again
                and not (signal and committing)
                and not (committing and _committed_after_all(reached))
            ):
                try:
                    self.record_spend(spent)
                except Exception as exc:  # the database is away: the original error is the one to raise
                    logger.warning("could not record the spend of a failed commit: %s", error_summary(exc))
            raise

    def _rows_stored(self, written: Sequence[int]) -> bool:
        """Whether a transaction whose COMMIT failed committed after all: its own llm_calls rows are
        there (ids are never reused; another run moving the checkpoint to the same place says nothing
        of this one). Without a row of its own (no call was made), taken for not committed."""
        if not written:
            return False
        with read_only(self._factory) as session:
            return session.scalar(select(LLMCall.id).where(LLMCall.id == written[0])) is not None

    def record_spend(
        self, spent: Sequence[tuple[SegmentPlace, Sequence[Attempt]]], *, erased: bool = False
    ) -> None:
        """Paid attempts whose page may be gone (erased or changed under the run): their llm_calls rows
        only, no audit rows (they describe the page). Without a provider's message (it may quote the
        page) when ``erased``, or under no job (`factmill extract`: no later erasure would find them)."""
        calls = [record for place, attempts in spent for record in call_records(place, attempts)]
        erased = erased or any(place.job_id is None for place, _ in spent)
        with self._factory.begin() as session:
            self._paid(session, discarded=True)
            self._ledger.record_many(session, calls, erased=erased)

    def _paid(self, session: Session, *, discarded: bool = False) -> None:
        """Called in the transaction that records a segment's LLM calls (``discarded``: without its
        facts, because the page changed). A backfill marks its batch request there, so a paid result is
        recorded exactly once; online runs have nothing to add."""

    def _write_attempts(
        self,
        session: Session,
        place: SegmentPlace,
        attempts: Sequence[Attempt],
        note: str | None = None,
        *,
        permanent: bool = False,
    ) -> None:
        """The llm_calls rows (through the ledger, one statement) and the audit rows pointing at them;
        ``permanent`` marks the last attempt as a permanent failure of the segment."""
        if not attempts:
            return
        errors = errors_of(attempts, note)
        self._paid(session)
        call_ids = self._ledger.record_many(session, call_records(place, attempts, note))
        ids = iter(call_ids)
        per_attempt = [next(ids) if a.called else None for a in attempts]
        _INSERT_AUDIT.execute(session, audit_rows(place, attempts, errors, per_attempt, permanent=permanent))

    def _advance_checkpoint(
        self,
        session: Session,
        fingerprint: str,
        place: SegmentPlace,
        expected: CheckpointState | None,
        new: CheckpointState,
    ) -> None:
        """Move the checkpoint from ``expected`` to ``new`` or raise: the guard against two runs on a page."""
        params: dict[str, Any] = {
            "b_fingerprint": fingerprint,
            "b_page_key": page_key(place.source_id, place.slug),
            "new_completed_key": encode_checkpoint_entry(place.source_id, place.slug, place.segment.end_iso),
            "new_messages_done": new.messages_done,
            "new_prefix_hash": new.prefix_hash,
            "new_next_row_num": new.next_row_num,
            "new_skipped": [entry.as_json() for entry in new.skipped],
        }
        if expected is None:
            moved = len(session.execute(CHECKPOINT_FIRST, params).all())  # no rowcount for this INSERT
        else:
            params |= {
                "was_messages_done": expected.messages_done,
                "was_prefix_hash": expected.prefix_hash,
                "was_next_row_num": expected.next_row_num,
                "was_skipped": [entry.as_json() for entry in expected.skipped],
            }
            moved = session.execute(CHECKPOINT_MOVE, params).rowcount  # type: ignore[attr-defined]
        if moved != 1:
            raise CheckpointConflictError(f"another run advanced the checkpoint of {place.slug!r} first")


def _state(row: Any) -> CheckpointState:
    """The checkpoint an ``OpCheckpoint`` (or a row with its ``CHECKPOINT_STATE`` columns) holds."""
    return CheckpointState(
        row.messages_done,
        row.prefix_hash,
        row.next_row_num,
        tuple(SkippedSegment.from_json(entry) for entry in row.skipped or ()),
    )


def _insert_facts(session: Session, rows: list[dict[str, Any]]) -> int:
    """Insert facts; returns how many went in (a row number already taken keeps its fact)."""
    return len(_INSERT_FACTS.returned(session, rows))


def _upsert_terminal(session: Session, source_id: str, slug: str) -> None:
    params = {"b_source_id": source_id, "b_slug": slug, "b_source_session": f"{TERMINAL_AUDIT_SOURCE}:{slug}"}
    session.execute(UPSERT_TERMINAL, params)


def _delete_terminal(session: Session, source_id: str, slug: str) -> None:
    session.execute(
        delete(FACTS).where(
            FACTS.c.source_id == source_id,
            FACTS.c.source_markdown_slug == slug,
            FACTS.c.row_num == TERMINAL_ROW_NUM,
        )
    )


def _committed_after_all(reached: Callable[[], bool] | None) -> bool:
    """A COMMIT that failed (the connection dropped as it ran) may have committed: when its checkpoint
    moved, the spend is stored, and recorded again it counted twice. Unknown (the database away) is
    taken for not committed: a spend counted once too often beats one lost."""
    if reached is None:
        return False
    try:
        return reached()
    except Exception:
        return False
