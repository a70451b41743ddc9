"""The compaction timeline: the applied summary, the context view a model gets, the cut plan."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from worker.core.compaction import (
    CHARACTERS_PER_TOKEN,
    NOT_ENOUGH_HISTORY,
    SUMMARY_CHAR_LIMIT,
    MessageHistory,
    TokenHistory,
    TranscriptMessage,
    clip_text,
    compacted_history,
    cut_in_history,
    estimate_tokens,
    serialize_transcript,
)
from worker.core.transcripts import TranscriptSettings, tool_calls_json


@dataclass(frozen=True)
class AppliedSummary:
    """The newest accepted compaction: its summary stands in for every message before ``cut_seq``."""

    compaction_id: int
    cut_seq: int
    summary: str

    def marker(self) -> TranscriptMessage:
        return TranscriptMessage(role="user", text=self.summary, is_compaction=True)


@dataclass(frozen=True)
class Timeline:
    """What the next compaction works on: the applied summary (as a marker) and every message after its cut.

    ``seqs[i]`` is the stored seq of ``messages[i]`` (None for the summary marker).
    """

    transcript_id: str
    settings: TranscriptSettings
    summary: AppliedSummary | None
    messages: list[TranscriptMessage]
    seqs: list[int | None]
    # When the transcript was created: an id erased and appended to again is another transcript.
    created_at: datetime | None = None

    @property
    def tokens(self) -> int:
        return sum(estimate_tokens(m) for m in self.messages)


@dataclass(frozen=True)
class ViewMessage:
    """One message of a context view; ``seq`` None for the summary and for repair placeholders."""

    message: TranscriptMessage
    seq: int | None

    def as_dict(self) -> dict[str, Any]:
        m = self.message
        return {
            "seq": self.seq,
            "role": m.role,
            "text": m.text,
            "tool_calls": tool_calls_json(m.tool_calls),
            "tool_call_id": m.tool_call_id,
            "tool_name": m.tool_name,
            "is_compaction": m.is_compaction,
            "tokens": estimate_tokens(m),
        }


@dataclass(frozen=True)
class ContextView:
    transcript_id: str
    compaction_id: int | None
    cut_seq: int | None
    messages: list[ViewMessage]

    @property
    def tokens(self) -> int:
        return sum(estimate_tokens(v.message) for v in self.messages)


def applied_timeline(
    transcript_id: str,
    settings: TranscriptSettings,
    summary: AppliedSummary | None,
    kept: Iterable[tuple[int, TranscriptMessage]],
    created_at: datetime | None = None,
) -> Timeline:
    """The timeline of a history whose ``summary`` is applied: its marker, then the stored messages from
    its cut on (``kept``: (seq, message), oldest first). What is sent shrinks; the history stays whole."""
    messages: list[TranscriptMessage] = [summary.marker()] if summary is not None else []
    seqs: list[int | None] = [None] if summary is not None else []
    for seq, message in kept:
        messages.append(message)
        seqs.append(seq)
    return Timeline(transcript_id, settings, summary, messages, seqs, created_at)


def view_of(timeline: Timeline) -> ContextView:
    """The timeline as a model should receive it: repaired so every tool call has its results, in place."""
    seq_of = {id(message): seq for message, seq in zip(timeline.messages, timeline.seqs, strict=True)}
    repaired = compacted_history(timeline.messages)
    summary = timeline.summary
    return ContextView(
        transcript_id=timeline.transcript_id,
        compaction_id=summary.compaction_id if summary else None,
        cut_seq=summary.cut_seq if summary else None,
        messages=[ViewMessage(m, seq_of.get(id(m))) for m in repaired],
    )


class NothingToCompactError(Exception):
    """The timeline has nothing worth summarizing yet; the message says why."""


@dataclass(frozen=True)
class CompactionPlan:
    cut: int  # index into the timeline of the first message kept verbatim
    cut_seq: int
    head: list[TranscriptMessage]
    serialized: str
    tokens_before: int
    kept_tokens: int
    # The cut was moved back so the head fits the summarizer's input: what is left over the threshold
    # goes to the next compaction (whose head starts with this one's summary).
    capped: bool = False

    def tokens_after(self, summary: str) -> int:
        """Estimated tokens of the context once ``summary`` replaces the head."""
        return (
            estimate_tokens(TranscriptMessage(role="user", text=summary, is_compaction=True))
            + self.kept_tokens
        )


def plan_compaction(
    messages: Sequence[TranscriptMessage],
    seqs: Sequence[int | None],
    *,
    keep_recent_tokens: int,
    tool_result_limit: int,
    max_head_tokens: int | None = None,
) -> CompactionPlan:
    """Cut the timeline (summary marker first, if any) and serialize its head for the summarizer.

    The cut runs on the stored timeline before any repair, so it never lands between a tool call and
    its results. A head whose serialized text is over ``max_head_tokens`` (the summarizer's input) is
    cut earlier, at the latest such place where it fits (``capped``): a context that grew far past
    its window is summarized oldest part first, in several compactions, instead of sending a request
    no model accepts, again on every trigger. Raises NothingToCompactError when the cut would keep
    everything, or would summarize only the previous summary, or while the newest message is a tool
    result (a turn in flight). When not even the oldest messages fit the summarizer's input, the head
    is those messages, clipped to fit.

    A timeline too long to load whole is planned from its stored rows with the same two steps:
    ``plan_cut`` over their roles and tokens, then ``plan_head`` over the head's messages.
    """
    starts_with_summary = bool(messages) and messages[0].is_compaction
    cut = plan_cut(MessageHistory(messages), keep_recent_tokens, starts_with_summary=starts_with_summary)
    cut_seq = seqs[cut]
    assert cut_seq is not None  # the marker is only ever at index 0, and cut >= 1
    return plan_head(
        zip(messages, seqs, strict=True),
        cut,
        cut_seq,
        tokens_before=sum(estimate_tokens(m) for m in messages),
        tool_result_limit=tool_result_limit,
        max_head_tokens=max_head_tokens,
    )


def plan_cut(history: TokenHistory, keep_recent_tokens: int, *, starts_with_summary: bool) -> int:
    """The index of the first message a compaction keeps, or NothingToCompactError (see plan_compaction)."""
    if len(history) and history.role(len(history) - 1) == "tool":
        raise NothingToCompactError(
            "the newest message is a tool result: the agent's turn is still in flight; compact after it ends"
        )
    cut = cut_in_history(history, keep_recent_tokens)
    if cut is None or (cut == 1 and starts_with_summary):
        raise NothingToCompactError(NOT_ENOUGH_HISTORY)
    return cut


# A capped head whose own messages (the previous summary aside) are under this share of the summarizer's
# input, before a unit that no later head could hold whole beside a summary, runs past that unit, clipped
# (see plan_head).
MIN_HEAD_SHARE = 0.5


def plan_head(
    timeline: Iterable[tuple[TranscriptMessage, int | None]],
    cut: int,
    cut_seq: int,
    *,
    tokens_before: int,
    tool_result_limit: int,
    max_head_tokens: int | None,
) -> CompactionPlan:
    """The plan of the head before ``cut`` (at seq ``cut_seq``), read from ``timeline`` (message, seq)
    oldest first and only as far as it needs: past ``max_head_tokens`` (the summarizer's input) the
    cut moves back to the latest place where the head fits (one on a message that is not a tool
    result, so a tool call stays with its results, past more than the summary marker), and the walk
    stops there. When even the first such place is over (the oldest messages alone: a pasted file, a
    long previous summary), the head is the messages before it, clipped to fit (``clip_text``): left
    whole, the transcript could never be compacted, and every append past its threshold ran another
    job that found the same. So is it when the head that fits holds under MIN_HEAD_SHARE of the input
    of its own and what follows it could never be held whole beside a summary (a short opening line,
    then a pasted file): summarized, that short head saved nothing, the run was rejected, and the next
    planned the same cut. Each message is serialized once (the head is their paragraphs joined by a
    blank line)."""
    max_chars = None if max_head_tokens is None else max_head_tokens * CHARACTERS_PER_TOKEN
    read: list[tuple[TranscriptMessage, int | None]] = []
    best: int | None = None
    place: int | None = cut  # past the input: where a cut may land after ``best`` (None: in a tool run)
    length = best_length = -2  # no separator before the first paragraph
    marker = 0  # the previous summary's paragraph and separator: not the head's own

    def short(head_length: int) -> bool:
        assert max_chars is not None
        return head_length - marker < max_chars * MIN_HEAD_SHARE

    for index, (message, seq) in enumerate(timeline):
        if index == cut:
            break
        read.append((message, seq))
        if index and max_chars is not None:
            fits = length <= max_chars  # the head before this message
            if message.role != "tool" and not (index == 1 and read[0][0].is_compaction):
                if not fits:
                    place = index
                    break
                best, best_length = index, length
            elif not fits and best is not None and not short(best_length):
                place = None  # the head at best is kept: the rest of the tool run is not read
                break
        length += len(serialize_transcript([message], tool_result_limit)) + 2
        if index == 0 and message.is_compaction:
            marker = length + 2
    capped = max_chars is not None and length > max_chars
    if capped:
        assert max_chars is not None
        span = length - best_length - 2  # from best to the place past the input
        if best is None:
            cut = place if place is not None else cut
        elif place is not None and short(best_length) and span + SUMMARY_CHAR_LIMIT > max_chars:
            cut = place
        else:
            cut = best
        cut_seq = cut_seq if cut == len(read) else _seq(read[cut][1])
    head = [message for message, _ in read[:cut]]
    serialized = serialize_transcript(head, tool_result_limit)
    if capped:
        assert max_chars is not None
        serialized = clip_text(serialized, max_chars)
    head_tokens = sum(estimate_tokens(m) for m in head)
    return CompactionPlan(
        cut=cut,
        cut_seq=cut_seq,
        head=head,
        serialized=serialized,
        tokens_before=tokens_before,
        kept_tokens=tokens_before - head_tokens,
        capped=capped,
    )


def _seq(seq: int | None) -> int:
    assert seq is not None  # the marker is only ever at index 0, and a cut is past it
    return seq
