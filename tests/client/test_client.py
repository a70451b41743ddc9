"""factmill_client against the real API process: signed ingestion, typed errors, idempotent retries,
paging, and the async client."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import httpx
import pytest

from factmill_client import (
    AsyncClient,
    AuthenticationError,
    Client,
    Conflict,
    NotFound,
    PayloadTooLarge,
    PermissionDenied,
    RetryPolicy,
    UnprocessableEntity,
)
from factmill_client.signing import SIGNATURE_HEADER
from tests.auth import new_key
from tests.client.conftest import BODY_CAP, PREVIOUS_SECRET, SECRET, Service
from tests.e2e.test_service_e2e import PAGE

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]


def page(n: int) -> dict[str, Any]:
    return {**PAGE, "slug": f"conversations/client/{n}", "title": f"Client page {n}"}


class Recording(httpx.HTTPTransport):
    """The real HTTP transport, keeping each request; ``lose`` answers arrive at the server but are lost
    on the way back (the connection drops after the server acted), like a flaky network."""

    def __init__(self, lose: int = 0) -> None:
        super().__init__()
        self.requests: list[httpx.Request] = []
        self.responses: list[httpx.Response] = []
        self.lose = lose

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        self.requests.append(request)
        response = super().handle_request(request)
        response.read()
        self.responses.append(response)
        if self.lose > 0:
            self.lose -= 1
            raise httpx.ReadError("connection reset after the request was sent", request=request)
        return response


def test_signed_ingest_then_the_page_facts_page_by_page(service: Service, factory):
    reader_key = new_key(factory, ["read"])
    with (
        Client(service.base_url, webhook_secret=SECRET) as sender,
        Client(service.base_url, api_key=reader_key) as reader,
    ):
        accepted = sender.ingest_page(PAGE)
        [job] = accepted.jobs
        assert (job.slug, job.created, accepted.unchanged) == (PAGE["slug"], True, [])
        done = reader.wait_for_job(job.job_id, timeout=120)
        assert done.status == "succeeded", (done, service.logs())
        whole = reader.page_facts("default", PAGE["slug"])
        assert whole.total >= 2 and len(whole.facts) == whole.total
        # One fact per request: the iterator follows the offsets to the end, in row order.
        paged = list(reader.iter_page_facts("default", PAGE["slug"], page_size=1))
        assert paged == whole.facts
        assert any("Acme" in fact.fact for fact in paged)
        # The facts about the page's people, by entity, newest first (GET /v1/entities/.../facts).
        entity = next(f.entity_slug for f in whole.facts if (f.entity_slug or "").startswith("people/"))
        about = reader.entity_facts(entity)
        assert about.entity == entity and about.total == len(about.facts) >= 1
        assert list(reader.iter_entity_facts(entity.upper(), page_size=1)) == about.facts  # a name reads too
        found = reader.search("lex: Acme", source_id="default")
        assert found.results and {r.page_slug for r in found.results} == {PAGE["slug"]}
        # The same content again: nothing changed, nothing queued.
        assert sender.ingest_page(PAGE).jobs == []


def test_the_webhook_secret_rotates_either_way_round(service: Service, factory):
    """The server accepts its previous secret beside the current one (senders move one by one); a
    sender signs with several secrets (the server may switch meanwhile); a stranger's is refused."""
    for n, secret in enumerate((PREVIOUS_SECRET, SECRET, ["an-old-one", SECRET], [SECRET, "a-new-one"])):
        with Client(service.base_url, webhook_secret=secret) as sender:
            assert sender.ingest_page(page(900 + n)).jobs, secret
    transport = Recording()
    with (
        Client(service.base_url, webhook_secret=["x-old", "x-new"], transport=transport) as stranger,
        pytest.raises(AuthenticationError, match="does not match"),
    ):
        stranger.ingest_page(page(999))
    assert transport.requests[0].headers[SIGNATURE_HEADER].count("v4=") == 2


