"""Backfills (batch_extraction jobs) through the one job lifecycle, real Postgres and the simulator's
batch endpoints over HTTP with the real SDKs: planning, store-before-send, collection, expiry, edits,
the kill switch and cancel. The crash test with worker processes is in test_backfill_crash.py."""

from __future__ import annotations

import json
import logging
import time
import typing
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from decimal import Decimal
from typing import Any

import httpx
import pytest
from fastapi.testclient import TestClient
from sqlalchemy import func, select, text, update
from sqlalchemy.orm import Session, sessionmaker

from models import (
    Backfill,
    BackfillBatch,
    BackfillRequest,
    ExtractionAudit,
    Fact,
    Job,
    LLMCall,
    Page,
    ProviderCopy,
)
from models.backfill import BACKFILL_STATUSES
from tests.auth import send_key
from tests.cli import invoke_cli
from tests.integration.test_api import ADMIN_HEADERS, Recorder, make_runtime
from tests.integration.test_batch import owed_gauge, page_body
from tests.integration.test_extraction import put_page
from tests.integration.test_service import unembedded
from tests.service import wait_for
from worker.accounting import cost_usd, parse_prices
from worker.api.app import create_app
from worker.api.routes.backfills import BackfillStatus
from worker.config_store import ConfigReader, set_config
from worker.core.conversation import parse_conversation_messages, segment_bytes, split_into_segments
from worker.extraction import (
    TERMINAL_AUDIT_SOURCE,
    ExtractOptions,
    backfill_limits,
    run_extract_conversation_facts,
)
from worker.extraction.backfill import BackfillPass
from worker.extraction.backfill_admin import backfill_report, cancel_backfill, poll_backfills, resume_waiting
from worker.extraction.backfill_request import (
    BATCH_EXTRACTION,
    RESEND_AFTER_SECONDS,
    BackfillSelection,
    request_backfill,
)
from worker.extraction.backfill_store import BackfillStore
from worker.extraction.batch import request_overhead_bytes, segment_request
from worker.extraction.options import CheckpointConflictError
from worker.extraction.pages import PageIn, store_page
from worker.extraction.provider_copies import RETRY_AFTER, sweep_provider_copies
from worker.extraction.store import ExtractionStore
from worker.jobs.lifecycle import JobOutcome, run_job
from worker.jobs.outbox import resume_paused
from worker.llm.anthropic_provider import AnthropicChatClient
from worker.llm.batch_api import FIND_MARGIN, UNDETERMINED
from worker.llm.batches import AnthropicBatchClient, OpenAIBatchClient
from worker.llm.errors import LLMError
from worker.llm.openai_compat import OpenAIChatClient
from worker.llm.types import Usage
from worker.runtime import Runtime
from worker.settings import Settings
from worker.simulator import Simulator, SimulatorConfig

pytestmark = pytest.mark.integration

PRICES = '{"simulator-1": {"input": 1000, "output": 1000}}'
SEGMENTS_PER_PAGE = 4  # page_body: four segments a day apart
BATCH_MAX = 8  # two pages per provider batch


def person(n: int) -> tuple[str, str, str]:
    return f"chats/p{n:04d}", f"Person{n} Example", f"Company{n}"


def seed_pages(factory: sessionmaker[Session], source: str, count: int) -> list[str]:
    with factory.begin() as session:
        set_config(session, "facts.extraction_enabled", "true")
        set_config(session, "llm.prices", PRICES)
    slugs = []
    for n in range(count):
        slug, name, company = person(n)
        put_page(factory, slug, page_body(name, company), title=f"chat: {name}", source_id=source)
        slugs.append(slug)
    return slugs


def extracted_then_edited(factory: sessionmaker[Session], sim: Simulator, count: int) -> list[str]:
    """``count`` pages of source "bf" extracted online, then each edited (its company now Globex): a
    backfill re-extracts each one whole and swaps its facts."""
    slugs = seed_pages(factory, "bf", count)
    llm = OpenAIChatClient(model="simulator-1", base_url=sim.base_url, provider="simulator")
    run_extract_conversation_facts(factory, llm, ExtractOptions(source_id="bf"))
    for n, slug in enumerate(slugs):
        name, company = person(n)[1:]
        edited = page_body(name, company).replace(company, "Globex", 1)
        put_page(factory, slug, edited, title=f"chat: {name}", source_id="bf")
    return slugs


@pytest.fixture(scope="module")
def batch_sim() -> Iterator[Simulator]:
    with Simulator(SimulatorConfig(batch_delay_seconds=0.05)) as simulator:
        yield simulator


@pytest.fixture
def sim(batch_sim: Simulator) -> Simulator:
    batch_sim.configure(**SimulatorConfig(batch_delay_seconds=0.05).model_dump())
    batch_sim.reset()
    return batch_sim


@pytest.fixture
def rt(factory: sessionmaker[Session], database_url: str, sim: Simulator) -> Iterator[Runtime]:
    yield from backfill_runtime(factory, database_url, llm="simulator", simulator_url=sim.base_url)


def backfill_runtime(factory: sessionmaker[Session], database_url: str, **provider: Any) -> Iterator[Runtime]:
    """A runtime over ``factory`` whose provider is ``provider`` (settings), BATCH_MAX requests a batch."""
    settings = Settings(database_url=database_url, backfill_batch_max_requests=BATCH_MAX, **provider)
    runtime = Runtime(settings=settings, factory=factory, config=ConfigReader(factory, ttl=0))
    yield runtime
    runtime.close()


def start(factory: sessionmaker[Session], source: str, **selection: Any) -> tuple[int, int]:
    with factory.begin() as session:
        return request_backfill(session, BackfillSelection(source_id=source, **selection), created_by="test")


def run_pass(rt: Runtime, job_id: int) -> JobOutcome:
    return run_job(rt, job_id, BATCH_EXTRACTION)


def drive(rt: Runtime, job_id: int, passes: int = 400) -> JobOutcome:
    """Run passes as beat would wake them, until the job stops waiting on its batches."""
    for _ in range(passes):
        outcome = run_pass(rt, job_id)
        if outcome.status != "paused" or job_row(rt.factory, job_id).pause_reason not in (
            "batch",
            "batch_fault",
        ):
            return outcome
        time.sleep(0.05)  # the simulator's batches end after batch_delay_seconds
    raise AssertionError(f"backfill job {job_id} still waiting after {passes} passes")


def job_row(factory: sessionmaker[Session], job_id: int) -> Job:
    with factory() as session:
        job = session.get(Job, job_id)
        assert job is not None
        return job


def request_statuses(factory: sessionmaker[Session], backfill_id: int) -> dict[str, int]:
    with factory() as session:
        rows = session.execute(
            select(BackfillRequest.status, func.count())
            .join(BackfillBatch, BackfillBatch.id == BackfillRequest.batch_id)
            .where(BackfillBatch.backfill_id == backfill_id)
            .group_by(BackfillRequest.status)
        ).all()
    return {status: count for status, count in rows}


def facts_of(factory: sessionmaker[Session], source: str) -> list[tuple[str, int, str]]:
    with factory() as session:
        rows = session.execute(
            select(Fact.source_markdown_slug, Fact.row_num, Fact.fact)
            .where(Fact.source_id == source, Fact.source != TERMINAL_AUDIT_SOURCE)
            .order_by(Fact.source_markdown_slug, Fact.row_num)
        ).all()
    return [tuple(row) for row in rows]  # type: ignore[misc]


def terminal_slugs(factory: sessionmaker[Session], source: str) -> set[str]:
    with factory() as session:
        return set(
            session.scalars(
                select(Fact.source_markdown_slug).where(
                    Fact.source_id == source, Fact.source == TERMINAL_AUDIT_SOURCE
                )
            )
        )


def ok_audits_per_segment(factory: sessionmaker[Session], source: str) -> dict[tuple[str, str], int]:
    with factory() as session:
        rows = session.execute(
            select(ExtractionAudit.page_slug, ExtractionAudit.segment_start, func.count())
            .where(ExtractionAudit.source_id == source, ExtractionAudit.outcome == "ok")
            .group_by(ExtractionAudit.page_slug, ExtractionAudit.segment_start)
        ).all()
    return {(slug, str(start)): count for slug, start, count in rows}


def calls_of(factory: sessionmaker[Session], job_id: int) -> list[LLMCall]:
    with factory() as session:
        return list(session.scalars(select(LLMCall).where(LLMCall.job_id == job_id)))


def assert_half_price(calls: list[LLMCall]) -> None:
    """Every batch row costs half what the same tokens cost online (the one costing function)."""
    prices = parse_prices(PRICES)
    assert calls
    for call in calls:
        usage = Usage(call.input_tokens, call.output_tokens, call.cache_read_tokens, call.cache_write_tokens)
        online = cost_usd(call.model, usage, prices)
        assert online > 0
        assert call.cost_usd == (online / 2).quantize(Decimal("0.000001")), call.id


def online_reference(
    factory: sessionmaker[Session], sim: Simulator, count: int
) -> list[tuple[str, int, str]]:
    """The same pages extracted online in another source: what the backfill must store."""
    seed_pages(factory, "online", count)
    llm = OpenAIChatClient(model="simulator-1", base_url=sim.base_url, provider="simulator")
    run_extract_conversation_facts(factory, llm, ExtractOptions(source_id="online"))
    return facts_of(factory, "online")


def test_a_backfill_extracts_every_page_once_through_batches_at_half_price(factory, rt, sim):
    slugs = seed_pages(factory, "bf", 6)
    reference = online_reference(factory, sim, 6)
    sim.reset()
    backfill_id, job_id = start(factory, "bf")
    outcome = drive(rt, job_id)

    assert outcome.status == "succeeded", job_row(factory, job_id).last_error
    segments = len(slugs) * SEGMENTS_PER_PAGE
    assert request_statuses(factory, backfill_id) == {"done": segments}
    assert facts_of(factory, "bf") == reference
    assert terminal_slugs(factory, "bf") == set(slugs)
    assert set(ok_audits_per_segment(factory, "bf").values()) == {1}
    stats = sim.stats()["batches"]
    assert stats["created"] == 3  # 24 requests, 8 to a batch (two whole pages each)
    assert stats["requests"] == segments
    calls = calls_of(factory, job_id)
    assert len(calls) == segments
    assert_half_price(calls)
    report = backfill_report(factory, backfill_id)
    assert report["status"] == "done" and report["job_status"] == "succeeded"
    assert report["llm_calls"] == segments
    assert Decimal(str(report["cost_usd"])) == sum(c.cost_usd for c in calls)
    assert [b["status"] for b in report["batches"]] == ["collected"] * 3  # type: ignore[union-attr]


def test_a_second_backfill_leaves_the_pages_a_first_still_extracts_to_it(factory, rt, sim):
    """Two overlapping backfills (a source and a prefix of it, or one asked twice) each planned and
    sent the same segments: paid twice, and the second to collect discarded its results."""
    seed_pages(factory, "bf", 2)
    sim.configure(batch_delay_seconds=3600)
    first, first_job = start(factory, "bf")
    assert run_pass(rt, first_job).status == "paused" and sim.stats()["batches"]["created"] == 1
    second, second_job = start(factory, "bf")
    assert run_pass(rt, second_job).status == "succeeded", "nothing left for it to plan"
    assert sim.stats()["batches"]["created"] == 1 and request_statuses(factory, second) == {}
    # Its report says what it left to the other (only a worker's log line did: "done", and a cancel of
    # the first left the pages unextracted without a word).
    from worker.extraction.backfill_admin import backfill_report

    assert backfill_report(factory, second)["pages_left_to_others"] == 2
    assert backfill_report(factory, first)["pages_left_to_others"] == 0
    sim.end_batches()
    assert drive(rt, first_job).status == "succeeded"
    assert request_statuses(factory, first) == {"done": 8}


def test_a_backfill_planned_after_anothers_cancel_was_asked_takes_the_pages_it_never_sent(
    factory, rt, sim, monkeypatch
):
    """The pages of a backfill whose cancel was asked but not yet run counted as in flight: one planned
    then left them to it, the cancel never sent them, and both ended with those pages unextracted."""
    seed_pages(factory, "bf", 2)
    with monkeypatch.context() as patched:
        patched.setattr(backfill_limits, "within_budget", lambda run, batch, estimate: False)
        first, first_job = start(factory, "bf")
        run_pass(rt, first_job)  # planned, nothing sent
    assert request_statuses(factory, first) == {"pending": 8} and sim.stats()["batches"]["created"] == 0
    with factory.begin() as session:
        cancel_backfill(session, first)
    second, second_job = start(factory, "bf")
    assert drive(rt, second_job).status == "succeeded"
    assert request_statuses(factory, second) == {"done": 8}
    assert drive(rt, first_job).status == "succeeded"
    assert backfill_report(factory, first)["status"] == "cancelled"


def test_a_cancel_asked_while_a_send_is_prepared_sends_nothing(factory, rt, sim, monkeypatch):
    """The pass read the cancel, then rebuilt the batch's requests (up to 50,000 from their pages) and
    began the send without reading it again: a backfill planned after the cancel took the same pages
    (both paid), or left them to this one, which then cancelled them unextracted."""
    seed_pages(factory, "bf", 2)
    backfill_id, job_id = start(factory, "bf")
    rebuild = BackfillPass.requests_to_send

    def cancelled_meanwhile(self: BackfillPass, batch: Any) -> Any:
        requests = rebuild(self, batch)
        with factory.begin() as session:
            cancel_backfill(session, backfill_id)
        return requests

    monkeypatch.setattr(BackfillPass, "requests_to_send", cancelled_meanwhile)
    assert run_pass(rt, job_id).status == "succeeded", "cancelled in this pass, not at a later poll"
    assert sim.stats()["batches"]["created"] == 0
    assert backfill_report(factory, backfill_id)["status"] == "cancelled"
    assert request_statuses(factory, backfill_id) == {"cancelled": 8}


def test_a_plan_stored_after_another_s_drops_the_pages_that_one_took(factory, rt, sim):
    """Each read the pages in flight before its planning, which can run for minutes: two planned at
    once both saw none, and both stored every page. The store checks again (one plan at a time, under
    an advisory lock; here the two stores run one after the other)."""
    from worker.extraction.backfill_rows import PlannedBatch, PlannedRequest
    from worker.extraction.backfill_store import BackfillStore as Store

    [slug] = seed_pages(factory, "bf", 1)
    with factory() as session:
        page_id = session.scalars(select(Page.id).where(Page.slug == slug)).one()
    first, _ = start(factory, "bf")
    second, _ = start(factory, "bf")

    def plan(key: str) -> list[PlannedBatch]:
        requests = [PlannedRequest(f"{key}-p{page_id}-m{m}", page_id, slug, m, "h") for m in (2, 4)]
        return [PlannedBatch(key, "simulator", "simulator-1", requests)]

    store = Store(factory)
    store.store_plan(first, plan("fmfirst"))
    store.store_plan(second, plan("fmsecond"))  # planned beside the first, stored after it
    assert request_statuses(factory, first) == {"pending": 2}
    assert request_statuses(factory, second) == {}
    from worker.extraction.backfill_admin import backfill_report

    assert backfill_report(factory, second)["pages_left_to_others"] == 1  # dropped when stored


