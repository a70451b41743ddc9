"""Fact lifecycle: duplicates merged, superseded facts closed, history kept, through its own queue.

``store`` (the SQL; each decision one transaction), ``service`` (one entity's run), ``job`` (the job
kind), ``history`` (reading facts as of a time, their chains, the operators' undo). The rules are
pure, in ``worker.core.consolidation``.
"""

from __future__ import annotations

from collections.abc import Sequence

from sqlalchemy.orm import Session, sessionmaker

from worker.consolidation.store import forgotten_entity_keys, orphaned_entity_keys, pending_entity_keys
from worker.jobs.outbox import CONSOLIDATION, JobRequest, page_subject, request_jobs
from worker.jobs.sending import enqueue

# How long a consolidation job's own budget runs before a request for its entity starts it over.
BUDGET_RENEW_SECONDS = 3_600.0


def _request_jobs(session: Session, pages: Sequence[tuple[str, str]]) -> list[JobRequest]:
    subjects = [page_subject(source_id, key) for source_id, key in pending_entity_keys(session, pages)]
    # New facts are new work, as a page's new content is: a job paused for its own budget, reused by
    # every later request, held the entity's one pending slot for good (the sweeper found no room). Not
    # at once: an entity named on every page is requested on every page's extraction, and its budget,
    # started over each time, would cap nothing but the day's; so it spends at most one a budget hour.
    return request_jobs(session, CONSOLIDATION, subjects, renew_spent_budget_after=BUDGET_RENEW_SECONDS)


def request_consolidation(session: Session, source_id: str, slug: str) -> list[tuple[int, str]]:
    """In the caller's transaction: one consolidation job per entity the page's extraction left to
    consolidate (a pending one is reused); returns the (job id, kind) pairs of the new ones, to enqueue
    after commit. A pending job is not sent again (as ``consolidate_pages_entities`` has it): a second
    message ran one waiting out its retry's backoff at once, spending an attempt."""
    requests = _request_jobs(session, [(source_id, slug)])
    return [(request.job_id, CONSOLIDATION) for request in requests if request.created]


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


# Facts stored this long ago without a consolidation request (their extraction's follow-up embeds them
# first, seconds to minutes) are caught up by the sweep; older than a day they wait for an operator
# (`factmill facts consolidate`), and a sweep reads at most CATCH_UP_SCAN of them.
CATCH_UP_GRACE_SECONDS = 600.0
CATCH_UP_WINDOW_SECONDS = 86_400.0
CATCH_UP_SCAN = 10_000


def catch_up_consolidation(factory: sessionmaker[Session], scan: int = CATCH_UP_SCAN) -> int:
    """Request (and send) the consolidation jobs a worker's death left unrequested: a page's request
    is made on the follow-up thread that embeds its facts, after its job succeeded, so a deploy or an
    OOM kill in between left the facts pending for good. As the follow-up would, it asks for their
    sources' orphans too (facts whose link a re-extraction deleted: hidden from current reads until
    another fact of their entity came). Returns how many jobs were requested."""
    with factory.begin() as session:
        keys = forgotten_entity_keys(
            session, grace_seconds=CATCH_UP_GRACE_SECONDS, window_seconds=CATCH_UP_WINDOW_SECONDS, scan=scan
        )
        keys = sorted({*keys, *orphaned_entity_keys(session, [source_id for source_id, _ in keys])})
        requests = request_jobs(session, CONSOLIDATION, [page_subject(s, key) for s, key in keys])
    enqueue(factory, [(request.job_id, CONSOLIDATION) for request in requests if request.created])
    return len(requests)


__all__ = [
    "BUDGET_RENEW_SECONDS",
    "catch_up_consolidation",
    "consolidate_page_entities",
    "consolidate_pages_entities",
    "request_consolidation",
]
