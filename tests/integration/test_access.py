"""Access control against the real API and Postgres: keys, scopes, tenants, bound signatures."""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import bindparam, create_engine, func, select, update
from sqlalchemy.orm import Session, sessionmaker
from sqlalchemy.pool import NullPool

from models import ApiKey, Erasure, Page
from tests.auth import bearer, new_key
from tests.integration.test_api import ADMIN_HEADERS, CONVERSATION, SECRET, Recorder, make_runtime, run_asgi
from tests.integration.test_search import seed
from worker.access import KeyStoreError, create_key, revoke_key
from worker.api.app import create_app
from worker.core.signing import compute_signature, sign, signed_json_headers

pytestmark = pytest.mark.integration

OPEN = {
    ("GET", "/healthz"),
    ("GET", "/readyz"),
    ("GET", "/openapi.json"),
    ("GET", "/docs"),
    ("GET", "/redoc"),
}
# Every operation, with the scope it needs (ingest routes also take a signature).
ROUTES = [
    ("GET", "/v1/search?q=lisbon", "read"),
    ("POST", "/v1/search", "read"),
    ("GET", "/v1/pages/default/alice/facts", "read"),
    ("GET", "/v1/jobs", "read"),
    ("GET", "/v1/jobs/1", "read"),
    ("GET", "/v1/transcripts", "read"),
    ("GET", "/v1/transcripts/t1", "read"),
    ("GET", "/v1/transcripts/t1/messages", "read"),
    ("GET", "/v1/transcripts/t1/context", "read"),
    ("GET", "/v1/transcripts/t1/compactions", "read"),
    ("GET", "/v1/calibration", "read"),
    ("GET", "/v1/pages", "read"),
    ("GET", "/v1/entities/people/alice/facts", "read"),
    ("POST", "/v1/pages", "ingest"),
    ("POST", "/v1/transcripts/t1/messages", "ingest"),
    ("PUT", "/v1/transcripts/t1", "ingest"),
    ("POST", "/v1/feedback", "ingest"),
    ("GET", "/v1/config", "admin"),
    ("GET", "/v1/config/facts.extraction_enabled", "admin"),
    ("PUT", "/v1/config/facts.extraction_enabled", "admin"),
    ("DELETE", "/v1/config/facts.extraction_enabled", "admin"),
    ("POST", "/v1/jobs/1/retry", "admin"),
    ("GET", "/metrics", "metrics"),
    ("DELETE", "/v1/pages/default/alice", "admin"),
    ("DELETE", "/v1/transcripts/t1", "admin"),
    ("POST", "/v1/backfills", "admin"),
    ("GET", "/v1/backfills", "admin"),
    ("GET", "/v1/backfills/1", "admin"),
    ("POST", "/v1/backfills/1/cancel", "admin"),
]


@pytest.fixture
def api(database_url: str, factory: sessionmaker[Session]) -> Iterator[TestClient]:
    with TestClient(create_app(make_runtime(database_url, factory), sender=Recorder(factory))) as client:
        yield client


def call(client: TestClient, method: str, url: str, headers: dict[str, str] | None = None) -> Any:
    body = {"q": "lisbon"} if url == "/v1/search" else {"value": "true"}
    return client.request(method, url, json=body if method in ("POST", "PUT") else None, headers=headers)


def page_body(slug: str, source_id: str = "default", body: str = CONVERSATION) -> bytes:
    return json.dumps(
        {"source_id": source_id, "slug": slug, "type": "conversation", "compiled_truth": body}
    ).encode()


def signed(body: bytes, path: str = "/v1/pages", method: str = "POST", **kw: Any) -> dict[str, str]:
    return signed_json_headers(body, SECRET, method=method, path=path, **kw)


def test_every_route_but_the_open_ones_refuses_an_anonymous_caller(api: TestClient) -> None:
    documented = {
        (method.upper(), path)
        for path, ops in api.get("/openapi.json").json()["paths"].items()
        for method in ops
    }
    assert len(documented) == len(ROUTES) + 2  # every operation is listed here, plus /healthz and /readyz
    for method, url, _ in ROUTES:
        answer = call(api, method, url)
        assert answer.status_code == 401, (method, url, answer.text)
        assert answer.headers.get("WWW-Authenticate") == "Bearer", (method, url)
    for method, url in OPEN:
        assert call(api, method, url).status_code == 200, url  # /readyz: "degraded" without a broker


