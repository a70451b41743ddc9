"""The MCP server in process, where the e2e suite (tests/e2e/test_mcp.py) cannot reach: a database that
cannot answer the key check, over stdio and over streamable HTTP."""

from __future__ import annotations

import logging
from typing import Any

import anyio
import pytest
from fastapi.testclient import TestClient
from mcp.server.mcpserver.exceptions import ToolError
from sqlalchemy import create_engine
from sqlalchemy.orm import Session, sessionmaker

from tests.integration.test_api import ADMIN, make_runtime
from worker.mcp.server import http_app, http_server, stdio_server

pytestmark = pytest.mark.integration

# Nothing listens on port 1: every connection is refused at once.
GONE_URL = "postgresql+psycopg://postgres@127.0.0.1:1/gone?connect_timeout=2"


@pytest.fixture
def gone() -> sessionmaker[Session]:
    engine = create_engine(GONE_URL, pool_pre_ping=False)
    yield sessionmaker(engine, expire_on_commit=False)
    engine.dispose()


def test_stdio_a_database_outage_at_the_key_check_is_a_plain_tool_error(
    database_url: str, gone: sessionmaker[Session], caplog: pytest.LogCaptureFixture
) -> None:
    """The key is looked up on every request: an outage reached the client as the driver's message
    (host, port, the SQL) and the log as a traceback."""
    server = stdio_server(make_runtime(database_url, gone), "fm_some_key")
    with caplog.at_level(logging.INFO):
        with pytest.raises(ToolError) as refused:
            anyio.run(server.call_tool, "search_facts", {"query": "lex: lisbon"})
        with pytest.raises(ToolError, match="database is unavailable"):
            anyio.run(server.list_tools)
    assert str(refused.value) == "the database is unavailable; try again shortly"
    logged = "\n".join(r.getMessage() for r in caplog.records)
    assert "OperationalError" in logged and "127.0.0.1" not in logged and "Traceback" not in caplog.text


def test_an_outage_a_tool_meets_after_the_key_check_is_the_same_plain_tool_error(
    database_url: str, gone: sessionmaker[Session], caplog: pytest.LogCaptureFixture
) -> None:
    """The admin token is checked without the database, so the tool itself met the outage: the client
    read "failed on the server (OperationalError)" and the log an ERROR, where a key's check said "try
    again shortly"."""
    server = stdio_server(make_runtime(database_url, gone), ADMIN)
    with caplog.at_level(logging.INFO), pytest.raises(ToolError) as refused:
        anyio.run(server.call_tool, "list_entity_facts", {"entity": "people/alice"})
    assert str(refused.value) == "the database is unavailable; try again shortly"
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert "127.0.0.1" not in caplog.text and "Traceback" not in caplog.text


def test_http_a_database_outage_at_the_key_check_is_a_503_with_retry_after(
    database_url: str, gone: sessionmaker[Session]
) -> None:
    runtime = make_runtime(database_url, gone)
    app = http_app(http_server(runtime), runtime, "127.0.0.1")
    body: dict[str, Any] = {"jsonrpc": "2.0", "id": 1, "method": "tools/list"}
    headers = {"Authorization": "Bearer fm_some_key", "Accept": "application/json, text/event-stream"}
    with TestClient(app, raise_server_exceptions=False) as client:
        answer = client.post("/mcp", json=body, headers=headers)
    assert answer.status_code == 503, answer.text
    assert answer.headers["Retry-After"] == "5" and "database is unavailable" in answer.json()["detail"]


def test_a_keys_searches_running_at_once_are_capped_as_the_apis_are(
    database_url: str, tx_factory: Any
) -> None:
    """The API caps a key's searches running at once (each holds a thread, maybe for a minute on the
    LLM); the MCP tool counted only searches begun a minute, so one key's burst took every thread of
    the server's pool. The slot is given back when a search ends."""
    from worker.access import Principal
    from worker.mcp.tools import FactmillTools

    runtime = make_runtime(database_url, tx_factory, search_concurrency_per_key=1, search_expand=False)
    reader = Principal("reader", frozenset({"read"}), None, key_id=7)
    tools = FactmillTools(runtime, lambda: reader)
    assert tools.search_facts("lex: alice")["results"] == []  # a search that ends gives its slot back
    assert tools.running.enter(reader.rate_key)  # one running (another thread's)
    with pytest.raises(ToolError, match="this key has 1 searches running"):
        tools.search_facts("lex: alice")
    tools.running.leave(reader.rate_key)
    assert tools.search_facts("lex: alice")["results"] == []


