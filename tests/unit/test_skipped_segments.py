"""Poison segments, the pure parts: the checkpoint's skipped entries, the simulator's text marker, the
config key that says how many permanent failures skip a segment."""

from __future__ import annotations

import pytest

from worker.config_store import validate_value
from worker.core.checkpoint import CheckpointState, SkippedSegment, messages_hash, segment_hash
from worker.core.conversation import Message, segment_of
from worker.extraction.segments import extract_segment
from worker.llm.errors import LLMError
from worker.llm.types import ChatRequest, ChatResponse, EmbeddingResponse, Usage
from worker.simulator.config import Fault, text_fault

MESSAGES = [Message("Alice", f"2024-03-15T09:0{i}:00Z", f"line {i}") for i in range(4)]


def test_a_skipped_segment_round_trips_through_its_json_and_is_named_by_its_messages():
    segment = segment_of(MESSAGES[1:3])
    entry = SkippedSegment(1, 3, segment_hash(segment), segment.start_iso, segment.end_iso)
    assert SkippedSegment.from_json(entry.as_json()) == entry
    assert segment_hash(segment) == messages_hash(MESSAGES[1:3])
    assert segment_hash(segment_of(MESSAGES[1:4])) != entry.segment_hash
    assert CheckpointState(3, "h", 0).skipped == ()


def test_a_segment_a_leading_orphan_joined_is_recorded_so_a_retry_rebuilds_it():
    """Checkpoint after [a, b]; then an orphan 10 minutes after b, a lone message, and a conversation
    [p2, p3] an hour later: the first segment is [orphan, p2, p3], not one run of the page. Recorded
    as the run [end - 3, end) it named [lone, p2, p3]: the retry found no match and never sent it."""
    from worker.core.checkpoint import skipped_record, with_leading_orphan
    from worker.core.conversation import split_into_segments

    times = ["09:00", "09:05", "09:15", "10:00", "11:00", "11:05"]
    messages = [Message(f"P{i % 2}", f"2024-03-15T{t}:00Z", f"m{i}") for i, t in enumerate(times)]
    segments = with_leading_orphan(messages[1], messages[2:], split_into_segments(messages[2:]))
    assert [m.text for m in segments[0].messages] == ["m2", "m4", "m5"]
    entry = skipped_record(messages, segments[0], 6)
    assert (entry.first, entry.end, entry.joined) == (4, 6, 2)
    assert SkippedSegment.from_json(entry.as_json()) == entry
    assert segment_hash(segment_of(entry.messages_of(messages))) == entry.segment_hash
    plain = skipped_record(MESSAGES, segment_of(MESSAGES[1:3]), 3)
    assert (plain.first, plain.joined) == (1, None) and "joined" not in plain.as_json()


def test_the_simulator_text_marker_names_a_fault():
    assert text_fault("hello [[sim:refusal]] there") is Fault.REFUSAL
    assert text_fault("[[sim:nonsense]] then [[sim:malformed]]") is Fault.MALFORMED
    assert text_fault("[sim:refusal] or [[SIM:refusal]]") is None


def test_max_segment_failures_is_validated():
    assert validate_value("extraction.max_segment_failures", " 3 ") == "3"
    for bad in ("0", "-1", "three", "101", "²", "٣"):  # "²".isdigit(), and int("²") raised bare
        with pytest.raises(ValueError, match="max_segment_failures must be an integer from 1 to 100"):
            validate_value("extraction.max_segment_failures", bad)
    with pytest.raises(ValueError, match="max_facts must be an integer from 1 to 25"):
        validate_value("extraction.max_facts", "²")


class _Answers:
    """An LLM client that answers from a script: "ok" (valid JSON), "bad" (not JSON), "refusal",
    "truncated", or an LLMError to raise. Pure: the segment logic alone, no server."""

    provider, model = "stub", "stub-1"

    def __init__(self, *answers: object) -> None:
        self.answers = list(answers)
        self.requests: list[ChatRequest] = []

    def chat(self, request: ChatRequest) -> ChatResponse:
        self.requests.append(request)
        answer = self.answers.pop(0)
        if isinstance(answer, Exception):
            raise answer
        finish = answer if answer in ("refusal", "truncated") else "end"
        text = {"ok": '{"facts": []}', "blank": "  "}.get(str(answer), "not json")
        return ChatResponse(text, finish, Usage(1, 1), self.provider, self.model, 1)  # type: ignore[arg-type]

    def embed(self, texts: list[str], *, purpose: str = "embedding") -> EmbeddingResponse:
        raise NotImplementedError


@pytest.mark.parametrize(
    ("answers", "permanent"),
    [
        (("refusal",), True),
        (("bad", "bad"), True),  # malformed after its repair turn
        (("bad", "ok"), False),  # the repair turn mended it
        (("truncated", "truncated"), True),  # truncated after its retry with a bigger cap
        (("truncated", "ok"), False),
        ((LLMError("bad request", retryable=False, status=400),), True),
        ((LLMError("too large", retryable=False, status=413),), True),
        ((LLMError("bad key", retryable=False, status=401),), False),  # the deployment's fault
        ((LLMError("model gone", retryable=False, status=404),), False),
        ((LLMError("overloaded", retryable=True, status=529),), False),
        (("ok",), False),
    ],
)
def test_which_failures_are_permanent(answers: tuple[object, ...], permanent: bool):
    client = _Answers(*answers)
    result = extract_segment(client, "segment text", max_facts=5, max_output_tokens=64)
    assert result.permanent is permanent
    assert not client.answers, "every scripted answer was asked for"