def test_a_reader_sees_no_spend_among_a_jobs_counters(
    api: TestClient, factory: sessionmaker[Session]
) -> None:
    """A job's spend is the metrics' and the admin's (GET /v1/jobs/{id} showed it to them alone), but a
    backfill's cost and a consolidation's prompt tokens were in the counters every reader listed."""
    from models import Job
    from worker.extraction.options import ExtractionCounters

    extraction = ExtractionCounters(pages_processed=1, llm_calls=3, input_tokens=1200, output_tokens=300)
    with factory.begin() as session:
        session.add_all(
            [
                Job(kind="extraction", subject="default|p", status="succeeded",
                    counters=extraction.as_dict(with_pages=False)),
                Job(kind="batch_extraction", subject="backfill:1", status="succeeded",
                    counters={"backfill": 1, "requests": 3, "cost_usd": 1.25}),
                Job(kind="consolidation", subject="default|people/a", status="succeeded",
                    counters={"pairs": 4, "prompt_tokens": 900}),
            ]
        )  # fmt: skip
    shown = {}
    for scopes in (["read"], ["read", "metrics"]):
        listed = api.get("/v1/jobs", headers=bearer(new_key(factory, scopes))).json()["jobs"]
        shown[scopes[-1]] = {job["kind"]: job["counters"] for job in listed}
    assert shown["read"]["batch_extraction"] == {"backfill": 1, "requests": 3}
    assert shown["read"]["consolidation"] == {"pairs": 4}
    assert shown["read"]["extraction"]["pages_processed"] == 1
    assert not {"llm_calls", "input_tokens", "output_tokens"} & set(shown["read"]["extraction"])
    assert shown["metrics"]["extraction"]["input_tokens"] == 1200
    assert shown["metrics"]["batch_extraction"]["cost_usd"] == 1.25
    assert shown["metrics"]["consolidation"]["prompt_tokens"] == 900
    for job in listed:
        one = api.get(f"/v1/jobs/{job['id']}", headers=bearer(new_key(factory, ["read"]))).json()
        assert not {"cost_usd", "prompt_tokens", "llm_calls", "input_tokens"} & set(one["counters"])


def test_a_config_write_checks_its_key_once(api: TestClient, factory: sessionmaker[Session]) -> None:
    """The config router's admin check and its handlers' were two dependencies: every write looked the
    key up twice, in two transactions (under pool pressure, a 503 from the second after the first)."""
    from sqlalchemy import event

    headers = bearer(new_key(factory, ["admin"]))
    lookups: list[str] = []

    def count(conn: Any, cursor: Any, statement: str, *args: Any) -> None:
        if "FROM api_keys" in statement:
            lookups.append(statement)

    engine = factory.kw["bind"]
    event.listen(engine, "before_cursor_execute", count)
    try:
        answer = api.put("/v1/config/extraction.max_facts", json={"value": "7"}, headers=headers)
    finally:
        event.remove(engine, "before_cursor_execute", count)
    assert answer.status_code == 200, answer.text
    assert len(lookups) == 1


def test_a_key_without_the_scope_is_403_naming_it(api: TestClient, factory: sessionmaker[Session]) -> None:
    keys = {scope: bearer(new_key(factory, [scope])) for scope in ("read", "ingest", "metrics")}
    for method, url, needed in ROUTES:
        for scope, headers in keys.items():
            if scope == needed:
                continue
            answer = call(api, method, url, headers)
            assert answer.status_code == 403, (scope, method, url, answer.text)
            assert f"'{needed}' scope" in answer.json()["detail"]


def test_the_right_scope_is_served_as_before(api: TestClient, factory: sessionmaker[Session]) -> None:
    reader, admin = bearer(new_key(factory, ["read"])), bearer(new_key(factory, ["admin"]))
    assert api.get("/v1/jobs", headers=reader).json() == {"jobs": []}
    assert api.get("/v1/calibration", headers=reader).status_code == 200
    assert api.get("/metrics", headers=admin).status_code == 200
    assert api.get("/v1/jobs", headers=admin).status_code == 200  # admin implies read
    assert api.get("/v1/config/facts.extraction_enabled", headers=admin).json()["enabled"] is True


def test_prometheus_scrapes_with_a_key_that_can_do_nothing_else(
    api: TestClient, factory: sessionmaker[Session]
) -> None:
    """/metrics took the admin scope: the Prometheus that scrapes it held the power to flip kill
    switches, retry jobs and erase pages."""
    scraper = bearer(new_key(factory, ["metrics"]))
    scraped = api.get("/metrics", headers=scraper)
    assert scraped.status_code == 200 and "factmill_jobs_ended_total" in scraped.text
    for method, url, _ in ROUTES:
        if url != "/metrics":
            assert call(api, method, url, scraper).status_code == 403, (method, url)
    # The figures cover every source: a key limited to some is refused them, as for transcripts (no such
    # key is made now; one made before that rule is stored so).
    limited = bearer(new_key(factory, ["read"], source_ids=["tenant-a"], name="old scraper"))
    with factory.begin() as session:
        session.execute(update(ApiKey).where(ApiKey.name == "old scraper").values(scopes=["metrics"]))
    refused = api.get("/metrics", headers=limited)
    assert (
        refused.status_code == 403 and "the metrics are not partitioned by source" in refused.json()["detail"]
    )


