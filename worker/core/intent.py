"""Intent terms, intent-weighted snippets and chunk scoring, strong signal, structured query documents."""

from __future__ import annotations

import re
import unicodedata
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from worker.core.folding import fold_accents

__all__ = [
    "CHUNK_SIZE_CHARS",
    "INTENT_STOP_WORDS",
    "INTENT_WEIGHT_CHUNK",
    "INTENT_WEIGHT_SNIPPET",
    "SNIPPET_CHUNK_CONTEXT_CHARS",
    "STRONG_SIGNAL_MIN_GAP",
    "STRONG_SIGNAL_MIN_SCORE",
    "QueryParseError",
    "SearchType",
    "SnippetResult",
    "StructuredQuery",
    "TypedSearch",
    "best_snippet_line",
    "extract_intent_terms",
    "extract_snippet",
    "has_strong_signal",
    "is_query_word",
    "parse_structured_query",
    "score_chunk",
    "search_type",
    "snippet_around",
]

INTENT_WEIGHT_SNIPPET = 0.3
INTENT_WEIGHT_CHUNK = 0.5
STRONG_SIGNAL_MIN_SCORE = 0.85
STRONG_SIGNAL_MIN_GAP = 0.15

# Default length of the chunk a vector hit points at, when the caller does not say.
CHUNK_SIZE_CHARS = 3600
# How far the snippet search reaches either side of a chunk.
SNIPPET_CHUNK_CONTEXT_CHARS = 100

# qmd's fixed English stop list (75 words). It holds only function words and search
# noise, so short domain terms such as "api", "sql", "ci" and "db" survive.
INTENT_STOP_WORDS: frozenset[str] = frozenset(
    {
        # 2-character function words
        "am", "an", "as", "at", "be", "by", "do", "he", "if",
        "in", "is", "it", "me", "my", "no", "of", "on", "or", "so",
        "to", "up", "us", "we",
        # 3-character function words
        "all", "and", "any", "are", "but", "can", "did", "for", "get",
        "has", "her", "him", "his", "how", "its", "let", "may", "not",
        "our", "out", "the", "too", "was", "who", "why", "you",
        # 4+ character common words
        "also", "does", "find", "from", "have", "into", "more", "need",
        "show", "some", "tell", "that", "them", "this", "want", "what",
        "when", "will", "with", "your",
        # search-context noise
        "about", "looking", "notes", "search", "where", "which",
    }
)  # fmt: skip

SearchType = Literal["lex", "vec", "hyde"]


def is_query_word(word: str) -> bool:
    """Whether a lower-cased word (its edge punctuation gone) is worth matching in a query: not empty,
    not a stop word, and of two or more characters unless it is no ASCII letter. A lone ideograph is a
    word (Chinese writes many with one), and so is a digit: dropped, "room 7" searched any room and
    called the answer complete, and the gate lost the "4" of a question's "gpt-4"."""
    if not word or word in INTENT_STOP_WORDS:
        return False
    return len(word) > 1 or not (word.isascii() and word.isalpha())


# --------------------------------------------------------------------------- intent terms


def _is_letter_or_number(char: str) -> bool:
    # Unicode general category L* or N*, the same class as the regex \p{L}\p{N}.
    return unicodedata.category(char)[0] in ("L", "N")


def _strip_edges(term: str) -> str:
    start, end = 0, len(term)
    while start < end and not _is_letter_or_number(term[start]):
        start += 1
    while end > start and not _is_letter_or_number(term[end - 1]):
        end -= 1
    return term[start:end]


def extract_intent_terms(text: str) -> list[str]:
    """Meaningful lower-case terms of an intent, in order, duplicates kept.

    Splits on whitespace, strips characters that are neither letters nor digits from
    each end of a term (so internal hyphens, dots, apostrophes and underscores stay),
    and drops one-character terms and stop words.
    """
    terms: list[str] = []
    for raw in text.lower().split():
        term = _strip_edges(raw)
        if len(term) > 1 and term not in INTENT_STOP_WORDS:
            terms.append(term)
    return terms


# --------------------------------------------------------------------------- snippets


