"""The client's pure parts: one signature scheme shared with the server, a client that stands alone,
the retry rules, the requests it builds, the errors it raises."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import tomllib
from pathlib import Path

import httpx
import pytest

import worker.core.signing as server_signing
from factmill_client import calls, errors, signing
from factmill_client.transport import Credentials, RetryPolicy, build_request

REPO = Path(__file__).resolve().parents[2]


def test_the_server_verifies_with_the_clients_own_signing_function():
    assert server_signing.sign is signing.sign
    assert server_signing.compute_signature is signing.compute_signature
    body = b'{"slug": "x"}'
    header = signing.sign(body, "s3cret", 1_700_000_000, method="post", path="/v1/pages")
    assert header.startswith("t=1700000000,v2=")
    now = 1_700_000_010
    assert (
        server_signing.verify(header, body, "s3cret", 300, now, method="POST", path="/v1/pages")
        == 1_700_000_000
    )
    with pytest.raises(server_signing.SignatureError):
        server_signing.verify(header, body, "s3cret", 300, now, method="POST", path="/v1/other")


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
    project = tomllib.loads((REPO / "factmill_client" / "pyproject.toml").read_text())["project"]
    assert sorted(d.split(">")[0] for d in project["dependencies"]) == ["httpx", "pydantic"]
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
    assert policy.after_response(retry, answer(429, **{"Retry-After": "2"}), 1) == 2.0
    assert policy.after_response(ingest, answer(503, **{"Retry-After": "3600"}), 1) is None  # too long
    assert policy.after_error(retry, httpx.ConnectError("refused", request=request), 1) is not None
    assert policy.after_error(retry, httpx.ReadTimeout("slow", request=request), 1) is None
    assert policy.after_error(ingest, httpx.ReadTimeout("slow", request=request), 1) is not None


def test_requests_carry_the_key_and_a_fresh_signature_over_the_path_as_sent():
    ticks = iter([1_700_000_000, 1_700_000_005])
    credentials = Credentials("fm_key", "s3cret", clock=lambda: next(ticks))
    call = calls.append_messages("chat 1/é", [{"role": "user", "text": "hi"}], None, None)
    with httpx.Client(base_url="http://factmill.test") as http:
        first, second = build_request(http, call, credentials), build_request(http, call, credentials)
    path = "/v1/transcripts/chat%201%2F%C3%A9/messages"
    assert first.url.raw_path.decode() == path
    assert first.headers["Authorization"] == "Bearer fm_key"
    assert first.headers["Idempotency-Key"] == second.headers["Idempotency-Key"] == call.idempotency_key
    assert first.headers[signing.SIGNATURE_HEADER] == signing.sign(
        first.content, "s3cret", 1_700_000_000, method="POST", path=path
    )
    assert second.headers[signing.SIGNATURE_HEADER].startswith("t=1700000005,")
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