def test_errors_are_typed_and_carry_the_servers_detail(service: Service, factory):
    reader_key = new_key(factory, ["read"])
    with (
        Client(service.base_url, api_key="fm_not_a_key") as stranger,
        pytest.raises(AuthenticationError) as bad_key,
    ):
        stranger.get_job(1)
    assert bad_key.value.status_code == 401 and "unknown or revoked API key" in bad_key.value.detail
    with (
        Client(service.base_url, webhook_secret="not-the-secret") as forger,
        pytest.raises(AuthenticationError) as forged,
    ):
        forger.ingest_page(PAGE)
    assert "signature does not match" in forged.value.detail
    with Client(service.base_url, webhook_secret=SECRET) as sender:
        with pytest.raises(UnprocessableEntity) as invalid:
            sender.ingest_pages([page(1), {"type": "conversation"}])
        assert {e["loc"] for e in invalid.value.errors} >= {"pages[1].slug"}
        with pytest.raises(PayloadTooLarge):
            sender.ingest_page({**page(2), "compiled_truth": "x" * BODY_CAP})
        [job] = sender.ingest_page(page(3)).jobs
    # A delivery signed a minute before the one stored (a late retry from another sender) is refused.
    with (
        Client(service.base_url, webhook_secret=SECRET, clock=lambda: time.time() - 60) as late,
        pytest.raises(Conflict) as stale,
    ):
        late.ingest_page({**page(3), "title": "an older edit"})
    assert stale.value.body["slug"] == page(3)["slug"]
    with Client(service.base_url, api_key=reader_key) as reader:
        with pytest.raises(NotFound) as missing:
            reader.get_job(10**9)
        assert missing.value.detail == f"no job {10**9}"
        with pytest.raises(PermissionDenied) as refused:
            reader.retry_job(job.job_id)
        assert "admin" in refused.value.detail
        settle(reader, [job.job_id])


def settle(client: Client, job_ids: list[int]) -> None:
    """Wait for the jobs, so the next test's TRUNCATE does not race the worker."""
    for job_id in job_ids:
        client.wait_for_job(job_id, timeout=120)


def test_a_lost_answer_is_retried_with_the_same_key_and_makes_one_job(service: Service, factory):
    transport = Recording(lose=1)
    fast = RetryPolicy(backoff=0.01)
    with Client(service.base_url, webhook_secret=SECRET, transport=transport, retry=fast) as sender:
        accepted = sender.ingest_page(page(10))
    first, second = transport.requests
    key = first.headers["Idempotency-Key"]
    assert key and second.headers["Idempotency-Key"] == key
    assert SIGNATURE_HEADER in second.headers
    # The server acted on the first send; the second is the stored answer replayed.
    assert transport.responses[1].headers.get("Idempotent-Replayed") == "true"
    assert transport.responses[0].json() == transport.responses[1].json() == accepted.model_dump()
    with Client(service.base_url, webhook_secret=SECRET) as sender:
        # The same logical call sent twice with one key: one job, the same answer.
        again = sender.ingest_page(page(11), idempotency_key="client-delivery-1")
        assert sender.ingest_page(page(11), idempotency_key="client-delivery-1") == again
    with Client(service.base_url, api_key=new_key(factory, ["read"])) as reader:
        slugs = [job.slug for job in reader.iter_jobs(kind="extraction")]  # not the consolidation jobs
        settle(reader, [accepted.jobs[0].job_id, again.jobs[0].job_id])
    assert sorted(slugs) == ["conversations/client/10", "conversations/client/11"]


class RefusedOnce(Recording):
    """Answers the first request 503 itself (nothing reaches the server); ``meanwhile`` runs first."""

    def __init__(self, meanwhile: Any) -> None:
        super().__init__()
        self.meanwhile = meanwhile

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        if not self.requests:
            self.requests.append(request)
            self.meanwhile()
            return httpx.Response(503, headers={"Retry-After": "0"}, json={"detail": "busy"}, request=request)
        return super().handle_request(request)


