"""The extraction checkpoint codec and resume arithmetic: fingerprints, entries, prefix hashes (pure)."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass
from itertools import islice
from typing import Any

from worker.core.conversation import (
    DEFAULT_SEGMENT_GAP_MINUTES,
    Message,
    Segment,
    instant_micros,
    segment_of,
)


def extract_conversation_facts_fingerprint(source_id: str) -> str:
    """First 8 hex digits of sha256 of ``{"sourceId":"<id>"}``: one resume namespace per source."""
    payload = json.dumps({"sourceId": source_id}, separators=(",", ":"), ensure_ascii=False)
    return hashlib.sha256(payload.encode("utf-8")).hexdigest()[:8]


@dataclass(frozen=True)
class CheckpointEntry:
    source_id: str
    slug: str
    end_iso: str


def encode_checkpoint_entry(source_id: str, slug: str, end_iso: str) -> str:
    """``sourceId|slug|endIso``; the slug may hold ``/`` and even ``|``, the other two may not."""
    if "|" in source_id or "|" in end_iso:
        raise ValueError(f"source_id and end_iso must not contain '|': {source_id!r}, {end_iso!r}")
    return f"{source_id}|{slug}|{end_iso}"


def decode_checkpoint_entry(entry: str) -> CheckpointEntry | None:
    """The entry's parts, or None when it is not of the form ``sourceId|slug|endIso``."""
    source_id, sep, rest = entry.partition("|")
    slug, sep2, end_iso = rest.rpartition("|")
    if not sep or not sep2 or not source_id or not slug or not end_iso:
        return None
    return CheckpointEntry(source_id=source_id, slug=slug, end_iso=end_iso)


def page_key(source_id: str, slug: str) -> str:
    """The checkpoint row's key within a fingerprint: one row per page."""
    return f"{source_id}|{slug}"


@dataclass(frozen=True)
class SkippedSegment:
    """A segment the checkpoint moved past without its facts (a poison segment): the messages
    ``[first, end)`` of the page (led by message ``joined`` when a conversation's last message joined
    it from before, ``with_leading_orphan``), their digest, and their time span (for people reading it)."""

    first: int
    end: int
    segment_hash: str
    start_iso: str
    end_iso: str
    joined: int | None = None

    def messages_of(self, messages: Sequence[Message]) -> list[Message]:
        """The segment's messages, from the page's."""
        run = list(messages[self.first : self.end])
        return run if self.joined is None else [messages[self.joined], *run]

    def as_json(self) -> dict[str, Any]:
        data: dict[str, Any] = {
            "first": self.first,
            "end": self.end,
            "segment_hash": self.segment_hash,
            "start_iso": self.start_iso,
            "end_iso": self.end_iso,
        }
        if self.joined is not None:
            data["joined"] = self.joined
        return data

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> SkippedSegment:
        joined = data.get("joined")
        return cls(
            int(data["first"]),
            int(data["end"]),
            str(data["segment_hash"]),
            str(data["start_iso"]),
            str(data["end_iso"]),
            None if joined is None else int(joined),
        )


def skipped_record(messages: Sequence[Message], segment: Segment, end: int) -> SkippedSegment:
    """The checkpoint's record of a skipped segment that ends just before message ``end``. A segment a
    leading orphan joined is not one run of the page's messages (a lone message may sit between): its
    run starts a message later and the orphan is named apart, or a retry rebuilt the wrong messages,
    found they no longer matched, and never re-extracted it."""
    first, joined = end - len(segment.messages), None
    if messages[first] is not segment.messages[0]:
        first += 1
        joined = next(i for i in range(first - 1, -1, -1) if messages[i] is segment.messages[0])
    return SkippedSegment(first, end, segment_hash(segment), segment.start_iso, segment.end_iso, joined)


@dataclass(frozen=True)
class CheckpointState:
    """Where a page's checkpoint stands: messages extracted, their digest, the next fact row number,
    and the segments it moved past without their facts (in page order)."""

    messages_done: int
    prefix_hash: str
    next_row_num: int
    skipped: tuple[SkippedSegment, ...] = ()