def test_a_keyed_delivery_needs_no_signature_but_a_sent_signature_must_hold(
    api: TestClient, factory: sessionmaker[Session]
) -> None:
    ingester = bearer(new_key(factory, ["ingest"]))
    body = page_body("keyed/a")
    ok = api.post("/v1/pages", content=body, headers=ingester | {"Content-Type": "application/json"})
    assert ok.status_code == 202, ok.text
    bad = api.post(
        "/v1/pages",
        content=body,
        headers=ingester | {"Factmill-Signature": sign(body, "wrong", method="POST", path="/v1/pages")},
    )
    assert bad.status_code == 401


def test_two_keys_sending_one_feedback_idempotency_key_are_two_submissions(
    api: TestClient, factory: sessionmaker[Session]
) -> None:
    """The key was scoped by nothing: a second tenant's observation was dropped as the first's
    duplicate (or refused as a reuse), and the key was stored as sent (it may name a person)."""
    from models import CalibrationObservation

    feedback = {"coverage": 0.4, "answer_kept": True, "origin": "ui"}
    headers = {"Content-Type": "application/json", "Idempotency-Key": "alice-2024-03-15"}
    for ingester in (bearer(new_key(factory, ["ingest"])), bearer(new_key(factory, ["ingest"]))):
        answer = api.post("/v1/feedback", content=json.dumps(feedback).encode(), headers=ingester | headers)
        assert answer.status_code == 201 and answer.json()["duplicate"] is False, answer.text
        again = api.post("/v1/feedback", content=json.dumps(feedback).encode(), headers=ingester | headers)
        assert again.status_code == 200 and again.json()["duplicate"] is True
    with factory() as session:
        keys = session.scalars(select(CalibrationObservation.dedupe_key)).all()
    assert len(set(keys)) == 2 and not any("alice" in (key or "") for key in keys)


def test_revoked_and_unknown_keys_are_refused(api: TestClient, factory: sessionmaker[Session]) -> None:
    with factory.begin() as session:
        created = create_key(session, "soon revoked", ["read"])
    assert api.get("/v1/jobs", headers=bearer(created.key)).status_code == 200
    with factory.begin() as session:
        revoke_key(session, created.id)
    refused = api.get("/v1/jobs", headers=bearer(created.key))
    assert refused.status_code == 401 and "revoked" in refused.json()["detail"]
    assert api.get("/v1/jobs", headers=bearer("fm_" + "x" * 43)).status_code == 401
    assert (
        api.get(
            "/v1/jobs", headers={"Authorization": b"Bearer " + "\u00e9".encode("latin-1") * 5000}
        ).status_code
        == 401
    )


def test_only_the_hash_is_stored_and_last_use_is_written_at_most_once_a_minute(
    api: TestClient, factory: sessionmaker[Session]
) -> None:
    key = new_key(factory, ["read"])
    with factory() as session:
        row = session.scalars(select(ApiKey)).one()
        assert (
            key not in (row.key_hash, row.prefix) and key.startswith(row.prefix) and row.last_used_at is None
        )
    api.get("/v1/jobs", headers=bearer(key))
    with factory() as session:
        first = session.scalars(select(ApiKey)).one().last_used_at
    assert first is not None
    api.get("/v1/jobs", headers=bearer(key))
    with factory() as session:
        assert session.scalars(select(ApiKey)).one().last_used_at == first  # within the minute: untouched
    with factory.begin() as session:
        session.execute(update(ApiKey).values(last_used_at=first - timedelta(minutes=2)))
    api.get("/v1/jobs", headers=bearer(key))
    with factory() as session:
        assert session.scalars(select(ApiKey)).one().last_used_at > first - timedelta(minutes=1)


def test_admin_keys_cover_every_source_and_scopes_are_checked(factory: sessionmaker[Session]) -> None:
    with factory.begin() as session, pytest.raises(KeyStoreError, match="admin key covers every source"):
        create_key(session, "x", ["admin"], ["default"])
    # /metrics refuses a source-limited key: such a key got 403 on every scrape.
    with factory.begin() as session, pytest.raises(KeyStoreError, match="metrics key covers every source"):
        create_key(session, "prometheus", ["metrics"], ["default"])
    with factory.begin() as session, pytest.raises(KeyStoreError, match="unknown scope"):
        create_key(session, "x", ["write"])
    # A blank or malformed source would limit the key to a source no page can have.
    for bad in ("", " default", "a|b", "x" * 201):
        with factory.begin() as session, pytest.raises(KeyStoreError, match="is not a source id"):
            create_key(session, "bob", ["read"], [bad])


