"""Index builds on hot tables for migrations: CONCURRENTLY, outside a transaction, retried cleanly."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from sqlalchemy import text

_INVALID = text("SELECT NOT indisvalid FROM pg_index WHERE indexrelid = to_regclass(:name)")


@contextmanager
def building_concurrently(op: Any) -> Iterator[None]:
    """Alembic's ``op`` outside the migration's transaction (CONCURRENTLY cannot run inside one), with
    the upgrade's lock_timeout (worker.db: a few seconds, then try again) lifted: a concurrent build
    waits for every transaction older than it in the database, and cut short it left an INVALID index
    and built it all again at every try. Its lock holds no read or write back."""
    with op.get_context().autocommit_block():
        bind = op.get_bind()
        was = bind.execute(text("SHOW lock_timeout")).scalar()
        bind.execute(text("SET lock_timeout = 0"))
        try:
            yield
        finally:
            bind.execute(text("SELECT set_config('lock_timeout', :was, false)"), {"was": was})


def create_index_concurrently(op: Any, name: str, definition: str) -> None:
    """CREATE INDEX CONCURRENTLY ``name`` ``definition`` (e.g. "ON facts (created_at) WHERE ..."), inside
    ``building_concurrently``. An attempt cut short (a restart) leaves an INVALID index of this name
    behind: it is dropped and built again; a valid one stays."""
    if op.get_bind().execute(_INVALID, {"name": name}).scalar():
        op.execute(f"DROP INDEX CONCURRENTLY {name}")
    op.execute(f"CREATE INDEX CONCURRENTLY IF NOT EXISTS {name} {definition}")
