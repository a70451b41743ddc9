"""The fact lifecycle against real Postgres and the simulator over HTTP: duplicates merged by rule,
updates closed by the model's batched answer, every decision audited once, re-runs inert, a
re-extracted page re-consolidated, and the job kind under the kill switch."""

from __future__ import annotations

import re
from concurrent.futures import ThreadPoolExecutor
from datetime import UTC, datetime
from typing import Any

import pytest
from sqlalchemy import event as sqlalchemy_event
from sqlalchemy import func, insert, select, text, update
from sqlalchemy.orm import Session, sessionmaker

from models import ConsolidationCheckpoint, ConsolidationDecision, Fact, Job, LLMCall
from tests.integration.test_extraction import fmt, put_page
from tests.integration.test_provider_replies import completion
from tests.llm_wrappers import FailsFirst
from tests.locks import waits_on_a_lock
from worker.accounting import Ledger
from worker.config_store import CONSOLIDATION_ENABLED, ConfigReader, set_config
from worker.consolidation import consolidate_pages_entities, request_consolidation
from worker.consolidation.service import EntityRun, consolidate_entity
from worker.consolidation.store import ConsolidationStore, orphaned_links_query
from worker.extraction import ExtractOptions, run_extract_conversation_facts
from worker.llm.openai_compat import OpenAIChatClient
from worker.llm.retry import RetryingClient, RetryPolicy

pytestmark = pytest.mark.integration

ALICE = "people/alice-example"
JAN_PAGE = "conversations/alice-january"
MAR_PAGE = "conversations/alice-march"
JAN_BODY = "\n".join(
    [
        fmt("Alice Example", "2026-01-10", "9:00 AM", "I live in Lisbon now."),
        fmt("Bob Demo", "2026-01-10", "9:01 AM", "Nice, how is it?"),
        fmt("Alice Example", "2026-01-10", "9:02 AM", "I am on the Basic plan."),
        fmt("Bob Demo", "2026-01-10", "9:03 AM", "Ok."),
        # A new segment the next day repeats a fact word for word (a duplicate within the page).
        fmt("Alice Example", "2026-01-11", "9:00 AM", "I live in Lisbon now."),
        fmt("Bob Demo", "2026-01-11", "9:01 AM", "You said."),
    ]
)
MAR_BODY = "\n".join(
    [
        fmt("Alice Example", "2026-03-05", "9:00 AM", "I live in Porto now."),
        fmt("Bob Demo", "2026-03-05", "9:01 AM", "Big change!"),
        fmt("Alice Example", "2026-03-05", "9:02 AM", "I am on the Basic plan."),
        fmt("Bob Demo", "2026-03-05", "9:03 AM", "Still?"),
    ]
)
MAR_START = datetime(2026, 3, 5, 9, 0, tzinfo=UTC)


@pytest.fixture
def llm(simulator: Any) -> OpenAIChatClient:
    return OpenAIChatClient(model="simulator-1", base_url=simulator.base_url, provider="simulator")


def extract(factory: sessionmaker[Session], llm: Any, slug: str, **options: Any) -> None:
    run_extract_conversation_facts(factory, llm, ExtractOptions(slug=slug, **options))


def consolidate(factory: sessionmaker[Session], llm: Any, key: str = ALICE, job_id: int | None = None):  # type: ignore[no-untyped-def]
    store = ConsolidationStore(factory, Ledger(ConfigReader(factory, ttl=0).get))
    return consolidate_entity(store, llm, EntityRun("default", key, job_id=job_id))


def alice(factory: sessionmaker[Session]) -> dict[str, list[Fact]]:
    """Alice's facts by their text."""
    with factory() as session:
        rows = session.scalars(
            select(Fact).where(Fact.entity_slug == ALICE, ~Fact.is_audit).order_by(Fact.id)
        ).all()
    out: dict[str, list[Fact]] = {}
    for row in rows:
        out.setdefault(row.fact, []).append(row)
    return out


def calls(factory: sessionmaker[Session]) -> int:
    with factory() as session:
        return int(session.scalar(select(func.count()).where(LLMCall.purpose == "consolidation")) or 0)


def decisions(factory: sessionmaker[Session]) -> list[tuple[str, str]]:
    with factory() as session:
        rows = session.execute(
            select(ConsolidationDecision.decision, ConsolidationDecision.decided_by).order_by(
                ConsolidationDecision.id
            )
        ).all()
    return [(d, by) for d, by in rows]


def test_duplicates_merge_by_rule_and_an_update_closes_the_old_fact(tx_factory, llm) -> None:
    put_page(tx_factory, JAN_PAGE, JAN_BODY)
    extract(tx_factory, llm, JAN_PAGE)
    first = consolidate(tx_factory, llm)
    assert first.llm_calls == 0, "a repeated fact is a duplicate by rule, without the model"
    facts = alice(tx_factory)
    lisbon = facts["Alice Example lives in Lisbon now."]
    assert [f.status for f in lisbon] == ["current", "duplicate"]
    assert lisbon[1].duplicate_of == lisbon[0].id
    assert all(f.consolidated_at is not None for fs in facts.values() for f in fs)

    put_page(tx_factory, MAR_PAGE, MAR_BODY)
    extract(tx_factory, llm, MAR_PAGE)
    second = consolidate(tx_factory, llm)
    assert second.llm_calls == 1, "the ambiguous pairs of an entity go to the model in one call"
    assert calls(tx_factory) == 1
    facts = alice(tx_factory)
    old, new = facts["Alice Example lives in Lisbon now."][0], facts["Alice Example lives in Porto now."][0]
    assert (old.status, old.superseded_by, old.valid_to) == ("superseded", new.id, MAR_START)
    assert (new.status, new.valid_to) == ("current", None)
    basic = facts["Alice Example is on the Basic plan."]
    assert [f.status for f in basic] == ["current", "duplicate"], "said again across pages: a duplicate"
    with tx_factory() as session:
        update = session.scalars(
            select(ConsolidationDecision).where(ConsolidationDecision.fact_id == new.id)
        ).one()
        checkpoint = session.get(ConsolidationCheckpoint, ("default", ALICE))
    assert (update.decision, update.decided_by, update.other_fact_id) == ("updates", "model", old.id)
    assert update.reason.startswith("simulator (not a model)") and update.llm_call_id is not None
    assert checkpoint is not None and checkpoint.facts_done == 5 and checkpoint.last_fact_id == basic[1].id
    assert decisions(tx_factory).count(("duplicate", "rule")) == 2


def test_a_fact_said_again_after_the_fact_that_closed_it_in_the_same_run_stays_current(
    tx_factory, llm
) -> None:
    """Lisbon (January), then one page: Porto (March), Lisbon again (June). The run planned June's
    Lisbon as a duplicate of January's before the model closed January's at March: the return to
    Lisbon answered nothing, now or at any as_of. Then it was kept current, but beside Porto: planned
    as a duplicate, it was compared with nothing. Now it is decided again in a second round, against
    what is current then: it closes Porto in June."""
    put_page(tx_factory, JAN_PAGE, JAN_BODY)
    extract(tx_factory, llm, JAN_PAGE)
    consolidate(tx_factory, llm)
    body = "\n".join(
        [
            *MAR_BODY.splitlines()[:2],
            fmt("Alice Example", "2026-06-01", "9:00 AM", "I live in Lisbon now."),
            fmt("Bob Demo", "2026-06-01", "9:01 AM", "Back again!"),
        ]
    )
    put_page(tx_factory, "conversations/alice-back", body)
    extract(tx_factory, llm, "conversations/alice-back")
    consolidate(tx_factory, llm)
    facts = alice(tx_factory)
    january, june = (
        facts["Alice Example lives in Lisbon now."][0],
        facts["Alice Example lives in Lisbon now."][-1],
    )
    porto = facts["Alice Example lives in Porto now."][0]
    assert (january.status, january.superseded_by) == ("superseded", porto.id)
    assert (june.status, june.duplicate_of, june.consolidated_at is not None) == ("current", None, True)
    june_start = datetime(2026, 6, 1, 9, 0, tzinfo=UTC)
    assert (porto.status, porto.superseded_by, porto.valid_to) == ("superseded", june.id, june_start)
    with tx_factory() as session:
        kept, decided = session.scalars(
            select(ConsolidationDecision)
            .where(ConsolidationDecision.fact_id == june.id)
            .order_by(ConsolidationDecision.id)
        ).all()
    assert (kept.decision, kept.decided_by, kept.other_fact_id) == ("new", "rule", january.id)
    assert "supersedes in the same run" in kept.reason and str(porto.id) in kept.reason
    assert (decided.decision, decided.decided_by, decided.other_fact_id) == ("updates", "model", porto.id)


def test_a_restatement_reopened_in_a_run_is_compared_with_the_facts_after_it(tx_factory, llm) -> None:
    """One run of Lisbon (Jan), Porto (Mar), Lisbon (Jun), Faro (Aug): June's Lisbon, planned as a
    duplicate of January's, was never compared with Faro, and when Porto's closing of January's
    reopened it, both it and Faro stood current. Decided again in a second round, Faro closes it."""
    counters = arrive(
        tx_factory,
        llm,
        lives("2026-01-10", "Lisbon"),
        lives("2026-03-05", "Porto"),
        lives("2026-06-01", "Lisbon"),
        lives("2026-08-01", "Faro"),
        each=False,
    )
    facts = alice(tx_factory)
    _january, june = facts["Alice Example lives in Lisbon now."]
    faro = facts["Alice Example lives in Faro now."][0]
    current = sorted(text for text, rows in facts.items() for row in rows if row.status == "current")
    assert current == ["Alice Example lives in Faro now."]
    august = datetime(2026, 8, 1, 9, 0, tzinfo=UTC)
    assert (june.status, june.superseded_by, june.valid_to) == ("superseded", faro.id, august)
    assert counters.facts_considered == 4 and counters.llm_calls == 2  # the second round asked once
    # Each fact counted once, under what it came to (June's Lisbon: closed by Faro, not "new").
    assert counters.decisions == {"new": 1, "supersede": 3}
    with tx_factory() as session:
        done = session.scalar(
            select(ConsolidationCheckpoint.facts_done).where(ConsolidationCheckpoint.entity_key == ALICE)
        )
    assert done == 5  # decisions written: June's Lisbon was written twice (left to decide again, decided)


def one_line_page(day: str, text: str) -> str:
    return "\n".join([fmt("Alice Example", day, "9:00 AM", text), fmt("Bob Demo", day, "9:01 AM", "I see.")])


def lives(day: str, city: str) -> tuple[str, str]:
    """A one-line page dated ``day`` in which Alice says where she lives: (slug, body)."""
    return f"conversations/alice-{day}", one_line_page(day, f"I live in {city} now.")


def arrive(factory: sessionmaker[Session], llm: Any, *pages: tuple[str, str], each: bool = True) -> Any:
    """Store and extract ``pages`` in order, consolidating after each one (``each``) or once after all;
    the last consolidation's counters."""
    counters = None
    for slug, body in pages:
        put_page(factory, slug, body)
        extract(factory, llm, slug)
        if each:
            counters = consolidate(factory, llm)
    return counters if each else consolidate(factory, llm)


def both_pages_consolidated(factory: sessionmaker[Session], llm: Any) -> None:
    """January's and March's pages stored, extracted and consolidated together."""
    put_page(factory, JAN_PAGE, JAN_BODY)
    put_page(factory, MAR_PAGE, MAR_BODY)
    extract(factory, llm, JAN_PAGE)
    extract(factory, llm, MAR_PAGE)
    consolidate(factory, llm)


def test_a_change_that_arrives_late_reopens_what_restated_the_old_fact_after_it(tx_factory, llm) -> None:
    """Lisbon (January) and Lisbon again (June) were consolidated, June's as a duplicate of January's;
    then Porto (March) arrived and closed January's. Only one run's restatements were reopened, so
    June's return to Lisbon stayed a duplicate of a closed fact: as of July, only Porto."""
    put_page(tx_factory, JAN_PAGE, JAN_BODY)
    put_page(tx_factory, "conversations/alice-june", one_line_page("2026-06-01", "I live in Lisbon now."))
    for slug in (JAN_PAGE, "conversations/alice-june"):
        extract(tx_factory, llm, slug)
    consolidate(tx_factory, llm)
    lisbon = alice(tx_factory)["Alice Example lives in Lisbon now."]
    assert [f.status for f in lisbon] == ["current", "duplicate", "duplicate"]
    put_page(tx_factory, MAR_PAGE, MAR_BODY)
    extract(tx_factory, llm, MAR_PAGE)
    consolidate(tx_factory, llm)
    facts = alice(tx_factory)
    january, next_day, june = facts["Alice Example lives in Lisbon now."]
    porto = facts["Alice Example lives in Porto now."][0]
    assert (january.status, january.superseded_by) == ("superseded", porto.id)
    assert next_day.status == "duplicate"  # said before Porto: January's fact answers for it
    assert (june.status, june.duplicate_of) == ("current", None)
    # Reopened, June's is decided again against what is current: the return to Lisbon closes Porto.
    assert (porto.status, porto.superseded_by) == ("superseded", june.id)
    with tx_factory() as session:
        reopened = session.scalars(
            select(ConsolidationDecision).where(
                ConsolidationDecision.fact_id == june.id, ConsolidationDecision.decision == "new"
            )
        ).one()
    assert (reopened.decided_by, reopened.other_fact_id) == ("rule", january.id)


def test_a_fact_said_between_two_of_a_chain_ends_the_earlier_one(tx_factory, llm) -> None:
    """Lisbon (January) was closed by Porto (March); Faro (February) arrived after both. Only current
    facts are compared: Faro was closed by Porto, and Lisbon kept its March end, so as of February 15
    both Lisbon and Faro answered."""
    for slug, body in ((JAN_PAGE, JAN_BODY), (MAR_PAGE, MAR_BODY)):
        put_page(tx_factory, slug, body)
        extract(tx_factory, llm, slug)
        consolidate(tx_factory, llm)
    put_page(tx_factory, "conversations/alice-feb", one_line_page("2026-02-01", "I live in Faro now."))
    extract(tx_factory, llm, "conversations/alice-feb")
    consolidate(tx_factory, llm)
    facts = alice(tx_factory)
    lisbon, faro = (
        facts["Alice Example lives in Lisbon now."][0],
        facts["Alice Example lives in Faro now."][0],
    )
    porto = facts["Alice Example lives in Porto now."][0]
    assert (faro.status, faro.superseded_by, faro.valid_to) == ("superseded", porto.id, MAR_START)
    feb = datetime(2026, 2, 1, 9, 0, tzinfo=UTC)
    assert (lisbon.status, lisbon.superseded_by, lisbon.valid_to) == ("superseded", faro.id, feb)
    with tx_factory() as session:
        slotted = session.scalars(
            select(ConsolidationDecision).where(
                ConsolidationDecision.fact_id == faro.id, ConsolidationDecision.other_fact_id == lisbon.id
            )
        ).one()
    assert (slotted.decision, slotted.decided_by) == ("updates", "rule")


