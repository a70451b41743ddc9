"""Service logs: the job or request each line belongs to, as text or JSON, and nothing else bound."""

from __future__ import annotations

import contextvars
import json
import logging
import sys
import threading

import pytest

from worker.runtime.logs import (
    ContextFilter,
    TextFormatter,
    bound_fields,
    json_formatter,
    log_context,
    wants_json,
)
from worker.settings import Settings


def _record(message: str = "job %s released", *args: object, exc: bool = False) -> logging.LogRecord:
    info = None
    if exc:
        try:
            raise ValueError("boom")
        except ValueError:
            info = sys.exc_info()
    record = logging.LogRecord("worker.jobs", logging.INFO, __file__, 1, message, args or (12,), info)
    ContextFilter().filter(record)
    return record


def test_fields_nest_and_end_with_their_context():
    assert bound_fields() == {}
    with log_context(task_id="t-1"):
        with log_context(job_id=12, job_kind="extraction"):
            assert bound_fields() == {"task_id": "t-1", "job_id": 12, "job_kind": "extraction"}
        assert bound_fields() == {"task_id": "t-1"}
    assert bound_fields() == {} and not hasattr(_record(), "job_id")


def test_a_thread_handed_the_context_logs_under_the_same_job():
    """The LLM pipe and the API's thread pool run work with a copied context: their lines name the job."""
    seen: list[dict[str, str | int]] = []
    with log_context(job_id=7):
        context = contextvars.copy_context()
    thread = threading.Thread(target=lambda: context.run(lambda: seen.append(bound_fields())))
    thread.start()
    thread.join()
    assert seen == [{"job_id": 7}]


def test_text_lines_end_with_the_bound_fields_and_keep_a_traceback_below():
    formatter = TextFormatter("%(levelname)s %(name)s: %(message)s")
    assert formatter.format(_record()) == "INFO worker.jobs: job 12 released"
    with log_context(job_id=12, job_kind="extraction"):
        assert (
            formatter.format(_record()) == "INFO worker.jobs: job 12 released [job_id=12 job_kind=extraction]"
        )
        first, *rest = formatter.format(_record(exc=True)).splitlines()
    assert first.endswith("[job_id=12 job_kind=extraction]")
    assert rest[0] == "Traceback (most recent call last):" and rest[-1] == "ValueError: boom"


def test_json_lines_are_one_object_with_the_bound_fields_and_extras():
    with log_context(request_id="abc", job_id=3):
        record = _record("GET %s %d", "/v1/search", 401)
    record.route = "/v1/search"  # as extra= sets it
    line = json_formatter().format(record)
    assert "\n" not in line
    parsed = json.loads(line)
    assert parsed["level"] == "INFO" and parsed["logger"] == "worker.jobs" and "time" in parsed
    assert parsed["message"] == "GET /v1/search 401" and parsed["route"] == "/v1/search"
    assert parsed["request_id"] == "abc" and parsed["job_id"] == 3
    assert "factmill_fields" not in parsed and "args" not in parsed
    with_trace = json.loads(json_formatter().format(_record(exc=True)))
    assert with_trace["exc_info"].endswith("ValueError: boom")


@pytest.mark.parametrize(
    ("values", "json_lines"),
    [
        ({}, False),
        ({"environment": "production"}, True),  # log collectors parse it
        ({"environment": "production", "log_format": "text"}, False),
        ({"log_format": "json"}, True),
    ],
)
def test_json_by_default_in_production_only(values, json_lines):
    assert wants_json(Settings(_env_file=None, **values)) is json_lines


def test_no_service_process_logs_the_llm_requests_urls() -> None:
    """httpx logs each request's URL at INFO, and FACTMILL_LLM_BASE_URL may carry user:password; only
    Celery's workers were quieted: the API and the MCP server logged them on every search."""
    import logging.config

    from worker.runtime.logs import logging_config

    names = ("httpx", "httpx2", "httpcore", "httpcore2")
    before = {name: logging.getLogger(name).level for name in names}
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    try:
        logging.config.dictConfig(logging_config(Settings(), "INFO"))
        assert all(not logging.getLogger(name).isEnabledFor(logging.INFO) for name in names)
        assert logging.getLogger("worker.api").isEnabledFor(logging.INFO)
    finally:
        for name, was in before.items():
            logging.getLogger(name).setLevel(was)
        root.handlers[:] = handlers
        root.setLevel(level)


def test_a_failed_embedding_names_no_page_and_no_providers_body(caplog: pytest.LogCaptureFixture) -> None:
    """It logged every page's source/slug (a slug can name a person) and the raw error."""
    from worker.search.embedding import _could_not_embed

    with caplog.at_level(logging.WARNING):
        _could_not_embed([("default", "people/jane-roe-clinic")], RuntimeError("boom"))
    assert "jane" not in caplog.text and "1 page(s)" in caplog.text and "RuntimeError: boom" in caplog.text


