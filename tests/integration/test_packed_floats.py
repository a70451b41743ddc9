"""models.packed against Postgres, and the search store's embedding path that uses it: which facts a
follow-up reads, and the fill that stores their vectors with the call that bought them."""

from __future__ import annotations

import math
import random
from decimal import Decimal

import pytest
from sqlalchemy import bindparam, insert, select, text
from sqlalchemy.orm import Session, sessionmaker

from models import Fact, LLMCall
from models.packed import PackedFloats, unpack_floats
from tests.rows import fact_row
from worker.accounting import Ledger, LLMCallRecord
from worker.llm.types import Usage
from worker.search.store import SearchStore

pytestmark = pytest.mark.integration

AWKWARD = [0.0, -0.0, 1.5, -2.25, 1e-300, 5e-324, 1.7976931348623157e308, 0.1, 1 / 3, -math.pi]


def test_packed_floats_arrive_as_the_same_doubles(session: Session) -> None:
    values = AWKWARD + [random.Random(7).uniform(-1, 1) for _ in range(3000)]
    packed = PackedFloats(values)
    got = session.execute(text("SELECT CAST(:v AS float8[])"), {"v": packed}).scalar_one()
    assert got == values
    again = session.execute(text("SELECT CAST(:v AS float8[])"), {"v": packed}).scalar_one()
    assert again == values  # sending it left the parameter as it was
    assert [math.copysign(1, x) for x in got[:2]] == [1, -1]  # the sign of zero too: bit for bit


def test_packed_floats_keep_infinities_nan_and_the_empty_array(session: Session) -> None:
    got = session.execute(
        text("SELECT CAST(:v AS float8[]), CAST(:e AS float8[])"),
        {"v": PackedFloats([math.inf, -math.inf, math.nan]), "e": PackedFloats([])},
    ).one()
    assert got[0][:2] == [math.inf, -math.inf] and math.isnan(got[0][2])
    assert got[1] == []


def test_floats_read_in_the_binary_format_are_the_stored_doubles(session: Session) -> None:
    """``unpack_floats(array_send(column))``, how consolidation reads an entity's vectors, answers what
    psycopg's parse of the text form does, bit for bit; the empty array is empty, and what a facts
    embedding never is (two dimensions, a NULL element) is refused, not misread."""
    values = AWKWARD + [math.inf, -math.inf] + [random.Random(8).uniform(-1, 1) for _ in range(3000)]
    stored = session.execute(text("SELECT CAST(:v AS float8[])"), {"v": values}).scalar_one()
    raw = session.execute(text("SELECT array_send(CAST(:v AS float8[]))"), {"v": values}).scalar_one()
    unpacked = unpack_floats(raw)
    assert list(unpacked) == stored == values
    assert [math.copysign(1, x) for x in unpacked[:2]] == [1, -1]
    assert list(unpack_floats(session.execute(text("SELECT array_send('{}'::float8[])")).scalar_one())) == []
    for odd in ("'{{1,2},{3,4}}'::float8[]", "'{1,NULL}'::float8[]", "'{1,2}'::int8[]"):
        with pytest.raises(ValueError):
            unpack_floats(session.execute(text(f"SELECT array_send({odd})")).scalar_one())


def facts(factory: sessionmaker[Session], count: int) -> list[int]:
    with factory.begin() as session:
        return list(
            session.scalars(insert(Fact).returning(Fact.id), [fact_row(n, f"fact {n}") for n in range(count)])
        )


def test_fill_embeddings_stores_each_facts_own_vector_and_keeps_one_already_there(
    tx_factory: sessionmaker[Session],
) -> None:
    store = SearchStore(tx_factory, Ledger(lambda key: None))
    ids = facts(tx_factory, 4)
    with tx_factory.begin() as session:
        session.execute(text("UPDATE facts SET embedding = '{9,9,9}' WHERE id = :id"), {"id": ids[2]})
    vectors = [[float(n), n + 0.5, -n / 3] for n in range(4)]
    # The third had one: a concurrent writer's stays.
    assert store.fill_embeddings(ids, vectors, model="m") == 3
    with tx_factory() as session:
        stored = dict(session.execute(select(Fact.id, Fact.embedding).where(Fact.id.in_(ids))).all())
    assert [stored[i] for i in ids] == [vectors[0], vectors[1], [9.0, 9.0, 9.0], vectors[3]]
    assert store.fill_embeddings([], [], model="m") == 0


