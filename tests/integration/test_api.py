"""The HTTP API against a real Postgres (and Redis for readiness and the real Celery sender)."""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import re
import time
import typing
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from datetime import UTC, datetime, timedelta
from types import SimpleNamespace
from typing import Any

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import create_engine, func, make_url, select, text, update
from sqlalchemy.orm import Session, sessionmaker

from factmill_client.signing import signable_key
from models import JOB_STATUSES, ConfigEntry, Fact, Job, Page, WebhookDelivery, forget_deliveries
from tests.auth import send_key
from tests.maintenance import maintained
from tests.service import SessionBroker
from worker.api.app import create_app
from worker.api.routes.jobs import JobKind, JobStatus
from worker.api.routes.pages import store_pages
from worker.config_store import CONFIG_KEYS, ConfigReader
from worker.core.signing import compute_signature, sign
from worker.deliveries import deliver_once, scoped_key
from worker.extraction.pages import PageIn
from worker.jobs import outbox
from worker.jobs.registry import kind_names
from worker.runtime import Runtime
from worker.settings import Settings

pytestmark = pytest.mark.integration

SECRET = "test-secret"
ADMIN = "test-admin"
# Tests that talk to Redis pass the session's broker_url; the rest get one that never answers.
NO_BROKER = "redis://127.0.0.1:1/0"
ADMIN_HEADERS = {"Authorization": f"Bearer {ADMIN}"}
CONVERSATION = "**Alice** (2024-03-15 9:00 AM): I signed the offer.\n**Bob** (2024-03-15 9:01 AM): Congrats!"


class Recorder:
    """A sender that records hand-offs and whether the job row was visible (committed) at that moment."""

    def __init__(self, factory: sessionmaker[Session]) -> None:
        self.factory = factory
        self.calls: list[tuple[str, int, str]] = []
        self.committed: list[bool] = []

    def __call__(self, task_name: str, job_id: int, queue: str) -> None:
        with self.factory() as session:  # a separate connection: sees only committed rows
            self.committed.append(session.get(Job, job_id) is not None)
        self.calls.append((task_name, job_id, queue))

    @property
    def job_ids(self) -> list[int]:
        return [job_id for _, job_id, _ in self.calls]


def make_runtime(database_url: str, factory: sessionmaker[Session], **settings: Any) -> Runtime:
    values: dict[str, Any] = {
        "database_url": database_url,
        "webhook_secret": SECRET,
        "admin_token": ADMIN,
        "broker_url": NO_BROKER,
    }
    return Runtime(
        settings=Settings(**(values | settings)), factory=factory, config=ConfigReader(factory, ttl=0)
    )


@pytest.fixture
def recorder(tx_factory: sessionmaker[Session]) -> Recorder:
    return Recorder(tx_factory)


@pytest.fixture
def client(
    database_url: str, broker_url: str, tx_factory: sessionmaker[Session], recorder: Recorder
) -> Iterator[TestClient]:
    runtime = make_runtime(database_url, tx_factory, broker_url=broker_url)  # /readyz checks the broker
    with TestClient(create_app(runtime, sender=recorder)) as test_client:
        send_key(test_client, tx_factory)  # reads send a read-scoped key; writes sign, admin routes say so
        yield test_client


# Tests that assert the job row was committed before the hand-off need real commits: inside a rolled-back
# outer transaction no other connection ever sees the row. They use these two over the truncating `factory`.
@pytest.fixture
def committed_recorder(factory: sessionmaker[Session]) -> Recorder:
    return Recorder(factory)


@pytest.fixture
def committed_client(
    database_url: str, broker_url: str, factory: sessionmaker[Session], committed_recorder: Recorder
) -> Iterator[TestClient]:
    runtime = make_runtime(database_url, factory, broker_url=broker_url)
    with TestClient(create_app(runtime, sender=committed_recorder)) as test_client:
        send_key(test_client, factory)
        yield test_client


def page(slug: str, body: str = CONVERSATION, **fields: Any) -> dict[str, Any]:
    return {"slug": slug, "type": "conversation", "title": slug, "compiled_truth": body, **fields}


def post(
    client: TestClient,
    payload: Any = None,
    *,
    raw: bytes | None = None,
    key: str | None = None,
    secret: str = SECRET,
    timestamp: int | None = None,
    signature: str | None = "sign",
    extra_headers: dict[str, str] | None = None,
) -> Any:
    body = raw if raw is not None else json.dumps(payload).encode()
    headers = {"Content-Type": "application/json", **(extra_headers or {})}
    if signature == "sign" and (key is None or signable_key(key)):
        headers["Factmill-Signature"] = sign(
            body, secret, timestamp, method="POST", path="/v1/pages", idempotency_key=key
        )
    elif signature == "sign":  # a key no v4 signature binds: signed as a sender before v4 did (v2)
        t = int(time.time()) if timestamp is None else timestamp
        headers["Factmill-Signature"] = f"t={t},v2={compute_signature(body, secret, t, 'POST', '/v1/pages')}"
    elif signature is not None:
        headers["Factmill-Signature"] = signature
    if key is not None:
        headers["Idempotency-Key"] = key
    return client.post("/v1/pages", content=body, headers=headers)


def count(factory: sessionmaker[Session], model: Any) -> int:
    with factory() as session:
        return session.scalar(select(func.count()).select_from(model)) or 0


def set_job(factory: sessionmaker[Session], job_id: int, **values: Any) -> None:
    with factory.begin() as session:
        session.execute(update(Job).where(Job.id == job_id).values(**values))


# ---------------------------------------------------------------------------
# POST /v1/pages
# ---------------------------------------------------------------------------


def test_signed_webhook_stores_page_and_job_and_sends_after_commit(
    committed_client: TestClient, factory: sessionmaker[Session], committed_recorder: Recorder
) -> None:
    response = post(committed_client, page("conversations/alice"))
    assert response.status_code == 202, response.text
    body = response.json()
    assert body["unchanged"] == []
    [job] = body["jobs"]
    assert job == {
        "job_id": job["job_id"],
        "source_id": "default",
        "slug": "conversations/alice",
        "created": True,
    }
    assert committed_recorder.calls == [("tasks.extraction.extract_page", job["job_id"], "extraction")]
    assert committed_recorder.committed == [True]  # the row was committed before the hand-off
    with factory() as session:
        stored = session.get(Job, job["job_id"])
        assert stored is not None
        assert (stored.kind, stored.subject, stored.status) == (
            "extraction",
            "default|conversations/alice",
            "queued",
        )
        assert stored.enqueued_at is not None
        assert (
            session.scalar(select(Page.title).where(Page.slug == "conversations/alice"))
            == "conversations/alice"
        )


@pytest.mark.parametrize("shape", ["wrapped", "list"])
def test_batch_of_pages(
    client: TestClient, tx_factory: sessionmaker[Session], recorder: Recorder, shape: str
) -> None:
    pages = [page(f"batch/p{i}", source_id="src-b" if i % 2 else "default") for i in range(5)]
    response = post(client, {"pages": pages} if shape == "wrapped" else pages)
    assert response.status_code == 202, response.text
    accepted = response.json()["jobs"]
    assert [(j["source_id"], j["slug"]) for j in accepted] == [
        (p.get("source_id", "default"), p["slug"]) for p in pages
    ]
    assert all(j["created"] for j in accepted)
    assert sorted(recorder.job_ids) == sorted(j["job_id"] for j in accepted)
    assert count(tx_factory, Page) == 5 and count(tx_factory, Job) == 5


def test_duplicate_delivery_replays_the_original_answer(
    client: TestClient, tx_factory: sessionmaker[Session], recorder: Recorder
) -> None:
    payload = {"pages": [page("dup/a"), page("dup/b")]}
    first = post(client, payload, key="delivery-1")
    assert first.status_code == 202
    # The signature is checked before any replay: a stale copy of the delivery gets nothing.
    assert post(client, payload, key="delivery-1", timestamp=1).status_code == 401
    # A retried delivery is signed again (new timestamp) but carries the same body and key.
    second = post(client, payload, key="delivery-1")
    assert second.status_code == 202
    assert second.json() == first.json()
    assert second.headers.get("Idempotent-Replayed") == "true"
    assert (
        count(tx_factory, Job) == 2
        and count(tx_factory, Page) == 2
        and count(tx_factory, WebhookDelivery) == 1
    )
    assert len(recorder.calls) == 2  # nothing sent again


def test_two_senders_may_use_the_same_idempotency_key(
    client: TestClient, tx_factory: sessionmaker[Session]
) -> None:
    """The stored key named no sender: a tenant's key limited to source "a" used "delivery-1", and
    another tenant's own first delivery under that key was refused ("reused with a different body"),
    which also told it that someone else had used the key."""
    from tests.auth import bearer, new_key

    first, second = (new_key(tx_factory, ["ingest"], [source]) for source in ("a", "b"))
    for key, source in ((first, "a"), (second, "b")):
        body = json.dumps(page("same/key") | {"source_id": source})
        headers = {**bearer(key), "Idempotency-Key": "delivery-1", "Content-Type": "application/json"}
        answered = client.post("/v1/pages", content=body, headers=headers)
        assert answered.status_code == 202, answered.text
        assert "Idempotent-Replayed" not in answered.headers
    assert count(tx_factory, Page) == 2 and count(tx_factory, WebhookDelivery) == 2
    # The same sender again: its stored answer, not a second delivery.
    body = json.dumps(page("same/key") | {"source_id": "a"})
    headers = {**bearer(first), "Idempotency-Key": "delivery-1", "Content-Type": "application/json"}
    assert client.post("/v1/pages", content=body, headers=headers).headers["Idempotent-Replayed"] == "true"


def test_only_a_digest_of_the_senders_key_is_kept(
    client: TestClient, tx_factory: sessionmaker[Session], caplog: pytest.LogCaptureFixture
) -> None:
    """A key a sender chose may name a person; an erasure cannot know which do, so none is kept,
    in the table or in the logs."""
    caplog.set_level(logging.DEBUG)
    key = "alice-example-chat-2024-03-15"
    assert post(client, page("digest/a"), key=key).status_code == 202
    with tx_factory() as session:
        [stored] = session.scalars(select(WebhookDelivery.idempotency_key)).all()
    assert (
        stored == scoped_key("POST /v1/pages", "", key, "signature")
        and len(stored) == 64
        and "alice" not in stored
    )
    assert int(stored, 16) >= 0  # hex
    replay = post(client, page("digest/a"), key=key)
    assert replay.headers.get("Idempotent-Replayed") == "true"
    assert "replayed webhook delivery" in caplog.text and "alice" not in caplog.text


def test_same_key_with_a_different_body_is_refused(
    client: TestClient, tx_factory: sessionmaker[Session]
) -> None:
    assert post(client, page("reuse/a"), key="k-1").status_code == 202
    response = post(client, page("reuse/b"), key="k-1")
    assert response.status_code == 422
    assert "Idempotency-Key reused with a different body" in response.json()["detail"]
    assert count(tx_factory, Page) == 1


def age_deliveries(factory: sessionmaker[Session], hours: float, key: str | None = None) -> None:
    """Make the stored answers (or the one stored under ``key``) ``hours`` old."""
    aged = update(WebhookDelivery).values(created_at=func.now() - timedelta(hours=hours))
    if key is not None:
        aged = aged.where(WebhookDelivery.idempotency_key == key)
    with factory.begin() as session:
        session.execute(aged)


