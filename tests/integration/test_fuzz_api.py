"""Schemathesis against the real API and Postgres (the ASGI app in-process): every operation, with the
admin's credentials, a key limited to another source and none, gives no 5xx and answers what the OpenAPI
document says (status codes, schemas); the limited key reads and changes nothing outside its source."""

from __future__ import annotations

import json
import os
import unicodedata
import uuid
from collections import Counter
from collections.abc import Callable, Iterator
from datetime import UTC, datetime
from functools import partial
from types import SimpleNamespace
from typing import Any
from urllib.parse import unquote

import jsonschema_rs
import pytest
import schemathesis
from fastapi.testclient import TestClient
from hypothesis import HealthCheck, given, reject, settings
from hypothesis import strategies as st
from hypothesis.errors import UnsatisfiedAssumption
from schemathesis import GenerationMode, checks
from sqlalchemy import text
from sqlalchemy.orm import Session, sessionmaker

from models import Job, Page
from tests.auth import bearer, new_key
from tests.integration.test_api import ADMIN, SECRET, Recorder, fact_row, make_runtime
from worker.api.app import create_app
from worker.api.deps import IDEMPOTENCY_HEADER
from worker.core.signing import SIGNATURE_HEADER, sign
from worker.jobs.outbox import page_subject

pytestmark = pytest.mark.integration

EXAMPLES_PER_OPERATION = int(os.environ.get("FUZZ_EXAMPLES", "50"))


def credentials(method: str, path: str, body: bytes, key: str | None = None) -> dict[str, str]:
    """What a legitimate client sends: the admin token and a v4 signature of method, path, the
    Idempotency-Key (``key``) and body."""
    signature = sign(body, SECRET, method=method, path=path, idempotency_key=key)
    return {"Authorization": f"Bearer {ADMIN}", SIGNATURE_HEADER: signature}


def seed(factory: sessionmaker[Session]) -> None:
    """Rows for the reads to answer with: pages (more than a listing's first page of generated limits),
    dated and undated facts about one entity, jobs. On an empty database every listing answered [] and
    every read 404, so their response schemas and cursors went unchecked."""
    with factory.begin() as session:
        for n in range(3):
            slug = f"conversations/fuzz-{n}"
            session.add(Page(source_id="default", slug=slug, type="conversation", content_hash=str(n)))
            for row in range(4):
                fact = fact_row(slug, row, f"Alice example said thing {row} of page {n}.")
                fact.entity_slug = "people/alice-example"
                fact.valid_from = datetime(2024, 1 + row, 1 + n, tzinfo=UTC) if row % 2 else None
                session.add(fact)
            session.add(Job(kind="extraction", subject=page_subject("default", slug), status="succeeded"))


def make_fuzzed_app(database_url: str, broker_url: str, factory: sessionmaker[Session]) -> Any:
    """The in-process API over a seeded database. No search rate limit: 60 a minute (the default) left
    most generated searches a 429, which the document allows, and never run."""
    seed(factory)
    runtime = make_runtime(
        database_url, factory, broker_url=broker_url, max_body_bytes=1024 * 1024, search_rate_per_minute=0
    )
    return create_app(runtime, sender=Recorder(factory))


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


# Every check is on (no 5xx, status codes, content types, response schemas and headers, invalid data
# refused, valid data accepted, auth enforced), but "schema-valid data accepted" on transcript appends:
# a message's fields depend on its role, a turn's tool-call ids are unique, and a tool result answers a
# call made before it, none of which JSON Schema can state; test_compaction_service.py and tests/unit
# hold those rules. A query document is a language of its own too: the document names it as the format
# "factmill-query" (described there), and QUERY_STRATEGY below generates valid ones for it. Every other
# rule is in the document as a pattern that tests/unit/test_document_patterns.py proves exact.
# A config value's form depends on the key in the path (a switch's true/false, a budget's amount, the
# prices' JSON), which no schema of the body can say either; test_api.py and test_budget.py hold those.
# A transcript's window must be larger than its reserve, counting the settings already stored (a
# partial update), which no schema can compare; test_compaction_service.py holds that.
UNSTATABLE = {
    ("POST", "/v1/transcripts/{transcript_id}/messages"): [checks.positive_data_acceptance],
    ("PUT", "/v1/transcripts/{transcript_id}"): [checks.positive_data_acceptance],
    ("PUT", "/v1/config/{key}"): [checks.positive_data_acceptance],
}