def test_a_retry_keeps_its_first_signed_time_and_rolls_no_newer_page_back(service: Service, factory):
    """The server keeps a page's newest delivery by its signed time. A retry was signed anew: after
    another sender stored a newer version meanwhile, the retried older one looked newer and replaced
    it. The call's attempts keep its first time (re-dated only once a server would refuse it)."""
    slug = "conversations/client/raced"
    older, newer = dict(page(40), slug=slug, title="older"), dict(page(41), slug=slug, title="newer")

    stored: list[int] = []

    def another_sender_stores_the_newer_one() -> None:
        with Client(service.base_url, webhook_secret=SECRET) as other:
            stored.extend(job.job_id for job in other.ingest_page(newer).jobs)

    offsets = iter([-20.0, 30.0, 30.0, 30.0])  # the first attempt signed 20 s ago, the retry later
    transport = RefusedOnce(another_sender_stores_the_newer_one)
    fast = RetryPolicy(backoff=0.01)
    with (
        Client(
            service.base_url,
            webhook_secret=SECRET,
            transport=transport,
            retry=fast,
            clock=lambda: time.time() + next(offsets),
        ) as sender,
        pytest.raises(Conflict, match="older than the stored one"),
    ):
        sender.ingest_page(older)
    first, second = transport.requests
    assert first.headers[SIGNATURE_HEADER].split(",")[0] == second.headers[SIGNATURE_HEADER].split(",")[0]
    with Client(service.base_url, webhook_secret=SECRET) as reader_of_the_stored:
        again = reader_of_the_stored.ingest_page(newer)  # unchanged: the stored page is still the newer one
    assert [ref.slug for ref in again.unchanged] == [slug], again
    with Client(service.base_url, api_key=new_key(factory, ["read"])) as reader:
        settle(reader, stored)


def test_a_retry_is_signed_anew_after_the_time_the_client_is_told(service: Service):
    """The 60 s a retry kept its first signed time was fixed: against a server whose tolerance is below
    it (FACTMILL_WEBHOOK_TOLERANCE_SECONDS may be 30), a retry after a timeout was refused as too old
    (401, not retried) and the delivery lost."""
    offsets = iter([-20.0, 30.0, 30.0, 30.0])  # the first attempt signed 20 s ago, the retry 50 s after
    transport = RefusedOnce(lambda: None)
    with Client(
        service.base_url,
        webhook_secret=SECRET,
        transport=transport,
        retry=RetryPolicy(backoff=0.01),
        clock=lambda: time.time() + next(offsets),
        redate_after_seconds=10,
    ) as sender:
        sender.ingest_page(dict(page(42), slug="conversations/client/redated"))
    first, second = transport.requests
    assert first.headers[SIGNATURE_HEADER].split(",")[0] != second.headers[SIGNATURE_HEADER].split(",")[0]
    with pytest.raises(ValueError, match="redate_after_seconds must be 0 or more"):
        Client(service.base_url, redate_after_seconds=-1)


def test_iter_jobs_follows_the_cursor_over_more_jobs_than_a_page(service: Service, factory):
    with Client(service.base_url, webhook_secret=SECRET) as sender:
        accepted = sender.ingest_pages([page(n) for n in range(20, 27)])
    created = sorted(job.job_id for job in accepted.jobs)
    transport = Recording()
    with Client(service.base_url, api_key=new_key(factory, ["read"]), transport=transport) as reader:
        jobs = list(reader.iter_jobs(kind="extraction", page_size=3))
        settle(reader, created)
    assert [job.id for job in jobs] == sorted(created, reverse=True)
    cursors = [r.url.params.get("before_id") for r in transport.requests if r.url.path == "/v1/jobs"]
    assert cursors == [None, str(jobs[2].id), str(jobs[5].id)]