def test_an_answer_past_its_window_is_forgotten_and_its_key_is_new_again(
    client: TestClient, database_url: str, tx_factory: sessionmaker[Session]
) -> None:
    runtime = make_runtime(database_url, tx_factory, idempotency_key_hours=24)
    assert post(client, page("window/a"), key="k-w").status_code == 202
    age_deliveries(tx_factory, 23)
    assert maintained(runtime).forgotten_deliveries == 0
    assert post(client, page("window/b"), key="k-w").status_code == 422  # kept: still the same delivery
    age_deliveries(tx_factory, 25)
    assert maintained(runtime).forgotten_deliveries == 1
    again = post(client, page("window/b"), key="k-w")
    assert again.status_code == 202 and "Idempotent-Replayed" not in again.headers
    assert count(tx_factory, Page) == 2 and count(tx_factory, WebhookDelivery) == 1


def test_forgetting_takes_the_oldest_answers_first_a_batch_at_a_time(
    tx_factory: sessionmaker[Session],
) -> None:
    with tx_factory.begin() as session:
        session.add_all(
            WebhookDelivery(idempotency_key=key, body_hash="h", response={})
            for key in ("young", *(f"old-{n}" for n in range(5)))
        )
    for n in range(5):
        age_deliveries(tx_factory, 48 + n, key=f"old-{n}")  # old-4 is the oldest
    kept = timedelta(hours=24)
    with tx_factory.begin() as session:
        assert forget_deliveries(session, kept, 3) == 3
    with tx_factory() as session:
        kept_keys = set(session.scalars(select(WebhookDelivery.idempotency_key)))
        assert kept_keys == {"young", "old-0", "old-1"}
    with tx_factory.begin() as session:
        assert forget_deliveries(session, kept, 3) == 2
        assert forget_deliveries(session, kept, 3) == 0
    assert count(tx_factory, WebhookDelivery) == 1


# Truncation: two connections, one blocked on the other's uncommitted idempotency key.
def test_concurrent_duplicate_delivery_returns_the_stored_answer(factory: sessionmaker[Session]) -> None:
    """The delivery row is inserted by a concurrent request that commits while ours waits on its key."""
    pages = [PageIn(slug="race/a", type="conversation", compiled_truth=CONVERSATION)]
    body_hash = hashlib.sha256(b"same body").hexdigest()
    stored = {
        "jobs": [{"job_id": 42, "source_id": "default", "slug": "race/a", "created": True}],
        "unchanged": [],
    }
    other = factory()
    other.begin()
    other.add(WebhookDelivery(idempotency_key="race-key", body_hash=body_hash, response=stored))
    other.flush()
    try:
        with ThreadPoolExecutor(1) as pool:
            future = pool.submit(store_pages, factory, pages, "race-key", body_hash)
            with pytest.raises(TimeoutError):
                future.result(timeout=0.5)  # blocked on the other transaction's key
            other.commit()
            response, pending, replayed = future.result(timeout=10)
    finally:
        other.close()
    assert (response, pending, replayed) == (stored, [], True)
    assert count(factory, Page) == 0 and count(factory, Job) == 0  # our work was rolled back


# Truncation: two threads, each with its own connection.
def test_a_second_copy_waits_for_the_first_and_replays_its_answer(factory: sessionmaker[Session]) -> None:
    """A client's retry that arrives while its first try still runs: it read no stored answer, ran its own
    write beside the first, and that write failed on what the first had stored (a tool result "already
    answered": 422) before it reached the key's unique index that would have replayed the answer."""
    import threading

    first_writing, release = threading.Event(), threading.Event()
    writes: list[str] = []

    def write(name: str) -> Any:
        def run(session: Session) -> tuple[dict[str, Any], str]:
            writes.append(name)
            if name == "first":
                first_writing.set()
                assert release.wait(10)
            return {"stored_by": name}, name

        return run

    key = scoped_key("/v1/transcripts/t/messages", "t", "retry-key", "signature")
    with ThreadPoolExecutor(2) as pool:
        first = pool.submit(deliver_once, factory, key, "hash", write("first"))
        assert first_writing.wait(10)
        second = pool.submit(deliver_once, factory, key, "hash", write("second"))
        with pytest.raises(TimeoutError):
            second.result(timeout=0.5)  # waits on the first copy's key
        release.set()
        assert first.result(timeout=10) == ({"stored_by": "first"}, "first")
        assert second.result(timeout=10) == ({"stored_by": "first"}, None)
    assert writes == ["first"]


@pytest.mark.parametrize(
    ("kwargs", "reason"),
    [
        ({"secret": "wrong-secret"}, "does not match"),
        ({"signature": None}, "missing Factmill-Signature"),
        ({"signature": "v1=abc"}, "malformed"),
        ({"timestamp": "stale"}, "too old"),
    ],
)
def test_unsigned_or_badly_signed_webhook_is_401(
    client: TestClient,
    tx_factory: sessionmaker[Session],
    recorder: Recorder,
    kwargs: dict[str, Any],
    reason: str,
) -> None:
    if kwargs.get("timestamp") == "stale":
        kwargs = {"timestamp": int(time.time()) - 6 * 60}
    response = post(client, page("unsigned/a"), **kwargs)
    assert response.status_code == 401
    assert reason in response.json()["detail"]
    assert response.headers["WWW-Authenticate"] == "Bearer"  # every 401 names a challenge (RFC 9110)
    assert count(tx_factory, Page) == 0 and recorder.calls == []


def test_altered_body_is_401(client: TestClient) -> None:
    body = json.dumps(page("altered/a")).encode()
    header = sign(body, SECRET, method="POST", path="/v1/pages")
    response = client.post(
        "/v1/pages", content=body.replace(b"altered", b"tampered"), headers={"Factmill-Signature": header}
    )
    assert response.status_code == 401 and "does not match" in response.json()["detail"]


# ---------------------------------------------------------------------------
# Size cap
# ---------------------------------------------------------------------------

CAP = 4096


@pytest.fixture
def small_client(
    database_url: str, tx_factory: sessionmaker[Session], recorder: Recorder
) -> Iterator[TestClient]:
    runtime = make_runtime(database_url, tx_factory, max_body_bytes=CAP)
    with TestClient(create_app(runtime, sender=recorder)) as test_client:
        yield test_client


def big_body() -> bytes:
    return json.dumps(page("big/a", body="x" * (CAP * 2))).encode()


def test_declared_length_over_the_cap_is_413(
    small_client: TestClient, tx_factory: sessionmaker[Session]
) -> None:
    body = big_body()
    response = small_client.post(
        "/v1/pages",
        content=body,
        headers={"Factmill-Signature": sign(body, SECRET, method="POST", path="/v1/pages")},
    )
    assert response.status_code == 413
    assert f"{CAP}-byte limit" in response.json()["detail"]
    assert count(tx_factory, Page) == 0


def test_chunked_body_without_length_over_the_cap_is_413(
    small_client: TestClient, tx_factory: sessionmaker[Session]
) -> None:
    body = big_body()

    def chunks() -> Iterator[bytes]:
        for start in range(0, len(body), 1000):
            yield body[start : start + 1000]

    response = small_client.post(
        "/v1/pages",
        content=chunks(),
        headers={"Factmill-Signature": sign(body, SECRET, method="POST", path="/v1/pages")},
    )
    assert response.status_code == 413
    assert count(tx_factory, Page) == 0


def test_chunked_body_over_the_cap_on_a_route_with_a_body_model_is_413(small_client: TestClient) -> None:
    """FastAPI reads a body model's body itself and answers any exception there with "400 There was an
    error parsing the body": POST /v1/backfills said 400 for a body the cap refused."""
    body = json.dumps({"source_id": "x" * (CAP * 2)}).encode()

    def chunks() -> Iterator[bytes]:
        for start in range(0, len(body), 1000):
            yield body[start : start + 1000]

    response = small_client.post("/v1/backfills", content=chunks(), headers=ADMIN_HEADERS)
    assert response.status_code == 413, response.text
    assert "request body is over the 4096-byte limit" in response.json()["detail"]


def test_lying_content_length_is_413(small_client: TestClient) -> None:
    body = big_body()
    headers = {
        "Factmill-Signature": sign(body, SECRET, method="POST", path="/v1/pages"),
        "Content-Length": "100",
    }
    response = small_client.post("/v1/pages", content=body, headers=headers)
    assert response.status_code == 413


def test_body_under_the_cap_is_accepted(small_client: TestClient) -> None:
    assert post(small_client, page("small/a", body="short")).status_code == 202


def run_asgi(app: Any, headers: list[tuple[bytes, bytes]], chunk: bytes, chunks: int) -> tuple[int, int]:
    """Drive the app at the ASGI level so the body really streams; returns (status, chunks read)."""
    pulled = 0
    sent: list[dict[str, Any]] = []

    async def receive() -> dict[str, Any]:
        nonlocal pulled
        pulled += 1
        return {"type": "http.request", "body": chunk, "more_body": pulled < chunks}

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    scope = {
        "type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST", "scheme": "http",
        "path": "/v1/pages", "raw_path": b"/v1/pages", "root_path": "", "query_string": b"",
        "headers": headers, "client": ("127.0.0.1", 1), "server": ("testserver", 80),
    }  # fmt: skip
    asyncio.run(app(scope, receive, send))
    return sent[0]["status"], pulled


def test_streaming_stops_reading_at_the_cap(database_url: str, tx_factory: sessionmaker[Session]) -> None:
    app = create_app(make_runtime(database_url, tx_factory, max_body_bytes=CAP), sender=Recorder(tx_factory))
    fresh = f"t={int(time.time())},v2=00".encode()  # its match is checked once the body is in
    status, pulled = run_asgi(app, [(b"factmill-signature", fresh)], b"x" * 1000, chunks=1000)
    assert status == 413
    assert pulled == CAP // 1000 + 1  # stopped at the first chunk past the cap, not at the end
    declared = [(b"factmill-signature", b"t=1,v2=00"), (b"content-length", str(CAP * 100).encode())]
    status, pulled = run_asgi(app, declared, b"x" * 1000, chunks=1000)
    assert (status, pulled) == (413, 0)  # refused on the header alone


# ---------------------------------------------------------------------------
# 422s
# ---------------------------------------------------------------------------


def test_malformed_json_is_422(client: TestClient) -> None:
    response = post(client, raw=b'{"slug": "a", ')
    assert response.status_code == 422
    assert "not valid JSON" in response.json()["detail"]


@pytest.mark.parametrize(
    ("payload", "expected"),
    [
        ({"type": "conversation"}, "slug: Field required"),
        (
            {"pages": [page("ok/a"), page("ok/b"), page("ok/c"), {"type": "conversation"}]},
            "pages[3].slug: Field required",
        ),
        ([page("bad slug!")], "pages[0].slug"),
        (page("ok/a", colour="blue"), "colour: Extra inputs are not permitted"),
        ({"pages": "nope"}, "pages: must be a list"),
        ({"pages": []}, "empty"),
        ("just a string", "body must be a page object"),
        ({"pages": [page("x/a")], "extra": 1}, "unexpected field"),
        (page("ok/a", type="   "), "type: must name a page type"),  # stored as type ""
    ],
)
def test_invalid_pages_are_422_naming_the_field(
    client: TestClient, tx_factory: sessionmaker[Session], payload: Any, expected: str
) -> None:
    response = post(client, payload)
    assert response.status_code == 422, response.text
    assert expected in response.json()["detail"]
    assert count(tx_factory, Page) == 0


