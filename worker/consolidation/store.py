"""Consolidation's reads and writes; every decision is one transaction (fact marked, effect, audit
row, entity checkpoint advanced), so each is committed exactly once."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from datetime import datetime
from typing import Any

from sqlalchemy import (
    BindParameter,
    ColumnElement,
    Float,
    Integer,
    Select,
    and_,
    bindparam,
    func,
    literal,
    or_,
    select,
    text,
    tuple_,
    update,
)
from sqlalchemy.dialects.postgresql import insert as pg_insert
from sqlalchemy.exc import DBAPIError
from sqlalchemy.orm import Session, sessionmaker

from models import ConsolidationCheckpoint, ConsolidationDecision, Fact
from models.fact import ORPHANED_LINK_SQL
from models.packed import unpack_floats
from models.tables import FACTS, JOBS
from worker.accounting import Ledger, LLMCallRecord
from worker.core.consolidation import (
    CURRENT,
    DUPLICATE,
    PAGE_KEY_PREFIX,
    SUPERSEDED,
    FactView,
    Supersession,
    began,
    close_interval,
    entity_key,
    entity_key_filter,
    said_at,
)
from worker.core.consolidation_plan import EARLIER_SAYING_REASON, RESTATED_REASON, Resolved, Row
from worker.db import statement_timed_out
from worker.jobs.outbox import CONSOLIDATION, PENDING, page_subject_sql

logger = logging.getLogger(__name__)
ENTITY_FACTS_BATCH = 1_000  # rows fetched at a time while an entity's facts are read
SLOTTED_REASON = (
    "rule: said between fact {old} and fact {newer}, which had closed it: fact {old} now ends where this "
    "one begins"
)
ORPHAN_REASON = "rule: the fact it was linked to was re-extracted or erased; considered again"


# An entity's facts as consolidation reads them (the caller adds which), in arrival order, streamed.
# The vectors come in Postgres's binary array format (unpack_floats): psycopg parsed each float of the
# text form in turn, about 1 µs a float, seconds for a large entity (bench/entity_read.py).
_ENTITY_FACTS = (
    select(
        Fact.id,
        Fact.fact,
        Fact.kind,
        Fact.valid_from,
        func.array_send(Fact.embedding).label("embedding"),
        Fact.context,
        Fact.created_at,
    )
    .where(~Fact.is_audit)
    .order_by(Fact.id)
    .execution_options(yield_per=ENTITY_FACTS_BATCH)
)


def _view(row: Any) -> FactView:
    vector = unpack_floats(row.embedding) if row.embedding is not None else None
    said = said_at(row.context, row.created_at)
    return FactView(row.id, row.fact, row.kind, row.valid_from, vector or None, row.id, said)


class ConsolidationStore:
    """Owns its transactions: every method opens its own session (``factory.begin()`` for writes)."""

    def __init__(self, factory: sessionmaker[Session], ledger: Ledger) -> None:
        self._factory = factory
        self._ledger = ledger

    def entity_facts(self, source_id: str, entity_key: str) -> tuple[list[FactView], list[FactView]]:
        """(the entity's unconsolidated facts, to decide; its current facts of the same kinds, to decide
        them against), each in arrival order, audit rows excluded. Other kinds are never compared, so
        they are not read, and nothing is when nothing is pending. Streamed, each vector kept as an
        array of doubles: as Python lists the vectors of a 50,000-fact entity took 414 MiB."""
        mine = _ENTITY_FACTS.where(Fact.source_id == source_id, _entity(entity_key))
        # A server-side cursor needs a transaction (not read_only's autocommit); closing rolls it back.
        with self._factory() as session:
            pending = [_view(row) for row in session.execute(mine.where(Fact.consolidated_at.is_(None)))]
            if not pending:
                return [], []
            decided = mine.where(
                Fact.consolidated_at.is_not(None),
                Fact.status == CURRENT,
                Fact.kind.in_(sorted({fact.kind for fact in pending})),
            )
            return pending, [_view(row) for row in session.execute(decided)]

    def repair_orphans(self, source_id: str, entity_key: str, job_id: int | None) -> int:
        """Facts marked duplicate or superseded whose link went (the other fact was re-extracted or
        erased) become current and unconsolidated again, each with an audit row; returns how many."""
        with self._factory.begin() as session:
            ids = session.scalars(
                update(Fact)
                .where(Fact.source_id == source_id, _entity(entity_key), _orphaned())
                .values(status=CURRENT, valid_to=None, consolidated_at=None)
                .returning(Fact.id)
            ).all()
            rows = [(i, Row(None, "restore", "rule", ORPHAN_REASON)) for i in ids]
            _insert_rows(session, source_id, entity_key, job_id, rows)
        return len(ids)

    def record_call(self, call: LLMCallRecord) -> int:
        """The batched call's llm_calls row (committed at once: it was paid for whatever follows)."""
        with self._factory.begin() as session:
            return self._ledger.record(session, call)

    def commit_decisions(
        self,
        source_id: str,
        entity_key: str,
        job_id: int | None,
        decisions: Sequence[tuple[Resolved, int | None]],
    ) -> list[bool]:
        """One transaction for a run of decisions (each with the llm_calls row it came from): the
        entity's checkpoint row locked, then per decision the new fact marked consolidated (only if it
        was not: False for it and nothing of it written), its effect (duplicate link, intervals
        closed) and its audit rows; the checkpoint advanced by the decisions written."""
        done: list[bool] = []
        with self._factory.begin() as session:
            created = lock_checkpoint(session, source_id, entity_key)
            for decision, llm_call_id in decisions:
                done.append(_write_decision(session, source_id, entity_key, job_id, decision, llm_call_id))
            # A decision left to decide again is counted when it is decided for good.
            written = [
                d.fact_id
                for d, ok in zip((d for d, _ in decisions), done, strict=True)
                if ok and not d.reconsider
            ]
            if created and not any(done):
                # Its facts went meanwhile (an erasure dropped the key's checkpoint): bring nothing back.
                session.execute(DROP_CHECKPOINT, {"source_id": source_id, "key": entity_key})
            if written:
                session.execute(
                    update(ConsolidationCheckpoint)
                    .where(
                        ConsolidationCheckpoint.source_id == source_id,
                        ConsolidationCheckpoint.entity_key == entity_key,
                    )
                    .values(
                        facts_done=ConsolidationCheckpoint.facts_done + len(written),
                        last_fact_id=written[-1],
                        updated_at=func.now(),
                    )
                )
        return done


