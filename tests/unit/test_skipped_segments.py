"""Poison segments, the pure parts: the checkpoint's skipped entries, the simulator's text marker, the
config key that says how many permanent failures skip a segment."""

from __future__ import annotations

import pytest

from worker.config_store import validate_value
from worker.core.checkpoint import CheckpointState, SkippedSegment, messages_hash, segment_hash
from worker.core.conversation import Message, segment_of
from worker.simulator.config import Fault, text_fault

MESSAGES = [Message("Alice", f"2024-03-15T09:0{i}:00Z", f"line {i}") for i in range(4)]


def test_a_skipped_segment_round_trips_through_its_json_and_is_named_by_its_messages():
    segment = segment_of(MESSAGES[1:3])
    entry = SkippedSegment(1, 3, segment_hash(segment), segment.start_iso, segment.end_iso)
    assert SkippedSegment.from_json(entry.as_json()) == entry
    assert segment_hash(segment) == messages_hash(MESSAGES[1:3])
    assert segment_hash(segment_of(MESSAGES[1:4])) != entry.segment_hash
    assert CheckpointState(3, "h", 0).skipped == ()


def test_the_simulator_text_marker_names_a_fault():
    assert text_fault("hello [[sim:refusal]] there") is Fault.REFUSAL
    assert text_fault("[[sim:nonsense]] then [[sim:malformed]]") is Fault.MALFORMED
    assert text_fault("[sim:refusal] or [[SIM:refusal]]") is None


def test_max_segment_failures_is_validated():
    assert validate_value("extraction.max_segment_failures", " 3 ") == "3"
    for bad in ("0", "-1", "three", "101"):
        with pytest.raises(ValueError, match="max_segment_failures"):
            validate_value("extraction.max_segment_failures", bad)