def test_more_than_1000_pages_is_422(client: TestClient, tx_factory: sessionmaker[Session]) -> None:
    response = post(client, {"pages": [page(f"many/p{i}", body="x") for i in range(1001)]})
    assert response.status_code == 422
    assert "1001 pages" in response.json()["detail"] and "at most 1000" in response.json()["detail"]
    assert count(tx_factory, Page) == 0


def test_bad_idempotency_key_is_422(client: TestClient) -> None:
    response = post(client, page("key/a"), key="x" * 300)
    assert response.status_code == 422 and "Idempotency-Key" in response.json()["detail"]
    # A header is bytes, read as latin-1: "注文-1" arrived holding C1 controls and was refused as not
    # printable; "é" was stored as "Ã©". Printable ASCII, said as such.
    body = json.dumps({"pages": [page("key/b")]}).encode()
    for key in ("order-€", "order-é", "注文-1"):
        headers = {**ADMIN_HEADERS, "Content-Type": "application/json", "Idempotency-Key": key.encode()}
        refused = client.post("/v1/pages", content=body, headers=headers)
        assert refused.status_code == 422, (key, refused.text)
        assert "printable ASCII characters" in refused.json()["detail"], refused.text
    pattern = client.get("/openapi.json").json()["paths"]["/v1/pages"]["post"]["parameters"]
    [header] = [p for p in pattern if p["name"] == "Idempotency-Key"]
    assert json.dumps(r"^ *[!-~](?:[ -~]*[!-~])? *$") in json.dumps(header), header  # the document says so


# ---------------------------------------------------------------------------
# Unchanged and pending pages
# ---------------------------------------------------------------------------


def test_unchanged_content_creates_no_job(
    client: TestClient, tx_factory: sessionmaker[Session], recorder: Recorder
) -> None:
    assert post(client, page("same/a")).status_code == 202
    set_job(tx_factory, recorder.job_ids[0], status="succeeded")
    response = post(client, page("same/a"))
    assert response.status_code == 202
    assert response.json() == {"jobs": [], "unchanged": [{"source_id": "default", "slug": "same/a"}]}
    assert count(tx_factory, Job) == 1 and len(recorder.calls) == 1


def test_page_changed_while_its_job_is_pending_reuses_the_job(
    client: TestClient, tx_factory: sessionmaker[Session], recorder: Recorder
) -> None:
    first = post(client, page("pending/a", body="v1")).json()["jobs"][0]
    second = post(client, page("pending/a", body="v2")).json()["jobs"][0]
    assert second == first | {"created": False}
    set_job(tx_factory, first["job_id"], status="running")
    third = post(client, page("pending/a", body="v3")).json()["jobs"][0]
    assert third["job_id"] == first["job_id"]
    with tx_factory() as session:
        job = session.get(Job, first["job_id"])
        assert job is not None and job.rerun_requested  # the running worker read old content
    assert count(tx_factory, Job) == 1
    # Sent once, when created: a pending job has its message (a queued one waiting out a retry's
    # backoff was sent at once on every delivery and burned its attempts through an outage).
    assert recorder.job_ids == [first["job_id"]]


# ---------------------------------------------------------------------------
# Jobs
# ---------------------------------------------------------------------------


def test_job_literals_match_the_models() -> None:
    assert typing.get_args(JobStatus) == JOB_STATUSES
    assert set(typing.get_args(JobKind)) == set(kind_names())


def test_jobs_list_filter_get_and_404(client: TestClient, tx_factory: sessionmaker[Session]) -> None:
    ids = [j["job_id"] for j in post(client, [page(f"list/p{i}") for i in range(3)]).json()["jobs"]]
    set_job(tx_factory, ids[0], status="failed", last_error="boom")

    listed = client.get("/v1/jobs").json()["jobs"]
    assert [j["id"] for j in listed] == sorted(ids, reverse=True)
    failed = client.get("/v1/jobs", params={"status": "failed"}).json()["jobs"]
    assert [(j["id"], j["last_error"]) for j in failed] == [(ids[0], "boom")]
    assert len(client.get("/v1/jobs", params={"kind": "extraction", "status": "queued"}).json()["jobs"]) == 2
    assert client.get("/v1/jobs", params={"kind": "compaction"}).json()["jobs"] == []
    assert len(client.get("/v1/jobs", params={"limit": 1}).json()["jobs"]) == 1
    assert [j["id"] for j in client.get("/v1/jobs", params={"before_id": ids[1]}).json()["jobs"]] == [ids[0]]

    for params, field in (
        ({"status": "bogus"}, "status"),
        ({"kind": "bogus"}, "kind"),
        ({"limit": 0}, "limit"),
    ):
        response = client.get("/v1/jobs", params=params)
        assert response.status_code == 422
        assert f"query.{field}" in response.json()["detail"]

    one = client.get(f"/v1/jobs/{ids[1]}")
    assert one.status_code == 200
    assert one.json()["source_id"] == "default" and one.json()["slug"] == "list/p1"
    assert one.json()["status"] == "queued"
    assert (one.json()["attempts"], one.json()["worker_losses"]) == (0, 0)
    set_job(tx_factory, ids[1], attempts=2, worker_losses=3)
    assert [(j["attempts"], j["worker_losses"]) for j in client.get("/v1/jobs").json()["jobs"]][1] == (2, 3)
    assert (client.get(f"/v1/jobs/{ids[1]}").json()["worker_losses"]) == 3
    # Why a paused job waits, and since when the LLM provider has served one nothing.
    assert (one.json()["pause_reason"], one.json()["provider_outage_since"]) == (None, None)
    set_job(tx_factory, ids[1], status="paused", pause_reason="batch_fault", provider_outage_since=func.now())
    shown = client.get(f"/v1/jobs/{ids[1]}").json()
    assert shown["pause_reason"] == "batch_fault" and shown["provider_outage_since"] is not None
    missing = client.get("/v1/jobs/999999")
    assert missing.status_code == 404 and missing.json() == {"detail": "no job 999999"}


def test_retry_a_failed_job(
    committed_client: TestClient, factory: sessionmaker[Session], committed_recorder: Recorder
) -> None:
    job_id = post(committed_client, page("retry/a")).json()["jobs"][0]["job_id"]
    # Queued (or running): already on its way, so a retry is refused rather than duplicated.
    assert committed_client.post(f"/v1/jobs/{job_id}/retry", headers=ADMIN_HEADERS).status_code == 409
    set_job(factory, job_id, status="failed", attempts=5, worker_losses=7, last_error="provider down")
    committed_recorder.calls.clear()
    response = committed_client.post(f"/v1/jobs/{job_id}/retry", headers=ADMIN_HEADERS)
    assert response.status_code == 202, response.text
    body = response.json()
    assert (body["status"], body["attempts"], body["worker_losses"], body["last_error"]) == (
        "queued",
        0,
        0,
        None,
    )
    assert committed_recorder.calls == [("tasks.extraction.extract_page", job_id, "extraction")]
    assert committed_recorder.committed == [True, True]
    assert committed_client.post("/v1/jobs/999999/retry", headers=ADMIN_HEADERS).status_code == 404


def test_a_retried_paused_job_says_no_pause_reason(
    committed_client: TestClient, factory: sessionmaker[Session]
) -> None:
    """The retry reset everything but the reason: "queued" was shown with pause_reason "budget" (and an
    operator reading the batch_fault alert's advice read a reason the job no longer had)."""
    job_id = post(committed_client, page("retry/paused")).json()["jobs"][0]["job_id"]
    set_job(factory, job_id, status="paused", pause_reason="budget")
    response = committed_client.post(f"/v1/jobs/{job_id}/retry", headers=ADMIN_HEADERS)
    assert response.status_code == 202, response.text
    assert (response.json()["status"], response.json()["pause_reason"]) == ("queued", None)
    with factory() as session:
        assert session.get(Job, job_id).pause_reason is None  # type: ignore[union-attr]


def test_retry_skipped_of_a_job_that_skips_no_segments_is_422(
    client: TestClient, tx_factory: sessionmaker[Session]
) -> None:
    """A bad argument, not a state to wait out: a 409 tells a client to follow the pending job. (The CLI
    calls it a usage error, exit 2.)"""
    with tx_factory.begin() as session:
        job_id = outbox.request_job(session, "compaction", "a-transcript").job_id
    set_job(tx_factory, job_id, status="failed")
    refused = client.post(f"/v1/jobs/{job_id}/retry?skipped=true", headers=ADMIN_HEADERS)
    assert refused.status_code == 422 and refused.json()["detail"] == (
        f"job {job_id} is a compaction job; only extraction jobs skip segments"
    )


def test_retry_when_a_newer_job_for_the_page_is_pending_is_409(
    client: TestClient, tx_factory: sessionmaker[Session]
) -> None:
    old = post(client, page("retry/b", body="v1")).json()["jobs"][0]["job_id"]
    set_job(tx_factory, old, status="failed")
    new = post(client, page("retry/b", body="v2")).json()["jobs"][0]["job_id"]
    assert new != old
    response = client.post(f"/v1/jobs/{old}/retry", headers=ADMIN_HEADERS)
    assert response.status_code == 409
    assert response.json()["pending_job_id"] == new
    with tx_factory() as session:
        assert session.scalar(select(Job.status).where(Job.id == old)) == "failed"


def test_a_retry_of_a_job_of_a_kind_this_release_does_not_run_is_409_and_changes_nothing(
    client: TestClient, tx_factory: sessionmaker[Session]
) -> None:
    """A row left by another release (a rolling deploy, a downgrade): the retry committed it queued,
    then its send failed (a 500), and no worker or sweep would ever take it."""
    with tx_factory.begin() as session:
        job = Job(kind="summarize-v9", subject="default|x", status="failed", last_error="old")
        session.add(job)
        session.flush()
        job_id = job.id
    response = client.post(f"/v1/jobs/{job_id}/retry", headers=ADMIN_HEADERS)
    assert response.status_code == 409 and "'summarize-v9', which this release does not run" in response.text
    with tx_factory() as session:
        assert session.scalar(select(Job.status).where(Job.id == job_id)) == "failed"


def test_a_retry_409_names_the_pending_job_of_its_own_kind(
    client: TestClient, tx_factory: sessionmaker[Session]
) -> None:
    """A consolidation subject is source|entity: the same text as a page's subject when the page's slug
    is an entity's (people/alice). The 409 named whichever pending job Postgres found first."""
    old = post(client, page("people/alice", body="v1")).json()["jobs"][0]["job_id"]
    set_job(tx_factory, old, status="failed")
    with tx_factory.begin() as session:
        for kind in ("consolidation", "compaction", "calibration"):
            session.add(Job(kind=kind, subject="default|people/alice", status="queued"))
    new = post(client, page("people/alice", body="v2")).json()["jobs"][0]["job_id"]
    response = client.post(f"/v1/jobs/{old}/retry", headers=ADMIN_HEADERS)
    assert response.status_code == 409 and response.json()["pending_job_id"] == new, response.text


# ---------------------------------------------------------------------------
# Facts
# ---------------------------------------------------------------------------


def fact_row(slug: str, row_num: int, text: str, *, is_audit: bool = False) -> Fact:
    return Fact(
        source_id="default", fact=text, kind="fact", confidence=0.9, notability="medium", context="",
        source="cli:extract-conversation-facts", source_session=f"cli:extract-conversation-facts:{slug}",
        source_markdown_slug=slug, row_num=row_num, is_audit=is_audit,
    )  # fmt: skip


