"""The operators' side of the lifecycle: an entity's timeline, and undoing a decision (unmerge a
duplicate, restore a superseded fact), each undo recorded as an audit row."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from typing import Any

from sqlalchemy import BigInteger, ColumnElement, Select, any_, bindparam, func, select, union, update
from sqlalchemy.dialects.postgresql import ARRAY
from sqlalchemy.orm import Session

from models import ConsolidationDecision, Fact
from worker.consolidation import BUDGET_RENEW_SECONDS
from worker.consolidation.decisions import restart_canonicals
from worker.consolidation.store import lock_checkpoint, unit_facts
from worker.core.consolidation import CURRENT, DUPLICATE, SUPERSEDED, entity_key
from worker.core.facts import entity_slug
from worker.jobs.outbox import CONSOLIDATION, page_subject, request_job

CLOSING = ("updates", "contradicts")


class UndoError(ValueError):
    """The fact cannot be unmerged or restored; the message says why and what to do."""


@dataclass(frozen=True)
class TimelineEntry:
    id: int
    fact: str
    kind: str
    status: str
    valid_from: datetime | None
    valid_to: datetime | None
    superseded_by: int | None
    duplicate_of: int | None
    page_slug: str
    reason: str | None  # the latest decision's reason about this fact


def entities_named(session: Session, name: str, limit: int = 5) -> list[str]:
    """Entity slugs whose last part is ``name`` read with the slug rule (``priya-raman`` finds
    people/priya-raman): what a reader who typed a bare name probably meant."""
    slug = entity_slug(name)
    if slug is None:
        return []
    last = slug.rsplit("/", 1)[-1]
    query = (
        select(Fact.entity_slug)
        .where(Fact.entity_slug.endswith("/" + last, autoescape=True), ~Fact.is_audit)
        .distinct()
        .order_by(Fact.entity_slug)
        .limit(limit)
    )
    return [s for s in session.scalars(query) if s and s != slug]


def entity_timeline(
    session: Session, entity: str, source_ids: list[str] | None = None, *, limit: int | None = None
) -> list[TimelineEntry]:
    """Every fact about ``entity`` (its slug, or a name the slug rule turns into it), in the order they
    became true, each with its latest decision; with ``limit``, the latest that many (an entity of
    200,000 facts was read and printed whole)."""
    where = [Fact.entity_slug == (entity_slug(entity) or entity), ~Fact.is_audit]
    if source_ids is not None:
        where.append(Fact.source_id.in_(source_ids))
    # The columns shown only (a fact's embedding is 256 floats, parsed one by one), and the decisions
    # by a subquery: a list of the ids bound two parameters a fact, past the protocol's 65,535 at
    # about 33,000 facts ("cannot reach the database").
    columns = select(*_TIMELINE_COLUMNS)
    if limit is None:
        facts = list(
            session.execute(columns.where(*where).order_by(Fact.valid_from.asc().nulls_first(), Fact.id))
        )
    else:
        # Two reads bounded by the limit, in the order of ix_facts_entity_timeline (the latest dated, then
        # if they are fewer the latest undated): one ordered NULLS LAST read and sorted the whole entity.
        dated = columns.where(*where, Fact.valid_from.is_not(None)).order_by(
            Fact.valid_from.desc(), Fact.id.desc()
        )
        latest = list(session.execute(dated.limit(limit)))
        if len(latest) < limit:
            undated = columns.where(*where, Fact.valid_from.is_(None)).order_by(Fact.id.desc())
            latest += session.execute(undated.limit(limit - len(latest)))
        facts = latest[::-1]
    reasons: dict[int, str] = {}
    if facts:
        closed_by = {row.id: row.superseded_by for row in facts}
        ids = bindparam("shown", [row.id for row in facts], type_=ARRAY(BigInteger))  # one parameter
        shown = where if limit is None else [*where, Fact.id == any_(ids)]
        for fact_id, other_id, decision, reason in session.execute(_decisions_about(shown)):
            # What changed the fact: the decision that superseded it (recorded on the newer fact's row),
            # else its own latest decision other than "unrelated". A verdict closes whichever of the two
            # became true first: a late fact "updating" a later one is itself closed, and the later one's
            # reason stays its own.
            closer = fact_id is not None and closed_by.get(other_id) == fact_id  # (a deleted one closes none)
            if decision in CLOSING and other_id is not None and closer:
                reasons[other_id] = reason
            if fact_id is not None and (decision != "unrelated" or fact_id not in reasons):
                reasons[fact_id] = reason
    return [TimelineEntry(*row, reasons.get(row.id)) for row in facts]


def _decisions_about(where: list[ColumnElement[bool]]) -> Select[Any]:
    """The decisions on the facts ``where`` selects, and the closing ones naming them, oldest first: two
    branches of one UNION, each on its column's index (an OR of the two IN lists scanned the table)."""
    ids = select(Fact.id).where(*where).scalar_subquery()
    columns = (
        ConsolidationDecision.id,
        ConsolidationDecision.fact_id,
        ConsolidationDecision.other_fact_id,
        ConsolidationDecision.decision,
        ConsolidationDecision.reason,
    )
    on_them = select(*columns).where(ConsolidationDecision.fact_id.in_(ids))
    closing_them = select(*columns).where(
        ConsolidationDecision.other_fact_id.in_(ids), ConsolidationDecision.decision.in_(CLOSING)
    )
    both = union(on_them, closing_them).subquery()
    return select(both.c.fact_id, both.c.other_fact_id, both.c.decision, both.c.reason).order_by(both.c.id)