def test_a_source_limited_key_sees_and_writes_only_its_sources(
    api: TestClient, factory: sessionmaker[Session]
) -> None:
    seed(factory, filler=0)
    work = bearer(new_key(factory, ["read", "ingest"], ["work"]))
    found = api.get("/v1/search", params={"q": "lex: Lisbon"}, headers=work).json()["results"]
    assert [r["fact"] for r in found] == ["Frank opened the Lisbon office"]
    everyone = api.get("/v1/search", params={"q": "lex: Lisbon"}, headers=ADMIN_HEADERS).json()["results"]
    assert len(everyone) > 1
    assert (
        api.post("/v1/search", json={"q": "lisbon", "source_id": "default"}, headers=work).status_code == 403
    )
    assert api.get("/v1/pages/default/alice-chat/facts", headers=work).status_code == 403
    # Its own source is read: a page it lacks is 404 by name (not 403), one it has is 200 (below).
    missing = api.get("/v1/pages/work/work-notes/facts", headers=work)
    assert missing.status_code == 404 and missing.json()["detail"] == "no page 'work-notes' in source 'work'"
    # Pages: its own source is written, another is refused (nothing of the request is stored).
    other = api.post(
        "/v1/pages", content=page_body("p", "default"), headers=work | {"Content-Type": "application/json"}
    )
    assert other.status_code == 403 and "'default'" in other.json()["detail"]
    mine = api.post(
        "/v1/pages", content=page_body("p", "work"), headers=work | {"Content-Type": "application/json"}
    )
    assert mine.status_code == 202, mine.text
    assert api.get("/v1/pages/work/p/facts", headers=work).status_code == 200
    signed_default = api.post(
        "/v1/pages", content=page_body("q", "default"), headers=signed(page_body("q", "default"))
    )
    [default_job] = signed_default.json()["jobs"]
    # Jobs: only the page jobs of its sources; another source's job is a 404.
    listed = api.get("/v1/jobs", headers=work).json()["jobs"]
    assert [j["source_id"] for j in listed] == ["work"]
    assert api.get(f"/v1/jobs/{default_job['job_id']}", headers=work).status_code == 404
    assert api.get(f"/v1/jobs/{listed[0]['id']}", headers=work).status_code == 200
    # Transcripts and calibration are not partitioned by source: refused with the reason.
    for url in ("/v1/transcripts", "/v1/transcripts/t1/messages", "/v1/calibration"):
        answer = api.get(url, headers=work)
        assert answer.status_code == 403 and "not partitioned by source" in answer.json()["detail"]


# --------------------------------------------------------------------------- signatures


def test_a_body_signed_for_one_transcript_is_refused_at_another(api: TestClient) -> None:
    body = json.dumps({"messages": [{"role": "user", "text": "hi"}]}).encode()
    headers = signed(body, "/v1/transcripts/alice/messages")
    assert api.post("/v1/transcripts/bob/messages", content=body, headers=headers).status_code == 401
    assert api.put(["/v1/transcripts/alice", "messages"][0], content=body, headers=headers).status_code == 401
    assert api.post("/v1/transcripts/alice/messages", content=body, headers=headers).status_code == 201


def test_v1_signatures_are_refused_unless_the_setting_is_on(
    database_url: str, factory: sessionmaker[Session]
) -> None:
    body = page_body("legacy/a")
    legacy = {"Content-Type": "application/json", "Factmill-Signature": sign(body, SECRET)}
    with TestClient(create_app(make_runtime(database_url, factory), sender=Recorder(factory))) as client:
        refused = client.post("/v1/pages", content=body, headers=legacy)
        assert refused.status_code == 401 and "(v1 refused)" in refused.json()["detail"]
    runtime = make_runtime(database_url, factory, accept_v1_signatures=True)
    with TestClient(create_app(runtime, sender=Recorder(factory))) as client:
        assert client.post("/v1/pages", content=body, headers=legacy).status_code == 202


def test_a_missing_or_malformed_signature_is_refused_before_the_body_is_read(
    database_url: str, factory: sessionmaker[Session]
) -> None:
    app = create_app(make_runtime(database_url, factory), sender=Recorder(factory))
    for headers in (
        [],
        [(b"factmill-signature", b"garbage")],
        [(b"factmill-signature", b"t=" + b"9" * 400 + b",v2=00")],
    ):
        status, pulled = run_asgi(app, headers, b"x" * 1000, chunks=1000)
        assert (status, pulled) == (401, 0), headers


def test_an_older_page_delivery_cannot_overwrite_a_newer_one(
    api: TestClient, factory: sessionmaker[Session]
) -> None:
    now = int(time.time())
    newer, older = (
        page_body("order/a", body=CONVERSATION + "\nnew"),
        page_body("order/a", body=CONVERSATION + "\nold"),
    )
    assert api.post("/v1/pages", content=newer, headers=signed(newer, timestamp=now)).status_code == 202
    stale = api.post("/v1/pages", content=older, headers=signed(older, timestamp=now - 60))
    assert stale.status_code == 409 and "older than the stored one" in stale.json()["detail"]
    with factory() as session:
        assert session.scalars(select(Page.compiled_truth)).one().endswith("new")
    later = page_body("order/a", body=CONVERSATION + "\nlater")
    assert api.post("/v1/pages", content=later, headers=signed(later, timestamp=now + 1)).status_code == 202


