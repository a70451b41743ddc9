"""The client's pure parts: one signature scheme shared with the server, a client that stands alone,
the retry rules, the requests it builds, the errors it raises."""

from __future__ import annotations

import hashlib
import hmac
import pickle
import subprocess
import sys
import textwrap
import tomllib
from datetime import UTC, datetime, timedelta
from email.utils import format_datetime
from pathlib import Path

import httpx
import pytest

import worker.core.signing as server_signing
from factmill_client import calls, errors, signing
from factmill_client.transport import Credentials, RetryPolicy, build_request, http_timeout, parse

REPO = Path(__file__).resolve().parents[2]


def test_the_server_verifies_with_the_clients_own_signing_function():
    assert server_signing.sign is signing.sign
    assert server_signing.compute_signature is signing.compute_signature
    body = b'{"slug": "x"}'
    header = signing.sign(body, "s3cret", 1_700_000_000, method="post", path="/v1/pages")
    assert header.startswith("t=1700000000,v4=")
    now = 1_700_000_010
    assert (
        server_signing.verify(header, body, "s3cret", 300, now, method="POST", path="/v1/pages")
        == 1_700_000_000
    )
    with pytest.raises(server_signing.SignatureError):
        server_signing.verify(header, body, "s3cret", 300, now, method="POST", path="/v1/other")


def test_a_secret_read_with_its_newline_signs_as_the_server_reads_it():
    """The server strips FACTMILL_WEBHOOK_SECRET; the client signed with the newline a secret file ends
    in, and every signed call was a 401 "wrong secret"."""
    from worker.settings import Settings

    held = Settings(_env_file=None, webhook_secret="whsec-abc\n").webhook_secrets()
    body = b'{"slug": "x"}'
    for given in ("whsec-abc\n", ["  whsec-abc\r\n"]):
        header = signing.sign(body, given, 1_700_000_000, method="POST", path="/v1/pages")
        assert server_signing.verify(header, body, held, 300, 1_700_000_001, method="POST", path="/v1/pages")
    with pytest.raises(ValueError, match="required"):
        signing.sign(body, " \n", 1_700_000_000, method="POST", path="/v1/pages")


def run_python(code: str, **env: str) -> str:
    result = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True,
        text=True,
        timeout=120,
        env={"PATH": "/usr/bin:/bin", **env},
    )
    assert result.returncode == 0, result.stderr
    return result.stdout


def test_the_servers_pure_core_imports_the_scheme_without_the_clients_http_stack():
    out = run_python(
        """
        import sys, worker.core.signing
        print(sorted(m for m in sys.modules if m.split(".")[0] in ("httpx", "pydantic", "anyio")))
        """,
        PYTHONPATH=str(REPO),
    )
    assert out.strip() == "[]"


def test_the_client_imports_and_works_without_any_server_code(tmp_path: Path):
    # Only the package's own folder on the path (no repo root), and the server's packages refused.
    (tmp_path / "factmill_client").symlink_to(REPO / "factmill_client")
    out = run_python(
        """
        import importlib.abc, sys
        class Refuse(importlib.abc.MetaPathFinder):
            def find_spec(self, name, path, target=None):
                if name.split(".")[0] in ("worker", "models", "tasks", "tenacity"):
                    raise ImportError(f"the client imported {name}")
        sys.meta_path.insert(0, Refuse())
        import factmill_client
        from factmill_client import AsyncClient, Client, NotFound, models
        accepted = models.JobAccepted(job_id=1, source_id="s", slug="x", created=True)
        with Client("http://127.0.0.1:9") as client:
            print(type(client).__name__, accepted.job_id)
        """,
        PYTHONPATH=str(tmp_path),
    )
    assert out.split() == ["Client", "1"]
    client_toml = tomllib.loads((REPO / "factmill_client" / "pyproject.toml").read_text())
    project = client_toml["project"]
    assert sorted(d.split(">")[0] for d in project["dependencies"]) == ["httpx", "pydantic"]
    # `license = "Apache-2.0"` (an SPDX string) is read by setuptools 77 on; before, the build failed.
    assert isinstance(project["license"], str) and "setuptools>=77" in client_toml["build-system"]["requires"]
    main = tomllib.loads((REPO / "pyproject.toml").read_text())
    assert "factmill_client*" in main["tool"]["setuptools"]["packages"]["find"]["include"]


