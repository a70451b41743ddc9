"""Consolidation's reads and writes; decisions commit in chunks (service.DECISIONS_PER_COMMIT), each
with its fact marked, its effect, its audit row and the entity checkpoint advanced, so each is
committed exactly once."""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Mapping, Sequence
from datetime import timedelta
from typing import Any

from sqlalchemy import (
    BigInteger,
    BindParameter,
    ColumnElement,
    Float,
    Integer,
    Select,
    Text,
    and_,
    any_,
    bindparam,
    cast,
    func,
    literal,
    or_,
    select,
    text,
    tuple_,
    update,
)
from sqlalchemy.dialects.postgresql import ARRAY
from sqlalchemy.dialects.postgresql import insert as pg_insert
from sqlalchemy.exc import DBAPIError
from sqlalchemy.orm import Session, sessionmaker

from models import ConsolidationCheckpoint, Fact
from models.fact import ORPHANED_LINK_SQL, existing_fact_ids
from models.packed import unpack_floats
from models.reads import read_only
from models.tables import FACTS, JOBS
from worker.accounting import Ledger, LLMCallRecord
from worker.consolidation.decisions import insert_rows, write_decision
from worker.core.consolidation import (
    CURRENT,
    PAGE_KEY_PREFIX,
    FactView,
    entity_key,
    entity_key_filter,
    order_key,
    said_at,
)
from worker.core.consolidation_plan import Resolved, Row
from worker.db import made_again_on_deadlock, statement_timed_out
from worker.jobs.outbox import CONSOLIDATION, PENDING, page_subject_sql

logger = logging.getLogger(__name__)
ENTITY_FACTS_BATCH = 1_000  # rows fetched at a time while an entity's facts are read
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
        Fact.embedding_model,
        Fact.context,
        Fact.created_at,
    )
    .where(~Fact.is_audit)
    .order_by(Fact.id)
    .execution_options(yield_per=ENTITY_FACTS_BATCH)
)


# The pending facts listed light (no text, no vector), to pick a round's facts before reading them whole.
_PENDING_LIST = (
    select(Fact.id, Fact.kind, Fact.valid_from, Fact.context, Fact.created_at, Fact.embedding_model)
    .where(~Fact.is_audit, Fact.consolidated_at.is_(None))
    .order_by(Fact.id)
)


def _listed_order(row: Any) -> tuple[float, int]:
    """A listed pending fact's place in order_key's order (when it became true, then arrival)."""
    said = said_at(row.context, row.created_at)
    return order_key(FactView(row.id, "", row.kind, row.valid_from, None, row.id, said))


def _view(row: Any, model: str | None) -> FactView:
    """The rules' view of a fact row; its vector only when ``model`` (the pending facts' embedding
    model) made it, or either is unknown: vectors of two models are not comparable (after a change of
    model, near-random cosines ranked the candidates until `factmill embed --reembed`)."""
    comparable = row.embedding_model is None or model is None or row.embedding_model == model
    vector = unpack_floats(row.embedding) if row.embedding is not None and comparable else None
    said = said_at(row.context, row.created_at)
    return FactView(row.id, row.fact, row.kind, row.valid_from, vector or None, row.id, said)


# Decisions committed together, each with the llm_calls rows its pairs' answers came from, by pair number.
DecisionRun = Sequence[tuple[Resolved, Mapping[int, int] | None]]


