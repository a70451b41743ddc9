"""Summarizer replies the gate must not apply, and summaries it could not judge (real Postgres)."""

from __future__ import annotations

from typing import Any

import pytest
from sqlalchemy import select, text
from sqlalchemy.orm import Session, sessionmaker

from models import Job
from tests.integration.test_compaction_service import (
    FALLBACK,
    GOAL,
    QUESTION,
    SETTINGS,
    ScriptedLLM,
    activate_threshold,
    append,
    compact_transcript,
    compactions,
    llm_calls,
    llm_for,
    rounds,
    runtime,
    session_messages,
)
from worker.calibration import ObservationIn, UnknownCompactionError, add_observation
from worker.compaction import context_view
from worker.core.compaction_gate import opens_as_summary, response_outcome, summary_of
from worker.jobs import outbox as jobs
from worker.jobs.lifecycle import run_job
from worker.llm.errors import LLMError
from worker.llm.types import CONTEXT_WINDOW_FULL, ChatRequest, ChatResponse, Usage

REFUSAL_IN_PROSE = "I'm sorry, but I can't help with that request."


def head_without_the_question(first: str = "Do it.", last: str = QUESTION) -> list[dict[str, Any]]:
    """A transcript whose head holds none of its latest question's words: whatever the summary says,
    coverage on them is 1.0 (seed 002: nothing relevant to lose)."""
    return [{"role": "user", "text": first}, *rounds(0, 25), {"role": "user", "text": last}]


def context_messages(factory: sessionmaker[Session], transcript_id: str) -> list[dict[str, Any]]:
    with factory() as session:
        return [v.as_dict() for v in context_view(session, transcript_id).messages]


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("## Goal\nShip it.", True),
        ("\n\n  ## Goal  \n- ship", True),
        ("# goal:\nship", True),
        ("### GOAL\n", True),
        ("Goal\nship", False),
        ("## Goals of the session\n", False),
        (REFUSAL_IN_PROSE, False),
        ("OK", False),
        ("Here is the summary:\n## Goal\nShip it.", True),  # a line of preamble
        ("# Summary\n\n## Goal\nShip it.", True),  # a title
        ("## Goal: ship the release\n## Progress", True),  # the goal on the heading's line
        ("```markdown\n## Goal\nShip it.\n```", True),  # in a code fence
        ("\ufeff## Goal\nShip it.", True),  # a byte-order mark
        ("## Goal of the session\n", False),
        ("One.\nTwo.\nThree.\n## Goal\nShip it.", False),  # past the first three lines
        # A reasoning model's thoughts ahead of it (an OpenAI-compatible server's reply text).
        (
            "<think>\nThe user wants a summary.\nGoal first.\nThen progress.\n</think>\n\n## Goal\nShip it.",
            True,
        ),
        ("<THINKING>a\nb\nc\nd</THINKING>## Goal\nShip it.", True),
        ("<think>never closed\na\nb\n## Goal\nShip it.", False),
    ],
)
def test_a_summary_opens_with_its_goal_heading(text: str, expected: bool) -> None:
    assert opens_as_summary(text) is expected
    assert (response_outcome("end", text) == "ok") is expected


def test_a_reply_that_is_not_a_summary_is_asked_again_then_stored_as_failed(
    database_url: str, tx_factory: sessionmaker[Session]
) -> None:
    """A refusal in prose the provider did not flag (or an instruction in the transcript obeyed) scored
    coverage 1.0 on a question the head never mentions, and replaced the transcript's history."""
    request = append(tx_factory, "prose", head_without_the_question(), settings=SETTINGS)
    job_id = request.trigger.job.job_id
    before = context_messages(tx_factory, "prose")
    outcome = run_job(
        runtime(database_url, tx_factory, ScriptedLLM(REFUSAL_IN_PROSE, "OK")), job_id, jobs.COMPACTION
    )
    assert outcome.status == "failed"
    [row] = compactions(tx_factory, "prose")
    assert row.status == "failed" and row.summary is None and row.coverage is None
    assert row.error == (
        "the summarizer's reply was not a summary (it had no '## Goal' heading) 2 times; the history was "
        "left as it was"
    )
    assert [(a["outcome"], a["reply"]) for a in row.attempt_log] == [
        ("malformed_output", REFUSAL_IN_PROSE),
        ("malformed_output", "OK"),
    ]
    assert context_messages(tx_factory, "prose") == before
    assert [call.outcome for call in llm_calls(tx_factory)] == ["malformed_output"] * 2