def test_the_sdks_request_logs_stay_off_at_debug() -> None:
    """At DEBUG the SDKs log each request's options whole: every prompt, a batch in one line."""
    from worker.runtime.logs import logging_config

    loggers = logging_config(Settings(), "DEBUG")["loggers"]
    assert loggers["openai"]["level"] == loggers["anthropic"]["level"] == "WARNING"


def test_an_sdk_that_lowers_its_own_log_level_after_the_set_up_still_writes_no_request() -> None:
    """ANTHROPIC_LOG=debug (the SDK's own switch) set its loggers to DEBUG when the SDK was imported, at
    the first client, after the set-up: each request's options, the prompt whole, were written."""
    from worker.runtime.logs import ContextFilter

    def record(name: str, level: int) -> logging.LogRecord:
        return logging.LogRecord(
            name, level, __file__, 1, "Request options: %s", ("Alice's diagnosis",), None
        )

    keeps = ContextFilter().filter
    assert not keeps(record("anthropic._base_client", logging.DEBUG))
    assert not keeps(record("httpx2", logging.INFO))
    assert keeps(record("anthropic._base_client", logging.WARNING))
    assert keeps(record("worker.llm.retry", logging.DEBUG))


def test_an_exception_logged_as_an_argument_says_its_status_and_code_not_the_providers_words() -> None:
    """A provider's error message went into WARNING lines word for word, and a gateway may quote the
    request in it: a page's text. Its status and code say what went wrong; the words stay in llm_calls."""
    import httpx2
    import openai

    from worker.llm.errors import to_llm_error
    from worker.runtime.logs import ContextFilter

    said = "Invalid value in messages[1].content: 'Alice told Bob her diagnosis'"
    body = {"error": {"message": said, "type": "invalid_request_error", "code": "invalid_value"}}
    response = httpx2.Response(400, json=body, request=httpx2.Request("POST", "http://provider/v1/chat"))
    client = openai.OpenAI(api_key="sk-test", base_url="http://provider/v1")
    # As the SDK makes it (its body is the inner error object, not the whole body).
    error = to_llm_error(client._make_status_error_from_response(response))
    assert said in str(error)  # kept where it is stored
    record = logging.LogRecord(
        "worker.llm.retry", logging.WARNING, __file__, 1, "call failed (%s)", (error,), None
    )
    assert ContextFilter().filter(record)
    assert record.getMessage() == "call failed (HTTP 400 (invalid_value))"
    unreachable = logging.LogRecord(
        "worker.x", logging.WARNING, __file__, 1, "%s", (ConnectionRefusedError(111, "refused"),), None
    )
    ContextFilter().filter(unreachable)
    assert unreachable.getMessage() == "ConnectionRefusedError: [Errno 111] refused"