class ConsolidationStore:
    """Owns its transactions: every method opens its own session (``factory.begin()`` for writes)."""

    def __init__(
        self, factory: sessionmaker[Session], ledger: Ledger, *, defer_unembedded_seconds: float | None = None
    ) -> None:
        self._factory = factory
        self._ledger = ledger
        # Facts stored this recently without a vector are left for a later run (their page's follow-up
        # embeds them, then asks for the entity again): decided now, they were compared by their words
        # only ("moved to Porto" and "lives in Lisbon" shared none: both kept current, for good).
        self._defer_unembedded = defer_unembedded_seconds
        self.deferred = 0  # the facts the last round's listing left for their vectors

    def entity_facts(self, source_id: str, entity_key: str) -> tuple[list[FactView], list[FactView]]:
        """(the entity's unconsolidated facts, to decide; its current facts of the same kinds, to decide
        them against), each in arrival order, audit rows excluded (``entity_round`` with no limit)."""
        _, pending, pool = self.entity_round(source_id, entity_key, None)
        return pending, pool

    def entity_round(
        self, source_id: str, entity_key: str, limit: int | None
    ) -> tuple[set[int], list[FactView], list[FactView]]:
        """(the ids of every unconsolidated fact of the entity (but those deferred for their vectors);
        the first ``limit`` of them by when they
        became true, to decide now (all, in arrival order, with no limit); the current facts of their
        kinds, to decide them against). Other kinds are never compared, so they are not read, and
        nothing is when nothing is pending. The pending facts are listed without their text and
        vectors first: each round read every pending fact whole (a backfill's 200,000 on one entity,
        vectors included) to decide 500 of them. Streamed, each vector kept as an array of doubles."""
        mine = _ENTITY_FACTS.where(Fact.source_id == source_id, unit_facts(entity_key))
        # A server-side cursor needs a transaction (not read_only's autocommit); closing rolls it back.
        with self._factory() as session:
            listing = _PENDING_LIST.where(Fact.source_id == source_id, unit_facts(entity_key))
            if self._defer_unembedded is None:
                listed = session.execute(listing).all()
            else:
                fresh = func.now() - timedelta(seconds=self._defer_unembedded)
                waits = and_(Fact.embedding.is_(None), Fact.created_at >= fresh).label("waits")
                rows = session.execute(listing.add_columns(waits)).all()
                listed = [row for row in rows if not row.waits]
                self.deferred = len(rows) - len(listed)
            if not listed:
                return set(), [], []
            # The model most of them were embedded by (None: none was): another model's vectors are
            # left out of the comparisons.
            models = Counter(row.embedding_model for row in listed if row.embedding_model is not None)
            model = models.most_common(1)[0][0] if models else None
            chosen = listed if limit is None else sorted(listed, key=_listed_order)[:limit]
            ids = bindparam("ids", [row.id for row in chosen], type_=ARRAY(BigInteger))
            which = Fact.consolidated_at.is_(None) if limit is None else Fact.id == any_(ids)
            pending = [_view(row, model) for row in session.execute(mine.where(which))]
            if limit is not None:
                pending.sort(key=order_key)
            decided = mine.where(
                Fact.consolidated_at.is_not(None),
                Fact.status == CURRENT,
                Fact.kind.in_(sorted({row.kind for row in chosen})),
            )
            pool = [_view(row, model) for row in session.execute(decided)]
            return {row.id for row in listed}, pending, pool

    def repair_orphans(self, source_id: str, entity_key: str, job_id: int | None) -> int:
        """Facts marked duplicate or superseded whose link went (the other fact was re-extracted or
        erased) become current and unconsolidated again, each with an audit row; returns how many.
        Made again when Postgres ends it to break a deadlock (it updates many facts in one statement)."""
        return made_again_on_deadlock(self._repair_orphans, source_id, entity_key, job_id)

    def _repair_orphans(self, source_id: str, entity_key: str, job_id: int | None) -> int:
        with self._factory.begin() as session:
            # An operator's undo, an erasure: one at a time. A checkpoint made only for this (an entity an
            # erasure just took away) goes again: it would keep the erased name.
            created = lock_checkpoint(session, source_id, entity_key)
            ids = session.scalars(
                update(Fact)
                .where(Fact.source_id == source_id, unit_facts(entity_key), _orphaned())
                .values(status=CURRENT, valid_to=None, consolidated_at=None)
                .returning(Fact.id)
            ).all()
            if created and not ids:
                session.execute(DROP_CHECKPOINT, {"source_id": source_id, "key": entity_key})
            rows = [(i, Row(None, "restore", "rule", ORPHAN_REASON)) for i in ids]
            insert_rows(session, source_id, entity_key, job_id, rows)
        return len(ids)

    def existing(self, fact_ids: set[int]) -> set[int]:
        """Which of ``fact_ids`` still exist (an erasure or a re-extraction removes facts mid-run)."""
        with read_only(self._factory) as session:
            return existing_fact_ids(session, fact_ids)

    def record_call(self, call: LLMCallRecord, *, erased: bool = False) -> int:
        """The batched call's llm_calls row (committed at once: it was paid for whatever follows);
        ``erased``: facts it was sent went meanwhile, so no provider message is kept."""
        with self._factory.begin() as session:
            return self._ledger.record_many(session, [call], erased=erased)[0]

    def commit_decisions(
        self,
        source_id: str,
        entity_key: str,
        job_id: int | None,
        decisions: DecisionRun,
    ) -> list[bool | None]:
        """One transaction for a run of decisions (each with the llm_calls rows its pairs' answers came
        from, by pair number): the
        entity's checkpoint row locked, then per decision the new fact marked consolidated (only if it
        was not: False for it and nothing of it written), its effect (duplicate link, intervals
        closed) and its audit rows; the checkpoint advanced by the decisions written. A decision naming
        a fact an erasure or a re-extraction removed since it was planned is not written (None): its
        link would fail the foreign key, and with it the other decisions of the transaction.

        Made again when Postgres ends it to break a deadlock (a vector fill updates the facts in its own
        order): the answers it writes were paid for, and a failed job asked for them again."""
        return made_again_on_deadlock(self._commit_decisions_once, source_id, entity_key, job_id, decisions)

    def _commit_decisions_once(
        self, source_id: str, entity_key: str, job_id: int | None, decisions: DecisionRun
    ) -> list[bool | None]:
        """One try of ``commit_decisions``: everything it does is in its transaction."""
        done: list[bool | None] = []
        with self._factory.begin() as session:
            created = lock_checkpoint(session, source_id, entity_key)
            present = _hold_facts(session, {i for decision, _ in decisions for i in decision.fact_ids})
            for decision, call_ids in decisions:
                if not decision.fact_ids <= present:
                    done.append(None)  # a fact it names went meanwhile: the next round decides it again
                    continue
                done.append(write_decision(session, source_id, entity_key, job_id, decision, call_ids))
            # Decisions written (a fact left to decide again is written, and counted, twice).
            written = [d.fact_id for (d, _), ok in zip(decisions, done, strict=True) if ok]
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