def test_a_blank_reply_is_asked_again_without_an_empty_assistant_turn() -> None:
    """The repair turn quoted the blank reply as an assistant turn: Anthropic refuses an empty one with
    a 400, so the segment was recorded as the provider's permanent refusal, not a malformed reply."""
    client = _Answers("blank", "ok")
    result = extract_segment(client, "segment text", max_facts=5, max_output_tokens=64)
    assert [a.outcome for a in result.attempts] == ["malformed_output", "ok"]
    assert all(text.strip() for request in client.requests for _, text in request.messages)
    assert client.requests[1].messages == client.requests[0].messages


def test_an_error_between_a_segments_attempts_keeps_the_paid_ones() -> None:
    """A malformed first reply (paid), then the budget check before the repair turn could not reach
    the database: the attempts were a local list, lost with the exception, and the retry paid again."""
    from worker.extraction.segments import SegmentAbortedError

    checks = iter([None, RuntimeError("the database is unavailable")])

    def before_call() -> None:
        error = next(checks)
        if error is not None:
            raise error

    with pytest.raises(SegmentAbortedError) as aborted:
        extract_segment(_Answers("bad"), "segment text", 5, 64, before_call=before_call)
    assert [a.outcome for a in aborted.value.attempts] == ["malformed_output"]
    assert isinstance(aborted.value.cause, RuntimeError)
    # Before any paid attempt, the error itself (nothing to record).
    with pytest.raises(RuntimeError):
        extract_segment(_Answers(), "segment text", 5, 64, before_call=_raise)


def _raise() -> None:
    raise RuntimeError("no database")


def test_a_retry_of_a_skipped_segment_records_the_attempts_an_error_cut_short() -> None:
    """`jobs retry --skipped` dropped the paid attempts of a segment whose next call was cut short
    (the lease lost, the database gone at the budget check): the error went on without them."""
    from types import SimpleNamespace

    from worker.extraction.poison import SkippedRetry
    from worker.extraction.segments import DISCARDED_ABORTED, Attempt, SegmentAbortedError

    paid = Attempt("malformed_output", None, [], "not json", "stub", "stub-1")
    recorded: list[tuple[object, list[Attempt], str | None]] = []
    store = SimpleNamespace(
        record_attempts=lambda place, attempts, note=None, **_: recorded.append((place, attempts, note))
    )
    counted: list[object] = []
    counters = SimpleNamespace(add_calls=counted.append)

    def extract(label: str, segment: object) -> object:
        raise SegmentAbortedError([paid], RuntimeError("lease lost"))

    retry = SkippedRetry(store, None, None, counters, extract)  # type: ignore[arg-type]
    place = SimpleNamespace(segment="segment")
    with pytest.raises(RuntimeError, match="lease lost"):
        retry._retry_one(SimpleNamespace(slug="p"), "label", None, None, place, None)  # type: ignore[arg-type]
    assert recorded == [(place, [paid], DISCARDED_ABORTED)] and len(counted) == 1


@pytest.mark.parametrize(
    "stored", ["²", "0", "101", " 7x", "-3", "9" * 5000, "0" * 5000, "0" * 4300 + "3000"]
)
def test_a_count_setting_no_writer_takes_is_read_as_its_default(stored: str) -> None:
    """The writer took ASCII digits in range; the readers took what str.isdigit did: "²" (stored by
    hand, or by an older release) raised ValueError from int() in every extraction job, retried until
    it failed; one past 100 failures was used as it was."""
    from worker.config_store import EXTRACTION_MAX_FACTS, EXTRACTION_MAX_SEGMENT_FAILURES
    from worker.extraction.options import (
        DEFAULT_MAX_SEGMENT_FAILURES,
        ExtractOptions,
        resolve_max_facts,
        resolve_max_segment_failures,
    )

    class Stored:
        def get(self, key: str) -> str | None:
            return {EXTRACTION_MAX_FACTS: stored, EXTRACTION_MAX_SEGMENT_FAILURES: stored}.get(key)

    assert resolve_max_facts(ExtractOptions(default_max_facts=9), Stored()) == 9  # type: ignore[arg-type]
    assert resolve_max_segment_failures(Stored()) == DEFAULT_MAX_SEGMENT_FAILURES  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="must be an integer from 1 to"):
        validate_value(EXTRACTION_MAX_FACTS, stored)


def test_a_count_setting_with_leading_zeros_is_read_as_its_number() -> None:
    """The writer always took "005"; a length check against the ceiling's digits read it as unset."""
    from worker.config_store import EXTRACTION_MAX_FACTS, stored_count

    assert stored_count("005", 25) == 5 and stored_count("0100", 100) == 100
    assert validate_value(EXTRACTION_MAX_FACTS, "005") == "005"
