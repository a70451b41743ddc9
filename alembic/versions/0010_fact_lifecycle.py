"""fact lifecycle: facts gain valid_to, a status (current | superseded | duplicate), the links to the
fact that superseded them or that they duplicate, and a consolidated marker; consolidation's decision
audit rows and per-entity checkpoints

Revision ID: 0010
Revises: 0009
Create Date: 2026-12-01

Existing facts start current with no links. They are not marked consolidated: the first consolidation
job of an entity considers its older facts too.
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa

from alembic import op

revision: str = "0010"
down_revision: str | None = "0009"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

FACT_STATUSES = ("current", "superseded", "duplicate")  # = worker.core.consolidation, frozen here
DECISIONS = ("duplicate", "updates", "contradicts", "unrelated", "new", "unmerge", "restore")
DECIDERS = ("rule", "model", "operator")


def _in(column: str, values: tuple[str, ...]) -> str:
    return f"{column} IN ({', '.join(repr(v) for v in values)})"


def _fact_link(name: str) -> sa.Column:  # type: ignore[type-arg]
    return sa.Column(
        name,
        sa.BigInteger(),
        sa.ForeignKey("facts.id", name=op.f(f"fk_facts_{name}_facts"), ondelete="SET NULL"),
        nullable=True,
    )


def upgrade() -> None:
    op.add_column("facts", sa.Column("valid_to", sa.DateTime(timezone=True), nullable=True))
    op.add_column("facts", sa.Column("status", sa.Text(), server_default="current", nullable=False))
    op.add_column("facts", _fact_link("superseded_by"))
    op.add_column("facts", _fact_link("duplicate_of"))
    op.add_column("facts", sa.Column("consolidated_at", sa.DateTime(timezone=True), nullable=True))
    op.create_check_constraint(op.f("ck_facts_status"), "facts", _in("status", FACT_STATUSES))
    op.create_index(op.f("ix_facts_superseded_by"), "facts", ["superseded_by"])
    op.create_index(op.f("ix_facts_duplicate_of"), "facts", ["duplicate_of"])
    op.create_index(op.f("ix_facts_source_id_entity"), "facts", ["source_id", "entity_slug"])
    op.create_table(
        "consolidation_decisions",
        sa.Column("id", sa.BigInteger(), nullable=False),
        sa.Column("job_id", sa.BigInteger(), nullable=True),
        sa.Column("source_id", sa.Text(), nullable=False),
        sa.Column("entity_key", sa.Text(), nullable=False),
        sa.Column("fact_id", sa.BigInteger(), nullable=True),
        sa.Column("other_fact_id", sa.BigInteger(), nullable=True),
        sa.Column("decision", sa.Text(), nullable=False),
        sa.Column("decided_by", sa.Text(), nullable=False),
        sa.Column("reason", sa.Text(), nullable=False),
        sa.Column("similarity", sa.Float(), nullable=True),
        sa.Column("llm_call_id", sa.BigInteger(), nullable=True),
        sa.Column("created_at", sa.DateTime(timezone=True), server_default=sa.text("now()"), nullable=False),
        sa.CheckConstraint(_in("decision", DECISIONS), name=op.f("ck_consolidation_decisions_decision")),
        sa.CheckConstraint(_in("decided_by", DECIDERS), name=op.f("ck_consolidation_decisions_decided_by")),
        sa.ForeignKeyConstraint(
            ["job_id"], ["jobs.id"], name=op.f("fk_consolidation_decisions_job_id_jobs"), ondelete="SET NULL"
        ),
        sa.ForeignKeyConstraint(
            ["fact_id"],
            ["facts.id"],
            name=op.f("fk_consolidation_decisions_fact_id_facts"),
            ondelete="SET NULL",
        ),
        sa.ForeignKeyConstraint(
            ["other_fact_id"],
            ["facts.id"],
            name=op.f("fk_consolidation_decisions_other_fact_id_facts"),
            ondelete="SET NULL",
        ),
        sa.ForeignKeyConstraint(
            ["llm_call_id"],
            ["llm_calls.id"],
            name=op.f("fk_consolidation_decisions_llm_call_id_llm_calls"),
            ondelete="SET NULL",
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_consolidation_decisions")),
    )
    for column in ("job_id", "fact_id", "other_fact_id"):
        op.create_index(op.f(f"ix_consolidation_decisions_{column}"), "consolidation_decisions", [column])
    op.create_index(
        op.f("ix_consolidation_decisions_entity"), "consolidation_decisions", ["source_id", "entity_key"]
    )
    op.create_table(
        "consolidation_checkpoints",
        sa.Column("source_id", sa.Text(), nullable=False),
        sa.Column("entity_key", sa.Text(), nullable=False),
        sa.Column("facts_done", sa.Integer(), server_default="0", nullable=False),
        sa.Column("last_fact_id", sa.BigInteger(), nullable=True),
        sa.Column("updated_at", sa.DateTime(timezone=True), server_default=sa.text("now()"), nullable=False),
        sa.PrimaryKeyConstraint("source_id", "entity_key", name=op.f("pk_consolidation_checkpoints")),
    )


def downgrade() -> None:
    op.drop_table("consolidation_checkpoints")
    op.drop_table("consolidation_decisions")
    op.drop_index(op.f("ix_facts_source_id_entity"), table_name="facts")
    op.drop_index(op.f("ix_facts_duplicate_of"), table_name="facts")
    op.drop_index(op.f("ix_facts_superseded_by"), table_name="facts")
    op.drop_constraint(op.f("ck_facts_status"), "facts", type_="check")
    for column in ("consolidated_at", "duplicate_of", "superseded_by", "status", "valid_to"):
        op.drop_column("facts", column)