_WORDS = st.text(alphabet=st.characters(categories=["L", "Nd"]), min_size=1, max_size=12)
# Valid queries as the "factmill-query" format means them: a plain line, or lex: lines (vec:/hyde: need
# an embedding model, which this in-process API has not). No intent: line: it may not meet the intent
# field, a rule between two fields that test_search.py holds.
QUERY_STRATEGY = st.one_of(
    st.lists(_WORDS, min_size=1, max_size=4).map(" ".join),
    st.lists(_WORDS.map(lambda w: f"lex: {w}"), min_size=1, max_size=3).map("\n".join),
)
schemathesis.openapi.format("factmill-query", QUERY_STRATEGY)


def conformance(document: dict[str, Any], operation: Any) -> Callable[[Any], bool]:
    """Whether a case truly conforms to the operation: its body and its patterned parameters, judged
    exactly (jsonschema_rs: Unicode properties as the document means them). Schemathesis generates
    ``\\p{M}`` and ``[^\\p{C}]`` from approximate ranges that hold unassigned code points, which the
    document excludes; such a "positive" case is the generator's mistake, not the API's, so it is
    dropped rather than sent."""
    spec = document["paths"][operation.path][operation.method.lower()]
    checks_: list[Callable[[Any], bool]] = []
    body = spec.get("requestBody")
    if body is not None:
        schema = body["content"]["application/json"]["schema"]
        valid_body = jsonschema_rs.validator_for({**schema, "components": document["components"]}).is_valid
        checks_.append(lambda case: isinstance(case.body, schemathesis.core.NotSet) or valid_body(case.body))
    for parameter in spec.get("parameters", []):
        pattern = parameter.get("schema", {}).get("pattern")
        if pattern is None:
            continue
        where, name = parameter["in"], parameter["name"]
        valid = jsonschema_rs.validator_for({"type": "string", "pattern": pattern}).is_valid
        checks_.append(partial(_parameter_ok, where=where, name=name, valid=valid))
    checks_.append(lambda case: not _newer_unicode(case))
    return lambda case: all(check(case) for check in checks_)


def _strings(value: Any) -> Iterator[str]:
    if isinstance(value, str):
        yield value
    elif isinstance(value, dict):
        for key, item in value.items():
            yield from _strings(key)
            yield from _strings(item)
    elif isinstance(value, list):
        for item in value:
            yield from _strings(item)


def _newer_unicode(case: Any) -> bool:
    """A character this Python's Unicode (14) does not know but the regex engine may (a newer letter):
    the API and the document then disagree by Unicode version alone, which no rule can fix."""
    parts = [case.body, case.query, case.headers]
    parts += [unquote(v) if isinstance(v, str) else v for v in (case.path_parameters or {}).values()]
    return any(
        unicodedata.category(ch) == "Cn" and not 0xD800 <= ord(ch) <= 0xDFFF
        for part in parts
        if part is not None and not isinstance(part, schemathesis.core.NotSet)
        for text in _strings(part)
        for ch in text
    )


def _parameter_ok(case: Any, *, where: str, name: str, valid: Callable[[Any], bool]) -> bool:
    values = {"path": case.path_parameters, "query": case.query, "header": case.headers}.get(where) or {}
    value = values.get(name)
    if isinstance(value, str) and where == "path":
        value = unquote(value)  # schemathesis holds path parameters percent-encoded
    return not isinstance(value, str) or valid(value)


# Who sends a case: its credential headers from (method, path, body, Idempotency-Key); None: no one's.
Caller = Callable[[str, str, bytes, str | None], dict[str, str]]


def call(case: Any, caller: Caller | None, conforms: Callable[[Any], bool], counts: Counter[str]) -> Any:
    """Send one case, count a 5xx answer in ``counts``, then run the checks (which raise on a failure)."""
    positive = case.meta is not None and case.meta.generation.mode == GenerationMode.POSITIVE
    excluded = UNSTATABLE.get((case.method.upper(), case.operation.path), [])
    if positive and checks.positive_data_acceptance not in excluded and not conforms(case):
        reject()
    if positive:
        # Each case is a new delivery. A generated key repeats across cases with other bodies, and the
        # API rightly answers that reuse with 422 (the IETF draft's code): replays are tested in
        # test_api.py, and a fresh key (the same one in the header and the feedback body, which must
        # agree) keeps the idempotency path running here.
        key = uuid.uuid4().hex
        if case.headers and IDEMPOTENCY_HEADER in case.headers:
            case.headers[IDEMPOTENCY_HEADER] = key
        if isinstance(case.body, dict) and isinstance(case.body.get("idempotency_key"), str):
            case.body["idempotency_key"] = key
    body = body_bytes(case)
    sent_key = (case.headers or {}).get(IDEMPOTENCY_HEADER)
    headers = caller(case.method, case.formatted_path, body or b"", sent_key) if caller else {}
    sent: dict[str, Any] = {}
    if body is not None:
        headers["Content-Type"] = "application/json"
        sent["data"] = body
    response = case.call(headers=headers, **sent)
    if response.status_code >= 500:
        counts["5xx"] += 1  # counted before the checks, whose not_a_server_error raises on it
    replay = {"headers": dict(headers), **sent}  # what call_and_validate hands the checks that re-send
    case.validate_response(response, excluded_checks=excluded, headers=headers, transport_kwargs=replay)
    return response