@dataclass(frozen=True, slots=True)
class SnippetResult:
    """A few lines of a body around its best-matching line, with a diff-style header.

    ``line`` is the 1-based number of the best line; ``snippet`` is the header
    ``@@ -<start>,<count> @@ (<before> before, <after> after)`` followed by the lines.
    """

    line: int
    snippet: str
    lines_before: int
    lines_after: int
    snippet_lines: int


def _query_terms(query: str) -> list[str]:
    return query.lower().split()


def _best_line(lines: list[str], query_terms: list[str], intent_terms: list[str]) -> tuple[int, float]:
    # Accents folded on both sides, as lexical search matches (so "zoe" finds the line of Zoë); a
    # departure from qmd, which compared them as written, that changes nothing for ASCII text.
    query_terms = [fold_accents(term) for term in query_terms]
    intent_terms = [fold_accents(term) for term in intent_terms]
    best_index, best_score = 0, -1.0
    for index, line in enumerate(lines):
        lowered = fold_accents(line.lower())
        score = 0.0
        for term in query_terms:
            if term in lowered:
                score += 1.0
        for term in intent_terms:
            if term in lowered:
                score += INTENT_WEIGHT_SNIPPET
        # Strictly greater: ties go to the earliest line.
        if score > best_score:
            best_index, best_score = index, score
    return best_index, best_score


def best_snippet_line(lines: Sequence[str], query: str, intent: str | None = None) -> tuple[int, float]:
    """(index, score) of the line of ``lines`` a snippet centres on: 1 per query term, the intent's
    terms ``INTENT_WEIGHT_SNIPPET`` each, the first on a tie."""
    return _best_line(list(lines), _query_terms(query), extract_intent_terms(intent) if intent else [])


def _split_lines(text: str) -> list[str]:
    # Only "\n" ends a line (str.splitlines would also split on \v, \x1c, \u2028, ...,
    # and shift line numbers); a CRLF body keeps its numbering and loses the "\r".
    return [line.removesuffix("\r") for line in text.split("\n")]


def extract_snippet(
    body: str,
    query: str,
    max_len: int = 500,
    chunk_pos: int | None = None,
    chunk_len: int | None = None,
    intent: str | None = None,
) -> SnippetResult:
    """The snippet of ``body`` that best answers ``query``, nudged toward ``intent``.

    Each line scores 1 per query term (the query lower-cased and split on whitespace,
    matched as substrings) and ``INTENT_WEIGHT_SNIPPET`` per intent term; the best line
    (the first on a tie, the first line when nothing matches) is shown with one line
    before it and two after. ``chunk_pos`` (a character offset, e.g. from a vector hit)
    narrows the search to ``SNIPPET_CHUNK_CONTEXT_CHARS`` before the chunk through
    ``chunk_len`` (default ``CHUNK_SIZE_CHARS``) plus the same after; a negative
    ``chunk_pos`` is ignored. If nothing matches in that window, ``chunk_pos == 0``
    searches the whole body and any other position anchors on the line holding it.
    Line numbers always count from the start of the body, blank lines included.
    Snippet text longer than ``max_len`` is cut to ``max_len - 3`` characters plus "...".
    """
    total_lines = body.count("\n") + 1
    # A negative position means "no chunk", as it did in qmd.
    window_pos = chunk_pos if chunk_pos is not None and chunk_pos >= 0 else None
    search_body = body
    line_offset = 0
    context_start = 0

    if window_pos is not None:
        search_len = chunk_len or CHUNK_SIZE_CHARS
        context_start = max(0, window_pos - SNIPPET_CHUNK_CONTEXT_CHARS)
        context_end = min(len(body), window_pos + search_len + SNIPPET_CHUNK_CONTEXT_CHARS)
        search_body = body[context_start:context_end]
        line_offset = body.count("\n", 0, context_start)

    lines = _split_lines(search_body)
    intent_terms = extract_intent_terms(intent) if intent else []
    best_index, best_score = _best_line(lines, _query_terms(query), intent_terms)

    if window_pos is not None and best_score <= 0:
        if window_pos == 0:
            return extract_snippet(body, query, max_len, None, None, intent)
        # Nothing matched near the chunk: anchor on the line the chunk starts in.
        best_index = search_body.count("\n", 0, window_pos - context_start)

    # The anchored window can be blank (e.g. a position past the end of the body):
    # show the best of the whole body rather than an empty snippet.
    if window_pos and not "\n".join(lines[max(0, best_index - 1) : best_index + 3]).strip():
        return extract_snippet(body, query, max_len, None, None, intent)
    return snippet_around(lines, best_index, max_len, line_offset, total_lines)