@pytest.mark.parametrize("job", ["failed", "deleted by retention"])
def test_a_backfill_whose_job_failed_holds_no_page_from_the_next(factory, rt, sim, job):
    """Its pending requests held their pages from every later backfill, for good once its job was gone."""
    seed_pages(factory, "bf", 2)
    sim.configure(batch_delay_seconds=3600)
    _, first_job = start(factory, "bf")
    assert run_pass(rt, first_job).status == "paused"
    with factory.begin() as session:
        session.execute(update(Job).where(Job.id == first_job).values(status="failed"))
        if job != "failed":
            session.execute(
                update(Backfill).values(job_id=None)
            )  # what retention's ON DELETE SET NULL leaves
    second, second_job = start(factory, "bf")
    assert run_pass(rt, second_job).status == "paused"
    assert request_statuses(factory, second) == {"pending": 8}
    sim.end_batches()


def test_selection_narrows_by_slug_prefix_and_caps_the_segments(factory, rt, sim):
    seed_pages(factory, "bf", 4)
    put_page(factory, "other/x", page_body("Zed", "Zeta"), title="chat: Zed", source_id="bf")
    backfill_id, job_id = start(factory, "bf", slug_prefix="chats/", max_segments=6)
    assert drive(rt, job_id).status == "succeeded"
    assert request_statuses(factory, backfill_id) == {"done": 6}
    assert terminal_slugs(factory, "bf") == {"chats/p0000"}  # p0001 got its first two segments only
    assert "other/x" not in {slug for slug, _, _ in facts_of(factory, "bf")}
    # The next backfill sends only what is left: nothing is asked twice.
    second_id, second_job = start(factory, "bf", slug_prefix="chats/")
    assert drive(rt, second_job).status == "succeeded"
    assert request_statuses(factory, second_id) == {"done": 4 * SEGMENTS_PER_PAGE - 6}


def test_planning_holds_one_page_s_messages_at_a_time(factory, rt, sim):
    """The plans of every selected page were listed before any was used: a corpus's text at once (400
    pages of 188 KiB: 94 MiB traced at the peak, 37 MiB now), and a worker out of memory planned again
    from scratch on every retry."""
    from worker.extraction.backfill import BackfillDeps
    from worker.extraction.backfill_store import BackfillStore as Store

    seed_pages(factory, "bf", 3)
    backfill_id, _ = start(factory, "bf")
    client = OpenAIBatchClient(OpenAIChatClient(model="simulator-1", base_url=sim.base_url))
    deps = BackfillDeps(factory, rt.ledger, rt.config, rt.budget, client, None)
    backfill = Store(factory).load(backfill_id)
    assert backfill is not None
    planning = BackfillPass(deps, backfill)
    planned: list[str] = []
    real_plan = planning.run.plan

    def counted(ref: Any, **kw: Any) -> Any:
        planned.append(ref.slug)
        return real_plan(ref, **kw)

    planning.run.plan = counted  # type: ignore[method-assign]
    plans = planning.planner().plans()
    first = next(plans)
    assert planned == [first.slug]  # the next page is planned when the first is done with
    assert len(list(plans)) == 2 and len(planned) == 3


def test_a_page_re_extracted_whole_is_never_sent_cut_short(factory, rt, sim):
    """An edited page's facts are swapped only once every segment has its result: cut short by
    max_segments, its results were paid for and its requests marked done, and nothing was stored."""
    [slug] = seed_pages(factory, "bf", 1)
    llm = OpenAIChatClient(model="simulator-1", base_url=sim.base_url, provider="simulator")
    run_extract_conversation_facts(factory, llm, ExtractOptions(source_id="bf"))
    before = facts_of(factory, "bf")
    put_page(
        factory,
        slug,
        page_body("Ann Example", "Acme").replace("Acme", "Globex", 1),
        title="chat",
        source_id="bf",
    )
    backfill_id, job_id = start(factory, "bf", max_segments=2)
    assert drive(rt, job_id).status == "succeeded"
    assert request_statuses(factory, backfill_id) == {} and calls_of(factory, job_id) == []
    assert facts_of(factory, "bf") == before  # nothing paid for, nothing lost: a later run re-extracts it
    second_id, second_job = start(factory, "bf")
    assert drive(rt, second_job).status == "succeeded"
    assert request_statuses(factory, second_id) == {"done": SEGMENTS_PER_PAGE}
    assert any("Globex" in fact for _, _, fact in facts_of(factory, "bf"))


def test_a_page_swapped_down_to_no_facts_still_asks_for_its_entities_consolidation(factory, rt, sim):
    """The swap deleted the page's facts and stored none: facts of other pages that they had closed stay
    closed by nothing (out of search) until consolidation repairs them, and only a swap that stored
    facts asked for it (an online run asks on every successful run)."""
    from tests.integration.test_batch import fmt

    [slug] = seed_pages(factory, "bf", 1)
    llm = OpenAIChatClient(model="simulator-1", base_url=sim.base_url, provider="simulator")
    run_extract_conversation_facts(factory, llm, ExtractOptions(source_id="bf"))
    assert facts_of(factory, "bf")
    with factory.begin() as session:  # what the online run asked for is done
        session.execute(update(Job).where(Job.kind == "consolidation").values(status="succeeded"))
        # A fact of another page the swap's deleted facts had closed: closed by nothing now.
        session.execute(
            text(
                "INSERT INTO facts (source_id, fact, kind, entity_slug, confidence, notability, source, "
                "source_session, source_markdown_slug, row_num, created_at, status, consolidated_at) VALUES "
                "('bf', 'Ann lived in Paris', 'fact', 'people/ann', 0.9, 'medium', 's', 's', 'chats/q', 0, "
                "now(), 'superseded', now())"
            )
        )
    chat = [
        fmt(who, day, t, "Hi there.")
        for day in (10, 11)
        for who, t in (("Ann", "9:00 AM"), ("Bob", "9:01 AM"))
    ]
    put_page(factory, slug, "\n".join(chat), title="chat", source_id="bf")  # edited: nothing to extract
    _, job_id = start(factory, "bf")
    assert drive(rt, job_id).status == "succeeded"
    assert [slug for slug, _, _ in facts_of(factory, "bf")] == ["chats/q"]  # the page's: swapped to none

    def asked() -> bool:
        with factory() as session:
            return bool(
                session.scalar(
                    select(func.count()).where(
                        Job.kind == "consolidation", Job.status == "queued", Job.subject == "bf|people/ann"
                    )
                )
            )

    wait_for(asked, 10, "a consolidation request for the page's entities and its source's orphans")


def test_a_pass_that_dies_before_a_whole_page_swap_leaves_its_results_to_be_collected_again(
    factory, rt, sim, monkeypatch
):
    """An edited page is re-extracted whole: its segments' results wait for one swap. A pass that died
    before the swap had marked their requests done (each in a transaction of its own), so the next pass
    found nothing to collect and the page kept its old facts for good. The marks now go in with the swap."""
    extracted_then_edited(factory, sim, 1)
    sim.configure(batch_delay_seconds=3600)
    backfill_id, job_id = start(factory, "bf")
    assert run_pass(rt, job_id).status == "paused"
    sim.end_batches()

    def dies(*args: Any, **kwargs: Any) -> int:
        raise RuntimeError("the worker died before the swap")

    monkeypatch.setattr(ExtractionStore, "replace_page", dies)
    assert run_pass(rt, job_id).status != "succeeded"
    assert request_statuses(factory, backfill_id) == {"pending": SEGMENTS_PER_PAGE}
    assert calls_of(factory, job_id) == []  # nothing recorded: the results are read again
    monkeypatch.undo()
    assert drive(rt, job_id).status == "succeeded"
    assert request_statuses(factory, backfill_id) == {"done": SEGMENTS_PER_PAGE}
    assert len(calls_of(factory, job_id)) == SEGMENTS_PER_PAGE  # paid once, recorded once
    assert set(ok_audits_per_segment(factory, "bf").values()) == {2}  # the online run's and the backfill's
    assert any("Globex" in fact for _, _, fact in facts_of(factory, "bf"))


def test_a_backfill_s_facts_are_embedded_and_their_entities_consolidated_as_an_online_run_s(factory, rt, sim):
    """A backfill committed its facts and followed up on none of them: vector search never found them
    (until someone ran `factmill embed`), and a swap's deleted facts left the facts they had closed
    hidden until another extraction of the source asked for consolidation."""
    seed_pages(factory, "bf", 2)
    _, job_id = start(factory, "bf")
    assert drive(rt, job_id).status == "succeeded"
    assert facts_of(factory, "bf")
    wait_for(lambda: unembedded(factory) == 0, 60, "the backfill's facts to be embedded")
    with factory() as session:
        consolidations = session.scalar(
            select(func.count()).select_from(Job).where(Job.kind == "consolidation")
        )
    assert consolidations


def test_a_swap_refused_for_one_page_leaves_nothing_held_for_the_next(factory, rt, sim, monkeypatch):
    """A refused swap (another run moved the page on) left its page's attempts held: the next page's
    swap wrote them too, found their requests already recorded, rolled back and ended the pass."""
    slugs = extracted_then_edited(factory, sim, 2)  # both re-extracted whole
    real_replace = ExtractionStore.replace_page
    calls: list[str] = []

    def first_refused(self: Any, fingerprint: str, last: Any, *args: Any, **kwargs: Any) -> int:
        calls.append(last.slug)
        if len(calls) == 1:
            raise CheckpointConflictError(f"{last.slug!r} was extracted by another run")
        return real_replace(self, fingerprint, last, *args, **kwargs)

    monkeypatch.setattr(ExtractionStore, "replace_page", first_refused)
    backfill_id, job_id = start(factory, "bf")
    assert drive(rt, job_id).status == "succeeded"
    assert calls == slugs
    assert request_statuses(factory, backfill_id) == {
        "discarded": SEGMENTS_PER_PAGE,
        "done": SEGMENTS_PER_PAGE,
    }
    assert len(calls_of(factory, job_id)) == 2 * SEGMENTS_PER_PAGE  # every paid result recorded once


def test_a_swap_given_up_records_its_earlier_results_as_discarded_not_done(factory, rt, sim, monkeypatch):
    """An edited page's third segment came back unusable: the swap was given up and the two results
    before it were marked done, though their facts were never stored."""
    import dataclasses

    from worker.extraction import backfill as backfill_module

    extracted_then_edited(factory, sim, 1)
    real = backfill_module.batch_segment_result
    seen: list[int] = []

    def third_unusable(*args: Any, **kwargs: Any) -> Any:
        result = real(*args, **kwargs)
        seen.append(1)
        if len(seen) == 3:
            last = dataclasses.replace(result.attempts[-1], outcome="malformed_output", facts=[], error="bad")
            return dataclasses.replace(result, attempts=[*result.attempts[:-1], last])
        return result

    monkeypatch.setattr(backfill_module, "batch_segment_result", third_unusable)
    backfill_id, job_id = start(factory, "bf")
    drive(rt, job_id)
    statuses = request_statuses(factory, backfill_id)
    assert statuses.get("done", 0) == 0 and statuses["discarded"] == 2 + (SEGMENTS_PER_PAGE - 3)
    assert statuses["failed"] == 1
    assert not any("Globex" in fact for _, _, fact in facts_of(factory, "bf"))  # the old facts stand
    # Their audit rows say they were held (as "ok, N facts" alone, they looked committed), as an online
    # re-extraction's do; the calls keep no note (on a call that succeeded it read as an error).
    from models import ExtractionAudit, LLMCall
    from worker.extraction.rows import HELD_NOTE

    with factory() as session:
        audit = session.execute(
            select(ExtractionAudit.outcome, ExtractionAudit.error).where(ExtractionAudit.job_id == job_id)
        ).all()
        noted = session.scalar(select(func.count()).where(LLMCall.error == HELD_NOTE))
    assert [row for row in audit if row.outcome == "ok"] == [("ok", HELD_NOTE)] * 2, audit
    assert noted == 0


def test_max_segments_has_one_bound_for_the_api_and_the_cli(factory):
    """The API refused more than 10,000,000 and the CLI took any bigint: one operation, two rules."""
    seed_pages(factory, "bf", 1)
    with pytest.raises(ValueError, match="max_segments must be from 1 to 10,000,000"):
        start(factory, "bf", max_segments=10_000_001)


def test_a_page_left_for_another_run_takes_none_of_max_segments(factory, rt, sim):
    """The plans counted a page re-extracted whole against max_segments before it was left out: the
    first page used the limit up, nothing was planned, and every run with that limit did the same."""
    slugs = seed_pages(factory, "bf", 2)
    llm = OpenAIChatClient(model="simulator-1", base_url=sim.base_url, provider="simulator")
    run_extract_conversation_facts(factory, llm, ExtractOptions(source_id="bf", slug=slugs[0]))
    edited = page_body("Ann Example", "Acme").replace("Acme", "Globex", 1)
    put_page(factory, slugs[0], edited, title="chat", source_id="bf")  # replaced whole: 4 segments
    backfill_id, job_id = start(factory, "bf", max_segments=2)
    assert drive(rt, job_id).status == "succeeded"
    assert request_statuses(factory, backfill_id) == {"done": 2}  # the second page's first two


def test_planning_stops_reading_pages_once_max_segments_is_planned(factory, rt, sim, monkeypatch):
    """Counting what is planned moved the limit after each page's plan: every page after the limit was
    still read and parsed (a mostly extracted corpus read whole on every run)."""
    from worker.extraction.service import ExtractionRun

    seed_pages(factory, "bf", 4)
    planned: list[str] = []
    real_plan = ExtractionRun.plan

    def counted(self: Any, ref: Any, **kw: Any) -> Any:
        planned.append(ref.slug)
        return real_plan(self, ref, **kw)

    monkeypatch.setattr(ExtractionRun, "plan", counted)
    backfill_id, job_id = start(factory, "bf", max_segments=SEGMENTS_PER_PAGE)
    assert drive(rt, job_id).status == "succeeded"  # to the end: no batch is left at the simulator
    assert set(planned) == {"chats/p0000"}  # planned, then read again to send and commit: no other page
    assert request_statuses(factory, backfill_id) == {"done": 4}


