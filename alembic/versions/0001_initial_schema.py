"""initial schema: pages, facts, audit, checkpoints, config, jobs, llm_calls

Revision ID: 0001
Revises:
Create Date: 2026-11-29
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from sqlalchemy.dialects import postgresql

from alembic import op

revision: str = "0001"
down_revision: str | None = None
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "config",
        sa.Column("key", sa.Text(), nullable=False),
        sa.Column("value", sa.Text(), nullable=False),
        sa.Column("updated_at", sa.DateTime(timezone=True), server_default=sa.text("now()"), nullable=False),
        sa.Column("updated_by", sa.Text(), nullable=True),
        sa.PrimaryKeyConstraint("key", name=op.f("pk_config")),
    )
    op.create_table(
        "facts",
        sa.Column("id", sa.BigInteger(), nullable=False),
        sa.Column("source_id", sa.Text(), nullable=False),
        sa.Column("fact", sa.Text(), nullable=False),
        sa.Column("kind", sa.Text(), nullable=False),
        sa.Column("entity_slug", sa.Text(), nullable=True),
        sa.Column("confidence", sa.Float(), nullable=False),
        sa.Column("notability", sa.Text(), nullable=False),
        sa.Column("context", sa.Text(), server_default="", nullable=False),
        sa.Column("valid_from", sa.DateTime(timezone=True), nullable=True),
        sa.Column("source", sa.Text(), nullable=False),
        sa.Column("source_session", sa.Text(), nullable=False),
        sa.Column("source_markdown_slug", sa.Text(), nullable=False),
        sa.Column("row_num", sa.Integer(), nullable=False),
        sa.Column("is_audit", sa.Boolean(), server_default="false", nullable=False),
        sa.Column("claim_metric", sa.Text(), nullable=True),
        sa.Column("claim_value", sa.Float(), nullable=True),
        sa.Column("claim_unit", sa.Text(), nullable=True),
        sa.Column("claim_period", sa.Text(), nullable=True),
        sa.Column("embedding", sa.ARRAY(sa.Float()), nullable=True),
        sa.Column("created_at", sa.DateTime(timezone=True), server_default=sa.text("now()"), nullable=False),
        sa.CheckConstraint(
            "kind IN ('event', 'preference', 'commitment', 'belief', 'fact')", name=op.f("ck_facts_kind")
        ),
        sa.CheckConstraint("notability IN ('high', 'medium', 'low')", name=op.f("ck_facts_notability")),
        sa.CheckConstraint(
            "(is_audit AND row_num < 0) OR (NOT is_audit AND row_num >= 0)",
            name=op.f("ck_facts_audit_row_num"),
        ),
        sa.CheckConstraint("confidence >= 0 AND confidence <= 1", name=op.f("ck_facts_confidence")),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_facts")),
        sa.UniqueConstraint(
            "source_id",
            "source_markdown_slug",
            "row_num",
            name=op.f("uq_facts_source_id_source_markdown_slug_row_num"),
        ),
    )
    op.create_index("ix_facts_entity_slug", "facts", ["entity_slug"], unique=False)
    op.create_index("ix_facts_source_session", "facts", ["source_session"], unique=False)
    op.create_table(
        "jobs",
        sa.Column("id", sa.BigInteger(), nullable=False),
        sa.Column("kind", sa.Text(), nullable=False),
        sa.Column("subject", sa.Text(), nullable=False),
        sa.Column("options", postgresql.JSONB(astext_type=sa.Text()), server_default="{}", nullable=False),
        sa.Column("status", sa.Text(), server_default="queued", nullable=False),
        sa.Column("attempts", sa.Integer(), server_default="0", nullable=False),
        sa.Column("idempotency_key", sa.Text(), nullable=True),
        sa.Column("counters", postgresql.JSONB(astext_type=sa.Text()), server_default="{}", nullable=False),
        sa.Column("last_error", sa.Text(), nullable=True),
        sa.Column("pause_reason", sa.Text(), nullable=True),
        sa.Column("rerun_requested", sa.Boolean(), server_default="false", nullable=False),
        sa.Column("enqueued_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("worker", sa.Text(), nullable=True),
        sa.Column("created_at", sa.DateTime(timezone=True), server_default=sa.text("now()"), nullable=False),
        sa.Column("updated_at", sa.DateTime(timezone=True), server_default=sa.text("now()"), nullable=False),
        sa.Column("started_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("finished_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("heartbeat_at", sa.DateTime(timezone=True), nullable=True),
        sa.CheckConstraint(
            "status IN ('queued', 'running', 'paused', 'succeeded', 'failed')", name=op.f("ck_jobs_status")
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_jobs")),
        sa.UniqueConstraint("idempotency_key", name=op.f("uq_jobs_idempotency_key")),
    )
    op.create_index("ix_jobs_status_kind", "jobs", ["status", "kind"], unique=False)
    op.create_index("ix_jobs_subject", "jobs", ["kind", "subject"], unique=False)
    op.create_index(
        "uq_jobs_pending_subject",
        "jobs",
        ["kind", "subject"],
        unique=True,
        postgresql_where=sa.text("status IN ('queued', 'running', 'paused')"),
    )
    op.create_table(
        "webhook_deliveries",
        sa.Column("idempotency_key", sa.Text(), nullable=False),
        sa.Column("body_hash", sa.Text(), nullable=False),
        sa.Column("response", postgresql.JSONB(astext_type=sa.Text()), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), server_default=sa.text("now()"), nullable=False),
        sa.PrimaryKeyConstraint("idempotency_key", name=op.f("pk_webhook_deliveries")),
    )
    op.create_table(
        "op_checkpoints",
        sa.Column("op", sa.Text(), nullable=False),
        sa.Column("fingerprint", sa.Text(), nullable=False),
        sa.Column("page_key", sa.Text(), nullable=False),
        sa.Column("completed_key", sa.Text(), nullable=False),
        sa.Column("messages_done", sa.Integer(), nullable=False),
        sa.Column("prefix_hash", sa.Text(), nullable=False),
        sa.Column("next_row_num", sa.Integer(), nullable=False),
        sa.Column("updated_at", sa.DateTime(timezone=True), server_default=sa.text("now()"), nullable=False),
        sa.PrimaryKeyConstraint("op", "fingerprint", "page_key", name=op.f("pk_op_checkpoints")),
    )
    op.create_table(
        "pages",
        sa.Column("id", sa.BigInteger(), nullable=False),
        sa.Column("source_id", sa.Text(), nullable=False),
        sa.Column("slug", sa.Text(), nullable=False),
        sa.Column("type", sa.Text(), nullable=False),
        sa.Column("title", sa.Text(), server_default="", nullable=False),
        sa.Column("compiled_truth", sa.Text(), server_default="", nullable=False),
        sa.Column("timeline", sa.Text(), server_default="", nullable=False),
        sa.Column(
            "frontmatter", postgresql.JSONB(astext_type=sa.Text()), server_default="{}", nullable=False
        ),
        sa.Column("content_hash", sa.Text(), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), server_default=sa.text("now()"), nullable=False),
        sa.Column("updated_at", sa.DateTime(timezone=True), server_default=sa.text("now()"), nullable=False),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_pages")),
        sa.UniqueConstraint("source_id", "slug", name=op.f("uq_pages_source_id_slug")),
    )
    op.create_index(op.f("ix_pages_type"), "pages", ["type"], unique=False)
    op.create_table(
        "llm_calls",
        sa.Column("id", sa.BigInteger(), nullable=False),
        sa.Column("job_id", sa.BigInteger(), nullable=True),
        sa.Column("provider", sa.Text(), nullable=False),
        sa.Column("model", sa.Text(), nullable=False),
        sa.Column("purpose", sa.Text(), nullable=False),
        sa.Column("input_tokens", sa.Integer(), server_default="0", nullable=False),
        sa.Column("output_tokens", sa.Integer(), server_default="0", nullable=False),
        sa.Column("cache_read_tokens", sa.Integer(), server_default="0", nullable=False),
        sa.Column("cache_write_tokens", sa.Integer(), server_default="0", nullable=False),
        sa.Column("latency_ms", sa.Integer(), server_default="0", nullable=False),
        sa.Column("outcome", sa.Text(), nullable=False),
        sa.Column("cost_usd", sa.Numeric(precision=12, scale=6), server_default="0", nullable=False),
        sa.Column("error", sa.Text(), nullable=True),
        sa.Column("created_at", sa.DateTime(timezone=True), server_default=sa.text("now()"), nullable=False),
        sa.ForeignKeyConstraint(
            ["job_id"], ["jobs.id"], name=op.f("fk_llm_calls_job_id_jobs"), ondelete="SET NULL"
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_llm_calls")),
    )
    op.create_index("ix_llm_calls_created_at", "llm_calls", ["created_at"], unique=False)
    op.create_index(op.f("ix_llm_calls_job_id"), "llm_calls", ["job_id"], unique=False)
    op.create_table(
        "extraction_audit",
        sa.Column("id", sa.BigInteger(), nullable=False),
        sa.Column("job_id", sa.BigInteger(), nullable=True),
        sa.Column("source_id", sa.Text(), nullable=False),
        sa.Column("page_slug", sa.Text(), nullable=False),
        sa.Column("segment_index", sa.Integer(), nullable=False),
        sa.Column("segment_start", sa.Text(), nullable=False),
        sa.Column("segment_end", sa.Text(), nullable=False),
        sa.Column("attempt", sa.Integer(), server_default="1", nullable=False),
        sa.Column("outcome", sa.Text(), nullable=False),
        sa.Column("facts_count", sa.Integer(), server_default="0", nullable=False),
        sa.Column("error", sa.Text(), nullable=True),
        sa.Column("llm_call_id", sa.BigInteger(), nullable=True),
        sa.Column("created_at", sa.DateTime(timezone=True), server_default=sa.text("now()"), nullable=False),
        sa.CheckConstraint(
            "outcome IN ('ok', 'malformed_output', 'truncated_output', 'refusal', 'provider_error', "
            "'budget_exhausted')",
            name=op.f("ck_extraction_audit_outcome"),
        ),
        sa.ForeignKeyConstraint(
            ["job_id"], ["jobs.id"], name=op.f("fk_extraction_audit_job_id_jobs"), ondelete="SET NULL"
        ),
        sa.ForeignKeyConstraint(
            ["llm_call_id"],
            ["llm_calls.id"],
            name=op.f("fk_extraction_audit_llm_call_id_llm_calls"),
            ondelete="SET NULL",
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_extraction_audit")),
    )
    op.create_index(op.f("ix_extraction_audit_job_id"), "extraction_audit", ["job_id"], unique=False)
    op.create_index("ix_extraction_audit_page", "extraction_audit", ["source_id", "page_slug"], unique=False)


def downgrade() -> None:
    op.drop_index("ix_extraction_audit_page", table_name="extraction_audit")
    op.drop_index(op.f("ix_extraction_audit_job_id"), table_name="extraction_audit")
    op.drop_table("extraction_audit")
    op.drop_index(op.f("ix_llm_calls_job_id"), table_name="llm_calls")
    op.drop_index("ix_llm_calls_created_at", table_name="llm_calls")
    op.drop_table("llm_calls")
    op.drop_index(op.f("ix_pages_type"), table_name="pages")
    op.drop_table("pages")
    op.drop_table("op_checkpoints")
    op.drop_table("webhook_deliveries")
    op.drop_index("uq_jobs_pending_subject", table_name="jobs")
    op.drop_index("ix_jobs_subject", table_name="jobs")
    op.drop_index("ix_jobs_status_kind", table_name="jobs")
    op.drop_table("jobs")
    op.drop_index("ix_facts_source_session", table_name="facts")
    op.drop_index("ix_facts_entity_slug", table_name="facts")
    op.drop_table("facts")
    op.drop_table("config")