def snippet_around(
    lines: Sequence[str],
    best_index: int,
    max_len: int = 500,
    line_offset: int = 0,
    total_lines: int | None = None,
    before: int = 1,
) -> SnippetResult:
    """The snippet of ``lines`` (of a body of ``total_lines``, the first of them its line
    ``line_offset + 1``) around its best line: ``before`` lines before it and two after, under the header."""
    total_lines = len(lines) if total_lines is None else total_lines
    start = max(0, best_index - before)
    shown = lines[start : best_index + 3]
    text = "\n".join(shown)
    if len(text) > max_len:
        text = text[: max(0, max_len - 3)] + "..."

    absolute_start = line_offset + start + 1
    count = len(shown)
    lines_before = absolute_start - 1
    lines_after = total_lines - (absolute_start + count - 1)
    header = f"@@ -{absolute_start},{count} @@ ({lines_before} before, {lines_after} after)"
    return SnippetResult(
        line=line_offset + best_index + 1,
        snippet=f"{header}\n{text}",
        lines_before=lines_before,
        lines_after=lines_after,
        snippet_lines=count,
    )


# --------------------------------------------------------------------------- chunk scoring


def score_chunk(chunk_text: str, query: str, intent: str | None = None) -> float:
    """Score a chunk for "best chunk per result": 1 per query term, ``INTENT_WEIGHT_CHUNK`` per intent term.

    Query terms are the lower-cased query split on whitespace, keeping terms longer
    than two characters; both kinds of term match as substrings, case-insensitively.
    """
    lowered = chunk_text.lower()
    query_score = sum(1.0 for term in _query_terms(query) if len(term) > 2 and term in lowered)
    intent_terms = extract_intent_terms(intent) if intent else []
    intent_score = sum(INTENT_WEIGHT_CHUNK for term in intent_terms if term in lowered)
    return query_score + intent_score


# --------------------------------------------------------------------------- strong signal


def has_strong_signal(top_score: float, second_score: float, intent: str | None = None) -> bool:
    """Whether the top lexical hit is clear enough to skip query expansion.

    True when the top score is at least ``STRONG_SIGNAL_MIN_SCORE`` and leads the second
    by at least ``STRONG_SIGNAL_MIN_GAP`` -- but never when an intent is given, because
    an intent says the plain lexical ranking is not what the user means.
    """
    if intent:
        return False
    return top_score >= STRONG_SIGNAL_MIN_SCORE and (top_score - second_score) >= STRONG_SIGNAL_MIN_GAP


# --------------------------------------------------------------------------- structured queries


class QueryParseError(ValueError):
    """A query document that cannot be run; the message says what to fix.

    ``line`` is the 1-based line (blank lines counted) the error is about, or ``None``
    when it is about the document as a whole.
    """

    def __init__(self, message: str, line: int | None = None) -> None:
        super().__init__(message)
        self.line = line


@dataclass(frozen=True, slots=True)
class TypedSearch:
    """One ``lex:``/``vec:``/``hyde:`` line of a query document."""

    type: SearchType
    query: str
    line: int


@dataclass(frozen=True, slots=True)
class StructuredQuery:
    """A parsed query document: its typed searches in order and its optional intent."""

    searches: tuple[TypedSearch, ...]
    intent: str | None = None


