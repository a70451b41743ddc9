"""A compaction plans from the stored rows: the same plan as from the whole timeline, reading only the
kept tail's roles and tokens and the head up to the summarizer's input."""

from __future__ import annotations

import random
from collections.abc import Iterator
from dataclasses import replace
from typing import Any

import pytest
from sqlalchemy import Connection, delete, event
from sqlalchemy.orm import Session, sessionmaker

from models import TranscriptMessageRow
from tests.integration.test_compaction_service import (
    GOAL,
    SETTINGS,
    ScriptedLLM,
    activate_threshold,
    append,
    compactions,
    runtime,
    session_messages,
)
from worker.compaction import TranscriptNotFoundError, load_timeline, stored_plan
from worker.compaction.records import CompactionRecord, save_compaction
from worker.core.timeline import NothingToCompactError, plan_compaction
from worker.jobs import outbox as jobs
from worker.jobs.lifecycle import run_job

pytestmark = pytest.mark.integration


def random_transcript(rng: random.Random) -> list[dict[str, Any]]:
    """User turns, assistant turns with tool calls and their results of random sizes."""
    out: list[dict[str, Any]] = []
    for turn in range(rng.randint(1, 10)):
        out.append({"role": "user", "text": "u" * rng.randint(1, 400)})
        for round_ in range(rng.randint(0, 3)):
            calls = [f"c{turn}-{round_}-{k}" for k in range(rng.randint(1, 3))]
            out.append(
                {
                    "role": "assistant",
                    "text": "a" * rng.randint(0, 80),
                    "tool_calls": [
                        {"id": c, "name": "sh", "arguments": {"n": "x" * rng.randint(0, 60)}} for c in calls
                    ],
                }
            )
            out.extend({"role": "tool", "tool_call_id": c, "text": "r" * rng.randint(0, 1500)} for c in calls)
        out.append({"role": "assistant", "text": "done " * rng.randint(1, 60)})
    return out


def test_the_stored_plan_is_the_plan_of_the_whole_timeline(tx_factory: sessionmaker[Session]) -> None:
    rng = random.Random(46)
    planned = 0
    for case in range(60):
        name = f"t{case}"
        append(tx_factory, name, random_transcript(rng))
        if rng.random() < 0.4:  # an applied summary: the view starts at its cut, behind a marker
            with tx_factory() as session:
                seqs = load_timeline(session, name).seqs
            cut = rng.choice([s for s in seqs if s is not None])
            summary = "s" * rng.randint(1, 900)
            record = CompactionRecord(name, "accepted", cut, None, 10, 0.0, None, [], summary, tokens_after=1)
            with tx_factory.begin() as session:
                assert save_compaction(session, record).status == "accepted"
            append(tx_factory, name, random_transcript(rng))
        keep = rng.randint(0, 3000)
        cap = rng.choice([None, 40, 300, 2000])
        with tx_factory() as session:
            timeline = load_timeline(session, name)
            expected: Any
            try:
                expected = plan_compaction(
                    timeline.messages,
                    timeline.seqs,
                    keep_recent_tokens=keep,
                    tool_result_limit=50,
                    max_head_tokens=cap,
                )
            except NothingToCompactError as exc:
                expected = str(exc)
            context = stored_plan.stored_context(session, name)
            assert context.tokens == timeline.tokens
            context = replace(context, settings=replace(context.settings, keep_recent_tokens=keep))
            try:
                got: Any = stored_plan.plan_stored(
                    session, context, tool_result_limit=50, max_head_tokens=cap
                )
            except NothingToCompactError as exc:
                got = str(exc)
        assert got == expected, (case, keep, cap)
        planned += not isinstance(got, str)
    assert planned > 20  # most cases planned a compaction, not "nothing to compact"


@pytest.fixture
def rows_of_text_read(tx_factory: sessionmaker[Session]) -> Iterator[list[int]]:
    """The rows each statement that reads messages' text returned, on the test's connection."""
    connection = tx_factory.kw["bind"]
    assert isinstance(connection, Connection)
    counts: list[int] = []

    def count(_conn: Any, cursor: Any, statement: str, *_: Any) -> None:
        if "transcript_messages.text," in statement:
            counts.append(cursor.rowcount)

    event.listen(connection, "after_cursor_execute", count)
    yield counts
    event.remove(connection, "after_cursor_execute", count)


def test_a_long_uncompacted_history_is_not_loaded_to_compact_its_head(
    database_url: str, tx_factory: sessionmaker[Session], rows_of_text_read: list[int], monkeypatch: Any
) -> None:
    """A transcript whose compaction was off for long (or whose window was set late) holds thousands
    of messages past its threshold; every compaction of it loaded all of them (memory grew with the
    history) to summarize a head the summarizer's input caps. It reads the tail's roles and tokens and
    the head's messages, one page at a time (the page is small here to count it)."""
    monkeypatch.setattr(stored_plan, "HEAD_PAGE_BYTES", 4096)
    request = append(tx_factory, "long", session_messages(600), settings=SETTINGS)  # 1,802 messages
    assert request.trigger.job is not None
    activate_threshold(tx_factory, 0.0)
    llm = ScriptedLLM(f"## Goal\n{GOAL}")
    rt = runtime(database_url, tx_factory, llm, compaction_max_input_tokens=1000)
    assert run_job(rt, request.trigger.job.job_id, jobs.COMPACTION).status == "succeeded"
    assert [r.status for r in compactions(tx_factory, "long")] == ["accepted"]
    assert 0 < sum(rows_of_text_read) < 100, rows_of_text_read  # the head's ~4,000 characters and a page
    assert max(rows_of_text_read) < 40, rows_of_text_read


def test_a_transcript_erased_between_its_totals_and_its_rows_is_not_found(
    tx_factory: sessionmaker[Session],
) -> None:
    append(tx_factory, "gone", session_messages(30), settings={**SETTINGS, "keep_recent_tokens": 100})
    with tx_factory() as session:
        context = stored_plan.stored_context(session, "gone")
    with tx_factory.begin() as session:
        session.execute(delete(TranscriptMessageRow).where(TranscriptMessageRow.transcript_id == "gone"))
    with tx_factory() as session, pytest.raises(TranscriptNotFoundError, match="gone"):
        stored_plan.plan_stored(session, context, tool_result_limit=50, max_head_tokens=None)
