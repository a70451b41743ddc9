"""What a search is asked (filters, limits) and what it answers (results, outcome, embedding report)."""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field
from datetime import datetime
from typing import Annotated, Any, Literal

from pydantic import PlainSerializer

from models import FACT_KINDS
from worker.core.facts import entity_slug, no_entity_slug
from worker.core.fusion import SearchLine
from worker.core.moments import as_utc
from worker.search.errors import DeadlineExceededError, SearchError

# A search's database reads (the probe; then every line together): each statement is cut at the lexical
# limit too, but a document of 20 lex: lines of broad words ran 10 statements each, and held a
# connection and a thread for minutes (the per-minute rate limit does not bound searches running at
# once). The LLM calls have their own bound, below.
SEARCH_SECONDS = 15.0
# A search's LLM calls together (the expansion, the vec/hyde embeddings): each try's timeouts are cut to
# what is left and no retry starts after it. Bounded by the gateway alone (five tries of a minute, two
# minutes of backoff), a search ran on for minutes after its client (30 s) had given up and sent it
# again, holding one of its key's concurrent searches and paying for the calls twice.
SEARCH_LLM_SECONDS = 10.0


@dataclass(frozen=True)
class Deadline:
    """When one read's statements must have ended."""

    at: float

    @classmethod
    def after(cls, seconds: float | None = None) -> Deadline:
        return cls(time.monotonic() + (SEARCH_SECONDS if seconds is None else seconds))

    def remaining_ms(self) -> int:
        return max(1, int((self.at - time.monotonic()) * 1000))

    def expired(self, slack: float = 0.0) -> bool:
        return time.monotonic() >= self.at - slack

    def check(self) -> None:
        """DeadlineExceededError once the time is up (checked before each statement)."""
        if self.expired():
            raise self.passed()

    @staticmethod
    def passed() -> DeadlineExceededError:
        return DeadlineExceededError(
            f"the search ran past its {SEARCH_SECONDS:g} s limit; search fewer lines or rarer words"
        )


__all__ = [
    "DEFAULT_LIMIT",
    "HNSW_EF_SEARCH",
    "MAX_LIMIT",
    "MAX_QUERY_CHARS",
    "MIN_CANDIDATES",
    "SEARCH_SECONDS",
    "Deadline",
    "EmbedReport",
    "SearchFilters",
    "SearchOutcome",
    "SearchRequest",
    "SearchResult",
    "VectorSearchStatus",
    "VectorStatus",
]

DEFAULT_LIMIT = 10
MAX_LIMIT = 100
# Each list contributes this many candidates to fusion (at least), so a fact ranked low in one list
# and high in another can still surface.
MIN_CANDIDATES = 30
# hnsw.ef_search: how many candidates the HNSW scan keeps while it walks the graph (at least four per
# result wanted, at most pgvector's 1,000). bench/search.py on the simulator's vectors, shipped index
# (m 16, ef_construction 64): at 100k facts tie-aware recall@10 0.848 at 120 and 0.938 at 400 (p95 9 ->
# 20 ms); at 1M 0.828 at 400 (p95 30 ms, index in shared_buffers). Below the 0.95 goal: BENCHMARKS.md.
HNSW_EF_SEARCH = 400
MAX_QUERY_CHARS = 2000
MAX_INTENT_CHARS = 500  # a search's intent (held by the service; the API's and MCP's inputs say it)
# Search lines a query document may hold: each is one query on the facts (an index scan; 25 ms at p50,
# over 100 ms for a broad prefix, at a million facts), so 2,000 characters of "lex: a" lines asked for
# some 280 of them in one request. LLM expansion adds at most 6 (2 a type).
MAX_SEARCH_LINES = 20

VectorStatus = Literal["available", "unavailable"]


def _isoformat(moment: datetime | None) -> str | None:
    return moment.isoformat() if moment else None