def test_a_signed_delivery_in_the_second_another_was_stored_in_is_told_to_sign_again(
    api: TestClient, factory: sessionmaker[Session]
) -> None:
    """A signature is dated to its second, a keyed delivery (or `factmill ingest`) to the microsecond:
    which came first within that second is not known. Refused as "older" with nothing more, the newer
    content was lost (a sender takes a 409 as final); taken as newer, a signed retry, or a delivery that
    waited on the row, replaced content stored after it. It is refused with the reason and Retry-After."""
    key = new_key(factory, ["ingest"])
    second = int(time.time()) - 10
    keyed = page_body("order/second", body=CONVERSATION + "\nkeyed")
    headers = bearer(key) | {"Content-Type": "application/json"}
    assert api.post("/v1/pages", content=keyed, headers=headers).status_code == 202
    with factory.begin() as session:  # stored 300 ms into the second the signature below is dated to
        session.execute(
            update(Page).values(delivered_at=func.to_timestamp(second) + timedelta(milliseconds=300))
        )
    same = page_body("order/second", body=CONVERSATION + "\nsigned in that second")
    refused = api.post("/v1/pages", content=same, headers=signed(same, timestamp=second))
    assert refused.status_code == 409 and refused.headers["Retry-After"] == "1", refused.text
    detail = refused.json()["detail"]
    assert "is not known to be newer than the stored one" in detail, detail
    assert "if this is the newer content, sign it again a second later" in detail
    later = api.post("/v1/pages", content=same, headers=signed(same, timestamp=second + 1))
    assert later.status_code == 202, later.text
    older = page_body("order/second", body=CONVERSATION + "\nolder")
    stale = api.post("/v1/pages", content=older, headers=signed(older, timestamp=second - 5))
    assert stale.status_code == 409 and "Retry-After" not in stale.headers  # plainly older: no hint
    # A keyed delivery is dated to the microsecond: within the second of the stored one it is known older.
    with factory.begin() as session:
        session.execute(update(Page).values(delivered_at=func.now() + timedelta(milliseconds=500)))
    again = page_body("order/second", body=CONVERSATION + "\nkeyed again")
    known = api.post("/v1/pages", content=again, headers=headers)
    assert known.status_code == 409 and "Retry-After" not in known.headers, known.text
    assert "is older than the stored one" in known.json()["detail"], known.text
    with factory() as session:
        assert session.scalars(select(Page.compiled_truth)).one().endswith("signed in that second")


def test_an_operators_ingest_is_dated_so_a_senders_older_retry_cannot_undo_it(
    api: TestClient, factory: sessionmaker[Session], tmp_path: Path
) -> None:
    """`factmill ingest` stored the page undated: the sender's retry of a delivery signed before the
    ingest passed the newest-delivery check and replaced the operator's content."""
    from worker.extraction.ingest import ingest_paths

    now = int(time.time())
    first = page_body("order/cli", body=CONVERSATION + "\nfirst")
    assert api.post("/v1/pages", content=first, headers=signed(first, timestamp=now - 60)).status_code == 202
    (tmp_path / "cli.md").write_text(
        f"---\ntype: conversation\nslug: order/cli\n---\n{CONVERSATION}\noperator\n"
    )
    report = ingest_paths(factory, [tmp_path / "cli.md"])
    assert report.ingested == ["order/cli"] and report.errors == []
    retry = page_body("order/cli", body=CONVERSATION + "\nretried")
    late = api.post("/v1/pages", content=retry, headers=signed(retry, timestamp=now - 30))
    assert late.status_code == 409 and "older than the stored one" in late.json()["detail"]
    with factory() as session:
        assert session.scalars(select(Page.compiled_truth)).one().endswith("operator\n")


def test_an_ingest_dated_before_a_delivery_from_a_clock_ahead_says_so_and_replaces_nothing(
    api: TestClient, factory: sessionmaker[Session], tmp_path: Path
) -> None:
    from worker.extraction.ingest import ingest_paths

    ahead = page_body("order/ahead", body=CONVERSATION + "\nahead")
    sent = api.post("/v1/pages", content=ahead, headers=signed(ahead, timestamp=int(time.time()) + 120))
    assert sent.status_code == 202, sent.text
    (tmp_path / "a.md").write_text(f"---\ntype: conversation\nslug: order/ahead\n---\n{CONVERSATION}\nfile\n")
    report = ingest_paths(factory, [tmp_path / "a.md"])
    [(_, reason)] = report.errors
    assert "later than this ingest (its sender's clock is ahead)" in reason and "after that time" in reason
    with factory() as session:
        assert session.scalars(select(Page.compiled_truth)).one().endswith("ahead")


