"""llm_calls: the refusals recorded before keep their length, not their words

Revision ID: 0032
Revises: 0031
Create Date: 2026-12-05

A refusal's reason is the model's own words, often quoting the segment or beginning a summary, and
llm_calls rows outlive the erasure of the page or transcript they were about. The ledger now keeps a
refusal's length only (worker.accounting.ledger.kept_error); this rewrites the rows recorded before,
in the same words. One pass over llm_calls; refusals are few, so few rows are written.
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa

from alembic import op

revision: str = "0032"
down_revision: str | None = "0031"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.execute(
        sa.text(
            "UPDATE llm_calls SET error = 'the model refused (' || length(error) "
            "|| ' characters of reply, kept with what it was about)' "
            "WHERE outcome = 'refusal' AND error IS NOT NULL AND error NOT LIKE 'the model refused (%'"
        )
    )


def downgrade() -> None:
    pass  # the words are gone; nothing to restore