def test_stdio_a_slow_key_check_leaves_the_event_loop_free(
    database_url: str, tx_factory: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Over stdio the key is read from the database on every request: read on the event loop, a slow
    database froze the server (no pings answered, no cancellation read, every other call queued)."""
    import threading

    from worker.mcp import server as mcp_server

    loop_ran = threading.Event()
    lookup = mcp_server.authenticate_key

    def slow_lookup(*args: Any) -> Any:
        # Another task of the loop must run while this waits: on the loop itself it never could.
        assert loop_ran.wait(timeout=10), "the key check held the event loop"
        return lookup(*args)

    monkeypatch.setattr(mcp_server, "authenticate_key", slow_lookup)
    server = stdio_server(make_runtime(database_url, tx_factory), "fm_unknown_key")

    async def meanwhile() -> None:
        await anyio.sleep(0.05)
        loop_ran.set()

    async def both() -> list[Any]:
        async with anyio.create_task_group() as group:
            group.start_soon(meanwhile)
            return await server.list_tools()

    assert anyio.run(both) == []  # an unknown key sees no tool


def test_a_text_argument_that_reads_as_json_is_kept_as_text(database_url: str, factory: Any) -> None:
    """The SDK parses a string argument as JSON wherever the declared type is not exactly str, so an
    optional text argument of "null" became no argument: an append keyed "null" was stored unkeyed (a
    retry appended it twice) and a search of the source named "null" searched every source."""
    from tests.auth import new_key

    runtime = make_runtime(database_url, factory)
    server = stdio_server(runtime, new_key(factory, ["ingest", "read"]))
    append = {
        "transcript_id": "t-null",
        "messages": [{"role": "user", "text": "hello"}],
        "idempotency_key": "null",
    }
    try:
        first = anyio.run(server.call_tool, "append_transcript_messages", append)
        again = anyio.run(server.call_tool, "append_transcript_messages", append)  # a retry: replayed
        assert again.structured_content == first.structured_content | {"replayed": True}
        listed = anyio.run(server.call_tool, "list_transcript_messages", {"transcript_id": "t-null"})
        assert len(listed.structured_content["messages"]) == 1
        searched = anyio.run(server.call_tool, "search_facts", {"query": "lex: x", "intent": '["a", "b"]'})
        assert not searched.is_error  # a text that reads as a JSON list is text too
    finally:
        runtime.close()


def test_stdio_an_append_over_the_body_cap_is_refused_and_stores_nothing(
    database_url: str, factory: Any
) -> None:
    """Over HTTP the body cap (FACTMILL_MAX_BODY_BYTES) refuses a large append; over stdio nothing did,
    and one message of hundreds of MB was stored, read whole later by each page of the transcript's
    messages and by the compaction worker."""
    from sqlalchemy import func, select

    from models import TranscriptMessageRow
    from tests.auth import new_key

    runtime = make_runtime(database_url, factory, max_body_bytes=65_536)
    server = stdio_server(runtime, new_key(factory, ["ingest"]))
    big = {"transcript_id": "agent-1", "messages": [{"role": "user", "text": "x" * 70_000}]}
    with pytest.raises(ToolError, match="over the 65536-byte limit"):
        anyio.run(server.call_tool, "append_transcript_messages", big)
    small = {"transcript_id": "agent-1", "messages": [{"role": "user", "text": "x" * 60_000}]}
    anyio.run(server.call_tool, "append_transcript_messages", small)
    # Measured as a client sends it (compact JSON, as the API's body is): with Python's ", " separators a
    # call's 25,000 arguments were 75 KB, refused, where the API took their 50 KB.
    call = {"id": "c1", "name": "lookup", "arguments": {"xs": [1] * 25_000}}
    spaced = {"transcript_id": "agent-1", "messages": [{"role": "assistant", "tool_calls": [call]}]}
    anyio.run(server.call_tool, "append_transcript_messages", spaced)
    with factory() as session:
        assert session.scalar(select(func.count()).select_from(TranscriptMessageRow)) == 2  # not the big one