def test_a_reply_that_is_not_a_summary_then_a_summary_applies_the_summary(
    database_url: str, tx_factory: sessionmaker[Session]
) -> None:
    request = append(tx_factory, "second", head_without_the_question(first=GOAL), settings=SETTINGS)
    job_id = request.trigger.job.job_id
    llm = ScriptedLLM("OK", f"## Goal\n{GOAL}")
    run_job(runtime(database_url, tx_factory, llm), job_id, jobs.COMPACTION)
    [row] = compactions(tx_factory, "second")
    assert row.status == "accepted" and row.summary == f"## Goal\n{GOAL}"
    assert [a["outcome"] for a in row.attempt_log] == ["malformed_output", "passed"]
    assert row.attempt_log[1]["missed_terms_named"] == []  # asked again as the first time
    assert [call.outcome for call in llm_calls(tx_factory)] == ["malformed_output", "ok"]


def test_a_reply_of_thoughts_alone_is_asked_again(
    database_url: str, tx_factory: sessionmaker[Session]
) -> None:
    """A reasoning model's reply with only its <think> block was "an empty reply": the run failed at once,
    the llm_calls row said malformed_output, and the second request a non-summary gets was never made."""
    request = append(tx_factory, "thoughts", head_without_the_question(first=GOAL), settings=SETTINGS)
    llm = ScriptedLLM("<think>\nthe goal first, then progress\n</think>", f"## Goal\n{GOAL}")
    run_job(runtime(database_url, tx_factory, llm), request.trigger.job.job_id, jobs.COMPACTION)
    [row] = compactions(tx_factory, "thoughts")
    assert row.status == "accepted" and [a["outcome"] for a in row.attempt_log] == [
        "malformed_output",
        "passed",
    ]


def test_a_reply_cut_off_by_the_context_window_says_to_lower_the_input_not_raise_the_output(
    database_url: str, tx_factory: sessionmaker[Session]
) -> None:
    """It said to raise FACTMILL_COMPACTION_MAX_OUTPUT_TOKENS, which makes the overflow worse."""
    request = append(tx_factory, "full", head_without_the_question(first=GOAL), settings=SETTINGS)
    cut = ChatResponse(
        "I will summar", "truncated", Usage(100, 3), "scripted", "scripted-1", 5, None, CONTEXT_WINDOW_FULL
    )
    run_job(runtime(database_url, tx_factory, ScriptedLLM(cut)), request.trigger.job.job_id, jobs.COMPACTION)
    [row] = compactions(tx_factory, "full")
    assert row.status == "failed" and "lower FACTMILL_COMPACTION_MAX_INPUT_TOKENS" in (row.error or ""), (
        row.error
    )


def test_a_summary_the_gate_could_not_judge_stores_no_coverage_and_takes_no_label(
    database_url: str, tx_factory: sessionmaker[Session]
) -> None:
    """With no query words (no instructions, user messages of stop words only) the gate lets a summary
    stand and measures the share of the head's bigrams kept: stored as the compaction's coverage, a label
    of it fed τ a number of another measure, one τ never judges."""
    raw = head_without_the_question(first="Do it.", last="Can you do it?")
    request = append(tx_factory, "unjudged", raw, settings=SETTINGS)
    job_id = request.trigger.job.job_id
    run_job(runtime(database_url, tx_factory, ScriptedLLM(f"## Goal\n{GOAL}")), job_id, jobs.COMPACTION)
    [row] = compactions(tx_factory, "unjudged")
    assert row.status == "accepted" and row.coverage is None and row.density is not None
    [attempt] = row.attempt_log
    assert attempt["judged"] is False and isinstance(attempt["coverage"], float)
    with pytest.raises(UnknownCompactionError, match="has no measured coverage"):
        add_observation(
            tx_factory,
            ObservationIn(attempt["coverage"], False, "eval", compaction_id=row.id),
            recompute_every=50,
        )


