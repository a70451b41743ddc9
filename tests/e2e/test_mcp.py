"""`factmill mcp` as an MCP client drives it: the SDK's client over stdio and over streamable HTTP,
against `python -m worker.cli mcp` subprocesses on the test database (real Postgres, stored facts)."""

from __future__ import annotations

import contextlib
import http.client
import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from typing import Any

import anyio
import httpx
import httpx2
import pytest
from mcp import ClientSession, StdioServerParameters, stdio_client
from mcp.client.streamable_http import streamable_http_client
from mcp.types import CallToolResult
from sqlalchemy import insert, select
from sqlalchemy.orm import Session, sessionmaker

from models import ApiKey, Fact, Page
from tests.auth import new_key
from tests.service import REPO, free_port
from worker.access import revoke_key
from worker.compaction import append_messages, parse_messages
from worker.core.facts import MAX_LIST_OFFSET
from worker.extraction.facts import ENTITY_CURSOR_PATTERN

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(180)]

READ_TOOLS = {
    "search_facts",
    "list_entity_facts",
    "list_pages",
    "list_page_facts",
    "get_transcript_context",
    "list_transcript_messages",
}
WRITE_TOOLS = {"append_transcript_messages", "record_summary_feedback"}
FACTS = [
    ("Alice moved to Lisbon in March 2024", "event"),
    ("Alice prefers oat milk in her coffee", "preference"),
    ("Alice promised to send the budget deck by Friday", "commitment"),
]


def _store(factory: sessionmaker[Session]) -> None:
    """One page and its facts, written straight into the tables (as the extraction would)."""
    with factory.begin() as session:
        for source_id, slug in (("default", "alice-chat"), ("work", "work-notes")):
            session.add(Page(source_id=source_id, slug=slug, type="conversation", content_hash=slug))
        rows = [
            {
                "source_id": "default",
                "fact": text,
                "kind": kind,
                "entity_slug": "alice",
                "confidence": 0.9,
                "notability": "high",
                "context": "conversation segment",
                "source": "cli:extract-conversation-facts",
                "source_session": "cli:extract-conversation-facts:alice-chat",
                "source_markdown_slug": "alice-chat",
                "row_num": row,
            }
            for row, (text, kind) in enumerate(FACTS)
        ]
        rows.append(rows[0] | {"source_id": "work", "fact": "Frank opened the Lisbon office", "row_num": 0})
        rows[-1] |= {"entity_slug": "frank", "source_markdown_slug": "work-notes"}
        session.execute(insert(Fact), rows)


@pytest.fixture
def env(factory: sessionmaker[Session], database_url: str, broker_url: str) -> dict[str, str]:
    _store(factory)
    clean = {k: v for k, v in os.environ.items() if not k.startswith("FACTMILL_")}
    return clean | {
        "FACTMILL_DATABASE_URL": database_url,
        "FACTMILL_BROKER_URL": broker_url,
        "FACTMILL_LLM": "simulator",
        "FACTMILL_SEARCH_EXPAND": "false",  # plain queries stay lexical: no LLM call in these tests
        "PYTHONPATH": str(REPO),
    }


def _payload(result: CallToolResult) -> Any:
    assert not result.is_error, result.content
    if result.structured_content is not None:
        return result.structured_content
    return json.loads(result.content[0].text)  # type: ignore[union-attr]


def _error_text(result: CallToolResult) -> str:
    assert result.is_error
    return " ".join(getattr(block, "text", "") for block in result.content)


async def _stdio_session(env: dict[str, str], key: str, job: Any) -> Any:
    params = StdioServerParameters(
        command=sys.executable,
        args=["-m", "worker.cli", "mcp"],
        env=env | {"FACTMILL_MCP_API_KEY": key},
        cwd=REPO,
    )
    async with stdio_client(params) as (read, write), ClientSession(read, write) as session:
        await session.initialize()
        return await job(session)


def _run_stdio(env: dict[str, str], key: str, job: Any) -> Any:
    return anyio.run(_stdio_session, env, key, job)