def test_an_expired_batch_leaves_its_unrun_requests_to_the_next_run(factory, rt, sim):
    slugs = seed_pages(factory, "bf", 4)
    reference = online_reference(factory, sim, 4)
    sim.configure(batch_expire=True, batch_expire_share=0.5)
    backfill_id, job_id = start(factory, "bf")
    assert drive(rt, job_id).status == "succeeded"
    first = request_statuses(factory, backfill_id)
    assert first == {"done": 8, "expired": 8}  # each batch (two pages) answered its first half only
    assert len(calls_of(factory, job_id)) == 8  # unrun requests are not paid for
    assert terminal_slugs(factory, "bf") == {slugs[0], slugs[2]}  # the first page of each batch

    sim.configure(batch_expire=False)
    second_id, second_job = start(factory, "bf")
    assert drive(rt, second_job).status == "succeeded"
    assert request_statuses(factory, second_id) == {"done": 8}
    assert facts_of(factory, "bf") == reference
    assert terminal_slugs(factory, "bf") == set(slugs)
    assert set(ok_audits_per_segment(factory, "bf").values()) == {1}


def test_a_page_edited_while_its_results_commit_is_logged_by_id_never_by_slug(
    factory, rt, sim, caplog, monkeypatch
):
    """The results are planned, then the page changes before they commit (PageChangedError): the log
    line named the slug through the error's text, and a slug can name a person."""
    caplog.set_level(logging.INFO)
    slugs = seed_pages(factory, "bf", 1)
    sim.configure(batch_delay_seconds=3600)
    _, job_id = start(factory, "bf")
    assert run_pass(rt, job_id).status == "paused"
    planned = BackfillPass.page_plan
    collecting = False

    def plan_then_edit(self: BackfillPass, page_id: int, slug: str) -> Any:
        plan = planned(self, page_id, slug)
        if collecting:  # another writer edits the page after this pass planned it
            edited = page_body("Person0 Example", "Company0").replace("signed the offer letter", "said no")
            put_page(factory, slug, edited, title="chat: Person0 Example", source_id="bf")
        return plan

    monkeypatch.setattr(BackfillPass, "page_plan", plan_then_edit)
    sim.end_batches()
    collecting = True
    assert drive(rt, job_id).status == "succeeded"
    assert slugs[0] not in {slug for slug, _, _ in facts_of(factory, "bf")}
    logged = [r.getMessage() for r in caplog.records]
    assert any("PageChangedError; its results are discarded" in m for m in logged), logged
    assert not any(slugs[0] in m for m in logged)


def test_a_page_edited_during_its_batch_is_recorded_as_discarded(factory, rt, sim):
    slugs = seed_pages(factory, "bf", 2)
    sim.configure(batch_delay_seconds=3600)  # the batch runs until the test lets it end
    backfill_id, job_id = start(factory, "bf")
    outcome = run_pass(rt, job_id)
    assert outcome.status == "paused"
    edited = page_body("Person0 Example", "Company0").replace("signed the offer letter", "turned down")
    put_page(factory, slugs[0], edited, title="chat: Person0 Example", source_id="bf")
    sim.end_batches()
    assert drive(rt, job_id).status == "succeeded"

    assert request_statuses(factory, backfill_id) == {"done": 4, "discarded": 4}
    calls = calls_of(factory, job_id)
    assert len(calls) == 8  # the discarded results were paid for: recorded once
    # An answered call keeps no error: a note there was replaced by "the provider's message went with
    # the erasure", of a call that had none, of a page never erased.
    assert [call.error for call in calls if call.outcome == "ok"] == [None] * 8
    assert terminal_slugs(factory, "bf") == {slugs[1]}
    assert slugs[0] not in {slug for slug, _, _ in facts_of(factory, "bf")}


@pytest.mark.parametrize("moved_on", ["erased", "edited"])
def test_a_page_that_moved_on_during_its_batch_keeps_no_provider_message_on_its_discarded_calls(
    factory, rt, sim, moved_on
):
    """Its results, recorded as discarded, are under the backfill's job with no audit row: no erasure
    finds them (then, or later for a page edited meanwhile), and a malformed reply's excerpt (the
    model's words on the page) stayed."""
    from worker.accounting import ERASED_CALL_ERROR
    from worker.extraction.erase import erase_page

    [slug] = seed_pages(factory, "bf", 1)
    sim.configure(batch_delay_seconds=3600, rate_malformed=1.0)
    backfill_id, job_id = start(factory, "bf")
    assert run_pass(rt, job_id).status == "paused"
    if moved_on == "erased":
        assert erase_page(factory, "bf", slug, "test") is not None
    else:
        edited = page_body("Person0 Example", "Company0").replace("signed the offer letter", "turned down")
        put_page(factory, slug, edited, title="chat: Person0 Example", source_id="bf")
    sim.end_batches()
    assert drive(rt, job_id).status == "succeeded"
    assert request_statuses(factory, backfill_id) == {"discarded": 4}
    calls = calls_of(factory, job_id)
    assert len(calls) == 4 and {call.outcome for call in calls} == {"malformed_output"}  # paid: kept
    assert {call.error for call in calls} == {ERASED_CALL_ERROR}, [call.error for call in calls]


def test_a_page_edited_before_its_batch_is_sent_sends_only_the_segments_before_the_edit(factory, rt, sim):
    """Results commit in order: a request after the edited segment (unchanged itself) was sent, paid
    for, and discarded at collection, though the README says a page changed before sending is dropped."""
    slugs = seed_pages(factory, "bf", 6)  # three batches of two pages (eight requests) each
    with factory.begin() as session:
        set_config(session, "llm.budget_daily_usd", "0.01")  # the first batch goes; the others wait
    sim.configure(batch_delay_seconds=3600)
    backfill_id, job_id = start(factory, "bf")
    assert run_pass(rt, job_id).status == "paused" and sim.stats()["batches"]["created"] == 1
    name, company = person(2)[1:]  # a page of the second batch, its third segment of four edited
    edited = page_body(name, company).replace("moved to Lisbon", "moved to Porto")
    put_page(factory, slugs[2], edited, title=f"chat: {name}", source_id="bf")
    with factory.begin() as session:
        set_config(session, "llm.budget_daily_usd", "100000")
    sim.configure(batch_delay_seconds=0.05)
    sim.end_batches()
    with factory.begin() as session:
        resume_paused(session, [BATCH_EXTRACTION], reason="budget")
    assert drive(rt, job_id).status == "succeeded"
    assert request_statuses(factory, backfill_id) == {"done": 22, "dropped": 2}
    assert len(calls_of(factory, job_id)) == 22, "nothing paid for and thrown away"


@pytest.mark.parametrize("budget", ["llm.budget_daily_usd", "llm.budget_job_usd"])
def test_batches_in_flight_count_against_the_budget_until_collected(factory, rt, sim, budget, monkeypatch):
    """A batch's spend is recorded when it is collected, hours after it was sent: a pass that sent
    three batches checked $0 spent three times and overspent by all of them. Now the batches in
    flight count by their estimates: the next batch waits for them (one may go alone), and is not
    rebuilt to find that out (its pages were read and parsed again on every poll while it waited)."""
    seed_pages(factory, "bf", 6)  # three batches of eight requests
    with factory.begin() as session:
        set_config(session, budget, "0.01")  # less than any batch here
    sim.configure(batch_delay_seconds=3600)
    built: list[int] = []
    rebuild = BackfillPass.requests_to_send

    def counted(self: BackfillPass, batch: Any) -> Any:
        built.append(batch.id)
        return rebuild(self, batch)

    monkeypatch.setattr(BackfillPass, "requests_to_send", counted)
    backfill_id, job_id = start(factory, "bf")
    assert run_pass(rt, job_id).status == "paused"
    assert sim.stats()["batches"]["created"] == 1  # three before
    assert run_pass(rt, job_id).status == "paused"
    assert len(built) == 1, built  # the batch sent; not the one waiting behind it, pass after pass
    with factory() as session:
        estimates = session.scalars(
            select(BackfillBatch.estimated_cost_usd).where(BackfillBatch.backfill_id == backfill_id)
        ).all()
    assert sorted(e is None for e in estimates) == [False, True, True] and max(e or 0 for e in estimates) > 0
    sim.end_batches()
    assert run_pass(rt, job_id).status == "paused"  # the next batch still waits; then the first is collected
    assert request_statuses(factory, backfill_id) == {"done": 8, "pending": 16}
    time.sleep(1.1)  # past the budget's one-second cache of the day's spend
    assert run_pass(rt, job_id).status == "paused"  # its spend is known now, and past the budget
    assert job_row(factory, job_id).pause_reason == "budget" and sim.stats()["batches"]["created"] == 1
    with factory.begin() as session:
        set_config(session, budget, "100000")
    sim.configure(batch_delay_seconds=0.05)
    with factory.begin() as session:
        resume_paused(session, [BATCH_EXTRACTION], reason="budget")
    assert drive(rt, job_id).status == "succeeded"
    assert request_statuses(factory, backfill_id) == {"done": 24} and sim.stats()["batches"]["created"] == 3


def test_a_budget_spent_elsewhere_still_lets_the_batches_sent_be_collected(factory, rt, sim):
    """The day's budget spent by online extraction while a batch ran: the next send raised before the
    pass polled, so the batch sent (paid for, holding the pages' text) was never collected, and a
    cancel woke nothing (the job waited for budget, not for batches)."""
    seed_pages(factory, "bf", 4)  # two batches of eight requests
    with factory.begin() as session:
        set_config(session, "llm.budget_daily_usd", "0.01")  # the second batch waits for the first
    sim.configure(batch_delay_seconds=3600)
    backfill_id, job_id = start(factory, "bf")
    assert run_pass(rt, job_id).status == "paused" and sim.stats()["batches"]["created"] == 1
    with factory.begin() as session:
        set_config(session, "llm.budget_daily_usd", "0")  # spent: no send may go
    sim.end_batches()
    assert run_pass(rt, job_id).status == "paused"
    assert request_statuses(factory, backfill_id) == {"done": 8, "pending": 8}  # the first collected
    assert job_row(factory, job_id).pause_reason == "budget" and sim.stats()["batches"]["created"] == 1
    with factory.begin() as session:
        woken = cancel_backfill(session, backfill_id)
    assert woken == [(job_id, BATCH_EXTRACTION)]
    assert drive(rt, job_id).status == "succeeded"
    assert backfill_report(factory, backfill_id)["status"] == "cancelled"


def test_a_request_s_bytes_stay_under_their_bound_on_both_wires(sim):
    """The planner cuts batches by an upper bound of each request's bytes (50,000 requests of a full
    segment each were 500 MB and more: past both providers' limits, refused on every retry)."""
    openai_chat = OpenAIChatClient(model="simulator-1", base_url=sim.base_url, provider="simulator")
    anthropic_chat = AnthropicChatClient(model="simulator-1", base_url=sim.url, provider="simulator")
    overhead = request_overhead_bytes(10, 1024)
    long_text = 'naïve café 東京 "quoted"\n\x01\x1b' * 400  # past the rendering's cut, escapes and all
    bodies = [page_body("Ann Example", "Acme"), page_body("Zoë Ångström", long_text)]
    # Thirty speakers whose bold "names" run 5,000 characters each: the header (kept whole) held them
    # all, 57 times the bound the batch was cut by.
    bodies.append("\n".join(f"**{'Å' * 5000}\x01{n}** (2024-06-01 9:{n:02d} AM): hi" for n in range(30)))
    for body in bodies:
        for segment in split_into_segments(parse_conversation_messages(body)):
            request = segment_request("chat: someone", segment, 10, 1024)
            lines = [
                {
                    "custom_id": "c" * 64,
                    "method": "POST",
                    "url": "/v1/chat/completions",
                    "body": openai_chat.chat_body(request),
                },
                {"custom_id": "c" * 64, "params": anthropic_chat.message_params(request)},
            ]
            for line in lines:
                bound = overhead + segment_bytes(segment, "chat: someone")
                assert len(json.dumps(line, ensure_ascii=False).encode()) <= bound


def test_a_page_erased_while_the_plan_was_read_keeps_no_request_nor_slug(factory, rt, sim, monkeypatch):
    """Planning reads pages without a lock and can take minutes: a page erased meanwhile had its requests
    stored after the erasure had renamed its slug everywhere, so its slug stayed in them."""
    from worker.extraction.erase import erase_page

    slugs = seed_pages(factory, "bf", 2)
    real_store = BackfillStore.store_plan

    def erased_meanwhile(self: Any, backfill_id: int, batches: Any, **counts: int) -> None:
        erase_page(factory, "bf", slugs[0], "test")
        real_store(self, backfill_id, batches, **counts)

    monkeypatch.setattr(BackfillStore, "store_plan", erased_meanwhile)
    backfill_id, job_id = start(factory, "bf")
    assert drive(rt, job_id).status == "succeeded"
    with factory() as session:
        stored = set(session.scalars(select(BackfillRequest.slug)))
    assert slugs[0] not in stored and slugs[1] in stored
    assert request_statuses(factory, backfill_id) == {"done": 4}


def test_an_erased_page_a_backfill_named_is_taken_out_of_its_filters(factory, rt, sim):
    """A backfill of one page (its slug, or a prefix that is the slug) kept the slug in its filters,
    shown by `factmill backfill show` and GET /v1/backfills after the page was erased."""
    from models import Backfill
    from worker.extraction.erase import erase_page, erased_name

    slugs = seed_pages(factory, "bf", 2)
    put_page(factory, f"{slugs[1]}-old", page_body("Old Example", "Acme"), source_id="bf")
    by_slug, _ = start(factory, "bf", slug=slugs[0])
    by_prefix, _ = start(factory, "bf", slug_prefix=slugs[0])
    folder = slugs[0].rsplit("/", 1)[0] + "/"
    by_folder, _ = start(factory, "bf", slug_prefix=folder)
    wider, _ = start(factory, "bf", slug_prefix=slugs[1])  # slugs[1] and slugs[1]-old
    erase_page(factory, "bf", slugs[0], "test")
    erase_page(factory, "bf", slugs[1], "test")
    with factory() as session:
        filters = {b.id: b.filters for b in session.scalars(select(Backfill))}
    name = erased_name("bf", slugs[0])
    assert filters[by_slug]["slug"] == name and filters[by_prefix]["slug_prefix"] == name
    assert filters[by_folder]["slug_prefix"] == folder  # names more than the page: kept
    assert filters[wider]["slug_prefix"] == slugs[1]  # so does a slug that prefixes another page's
    assert slugs[0] not in json.dumps(filters)
    # ...until the last page under it goes: the prefix, an erased slug itself, is taken out then.
    erase_page(factory, "bf", f"{slugs[1]}-old", "test")
    with factory() as session:
        widened = session.get(Backfill, wider)
        assert widened is not None and widened.filters["slug_prefix"] == erased_name("bf", slugs[1])


