"""Search query text: lex lines into tsquery texts, BM25-style idf and normalisation, expansion replies."""

from __future__ import annotations

import itertools
import math
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal, cast

from worker.core.folding import UNSPACED_PIECE, UNSPACED_RUN, fold_accents, has_unspaced_script
from worker.core.intent import SearchType, is_query_word, plain_query_text, search_type

__all__ = [
    "BM25_B",
    "BM25_K1",
    "CONTEXT_ONLY_WEIGHT",
    "EXPANSION_MAX_LINES_PER_TYPE",
    "EXPANSION_MAX_LINE_CHARS",
    "MIN_PREFIX_CHARS",
    "TYPICAL_FACT_LEXEMES",
    "LexItem",
    "LexQuery",
    "LexUnit",
    "idf",
    "lex_items",
    "lex_units",
    "normalise_score",
    "parse_expansion",
    "parse_lex_query",
    "plain_text",
    "rarest_first",
    "restrict_weights",
    "snippet_words",
    "units_left_out",
]

# BM25-style lexical scoring.
BM25_K1 = 1.2
BM25_B = 0.75
# Lexemes in a typical fact row (fact + entity + segment context); the length normalisation's pivot.
TYPICAL_FACT_LEXEMES = 20
CONTEXT_ONLY_WEIGHT = 0.5
MIN_PREFIX_CHARS = 3

EXPANSION_MAX_LINES_PER_TYPE = 2
EXPANSION_MAX_LINE_CHARS = 300

_LEX_TOKEN = re.compile(r'(-?)"([^"]*)"|(\S+)')
_TSQUERY_LEXEME = re.compile(r"'((?:[^'\\]|''|\\.)*)'")
# The body is stripped where it is read: a lazy body before `\s*$` tried every space of a long run in
# the middle of a line up to its end (quadratic in the model's reply).
_EXPANSION_LINE = re.compile(r"^\s*(?:[-*]\s*)?(lex|vec|hyde)\s*:\s*(.+)$", re.IGNORECASE)


@dataclass(frozen=True)
class LexQuery:
    terms: tuple[str, ...]  # plain words, each ANDed (prefix match)
    phrases: tuple[str, ...]  # quoted phrases, matched in order
    excluded: tuple[str, ...]  # -word / -"phrase"
    # All of them as written, each as (kind, text): "w" word, "p" phrase, "x" excluded (lex_items).
    written: tuple[tuple[str, str], ...] = field(default=(), compare=False)

    @property
    def search_key(self) -> tuple[frozenset[str], ...]:
        """What the search matches on: its words ANDed in any order, any case (an expansion that wrote
        the user's words in another order ran the same search again, weighing its hits twice)."""
        return tuple(
            frozenset(part.casefold() for part in parts)
            for parts in (self.terms, self.phrases, self.excluded)
        )


def parse_lex_query(query: str) -> LexQuery:
    """Split a lex line into words, "quoted phrases" and -exclusions; stop words and one-letter words
    drop out of the plain words (unless nothing else is left; see ``is_query_word``)."""
    written: list[tuple[str, str]] = []
    later: list[tuple[str, str]] = []
    for match in _LEX_TOKEN.finditer(query):
        negated, phrase, word = match.group(1), match.group(2), match.group(3)
        if phrase is not None:
            if phrase.strip():
                written.append(("x" if negated else "p", phrase.strip()))
        elif word.startswith("-") and len(word) > 1:
            written.append(("x", word[1:]))
        elif has_unspaced_script(folded := fold_accents(word)):
            in_place, deferred = _unspaced_units(folded)
            written += in_place
            later += deferred
        elif word.upper() != "AND":
            written.append(("w", word))
    written += later
    phrases = [text for kind, text in written if kind == "p"]
    content = [(kind, t) for kind, t in written if kind != "w" or _content_word(t)]
    # A query made only of stop words still searches for them; beside a phrase they are dropped (`where
    # is "Priya"` required "where" and "is" too, and the rarest-first fallback then kept them over Priya).
    if not any(kind == "w" for kind, _ in content) and not phrases:
        content = written
    return LexQuery(
        tuple(t for kind, t in content if kind == "w"),
        tuple(phrases),
        tuple(t for kind, t in written if kind == "x"),
        tuple(content),
    )


# Pairs of a stretch searched in the order written; its later ones go after the rest of the line's
# units, which a long question typed without spaces crowded out of MAX_LEX_UNITS (a name after it).
PAIRS_IN_PLACE = 8


def _stretches(word: str) -> list[list[str]]:
    """A word's stretches between punctuation, each as its pieces (UNSPACED_PIECE): "5月3日" is one
    stretch [5, 月, 3, 日]; "iPhone,苹果" two, [iPhone] and [苹, 果]; "「", "、" none."""
    stretches: list[list[str]] = []
    end = -1
    for piece in UNSPACED_PIECE.finditer(word):
        if piece.start() != end:
            stretches.append([])
        stretches[-1].append(piece.group())
        end = piece.end()
    return stretches


