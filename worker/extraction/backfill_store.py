"""A backfill's rows (backfills, backfill_batches, backfill_requests): each method owns its transaction."""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import nullcontext
from dataclasses import dataclass, replace
from decimal import Decimal
from typing import Any

from sqlalchemy import BigInteger, and_, any_, bindparam, case, func, insert, or_, select, update
from sqlalchemy.dialects.postgresql import ARRAY
from sqlalchemy.orm import Session, sessionmaker

from models import Backfill, BackfillBatch, BackfillRequest, Job, LLMCall
from models.reads import read_only
from models.tables import PAGES
from worker.accounting import Ledger
from worker.core.conversation import Segment
from worker.extraction.backfill_rows import BatchRow, PlannedBatch, RequestRow
from worker.extraction.page_version import page_erased
from worker.extraction.rows import SegmentPlace, call_records, held_note
from worker.extraction.segments import Attempt
from worker.extraction.store import ExtractionStore, PageVersion
from worker.llm.batch_api import PROVIDER_WINDOW

OPEN_BATCHES = ("planned", "submitting", "submitted")
_SENT_NOW = {"submitted_at": func.now(), "provider_status": None}  # (a failed send's word goes: sent now)
SEND_FAILED = "send failed"  # provider_status of a batch whose last send failed (then its error class)
# A result with no segment to describe it (its page moved on) is recorded against this stand-in.
NO_SEGMENT = Segment((), (), "", "")


# The planned pages that still exist, held (FOR SHARE) in the order a webhook's delivery locks its pages:
# Python's sort of (source_id, slug), code point by code point, which is the "C" collation's byte order
# in UTF-8. In the database's own collation (en_US on the official Postgres images) "Bob" sorts after
# "alice" and Python's before it: a delivery and a plan each held one of two pages and waited on the other.
HOLD_PAGES = (
    select(PAGES.c.id)
    .where(PAGES.c.id == any_(bindparam("ids", type_=ARRAY(BigInteger))))
    .order_by(PAGES.c.source_id.collate("C"), PAGES.c.slug.collate("C"))
    .with_for_update(read=True)
)


class RequestAlreadyRecordedError(RuntimeError):
    """A batch request's result was recorded already: the transaction recording it again rolls back."""


@dataclass(frozen=True)
class _Held:
    """A segment's attempts kept for the swap, with the request its result answers."""

    place: SegmentPlace
    attempts: tuple[Attempt, ...]
    permanent: bool
    marking: tuple[int, str] | None
    page: PageVersion | None


# A plan's requests go in this many a statement (each a multi-row INSERT the driver pages).
_PLAN_INSERT_CHUNK = 5_000

# Backfills with no job to run them: it failed, or job retention deleted it.
_JOBLESS_BACKFILLS = (
    select(Backfill.id)
    .outerjoin(Job, Job.id == Backfill.job_id)
    .where(or_(Backfill.job_id.is_(None), Job.status == "failed"))
)
PLANS_LOCK_ID = 0x464D_504C_414E  # "FMPLAN": one backfill's plan stored at a time
UNSENT = ("planned", "submitting")  # a batch whose send may still begin, or be recorded


def _mark(session: Session, request_id: int, status: str) -> None:
    """Move a pending request to ``status`` in the caller's transaction, or raise (it was recorded)."""
    moved = session.execute(
        update(BackfillRequest)
        .where(BackfillRequest.id == request_id, BackfillRequest.status == "pending")
        .values(status=status, updated_at=func.now())
        .returning(BackfillRequest.id)
    ).scalar_one_or_none()
    if moved is None:
        raise RequestAlreadyRecordedError(f"batch request {request_id} was recorded already")