def test_batches_are_cut_by_their_bytes_too(factory, rt, sim):
    seed_pages(factory, "bf", 4)  # four requests a page: two pages a batch by count
    segments = split_into_segments(parse_conversation_messages(page_body("Ann Example", "Acme")))
    one_page = sum(
        request_overhead_bytes(10, rt.settings.llm_max_output_tokens) + segment_bytes(s) for s in segments
    )
    rt.settings.backfill_batch_max_bytes = one_page * 3 // 2  # one page's requests a batch
    backfill_id, job_id = start(factory, "bf")
    assert drive(rt, job_id).status == "succeeded"
    assert sim.stats()["batches"]["created"] == 4 and request_statuses(factory, backfill_id) == {"done": 16}


def sends_fail(monkeypatch: pytest.MonkeyPatch, error: LLMError) -> None:
    """Every batch create fails with ``error`` (a provider refusing or failing the upload)."""

    def fail(self: Any, requests: Any, key: str | None = None) -> str:
        raise error

    monkeypatch.setattr(OpenAIBatchClient, "submit", fail)


def test_a_batch_the_provider_refused_is_not_counted_in_flight(factory, rt, sim, monkeypatch):
    """A create refused outright (a 400 or 413) left the batch "submitting" with its estimate, counted
    against every backfill's day budget for good, though the provider held nothing."""
    seed_pages(factory, "bf", 2)
    sends_fail(monkeypatch, LLMError("HTTP 413: the batch file is too large", retryable=False, status=413))
    backfill_id, job_id = start(factory, "bf")
    assert run_pass(rt, job_id).status == "retry"
    with factory() as session:
        batch = session.scalars(select(BackfillBatch).where(BackfillBatch.backfill_id == backfill_id)).one()
    assert (batch.status, batch.estimated_cost_usd) == ("planned", None)
    assert BackfillStore(factory).in_flight_estimate() == 0


def test_a_send_that_failed_after_the_provider_took_it_is_looked_up_not_paid_twice(
    factory, rt, sim, monkeypatch
):
    """An error without an HTTP status (the SDK could not read the create's answer) was taken for a
    refusal: the batch went back to "planned" and the next pass sent a second, paid copy; the first
    was never polled, collected or deleted. Only a 4xx is a refusal; otherwise it is looked up."""
    from worker.extraction import backfill as backfill_module

    seed_pages(factory, "bf", 2)
    sim.configure(batch_delay_seconds=3600)
    monkeypatch.setattr(backfill_module, "RESEND_AFTER_SECONDS", 0.0)
    real_submit = OpenAIBatchClient.submit

    def answer_unread(self: Any, requests: Any, key: str | None = None) -> str:
        real_submit(self, requests, key=key)
        raise LLMError("ValidationError: the reply did not parse", retryable=False)

    monkeypatch.setattr(OpenAIBatchClient, "submit", answer_unread)
    backfill_id, job_id = start(factory, "bf")
    assert run_pass(rt, job_id).status == "retry"
    monkeypatch.setattr(OpenAIBatchClient, "submit", real_submit)
    assert run_pass(rt, job_id).status == "paused"
    assert sim.stats()["batches"]["created"] == 1
    with factory() as session:
        batch = session.scalars(select(BackfillBatch).where(BackfillBatch.backfill_id == backfill_id)).one()
    assert batch.status == "submitted" and batch.provider_batch_id is not None
    sim.end_batches()
    assert drive(rt, job_id).status == "succeeded"


def test_a_copy_another_run_found_and_recorded_is_this_run_s_own(factory, rt, sim, monkeypatch):
    """Another run looked the batch up while this one sent it, found this run's copy and recorded it:
    this run took it for a second copy, cancelled it and owed its delete, though it was the only one."""
    seed_pages(factory, "bf", 2)
    sim.configure(batch_delay_seconds=3600)
    real_submit = OpenAIBatchClient.submit

    def found_by_another_run(self: Any, requests: Any, key: str | None = None) -> str:
        sent = real_submit(self, requests, key=key)
        with factory.begin() as session:
            session.execute(
                update(BackfillBatch)
                .where(BackfillBatch.key == key)
                .values(status="submitted", provider_batch_id=sent)
            )
        return sent

    monkeypatch.setattr(OpenAIBatchClient, "submit", found_by_another_run)
    backfill_id, job_id = start(factory, "bf")
    assert run_pass(rt, job_id).status == "paused"
    with factory() as session:
        assert session.scalars(select(ProviderCopy.batch_id)).all() == [], "nothing to delete: it is the one"
    sim.end_batches()
    assert drive(rt, job_id).status == "succeeded"
    assert request_statuses(factory, backfill_id) == {"done": 8}


@pytest.mark.parametrize("meanwhile", ["cancelled", "recorded, then this send failed"])
def test_a_send_that_ends_after_another_run_moved_its_batch_on(factory, rt, sim, monkeypatch, meanwhile):
    """Cancelled by another run during this run's upload, the batch came back as "submitted" in a
    finished backfill (never polled, its copy never deleted); a send of this run that failed after
    another run recorded its own was reported failed (an attempt spent, the job failed at the last)."""
    seed_pages(factory, "bf", 2)
    sim.configure(batch_delay_seconds=3600)
    real_submit = OpenAIBatchClient.submit
    sent: list[str] = []

    def raced(self: Any, requests: Any, key: str | None = None) -> str:
        copy = real_submit(self, requests, key=key)
        sent.append(copy)
        with factory.begin() as session:
            if meanwhile == "cancelled":
                session.execute(update(BackfillBatch).values(status="cancelled"))
                return copy
            session.execute(update(BackfillBatch).values(status="submitted", provider_batch_id=copy))
        raise LLMError("HTTP 502: bad gateway", retryable=True, status=502)

    monkeypatch.setattr(OpenAIBatchClient, "submit", raced)
    backfill_id, job_id = start(factory, "bf")
    outcome = run_pass(rt, job_id).status
    with factory() as session:
        batch = session.scalars(select(BackfillBatch)).one()
        owed = session.scalars(select(ProviderCopy.batch_id)).all()
    if meanwhile == "cancelled":
        assert (batch.status, batch.provider_batch_id) == ("cancelled", None)
        assert owed == sent, "this run's copy is owed its delete (and cancelled)"
    else:
        assert outcome == "paused" and (batch.status, batch.provider_batch_id) == ("submitted", sent[0])
        sim.end_batches()
        assert drive(rt, job_id).status == "succeeded"
        assert request_statuses(factory, backfill_id) == {"done": 8}


def test_a_retried_backfill_drops_the_pages_another_sent_meanwhile(factory, rt, sim):
    """Its job failed, so another backfill took its pages; retried, it sent them too (paid twice)."""
    seed_pages(factory, "bf", 4)  # two batches of two pages
    with factory.begin() as session:
        set_config(session, "llm.budget_daily_usd", "0.01")  # its second batch waits
    sim.configure(batch_delay_seconds=3600)
    first, first_job = start(factory, "bf")
    assert run_pass(rt, first_job).status == "paused" and sim.stats()["batches"]["created"] == 1
    with factory.begin() as session:
        session.execute(update(Job).where(Job.id == first_job).values(status="failed"))
        set_config(session, "llm.budget_daily_usd", "100000")
    _, second_job = start(factory, "bf")
    assert run_pass(rt, second_job).status == "paused" and sim.stats()["batches"]["created"] == 3
    with factory.begin() as session:  # an operator retries the first
        session.execute(update(Job).where(Job.id == first_job).values(status="queued"))
    assert run_pass(rt, first_job).status == "paused"
    assert sim.stats()["batches"]["created"] == 3, "nothing sent twice"
    assert request_statuses(factory, first) == {"pending": 8, "dropped": 8}
    # Said in its report (dropped when sent, the pages were counted nowhere: a cancel of the other left
    # them unextracted without a word); a pass again counts nothing twice.
    from worker.extraction.backfill_admin import backfill_report

    assert backfill_report(factory, first)["pages_left_to_others"] == 2
    run_pass(rt, first_job)
    assert backfill_report(factory, first)["pages_left_to_others"] == 2
    sim.end_batches()


def test_a_second_copy_sent_by_a_run_whose_lease_lapsed_is_cancelled_and_owed(factory, rt, sim, monkeypatch):
    """Another run recorded the batch's send while this one (its lease lapsed during a long upload) sent
    it too: this run's id overwrote the first, which was never polled nor collected, nor deleted."""
    seed_pages(factory, "bf", 2)
    sim.configure(batch_delay_seconds=3600)
    real_submit = OpenAIBatchClient.submit
    firsts: list[str] = []

    def raced(self: Any, requests: Any, key: str | None = None) -> str:
        first = real_submit(self, requests, key=key)  # the other run's send, recorded by it meanwhile
        firsts.append(first)
        with factory.begin() as session:
            session.execute(
                update(BackfillBatch)
                .where(BackfillBatch.key == key)
                .values(status="submitted", provider_batch_id=first)
            )
        return real_submit(self, requests, key=key)

    monkeypatch.setattr(OpenAIBatchClient, "submit", raced)
    backfill_id, job_id = start(factory, "bf")
    assert run_pass(rt, job_id).status == "paused"
    with factory() as session:
        [kept] = session.scalars(select(BackfillBatch.provider_batch_id)).all()
        owed = session.scalars(select(ProviderCopy.batch_id)).all()
    assert [kept] == firsts and len(owed) == 1 and owed[0] != kept, "the second copy is owed its delete"
    sim.end_batches()
    assert drive(rt, job_id).status == "succeeded"
    assert request_statuses(factory, backfill_id) == {"done": 8}


class SenderKilled(Exception):
    """What the run sees of a worker killed mid-send: nothing (no failed send is recorded)."""


def upload_then_time_out(orphans: list[str], killed: bool = False) -> Any:
    """A batch create that uploads the requests and then times out (the upload's id kept in ``orphans``);
    ``killed``: the sender dies after the upload instead, before any create."""

    def submit(self: Any, requests: Any, key: str | None = None) -> str:
        if killed:
            time.sleep(1.1)  # an upload takes its time: made in a later second than the send's start
        upload = self._sdk.files.create(file=(f"factmill-extraction-{key}.jsonl", b"{}\n"), purpose="batch")
        orphans.append(upload.id)
        if killed:
            raise SenderKilled
        raise LLMError("the create timed out", retryable=True)

    return submit


def test_the_upload_of_a_sender_killed_before_its_create_is_deleted_before_the_batch_is_sent_again(
    factory, rt, sim, monkeypatch
):
    """Only uploads made before the send began were deleted: the killed sender's own upload (the pages'
    text) came after, and stayed at the provider for good, named nowhere."""
    seed_pages(factory, "bf", 2)
    orphans: list[str] = []
    with monkeypatch.context() as patched:
        patched.setattr(OpenAIBatchClient, "submit", upload_then_time_out(orphans, killed=True))
        backfill_id, job_id = start(factory, "bf")
        run_pass(rt, job_id)
    with factory() as session:
        status = select(BackfillBatch.status).where(BackfillBatch.backfill_id == backfill_id)
        assert session.scalar(status) == "submitting"  # no failed send recorded: looked up first
    assert sim.state.store.find_file(orphans[0]) is not None
    sim.configure(batch_delay_seconds=3600)
    assert run_pass(rt, job_id).status == "paused", "looked up, not found: sent again"
    assert sim.state.store.find_file(orphans[0]) is None
    sim.end_batches()
    assert drive(rt, job_id).status == "succeeded"
    assert request_statuses(factory, backfill_id) == {"done": 8}


@pytest.mark.parametrize("delete_fails", [False, True])
def test_an_upload_whose_create_failed_is_deleted_before_the_batch_is_sent_again(
    factory, rt, sim, monkeypatch, delete_fails
):
    """A create that timed out after its upload left the pages' text at the provider, named nowhere
    (only in a log line); the resend uploaded it a second time beside it. A delete that fails does not
    hold the resend back."""
    from worker.extraction import backfill as backfill_module

    seed_pages(factory, "bf", 2)
    orphans: list[str] = []

    with monkeypatch.context() as patched:
        patched.setattr(OpenAIBatchClient, "submit", upload_then_time_out(orphans))
        backfill_id, job_id = start(factory, "bf")
        assert run_pass(rt, job_id).status == "retry"
    assert sim.state.store.find_file(orphans[0]) is not None
    monkeypatch.setattr(backfill_module, "RESEND_AFTER_SECONDS", 0.0)  # the resend is due at once
    # The batch runs until the test lets it end (ended within the pass on a loaded host, it was collected
    # in the same pass: "succeeded", not "paused").
    sim.configure(batch_delete_fails=delete_fails, batch_delay_seconds=3600)
    assert run_pass(rt, job_id).status == "paused", "sent again, waiting for the batch"
    held = sim.state.store.find_file(orphans[0]) is not None
    assert held == delete_fails, "deleted before the batch went again (unless the provider failed it)"
    sim.configure(batch_delete_fails=False)
    sim.end_batches()
    assert drive(rt, job_id).status == "succeeded"
    assert request_statuses(factory, backfill_id) == {"done": 8}


def test_an_upload_whose_create_failed_is_deleted_when_the_backfill_is_cancelled(
    factory, rt, sim, monkeypatch
):
    """Cancelled before its resend, the batch was marked cancelled and the earlier send's upload (the
    pages' text, named nowhere) stayed at the provider for good."""
    seed_pages(factory, "bf", 2)
    orphans: list[str] = []

    monkeypatch.setattr(OpenAIBatchClient, "submit", upload_then_time_out(orphans))
    backfill_id, job_id = start(factory, "bf")
    assert run_pass(rt, job_id).status == "retry"
    assert sim.state.store.find_file(orphans[0]) is not None
    with factory.begin() as session:
        cancel_backfill(session, backfill_id)
    assert drive(rt, job_id).status == "succeeded"
    assert backfill_report(factory, backfill_id)["status"] == "cancelled"
    assert sim.state.store.find_file(orphans[0]) is None


