"""Fact lifecycle: duplicates merged, superseded facts closed, history kept, through its own queue.

``store`` (the SQL; each decision one transaction), ``service`` (one entity's run), ``job`` (the job
kind), ``history`` (reading facts as of a time, their chains, the operators' undo). The rules are
pure, in ``worker.core.consolidation``.
"""

from __future__ import annotations

from collections.abc import Sequence

from sqlalchemy.orm import Session, sessionmaker

from worker.consolidation.store import pending_entity_keys
from worker.jobs.outbox import CONSOLIDATION, JobRequest, enqueue, page_subject, request_jobs


def _request_jobs(session: Session, pages: Sequence[tuple[str, str]]) -> list[JobRequest]:
    subjects = [page_subject(source_id, key) for source_id, key in pending_entity_keys(session, pages)]
    return request_jobs(session, CONSOLIDATION, subjects)


def request_consolidation(session: Session, source_id: str, slug: str) -> list[tuple[int, str]]:
    """In the caller's transaction: one consolidation job per entity the page's extraction left to
    consolidate (a pending one is reused); returns the (job id, kind) pairs to enqueue after commit."""
    return [(request.job_id, CONSOLIDATION) for request in _request_jobs(session, [(source_id, slug)])]


def consolidate_pages_entities(factory: sessionmaker[Session], pages: Sequence[tuple[str, str]]) -> int:
    """Request the consolidation jobs for the new facts of these (source id, slug) pages in one
    transaction, and send the new ones after the commit; returns how many jobs were requested. A job
    that was already pending is not sent again: its message is on its way (or the sweeper re-sends
    it), and a running one was marked to run again. Safe to call again: facts stay pending until
    decided."""
    with factory.begin() as session:
        requests = _request_jobs(session, pages)
    enqueue(factory, [(request.job_id, CONSOLIDATION) for request in requests if request.created])
    return len(requests)


def consolidate_page_entities(factory: sessionmaker[Session], source_id: str, slug: str) -> int:
    """``consolidate_pages_entities`` for one page."""
    return consolidate_pages_entities(factory, [(source_id, slug)])


__all__ = ["consolidate_page_entities", "consolidate_pages_entities", "request_consolidation"]