def _unspaced_units(word: str) -> tuple[list[tuple[str, str]], list[tuple[str, str]]]:
    """A word holding characters of a script written without spaces (worker.core.folding), as the units
    it is searched by, (in place, after the rest): a stretch of it holding such characters as the
    overlapping pairs of its pieces, each a phrase ("东京大学": 东京, 京大, 大学; "5月3日": 5月, 月3, 3日, so
    it is not 3月5日; "B站" whole; one piece alone is itself), so "东京" is found inside "李雷住在东京。" and
    a question typed without spaces finds the facts holding most of its pairs (the rarest-first
    fallback drops the pairs no fact holds); a stretch without any is a word ("iPhone,苹果": iphone,
    苹果)."""
    in_place: list[tuple[str, str]] = []
    later: list[tuple[str, str]] = []
    for pieces in _stretches(word):
        if not any(UNSPACED_RUN.fullmatch(piece) for piece in pieces):
            in_place.append(("w", "".join(pieces)))
            continue
        pairs = [("p", a + b) for a, b in itertools.pairwise(pieces)] or [("p", pieces[0])]
        room = max(0, PAIRS_IN_PLACE - sum(kind == "p" for kind, _ in in_place))  # (over the whole word)
        in_place += pairs[:room]
        later += pairs[room:]
    return in_place, later


def _content_word(word: str) -> bool:
    return is_query_word(_bare(word))


def snippet_words(query: str) -> str:
    """What a snippet looks for in a lex line: its words and its phrases' words, without the quote
    marks, and not what it excludes (split on spaces as written, '"project' and 'apollo"' matched no
    line, and '-budget' drew the snippet to the very line excluded)."""
    words: list[str] = []
    for match in _LEX_TOKEN.finditer(query):
        negated, phrase, word = match.group(1), match.group(2), match.group(3)
        if phrase is not None:
            if not negated and phrase.strip():
                words.append(phrase.strip())
        elif not (word.startswith("-") and len(word) > 1) and word != "AND" and word.strip('"'):
            # Stop words too: qmd's snippet terms are every word of the query. A quote left open is
            # read by the search as no quote at all. A word of an unspaced script: the units the search
            # reads it by ("iPhone,苹果" is on no line; "苹果" is, and a question's pairs on the best).
            bare = word.strip('"')
            if has_unspaced_script(folded := fold_accents(bare)):
                words += [text for units in _unspaced_units(folded) for _, text in units]
            else:
                words.append(bare)
    return " ".join(words)


def plain_text(query: str) -> str:
    """A plain query's words, one space apart; a single "expand: ..." line is a plain query spelled out
    (the structured-query parser returns None for it). Trimmed by the parser's rule (plain_query_text)."""
    return " ".join((plain_query_text(query) or "").split())


def _bare(word: str) -> str:
    """The word lowered, without the non-word characters (re's \\W) at either end. A loop, not the
    regex ``^\\W+|\\W+$``: that retries its tail match at every position of a run of punctuation, so
    a 2,000-character word of it took 0.15 s a call (and every search calls this per word)."""
    word = word.lower()  # first: lowering can end a word in a mark ("İ" is "i" and U+0307)
    start, end = 0, len(word)
    while start < end and not _is_word_char(word[start]):
        start += 1
    while end > start and not _is_word_char(word[end - 1]):
        end -= 1
    return word[start:end]


def _is_word_char(char: str) -> bool:
    return char.isalnum() or char == "_"  # re's \w on str (its documented definition)


def _quote_lexeme(lexeme: str) -> str:
    return "'" + lexeme.replace("\\", "\\\\").replace("'", "''") + "'"


def restrict_weights(tsquery_text: str, weights: str) -> str:
    """The tsquery text with every lexeme restricted to the given weights (e.g. 'AB')."""
    return _TSQUERY_LEXEME.sub(lambda m: f"{m.group(0)}:{weights}", tsquery_text)


LexKind = Literal["w", "p", "x"]  # word, phrase, excluded


@dataclass(frozen=True)
class LexItem:
    """One piece of a lex line for Postgres's parser: a word (its lexemes are wanted) or a phrase or
    an exclusion (its tsquery text is wanted)."""

    kind: LexKind
    text: str


@dataclass(frozen=True)
class LexUnit:
    """One word or phrase of a lex line as tsquery texts. A word of MIN_PREFIX_CHARS or more also
    matches as a prefix ("meet" finds "meetings"); ``exact`` is its match without the prefixes, tried
    first (worker.search.store._ranked_matches)."""

    match: str  # tsquery text matching the unit anywhere
    strong: str  # the same, restricted to the fact text and the entity (weights A, B)
    exact: str = ""  # ``match`` without prefix matching ("" when the two are the same)