def _write_decision(
    session: Session,
    source_id: str,
    entity_key: str,
    job_id: int | None,
    decision: Resolved,
    llm_call_id: int | None,
) -> bool:
    values: dict[str, Any] = {"consolidated_at": None if decision.reconsider else func.now()}
    rows = [(decision.fact_id, row) for row in decision.rows]
    changed = _changed_after(session, decision)
    if changed is not None:  # said before a fact its canonical closed: not the canonical's saying
        changed_id, changed_at = changed
        values.update(status=SUPERSEDED, superseded_by=changed_id, valid_to=changed_at)
        reason = EARLIER_SAYING_REASON.format(canonical=decision.duplicate_of, changed=changed_id)
        rows = [(fact_id, row) for fact_id, row in rows if row.decided_by == "model"]  # the model's verdicts
        rows.append((decision.fact_id, Row(decision.duplicate_of, "new", "rule", reason)))
    elif decision.duplicate_of is not None:
        values.update(status=DUPLICATE, duplicate_of=decision.duplicate_of)
    marked = session.scalars(
        update(Fact)
        .where(Fact.id == decision.fact_id, Fact.consolidated_at.is_(None))
        .values(**values)
        .returning(Fact.id)
    ).all()
    if not marked:
        return False
    if changed is not None:  # what was true before it, and ended where the changed fact began, ends here
        rows += _slot_into_chain(session, decision.fact_id, decision.since, changed[0])
    elif decision.duplicate_of is not None and decision.since is not None:
        _start_canonical_by(session, decision.duplicate_of, decision.since)
    for closing in decision.closings:
        # A fact closed is decided: one left to decide again (reopened earlier in this run) is not
        # planned again as if it were current.
        session.execute(
            update(Fact)
            .where(Fact.id == closing.older.id, Fact.status == CURRENT)
            .values(
                status=SUPERSEDED,
                superseded_by=closing.newer.id,
                valid_to=closing.valid_to,
                consolidated_at=func.coalesce(Fact.consolidated_at, func.now()),
            )
        )
        if closing.older.id == decision.fact_id:
            rows += _slot_into_chain(session, closing.older.id, closing.older.since, closing.newer.id)
        else:
            rows += _reopen_later_restatements(session, closing)
    _insert_rows(session, source_id, entity_key, job_id, rows, llm_call_id)
    return True