def test_a_run_decided_by_rule_alone_still_heeds_its_guard_each_round(tx_factory, llm, monkeypatch) -> None:
    """January's page is decided by rule alone (no pair is asked). The guard (the kill switch, a stopping
    worker) was checked only before a question, so such a run went on round after round to the end;
    now it is checked before each round, and what the rounds before committed stays."""
    import worker.consolidation.service as service

    monkeypatch.setattr(service, "MAX_FACTS_PER_ROUND", 1)
    put_page(tx_factory, JAN_PAGE, JAN_BODY)
    extract(tx_factory, llm, JAN_PAGE)

    class SwitchedOff(Exception):
        pass

    rounds: list[int] = []

    def guard() -> None:
        rounds.append(1)
        if len(rounds) > 2:
            raise SwitchedOff

    store = ConsolidationStore(tx_factory, Ledger(ConfigReader(tx_factory, ttl=0).get))
    with pytest.raises(SwitchedOff):
        consolidate_entity(store, llm, EntityRun("default", ALICE, guard=guard))
    facts = [f for fs in alice(tx_factory).values() for f in fs]
    assert len(facts) > 2
    assert sum(f.consolidated_at is not None for f in facts) == 2  # two rounds of one fact each


def test_a_duplicate_said_before_its_canonical_moves_the_canonicals_start(tx_factory, llm) -> None:
    """Lisbon (March 1) was consolidated; then a page from January saying the same arrived: a duplicate
    of March's fact by rule. As of February neither answered (a duplicate never does, and March's
    had not begun): the canonical now starts when the fact was first said."""
    put_page(tx_factory, "conversations/alice-mar1", one_line_page("2026-03-01", "I live in Lisbon now."))
    extract(tx_factory, llm, "conversations/alice-mar1")
    consolidate(tx_factory, llm)
    put_page(tx_factory, "conversations/alice-jan", one_line_page("2026-01-05", "I live in Lisbon now."))
    extract(tx_factory, llm, "conversations/alice-jan")
    consolidate(tx_factory, llm)
    march, january = alice(tx_factory)["Alice Example lives in Lisbon now."]
    assert (january.status, january.duplicate_of) == ("duplicate", march.id)
    assert (march.status, march.valid_from) == ("current", datetime(2026, 1, 5, 9, 0, tzinfo=UTC))
    from worker.consolidation.history import Lifecycle

    with tx_factory() as session:
        clause, params = Lifecycle(as_of=datetime(2026, 2, 1, tzinfo=UTC)).clause("f")
        answered = session.scalars(
            text(f"SELECT f.id FROM facts f WHERE f.entity_slug = :e AND NOT f.is_audit AND {clause}"),
            {**params, "e": ALICE},
        ).all()
    assert answered == [march.id]


def test_moving_a_canonicals_start_back_ends_what_it_closed_there_too(tx_factory, llm) -> None:
    """Lisbon (Jan) was closed by Porto (Mar); then Porto said in February arrived, a duplicate of
    March's. Porto now starts in February, and Lisbon ended in March still: both answered between."""
    arrive(tx_factory, llm, (JAN_PAGE, JAN_BODY), (MAR_PAGE, MAR_BODY), lives("2026-02-01", "Porto"))
    facts = alice(tx_factory)
    lisbon = facts["Alice Example lives in Lisbon now."][0]
    march, february = facts["Alice Example lives in Porto now."]
    feb = datetime(2026, 2, 1, 9, 0, tzinfo=UTC)
    assert (february.status, february.duplicate_of, march.valid_from) == ("duplicate", march.id, feb)
    assert (lisbon.status, lisbon.superseded_by, lisbon.valid_to) == ("superseded", march.id, feb)


@pytest.mark.parametrize("goes", ["erased", "unmerged"])
def test_an_earlier_saying_that_goes_gives_its_canonical_its_own_start_back(tx_factory, llm, goes) -> None:
    """As above, February's Porto moved March's start back to February and ended Lisbon there. Then
    February's saying goes (its page erased, or the duplicate unmerged): March's Porto starts in March
    again and Lisbon ends there again. Before, both kept February's time, and as of February 15 Porto
    answered with no saying left to support it. (A page re-extracted without the saying is not
    restarted: see forget_reasons_about.)"""
    from worker.consolidation.history import Lifecycle
    from worker.consolidation.operators import unmerge
    from worker.extraction.erase import erase_page

    feb_slug, feb_body = lives("2026-02-01", "Porto")
    arrive(tx_factory, llm, (JAN_PAGE, JAN_BODY), (MAR_PAGE, MAR_BODY), (feb_slug, feb_body))
    march, february = alice(tx_factory)["Alice Example lives in Porto now."]
    assert march.valid_from == datetime(2026, 2, 1, 9, 0, tzinfo=UTC)  # the premise
    if goes == "erased":
        erase_page(tx_factory, "default", feb_slug, "test")
    else:
        with tx_factory.begin() as session:
            assert unmerge(session, february.id, "test") == march.id
    facts = alice(tx_factory)
    lisbon = facts["Alice Example lives in Lisbon now."][0]
    march = next(f for f in facts["Alice Example lives in Porto now."] if f.id == march.id)
    assert (march.status, march.valid_from, march.valid_to) == ("current", MAR_START, None)
    assert (lisbon.status, lisbon.superseded_by, lisbon.valid_to) == ("superseded", march.id, MAR_START)
    with tx_factory() as session:
        clause, params = Lifecycle(as_of=datetime(2026, 2, 15, tzinfo=UTC)).clause("f")
        answered = session.scalars(
            text(f"SELECT f.id FROM facts f WHERE f.entity_slug = :e AND NOT f.is_audit AND {clause}"),
            {**params, "e": ALICE},
        ).all()
    assert lisbon.id in answered
    assert march.id not in answered  # (an unmerged February answers for itself: a fact of its own now)


def test_a_canonical_closed_inside_the_time_it_was_moved_over_is_decided_again(tx_factory, llm) -> None:
    """Porto (Feb 1) moved March's Porto back to February; then Lyon (Feb 10) arrived and closed it
    there. February's page erased, March's Porto went back to March as an empty interval and Lisbon's end
    went to March over Lyon's: as of Feb 20 both Lisbon and Lyon answered, and Lyon stayed current
    though Porto was said last. Now what it closed ends where it was closed, and it is decided again."""
    from worker.consolidation.history import Lifecycle
    from worker.extraction.erase import erase_page

    february = lives("2026-02-01", "Porto")
    arrive(tx_factory, llm, (JAN_PAGE, JAN_BODY), (MAR_PAGE, MAR_BODY), february, lives("2026-02-10", "Lyon"))
    facts = alice(tx_factory)
    porto, lyon = facts["Alice Example lives in Porto now."][0], facts["Alice Example lives in Lyon now."][0]
    feb10 = datetime(2026, 2, 10, 9, 0, tzinfo=UTC)
    assert (porto.status, porto.superseded_by, porto.valid_to) == ("superseded", lyon.id, feb10)  # premise
    erase_page(tx_factory, "default", february[0], "test")
    consolidate(tx_factory, llm)

    def answered(day: datetime) -> list[str]:
        with tx_factory() as session:
            clause, params = Lifecycle(as_of=day).clause("f")
            return list(
                session.scalars(
                    text(
                        f"SELECT f.fact FROM facts f WHERE f.entity_slug = :e AND NOT f.is_audit "
                        f"AND f.fact LIKE '%lives in%' AND {clause}"
                    ),
                    {**params, "e": ALICE},
                )
            )

    assert answered(datetime(2026, 2, 5, tzinfo=UTC)) == ["Alice Example lives in Lisbon now."]
    assert answered(datetime(2026, 2, 20, tzinfo=UTC)) == ["Alice Example lives in Lyon now."]
    assert answered(datetime(2026, 3, 10, tzinfo=UTC)) == ["Alice Example lives in Porto now."]
    current = [
        t for t, rows in alice(tx_factory).items() for r in rows if r.status == "current" and "lives" in t
    ]
    assert current == ["Alice Example lives in Porto now."]


def test_an_unmerge_that_leaves_a_canonical_to_decide_again_requests_its_entitys_run(tx_factory, llm) -> None:
    """The scenario above undone by an operator's unmerge of February's Porto: March's Porto is left to
    be decided again, and nothing asked for its entity's run (hidden until some other page of the
    source was extracted)."""
    from worker.consolidation.operators import unmerge
    from worker.jobs.outbox import CONSOLIDATION, page_subject

    arrive(
        tx_factory,
        llm,
        (JAN_PAGE, JAN_BODY),
        (MAR_PAGE, MAR_BODY),
        lives("2026-02-01", "Porto"),
        lives("2026-02-10", "Lyon"),
    )
    march, february = alice(tx_factory)["Alice Example lives in Porto now."]
    assert (march.status, february.duplicate_of) == ("superseded", march.id)  # premise: Lyon closed it
    with tx_factory.begin() as session:
        unmerge(session, february.id, "test")
    with tx_factory() as session:
        pending = session.scalars(
            select(Job.status).where(Job.kind == CONSOLIDATION, Job.subject == page_subject("default", ALICE))
        ).all()
    assert pending == ["queued"]
    consolidate(tx_factory, llm)
    porto = {f.id: f for f in alice(tx_factory)["Alice Example lives in Porto now."]}[march.id]
    # Decided again, by its own date (what it decides is the rules'): no longer an orphan.
    assert porto.consolidated_at is not None and porto.valid_from == MAR_START
    assert porto.status == "current" or (porto.superseded_by or porto.duplicate_of) is not None


@pytest.mark.parametrize(
    ("days", "answers"),
    [
        # (Lyon said early, Lyon, Porto, Porto said early): Porto, the later, closed Lyon.
        (("01-25", "02-10", "03-05", "02-01"), {"02-05": "Lisbon", "02-20": "Lyon", "03-10": "Porto"}),
        # Porto, the earlier, closed Lyon (moved before it): the closer gets the earlier new start.
        (("01-20", "03-01", "02-01", "01-25"), {"01-28": "Lisbon", "02-15": "Porto", "03-10": "Lyon"}),
    ],
    ids=["the-later-closed-it", "the-earlier-closed-it"],
)
def test_canonicals_one_page_moved_along_one_chain_are_restarted_closer_first(
    tx_factory, llm, days: tuple[str, str, str, str], answers: dict[str, str]
) -> None:
    """One page said Lyon and, appended later, Porto, each early: each moved a canonical of one chain
    back, and the one that closed the other ended it at its own moved start. Erased, the closed one
    restarted first was read as closed before its own start (on an end its closer's restart was about
    to move back) and orphaned, ending Lisbon on a date only the erased page said: for days nothing
    answered where Alice lived. Restarted by date (the later first), the second shape did the same."""
    from worker.consolidation.history import Lifecycle
    from worker.extraction.erase import erase_page

    lyon_early, lyon, porto, porto_early = (f"2026-{day}" for day in days)
    said = "conversations/alice-said"
    lyon_said = one_line_page(lyon_early, "I live in Lyon now.")
    arrive(
        tx_factory,
        llm,
        lives("2026-01-01", "Lisbon"),
        lives(lyon, "Lyon"),
        (said, lyon_said),
        lives(porto, "Porto"),
        (said, lyon_said + "\n" + one_line_page(porto_early, "I live in Porto now.")),
    )
    facts = alice(tx_factory)
    premise = [f.status for city in ("Lyon", "Porto") for f in facts[f"Alice Example lives in {city} now."]]
    assert premise.count("duplicate") == 2, premise  # both early sayings merged
    erase_page(tx_factory, "default", said, "test")
    consolidate(tx_factory, llm)

    def answered(day: str) -> list[str]:
        with tx_factory() as session:
            clause, params = Lifecycle(as_of=datetime.fromisoformat(f"2026-{day}T12:00:00+00:00")).clause("f")
            return list(
                session.scalars(
                    text(
                        f"SELECT f.fact FROM facts f WHERE f.entity_slug = :e AND NOT f.is_audit AND {clause}"
                    ),
                    {**params, "e": ALICE},
                )
            )

    for day, city in answers.items():
        assert answered(day) == [f"Alice Example lives in {city} now."], day


def test_a_canonical_restarts_at_the_earliest_saying_still_merged_into_it(tx_factory, llm) -> None:
    """Porto said on February 1 and on February 20, both duplicates of March's: the first erased,
    March's starts on February 20 (the saying left), and Lisbon ends there."""
    from worker.extraction.erase import erase_page

    first, second = lives("2026-02-01", "Porto"), lives("2026-02-20", "Porto")
    arrive(tx_factory, llm, (JAN_PAGE, JAN_BODY), (MAR_PAGE, MAR_BODY), second, first)
    erase_page(tx_factory, "default", first[0], "test")
    facts = alice(tx_factory)
    march = facts["Alice Example lives in Porto now."][0]
    lisbon = facts["Alice Example lives in Lisbon now."][0]
    feb20 = datetime(2026, 2, 20, 9, 0, tzinfo=UTC)
    assert (march.valid_from, lisbon.superseded_by, lisbon.valid_to) == (feb20, march.id, feb20)


def test_a_saying_from_before_what_its_canonical_closed_is_a_fact_of_its_own(tx_factory, llm) -> None:
    """Lisbon (Jan) was closed by Porto (Mar); then Porto said in December arrived, a duplicate of
    March's by rule. March's Porto moved its start back to December and ended Lisbon there, at
    greatest(December, January): Lisbon's interval was empty, and as of February only Porto answered.
    December's Porto is a saying of its own, ended where Lisbon begins; Lisbon and March's keep theirs,
    and Faro (Nov), which Lisbon had closed, now ends where December's Porto begins."""
    november, december = lives("2025-11-03", "Faro"), lives("2025-12-01", "Porto")
    arrive(tx_factory, llm, november, (JAN_PAGE, JAN_BODY), (MAR_PAGE, MAR_BODY), december)
    facts = alice(tx_factory)
    lisbon = facts["Alice Example lives in Lisbon now."][0]
    march, december = facts["Alice Example lives in Porto now."]
    jan = datetime(2026, 1, 10, 9, 0, tzinfo=UTC)
    assert (march.status, march.valid_from) == ("current", MAR_START)
    assert (lisbon.status, lisbon.superseded_by, lisbon.valid_from, lisbon.valid_to) == (
        "superseded",
        march.id,
        jan,
        MAR_START,
    )
    assert (december.status, december.superseded_by, december.valid_to) == ("superseded", lisbon.id, jan)
    faro = facts["Alice Example lives in Faro now."][0]
    dec = datetime(2025, 12, 1, 9, 0, tzinfo=UTC)
    assert (faro.status, faro.superseded_by, faro.valid_to) == ("superseded", december.id, dec)
    with tx_factory() as session:
        rows = session.scalars(
            select(ConsolidationDecision).where(ConsolidationDecision.fact_id == december.id)
        ).all()
    assert {(r.decision, r.decided_by, r.other_fact_id) for r in rows} == {
        ("new", "rule", march.id),
        ("updates", "rule", faro.id),  # slotted into the chain
    }