def test_a_page_s_facts_and_their_total_are_read_in_one_snapshot(
    database_url: str, factory: sessionmaker[Session]
) -> None:
    """A re-extraction committing between the count and the rows: the total disagreed with the facts
    (`factmill facts list` said "the first 2 of 2" over three)."""
    from sqlalchemy import event

    slug = "conversations/snapshot"
    with factory.begin() as session:
        session.add(Page(source_id="default", slug=slug, type="conversation", content_hash="x"))
        session.add_all([fact_row(slug, 0, "First."), fact_row(slug, 1, "Second.")])
    engine = factory.kw["bind"]
    writer = create_engine(database_url)

    committed: list[bool] = []

    def commit_a_fact_after_the_count(conn: Any, cursor: Any, statement: str, *args: Any) -> None:
        if "count(" in statement.lower() and not committed:
            committed.append(True)
            with sessionmaker(writer).begin() as other:
                other.add(fact_row(slug, 2, "Third, committed meanwhile."))

    app = create_app(make_runtime(database_url, factory))
    with TestClient(app) as api:
        send_key(api, factory)
        event.listen(engine, "after_cursor_execute", commit_a_fact_after_the_count)
        try:
            body = api.get(f"/v1/pages/default/{slug}/facts").json()
        finally:
            if event.contains(engine, "after_cursor_execute", commit_a_fact_after_the_count):
                event.remove(engine, "after_cursor_execute", commit_a_fact_after_the_count)
            writer.dispose()
    assert committed and body["total"] == len(body["facts"]) == 2, body


def test_facts_endpoint_excludes_audit_rows(client: TestClient, tx_factory: sessionmaker[Session]) -> None:
    slug = "conversations/imessage/alice"
    assert post(client, page(slug)).status_code == 202
    with tx_factory.begin() as session:
        session.add_all(
            [
                fact_row(slug, 1, "Bob congratulated Alice."),
                fact_row(slug, 0, "Alice signed the offer."),
                fact_row(slug, -1, "EXTRACTION_COMPLETE", is_audit=True),
                fact_row("conversations/other", 0, "Unrelated."),
            ]
        )
    response = client.get(f"/v1/pages/default/{slug}/facts")
    assert response.status_code == 200, response.text
    body = response.json()
    assert (body["source_id"], body["slug"], body["total"]) == ("default", slug, 2)
    assert [(f["row_num"], f["fact"]) for f in body["facts"]] == [
        (0, "Alice signed the offer."),
        (1, "Bob congratulated Alice."),
    ]
    paged = client.get(f"/v1/pages/default/{slug}/facts", params={"offset": 1, "limit": 1}).json()
    assert [f["row_num"] for f in paged["facts"]] == [1] and paged["total"] == 2


def test_an_offset_past_ten_thousand_is_refused_with_the_cursor_named(client: TestClient) -> None:
    """Each read takes its first offset + limit rows: ?offset=1000000000 read and sorted an entity's
    every fact (twice) on one reader's request. The MCP tools take the same bound."""
    from pydantic import TypeAdapter, ValidationError

    from worker.mcp.inputs import Offset

    for path in ("/v1/entities/people/alice/facts", "/v1/pages/default/conversations/x/facts"):
        assert client.get(path, params={"offset": 10_000}).status_code in (200, 404)
        refused = client.get(path, params={"offset": 10_001})
        assert refused.status_code == 422 and "10000" in refused.text, refused.text
    with pytest.raises(ValidationError):
        TypeAdapter(Offset).validate_python(10_001)
    assert "page by the list's cursor" in client.get("/openapi.json").text


def test_facts_are_paged_by_cursor_and_facts_that_change_between_reads_are_neither_repeated_nor_skipped(
    client: TestClient, tx_factory: sessionmaker[Session]
) -> None:
    """Paged by offset, a fact stored newer than those read (an entity's list is newest first) shifted
    the rest: one was read twice; a fact superseded between two reads shifted them back: one was
    skipped. The lists answer a cursor past their last fact."""
    slug = "conversations/imessage/paged"
    assert post(client, page(slug)).status_code == 202
    when = datetime(2024, 3, 1, tzinfo=UTC)
    with tx_factory.begin() as session:
        rows = [fact_row(slug, n, f"Alice did thing {n}.") for n in range(5)]
        for n, row in enumerate(rows):
            row.entity_slug, row.valid_from = "people/alice", (when + timedelta(days=n) if n != 4 else None)
        session.add_all(rows)
    entity_url = "/v1/entities/people/alice/facts"
    first = client.get(entity_url, params={"limit": 2}).json()
    assert [f["fact"][-3:-1] for f in first["facts"]] == [" 3", " 2"] and first["next_after"]
    with tx_factory.begin() as session:  # a newer fact comes, and one not yet read is superseded
        newer = fact_row(slug, 5, "Alice did thing 5.")
        newer.entity_slug, newer.valid_from = "people/alice", when + timedelta(days=9)
        undated = [fact_row(slug, n, f"Alice did thing {n}.") for n in (6, 7)]
        for row in undated:
            row.entity_slug = "people/alice"
        session.add_all([newer, *undated])
        session.execute(update(Fact).where(Fact.fact == "Alice did thing 1.").values(status="superseded"))
    rest, after = [], first["next_after"]
    while after is not None:  # a fact a page: the undated ones are paged by id alone
        got = client.get(entity_url, params={"limit": 1, "after": after}).json()
        rest += [f["fact"] for f in got["facts"]]
        after = got["next_after"]
    assert rest == [f"Alice did thing {n}." for n in (0, 7, 6, 4)]  # undated last, newest id first
    refused = client.get(entity_url, params={"after": "not a cursor"})
    assert refused.status_code == 422, refused.text
    # A page's facts, by row: past the cursor, whatever came before it meanwhile.
    page_url = f"/v1/pages/default/{slug}/facts"
    head = client.get(page_url, params={"limit": 3}).json()
    assert [f["row_num"] for f in head["facts"]] == [0, 2, 3] and head["next_after_row_num"] == 3
    with tx_factory.begin() as session:
        session.execute(
            update(Fact)
            .where(Fact.row_num == 0, Fact.source_markdown_slug == slug)
            .values(status="superseded")
        )
    tail = client.get(page_url, params={"limit": 3, "after_row_num": head["next_after_row_num"]}).json()
    assert [f["row_num"] for f in tail["facts"]] == [4, 5, 6] and tail["next_after_row_num"] == 6
    assert [f["row_num"] for f in client.get(page_url, params={"after_row_num": 6}).json()["facts"]] == [7]
    # Every cursor of the document's form is a place in the list (a start past datetime's range is its
    # bound; ids stop short of a bigint's), never a 500.
    for far in ("9" * 18 + ":" + "9" * 18, "-" + "9" * 18 + ":1", "n:" + "9" * 18):
        assert client.get(entity_url, params={"after": far}).status_code == 200, far
    assert client.get(entity_url, params={"after": "n:" + "9" * 19}).status_code == 422


def test_facts_of_an_unknown_page_is_404(client: TestClient) -> None:
    response = client.get("/v1/pages/default/no/such/page/facts")
    assert response.status_code == 404
    assert "no/such/page" in response.json()["detail"]


# ---------------------------------------------------------------------------
# Config
# ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("headers", "reason"),
    [
        ({}, "missing"),
        ({"Authorization": "Bearer nope"}, "wrong admin token"),
        ({"Authorization": "Basic eDp5"}, "missing"),
    ],
)
def test_config_requires_the_admin_token(client: TestClient, headers: dict[str, str], reason: str) -> None:
    for response in (
        client.get("/v1/config/facts.extraction_enabled", headers=headers),
        client.put("/v1/config/facts.extraction_enabled", json={"value": "false"}, headers=headers),
    ):
        assert response.status_code == 401
        assert reason in response.json()["detail"]
        assert response.headers["WWW-Authenticate"] == "Bearer"


def test_config_get_and_put(client: TestClient) -> None:
    key = "/v1/config/facts.extraction_enabled"
    unset = client.get(key, headers=ADMIN_HEADERS)
    assert unset.status_code == 200
    assert (unset.json()["value"], unset.json()["enabled"]) == (None, True)

    put = client.put(key, json={"value": " OFF "}, headers=ADMIN_HEADERS)
    assert put.status_code == 200, put.text
    assert (put.json()["value"], put.json()["enabled"], put.json()["resumed"]) == ("OFF", False, 0)
    got = client.get(key, headers=ADMIN_HEADERS).json()
    assert (got["value"], got["enabled"], got["updated_by"]) == ("OFF", False, "api admin token")
    # Who changed it: the key (its id and name), so several admins' changes can be told apart.
    from tests.auth import new_key

    factory = client.app.state.factmill.factory  # type: ignore[attr-defined]
    ops = new_key(factory, ["admin"], name="ops-alice")
    client.put(key, json={"value": "off"}, headers={"Authorization": f"Bearer {ops}"})
    by = client.get(key, headers=ADMIN_HEADERS).json()["updated_by"]
    assert re.fullmatch(r"api key \d+ \(ops-alice\)", by) and ops not in by

    assert client.put(key, json={"value": True}, headers=ADMIN_HEADERS).json()["value"] == "true"
    bare = client.put(key, json=False, headers=ADMIN_HEADERS)  # the value alone, not {"value": ...}
    assert bare.json()["detail"] == 'body must be a JSON object with the fields "value"', bare.text
    assert client.get(key, headers=ADMIN_HEADERS).json()["value"] == "true"  # nothing stored
    assert (
        client.put("/v1/config/extraction.max_facts", json={"value": 7}, headers=ADMIN_HEADERS).status_code
        == 200
    )
    assert client.get("/v1/config/extraction.max_facts", headers=ADMIN_HEADERS).json()["value"] == "7"
    # 5.0 is the integer 5 in JSON, as everywhere in the API (stored as "5.0", it was refused: not a count).
    whole = client.put("/v1/config/extraction.max_facts", json={"value": 5.0}, headers=ADMIN_HEADERS)
    assert whole.status_code == 200 and whole.json()["value"] == "5", whole.text
    missing = client.get("/v1/config/no.such.key", headers=ADMIN_HEADERS)
    assert missing.status_code == 404 and "unknown config key 'no.such.key'" in missing.json()["detail"]
    unset = client.get("/v1/config/llm.prices", headers=ADMIN_HEADERS)  # known, never set
    assert unset.status_code == 404 and "is not set" in unset.json()["detail"]


def test_a_config_value_may_be_a_json_number_or_object(client: TestClient) -> None:
    """A budget is a number and llm.prices an object: as JSON they are sent so; they are stored as text."""
    budget = client.put("/v1/config/llm.budget_daily_usd", json={"value": 2.5}, headers=ADMIN_HEADERS)
    assert budget.status_code == 200 and budget.json()["value"] == "2.5"
    prices = {"simulator-1": {"input": 1, "output": 2.5}}
    put = client.put("/v1/config/llm.prices", json={"value": prices}, headers=ADMIN_HEADERS)
    assert put.status_code == 200 and json.loads(put.json()["value"]) == prices
    absurd = client.put(
        "/v1/config/llm.prices", json={"value": {"m": {"input": 1e300, "output": 1}}}, headers=ADMIN_HEADERS
    )
    assert absurd.status_code == 422 and "must be from 0 to 10,000 USD" in absurd.json()["detail"]
    for value in (None, [1]):
        refused = client.put("/v1/config/llm.budget_daily_usd", json={"value": value}, headers=ADMIN_HEADERS)
        assert refused.status_code == 422
        assert refused.json()["detail"] == (
            "body.value: a config value is text, a number, true/false or a JSON object (llm.prices); "
            "to unset a key, DELETE /v1/config/{key}"
        )