def lex_items(lex: LexQuery) -> list[LexItem]:
    """Its words, phrases and exclusions in the order written (the first MAX_LEX_UNITS are searched:
    words first, a phrase written before them was left out), in the order ``lex_units`` expects their
    parses. A LexQuery built by hand, with no written order: words, then phrases, then exclusions."""
    if lex.written:
        return [LexItem(cast(LexKind, kind), text) for kind, text in lex.written]
    return (
        [LexItem("w", t) for t in lex.terms]
        + [LexItem("p", p) for p in lex.phrases]
        + [LexItem("x", x) for x in lex.excluded]
    )


def units_left_out(items: Sequence[LexItem], parsed: Sequence[str | None], units: Sequence[LexUnit]) -> bool:
    """Whether ``lex_units`` left searchable words or phrases out (past MAX_LEX_UNITS): a list that
    holds the units searched is no complete answer to the line."""
    return len({(i.kind, v) for i, v in zip(items, parsed, strict=True) if v and i.kind != "x"}) > len(units)


# Words and phrases of one lex line that are searched (the first ones, repeats counted once) and
# exclusions kept. Each unit costs a frequency count and a test on every fact a match holds: a line of
# 500 copies of "seg" (a prefix of a word every fact's context holds) scored the whole table 1,000 times.
MAX_LEX_UNITS = 32


def lex_units(items: Sequence[LexItem], parsed: Sequence[str | None]) -> tuple[list[LexUnit], list[str]]:
    """(units to match, negated tsquery texts) from each item's parse by Postgres: a word's lexemes
    joined by chr(31), a phrase's or an exclusion's tsquery text (empty: nothing searchable). A repeat
    counts once; past MAX_LEX_UNITS of either, the rest are left out."""
    units: list[LexUnit] = []
    excluded: list[str] = []
    seen: set[tuple[str, str]] = set()
    for item, value in zip(items, parsed, strict=True):
        if not value:
            continue  # nothing searchable in it (punctuation only)
        full = len(excluded if item.kind == "x" else units) >= MAX_LEX_UNITS
        if full or (item.kind, value) in seen:
            continue
        seen.add((item.kind, value))
        if item.kind == "w":
            # A word Postgres splits ("priya's": priya, s) keeps its pieces of two or more characters: a
            # required "s" matched only possessives, and the unit could not drop it alone.
            pieces = value.split("\x1f")
            pieces = [x for x in pieces if len(x) > 1] or pieces
            # Prefix matching ("meet" finds "meetings") only for words long enough to mean something.
            lexemes = [(_quote_lexeme(x), len(x) >= MIN_PREFIX_CHARS) for x in pieces]
            match = " & ".join(f"{x}:*" if prefix else x for x, prefix in lexemes)
            strong = " & ".join(f"{x}:*AB" if prefix else f"{x}:AB" for x, prefix in lexemes)
            if any(prefix for _, prefix in lexemes):
                exact = " & ".join(x for x, _ in lexemes)
                units.append(LexUnit(f"({match})", f"({strong})", f"({exact})"))
            else:
                units.append(LexUnit(f"({match})", f"({strong})"))
        elif item.kind == "p":
            units.append(LexUnit(f"({value})", f"({restrict_weights(value, 'AB')})"))
        else:
            excluded.append(f"!({value})")
    return units, excluded


def rarest_first(dfs: Sequence[float]) -> list[int]:
    """Unit indexes, the rarest first and words no fact holds last: a match keeps a prefix of this
    list, so it drops the absent words first, then the most common (the rarer words say more)."""
    return sorted(range(len(dfs)), key=lambda i: (dfs[i] == 0, dfs[i], i))


def idf(df: float, total: float) -> float:
    return math.log(1.0 + (total - df + 0.5) / (df + 0.5))


def normalise_score(raw: float) -> float:
    """|x| / (1 + |x|): any raw score into [0, 1), order kept."""
    magnitude = abs(raw)
    return magnitude / (1.0 + magnitude)


def parse_expansion(reply: str, query: str) -> list[tuple[SearchType, str]]:
    """The usable lex/vec/hyde lines of an expansion reply: at most two of each type, no repeats of
    the query, anything else ignored."""
    seen = {("lex", query.strip().lower()), ("vec", query.strip().lower())}
    per_type: dict[str, int] = {}
    lines: list[tuple[SearchType, str]] = []
    for raw in reply.splitlines():
        match = _EXPANSION_LINE.match(raw)
        if not match:
            continue
        kind = match.group(1).lower()
        body = match.group(2).strip().strip('"').strip()[:EXPANSION_MAX_LINE_CHARS]
        key = (kind, body.lower())
        if not body or key in seen or per_type.get(kind, 0) >= EXPANSION_MAX_LINES_PER_TYPE:
            continue
        seen.add(key)
        per_type[kind] = per_type.get(kind, 0) + 1
        lines.append((search_type(kind), body))
    return lines
