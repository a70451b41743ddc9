"""Reading the lifecycle back: current facts by default, the chain with include_history, what was true
as_of a time (search, the facts route over HTTP, the timeline), the operators' undo, the metrics."""

from __future__ import annotations

import json
from collections.abc import Iterator
from datetime import UTC, datetime
from typing import Any

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import select, update
from sqlalchemy.orm import Session, sessionmaker

from models import ConsolidationDecision, Fact
from tests.auth import send_key
from tests.cli import invoke_cli
from tests.integration.test_api import Recorder, make_runtime
from tests.integration.test_consolidation import (
    ALICE,
    JAN_PAGE,
    both_pages_consolidated,
)
from worker.api.app import create_app
from worker.api.metrics import ConsolidationCollector
from worker.consolidation.operators import UndoError, entities_named, entity_timeline, restore, unmerge
from worker.llm.openai_compat import OpenAIChatClient
from worker.search import SearchFilters, search

pytestmark = pytest.mark.integration

LISBON = "Alice Example lives in Lisbon now."
PORTO = "Alice Example lives in Porto now."
FEB = datetime(2026, 2, 1, tzinfo=UTC)
APR = datetime(2026, 4, 1, tzinfo=UTC)


@pytest.fixture
def consolidated(tx_factory: sessionmaker[Session], simulator: Any) -> sessionmaker[Session]:
    llm = OpenAIChatClient(model="simulator-1", base_url=simulator.base_url, provider="simulator")
    both_pages_consolidated(tx_factory, llm)
    return tx_factory


def found(factory: sessionmaker[Session], **lifecycle: Any) -> list[tuple[str, str]]:
    outcome = search(factory, None, "lex: lives", filters=SearchFilters(entity=ALICE, **lifecycle), limit=20)
    return sorted((r.fact, r.status) for r in outcome.results)


def test_search_returns_current_facts_the_chain_or_what_was_true_then(consolidated) -> None:
    assert found(consolidated) == [(PORTO, "current")]
    assert found(consolidated, include_history=True) == sorted(
        [(LISBON, "superseded"), (LISBON, "duplicate"), (PORTO, "current")]
    )
    assert found(consolidated, as_of=FEB) == [(LISBON, "superseded")], "in February she lived in Lisbon"
    assert found(consolidated, as_of=APR) == [(PORTO, "current")]
    outcome = search(consolidated, None, "lex: lisbon", filters=SearchFilters(include_history=True), limit=5)
    first = min(outcome.results, key=lambda r: r.fact_id)
    porto = next(f for f in entity_timeline(consolidated(), ALICE) if f.fact == PORTO)
    assert (first.superseded_by, first.valid_to) == (porto.id, porto.valid_from)
    assert outcome.as_dict()["results"][0]["valid_to"] is not None


@pytest.fixture
def client(database_url: str, broker_url: str, consolidated: sessionmaker[Session]) -> Iterator[TestClient]:
    runtime = make_runtime(database_url, consolidated, broker_url=broker_url)
    with TestClient(create_app(runtime, sender=Recorder(consolidated))) as test_client:
        send_key(test_client, consolidated)
        yield test_client


def test_the_facts_route_answers_current_history_and_as_of(client: TestClient) -> None:
    url = f"/v1/pages/default/{JAN_PAGE}/facts"
    current = client.get(url).json()["facts"]
    assert LISBON not in {f["fact"] for f in current}
    history = client.get(url, params={"include_history": "true"}).json()["facts"]
    lisbon = [f for f in history if f["fact"] == LISBON]
    assert [f["status"] for f in lisbon] == ["superseded", "duplicate"]
    assert lisbon[0]["valid_to"].startswith("2026-03-05T09:00") and lisbon[0]["superseded_by"] is not None
    assert lisbon[1]["duplicate_of"] == lisbon[0]["id"]
    then = client.get(url, params={"as_of": "2026-02-01T00:00:00Z"}).json()["facts"]
    assert LISBON in {f["fact"] for f in then}
    assert client.get(url, params={"as_of": "not a time"}).status_code == 422
    schema = client.get("/openapi.json").json()["components"]["schemas"]
    assert {"status", "valid_to", "superseded_by", "duplicate_of"} <= set(schema["FactRecord"]["properties"])