def test_a_mistyped_config_key_is_refused_with_the_key_it_is_close_to(client: TestClient) -> None:
    typo = client.put("/v1/config/compaction.enable", json={"value": "off"}, headers=ADMIN_HEADERS)
    assert typo.status_code == 422
    assert "did you mean 'compaction.enabled'?" in typo.json()["detail"]
    assert "facts.extraction_enabled" in typo.json()["detail"]  # the known keys are listed
    assert client.get("/v1/config/compaction.enabled", headers=ADMIN_HEADERS).json()["value"] is None
    listed = client.get("/v1/config/compaction.enable", headers=ADMIN_HEADERS)
    assert listed.status_code == 404 and "did you mean" in listed.json()["detail"]


def test_invalid_kill_switch_value_is_422(client: TestClient) -> None:
    response = client.put(
        "/v1/config/facts.extraction_enabled", json={"value": "maybe"}, headers=ADMIN_HEADERS
    )
    assert response.status_code == 422
    assert "facts.extraction_enabled must be one of" in response.json()["detail"]
    assert client.get("/v1/config/facts.extraction_enabled", headers=ADMIN_HEADERS).json()["value"] is None
    no_value = client.put("/v1/config/facts.extraction_enabled", json={}, headers=ADMIN_HEADERS)
    assert no_value.status_code == 422 and "body.value" in no_value.json()["detail"]
    # A mistyped page type narrowed extraction to nothing (and a page stored then lost its facts).
    typo = client.put("/v1/config/extraction.page_types", json={"value": "slak"}, headers=ADMIN_HEADERS)
    assert typo.status_code == 422 and "'slak' is not one" in typo.json()["detail"]
    assert client.get("/v1/config/extraction.page_types", headers=ADMIN_HEADERS).status_code == 404


def test_turning_a_kill_switch_on_resumes_paused_jobs(
    committed_client: TestClient, factory: sessionmaker[Session], committed_recorder: Recorder
) -> None:
    with factory.begin() as session:
        paused = Job(
            kind="extraction", subject="default|paused/a", status="paused", last_error="extraction disabled"
        )
        other = Job(kind="compaction", subject="transcript-1", status="paused")
        session.add_all([paused, other])
        session.flush()
        paused_id, other_id = paused.id, other.id
    committed_client.put(
        "/v1/config/facts.extraction_enabled", json={"value": "false"}, headers=ADMIN_HEADERS
    )
    assert committed_recorder.calls == []
    response = committed_client.put(
        "/v1/config/facts.extraction_enabled", json={"value": "true"}, headers=ADMIN_HEADERS
    )
    assert response.status_code == 200
    assert response.json()["resumed"] == 1
    assert committed_recorder.calls == [("tasks.extraction.extract_page", paused_id, "extraction")]
    assert committed_recorder.committed == [True]
    with factory() as session:
        assert session.scalar(select(Job.status).where(Job.id == paused_id)) == "queued"
        assert session.scalar(select(Job.status).where(Job.id == other_id)) == "paused"  # other switch


