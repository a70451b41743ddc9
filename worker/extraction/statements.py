"""The SQL extraction's store runs for every page, built once with bound parameters: building a
statement per call cost about as much Python as running it (py-spy of bench/pipeline.py, one-segment
pages). The store (``worker.extraction.store``) owns the transactions; this module only holds SQL.

Parameters of an INSERT or UPDATE may not share a column's name (SQLAlchemy reserves those for the
VALUES and SET clauses): they are prefixed ``b_`` (a key), ``new_`` (the value written) or ``was_``
(the value expected).
"""

from __future__ import annotations

from sqlalchemy import bindparam, case, cast, func, select, update
from sqlalchemy.dialects.postgresql import JSONB
from sqlalchemy.dialects.postgresql import insert as pg_insert

from models.tables import FACTS, OP_CHECKPOINTS, PAGES
from worker.extraction.options import OP_NAME, TERMINAL_AUDIT_SOURCE

# The terminal audit row: a page's marker of a complete extraction, on a row number no fact can take.
TERMINAL_AUDIT_FACT = "EXTRACTION_COMPLETE"
TERMINAL_ROW_NUM = -1

PAGE_SIZE = func.octet_length(PAGES.c.compiled_truth) + func.octet_length(PAGES.c.timeline)
LIST_PAGES = (
    select(PAGES.c.id, PAGES.c.slug, PAGE_SIZE)
    .where(PAGES.c.source_id == bindparam("source_id"), PAGES.c.type.in_(bindparam("types", expanding=True)))
    .order_by(PAGES.c.slug)
)
LIST_ONE_PAGE = LIST_PAGES.where(PAGES.c.slug == bindparam("slug"))
LOAD_PAGE = select(
    PAGES.c.compiled_truth, PAGES.c.timeline, PAGES.c.type, PAGES.c.title, PAGES.c.content_hash
).where(PAGES.c.id == bindparam("page_id"))
CHECKPOINT_STATE = (
    OP_CHECKPOINTS.c.messages_done,
    OP_CHECKPOINTS.c.prefix_hash,
    OP_CHECKPOINTS.c.next_row_num,
    OP_CHECKPOINTS.c.skipped,
)
LOAD_PAGE_WITH_CHECKPOINT = LOAD_PAGE.add_columns(*CHECKPOINT_STATE).outerjoin(
    OP_CHECKPOINTS,
    (OP_CHECKPOINTS.c.op == OP_NAME)
    & (OP_CHECKPOINTS.c.fingerprint == bindparam("fingerprint"))
    & (OP_CHECKPOINTS.c.page_key == bindparam("page_key")),
)
# The checkpoint's compare-and-set: created (no row yet), or moved from the expected state to the new.
NEW_CHECKPOINT = {
    "completed_key": bindparam("new_completed_key"),
    "messages_done": bindparam("new_messages_done"),
    "prefix_hash": bindparam("new_prefix_hash"),
    "next_row_num": bindparam("new_next_row_num"),
    "skipped": bindparam("new_skipped", type_=JSONB),
}
CHECKPOINT_FIRST = (
    pg_insert(OP_CHECKPOINTS)
    .values(
        op=OP_NAME,
        fingerprint=bindparam("b_fingerprint"),
        page_key=bindparam("b_page_key"),
        **NEW_CHECKPOINT,
    )
    .on_conflict_do_nothing()
    .returning(OP_CHECKPOINTS.c.op)
)
CHECKPOINT_MOVE = (
    update(OP_CHECKPOINTS)
    .where(
        OP_CHECKPOINTS.c.op == OP_NAME,
        OP_CHECKPOINTS.c.fingerprint == bindparam("b_fingerprint"),
        OP_CHECKPOINTS.c.page_key == bindparam("b_page_key"),
        OP_CHECKPOINTS.c.messages_done == bindparam("was_messages_done"),
        OP_CHECKPOINTS.c.prefix_hash == bindparam("was_prefix_hash"),
        OP_CHECKPOINTS.c.next_row_num == bindparam("was_next_row_num"),
        OP_CHECKPOINTS.c.skipped == cast(bindparam("was_skipped", type_=JSONB), JSONB),
    )
    .values(
        **NEW_CHECKPOINT
        | {
            # A commit that covers nothing new (a skipped segment re-extracted, `jobs retry --skipped`)
            # keeps the entry of the furthest segment: it named the retried segment's older end.
            "completed_key": case(
                (
                    (OP_CHECKPOINTS.c.messages_done == bindparam("new_messages_done"))
                    & (OP_CHECKPOINTS.c.prefix_hash == bindparam("new_prefix_hash")),
                    OP_CHECKPOINTS.c.completed_key,
                ),
                else_=bindparam("new_completed_key"),
            )
        },
        updated_at=func.now(),
    )
)
PAGE_VERSION = (
    select(PAGES.c.content_hash, PAGES.c.type)
    .where(PAGES.c.id == bindparam("page_id"))
    .with_for_update(read=True)
)
UPSERT_TERMINAL = (
    pg_insert(FACTS)
    .values(
        source_id=bindparam("b_source_id"),
        fact=TERMINAL_AUDIT_FACT,
        kind="fact",
        entity_slug=None,
        confidence=1.0,
        notability="low",
        context="",
        valid_from=None,
        source=TERMINAL_AUDIT_SOURCE,
        source_session=bindparam("b_source_session"),
        source_markdown_slug=bindparam("b_slug"),
        row_num=TERMINAL_ROW_NUM,
        is_audit=True,
    )
    .on_conflict_do_update(
        index_elements=[FACTS.c.source_id, FACTS.c.source_markdown_slug, FACTS.c.row_num],
        set_={"created_at": func.now()},
    )
)