def test_operators_undo_decisions_with_an_audit_row_and_metrics_count_them(consolidated) -> None:
    timeline = entity_timeline(consolidated(), ALICE)
    old, dup = [e for e in timeline if e.fact == LISBON]
    with consolidated.begin() as session:
        assert restore(session, old.id, "alice-admin") > 0
        assert unmerge(session, dup.id, "alice-admin") == old.id
    with consolidated() as session:
        rows = {
            f.id: (f.status, f.valid_to, f.superseded_by, f.duplicate_of)
            for f in session.scalars(select(Fact))
        }
        undo = session.execute(
            select(
                ConsolidationDecision.decision, ConsolidationDecision.decided_by, ConsolidationDecision.reason
            )
            .where(ConsolidationDecision.decided_by == "operator")
            .order_by(ConsolidationDecision.id)
        ).all()
    assert rows[old.id] == ("current", None, None, None) and rows[dup.id] == ("current", None, None, None)
    assert [(d, by) for d, by, _ in undo] == [("restore", "operator"), ("unmerge", "operator")]
    assert all("alice-admin" in reason for _, _, reason in undo)
    with consolidated.begin() as session, pytest.raises(UndoError, match="not a duplicate"):
        unmerge(session, old.id, "x")
    with consolidated.begin() as session, pytest.raises(UndoError, match="no fact"):
        restore(session, 10**12, "x")
    families = {m.name: m for m in ConsolidationCollector(consolidated).collect()}
    samples = {
        tuple(s.labels.values()): s.value for s in families["factmill_consolidation_decisions"].samples
    }
    assert samples[("duplicate", "rule")] == 2 and samples[("updates", "model")] == 1
    assert samples[("restore", "operator")] == 1 and samples[("unmerge", "operator")] == 1
    statuses = {s.labels["status"]: s.value for s in families["factmill_facts_by_status"].samples}
    assert statuses["superseded"] == 0 and statuses["duplicate"] == 1 and statuses["current"] >= 4


def test_a_bare_name_finds_the_timeline_or_the_entities_it_names(consolidated) -> None:
    """`factmill facts history priya-raman` said "no facts" of people/priya-raman; a name in the slug
    rule's form reads the timeline, and a bare last part is answered with the entities it names."""
    with consolidated() as session:
        by_slug = entity_timeline(session, ALICE)
        assert by_slug and entity_timeline(session, "People/Alice Example") == by_slug
        assert entity_timeline(session, "alice-example") == []
        assert entities_named(session, "alice-example") == [ALICE]
        assert entities_named(session, "Alice Example") == [ALICE]
        assert entities_named(session, ALICE) == []  # it is the entity: nothing else to suggest
        assert entities_named(session, "!!") == []


def test_the_timeline_of_an_entity_of_tens_of_thousands_of_facts(tx_factory: sessionmaker[Session]) -> None:
    """It loaded every fact whole (256 floats of embedding each) and asked for their decisions with the
    ids in an IN list, two parameters a fact: past about 33,000 facts the driver refused the query."""
    from sqlalchemy import text

    with tx_factory.begin() as session:
        session.execute(
            text(
                "INSERT INTO facts (source_id, fact, kind, entity_slug, confidence, notability, source, "
                "source_session, source_markdown_slug, row_num) "
                "SELECT 'default', 'fact ' || n, 'fact', 'people/big', 0.9, "
                "'medium', 'cli:extract-conversation-facts', 's', 'conversations/big', n "
                "FROM generate_series(0, 33999) AS n"
            )
        )
        first = session.scalar(select(Fact.id).where(Fact.row_num == 0))
        session.add(
            ConsolidationDecision(
                source_id="default", entity_key="people/big", fact_id=first, decision="new",
                decided_by="rule", reason="the first",
            )
        )  # fmt: skip
    with tx_factory() as session:
        timeline = entity_timeline(session, "people/big")
    assert len(timeline) == 34_000 and timeline[0].reason == "the first" and timeline[1].reason is None