def unit_facts(entity_key: str) -> Any:
    """The facts of a consolidation unit: an entity's, or (page:SLUG) a page's without one."""
    slug, page = entity_key_filter(entity_key)
    if page is not None:
        return and_(Fact.entity_slug.is_(None), Fact.source_markdown_slug == page)
    return Fact.entity_slug == slug


def _orphaned() -> Any:
    # The partial index's own text (models.fact.ORPHANED_LINK_SQL), so the planner can use it. Bracketed:
    # a text clause is not grouped in an AND, and the OR inside escaped every filter beside it.
    return text(f"({ORPHANED_LINK_SQL})")


def _hold_facts(session: Session, fact_ids: set[int]) -> set[int]:
    """Which of ``fact_ids`` still exist, each held (FOR KEY SHARE) until the commit: a delete waits
    for the decisions that link to it, and a decision never links to a fact deleted meanwhile."""
    if not fact_ids:
        return set()
    held = (
        select(Fact.id)
        .where(Fact.id == any_(bindparam("ids", sorted(fact_ids), type_=ARRAY(BigInteger))))
        .order_by(Fact.id)
        .with_for_update(read=True, key_share=True)
    )
    return set(session.scalars(held))


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


def orphaned_links_query(source_ids: Sequence[str] | BindParameter[Any]) -> Any:
    """The facts of these sources whose lifecycle link went (read through ix_facts_orphaned_links)."""
    return (
        select(Fact.source_id, Fact.entity_slug, Fact.source_markdown_slug)
        .where(Fact.source_id.in_(source_ids), _orphaned())
        .distinct()
    )