def test_the_batches_of_a_backfill_whose_job_failed_are_not_counted_in_flight(factory, rt, sim, monkeypatch):
    """A send that kept failing (a retryable error) left its batch "submitting" with its estimate; once
    the job failed nothing would collect it, and it held every other backfill under a day budget."""
    seed_pages(factory, "bf", 2)
    sends_fail(monkeypatch, LLMError("HTTP 503: overloaded", retryable=True, status=503))
    _, job_id = start(factory, "bf")
    assert run_pass(rt, job_id).status == "retry"
    assert BackfillStore(factory).in_flight_estimate() > 0, "the provider may hold it: counted"
    with factory.begin() as session:
        session.execute(update(Job).where(Job.id == job_id).values(status="failed"))
    assert BackfillStore(factory).in_flight_estimate() == 0
    with factory.begin() as session:  # a batch the provider got runs and is billed: still counted
        session.execute(update(BackfillBatch).values(status="submitted", provider_batch_id="sim-batch_sent"))
    assert BackfillStore(factory).in_flight_estimate() > 0
    # Past the provider's window it ended and was billed on its day; nothing collects it: counted for
    # good, it held every other backfill under every later day's budget.
    with factory.begin() as session:
        session.execute(update(BackfillBatch).values(submitted_at=func.now() - timedelta(hours=26)))
    assert BackfillStore(factory).in_flight_estimate() == 0
    with factory.begin() as session:  # while a job runs the backfill, it collects it: counted till then
        session.execute(update(Job).where(Job.id == job_id).values(status="queued"))
    assert BackfillStore(factory).in_flight_estimate() > 0


@pytest.mark.parametrize("retryable", [False, True])
def test_a_send_the_provider_refuses_still_lets_the_batches_in_flight_be_collected(
    factory, rt, sim, monkeypatch, retryable
):
    """A refused send ended the pass before its polling: the batches sent were never collected (their
    paid results lost), the job failed after its retries and the backfill stayed running for good."""
    seed_pages(factory, "bf", 4)  # two batches
    real_submit = OpenAIBatchClient.submit
    sends: list[str | None] = []

    def second_refused(self: Any, requests: Any, key: str | None = None) -> str:
        sends.append(key)
        if len(sends) > 1:
            if retryable:  # an outage: left "submitting", looked up by its key before the next send
                raise LLMError("HTTP 503: unavailable", retryable=True, status=503)
            raise LLMError("HTTP 400: too many batches enqueued", retryable=False, status=400)
        return real_submit(self, requests, key=key)

    monkeypatch.setattr(OpenAIBatchClient, "submit", second_refused)
    sim.configure(batch_delay_seconds=3600)  # the first batch runs until the test ends it
    backfill_id, job_id = start(factory, "bf")
    # While a paid batch is out the job waits on it (failed, nothing would poll it again).
    assert run_pass(rt, job_id).status == "paused"
    sim.end_batches()
    assert run_pass(rt, job_id).status == "paused"  # collected; the second waits to be sent again
    assert request_statuses(factory, backfill_id) == {"done": 8, "pending": 8}
    assert len(terminal_slugs(factory, "bf")) == 2  # the first batch's pages are stored
    assert len(sends) == 2  # the failed one is not sent again within RESEND_AFTER_SECONDS
    with factory() as session:
        failed = session.scalars(
            select(BackfillBatch).where(
                BackfillBatch.backfill_id == backfill_id, BackfillBatch.submitted_at.is_(None)
            )
        ).one()
    assert (failed.provider_status or "").startswith("send failed")

    def resend_due() -> None:
        with factory.begin() as session:
            session.execute(
                update(BackfillBatch)
                .where(BackfillBatch.id == failed.id)
                .values(submit_started_at=func.now() - timedelta(seconds=RESEND_AFTER_SECONDS + 1))
            )

    resend_due()
    # Nothing left in flight: a refused send is the job's error (a retry with backoff; a send that
    # keeps failing ends the job once its attempts are spent); an outage is waited out on the job's
    # outage clock, spending no attempt.
    assert run_pass(rt, job_id).status == "retry" and len(sends) == 3
    job = job_row(factory, job_id)
    assert (job.attempts, job.provider_outage_since is not None) == ((0, True) if retryable else (1, False))
    if retryable:  # a pass within the resend's wait goes nowhere: the outage clock runs on
        with factory.begin() as session:
            session.execute(update(Job).where(Job.id == job_id).values(enqueued_at=func.now()))
        assert run_pass(rt, job_id).status == "paused"
        assert job_row(factory, job_id).provider_outage_since == job.provider_outage_since
    monkeypatch.undo()
    resend_due()
    sim.configure(batch_delay_seconds=0.05)
    assert drive(rt, job_id).status == "succeeded"
    assert request_statuses(factory, backfill_id) == {"done": 16}


def test_a_cancel_that_arrives_during_a_pass_sends_no_more_of_it(factory, rt, sim, monkeypatch):
    seed_pages(factory, "bf", 4)  # two batches
    sim.configure(batch_delay_seconds=3600)
    real_submit = OpenAIBatchClient.submit
    backfill_id, job_id = start(factory, "bf")

    def cancelled_meanwhile(self: Any, requests: Any, key: str | None = None) -> str:
        with factory.begin() as session:  # the operator's cancel, while the pass sends
            cancel_backfill(session, backfill_id)
        return real_submit(self, requests, key=key)

    monkeypatch.setattr(OpenAIBatchClient, "submit", cancelled_meanwhile)
    # The first batch went, and was cancelled at the provider in the same pass; the second never went.
    assert run_pass(rt, job_id).status == "succeeded"
    assert sim.stats()["batches"]["created"] == 1
    assert backfill_report(factory, backfill_id)["status"] == "cancelled"
    assert request_statuses(factory, backfill_id) == {"cancelled": 16}


def test_cancelling_a_backfill_whose_job_failed_runs_the_cancel(factory, rt, sim):
    seed_pages(factory, "bf", 2)
    sim.configure(batch_delay_seconds=3600)
    backfill_id, job_id = start(factory, "bf")
    assert run_pass(rt, job_id).status == "paused"
    with factory.begin() as session:  # its retries spent on some provider error
        session.execute(update(Job).where(Job.id == job_id).values(status="failed", pause_reason=None))
    with factory.begin() as session:
        assert cancel_backfill(session, backfill_id) == [(job_id, BATCH_EXTRACTION)]
    assert drive(rt, job_id).status == "succeeded"
    assert backfill_report(factory, backfill_id)["status"] == "cancelled"
    assert request_statuses(factory, backfill_id) == {"cancelled": 8}


def test_a_pass_that_ends_waiting_on_its_batches_starts_the_job_s_budgets_over(factory, rt, sim):
    """A backfill's job lives through hundreds of passes: five errors days apart (a poll refused, a
    worker restarted) added up to a failed job and a backfill left running for good."""
    seed_pages(factory, "bf", 2)
    sim.configure(batch_delay_seconds=3600)
    _, job_id = start(factory, "bf")
    with factory.begin() as session:  # four earlier passes ended in errors
        session.execute(update(Job).where(Job.id == job_id).values(attempts=4, worker_losses=3))
    assert run_pass(rt, job_id).status == "paused"
    job = job_row(factory, job_id)
    assert (job.attempts, job.worker_losses) == (0, 0)
    sim.end_batches()  # collected, so the simulator holds none of its files for the tests after
    assert drive(rt, job_id).status == "succeeded"


def sent_then_switched_off(factory: sessionmaker[Session], rt: Runtime, sim: Simulator) -> tuple[int, int]:
    """A backfill of two pages whose batch was sent (it runs an hour), then extraction switched off."""
    seed_pages(factory, "bf", 2)
    sim.configure(batch_delay_seconds=3600)
    backfill_id, job_id = start(factory, "bf")
    assert run_pass(rt, job_id).status == "paused"  # sent; waiting for the batch
    with factory.begin() as session:
        set_config(session, "facts.extraction_enabled", "false")
    return backfill_id, job_id


def test_the_kill_switch_pauses_collection_and_resumes_it(factory, rt, sim):
    backfill_id, job_id = sent_then_switched_off(factory, rt, sim)
    sim.end_batches()
    assert run_pass(rt, job_id).status == "paused"
    job = job_row(factory, job_id)
    assert job.pause_reason == "kill_switch"
    assert request_statuses(factory, backfill_id) == {"pending": 8}  # nothing committed, nothing cancelled
    assert facts_of(factory, "bf") == []
    with factory.begin() as session:
        set_config(session, "facts.extraction_enabled", "true")
    assert drive(rt, job_id).status == "succeeded"
    assert request_statuses(factory, backfill_id) == {"done": 8}
    assert sim.stats()["batches"]["created"] == 1


def test_a_cancel_while_extraction_is_switched_off_cancels_the_batches_at_the_provider(factory, rt, sim):
    """The cancel woke no job paused by the kill switch (and a woken one paused again before its pass):
    the batches ran on at the provider, paid for, until someone turned extraction back on."""
    backfill_id, job_id = sent_then_switched_off(factory, rt, sim)
    assert run_pass(rt, job_id).status == "paused" and job_row(factory, job_id).pause_reason == "kill_switch"
    with factory.begin() as session:
        assert cancel_backfill(session, backfill_id) == [(job_id, BATCH_EXTRACTION)]
    assert run_pass(rt, job_id).status == "paused"
    job = job_row(factory, job_id)
    assert job.pause_reason == "kill_switch" and "1 batch(es) of backfill" in (job.last_error or "")
    with factory() as session:
        [provider_id] = session.scalars(select(BackfillBatch.provider_batch_id)).all()
    status = httpx.get(f"{sim.base_url}/batches/{provider_id}", headers={"Authorization": "Bearer x"})
    assert status.json()["status"] == "cancelled"  # stopped now, not when the switch is on again
    assert facts_of(factory, "bf") == []  # nothing collected while the switch is off
    with factory.begin() as session:
        set_config(session, "facts.extraction_enabled", "true")
    assert drive(rt, job_id).status == "succeeded"
    assert backfill_report(factory, backfill_id)["status"] == "cancelled"


def test_a_cancel_refused_while_switched_off_pauses_and_is_asked_again_once_it_is_on(factory, rt, sim):
    """The provider refuses the cancel while the switch is off: the job waits for the switch, spends
    no attempt, says so, and the pass asks again once extraction is back on."""
    backfill_id, job_id = sent_then_switched_off(factory, rt, sim)
    sim.configure(batch_cancel_fails=True)
    with factory.begin() as session:
        cancel_backfill(session, backfill_id)
    assert run_pass(rt, job_id).status == "paused"
    job = job_row(factory, job_id)
    assert job.pause_reason == "kill_switch" and job.attempts == 0
    assert "the provider did not cancel 1 now (asked again then)" in (job.last_error or "")
    sim.configure(batch_cancel_fails=False)
    with factory.begin() as session:
        set_config(session, "facts.extraction_enabled", "true")
    assert drive(rt, job_id).status == "succeeded"
    assert backfill_report(factory, backfill_id)["status"] == "cancelled"
    assert facts_of(factory, "bf") == []


def test_cancel_stops_the_running_batch_and_sends_no_more(factory, rt, sim):
    seed_pages(factory, "bf", 4)
    sim.configure(batch_delay_seconds=3600)
    backfill_id, job_id = start(factory, "bf")
    assert run_pass(rt, job_id).status == "paused"
    with factory.begin() as session:
        woken = cancel_backfill(session, backfill_id)
    assert woken == [(job_id, BATCH_EXTRACTION)]  # the waiting job is queued again at once
    assert drive(rt, job_id).status == "succeeded"
    report = backfill_report(factory, backfill_id)
    assert report["status"] == "cancelled"
    assert request_statuses(factory, backfill_id) == {"cancelled": 16}
    assert facts_of(factory, "bf") == []
    assert calls_of(factory, job_id) == []
    with factory.begin() as session:
        assert cancel_backfill(session, backfill_id) is None  # finished: nothing to cancel


def test_a_cancel_the_provider_refuses_ends_neither_the_pass_nor_the_job(factory, rt, sim):
    """A batch that ended between its poll and its cancel (the provider answers 400): the refusal
    escaped the pass, the other batches went unpolled, and the job spent an attempt on each pass."""
    seed_pages(factory, "bf", 4)
    sim.configure(batch_delay_seconds=3600)
    backfill_id, job_id = start(factory, "bf")
    assert run_pass(rt, job_id).status == "paused"  # sent, waiting
    sim.configure(batch_cancel_fails=True)
    with factory.begin() as session:
        cancel_backfill(session, backfill_id)
    assert run_pass(rt, job_id).status == "paused", "refused: it is asked again next pass"
    assert job_row(factory, job_id).attempts == 0
    sim.configure(batch_cancel_fails=False)
    assert drive(rt, job_id).status == "succeeded"
    assert backfill_report(factory, backfill_id)["status"] == "cancelled"


def test_a_status_the_provider_cannot_give_now_ends_neither_a_cancels_pass_nor_its_job(
    factory, rt, sim, monkeypatch
):
    """A 429 asking for a batch's status before cancelling it escaped the pass (polling logged it and
    went on): the other batches went uncancelled and unpolled, and the job spent an attempt."""
    seed_pages(factory, "bf", 4)
    sim.configure(batch_delay_seconds=3600)
    backfill_id, job_id = start(factory, "bf")
    assert run_pass(rt, job_id).status == "paused"
    real_status = OpenAIBatchClient.status

    def busy(self: Any, batch_id: str) -> Any:
        raise LLMError("HTTP 429: slow down", retryable=True, status=429)

    monkeypatch.setattr(OpenAIBatchClient, "status", busy)
    with factory.begin() as session:
        cancel_backfill(session, backfill_id)
    assert run_pass(rt, job_id).status == "paused", "asked again next pass"
    assert job_row(factory, job_id).attempts == 0
    monkeypatch.setattr(OpenAIBatchClient, "status", real_status)
    assert drive(rt, job_id).status == "succeeded"
    assert backfill_report(factory, backfill_id)["status"] == "cancelled"


def ended_with_every_request_committed(
    factory: sessionmaker[Session], rt: Runtime, sim: Simulator
) -> tuple[int, int, str]:
    """A backfill of two pages whose batch ended and whose every request committed (as its pages'
    commits mark them), the batch not yet marked collected: (backfill id, job id, provider batch id)."""
    seed_pages(factory, "bf", 2)
    sim.configure(batch_delay_seconds=3600)
    backfill_id, job_id = start(factory, "bf")
    assert run_pass(rt, job_id).status == "paused"
    sim.end_batches()
    with factory.begin() as session:
        batch = session.scalars(select(BackfillBatch).where(BackfillBatch.backfill_id == backfill_id)).one()
        for request in session.scalars(select(BackfillRequest).where(BackfillRequest.batch_id == batch.id)):
            request.status = "done"
        provider_batch_id = batch.provider_batch_id
    assert provider_batch_id is not None
    return backfill_id, job_id, provider_batch_id


def test_a_pass_that_died_after_deleting_the_providers_copy_finishes_without_it(factory, rt, sim):
    """Every result committed and the provider's copy deleted, then the worker died before marking the
    batch collected: the next pass downloads nothing (there is nothing left) and finishes."""
    backfill_id, job_id, provider_batch_id = ended_with_every_request_committed(factory, rt, sim)
    OpenAIBatchClient(OpenAIChatClient(model="simulator-1", base_url=sim.base_url)).discard(provider_batch_id)
    assert drive(rt, job_id).status == "succeeded"
    assert backfill_report(factory, backfill_id)["status"] == "done"
    assert sim.stats()["batches"]["results_downloads"] == 0