def test_the_as_of_sql_and_its_pure_rule_agree_on_every_kind_of_fact(
    tx_factory: sessionmaker[Session],
) -> None:
    """The SQL read an undated fact as begun when it was stored; true_at, which it says it mirrors (and
    which the unit tests pinned), read it as always true: the one oracle was not what production ran."""
    from itertools import product

    from sqlalchemy import text

    from worker.consolidation.history import Lifecycle
    from worker.core.consolidation import true_at

    moments = [datetime(2026, month, 1, tzinfo=UTC) for month in (1, 3, 5, 7)]
    starts, ends = [None, *moments], [None, *moments]
    rows = [
        (n, start, end, status, stored)
        for n, (start, end, status, stored) in enumerate(
            product(starts, ends, ("current", "superseded", "duplicate"), moments)
        )
    ]
    insert = text(
        "INSERT INTO facts (source_id, fact, kind, confidence, notability, source, source_session, "
        "source_markdown_slug, row_num, valid_from, valid_to, status, created_at) "
        "VALUES ('default', 'f', 'fact', 0.9, 'medium', 'cli:extract-conversation-facts', 's', 'p', "
        ":n, :start, :end, :status, :stored)"
    )
    with tx_factory.begin() as session:
        for n, start, end, status, stored in rows:
            session.execute(insert, {"n": n, "start": start, "end": end, "status": status, "stored": stored})
    for as_of in [*moments, datetime(2026, 2, 1, tzinfo=UTC), datetime(2026, 12, 1, tzinfo=UTC)]:
        where, params = Lifecycle(as_of=as_of).clause("facts")
        with tx_factory() as session:
            found = set(session.scalars(text(f"SELECT row_num FROM facts WHERE {where}"), params))
        expected = {
            n
            for n, start, end, status, stored in rows
            if true_at(start, end, status, as_of, stored_at=stored)
        }
        assert found == expected, as_of
        assert found, "a moment at which nothing was true would check nothing"


def test_an_undated_fact_is_true_from_when_it_was_said(
    tx_factory: sessionmaker[Session], simulator: Any
) -> None:
    """Facts with no date of their own (a model that gave none): the as-of reads started them when they
    were stored (December here, as a backfill of old chats does), while consolidation closed Lisbon at
    Porto's March: it ended before it began, and was true as of no moment."""
    from sqlalchemy import text

    from tests.integration.test_consolidation import JAN_BODY, MAR_BODY, MAR_PAGE, consolidate, extract
    from tests.integration.test_extraction import put_page

    llm = OpenAIChatClient(model="simulator-1", base_url=simulator.base_url, provider="simulator")
    for slug, body in ((JAN_PAGE, JAN_BODY), (MAR_PAGE, MAR_BODY)):
        put_page(tx_factory, slug, body)
        extract(tx_factory, llm, slug)
    with tx_factory.begin() as session:  # undated, and stored long after they were said
        session.execute(text("UPDATE facts SET valid_from = NULL, created_at = '2026-12-01T00:00:00Z'"))
    consolidate(tx_factory, llm)
    assert found(tx_factory, as_of=FEB) == [(LISBON, "superseded")], "in February she lived in Lisbon"
    assert found(tx_factory, as_of=APR) == [(PORTO, "current")]


def test_facts_history_json_writes_an_open_end_as_null(
    factory: sessionmaker[Session], simulator: Any, database_url: str
) -> None:
    """--json wrote "…" for a fact with no end (or no start), the table's way of saying it, where the
    API and a JSON reader expect null; and a start to the minute only."""
    llm = OpenAIChatClient(model="simulator-1", base_url=simulator.base_url, provider="simulator")
    both_pages_consolidated(factory, llm)
    shown = invoke_cli(database_url, "facts", "history", ALICE, "--json")
    assert shown.exit_code == 0, shown.output
    timeline = json.loads(shown.output)
    assert timeline and "…" not in shown.output
    current = [entry for entry in timeline if entry["status"] == "current"]
    assert current and all(entry["valid_to"] is None for entry in current)
    assert all(
        entry["valid_from"] is None or datetime.fromisoformat(entry["valid_from"]) for entry in timeline
    )


def test_the_timeline_credits_a_change_to_the_fact_it_closed(tx_factory, simulator: Any) -> None:
    """A late "Paris" (January) said to update the current "Berlin" (March) is itself closed, Berlin
    staying current; the timeline gave Berlin that verdict as the reason it changed."""
    from tests.integration.test_consolidation import arrive, lives

    llm = OpenAIChatClient(model="simulator-1", base_url=simulator.base_url, provider="simulator")
    arrive(tx_factory, llm, lives("2026-03-05", "Berlin"), lives("2026-01-05", "Paris"))
    with tx_factory() as session:
        timeline = {entry.fact: entry for entry in entity_timeline(session, ALICE)}
    paris, berlin = (
        timeline["Alice Example lives in Paris now."],
        timeline["Alice Example lives in Berlin now."],
    )
    assert (paris.status, paris.superseded_by, berlin.status) == ("superseded", berlin.id, "current")
    assert paris.reason is not None and "Paris" in paris.reason
    assert berlin.reason is not None and berlin.reason.startswith("rule: "), berlin.reason  # its own
    # Paris's page erased, the verdict's fact id goes NULL, as does Berlin's superseded_by: no match.
    from worker.extraction.erase import erase_page

    erase_page(tx_factory, "default", lives("2026-01-05", "Paris")[0], "test")
    with tx_factory() as session:
        [after] = [e for e in entity_timeline(session, ALICE) if e.id == berlin.id]
    assert after.reason == berlin.reason