def answer(status: int, **headers: str) -> httpx.Response:
    return httpx.Response(status, headers=headers, json={"detail": "x"})


def test_retry_rules():
    policy = RetryPolicy(attempts=3, backoff=1.0, max_backoff=10.0, max_retry_after=30)
    ingest = calls.ingest({}, None)  # deduplicated by its key: replayable
    retry = calls.retry_job(1, False)  # would act twice: only resent when it surely was not acted on
    request = httpx.Request("POST", "http://x/")
    assert 0.5 <= (policy.after_response(ingest, answer(503), 1) or 0) <= 1.0
    assert 1.0 <= (policy.after_response(ingest, answer(502), 2) or 0) <= 2.0
    assert policy.after_response(ingest, answer(503), 3) is None  # attempts used up
    assert policy.after_response(ingest, answer(409), 1) is None
    assert policy.after_response(retry, answer(500), 1) is None
    # Not before Retry-After, a little jitter on top (clients a server told "2" came back together).
    waits = {policy.after_response(retry, answer(429, **{"Retry-After": "2"}), 1) for _ in range(20)}
    assert all(2.0 <= (wait or 0) <= 3.0 for wait in waits) and len(waits) > 1, waits
    # Never less than the backoff: a Retry-After of 0 (or a date past) resent at once, every attempt.
    assert all(
        1.0 <= (policy.after_response(ingest, answer(503, **{"Retry-After": "0"}), 2) or 0) <= 3.0
        for _ in range(20)
    )
    assert policy.after_response(ingest, answer(503, **{"Retry-After": "3600"}), 1) is None  # too long
    assert policy.after_error(retry, httpx.ConnectError("refused", request=request), 1) is not None
    assert policy.after_error(retry, httpx.ReadTimeout("slow", request=request), 1) is None
    assert policy.after_error(ingest, httpx.ReadTimeout("slow", request=request), 1) is not None
    # A body the server's large-body line did not get in time (408): no route read it, any call goes again.
    assert policy.after_response(retry, answer(408), 1) is not None


def test_a_large_upload_may_wait_its_turn_at_the_server_past_the_read_timeout():
    """The server reads a few large bodies at a time and leaves the others unread: at the client's 30 s
    write timeout a 25 MiB ingest waiting its turn was sent again, whole, to the back of the line."""
    from factmill_client import AsyncClient, Client

    for made in (Client("http://x"), AsyncClient("http://x")):
        timeout = made._http.timeout
        assert (timeout.read, timeout.connect, timeout.write) == (30.0, 30.0, 300.0)
    # A body the socket buffers hold whole waits for its turn in the read: a large one reads longer too.
    http = httpx.Client(base_url="http://x", timeout=http_timeout(30.0))
    credentials = Credentials(None, None)
    large = build_request(http, calls.ingest({"pages": ["x" * (1024 * 1024)]}, None), credentials)
    small = build_request(http, calls.ingest({"pages": []}, None), credentials)
    assert large.extensions["timeout"]["read"] == 300.0 and small.extensions["timeout"]["read"] == 30.0
    http.close()
    # httpx's own forms are taken as given, as httpx took them before.
    assert http_timeout(None) is None and http_timeout(httpx.Timeout(5.0)) == httpx.Timeout(5.0)


def test_requests_carry_the_key_and_a_fresh_signature_over_the_path_as_sent():
    ticks = iter([1_700_000_000, 1_700_000_005])
    credentials = Credentials("fm_key", "s3cret", clock=lambda: next(ticks))
    call = calls.append_messages("chat-1·é?#%", [{"role": "user", "text": "hi"}], None, None)
    with httpx.Client(base_url="http://factmill.test") as http:
        first, second = build_request(http, call, credentials), build_request(http, call, credentials)
    path = "/v1/transcripts/chat-1%C2%B7%C3%A9%3F%23%25/messages"
    assert first.url.raw_path.decode() == path
    assert first.headers["Authorization"] == "Bearer fm_key"
    assert first.headers["Idempotency-Key"] == second.headers["Idempotency-Key"] == call.idempotency_key
    # v4: the key is signed too, so a copy sent again under another key (or none) is refused.
    key = call.idempotency_key
    signed = f"v4\n1700000000\nPOST\n{len(path)}:{path}\n{len(key)}:{key}\n".encode() + first.content
    expected = hmac.new(b"s3cret", signed, hashlib.sha256).hexdigest()
    assert first.headers[signing.SIGNATURE_HEADER] == f"t=1700000000,v4={expected}"
    assert second.headers[signing.SIGNATURE_HEADER].startswith("t=1700000005,v4=")
    assert calls.ingest({}, None).idempotency_key != calls.ingest({}, None).idempotency_key