def _changed_after(session: Session, decision: Resolved) -> tuple[int, datetime] | None:
    """For a duplicate said before its canonical: the first fact the canonical closed that began after
    it (id, start), if any. Paris (Jan) arriving after Berlin (Feb) was closed by Paris (Mar) is not
    March's saying: Berlin came between. Merged, March's start moved back to January and Berlin's
    interval was ended at its own start (empty: as of February, only Paris answered)."""
    if decision.duplicate_of is None or decision.since is None:
        return None
    closed = session.execute(
        select(Fact.id, Fact.valid_from, Fact.context, Fact.created_at).where(
            Fact.superseded_by == decision.duplicate_of, Fact.status == SUPERSEDED
        )
    ).all()
    starts = [(began(old.valid_from, old.context, old.created_at), old.id) for old in closed]
    later = [(start, fact_id) for start, fact_id in starts if start > decision.since]
    if not later:
        return None
    start, fact_id = min(later)
    return fact_id, start


def _start_canonical_by(session: Session, canonical: int, since: datetime) -> None:
    """A duplicate said before its canonical began (it arrived later): the fact was true since then, so
    the canonical starts there (as of a time between the two, neither answered), and what it had closed
    ends there too (else both it and its successor answered in between)."""
    moved = session.execute(
        update(Fact)
        .where(Fact.id == canonical, func.coalesce(Fact.valid_from, Fact.created_at) > since)  # AS_OF_SQL's
        .values(valid_from=since)
        .returning(Fact.id)
    ).first()
    if moved is None:
        return
    session.execute(
        update(Fact)
        .where(Fact.superseded_by == canonical, Fact.status == SUPERSEDED, Fact.valid_to > since)
        .values(valid_to=func.greatest(since, func.coalesce(Fact.valid_from, since)))
    )


def _slot_into_chain(
    session: Session, new_id: int, start: datetime | None, newer_id: int
) -> list[tuple[int, Row]]:
    """A new fact said before the current one that closes it (it arrived late): what that fact had
    closed before, and was still true when the new one was said, now ends where the new one begins.
    Only the current facts are compared, so Paris (Jan, closed by Berlin in Mar) kept its March end
    when Lyon (Feb) came: as of Feb 15 both Paris and Lyon answered."""
    if start is None:
        return []
    earlier = session.execute(
        select(Fact.id, Fact.valid_from, Fact.context, Fact.created_at).where(
            Fact.superseded_by == newer_id,
            Fact.status == SUPERSEDED,
            Fact.id != new_id,
            Fact.valid_to > start,
        )
    ).all()
    rows: list[tuple[int, Row]] = []
    for old in earlier:
        since = began(old.valid_from, old.context, old.created_at)
        if since >= start:
            continue
        session.execute(
            update(Fact)
            .where(Fact.id == old.id)
            .values(superseded_by=new_id, valid_to=close_interval(since, start))
        )
        rows.append(
            (new_id, Row(old.id, "updates", "rule", SLOTTED_REASON.format(old=old.id, newer=newer_id)))
        )
    return rows