def test_a_saying_from_before_what_its_canonical_closes_in_the_same_run_is_a_fact_of_its_own(
    tx_factory, llm
) -> None:
    """Faro (Nov) was closed by Porto (Mar); a late run brings Porto said in December and Lisbon (Jan)
    together. December's Porto was merged into March's first (Lisbon was not yet closed by it), March's
    start moved back to December, and Lisbon, then closed by March's at March, answered beside it. Now
    December's Porto ends where Lisbon begins, and Faro where December's Porto begins."""
    arrive(tx_factory, llm, lives("2025-11-03", "Faro"), (MAR_PAGE, MAR_BODY))
    arrive(tx_factory, llm, lives("2025-12-01", "Porto"), lives("2026-01-10", "Lisbon"), each=False)
    facts = alice(tx_factory)
    march, december = facts["Alice Example lives in Porto now."]
    lisbon, faro = (
        facts["Alice Example lives in Lisbon now."][0],
        facts["Alice Example lives in Faro now."][0],
    )
    jan, dec = datetime(2026, 1, 10, 9, 0, tzinfo=UTC), datetime(2025, 12, 1, 9, 0, tzinfo=UTC)
    assert (march.status, march.valid_from) == ("current", MAR_START)
    assert (lisbon.status, lisbon.superseded_by, lisbon.valid_to) == ("superseded", march.id, MAR_START)
    assert (december.status, december.superseded_by, december.valid_to) == ("superseded", lisbon.id, jan)
    assert (faro.status, faro.superseded_by, faro.valid_to) == ("superseded", december.id, dec)


def test_a_split_saying_ends_at_the_first_change_whether_this_run_or_an_earlier_one_made_it(
    tx_factory, llm
) -> None:
    """Faro (Nov) -> Lisbon (Jan) -> Porto (Mar) were consolidated; a late run brings Porto said in
    December and Braga (Feb). The split weighed only this run's change (Braga) and ended December's
    Porto in February, while Lisbon, an earlier run's change, began in January."""
    arrive(
        tx_factory,
        llm,
        lives("2025-11-03", "Faro"),
        lives("2026-01-10", "Lisbon"),
        lives("2026-03-05", "Porto"),
    )
    arrive(tx_factory, llm, lives("2025-12-01", "Porto"), lives("2026-02-01", "Braga"), each=False)
    facts = alice(tx_factory)
    march, december = facts["Alice Example lives in Porto now."]
    faro, lisbon = (
        facts["Alice Example lives in Faro now."][0],
        facts["Alice Example lives in Lisbon now."][0],
    )
    braga = facts["Alice Example lives in Braga now."][0]

    def at(month: int, day: int, year: int = 2026) -> datetime:
        return datetime(year, month, day, 9, 0, tzinfo=UTC)

    chain = [(f.id, f.superseded_by, f.valid_to) for f in (faro, december, lisbon, braga)]
    assert chain == [
        (faro.id, december.id, at(12, 1, 2025)),
        (december.id, lisbon.id, at(1, 10)),
        (lisbon.id, braga.id, at(2, 1)),
        (braga.id, march.id, at(3, 5)),
    ]
    assert (march.status, march.valid_from) == ("current", at(3, 5))


def test_rerunning_changes_nothing(tx_factory, llm) -> None:
    put_page(tx_factory, JAN_PAGE, JAN_BODY)
    put_page(tx_factory, MAR_PAGE, MAR_BODY)
    extract(tx_factory, llm, JAN_PAGE)
    extract(tx_factory, llm, MAR_PAGE)
    consolidate(tx_factory, llm)
    before = (
        decisions(tx_factory),
        calls(tx_factory),
        {t: [(f.status, f.valid_to) for f in fs] for t, fs in alice(tx_factory).items()},
    )
    again = consolidate(tx_factory, llm)
    assert again.facts_considered == 0 and again.llm_calls == 0
    after = (
        decisions(tx_factory),
        calls(tx_factory),
        {t: [(f.status, f.valid_to) for f in fs] for t, fs in alice(tx_factory).items()},
    )
    assert after == before


def test_a_run_reads_only_the_pending_facts_kinds_and_nothing_when_none_is_pending(tx_factory, llm) -> None:
    """A run read every fact of the entity (with its vector), then used the pending facts' kinds only:
    other kinds are never compared. Now it reads the current facts of the pending facts' kinds, and
    nothing more when nothing is pending (another run got there first)."""
    put_page(tx_factory, JAN_PAGE, JAN_BODY)
    extract(tx_factory, llm, JAN_PAGE)
    consolidate(tx_factory, llm)
    store = ConsolidationStore(tx_factory, Ledger(ConfigReader(tx_factory, ttl=0).get))
    assert store.entity_facts("default", ALICE) == ([], [])
    with tx_factory() as session:
        first, second = session.scalars(
            select(Fact.id)
            .where(Fact.entity_slug == ALICE, ~Fact.is_audit, Fact.status == "current")
            .order_by(Fact.id)
        ).all()
    with tx_factory.begin() as session:
        session.execute(text("UPDATE facts SET consolidated_at = NULL WHERE id = :id"), {"id": first})
        session.execute(text("UPDATE facts SET kind = 'event' WHERE id = :id"), {"id": second})
    pending, pool = store.entity_facts("default", ALICE)
    assert [fact.id for fact in pending] == [first] and pool == []  # the event is not read for a fact
    with tx_factory.begin() as session:
        session.execute(text("UPDATE facts SET kind = 'fact' WHERE id = :id"), {"id": second})
    pending, pool = store.entity_facts("default", ALICE)
    assert [fact.id for fact in pending] == [first] and [fact.id for fact in pool] == [second]


def test_re_extracting_a_page_re_consolidates_its_entities(tx_factory, llm) -> None:
    put_page(tx_factory, JAN_PAGE, JAN_BODY)
    put_page(tx_factory, MAR_PAGE, MAR_BODY)
    extract(tx_factory, llm, JAN_PAGE)
    extract(tx_factory, llm, MAR_PAGE)
    consolidate(tx_factory, llm)
    extract(tx_factory, llm, MAR_PAGE, force=True)  # the March facts are deleted and extracted again
    old = alice(tx_factory)["Alice Example lives in Lisbon now."][0]
    assert old.status == "superseded" and old.superseded_by is None, "its link went with the old fact"
    with tx_factory.begin() as session:
        keys = request_consolidation(session, "default", MAR_PAGE)
    assert ALICE in {subject for subject in _subjects(tx_factory, keys)}
    redo = consolidate(tx_factory, llm)
    assert redo.restored == 1
    facts = alice(tx_factory)
    old, new = facts["Alice Example lives in Lisbon now."][0], facts["Alice Example lives in Porto now."][0]
    assert (old.status, old.superseded_by, old.valid_to) == ("superseded", new.id, MAR_START)
    assert [f.status for f in facts["Alice Example is on the Basic plan."]] == ["current", "duplicate"]
    with tx_factory() as session:
        restored = session.scalars(
            select(ConsolidationDecision).where(ConsolidationDecision.decision == "restore")
        ).one()
    assert restored.fact_id == old.id and restored.decided_by == "rule"


def _subjects(factory: sessionmaker[Session], jobs: list[tuple[int, str]]) -> list[str]:
    with factory() as session:
        return [session.get(Job, job_id).subject.partition("|")[2] for job_id, _ in jobs]  # type: ignore[union-attr]


def test_request_consolidation_asks_one_job_per_entity_and_groups_facts_without_one_by_page(
    tx_factory, llm
) -> None:
    put_page(tx_factory, JAN_PAGE, JAN_BODY)
    extract(tx_factory, llm, JAN_PAGE)
    with tx_factory.begin() as session:
        session.execute(
            Fact.__table__.update()
            .where(Fact.fact == "Alice Example is on the Basic plan.")
            .values(entity_slug=None)
        )
    with tx_factory.begin() as session:
        first = request_consolidation(session, "default", JAN_PAGE)
        again = request_consolidation(session, "default", JAN_PAGE)
    assert sorted(_subjects(tx_factory, first)) == sorted([ALICE, f"page:{JAN_PAGE}"])
    assert again == [], "one pending job per entity: asking again reuses it, with nothing new to send"
    with tx_factory() as session:
        assert session.scalar(select(func.count()).select_from(Job).where(Job.status == "queued")) == 2
    consolidate(tx_factory, llm)
    consolidate(tx_factory, llm, key=f"page:{JAN_PAGE}")
    with tx_factory.begin() as session:
        assert request_consolidation(session, "default", JAN_PAGE) == [], "nothing left to consolidate"


def test_pages_request_their_entities_jobs_together_and_a_pending_job_is_sent_once(tx_factory, llm) -> None:
    put_page(tx_factory, JAN_PAGE, JAN_BODY)
    put_page(tx_factory, MAR_PAGE, MAR_BODY)
    extract(tx_factory, llm, JAN_PAGE)
    extract(tx_factory, llm, MAR_PAGE)
    pages = [("default", JAN_PAGE), ("default", MAR_PAGE)]
    # Alice's facts on both pages: one job for her, sent once; nothing else has pending facts.
    assert consolidate_pages_entities(tx_factory, pages) == 1

    def jobs() -> list[tuple[str, Any]]:
        with tx_factory() as session:
            rows = session.execute(select(Job.subject, Job.enqueued_at).where(Job.kind == "consolidation"))
            return [(subject, enqueued_at) for subject, enqueued_at in rows]

    sent = jobs()
    assert [subject.partition("|")[2] for subject, _ in sent] == [ALICE] and sent[0][1] is not None
    # Asked again while it is still queued: the same job, not a second message.
    assert consolidate_pages_entities(tx_factory, pages) == 1
    assert jobs() == sent, "a pending job's message is already on its way: it is not sent again"


def test_more_pages_than_a_query_has_parameters_request_their_entities(tx_factory, llm) -> None:
    """A tuple IN list took two parameters a page: past 32,767 pages (a backfill pass's) the driver
    refused the query, after the pass's facts had committed."""
    from worker.consolidation.store import pending_entity_keys

    put_page(tx_factory, JAN_PAGE, JAN_BODY)
    extract(tx_factory, llm, JAN_PAGE)
    pages = [("default", f"never-stored-{n}") for n in range(40_000)] + [("default", JAN_PAGE)]
    with tx_factory() as session:
        assert ("default", ALICE) in pending_entity_keys(session, pages)


def test_the_orphaned_link_read_can_use_its_partial_index(session: Session) -> None:
    # The index is built by the migration and the query by the store: if their predicates drift
    # apart, the planner can no longer prove the query's rows are in the index and every extraction
    # scans its source's facts again. Sequential scans are priced out so the empty table still shows
    # which plans are possible; the other indexes on source_id are dropped (in the test's transaction,
    # rolled back) since on an empty table the planner is free to prefer them.
    query = orphaned_links_query(["default"]).compile(
        dialect=session.get_bind().dialect, compile_kwargs={"literal_binds": True}
    )
    session.execute(text("SET LOCAL enable_seqscan = off"))
    session.execute(text("DROP INDEX ix_facts_source_id_entity"))
    session.execute(text("ALTER TABLE facts DROP CONSTRAINT uq_facts_source_id_source_markdown_slug_row_num"))
    plan = "\n".join(session.execute(text(f"EXPLAIN {query}")).scalars())
    assert "ix_facts_orphaned_links" in plan, plan


def test_the_job_kind_runs_under_its_kill_switch(factory, database_url, simulator) -> None:
    from worker.jobs.lifecycle import run_job
    from worker.jobs.outbox import CONSOLIDATION, page_subject, request_job
    from worker.runtime import Runtime
    from worker.settings import Settings

    # The facts are extracted here, not embedded: as by workers that embed none (with embedding on, a
    # worker's run leaves facts stored in the last ten minutes without a vector for their follow-up).
    settings = Settings(
        database_url=database_url,
        simulator_url=simulator.base_url,
        llm="simulator",
        embed_after_extraction=False,
    )
    rt = Runtime(settings=settings, factory=factory, config=ConfigReader(factory, ttl=0))
    llm = OpenAIChatClient(model="simulator-1", base_url=simulator.base_url, provider="simulator")
    put_page(factory, JAN_PAGE, JAN_BODY)
    put_page(factory, MAR_PAGE, MAR_BODY)
    extract(factory, llm, JAN_PAGE)
    extract(factory, llm, MAR_PAGE)
    with factory.begin() as session:
        set_config(session, CONSOLIDATION_ENABLED, "false")
        job_id = request_job(session, CONSOLIDATION, page_subject("default", ALICE)).job_id
    try:
        assert run_job(rt, job_id, CONSOLIDATION).status == "paused"
        assert decisions(factory) == []
        with factory.begin() as session:
            set_config(session, CONSOLIDATION_ENABLED, "true")
            session.execute(Job.__table__.update().where(Job.id == job_id).values(status="queued"))
        assert run_job(rt, job_id, CONSOLIDATION).status == "succeeded"
        with factory() as session:
            job = session.get(Job, job_id)
            audit_jobs = set(session.scalars(select(ConsolidationDecision.job_id)))
            call_jobs = set(session.scalars(select(LLMCall.job_id).where(LLMCall.purpose == "consolidation")))
        assert job is not None and job.counters["llm_calls"] == 1
        assert job.counters["decisions"] == {"new": 2, "duplicate": 2, "supersede": 1}
        assert audit_jobs == {job_id} and call_jobs == {job_id}
    finally:
        rt.close()


def test_the_sweep_requests_the_consolidation_a_dead_worker_never_requested(
    tx_factory, llm, database_url
) -> None:
    """A page's consolidation is requested on the follow-up thread that embeds its facts, after its
    job has succeeded: a deploy, scale-in or OOM kill in between left the facts unconsolidated for
    good (duplicates shown, nothing superseded) until another page of the entity came."""
    from datetime import timedelta

    from tests.integration.test_api import make_runtime
    from tests.maintenance import maintained
    from worker.jobs.outbox import CONSOLIDATION, page_subject

    put_page(tx_factory, JAN_PAGE, JAN_BODY)
    extract(tx_factory, llm, JAN_PAGE)  # no request made: as if its worker died before the follow-up
    # Its facts have no vectors: the vectors catch-up would hand them to follow-up threads (another thread
    # on this test's one connection).
    rt = make_runtime(database_url, tx_factory, embed_after_extraction=False)

    def jobs() -> list[tuple[str, str]]:
        with tx_factory() as session:
            return list(session.execute(select(Job.subject, Job.status).where(Job.kind == CONSOLIDATION)))

    assert maintained(rt).steps["consolidations_caught_up"] == 0 and jobs() == []  # within the grace
    with tx_factory.begin() as session:
        session.execute(Fact.__table__.update().values(created_at=func.now() - timedelta(minutes=20)))
    assert maintained(rt).steps["consolidations_caught_up"] == 1
    assert jobs() == [(page_subject("default", ALICE), "queued")]
    assert maintained(rt).steps["consolidations_caught_up"] == 0  # a job is pending
    with tx_factory.begin() as session:  # it failed: an operator's retry, not a new job every sweep
        session.execute(Job.__table__.update().values(status="failed"))
    assert maintained(rt).steps["consolidations_caught_up"] == 0
    with tx_factory.begin() as session:
        session.execute(Job.__table__.delete())
        session.execute(Fact.__table__.update().values(created_at=func.now() - timedelta(days=2)))
    assert maintained(rt).steps["consolidations_caught_up"] == 0  # past the day: `factmill facts consolidate`


