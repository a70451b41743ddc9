"""Fact lifecycle: duplicates merged, superseded facts closed, history kept, through its own queue.

``store`` (the SQL; each decision one transaction), ``service`` (one entity's run), ``job`` (the job
kind), ``history`` (reading facts as of a time, their chains, the operators' undo). The rules are
pure, in ``worker.core.consolidation``.
"""

from __future__ import annotations

from sqlalchemy.orm import Session, sessionmaker

from worker.consolidation.store import pending_entity_keys
from worker.jobs.outbox import CONSOLIDATION, enqueue, page_subject, request_job


def request_consolidation(session: Session, source_id: str, slug: str) -> list[tuple[int, str]]:
    """In the caller's transaction: one consolidation job per entity the page's extraction left to
    consolidate (a pending one is reused); returns the (job id, kind) pairs to enqueue after commit."""
    return [
        (request_job(session, CONSOLIDATION, page_subject(source_id, key)).job_id, CONSOLIDATION)
        for key in pending_entity_keys(session, source_id, slug)
    ]


def consolidate_page_entities(factory: sessionmaker[Session], source_id: str, slug: str) -> int:
    """Request (and send, after the commit) the consolidation jobs for a page's new facts; returns how
    many jobs were requested. Safe to call again: the facts stay pending until decided."""
    with factory.begin() as session:
        jobs = request_consolidation(session, source_id, slug)
    enqueue(factory, jobs)
    return len(jobs)


__all__ = ["consolidate_page_entities", "request_consolidation"]