_TIMELINE_COLUMNS = (
    Fact.id,
    Fact.fact,
    Fact.kind,
    Fact.status,
    Fact.valid_from,
    Fact.valid_to,
    Fact.superseded_by,
    Fact.duplicate_of,
    Fact.source_markdown_slug,
)


def _locked(session: Session, fact_id: int) -> Fact:
    """The fact, locked after its entity's checkpoint: one writer of an entity's lifecycle at a time
    (a consolidation committing a round, an erasure renaming its decisions), taken in their order."""
    where = (Fact.id == fact_id, ~Fact.is_audit)
    found = session.execute(
        select(Fact.source_id, Fact.entity_slug, Fact.source_markdown_slug).where(*where)
    ).first()
    if found is not None:
        lock_checkpoint(session, found.source_id, entity_key(found.entity_slug, found.source_markdown_slug))
    fact = session.scalars(select(Fact).where(*where).with_for_update()).one_or_none()
    if fact is None:
        raise UndoError(
            f"there is no fact {fact_id}; `factmill facts history ENTITY` lists an entity's facts"
        )
    return fact


def _record(session: Session, fact: Fact, other: int | None, decision: str, by: str) -> None:
    session.add(
        ConsolidationDecision(
            source_id=fact.source_id,
            entity_key=entity_key(fact.entity_slug, fact.source_markdown_slug),
            fact_id=fact.id,
            other_fact_id=other,
            decision=decision,
            decided_by="operator",
            reason=f"operator: {decision} by {by}",
        )
    )


def unmerge(session: Session, fact_id: int, by: str) -> int | None:
    """In the caller's transaction: a duplicate becomes a current fact of its own again (and stays
    consolidated, so it is not merged again); returns the fact it had duplicated (None: one since
    deleted, its link gone)."""
    fact = _locked(session, fact_id)
    if fact.status != DUPLICATE:
        raise UndoError(f"fact {fact_id} is {fact.status}, not a duplicate: only duplicates are unmerged")
    other = fact.duplicate_of
    if restart_canonicals(session, select(Fact.id).where(Fact.id == fact_id)):
        # A canonical left to be decided again: its entity's run, sent by the sweeper within seconds.
        key = entity_key(fact.entity_slug, fact.source_markdown_slug)
        request_job(
            session,
            CONSOLIDATION,
            page_subject(fact.source_id, key),
            renew_spent_budget_after=BUDGET_RENEW_SECONDS,  # as every request for new work on it is
        )
    session.execute(update(Fact).where(Fact.id == fact_id).values(status=CURRENT, duplicate_of=None))
    _record(session, fact, other, "unmerge", by)
    return other


def restore(session: Session, fact_id: int, by: str) -> int | None:
    """In the caller's transaction: a superseded fact is current again (its interval reopened);
    returns the fact that had superseded it (None: one since deleted)."""
    fact = _locked(session, fact_id)
    if fact.status != SUPERSEDED:
        raise UndoError(
            f"fact {fact_id} is {fact.status}, not superseded: only superseded facts are restored "
            "(a duplicate is unmerged)"
        )
    other = fact.superseded_by
    session.execute(
        update(Fact).where(Fact.id == fact_id).values(status=CURRENT, superseded_by=None, valid_to=None)
    )
    _record(session, fact, other, "restore", by)
    return other


def count_entity_facts(session: Session, entity: str, source_ids: list[str] | None = None) -> int:
    """How many facts ``entity_timeline`` would list without a limit."""
    where = [Fact.entity_slug == (entity_slug(entity) or entity), ~Fact.is_audit]
    if source_ids is not None:
        where.append(Fact.source_id.in_(source_ids))
    return session.scalar(select(func.count()).select_from(Fact).where(*where)) or 0


def unit_has_facts(session: Session, source_id: str, key: str) -> bool:
    """Whether the consolidation unit ``key`` (an entity, or page:SLUG) has a fact in ``source_id``."""
    facts = select(Fact.id).where(Fact.source_id == source_id, ~Fact.is_audit, unit_facts(key))
    return bool(session.scalar(select(facts.exists())))