def _reopen_later_restatements(session: Session, closing: Supersession) -> list[tuple[int, Row]]:
    """A fact closed now (by one that arrived late) may have duplicates said after the closing, in
    earlier runs: each restates it once it had changed ("Paris" in June, after "Berlin" in March),
    so it is current again, as ``reopen_restatements`` decides within one run; as a duplicate of a
    closed fact it answered nothing."""
    closed_at = closing.newer.since
    if closed_at is None:
        return []
    duplicates = session.execute(
        select(Fact.id, Fact.valid_from, Fact.context, Fact.created_at).where(
            Fact.duplicate_of == closing.older.id, Fact.status == DUPLICATE
        )
    ).all()
    rows: list[tuple[int, Row]] = []
    for dup in duplicates:
        since = began(dup.valid_from, dup.context, dup.created_at)
        if since < closed_at:
            continue
        # Current and unconsolidated: decided again (the run's next round) against what is current now.
        session.execute(
            update(Fact)
            .where(Fact.id == dup.id)
            .values(status=CURRENT, duplicate_of=None, consolidated_at=None)
        )
        reason = RESTATED_REASON.format(old=closing.older.id, newer=closing.newer.id)
        rows.append((dup.id, Row(closing.older.id, "new", "rule", reason)))
    return rows


def _entity(entity_key: str) -> Any:
    slug, page = entity_key_filter(entity_key)
    if page is not None:
        return and_(Fact.entity_slug.is_(None), Fact.source_markdown_slug == page)
    return Fact.entity_slug == slug


def _orphaned() -> Any:
    # The partial index's own text (models.fact.ORPHANED_LINK_SQL), so the planner can use it.
    return text(ORPHANED_LINK_SQL)


def lock_checkpoint(session: Session, source_id: str, entity_key: str) -> bool:
    """Create the entity's checkpoint row if needed and hold it: one writer of an entity's decisions at
    a time (an erasure renaming the key waits for a commit in flight). True when this call created it."""
    created = session.scalars(
        pg_insert(ConsolidationCheckpoint)
        .values(source_id=source_id, entity_key=entity_key)
        .on_conflict_do_nothing()
        .returning(ConsolidationCheckpoint.source_id)
    ).all()
    session.execute(
        select(ConsolidationCheckpoint.source_id)
        .where(
            ConsolidationCheckpoint.source_id == source_id,
            ConsolidationCheckpoint.entity_key == entity_key,
        )
        .with_for_update()
    )
    return bool(created)


DROP_CHECKPOINT = text(
    "DELETE FROM consolidation_checkpoints WHERE source_id = :source_id AND entity_key = :key"
)


def _insert_rows(
    session: Session,
    source_id: str,
    entity_key: str,
    job_id: int | None,
    rows: Sequence[tuple[int, Row]],
    llm_call_id: int | None = None,
) -> None:
    if not rows:
        return
    session.execute(
        pg_insert(ConsolidationDecision),
        [
            {
                "job_id": job_id,
                "source_id": source_id,
                "entity_key": entity_key,
                "fact_id": fact_id,
                "other_fact_id": row.other_fact_id,
                "decision": row.decision,
                "decided_by": row.decided_by,
                "reason": row.reason,
                "similarity": row.similarity,
                "llm_call_id": llm_call_id if row.decided_by == "model" else None,
            }
            for fact_id, row in rows
        ],
    )


def orphaned_links_query(source_ids: Sequence[str] | BindParameter[Any]) -> Any:
    """The facts of these sources whose lifecycle link went (read through ix_facts_orphaned_links)."""
    return (
        select(Fact.source_id, Fact.entity_slug, Fact.source_markdown_slug)
        .where(Fact.source_id.in_(source_ids), _orphaned())
        .distinct()
    )


# Built once (this runs for every extracted page): Core on the table, not ORM-enabled (models.tables).
_PAGES_UNCONSOLIDATED = (
    select(FACTS.c.source_id, FACTS.c.entity_slug, FACTS.c.source_markdown_slug)
    .where(
        tuple_(FACTS.c.source_id, FACTS.c.source_markdown_slug).in_(bindparam("pages", expanding=True)),
        ~FACTS.c.is_audit,
        FACTS.c.consolidated_at.is_(None),
    )
    .distinct()
)
_ORPHANED_LINKS = orphaned_links_query(bindparam("sources", expanding=True))


