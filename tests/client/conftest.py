"""The client's tests talk to the real API: one `factmill serve` and one `factmill worker` process per
module, on the session's Postgres, Redis and LLM simulator."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import pytest

from tests.service import ServiceProcess, free_port, running, service_env, start_worker

SECRET = "test-secret"  # = service_env's FACTMILL_WEBHOOK_SECRET
PREVIOUS_SECRET = "test-previous-secret"  # the server still accepts it, as while a secret is rotated
BODY_CAP = 64 * 1024  # small, so a 413 is cheap to provoke


@dataclass(frozen=True)
class Service:
    base_url: str
    api: ServiceProcess
    worker: ServiceProcess

    def logs(self) -> str:
        return f"--- api\n{self.api.tail()}\n--- worker\n{self.worker.tail()}"


@pytest.fixture(scope="module")
def service(database_url: str, broker_url: str, simulator: object) -> Iterator[Service]:
    env = service_env(
        database_url,
        broker_url,
        simulator.base_url,  # type: ignore[attr-defined]
        max_body_bytes=BODY_CAP,
        webhook_previous_secret=PREVIOUS_SECRET,
    )
    port = free_port()
    api = ServiceProcess(
        ["serve", "--port", str(port)], env, ready_marker="Application startup complete", name="api"
    ).start()
    try:
        worker = start_worker(env, queues="extraction,compaction", concurrency=4)
    except BaseException:
        api.stop()
        raise
    with running(api, worker):
        yield Service(f"http://127.0.0.1:{port}", api, worker)
