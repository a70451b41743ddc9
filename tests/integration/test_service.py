"""The job queue end to end: real Celery worker processes, real Redis, real Postgres, the simulator."""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from sqlalchemy import func, select
from sqlalchemy.orm import Session, sessionmaker

from models import Fact, Job, LLMCall
from tests.conftest import fresh_database
from tests.service import (
    ServiceProcess,
    celery_sender,
    free_port,
    running,
    service_env,
    start_beat,
    start_worker,
    wait_for,
)
from worker import db
from worker.config_store import set_config
from worker.extraction import PER_SEGMENT_SOURCE_PREFIX, ExtractOptions, run_extract_conversation_facts
from worker.extraction.pages import PageIn, upsert_page
from worker.jobs.outbox import EXTRACTION, apply_switch_change, page_subject, request_job
from worker.jobs.registry import get_kind
from worker.jobs.sending import enqueue
from worker.llm.openai_compat import OpenAIChatClient

pytestmark = [pytest.mark.integration, pytest.mark.timeout(240)]


def conversation(pages_seed: int, segments: int, per_segment: int = 3) -> str:
    """A page with ``segments`` segments: messages a minute apart, segments two hours apart."""
    lines = []
    for s in range(segments):
        for m in range(per_segment):
            hour, minute = 8 + (2 * s) % 12, m
            day = 1 + (2 * s) // 12
            who = ("Alice Example", "Bob Demo", "Zoë Ångström")[(s + m) % 3]
            lines.append(
                f"**{who}** (2024-05-{day:02d} {hour:02d}:{minute:02d}): "
                f"I moved to Lisbon in {2000 + pages_seed} "
                f"and I love running {5 + s} km on Sundays; I will call Acme Corp about order {s}-{m}."
            )
    return "\n".join(lines)


@pytest.fixture
def env(database_url: str, broker_url: str, simulator: Any) -> dict[str, str]:
    return service_env(database_url, broker_url, simulator.base_url)


@pytest.fixture
def sender(env: dict[str, str]) -> Iterator[Any]:
    """Hands jobs to the same broker (and key prefix) as the worker processes."""
    with celery_sender(env) as send:
        yield send


@pytest.fixture(autouse=True)
def _reset_simulator(simulator: Any) -> Iterator[None]:
    yield
    simulator.restore()


def add_pages(factory: sessionmaker[Session], pages: dict[str, str], sender: Any) -> list[int]:
    jobs: list[tuple[int, str]] = []
    for slug, body in pages.items():
        with factory.begin() as session:
            upsert_page(session, PageIn(slug=slug, type="conversation", title=slug, compiled_truth=body))
            jobs.append((request_job(session, EXTRACTION, page_subject("default", slug)).job_id, EXTRACTION))
    enqueue(factory, jobs, sender)
    return [job_id for job_id, _ in jobs]


# These tests follow the page extraction jobs; a successful one also requests consolidation jobs (the
# fact lifecycle), which the workers here do not serve.
PAGE_JOBS = Job.kind == "extraction"


def statuses(factory: sessionmaker[Session]) -> dict[str, int]:
    with factory() as session:
        query = select(Job.status, func.count()).where(PAGE_JOBS).group_by(Job.status)
        return dict(session.execute(query).all())  # type: ignore[arg-type]


def job_ids(factory: sessionmaker[Session], status: str) -> set[int]:
    with factory() as session:
        return set(session.scalars(select(Job.id).where(PAGE_JOBS, Job.status == status)))


def spent(factory: sessionmaker[Session]) -> dict[int, tuple[int, int]]:
    """Each job's two budgets as spent: (attempts, worker losses)."""
    with factory() as session:
        rows = session.execute(select(Job.id, Job.attempts, Job.worker_losses).where(PAGE_JOBS))
        return {job_id: (attempts, losses) for job_id, attempts, losses in rows}


def all_succeeded(factory: sessionmaker[Session], n: int) -> bool:
    return statuses(factory).get("succeeded", 0) == n


