"""Seed twins: extractConversationFactsFingerprint and checkpoint entry encoding."""

from __future__ import annotations

import hashlib

import pytest

from worker.core.checkpoint import CheckpointState, PrefixHasher, messages_hash, prefix_digests, resume_point
from worker.core.conversation import Message
from worker.extraction import (
    PER_SEGMENT_SOURCE_PREFIX,
    TERMINAL_AUDIT_SOURCE,
    decode_checkpoint_entry,
    encode_checkpoint_entry,
    extract_conversation_facts_fingerprint,
)


def test_same_source_id_yields_same_fingerprint():
    assert extract_conversation_facts_fingerprint("default") == extract_conversation_facts_fingerprint(
        "default"
    )


def test_different_source_id_yields_different_fingerprint():
    assert extract_conversation_facts_fingerprint("a") != extract_conversation_facts_fingerprint("b")


def test_fingerprint_is_first_8_hex_of_sha256_of_the_json():
    expected = hashlib.sha256(b'{"sourceId":"default"}').hexdigest()[:8]
    assert extract_conversation_facts_fingerprint("default") == expected


def test_round_trips_source_id_slug_iso():
    entry = encode_checkpoint_entry("default", "conversations/imessage/alice-example", "2024-03-16T08:05:00Z")
    decoded = decode_checkpoint_entry(entry)
    assert decoded is not None
    assert (decoded.source_id, decoded.slug, decoded.end_iso) == (
        "default",
        "conversations/imessage/alice-example",
        "2024-03-16T08:05:00Z",
    )


def test_decodes_null_for_malformed_entries():
    assert decode_checkpoint_entry("no-pipes-here") is None
    assert decode_checkpoint_entry("only-one|pipe") is None
    assert decode_checkpoint_entry("||") is None
    assert decode_checkpoint_entry("a||2024") is None


def test_slug_with_forward_slashes_survives_encoding():
    entry = encode_checkpoint_entry("src-a", "conversations/group/2024/march/team-x", "2024-03-16T08:05:00Z")
    decoded = decode_checkpoint_entry(entry)
    assert decoded is not None and decoded.slug == "conversations/group/2024/march/team-x"


def test_slug_with_a_pipe_survives_encoding():
    decoded = decode_checkpoint_entry(encode_checkpoint_entry("s", "odd|slug", "2024-03-16T08:05:00Z"))
    assert decoded is not None and (decoded.source_id, decoded.slug) == ("s", "odd|slug")


def test_source_id_with_a_pipe_is_refused():
    with pytest.raises(ValueError):
        encode_checkpoint_entry("a|b", "slug", "2024-03-16T08:05:00Z")


def test_source_names():
    assert PER_SEGMENT_SOURCE_PREFIX == "cli:extract-conversation-facts"
    assert TERMINAL_AUDIT_SOURCE == "cli:extract-conversation-facts:terminal"


MESSAGES = [Message("Alice", f"2024-03-15T09:0{i}:00Z", f"line {i}") for i in range(4)]


def test_resume_point_after_an_append_and_from_scratch_after_an_edit():
    done = CheckpointState(2, messages_hash(MESSAGES[:2]), next_row_num=5)
    assert resume_point(MESSAGES, PrefixHasher(MESSAGES), None) == (0, False)
    assert resume_point(MESSAGES, PrefixHasher(MESSAGES), done) == (2, False)
    edited = [Message("Alice", MESSAGES[0].timestamp, "changed"), *MESSAGES[1:]]
    assert resume_point(edited, PrefixHasher(edited), done) == (0, True)
    assert resume_point(MESSAGES[:1], PrefixHasher(MESSAGES[:1]), done) == (0, True)  # the page shrank


def test_prefix_hasher_digests_match_a_fresh_hash_going_forward_and_back():
    hasher = PrefixHasher(MESSAGES)
    assert hasher.digest(3) == messages_hash(MESSAGES[:3])
    assert hasher.digest(1) == messages_hash(MESSAGES[:1])


def test_prefix_digests_read_the_messages_once_and_no_further_than_the_largest_count():
    def stream():
        yield from MESSAGES[:2]
        raise AssertionError("read past the largest count")

    assert prefix_digests(stream(), (2, 1, 0)) == {
        0: messages_hash([]),
        1: messages_hash(MESSAGES[:1]),
        2: messages_hash(MESSAGES[:2]),
    }
    assert prefix_digests(iter(MESSAGES), (len(MESSAGES) + 1, 1)) == {1: messages_hash(MESSAGES[:1])}


def test_a_last_message_left_alone_joins_the_first_segment_of_a_resumed_run() -> None:
    from worker.core.checkpoint import with_leading_orphan
    from worker.core.conversation import Message, split_into_segments

    def at(day: int, hour: int, minute: int, text: str) -> Message:
        return Message("A", f"2024-03-{day:02d}T{hour:02d}:{minute:02d}:00Z", text)

    previous = at(15, 9, 2, "the last one extracted")
    pending = [at(15, 9, 3, "last word"), at(15, 11, 0, "hi"), at(15, 11, 1, "hello")]
    pending += [at(15, 14, 0, "bye"), at(15, 14, 1, "ciao")]
    segments = split_into_segments(pending)
    assert [len(s.messages) for s in segments] == [2, 2]  # the lone 9:03 dropped
    joined = with_leading_orphan(previous, pending, segments)
    assert [m.text for m in joined[0].messages] == ["last word", "hi", "hello"]
    assert joined[0].start_iso == "2024-03-15T09:03:00Z" and joined[1] == segments[1]
    assert with_leading_orphan(previous, pending[1:], split_into_segments(pending[1:])) == segments  # none
    assert with_leading_orphan(previous, pending[:1], []) == []  # alone: nothing to join yet
    # Daily posts after the checkpoint do not continue its conversation: dropped, as a full run drops them.
    posts = [at(16 + n, 9, 0, f"post {n}") for n in range(3)] + [at(20, 9, 0, "hi"), at(20, 9, 1, "hello")]
    assert with_leading_orphan(previous, posts, split_into_segments(posts)) == split_into_segments(posts)