def test_errors_map_statuses_and_keep_the_problem_detail():
    request = httpx.Request("GET", "http://x/")
    problems = {"detail": "pages[0].slug: Field required", "errors": [{"loc": "pages[0].slug", "msg": "m"}]}
    invalid = errors.error_for(httpx.Response(422, json=problems, request=request))
    assert isinstance(invalid, errors.UnprocessableEntity)
    assert invalid.detail == problems["detail"] and invalid.errors == problems["errors"]
    for status, cls in errors.BY_STATUS.items():
        assert type(errors.error_for(httpx.Response(status, json={"detail": "d"}))) is cls
    proxy = errors.error_for(httpx.Response(502, text="<html>bad gateway</html>"))
    assert isinstance(proxy, errors.ServerError) and proxy.detail == "<html>bad gateway</html>"
    limited = errors.error_for(httpx.Response(429, json={"detail": "d"}, headers={"Retry-After": "7"}))
    assert isinstance(limited, errors.RateLimited) and limited.retry_after == 7.0
    # A gateway or WAF in front of the API answers in its own JSON: its message, not "None".
    waf = errors.error_for(httpx.Response(403, json={"message": "Forbidden by WAF rule 12"}))
    assert isinstance(waf, errors.PermissionDenied) and waf.detail == "Forbidden by WAF rule 12"
    assert str(errors.error_for(httpx.Response(400, json={"error": "bad"}))) == "400: bad"
    assert errors.error_for(httpx.Response(502, json={"other": 1})).detail == '{"other":1}'


def test_a_dot_segment_id_is_escaped_so_httpx_keeps_it_on_its_route():
    """httpx resolves "." and ".." away: append_messages("..") went to /v1/messages and
    get_transcript(".") to the list route. Escaped, the path reaches the server as written."""
    assert calls.segment("..") == "%2E%2E" and calls.segment(".") == "%2E" and calls.segment("a.b") == "a.b"
    call = calls.append_messages("..", [{"role": "user", "text": "hi"}], None, None)
    with httpx.Client(base_url="http://factmill.test") as http:
        request = build_request(http, call, Credentials(None, "s3cret"))
    assert request.url.raw_path.decode() == "/v1/transcripts/%2E%2E/messages"


def test_dot_parts_of_a_slug_or_an_entity_name_stay_on_their_route():
    """ "people/../alice" went to alice's facts, and "x/.." to no route: httpx resolved the parts."""
    with httpx.Client(base_url="http://factmill.test") as http:
        entity = build_request(http, calls.entity_facts("people/../alice", None, 10, 0), Credentials())
        page = build_request(http, calls.page_facts("default", "a/./b", 10, None), Credentials())
    assert entity.url.raw_path.decode().startswith("/v1/entities/people/%2E%2E/alice/facts")
    assert page.url.raw_path.decode().startswith("/v1/pages/default/a/%2E/b/facts")
    assert calls.slash_path("conversations/2024/zoë") == "conversations/2024/zo%C3%AB"


def test_retry_after_as_an_http_date_is_waited_for_or_raised():
    """A proxy's 503 "Retry-After: <date>" was read as no header: resent at once, three times."""
    in_an_hour = httpx.Headers({"Retry-After": "Wed, 21 Oct 2026 08:28:00 GMT"})
    assert errors.retry_after_seconds(in_an_hour, now=1_792_567_680) == 3600.0
    assert errors.retry_after_seconds(httpx.Headers({"Retry-After": "soon"})) is None
    past = httpx.Headers({"Retry-After": "Wed, 21 Oct 2015 07:28:00 GMT"})
    assert errors.retry_after_seconds(past) == 0.0
    policy = RetryPolicy(attempts=3, max_retry_after=30)
    proxied = httpx.Response(
        503, headers={"Retry-After": format_datetime(datetime.now(UTC) + timedelta(hours=1), usegmt=True)}
    )
    assert policy.after_response(calls.ingest({}, None), proxied, 1) is None  # past the cap: raised