def test_iter_pages_follows_the_cursor_and_a_source_limited_key_sees_its_own(service: Service, factory):
    """GET /v1/pages: by source and slug, each with its current facts and last extraction job."""
    listed = [dict(page(n), source_id="lister", slug=f"lister/p{n}") for n in range(5)]
    with Client(service.base_url, webhook_secret=SECRET) as sender:
        accepted = sender.ingest_pages([*listed, dict(page(9), source_id="other", slug="other/p9")])
    transport = Recording()
    with Client(service.base_url, api_key=new_key(factory, ["read"]), transport=transport) as reader:
        settle(reader, [job.job_id for job in accepted.jobs])
        pages = list(reader.iter_pages(source_id="lister", page_size=2))
        under = reader.list_pages(source_id="lister", slug_prefix="lister/p3")
    assert [p.slug for p in pages] == [f"lister/p{n}" for n in range(5)]
    assert all(p.last_job_status == "succeeded" and p.facts >= 1 for p in pages), pages
    assert [p.slug for p in under.pages] == ["lister/p3"] and under.next_after is None
    cursors = [r.url.params.get("after") for r in transport.requests if r.url.path == "/v1/pages"]
    assert cursors[:3] == [None, "lister|lister/p1", "lister|lister/p3"]
    with Client(service.base_url, api_key=new_key(factory, ["read"], source_ids=["other"])) as limited:
        assert [p.slug for p in limited.list_pages().pages] == ["other/p9"]
        with pytest.raises(PermissionDenied):
            limited.list_pages(source_id="lister")
        # An entity's facts: only those of the key's sources.
        entities = {f.entity_slug for f in limited.page_facts("other", "other/p9").facts} - {None}
        for entity in entities:
            assert {f.source_id for f in limited.iter_entity_facts(entity)} == {"other"}
        assert entities
        with pytest.raises(PermissionDenied):
            limited.entity_facts("people/alice-example", source_id="lister")


def test_admin_calls_config_and_erasure(service: Service, factory):
    with Client(service.base_url, webhook_secret=SECRET) as sender:
        [job] = sender.ingest_page(page(30)).jobs
    with Client(service.base_url, api_key=new_key(factory, ["admin", "read"])) as admin:
        settle(admin, [job.job_id])
        assert admin.get_config("facts.extraction_enabled").enabled is True
        assert admin.set_config("extraction.max_segment_failures", 5).value == "5"
        assert admin.get_config("extraction.max_segment_failures").value == "5"
        # The whole table: every key workers read, set or not (GET /v1/config).
        listed = {c.key: c for c in admin.list_config().config}
        assert listed["extraction.max_segment_failures"].value == "5"
        assert listed["facts.extraction_enabled"].enabled is True and "llm.prices" in listed
        assert admin.unset_config("extraction.max_segment_failures").value is None
        with pytest.raises(NotFound):  # a known key, no longer set
            admin.get_config("extraction.max_segment_failures")
        erased = admin.delete_page("default", "conversations/client/30")
        assert erased.slug == "conversations/client/30"
        with pytest.raises(NotFound):
            admin.delete_page("default", "conversations/client/30")


def test_backfills_start_list_show_and_cancel(service: Service, factory):
    with Client(service.base_url, webhook_secret=SECRET) as sender:
        [job] = sender.ingest_page(page(40)).jobs
    with Client(service.base_url, api_key=new_key(factory, ["admin", "read"])) as admin:
        settle(admin, [job.job_id])
        with pytest.raises(NotFound, match="nothing to backfill"):
            admin.start_backfill("no-such-source")
        started = admin.start_backfill(slug_prefix="conversations/client/40", max_segments=10)
        assert admin.wait_for_job(started.job_id, timeout=120).status == "succeeded"
        shown = admin.get_backfill(started.id)  # its one page was extracted already: nothing pending
        assert (shown.status, shown.job_status, shown.requests["total"]) == ("done", "succeeded", 0)
        assert shown.filters["max_segments"] == 10 and shown.batches == []
        [listed] = admin.list_backfills(status="done").backfills
        assert listed.id == started.id and listed.source_id == "default"
        assert admin.list_backfills(before_id=started.id).backfills == []
        assert admin.cancel_backfill(started.id).status == "done"  # finished: answered as it is
        with pytest.raises(NotFound):
            admin.get_backfill(started.id + 1000)
    with (
        Client(service.base_url, api_key=new_key(factory, ["read"])) as reader,
        pytest.raises(PermissionDenied),
    ):
        reader.list_backfills()


def test_a_transcript_named_dot_dot_is_reached_through_its_own_routes(service: Service, factory):
    key = new_key(factory, ["read", "ingest"])
    with Client(service.base_url, api_key=key) as client:
        appended = client.append_messages(
            "..", [{"role": "user", "text": "hi"}, {"role": "user", "text": "yo"}]
        )
        assert appended.last_seq == appended.first_seq + 1
        assert client.get_transcript("..").transcript_id == ".."
        assert [m.text for m in client.iter_messages("..")] == ["hi", "yo"]
        with pytest.raises(NotFound):  # never written: its own 404, not the list route's answer
            client.get_transcript(".")