def test_the_cli_writes_exceptions_logged_as_arguments_by_the_same_rule() -> None:
    """`factmill extract`, `search`, `mcp` over stdio log through the CLI's own handler: the provider's
    words reached it (a retry's warning), where the services' filter had them out."""
    import subprocess

    script = (
        "import logging, sys\n"
        "from worker.cli.app import main\n"
        "sys.argv = ['factmill', '--help']\n"
        "try:\n    main()\nexcept SystemExit:\n    pass\n"
        "from worker.llm.errors import LLMError\n"
        "logging.getLogger('worker.llm.retry').warning('gave up: %s', LLMError(\n"
        "    'HTTP 400: quoting Alice told Bob', retryable=False, status=400, code='invalid_value'))\n"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert "WARNING worker.llm.retry: gave up: HTTP 400 (invalid_value)" in done.stderr, done.stderr
    assert "Alice" not in done.stderr


def _database_error_quoting_a_row() -> BaseException:
    """A unique violation as SQLAlchemy raises it from psycopg: its DETAIL quotes the row's key."""
    import psycopg
    from sqlalchemy.exc import IntegrityError

    detail = (
        "duplicate key value violates unique constraint\nDETAIL:  Key (slug)=(people/jane-roe-clinic) exists."
    )
    try:
        try:
            raise psycopg.errors.UniqueViolation(detail)
        except psycopg.Error as orig:
            raise IntegrityError("INSERT INTO pages ...", None, orig) from orig
    except IntegrityError as exc:
        try:
            raise RuntimeError("could not settle the job") from exc
        except RuntimeError as outer:
            return outer


def test_a_traceback_keeps_its_frames_and_tells_each_exception_of_its_chain_without_its_data() -> None:
    """A traceback (exc_info) was printed whole: a database error's DETAIL, a provider's words, a page's
    slug reached the log the ``%s`` rule keeps them from."""
    error = _database_error_quoting_a_row()
    record = logging.LogRecord(
        "worker.jobs",
        logging.ERROR,
        __file__,
        1,
        "settle failed",
        (),
        (type(error), error, error.__traceback__),
    )
    assert ContextFilter().filter(record)
    for formatted in (
        TextFormatter("%(message)s").format(record),
        json.loads(json_formatter().format(record))["exc_info"],
    ):
        assert "jane" not in formatted
        assert "IntegrityError: UniqueViolation (SQLSTATE 23505)" in formatted  # told, not quoted
        assert "The above exception was the direct cause of the following exception:" in formatted
        assert formatted.count("Traceback (most recent call last):") == 3
        assert 'raise RuntimeError("could not settle the job") from exc' in formatted  # the frames stay
        assert formatted.endswith("RuntimeError: could not settle the job")


def test_celerys_record_of_a_task_that_raised_tells_its_error_without_its_data() -> None:
    """An error that escapes a job's run (the claim's or the settle's database error) is logged by
    Celery's tracer: its message, its traceback and (JSON lines) its ``data`` field carried the DETAIL."""
    from billiard.einfo import ExceptionInfo
    from celery import Celery
    from celery.app.task import Context
    from celery.app.trace import TraceInfo

    error = _database_error_quoting_a_row()
    app = Celery("logs-test", set_as_current=False)

    @app.task(name="tasks.test.settle")
    def task() -> None: ...

    seen: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = seen.append  # type: ignore[method-assign]
    handler.addFilter(ContextFilter())
    trace_logger = logging.getLogger("celery.app.trace")
    trace_logger.addHandler(handler)
    try:
        try:
            raise error
        except RuntimeError:
            einfo = ExceptionInfo()
        request = Context(hostname="w1", id="t-1", args=(12,), kwargs={}, argsrepr="(12,)", kwargsrepr="{}")
        TraceInfo("FAILURE", error)._log_error(task, request, einfo)
    finally:
        trace_logger.removeHandler(handler)
    (record,) = seen
    text = TextFormatter("%(message)s").format(record)
    line = json_formatter().format(record)
    assert "jane" not in text and "jane" not in line
    assert text.startswith(
        "Task tasks.test.settle[t-1] raised unexpected: RuntimeError: could not settle the job"
    )
    assert "IntegrityError: UniqueViolation (SQLSTATE 23505)" in json.loads(line)["data"]["traceback"]


def test_a_traceback_of_an_llm_error_tells_its_sdk_cause_by_status_not_by_the_providers_words() -> None:
    """An LLMError is raised from the SDK's error, whose message is the provider's body: the traceback
    printed it as the LLMError's cause."""
    import httpx2
    import openai

    from worker.llm.errors import to_llm_error

    said = "Invalid value in messages[1].content: 'Alice told Bob her diagnosis'"
    body = {"error": {"message": said, "type": "invalid_request_error", "code": "invalid_value"}}
    response = httpx2.Response(400, json=body, request=httpx2.Request("POST", "http://provider/v1/chat"))
    sdk_error = openai.OpenAI(
        api_key="sk-test", base_url="http://provider/v1"
    )._make_status_error_from_response(response)
    try:
        try:
            raise sdk_error
        except openai.APIStatusError as exc:
            raise to_llm_error(exc) from exc
    except Exception as error:
        record = logging.LogRecord(
            "worker.jobs",
            logging.ERROR,
            __file__,
            1,
            "run failed",
            (),
            (type(error), error, error.__traceback__),
        )
    assert ContextFilter().filter(record)
    formatted = TextFormatter("%(message)s").format(record)
    assert "Alice" not in formatted and "diagnosis" not in formatted, formatted
    assert "BadRequestError: HTTP 400" in formatted
    assert formatted.splitlines()[-1] == "LLMError: HTTP 400 (invalid_value)", formatted


def test_the_heartbeats_lines_name_the_job_they_beat_for() -> None:
    """The heartbeat thread started with no bound fields: the line saying a job stalled and its lease is
    left to lapse (and a failed beat's) carried no job_id, job_kind or task_id."""
    import time

    from sqlalchemy.orm import sessionmaker

    from worker.jobs.leases import Heartbeat

    records: list[logging.LogRecord] = []

    class Kept(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            records.append(record)

    handler = Kept()
    handler.addFilter(ContextFilter())
    leases = logging.getLogger("worker.jobs.leases")
    leases.addHandler(handler)
    try:
        with log_context(task_id="t-9", job_id=9, job_kind="extraction"):
            beat = Heartbeat(sessionmaker(), 9, "token", interval=0.01, stall_after=0.0, listen=False)
            with beat:
                deadline = time.monotonic() + 10
                while not any("showed no progress" in r.getMessage() for r in records):
                    assert time.monotonic() < deadline, "the heartbeat never took the run for stalled"
                    time.sleep(0.01)
    finally:
        leases.removeHandler(handler)
    stalled = next(r for r in records if "showed no progress" in r.getMessage())
    assert (stalled.task_id, stalled.job_id, stalled.job_kind) == ("t-9", 9, "extraction")  # type: ignore[attr-defined]