@pytest.fixture
def anthropic_rt(factory: sessionmaker[Session], database_url: str, sim: Simulator) -> Iterator[Runtime]:
    """A runtime whose provider is Anthropic's wire (the simulator speaks it too)."""
    yield from backfill_runtime(
        factory, database_url, llm="anthropic", anthropic_api_key="sk-ant-test", llm_base_url=sim.url
    )


def test_a_batch_sent_to_another_provider_than_the_one_configured_now_is_left_alone(
    factory, rt, anthropic_rt, sim
):
    """Asked of the provider configured after the switch, the batch was "gone" (404): its paid results
    counted expired, the other provider kept the pages' text, and nothing said so."""
    seed_pages(factory, "bf", 2)
    sim.configure(batch_delay_seconds=3600)
    backfill_id, job_id = start(factory, "bf")
    assert run_pass(rt, job_id).status == "paused"  # sent through the OpenAI wire, waiting
    sim.end_batches()
    assert run_pass(anthropic_rt, job_id).status == "paused", "waits for its provider to come back"
    with factory() as session:
        [held] = session.scalars(select(BackfillBatch).where(BackfillBatch.backfill_id == backfill_id))
    assert held.status == "submitted" and (held.provider_status or "").startswith("held at simulator")
    assert request_statuses(factory, backfill_id) == {"pending": 8}
    assert drive(rt, job_id).status == "succeeded"  # configured back: collected as usual
    assert request_statuses(factory, backfill_id) == {"done": 8}


def test_an_anthropic_batch_deleted_before_its_pass_died_is_finished_without_it(factory, anthropic_rt, sim):
    """Anthropic deletes the batch itself on discard: a pass that died between the delete and marking it
    collected met a 404 on every pass after, until the job failed and the backfill stayed running."""
    seed_pages(factory, "bf", 2)
    sim.configure(batch_delay_seconds=3600)
    backfill_id, job_id = start(factory, "bf")
    assert run_pass(anthropic_rt, job_id).status == "paused"
    sim.end_batches()
    with factory.begin() as session:
        batch = session.scalars(select(BackfillBatch).where(BackfillBatch.backfill_id == backfill_id)).one()
        done = session.scalars(select(BackfillRequest).where(BackfillRequest.batch_id == batch.id)).all()
        for request in done:  # every page committed before the pass died
            request.status = "done"
        provider_batch_id = batch.provider_batch_id
    assert provider_batch_id is not None
    chat = AnthropicChatClient(model="simulator-1", base_url=sim.url, provider="simulator")
    AnthropicBatchClient(chat).discard(provider_batch_id)
    assert drive(anthropic_rt, job_id).status == "succeeded"
    report = backfill_report(factory, backfill_id)
    assert report["status"] == "done" and report["requests"]["done"] == 8, report


def sent_batch_the_provider_does_not_know(
    factory: sessionmaker[Session], rt: Runtime, sim: Simulator, sent_days_ago: int = 0
) -> tuple[int, int]:
    """A backfill whose one batch was sent (``sent_days_ago``) under an id the provider answers 404 for.
    The batch really sent is ended and deleted: left running, a later test's end_batches() made its
    result files, and that test's count of the files held was one off."""
    seed_pages(factory, "bf", 2)
    backfill_id, job_id = start(factory, "bf")
    assert run_pass(rt, job_id).status == "paused"
    with factory.begin() as session:
        batch = session.scalars(select(BackfillBatch).where(BackfillBatch.backfill_id == backfill_id)).one()
        sent_as, batch.provider_batch_id = batch.provider_batch_id, f"batch_of_another_project_{backfill_id}"
        batch.submit_started_at = func.now() - timedelta(days=sent_days_ago)
    assert sent_as is not None
    sim.end_batches()
    if rt.settings.llm == "anthropic":
        AnthropicBatchClient(AnthropicChatClient(model="simulator-1", base_url=sim.url)).discard(sent_as)
    else:
        OpenAIBatchClient(OpenAIChatClient(model="simulator-1", base_url=sim.base_url)).discard(sent_as)
    return backfill_id, job_id


def test_a_batch_the_provider_does_not_know_with_requests_pending_waits_until_cancelled(
    factory, anthropic_rt, sim
):
    """A 404 for a batch whose results were never read (a key of another project or workspace of the
    same provider cannot see it) collected it as gone: its requests counted expired, the backfill
    "done", while the batch ran on, billed, its results and the pages' text left there. It waits now,
    saying why, until the key that sent it is back or the backfill is cancelled."""
    sim.configure(batch_delay_seconds=3600)
    backfill_id, job_id = sent_batch_the_provider_does_not_know(factory, anthropic_rt, sim)
    for _ in range(2):
        assert run_pass(anthropic_rt, job_id).status == "paused"
        assert job_row(factory, job_id).pause_reason == "batch"
        report = backfill_report(factory, backfill_id)
        assert report["status"] == "running" and request_statuses(factory, backfill_id) == {"pending": 8}
    with factory() as session:
        said = session.scalar(
            select(BackfillBatch.provider_status).where(BackfillBatch.provider_batch_id.isnot(None))
        )
    assert said is not None and said.startswith("not found at anthropic: configure the key that sent it"), (
        said
    )
    with factory.begin() as session:
        cancel_backfill(session, backfill_id)
    assert drive(anthropic_rt, job_id).status == "succeeded"
    assert backfill_report(factory, backfill_id)["status"] == "cancelled"
    assert request_statuses(factory, backfill_id) == {"cancelled": 8}


def test_a_batch_not_found_past_what_the_provider_keeps_is_collected_as_gone(factory, anthropic_rt, sim):
    """Sent longer ago than Anthropic keeps a batch (29 days; a backfill paused for weeks), a 404 is the
    batch gone for good, not one held under another key: collected, its requests missing (the next
    backfill takes the pages)."""
    sim.configure(batch_delay_seconds=3600)
    backfill_id, job_id = sent_batch_the_provider_does_not_know(factory, anthropic_rt, sim, sent_days_ago=30)
    assert drive(anthropic_rt, job_id).status == "succeeded"
    assert backfill_report(factory, backfill_id)["status"] == "done"
    assert not {"done", "pending"} & set(request_statuses(factory, backfill_id))


def test_an_old_batch_openai_does_not_know_still_waits(factory, database_url, sim):
    """OpenAI keeps a batch object: a 404 there is another project's key however old the batch (taken
    for gone past Anthropic's 29 days, its billed results were abandoned)."""
    sim.configure(batch_delay_seconds=3600)
    openai = {"llm": "openai", "openai_api_key": "sk-test", "llm_base_url": sim.base_url}
    for openai_rt in backfill_runtime(factory, database_url, **openai):  # (once: closed after)
        backfill_id, job_id = sent_batch_the_provider_does_not_know(factory, openai_rt, sim, sent_days_ago=30)
        assert run_pass(openai_rt, job_id).status == "paused"
        assert job_row(factory, job_id).pause_reason == "batch"
        assert backfill_report(factory, backfill_id)["status"] == "running"
        with factory() as session:
            assert session.scalar(select(BackfillBatch.provider)) == "openai"


def test_an_anthropic_batch_cancelled_counts_its_unrun_requests_cancelled(factory, anthropic_rt, sim):
    """Anthropic says "ended" of a cancelled batch: its requests that never ran were counted expired."""
    seed_pages(factory, "bf", 2)
    sim.configure(batch_delay_seconds=3600)
    backfill_id, job_id = start(factory, "bf")
    assert run_pass(anthropic_rt, job_id).status == "paused"
    with factory.begin() as session:
        cancel_backfill(session, backfill_id)
    assert drive(anthropic_rt, job_id).status == "succeeded"
    report = backfill_report(factory, backfill_id)
    assert report["status"] == "cancelled" and report["requests"].get("expired", 0) == 0, report
    assert report["requests"]["cancelled"] == 8


def test_beats_poll_deletes_a_collected_batchs_copy_whose_delete_failed(factory, rt, sim):
    """A backfill's batch is collected while the provider's delete fails: its copy (the pages' text)
    is owed, shown on /metrics, and beat's backfill poll deletes it once due, as the deployment's own
    provider client (FACTMILL_LLM, the simulator here)."""
    seed_pages(factory, "bf", 2)
    held = sim.stats()["batches"]["held"]["files"]  # an earlier test of the module may have left some
    sim.configure(batch_delete_fails=True)
    rt.settings.llm_backoff_base_seconds = 0.01  # the failing delete's retries, quickly
    backfill_id, job_id = start(factory, "bf")
    assert drive(rt, job_id).status == "succeeded"
    assert backfill_report(factory, backfill_id)["status"] == "done"
    with factory() as session:
        assert len(session.scalars(select(ProviderCopy.batch_id)).all()) == 1
    assert sim.stats()["batches"]["held"]["files"] > held
    assert owed_gauge(factory) == 1
    sim.configure(batch_delete_fails=False)
    assert sweep_provider_copies(factory, rt.settings).deleted == 0  # not due yet (RETRY_AFTER)
    with factory.begin() as session:
        session.execute(update(ProviderCopy).values(tried_at=func.now() - RETRY_AFTER))
    assert poll_backfills(factory, rt.settings) == 0  # beat's poll: no backfill waits; the copy is due
    assert sim.stats()["batches"]["held"]["files"] == held
    assert owed_gauge(factory) == 0
    with factory() as session:
        assert session.scalar(select(func.count()).select_from(ProviderCopy)) == 0


def test_a_batch_whose_send_began_is_looked_up_by_its_key_never_sent_blindly(factory, rt, sim):
    """The sender died after the provider accepted the batch and before its id was stored: the next
    pass finds it by its key and sends nothing again."""
    seed_pages(factory, "bf", 2)
    held = sim.stats()["batches"]["held"]["files"]  # an earlier test of the module may have left some
    backfill_id, job_id = start(factory, "bf")
    sim.configure(batch_delay_seconds=3600)
    assert run_pass(rt, job_id).status == "paused"
    with factory.begin() as session:
        batch = session.scalars(select(BackfillBatch).where(BackfillBatch.backfill_id == backfill_id)).one()
        sent_id = batch.provider_batch_id
        batch.status, batch.provider_batch_id = "submitting", None  # as if its id was never stored
    sim.end_batches()
    assert drive(rt, job_id).status == "succeeded"
    with factory() as session:
        batch = session.scalars(select(BackfillBatch).where(BackfillBatch.backfill_id == backfill_id)).one()
    assert batch.provider_batch_id == sent_id
    batches = sim.stats()["batches"]
    assert batches["created"] == 1 and batches["requests"] == 8 and batches["results_downloads"] == 1
    assert batches["held"]["files"] == held  # its input and result files deleted once collected
    assert request_statuses(factory, backfill_id) == {"done": 8}


@pytest.fixture
def recorder(tx_factory: sessionmaker[Session]) -> Recorder:
    return Recorder(tx_factory)


@pytest.fixture
def client(
    database_url: str, tx_factory: sessionmaker[Session], recorder: Recorder, sim: Simulator
) -> Iterator[TestClient]:
    runtime = make_runtime(database_url, tx_factory, simulator_url=sim.base_url)
    with TestClient(create_app(runtime, sender=recorder)) as test_client:
        send_key(test_client, tx_factory)  # a read-scoped key; admin calls pass ADMIN_HEADERS
        yield test_client


def test_a_provider_without_a_batch_api_refuses_the_backfill_up_front(database_url, tx_factory, recorder):
    """With FACTMILL_LLM=openai-compatible a backfill was stored and its job queued, to fail at its
    first run; the API now answers 409 and stores nothing (the CLI exits 2: tests/e2e)."""
    seed_pages(tx_factory, "bf", 1)
    runtime = make_runtime(
        database_url, tx_factory, llm="openai-compatible", llm_base_url="http://127.0.0.1:9/v1"
    )
    with TestClient(create_app(runtime, sender=recorder)) as api:
        refused = api.post("/v1/backfills", json={"source_id": "bf"}, headers=ADMIN_HEADERS)
    assert refused.status_code == 409
    assert "openai-compatible has no batch API" in refused.json()["detail"]
    with tx_factory() as session:
        assert session.scalar(select(func.count()).select_from(Backfill)) == 0
    assert recorder.calls == []


def test_a_simulator_each_worker_starts_for_itself_refuses_the_backfill(database_url, tx_factory, recorder):
    """With FACTMILL_LLM=simulator and no FACTMILL_SIMULATOR_URL each pass of a backfill started a
    simulator of its own and stopped it when the pass ended: the next pass found every batch gone (404)
    and the backfill ended "done" with no fact. The API refuses it up front (409)."""
    seed_pages(tx_factory, "bf", 1)
    runtime = make_runtime(database_url, tx_factory, llm="simulator", simulator_url=None)
    with TestClient(create_app(runtime, sender=recorder)) as api:
        refused = api.post("/v1/backfills", json={"source_id": "bf"}, headers=ADMIN_HEADERS)
    assert refused.status_code == 409 and "FACTMILL_SIMULATOR_URL" in refused.json()["detail"]


def test_a_worker_with_a_simulator_of_its_own_fails_a_backfill_before_sending(database_url, factory):
    """A backfill taken by an API configured otherwise: the worker fails its job saying why."""
    seed_pages(factory, "bf", 1)
    _, job_id = start(factory, "bf")
    for rt in backfill_runtime(factory, database_url, llm="simulator", simulator_url=None):
        assert run_pass(rt, job_id).status == "failed"
    assert "FACTMILL_SIMULATOR_URL" in (job_row(factory, job_id).last_error or "")
    with factory() as session:
        assert session.scalar(select(func.count()).select_from(BackfillBatch)) == 0


def test_the_cli_refuses_a_backfill_the_provider_cannot_batch(database_url, factory):
    seed_pages(factory, "bf", 1)
    env = {"FACTMILL_LLM": "openai-compatible", "FACTMILL_LLM_BASE_URL": "http://127.0.0.1:9/v1"}
    refused = invoke_cli(database_url, "backfill", "--source", "bf", **env)
    assert refused.exit_code == 2 and "openai-compatible has no batch API" in refused.output
    with factory() as session:
        assert session.scalar(select(func.count()).select_from(Backfill)) == 0


