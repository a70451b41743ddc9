"""README's "Operating it" with no broker configured: `factmill serve`, `worker` and `beat` started as
separate processes share the one embedded Redis of their data folder, and `factmill down` stops it."""

from __future__ import annotations

import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from sqlalchemy import text

from factmill_client import Client
from tests.auth import new_key
from tests.e2e.test_service_e2e import PAGE, SECRET
from tests.service import (
    REPO,
    ServiceProcess,
    free_port,
    running,
    service_env,
    start_beat,
    start_worker,
    stop_embedded_broker,
    wait_for,
)
from worker.embedded import broker_paths
from worker.embedded.base import pid_alive, read_pid
from worker.embedded.broker import servers_on

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]

GONE_BACKEND = 2_147_483_000  # no Postgres backend has this pid


def embedded_broker_env(database_url: str, simulator_url: str, data_dir: Path) -> dict[str, str]:
    """The service environment with no FACTMILL_BROKER_URL: the processes find the broker themselves.
    (The database is the test run's own; only the broker is the embedded default here.)"""
    env = service_env(database_url, "unused", simulator_url)
    del env["FACTMILL_BROKER_URL"], env["FACTMILL_BROKER_KEY_PREFIX"]
    env["FACTMILL_DATA_DIR"] = str(data_dir)
    return env


def test_separate_service_processes_share_the_embedded_broker_and_down_stops_it(
    database_url, factory, simulator, tmp_path: Path
):
    data_dir = tmp_path / "var"
    env = embedded_broker_env(database_url, simulator.base_url, data_dir)
    paths = broker_paths(data_dir)
    processes: list[ServiceProcess] = []
    try:
        # The worker and beat start at once: both race to start the embedded Redis, one must win.
        with ThreadPoolExecutor(2) as pool:
            starting = [pool.submit(start_worker, env), pool.submit(start_beat, env, data_dir)]
        processes += [future.result() for future in starting if future.exception() is None]
        for future in starting:
            if future.exception() is not None:
                raise AssertionError(f"a service process did not start: {future.exception()}")
        port = free_port()
        processes.append(
            ServiceProcess(
                ["serve", "--port", str(port)], env, ready_marker="Application startup complete", name="api"
            ).start()
        )
        worker, beat, api = processes
        base = f"http://127.0.0.1:{port}"
        with (
            running(*processes),
            Client(base, webhook_secret=SECRET) as sender,
            Client(base, api_key=new_key(factory, ["read"])) as reader,
        ):
            assert reader.ready()
            [job] = sender.ingest_page(PAGE, idempotency_key="embedded-broker-1").jobs
            with factory.begin() as session:  # a running total left by a connection long gone
                session.execute(text(f"INSERT INTO row_counts VALUES ('segments', 'ok', {GONE_BACKEND}, 0)"))

            def succeeded() -> bool:
                return reader.get_job(job.job_id).status == "succeeded"

            wait_for(succeeded, 90, "the job to succeed", diagnostics=lambda: worker.tail() + api.tail())
            # Beat's schedule reaches the same worker too (the sweeper is what recovers lost jobs).
            wait_for(
                lambda: "tasks.maintenance.sweep" in "".join(worker.output),
                60,
                "beat's sweep to reach the worker",
                diagnostics=lambda: worker.tail() + beat.tail(),
            )

            def folded() -> bool:  # the sweep moves gone connections' totals into backend 0
                with factory() as session:
                    return not session.scalar(
                        text(f"SELECT count(*) FROM row_counts WHERE backend = {GONE_BACKEND}")
                    )

            wait_for(folded, 60, "the sweep to fold the running totals", diagnostics=worker.tail)
            facts = reader.page_facts("default", PAGE["slug"]).facts
            assert any("Acme" in fact.fact for fact in facts)
            server = read_pid(paths.pid_file)
            assert server is not None and servers_on(paths.socket) == [server]  # one, for all three

        down = subprocess.run(
            [sys.executable, "-m", "worker.cli", "down"],
            cwd=REPO,
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert down.returncode == 0, down.stdout + down.stderr
        assert f"embedded Redis: stopped (pid {server})" in down.stdout
        assert "Postgres" not in down.stdout  # FACTMILL_DATABASE_URL is set: not ours to stop
        assert not pid_alive(server) and servers_on(paths.socket) == []
        assert not os.path.exists(paths.socket)
    finally:
        for process in processes:
            process.stop()
        stop_embedded_broker(data_dir)