def test_a_compaction_job_superseded_by_another_compaction_succeeds(
    database_url: str, tx_factory: sessionmaker[Session], simulator: Any
) -> None:
    """A worker's summary of a timeline another compaction replaced meanwhile (`compact --now` beside
    it) is kept as failed and not applied, as it should be; but its job failed with it, and fired the
    failing-jobs alert over a summary that was applied."""
    request = append(tx_factory, "race", session_messages(25), settings=SETTINGS)
    job_id = request.trigger.job.job_id
    winner: dict[str, Any] = {}

    def compact_meanwhile(request: ChatRequest) -> str:
        winner["outcome"] = compact_transcript(
            tx_factory, llm_for(simulator), "race", threshold=lambda: FALLBACK
        )
        return f"## Goal\n{GOAL}"

    run_job(runtime(database_url, tx_factory, ScriptedLLM(compact_meanwhile)), job_id, jobs.COMPACTION)
    loser = next(row for row in compactions(tx_factory, "race") if row.id != winner["outcome"].compaction_id)
    assert winner["outcome"].status == "accepted" and loser.status == "failed"
    with tx_factory() as session:
        job = session.get(Job, job_id)
        assert job is not None and job.status == "succeeded", (job.status, job.last_error)
        assert job.last_error == f"compaction {loser.id} {loser.error}"
        assert job.counters["status"] == "superseded" and job.counters["compaction_id"] == loser.id
        ended = session.execute(
            text("SELECT label, sum(n) FROM row_counts WHERE counter = 'jobs_ended' GROUP BY 1")
        ).all()
    assert dict(ended) == {"succeeded/compaction": 1}


def test_a_code_fence_or_a_preamble_around_a_summary_is_not_stored() -> None:
    assert summary_of("```markdown\n## Goal\nShip it.\n```") == "## Goal\nShip it."
    assert summary_of("\ufeff## Goal\nShip it.") == "## Goal\nShip it."
    assert summary_of("<think>\nfirst the goal\n</think>\n## Goal\nShip it.") == "## Goal\nShip it."
    assert summary_of("Here is the summary:\n\n## Goal\nShip it.") == "## Goal\nShip it."
    assert summary_of("Here is the summary:\n```markdown\n## Goal\nShip it.\n```") == "## Goal\nShip it."
    # A section the model put before the Goal is the summary's own: kept, with the rest.
    first = "## Constraints & Preferences\n- keep the canary\n## Goal\nShip it."
    assert summary_of(first) == first


def test_the_heading_the_gate_looks_for_is_the_one_the_prompt_asks_for_and_the_simulator_writes() -> None:
    """One rule: the gate's Goal heading is SUMMARY_HEADINGS' first, which the prompt lists and the
    simulator's summaries open with (renamed in one place, every reply would be "not a summary")."""
    from worker.core.compaction import SUMMARY_HEADINGS, summarizer_system_prompt
    from worker.simulator import LOSSY_SUMMARY

    prompt = summarizer_system_prompt().splitlines()
    assert all(heading in prompt for heading in SUMMARY_HEADINGS)
    assert opens_as_summary(LOSSY_SUMMARY) and LOSSY_SUMMARY.startswith(SUMMARY_HEADINGS[0])


