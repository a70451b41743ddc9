"""The service as a user drives it: `factmill serve` and `factmill worker` processes, signed webhooks
sent with the Python client (factmill_client)."""

from __future__ import annotations

import http.client
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from factmill_client import AuthenticationError, Client
from tests.auth import bearer, new_key
from tests.service import (
    REPO,
    ServiceProcess,
    free_port,
    running,
    service_env,
    start_worker,
    wait_for,
)

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]

SECRET = "test-secret"


PAGE = {
    "slug": "conversations/e2e/alice",
    "type": "conversation",
    "title": "Alice and Bob",
    "compiled_truth": "\n".join(
        [
            "**Alice Example** (2024-03-15 9:00 AM): I just signed the offer letter for Acme Corp.",
            "**Bob Demo** (2024-03-15 9:01 AM): Congrats! What's the title?",
            "**Alice Example** (2024-03-16 8:00 AM): I started at Acme Corp this morning and I love it.",
            "**Bob Demo** (2024-03-16 8:05 AM): I will visit you in Denver next month.",
        ]
    ),
}


def test_signed_webhook_to_facts_through_api_and_worker_processes(
    database_url, factory, broker_url, simulator
):
    # `factory` empties the database first: the job counts below must not include earlier tests' jobs.
    env = service_env(database_url, broker_url, simulator.base_url)
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    api = ServiceProcess(
        ["serve", "--port", str(port)], env, ready_marker="Application startup complete", name="api"
    ).start()
    worker = start_worker(env, queues="extraction")
    reader_key, admin = new_key(factory, ["read"]), bearer(new_key(factory, ["admin"]))
    with (
        running(api, worker),
        Client(base, webhook_secret=SECRET) as sender,
        Client(base, api_key=reader_key) as reader,
    ):
        assert reader.ready()
        with Client(base) as anonymous, pytest.raises(AuthenticationError):
            anonymous.list_jobs()  # anonymous reads are refused
        first = sender.ingest_page(PAGE, idempotency_key="delivery-1")
        [job] = first.jobs
        assert sender.ingest_page(PAGE, idempotency_key="delivery-1") == first
        with (
            Client(base, webhook_secret=SECRET, clock=lambda: time.time() - 360) as late,
            pytest.raises(AuthenticationError) as stale,
        ):
            late.ingest_page(PAGE)
        assert "old" in stale.value.detail
        with Client(base, webhook_secret="not-the-secret") as forger, pytest.raises(AuthenticationError):
            forger.ingest_page(PAGE)

        wait_for(
            lambda: reader.get_job(job.job_id).status == "succeeded",
            60,
            "the job to succeed",
            diagnostics=worker.tail,
        )
        facts = reader.page_facts("default", "conversations/e2e/alice").facts
        assert facts and [f.row_num for f in facts] == list(range(len(facts)))
        assert any("Acme" in f.fact for f in facts)
        assert sender.ingest_page(PAGE).jobs == []  # unchanged
        # Prometheus text is scraped, not a client call.
        assert httpx.get(f"{base}/metrics", headers=bearer(reader_key)).status_code == 403
        metrics = httpx.get(f"{base}/metrics", headers=admin).text
        assert 'factmill_jobs{kind="extraction",status="succeeded"} 1.0' in metrics
        reader.search("lex: Denver", intent="where Alice works")
    # Logs never carry page text, slugs (a slug can name a person; an erasure cannot reach a log), the
    # facts, a search's words or a secret: every line both processes wrote, at INFO.
    logged = "".join(api.output + worker.output)
    assert "job" in logged and "/v1/pages" in logged  # they did log
    private = [PAGE["slug"], "alice", "Alice Example", "offer letter", "Denver", "Acme", SECRET, reader_key]
    private += [f.fact for f in facts]
    assert [p for p in private if p.lower() in logged.lower()] == []


@pytest.mark.parametrize(
    ("command", "ready_marker", "health"),
    [
        (["serve"], "Application startup complete", "/healthz"),
        (["simulator"], "Uvicorn running", "/_simulator/health"),
    ],
    ids=["api", "simulator"],
)
def test_an_idle_connection_stays_open_past_a_client_pools_expiry(
    database_url, broker_url, simulator, command, ready_marker, health
):
    """An HTTP/1.1 connection idle 6 s (longer than httpx's 5 s pool expiry and uvicorn's own 5 s
    keep-alive) still answers: the server is never the side that closes an idle connection a client may
    be sending on."""
    port = free_port()
    server = ServiceProcess(
        [*command, "--port", str(port)],
        service_env(database_url, broker_url, simulator.base_url),
        ready_marker=ready_marker,
        name=command[0],
    ).start()
    with running(server):
        wait_for(
            lambda: _answers(f"http://127.0.0.1:{port}{health}"),
            30,
            "the server listening",
            diagnostics=server.tail,
        )
        connection = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
        try:
            connection.request("GET", health)
            first = connection.getresponse()
            assert first.status == 200 and first.read()
            opened = connection.sock
            time.sleep(6)
            # A server that closed the idle connection makes this raise RemoteDisconnected.
            connection.request("GET", health)
            second = connection.getresponse()
            assert second.status == 200 and second.read()
            assert connection.sock is opened  # the same connection, not a new one
        finally:
            connection.close()


