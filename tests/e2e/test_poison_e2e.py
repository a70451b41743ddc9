"""A poison segment as a user meets it: `factmill serve` and `factmill worker` processes, a signed webhook,
the simulator refusing one segment every time; then `retry?skipped=true` and `jobs retry --skipped`."""

from __future__ import annotations

import json
import subprocess
import sys
from typing import Any

import httpx
import pytest

from factmill_client import Client
from tests.auth import bearer, new_key
from tests.service import REPO, ServiceProcess, free_port, running, service_env, start_worker, wait_for

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]

SLUG = "conversations/e2e/poison"
MIDDLE = "2024-03-16T09:00:00Z"


def lines(day: int, marker: str = "") -> list[str]:
    return [
        f"**Alice Example** (2024-03-{day} 9:00 AM): I moved to Lisbon in 20{day} and I love it. {marker}",
        f"**Bob Demo** (2024-03-{day} 9:01 AM): I will call Acme Corp about order {day} tomorrow.",
    ]


PAGE = {
    "slug": SLUG,
    "type": "conversation",
    "title": "Poison",
    "compiled_truth": "\n".join([*lines(15), *lines(16, "[[sim:refusal]]"), *lines(17)]),
}


def deliver(base_url: str) -> int:
    with Client(base_url, webhook_secret="test-secret") as sender:
        [job] = sender.ingest_page(PAGE).jobs
    return job.job_id


def chat_calls(sim: Any) -> int:
    """Requests for a model reply (a finished job also embeds its new facts: those are not counted)."""
    by_route = sim.stats()["by_route"]
    return int(by_route.get("chat.completions", 0) + by_route.get("messages", 0))


def cli(env: dict[str, str], *args: str) -> str:
    result = subprocess.run(
        [sys.executable, "-m", "worker.cli", *args],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    return result.stdout


def test_poison_segment_skipped_then_retried_through_the_api_and_the_cli(
    database_url, factory, broker_url, sim
):
    env = service_env(database_url, broker_url, sim.base_url)
    port = free_port()
    api = ServiceProcess(
        ["serve", "--port", str(port)], env, ready_marker="Application startup complete", name="api"
    ).start()
    worker = start_worker(env, queues="extraction")
    base = f"http://127.0.0.1:{port}"
    admin_key = new_key(factory, ["admin"])
    admin = bearer(admin_key)
    with (
        running(api, worker),
        Client(base, api_key=new_key(factory, ["read"])) as reader,
        Client(base, api_key=admin_key) as operator,
        httpx.Client(base_url=base, timeout=10) as client,  # /metrics only: Prometheus text, scraped
    ):

        def job() -> dict[str, Any]:
            return reader.get_job(job_id).model_dump()

        def page_facts() -> list[tuple[int, str, str]]:
            return [(f.row_num, f.context, f.fact) for f in reader.iter_page_facts("default", SLUG)]

        def settled() -> None:
            wait_for(
                lambda: job()["status"] in ("succeeded", "failed"), 120, "the job", diagnostics=worker.tail
            )

        job_id = deliver(base)
        settled()
        state = job()
        # Two runs failed on the refusal (each spent an attempt), the third skipped the segment.
        assert (state["status"], state["attempts"]) == ("succeeded", 3), state
        assert state["counters"]["segments_skipped"] == 1 and "--skipped" in state["last_error"]
        skipped_facts = page_facts()
        assert skipped_facts and not any(MIDDLE in context for _, context, _ in skipped_facts)
        assert {context[21:31] for _, context, _ in skipped_facts} == {"2024-03-15", "2024-03-17"}
        shown = json.loads(cli(env, "jobs", "show", str(job_id)))
        assert shown["counters"]["segments_skipped"] == 1
        metrics = client.get("/metrics", headers=admin).text
        assert 'factmill_segments_total{outcome="skipped"} 1.0' in metrics
        assert "factmill_segments_skipped 1.0" in metrics

        # Through the API while the model still refuses: one call, the segment stays skipped.
        before = chat_calls(sim)
        retried = operator.retry_job(job_id, skipped=True)
        assert retried.id == job_id and not retried.done, retried
        settled()
        assert job()["status"] == "succeeded"
        assert (job()["counters"]["segments_skipped"], job()["counters"]["segments_unskipped"]) == (1, 0)
        assert chat_calls(sim) - before == 1
        assert page_facts() == skipped_facts

        # Through the CLI once the segment is good: only it is extracted, once, on the next row numbers.
        sim.configure(text_faults=False)
        before = chat_calls(sim)
        assert "skipped segments" in cli(env, "jobs", "retry", str(job_id), "--skipped")
        settled()
        state = job()
        assert state["status"] == "succeeded", state
        assert (state["counters"]["segments_skipped"], state["counters"]["segments_unskipped"]) == (0, 1)
        assert chat_calls(sim) - before == 1
        after = page_facts()
        assert after[: len(skipped_facts)] == skipped_facts
        assert [n for n, _, _ in after] == list(range(len(after)))
        assert after[len(skipped_facts) :] and all(MIDDLE in c for _, c, _ in after[len(skipped_facts) :])
        metrics = client.get("/metrics", headers=admin).text
        assert "factmill_segments_skipped 0.0" in metrics
        # A retry without --skipped reads the page as it is: nothing new, no call.
        before = chat_calls(sim)
        cli(env, "jobs", "retry", str(job_id))
        settled()
        assert chat_calls(sim) == before and page_facts() == after


def test_factmill_extract_skips_and_then_re_extracts_with_skipped(database_url, factory, broker_url, sim):
    from worker.config_store import set_config
    from worker.extraction import PageIn, upsert_page

    with factory.begin() as session:
        set_config(session, "extraction.max_segment_failures", "1")
        upsert_page(
            session,
            PageIn(slug=SLUG, type="conversation", title="Poison", compiled_truth=PAGE["compiled_truth"]),
        )
    env = service_env(database_url, broker_url, sim.base_url)
    first = json.loads(cli(env, "extract", "--slug", SLUG, "--json"))
    assert (first["pages_processed"], first["segments_processed"], first["segments_skipped"]) == (1, 2, 1)
    sim.configure(text_faults=False)
    retried = json.loads(cli(env, "extract", "--slug", SLUG, "--skipped", "--json"))
    assert (retried["segments_unskipped"], retried["segments_skipped"], retried["llm_calls"]) == (1, 0, 1)
    again = json.loads(cli(env, "extract", "--slug", SLUG, "--skipped", "--json"))
    assert (again["llm_calls"], again["pages_skipped"]) == (0, 1)
