"""`factmill serve --workers N`: one set of request counts for all of its processes."""

from __future__ import annotations

import json
import re
from pathlib import Path

import httpx
import pytest

from tests.service import ServiceProcess, free_port, running, service_env, wait_for

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]

HEALTHZ = re.compile(
    r'^factmill_http_requests_total\{method="GET",route="/healthz",status="200"\} (\S+)$', re.M
)


def _answers(url: str) -> bool:
    try:
        return httpx.get(url, timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


def test_every_scrape_counts_the_requests_of_every_process(
    database_url, broker_url, simulator, tmp_path: Path
):
    """Each of the compose file's two API processes answered /metrics with its own counts, so a
    counter went 20, 10, 20 between scrapes and Prometheus read each fall as a reset."""
    port = free_port()
    env = service_env(database_url, broker_url, simulator.base_url) | {"TMPDIR": str(tmp_path)}
    server = ServiceProcess(
        ["serve", "--port", str(port), "--workers", "2"],
        env,
        ready_marker=None,
        name="api",
    ).start()
    base = f"http://127.0.0.1:{port}"
    with running(server):
        wait_for(lambda: _answers(f"{base}/healthz"), 60, "the API listening", diagnostics=server.tail)
        with httpx.Client(base_url=base) as client:
            for _ in range(40):  # new connections: the kernel spreads them over both processes
                assert httpx.get(f"{base}/healthz").status_code == 200
            answers = [
                client.get("/metrics", headers={"Authorization": "Bearer test-admin"}, timeout=10).text
                for _ in range(8)
            ]
        pids = {line for line in server.output if "Started server process" in line}
        assert len(pids) == 2, server.tail()
        for text in answers:
            counted = [float(n) for n in HEALTHZ.findall(text)]
            # The polls of wait_for count too: at least the 40, and the same in every answer.
            assert len(counted) == 1 and counted[0] >= 40, text
            assert counted[0] == float(HEALTHZ.findall(answers[0])[0])
            assert "factmill_jobs_ended_total" in text  # the store's figures are there as well
            assert "\nprocess_start_time_seconds" not in text  # it would describe one process only
        assert list(tmp_path.glob("factmill-metrics-*")), "the counts are kept in a folder of their own"
    assert not list(tmp_path.glob("factmill-metrics-*")), "the folder outlived the server"


def test_the_access_log_names_routes_never_what_a_path_or_query_holds(
    database_url, broker_url, simulator, tmp_path: Path
):
    """uvicorn's access log wrote every path with its query: search text and the slug of a page being
    erased stayed in the logs. The API's own access line names the route's template instead, in JSON
    here, each line carrying the request's id."""
    port = free_port()
    env = service_env(database_url, broker_url, simulator.base_url) | {"FACTMILL_LOG_FORMAT": "json"}
    server = ServiceProcess(["serve", "--port", str(port)], env, ready_marker=None, name="api").start()
    base = f"http://127.0.0.1:{port}"
    admin = {"Authorization": "Bearer test-admin"}
    with running(server):
        wait_for(lambda: _answers(f"{base}/healthz"), 60, "the API listening", diagnostics=server.tail)
        answers = [
            httpx.get(f"{base}/v1/search", params={"q": "alice hiv diagnosis"}, headers=admin, timeout=30),
            httpx.get(f"{base}/v1/search", params={"q": "alice hiv diagnosis"}, timeout=30),  # 401
            httpx.delete(f"{base}/v1/pages/default/alice-private-notes", headers=admin, timeout=30),
        ]
        wait_for(lambda: sum("worker.api.access" in line for line in server.output) >= 4, 10, "access lines")
    text = "".join(server.output)
    assert "hiv" not in text and "alice-private-notes" not in text, text
    lines = [json.loads(line) for line in server.output if line.startswith("{")]
    assert len(lines) == len([line for line in server.output if line.strip()]), "a line that is not JSON"
    access = {line["request_id"]: line for line in lines if line["logger"] == "worker.api.access"}
    for answer in answers:
        line = access[answer.headers["X-Request-ID"]]
        assert line["status"] == answer.status_code and line["method"] == answer.request.method
        assert line["route"] in ("/v1/search", "/v1/pages/{source_id}/{slug:text}")