def test_a_backlog_of_covered_facts_hides_no_lost_request(tx_factory) -> None:
    """The catch-up read the oldest facts first and only then passed over those whose entity had a job:
    a backlog of queued (or paused) jobs' facts filled the read every sweep, and a lost request behind
    it was never found."""
    from worker.consolidation import catch_up_consolidation
    from worker.jobs.outbox import CONSOLIDATION, page_subject, request_job

    with tx_factory.begin() as session:
        session.execute(
            text(
                "INSERT INTO facts (source_id, fact, kind, entity_slug, confidence, notability, source, "
                "source_session, source_markdown_slug, row_num, created_at) "
                "SELECT 'default', 'backlog ' || n, 'fact', 'people/queued', 0.9, 'medium', 's', 's', "
                "'conversations/q', n, now() - interval '2 hours' FROM generate_series(0, 29) AS n"
            )
        )
        session.execute(
            text(
                "INSERT INTO facts (source_id, fact, kind, entity_slug, confidence, notability, source, "
                "source_session, source_markdown_slug, row_num, created_at) "
                "VALUES ('default', 'lost', 'fact', 'people/lost', 0.9, 'medium', 's', 's', "
                "'conversations/l', 0, now() - interval '1 hour')"
            )
        )
        request_job(session, CONSOLIDATION, page_subject("default", "people/queued"))  # covers the backlog
    assert catch_up_consolidation(tx_factory, scan=10) == 1
    with tx_factory() as session:
        subjects = set(session.scalars(select(Job.subject).where(Job.kind == CONSOLIDATION)))
    assert subjects == {"default|people/queued", "default|people/lost"}


def test_a_job_leaves_facts_still_waiting_for_their_vectors_and_the_catch_up_sees_them_later(
    tx_factory,
) -> None:
    """A page's facts commit, then its follow-up embeds them and asks for their entities: a job another
    page asked for meanwhile decided them by their words only ("moved to Porto" and "lives in Lisbon"
    share none: both current for good). Facts stored in the last ten minutes without a vector wait for
    their own request; a job asked for in that time does not count as having covered them."""
    from worker.consolidation import CATCH_UP_GRACE_SECONDS, catch_up_consolidation
    from worker.jobs.outbox import CONSOLIDATION, page_subject, request_job

    insert = (
        "INSERT INTO facts (source_id, fact, kind, entity_slug, confidence, notability, source, "
        "source_session, source_markdown_slug, row_num, created_at, embedding) VALUES "
    )
    with tx_factory.begin() as session:
        session.execute(
            text(
                insert
                + "('default', 'fresh', 'fact', 'people/e', 0.9, 'medium', 's', 's', 'conversations/a', 0, "
                "now(), NULL), "
                "('default', 'embedded', 'fact', 'people/e', 0.9, 'medium', 's', 's', 'conversations/a', 1, "
                "now(), ARRAY[0.6, 0.8]), "
                "('default', 'old', 'fact', 'people/e', 0.9, 'medium', 's', 's', 'conversations/b', 0, "
                "now() - interval '20 minutes', NULL)"
            )
        )
    deferring = ConsolidationStore(
        tx_factory, Ledger({}.get), defer_unembedded_seconds=CATCH_UP_GRACE_SECONDS
    )
    pending, batch, _ = deferring.entity_round("default", "people/e", 10)
    assert sorted(f.text for f in batch) == ["embedded", "old"] and len(pending) == 2
    assert deferring.deferred == 1  # the job says so ("every fact was decided" said of a pending one)
    everything = ConsolidationStore(tx_factory, Ledger({}.get))  # embedding off: nothing to wait for
    assert len(everything.entity_round("default", "people/e", 10)[0]) == 3
    # Nor is there with Anthropic alone (no embeddings API): its facts were deferred every time.
    from worker.llm.gateway import can_embed
    from worker.settings import Settings

    assert not can_embed(Settings(llm="anthropic", anthropic_api_key="k"))
    assert can_embed(Settings(llm="anthropic", anthropic_api_key="k", openai_api_key="o"))
    assert can_embed(Settings(llm="simulator")) and can_embed(Settings(llm="openai", openai_api_key="o"))
    # A job of the entity asked for a minute after the fresh fact (it passed the fact over): once the
    # fact is past the grace, the catch-up asks for it again; a job asked for after that covers it.
    with tx_factory.begin() as session:
        session.execute(update(Fact).values(created_at=func.now() - text("interval '20 minutes'")))
        job_id = request_job(session, CONSOLIDATION, page_subject("default", "people/e")).job_id
        session.execute(
            update(Job)
            .where(Job.id == job_id)
            .values(status="succeeded", created_at=func.now() - text("interval '19 minutes'"))
        )
    assert catch_up_consolidation(tx_factory) == 1
    with tx_factory.begin() as session:
        session.execute(update(Job).values(status="failed"))
    assert catch_up_consolidation(tx_factory) == 0  # the job asked for after the grace covers it


def test_without_an_embeddings_model_new_facts_skip_the_embedding_follow_up(
    database_url, factory, llm
) -> None:
    """Anthropic with no OpenAI key has no embeddings API, yet every commit sent its page to the
    embedding follow-up: each run re-read the page's facts to fail, logged a retry no sweep would make,
    and charged the chat model's rate limit for the refused call. The page's entities are now asked for
    at the run's end, as without embedding."""
    from worker.jobs.lifecycle import run_job
    from worker.jobs.outbox import CONSOLIDATION, EXTRACTION, page_subject, request_job
    from worker.runtime import Runtime
    from worker.settings import Settings

    class Submitted:
        def __init__(self) -> None:
            self.items: list[Any] = []

        def submit(self, key: Any, item: Any, work: Any) -> None:
            self.items.append((key, item))

    follow_ups = Submitted()
    settings = Settings(database_url=database_url, llm="anthropic", anthropic_api_key="k")
    rt = Runtime(
        settings=settings,
        factory=factory,
        config=ConfigReader(factory, ttl=0),
        _llm=llm,
        _follow_ups=follow_ups,  # type: ignore[arg-type]
    )
    put_page(factory, JAN_PAGE, JAN_BODY)
    with factory.begin() as session:
        job_id = request_job(session, EXTRACTION, page_subject("default", JAN_PAGE)).job_id
    assert run_job(rt, job_id, EXTRACTION).status == "succeeded"
    assert follow_ups.items == []
    with factory() as session:
        asked = session.scalars(select(Job.subject).where(Job.kind == CONSOLIDATION)).all()
    assert page_subject("default", ALICE) in asked


def test_the_catch_up_asks_for_the_orphans_a_lost_follow_up_would_have(tx_factory) -> None:
    """A re-extraction deleted the fact that another had been closed by: the orphan's entity was asked
    for by the page's follow-up only, and a worker that died before it left the orphan hidden from
    current reads for good (the catch-up and `factmill facts consolidate` read unconsolidated facts
    only). The catch-up asks for the sources' orphans with the facts it catches up, the work list too."""
    from worker.consolidation import catch_up_consolidation
    from worker.consolidation.store import unconsolidated_entity_keys

    insert = (
        "INSERT INTO facts (source_id, fact, kind, entity_slug, confidence, notability, source, "
        "source_session, source_markdown_slug, row_num, created_at, status, consolidated_at) VALUES "
    )
    with tx_factory.begin() as session:
        session.execute(
            text(
                insert
                + "('default', 'new', 'fact', 'people/new', 0.9, 'medium', 's', 's', 'conversations/p', 0, "
                "now() - interval '1 hour', 'current', NULL), "
                "('default', 'orphan', 'fact', 'people/orphan', 0.9, 'medium', 's', 's', 'chats/o', 0, "
                "now() - interval '3 days', 'superseded', now() - interval '2 days'), "
                "('other', 'elsewhere', 'fact', 'people/else', 0.9, 'medium', 's', 's', 'chats/e', 0, "
                "now() - interval '3 days', 'superseded', now() - interval '2 days')"
            )
        )
        assert unconsolidated_entity_keys(session, "default") == [
            ("default", "people/new"),
            ("default", "people/orphan"),
        ]
        assert unconsolidated_entity_keys(session, None) == [
            ("default", "people/new"),
            ("default", "people/orphan"),
            ("other", "people/else"),
        ]
    assert catch_up_consolidation(tx_factory) == 2
    with tx_factory() as session:
        subjects = set(session.scalars(select(Job.subject).where(Job.kind == "consolidation")))
    assert subjects == {"default|people/new", "default|people/orphan"}  # not the other source's


def test_the_catch_up_read_can_use_its_partial_index(session: Session) -> None:
    from worker.consolidation.store import _FORGOTTEN

    session.execute(text("SET LOCAL enable_seqscan = off"))
    query = _FORGOTTEN.params(grace=600, window=86400, scan=10)
    sql = str(query.compile(session.get_bind(), compile_kwargs={"literal_binds": True}))
    plan = "\n".join(session.execute(text(f"EXPLAIN {sql}")).scalars())
    assert "ix_facts_unconsolidated" in plan, plan


def test_the_vectors_catch_up_read_can_use_its_partial_index(session: Session) -> None:
    from worker.search.store import _LATE_PAGES

    session.execute(text("SET LOCAL enable_seqscan = off"))
    plan = "\n".join(
        session.execute(
            text(f"EXPLAIN {_LATE_PAGES.text}"), {"grace": 120.0, "window": 86400.0, "scan": 1000}
        ).scalars()
    )
    assert "ix_facts_unembedded" in plan, plan


@pytest.mark.parametrize(
    ("entity_slug", "page_slug"),
    [("people/alice", "conversations/a"), (None, "conversations/a"), ("", "conversations/b|c")],
)
def test_the_sql_entity_key_is_the_pure_one(
    session: Session, entity_slug: str | None, page_slug: str
) -> None:
    """The catch-up matches jobs by the subject it builds in SQL: a key built otherwise than the request's
    would never find its job and request a new one every sweep."""
    from sqlalchemy import literal

    from worker.consolidation.store import entity_key_sql
    from worker.core.consolidation import entity_key

    in_sql = session.scalar(select(entity_key_sql(literal(entity_slug), literal(page_slug))))
    assert in_sql == entity_key(entity_slug, page_slug)


def test_forgetting_the_reasons_about_a_pages_facts_can_use_each_sides_index(session: Session) -> None:
    """It now runs on every re-extraction: under one OR, the update scanned every decision."""
    from worker.consolidation.erasure import forget_reasons_about, page_facts

    session.execute(text("SET LOCAL enable_seqscan = off"))
    plans: list[str] = []

    @sqlalchemy_event.listens_for(session.get_bind(), "before_cursor_execute", retval=True)
    def explain(conn, cursor, statement, parameters, context, executemany):  # type: ignore[no-untyped-def]
        if statement.startswith("UPDATE consolidation_decisions"):
            cursor.execute("EXPLAIN " + statement, parameters)
            plans.append("\n".join(row[0] for row in cursor.fetchall()))
        return statement, parameters

    try:
        forget_reasons_about(session, page_facts("default", "conversations/x"), "gone")
    finally:
        sqlalchemy_event.remove(session.get_bind(), "before_cursor_execute", explain)
    assert len(plans) == 2
    assert "ix_consolidation_decisions_fact_id" in plans[0], plans[0]
    assert "ix_consolidation_decisions_other_fact_id" in plans[1], plans[1]


def both_pages_extracted(factory: sessionmaker[Session], simulator: Any) -> dict[str, str]:
    """The January and March pages stored and extracted (nothing consolidated yet); the environment a
    `factmill` command needs to reach the same simulator."""
    llm = OpenAIChatClient(model="simulator-1", base_url=simulator.base_url, provider="simulator")
    for slug, body in ((JAN_PAGE, JAN_BODY), (MAR_PAGE, MAR_BODY)):
        put_page(factory, slug, body)
        extract(factory, llm, slug)
    return {"FACTMILL_LLM": "simulator", "FACTMILL_SIMULATOR_URL": simulator.base_url}


def test_the_cli_run_honours_the_kill_switch_and_says_why_it_stopped(
    factory, database_url, simulator
) -> None:
    """`factmill facts consolidate` ignored consolidation.enabled (every other "run it here" command
    refuses while its switch is off) and ended on a traceback at a spent budget or a provider error."""
    from tests.cli import invoke_cli
    from tests.integration.test_access_budget import configure, spend

    env = both_pages_extracted(factory, simulator)

    def run(*args: str, entity: str = ALICE) -> Any:
        return invoke_cli(database_url, "facts", "consolidate", "--entity", entity, *args, **env)

    configure(factory, CONSOLIDATION_ENABLED, "false")
    refused = run()
    assert refused.exit_code == 3 and "consolidation is disabled" in refused.output, refused.output
    assert decisions(factory) == [] and calls(factory) == 0
    configure(factory, "llm.budget_daily_usd", "1")
    spend(factory, "extraction", "2")
    stopped = run("--override-disabled")
    assert stopped.exit_code == 1 and "budget is exhausted" in stopped.output, stopped.output
    assert isinstance(stopped.exception, SystemExit)  # one line, no traceback
    configure(factory, "llm.budget_daily_usd", "100")
    # A typo (or the wrong source) ran a job on nothing and said "1 entity, 0 fact(s)", exit 0.
    typo = run("--override-disabled", entity="people/alcie-example")
    assert typo.exit_code == 1 and "no facts about 'people/alcie-example'" in typo.output, typo.output
    assert calls(factory) == 0
    # Named as `facts history` takes it: taken as typed, it consolidated nothing and said so, exit 0.
    done = run("--override-disabled", entity="People/Alice Example")
    assert done.exit_code == 0, done.output
    assert {d for d, _ in decisions(factory)} == {"new", "duplicate", "updates"}