class BackfillSegmentStore(ExtractionStore):
    """The extraction store whose segment transactions also mark the batch request they record
    (``marking``, set by the collector around each commit): paid once, committed once."""

    results_read_again = True

    def __init__(self, factory: sessionmaker[Session], ledger: Ledger) -> None:
        super().__init__(factory, ledger)
        self.marking: tuple[int, str] | None = None  # (request id, status once recorded)
        self._held: list[_Held] = []

    def _paid(self, session: Session, *, discarded: bool = False) -> None:
        if self.marking is not None:
            request_id, status = self.marking
            _mark(session, request_id, "discarded" if discarded else status)

    # A page replaced whole records its segments' attempts, and marks their requests, with the swap:
    # marked in transactions of their own, a run that died before the swap left the requests "done"
    # and the page's paid results never stored (the next pass found nothing pending to collect).

    def hold_attempts(
        self, place: SegmentPlace, attempts: Sequence[Attempt], *, permanent: bool, page: PageVersion | None
    ) -> None:
        self._held.append(_Held(place, tuple(attempts), permanent, self.marking, page))

    def release_held(self) -> None:
        """The swap was given up (a later segment failed, or the results ran out): the results held are
        paid for and their facts unused: recorded, their requests ``discarded`` (the failed one keeps
        ``failed``); only their calls when the page was erased meanwhile (audit rows name it)."""
        held, self._held = self._held, []
        if not held:
            return
        unused = [
            replace(one, marking=(one.marking[0], "discarded"))
            if one.marking is not None and one.marking[1] == "done"
            else one
            for one in held
        ]
        page = held[0].page
        with self._factory.begin() as session:
            if page is not None and page_erased(session, page.page_id):
                self._write_spend(session, unused)
                return
            self._write_rows(session, unused, released=True)

    def forget_held(self) -> None:
        """Drop what is held (the page's commit ended without writing it: its requests are still
        pending, and are recorded as discarded or collected again). Left held, the next page's swap
        wrote them too, found their requests recorded, and rolled back."""
        self._held = []

    def _write_held(self, session: Session) -> None:
        held, self._held = self._held, []  # a swap refused rolls back: its requests stay pending
        self._write_rows(session, held)

    def _write_rows(self, session: Session, held: Sequence[_Held], *, released: bool = False) -> None:
        """The held rows; ``released`` (no swap came): an answered segment's say it was held, as online
        runs' do (as "ok, N facts" alone, they looked committed)."""
        outer = self.marking
        try:
            for one in held:
                self.marking = one.marking
                note = held_note(one.attempts) if released else None
                self._write_attempts(session, one.place, one.attempts, note, permanent=one.permanent)
        finally:
            self.marking = outer

    def _write_spend(self, session: Session, held: Sequence[_Held]) -> None:
        """Their calls alone (llm_calls rows, without a provider's message: the page was erased, and the
        backfill's job is not one of the page's for the erasure to find) and their requests marked
        discarded."""
        for one in held:
            if one.marking is not None:
                _mark(session, one.marking[0], "discarded")
        calls = [r for one in held for r in call_records(one.place, one.attempts)]
        self._ledger.record_many(session, calls, erased=True)

    def record_discarded_result(
        self, request_id: int, job_id: int | None, page: tuple[int, str, str], attempts: Sequence[Attempt]
    ) -> None:
        """A paid result its page (id, source, slug) could not use: its llm_calls rows and the request's
        mark, together; without a provider's message (it may quote the page), the page erased or not:
        the calls are under the backfill's job, with no audit row, so no later erasure finds them."""
        _, source_id, slug = page
        place = SegmentPlace(job_id, source_id, slug, -1, NO_SEGMENT)
        with self._factory.begin() as session:
            _mark(session, request_id, "discarded")
            # No note: with ``erased`` every error is replaced, and a note made an answered call read as
            # one whose provider's message "went with the erasure" (the request's mark says discarded).
            self._ledger.record_many(session, call_records(place, attempts), erased=True)


