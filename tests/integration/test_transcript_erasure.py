"""Erasing a transcript (API and CLI): its messages, its compactions (summaries) and its id go, in one
transaction, leaving one content-free row; real Postgres and the simulator over HTTP."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from typing import Any

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import Text, func, select
from sqlalchemy.orm import Session, sessionmaker

from models import (
    CalibrationObservation,
    Compaction,
    Job,
    Transcript,
    TranscriptErasure,
    TranscriptMessageRow,
    WebhookDelivery,
)
from tests.auth import send_key
from tests.cli import invoke_cli
from tests.integration.test_api import ADMIN_HEADERS, Recorder, make_runtime
from tests.integration.test_compaction_service import (
    SETTINGS,
    append,
    llm_for,
    post_messages,
    put_settings,
    session_messages,
)
from worker.api.app import create_app
from worker.calibration import FALLBACK
from worker.compaction import compact_transcript, request_compaction, views
from worker.compaction.erase import TRANSCRIPT_ERASED, erased_transcript_digest, erased_transcript_name
from worker.jobs.outbox import COMPACTION

pytestmark = pytest.mark.integration

TRANSCRIPT = "support-chat-alice"  # a client's label that names a person


@pytest.fixture
def client(database_url: str, factory: sessionmaker[Session]) -> Iterator[TestClient]:
    with TestClient(create_app(make_runtime(database_url, factory), sender=Recorder(factory))) as test_client:
        send_key(test_client, factory)
        yield test_client


def counted(factory: sessionmaker[Session], model: Any, *where: Any) -> int:
    with factory() as session:
        return session.scalar(select(func.count()).select_from(model).where(*where)) or 0


def test_delete_erases_the_transcript_and_leaves_one_content_free_row(
    client: TestClient, factory: sessionmaker[Session], simulator: Any
) -> None:
    appended = post_messages(
        client, TRANSCRIPT, {"messages": session_messages(25), "settings": SETTINGS}, key="append-1"
    )
    assert appended.status_code == 201, appended.text
    messages = appended.json()["appended"]
    # The settings' answer is kept by its key, and echoes the instructions: a person's words.
    instructions = "focus on the diagnosis Dr Okafor gave"
    changed = put_settings(client, TRANSCRIPT, {"instructions": instructions}, key="settings-1")
    assert changed.status_code == 200 and changed.json()["settings"]["instructions"] == instructions
    summary = compact_transcript(
        factory, llm_for(simulator), TRANSCRIPT, threshold=lambda: FALLBACK, force=True
    )
    assert summary.status == "accepted"
    with factory.begin() as session:
        session.add(
            CalibrationObservation(
                coverage=0.7, answer_kept=True, origin="eval", compaction_id=summary.compaction_id
            )
        )
        pending = request_compaction(session, TRANSCRIPT, force=True).job_id
        session.execute(
            Job.__table__.update()
            .where(Job.kind == COMPACTION, Job.id != pending)
            .values(last_error=f"about {TRANSCRIPT}")
        )

    assert client.delete(f"/v1/transcripts/{TRANSCRIPT}").status_code == 403  # the client's key: not admin
    answer = client.delete(f"/v1/transcripts/{TRANSCRIPT}", headers=ADMIN_HEADERS)
    assert answer.status_code == 200, answer.text
    assert answer.json() == {
        "transcript_id": TRANSCRIPT,
        "messages_removed": messages,
        "compactions_removed": 1,
        "jobs_cancelled": 1,
    }

    assert client.get(f"/v1/transcripts/{TRANSCRIPT}", headers=ADMIN_HEADERS).status_code == 404
    assert counted(factory, TranscriptMessageRow) == 0 and counted(factory, Compaction) == 0
    with factory() as session:
        [observation] = session.scalars(select(CalibrationObservation)).all()
        assert observation.compaction_id is None  # the label stays, no longer naming the summary
        jobs = session.scalars(select(Job).where(Job.kind == COMPACTION)).all()
        leaks = session.scalar(
            select(func.count()).where(
                func.cast(WebhookDelivery.response, Text).contains(TRANSCRIPT)
                | func.cast(WebhookDelivery.response, Text).contains("Okafor")
            )
        )
        [row] = session.scalars(select(TranscriptErasure)).all()
    assert jobs and {job.subject for job in jobs} == {erased_transcript_name(TRANSCRIPT)}
    assert not [job for job in jobs if TRANSCRIPT in (job.last_error or "")]
    assert [job.status for job in jobs if job.id == pending] == ["failed"]
    assert {job.last_error for job in jobs} == {TRANSCRIPT_ERASED}
    assert leaks == 0
    assert (row.transcript_sha256, row.requested_by, row.messages_removed) == (
        erased_transcript_digest(TRANSCRIPT),
        "api admin token",
        messages,
    )
    stored = " ".join(str(getattr(row, c.key)) for c in TranscriptErasure.__table__.columns)
    assert "alice" not in stored

    # The append repeated with its key is answered as before, naming the erased transcript, and brings
    # nothing back; a second erasure finds nothing.
    replay = post_messages(
        client, TRANSCRIPT, {"messages": session_messages(25), "settings": SETTINGS}, key="append-1"
    )
    assert replay.status_code == 201 and replay.headers.get("Idempotent-Replayed") == "true"
    assert replay.json()["transcript_id"] == erased_transcript_name(TRANSCRIPT)
    assert counted(factory, TranscriptMessageRow) == 0
    again = put_settings(client, TRANSCRIPT, {"instructions": instructions}, key="settings-1")
    assert again.status_code == 200 and again.headers.get("Idempotent-Replayed") == "true"
    assert again.json()["transcript_id"] == erased_transcript_name(TRANSCRIPT)
    assert again.json()["settings"]["instructions"] is None
    missing = client.delete(f"/v1/transcripts/{TRANSCRIPT}", headers=ADMIN_HEADERS)
    # A retried erasure (its first answer lost) is told it was erased, not that it never was.
    with factory() as session:
        [erased_at] = session.scalars(select(TranscriptErasure.erased_at)).all()
    assert missing.status_code == 404 and missing.json()["detail"] == (
        f"no transcript {TRANSCRIPT!r} (it was erased at {erased_at.isoformat(timespec='seconds')})"
    )
    assert counted(factory, TranscriptErasure) == 1


def test_a_job_of_an_erased_transcript_is_not_retried(
    client: TestClient, factory: sessionmaker[Session]
) -> None:
    """Its retry was accepted (202), and the worker then failed it ("no transcript 'erased:...'"), a
    failure the failing-jobs alert counted; an extraction job of an erased page was refused already."""
    appended = post_messages(client, TRANSCRIPT, {"messages": session_messages(25), "settings": SETTINGS})
    assert appended.status_code == 201, appended.text
    with factory.begin() as session:
        job_id = request_compaction(session, TRANSCRIPT, force=True).job_id
    assert client.delete(f"/v1/transcripts/{TRANSCRIPT}", headers=ADMIN_HEADERS).status_code == 200
    response = client.post(f"/v1/jobs/{job_id}/retry", headers=ADMIN_HEADERS)
    assert response.status_code == 409, response.text
    assert response.json()["detail"].startswith(
        f"job {job_id}'s transcript is no longer stored (it was erased)"
    )
    with factory() as session:
        job = session.get(Job, job_id)
        assert job is not None and (job.status, job.last_error) == ("failed", TRANSCRIPT_ERASED)


def test_cli_transcripts_erase(database_url: str, factory: sessionmaker[Session]) -> None:
    append(factory, TRANSCRIPT, session_messages(3))
    result = invoke_cli(database_url, "transcripts", "erase", TRANSCRIPT, "--json")
    assert result.exit_code == 0, result.output
    assert json.loads(result.output)["messages_removed"] == len(session_messages(3))
    assert counted(factory, TranscriptMessageRow) == 0
    missing = invoke_cli(database_url, "transcripts", "erase", TRANSCRIPT)
    assert missing.exit_code == 1 and f"no transcript {TRANSCRIPT!r} (it was erased at " in missing.output
    assert "; nothing was erased" in missing.output
    never = invoke_cli(database_url, "transcripts", "erase", "never-stored")
    assert never.exit_code == 1 and "no transcript 'never-stored'; nothing was erased" in never.output
    with factory() as session:
        assert session.scalars(select(TranscriptErasure.requested_by)).all() == ["cli"]


def test_a_delivery_signed_before_the_erasure_cannot_begin_the_transcript_again(
    client: TestClient, factory: sessionmaker[Session]
) -> None:
    """An append (or a settings change) signed before the erasure, late in transit or a sender's retry of
    one that never arrived, began the transcript again with the erased messages. One signed after it
    begins a new transcript."""
    now = int(time.time())
    words = {"messages": [{"role": "user", "text": "my card number is 4111"}]}
    assert post_messages(client, TRANSCRIPT, words, timestamp=now - 30).status_code == 201
    assert client.delete(f"/v1/transcripts/{TRANSCRIPT}", headers=ADMIN_HEADERS).status_code == 200
    late = post_messages(client, TRANSCRIPT, words, timestamp=now - 20)
    assert late.status_code == 409 and "older than the transcript's erasure" in late.json()["detail"], (
        late.text
    )
    # A change valid only against the erased state is refused as late (409), not as invalid (422).
    settings = put_settings(client, TRANSCRIPT, {"context_window": 9000}, timestamp=now - 20)
    assert settings.status_code == 409
    assert counted(factory, TranscriptMessageRow) == 0 and counted(factory, Transcript) == 0
    fresh = {"messages": [{"role": "user", "text": "a new session"}]}
    assert post_messages(client, TRANSCRIPT, fresh, timestamp=now + 5).status_code == 201
    # Begun again after the erasure, it takes no append signed before it either.
    late_again = post_messages(client, TRANSCRIPT, words, timestamp=now - 10)
    assert late_again.status_code == 409, late_again.text
    assert counted(factory, TranscriptMessageRow) == 1


def test_a_delivery_signed_in_the_erasures_second_is_told_to_wait_a_second(
    client: TestClient, factory: sessionmaker[Session]
) -> None:
    """A signature is dated to the second, an erasure to the microsecond: an append signed just after
    the erasure, in its second, was refused as older, and the 409's advice (re-sign it) was refused
    again until the second had passed."""
    words = {"messages": [{"role": "user", "text": "hello"}]}
    assert post_messages(client, TRANSCRIPT, words).status_code == 201
    assert client.delete(f"/v1/transcripts/{TRANSCRIPT}", headers=ADMIN_HEADERS).status_code == 200
    with factory() as session:
        erased_at = session.scalar(select(func.max(TranscriptErasure.erased_at)))
    assert erased_at is not None
    second = int(erased_at.timestamp())
    same = post_messages(client, TRANSCRIPT, words, timestamp=second)
    assert same.status_code == 409 and "sign it again a second after the erasure" in same.json()["detail"]
    assert same.headers["Retry-After"] == "1"
    older = post_messages(client, TRANSCRIPT, words, timestamp=second - 5)
    assert older.status_code == 409 and "Retry-After" not in older.headers
    assert "a second after" not in older.json()["detail"]
    assert post_messages(client, TRANSCRIPT, words, timestamp=second + 1).status_code == 201


def test_an_mcp_append_that_waited_past_the_erasure_cannot_begin_the_transcript_again(
    database_url: str, factory: sessionmaker[Session]
) -> None:
    """An MCP append was dated when its transaction began: one that arrived before the erasure and
    waited (for a thread of the server's pool, a pooled connection) past it began the transcript again
    with its words. It is dated when it arrived (the server sets ARRIVED before the wait)."""
    from mcp.server.mcpserver.exceptions import ToolError

    from worker.access import Principal
    from worker.compaction.erase import erase_transcript
    from worker.mcp.arrival import ARRIVED
    from worker.mcp.inputs import MessageIn
    from worker.mcp.tools import FactmillTools

    runtime = make_runtime(database_url, factory)
    agent = Principal("agent", frozenset({"ingest", "read"}), None, key_id=9)
    tools = FactmillTools(runtime, lambda: agent)
    words = [MessageIn(role="user", text="my card number is 4111")]
    try:
        assert tools.append_transcript_messages(TRANSCRIPT, words)["appended"] == 1
        arrived = ARRIVED.set(time.monotonic())  # the call arrives, then waits for a thread
        try:
            assert erase_transcript(factory, TRANSCRIPT, "test") is not None  # committed meanwhile
            with pytest.raises(ToolError, match="older than the transcript's erasure"):
                tools.append_transcript_messages(TRANSCRIPT, words)
        finally:
            ARRIVED.reset(arrived)
        assert counted(factory, TranscriptMessageRow) == 0 and counted(factory, Transcript) == 0
        assert tools.append_transcript_messages(TRANSCRIPT, words)["appended"] == 1  # after it: a new one
    finally:
        runtime.close()


def test_a_keyed_mcp_append_stored_before_a_rule_tightened_replays_its_answer(
    database_url: str, factory: sessionmaker[Session]
) -> None:
    """The API's appends get their stored answer when a release refuses what an earlier one stored; the
    MCP tool parsed the messages first and refused them: an agent told its stored append was refused
    fixed and resent it under a new key, and it was stored twice."""
    import hashlib

    from mcp.server.mcpserver.exceptions import ToolError

    from worker.access import Principal
    from worker.deliveries import deliver_once, scoped_key
    from worker.mcp.inputs import MCP_APPEND, MessageIn
    from worker.mcp.tools import FactmillTools

    runtime = make_runtime(database_url, factory)
    agent = Principal("agent", frozenset({"ingest", "read"}), None, key_id=9)
    tools = FactmillTools(runtime, lambda: agent)
    words = [MessageIn(role="tool", text="exit 0")]  # a result naming no call: refused by today's rules
    said = json.dumps({"messages": [{"role": "tool", "text": "exit 0"}], "settings": None}, sort_keys=True)
    stored = {"transcript_id": TRANSCRIPT, "appended": 1, "first_seq": 1, "last_seq": 1}
    scoped = scoped_key(MCP_APPEND, TRANSCRIPT, "k-1", agent.sender)
    deliver_once(factory, scoped, hashlib.sha256(said.encode()).hexdigest(), lambda session: (stored, None))
    try:
        assert tools.append_transcript_messages(TRANSCRIPT, words, idempotency_key="k-1") == stored | {
            "replayed": True
        }
        with pytest.raises(ToolError, match="tool_call_id"):  # a new append: today's rules
            tools.append_transcript_messages(TRANSCRIPT, words, idempotency_key="k-2")
    finally:
        runtime.close()


def test_the_mcp_server_dates_a_call_when_it_arrives(
    database_url: str, factory: sessionmaker[Session], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The server half: it notes the call's arrival before the tool runs, so an erasure that commits
    in between (here while the messages are parsed) is later than the append, which it refuses."""
    import anyio
    from mcp.server.mcpserver.exceptions import ToolError

    from tests.auth import new_key
    from worker.compaction.erase import erase_transcript
    from worker.mcp import tools as mcp_tools
    from worker.mcp.server import stdio_server

    runtime = make_runtime(database_url, factory)
    server = stdio_server(runtime, new_key(factory, ["ingest"]))
    words = {"transcript_id": TRANSCRIPT, "messages": [{"role": "user", "text": "my card number is 4111"}]}
    try:
        anyio.run(server.call_tool, "append_transcript_messages", words)
        parse = mcp_tools.parse_messages

        def erased_meanwhile(raw: Any) -> Any:
            assert erase_transcript(factory, TRANSCRIPT, "test") is not None
            return parse(raw)

        monkeypatch.setattr(mcp_tools, "parse_messages", erased_meanwhile)
        with pytest.raises(ToolError, match="older than the transcript's erasure"):
            anyio.run(server.call_tool, "append_transcript_messages", words)
        assert counted(factory, TranscriptMessageRow) == 0 and counted(factory, Transcript) == 0
        monkeypatch.undo()
        # Noted before the key's check too (over stdio a database read, which may wait).
        anyio.run(server.call_tool, "append_transcript_messages", words)
        check = server._checked_principal

        def erased_during_the_check() -> Any:
            assert erase_transcript(factory, TRANSCRIPT, "test") is not None
            return check()

        monkeypatch.setattr(server, "_checked_principal", erased_during_the_check)
        with pytest.raises(ToolError, match="older than the transcript's erasure"):
            anyio.run(server.call_tool, "append_transcript_messages", words)
    finally:
        runtime.close()


def test_an_mcp_append_over_http_is_dated_when_its_request_arrived(
    database_url: str, factory: sessionmaker[Session], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Over HTTP the key is checked (a thread of the shared pool, a database read) and the body read
    before the tool runs: dated when the tool ran, an append whose request arrived before an erasure
    that committed meanwhile began the transcript again with its words. The API dates by the request's
    head; so does the MCP app now."""
    from tests.auth import new_key
    from worker.compaction.erase import erase_transcript
    from worker.mcp import server as mcp_server

    runtime = make_runtime(database_url, factory)
    app = mcp_server.http_app(mcp_server.http_server(runtime), runtime, "127.0.0.1")
    headers = {
        "Authorization": f"Bearer {new_key(factory, ['ingest'])}",
        "Accept": "application/json, text/event-stream",
    }
    words = {"transcript_id": TRANSCRIPT, "messages": [{"role": "user", "text": "my card number is 4111"}]}
    call = {"jsonrpc": "2.0", "id": 1, "method": "tools/call"}
    call["params"] = {"name": "append_transcript_messages", "arguments": words}
    try:
        with TestClient(app, base_url="http://127.0.0.1:8000") as client:
            assert client.post("/mcp", json=call, headers=headers).status_code == 200
            assert counted(factory, TranscriptMessageRow) == 1
            check = mcp_server.principal_for

            def erased_during_the_check(*args: Any) -> Any:
                assert erase_transcript(factory, TRANSCRIPT, "test") is not None
                return check(*args)

            monkeypatch.setattr(mcp_server, "principal_for", erased_during_the_check)
            answer = client.post("/mcp", json=call, headers=headers)
            assert answer.status_code == 200 and "older than the transcript" in answer.text, answer.text
        assert counted(factory, TranscriptMessageRow) == 0 and counted(factory, Transcript) == 0
    finally:
        runtime.close()


def test_a_keyed_mcp_append_that_waited_on_its_key_is_dated_when_it_arrived(
    database_url: str, factory: sessionmaker[Session]
) -> None:
    """Dated by now() less its wait, an append whose transaction began on its key's lock counted that
    wait twice: one sent just after an erasure, which waited a second on a copy of itself, was dated
    before the erasure and refused."""
    import threading

    from sqlalchemy import text as sql

    from worker.access import Principal
    from worker.compaction.erase import erase_transcript
    from worker.deliveries import DELIVERY_LOCK_CLASS, scoped_key
    from worker.mcp.arrival import ARRIVED
    from worker.mcp.inputs import MCP_APPEND, MessageIn
    from worker.mcp.tools import FactmillTools

    runtime = make_runtime(database_url, factory)
    agent = Principal("agent", frozenset({"ingest", "read"}), None, key_id=9)
    tools = FactmillTools(runtime, lambda: agent)
    words = [MessageIn(role="user", text="hello again")]
    try:
        tools.append_transcript_messages(TRANSCRIPT, words)
        assert erase_transcript(factory, TRANSCRIPT, "test") is not None
        key = scoped_key(MCP_APPEND, TRANSCRIPT, "k-1", agent.sender)
        holder = factory()
        holder.execute(
            sql("SELECT pg_advisory_xact_lock(:c, hashtext(:k))"), {"c": DELIVERY_LOCK_CLASS, "k": key}
        )
        released = threading.Timer(1.0, holder.rollback)  # a copy of it holds the key for a second
        arrived = ARRIVED.set(time.monotonic())  # sent after the erasure
        try:
            released.start()
            answer = tools.append_transcript_messages(TRANSCRIPT, words, idempotency_key="k-1")
        finally:
            ARRIVED.reset(arrived)
            released.join()
            holder.close()
        assert answer["appended"] == 1  # a new transcript, begun after the erasure
    finally:
        runtime.close()


def test_an_mcp_append_that_waited_for_a_pooled_connection_is_dated_when_it_arrived(
    database_url: str,
) -> None:
    """The wait for a pooled connection is part of the call's wait: measured before the connection was
    taken, an append that arrived before an erasure and waited for a connection past it was dated
    after the erasure, and began the transcript again with its words."""
    import threading

    from sqlalchemy import create_engine, func, select
    from sqlalchemy.orm import sessionmaker as make_sessions

    from worker.mcp.arrival import ARRIVED, arrived_at

    engine = create_engine(database_url, pool_size=1, max_overflow=0, pool_timeout=30)
    released_at: list[Any] = []
    holding = threading.Event()

    def hold_the_only_connection() -> None:
        with engine.connect() as connection:
            holding.set()
            time.sleep(1.0)
            released_at.append(connection.execute(select(func.clock_timestamp())).scalar())

    holder = threading.Thread(target=hold_the_only_connection)
    try:
        holder.start()
        assert holding.wait(10)
        arrived = ARRIVED.set(time.monotonic())  # the call arrives while the pool has no connection
        try:
            with make_sessions(engine)() as session:
                dated = arrived_at(session)  # waits about a second for the connection
        finally:
            ARRIVED.reset(arrived)
        holder.join()
        # Before the connection came back (by the database's clock), not after it.
        assert (released_at[0] - dated).total_seconds() > 0.5
    finally:
        holder.join()
        engine.dispose()


def test_a_keyed_append_in_flight_while_the_transcript_is_erased_cannot_begin_it_again(
    client: TestClient, factory: sessionmaker[Session], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A delivery with an API key (no signature) was undated, so neither check ran: an append that
    arrived before the erasure and was written after it began the transcript again with its words."""
    from tests.auth import bearer, new_key
    from worker.api.routes import transcripts as routes
    from worker.compaction.erase import erase_transcript

    headers = bearer(new_key(factory, ["ingest"]))
    path = f"/v1/transcripts/{TRANSCRIPT}/messages"
    words = {"messages": [{"role": "user", "text": "my card number is 4111"}]}
    assert client.post(path, json=words, headers=headers).status_code == 201
    parse = routes._parse_append

    def erased_meanwhile(data: Any) -> Any:  # the erasure commits after the append arrived
        assert erase_transcript(factory, TRANSCRIPT, "test") is not None
        return parse(data)

    monkeypatch.setattr(routes, "_parse_append", erased_meanwhile)
    late = client.post(path, json=words, headers=headers)
    assert late.status_code == 409 and "older than the transcript's erasure" in late.json()["detail"], (
        late.text
    )
    # Dated to the microsecond on arrival, not signed: told nothing of signatures' seconds.
    assert "Retry-After" not in late.headers and "signatures are dated" not in late.json()["detail"]
    assert counted(factory, TranscriptMessageRow) == 0 and counted(factory, Transcript) == 0
    monkeypatch.undo()
    assert client.post(path, json=words, headers=headers).status_code == 201  # after it: a new transcript


def test_a_transcripts_figures_are_read_in_one_snapshot(
    client: TestClient, database_url: str, factory: sessionmaker[Session], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Its figures came from several statements: an append committed between them (an agent appends
    while it reads) counted more tokens in the context than in the whole history."""
    append(factory, "snap", session_messages(2))
    read_context = views.context_now

    def appended_meanwhile(session: Session, transcript_id: str) -> Any:
        append(factory, "snap", session_messages(3))
        return read_context(session, transcript_id)

    monkeypatch.setattr(views, "context_now", appended_meanwhile)
    stats = client.get("/v1/transcripts/snap", headers=ADMIN_HEADERS).json()
    assert stats["context_tokens"] <= stats["history_tokens"], stats
    shown = invoke_cli(database_url, "transcripts", "show", "snap", "--json")  # and `transcripts show`
    assert shown.exit_code == 0, shown.output
    figures = json.loads(shown.output)
    assert figures["context_tokens"] <= figures["history_tokens"], figures