def test_the_cli_run_leaves_an_entity_a_worker_is_consolidating_and_runs_the_rest_as_jobs(
    factory, database_url, simulator
) -> None:
    """`factmill facts consolidate` ran beside a worker's job for the same entity: both asked the model
    about the same pairs, and paid twice. It now runs each entity as its job, under its lease."""
    from sqlalchemy import update

    from tests.cli import invoke_cli
    from worker.jobs.outbox import CONSOLIDATION, page_subject, request_job

    env = both_pages_extracted(factory, simulator)
    subject = page_subject("default", ALICE)
    with factory.begin() as session:  # a worker holds Alice's job now (its heartbeat is fresh)
        job_id = request_job(session, CONSOLIDATION, subject).job_id
        session.execute(
            update(Job).where(Job.id == job_id).values(status="running", worker="w1", heartbeat_at=func.now())
        )
    before = calls(factory)
    held = invoke_cli(database_url, "facts", "consolidate", "--entity", ALICE, **env)
    assert held.exit_code == 0 and f"job {job_id} is consolidating it now" in held.output, held.output
    assert calls(factory) == before and decisions(factory) == []
    with factory.begin() as session:  # the worker finished (or died): the CLI runs it as that job
        session.execute(update(Job).where(Job.id == job_id).values(status="failed", worker=None))
    done = invoke_cli(database_url, "facts", "consolidate", "--entity", ALICE, **env)
    assert done.exit_code == 0 and {d for d, _ in decisions(factory)} == {"new", "duplicate", "updates"}
    with factory() as session:
        ran = session.scalars(select(Job).where(Job.kind == CONSOLIDATION, Job.subject == subject)).all()
    assert [j.status for j in ran if j.id != job_id] == ["succeeded"]  # its run is in the job history


class Interrupted:
    """A chat client whose call is cut short by the operator's Ctrl-C."""

    provider, model = "simulator", "simulator-1"

    def chat(self, request: Any) -> Any:
        raise KeyboardInterrupt

    def embed(self, texts: Any, *, purpose: str = "embedding") -> Any:
        raise AssertionError("not asked")


def test_a_run_here_interrupted_gives_its_job_back_and_a_paused_one_starts_over(
    factory, database_url, simulator
) -> None:
    """Ctrl-C in `facts consolidate` left its job "running" under the command's lease: for a minute the
    next run said a worker held it, then the sweeper counted a worker lost. And a job paused for its
    own budget paused again at once, stopping every run of the command at that entity."""
    from worker.consolidation.job import consolidate_here
    from worker.jobs.lifecycle import INTERRUPTED_NOTE
    from worker.jobs.outbox import CONSOLIDATION, page_subject
    from worker.runtime import Runtime
    from worker.settings import Settings

    both_pages_extracted(factory, simulator)
    settings = Settings(database_url=database_url, simulator_url=simulator.base_url, llm="simulator")
    cut = Runtime(settings=settings, factory=factory, config=ConfigReader(factory, ttl=0), _llm=Interrupted())
    with pytest.raises(KeyboardInterrupt):
        consolidate_here(cut, "default", ALICE)
    with factory() as session:
        [job] = session.scalars(select(Job).where(Job.subject == page_subject("default", ALICE))).all()
    assert (job.kind, job.status, job.worker, job.last_error) == (
        CONSOLIDATION,
        "queued",
        None,
        INTERRUPTED_NOTE,
    )
    with factory.begin() as session:  # as a worker's run left it: its own budget spent
        session.execute(update(Job).where(Job.id == job.id).values(status="paused", pause_reason="budget"))
    rt = Runtime(settings=settings, factory=factory, config=ConfigReader(factory, ttl=0))
    try:
        done = consolidate_here(rt, "default", ALICE)
    finally:
        rt.close()
    assert (done.status, done.job_id) == ("succeeded", job.id) and done.counters["llm_calls"] > 0


def test_an_erasure_waits_for_a_commit_in_flight_and_forgets_the_reasons_it_wrote(factory, llm) -> None:
    """Alice's facts are on two pages, so erasing one renames no key and held no checkpoint: a
    consolidation commit in flight inserted a reason quoting a fact of the erased page unseen by the
    erasure's forgetting, and the delete then nulled its fact id, leaving the quote where no erasure
    could find it. The erasure now holds the checkpoint of every entity its facts are under first."""
    import threading

    from worker.consolidation.erasure import ERASED_REASON
    from worker.consolidation.store import lock_checkpoint
    from worker.extraction.erase import erase_page

    for slug, body in ((JAN_PAGE, JAN_BODY), (MAR_PAGE, MAR_BODY)):
        put_page(factory, slug, body)
        extract(factory, llm, slug)
    facts = alice(factory)
    lisbon = facts["Alice Example lives in Lisbon now."][0]  # on the January page, erased below
    porto = facts["Alice Example lives in Porto now."][0]
    quote = "Porto replaces 'Alice Example lives in Lisbon now.'"
    with factory() as commit, commit.begin():  # a consolidation commit, in flight
        lock_checkpoint(commit, "default", ALICE)
        commit.add(
            ConsolidationDecision(
                source_id="default",
                entity_key=ALICE,
                fact_id=porto.id,
                other_fact_id=lisbon.id,
                decision="updates",
                decided_by="model",
                reason=quote,
            )
        )
        commit.flush()
        erasing = threading.Thread(target=erase_page, args=(factory, "default", JAN_PAGE, "test"))
        erasing.start()
        assert waits_on_a_lock(factory), "the erasure never waited for the commit in flight"
    erasing.join(timeout=30)
    with factory() as session:
        [row] = session.scalars(
            select(ConsolidationDecision).where(ConsolidationDecision.fact_id == porto.id)
        )
    assert row.other_fact_id is None and row.reason == ERASED_REASON