def fact_rows(factory: sessionmaker[Session]) -> list[tuple[str, int, str]]:
    with factory() as session:
        rows = session.execute(
            select(Fact.source_markdown_slug, Fact.row_num, Fact.fact)
            .where(Fact.source == PER_SEGMENT_SOURCE_PREFIX)
            .order_by(Fact.source_markdown_slug, Fact.row_num)
        )
        return [(slug, num, fact) for slug, num, fact in rows]


def expected_facts(server_url: str, pages: dict[str, str], simulator: Any) -> list[tuple[str, int, str]]:
    """The facts of an uninterrupted, sequential run of the same pages in a database of its own."""
    with fresh_database(server_url, "expected") as url:
        db.upgrade(url)
        factory = sessionmaker(db.get_engine(url), expire_on_commit=False)
        with factory.begin() as session:
            for slug, body in pages.items():
                upsert_page(session, PageIn(slug=slug, type="conversation", title=slug, compiled_truth=body))
        llm = OpenAIChatClient(model="simulator-1", base_url=simulator.base_url, provider="simulator")
        counters = run_extract_conversation_facts(factory, llm, ExtractOptions())
        assert counters.pages_processed == len(pages)
        rows = fact_rows(factory)
        db.get_engine(url).dispose()
        # Some facts: compared with none, a worker that stored none (or lost every reply) would pass.
        assert len(rows) >= len(pages), rows
        return rows


def test_worker_process_extracts_every_queued_page(factory, env, sender, server_url, simulator):
    pages = {f"conversations/p{i}": conversation(i, segments=3) for i in range(6)}
    worker = start_worker(env)
    with running(worker):
        add_pages(factory, pages, sender)
        wait_for(
            lambda: all_succeeded(factory, len(pages)),
            90,
            "every job to succeed",
            diagnostics=lambda: f"{statuses(factory)}\n{worker.tail()}",
        )
        # Vectors follow the commits on the worker's follow-up threads, not before the job ends.
        wait_for(lambda: unembedded(factory) == 0, 60, "the facts to be embedded in the background")
    assert fact_rows(factory) == expected_facts(server_url, pages, simulator)
    with factory() as session:
        job = session.scalars(select(Job).where(PAGE_JOBS).order_by(Job.id).limit(1)).one()
    assert job.counters["segments_processed"] == 3 and job.attempts == 1 and job.finished_at is not None
    # The worker logged its tasks at INFO, but not one line per LLM request (llm_calls rows record them).
    log = "".join(worker.output)
    assert "tasks.extraction.extract_page" in log
    assert "HTTP Request:" not in log


def unembedded(factory: sessionmaker[Session]) -> int:
    with factory() as session:
        return int(
            session.scalar(
                select(func.count())
                .select_from(Fact)
                .where(Fact.embedding.is_(None), Fact.is_audit.is_(False))
            )
            or 0
        )