def test_a_delivery_naming_one_page_twice_is_refused_whole(
    api: TestClient, factory: sessionmaker[Session]
) -> None:
    """Both were upserted in turn and both answered stored: the later replaced the earlier unsaid.
    NFC and NFD spellings of a slug name one page."""
    pages = [
        {"slug": "twice/caf\u00e9", "type": "conversation", "compiled_truth": CONVERSATION + "\na"},
        {"slug": "other", "type": "conversation", "compiled_truth": CONVERSATION},
        {"slug": "twice/cafe\u0301", "type": "conversation", "compiled_truth": CONVERSATION + "\nb"},
    ]
    body = json.dumps({"pages": pages}).encode()
    refused = api.post("/v1/pages", content=body, headers=signed(body))
    assert refused.status_code == 409
    assert refused.json()["detail"].startswith("pages[2]: the same page as pages[0]")
    with factory() as session:
        assert session.scalars(select(Page.slug)).all() == []


def test_an_unchanged_redelivery_still_dates_the_page_so_an_older_change_cannot_follow_it(
    api: TestClient, factory: sessionmaker[Session]
) -> None:
    """X signed at t, Y at t+10 (delayed in transit), X again at t+20: the last arrived as unchanged
    and left the page dated t, so Y, arriving last, replaced what the newest delivery said."""
    now = int(time.time())
    x, y = page_body("order/b", body=CONVERSATION + "\nx"), page_body("order/b", body=CONVERSATION + "\ny")
    assert api.post("/v1/pages", content=x, headers=signed(x, timestamp=now - 20)).status_code == 202
    again = api.post("/v1/pages", content=x, headers=signed(x, timestamp=now))
    assert again.status_code == 202 and len(again.json()["unchanged"]) == 1
    late = api.post("/v1/pages", content=y, headers=signed(y, timestamp=now - 10))
    assert late.status_code == 409 and "older than the stored one" in late.json()["detail"]
    with factory() as session:
        assert session.scalars(select(Page.compiled_truth)).one().endswith("x")


def test_a_delivery_signed_before_the_page_was_erased_cannot_bring_it_back(
    api: TestClient, factory: sessionmaker[Session]
) -> None:
    """The page row, and the time of its newest delivery, went with the erasure: a delivery signed
    before it (late in transit, or a sender's retry of one that never arrived) stored the erased
    content again and its facts were extracted again. One signed after it is a new page."""
    now = int(time.time())
    page = page_body("erase/a", body=CONVERSATION + "\nsecret")
    assert api.post("/v1/pages", content=page, headers=signed(page, timestamp=now - 30)).status_code == 202
    erased = api.delete("/v1/pages/default/erase/a", headers=ADMIN_HEADERS)
    assert erased.status_code == 200, erased.text
    late = api.post("/v1/pages", content=page, headers=signed(page, timestamp=now - 20))
    assert late.status_code == 409 and "older than the page's erasure" in late.json()["detail"]
    assert "Retry-After" not in late.headers
    with factory() as session:
        assert session.scalars(select(Page.compiled_truth)).all() == []
        erased_at = session.scalar(select(func.max(Erasure.erased_at)))
    # Signed in the erasure's second (a signature is dated to the second): told to wait one.
    assert erased_at is not None
    same = api.post("/v1/pages", content=page, headers=signed(page, timestamp=int(erased_at.timestamp())))
    assert same.status_code == 409 and "a second after the erasure" in same.json()["detail"]
    assert same.headers["Retry-After"] == "1"
    again = page_body("erase/a", body=CONVERSATION + "\nagain")
    assert api.post("/v1/pages", content=again, headers=signed(again, timestamp=now + 5)).status_code == 202


def test_one_idempotency_key_on_two_routes_is_two_deliveries(api: TestClient) -> None:
    pages = page_body("idem/a")
    first = api.post("/v1/pages", content=pages, headers=signed(pages, idempotency_key="k1"))
    assert first.status_code == 202
    messages = json.dumps({"messages": [{"role": "user", "text": "hi"}]}).encode()
    for transcript in ("a", "b"):
        path = f"/v1/transcripts/{transcript}/messages"
        answer = api.post(path, content=messages, headers=signed(messages, path, idempotency_key="k1"))
        assert answer.status_code == 201 and "Idempotent-Replayed" not in answer.headers, answer.text
    assert (
        api.post("/v1/pages", content=pages, headers=signed(pages, idempotency_key="k1")).headers[
            "Idempotent-Replayed"
        ]
        == "true"
    )


def test_a_bar_in_a_transcript_id_does_not_make_two_deliveries_one(api: TestClient) -> None:
    # Transcript "a|b" with key "k" and transcript "a" with key "b|k" hashed one scope: the second was
    # answered with the first's stored answer and its messages were never stored.
    messages = json.dumps({"messages": [{"role": "user", "text": "hi"}]}).encode()
    for transcript, key in (("bar%7Cb", "k"), ("bar", "b|k")):
        path = f"/v1/transcripts/{transcript}/messages"
        answer = api.post(path, content=messages, headers=signed(messages, path, idempotency_key=key))
        assert answer.status_code == 201 and "Idempotent-Replayed" not in answer.headers, answer.text
    stored = api.get("/v1/transcripts/bar/messages", headers=ADMIN_HEADERS).json()
    assert [m["text"] for m in stored["messages"]] == ["hi"]
    # Every subject without a bar keeps the digest stored answers were kept under (a backslash too).
    from worker.deliveries import scoped_key

    route = "POST /v1/transcripts/{id}/messages"
    expected = hashlib.sha256(f"{route}|a\\b|k".encode()).hexdigest()
    assert scoped_key(route, "a\\b", "k", "signature") == expected


