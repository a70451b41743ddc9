"""facts.embedding_model: the model whose vector a fact holds

Revision ID: 0036
Revises: 0035
Create Date: 2026-12-05

Only the vectors' dimension was checked: after a change of embedding model (or provider) of the same
dimension, queries embedded by the new model were compared with facts embedded by the old one, and
vector search answered near-random neighbours at full weight. Each vector now names its model; a
search compares a query only with facts of its model. The vectors there were keep it empty (their
model was not kept): they are compared with any query, as before, until `factmill embed --reembed`.
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa

from alembic import op

revision: str = "0036"
down_revision: str | None = "0035"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.add_column("facts", sa.Column("embedding_model", sa.Text(), nullable=True))


def downgrade() -> None:
    op.drop_column("facts", "embedding_model")
