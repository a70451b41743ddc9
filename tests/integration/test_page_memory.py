"""An extraction job's page is read only when the process's page memory has room for it
(FACTMILL_EXTRACTION_PAGE_BYTES_HELD): a worker of 64 jobs on pages of a few MiB each passed its pod's
memory limit, and every job on it lost its run to the OOM kill."""

from __future__ import annotations

import threading
from typing import Any

import pytest
from sqlalchemy import select
from sqlalchemy.orm import Session, sessionmaker

from models import Job
from tests.integration.test_extraction import SAMPLE_BODY, SLUG, put_page
from worker.config_store import EXTRACTION_ENABLED, ConfigReader, set_config
from worker.jobs import shutdown
from worker.jobs.lifecycle import JobOutcome, run_job
from worker.jobs.outbox import EXTRACTION, page_subject, request_job
from worker.runtime import Runtime
from worker.settings import Settings

pytestmark = pytest.mark.integration


def runtime(factory: sessionmaker[Session], database_url: str, simulator: Any) -> Runtime:
    settings = Settings(
        database_url=database_url,
        simulator_url=simulator.base_url,
        llm="simulator",
        consolidate_after_extraction=False,
        embed_after_extraction=False,
        extraction_page_bytes_held=len(SAMPLE_BODY.encode()),
    )
    return Runtime(settings=settings, factory=factory, config=ConfigReader(factory, ttl=0))


def start_job(rt: Runtime, factory: sessionmaker[Session]) -> tuple[int, threading.Thread, list[JobOutcome]]:
    put_page(factory, body=SAMPLE_BODY)
    with factory.begin() as session:
        job_id = request_job(session, EXTRACTION, page_subject("default", SLUG)).job_id
    outcomes: list[JobOutcome] = []
    thread = threading.Thread(target=lambda: outcomes.append(run_job(rt, job_id, EXTRACTION)), daemon=True)
    thread.start()
    return job_id, thread, outcomes


def wait_for_a_waiter(rt: Runtime) -> None:
    for _ in range(1000):
        if rt.page_memory.waiting:
            return
        threading.Event().wait(0.01)
    raise AssertionError("the job never waited for page memory")


# Truncation: the job runs on its own thread and connections.
def test_a_job_s_page_waits_for_room_in_the_process_s_page_memory(
    factory: sessionmaker[Session], database_url: str, simulator: Any
) -> None:
    rt = runtime(factory, database_url, simulator)
    simulator.reset()
    with rt.page_memory.holding(1):  # another job's page holds part of it: this one does not fit
        _, thread, outcomes = start_job(rt, factory)
        wait_for_a_waiter(rt)
        assert simulator.recent_requests() == [] and outcomes == []
    thread.join(60)
    assert [o.status for o in outcomes] == ["succeeded"] and simulator.recent_requests()
    assert rt.page_memory.held == 0


def test_a_job_waiting_for_page_memory_pauses_when_the_kill_switch_goes_off(
    factory: sessionmaker[Session], database_url: str, simulator: Any
) -> None:
    rt = runtime(factory, database_url, simulator)
    simulator.reset()
    with rt.page_memory.holding(1):
        job_id, thread, outcomes = start_job(rt, factory)
        wait_for_a_waiter(rt)
        with factory.begin() as session:
            set_config(session, EXTRACTION_ENABLED, "false")
        thread.join(15)  # (the wait reads the switch every second)
        assert not thread.is_alive(), "the wait never read the switch"  # (still holding the memory)
    assert [o.status for o in outcomes] == ["paused"] and simulator.recent_requests() == []
    with factory() as session:
        assert session.scalar(select(Job.pause_reason).where(Job.id == job_id)) == "kill_switch"


def test_a_job_waiting_for_page_memory_is_released_when_its_worker_stops(
    factory: sessionmaker[Session], database_url: str, simulator: Any
) -> None:
    rt = runtime(factory, database_url, simulator)
    try:
        with rt.page_memory.holding(1):
            job_id, thread, outcomes = start_job(rt, factory)
            wait_for_a_waiter(rt)
            shutdown._stopping.set()
            thread.join(15)
            assert not thread.is_alive(), "the wait never saw the worker stop"  # (still holding the memory)
        assert [o.status for o in outcomes] == ["released"] and rt.page_memory.waiting == 0
        with factory() as session:
            assert session.scalar(select(Job.status).where(Job.id == job_id)) == "queued"
    finally:
        shutdown._stopping.clear()
