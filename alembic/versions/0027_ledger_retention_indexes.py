"""extraction_audit and consolidation_decisions: the indexes FACTMILL_LEDGER_RETENTION_DAYS needs

Revision ID: 0027
Revises: 0026
Create Date: 2026-12-04

The maintenance sweep may now delete llm_calls and extraction_audit rows past a retention (oldest
first). extraction_audit had no index on created_at, and nothing indexed the two columns that name an
llm_calls row (extraction_audit.llm_call_id, consolidation_decisions.llm_call_id): each deleted call's
ON DELETE SET NULL would have read both tables whole.
"""

from __future__ import annotations

from collections.abc import Sequence

from alembic import op

revision: str = "0027"
down_revision: str | None = "0026"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

INDEXES = (
    ("ix_extraction_audit_created_at", "extraction_audit", "created_at"),
    ("ix_extraction_audit_llm_call_id", "extraction_audit", "llm_call_id"),
    ("ix_consolidation_decisions_llm_call_id", "consolidation_decisions", "llm_call_id"),
)


def upgrade() -> None:
    for name, table, column in INDEXES:
        op.create_index(name, table, [column])


def downgrade() -> None:
    for name, table, _ in INDEXES:
        op.drop_index(name, table_name=table)
