"""The migrations build exactly the schema the models describe (drift test), and downgrade cleanly."""

from __future__ import annotations

import pytest
from alembic.autogenerate import compare_metadata
from alembic.runtime.migration import MigrationContext
from sqlalchemy import create_engine, inspect, pool

import models
from tests.conftest import fresh_database
from worker import db

pytestmark = pytest.mark.integration


def test_migrations_match_models(server_url: str) -> None:
    with fresh_database(server_url, "drift") as url:
        db.upgrade(url)
        engine = create_engine(url, poolclass=pool.NullPool)
        with engine.connect() as conn:
            context = MigrationContext.configure(
                conn, opts={"compare_type": True, "compare_server_default": True}
            )
            diff = compare_metadata(context, models.Base.metadata)
        engine.dispose()
    assert diff == [], f"models and migrations differ; write a migration: {diff}"


def test_downgrade_to_base_and_up_again(server_url: str) -> None:
    from alembic import command

    with fresh_database(server_url, "down") as url:
        db.upgrade(url)
        command.downgrade(db.alembic_config(url), "base")
        engine = create_engine(url, poolclass=pool.NullPool)
        assert set(inspect(engine).get_table_names()) <= {"alembic_version"}
        db.upgrade(url)
        assert set(models.Base.metadata.tables) <= set(inspect(engine).get_table_names())
        engine.dispose()


def test_constraint_names_follow_the_convention(database_url: str) -> None:
    inspector = inspect(db.get_engine(database_url))
    assert inspector.get_pk_constraint("facts")["name"] == "pk_facts"
    uniques = {u["name"] for u in inspector.get_unique_constraints("facts")}
    assert "uq_facts_source_id_source_markdown_slug_row_num" in uniques