# Built once (this runs for every extracted page): Core on the table, not ORM-enabled (models.tables).
# The pages as two array parameters: a tuple IN list took two parameters a page, and past 32,767 pages
# (a backfill pass's) the driver refused the query, after the pass's facts had committed.
_PAGES = (
    func.unnest(cast(bindparam("sources"), ARRAY(Text)), cast(bindparam("slugs"), ARRAY(Text)))
    .table_valued("source_id", "slug")
    .render_derived()
)
_PAGES_UNCONSOLIDATED = (
    select(FACTS.c.source_id, FACTS.c.entity_slug, FACTS.c.source_markdown_slug)
    .where(
        tuple_(FACTS.c.source_id, FACTS.c.source_markdown_slug).in_(
            select(_PAGES.c.source_id, _PAGES.c.slug)
        ),
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
    sources, slugs = [source for source, _ in pages], [slug for _, slug in pages]
    new = session.execute(_PAGES_UNCONSOLIDATED, {"sources": sources, "slugs": slugs}).all()
    keys = {(row.source_id, entity_key(row.entity_slug, row.source_markdown_slug)) for row in new}
    return sorted(keys | set(orphaned_entity_keys(session, sources)))


def entity_key_sql(
    entity_slug: ColumnElement[str | None], page_slug: ColumnElement[str]
) -> ColumnElement[str]:
    """worker.core.consolidation.entity_key in SQL (a test holds the two to the same answers)."""
    return func.coalesce(func.nullif(entity_slug, ""), literal(PAGE_KEY_PREFIX) + page_slug)


def _forgotten() -> Select[Any]:
    """The unconsolidated facts of the last day stored before the grace, oldest first
    (ix_facts_unconsolidated), whose entity has no consolidation job pending nor requested a grace or
    more after the fact was stored: the requests a dead worker's follow-up never made. A failed job
    requested then covers it too (an operator's retry, not a new job every sweep), and a day bounds the
    scan. Covered
    facts are passed over before the limit (a backlog of queued or paused jobs filled a limit taken first,
    every sweep, and hid the lost)."""
    fact = FACTS.alias("f")
    key = entity_key_sql(fact.c.entity_slug, fact.c.source_markdown_slug)
    grace = func.make_interval(0, 0, 0, 0, 0, 0, bindparam("grace", type_=Float))
    # A job requested within the grace may have passed the fact over (stored without its vector yet:
    # ConsolidationStore's defer_unembedded_seconds): only a later one covers it.
    covered = (
        select(literal(1))
        .where(
            JOBS.c.kind == CONSOLIDATION,
            JOBS.c.subject == page_subject_sql(fact.c.source_id, key),
            or_(JOBS.c.status.in_(PENDING), JOBS.c.created_at >= fact.c.created_at + grace),
        )
        .exists()
    )
    since = func.now() - func.make_interval(0, 0, 0, 0, 0, 0, bindparam("window", type_=Float))
    until = func.now() - grace
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


def orphaned_entity_keys(session: Session, source_ids: Sequence[str]) -> list[tuple[str, str]]:
    """(source id, entity key) of these sources' facts whose lifecycle link went (ix_facts_orphaned_links)."""
    if not source_ids:
        return []
    rows = session.execute(_ORPHANED_LINKS, {"sources": sorted(set(source_ids))}).all()
    return sorted({(row.source_id, entity_key(row.entity_slug, row.source_markdown_slug)) for row in rows})


def unconsolidated_entity_keys(session: Session, source_id: str | None) -> list[tuple[str, str]]:
    """(source id, entity key) of every entity of the source (of every source when None) with facts not
    yet consolidated, or whose link went (a backfill's or an operator's work list: an orphan's request
    lost with its page's follow-up was found by neither)."""
    query = select(Fact.source_id, Fact.entity_slug, Fact.source_markdown_slug).where(
        ~Fact.is_audit, Fact.consolidated_at.is_(None)
    )
    if source_id is not None:
        query = query.where(Fact.source_id == source_id)
    rows = session.execute(query.distinct()).all()
    keys = {(row.source_id, entity_key(row.entity_slug, row.source_markdown_slug)) for row in rows}
    sources = (
        [source_id] if source_id is not None else list(session.scalars(select(Fact.source_id).distinct()))
    )
    return sorted(keys | set(orphaned_entity_keys(session, sources)))
