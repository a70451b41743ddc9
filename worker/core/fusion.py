"""Reciprocal-rank fusion of search lists, and the intent-weighted snippet of a result's segment."""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any, Literal

from worker.core.intent import (
    SNIPPET_CHUNK_CONTEXT_CHARS,
    SearchType,
    SnippetResult,
    best_snippet_line,
    extract_intent_terms,
    score_chunk,
    snippet_around,
)

__all__ = [
    "EXPANSION_LINE_WEIGHT",
    "FIRST_PLACE_BONUS",
    "PODIUM_BONUS",
    "RRF_K",
    "SNIPPET_MAX_CHARS",
    "USER_LINE_WEIGHT",
    "Fused",
    "Hit",
    "Origin",
    "SearchLine",
    "best_chunk",
    "fuse",
    "segment_range",
    "segment_snippet",
]

RRF_K = 60
USER_LINE_WEIGHT = 2.0
EXPANSION_LINE_WEIGHT = 1.0
FIRST_PLACE_BONUS = 0.05
PODIUM_BONUS = 0.02  # second or third place in some list
SNIPPET_MAX_CHARS = 500

Origin = Literal["user", "expansion", "query"]

_SEGMENT_RANGE = re.compile(r"(\S+)\s+to\s+(\S+)\s*$")


@dataclass(frozen=True)
class SearchLine:
    """One search that fed the fusion: a user line, an LLM expansion, or the plain query itself."""

    type: SearchType
    query: str
    origin: Origin
    weight: float
    line: int | None = None
    hits: int = 0

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class Hit:
    fact_id: int
    score: float


@dataclass
class Fused:
    fact_id: int
    score: float = 0.0
    best_rank: int = 1_000_000
    lex_score: float | None = None
    vec_score: float | None = None
    matched_by: list[str] = field(default_factory=list)


def fuse(lists: Sequence[tuple[SearchLine, Sequence[Hit]]]) -> list[Fused]:
    """Reciprocal-rank fusion: sum of weight / (k + rank) over the lists, plus a top-place bonus."""
    fused: dict[int, Fused] = {}
    for index, (line, hits) in enumerate(lists):
        label = f"{line.type}:{index + 1}"
        for rank, hit in enumerate(hits):
            entry = fused.setdefault(hit.fact_id, Fused(hit.fact_id))
            entry.score += line.weight / (RRF_K + rank + 1)
            entry.best_rank = min(entry.best_rank, rank)
            entry.matched_by.append(label)
            if line.type == "lex":
                entry.lex_score = max(entry.lex_score or 0.0, hit.score)
            else:
                entry.vec_score = max(entry.vec_score or 0.0, hit.score)
    for entry in fused.values():
        if entry.best_rank == 0:
            entry.score += FIRST_PLACE_BONUS
        elif entry.best_rank <= 2:
            entry.score += PODIUM_BONUS
    return sorted(fused.values(), key=lambda e: (-e.score, e.fact_id))


def segment_range(context: str) -> tuple[str | None, str | None]:
    """(start, end) of a "conversation segment START to END" context, else (None, None)."""
    match = _SEGMENT_RANGE.search(context)
    return (match.group(1), match.group(2)) if match else (None, None)


# Snippets score every line of a result's segment against every query and intent word, twice a result:
# a 2,000-character query of 660 short words and a 500-character intent cost 1.2 s of CPU a request at
# limit 100, after the search's own deadline. Past this many words, the first distinct content words
# are used (as an intent's are read: lowered, punctuation stripped from their ends, stop words dropped;
# short words and stop words took the places of the words that find the line).
MAX_SNIPPET_TERMS = 32


def bounded_terms(text: str | None) -> str | None:
    """``text`` as it is, or, past MAX_SNIPPET_TERMS words, its first distinct content words."""
    if text is None or len(text.split()) <= MAX_SNIPPET_TERMS:
        return text
    return " ".join(list(dict.fromkeys(extract_intent_terms(text)))[:MAX_SNIPPET_TERMS])


def best_chunk(lines: Sequence[str], own: int, query: str, intent: str | None) -> int:
    """The line of a result's segment that best answers the query, intent-weighted (own line on ties)."""
    best, best_score = own, score_chunk(lines[own], query, intent)
    for index, line in enumerate(lines):
        score = score_chunk(line, query, intent)
        if score > best_score:
            best, best_score = index, score
    return best


def segment_snippet(
    segment: Sequence[tuple[int, str]],
    own_row: int,
    query: str,
    intent: str | None,
    max_chars: int = SNIPPET_MAX_CHARS,
    *,
    first_line: int = 0,
    of_lines: int | None = None,
) -> SnippetResult:
    """The snippet of a result's segment ((row_num, fact) pairs, one fact a line) around its best line.
    ``segment`` may be a window of the whole: its first fact is the whole's line ``first_line + 1`` of
    ``of_lines``, and the snippet's line numbers count from the whole's start (qmd's rule)."""
    # A fact's own line breaks would shift the numbering, so they become spaces.
    lines = [" ".join(fact.split()) for _, fact in segment]
    own = next((i for i, (num, _) in enumerate(segment) if num == own_row), 0)
    chunk = best_chunk(lines, own, query, intent)
    # qmd's rule: the snippet's line is the best (by the snippet's weights) within 100 characters either
    # side of the chunk; here of whole lines, and shown whole (a window of characters began the line
    # before mid-word and cut the lines after, in every search result).
    starts = [0]
    for line in lines[:-1]:
        starts.append(starts[-1] + len(line) + 1)
    low = starts[chunk] - SNIPPET_CHUNK_CONTEXT_CHARS
    high = starts[chunk] + len(lines[chunk]) + SNIPPET_CHUNK_CONTEXT_CHARS
    near = [i for i, start in enumerate(starts) if start + len(lines[i]) >= low and start <= high]
    index, score = best_snippet_line(lines[near[0] : near[-1] + 1], query, intent)
    best = near[0] + index if score > 0 else chunk
    # A long fact before the best one would fill the snippet and push the best one out of it: then the
    # snippet begins at the best line.
    crowded = best > 0 and len(lines[best - 1]) + 1 + len(lines[best]) > max_chars - 3
    before = 0 if crowded else 1
    return snippet_around(lines, best, max_chars, line_offset=first_line, total_lines=of_lines, before=before)
