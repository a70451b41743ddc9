"""What an erased page leaves in the fact lifecycle, taken out inside the erasure's transaction.

A model's decision quotes the facts it judged ("Lisbon -> Porto, dated ..."); the facts that name no
entity are consolidated under the page's own key (``page:<slug>``, in decisions, checkpoints and the
jobs' subjects), and an entity only this page's facts name ("people/alice-example") keeps its key
there too; and a fact the erased page's facts had superseded or absorbed is left pointing at nothing,
hidden from search until its entity is consolidated again.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from sqlalchemy import Select, select, text, update
from sqlalchemy.orm import Session

from models import ConsolidationDecision, Fact
from worker.accounting import forget_call_errors
from worker.consolidation.decisions import restart_canonicals
from worker.consolidation.store import DROP_CHECKPOINT, lock_checkpoint
from worker.core.consolidation import PAGE_KEY_PREFIX, entity_key
from worker.core.erasure import erased_label
from worker.jobs.outbox import CONSOLIDATION, cancel_jobs, page_subject

ERASED_REASON = "erased with its page"
KEY_ERASED = "every fact it would consolidate was erased with its page"
KEY_REPLACED = "every fact it would consolidate was deleted when its page changed"
# A decision about facts a re-extraction (or a page with nothing left to extract) deleted: its reason
# quoted them, and once they are gone (the decision's fact ids set null) no erasure could find it.
REPLACED_REASON = "its facts were deleted when their page changed"
FORGOTTEN = (ERASED_REASON, REPLACED_REASON)
# The entities no fact of the source names but this page's (they leave with it).
_ONLY_THIS_PAGE = text(
    "SELECT DISTINCT f.entity_slug FROM facts f WHERE f.source_id = :source_id "
    "AND f.source_markdown_slug = :slug AND f.entity_slug IS NOT NULL AND NOT f.is_audit "
    "AND NOT EXISTS (SELECT 1 FROM facts o WHERE o.source_id = f.source_id "
    "AND o.entity_slug = f.entity_slug AND o.source_markdown_slug <> :slug AND NOT o.is_audit)"
)
_RENAME_DECISIONS = text(
    "UPDATE consolidation_decisions SET entity_key = :erased "
    "WHERE source_id = :source_id AND entity_key = :key"
)
_RENAME_JOBS = text("UPDATE jobs SET subject = :erased WHERE kind = :kind AND subject = :subject")
# What an erasure leaves of the notes of the consolidation jobs that judged the page's facts (a failed
# one's is a provider's message, which may quote the facts it sent), and a re-extraction of those under
# an entity no fact names any more. A cancellation's stays, and a paused job's (why it waits).
NOTE_ERASED = "the note went with the erasure of a page whose facts this job judged"
NOTE_REPLACED = "the note went with the facts it was about, deleted when their page changed"
# Notes that quote nothing: kept (an erasure's stays when the same transaction then retires the key).
_CONTENT_FREE = (KEY_ERASED, KEY_REPLACED, NOTE_ERASED, NOTE_REPLACED)
_FORGET_NOTES = text(
    "UPDATE jobs SET last_error = :note WHERE kind = :kind AND subject = :subject "
    "AND last_error IS NOT NULL AND last_error NOT IN (:free0, :free1, :free2, :free3) "
    "AND status <> 'paused'"
)


@dataclass(frozen=True)
class _Why:
    """Why a key's facts went: what its cancelled jobs and the notes of the others say."""

    cancelled: str
    note: str


_ERASED = _Why(KEY_ERASED, NOTE_ERASED)
_REPLACED = _Why(KEY_REPLACED, NOTE_REPLACED)


def forget_page_decisions(session: Session, source_id: str, slug: str, erased_slug: str) -> None:
    """Before the page's facts are deleted, in the caller's transaction: the reasons of the decisions
    about them become ``ERASED_REASON`` (the decision and who made it stay); the page's own key becomes
    ``page:<erased_slug>``, and each entity only its facts name ``erased:<sha256>``, in decisions and
    jobs; their checkpoints go (no fact is left under them)."""
    judged = forget_reasons_about(session, page_facts(source_id, slug), ERASED_REASON)
    keys = {PAGE_KEY_PREFIX + slug: PAGE_KEY_PREFIX + erased_slug}
    for entity in session.scalars(_ONLY_THIS_PAGE, {"source_id": source_id, "slug": slug}):
        keys[entity] = erased_entity_key(source_id, entity)
    for key, erased in keys.items():
        _rename_key(session, source_id, key, erased, _ERASED)
    # An entity other pages name too keeps its key, and its jobs' calls sent this page's facts as well.
    for judged_source, key in sorted(judged):  # the page's source: its facts are all in it
        if key not in keys:
            _forget_job_words(session, judged_source, key, _ERASED.note)


def page_facts(source_id: str, slug: str) -> Select[Any]:
    """The ids of the page's facts (its audit rows are never judged)."""
    return select(Fact.id).where(
        Fact.source_id == source_id, Fact.source_markdown_slug == slug, Fact.is_audit.is_(False)
    )