def test_a_captured_v4_delivery_cannot_be_stored_again_under_another_key(api: TestClient) -> None:
    """v4 signs the Idempotency-Key: a copy sent again within the tolerance window keeps the key it was
    signed with (and gets the stored answer) or is refused; under v2 a new key made it a new delivery,
    and the transcript held the messages twice."""
    path = "/v1/transcripts/replayed/messages"
    body = json.dumps({"messages": [{"role": "user", "text": "pay the invoice on friday"}]}).encode()
    headers = signed(body, path, idempotency_key="delivery-1")
    assert headers["Idempotency-Key"] == "delivery-1" and ",v4=" in headers["Factmill-Signature"]
    assert api.post(path, content=body, headers=headers).status_code == 201
    again = api.post(path, content=body, headers=headers)
    assert again.status_code == 201 and again.headers["Idempotent-Replayed"] == "true"
    other_key = api.post(path, content=body, headers=headers | {"Idempotency-Key": "delivery-2"})
    assert other_key.status_code == 401 and "does not match" in other_key.json()["detail"]
    no_key = {k: v for k, v in headers.items() if k != "Idempotency-Key"}
    dropped = api.post(path, content=body, headers=no_key)
    assert dropped.status_code == 401 and "Idempotency-Key" in dropped.json()["detail"]
    stored = api.get(path, headers=ADMIN_HEADERS).json()
    assert [m["text"] for m in stored["messages"]] == ["pay the invoice on friday"]


def test_v2_signatures_are_refused_once_the_setting_is_off(
    database_url: str, factory: sessionmaker[Session]
) -> None:
    body = page_body("v2/a")
    runtime = make_runtime(database_url, factory, accept_v2_signatures=False)
    with TestClient(create_app(runtime, sender=Recorder(factory))) as client:
        now = int(time.time())
        v2 = f"t={now},v2={compute_signature(body, SECRET, now, 'POST', '/v1/pages')}"
        old = {"Content-Type": "application/json", "Factmill-Signature": v2, "Idempotency-Key": "p1"}
        refused = client.post("/v1/pages", content=body, headers=old)
        assert refused.status_code == 401 and "(v2 refused)" in refused.json()["detail"]
        accepted = client.post("/v1/pages", content=body, headers=signed(body, idempotency_key="p1"))
        assert accepted.status_code == 202, accepted.text


def test_the_openapi_document_shows_the_security_scheme(api: TestClient) -> None:
    document = api.get("/openapi.json").json()
    assert document["components"]["securitySchemes"]["ApiKey"]["scheme"] == "bearer"
    assert {"ApiKey": []} in document["paths"]["/v1/jobs"]["get"]["security"]
    assert "security" not in document["paths"]["/healthz"]["get"]


def test_a_keyed_delivery_is_dated_when_it_reached_the_server_by_the_databases_clock(tx_factory: Any) -> None:
    """Dated after its body was read (a wait for a large-body place, a slow upload), a keyed append sent
    before its transcript's erasure was taken for one sent after it, and began it again; dated by the API
    host's clock, which erasures are not, the same with a host clock ahead of the database's."""
    from datetime import timedelta

    from sqlalchemy import func, select

    from worker.api.auth import Ingest

    host_ahead = time.time() + 3600  # the API host's clock an hour ahead of the database's
    keyed = Ingest(
        principal=None,
        signature=None,
        method="POST",
        path="/v1/pages",
        arrived_at=host_ahead - 90,
        arrived_monotonic=time.monotonic() - 90,
    )
    unknown = Ingest(principal=None, signature=None, method="POST", path="/v1/pages")
    with tx_factory() as session:
        database_now = session.scalar(select(func.clock_timestamp()))
        dated = keyed.delivered_at(None, b"{}")(session)  # type: ignore[arg-type]
        assert abs(dated - (database_now - timedelta(seconds=90))) < timedelta(seconds=5), dated
        assert abs(unknown.delivered_at(None, b"{}")(session) - database_now) < timedelta(seconds=5)  # type: ignore[arg-type]