def test_a_summary_below_tau_then_replies_that_are_not_summaries_is_rejected_as_judged(
    database_url: str, tx_factory: sessionmaker[Session]
) -> None:
    """The retry that names the missed terms came back as prose: the run was stored as failed ("not a
    summary after 2 attempts", one was), the first summary's coverage lost, the job failed."""
    request = append(tx_factory, "below", session_messages(25), settings=SETTINGS)
    job_id = request.trigger.job.job_id
    activate_threshold(tx_factory, 1.0)  # nothing short of a copy passes
    llm = ScriptedLLM("## Goal\nnope", "OK", "Sure.")
    outcome = run_job(runtime(database_url, tx_factory, llm), job_id, jobs.COMPACTION)
    assert outcome.status == "succeeded"
    [row] = compactions(tx_factory, "below")
    assert (row.status, row.summary) == ("rejected", "## Goal\nnope")
    assert row.coverage is not None and row.coverage < 1.0 and row.missed_terms
    assert row.error is not None and "the retry's reply was not a summary" in row.error
    assert [a["outcome"] for a in row.attempt_log] == [
        "below_threshold",
        "malformed_output",
        "malformed_output",
    ]
    # Both asks after the first name what it missed.
    assert [bool(a["missed_terms_named"]) for a in row.attempt_log] == [False, True, True]


@pytest.mark.parametrize(
    ("retry", "outcome"),
    [
        ("   \n", "empty_output"),
        (LLMError("the provider's reply is not text", retryable=False), "provider_error"),
        (ChatResponse("", "refusal", Usage(10, 3), "scripted", "scripted-1", 4, refusal="no"), "refusal"),
    ],
)
def test_a_summary_below_tau_then_a_retry_that_fails_is_rejected_as_judged(
    database_url: str, tx_factory: sessionmaker[Session], retry: Any, outcome: str
) -> None:
    """The retry naming the missed terms came back empty, refused or failed: the run was stored as
    failed with no coverage (the first summary's judgement lost to calibration) and the job failed, where
    two replies that are not summaries reject it as judged."""
    request = append(tx_factory, "below", session_messages(25), settings=SETTINGS)
    job_id = request.trigger.job.job_id
    activate_threshold(tx_factory, 1.0)  # nothing short of a copy passes
    llm = ScriptedLLM("## Goal\nnope", retry)
    run = run_job(runtime(database_url, tx_factory, llm), job_id, jobs.COMPACTION)
    assert run.status == "succeeded"
    [row] = compactions(tx_factory, "below")
    assert (row.status, row.summary) == ("rejected", "## Goal\nnope")
    assert row.coverage is not None and row.coverage < 1.0 and row.missed_terms
    assert (
        row.error is not None
        and row.error.endswith("; the summary was not applied")
        and "the retry failed (" in row.error
    )
    assert [a["outcome"] for a in row.attempt_log] == ["below_threshold", outcome]


def test_a_reply_that_is_not_a_summary_does_not_take_the_retry_naming_the_missed_terms(
    database_url: str, tx_factory: sessionmaker[Session]
) -> None:
    request = append(tx_factory, "first", session_messages(25), settings=SETTINGS)
    job_id = request.trigger.job.job_id
    activate_threshold(tx_factory, 1.0)
    llm = ScriptedLLM("OK", "## Goal\nnope", "## Goal\nnope again")
    run_job(runtime(database_url, tx_factory, llm), job_id, jobs.COMPACTION)
    [row] = compactions(tx_factory, "first")
    assert (row.status, row.summary) == ("rejected", "## Goal\nnope again")
    assert [a["outcome"] for a in row.attempt_log] == [
        "malformed_output",
        "below_threshold",
        "below_threshold",
    ]
    assert [bool(a["missed_terms_named"]) for a in row.attempt_log] == [False, False, True]


def test_a_superseded_outcome_says_so_in_its_json() -> None:
    """`compact --now --json` printed "failed" and exited 0 for a run another compaction superseded."""
    from worker.compaction.service import CompactionOutcome
    from worker.compaction.waits import SUPERSEDED

    superseded = CompactionOutcome(
        "failed", "t", detail=f"{SUPERSEDED} compaction 6 was accepted while this one ran"
    )
    assert superseded.as_dict()["superseded"] is True and "superseded" not in superseded.job_counters()
    assert (
        CompactionOutcome("failed", "t", detail="the summarizer call failed").as_dict()["superseded"] is False
    )