async def _search_and_list(session: ClientSession) -> dict[str, Any]:
    tools = {tool.name for tool in (await session.list_tools()).tools}
    found = _payload(await session.call_tool("search_facts", {"query": "lex: Lisbon"}))
    page = _payload(
        await session.call_tool("list_page_facts", {"source_id": "default", "slug": "alice-chat"})
    )
    entity = _payload(await session.call_tool("list_entity_facts", {"entity": "alice"}))
    listed = _payload(await session.call_tool("list_pages", {}))
    nul = await session.call_tool("search_facts", {"query": "lex: Lis\u0000bon"})
    piped = await session.call_tool("search_facts", {"query": "lex: Lisbon", "source_id": "a|b"})
    boolean = await session.call_tool("list_entity_facts", {"entity": "alice", "limit": True})
    unnamed = await session.call_tool("list_entity_facts", {"entity": "---"})  # the API's 422
    huge = [
        await session.call_tool(tool, arguments)
        for tool, arguments in (
            ("list_entity_facts", {"entity": "a" * 1001}),
            ("search_facts", {"query": "lex: a", "entity": "-" * 1001}),
            ("list_page_facts", {"slug": "s" * 2001}),
            ("list_page_facts", {"slug": "s", "source_id": "s" * 1000}),
            ("search_facts", {"query": "lex: a", "source_id": "s" * 50_000}),
            ("list_entity_facts", {"entity": "alice", "source_id": "s" * 50_000}),
            ("list_pages", {"source_id": "s" * 50_000}),
        )
    ]
    misspelled = await session.call_tool("search_facts", {"query": "lex: Lisbon", "source": "work"})
    many_unknown = await session.call_tool("list_pages", {f"k{n}": 1 for n in range(4_000)})
    annotations = {tool.name: tool.annotations for tool in (await session.list_tools()).tools}
    then = {"as_of": "2000-01-01T00:00:00Z"}
    entity_then = _payload(await session.call_tool("list_entity_facts", {"entity": "alice"} | then))
    page_then = _payload(
        await session.call_tool("list_page_facts", {"source_id": "default", "slug": "alice-chat"} | then)
    )
    schemas = {tool.name: tool.input_schema for tool in (await session.list_tools()).tools}
    append = await session.call_tool(
        "append_transcript_messages",
        {"transcript_id": "agent-1", "messages": [{"role": "user", "text": "Where does Alice live?"}]},
    )
    return {
        "tools": tools,
        "found": found,
        "page": page,
        "entity": entity,
        "append": append,
        "nul": nul,
        "piped": piped,
        "boolean": boolean,
        "unnamed": unnamed,
        "huge": huge,
        "misspelled": misspelled,
        "many_unknown": many_unknown,
        "annotations": annotations,
        "entity_then": entity_then,
        "page_then": page_then,
        "listed": listed,
        "schemas": schemas,
    }