def test_kill_switch_pauses_within_seconds_and_resume_completes(factory, env, sender, simulator):
    # ~300 calls at 500 ms with 24 in flight: about 6 s of work, so the switch lands mid-run.
    simulator.configure(latency_ms=500)
    pages = {f"conversations/k{i}": conversation(i, segments=10) for i in range(30)}
    worker = start_worker(env, concurrency=6)
    with running(worker):
        add_pages(factory, pages, sender)
        wait_for(lambda: statuses(factory).get("running", 0) > 0, 60, "jobs to start")
        time.sleep(0.5)
        with factory.begin() as session:
            set_config(session, "facts.extraction_enabled", "false", updated_by="test")
        switched_off = time.monotonic()
        wait_for(
            lambda: statuses(factory).get("running", 0) == 0,
            30,
            "running jobs to stop",
            diagnostics=lambda: str(statuses(factory)),
        )
        # Within 5 s of the switch no new LLM call may start; in-flight ones may finish.
        time.sleep(max(0.0, 5.0 - (time.monotonic() - switched_off)))
        calls_at_5s = simulator.stats()["requests_total"]
        time.sleep(2.0)
        assert simulator.stats()["requests_total"] == calls_at_5s, "LLM calls continued after the kill switch"
        state = statuses(factory)
        assert state.get("failed", 0) == 0 and state.get("running", 0) == 0
        assert state.get("paused", 0) > 0, state
        assert state.get("paused", 0) + state.get("succeeded", 0) + state.get("queued", 0) == len(pages)
        # Queued jobs are paused by the worker as it reaches them (the switch is checked at claim).
        wait_for(lambda: statuses(factory).get("queued", 0) == 0, 30, "queued jobs to be paused")
        with factory.begin() as session:
            set_config(session, "facts.extraction_enabled", "true", updated_by="test")
        resumed = apply_switch_change(factory, "facts.extraction_enabled", "true", sender)
        assert resumed > 0
        wait_for(
            lambda: all_succeeded(factory, len(pages)),
            120,
            "every job to succeed after resume",
            diagnostics=lambda: f"{statuses(factory)}\n{worker.tail()}",
        )
    with factory() as session:
        assert session.scalar(select(func.count()).select_from(LLMCall).where(LLMCall.outcome != "ok")) == 0
    # Paused (at claim or mid-run) and resumed, each job still spent exactly one attempt: its one run.
    assert set(spent(factory).values()) == {(1, 0)}, spent(factory)


def test_flushed_broker_loses_no_page(factory, env, sender, tmp_path: Path, server_url, simulator, broker):
    simulator.configure(latency_ms=100)
    pages = {f"conversations/f{i}": conversation(i, segments=4) for i in range(16)}
    worker = start_worker(env, concurrency=4)
    beat = start_beat(env, tmp_path)
    with running(worker, beat):
        add_pages(factory, pages, sender)
        wait_for(lambda: statuses(factory).get("succeeded", 0) >= 2, 60, "some jobs to finish")
        with broker.client() as client:  # every key of this service's (its own prefix): nobody else's
            prefix = env["FACTMILL_BROKER_KEY_PREFIX"]
            lost = list(client.scan_iter(match=f"{prefix}*", count=1000))
            assert lost, "the flush found none of the service's keys: is the prefix in use?"
            client.delete(*lost)
        wait_for(
            lambda: all_succeeded(factory, len(pages)),
            150,
            "every job to succeed after the flush",
            diagnostics=lambda: f"{statuses(factory)}\n{worker.tail()}\n{beat.tail(20)}",
        )
    assert fact_rows(factory) == expected_facts(server_url, pages, simulator)


def test_sigkilled_worker_loses_and_duplicates_nothing(
    factory, env, sender, tmp_path: Path, server_url, simulator
):
    simulator.configure(latency_ms=120)
    pages = {f"conversations/s{i}": conversation(i, segments=12) for i in range(6)}
    beat = start_beat(env, tmp_path)
    interrupted: set[int] = set()
    with running(beat):
        add_pages(factory, pages, sender)
        # The victims' pipe holds one LLM call at a time, so their three pages advance a segment at a
        # time (about 36 x 120 ms) and the kill lands mid-page. With the default pipe of 64 a page's 12
        # segments go out at once and commit together, and a kill after "some facts" found every page
        # it had claimed already finished.
        victim_env = {**env, "FACTMILL_LLM_CONCURRENCY": "1"}
        for round_ in range(2):  # kill mid-page, twice
            worker = start_worker(victim_env, concurrency=3, name=f"victim{round_}-{uuid.uuid4().hex[:4]}@%h")
            before = len(fact_rows(factory))
            wait_for(
                lambda b=before: len(fact_rows(factory)) > b + 5 and statuses(factory).get("running", 0) > 0,  # type: ignore[misc]
                60,
                "some segments to commit while jobs run",
            )
            worker.kill()
            assert statuses(factory).get("running", 0) > 0, "the kill should have interrupted running jobs"
            interrupted |= job_ids(factory, "running")
        survivor = start_worker(env, concurrency=6)
        with running(survivor):
            wait_for(
                lambda: all_succeeded(factory, len(pages)),
                150,
                "every job to succeed after the kills",
                diagnostics=lambda: f"{statuses(factory)}\n{survivor.tail()}\n{beat.tail(20)}",
            )
    rows = fact_rows(factory)
    assert len(rows) == len(set((slug, num) for slug, num, _ in rows))
    assert rows == expected_facts(server_url, pages, simulator)
    # A SIGKILL spends a worker loss, never an attempt: each job reached one verdict of its own.
    budgets = spent(factory)
    assert {attempts for attempts, _ in budgets.values()} == {1}, budgets
    assert all(budgets[job_id][1] >= 1 for job_id in interrupted), (interrupted, budgets)