def test_a_failed_call_of_a_run_whose_transcript_was_erased_meanwhile_keeps_no_provider_message(
    factory: sessionmaker[Session],
) -> None:
    """`compact --now` (no job) whose summarizer call failed with a message quoting the transcript while
    the transcript was erased: the call was recorded with it, and no compaction row named it for the
    erasure to find. (Real commits: the erasure runs in its own transaction.)"""
    from models import LLMCall
    from worker.accounting import ERASED_CALL_ERROR
    from worker.compaction.erase import erase_transcript
    from worker.llm.errors import LLMError

    quoted = "HTTP 400: cannot process 'Deploy the payments service to the Frankfurt region'"
    append(factory, "gone", session_messages(25), settings=SETTINGS)

    def erase_then_fail(request: ChatRequest) -> str:
        assert erase_transcript(factory, "gone", "test") is not None
        raise LLMError(quoted, retryable=False, status=400)

    outcome = compact_transcript(factory, ScriptedLLM(erase_then_fail), "gone", threshold=lambda: FALLBACK)
    assert outcome.status == "failed" and outcome.compaction_id is None
    with factory() as session:
        errors = list(session.scalars(select(LLMCall.error)))
    assert errors == [ERASED_CALL_ERROR]


def test_calls_recorded_for_an_erased_page_keep_a_refusals_length_not_a_providers_message(
    tx_factory: sessionmaker[Session],
) -> None:
    from models import LLMCall
    from worker.accounting import ERASED_CALL_ERROR, Ledger, LLMCallRecord
    from worker.accounting.ledger import kept_error

    refusal = LLMCallRecord(
        "extraction", "p", "m", None, 5, "refusal", None, "I will not repeat Alice's offer"
    )
    failed = LLMCallRecord("extraction", "p", "m", None, 5, "provider_error", None, "HTTP 400: Alice's offer")
    with tx_factory.begin() as session:
        ids = Ledger(lambda key: None).record_many(session, [refusal, failed], erased=True)
    with tx_factory() as session:
        assert [session.get(LLMCall, i).error for i in ids] == [kept_error(refusal), ERASED_CALL_ERROR]  # type: ignore[union-attr]


@pytest.mark.parametrize(
    "said", ["", "Let me first work out what the user is after. The transcript opens with"]
)
def test_a_reply_cut_off_before_any_summary_fails_naming_the_cap(
    database_url: str, tx_factory: sessionmaker[Session], sim: Any, said: str
) -> None:
    """A reasoning model that thought past the output cap (nothing written), or a preamble that ran past
    it: stored as "an empty reply" or asked again at the same cap as "not a summary", the calls' rows
    never said truncated_output, and nothing named the setting to raise."""
    from worker.llm.openai_compat import OpenAIChatClient

    cut = {
        "id": "chatcmpl-cut",
        "object": "chat.completion",
        "created": 0,
        "model": "simulator-1",
        "choices": [
            {"index": 0, "message": {"role": "assistant", "content": said}, "finish_reason": "length"}
        ],
        "usage": {"prompt_tokens": 900, "completion_tokens": 4096, "total_tokens": 4996},
    }
    request = append(tx_factory, "cut", session_messages(25), settings=SETTINGS)
    llm = OpenAIChatClient(model="simulator-1", base_url=sim.base_url, provider="simulator")
    sim.configure(raw_replies={"chat.completions": cut})
    try:
        outcome = run_job(runtime(database_url, tx_factory, llm), request.trigger.job.job_id, jobs.COMPACTION)
    finally:
        sim.configure(raw_replies={})
    assert outcome.status == "failed"
    [row] = compactions(tx_factory, "cut")
    assert row.status == "failed" and row.summary is None
    assert row.error == (
        "the summarizer's reply was cut off at its output cap (4096 tokens) before any summary; raise "
        "FACTMILL_COMPACTION_MAX_OUTPUT_TOKENS; the history was left as it was"
    )
    assert [call.outcome for call in llm_calls(tx_factory)] == ["truncated_output"], "not asked again"
    assert response_outcome("truncated", said) == "truncated_output"
    assert response_outcome("truncated", "## Goal\nship it") == "truncated_output"  # a summary begun: judged
    assert response_outcome("end", said) == ("empty_output" if not said else "malformed_output")