def segment_hash(segment: Segment) -> str:
    """A digest of one segment's messages: who said what when. It names the segment across runs
    (its index changes as the checkpoint moves), so its failures can be counted."""
    return messages_hash(segment.messages)


class PrefixHasher:
    """sha256 over a growing prefix of the messages: digest(k) costs only the messages added since the
    last call, so checkpointing every segment of a long page stays linear, not quadratic."""

    def __init__(self, messages: Sequence[Message]) -> None:
        self._messages = messages
        self._digest = hashlib.sha256()
        self._done = 0

    def digest(self, count: int) -> str:
        if count < self._done:  # going back (an edited page): start over
            self._digest, self._done = hashlib.sha256(), 0
        update = self._digest.update
        for message in self._messages[self._done : count]:
            _hash_message(update, message)
        self._done = count
        return self._digest.copy().hexdigest()


def _hash_message(update: Callable[[bytes], object], message: Message) -> None:
    for part in (message.speaker, message.timestamp, message.text):
        update(part.encode("utf-8", "surrogatepass"))
        update(b"\x1f")
    update(b"\x1e")


def prefix_digests(messages: Iterable[Message], counts: Collection[int]) -> dict[int, str]:
    """``PrefixHasher.digest`` at each of ``counts``, reading ``messages`` only as far as the largest and
    holding none of them (a count past the last message has no digest)."""
    wanted, digest = set(counts), hashlib.sha256()
    digests = {0: digest.hexdigest()} if 0 in wanted else {}
    for done, message in enumerate(islice(messages, max(wanted, default=0)), start=1):
        _hash_message(digest.update, message)
        if done in wanted:
            digests[done] = digest.copy().hexdigest()
    return digests


def messages_hash(messages: Sequence[Message]) -> str:
    """A digest of the messages already extracted, to tell an append from an edit."""
    return PrefixHasher(messages).digest(len(messages))


def resume_point(
    messages: Sequence[Message], hasher: PrefixHasher, checkpoint: CheckpointState | None
) -> tuple[int, bool]:
    """(first message still to extract, whether the page must be re-extracted whole).

    Resume after the checkpoint when the messages it covers are unchanged (an append); when they were
    edited (or the page shrank), start over and replace the page's facts.
    """
    if checkpoint is None:
        return 0, False
    done = checkpoint.messages_done
    if done <= len(messages) and hasher.digest(done) == checkpoint.prefix_hash:
        return done, False
    return 0, True


def with_leading_orphan(
    previous: Message,
    pending: Sequence[Message],
    segments: list[Segment],
    gap_minutes: float = DEFAULT_SEGMENT_GAP_MINUTES,
) -> list[Segment]:
    """The segments of the messages after a checkpoint, the first of those messages joining the first
    segment when no segment holds it and it continues the conversation before the checkpoint (within
    ``gap_minutes`` of ``previous``, its last message; out of order counts as within, as it never cuts).

    That is a conversation's last message, appended after its segment was extracted: alone, it was
    dropped for being too few, and the run that extracted the next conversation (after a gap) moved
    the checkpoint past it, so no run ever sent it; a full run has it in its conversation's segment
    (unless that one was full: then it drops it too, and this run sends it all the same). A
    message that does not continue it (a lone daily post) is dropped as a full run drops it."""
    if not segments or not pending or segments[0].messages[0] is pending[0]:
        return segments
    orphan = pending[0]
    gap = instant_micros(orphan.timestamp) - instant_micros(previous.timestamp)
    if gap > gap_minutes * 60_000_000:  # microseconds
        return segments
    return [segment_of([orphan, *segments[0].messages]), *segments[1:]]


def segment_ends(messages: Sequence[Message], start: int, segments: Sequence[Segment]) -> list[int]:
    """For each segment, the index just past its last message in ``messages``."""
    ends: list[int] = []
    cursor = start
    for segment in segments:
        last = segment.messages[-1]
        while messages[cursor] is not last:
            cursor += 1
        cursor += 1
        ends.append(cursor)
    return ends