def fuzz_operation(
    operation: Any,
    caller: Caller | None,
    document: dict[str, Any],
    config: settings = FUZZ_SETTINGS,
    tally: Counter[str] | None = None,
    answered: Callable[[Any, Any], None] | None = None,
) -> None:
    """Run ``config.max_examples`` generated cases against one operation; raises on the first failure.
    ``tally`` (bench/fuzz.py) counts the cases sent, the 5xx answers and the failed checks; ``answered``
    sees each case and its response after the checks."""
    conforms = conformance(document, operation)
    counts: Counter[str] = Counter() if tally is None else tally

    @given(case=operation.as_strategy())
    @config
    def run(case: Any) -> None:
        try:
            response = call(case, caller, conforms, counts)
            if answered is not None:
                answered(case, response)
        except UnsatisfiedAssumption:  # dropped before sending (see ``conformance``)
            raise
        except (Exception, BaseExceptionGroup):  # validate_response raises a FailureGroup
            counts["cases"] += 1
            counts["failures"] += 1
            raise
        counts["cases"] += 1

    run()


def operations(app: Any) -> list[Any]:
    loaded = schemathesis.openapi.from_asgi("/openapi.json", app)
    # JSON Schema cannot say "no NUL character" short of a pattern on every string; the document's
    # description states that rule instead (422 for NUL and lone surrogates, which UTF-8 already excludes).
    loaded.config.generation.update(allow_x00=False)
    return [result.ok() for result in loaded.get_all_operations()]


# The operations are dealt out to this many tests (every SHARDS-th one each), so that parallel test
# processes share the fuzzing, which is the suite's longest run in one test process.
SHARDS = 4


@pytest.mark.parametrize("shard", range(SHARDS), ids=lambda shard: f"{shard + 1}of{SHARDS}")
@pytest.mark.parametrize("authenticated", [True, False], ids=["authenticated", "anonymous"])
def test_every_operation_conforms_and_never_answers_5xx(
    database_url: str, broker_url: str, factory: sessionmaker[Session], authenticated: bool, shard: int
) -> None:
    caller = credentials if authenticated else None
    # A real broker, so /readyz answers 200 (its 503 is a server error by design when Redis is down).
    app = make_fuzzed_app(database_url, broker_url, factory)
    every = operations(app)
    assert len(every) >= SHARDS * 4, "the API's operations are fewer than expected: is the document empty?"
    failures: list[str] = []
    for operation in every[shard::SHARDS]:
        # Every operation's first failure collected, then all reported (a FailureGroup is no Exception).
        try:
            fuzz_operation(operation, caller, app.openapi())
        except (Exception, BaseExceptionGroup) as exc:
            failures.append(f"{operation.label}: {str(exc)[:3000]}")
    assert not failures, "\n\n".join(failures)


# A key for reading and ingesting one source, "work", fuzzed against the "default" source's seeded rows.
LIMITED_SOURCE = "work"
SEEDED_MARKS = ("fuzz-", "Alice example said")  # in every seeded page's slug, every seeded fact's text


def outside_the_source(factory: sessionmaker[Session]) -> dict[str, Any]:
    """What a key limited to LIMITED_SOURCE may neither change nor add to: every other source's pages,
    facts and jobs, and the data no source partitions (transcripts, feedback, config, keys, backfills)."""
    counted = {
        "pages": "SELECT count(*), string_agg(slug || content_hash, ',' ORDER BY slug) FROM pages"
        " WHERE source_id <> :source",
        "facts": "SELECT count(*), string_agg(fact, ',' ORDER BY id) FROM facts WHERE source_id <> :source",
        "jobs": "SELECT count(*), string_agg(status || subject, ',' ORDER BY id) FROM jobs"
        " WHERE subject NOT LIKE :source || '|%'",
        **{table: f"SELECT count(*), max(1) FROM {table}" for table in UNPARTITIONED},
    }
    with factory() as session:
        return {
            name: tuple(session.execute(text(sql), {"source": LIMITED_SOURCE}).one())
            for name, sql in counted.items()
        }