def test_a_delivery_stored_before_a_rule_tightened_gets_its_stored_answer_when_sent_again(
    api: TestClient, factory: sessionmaker[Session]
) -> None:
    """A release refuses what an earlier one stored (a source id beginning with '/', a message's unknown
    field): the sender's retry of such a delivery, within the window and under its key, was a 422 for a
    body already stored, and the client believed nothing was."""

    from worker.deliveries import WEBHOOK_SENDER, deliver_once, scoped_key

    def stored_before(route: str, subject: str, key: str, body: bytes, answer: dict[str, Any]) -> None:
        scoped = scoped_key(route, subject, key, WEBHOOK_SENDER)
        deliver_once(factory, scoped, hashlib.sha256(body).hexdigest(), lambda session: (answer, None))

    page = json.dumps({"source_id": "/team", "slug": "notes/a", "type": "conversation"}).encode()
    accepted = {
        "jobs": [{"job_id": 7, "source_id": "/team", "slug": "notes/a", "created": True}],
        "unchanged": [],
    }
    stored_before("POST /v1/pages", "", "d-1", page, accepted)
    again = api.post("/v1/pages", content=page, headers=signed(page, idempotency_key="d-1"))
    assert again.status_code == 202 and again.headers["Idempotent-Replayed"] == "true", again.text
    assert again.json() == accepted
    refused = api.post("/v1/pages", content=page, headers=signed(page, idempotency_key="d-2"))
    assert refused.status_code == 422 and "leading '/'" in refused.text  # a new delivery: today's rules

    path = "/v1/transcripts/t1/messages"
    messages = json.dumps({"messages": [{"role": "user", "text": "hi", "content": "hi"}]}).encode()
    appended = {"transcript_id": "t1", "appended": 1, "first_seq": 1, "last_seq": 1}
    stored_before("POST /v1/transcripts/{id}/messages", "t1", "m-1", messages, appended)
    again = api.post(path, content=messages, headers=signed(messages, path, idempotency_key="m-1"))
    assert again.status_code == 201 and again.headers["Idempotent-Replayed"] == "true", again.text
    assert again.json() == appended
    refused = api.post(path, content=messages, headers=signed(messages, path, idempotency_key="m-2"))
    assert refused.status_code == 422 and "unknown field(s) content" in refused.text


def test_a_delivery_postgres_ends_to_break_a_deadlock_is_made_again(factory: sessionmaker[Session]) -> None:
    """Two deliveries locking the same rows in crossed orders (two batches emptying pages whose facts
    name the same entities): Postgres ended one, a 500 to a sender who did nothing wrong. It was all
    rolled back and nothing is sent before the commit, so it is made again; both are stored."""
    import threading
    from concurrent.futures import ThreadPoolExecutor

    from worker.deliveries import deliver_once
    from worker.extraction.pages import PageIn, upsert_page

    with factory.begin() as session:
        ids = [upsert_page(session, PageIn(slug=f"p{n}", type="note")).page_id for n in (0, 1)]
    both_hold_one = threading.Barrier(2, timeout=30)
    tries: list[str] = []

    def crossed(first: int, then: int, name: str) -> Any:
        def write(session: Session) -> tuple[dict[str, Any], None]:
            tries.append(name)
            lock = select(Page.id).where(Page.id == bindparam("id")).with_for_update()
            session.execute(lock, {"id": ids[first]})
            if tries.count(name) == 1:  # the first try of each meets the other holding its first row
                both_hold_one.wait()
            session.execute(lock, {"id": ids[then]})
            return {"delivery": name}, None

        return write

    with ThreadPoolExecutor(2) as pool:
        one = pool.submit(deliver_once, factory, "k-one", "h1", crossed(0, 1, "one"))
        two = pool.submit(deliver_once, factory, "k-two", "h2", crossed(1, 0, "two"))
        answers = [one.result(timeout=60)[0], two.result(timeout=60)[0]]
    assert answers == [{"delivery": "one"}, {"delivery": "two"}]
    assert len(tries) == 3  # one of the two was made again


def test_a_read_only_database_still_serves_keyed_reads_and_answers_writes_503(
    database_url: str, factory: sessionmaker[Session]
) -> None:
    """A database that answers reads but refuses writes (a standby after a failover, a managed server
    gone read-only on a full disk, default_transaction_read_only for maintenance): the key check's
    once-a-minute last_used_at write made every keyed request a 500, reads included."""
    key = new_key(factory, ["read", "ingest"])
    with factory.begin() as session:
        session.execute(update(ApiKey).values(last_used_at=func.now() - timedelta(minutes=5)))
    engine = create_engine(
        database_url, connect_args={"options": "-c default_transaction_read_only=on"}, poolclass=NullPool
    )
    read_only = sessionmaker(engine, expire_on_commit=False)
    try:
        with TestClient(create_app(make_runtime(database_url, read_only), sender=Recorder(read_only))) as api:
            assert api.get("/v1/jobs", headers=bearer(key)).status_code == 200
            refused = api.post(
                "/v1/pages",
                content=page_body("read-only"),
                headers=bearer(key) | {"Content-Type": "application/json"},
            )
            assert refused.status_code == 503, refused.text
            assert refused.headers["Retry-After"]
    finally:
        engine.dispose()
    with factory() as session:  # the refused write left nothing behind
        assert session.scalar(select(func.count()).select_from(Page)) == 0