def test_the_api_starts_shows_and_cancels_backfills_with_the_admin_scope(client, recorder, tx_factory):
    seed_pages(tx_factory, "bf", 1)
    assert client.post("/v1/backfills", json={"source_id": "bf"}).status_code == 403  # a read key
    refused = client.post("/v1/backfills", json={"since": "yesterday"}, headers=ADMIN_HEADERS)
    assert refused.status_code == 422 and "body.since" in refused.text  # the field is named
    created = client.post(
        "/v1/backfills", json={"source_id": "bf", "slug_prefix": "chats/"}, headers=ADMIN_HEADERS
    )
    assert created.status_code == 202, created.text
    backfill_id, job_id = created.json()["id"], created.json()["job_id"]
    assert recorder.calls == [("tasks.backfill.run_backfill", job_id, "extraction")]  # after the commit
    assert client.get(f"/v1/backfills/{backfill_id}").status_code == 403
    shown = client.get(f"/v1/backfills/{backfill_id}", headers=ADMIN_HEADERS).json()
    assert shown["status"] == "planning" and shown["job_status"] == "queued"
    assert shown["filters"]["slug_prefix"] == "chats/" and shown["requests"]["total"] == 0
    assert client.get("/v1/backfills/999999", headers=ADMIN_HEADERS).status_code == 404
    cancelled = client.post(f"/v1/backfills/{backfill_id}/cancel", headers=ADMIN_HEADERS)
    assert cancelled.status_code == 202 and cancelled.json()["cancel_requested"] is True
    text = client.get("/metrics", headers=ADMIN_HEADERS).text
    assert 'factmill_backfills{status="planning"} 1.0' in text
    assert 'factmill_backfill_requests{status="pending"} 0.0' in text


def test_backfills_are_listed_newest_first_with_their_job_to_the_admin_scope(client, tx_factory):
    """There was no way to find a backfill but by the id its start printed."""
    seed_pages(tx_factory, "bf", 1)
    seed_pages(tx_factory, "bf2", 1)
    bodies = [{"source_id": "bf"}, {"source_id": "bf2", "slug_prefix": "chats/"}, {"source_id": "bf"}]
    ids = [client.post("/v1/backfills", json=b, headers=ADMIN_HEADERS).json()["id"] for b in bodies]
    assert client.get("/v1/backfills").status_code == 403  # a read key
    listed = client.get("/v1/backfills", headers=ADMIN_HEADERS).json()["backfills"]
    assert [b["id"] for b in listed] == ids[::-1]
    middle = listed[1]
    assert (middle["source_id"], middle["filters"]["slug_prefix"], middle["status"]) == (
        "bf2",
        "chats/",
        "planning",
    )
    assert middle["job_status"] == "queued" and middle["created_by"] == "FACTMILL_ADMIN_TOKEN"
    assert "requests" not in middle  # a list shows no progress: `GET /v1/backfills/{id}` does
    page = client.get("/v1/backfills", params={"limit": 1, "before_id": ids[2]}, headers=ADMIN_HEADERS)
    assert [b["id"] for b in page.json()["backfills"]] == [ids[1]]
    done = client.get("/v1/backfills", params={"status": "done"}, headers=ADMIN_HEADERS)
    assert done.json() == {"backfills": []}
    bad = client.get("/v1/backfills", params={"status": "finished"}, headers=ADMIN_HEADERS)
    assert bad.status_code == 422 and "status" in bad.text


def test_the_backfill_statuses_the_api_names_are_the_tables(client):
    assert typing.get_args(BackfillStatus) == BACKFILL_STATUSES


def test_factmill_backfill_list(factory, database_url):
    """The CLI lists them too (it reads through its own engine: rows committed)."""
    seed_pages(factory, "bf", 1)
    with factory.begin() as session:
        backfill_id, job_id = request_backfill(
            session, BackfillSelection("bf", None, "chats/", 5), created_by="cli"
        )
    listed = invoke_cli(database_url, "backfill", "list", "--json")
    assert listed.exit_code == 0, listed.output
    [row] = json.loads(listed.output)
    assert (row["id"], row["job_id"], row["job_status"], row["created_by"]) == (
        backfill_id,
        job_id,
        "queued",
        "cli",
    )
    table = invoke_cli(database_url, "backfill", "list")
    assert table.exit_code == 0 and "┃ id ┃ source" in table.output and "planning" in table.output
    assert "slug_prefi" in table.output and "force" not in table.output  # no flag not given
    refused = invoke_cli(database_url, "backfill", "list", "--status", "finished")
    assert (
        refused.exit_code == 2
        and "--status must be one of planning, running, done, cancelled" in refused.output
    )


def test_a_backfill_that_matches_no_stored_page_is_refused_and_stores_nothing(client, recorder, tx_factory):
    """A source or prefix typed wrong used to be accepted and plan nothing: a job that succeeded
    having done nothing, and no word of why."""
    seed_pages(tx_factory, "bf", 1)  # chats/p0000
    with tx_factory.begin() as session:
        store_page(session, PageIn(source_id="bf-notes", slug="notes/a", type="note", compiled_truth="x"))
    for body, said in [
        ({"source_id": "bf-typo"}, "in source 'bf-typo': nothing to backfill"),
        ({"source_id": "bf", "slug_prefix": "chat/"}, "in source 'bf' whose slug starts with 'chat/'"),
        ({"source_id": "bf", "slug_prefix": "chats%"}, "whose slug starts with 'chats%'"),  # % is no wildcard
        # Pages extraction never reads (the planner lists none): accepted, it ended "done" with nothing.
        ({"source_id": "bf-notes"}, "no page of a type extraction reads (conversation"),
    ]:
        refused = client.post("/v1/backfills", json=body, headers=ADMIN_HEADERS)
        assert refused.status_code == 404 and said in refused.json()["detail"], refused.text
    with tx_factory() as session:
        assert session.scalar(select(func.count()).select_from(Backfill)) == 0
        assert session.scalar(select(func.count()).select_from(Job).where(Job.kind == BATCH_EXTRACTION)) == 0
    assert recorder.calls == []
    assert client.post("/v1/backfills", json={"source_id": "bf"}, headers=ADMIN_HEADERS).status_code == 202


def test_a_slug_or_prefix_typed_in_nfd_finds_the_nfc_slugs(client, tx_factory):
    """Stored slugs are NFC; a prefix typed on a Mac (NFD) matched nothing: the listing was empty and a
    backfill was refused as matching no page."""
    put_page(tx_factory, "café/chat-1", page_body("Ana Example", "Acme"), source_id="bf")
    nfd = "cafe\u0301/"
    listed = client.get("/v1/pages", params={"slug_prefix": nfd}, headers=ADMIN_HEADERS).json()["pages"]
    assert [p["slug"] for p in listed] == ["café/chat-1"]
    body = {"source_id": "bf", "slug_prefix": nfd}
    assert client.post("/v1/backfills", json=body, headers=ADMIN_HEADERS).status_code == 202
    facts = client.get(f"/v1/pages/bf/{nfd}chat-1/facts", headers=ADMIN_HEADERS)  # so is a page's slug
    assert facts.status_code == 200 and facts.json()["slug"] == "café/chat-1"
    # A prefix is held to the cap of a slug as sent, not as stored: 300 syllables decomposed are 600.
    import unicodedata

    long_slug = "가" * 300
    put_page(tx_factory, long_slug, page_body("Ana Example", "Acme"), source_id="bf")
    decomposed = unicodedata.normalize("NFD", long_slug)
    listed = client.get("/v1/pages", params={"slug_prefix": decomposed}, headers=ADMIN_HEADERS)
    assert [p["slug"] for p in listed.json()["pages"]] == [long_slug], listed.text
    body = {"source_id": "bf", "slug_prefix": decomposed}
    assert client.post("/v1/backfills", json=body, headers=ADMIN_HEADERS).status_code == 202


@pytest.mark.parametrize("wire", ["openai", "anthropic"])
def test_a_batch_is_found_at_the_provider_by_its_key(sim, wire):
    """``find`` is how a send whose answer was lost is recovered; it must never mistake another batch."""

    client: Any
    if wire == "openai":
        client = OpenAIBatchClient(
            OpenAIChatClient(model="simulator-1", base_url=sim.base_url, provider="simulator")
        )
    else:
        client = AnthropicBatchClient(
            AnthropicChatClient(model="simulator-1", base_url=sim.url, provider="simulator")
        )

    segment = split_into_segments(parse_conversation_messages(page_body("Ann Example", "Acme")))[0]
    request = segment_request("chat: Ann", segment, 5, 256)
    sim.configure(batch_delay_seconds=3600)
    other = client.submit([("fmotherb1n0-p1-m2", request)], key="fmotherb1n0")
    mine = client.submit([("fmmineb1n0-p1-m2", request), ("fmmineb1n0-p1-m4", request)], key="fmmineb1n0")
    assert other != mine
    if wire == "openai":  # its metadata carries the key
        assert client.find("fmmineb1n0") == mine
    else:  # Message Batches keep no metadata: while a batch runs, any of them may be it
        assert client.find("fmmineb1n0") is UNDETERMINED
        # ...unless it was created well before the send began: any batch running in the workspace
        # kept every lookup undecided (and each read the first result of every ended batch).
        later = datetime.now(UTC) + FIND_MARGIN + timedelta(minutes=1)
        assert client.find("fmmineb1n0", later) is None
        # ...or well after it (this backfill's later sends, other tools' batches): the send that died
        # before its create reached the provider was undecided until every one of them ended.
        earlier = datetime.now(UTC) - FIND_MARGIN - timedelta(minutes=1)
        assert client.find("fmmineb1n0", earlier) is None
    sim.end_batches()
    assert client.find("fmmineb1n0") == mine
    assert client.find("fmotherb1n0") == other
    assert client.find("fmneverb1n0") is None
    if wire == "anthropic":
        # A newer ended batch whose results cannot be read (past Anthropic's 29 days, or another
        # tool's) failed every lookup, and with it every pass and cancel of the backfill.
        gone = client.submit([("fmgoneb1n0-p1-m2", request)], key="fmgoneb1n0")
        sim.end_batches()
        sim.configure(batch_results_gone=[gone])
        assert client.find("fmmineb1n0") == mine
        assert client.find("fmgoneb1n0") is None


def test_a_batch_gone_with_nothing_pending_is_not_reported_as_a_refused_cancel(factory, anthropic_rt, sim):
    """Cancelled while extraction is switched off, a batch the provider holds no more (deleted by a pass
    that died before marking it collected) was collected at once, and counted as a cancel refused."""
    backfill_id, job_id, provider_batch_id = ended_with_every_request_committed(factory, anthropic_rt, sim)
    with factory.begin() as session:
        set_config(session, "facts.extraction_enabled", "false")
    chat = AnthropicChatClient(model="simulator-1", base_url=sim.url, provider="simulator")
    AnthropicBatchClient(chat).discard(provider_batch_id)
    with factory.begin() as session:
        cancel_backfill(session, backfill_id)
    assert run_pass(anthropic_rt, job_id).status == "paused"
    note = job_row(factory, job_id).last_error or ""
    assert "1 gone at the provider" in note and "did not cancel" not in note, note


def test_a_plan_holds_its_pages_in_the_order_a_delivery_locks_them_whatever_the_collation(
    session: Session, collation_unlike_c: str
) -> None:
    """A delivery locks its pages in Python's order of (source_id, slug); the plan held them in the
    database's collation, en_US on the official Postgres images, where "Bob" sorts after "alice" (and
    Python's before it): each held one of two pages and waited on the other. Here the column is given
    that collation (in the test's transaction, rolled back)."""
    from worker.extraction.backfill_store import HOLD_PAGES
    from worker.extraction.pages import PageIn, upsert_page

    session.execute(text(f'ALTER TABLE pages ALTER COLUMN slug TYPE text COLLATE "{collation_unlike_c}"'))
    slugs = ["alice", "Bob", "ab", "a-c", "Zed", "zed"]
    ids = {upsert_page(session, PageIn(slug=slug, type="note")).page_id: slug for slug in slugs}
    held = [ids[page_id] for page_id in session.scalars(HOLD_PAGES, {"ids": list(ids)})]
    assert held == sorted(slugs), held


def test_the_kill_switch_stops_a_pass_sending_its_batches(factory, rt, sim, monkeypatch):
    """The switch was read before a pass and before each page it collected, never before a send: turned
    off while a pass sent a large selection (uploads of up to 95 MB, one after another), every batch
    left was still sent, run and billed, and the pages' text went to the provider."""
    seed_pages(factory, "bf", 6)  # three batches of two pages
    sim.configure(batch_delay_seconds=3600)
    _, job_id = start(factory, "bf")
    real_submit = OpenAIBatchClient.submit

    def switched_off_after(self: Any, *args: Any, **kwargs: Any) -> Any:
        sent = real_submit(self, *args, **kwargs)
        with factory.begin() as session:  # the operator, as the first batch goes
            set_config(session, "facts.extraction_enabled", "false")
        return sent

    monkeypatch.setattr(OpenAIBatchClient, "submit", switched_off_after)
    assert run_pass(rt, job_id).status == "paused"
    assert job_row(factory, job_id).pause_reason == "kill_switch"
    assert sim.stats()["batches"]["created"] == 1, "batches were sent after the switch went off"
    with factory() as session:
        statuses = sorted(session.scalars(select(BackfillBatch.status)).all())
    assert statuses.count("planned") == 2, statuses  # sent once the switch is on again


@pytest.mark.parametrize("fault", ["no batch API", "key refused", "download times out"])
def test_a_fault_that_would_end_the_job_waits_while_batches_are_at_the_provider(
    factory, database_url, rt, sim, monkeypatch, fault
):
    """A worker switched to a provider with no batch API (online extraction moved to vLLM), or a key
    rotated under a backfill: the job failed (at once, or after its five attempts), and with it nothing
    polled its batches again: their paid results were never collected, their copies of the pages never
    deleted nor owed, and their estimate counted in flight for good. It waits on them now, saying why."""
    seed_pages(factory, "bf", 2)
    sim.configure(batch_delay_seconds=3600)  # the batch runs until the test ends it
    backfill_id, job_id = start(factory, "bf")
    assert run_pass(rt, job_id).status == "paused"
    if fault == "no batch API":
        elsewhere = Settings(database_url=database_url, llm="openai-compatible", llm_base_url=sim.base_url)
        faulty = Runtime(settings=elsewhere, factory=factory, config=ConfigReader(factory, ttl=0))
    elif fault == "key refused":
        faulty = rt

        def refused(self: Any, batch_id: str) -> Any:
            raise LLMError("HTTP 401: invalid api key", retryable=False, status=401, deployment_fault=True)

        monkeypatch.setattr(OpenAIBatchClient, "status", refused)
    else:  # the batch ended, and fetching its results times out every time (retryable, no status)
        faulty = rt
        sim.end_batches()

        def timed_out(self: Any, batch_id: str, requests: Any) -> Any:
            raise LLMError("the provider timed out", retryable=True)

        monkeypatch.setattr(OpenAIBatchClient, "results", timed_out)
    try:
        for _ in range(6):  # past the five attempts a job has
            assert run_pass(faulty, job_id).status == "paused"
    finally:
        if faulty is not rt:
            faulty.close()
    job = job_row(factory, job_id)
    # Told apart from a normal wait (an alert watches it), and woken by beat's poll all the same.
    assert (job.status, job.pause_reason, job.attempts) == ("paused", "batch_fault", 0)
    with factory.begin() as session:
        assert (job_id, BATCH_EXTRACTION) in resume_waiting(session)
    expected = {"no batch API": "no batch API", "key refused": "invalid api key"}.get(fault, "timed out")
    assert "1 batch(es) of backfill" in (job.last_error or "") and expected in (job.last_error or ""), (
        job.last_error
    )
    # Mended: the next pass collects what the provider held.
    monkeypatch.undo()
    sim.end_batches()
    assert drive(rt, job_id).status == "succeeded"
    assert request_statuses(factory, backfill_id) == {"done": 8}