UNPARTITIONED = (
    "transcripts",
    "transcript_messages",
    "calibration_observations",
    "config",
    "api_keys",
    "backfills",
)


@pytest.mark.parametrize("shard", range(SHARDS), ids=lambda shard: f"{shard + 1}of{SHARDS}")
def test_a_key_limited_to_one_source_reads_and_changes_nothing_outside_it(
    database_url: str, broker_url: str, factory: sessionmaker[Session], shard: int
) -> None:
    app = make_fuzzed_app(database_url, broker_url, factory)
    key = new_key(factory, ["read", "ingest"], [LIMITED_SOURCE])
    before = outside_the_source(factory)
    leaked: list[str] = []

    def seen(case: Any, response: Any) -> None:
        if response.status_code < 300 and any(mark in response.text for mark in SEEDED_MARKS):
            leaked.append(f"{case.method} {case.formatted_path} {case.query}: {response.text[:300]}")

    failures: list[str] = []
    for operation in operations(app)[shard::SHARDS]:
        try:
            fuzz_operation(operation, lambda *_: bearer(key), app.openapi(), LIMITED_SETTINGS, answered=seen)
        except (Exception, BaseExceptionGroup) as exc:
            failures.append(f"{operation.label}: {str(exc)[:3000]}")
    assert not failures, "\n\n".join(failures)
    # Generated paths never name the seeded rows: their own addresses, read with the limited key.
    with TestClient(app) as client:
        for path, parameters, query in SEEDED_READS:
            answer = client.get(path.format(**parameters), params=query, headers=bearer(key))
            assert answer.status_code in (200, 403), (path, answer.text[:300])
            seen(SimpleNamespace(method="GET", formatted_path=path, query=query), answer)
    assert not leaked, "\n".join(leaked)
    assert outside_the_source(factory) == before


LIMITED_SETTINGS = settings(FUZZ_SETTINGS, max_examples=max(1, EXAMPLES_PER_OPERATION // 4))


# The seeded rows' own addresses: generated path parameters essentially never name them, so the reads
# of a page's or an entity's facts answered 404 or [] throughout the fuzzing above.
SEEDED_READS = [
    ("/v1/pages", {}, {"limit": 1}),
    ("/v1/pages/{source_id}/{slug}/facts", {"source_id": "default", "slug": "conversations/fuzz-0"}, {}),
    (
        "/v1/pages/{source_id}/{slug}/facts",
        {"source_id": "default", "slug": "conversations/fuzz-1"},
        {"limit": 2, "include_history": "true"},
    ),
    ("/v1/entities/{entity}/facts", {"entity": "people/alice-example"}, {"limit": 3}),
    ("/v1/entities/{entity}/facts", {"entity": "people/alice-example"}, {"include_history": "true"}),
    ("/v1/jobs", {}, {"status": "succeeded"}),  # (paged by before_id, the last id: no cursor to follow)
]


def test_the_reads_of_seeded_rows_and_their_next_pages_answer_as_documented(
    database_url: str, broker_url: str, factory: sessionmaker[Session]
) -> None:
    app = make_fuzzed_app(database_url, broker_url, factory)
    by_path = {op.path: op for op in operations(app) if op.method.upper() == "GET"}
    for path, parameters, query in SEEDED_READS:
        operation, pages, paged = by_path[path], 0, "limit" in query
        while query is not None and pages < 20:
            case = operation.Case(path_parameters=parameters, query=query)
            headers = credentials("GET", case.formatted_path, b"")
            response = case.call(headers=headers)
            assert response.status_code == 200, (path, parameters, query, response.text)
            case.validate_response(response, headers=headers)
            body, pages = response.json(), pages + 1
            listed = next(v for k, v in body.items() if isinstance(v, list))
            assert listed, (path, parameters, query, body)  # the seeded rows, not an empty answer
            cursor = {k: v for k, v in body.items() if k.startswith("next_") and v is not None}
            query = {**query, **{_CURSOR_PARAMETER[k]: v for k, v in cursor.items()}} if cursor else None
        assert pages > 1 if paged else pages == 1, (path, parameters, pages)  # its cursors were followed


_CURSOR_PARAMETER = {"next_after": "after", "next_after_row_num": "after_row_num"}