def test_api_errors_cross_a_process_boundary():
    error = errors.error_for(httpx.Response(409, json={"detail": "busy"}, headers={"Retry-After": "3"}))
    again = pickle.loads(pickle.dumps(error))
    assert type(again) is errors.Conflict and (again.status_code, again.detail) == (409, "busy")
    assert again.retry_after == 3.0


def test_retries_are_logged_without_the_ids_in_the_path(caplog: pytest.LogCaptureFixture):
    from factmill_client.transport import give_up_message, note_retry

    call = calls.append_messages("alice-smith-diary", [{"role": "user", "text": "hi"}], None, None)
    with caplog.at_level("INFO", logger="factmill_client"):
        note_retry(call, 1, "answered 503", 0.5)
    said = caplog.records[-1].getMessage() + give_up_message(call, TimeoutError("t"), 4)
    assert "/v1/transcripts/…" in said and "alice-smith" not in said


def test_an_unsignable_idempotency_key_is_refused_when_the_call_is_made():
    for bad in ("clé-1", " padded ", "", "x" * 256):
        with pytest.raises(ValueError, match="printable ASCII"):
            calls.ingest({}, bad)
    assert calls.ingest({}, "delivery-1").idempotency_key == "delivery-1"


def test_a_success_answer_of_another_shape_is_an_api_error_not_a_pydantic_one():
    call = calls.ingest({}, None)
    for response in (
        httpx.Response(200, text="<html>captive portal</html>"),
        httpx.Response(200, json={"something": "else"}),
    ):
        with pytest.raises(errors.UnexpectedResponse) as info:
            parse(call, response)
        assert isinstance(info.value, errors.FactmillError) and "not a PagesAccepted" in info.value.detail
    unavailable = errors.error_for(httpx.Response(503, json={"detail": "d"}, headers={"Retry-After": "5"}))
    assert isinstance(unavailable, errors.ServerError) and unavailable.retry_after == 5.0


def test_a_call_keeps_its_first_signed_time_until_a_server_would_refuse_it():
    ticks = iter([1_700_000_000, 1_700_000_030, 1_700_000_061, 1_700_000_090])
    credentials = Credentials(None, "s3cret", clock=lambda: next(ticks))
    first = credentials.signing_time(None)
    assert first == 1_700_000_000
    assert credentials.signing_time(first) == first  # 30 s on: still taken, and still the call's time
    redated = credentials.signing_time(first)  # 61 s on: past REDATE_AFTER_SECONDS, dated anew
    assert redated == 1_700_000_061 and credentials.signing_time(redated) == redated


def test_an_answer_that_cannot_be_decoded_is_a_factmill_error() -> None:
    """httpx's DecodingError (a body its Content-Encoding does not describe) is no TransportError: it
    escaped the client's classes, against "FactmillError: anything the client raises"."""
    import asyncio

    from factmill_client import ApiConnectionError, AsyncClient, Client, FactmillError

    def broken(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, headers={"Content-Encoding": "gzip"}, content=b"not gzip at all")

    with (
        Client("http://factmill.test", transport=httpx.MockTransport(broken)) as client,
        pytest.raises(ApiConnectionError) as caught,
    ):
        client.get_job(1)
    assert isinstance(caught.value, FactmillError) and "DecodingError" in str(caught.value)

    async def run() -> None:
        async with AsyncClient("http://factmill.test", transport=httpx.MockTransport(broken)) as client:
            with pytest.raises(ApiConnectionError):
                await client.get_job(1)

    asyncio.run(run())