def test_stdio_read_key_lists_and_gets_facts_but_no_write_tools(env, factory):
    seen = _run_stdio(env, new_key(factory, ["read"]), _search_and_list)
    assert seen["tools"] == READ_TOOLS
    facts = [r["fact"] for r in seen["found"]["results"]]
    assert "Alice moved to Lisbon in March 2024" in facts and "Frank opened the Lisbon office" in facts
    assert [f["fact"] for f in seen["page"]["facts"]] == [text for text, _ in FACTS]
    assert seen["entity"]["total"] == 3
    assert [(p["source_id"], p["slug"], p["facts"]) for p in seen["listed"]["pages"]] == [
        ("default", "alice-chat", 3),
        ("work", "work-notes", 1),
    ]
    assert "must not contain NUL" in _error_text(seen["nul"])  # refused as input, not a server error
    assert "is not a source id" in _error_text(seen["piped"])  # not an empty answer
    assert "valid integer" in _error_text(seen["boolean"])  # true is not a limit of 1
    assert "entity '---' has no letters or digits" in _error_text(seen["unnamed"])  # not an empty list
    # Megabytes of entity were walked a character at a time and quoted back whole.
    for refused in seen["huge"]:
        said = _error_text(refused)
        assert "at most" in said and len(said) < 1000, said
    # A misspelled filter was dropped (every source searched); as_of was dropped (today's facts).
    assert "search_facts takes no argument(s) source" in _error_text(seen["misspelled"])
    many = _error_text(seen["many_unknown"])  # listed short (thousands of names came back whole)
    assert "list_pages takes no argument(s) k0, k1" in many and "and 3994 more" in many and len(many) < 1000
    # A search may call the model (paid, the readers' shared budget): hosts approve closed-world reads.
    hints = seen["annotations"]
    assert hints["search_facts"].open_world_hint and hints["search_facts"].read_only_hint
    assert not hints["list_pages"].open_world_hint and hints["list_pages"].read_only_hint
    assert seen["entity_then"]["total"] == 0 and seen["page_then"]["facts"] == []  # nothing known in 2000
    limit = seen["schemas"]["list_entity_facts"]["properties"]["limit"]
    assert (limit["type"], limit["minimum"], limit["maximum"]) == ("integer", 1, 1000)  # bounds a client sees
    # A page's facts: 10,000 were tens of MB, sent twice by the SDK; no agent's context holds that.
    page_limit = seen["schemas"]["list_page_facts"]["properties"]["limit"]
    assert (page_limit["maximum"], page_limit["default"]) == (1000, 200)
    # Every rule an argument is refused by is in the schema a client reads (not only in the refusal).
    for tool in ("search_facts", "list_entity_facts", "list_pages"):
        [source, _] = seen["schemas"][tool]["properties"]["source_id"]["anyOf"]
        assert (source["minLength"], source["maxLength"]) == (1, 200), tool
    assert seen["schemas"]["list_entity_facts"]["properties"]["after"]["pattern"] == ENTITY_CURSOR_PATTERN
    # An offset of a billion read and sorted every fact of the entity to answer nothing.
    for tool in ("list_entity_facts", "list_page_facts"):
        offset = seen["schemas"][tool]["properties"]["offset"]
        assert (offset["minimum"], offset["maximum"]) == (0, MAX_LIST_OFFSET), tool
    refused = _error_text(seen["append"])
    assert "append_transcript_messages refused" in refused and "'ingest' scope" in refused