def test_prefork_pool_runs_jobs_too(factory, env, sender, server_url, simulator):
    pages = {f"conversations/pf{i}": conversation(i, segments=2) for i in range(3)}
    worker = ServiceProcess(
        [
            "worker",
            "--queues",
            "extraction",
            "--concurrency",
            "2",
            "--pool",
            "prefork",
            "--hostname",
            f"prefork-{uuid.uuid4().hex[:4]}@%h",
        ],
        env,
        ready_marker="ready.",
        name="worker",
    ).start()
    with running(worker):
        add_pages(factory, pages, sender)
        wait_for(
            lambda: all_succeeded(factory, len(pages)),
            90,
            "every job to succeed",
            diagnostics=lambda: f"{statuses(factory)}\n{worker.tail()}",
        )
    assert fact_rows(factory) == expected_facts(server_url, pages, simulator)


def test_flower_turns_task_events_on_and_shows_the_workers_tasks(factory, env, sender):
    """Workers start with task events off (FACTMILL_TASK_EVENTS, off by default): Flower, on the same
    broker, turns them on when it starts and then shows the tasks a worker runs."""
    port = free_port()
    assert "FACTMILL_TASK_EVENTS" not in env
    worker = start_worker(env, concurrency=2)
    # As deployed (compose, Kubernetes): every address, behind Flower's login.
    flower_env = {**env, "FLOWER_BASIC_AUTH": "ops:flower-test-password"}
    args = ["flower", "--host", "0.0.0.0", "--port", str(port)]
    flower = ServiceProcess(args, flower_env, ready_marker=None, name="flower")
    login = httpx.BasicAuth("ops", "flower-test-password")
    with running(worker, flower.start()):
        base = f"http://127.0.0.1:{port}"

        def up() -> bool:
            try:
                return httpx.get(f"{base}/healthcheck", timeout=2).text == "OK"
            except httpx.HTTPError:
                return False

        wait_for(up, 60, "Flower to answer", diagnostics=flower.tail)  # its health check needs no login
        assert "redis" in flower.tail(200).lower()
        for path in ("/", "/api/tasks", "/api/workers"):
            assert httpx.get(f"{base}{path}", timeout=5).status_code == 401, path
        wrong = httpx.BasicAuth("ops", "wrong")
        assert httpx.get(f"{base}/api/tasks", auth=wrong, timeout=5).status_code == 401
        assert "task events: OFF" in "".join(worker.output), worker.tail()  # Celery's start-up banner
        task_name, sent = get_kind(EXTRACTION).task_name, 0

        def shows_an_extraction() -> bool:
            # Until Flower has turned the worker's events on, a task runs unseen: send another.
            nonlocal sent
            tasks = httpx.get(f"{base}/api/tasks", auth=login, timeout=5).json().values()
            if any(t.get("name") == task_name and t.get("state") == "SUCCESS" for t in tasks):
                return True
            sent += 1
            add_pages(factory, {f"conversations/flower-{sent}": conversation(sent, segments=1)}, sender)
            return False

        wait_for(
            shows_an_extraction, 90, "Flower to show an extraction task", interval=2, diagnostics=flower.tail
        )
    assert statuses(factory).get("succeeded", 0) >= 1
