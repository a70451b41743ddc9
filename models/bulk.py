"""Bulk INSERTs whose SQL never changes with the number of rows: the rows as one JSON document.

A multi-row ``VALUES`` insert (SQLAlchemy's insertmanyvalues) writes a new statement for every batch
size, with a placeholder per value. psycopg parses a statement longer than 4,096 characters or with
more than 50 parameters again on every call, in Python, and a page's facts are far past both limits:
that parse was the largest cost of committing a page (py-spy, bench/pipeline.py). Here the statement
text is fixed per table and column list, has one parameter, is parsed once and prepared by psycopg
after a few uses, and still goes in one round trip. The rows travel as one JSON array that Postgres
reads with ``jsonb_to_recordset`` into the columns' own types: an array per column (``unnest``, the
first version) made psycopg inspect and dump every list in Python, a few percent of a worker's CPU.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from datetime import date, datetime
from decimal import Decimal
from typing import Any

from sqlalchemy import Table, text
from sqlalchemy.dialects import postgresql
from sqlalchemy.orm import Session

_DIALECT = postgresql.dialect()  # type: ignore[no-untyped-call]
_ORDINAL = "bulk_ordinal"
_ROWS = "bulk_rows"


def _json_value(value: Any) -> Any:
    """What json.dumps cannot write itself, as the text Postgres reads into the column's type."""
    if isinstance(value, datetime | date):
        return value.isoformat()
    if isinstance(value, Decimal):
        return str(value)
    raise TypeError(f"a bulk insert cannot send a {type(value).__name__}")


def _finite(value: Any) -> Any:
    # JSON has no infinities or NaN; as strings, Postgres reads them into a float column all the same.
    if isinstance(value, float) and not math.isfinite(value):
        return "NaN" if math.isnan(value) else ("Infinity" if value > 0 else "-Infinity")
    return value


def rows_json(rows: Sequence[Mapping[str, Any]]) -> str:
    """The rows as one JSON array of objects (the document a BulkInsert sends)."""
    try:
        return json.dumps(rows, default=_json_value, allow_nan=False, ensure_ascii=False)
    except ValueError:  # a float that is not finite: rare, so only then are the values looked at
        cleaned = [{name: _finite(value) for name, value in row.items()} for row in rows]
        return json.dumps(cleaned, default=_json_value, allow_nan=False, ensure_ascii=False)


class BulkInsert:
    """``INSERT INTO table (columns) SELECT ... FROM jsonb_to_recordset(rows)``, built once per call site.

    ``conflict``: the unique columns of an ``ON CONFLICT ... DO NOTHING``. ``returning``: the column (or
    columns, comma-separated, for ``returned_rows``) whose values come back for the rows that went in.
    ``around``: a statement with ``{insert}`` where the INSERT goes, as a ``WITH`` query that also uses
    its ``RETURNING`` rows; what it selects is what ``returned`` gives.
    """

    def __init__(
        self,
        table: Table,
        columns: Sequence[str],
        *,
        conflict: Sequence[str] = (),
        returning: str | None = None,
        around: str | None = None,
    ) -> None:
        self.columns = tuple(columns)
        self._column_set = frozenset(self.columns)
        names = ", ".join(self.columns)
        types = ", ".join(f"{name} {table.c[name].type.compile(dialect=_DIALECT)}" for name in self.columns)
        # WITH ORDINALITY ... ORDER BY: the rows go in in the order given, so a sequence-generated key
        # takes ascending values in that order (the guarantee SQLAlchemy's own sorted RETURNING uses).
        sql = (
            f"INSERT INTO {table.name} ({names}) SELECT {names} FROM ROWS FROM "
            f"(jsonb_to_recordset(CAST(:{_ROWS} AS jsonb)) AS ({types})) "
            f"WITH ORDINALITY AS given({names}, {_ORDINAL}) ORDER BY {_ORDINAL}"
        )
        if conflict:
            sql += f" ON CONFLICT ({', '.join(conflict)}) DO NOTHING"
        if returning is not None:
            sql += f" RETURNING {returning}"
        if around is not None:
            sql = around.replace("{insert}", sql)
        self._statement = text(sql)

    def _parameters(self, rows: Sequence[Mapping[str, Any]]) -> dict[str, str]:
        # Every row must name exactly the columns: jsonb_to_recordset reads a missing key as NULL and
        # ignores an extra one, so either would otherwise go unnoticed.
        if rows[0].keys() != self._column_set:
            raise ValueError(f"rows have columns {sorted(rows[0])}, the insert takes {sorted(self.columns)}")
        if any(row.keys() != self._column_set for row in rows[1:]):
            raise ValueError(f"every row must have the columns {sorted(self.columns)}")
        return {_ROWS: rows_json(rows)}

    def execute(self, session: Session, rows: Sequence[Mapping[str, Any]]) -> None:
        """Insert the rows in the caller's transaction."""
        if rows:
            session.execute(self._statement, self._parameters(rows))

    def returned(self, session: Session, rows: Sequence[Mapping[str, Any]]) -> list[Any]:
        """Insert the rows; the ``returning`` values of those that went in."""
        if not rows:
            return []
        return list(session.execute(self._statement, self._parameters(rows)).scalars())

    def returned_rows(self, session: Session, rows: Sequence[Mapping[str, Any]]) -> list[Any]:
        """Insert the rows; the ``returning`` columns (several, comma-separated) of those that went in."""
        if not rows:
            return []
        return list(session.execute(self._statement, self._parameters(rows)).all())

    def new_keys(self, session: Session, rows: Sequence[Mapping[str, Any]]) -> list[int]:
        """Insert the rows (no conflict clause) and return their sequence-generated keys, one per row in
        the order given: ascending keys were assigned in insertion order, which is the order given."""
        keys = sorted(int(key) for key in self.returned(session, rows))
        if len(keys) != len(rows):
            raise RuntimeError(f"expected {len(rows)} new keys, got {len(keys)}")
        return keys
