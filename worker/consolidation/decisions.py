"""One consolidation decision written: the fact marked (duplicate, superseded or current), its effects on
the entity's other facts (a canonical's start, intervals closed, a chain slotted into, restatements
reopened) and its audit rows, in the caller's transaction (``ConsolidationStore.commit_decisions``)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import Any

from sqlalchemy import Select, func, select, update
from sqlalchemy.dialects.postgresql import insert as pg_insert
from sqlalchemy.orm import Session

from models import ConsolidationDecision, Fact
from worker.core.consolidation import (
    CURRENT,
    DUPLICATE,
    SUPERSEDED,
    Supersession,
    began,
    close_interval,
    segment_start,
)
from worker.core.consolidation_plan import EARLIER_SAYING_REASON, RESTATED_REASON, Resolved, Row

SLOTTED_REASON = (
    "rule: said between fact {old} and fact {newer}, which had closed it: fact {old} now ends where this "
    "one begins"
)


def write_decision(
    session: Session,
    source_id: str,
    entity_key: str,
    job_id: int | None,
    decision: Resolved,
    call_ids: Mapping[int, int] | None,
) -> bool:
    values: dict[str, Any] = {"consolidated_at": None if decision.reconsider else func.now()}
    if decision.since is not None:
        # An undated fact begins when it was said (its segment's time), as the rules here read it: the
        # as-of reads took the time it was stored, so a backfilled fact (said in 2024, stored in 2026)
        # closed by a later saying ended before it began, and was never true as of any moment.
        values["valid_from"] = func.coalesce(Fact.valid_from, decision.since)
    rows = [(decision.fact_id, row) for row in decision.rows]
    canonical = decision.duplicate_of if decision.duplicate_of is not None else decision.restates
    changed = _first_change(session, decision, canonical)
    if changed is not None:  # said before a fact its canonical closed: not the canonical's saying
        changed_id, changed_at = changed
        values.update(status=SUPERSEDED, superseded_by=changed_id, valid_to=changed_at)
        reason = EARLIER_SAYING_REASON.format(canonical=canonical, changed=changed_id)
        rows = [(fact_id, row) for fact_id, row in rows if row.decided_by == "model"]  # the model's verdicts
        rows.append((decision.fact_id, Row(canonical, "new", "rule", reason)))
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
    if changed is not None and canonical is not None:
        # What was still true when it was said ends where it begins: a fact the changed one closed, or
        # one the canonical closed (before this run's changes, the canonical closed what they now close).
        for newer in dict.fromkeys((changed[0], canonical)):
            rows += _slot_into_chain(session, decision.fact_id, decision.since, newer)
    elif decision.duplicate_of is not None and decision.since is not None:
        _start_canonical_by(session, decision.duplicate_of, decision.since)
    for closing in decision.closings if decision.restates is None else ():  # a split's: applied above
        # A fact closed is decided: one left to decide again (reopened earlier in this run) is not
        # planned again as if it were current.
        session.execute(
            update(Fact)
            .where(Fact.id == closing.older.id, Fact.status == CURRENT)
            .values(
                status=SUPERSEDED,
                superseded_by=closing.newer.id,
                valid_from=func.coalesce(Fact.valid_from, closing.older.since),  # see write_decision
                valid_to=closing.valid_to,
                consolidated_at=func.coalesce(Fact.consolidated_at, func.now()),
            )
        )
        if closing.older.id == decision.fact_id:
            rows += _slot_into_chain(session, closing.older.id, closing.older.since, closing.newer.id)
        else:
            rows += _reopen_later_restatements(session, closing)
    insert_rows(session, source_id, entity_key, job_id, rows, call_ids)
    return True


def _first_change(session: Session, decision: Resolved, canonical: int | None) -> tuple[int, datetime] | None:
    """For a saying of ``canonical`` said before it: the first fact that changed it since (id, start),
    if any: one the canonical closed that began after it, or (a split) the one this run closes it by.
    Paris (Jan) arriving after Berlin (Feb) was closed by Paris (Mar) is not March's saying: Berlin came
    between. Merged, March's start moved back to January and Berlin's interval was ended at its own
    start (empty: as of February, only Paris answered)."""
    since = decision.since
    if canonical is None or since is None:
        return None
    closed = session.execute(
        select(Fact.id, Fact.valid_from, Fact.context, Fact.created_at).where(
            Fact.superseded_by == canonical, Fact.status == SUPERSEDED
        )
    ).all()
    starts = [(began(old.valid_from, old.context, old.created_at), old.id) for old in closed]
    if decision.restates is not None:
        starts += [(c.newer.since, c.newer.id) for c in decision.closings if c.newer.since is not None]
    later = [(start, fact_id) for start, fact_id in starts if start > since]
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


def restart_canonicals(session: Session, leaving: Select[Any]) -> bool:
    """In the caller's transaction, before duplicates leave for good (erased with their page, dropped
    from a page left with nothing to say, unmerged; not re-extracted: see ``forget_reasons_about``): a
    canonical one of them had started earlier (``_start_canonical_by``) starts again at the
    earliest of its own saying and the sayings still merged into it, and what it had closed ends there
    again. Left moved, a page gone (even erased) kept answering as-of reads through another fact's
    start, and kept the facts that canonical closed cut short.

    A canonical closed before that start (by a fact said between the gone saying and its own) was
    closed on the moved start: what it had closed ends where it was closed, and it is left orphaned
    (its link cleared), so its entity's next run decides it again by its own date (the erasure and
    the page's extraction job request that run for their sources' orphans, an unmerge for its entity).
    Returns whether one was orphaned."""
    leaves = Fact.id.in_(leaving)
    canonicals = session.execute(
        select(Fact.id, Fact.valid_from, Fact.context)
        .where(Fact.id.in_(select(Fact.duplicate_of).where(leaves, Fact.status == DUPLICATE)), ~leaves)
        .order_by(Fact.id)
    ).all()
    starts: list[tuple[datetime, int]] = []
    for canonical in canonicals:
        own = segment_start(canonical.context)
        if own is None or canonical.valid_from is None or canonical.valid_from >= own:
            continue  # never moved (a start from anywhere but its segment is not known to be its own)
        sayings = session.execute(
            select(Fact.valid_from, Fact.context, Fact.created_at).where(
                Fact.duplicate_of == canonical.id, Fact.status == DUPLICATE, ~leaves
            )
        ).all()
        start = min([own, *(began(d.valid_from, d.context, d.created_at) for d in sayings)])
        if start > canonical.valid_from:
            starts.append((start, canonical.id))
    orphaned = False
    for start, canonical_id in _closers_first(session, starts):
        status, valid_to = session.execute(
            select(Fact.status, Fact.valid_to).where(Fact.id == canonical_id)
        ).one()
        ends = start  # where what it closed ends now
        values: dict[str, Any] = {"valid_from": start}
        if status == SUPERSEDED and valid_to is not None and valid_to < start:
            ends = valid_to
            values.update(valid_to=start, superseded_by=None)  # empty until decided again (an orphan)
            orphaned = True
        session.execute(update(Fact).where(Fact.id == canonical_id).values(**values))
        session.execute(
            update(Fact)
            .where(Fact.superseded_by == canonical_id, Fact.status == SUPERSEDED, Fact.valid_to < ends)
            .values(valid_to=func.greatest(ends, func.coalesce(Fact.valid_from, ends)))
        )
    return orphaned


def _closers_first(session: Session, starts: list[tuple[datetime, int]]) -> list[tuple[datetime, int]]:
    """``starts`` (new start, canonical) ordered so that a canonical comes after the one that closed it,
    when both move: one page's two sayings can have moved two canonicals of one chain, and the closed
    one's end is its closer's start, moved back with it; read before its closer's restart, it was taken
    for a closing before its own start, on a date only the gone saying said. By date instead of by
    link, a closer restarted to the earlier date came second. (Links form a forest: no cycles.)"""
    closers = dict(
        session.execute(select(Fact.id, Fact.superseded_by).where(Fact.id.in_([c for _, c in starts]))).all()
    )
    waiting = {canonical: start for start, canonical in starts}
    ordered: list[tuple[datetime, int]] = []
    while waiting:
        ready = sorted(c for c in waiting if closers.get(c) not in waiting) or sorted(waiting)
        ordered += [(waiting.pop(c), c) for c in ready]
    return ordered


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
        # It ends earlier now: what restated it after this end restates it once it had changed.
        rows += _reopen_restatements_after(session, old.id, new_id, start)
    return rows


def _reopen_later_restatements(session: Session, closing: Supersession) -> list[tuple[int, Row]]:
    return _reopen_restatements_after(session, closing.older.id, closing.newer.id, closing.newer.since)


def _reopen_restatements_after(
    session: Session, older_id: int, newer_id: int, closed_at: datetime | None
) -> list[tuple[int, Row]]:
    """A fact closed now (by one that arrived late) may have duplicates said after the closing, in
    earlier runs: each restates it once it had changed ("Paris" in June, after "Berlin" in March),
    so it is current again, as ``reopen_restatements`` decides within one run; as a duplicate of a
    closed fact it answered nothing."""
    if closed_at is None:
        return []
    duplicates = session.execute(
        select(Fact.id, Fact.valid_from, Fact.context, Fact.created_at).where(
            Fact.duplicate_of == older_id, Fact.status == DUPLICATE
        )
    ).all()
    rows: list[tuple[int, Row]] = []
    for dup in duplicates:
        since = began(dup.valid_from, dup.context, dup.created_at)
        # Ties broken by arrival, as the planner breaks them (order_key): a segment's facts share one
        # start, and a restatement said before the change in the same segment came back current, then
        # closed the change at its own start (an empty interval: no read returned it again).
        if (since, dup.id) < (closed_at, newer_id):
            continue
        # Current and unconsolidated: decided again (the run's next round) against what is current now.
        session.execute(
            update(Fact)
            .where(Fact.id == dup.id)
            .values(status=CURRENT, duplicate_of=None, consolidated_at=None)
        )
        reason = RESTATED_REASON.format(old=older_id, newer=newer_id)
        rows.append((dup.id, Row(older_id, "new", "rule", reason)))
    return rows


def insert_rows(
    session: Session,
    source_id: str,
    entity_key: str,
    job_id: int | None,
    rows: Sequence[tuple[int, Row]],
    call_ids: Mapping[int, int] | None = None,
) -> None:
    """The audit rows; a model row names the llm_calls row that answered its own pair (``call_ids`` by
    pair number): a fact's pairs may be answered by several calls (across a question's boundary, in
    the halves of a cut-off or refused one, a skipped pair asked alone), and each row named the first."""
    if not rows:
        return
    answered_by = call_ids or {}
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
                "llm_call_id": answered_by.get(row.pair) if row.pair is not None else None,
            }
            for fact_id, row in rows
        ],
    )


__all__ = ["SLOTTED_REASON", "insert_rows", "restart_canonicals", "write_decision"]