class BackfillStore:
    """Reads and writes of the backfill tables."""

    def __init__(self, factory: sessionmaker[Session]) -> None:
        self._factory = factory

    def load(self, backfill_id: int) -> Backfill | None:
        with read_only(self._factory) as session:
            return session.get(Backfill, backfill_id)

    def store_plan(
        self, backfill_id: int, batches: Sequence[PlannedBatch], *, left_to_others: int = 0
    ) -> None:
        """Every batch and request of the backfill, in one transaction, before anything is sent; not a
        page another backfill stored requests for since this one began to plan (two planned at once).
        The pages left to others (``left_to_others`` when planned, and those) are counted with it."""
        with self._factory.begin() as session:
            backfill = session.get(Backfill, backfill_id, with_for_update=True)
            if backfill is None or backfill.status != "planning":
                return  # planned already (a run that died after this commit)
            session.execute(select(func.pg_advisory_xact_lock(PLANS_LOCK_ID)))  # one plan stored at a time
            taken = self.pages_in_flight(but=backfill_id, session=session)
            # Only pages that still exist, held (FOR SHARE) until the plan commits: a page erased while
            # the plan was read kept its slug in the requests stored after its erasure had renamed them.
            planned_ids = sorted({r.page_id for b in batches for r in b.requests})
            present = set(session.scalars(HOLD_PAGES, {"ids": planned_ids}))
            for planned in batches:
                kept = [r for r in planned.requests if r.page_id not in taken and r.page_id in present]
                if not kept:
                    continue
                batch = BackfillBatch(
                    backfill_id=backfill_id, key=planned.key, provider=planned.provider, model=planned.model
                )
                session.add(batch)
                session.flush()
                # Inserted in chunks, not as ORM objects: a million of them, kept in the session until
                # the commit, were several times the plan's own size.
                for start in range(0, len(kept), _PLAN_INSERT_CHUNK):
                    session.execute(
                        insert(BackfillRequest),
                        [
                            {
                                "batch_id": batch.id,
                                "custom_id": r.custom_id,
                                "page_id": r.page_id,
                                "slug": r.slug,
                                "end_message": r.end_message,
                                "segment_hash": r.segment_hash,
                            }
                            for r in kept[start : start + _PLAN_INSERT_CHUNK]
                        ],
                    )
            dropped = {
                r.page_id for b in batches for r in b.requests if r.page_id in taken and r.page_id in present
            }
            backfill.pages_left_to_others = left_to_others + len(dropped)
            backfill.status = "running"

    def batches(self, backfill_id: int, statuses: Sequence[str] = OPEN_BATCHES) -> list[BatchRow]:
        with read_only(self._factory) as session:
            failed_ago = case(
                (
                    BackfillBatch.provider_status.startswith(SEND_FAILED),
                    func.extract("epoch", func.now() - BackfillBatch.submit_started_at),
                ),
                else_=None,
            )
            rows = session.execute(
                select(
                    BackfillBatch.id,
                    BackfillBatch.send_key.label("key"),
                    BackfillBatch.status,
                    BackfillBatch.provider_batch_id,
                    failed_ago,
                    BackfillBatch.provider,
                    BackfillBatch.submit_started_at,
                    BackfillBatch.provider_status,
                )
                .where(BackfillBatch.backfill_id == backfill_id, BackfillBatch.status.in_(statuses))
                .order_by(BackfillBatch.id)
            ).all()
        return [
            BatchRow(
                row.id,
                row.key,
                row.status,
                row.provider_batch_id,
                None if row[4] is None else float(row[4]),
                row.provider,
                row.submit_started_at,
                row.provider_status,
            )
            for row in rows
        ]

    def in_flight_estimate(self, backfill_id: int | None = None, *, but: int | None = None) -> Decimal:
        """What the batches sent and not yet collected (of one backfill, or of all; ``but`` one) may still
        cost. Of a backfill whose job failed (or is gone), nothing collects them: not one whose send kept
        failing (nothing sends it again), nor one sent past the provider's window (it ended and was
        billed that day); counted for good, they held every other backfill's batches under every later
        day's budget."""
        # A sent batch stays counted while the provider may run it and bill it, collected or not.
        sent_at = func.coalesce(BackfillBatch.submitted_at, BackfillBatch.submit_started_at)
        stranded = BackfillBatch.backfill_id.in_(_JOBLESS_BACKFILLS) & or_(
            and_(
                BackfillBatch.status == "submitting",
                BackfillBatch.provider_batch_id.is_(None),
                func.coalesce(BackfillBatch.provider_status, "").startswith(SEND_FAILED),
            ),
            sent_at < func.now() - PROVIDER_WINDOW,
        )
        query = select(func.coalesce(func.sum(BackfillBatch.estimated_cost_usd), 0)).where(
            BackfillBatch.status.in_(("submitting", "submitted")),
            BackfillBatch.id != (but or 0),
            ~stranded,
        )
        if backfill_id is not None:
            query = query.where(BackfillBatch.backfill_id == backfill_id)
        with read_only(self._factory) as session:
            return Decimal(session.scalar(query) or 0)

    def pages_in_flight(
        self, but: int, session: Session | None = None, *, sent_only: bool = False
    ) -> set[int]:
        """The pages another unfinished backfill (not ``but``) still has pending requests for (with
        ``sent_only``, in batches whose send began); not one whose job failed or is gone (nothing runs
        it: its pages would be held from every later one), nor the unsent batches of one whose cancel
        was asked (they never go: a backfill planned before that cancel's pass left their pages, and
        both ended with them unextracted)."""
        sent = BackfillBatch.status.in_(("submitting", "submitted"))
        query = (
            select(BackfillRequest.page_id)
            .join(BackfillBatch, BackfillBatch.id == BackfillRequest.batch_id)
            .join(Backfill, Backfill.id == BackfillBatch.backfill_id)
            .where(
                BackfillRequest.status == "pending",
                BackfillBatch.backfill_id != but,
                Backfill.status.not_in(("done", "cancelled")),
                Backfill.id.not_in(_JOBLESS_BACKFILLS),
                or_(Backfill.cancel_requested.is_(False), sent),
            )
            .distinct()
        )
        if sent_only:
            query = query.where(sent)
        with nullcontext(session) if session is not None else read_only(self._factory) as reading:
            return set(reading.scalars(query))

    def pending_requests(self, batch_id: int) -> list[RequestRow]:
        """The batch's requests still waiting for a result, in page order (slug, then segment)."""
        with read_only(self._factory) as session:
            rows = session.execute(
                select(
                    BackfillRequest.id,
                    BackfillRequest.custom_id,
                    BackfillRequest.page_id,
                    BackfillRequest.slug,
                    BackfillRequest.end_message,
                    BackfillRequest.segment_hash,
                    BackfillRequest.status,
                )
                .where(BackfillRequest.batch_id == batch_id, BackfillRequest.status == "pending")
                .order_by(BackfillRequest.slug, BackfillRequest.end_message)
            ).all()
        return [RequestRow(*row) for row in rows]

    def has_pending(self, batch_id: int) -> bool:
        """Whether a request of the batch still waits for a result (not loaded: a batch holds 50,000)."""
        pending = BackfillRequest.batch_id == batch_id, BackfillRequest.status == "pending"
        with read_only(self._factory) as session:
            return bool(session.scalar(select(select(BackfillRequest.id).where(*pending).exists())))

    def still_pending(self, request_ids: Sequence[int]) -> set[int]:
        with read_only(self._factory) as session:
            rows = session.scalars(
                select(BackfillRequest.id).where(
                    BackfillRequest.id.in_(request_ids), BackfillRequest.status == "pending"
                )
            )
            return set(rows)

    def leave_pages(self, backfill_id: int, request_ids: Sequence[int]) -> None:
        """Requests of pages another backfill sent for (dropped), and those pages counted as left to it
        (pages_left_to_others), in one transaction: once not pending, a rerun cannot count them again."""
        if not request_ids:
            return
        with self._factory.begin() as session:
            pages = set(
                session.scalars(
                    update(BackfillRequest)
                    .where(BackfillRequest.id.in_(request_ids), BackfillRequest.status == "pending")
                    .values(status="dropped", updated_at=func.now())
                    .returning(BackfillRequest.page_id)
                )
            )
            if pages:
                session.execute(
                    update(Backfill)
                    .where(Backfill.id == backfill_id)
                    .values(pages_left_to_others=Backfill.pages_left_to_others + len(pages))
                )

    def mark_requests(self, request_ids: Sequence[int], status: str) -> None:
        """Requests that end without a result (expired, cancelled, dropped before sending)."""
        if not request_ids:
            return
        with self._factory.begin() as session:
            session.execute(
                update(BackfillRequest)
                .where(BackfillRequest.id.in_(request_ids), BackfillRequest.status == "pending")
                .values(status=status, updated_at=func.now())
            )

    def record_sent(self, batch_id: int, provider_batch_id: str) -> bool:
        """Record the provider's id of a batch this run sent (or found); False (nothing written) when
        another run recorded another one first. The same id recorded already (another run found this
        run's copy) is this run's: True."""
        with self._factory.begin() as session:
            status, recorded = session.execute(
                select(BackfillBatch.status, BackfillBatch.provider_batch_id)
                .where(BackfillBatch.id == batch_id)
                .with_for_update()
            ).one()
            if recorded is not None:
                return bool(recorded == provider_batch_id)
            if status not in UNSENT:
                return False  # cancelled or finished meanwhile: nothing would poll it
            session.execute(
                update(BackfillBatch)
                .where(BackfillBatch.id == batch_id)
                .values(status="submitted", provider_batch_id=provider_batch_id, **_SENT_NOW)
            )
            return True

    def set_batch(self, batch_id: int, *, unsent_only: bool = False, **values: Any) -> bool:
        """Move a batch on (submit_started_at, provider_batch_id, status...) and commit at once; with
        ``unsent_only``, only while no run has recorded its send and it is not cancelled or finished.
        Whether it was moved. A send begins ("submitting") only while no cancel of its backfill was asked,
        read under the backfill row FOR SHARE, which a cancel locks FOR UPDATE: a cancel asked during the
        pass's work before the send (its requests rebuilt) let the batch go, while a backfill planned
        after the cancel took its pages too (both paid), or left them to it (then cancelled unextracted)."""
        timestamps = {
            "submitting": "submit_started_at",
            "submitted": "submitted_at",
            "collected": "collected_at",
        }
        stamp = timestamps.get(values.get("status", ""))
        if stamp is not None:
            values[stamp] = func.now()
        which = [BackfillBatch.id == batch_id]
        if unsent_only:
            which += [BackfillBatch.provider_batch_id.is_(None), BackfillBatch.status.in_(UNSENT)]
        with self._factory.begin() as session:
            if values.get("status") == "submitting" and session.scalar(
                select(Backfill.cancel_requested)
                .join(BackfillBatch, BackfillBatch.backfill_id == Backfill.id)
                .where(BackfillBatch.id == batch_id)
                .with_for_update(read=True, of=Backfill)
            ):
                return False
            moved = session.execute(
                update(BackfillBatch).where(*which).values(**values).returning(BackfillBatch.id)
            ).first()
            if moved is not None and values.get("status") == "cancelled":
                session.execute(
                    update(BackfillRequest)
                    .where(BackfillRequest.batch_id == batch_id, BackfillRequest.status == "pending")
                    .values(status="cancelled", updated_at=func.now())
                )
        return moved is not None

    def cancel_requested(self, backfill_id: int) -> bool:
        with read_only(self._factory) as session:
            return bool(session.scalar(select(Backfill.cancel_requested).where(Backfill.id == backfill_id)))

    def finish(self, backfill_id: int, status: str) -> None:
        with self._factory.begin() as session:
            session.execute(
                update(Backfill)
                .where(Backfill.id == backfill_id)
                .values(status=status, finished_at=func.now())
            )


def request_counts(session: Session, backfill_id: int) -> dict[str, int]:
    """The backfill's requests by status."""
    rows = session.execute(
        select(BackfillRequest.status, func.count())
        .join(BackfillBatch, BackfillBatch.id == BackfillRequest.batch_id)
        .where(BackfillBatch.backfill_id == backfill_id)
        .group_by(BackfillRequest.status)
    ).all()
    return {status: int(count) for status, count in rows}


def spend(session: Session, job_id: int | None) -> tuple[int, str]:
    """(LLM calls recorded, their cost in USD) for the backfill's job: what its batches cost so far."""
    if job_id is None:
        return 0, "0"
    calls, cost = session.execute(
        select(func.count(), func.coalesce(func.sum(LLMCall.cost_usd), 0)).where(LLMCall.job_id == job_id)
    ).one()
    return int(calls), str(cost)


def job_status(session: Session, job_id: int | None) -> tuple[str | None, str | None]:
    if job_id is None:
        return None, None
    row = session.execute(select(Job.status, Job.last_error).where(Job.id == job_id)).one_or_none()
    return (row.status, row.last_error) if row is not None else (None, None)