# Python's isoformat ("+00:00"), in as_dict and in the HTTP answer alike (pydantic would write "Z").
IsoDatetime = Annotated[datetime | None, PlainSerializer(_isoformat, return_type=str | None)]


def _rounded(score: float | None) -> float | None:
    return None if score is None else round(score, 6)


@dataclass(frozen=True)
class SearchFilters:
    """Restrict results to one source, entity, kind, and/or facts valid (or written) since a moment."""

    source_id: str | None = None
    entity: str | None = None
    kind: str | None = None
    since: datetime | None = None
    # The sources a caller may see (a source-limited API key); None: every source.
    source_ids: tuple[str, ...] | None = None
    # Lifecycle: current facts only (the default), every fact of the chain, or those true at as_of.
    include_history: bool = False
    as_of: datetime | None = None

    def __post_init__(self) -> None:
        for name in ("since", "as_of"):  # a time naming no zone is UTC, whatever the server's zone
            moment = getattr(self, name)
            if moment is not None:
                object.__setattr__(self, name, as_utc(moment))
        if self.kind is not None and self.kind not in FACT_KINDS:
            raise SearchError(f"kind must be one of {', '.join(FACT_KINDS)}; got {self.kind!r}")
        if self.entity is not None:
            # Read with the rule facts are stored under: "People/Zoë Ångström" finds people/zoë-ångström.
            slug = entity_slug(self.entity)
            if slug is None:
                raise SearchError(no_entity_slug(self.entity))
            object.__setattr__(self, "entity", slug)


@dataclass(frozen=True)
class SearchRequest:
    """One search as asked: a plain query or a query document, with its intent, filters and limit."""

    query: str
    intent: str | None = None
    filters: SearchFilters = field(default_factory=SearchFilters)
    limit: int = DEFAULT_LIMIT
    expand: bool = True  # let the LLM expand a plain query


# The HTTP API's answer uses this class as its schema (worker.api.search_routes), hence IsoDatetime.
@dataclass(frozen=True)
class SearchResult:
    """A fact with its fused score, its provenance and a snippet of its conversation segment."""

    fact_id: int
    fact: str
    kind: str
    entity: str | None
    score: float
    lex_score: float | None
    vec_score: float | None
    source_id: str
    page_slug: str
    segment: str
    segment_start: str | None
    segment_end: str | None
    row_num: int
    confidence: float
    notability: str
    valid_from: IsoDatetime
    # Lifecycle: current | superseded | duplicate, when it stopped being true, and its links.
    status: str
    valid_to: IsoDatetime
    superseded_by: int | None
    duplicate_of: int | None
    snippet: str
    snippet_line: int
    matched_by: tuple[str, ...]

    def as_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out.update(
            score=round(self.score, 6),
            lex_score=_rounded(self.lex_score),
            vec_score=_rounded(self.vec_score),
            valid_from=_isoformat(self.valid_from),
            valid_to=_isoformat(self.valid_to),
            matched_by=list(self.matched_by),
        )
        return out


@dataclass(frozen=True)
class SearchOutcome:
    """What a search did and found."""

    query: str
    intent: str | None
    structured: bool
    expanded: bool
    strong_signal: bool
    vector_search: VectorStatus
    lines: tuple[SearchLine, ...]
    results: tuple[SearchResult, ...]
    took_ms: float
    notes: tuple[str, ...] = ()

    def as_dict(self) -> dict[str, Any]:
        plain = ("query", "intent", "structured", "expanded", "strong_signal", "vector_search")
        return {name: getattr(self, name) for name in plain} | {
            "searches": [line.as_dict() for line in self.lines],
            "results": [result.as_dict() for result in self.results],
            "took_ms": round(self.took_ms, 2),
            "notes": list(self.notes),
        }


@dataclass(frozen=True)
class VectorSearchStatus:
    available: bool
    extension_version: str | None
    reason: str | None


@dataclass
class EmbedReport:
    embedded: int = 0
    batches: int = 0
    skipped: int = 0
    vector_search: VectorStatus = "unavailable"