# ASCII-only case folding: under Unicode rules "İntent:" and "ıntent:" would pass for "intent:".
_TYPED_PREFIX = re.compile(r"^(lex|vec|hyde):\s*", re.IGNORECASE | re.ASCII)
_EXPAND_PREFIX = re.compile(r"^expand:\s*", re.IGNORECASE | re.ASCII)
_INTENT_PREFIX = re.compile(r"^intent:\s*", re.IGNORECASE | re.ASCII)
# A byte-order mark is trimmed like whitespace, so a document saved with one still parses. Every
# character `\s` matches (str.isspace: none is above U+3000), and str.strip: a pattern ending in `\s+$`
# tried each space of a long run in the middle of a line to its end (quadratic).
_EDGE_SPACE = "".join(c for c in map(chr, range(0x3001)) if c.isspace()) + "\ufeff"


def _trim(text: str) -> str:
    return text.strip(_EDGE_SPACE)


def plain_query_text(query: str) -> str | None:
    """What a plain query (``parse_structured_query`` returned None for it) asks, trimmed as the parser
    trims a line (byte-order mark included), without a single ``expand:`` line's prefix; None when
    nothing is left. One rule with the parser: trimmed apart, a document saved with a BOM kept
    "expand:" as a search word (and sent it to the model), and a BOM alone was a query that paid for
    an expansion and an embedding where blanks got a 400."""
    line = _trim(query)
    expand = _EXPAND_PREFIX.match(line)
    if expand is not None:
        line = _trim(line[expand.end() :])
    return line or None


def parse_structured_query(text: str) -> StructuredQuery | None:
    """Parse a query document of ``lex:``/``vec:``/``hyde:``/``intent:`` lines.

    Returns ``None`` for a plain query (a single untyped line, a single ``expand:`` line,
    or nothing but blank lines) and raises ``QueryParseError`` for a document that mixes
    forms, lacks text, repeats ``intent:``, or has an intent but no search.
    """
    numbered = [(number, _trim(raw)) for number, raw in enumerate(text.split("\n"), start=1)]
    lines = [(number, trimmed) for number, trimmed in numbered if trimmed]
    if not lines:
        return None

    searches: list[TypedSearch] = []
    intent: str | None = None

    for number, line in lines:
        expand = _EXPAND_PREFIX.match(line)
        if expand:
            if len(lines) > 1:
                raise QueryParseError(
                    f"Line {number} starts with expand:, but query documents cannot mix expand "
                    "with typed lines. Submit a single expand query instead.",
                    number,
                )
            if not _trim(line[expand.end() :]):
                raise QueryParseError("expand: query must include text.", number)
            return None

        intent_match = _INTENT_PREFIX.match(line)
        if intent_match:
            if intent is not None:
                raise QueryParseError(
                    f"Line {number}: only one intent: line is allowed per query document.", number
                )
            intent_text = _trim(line[intent_match.end() :])
            if not intent_text:
                raise QueryParseError(f"Line {number}: intent: must include text.", number)
            intent = intent_text
            continue

        typed = _TYPED_PREFIX.match(line)
        if typed:
            kind = search_type(typed.group(1))
            query = _trim(line[typed.end() :])
            if not query:
                raise QueryParseError(f"Line {number} ({kind}:) must include text.", number)
            # "\n" already split the lines, but a lone "\r" inside one is still a line break.
            if "\r" in query or "\n" in query:
                raise QueryParseError(
                    f"Line {number} ({kind}:) contains a newline. Keep each query on a single line.",
                    number,
                )
            searches.append(TypedSearch(type=kind, query=query, line=number))
            continue

        if len(lines) == 1:
            return None

        raise QueryParseError(
            f"Line {number} is missing a lex:/vec:/hyde:/intent: prefix. "
            "Each line in a query document must start with one.",
            number,
        )

    if intent is not None and not searches:
        raise QueryParseError("intent: cannot appear alone. Add at least one lex:, vec:, or hyde: line.")

    return StructuredQuery(searches=tuple(searches), intent=intent) if searches else None


_SEARCH_TYPES: dict[str, SearchType] = {"lex": "lex", "vec": "vec", "hyde": "hyde"}


def search_type(prefix: str) -> SearchType:
    """The search type a lex/vec/hyde prefix names (any case; anything else is hyde)."""
    return _SEARCH_TYPES.get(prefix.lower(), "hyde")