def test_a_batch_failed_over_the_queued_token_limit_is_sent_again_one_at_a_time(factory, rt, sim):
    """OpenAI takes the create, then fails the whole batch when the organisation's queued tokens would
    pass its limit (none of its requests run): collected as failed, its requests were counted expired
    and the backfill ended "done" with those pages never extracted."""
    seed_pages(factory, "bf", 4)  # two batches
    sim.configure(batch_fail="token_limit_exceeded")
    backfill_id, job_id = start(factory, "bf")
    assert run_pass(rt, job_id).status == "paused"  # both sent
    time.sleep(0.2)  # both end, failed
    assert run_pass(rt, job_id).status == "paused"  # both planned again, each waiting out its resend

    def batches() -> list[tuple[str, str]]:
        with factory() as session:
            rows = session.scalars(
                select(BackfillBatch)
                .where(BackfillBatch.backfill_id == backfill_id)
                .order_by(BackfillBatch.id)
            ).all()
        return [(row.status, row.provider_status or "") for row in rows]

    assert [status for status, _ in batches()] == ["planned", "planned"]
    assert all("queued-token limit" in said and "token_limit_exceeded" in said for _, said in batches())
    assert request_statuses(factory, backfill_id) == {"pending": 16}
    assert BackfillStore(factory).in_flight_estimate() == 0
    sim.configure(batch_fail=None, batch_delay_seconds=3600)
    with factory.begin() as session:  # their resend is due
        session.execute(
            update(BackfillBatch).values(
                submit_started_at=func.now() - timedelta(seconds=RESEND_AFTER_SECONDS + 1)
            )
        )
    assert run_pass(rt, job_id).status == "paused"
    assert [status for status, _ in batches()] == ["submitted", "planned"], "one at a time while limited"
    sim.end_batches()
    sim.configure(batch_delay_seconds=0.05)
    assert drive(rt, job_id).status == "succeeded"
    assert request_statuses(factory, backfill_id) == {"done": 16}


def resend_due(factory: sessionmaker[Session]) -> None:
    """Every batch whose send failed may be sent again now (RESEND_AFTER_SECONDS passed)."""
    with factory.begin() as session:
        session.execute(
            update(BackfillBatch).values(
                submit_started_at=func.now() - timedelta(seconds=RESEND_AFTER_SECONDS + 1)
            )
        )


def test_a_batch_over_the_queued_token_limit_by_itself_is_collected_as_failed_after_its_tries(
    factory, rt, sim, caplog
):
    """Sent again every ten minutes for good, each time uploading the pages' text, with nothing saying
    why: after MAX_LIMIT_FAILURES it is collected as failed (its requests expired), saying what to do."""
    from worker.extraction.backfill_limits import MAX_LIMIT_FAILURES

    seed_pages(factory, "bf", 1)  # one batch
    sim.configure(batch_fail="token_limit_exceeded")
    backfill_id, job_id = start(factory, "bf")
    sends = 0
    for _ in range(MAX_LIMIT_FAILURES):
        assert run_pass(rt, job_id).status == "paused"  # sent (again)
        sends += 1
        time.sleep(0.2)  # it ends, failed
        outcome = run_pass(rt, job_id)
        resend_due(factory)
    assert sends == MAX_LIMIT_FAILURES and outcome.status == "succeeded"
    assert request_statuses(factory, backfill_id) == {"expired": 4}
    with factory() as session:
        batch = session.scalars(select(BackfillBatch).where(BackfillBatch.backfill_id == backfill_id)).one()
    assert (batch.status, batch.limit_failures) == ("collected", MAX_LIMIT_FAILURES - 1)
    assert "over the provider's queued-token limit by itself" in caplog.text


def test_a_worker_killed_before_a_limited_batchs_delete_leaves_that_copy_owed(factory, rt, sim, monkeypatch):
    """A batch failed over the queued-token limit is planned again (its provider id cleared), then its
    copy deleted: a worker killed in between left that copy's files (the pages' text) at the provider,
    named nowhere (the resend's upload cleanup looks for the next copy's name). It is owed first now,
    and beat's poll deletes it."""
    seed_pages(factory, "bf", 1)  # one batch
    sim.configure(batch_fail="token_limit_exceeded")
    _, job_id = start(factory, "bf")
    assert run_pass(rt, job_id).status == "paused"
    with factory() as session:
        failed_copy = session.scalar(select(BackfillBatch.provider_batch_id))
    assert failed_copy is not None
    time.sleep(0.2)  # it ends, failed

    def killed(*args: Any) -> bool:
        raise SystemExit("killed")

    monkeypatch.setattr(backfill_limits, "discard_batch", killed)
    with pytest.raises(SystemExit):
        run_pass(rt, job_id)
    monkeypatch.undo()
    with factory() as session:
        assert session.scalar(select(BackfillBatch.provider_batch_id)) is None  # planned again
        owed = session.scalars(select(ProviderCopy.batch_id)).all()
    assert owed == [failed_copy]
    with factory.begin() as session:
        session.execute(update(ProviderCopy).values(tried_at=func.now() - RETRY_AFTER))
    assert sweep_provider_copies(factory, rt.settings).deleted == 1


def test_a_resend_whose_create_was_lost_is_not_taken_for_the_copy_that_failed_over_the_limit(
    factory, rt, sim, monkeypatch
):
    """OpenAI keeps the failed copy listed under the key it was sent with: looked up by that key, a
    resend whose create's answer was lost was taken for it, counted as failing over the limit again,
    and on its last try its pages were given up (requests expired) without being sent."""
    seed_pages(factory, "bf", 1)  # one batch
    sim.configure(batch_fail="token_limit_exceeded")
    backfill_id, job_id = start(factory, "bf")
    assert run_pass(rt, job_id).status == "paused"  # sent
    time.sleep(0.2)  # it ends, failed
    assert run_pass(rt, job_id).status == "paused"  # planned again
    sim.configure(batch_fail=None, batch_delay_seconds=0.05)
    resend_due(factory)

    def lost(self: Any, requests: Any, key: str | None = None) -> str:
        raise LLMError("the provider timed out", retryable=True)  # the create's outcome unknown

    monkeypatch.setattr(OpenAIBatchClient, "submit", lost)
    run_pass(rt, job_id)  # left "submitting": looked up by its key before any resend
    monkeypatch.undo()
    resend_due(factory)
    run_pass(rt, job_id)
    with factory() as session:
        batch = session.scalars(select(BackfillBatch).where(BackfillBatch.backfill_id == backfill_id)).one()
    assert batch.limit_failures == 1 and batch.status in ("submitted", "collected"), batch.provider_status
    assert drive(rt, job_id).status == "succeeded"
    assert request_statuses(factory, backfill_id) == {"done": 4}


def test_results_the_provider_keeps_no_more_leave_their_requests_missing(factory, rt, sim, monkeypatch):
    """A 404 on the results (Anthropic's after 29 days, an OpenAI output file expired or deleted): the
    job waited on the batch for good, and a cancel could not end it (it collects first)."""
    seed_pages(factory, "bf", 2)
    sim.configure(batch_delay_seconds=3600)
    backfill_id, job_id = start(factory, "bf")
    assert run_pass(rt, job_id).status == "paused"
    sim.end_batches()

    def gone(self: Any, batch_id: str, requests: Any) -> Any:
        raise LLMError("HTTP 404: No such File object", retryable=False, status=404)

    monkeypatch.setattr(OpenAIBatchClient, "results", gone)
    assert run_pass(rt, job_id).status == "succeeded"
    assert request_statuses(factory, backfill_id) == {"expired": 8}


def test_a_batch_resent_after_the_queued_token_limit_goes_alone(factory, rt, sim, monkeypatch):
    """Once resent, a limited batch lost its mark, and a batch that had waited for budget went out beside
    it: over the limit again, the first was given up as 'over the limit by itself' though it fit alone."""
    seed_pages(factory, "bf", 4)  # two batches
    real_within = backfill_limits.within_budget
    backfill_id, job_id = start(factory, "bf")
    sim.configure(batch_fail="token_limit_exceeded")

    def first_only(run: BackfillPass, batch: Any, estimate: Any) -> bool:
        return bool(batch.id == min_id(factory, backfill_id))

    monkeypatch.setattr(backfill_limits, "within_budget", first_only)
    assert run_pass(rt, job_id).status == "paused"  # the first sent; the second waits (budget)
    time.sleep(0.2)
    assert run_pass(rt, job_id).status == "paused"  # the first failed over the limit: planned again
    monkeypatch.setattr(backfill_limits, "within_budget", real_within)
    sim.configure(batch_fail=None, batch_delay_seconds=3600)
    resend_due(factory)
    assert run_pass(rt, job_id).status == "paused"
    with factory() as session:
        statuses = list(
            session.scalars(
                select(BackfillBatch.status)
                .where(BackfillBatch.backfill_id == backfill_id)
                .order_by(BackfillBatch.id)
            )
        )
    assert statuses == ["submitted", "planned"], "the resent batch goes alone"
    sim.end_batches()
    sim.configure(batch_delay_seconds=0.05)
    assert drive(rt, job_id).status == "succeeded"
    assert request_statuses(factory, backfill_id) == {"done": 16}


def min_id(factory: sessionmaker[Session], backfill_id: int) -> int:
    with factory() as session:
        return int(
            session.scalar(select(func.min(BackfillBatch.id)).where(BackfillBatch.backfill_id == backfill_id))
        )


def test_a_batch_resent_after_the_queued_token_limit_waits_for_other_backfills_too(factory, rt, sim):
    """The limit is the organisation's: another backfill's batch sent beside the resend failed it again,
    and it was given up as over the limit by itself though it fit alone."""
    seed_pages(factory, "a", 2)
    seed_pages(factory, "b", 2)
    sim.configure(batch_fail="token_limit_exceeded")
    first, first_job = start(factory, "a")
    assert run_pass(rt, first_job).status == "paused"
    time.sleep(0.2)
    assert run_pass(rt, first_job).status == "paused"  # failed over the limit: planned again
    sim.configure(batch_fail=None, batch_delay_seconds=3600)
    second, second_job = start(factory, "b")
    assert run_pass(rt, second_job).status == "paused"  # nothing limited is out: it goes
    resend_due(factory)
    assert run_pass(rt, first_job).status == "paused"
    with factory() as session:
        statuses = dict(session.execute(select(BackfillBatch.backfill_id, BackfillBatch.status)).all())
    assert statuses == {first: "planned", second: "submitted"}, "it waits for the other backfill's batch"
    sim.end_batches()
    sim.configure(batch_delay_seconds=0.05)
    assert drive(rt, second_job).status == "succeeded"
    assert drive(rt, first_job).status == "succeeded"
    assert request_statuses(factory, first) == {"done": 8}


def test_a_pass_that_sent_a_batch_while_another_s_send_failed_empties_the_outage_clock(
    factory, rt, sim, monkeypatch
):
    """Troubled (a send failed) is not "went nowhere": a pass that sent or collected batches beside it
    left the clock from an earlier outage running, and the job later failed as "served nothing for 24 h"."""
    seed_pages(factory, "bf", 4)  # two batches
    real_submit = OpenAIBatchClient.submit
    sends: list[str | None] = []

    def second_unavailable(self: Any, requests: Any, key: str | None = None) -> str:
        sends.append(key)
        if len(sends) > 1:
            raise LLMError("HTTP 503: unavailable", retryable=True, status=503)
        return real_submit(self, requests, key=key)

    monkeypatch.setattr(OpenAIBatchClient, "submit", second_unavailable)
    sim.configure(batch_delay_seconds=3600)
    _, job_id = start(factory, "bf")
    with factory.begin() as session:  # an earlier outage's clock
        session.execute(update(Job).where(Job.id == job_id).values(provider_outage_since=func.now()))
    assert run_pass(rt, job_id).status == "paused" and len(sends) == 2  # one sent, one failed
    assert job_row(factory, job_id).provider_outage_since is None


def test_a_limited_resend_waits_on_another_backfill_s_batch_only_within_the_provider_s_window(
    factory, rt, sim
):
    """Another backfill's batch counts while the provider may still hold its queued tokens; one whose
    job failed (nothing polls it) or cannot reach its batches counted for good, and every backfill's
    sends at the provider waited on it."""
    seed_pages(factory, "c", 2)
    seed_pages(factory, "a", 2)
    sim.configure(batch_delay_seconds=3600)
    dead, dead_job = start(factory, "c")
    assert run_pass(rt, dead_job).status == "paused"  # its batch is at the provider
    with factory.begin() as session:
        session.execute(update(Job).where(Job.id == dead_job).values(status="failed"))
    sim.configure(batch_fail="token_limit_exceeded", batch_delay_seconds=0.05)
    live, live_job = start(factory, "a")
    assert run_pass(rt, live_job).status == "paused"
    time.sleep(0.2)
    assert run_pass(rt, live_job).status == "paused"  # failed over the limit: planned again
    sim.configure(batch_fail=None, batch_delay_seconds=3600)

    def statuses() -> dict[int, str]:
        with factory() as session:
            return dict(session.execute(select(BackfillBatch.backfill_id, BackfillBatch.status)).all())

    resend_due(factory)
    assert run_pass(rt, live_job).status == "paused"
    assert statuses() == {dead: "submitted", live: "planned"}, "within its window the other batch counts"
    with factory.begin() as session:  # a day and more later: the provider has ended it
        session.execute(
            update(BackfillBatch)
            .where(BackfillBatch.backfill_id == dead)
            .values(submitted_at=func.now() - timedelta(hours=26))
        )
    resend_due(factory)
    assert run_pass(rt, live_job).status == "paused"
    assert statuses() == {dead: "submitted", live: "submitted"}, "the resend went"
