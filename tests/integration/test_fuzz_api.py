"""Schemathesis against the real API and Postgres (the ASGI app in-process): every operation, with and
without credentials, gives no 5xx and answers what the OpenAPI document says (status codes, schemas)."""

from __future__ import annotations

import json
from typing import Any

import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from schemathesis import checks
from sqlalchemy.orm import Session, sessionmaker

from tests.integration.test_api import ADMIN, SECRET, Recorder, make_runtime
from worker.api.app import create_app
from worker.core.signing import SIGNATURE_HEADER, sign

pytestmark = pytest.mark.integration

EXAMPLES_PER_OPERATION = 50


def credentials(method: str, path: str, body: bytes) -> dict[str, str]:
    """What a legitimate client sends: the admin token and a v2 signature of method, path and body."""
    signature = sign(body, SECRET, method=method, path=path)
    return {"Authorization": f"Bearer {ADMIN}", SIGNATURE_HEADER: signature}


def body_bytes(case: Any) -> bytes | None:
    body = case.body
    if isinstance(body, schemathesis.core.NotSet):
        return None
    return body if isinstance(body, bytes) else json.dumps(body).encode("utf-8")


FUZZ_SETTINGS = settings(
    max_examples=EXAMPLES_PER_OPERATION,
    deadline=None,
    suppress_health_check=list(HealthCheck),
    derandomize=True,
    database=None,
)


# Every other check stays on (no 5xx, status codes, content types, response schemas and headers, invalid
# data refused). Off: "schema-valid data accepted", because the API has rules JSON Schema does not state
# (the slug grammar, no NUL or lone surrogates in text, a tool result answers the call before it). Off:
# "ignored auth", because the ingestion routes rightly accept a webhook signature in place of a key, and
# the check strips only the Authorization header; test_access.py asserts that every operation refuses a
# caller with neither.
EXCLUDED_CHECKS = [checks.positive_data_acceptance, checks.ignored_auth]


def call(case: Any, authenticated: bool) -> None:
    body = body_bytes(case)
    headers = credentials(case.method, case.formatted_path, body or b"") if authenticated else {}
    if body is not None:
        headers["Content-Type"] = "application/json"
        case.call_and_validate(headers=headers, data=body, excluded_checks=EXCLUDED_CHECKS)
    else:
        case.call_and_validate(headers=headers, excluded_checks=EXCLUDED_CHECKS)


def fuzz_operation(operation: Any, authenticated: bool, config: settings = FUZZ_SETTINGS) -> None:
    """Run ``config.max_examples`` generated cases against one operation; raises on the first failure."""

    @given(case=operation.as_strategy())
    @config
    def run(case: Any) -> None:
        call(case, authenticated)

    run()


def operations(app: Any) -> list[Any]:
    loaded = schemathesis.openapi.from_asgi("/openapi.json", app)
    return [result.ok() for result in loaded.get_all_operations()]


@pytest.mark.parametrize("authenticated", [True, False], ids=["authenticated", "anonymous"])
def test_every_operation_conforms_and_never_answers_5xx(
    database_url: str, broker_url: str, factory: sessionmaker[Session], authenticated: bool
) -> None:
    # A real broker, so /readyz answers 200 (its 503 is a server error by design when Redis is down).
    runtime = make_runtime(database_url, factory, broker_url=broker_url, max_body_bytes=1024 * 1024)
    app = create_app(runtime, sender=Recorder(factory))
    failures: list[str] = []
    for operation in operations(app):
        try:
            fuzz_operation(operation, authenticated)
        except Exception as exc:  # collect every operation's first failure, then report them all
            failures.append(f"{operation.label}: {str(exc)[:3000]}")
    assert not failures, "\n\n".join(failures)