def test_the_facts_lists_are_walked_by_their_cursor_and_by_offset_from_an_older_server() -> None:
    """By offset, a fact stored or superseded between two reads was read twice or skipped."""
    from factmill_client import models

    paging = calls.entity_facts_paging("people/alice", None, 2)
    fact = {
        "id": 7, "row_num": 0, "fact": "f", "kind": "fact", "entity_slug": "people/alice", "confidence": 1.0,
        "notability": "high", "context": "", "valid_from": None, "source": "s", "source_session": "s",
        "claim_metric": None, "claim_value": None, "claim_unit": None, "claim_period": None,
        "created_at": "2024-03-01T00:00:00Z", "status": "current", "valid_to": None, "superseded_by": None,
        "duplicate_of": None, "source_id": "default", "source_markdown_slug": "p",
    }  # fmt: skip
    page = {"entity": "people/alice", "total": 9, "facts": [fact, fact]}
    following = paging.after(models.EntityFactsPage.model_validate(page | {"next_after": "n:7"}), 2)
    assert following is not None and following.params["after"] == "n:7" and following.params["offset"] == 0
    assert paging.after(models.EntityFactsPage.model_validate(page | {"next_after": None}), 2) is None
    older = paging.after(models.EntityFactsPage.model_validate(page), 2)  # a server that answers no cursor
    assert older is not None and older.params["offset"] == 2 and "after" not in older.params
    rows = calls.facts_paging("default", "p", 2)
    by_row = {"source_id": "default", "slug": "p", "page_id": 1, "total": 9, "facts": [fact, fact]}
    following = rows.after(models.PageFactsPage.model_validate(by_row | {"next_after_row_num": 4}), 2)
    assert following is not None and following.params["after_row_num"] == 4
    assert rows.after(models.PageFactsPage.model_validate(by_row | {"next_after_row_num": None}), 2) is None


def test_an_entity_walk_yields_a_fact_the_cursor_met_again_once() -> None:
    """A consolidation moved a fact read already past the cursor (its start made earlier): the next page
    held it again, and the walk, which promises every fact, yielded it twice."""
    import asyncio
    from typing import Any

    from factmill_client import AsyncClient, Client

    def fact(fact_id: int) -> dict[str, Any]:
        return {
            "id": fact_id, "row_num": 0, "fact": f"f{fact_id}", "kind": "fact", "entity_slug": "people/alice",
            "confidence": 1.0, "notability": "high", "context": "", "valid_from": None, "source": "s",
            "source_session": "s", "claim_metric": None, "claim_value": None, "claim_unit": None,
            "claim_period": None, "created_at": "2024-03-01T00:00:00Z", "status": "current", "valid_to": None,
            "superseded_by": None, "duplicate_of": None, "source_id": "default", "source_markdown_slug": "p",
        }  # fmt: skip

    def pages(request: httpx.Request) -> httpx.Response:
        later = request.url.params.get("after") == "c1"
        facts = [fact(2), fact(3)] if later else [fact(1), fact(2)]
        cursor = None if later else "c1"
        return httpx.Response(
            200, json={"entity": "people/alice", "total": 3, "facts": facts, "next_after": cursor}
        )

    with Client("http://factmill.test", transport=httpx.MockTransport(pages)) as client:
        assert [f.id for f in client.iter_entity_facts("people/alice", page_size=2)] == [1, 2, 3]

    async def walk() -> list[int]:
        async with AsyncClient("http://factmill.test", transport=httpx.MockTransport(pages)) as client:
            return [f.id async for f in client.iter_entity_facts("people/alice", page_size=2)]

    assert asyncio.run(walk()) == [1, 2, 3]