async def _append_and_read(session: ClientSession) -> dict[str, Any]:
    tools = {tool.name for tool in (await session.list_tools()).tools}
    messages = [
        {"role": "user", "text": "Where does Alice live?"},
        {  # OpenAI's shape, as the API takes it (the tool refused the type and the text arguments)
            "role": "assistant",
            "text": None,
            "tool_calls": [{"id": "c1", "type": "function", "name": "search", "arguments": '{"q": "Alice"}'}],
        },
        {"role": "tool", "text": "Lisbon", "tool_call_id": "c1"},
        {"role": "assistant", "text": "Alice lives in Lisbon."},
    ]
    arguments = {"transcript_id": "agent-1", "messages": messages}
    appended = _payload(await session.call_tool("append_transcript_messages", arguments))
    context = _payload(await session.call_tool("get_transcript_context", {"transcript_id": "agent-1"}))
    bad = await session.call_tool(
        "append_transcript_messages",
        {"transcript_id": "agent-1", "messages": [{"role": "tool", "text": "orphan", "tool_call_id": "zz"}]},
    )
    feedback = _payload(
        await session.call_tool(
            "record_summary_feedback", {"coverage": 0.8, "answer_kept": True, "origin": "agent:test"}
        )
    )
    huge = await session.call_tool("get_transcript_context", {"transcript_id": "huge"})
    # What that error points to, a tool an MCP client has (it named an HTTP route alone).
    paged: list[dict[str, Any]] = []
    if "its context view" in _error_text(huge):  # stored by the test that runs this
        paged.append(_payload(await session.call_tool("list_transcript_messages", {"transcript_id": "huge"})))
    while paged and paged[-1]["next_after_seq"] is not None:
        after = {"transcript_id": "huge", "after_seq": paged[-1]["next_after_seq"]}
        paged.append(_payload(await session.call_tool("list_transcript_messages", after)))
    first_two = _payload(
        await session.call_tool("list_transcript_messages", {"transcript_id": "agent-1", "limit": 2})
    )
    windowed = _payload(
        await session.call_tool(
            "append_transcript_messages",
            {
                "transcript_id": "agent-2",
                "messages": [{"role": "user", "text": "hello"}],
                "settings": {"context_window": 8000, "reserve_tokens": 1000, "keep_recent_tokens": 500},
            },
        )
    )
    lax = await session.call_tool(  # true is no coverage nor compaction id (the API's 422)
        "record_summary_feedback",
        {"coverage": True, "answer_kept": False, "origin": "agent:test", "compaction_id": True},
    )
    # Messages sent as JSON text: the SDK's json.loads makes "\ud800" a lone surrogate, which the
    # insert could not encode ("failed on the server"); now refused naming it.
    surrogate = '[{"role":"assistant","tool_calls":[{"id":"c9","name":"t","arguments":{"q":"\\ud800"}}]}]'
    unstorable = await session.call_tool(
        "append_transcript_messages", {"transcript_id": "agent-1", "messages": surrogate}
    )
    # The settings are a plain dict: NUL and a lone surrogate in instructions reached the insert and
    # the digest ("failed on the server").
    bad_settings = [
        await session.call_tool(
            "append_transcript_messages",
            {"transcript_id": "agent-4", "messages": [{"role": "user", "text": "hi"}], "settings": settings},
        )
        for settings in ({"instructions": "a\u0000b"}, '{"instructions": "\\ud800"}', '{"\\ud800": 1}')
    ]
    once = {
        "transcript_id": "agent-3",
        "messages": [{"role": "user", "text": "sent twice"}],
        "idempotency_key": "append-1",
    }
    first = _payload(await session.call_tool("append_transcript_messages", once))
    again = _payload(await session.call_tool("append_transcript_messages", once))
    other = await session.call_tool(
        "append_transcript_messages", once | {"messages": [{"role": "user", "text": "something else"}]}
    )
    keyed = _payload(await session.call_tool("get_transcript_context", {"transcript_id": "agent-3"}))
    return {
        "keyed": (first, again, _error_text(other), [m["text"] for m in keyed["messages"]]),
        "bad_settings": [_error_text(result) for result in bad_settings],
        "lax": lax,
        "unstorable": unstorable,
        "tools": tools,
        "appended": appended,
        "context": context,
        "bad": bad,
        "feedback": feedback,
        "huge": huge,
        "paged": paged,
        "first_two": first_two,
        "windowed": windowed,
    }


def test_stdio_ingest_key_appends_transcript_messages_and_records_feedback(env, factory):
    big = "y" * (11 * 1024 * 1024)  # a context view past MAX_CONTEXT_VIEW_BYTES: refused, not loaded
    with factory.begin() as session:
        append_messages(session, "huge", parse_messages([{"role": "user", "text": big}] * 3))
    seen = _run_stdio(env, new_key(factory, ["read", "ingest"]), _append_and_read)
    assert seen["tools"] == READ_TOOLS | WRITE_TOOLS
    assert (seen["appended"]["appended"], seen["appended"]["first_seq"]) == (4, 0)
    assert [m["role"] for m in seen["context"]["messages"]] == ["user", "assistant", "tool", "assistant"]
    assert seen["context"]["compaction_id"] is None and seen["context"]["coverage"] is None  # none yet
    assert seen["context"]["messages"][1]["tool_calls"][0]["arguments"] == '{"q": "Alice"}'
    assert "messages[0]: tool result answers no earlier call" in _error_text(seen["bad"])
    assert seen["feedback"]["duplicate"] is False and seen["feedback"]["id"] >= 1
    lax = _error_text(seen["lax"])
    assert "coverage" in lax and "compaction_id" in lax and "valid" in lax, lax
    unstorable = _error_text(seen["unstorable"])
    assert "tool_calls[0].arguments.q: must not contain lone surrogates" in unstorable, unstorable
    nul, surrogate, surrogate_name = seen["bad_settings"]
    assert "settings.instructions must not contain NUL" in nul, nul
    assert "settings.instructions must not contain lone surrogates" in surrogate, surrogate
    # A name that is no text is refused in words the reply can carry (raw, the session ended).
    assert "unknown setting(s) '\\ud800'" in surrogate_name, surrogate_name
    huge = _error_text(seen["huge"])
    assert "its context view is 34,606," in huge and "past the 4,194,304" in huge and "/messages" in huge
    assert "list_transcript_messages" in huge
    # Its 11 MiB messages a page each (a page holds 4 MiB, or its one message past it).
    assert [[m["seq"] for m in page["messages"]] for page in seen["paged"]] == [[0], [1], [2]]
    first_two = seen["first_two"]
    assert [m["role"] for m in first_two["messages"]] == ["user", "assistant"]
    assert first_two["next_after_seq"] == 1 and first_two["messages"][1]["tool_calls"][0]["name"] == "search"
    assert seen["windowed"]["trigger_tokens"] == 8000 - 1000  # the settings went in with the append
    # A retried append with its key is answered as before and appends nothing twice.
    first, again, other, texts = seen["keyed"]
    assert again == first | {"replayed": True} and texts == ["sent twice"]
    assert "idempotency_key was used before with other messages" in other