def test_fill_embeddings_refuses_vectors_of_different_sizes(tx_factory: sessionmaker[Session]) -> None:
    store = SearchStore(tx_factory, Ledger(lambda key: None))
    ids = facts(tx_factory, 2)
    with pytest.raises(ValueError, match="same number of dimensions"):
        store.fill_embeddings(ids, [[1.0, 2.0], [1.0]], model="m")
    with pytest.raises(ValueError, match="2 facts but 1 embeddings"):
        store.fill_embeddings(ids, [[1.0, 2.0]], model="m")


def test_fill_embeddings_records_the_call_that_bought_them_with_them(
    tx_factory: sessionmaker[Session],
) -> None:
    store = SearchStore(tx_factory, Ledger(lambda key: None))
    ids = facts(tx_factory, 2)
    # A model the list prices know, so the row's cost shows the ledger costed it.
    call = LLMCallRecord("fact_embedding", "openai", "gpt-4o-mini", Usage(input_tokens=1_000_000), 12, "ok")
    assert store.fill_embeddings(ids, [[1.0], [2.0]], model="m", call=call) == 2
    with tx_factory() as session:
        rows = session.execute(select(LLMCall.purpose, LLMCall.input_tokens, LLMCall.cost_usd)).all()
    assert [(purpose, tokens) for purpose, tokens, _ in rows] == [("fact_embedding", 1_000_000)]
    assert rows[0].cost_usd == Decimal("0.15")  # costed by the ledger's prices


def test_pages_facts_to_embed_reads_the_pages_asked_for_and_only_facts_without_one(
    tx_factory: sessionmaker[Session],
) -> None:
    store = SearchStore(tx_factory, Ledger(lambda key: None))
    rows = [fact_row(n) | {"source_markdown_slug": slug} for n, slug in enumerate(["p", "q", "r", "q"])]
    rows.append(fact_row(9) | {"source_id": "other", "source_markdown_slug": "q"})
    with tx_factory.begin() as session:
        ids = list(session.scalars(insert(Fact).returning(Fact.id), rows))
        session.execute(text("UPDATE facts SET embedding = '{1}' WHERE id = :id"), {"id": ids[3]})
    found = store.pages_facts_to_embed([("default", "q"), ("default", "p"), ("default", "missing")])
    assert [row.id for row in found] == [ids[0], ids[1]]  # id order; q's second fact has a vector
    assert store.pages_facts_to_embed([]) == []


def test_a_fill_postgres_ends_to_break_a_deadlock_is_made_again(factory: sessionmaker[Session]) -> None:
    """The fill locks its facts in the join's order; a consolidation commit or an erasure holding one
    of them and then wanting another it holds deadlocked with it, and the fill was ended: `factmill
    embed` aborted, a follow-up's vectors were lost. It is made again (the vectors are in hand)."""
    from concurrent.futures import ThreadPoolExecutor

    from tests.locks import waits_on_a_lock

    store = SearchStore(factory, Ledger(lambda key: None))
    first, second = facts(factory, 2)
    lock = select(Fact.id).where(Fact.id == bindparam("id")).with_for_update()
    with factory() as other, ThreadPoolExecutor(1) as pool:
        other.execute(lock, {"id": second})  # the other side holds the second fact
        filling = pool.submit(store.fill_embeddings, [first, second], [[1.0], [2.0]], model="m")
        assert waits_on_a_lock(factory, filling, "%UPDATE facts%"), "the fill never waited on the fact"
        other.execute(lock, {"id": first})  # then wants the first, which the fill holds
        other.commit()
        assert filling.result(timeout=60) == 2
    with factory() as session:
        stored = dict(
            session.execute(select(Fact.id, Fact.embedding).where(Fact.id.in_([first, second]))).all()
        )
    assert stored == {first: [1.0], second: [2.0]}