def _answers(url: str) -> bool:
    try:
        return httpx.get(url, timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


def left_queued(data_dir: Path) -> None:
    """One of the demo's extraction jobs back to queued, its message lost, as a demo stopped early (and
    a broker restarted) leaves it."""
    from sqlalchemy import create_engine, text

    from worker.embedded.postgres import embedded_postgres_url

    engine = create_engine(embedded_postgres_url(data_dir))
    try:
        with engine.begin() as connection:
            connection.execute(
                text(
                    "UPDATE jobs SET status = 'queued', enqueued_at = now(), worker = NULL "
                    "WHERE id = (SELECT min(id) FROM jobs WHERE kind = 'extraction')"
                )
            )
    finally:
        engine.dispose()


def set_revision(data_dir: Path, revision: str) -> None:
    from sqlalchemy import create_engine, text

    from worker.embedded.postgres import embedded_postgres_url

    engine = create_engine(embedded_postgres_url(data_dir))
    try:
        with engine.begin() as connection:
            connection.execute(text("UPDATE alembic_version SET version_num = :v"), {"v": revision})
    finally:
        engine.dispose()


def test_demo_runs_end_to_end_on_the_embedded_default(tmp_path: Path):
    """`factmill demo` with no server configured: embedded Postgres + Redis, API, worker, beat."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("FACTMILL_")}
    env["FACTMILL_DATA_DIR"] = str(tmp_path / "var")
    env.pop("OPENAI_API_KEY", None)
    env.pop("ANTHROPIC_API_KEY", None)
    try:
        result = subprocess.run(
            [sys.executable, "-m", "worker.cli", "demo", "--concurrency", "4"],
            cwd=REPO,
            env=env,
            capture_output=True,
            text=True,
            timeout=240,
        )
        output = result.stdout + result.stderr
        assert result.returncode == 0, output
        assert "simulator" in output and "not a real model" in output
        assert "not a real model" in result.stdout  # beside the facts it made, not only on stderr
        assert "23 (23 succeeded)" in output  # 22 conversations + 1 person page, every job done
        assert "facts" in output and "LLM calls" in output
        # The calls and tokens are counted (a reader's key, as the demo's was, sees no spend: it said 0).
        calls = re.search(r"LLM calls\s*│?\s*(\d+)", result.stdout)
        assert calls is not None and int(calls.group(1)) > 0, result.stdout
        # The lifecycle: Priya moved from Lisbon to Porto; the demo shows the current and the old fact.
        assert "Priya Raman lives in Porto now." in output
        assert "Priya Raman lives in Lisbon now." in output and "superseded by fact" in output
        rerun = subprocess.run(
            [sys.executable, "-m", "worker.cli", "demo", "--concurrency", "2"],
            cwd=REPO,
            env=env,
            capture_output=True,
            text=True,
            timeout=240,
        )
        assert rerun.returncode == 0, rerun.stdout + rerun.stderr
        assert "nothing new to extract" in rerun.stderr
        # A demo stopped before its jobs were done: a rerun followed none (its pages are unchanged),
        # said there was nothing new, and stopped the worker again; they stayed pending for good.
        left_queued(tmp_path / "var")
        # Its message lost: the sweeper sends it again 20 s after (a job never sent went at once, done
        # before the demo listed what was pending, which made the case a race).
        lost = {"FACTMILL_SWEEP_INTERVAL_SECONDS": "1", "FACTMILL_JOB_REQUEUE_AFTER_SECONDS": "20"}
        after_a_stop = subprocess.run(
            [sys.executable, "-m", "worker.cli", "demo", "--concurrency", "2"],
            cwd=REPO,
            env=env | lost,
            capture_output=True,
            text=True,
            timeout=240,
        )
        output = after_a_stop.stdout + after_a_stop.stderr
        assert after_a_stop.returncode == 0, output
        assert "1 extraction job(s) an earlier run left unfinished" in output
        assert "nothing new to extract" not in output and "1 (1 succeeded)" in output
        # Its kill switch off (as the README shows how): the jobs are paused, and the demo says so at
        # once, exit 3 (it watched a bar at 0 for ten minutes, then blamed the worker).
        switched = subprocess.run(
            [sys.executable, "-m", "worker.cli", "config", "set", "facts.extraction_enabled", "false"],
            cwd=REPO, env=env, capture_output=True, text=True, timeout=120,
        )  # fmt: skip
        assert switched.returncode == 0, switched.stdout + switched.stderr
        new_page = tmp_path / "more" / "new.md"
        new_page.parent.mkdir()
        new_page.write_text(
            "---\nslug: conversations/paused\ntype: conversation\ntitle: paused\n---\n"
            "**Ana** (2024-04-20 10:30 AM): I moved to Lima.\n**Bo** (2024-04-20 10:31 AM): Congrats!\n"
        )
        demo_more = [sys.executable, "-m", "worker.cli", "demo", "--concurrency", "2", "--examples"]
        paused = subprocess.run(
            [*demo_more, str(new_page.parent)], cwd=REPO, env=env, capture_output=True, text=True, timeout=240
        )
        output = paused.stdout + paused.stderr
        assert paused.returncode == 3, output
        assert "1 job(s) paused, waiting for an operator" in output and "facts.extraction_enabled" in output
        # A schema a newer release upgraded: one line, as `db upgrade` says it (a traceback before).
        set_revision(tmp_path / "var", "9999_from_the_future")
        newer = subprocess.run(
            [*demo_more, str(new_page.parent)], cwd=REPO, env=env, capture_output=True, text=True, timeout=240
        )
        output = newer.stdout + newer.stderr
        assert newer.returncode == 1 and "Traceback" not in output, output
        assert "9999_from_the_future, newer than this factmill" in output
    finally:
        subprocess.run(
            [sys.executable, "-m", "worker.cli", "db", "stop"],
            cwd=REPO,
            env=env,
            capture_output=True,
            timeout=60,
        )