def forget_reasons_about(
    session: Session, fact_ids: Select[Any], reason: str, *, restart: bool = True
) -> set[tuple[str, str]]:
    """Before these facts are deleted, in the caller's transaction: the reasons of the decisions about
    them become ``reason`` (the decision and who made it stay). The one place a deletion of facts
    forgets what the model said of them: an erasure, a re-extraction, a page left with nothing to say;
    and, with ``restart``, where one of them, a duplicate, had moved its canonical's start back, the
    start moves again (``restart_canonicals``). Not for a re-extraction, whose facts come back at once,
    mostly as they were: restarted before they did, a model of the rules over every chain of up to five
    sayings found hundreds of shapes left wrong that had been right, against a handful mended.

    First the checkpoint of every entity these facts are under is held (in order): a consolidation
    commit in flight for one of them ends before this (its decisions, quoting these facts, are then
    seen and forgotten here). Only the keys an erasure renames were held: a commit under an entity other
    pages name too inserted its reasons unseen, and the delete below then nulled their fact ids,
    leaving the quote where no erasure could find it."""
    entities = session.execute(
        select(Fact.source_id, Fact.entity_slug, Fact.source_markdown_slug)
        .where(Fact.id.in_(fact_ids))
        .distinct()
    ).all()
    keys = {(s, entity_key(e, page)) for s, e, page in entities}
    for source_id, key in sorted(keys):
        if lock_checkpoint(session, source_id, key):
            # Made only to be held (no run has written one): gone again, still held until the end.
            session.execute(DROP_CHECKPOINT, {"source_id": source_id, "key": key})
    if restart:
        restart_canonicals(session, fact_ids)  # what an earlier saying of theirs moved goes back
    # One statement a side: under an OR, Postgres scans the whole table instead of each side's index,
    # and this now runs on every re-extraction, not only on an erasure.
    for side in (ConsolidationDecision.fact_id, ConsolidationDecision.other_fact_id):
        session.execute(
            update(ConsolidationDecision)
            .where(ConsolidationDecision.reason.not_in(FORGOTTEN), side.in_(fact_ids))
            .values(reason=reason)
            .execution_options(synchronize_session=False)
        )
    return keys


_NAMED = text(
    "SELECT EXISTS (SELECT 1 FROM facts WHERE source_id = :source_id AND entity_slug = :entity "
    "AND NOT is_audit)"
)


def retire_unnamed_keys(session: Session, keys: set[tuple[str, str]]) -> None:
    """After a page's facts were deleted and replaced (``keys``: what ``forget_reasons_about`` returned),
    in the caller's transaction: an entity no fact of its source names any more leaves under its erased
    label, as an erasure's does. Kept, its name stayed in the decisions, checkpoint and jobs of facts
    that are gone, and a later erasure of the page that named it looked only at the facts it has now,
    so it never renamed it. A page's own key stays: the page still names it (its erasure renames it)."""
    for source_id, key in sorted(keys):
        if key.startswith(PAGE_KEY_PREFIX):
            continue
        if not session.scalar(_NAMED, {"source_id": source_id, "entity": key}):
            _rename_key(session, source_id, key, erased_entity_key(source_id, key), _REPLACED)


def erased_entity_key(source_id: str, entity_key: str) -> str:
    """What stands for an entity whose every fact was erased (its slug can name a person)."""
    return erased_label(source_id, entity_key)


def _rename_key(session: Session, source_id: str, key: str, erased: str, why: _Why) -> None:
    """``key`` becomes ``erased`` in the source's decisions and consolidation jobs; its checkpoint goes.

    First its checkpoint is locked: a run's commit of decisions in flight ends before the renaming (its
    rows committed after it kept the key, and the reasons quoting the page). Its pending and running
    jobs are cancelled: every fact under the key goes with the page, and a run going on would write
    under the old key again."""
    names = {"source_id": source_id, "key": key, "erased": erased}
    lock_checkpoint(session, source_id, key)
    cancel_jobs(session, CONSOLIDATION, page_subject(source_id, key), why.cancelled)
    session.execute(_RENAME_DECISIONS, names)
    session.execute(DROP_CHECKPOINT, names)
    session.execute(
        _RENAME_JOBS,
        {
            "kind": CONSOLIDATION,
            "subject": page_subject(source_id, key),
            "erased": page_subject(source_id, erased),
        },
    )
    _forget_job_words(session, source_id, erased, why.note)


def _forget_job_words(session: Session, source_id: str, key: str, note: str) -> None:
    """The notes of the consolidation jobs under ``key`` become ``note`` and their calls' provider
    messages go: either may quote the facts the jobs sent (as the page's extraction calls' may)."""
    subject = page_subject(source_id, key)
    free = {f"free{n}": kept for n, kept in enumerate(_CONTENT_FREE)}
    session.execute(_FORGET_NOTES, {"note": note, "kind": CONSOLIDATION, "subject": subject, **free})
    forget_call_errors(session, CONSOLIDATION, subject)


__all__ = [
    "ERASED_REASON",
    "REPLACED_REASON",
    "erased_entity_key",
    "forget_page_decisions",
    "forget_reasons_about",
    "page_facts",
    "retire_unnamed_keys",
]