def test_a_run_commits_round_by_round_so_a_failure_keeps_what_was_decided(
    tx_factory, llm, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every pair was asked before one decision was committed: a time limit, a budget pause or one
    unusable answer late in a large entity threw away every answer paid for (and paid again on each
    retry). Rounds of at most MAX_FACTS_PER_ROUND facts commit as they go."""
    from worker.consolidation import service
    from worker.llm.errors import LLMError

    monkeypatch.setattr(service, "MAX_FACTS_PER_ROUND", 2)
    for month, city in (("01", "Lisbon"), ("03", "Porto"), ("05", "Faro"), ("07", "Braga")):
        slug, body = lives(f"2026-{month}-05", city)
        put_page(tx_factory, slug, body)
        extract(tx_factory, llm, slug)

    class FailsOnItsSecondCall:  # the real simulator client, with the provider failing once
        provider, model, calls = llm.provider, llm.model, 0

        def chat(self, request: Any) -> Any:
            self.calls += 1
            if self.calls == 2:
                raise LLMError("HTTP 500: the provider failed", retryable=True, status=500)
            return llm.chat(request)

    with pytest.raises(LLMError):
        consolidate(tx_factory, FailsOnItsSecondCall())
    with tx_factory() as session:
        decided = session.scalars(
            select(Fact.fact).where(Fact.entity_slug == ALICE, Fact.consolidated_at.is_not(None))
        ).all()
    assert sorted(decided) == ["Alice Example lives in Lisbon now.", "Alice Example lives in Porto now."]
    before = calls(tx_factory)
    counters = consolidate(tx_factory, llm)
    assert counters.facts_considered == 2 and calls(tx_factory) - before == counters.llm_calls
    current = [t for t, rows in alice(tx_factory).items() for r in rows if r.status == "current"]
    assert current == ["Alice Example lives in Braga now."]


def test_a_fact_left_to_decide_again_that_a_later_fact_closes_is_decided(tx_factory, llm) -> None:
    """A reopened restatement is written current and unconsolidated, to be decided again; closed by a
    later fact of the same round it stayed unconsolidated, and the next round planned it as if current."""
    from worker.core.consolidation import FactView, Supersession
    from worker.core.consolidation_plan import Resolved, Row

    for slug, body in ((JAN_PAGE, JAN_BODY), (MAR_PAGE, MAR_BODY)):
        put_page(tx_factory, slug, body)
        extract(tx_factory, llm, slug)
    facts = alice(tx_factory)
    lisbon, porto = (
        facts["Alice Example lives in Lisbon now."][0],
        facts["Alice Example lives in Porto now."][0],
    )
    store = ConsolidationStore(tx_factory, Ledger(ConfigReader(tx_factory, ttl=0).get))

    def view(fact: Fact) -> FactView:
        return FactView(fact.id, fact.fact, fact.kind, fact.valid_from)

    again = Resolved(lisbon.id, (Row(None, "new", "rule", "reopened"),), reconsider=True)
    closing = Supersession(view(lisbon), view(porto), MAR_START)
    closes = Resolved(porto.id, (Row(lisbon.id, "updates", "model", "moved"),), closings=(closing,))
    assert store.commit_decisions("default", ALICE, None, [(again, None), (closes, None)]) == [True, True]
    with tx_factory() as session:
        row = session.get(Fact, lisbon.id)
        assert row is not None and row.status == "superseded" and row.consolidated_at is not None


def test_an_entitys_orphan_repair_and_read_stay_inside_its_source_and_entity(tx_factory, llm) -> None:
    # The orphan predicate is an OR: written into the WHERE without brackets it escaped the source
    # and entity filters, and a run for Alice restored (and audited as hers) every orphan anywhere.
    put_page(tx_factory, JAN_PAGE, JAN_BODY)
    extract(tx_factory, llm, JAN_PAGE)
    consolidate(tx_factory, llm)
    with tx_factory.begin() as session:
        elsewhere = session.scalars(
            select(Fact).where(Fact.fact == "Alice Example is on the Basic plan.")
        ).one()
        elsewhere.source_id, elsewhere.entity_slug = "other", "people/bob-demo"
        elsewhere.status, elsewhere.duplicate_of = "duplicate", None
        orphan_id = elsewhere.id
    with tx_factory() as session:
        read = session.execute(orphaned_links_query(["default"])).all()
    assert read == [], "another source's orphan is not this source's to read"
    restored = ConsolidationStore(tx_factory, Ledger(ConfigReader(tx_factory, ttl=0).get)).repair_orphans(
        "default", ALICE, None
    )
    with tx_factory() as session:
        kept = session.get(Fact, orphan_id)
        restores = session.scalars(
            select(ConsolidationDecision).where(ConsolidationDecision.fact_id == orphan_id)
        ).all()
    assert restored == 0 and kept is not None and kept.status == "duplicate"
    assert [r.decision for r in restores if r.decision == "restore"] == []


def test_pairs_a_reply_skipped_are_asked_again_once_then_kept_unrelated(tx_factory, sim) -> None:
    # A reply in a Markdown fence (json_object mode allows one) that decides nothing: the skipped pairs
    # went straight to "unrelated" for good (an update lost); now they are asked once more on their own.
    from worker.core.consolidation_plan import UNANSWERED_REASON

    llm = OpenAIChatClient(model="simulator-1", base_url=sim.base_url, provider="simulator")
    put_page(tx_factory, JAN_PAGE, JAN_BODY)
    put_page(tx_factory, MAR_PAGE, MAR_BODY)
    extract(tx_factory, llm, JAN_PAGE)
    consolidate(tx_factory, llm)
    extract(tx_factory, llm, MAR_PAGE)
    fenced = '```json\n{"decisions": []}\n```'
    sim.configure(raw_replies={"chat.completions": completion(content=fenced, model="simulator-1")})
    run = consolidate(tx_factory, llm)
    assert run.llm_calls == 2 and calls(tx_factory) == 2, "one ask, then one more for the skipped pair"
    assert run.pairs_asked == 1, "a pair asked again is still one pair"
    facts = alice(tx_factory)
    porto = facts["Alice Example lives in Porto now."][0]
    with tx_factory() as session:
        asked = session.scalars(
            select(ConsolidationDecision).where(
                ConsolidationDecision.fact_id == porto.id, ConsolidationDecision.decided_by == "model"
            )
        ).one()
        second_call = session.scalars(
            select(LLMCall.id).where(LLMCall.purpose == "consolidation").order_by(LLMCall.id.desc())
        ).first()
    assert (asked.decision, asked.reason) == ("unrelated", UNANSWERED_REASON)
    assert asked.llm_call_id == second_call, "an unanswered pair names the last call that was asked"
    assert facts["Alice Example lives in Lisbon now."][0].status == "current"


def test_a_pair_skipped_twice_is_settled_in_a_stopped_rounds_head(tx_factory, llm, monkeypatch) -> None:
    """A pair the model skips twice is kept as unrelated by a whole round; a stop later in the round
    wrote nothing from its fact on (it counted as unanswered), and the next run paid for it again."""
    from worker.consolidation import service
    from worker.jobs.shutdown import WorkerStoppingError
    from worker.simulator import Simulator, SimulatorConfig

    monkeypatch.setattr(service, "MAX_PAIRS_PER_CALL", 1)  # a question a pair
    cities = ("Lisbon", "Porto", "Faro")  # pairs: Porto-Lisbon, then Faro's two
    for n, city in enumerate(cities, 1):
        slug, body = lives(f"2026-0{n}-05", city)
        put_page(tx_factory, slug, body)
        extract(tx_factory, llm, slug)
    fenced = '```json\n{"decisions": []}\n```'  # a reply that decides nothing
    asked: list[int] = []
    with Simulator(SimulatorConfig()) as other:
        other.configure(raw_replies={"chat.completions": completion(content=fenced, model="simulator-1")})
        skipping = OpenAIChatClient(model="simulator-1", base_url=other.base_url, provider="simulator")

        class SkipsTheFirstPairTwice:
            provider, model = llm.provider, llm.model

            def chat(self, request: Any) -> Any:
                asked.append(1)
                return (skipping if len(asked) <= 2 else llm).chat(request)

        def stopping_at_the_fourth_question() -> None:
            if len(asked) >= 3:
                raise WorkerStoppingError("the worker is stopping")

        store = ConsolidationStore(tx_factory, Ledger(ConfigReader(tx_factory, ttl=0).get))
        run = EntityRun("default", ALICE, guard=stopping_at_the_fourth_question)
        with pytest.raises(WorkerStoppingError):
            consolidate_entity(store, SkipsTheFirstPairTwice(), run)
    decided = {t for t, rows in alice(tx_factory).items() for r in rows if r.consolidated_at is not None}
    assert decided == {"Alice Example lives in Lisbon now.", "Alice Example lives in Porto now."}


def test_a_page_that_stops_being_extracted_sends_its_orphans_to_consolidation(factory, simulator) -> None:
    # A page whose type extraction does not read loses its facts with the delivery: the facts of other
    # pages that were duplicates of them (or closed by them) lost their link and stayed hidden, since
    # the extraction job that followed found no page to extract and asked for no consolidation.
    from worker.extraction.pages import PageIn, store_page
    from worker.jobs.lifecycle import run_job
    from worker.jobs.outbox import EXTRACTION
    from worker.runtime import Runtime
    from worker.settings import Settings

    llm = OpenAIChatClient(model="simulator-1", base_url=simulator.base_url, provider="simulator")
    both_pages_consolidated(factory, llm)
    assert [f.status for f in alice(factory)["Alice Example is on the Basic plan."]] == [
        "current",
        "duplicate",
    ]
    with factory.begin() as session:
        session.execute(Job.__table__.delete().where(Job.kind == "consolidation"))
        request = store_page(session, PageIn(slug=JAN_PAGE, type="note", title="x", compiled_truth=JAN_BODY))
    assert request is not None
    [orphan] = alice(factory)["Alice Example is on the Basic plan."]
    assert (orphan.status, orphan.duplicate_of) == ("duplicate", None)
    settings = Settings(
        database_url=factory.kw["bind"].url.render_as_string(hide_password=False),
        simulator_url=simulator.base_url,
        llm="simulator",
        embed_after_extraction=False,
    )
    rt = Runtime(settings=settings, factory=factory, config=ConfigReader(factory, ttl=0))
    try:
        assert run_job(rt, request.job_id, EXTRACTION).status == "succeeded"
    finally:
        rt.close()
    with factory() as session:
        subjects = session.scalars(select(Job.subject).where(Job.kind == "consolidation")).all()
    assert subjects == [f"default|{ALICE}"]


def test_a_fact_a_late_one_ends_earlier_lets_its_later_restatement_answer(tx_factory, llm) -> None:
    # Paris (Jan 10) and Paris again (Mar 1, its duplicate); Berlin (Apr 1) closed January's Paris.
    # Lyon (Feb 1) arrived late: slotted into Berlin's chain, January's Paris ends at Lyon's start,
    # and March's Paris, a duplicate of a fact ended before it was said, answered nothing: as of Mar 15
    # only Lyon. Now it is reopened and decided again in the same run: Paris from March 1 until Berlin.
    arrive(
        tx_factory,
        llm,
        lives("2026-01-10", "Paris"),
        lives("2026-03-01", "Paris"),
        lives("2026-04-01", "Berlin"),
    )
    arrive(tx_factory, llm, lives("2026-02-01", "Lyon"))
    facts = alice(tx_factory)
    january, march = facts["Alice Example lives in Paris now."]
    lyon, berlin = (
        facts["Alice Example lives in Lyon now."][0],
        facts["Alice Example lives in Berlin now."][0],
    )
    at = lambda day: datetime.fromisoformat(f"2026-{day}T09:00:00+00:00")  # noqa: E731
    assert (january.superseded_by, january.valid_to) == (lyon.id, at("02-01"))
    assert (march.status, march.superseded_by, march.valid_to) == ("superseded", berlin.id, at("04-01"))
    assert (lyon.superseded_by, lyon.valid_to) == (march.id, at("03-01"))
    assert berlin.status == "current"


def test_vectors_of_another_embedding_model_are_not_compared(tx_factory, llm) -> None:
    # After a change of embedding model, the pending facts' vectors were compared with the old model's:
    # near-random cosines ranked the candidates (and could call a pair near-identical).
    put_page(tx_factory, JAN_PAGE, JAN_BODY)
    extract(tx_factory, llm, JAN_PAGE)
    consolidate(tx_factory, llm)
    put_page(tx_factory, MAR_PAGE, MAR_BODY)
    extract(tx_factory, llm, MAR_PAGE)
    with tx_factory.begin() as session:
        session.execute(text("UPDATE facts SET embedding = '{1,0,0}', embedding_model = 'p/old'"))
        session.execute(
            text("UPDATE facts SET embedding_model = 'p/new' WHERE consolidated_at IS NULL AND NOT is_audit")
        )
    store = ConsolidationStore(tx_factory, Ledger(ConfigReader(tx_factory, ttl=0).get))
    pending, pool = store.entity_facts("default", ALICE)
    assert pending and pool
    assert all(f.embedding is not None for f in pending)
    assert all(f.embedding is None for f in pool), "another model's vectors are left out"
    with tx_factory.begin() as session:  # vectors whose model was not kept: compared, as before
        session.execute(text("UPDATE facts SET embedding_model = NULL WHERE consolidated_at IS NOT NULL"))
    assert all(f.embedding is not None for f in store.entity_facts("default", ALICE)[1])


@pytest.mark.parametrize("when", ["before the call", "during the call"])
def test_a_page_erased_mid_run_is_neither_sent_to_the_model_nor_linked_to(factory, llm, when: str) -> None:
    """Alice's Lisbon (January's page) and Porto (March's) are asked of the model; January's page is
    erased meanwhile. Its facts' text went to the provider after the erasure had returned, and the
    decision linking to a deleted fact failed its foreign key at commit: the round's other decisions
    rolled back with it and the job retried, paying for the round again."""
    from worker.extraction.erase import erase_page

    for slug, body in ((JAN_PAGE, JAN_BODY), (MAR_PAGE, MAR_BODY)):
        put_page(factory, slug, body)
        extract(factory, llm, slug)
    erased: list[bool] = []

    def erase_january() -> None:
        if not erased:
            erased.append(True)
            erase_page(factory, "default", JAN_PAGE, "test")

    class ErasedDuringItsCall:  # the real simulator client; the erasure lands while it is asked
        provider, model = llm.provider, llm.model

        def chat(self, request: Any) -> Any:
            erase_january()
            return llm.chat(request)

    store = ConsolidationStore(factory, Ledger(ConfigReader(factory, ttl=0).get))
    if when == "before the call":
        counters = consolidate_entity(store, llm, EntityRun("default", ALICE, guard=erase_january))
        assert counters.llm_calls == 0 and calls(factory) == 0, "nothing of the erased page was sent"
    else:
        counters = consolidate_entity(store, ErasedDuringItsCall(), EntityRun("default", ALICE))
    assert erased
    facts = alice(factory)
    assert "Alice Example lives in Lisbon now." not in facts
    [porto] = facts["Alice Example lives in Porto now."]
    assert (porto.status, porto.superseded_by, porto.valid_to) == ("current", None, None)
    assert all(f.consolidated_at is not None for fs in facts.values() for f in fs), "all decided"


def test_a_page_erased_while_its_call_waits_to_try_again_is_not_sent_on_the_next_try(factory, llm) -> None:
    """The facts were looked up once, before the call: an erasure that returned during the gateway's
    backoff (minutes in an outage) had its page's text sent to the provider on the next try."""
    from worker.extraction.erase import erase_page

    for slug, body in ((JAN_PAGE, JAN_BODY), (MAR_PAGE, MAR_BODY)):
        put_page(factory, slug, body)
        extract(factory, llm, slug)
    sent: list[str] = []

    class Sent:  # the real simulator client, what reaches it noted
        provider, model = llm.provider, llm.model

        def chat(self, request: Any) -> Any:
            sent.append(request.messages[0][1])
            return llm.chat(request)

    def erase_january_in_the_backoff(_seconds: float) -> None:
        erase_page(factory, "default", JAN_PAGE, "test")

    retrying = RetryingClient(
        FailsFirst(Sent()), RetryPolicy(max_attempts=3), sleep=erase_january_in_the_backoff
    )
    store = ConsolidationStore(factory, Ledger(ConfigReader(factory, ttl=0).get))
    consolidate_entity(store, retrying, EntityRun("default", ALICE))
    assert not any("Lisbon" in question for question in sent), sent
    with factory() as session:  # the failed first try is recorded (it was a request)
        outcomes = list(session.scalars(select(LLMCall.outcome).where(LLMCall.purpose == "consolidation")))
    assert outcomes == ["provider_error"]
    facts = alice(factory)
    [porto] = facts["Alice Example lives in Porto now."]
    assert porto.status == "current" and porto.consolidated_at is not None


def test_a_round_reads_whole_only_the_facts_it_decides(tx_factory, llm) -> None:
    """Each round read every pending fact whole, vectors included (a backfill's 200,000 on one entity),
    to decide the first 500: the pending facts are listed light, and the round's own read whole."""
    from sqlalchemy import event

    for month, city in (("07", "Braga"), ("01", "Lisbon"), ("05", "Faro"), ("03", "Porto")):
        slug, body = lives(f"2026-{month}-05", city)
        put_page(tx_factory, slug, body)
        extract(tx_factory, llm, slug)
    store = ConsolidationStore(tx_factory, Ledger(ConfigReader(tx_factory, ttl=0).get))
    statements: list[str] = []

    def record(_conn: Any, _cursor: Any, statement: str, *_: Any) -> None:
        statements.append(statement)

    with tx_factory() as session:
        bind = session.get_bind()
    event.listen(bind, "before_cursor_execute", record)
    try:
        pending, batch, _ = store.entity_round("default", ALICE, 2)
    finally:
        event.remove(bind, "before_cursor_execute", record)
    assert len(pending) == 4
    assert [fact.text for fact in batch] == [
        "Alice Example lives in Lisbon now.",
        "Alice Example lives in Porto now.",
    ]
    whole = [s for s in statements if "array_send" in s]
    assert any("ANY" in s for s in whole), "the round's facts are read whole by their ids"
    assert not [s for s in whole if "consolidated_at IS NULL" in s], "no pending fact is read whole else"


def test_each_try_the_gateway_retried_for_a_decision_is_a_call_of_its_own(tx_factory, llm) -> None:
    """Through ``chat`` the retry layer's tries were hidden: one llm_calls row a consolidation call."""
    put_page(tx_factory, JAN_PAGE, JAN_BODY)
    put_page(tx_factory, MAR_PAGE, MAR_BODY)
    extract(tx_factory, llm, JAN_PAGE)
    extract(tx_factory, llm, MAR_PAGE)
    retried = RetryingClient(FailsFirst(llm), RetryPolicy(max_attempts=3), sleep=lambda seconds: None)
    assert consolidate(tx_factory, retried).llm_calls == 1
    with tx_factory() as session:
        outcomes = session.scalars(
            select(LLMCall.outcome).where(LLMCall.purpose == "consolidation").order_by(LLMCall.id)
        ).all()
    assert outcomes == ["provider_error", "ok"]


def test_a_stop_during_a_rate_limits_wait_writes_no_call(tx_factory, llm) -> None:
    """Stopped while the first try waited on the rate limiter (the switch turned off), the stop was
    written as a provider_error call, though no request went out."""
    from worker.jobs.registry import KillSwitchOffError
    from worker.llm.ratelimit import RateLimitedClient, RateLimits

    put_page(tx_factory, JAN_PAGE, JAN_BODY)
    put_page(tx_factory, MAR_PAGE, MAR_BODY)
    extract(tx_factory, llm, JAN_PAGE)
    extract(tx_factory, llm, MAR_PAGE)
    switched_off: list[bool] = []

    class Waits:
        limits = RateLimits(requests_per_minute=1)

        def acquire(self, key: str, tokens: int) -> float:
            switched_off.append(True)  # the operator turns the switch off while the call waits
            return 2.5

        def reconcile(self, key: str, estimated: int, actual: int) -> None:
            return None

    def guard() -> None:
        if switched_off:
            raise KillSwitchOffError("consolidation.enabled was turned off")

    limited = RetryingClient(
        RateLimitedClient(llm, Waits()), RetryPolicy(max_attempts=3), sleep=lambda s: None
    )
    store = ConsolidationStore(tx_factory, Ledger(ConfigReader(tx_factory, ttl=0).get))
    with pytest.raises(KillSwitchOffError):
        consolidate_entity(store, limited, EntityRun("default", ALICE, guard=guard))
    assert calls(tx_factory) == 0


def refusing_client(simulator: Any) -> OpenAIChatClient:
    """The simulator's client, every answer a refusal (as a provider's content filter answers)."""
    return OpenAIChatClient(
        model="simulator-1",
        base_url=simulator.base_url,
        provider="simulator",
        default_headers={"x-simulator-fault": "refusal"},
    )


def model_verdicts(factory: sessionmaker[Session]) -> tuple[dict[int, str], list[Any]]:
    """The facts' texts by id, and the model's verdicts: (reason, fact, other fact, llm call)."""
    with factory() as session:
        texts = {fact_id: fact for fact_id, fact in session.execute(select(Fact.id, Fact.fact))}
        verdicts = session.execute(
            select(
                ConsolidationDecision.reason,
                ConsolidationDecision.fact_id,
                ConsolidationDecision.other_fact_id,
                ConsolidationDecision.llm_call_id,
            ).where(ConsolidationDecision.decided_by == "model")
        ).all()
    return texts, list(verdicts)


# A pair as a question states it: its new fact's text and its old fact's.
ASKED_PAIR = re.compile(r"^\d+\. NEW \([^)]*\): (.*)\n   OLD \([^)]*\): (.*)$", re.MULTILINE)


def test_an_answer_cut_off_at_its_token_cap_is_asked_again_in_halves(
    tx_factory, llm, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A reply cut off at max_tokens (a model's reasons longer than the cap allows a pair) failed the
    job, and its retry asked the same pairs under the same cap: cut at the same place, paid for again on
    every retry. The halves are asked under at least the cap their question was cut at (under their own
    smaller one, each was cut again); every pair is decided, under the call that answered it."""
    from worker.consolidation import service

    monkeypatch.setattr(service, "OUTPUT_TOKENS_PER_PAIR", 15)  # a model wordier than the allowance
    cities = ("Lisbon", "Porto", "Faro", "Braga", "Evora", "Sintra", "Aveiro")  # 20 pairs in one question
    arrive(tx_factory, llm, *[lives(f"2026-0{n}-05", city) for n, city in enumerate(cities, 1)], each=False)

    class Recording:  # the real simulator client, each question's pairs and cap noted
        provider, model = llm.provider, llm.model

        def __init__(self) -> None:
            self.asked: list[tuple[int, int]] = []
            self.pairs: list[set[tuple[str, str]]] = []  # each question's (new, old) texts

        def chat(self, request: Any) -> Any:
            question = request.messages[0][1]
            self.asked.append((question.count(" OLD ("), request.max_tokens))
            self.pairs.append(set(ASKED_PAIR.findall(question)))
            return llm.chat(request)

    with tx_factory.begin() as session:  # decide again, through the recording client
        session.execute(text("DELETE FROM consolidation_decisions"))
        session.execute(update(Fact).values(status="current", superseded_by=None, duplicate_of=None,
                                            valid_to=None, consolidated_at=None))  # fmt: skip
    model = Recording()
    counters = consolidate(tx_factory, model)
    first_pairs, first_cap = model.asked[0]
    assert (first_pairs, first_cap) == (20, 300) and len(model.asked) > 1, model.asked
    assert all(cap >= first_cap for _, cap in model.asked[1:]), model.asked  # never a smaller cap
    with tx_factory() as session:
        outcomes = dict(
            session.execute(
                select(LLMCall.outcome, func.count())
                .where(LLMCall.purpose == "consolidation", LLMCall.id > 0)
                .group_by(LLMCall.outcome)
            ).all()
        )
        unlinked = session.scalar(
            select(func.count()).where(
                ConsolidationDecision.decided_by == "model", ConsolidationDecision.llm_call_id.is_(None)
            )
        )
    assert outcomes.get("truncated_output", 0) >= 1 and counters.llm_calls == len(model.asked)
    assert unlinked == 0
    # Each verdict names the call that was asked its pair (every row of a fact named its first pair's
    # call, though the fact's pairs were answered across the halves).
    with tx_factory() as session:
        order = list(
            session.scalars(select(LLMCall.id).where(LLMCall.purpose == "consolidation").order_by(LLMCall.id))
        )
    texts, verdicts = model_verdicts(tx_factory)
    rows = [(new, old, call) for _, new, old, call in verdicts]
    order = order[-len(model.asked) :]  # the recorded questions' calls (the first run's came before)
    wrong = [
        (texts[new], texts[old])
        for new, old, call in rows
        if (texts[new], texts[old]) not in model.pairs[order.index(call)]
    ]
    assert not wrong and len({call for _, _, call in rows}) > 1, wrong
    current = [t for t, rows in alice(tx_factory).items() for r in rows if r.status == "current"]
    assert current == ["Alice Example lives in Aveiro now."]


def test_a_pair_the_model_refuses_is_asked_apart_and_the_others_are_decided(
    tx_factory, llm, simulator
) -> None:
    """A refusal (a content filter on one fact's text) failed the round: the job retried it whole, was
    refused the same way every time, failed, and no later fact of the entity was consolidated again.
    Halved, the others are decided; the pair refused on its own is kept as unrelated, saying why."""
    from worker.core.consolidation_plan import UNANSWERED_REASON

    cities = ("Lisbon", "Porto", "Faro", "Braga", "Evora")
    arrive(tx_factory, llm, *[lives(f"2026-0{n}-05", city) for n, city in enumerate(cities, 1)], each=False)
    refusing = refusing_client(simulator)

    class FilteringBraga:  # the simulator refuses any question that holds Braga's fact
        provider, model = llm.provider, llm.model

        def __init__(self) -> None:
            self.asked: list[int] = []

        def chat(self, request: Any) -> Any:
            self.asked.append(request.messages[0][1].count(" OLD ("))
            return (refusing if "Braga" in request.messages[0][1] else llm).chat(request)

    with tx_factory.begin() as session:  # decide again, through the filtering client
        session.execute(text("DELETE FROM consolidation_decisions"))
        session.execute(update(Fact).values(status="current", superseded_by=None, duplicate_of=None,
                                            valid_to=None, consolidated_at=None))  # fmt: skip
    model = FilteringBraga()
    counters = consolidate(tx_factory, model)  # no ConsolidationReplyError
    assert model.asked[0] > 1 and 1 in model.asked[1:], model.asked  # halved down to a pair alone
    with tx_factory() as session:
        refused = session.scalar(
            select(func.count()).where(LLMCall.purpose == "consolidation", LLMCall.outcome == "refusal")
        )
    texts, verdicts = model_verdicts(tx_factory)
    rows = [(reason, new, old) for reason, new, old, _ in verdicts]
    assert refused and counters.llm_calls == len(model.asked)
    unanswered = [(texts[new], texts[old]) for reason, new, old in rows if reason == UNANSWERED_REASON]
    assert unanswered and all("Braga" in new + old for new, old in unanswered), rows
    assert any(reason != UNANSWERED_REASON for reason, _, _ in rows)  # the others were decided


def test_two_filtered_facts_at_the_head_of_a_round_are_no_shared_refusal(tx_factory, llm, simulator) -> None:
    """Depth first, the earliest pending facts' pairs are asked alone before any other: two filtered
    facts at the head of a round (five pairs each) made eight refusals with none answered yet, and the
    round stopped as if the entity were refused, on every retry. Two facts are in every refused pair:
    they are kept as unrelated and the others decided."""
    from worker.core.consolidation_plan import UNANSWERED_REASON

    earlier = ("Lisbon", "Porto", "Faro", "Braga", "Evora", "Sintra")
    arrive(tx_factory, llm, *[lives(f"2026-0{n}-05", city) for n, city in enumerate(earlier, 1)], each=False)
    later = ("Zurich", "Zagreb", "Aveiro", "Tavira", "Lagos")  # the first two are filtered
    arrive(tx_factory, llm, *[lives(f"2026-{n:02d}-05", city) for n, city in enumerate(later, 7)], each=False)
    with tx_factory.begin() as session:  # the later five decided again, through the filtering client
        later_facts = Fact.fact.in_([f"Alice Example lives in {city} now." for city in later])
        session.execute(text("DELETE FROM consolidation_decisions WHERE fact_id IN (SELECT id FROM facts "
                             "WHERE fact ~ 'lives in (Zurich|Zagreb|Aveiro|Tavira|Lagos) now')"))  # fmt: skip
        session.execute(update(Fact).where(later_facts).values(status="current", superseded_by=None,
                        duplicate_of=None, valid_to=None, consolidated_at=None))  # fmt: skip
        session.execute(update(Fact).where(~later_facts, ~Fact.is_audit).values(status="current",
                        superseded_by=None, valid_to=None))  # fmt: skip
    refusing = refusing_client(simulator)

    class FilteringTwo:
        provider, model = llm.provider, llm.model

        def chat(self, request: Any) -> Any:
            question = request.messages[0][1]
            return (refusing if "Zurich" in question or "Zagreb" in question else llm).chat(request)

    counters = consolidate(tx_factory, FilteringTwo())
    assert counters.pairs_refused >= 8 and counters.pairs_answered, counters.as_dict()
    texts, verdicts = model_verdicts(tx_factory)
    rows = [(reason, texts[new], texts[old]) for reason, new, old, _ in verdicts]
    unanswered = [(new, old) for reason, new, old in rows if reason == UNANSWERED_REASON]
    # Kept as unrelated: only pairs holding one of the two; every other pair was decided.
    assert unanswered and all("Zurich" in n + o or "Zagreb" in n + o for n, o in unanswered), rows
    decided = [(new, old) for reason, new, old in rows if reason != UNANSWERED_REASON]
    assert any("Aveiro" in n + o or "Tavira" in n + o or "Lagos" in n + o for n, o in decided), rows


def test_a_model_that_refuses_the_whole_entity_fails_the_round_after_a_few_calls(
    tx_factory, llm, simulator
) -> None:
    """Halving a refused question down to its last pair is for one fact's text: when the model refuses
    what every question shares (the entity), each question of 40 pairs cost 79 calls and every pair was
    written as unrelated. Once SHARED_REFUSAL_PAIRS are refused alone with none answered, the round
    stops unwritten and the job retries, as before the split."""
    from worker.consolidation.service import SHARED_REFUSAL_PAIRS, ConsolidationReplyError

    cities = ("Lisbon", "Porto", "Faro", "Braga", "Evora", "Sintra", "Aveiro")  # 20 pairs
    arrive(tx_factory, llm, *[lives(f"2026-0{n}-05", city) for n, city in enumerate(cities, 1)], each=False)
    refusing = refusing_client(simulator)
    asked: list[int] = []

    class RefusingAll:
        provider, model = llm.provider, llm.model

        def chat(self, request: Any) -> Any:
            asked.append(request.messages[0][1].count(" OLD ("))
            return refusing.chat(request)

    with tx_factory.begin() as session:  # decide again, through the refusing client
        session.execute(text("DELETE FROM consolidation_decisions"))
        session.execute(update(Fact).values(status="current", superseded_by=None, duplicate_of=None,
                                            valid_to=None, consolidated_at=None))  # fmt: skip
    with pytest.raises(ConsolidationReplyError, match="refuses what they share"):
        consolidate(tx_factory, RefusingAll())
    assert asked.count(1) == SHARED_REFUSAL_PAIRS and len(asked) < 3 * SHARED_REFUSAL_PAIRS, asked
    with tx_factory() as session:
        # No pair written as unrelated (the first fact, with no pair to ask, is decided by the rules).
        model = ConsolidationDecision.decided_by == "model"
        assert not session.scalar(select(func.count()).select_from(ConsolidationDecision).where(model))


def test_a_stop_between_a_rounds_questions_writes_the_facts_already_answered(
    tx_factory, llm, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A stop (a SIGTERM, the switch, the budget) between question k and k+1 of a round threw away the
    answers to questions 1..k, and the next run paid for them again. The leading facts whose every pair
    was answered are written as a smaller round; the rest wait, and only they are asked next time."""
    from worker.consolidation import service
    from worker.jobs.shutdown import WorkerStoppingError

    monkeypatch.setattr(service, "MAX_PAIRS_PER_CALL", 5)  # 20 pairs: four questions
    cities = ("Lisbon", "Porto", "Faro", "Braga", "Evora", "Sintra", "Aveiro")
    for n, city in enumerate(cities, 1):
        slug, body = lives(f"2026-0{n}-05", city)
        put_page(tx_factory, slug, body)
        extract(tx_factory, llm, slug)
    asked: list[int] = []
    new_facts: set[str] = set()

    class Asked:
        provider, model = llm.provider, llm.model

        def chat(self, request: Any) -> Any:
            asked.append(request.messages[0][1].count(" OLD ("))
            new_facts.update(new for new, _ in ASKED_PAIR.findall(request.messages[0][1]))
            return llm.chat(request)

    def stopping_after_two_questions() -> None:
        if len(asked) >= 2:
            raise WorkerStoppingError("the worker is stopping")

    store = ConsolidationStore(tx_factory, Ledger(ConfigReader(tx_factory, ttl=0).get))
    with pytest.raises(WorkerStoppingError):
        consolidate_entity(store, Asked(), EntityRun("default", ALICE, guard=stopping_after_two_questions))
    assert asked == [5, 5]
    decided = {t for t, rows in alice(tx_factory).items() for r in rows if r.consolidated_at is not None}
    assert decided == {
        f"Alice Example lives in {c} now." for c in ("Lisbon", "Porto", "Faro", "Braga", "Evora")
    }
    new_facts.clear()
    consolidate_entity(store, Asked(), EntityRun("default", ALICE))
    assert new_facts == {"Alice Example lives in Sintra now.", "Alice Example lives in Aveiro now."}
    current = [t for t, rows in alice(tx_factory).items() for r in rows if r.status == "current"]
    assert current == ["Alice Example lives in Aveiro now."]


def test_a_stop_writes_no_duplicate_whose_place_depends_on_a_later_fact_of_its_round(tx_factory, llm) -> None:
    """Paris (March) is known; a late page says Paris (January) and another Berlin (February). Written
    alone before Berlin's answer, January's Paris was a plain duplicate of March's and moved its start back
    to January, and Berlin then closed it: Berlin became the answer. The duplicate waits for its round."""
    from worker.jobs.shutdown import WorkerStoppingError

    arrive(tx_factory, llm, lives("2026-03-05", "Paris"))
    march = alice(tx_factory)["Alice Example lives in Paris now."][0]
    for day, city in (("2026-01-05", "Paris"), ("2026-02-05", "Berlin")):
        slug, body = lives(day, city)
        put_page(tx_factory, slug, body)
        extract(tx_factory, llm, slug)

    def stopping() -> None:
        raise WorkerStoppingError("the worker is stopping")

    store = ConsolidationStore(tx_factory, Ledger(ConfigReader(tx_factory, ttl=0).get))
    with pytest.raises(WorkerStoppingError):
        consolidate_entity(store, llm, EntityRun("default", ALICE, guard=stopping))
    with tx_factory() as session:
        again = session.get(Fact, march.id)
        assert again is not None and again.valid_from == march.valid_from  # its start where it was
        undecided = select(func.count()).where(Fact.consolidated_at.is_(None), ~Fact.is_audit)
        assert session.scalar(undecided) == 2  # January's Paris waits for its round, with Berlin
    consolidate(tx_factory, llm)
    current = [t for t, rows in alice(tx_factory).items() for r in rows if r.status == "current"]
    assert "Alice Example lives in Berlin now." not in current, current


def test_a_stopping_worker_writes_the_answers_its_round_paid_for(tx_factory, llm) -> None:
    """The guard (which raises once the worker begins to stop) ran before each commit: a SIGTERM after a
    round's questions were answered threw every answer away, and the next worker paid for them again.
    What is paid for is written while the lease holds; the stop comes at the next question."""
    from worker.jobs.shutdown import WorkerStoppingError

    arrive(tx_factory, llm, lives("2026-01-05", "Lisbon"), lives("2026-02-05", "Porto"), each=False)
    with tx_factory.begin() as session:  # decide again, under a worker that begins to stop
        session.execute(text("DELETE FROM consolidation_decisions"))
        session.execute(update(Fact).values(status="current", superseded_by=None, duplicate_of=None,
                                            valid_to=None, consolidated_at=None))  # fmt: skip
    asked: list[int] = []

    class Asked:
        provider, model = llm.provider, llm.model

        def chat(self, request: Any) -> Any:
            asked.append(1)
            return llm.chat(request)

    def stopping_once_answered() -> None:
        if asked:
            raise WorkerStoppingError("the worker is stopping")

    leases: list[int] = []
    store = ConsolidationStore(tx_factory, Ledger(ConfigReader(tx_factory, ttl=0).get))
    run = EntityRun("default", ALICE, guard=stopping_once_answered, lease=lambda: leases.append(1))
    counters = consolidate_entity(store, Asked(), run)
    assert asked == [1] and leases and counters.llm_calls == 1
    current = [t for t, rows in alice(tx_factory).items() for r in rows if r.status == "current"]
    assert current == ["Alice Example lives in Porto now."]  # Porto's answer was written


def test_a_backfill_of_a_years_moves_leaves_only_the_last_current(tx_factory, llm) -> None:
    """Seven sayings of where Alice lives, consolidated in one round (a backfill): the last was asked
    about the five oldest, not June's, and June's and July's both stayed current."""
    cities = ("Lisbon", "Porto", "Faro", "Braga", "Evora", "Sintra", "Aveiro")
    arrive(tx_factory, llm, *[lives(f"2026-0{n}-05", city) for n, city in enumerate(cities, 1)], each=False)
    current = [t for t, rows in alice(tx_factory).items() for r in rows if r.status == "current"]
    assert current == ["Alice Example lives in Aveiro now."]


def test_an_operators_undo_waits_for_a_consolidation_commit_of_its_entity(factory, llm) -> None:
    """An undo wrote its fact without the entity's checkpoint: a round committing between the undo's
    read and its write closed a fact the operator had just made current (half undone, unsaid)."""
    import threading

    from worker.consolidation.operators import restore
    from worker.consolidation.store import lock_checkpoint

    both_pages_consolidated(factory, llm)
    [lisbon] = [f for f in alice(factory)["Alice Example lives in Lisbon now."] if f.status == "superseded"]
    done: list[int] = []

    def undo() -> None:
        with factory.begin() as session:
            done.append(restore(session, lisbon.id, "test"))

    with factory() as commit, commit.begin():  # a consolidation round, committing
        lock_checkpoint(commit, "default", ALICE)
        undoing = threading.Thread(target=undo)
        undoing.start()
        assert waits_on_a_lock(factory) and not done, "the undo never waited for the round in flight"
    undoing.join(timeout=30)
    assert done and done[0] > 0


def test_the_orphan_repair_of_an_entity_with_nothing_leaves_no_checkpoint(tx_factory) -> None:
    """A consolidation job claimed just before an erasure took the entity's last fact away: its repair
    made the checkpoint the erasure had dropped (keyed by the erased name), and left it."""
    store = ConsolidationStore(tx_factory, Ledger(ConfigReader(tx_factory, ttl=0).get))
    assert store.repair_orphans("default", "people/erased-person", None) == 0
    with tx_factory() as session:
        assert session.get(ConsolidationCheckpoint, ("default", "people/erased-person")) is None


def test_the_cli_run_without_a_source_consolidates_every_source(factory, database_url, simulator) -> None:
    """`factmill facts consolidate` (the README's catch-up for consolidation turned off after
    extraction) read the default source alone: another source's facts stayed unconsolidated, and the
    run said "0 entities". Without --source-id it takes every source; with it, that source alone."""
    from tests.cli import invoke_cli

    llm = OpenAIChatClient(model="simulator-1", base_url=simulator.base_url, provider="simulator")
    put_page(factory, JAN_PAGE, JAN_BODY, source_id="tenant-a")
    run_extract_conversation_facts(factory, llm, ExtractOptions(source_id="tenant-a", slug=JAN_PAGE))
    env = {"FACTMILL_LLM": "simulator", "FACTMILL_SIMULATOR_URL": simulator.base_url}

    def sources_decided() -> set[str]:
        with factory() as session:
            return set(session.scalars(select(ConsolidationDecision.source_id)))

    only_default = invoke_cli(database_url, "facts", "consolidate", "--source-id", "default", **env)
    assert only_default.exit_code == 0 and "0 entities" in only_default.output, only_default.output
    assert sources_decided() == set()
    every = invoke_cli(database_url, "facts", "consolidate", **env)
    assert every.exit_code == 0, every.output
    assert sources_decided() == {"tenant-a"}
    with factory() as session:
        left = session.scalar(
            select(func.count()).where(
                Fact.source_id == "tenant-a", ~Fact.is_audit, Fact.consolidated_at.is_(None)
            )
        )
    assert left == 0


def test_a_round_that_deadlocks_with_a_vector_fill_is_written_again_and_asked_once(factory, llm) -> None:
    """A vector fill updates facts in its join's order; a round marks the new fact, then closes the older
    one. Crossed, Postgres ended the round (it waited first): the job spent an attempt, and its retry
    paid the model again for every answer of the round. The round's write is made again instead."""
    put_page(factory, JAN_PAGE, JAN_BODY)
    extract(factory, llm, JAN_PAGE)
    consolidate(factory, llm)
    put_page(factory, MAR_PAGE, MAR_BODY)
    extract(factory, llm, MAR_PAGE)
    facts = alice(factory)
    old, new = facts["Alice Example lives in Lisbon now."][0], facts["Alice Example lives in Porto now."][0]
    same = {"confidence": Fact.confidence}
    with factory() as fill, ThreadPoolExecutor(1) as pool:
        fill.execute(update(Fact).where(Fact.id == old.id).values(**same))  # the fill holds the older fact
        running = pool.submit(consolidate, factory, llm)
        assert waits_on_a_lock(factory, running, "%UPDATE facts%"), "the round never waited on the fill"
        fill.execute(update(Fact).where(Fact.id == new.id).values(**same))  # ... which then waits on the new
        fill.commit()
        second = running.result(timeout=60)
    assert second.llm_calls == 1 and calls(factory) == 1, "the round's answer was paid for once"
    facts = alice(factory)
    old, new = facts["Alice Example lives in Lisbon now."][0], facts["Alice Example lives in Porto now."][0]
    assert (old.status, old.superseded_by, new.status) == ("superseded", new.id, "current")


def test_the_sweep_embeds_the_facts_a_follow_up_left_without_a_vector(factory, llm, database_url, simulator):
    """The day's budget spent (or the embedding model down), an extraction's embedding follow-up left
    its facts without vectors and nothing tried again: vector search never found them until an operator
    ran `factmill embed`. The sweep hands their pages to the follow-up again once the budget has room,
    within a day; the follow-up's threads make the calls (the sweep never waits on the model)."""
    from datetime import timedelta

    from tests.integration.test_api import make_runtime
    from tests.maintenance import maintained
    from tests.service import wait_for

    put_page(factory, JAN_PAGE, JAN_BODY)
    extract(factory, llm, JAN_PAGE)  # its follow-up never embedded them

    def unembedded() -> int:
        with factory() as session:
            return session.scalar(select(func.count()).where(Fact.embedding.is_(None), ~Fact.is_audit)) or 0

    def aged(delta: timedelta) -> None:
        with factory.begin() as session:
            session.execute(Fact.__table__.update().values(created_at=func.now() - delta))

    stored = unembedded()
    assert stored > 0
    rt = make_runtime(database_url, factory, simulator_url=simulator.base_url, embed_after_extraction=True)
    anthropic = make_runtime(database_url, factory, llm="anthropic", anthropic_api_key="sk-ant-test")
    try:
        assert maintained(rt).steps["vectors_caught_up"] == 0  # its own follow-up's time
        aged(timedelta(minutes=10))
        with factory.begin() as session:
            set_config(session, "llm.budget_daily_usd", "0")
        assert maintained(rt).steps["vectors_caught_up"] == 0  # no budget: it waits
        with factory.begin() as session:
            set_config(session, "llm.budget_daily_usd", "100")
        assert maintained(anthropic).steps["vectors_caught_up"] == 0  # no embeddings model: nothing to try
        assert unembedded() == stored
        assert maintained(rt).steps["vectors_caught_up"] == 1  # the page, to the follow-up
        wait_for(lambda: unembedded() == 0, 30, "the follow-up's vectors")
        with factory.begin() as session:
            session.execute(Fact.__table__.update().values(embedding=None))
        aged(timedelta(days=2))
        assert maintained(rt).steps["vectors_caught_up"] == 0  # past the day: `factmill embed`
    finally:
        rt.close()
        anthropic.close()


def test_a_unit_named_on_the_command_line_has_facts_by_its_own_rule(tx_factory) -> None:
    """`facts consolidate --entity` refuses a unit with no facts (a typo ran a job on nothing); counted by
    the entity rule, page:SLUG (a page's facts without an entity, which its help offers) never had any."""
    from tests.integration.test_api import fact_row
    from worker.consolidation.operators import unit_has_facts

    with tx_factory.begin() as session:
        loose = fact_row("notes/foo", 0, "The launch moved to May.")
        named = fact_row("notes/foo", 1, "Alice leads it.")
        named.entity_slug = ALICE
        session.add_all([loose, named])
    with tx_factory() as session:
        assert unit_has_facts(session, "default", "page:notes/foo")
        assert unit_has_facts(session, "default", ALICE)
        assert not unit_has_facts(session, "default", "page:notes/bar")
        assert not unit_has_facts(session, "work", ALICE)  # another source's
        assert not unit_has_facts(session, "default", "people/alcie-example")


def test_a_restatement_said_before_the_change_in_the_change_s_own_segment_stays_a_duplicate(session) -> None:
    """A segment's facts share one start: "Alice lives in Paris" (kept as a duplicate of the older
    Paris), then "Alice moved to Berlin", which closed the older Paris. The closing reopened the
    restatement (its start was not before the change's) though it was said first; decided again, it
    closed Berlin at Berlin's own start, an empty interval no read returned. As the planner does, a tie
    of starts is broken by arrival."""
    from tests.rows import fact_row
    from worker.consolidation.decisions import _reopen_restatements_after

    segment = datetime(2024, 3, 1, 9, 0, tzinfo=UTC)

    def add(row_num: int, text: str, **columns: Any) -> int:
        return session.execute(
            insert(Fact).values(fact_row(row_num, text) | columns).returning(Fact.id)
        ).scalar_one()

    older = add(0, "Alice lives in Paris", valid_from=datetime(2024, 1, 1, tzinfo=UTC))
    before = add(1, "Alice lives in Paris", valid_from=segment, status="duplicate", duplicate_of=older)
    change = add(2, "Alice moved from Paris to Berlin", valid_from=segment)
    after = add(3, "Alice lives in Paris again", valid_from=segment, status="duplicate", duplicate_of=older)
    reopened = _reopen_restatements_after(session, older, change, segment)
    assert [fact_id for fact_id, _ in reopened] == [after]
    statuses = dict(session.execute(select(Fact.id, Fact.status).where(Fact.id.in_([before, after]))).all())
    assert statuses == {before: "duplicate", after: "current"}


def test_a_stop_inside_a_split_question_writes_the_answers_its_first_half_paid_for(
    tx_factory, llm, simulator
) -> None:
    """A question whose answer was cut off at its cap is asked again in halves; a stop (the budget, the
    switch, a SIGTERM, an unusable reply) before the second half threw the first half's answers away,
    and the next run paid for them again."""
    from worker.jobs.shutdown import WorkerStoppingError

    cities = ("Lisbon", "Porto", "Faro", "Braga", "Evora", "Sintra", "Aveiro")  # 20 pairs, one question
    arrive(tx_factory, llm, *[lives(f"2026-0{n}-05", city) for n, city in enumerate(cities, 1)], each=False)
    with tx_factory.begin() as session:  # decide again, first through a reply cut off at its cap
        session.execute(text("DELETE FROM consolidation_decisions"))
        session.execute(update(Fact).values(status="current", superseded_by=None, duplicate_of=None,
                                            valid_to=None, consolidated_at=None))  # fmt: skip
    cut = OpenAIChatClient(
        model="simulator-1",
        base_url=simulator.base_url,
        provider="simulator",
        default_headers={"x-simulator-fault": "truncated"},
    )
    asked: list[int] = []

    class CutThenAnswered:
        provider, model = llm.provider, llm.model

        def chat(self, request: Any) -> Any:
            asked.append(request.messages[0][1].count(" OLD ("))
            return (cut if len(asked) == 1 else llm).chat(request)

    def stopping_after_two_questions() -> None:
        if len(asked) >= 2:
            raise WorkerStoppingError("the worker is stopping")

    store = ConsolidationStore(tx_factory, Ledger(ConfigReader(tx_factory, ttl=0).get))
    with pytest.raises(WorkerStoppingError):
        consolidate_entity(
            store, CutThenAnswered(), EntityRun("default", ALICE, guard=stopping_after_two_questions)
        )
    assert asked == [20, 10]
    decided = [t for t, rows in alice(tx_factory).items() for r in rows if r.consolidated_at is not None]
    assert len(decided) > 1, decided  # before: the first fact alone (the rules decide it, no pair asked)
    asked.clear()
    consolidate_entity(store, llm_counting(llm, asked), EntityRun("default", ALICE))
    assert 0 < sum(asked) < 20, asked  # only the pairs not answered before


def llm_counting(llm: Any, asked: list[int]) -> Any:
    """``llm``, each question's pair count appended to ``asked``."""

    class Counting:
        provider, model = llm.provider, llm.model

        def chat(self, request: Any) -> Any:
            asked.append(request.messages[0][1].count(" OLD ("))
            return llm.chat(request)

    return Counting()


def test_a_consolidation_reply_that_cannot_be_read_is_recorded_as_malformed(tx_factory, sim) -> None:
    """Its llm_calls row said ok (the job retried on the unusable reply): `factmill costs`, the metrics and
    the spend by outcome showed a retry loop as calls that worked. Extraction and compaction say
    malformed_output for a reply they cannot use."""
    from worker.consolidation.service import ConsolidationReplyError

    llm = OpenAIChatClient(model="simulator-1", base_url=sim.base_url, provider="simulator")
    for slug, body in ((JAN_PAGE, JAN_BODY), (MAR_PAGE, MAR_BODY)):
        put_page(tx_factory, slug, body)
        extract(tx_factory, llm, slug)
    sim.configure(
        raw_replies={"chat.completions": completion(content="I think they agree.", model="simulator-1")}
    )
    with pytest.raises(ConsolidationReplyError, match="malformed"):
        consolidate(tx_factory, llm)
    with tx_factory() as session:
        [(outcome, error)] = session.execute(
            select(LLMCall.outcome, LLMCall.error).where(LLMCall.purpose == "consolidation")
        ).all()
    assert outcome == "malformed_output" and "the consolidation answer was malformed" in (error or "")


def test_a_stop_inside_a_refused_question_writes_the_pairs_refused_alone_and_the_answers(
    tx_factory, llm, simulator
) -> None:
    """One fact's text refused (a content filter): its questions are halved down to its pairs, refused
    alone and kept as unrelated. A stop before the split ended threw those refusals away (only the
    answers were kept), the facts before it could not be written, and the next run paid again."""
    from worker.jobs.shutdown import WorkerStoppingError

    cities = ("Lisbon", "Porto", "Faro", "Braga", "Evora", "Sintra", "Aveiro")
    arrive(tx_factory, llm, *[lives(f"2026-0{n}-05", city) for n, city in enumerate(cities, 1)], each=False)
    with tx_factory.begin() as session:  # decide again, Lisbon's text refused wherever it is asked
        session.execute(text("DELETE FROM consolidation_decisions"))
        session.execute(update(Fact).values(status="current", superseded_by=None, duplicate_of=None,
                                            valid_to=None, consolidated_at=None))  # fmt: skip
    refusing = refusing_client(simulator)
    asked: list[int] = []

    class FilteringLisbon:
        provider, model = llm.provider, llm.model

        def chat(self, request: Any) -> Any:
            asked.append(request.messages[0][1].count(" OLD ("))
            return (refusing if "Lisbon" in request.messages[0][1] else llm).chat(request)

    def stopping() -> None:
        if len(asked) >= STOP_AFTER:
            raise WorkerStoppingError("the worker is stopping")

    store = ConsolidationStore(tx_factory, Ledger(ConfigReader(tx_factory, ttl=0).get))
    with pytest.raises(WorkerStoppingError):
        consolidate_entity(store, FilteringLisbon(), EntityRun("default", ALICE, guard=stopping))
    assert asked == [20, 10, 5, 2, 1, 1]  # halved down to Porto's pair with Lisbon, refused alone
    decided = [t for t, rows in alice(tx_factory).items() for r in rows if r.consolidated_at is not None]
    # Porto's one pair refused alone: kept as unrelated, so Porto is written (before: Lisbon alone,
    # which the rules decide with no pair asked).
    assert decided == ["Alice Example lives in Lisbon now.", "Alice Example lives in Porto now."]
    # With none answered, a refusal may be of what every question shares (the entity: found only at the
    # eighth, SharedRefusalError): a stop before that keeps none, and writes no pair as unrelated.
    with tx_factory.begin() as session:
        session.execute(text("DELETE FROM consolidation_decisions"))
        session.execute(update(Fact).values(consolidated_at=None))
    asked.clear()
    with pytest.raises(WorkerStoppingError):
        consolidate_entity(store, llm_counting(refusing, asked), EntityRun("default", ALICE, guard=stopping))
    with tx_factory() as session:
        model = ConsolidationDecision.decided_by == "model"
        assert not session.scalar(select(func.count()).select_from(ConsolidationDecision).where(model))


STOP_AFTER = 6  # the questions asked before the worker stops