def pending_entity_keys(session: Session, pages: Sequence[tuple[str, str]]) -> list[tuple[str, str]]:
    """(source id, entity key) for each entity these pages' extraction left to consolidate: those of
    their unconsolidated facts, and those of their sources' facts whose link went (re-extraction
    deleted the fact they pointed to). Two reads for all the pages: their new facts, their sources'
    orphans."""
    if not pages:
        return []
    new = session.execute(_PAGES_UNCONSOLIDATED, {"pages": list(pages)}).all()
    orphans = session.execute(
        _ORPHANED_LINKS, {"sources": sorted({source_id for source_id, _ in pages})}
    ).all()
    return sorted(
        {(row.source_id, entity_key(row.entity_slug, row.source_markdown_slug)) for row in (*new, *orphans)}
    )


def entity_key_sql(
    entity_slug: ColumnElement[str | None], page_slug: ColumnElement[str]
) -> ColumnElement[str]:
    """worker.core.consolidation.entity_key in SQL (a test holds the two to the same answers)."""
    return func.coalesce(func.nullif(entity_slug, ""), literal(PAGE_KEY_PREFIX) + page_slug)


def _forgotten() -> Select[Any]:
    """The unconsolidated facts of the last day stored before the grace, oldest first
    (ix_facts_unconsolidated), whose entity has no consolidation job pending nor requested since the fact
    was stored: the requests a dead worker's follow-up never made. A failed job requested after the fact
    covers it too (an operator's retry, not a new job every sweep), and a day bounds the scan. Covered
    facts are passed over before the limit (a backlog of queued or paused jobs filled a limit taken first,
    every sweep, and hid the lost)."""
    fact = FACTS.alias("f")
    key = entity_key_sql(fact.c.entity_slug, fact.c.source_markdown_slug)
    covered = (
        select(literal(1))
        .where(
            JOBS.c.kind == CONSOLIDATION,
            JOBS.c.subject == page_subject_sql(fact.c.source_id, key),
            or_(JOBS.c.status.in_(PENDING), JOBS.c.created_at >= fact.c.created_at),
        )
        .exists()
    )
    since = func.now() - func.make_interval(0, 0, 0, 0, 0, 0, bindparam("window", type_=Float))
    until = func.now() - func.make_interval(0, 0, 0, 0, 0, 0, bindparam("grace", type_=Float))
    scanned = (
        select(fact.c.source_id, fact.c.entity_slug, fact.c.source_markdown_slug)
        .where(fact.c.consolidated_at.is_(None), ~fact.c.is_audit)
        .where(fact.c.created_at < until, fact.c.created_at > since, ~covered)
        .order_by(fact.c.created_at)
        .limit(bindparam("scan", type_=Integer))
        .subquery()
    )
    return select(scanned).distinct()


_FORGOTTEN = _forgotten()
# A day's backlog of covered facts is read through; past this the sweep's step gives up until the next.
FORGOTTEN_READ_TIMEOUT = "5s"


def forgotten_entity_keys(
    session: Session, *, grace_seconds: float, window_seconds: float, scan: int
) -> list[tuple[str, str]]:
    """(source id, entity key) of the entities whose consolidation request was lost (``_FORGOTTEN``);
    none when the read takes longer than FORGOTTEN_READ_TIMEOUT (a huge backlog: logged)."""
    params = {"grace": grace_seconds, "window": window_seconds, "scan": scan}
    try:
        with session.begin_nested():
            session.execute(text(f"SET LOCAL statement_timeout = '{FORGOTTEN_READ_TIMEOUT}'"))
            rows = session.execute(_FORGOTTEN, params).all()
            session.execute(text("SET LOCAL statement_timeout = DEFAULT"))
    except DBAPIError as exc:
        if not statement_timed_out(exc):
            raise
        logger.warning(
            "the consolidation catch-up read took over %s; tried again next sweep", FORGOTTEN_READ_TIMEOUT
        )
        return []
    return sorted({(row.source_id, entity_key(row.entity_slug, row.source_markdown_slug)) for row in rows})


def unconsolidated_entity_keys(session: Session, source_id: str) -> list[str]:
    """Every entity of the source with facts not yet consolidated (a backfill's work list)."""
    rows = session.execute(
        select(Fact.entity_slug, Fact.source_markdown_slug)
        .where(Fact.source_id == source_id, ~Fact.is_audit, Fact.consolidated_at.is_(None))
        .distinct()
    ).all()
    return sorted({entity_key(row.entity_slug, row.source_markdown_slug) for row in rows})