def test_deleting_a_config_key_restores_its_default_and_resumes_what_it_paused(
    committed_client: TestClient,
    factory: sessionmaker[Session],
    committed_recorder: Recorder,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """An operator who turned a switch off can put it back to its default, which is on: the jobs it
    paused are sent again, as when it is set to true."""
    key = "/v1/config/facts.extraction_enabled"
    assert committed_client.put(key, json={"value": "off"}, headers=ADMIN_HEADERS).status_code == 200
    with factory.begin() as session:
        paused = Job(kind="extraction", subject="default|paused/a", status="paused", last_error="disabled")
        session.add(paused)
        session.flush()
        paused_id = paused.id
        session.add(ConfigEntry(key="facts.extraction_enable", value="false"))  # kept from before checks
    assert committed_client.delete(key).status_code == 401
    # The whole table (GET /v1/config): every key workers read, in CONFIG_KEYS' order, then the unread.
    table = committed_client.get("/v1/config", headers=ADMIN_HEADERS).json()
    assert [c["key"] for c in table["config"]] == [*CONFIG_KEYS, "facts.extraction_enable"]
    assert table["unread"] == ["facts.extraction_enable"]
    listed = {c["key"]: c for c in table["config"]}
    assert (listed["facts.extraction_enabled"]["value"], listed["facts.extraction_enabled"]["enabled"]) == (
        "off",
        False,
    )
    assert listed["compaction.enabled"]["enabled"] is True and listed["llm.prices"]["value"] is None
    assert listed["compaction.quality_gate"]["enabled"] is True  # a switch, on when unset
    gate = committed_client.get("/v1/config/compaction.quality_gate", headers=ADMIN_HEADERS)
    assert gate.status_code == 200 and gate.json()["enabled"] is True, gate.text
    with caplog.at_level("INFO", logger="worker.api.routes.config"):
        response = committed_client.delete(key, headers=ADMIN_HEADERS)
    assert "config facts.extraction_enabled unset by api admin token" in caplog.text  # who, when the row goes
    assert response.status_code == 200, response.text
    assert {k: response.json()[k] for k in ("value", "enabled", "resumed")} == {
        "value": None,
        "enabled": True,
        "resumed": 1,
    }
    assert committed_recorder.calls == [("tasks.extraction.extract_page", paused_id, "extraction")]
    got = committed_client.get(key, headers=ADMIN_HEADERS).json()
    assert (got["value"], got["enabled"], got["updated_by"]) == (None, True, None)
    again = committed_client.delete(key, headers=ADMIN_HEADERS)  # not set: nothing changes
    assert again.status_code == 200 and again.json()["resumed"] == 0
    assert (
        committed_client.delete("/v1/config/facts.extraction_enable", headers=ADMIN_HEADERS).status_code
        == 200
    )
    gone = committed_client.delete("/v1/config/facts.extraction_enable", headers=ADMIN_HEADERS)
    assert gone.status_code == 404 and "did you mean 'facts.extraction_enabled'?" in gone.json()["detail"]
    # The document says so too: DELETE's key has no enum (a generated client could not send an unread
    # key), PUT's lists the keys.
    paths = committed_client.get("/openapi.json").json()["paths"]["/v1/config/{key}"]
    schema = {
        m: next(p for p in paths[m]["parameters"] if p["name"] == "key")["schema"] for m in ("put", "delete")
    }
    assert "enum" in schema["put"] and "enum" not in schema["delete"]
    with factory() as session:
        assert session.scalar(select(func.count()).select_from(ConfigEntry)) == 0
        assert session.scalar(select(Job.status).where(Job.id == paused_id)) == "queued"


# ---------------------------------------------------------------------------
# Operations
# ---------------------------------------------------------------------------


def test_healthz(client: TestClient) -> None:
    response = client.get("/healthz")
    assert response.status_code == 200 and response.json() == {"status": "ok"}


def test_readyz_with_database_and_redis(client: TestClient) -> None:
    response = client.get("/readyz")
    assert response.status_code == 200, response.text
    assert response.json()["checks"] == {"database": "ok", "broker": "ok"}
    assert "\nfactmill_broker_up 1.0\n" in client.get("/metrics", headers=ADMIN_HEADERS).text


def test_paused_jobs_are_counted_by_why(client: TestClient, tx_factory: sessionmaker[Session]) -> None:
    """factmill_jobs{status="paused"} could not tell a backfill waiting for its batches (normal, for
    hours) from a kill switch, so the paused alert fired on every backfill and said to turn a switch on."""
    from models import Job
    from worker.extraction.backfill_request import WAITING_FOR_BATCHES
    from worker.jobs.registry import pause_reasons

    assert WAITING_FOR_BATCHES in pause_reasons()
    with tx_factory.begin() as session:
        session.add_all(
            [
                Job(kind="batch_extraction", subject="b", status="paused", pause_reason=WAITING_FOR_BATCHES),
                Job(kind="extraction", subject="x", status="paused", pause_reason="budget"),
                Job(kind="extraction", subject="y", status="paused", pause_reason="budget"),
                Job(kind="compaction", subject="t", status="paused", pause_reason=None),
            ]
        )
    text = client.get("/metrics", headers=ADMIN_HEADERS).text
    assert 'factmill_jobs_paused{kind="batch_extraction",reason="batch"} 1.0' in text
    assert 'factmill_jobs_paused{kind="batch_extraction",reason="kill_switch"} 0.0' in text
    assert 'factmill_jobs_paused{kind="extraction",reason="budget"} 2.0' in text
    assert 'factmill_jobs_paused{kind="compaction",reason="kill_switch"} 1.0' in text  # no reason: a switch


def test_jobs_waiting_with_no_worker_on_them_show_how_long(
    client: TestClient, tx_factory: sessionmaker[Session]
) -> None:
    """A queue nobody takes from (workers down) or a sweeper that stopped (beat down) left jobs queued or
    running for good with no alert: the backlog rule needs a thousand growing, and nothing watched a
    running job's heartbeat."""
    from datetime import timedelta

    from models import Job
    from tests.clock import now

    with tx_factory.begin() as session:
        session.add_all(
            [
                Job(
                    kind="extraction", subject="a", status="queued", created_at=now() - timedelta(minutes=20)
                ),
                Job(
                    kind="extraction", subject="b", status="queued", enqueued_at=now() - timedelta(minutes=5)
                ),
                # Waiting out a backoff (or an outage): not due, not counted.
                Job(kind="compaction", subject="c", status="queued", enqueued_at=now() + timedelta(hours=1)),
                Job(
                    kind="consolidation",
                    subject="d",
                    status="running",
                    heartbeat_at=now() - timedelta(minutes=10),
                ),
                # A kind only a newer release runs (this one rolled back): nothing here takes or sweeps
                # it, by design; its ages fired "the sweeper is not running" for good.
                Job(
                    kind="newer_kind", subject="e", status="running", heartbeat_at=now() - timedelta(hours=2)
                ),
                Job(kind="newer_kind", subject="f", status="queued", created_at=now() - timedelta(hours=2)),
            ]
        )
    metrics = client.get("/metrics", headers=ADMIN_HEADERS).text
    assert 'kind="newer_kind"}' not in metrics  # no wait series (factmill_jobs still counts them:)
    assert 'factmill_jobs{kind="newer_kind",status="running"} 1.0' in metrics

    def value(name: str, kind: str) -> float:
        [line] = [line for line in metrics.splitlines() if line.startswith(f'{name}{{kind="{kind}"}}')]
        return float(line.rsplit(" ", 1)[1])

    assert 1190 <= value("factmill_job_oldest_due_seconds", "extraction") <= 1300
    assert value("factmill_job_oldest_due_seconds", "compaction") == 0.0
    assert 590 <= value("factmill_job_oldest_heartbeat_seconds", "consolidation") <= 700
    assert value("factmill_job_oldest_heartbeat_seconds", "extraction") == 0.0
    # What a pool can take (KEDA and the backlog alert): a job waiting out an outage is queued, not due.
    assert (value("factmill_jobs_due", "extraction"), value("factmill_jobs_due", "compaction")) == (2.0, 0.0)
    assert 'factmill_jobs{kind="compaction",status="queued"} 1.0' in metrics


def test_facts_a_follow_up_has_not_reached_show_how_many_and_how_long(
    client: TestClient, tx_factory: sessionmaker[Session]
) -> None:
    """Facts left without a vector or a consolidation (a down model, a spent budget, a failed job; the
    sweeps give up after a day) were missed by vector search or answered beside their duplicates, and no
    metric said so."""
    from tests.clock import now

    def fact(row_num: int, age: timedelta, *, vector: bool, consolidated: bool, audit: bool = False) -> Fact:
        row = fact_row("conversations/lag", row_num, f"Fact {row_num}.", is_audit=audit)
        row.created_at = now() - age
        row.embedding = [0.1, 0.2] if vector else None
        row.consolidated_at = now() if consolidated else None
        return row

    with tx_factory.begin() as session:
        session.add_all(
            [
                fact(0, timedelta(hours=2), vector=False, consolidated=False),
                fact(-1, timedelta(hours=3), vector=False, consolidated=False, audit=True),  # never counted
                fact(1, timedelta(hours=5), vector=True, consolidated=True),
                fact(2, timedelta(seconds=0), vector=True, consolidated=False),
            ]
        )
    metrics = client.get("/metrics", headers=ADMIN_HEADERS).text

    def value(name: str, step: str) -> float:
        [line] = [line for line in metrics.splitlines() if line.startswith(f'{name}{{step="{step}"}}')]
        return float(line.rsplit(" ", 1)[1])

    assert value("factmill_facts_awaiting", "embedding") == 1.0
    assert value("factmill_facts_awaiting", "consolidation") == 2.0
    # (Postgres's now() is the outer test transaction's start, before the set-up: up to minutes less.)
    assert 7000 <= value("factmill_facts_awaiting_oldest_seconds", "embedding") <= 7300
    assert 7000 <= value("factmill_facts_awaiting_oldest_seconds", "consolidation") <= 7300
    assert 'factmill_metrics_unread{collector="follow_ups"} 0.0' in metrics


def test_only_the_follow_ups_a_deployment_runs_are_watched(tx_factory: sessionmaker[Session]) -> None:
    """A step the deployment does not run leaves every fact awaiting it: its series would alert for good."""
    from worker.api.follow_up_metrics import FollowUpCollector, follow_up_steps
    from worker.settings import Settings

    assert follow_up_steps(Settings(llm="simulator")) == ("embedding", "consolidation")
    # Anthropic embeds through OpenAI only with an OpenAI key.
    assert follow_up_steps(Settings(llm="anthropic", anthropic_api_key="k", openai_api_key=None)) == (
        "consolidation",
    )
    assert follow_up_steps(Settings(llm="simulator", embed_after_extraction=False)) == ("consolidation",)
    assert follow_up_steps(Settings(llm="simulator", consolidate_after_extraction=False)) == ("embedding",)
    with tx_factory.begin() as session:
        session.add(fact_row("conversations/lag", 0, "Waits for both."))
    assert FollowUpCollector(tx_factory, ()).collect() == []
    [count, _] = FollowUpCollector(tx_factory, ("consolidation",)).collect()
    assert [sample.labels for sample in count.samples] == [{"step": "consolidation"}]


def answers_while_every_request_thread_is_busy(client: TestClient, path: str, **kw: Any) -> Any:
    """GET ``path`` while every request thread (FACTMILL_API_THREADS) is held; the answer, or None when
    it waited for one."""
    import threading

    import anyio.to_thread

    holders = [object() for _ in range(64)]
    portal = client.portal
    assert portal is not None
    limiter = portal.call(anyio.to_thread.current_default_thread_limiter)
    for holder in holders[: int(limiter.total_tokens)]:
        portal.call(limiter.acquire_on_behalf_of_nowait, holder)
    answers: list[Any] = []
    asker = threading.Thread(target=lambda: answers.append(client.get(path, **kw)), daemon=True)
    asker.start()
    asker.join(10)
    answered_while_busy = list(answers)
    for holder in holders[: int(limiter.total_tokens)]:
        portal.call(limiter.release_on_behalf_of, holder)
    asker.join(10)
    return answered_while_busy[0] if answered_while_busy else None


def test_the_scrape_threads_run_in_the_request_s_context() -> None:
    """The executor's threads do not copy context variables as anyio's do: the key check's and the
    collectors' log lines lost the request id, their database spans the request's."""
    import asyncio
    import contextvars

    from worker.api.auth import on_scrape_threads

    request_id: contextvars.ContextVar[str] = contextvars.ContextVar("request_id", default="none")

    async def scrape() -> str:
        request_id.set("req-1")
        return await on_scrape_threads(request_id.get)

    assert asyncio.run(scrape()) == "req-1"


def test_readyz_answers_while_every_request_thread_is_busy(client: TestClient) -> None:
    """Slow searches held every request thread (FACTMILL_API_THREADS), and /readyz, a plain def, waited
    behind them: past the probe's timeout Kubernetes took every replica out of service."""
    response = answers_while_every_request_thread_is_busy(client, "/readyz")
    assert response is not None and response.status_code == 200 and response.json()["status"] == "ready"


def test_metrics_answer_while_every_request_thread_is_busy(client: TestClient) -> None:
    """/metrics and its key check waited for a request thread too: the scrape timed out, every series
    went stale (FactmillMetricsAbsent fired, naming the key) and the store and broker alerts went blind."""
    response = answers_while_every_request_thread_is_busy(client, "/metrics", headers=ADMIN_HEADERS)
    assert response is not None and response.status_code == 200 and "factmill_jobs" in response.text
    reader = answers_while_every_request_thread_is_busy(client, "/metrics")  # the client's read key
    assert reader is not None and reader.status_code == 403 and "'metrics'" in reader.json()["detail"]
    # No key at all: 401 on the event loop, without queueing for the scrape's two threads.
    import threading

    from worker.api import auth

    release = threading.Event()
    busy = [auth._SCRAPE_THREADS.submit(release.wait, 30) for _ in range(2)]
    answers: list[Any] = []
    asker = threading.Thread(
        target=lambda: answers.append(client.get("/metrics", headers={"Authorization": ""}))
    )
    asker.start()
    asker.join(10)
    answered_while_held = list(answers)
    release.set()
    asker.join(10)
    for held in busy:
        held.result()
    assert answered_while_held and answered_while_held[0].status_code == 401


def test_readyz_names_the_unreachable_broker(
    database_url: str, tx_factory: sessionmaker[Session], caplog: pytest.LogCaptureFixture
) -> None:
    """Probes carry no credential: the answer names the check and the error's class, never the
    driver's message (it named the broker's host and port, or the database's socket path and role)."""
    runtime = make_runtime(database_url, tx_factory, broker_url="redis://127.0.0.1:1/0")
    with TestClient(create_app(runtime, sender=Recorder(tx_factory))) as test_client:
        response = test_client.get("/readyz")
        scraped = test_client.get("/metrics", headers=ADMIN_HEADERS).text
    # Ready, degraded: pages are still stored without the broker (the sweeper sends their jobs), and a
    # 503 took every replica out of the Kubernetes Service for a Redis restart.
    assert response.status_code == 200
    assert response.json() == {
        "status": "degraded",
        "checks": {"database": "ok", "broker": "unreachable (ConnectionError)"},
    }
    assert "127.0.0.1" not in response.text and "6379" not in response.text
    assert "degraded: broker unreachable (ConnectionError: Error 111 connecting to 127.0.0.1:1" in caplog.text
    assert "\nfactmill_broker_up 0.0\n" in scraped  # how Prometheus learns of it


def test_an_unreachable_database_is_a_503_with_retry_after_on_every_route(database_url: str) -> None:
    """Not a bug of the request nor of the code: 503 and Retry-After, so senders try again."""
    dead = sessionmaker(create_engine("postgresql+psycopg://postgres@127.0.0.1:1/none"))
    runtime = make_runtime(database_url, dead)
    with TestClient(create_app(runtime, sender=Recorder(dead)), raise_server_exceptions=False) as test_client:
        ready = test_client.get("/readyz")
        assert (
            ready.status_code == 503 and "database unreachable (OperationalError)" in ready.json()["detail"]
        )
        assert "127.0.0.1" not in ready.text and "none" not in ready.text  # the DSN stays in the log
        broken = test_client.get("/v1/jobs", headers=ADMIN_HEADERS)  # the admin token needs no DB
        assert broken.status_code == 503 and broken.headers["Retry-After"] == "5"
        request_id = broken.headers["X-Request-ID"]
        assert broken.json() == {
            "detail": "the database is unavailable; try again shortly",
            "request_id": request_id,
        }
        delivery = post(test_client, page("down/a"))  # a signed page: the sender will deliver again
        assert delivery.status_code == 503 and delivery.headers["Retry-After"] == "5"
        metrics = test_client.get("/metrics", headers=ADMIN_HEADERS)
        assert metrics.status_code == 200 and "factmill_store_up 0.0" in metrics.text
        # Counted as what the client got (the request metrics recorded a 500 for these 503s).
        assert 'route="/v1/jobs",status="503"} 1.0' in metrics.text
        assert 'status="500"' not in metrics.text


def test_the_metrics_scrape_reports_a_database_outage_to_the_key_it_checked_before(
    database_url: str, factory: sessionmaker[Session], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A metrics key is checked in Postgres: while it was down the scrape got a 503, the target went
    down and factmill_store_up 0 was never stored (FactmillStoreDown could not fire). A key that passed
    the check within the grace is taken on it while the database is down; an unchecked one is not."""
    from types import SimpleNamespace

    import psycopg
    from sqlalchemy import event
    from sqlalchemy.pool import NullPool

    from models import ApiKey
    from tests.auth import bearer, new_key
    from worker.access.store import hash_key, revoke_key
    from worker.api import deps

    now = [1_000.0]  # the grace's clock, moved by hand
    monkeypatch.setattr(deps, "time", SimpleNamespace(monotonic=lambda: now[0]))
    engine = create_engine(database_url, poolclass=NullPool)
    down = [False]

    @event.listens_for(engine, "do_connect")
    def refuse(*_: Any) -> None:
        if down[0]:
            raise psycopg.OperationalError("connection refused (the test's outage)")

    gated = sessionmaker(engine)
    scraper, unchecked = bearer(new_key(factory, ["metrics"])), bearer(new_key(factory, ["metrics"]))
    revoked_key, reader = new_key(factory, ["metrics"]), bearer(new_key(factory, ["read"]))
    revoked = bearer(revoked_key)
    runtime = make_runtime(database_url, gated)
    with TestClient(create_app(runtime, sender=Recorder(gated)), raise_server_exceptions=False) as client:
        assert "factmill_store_up 1.0" in client.get("/metrics", headers=scraper).text
        assert client.get("/metrics", headers=revoked).status_code == 200
        with factory.begin() as session:
            found = session.scalars(select(ApiKey).where(ApiKey.key_hash == hash_key(revoked_key))).one()
            revoke_key(session, found.id)
        assert client.get("/metrics", headers=revoked).status_code == 401  # refused: forgotten too
        assert client.get("/metrics", headers=reader).status_code == 403  # not let in: not remembered
        down[0] = True
        assert client.get("/metrics", headers=revoked).status_code == 503
        assert client.get("/metrics", headers=reader).status_code == 503
        during = client.get("/metrics", headers=scraper)
        assert during.status_code == 200 and "factmill_store_up 0.0" in during.text
        assert client.get("/metrics", headers=unchecked).status_code == 503
        assert client.get("/v1/jobs", headers=scraper).status_code == 503  # only the scrape's route
        now[0] += 800  # within 15 minutes of the last check the database made
        assert client.get("/metrics", headers=scraper).status_code == 200
        now[0] += 200  # a scrape taken on the remembered check does not renew it
        assert client.get("/metrics", headers=scraper).status_code == 503
    engine.dispose()


def silent_database(database_url: str, timeout: float = 0.0) -> tuple[Any, list[bool], list[int]]:
    """An engine on the test database whose connects fail as a silent server's time out once ``down[0]``
    is set, each after ``timeout`` seconds: (engine, down, attempts), each failed connect appended to
    ``attempts``."""
    import psycopg
    from sqlalchemy import event
    from sqlalchemy.pool import NullPool

    engine = create_engine(database_url, poolclass=NullPool)
    down: list[bool] = [False]
    attempts: list[int] = []

    @event.listens_for(engine, "do_connect")
    def refuse(*_: Any) -> None:
        if down[0]:
            attempts.append(1)
            time.sleep(timeout)
            raise psycopg.OperationalError("connection timed out (the test's outage)")

    return engine, down, attempts


def test_a_scrape_during_an_outage_asks_the_database_once_for_its_key_and_its_figures(
    database_url: str, factory: sessionmaker[Session]
) -> None:
    """The remembered key was taken only after the key check had failed: against a database that drops
    packets each scrape waited its connect timeout (10 s) there, then the collectors' own, past
    Prometheus's scrape timeout, and factmill_store_up 0 never reached it."""
    from tests.auth import bearer, new_key

    engine, down, attempts = silent_database(database_url)
    gated = sessionmaker(engine)
    scraper = bearer(new_key(factory, ["metrics"]))
    with TestClient(create_app(make_runtime(database_url, gated), sender=Recorder(gated))) as client:
        assert "factmill_store_up 1.0" in client.get("/metrics", headers=scraper).text
        down[0] = True
        for _ in range(3):
            assert "factmill_store_up 0.0" in client.get("/metrics", headers=scraper).text
    assert len(attempts) == 1
    engine.dispose()


def test_scrapes_a_minute_apart_through_an_outage_each_ask_with_a_quick_connect(
    database_url: str, factory: sessionmaker[Session], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The outage was forgotten 15 s after it was seen: at Prometheus's 1-minute default every scrape
    waited out the full connect timeout again (the key check's, 10 s), timed out, and FactmillStoreDown
    could not fire. Within OUTAGE_MEMORY_SECONDS a scrape asks with a short connect first."""
    from tests.auth import bearer, new_key
    from worker.api import scrape_reads

    engine, down, attempts = silent_database(database_url)
    gated = sessionmaker(engine)
    probes: list[bool] = []

    def probe(_factory: Any) -> bool | None:
        probes.append(down[0])
        return True if down[0] else None

    monkeypatch.setattr(scrape_reads, "store_away", probe)
    clock = [1000.0]  # the outage memory's clock, moved a minute between scrapes
    monkeypatch.setattr(scrape_reads, "time", SimpleNamespace(monotonic=lambda: clock[0]))
    scraper = bearer(new_key(factory, ["metrics"]))
    with TestClient(create_app(make_runtime(database_url, gated), sender=Recorder(gated))) as client:
        assert "factmill_store_up 1.0" in client.get("/metrics", headers=scraper).text
        down[0] = True
        assert "factmill_store_up 0.0" in client.get("/metrics", headers=scraper).text
        for _ in range(3):
            clock[0] += 60
            assert "factmill_store_up 0.0" in client.get("/metrics", headers=scraper).text
        assert len(attempts) == 1 and probes == [True] * 3  # one quick connect a scrape, none slow
        # Up but refusing a new connection (out of connections): the pool's own may still read, so the
        # reads go ahead (they said "store down" for as long as it lasted, the connections alert blind).
        monkeypatch.setattr(scrape_reads, "store_away", lambda _factory: False)
        clock[0] += 60
        assert "factmill_store_up 0.0" in client.get("/metrics", headers=scraper).text
        assert len(attempts) == 2  # this scrape's first read tried its pool; the rest skipped
        monkeypatch.setattr(scrape_reads, "store_away", probe)
        down[0] = False
        clock[0] += 60
        assert "factmill_store_up 1.0" in client.get("/metrics", headers=scraper).text
        assert probes[-1] is False
    engine.dispose()


def test_the_quick_connect_tells_a_database_that_answers_from_one_gone(database_url: str) -> None:
    from worker.api.scrape_reads import store_away

    assert store_away(sessionmaker(create_engine(database_url))) is None
    # Connected as the engine connects: a URL written back out lost the space of a password or an option
    # (libpq refused it with no SQLSTATE, read as gone, and every scrape after it said the store was down).
    spaced = make_url(database_url).set(password="p x", query={"options": "-c statement_timeout=5s"})
    assert store_away(sessionmaker(create_engine(spaced))) is None
    closed_port = make_url(database_url).set(host="127.0.0.1", port=1)
    assert store_away(sessionmaker(create_engine(closed_port))) is True


@pytest.mark.parametrize("remembered_first", [True, False], ids=["seen-by-the-scrape", "seen-by-the-key"])
def test_a_key_no_scrape_checked_is_refused_during_an_outage_without_a_lookup(
    database_url: str, factory: sessionmaker[Session], remembered_first: bool
) -> None:
    """Only a remembered key skipped the lookup: anyone sending made-up keys held the scrape's two
    threads, each for the connect timeout of a database that drops packets, and the real scrape timed
    out behind them (factmill_store_up 0 never reached Prometheus)."""
    from tests.auth import bearer, new_key

    made_up = {"Authorization": "Bearer fm_made_up_key"}
    scraper = bearer(new_key(factory, ["metrics"]))
    engine, down, attempts = silent_database(database_url)
    gated = sessionmaker(engine)
    app = create_app(make_runtime(database_url, gated), sender=Recorder(gated))
    with TestClient(app, raise_server_exceptions=False) as client:
        assert "factmill_store_up 1.0" in client.get("/metrics", headers=scraper).text
        down[0] = True
        if remembered_first:  # the outage seen by the real scrape
            assert "factmill_store_up 0.0" in client.get("/metrics", headers=scraper).text
        else:  # or by a made-up key's own lookup, the one it makes
            assert client.get("/metrics", headers=made_up).status_code == 503
        seen = len(attempts)
        for _ in range(3):
            refused = client.get("/metrics", headers=made_up)
            assert refused.status_code == 503 and refused.headers["Retry-After"] == "5"
        assert len(attempts) == seen
        assert "factmill_store_up 0.0" in client.get("/metrics", headers=scraper).text
        # Told without the database: the admin token (admin implies metrics) is let in, and what has no
        # key's form is refused (it opened a transaction to find no row).
        admin = client.get("/metrics", headers=ADMIN_HEADERS)
        assert admin.status_code == 200 and "factmill_store_up 0.0" in admin.text
        assert client.get("/metrics", headers={"Authorization": "Bearer not-a-key"}).status_code == 401
        assert len(attempts) == seen
    engine.dispose()


def test_made_up_keys_queued_before_an_outage_was_seen_do_not_each_wait_out_a_connect(
    database_url: str, factory: sessionmaker[Session]
) -> None:
    """The refusal was asked on the event loop only: keys that arrived together, before the first lookup
    failed and the outage was seen, were all queued on the scrape's two threads and each waited its
    connect timeout there, the real scrape behind them. They are asked again on the thread."""
    from concurrent.futures import ThreadPoolExecutor

    from tests.auth import bearer, new_key

    scraper = bearer(new_key(factory, ["metrics"]))
    engine, down, attempts = silent_database(database_url, timeout=1.0)
    gated = sessionmaker(engine)
    app = create_app(make_runtime(database_url, gated), sender=Recorder(gated))
    with TestClient(app, raise_server_exceptions=False) as client:
        assert "factmill_store_up 1.0" in client.get("/metrics", headers=scraper).text
        down[0] = True
        made_up = [{"Authorization": f"Bearer fm_made_up_{n}"} for n in range(8)]
        with ThreadPoolExecutor(8) as pool:
            answers = list(pool.map(lambda headers: client.get("/metrics", headers=headers), made_up))
        assert {a.status_code for a in answers} == {503}
        assert len(attempts) <= 2, attempts  # the first on each thread; the rest refused on it
    engine.dispose()


def test_a_scrape_tries_a_database_it_cannot_reach_once(database_url: str) -> None:
    """Each of the five collectors waited out its own connect timeout: against a silent server a scrape
    took minutes, past Prometheus's timeout, so factmill_store_up 0 never reached it."""
    from prometheus_client import CollectorRegistry, generate_latest

    from worker.api import metrics

    engine, down, attempts = silent_database(database_url)
    down[0] = True
    gated = sessionmaker(engine)
    registry = CollectorRegistry(auto_describe=False)
    for collector in (
        metrics.StoreCollector,
        metrics.CompactionCollector,
        metrics.ConsolidationCollector,
        metrics.BackfillCollector,
        metrics.PostgresCollector,
    ):
        registry.register(collector(gated))  # type: ignore[arg-type]
    assert b"factmill_store_up 0.0" in generate_latest(registry)
    assert b"factmill_store_up 0.0" in generate_latest(registry)  # the next scrape, soon after
    assert len(attempts) == 1
    engine.dispose()


def test_a_store_read_past_its_timeout_is_no_store_down(
    client: TestClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A statement of the store's collector past its timeout (a migration's lock queued behind a long
    transaction) answered factmill_store_up 0: FactmillStoreDown (critical) while Postgres answered."""
    from worker.api import metrics, scrape_reads

    def slow(session: Session) -> None:
        session.execute(text("SELECT pg_sleep(2)"))

    healthy = client.get("/metrics", headers=ADMIN_HEADERS).text
    assert "factmill_metrics_unbuilt 0.0" in healthy  # (said 0 too: the alert takes min over replicas)
    assert 'factmill_metrics_unread{collector="store"} 0.0' in healthy
    monkeypatch.setattr(scrape_reads, "METRICS_STATEMENT_TIMEOUT", "50ms")
    monkeypatch.setattr(metrics, "_StoreRows", slow)
    scraped = client.get("/metrics", headers=ADMIN_HEADERS).text
    assert "factmill_store_up 1.0" in scraped
    assert 'factmill_metrics_unread{collector="store"} 1.0' in scraped
    assert 'factmill_metrics_unread{collector="postgres"} 0.0' in scraped


def test_an_exhausted_connection_pool_is_a_503_with_retry_after(database_url: str) -> None:
    """Every pooled connection busy past the pool's timeout: a capacity limit, answered as one."""
    engine = create_engine(database_url, pool_size=1, max_overflow=0, pool_timeout=0.2)
    factory = sessionmaker(engine)
    runtime = make_runtime(database_url, factory)
    try:
        app = create_app(runtime, sender=Recorder(factory))
        with (
            TestClient(app, raise_server_exceptions=False) as client,
            engine.connect(),  # the pool's only connection, held
        ):
            busy = client.get("/v1/jobs", headers=ADMIN_HEADERS)
        assert busy.status_code == 503 and busy.headers["Retry-After"] == "5"
        assert busy.json()["detail"] == "the database is unavailable; try again shortly"
        with TestClient(create_app(runtime, sender=Recorder(factory))) as client:
            assert client.get("/v1/jobs", headers=ADMIN_HEADERS).status_code == 200  # free again
    finally:
        engine.dispose()


def test_a_busy_pool_is_no_outage_a_remembered_metrics_key_passes_through(database_url: str, factory) -> None:
    """The grace that lets a scrape through a database outage took a pool busy past its timeout for
    one: a key revoked meanwhile (seen by another API process) was still served the figures."""
    from tests.auth import bearer, new_key
    from worker.api.scrape_reads import note_outage

    engine = create_engine(database_url, pool_size=1, max_overflow=0, pool_timeout=0.2)
    gated = sessionmaker(engine)
    scraper = bearer(new_key(factory, ["metrics"]))
    runtime = make_runtime(database_url, gated)
    try:
        app = create_app(runtime, sender=Recorder(gated))
        with TestClient(app, raise_server_exceptions=False) as client:
            assert client.get("/metrics", headers=scraper).status_code == 200  # checked: remembered
            with engine.connect():  # the pool's only connection, held
                busy = client.get("/metrics", headers=scraper)
                # A collector that found the pool busy too is no outage the key is taken through.
                note_outage(gated, gone=False)
                still = client.get("/metrics", headers=scraper)
        assert busy.status_code == 503 and busy.headers["Retry-After"] == "5"
        assert still.status_code == 503
    finally:
        engine.dispose()


def test_metrics_exposes_jobs_facts_llm_and_requests(
    client: TestClient, tx_factory: sessionmaker[Session]
) -> None:
    job_id = post(client, page("metrics/a")).json()["jobs"][0]["job_id"]
    with tx_factory.begin() as session:
        session.add_all(
            [fact_row("metrics/a", 0, "A fact."), fact_row("metrics/a", -1, "DONE", is_audit=True)]
        )
        from models import LLMCall

        session.add_all(
            [
                LLMCall(job_id=job_id, provider="sim", model="sim", purpose="extraction", input_tokens=100,
                        cache_read_tokens=40, output_tokens=20, latency_ms=120, outcome="ok"),
                LLMCall(job_id=job_id, provider="sim", model="sim", purpose="extraction", input_tokens=50,
                        output_tokens=0, latency_ms=3000, outcome="provider_error"),
            ]
        )  # fmt: skip
    set_job(tx_factory, job_id, attempts=1, worker_losses=2)
    with tx_factory.begin() as session:
        from worker.config_store import COMPACTION_ENABLED, set_config

        set_config(session, COMPACTION_ENABLED, "off")
    client.get(f"/v1/jobs/{job_id}")
    text = client.get("/metrics", headers=ADMIN_HEADERS).text
    assert 'factmill_jobs{kind="extraction",status="queued"} 1.0' in text
    assert 'factmill_jobs{kind="compaction",status="failed"} 0.0' in text
    assert 'factmill_job_attempts{kind="extraction",status="queued"} 1.0' in text
    assert 'factmill_job_worker_losses{kind="extraction",status="queued"} 2.0' in text
    assert 'factmill_job_worker_losses{kind="extraction",status="failed"} 0.0' in text
    assert 'factmill_kill_switch_enabled{switch="compaction.enabled"} 0.0' in text
    assert 'factmill_kill_switch_enabled{switch="facts.extraction_enabled"} 1.0' in text  # unset: on
    assert "factmill_facts 1.0" in text  # the audit row is not a fact
    assert 'factmill_segments_total{outcome="ok"} 0.0' in text
    assert 'factmill_llm_calls_total{outcome="ok",purpose="extraction"} 1.0' in text
    assert 'factmill_llm_tokens_total{direction="in",purpose="extraction"} 150.0' in text
    assert 'factmill_llm_tokens_total{direction="cached",purpose="extraction"} 40.0' in text
    assert 'factmill_llm_latency_seconds_bucket{le="0.25",purpose="extraction"} 1.0' in text
    assert 'factmill_llm_latency_seconds_bucket{le="+Inf",purpose="extraction"} 2.0' in text
    assert 'factmill_llm_latency_seconds_sum{purpose="extraction"} 3.12' in text
    assert 'factmill_http_requests_total{method="GET",route="/v1/jobs/{job_id}",status="200"} 1.0' in text
    assert 'factmill_http_requests_total{method="POST",route="/v1/pages",status="202"} 1.0' in text
    assert "factmill_http_request_duration_seconds_bucket" in text


def _gauge(text: str, name: str) -> float:
    return float(next(line for line in text.splitlines() if line.startswith(f"{name} ")).split()[1])


def test_metrics_show_postgres_connections_against_the_limit(client: TestClient, database_url: str) -> None:
    """The connections gauge counts every backend of the server (three held here, the scrape's own), and the
    limit is max_connections less the reserved slots, as ``SHOW`` reports them."""
    engine = create_engine(database_url, pool_size=3, max_overflow=0)
    try:
        held = [engine.connect() for _ in range(3)]
        settings = {
            name: int(held[0].exec_driver_sql(f"SHOW {name}").scalar_one())
            for name in ("max_connections", "superuser_reserved_connections", "server_version_num")
        }
        reserved = settings["superuser_reserved_connections"]
        if settings["server_version_num"] >= 160000:
            reserved += int(held[0].exec_driver_sql("SHOW reserved_connections").scalar_one())
        text = client.get("/metrics", headers=ADMIN_HEADERS).text
        assert _gauge(text, "factmill_postgres_connections") >= len(held) + 1
        assert _gauge(text, "factmill_postgres_connection_limit") == settings["max_connections"] - reserved
        for connection in held:
            connection.close()
    finally:
        engine.dispose()


def test_openapi_lists_the_routes(client: TestClient) -> None:
    spec = client.get("/openapi.json").json()
    assert spec["info"]["title"] == "Factmill" and spec["info"]["version"]
    assert {tag["name"] for tag in spec["tags"]} >= {"pages", "jobs", "facts", "config", "operations"}
    assert set(spec["paths"]) >= {
        "/v1/pages",
        "/v1/jobs",
        "/v1/jobs/{job_id}",
        "/v1/jobs/{job_id}/retry",
        "/v1/pages/{source_id}/{slug}/facts",
        "/v1/config/{key}",
        "/healthz",
        "/readyz",
        "/metrics",
    }
    post_pages = spec["paths"]["/v1/pages"]["post"]
    assert {p["name"] for p in post_pages["parameters"]} == {"Idempotency-Key"}
    assert "408" in post_pages["responses"]  # a body too slow to arrive: answered, so documented
    # Either credential: an ingest key, or the webhook signature (a security scheme, not a parameter).
    assert post_pages["security"] == [{"ApiKey": []}, {"WebhookSignature": []}]
    assert spec["components"]["securitySchemes"]["WebhookSignature"] == {
        "type": "apiKey",
        "in": "header",
        "name": "Factmill-Signature",
        "description": spec["components"]["securitySchemes"]["WebhookSignature"]["description"],
    }
    assert "requestBody" in post_pages


# Keywords pydantic writes when a constraint cannot apply to its type (e.g. ge on an optional
# field): JSON Schema ignores them, so the document would not state the bound the API enforces.
PYDANTIC_ONLY = {"ge", "le", "gt", "lt", "min_length", "max_length", "strict"}


def test_openapi_holds_only_json_schema_keywords(client: TestClient) -> None:
    found: list[str] = []

    def walk(node: object, where: str) -> None:
        if isinstance(node, dict):
            in_properties = where.endswith(".properties")
            for key, value in node.items():
                if key in PYDANTIC_ONLY and not in_properties:
                    found.append(f"{where}.{key}")
                walk(value, f"{where}.{key}")
        elif isinstance(node, list):
            for index, item in enumerate(node):
                walk(item, f"{where}[{index}]")

    walk(client.get("/openapi.json").json(), "$")
    assert not found, found


# ---------------------------------------------------------------------------
# The real Celery sender
# ---------------------------------------------------------------------------


def test_webhook_sends_through_the_real_celery_sender(
    database_url: str, tx_factory: sessionmaker[Session], broker: SessionBroker
) -> None:
    prefix = f"factmill-test-{uuid.uuid4().hex[:8]}:"
    runtime = make_runtime(database_url, tx_factory, broker_url=broker.url, broker_key_prefix=prefix)
    client = broker.client()
    try:
        with TestClient(create_app(runtime)) as test_client:  # no sender: Celery on runtime.settings
            job_id = post(test_client, page("celery/a")).json()["jobs"][0]["job_id"]
        raw = client.lrange(f"{prefix}extraction", 0, -1)
        assert len(raw) == 1
        message = json.loads(raw[0])
        assert message["headers"]["task"] == "tasks.extraction.extract_page"
        assert message["headers"]["argsrepr"] == f"[{job_id}]"
        with tx_factory() as session:
            assert session.scalar(select(Job.enqueued_at).where(Job.id == job_id)) is not None
    finally:
        for key in client.scan_iter(f"{prefix}*"):
            client.delete(key)
        client.close()


def test_front_matter_nesting_has_one_limit_whichever_way_the_page_comes_in(client: TestClient) -> None:
    """`factmill ingest` refused a page file's front matter nested past 32 levels; the webhook stored
    one nested 63 deep (only the request's own JSON depth cap applied): the same page in or out by
    its way in."""
    from worker.extraction.pages import MAX_FRONT_MATTER_DEPTH

    def nested(levels: int) -> dict[str, Any]:
        value: dict[str, Any] = {"leaf": 1}
        for _ in range(levels - 1):
            value = {"k": value}
        return value

    deepest = post(client, page("fm/deepest", frontmatter=nested(MAX_FRONT_MATTER_DEPTH)))
    assert deepest.status_code == 202, deepest.text
    deeper = post(client, page("fm/deeper", frontmatter=nested(MAX_FRONT_MATTER_DEPTH + 8)))
    assert deeper.status_code == 422, deeper.text
    assert f"front matter nests deeper than {MAX_FRONT_MATTER_DEPTH} levels" in deeper.text


def test_a_page_listing_pages_past_a_slug_stored_before_the_length_bound(
    client: TestClient, tx_factory: sessionmaker[Session]
) -> None:
    """A slug longer than new ones may be (stored before the bound, or around the API) gave a cursor
    the listing's own route refused (a 422): every page after it was out of reach."""
    from models import Page

    with tx_factory.begin() as session:
        for slug in ("a" * 700 + "z" * 5000, "b-after"):  # (a repetitive key is compressed in its index)
            session.add(Page(source_id="default", slug=slug, type="conversation", content_hash="x"))
    first = client.get("/v1/pages", params={"limit": 1})
    assert first.status_code == 200, first.text
    rest = client.get("/v1/pages", params={"limit": 1, "after": first.json()["next_after"]})
    assert rest.status_code == 200, rest.text
    assert [p["slug"] for p in rest.json()["pages"]] == ["b-after"]


@pytest.mark.parametrize("after", ["|x", "|", "no-bar"])
def test_a_page_cursor_without_a_source_is_refused_as_the_document_says(
    client: TestClient, after: str
) -> None:
    """The document's pattern (^[^|]+\\|) refuses an empty source; the route answered 200 for "|x"."""
    answer = client.get("/v1/pages", params={"after": after})
    assert answer.status_code == 422 and "after must be a source|slug" in answer.text