def test_an_entitys_timeline_is_read_from_its_end_up_to_a_limit(
    factory: sessionmaker[Session], database_url: str
) -> None:
    """`facts history` read and printed every fact of an entity (200,000 facts: every one, and every
    decision on them). It shows the latest --limit (1,000 by default), in order, and says how many more."""
    from sqlalchemy import text

    from worker.consolidation.operators import count_entity_facts

    with factory.begin() as session:
        session.execute(
            text(
                "INSERT INTO facts (source_id, fact, kind, entity_slug, confidence, notability, source, "
                "source_session, source_markdown_slug, row_num, valid_from) "
                "SELECT 'default', 'fact ' || n, 'fact', 'people/long', 0.9, 'medium', "
                "'cli:extract-conversation-facts', 's', 'conversations/long', n, "
                "timestamptz '2024-01-01' + n * interval '1 day' FROM generate_series(0, 4) AS n"
            )
        )
        session.execute(  # two undated facts: they come first in the timeline, last in its latest
            text(
                "INSERT INTO facts (source_id, fact, kind, entity_slug, confidence, notability, source, "
                "source_session, source_markdown_slug, row_num) "
                "SELECT 'default', 'undated ' || n, 'fact', 'people/long', 0.9, 'medium', "
                "'cli:extract-conversation-facts', 's', 'conversations/long', 10 + n "
                "FROM generate_series(0, 1) n"
            )
        )
        last = session.scalar(select(Fact.id).where(Fact.row_num == 4))
        session.add(
            ConsolidationDecision(
                source_id="default", entity_key="people/long", fact_id=last, decision="new",
                decided_by="rule", reason="the last",
            )
        )  # fmt: skip
    with factory() as session:
        tail = entity_timeline(session, "people/long", limit=2)
        assert [e.fact for e in tail] == ["fact 3", "fact 4"] and tail[1].reason == "the last"
        whole = entity_timeline(session, "people/long")
        assert len(whole) == count_entity_facts(session, "people/long") == 7
        assert [e.fact for e in whole[:2]] == ["undated 0", "undated 1"]
        for limit in range(1, 9):  # the latest dated, then the latest undated: the whole's tail
            assert entity_timeline(session, "people/long", limit=limit) == whole[-limit:]
    shown = invoke_cli(database_url, "facts", "history", "people/long", "--limit", "2", "--json")
    assert shown.exit_code == 0, shown.output
    assert "the latest 2 of 7 facts; --limit shows more" in shown.stderr
    assert [entry["fact"] for entry in json.loads(shown.stdout)] == ["fact 3", "fact 4"]


def test_undoing_a_decision_whose_other_fact_is_gone_says_so_not_fact_0(consolidated) -> None:
    """An erasure or a re-extraction deleted the fact a duplicate pointed at (its link went NULL) before
    the consolidation job repaired it: `facts unmerge` said "unmerged from fact 0"."""
    from worker.cli.lifecycle import undone

    timeline = entity_timeline(consolidated(), ALICE)
    _, dup = [e for e in timeline if e.fact == LISBON]
    with consolidated.begin() as session:
        session.execute(update(Fact).where(Fact.id == dup.id).values(duplicate_of=None))
        assert unmerge(session, dup.id, "alice-admin") is None
    said = undone("unmerge", dup.id, None)
    assert "unmerged from a fact since deleted" in said and "fact 0" not in said


def test_cli_search_with_history_shows_each_facts_status_and_link(
    factory: sessionmaker[Session], simulator: Any, database_url: str
) -> None:
    """`factmill search --include-history` printed the superseded "lives in Lisbon" beside the current
    "lives in Porto" with nothing telling them apart; the table has a status column (and its link)
    whenever a result is not current."""
    llm = OpenAIChatClient(model="simulator-1", base_url=simulator.base_url, provider="simulator")
    both_pages_consolidated(factory, llm)
    with factory() as session:
        porto = next(f for f in entity_timeline(session, ALICE) if f.fact == PORTO)
    args = ("search", "lex: lives", "--no-expand", "--limit", "5")
    shown = invoke_cli(database_url, *args, "--include-history", COLUMNS="250")
    assert shown.exit_code == 0, shown.output
    assert f"superseded → {porto.id}" in shown.output and "duplicate = " in shown.output
    current = invoke_cli(database_url, *args, COLUMNS="250")
    assert current.exit_code == 0 and "Porto" in current.output and "status" not in current.output