@pytest.mark.parametrize("secret", ["", "  \n", [], ["s3cret", ""]])
def test_a_webhook_secret_that_signs_nothing_is_refused_when_the_client_is_made(secret: object) -> None:
    """An empty secret (an unset variable read as "") sent every ingest unsigned, each a 401 "missing
    Factmill-Signature header"; a blank one raised a bare ValueError on the first ingest."""
    from factmill_client import Client

    with pytest.raises(ValueError, match="webhook secret"):
        Client("http://127.0.0.1:9", webhook_secret=secret)  # type: ignore[arg-type]
    with Client("http://127.0.0.1:9", webhook_secret=" s3cret\n"):  # read from a file: taken, stripped
        pass

    def sent(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        return httpx.Response(404, json={"detail": "no such transcript"})  # the request is what is checked

    for blank in ("", "\n", "  \t"):  # beside a key, a blank secret signs nothing: the key authenticates
        seen: list[httpx.Request] = []
        transport = httpx.MockTransport(sent)
        client = Client("http://factmill.test", api_key="fm_key", webhook_secret=blank, transport=transport)
        with client, pytest.raises(errors.NotFound):  # a signed call: sent (not a ValueError), unsigned
            client.append_messages("t", [{"role": "user", "text": "hi"}])
        [request] = seen
        assert request.headers["Authorization"] == "Bearer fm_key"
        assert signing.SIGNATURE_HEADER not in request.headers
    with pytest.raises(
        ValueError, match="webhook secret"
    ):  # an empty key is no key: nothing would authenticate
        Client("http://127.0.0.1:9", api_key="", webhook_secret=secret)  # type: ignore[arg-type]


@pytest.mark.parametrize("key", ["fm_secretkey\n", " fm_secretkey", "fm_secret key", "fm_sécret"])
def test_an_api_key_no_header_can_carry_is_refused_without_quoting_it(
    key: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A key read from a file with its newline: httpx refused the header and quoted it whole in its
    error, and the client's ApiConnectionError (after three retries of a GET) carried the key into any
    log that recorded it. Refused before the connection pool is made (it was left open)."""
    from factmill_client import AsyncClient, Client

    pools: list[object] = []
    for name in ("Client", "AsyncClient"):
        made = getattr(httpx, name)
        monkeypatch.setattr(
            httpx, name, lambda *a, made=made, **kw: pools.append(made(*a, **kw)) or pools[-1]
        )
    for client in (Client, AsyncClient):
        with pytest.raises(ValueError, match="api_key holds") as refused:
            client("http://127.0.0.1:9", api_key=key)
        assert "secret" not in str(refused.value)
    assert pools == []
    with Client("http://127.0.0.1:9", api_key="fm_secretkey"):  # a key of visible ASCII is taken
        pass


@pytest.mark.parametrize(
    "call",
    [
        lambda: calls.append_messages("team/chat-1", [{"role": "user", "text": "hi"}], None, None),
        lambda: calls.get_transcript("alice/messages"),
        lambda: calls.get_context("alice/context"),
        lambda: calls.list_messages("a/b", None, 10),
        lambda: calls.delete_transcript("alice/compactions"),
    ],
)
def test_a_transcript_id_holding_a_slash_is_refused_before_it_is_sent(call) -> None:
    """The server decodes %2F before it routes: "alice%2Fmessages" read alice's messages, "team%2Fchat-1"
    was a bare 404 for an append that creates its transcript. A transcript id holds no '/'."""
    with pytest.raises(ValueError, match="no '/'"):
        call()


def test_httpx_log_lines_for_a_client_name_only_the_route_group(caplog: pytest.LogCaptureFixture):
    """httpx logs every request's URL whole at INFO, the level the retry lines need: beside the client's
    own "/v1/pages/…" stood the page's slug, the entity, the cursor (README: ids can name a person)."""
    from factmill_client import Client

    transport_ = httpx.MockTransport(lambda request: httpx.Response(404, json={"detail": "no page"}))
    client = Client("http://h:8000/api", transport=transport_)
    with caplog.at_level("INFO", logger="httpx"), pytest.raises(errors.NotFound):
        client.page_facts("default", "conversations/alice-smith")
    with caplog.at_level("INFO", logger="httpx"):
        httpx.Client(transport=transport_).get("http://elsewhere/v1/pages/default/bob-jones?limit=5")
    lines = [record.getMessage() for record in caplog.records if record.name == "httpx"]
    assert len(lines) == 2, lines
    assert (
        "GET http://h:8000/api/v1/pages/… " in lines[0]
        and "alice" not in lines[0]
        and "limit" not in lines[0]
    )
    assert "http://elsewhere/v1/pages/default/bob-jones?limit=5" in lines[1]  # not a Factmill client's
    # Kept while a client of that base is open, forgotten once the last one closes (the set only grew).
    from factmill_client import transport

    other = Client("http://h:8000/api", transport=transport_)
    client.close()
    client.close()  # (twice: counted once)
    assert httpx.URL("http://h:8000/api/") in transport._BASES
    other.close()
    assert httpx.URL("http://h:8000/api/") not in transport._BASES