async def _sources_only(session: ClientSession) -> dict[str, Any]:
    tools = {tool.name for tool in (await session.list_tools()).tools}
    found = _payload(await session.call_tool("search_facts", {"query": "lex: Lisbon"}))
    other = await session.call_tool("list_page_facts", {"source_id": "default", "slug": "alice-chat"})
    listed = _payload(await session.call_tool("list_pages", {}))
    refused = await session.call_tool("list_pages", {"source_id": "default"})
    bad_cursor = await session.call_tool("list_pages", {"after": "no-pipe"})
    return {
        "tools": tools,
        "found": found,
        "other": other,
        "listed": listed,
        "refused": refused,
        "bad_cursor": bad_cursor,
    }


def test_a_source_limited_key_sees_only_its_sources_facts(env, factory):
    key = new_key(factory, ["read", "ingest"], source_ids=["work"])
    seen = _run_stdio(env, key, _sources_only)
    # Transcripts and feedback are not partitioned by source: a source-limited key gets neither.
    assert seen["tools"] == {"search_facts", "list_entity_facts", "list_pages", "list_page_facts"}
    assert [p["slug"] for p in seen["listed"]["pages"]] == ["work-notes"]
    assert "may not read source 'default'" in _error_text(seen["refused"])
    assert "must be a source|slug" in _error_text(seen["bad_cursor"])  # a tool error, not a crash
    assert [r["fact"] for r in seen["found"]["results"]] == ["Frank opened the Lisbon office"]
    assert "may not read source 'default'" in _error_text(seen["other"])


def test_stdio_a_key_revoked_mid_session_is_refused_at_once(env, factory):
    key = new_key(factory, ["read"])

    async def revoke_then_search(session: ClientSession) -> tuple[Any, Any]:
        before = await session.call_tool("search_facts", {"query": "lex: Lisbon"})
        with factory.begin() as db_session:
            revoke_key(db_session, db_session.scalars(select(ApiKey.id)).one())
        return before, await session.call_tool("search_facts", {"query": "lex: Lisbon"})

    before, after = _run_stdio(env, key, revoke_then_search)
    assert _payload(before)["results"]
    assert "unknown or revoked" in _error_text(after)


def test_stdio_without_a_valid_key_refuses_to_start(env):
    for extra in ({}, {"FACTMILL_MCP_API_KEY": "fm_not-a-key"}):
        result = subprocess.run(
            [sys.executable, "-m", "worker.cli", "mcp"],
            cwd=REPO,
            env=env | extra,
            capture_output=True,
            text=True,
            timeout=60,
            stdin=subprocess.DEVNULL,
        )
        assert result.returncode == 2, result.stderr
        assert result.stdout == ""
        lines = [line for line in result.stderr.splitlines() if line.strip()]
        assert len(lines) == 1 and lines[0].startswith("error:"), result.stderr


def test_a_server_database_without_a_broker_is_refused(env, factory):
    """The README's client config named the database only: the transcripts' compaction jobs went to an
    embedded Redis under the agent's folder, which no worker reads."""
    unbrokered = {k: v for k, v in env.items() if k != "FACTMILL_BROKER_URL"}
    result = subprocess.run(
        [sys.executable, "-m", "worker.cli", "mcp"],
        cwd=REPO,
        env=unbrokered | {"FACTMILL_MCP_API_KEY": new_key(factory, ["read"])},
        capture_output=True,
        text=True,
        timeout=60,
        stdin=subprocess.DEVNULL,
    )
    assert result.returncode == 2, result.stderr
    assert "FACTMILL_BROKER_URL is not" in result.stderr


