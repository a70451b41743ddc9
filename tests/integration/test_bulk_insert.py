"""models.bulk against Postgres: keys in the order given, conflicts skipped, one fixed statement text."""

from __future__ import annotations

import math
from collections.abc import Iterator
from datetime import UTC, datetime
from decimal import Decimal

import pytest
from sqlalchemy import event, select
from sqlalchemy.orm import Session

from models import Fact, LLMCall
from models.bulk import BulkInsert
from tests.rows import fact_row as fact
from worker.extraction.rows import FACT_COLUMNS

pytestmark = pytest.mark.integration

CALL_COLUMNS = ("provider", "model", "purpose", "input_tokens", "outcome", "cost_usd", "job_id")
CALLS = BulkInsert(LLMCall.__table__, CALL_COLUMNS, returning="id")  # type: ignore[arg-type]
FACTS = BulkInsert(
    Fact.__table__,  # type: ignore[arg-type]
    FACT_COLUMNS,
    conflict=("source_id", "source_markdown_slug", "row_num"),
    returning="row_num",
)


def call(tokens: int) -> dict[str, object]:
    return {
        "provider": "openai",
        "model": "m",
        "purpose": "extraction",
        "input_tokens": tokens,
        "outcome": "ok",
        "cost_usd": Decimal("0.000125"),
        "job_id": None,
    }


@pytest.fixture
def statements(session: Session) -> Iterator[list[str]]:
    """The SQL texts sent to Postgres while the test runs."""
    sent: list[str] = []

    def record(conn, cursor, statement, parameters, context, executemany):  # type: ignore[no-untyped-def]
        sent.append(statement)

    engine = session.get_bind()
    event.listen(engine, "before_cursor_execute", record)
    yield sent
    event.remove(engine, "before_cursor_execute", record)


def test_new_keys_come_back_one_per_row_in_the_order_given(session: Session) -> None:
    tokens = [7, 3, 9, 1, 5] * 40
    keys = CALLS.new_keys(session, [call(n) for n in tokens])
    assert len(set(keys)) == len(tokens)
    stored = dict(session.execute(select(LLMCall.id, LLMCall.input_tokens).where(LLMCall.id.in_(keys))).all())
    assert [stored[key] for key in keys] == tokens
    assert {row.cost_usd for row in session.scalars(select(LLMCall).where(LLMCall.id.in_(keys)))} == {
        Decimal("0.000125")
    }


def test_rows_already_there_are_skipped_and_only_new_ones_come_back(session: Session) -> None:
    assert sorted(FACTS.returned(session, [fact(0), fact(1)])) == [0, 1]
    assert FACTS.returned(session, [fact(1, "something else"), fact(2)]) == [2]
    stored = session.execute(
        select(Fact.row_num, Fact.fact).where(Fact.source_markdown_slug == "p").order_by(Fact.row_num)
    ).all()
    assert [tuple(row) for row in stored] == [
        (0, "Alice works at Acme"),
        (1, "Alice works at Acme"),
        (2, "Alice works at Acme"),
    ]


def test_a_row_that_names_other_columns_is_refused_before_anything_is_sent(
    session: Session, statements: list[str]
) -> None:
    with pytest.raises(ValueError, match="the insert takes"):
        CALLS.new_keys(session, [call(1) | {"latency_ms": 5}])
    with pytest.raises(ValueError, match="the insert takes"):
        FACTS.returned(session, [{k: v for k, v in fact(0).items() if k != "claim_unit"}])
    assert not [sql for sql in statements if sql.startswith("INSERT")]


def test_nothing_to_insert_sends_nothing(session: Session, statements: list[str]) -> None:
    assert CALLS.new_keys(session, []) == []
    assert FACTS.returned(session, []) == []
    assert not [sql for sql in statements if sql.startswith("INSERT")]


def test_the_statement_is_the_same_short_text_for_any_number_of_rows(
    session: Session, statements: list[str]
) -> None:
    # What makes it cheap: psycopg caches the parse of a statement up to 4,096 characters and 50
    # parameters (psycopg._queries); a VALUES list per row would be a new, long statement each time.
    FACTS.returned(session, [fact(0)])
    FACTS.returned(session, [fact(n) for n in range(1, 301)])
    inserts = [sql for sql in statements if sql.startswith("INSERT")]
    assert len(inserts) == 2 and inserts[0] == inserts[1]
    assert len(inserts[0]) <= 4096
    assert inserts[0].count("%(") <= 50


def test_values_arrive_as_their_column_types(session: Session) -> None:
    """The rows travel as one JSON document: text with quotes, escapes and any script, timestamps with
    their zone, exact decimals, floats that JSON cannot write (infinity, NaN) and NULLs arrive intact."""
    text = 'She said "ça va?" \\ back\\slash, tab\t, 漢字 and 🙂'
    when = datetime(2024, 3, 15, 9, 0, 30, 123456, tzinfo=UTC)
    rows = [
        fact(0, text) | {"valid_from": when, "claim_value": math.inf, "claim_metric": "salary"},
        fact(1) | {"claim_value": -math.inf},
        fact(2) | {"claim_value": math.nan, "confidence": 0.1 + 0.2},
    ]
    assert sorted(FACTS.returned(session, rows)) == [0, 1, 2]
    columns = (Fact.row_num, Fact.fact, Fact.valid_from, Fact.claim_value, Fact.claim_metric, Fact.confidence)
    query = select(*columns).where(Fact.source_markdown_slug == "p")
    stored = {row.row_num: row for row in session.execute(query)}
    assert (stored[0].fact, stored[0].valid_from, stored[0].claim_metric) == (text, when, "salary")
    assert stored[0].claim_value == math.inf and stored[1].claim_value == -math.inf
    assert math.isnan(stored[2].claim_value) and stored[2].confidence == 0.1 + 0.2
    assert stored[1].valid_from is None and stored[1].claim_metric is None
    keys = CALLS.new_keys(session, [call(1) | {"cost_usd": Decimal("0.123456")}])
    assert session.scalar(select(LLMCall.cost_usd).where(LLMCall.id == keys[0])) == Decimal("0.123456")


def test_a_later_row_short_of_a_column_is_refused_not_stored_with_a_null(session: Session) -> None:
    short = {k: v for k, v in fact(1).items() if k != "kind"}
    with pytest.raises(ValueError, match="every row must have the columns"):
        FACTS.returned(session, [fact(0), short])
    with pytest.raises(ValueError, match="every row must have the columns"):
        FACTS.returned(session, [fact(0), fact(1) | {"extra": 1}])
