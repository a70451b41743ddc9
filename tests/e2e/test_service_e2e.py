"""The service as a user drives it: `factmill serve` and `factmill worker` processes, signed webhooks."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.auth import bearer, new_key
from tests.service import (
    REPO,
    ServiceProcess,
    running,
    service_env,
    start_worker,
    wait_for,
)
from worker.core.signing import sign

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]

SECRET = "test-secret"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def post(
    client: httpx.Client,
    payload: Any,
    *,
    secret: str = SECRET,
    key: str | None = None,
    timestamp: int | None = None,
) -> httpx.Response:
    body = json.dumps(payload).encode()
    headers = {
        "Content-Type": "application/json",
        "Factmill-Signature": sign(body, secret, timestamp, method="POST", path="/v1/pages"),
    }
    if key:
        headers["Idempotency-Key"] = key
    return client.post("/v1/pages", content=body, headers=headers)


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
    api = ServiceProcess(
        ["serve", "--port", str(port)], env, ready_marker="Application startup complete", name="api"
    ).start()
    worker = start_worker(env, queues="extraction")
    reader, admin = bearer(new_key(factory, ["read"])), bearer(new_key(factory, ["admin"]))
    with running(api, worker), httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=10) as client:
        assert client.get("/readyz").status_code == 200
        assert client.get("/v1/jobs").status_code == 401  # anonymous reads are refused
        first = post(client, PAGE, key="delivery-1")
        assert first.status_code == 202, first.text
        [job] = first.json()["jobs"]
        again = post(client, PAGE, key="delivery-1")
        assert again.status_code == 202 and again.json() == first.json()
        stale = post(client, PAGE, timestamp=int(time.time()) - 360)
        assert stale.status_code == 401 and "old" in stale.json()["detail"]
        forged = post(client, PAGE, secret="not-the-secret")
        assert forged.status_code == 401

        def done() -> bool:
            return client.get(f"/v1/jobs/{job['job_id']}", headers=reader).json()["status"] == "succeeded"

        wait_for(done, 60, "the job to succeed", diagnostics=worker.tail)
        facts = client.get("/v1/pages/default/conversations/e2e/alice/facts", headers=reader).json()["facts"]
        assert facts and [f["row_num"] for f in facts] == list(range(len(facts)))
        assert any("Acme" in f["fact"] for f in facts)
        unchanged = post(client, PAGE)
        assert unchanged.status_code == 202 and unchanged.json()["jobs"] == []
        assert client.get("/metrics", headers=reader).status_code == 403
        metrics = client.get("/metrics", headers=admin).text
        assert 'factmill_jobs{kind="extraction",status="succeeded"} 1.0' in metrics


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
        assert "23 (23 succeeded)" in output  # 22 conversations + 1 person page, every job done
        assert "facts" in output and "LLM calls" in output
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
    finally:
        subprocess.run(
            [sys.executable, "-m", "worker.cli", "db", "stop"],
            cwd=REPO,
            env=env,
            capture_output=True,
            timeout=60,
        )
