"""What an erased page leaves in the fact lifecycle, taken out inside the erasure's transaction.

A model's decision quotes the facts it judged ("Lisbon -> Porto, dated ..."); the facts that name no
entity are consolidated under the page's own key (``page:<slug>``, in decisions, checkpoints and the
jobs' subjects), and an entity only this page's facts name ("people/alice-example") keeps its key
there too; and a fact the erased page's facts had superseded or absorbed is left pointing at nothing,
hidden from search until its entity is consolidated again.
"""

from __future__ import annotations

from sqlalchemy import text
from sqlalchemy.orm import Session

from worker.core.consolidation import PAGE_KEY_PREFIX
from worker.core.erasure import erased_label
from worker.jobs.outbox import CONSOLIDATION, page_subject

ERASED_REASON = "erased with its page"

_PAGE_FACTS = (
    "SELECT id FROM facts WHERE source_id = :source_id AND source_markdown_slug = :slug AND NOT is_audit"
)
_FORGET_REASONS = text(
    "UPDATE consolidation_decisions SET reason = :reason WHERE reason <> :reason "
    f"AND (fact_id IN ({_PAGE_FACTS}) OR other_fact_id IN ({_PAGE_FACTS}))"
)
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
_DROP_CHECKPOINT = text(
    "DELETE FROM consolidation_checkpoints WHERE source_id = :source_id AND entity_key = :key"
)
_RENAME_JOBS = text("UPDATE jobs SET subject = :erased WHERE kind = :kind AND subject = :subject")


def forget_page_decisions(session: Session, source_id: str, slug: str, erased_slug: str) -> None:
    """Before the page's facts are deleted, in the caller's transaction: the reasons of the decisions
    about them become ``ERASED_REASON`` (the decision and who made it stay); the page's own key becomes
    ``page:<erased_slug>``, and each entity only its facts name ``erased:<sha256>``, in decisions and
    jobs; their checkpoints go (no fact is left under them)."""
    session.execute(_FORGET_REASONS, {"reason": ERASED_REASON, "source_id": source_id, "slug": slug})
    keys = {PAGE_KEY_PREFIX + slug: PAGE_KEY_PREFIX + erased_slug}
    for entity in session.scalars(_ONLY_THIS_PAGE, {"source_id": source_id, "slug": slug}):
        keys[entity] = erased_entity_key(source_id, entity)
    for key, erased in keys.items():
        _rename_key(session, source_id, key, erased)


def erased_entity_key(source_id: str, entity_key: str) -> str:
    """What stands for an entity whose every fact was erased (its slug can name a person)."""
    return erased_label(source_id, entity_key)


def _rename_key(session: Session, source_id: str, key: str, erased: str) -> None:
    """``key`` becomes ``erased`` in the source's decisions and consolidation jobs; its checkpoint goes."""
    names = {"source_id": source_id, "key": key, "erased": erased}
    session.execute(_RENAME_DECISIONS, names)
    session.execute(_DROP_CHECKPOINT, names)
    session.execute(
        _RENAME_JOBS,
        {
            "kind": CONSOLIDATION,
            "subject": page_subject(source_id, key),
            "erased": page_subject(source_id, erased),
        },
    )


__all__ = ["ERASED_REASON", "erased_entity_key", "forget_page_decisions"]