def test_the_http_server_refuses_to_start_in_production_on_placeholder_secrets(env):
    """`serve` refused the placeholder admin token in production; `mcp --http` started and took it as
    the bootstrap admin: every tool, every source, for whoever read the README."""
    production = env | {"FACTMILL_ENVIRONMENT": "production", "FACTMILL_LLM": "simulator"}
    result = subprocess.run(
        [sys.executable, "-m", "worker.cli", "mcp", "--http", str(free_port())],
        cwd=REPO,
        env=production,
        capture_output=True,
        text=True,
        timeout=60,
        stdin=subprocess.DEVNULL,
    )
    assert result.returncode == 2, result.stderr
    assert "is a placeholder; set a real secret" in result.stderr


@pytest.fixture
def http_server(env: dict[str, str]) -> Iterator[str]:
    with _mcp_http(env) as url:
        yield url


@contextlib.contextmanager
def _mcp_http(env: dict[str, str], logged: list[str] | None = None) -> Iterator[str]:
    """`factmill mcp --http PORT` started with ``env``; its URL once it answers. Its stderr lines go into
    ``logged`` when it has stopped."""
    port = free_port()
    process = subprocess.Popen(
        [sys.executable, "-m", "worker.cli", "mcp", "--http", str(port)],
        cwd=REPO,
        env=env,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    url = f"http://127.0.0.1:{port}/mcp"
    try:
        for _ in range(300):
            assert process.poll() is None, process.communicate()[1]
            try:
                httpx.get(url, timeout=1)
                break
            except httpx.TransportError:
                time.sleep(0.1)
        yield url
    finally:
        process.terminate()
        _, stderr = process.communicate(timeout=30)
        if logged is not None:
            logged.extend(line for line in stderr.splitlines() if line.strip())


def test_http_keeps_an_idle_connection_open_past_a_client_pools_expiry(http_server):
    """As the API does (FACTMILL_API_KEEP_ALIVE_SECONDS): a connection idle 6 s, longer than httpx's
    pool and uvicorn's own 5 s, still answers on the same socket."""
    url = httpx.URL(http_server)
    connection = http.client.HTTPConnection(url.host, url.port, timeout=10)
    try:
        connection.request("GET", url.path)
        connection.getresponse().read()  # 401: no key; the connection is what matters
        opened = connection.sock
        time.sleep(6)
        connection.request("GET", url.path)  # RemoteDisconnected if the server closed it
        assert connection.getresponse().status == 401
        assert connection.sock is opened
    finally:
        connection.close()


def test_http_refuses_a_body_over_the_cap_with_413_and_keeps_serving(env, factory):
    """The SDK reads a whole body and answers a failed read with a 500; the server caps it as the API
    does (FACTMILL_MAX_BODY_BYTES): by its Content-Length, or as a chunked stream passes the cap."""
    key = new_key(factory, ["read"])
    rpc = {"Accept": "application/json, text/event-stream", "Content-Type": "application/json"}
    big = b'{"jsonrpc": "2.0", "id": 1, "method": "ping", "params": {"pad": "' + b"a" * 70_000 + b'"}}'

    def chunks() -> Iterator[bytes]:  # no Content-Length: sent chunked
        for start in range(0, len(big), 8192):
            yield big[start : start + 8192]

    with _mcp_http(env | {"FACTMILL_MAX_BODY_BYTES": "65536"}) as url:
        keyed = rpc | {"Authorization": f"Bearer {key}"}
        declared = httpx.post(url, content=big, headers=keyed, timeout=30)
        assert declared.status_code == 413 and "65536-byte limit" in declared.json()["detail"]
        streamed = httpx.post(url, content=chunks(), headers=keyed, timeout=30)
        assert streamed.status_code == 413 and "65536-byte limit" in streamed.json()["detail"]
        assert httpx.post(url, content=chunks(), headers=rpc, timeout=30).status_code == 401  # no key
        reader = anyio.run(_http_session, url, key, _search_and_list)  # and it still serves
    assert reader["tools"] == READ_TOOLS


def test_http_takes_a_body_up_to_factmills_cap_and_holds_no_session(http_server, factory):
    """The SDK's own body limit (4 MiB) stood below FACTMILL_MAX_BODY_BYTES (25 MiB): a tool result of
    5 MB was a plain-text 413 over HTTP, and taken over stdio and by the API. And its sessions (10,000
    for the whole server, 30 minutes idle) let one key's initializes hold every slot: none is kept."""
    key = new_key(factory, ["read"])
    rpc = {"Accept": "application/json, text/event-stream", "Authorization": f"Bearer {key}"}
    pad = "a" * (5 * 1024 * 1024)
    answer = httpx.post(
        http_server,
        json={"jsonrpc": "2.0", "id": 1, "method": "ping", "params": {"pad": pad}},
        headers=rpc,
        timeout=60,
    )
    assert answer.status_code == 200, answer.text[:200]
    initialize = {
        "jsonrpc": "2.0",
        "id": 2,
        "method": "initialize",
        "params": {
            "protocolVersion": "2025-06-18",
            "capabilities": {},
            "clientInfo": {"name": "t", "version": "1"},
        },
    }
    started = httpx.post(http_server, json=initialize, headers=rpc, timeout=30)
    assert started.status_code == 200 and "mcp-session-id" not in started.headers


async def _http_session(url: str, key: str, job: Any) -> Any:
    async with (
        httpx2.AsyncClient(headers={"Authorization": f"Bearer {key}"}, timeout=60) as http,
        streamable_http_client(url, http_client=http) as (read, write),
        ClientSession(read, write) as session,
    ):
        await session.initialize()
        return await job(session)


def test_http_logs_in_the_services_format(env):
    """It wrote uvicorn's own lines and a plain banner; a collector parsing FACTMILL_LOG_FORMAT=json
    lines met text."""
    logged: list[str] = []
    with _mcp_http(env | {"FACTMILL_LOG_FORMAT": "json"}, logged) as url:
        assert httpx.get(url + "?q=Alice+told+Bob", timeout=10).status_code == 401
    records = [json.loads(line) for line in logged]  # every line one JSON object
    messages = [r["message"] for r in records]
    assert any(m.startswith("factmill MCP server on http://127.0.0.1:") for m in messages), messages
    assert any("Application startup complete" in m for m in messages), messages  # uvicorn's lines, ours
    # No raw request line (uvicorn's access log): a client's or a scanner's path and query are not ours.
    assert not any("Alice" in m or "GET /mcp" in m for m in messages), messages
    assert {r["level"] for r in records} <= {"INFO", "WARNING"}


def test_http_each_request_carries_its_key(http_server, factory):
    reader = anyio.run(_http_session, http_server, new_key(factory, ["read"]), _search_and_list)
    assert reader["tools"] == READ_TOOLS
    assert "Alice moved to Lisbon in March 2024" in [r["fact"] for r in reader["found"]["results"]]
    assert "'ingest' scope" in _error_text(reader["append"])
    writer = anyio.run(_http_session, http_server, new_key(factory, ["read", "ingest"]), _append_and_read)
    assert writer["tools"] == READ_TOOLS | WRITE_TOOLS
    assert writer["appended"]["appended"] == 4
    # The key as the API reads it: a second space before it (typed, or pasted from a file).
    spaced = httpx.post(
        http_server,
        headers={
            "Authorization": f"Bearer  {new_key(factory, ['read'])}",
            "Accept": "application/json, text/event-stream",
        },
        json={"jsonrpc": "2.0", "id": 1, "method": "ping"},
        timeout=10,
    )
    assert spaced.status_code == 200, spaced.text
    # Without a key (or with a wrong one) the endpoint answers 401 before any tool runs.
    for headers in ({}, {"Authorization": "Bearer fm_wrong"}):
        answer = httpx.post(
            http_server,
            headers=headers | {"Accept": "application/json, text/event-stream"},
            json={"jsonrpc": "2.0", "id": 1, "method": "tools/list"},
            timeout=10,
        )
        assert answer.status_code == 401