def test_transcript_settings_compactions_feedback_and_calibration(service: Service, factory):
    """The client had no call for them: a user labelling a compaction (README's flow) signed and keyed
    POST /v1/feedback by hand, and could not list the compactions to label."""
    from models import Compaction

    key = new_key(factory, ["read", "ingest"])
    with Client(service.base_url, api_key=key) as client:
        settings = client.set_transcript_settings(
            "labelled", {"context_window": 9000, "reserve_tokens": 1000}
        )
        assert (settings.settings.context_window, settings.settings.reserve_tokens) == (9000, 1000)
        again = client.set_transcript_settings("labelled", {"instructions": "keep the numbers"})
        assert again.settings.context_window == 9000 and again.settings.instructions == "keep the numbers"
        with factory.begin() as session:  # a compaction the gate judged (the worker's to make, normally)
            row = Compaction(
                transcript_id="labelled", status="rejected", cut_seq=0, tokens_before=10, coverage=0.7
            )
            session.add(row)
            session.flush()
            compaction_id = row.id
        [listed] = client.list_compactions("labelled").compactions
        assert (listed.id, listed.coverage) == (compaction_id, 0.7)
        before = client.get_calibration().observations.n
        label = {"origin": "eval:client", "compaction_id": compaction_id, "idempotency_key": "label-1"}
        first = client.record_feedback(listed.coverage, True, **label)
        repeat = client.record_feedback(listed.coverage, True, **label)
        assert (first.duplicate, repeat.duplicate, repeat.id) == (False, True, first.id)
        calibration = client.get_calibration(limit=5)
        assert calibration.observations.n == before + 1 and calibration.tau > 0
        with pytest.raises(Conflict):  # a coverage other than the one the compaction scored
            client.record_feedback(0.2, False, origin="eval:client", compaction_id=compaction_id)


def test_async_client_appends_a_transcript_and_pages_through_it(service: Service, factory):
    key = new_key(factory, ["read", "ingest"])
    messages = [{"role": "user" if i % 2 == 0 else "assistant", "text": f"message {i}"} for i in range(5)]

    async def scenario() -> dict[str, Any]:
        async with AsyncClient(service.base_url, api_key=key) as client:
            appended = await client.append_messages("client-t1", messages[:3])
            await client.append_messages("client-t1", messages[3:])
            history = [m async for m in client.iter_messages("client-t1", page_size=2)]
            context = await client.get_context("client-t1")
            await client.append_messages("client-t0", messages[:1])
            listed = await client.list_transcripts(limit=2)
            pages = await client.ingest_pages([page(40), page(41), page(42)])
            # The pages' extraction jobs (a consolidation job an extraction requested meanwhile is on a
            # queue this service's worker does not read: listed, it was waited for in vain).
            jobs = [job.id async for job in client.iter_jobs(kind="extraction", page_size=2)]
            for job_id in jobs:
                await client.wait_for_job(job_id, timeout=120)
            with pytest.raises(NotFound) as missing:
                await client.get_transcript("never-written")
            return {
                "appended": appended,
                "history": history,
                "context": context,
                "pages": pages,
                "jobs": jobs,
                "missing": missing.value.detail,
                "listed": listed,
            }

    out = asyncio.run(scenario())
    first = out["appended"].first_seq
    assert out["appended"].last_seq == first + 2
    assert [m.text for m in out["history"]] == [m["text"] for m in messages]
    assert [m.seq for m in out["history"]] == list(range(first, first + 5))
    assert [m.text for m in out["context"].messages] == [m["text"] for m in messages]
    assert sorted(out["jobs"]) == sorted(job.job_id for job in out["pages"].jobs)
    assert "never-written" in out["missing"]
    # Most recently changed first, each with its messages and tokens (GET /v1/transcripts).
    listed = [(t.transcript_id, t.messages) for t in out["listed"].transcripts]
    assert listed == [("client-t0", 1), ("client-t1", 5)]
