"""Lexical search (Postgres full-text search): a lex line's words ranked BM25-like over the facts, rarest
words kept when no fact holds them all; and the filters every search list applies."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from sqlalchemy import text
from sqlalchemy.exc import DBAPIError
from sqlalchemy.orm import Session

from worker.consolidation.history import Lifecycle
from worker.core.fusion import Hit
from worker.core.lexing import (
    BM25_B,
    BM25_K1,
    CONTEXT_ONLY_WEIGHT,
    TYPICAL_FACT_LEXEMES,
    LexItem,
    LexUnit,
    idf,
    lex_items,
    lex_units,
    normalise_score,
    parse_lex_query,
    rarest_first,
    units_left_out,
)
from worker.db import statement_timed_out
from worker.search.errors import SearchError
from worker.search.values import Deadline, SearchFilters

__all__ = ["filter_sql", "lexical_search"]

# Document frequencies are counted exactly up to this many rows; above it the planner's estimate
# (from the column statistics) is used, so a very common term never costs a long count.
DF_EXACT_CAP = 1000
SMALL_TABLE_ROWS = 10_000
# Each statement of a lexical search stops after this (a search at a million facts takes tens of ms): a
# query that would score the whole table many times over is refused (400), not left to hold a
# connection and a core while the reader's next requests queue behind it.
LEX_STATEMENT_TIMEOUT = "5s"
_PARSE_ITEMS = text(
    "SELECT u.i, CASE WHEN u.k = 'w' "
    "THEN array_to_string(tsvector_to_array(to_tsvector('simple', search_words(u.t))), chr(31)) "
    "ELSE phraseto_tsquery('simple', search_words(u.t))::text END "
    "FROM unnest(CAST(:kinds AS text[]), CAST(:texts AS text[])) WITH ORDINALITY AS u(k, t, i) "
    "ORDER BY u.i"
)
# Columns named as SearchResult's fields.

# --------------------------------------------------------------------------- filters


# SearchFilters field -> its clause; the value is bound as :f_<field>.
_FILTER_CLAUSES = (
    ("source_id", "{a}.source_id = :f_source_id"),
    ("entity", "{a}.entity_slug = :f_entity"),
    ("kind", "{a}.kind = :f_kind"),
    ("since", "COALESCE({a}.valid_from, {a}.created_at) >= :f_since"),
    ("source_ids", "{a}.source_id = ANY(:f_source_ids)"),
)


def filter_sql(filters: SearchFilters, alias: str = "f") -> tuple[str, dict[str, Any]]:
    # Audit rows (the terminal EXTRACTION_COMPLETE markers) are bookkeeping: never a search result.
    clauses = [f"NOT {alias}.is_audit"]
    lifecycle, params = Lifecycle(filters.include_history, filters.as_of).clause(alias)
    if lifecycle is not None:
        clauses.append(lifecycle)
    for name, clause in _FILTER_CLAUSES:
        value = getattr(filters, name)
        if value is not None:
            clauses.append(clause.format(a=alias))
            params[f"f_{name}"] = list(value) if isinstance(value, tuple) else value
    return " AND ".join(clauses), params


# --------------------------------------------------------------------------- lexical search


def lexical_search(
    session: Session, query: str, filters: SearchFilters, limit: int, deadline: Deadline | None = None
) -> tuple[list[Hit], bool]:
    """Facts matching ``query``, best first, with scores in [0, 1), and whether they hold every word.

    Facts holding every word and phrase come first. When no fact holds them all, words no fact
    holds are dropped, then the most common word, then the next, until some fact matches (the
    rarer words say more); a dropped word still adds to the score of the facts that hold it.
    """
    if deadline is not None:
        deadline.check()
    items = lex_items(parse_lex_query(query))
    try:
        parsed = _parse_items(session, items) if items else []
        units, excluded = lex_units(items, parsed) if items else ([], [])
    except DBAPIError as exc:  # cut where an earlier line's statement_timeout left it: the time is up
        if deadline is not None and statement_timed_out(exc):
            raise deadline.passed() from exc
        raise
    if not units:
        return [], True
    # Each statement is cut at LEX_STATEMENT_TIMEOUT, or where the read's time ends if sooner (set again
    # before each ranking and count once that is nearer: _bound; a count of several statements gives
    # each the limit set before it, so a read may pass its time by up to one such limit).
    limit_ms = _ms(LEX_STATEMENT_TIMEOUT) if deadline is None else _limit_ms(deadline)
    # The planner prices a tsvector match like any operator and so prefers a sequential scan once a
    # term is in a few percent of the rows; the GIN bitmap scan is several times faster there.
    # Disabling a scan only adds a huge cost to it, and a statement that must scan anyway (counting a
    # small table's facts) then looks costly enough to JIT-compile: about 27 ms a search on a small
    # table, where the whole search takes 9. So JIT goes off with it.
    try:
        seqscan, jit, timeout = session.execute(
            text(
                "SELECT current_setting('enable_seqscan'), current_setting('jit'), "
                "current_setting('statement_timeout'), set_config('enable_seqscan', 'off', true), "
                "set_config('jit', 'off', true), set_config('statement_timeout', :limit, true)"
            ),
            {"limit": f"{limit_ms}ms"},
        ).one()[:3]
        hits = _ranked_matches(session, units, excluded, filters, limit, deadline)
        session.execute(
            text(
                "SELECT set_config('enable_seqscan', :seqscan, true), set_config('jit', :jit, true), "
                "set_config('statement_timeout', :timeout, true)"
            ),
            {"seqscan": seqscan, "jit": jit, "timeout": timeout},
        )
    except DBAPIError as exc:  # the transaction is aborted, and its local settings with it
        if statement_timed_out(exc) and deadline is not None and deadline.expired(slack=0.05):
            raise deadline.passed() from exc
        if statement_timed_out(exc):
            raise SearchError(
                f"the lexical search ran past its {LEX_STATEMENT_TIMEOUT} limit; search for fewer or "
                "rarer words"
            ) from exc
        raise
    found, complete = hits
    # Words the line's cap left out were never searched: no clear answer to it (no strong signal).
    return found, complete and not units_left_out(items, parsed, units)


def _parse_items(session: Session, items: Sequence[LexItem]) -> list[str | None]:
    """Each item through Postgres's own parser and accent folding (so "v1.2" or "alice-smith" split,
    and "Zoë" folds, exactly as the indexed text did): a word's lexemes joined by chr(31), a phrase's
    tsquery text."""
    rows = session.execute(
        _PARSE_ITEMS, {"kinds": [item.kind for item in items], "texts": [item.text for item in items]}
    ).all()
    return [value for _, value in rows]


def _document_frequencies(
    session: Session, units: Sequence[LexUnit], source_ids: Sequence[str] | None = None
) -> tuple[list[float], float]:
    """(df of each unit, number of facts), within ``source_ids`` when the reader is limited to them.

    On a small table every df is counted. On a large one the planner's estimate (from the column
    statistics ANALYZE keeps) stands for common units, and only units it expects to be rare are
    counted, so a common word never costs a long count. A reader limited to some sources gets counts
    of their facts only: counted table-wide, its scores told it how many of another source's facts
    held a word (exactly, up to a thousand), and when they gained one.
    """
    scope, params = (
        ("", {}) if source_ids is None else (" AND source_id = ANY(:sources)", {"sources": list(source_ids)})
    )
    estimated_rows = float(
        session.scalar(text("SELECT reltuples FROM pg_class WHERE oid = 'facts'::regclass")) or -1
    )
    small = estimated_rows < SMALL_TABLE_ROWS
    if small:
        total = float(
            session.scalar(text(f"SELECT count(*) FROM facts WHERE NOT is_audit{scope}"), params) or 0
        )
    elif source_ids is not None:
        total = _estimated_rows(session, f"SELECT 1 FROM facts WHERE NOT is_audit{scope}", params)
    else:
        total = estimated_rows
    dfs: list[float] = []
    to_count: list[int] = []
    for i, unit in enumerate(units):
        if small:
            dfs.append(0.0)
            to_count.append(i)
            continue
        estimate = _estimated_rows(
            session,
            f"SELECT 1 FROM facts WHERE search_vector @@ CAST(:q AS tsquery){scope}",
            params | {"q": unit.match},
        )
        dfs.append(estimate)
        if estimate <= DF_EXACT_CAP:
            to_count.append(i)
    if to_count:
        cap = SMALL_TABLE_ROWS if small else DF_EXACT_CAP  # a small table's counts are all exact
        parts = [
            f"(SELECT count(*) FROM (SELECT 1 FROM facts WHERE search_vector @@ CAST(:q{i} AS tsquery) "
            f"AND NOT is_audit{scope} LIMIT {cap}) s{i})"
            for i in to_count
        ]
        counts = session.execute(
            text(f"SELECT {', '.join(parts)}"), params | {f"q{i}": units[i].match for i in to_count}
        ).one()
        for i, count in zip(to_count, counts, strict=True):
            dfs[i] = float(count) if count < cap else max(float(count), dfs[i])
    return dfs, max(total, max(dfs, default=0.0), 1.0)


def _estimated_rows(session: Session, query: str, params: dict[str, Any]) -> float:
    """The planner's estimate of the rows ``query`` returns (EXPLAIN; nothing is run)."""
    plan = session.execute(text(f"EXPLAIN (FORMAT JSON) {query}"), params).scalar_one()
    return float(plan[0]["Plan"]["Plan Rows"]) if isinstance(plan, list) else 0.0


def _visible_units(
    session: Session, units: Sequence[LexUnit], where: str, params: dict[str, Any]
) -> list[bool]:
    """Whether each unit is in some fact the search's filters let through (one query: an EXISTS each)."""
    if not units:
        return []
    parts = [
        f"EXISTS (SELECT 1 FROM facts f WHERE f.search_vector @@ CAST(:seen{i} AS tsquery) AND {where})"
        for i in range(len(units))
    ]
    row = session.execute(
        text(f"SELECT {', '.join(parts)}"), params | {f"seen{i}": unit.match for i, unit in enumerate(units)}
    ).one()
    return [bool(value) for value in row]


def _f8(value: float) -> str:
    return f"CAST({float(value)!r} AS float8)"


def _ranking_statements(
    units: Sequence[LexUnit], dfs: Sequence[float], total: float, where: str, params: dict[str, Any]
) -> tuple[Any, Any]:
    """(the ranked query through the index, the one a rare word drives), their unit parameters added to
    ``params``: each unit's idf-weighted match, exact words over prefixes, with BM25's length norm."""
    terms = []
    for i, unit in enumerate(units):
        params[f"strong{i}"] = unit.strong
        params[f"match{i}"] = unit.match
        params[f"idf{i}"] = idf(dfs[i], total)
        terms.append(
            f"(CAST(:idf{i} AS float8) * CASE WHEN f.search_vector @@ CAST(:strong{i} AS tsquery) "
            f"THEN {_f8(1.0)} WHEN f.search_vector @@ CAST(:match{i} AS tsquery) "
            f"THEN {_f8(CONTEXT_ONLY_WEIGHT)} ELSE {_f8(0.0)} END)"
        )
    length_norm = (
        f"({_f8(BM25_K1 + 1)} / ({_f8(1.0)} + {_f8(BM25_K1)} * ({_f8(1.0 - BM25_B)} + {_f8(BM25_B)} * "
        f"length(f.search_vector) / {_f8(TYPICAL_FACT_LEXEMES)})))"
    )
    scored = f"SELECT f.id, ({' + '.join(terms)}) * {length_norm} AS raw"
    ranking = "ORDER BY raw DESC, f.id LIMIT :limit"
    indexed = text(
        f"{scored} FROM facts f WHERE f.search_vector @@ CAST(:match AS tsquery) AND {where} {ranking}"
    )
    # A rare word drives: its few facts come through the index and the other words are checked on
    # each, instead of the index intersecting the common words' long posting lists (GIN merges a
    # prefix's lists in full: its fast scan skips only exact entries).
    driven = text(
        f"WITH driving AS MATERIALIZED (SELECT f.id, f.search_vector FROM facts f "
        f"WHERE f.search_vector @@ CAST(:drive AS tsquery) AND {where}) "
        f"{scored} FROM driving f WHERE f.search_vector @@ CAST(:match AS tsquery) {ranking}"
    )
    return indexed, driven


def _ms(duration: str) -> int:
    """A Postgres duration of LEX_STATEMENT_TIMEOUT's form ("5s", "50ms") in milliseconds."""
    return int(duration[:-2]) if duration.endswith("ms") else int(float(duration[:-1]) * 1000)


def _limit_ms(deadline: Deadline) -> int:
    return min(_ms(LEX_STATEMENT_TIMEOUT), deadline.remaining_ms())


def _bound(session: Session, deadline: Deadline | None) -> None:
    """Before a statement: the read's time is not up, and the statement stops where it ends when that
    is nearer than LEX_STATEMENT_TIMEOUT (a round trip only then)."""
    if deadline is None:
        return
    deadline.check()
    limit_ms = _limit_ms(deadline)
    if limit_ms < _ms(LEX_STATEMENT_TIMEOUT):
        session.execute(text("SELECT set_config('statement_timeout', :t, true)"), {"t": f"{limit_ms}ms"})


def _exact_first(exact_rows: list[Any], rows: list[Any], limit: int) -> list[Any]:
    """Facts holding the words themselves, then those holding only longer words they begin. Replaced by
    the prefix ranking when they did not fill the list, a list of more results lost the exact ones a list
    of fewer had ("meet": the top ten of twenty were the meetings, of ten the meeting of Grace)."""
    if not exact_rows:
        return rows
    first = {row[0] for row in exact_rows}
    return (exact_rows + [row for row in rows if row[0] not in first])[:limit]


def _ranked_matches(
    session: Session,
    units: list[LexUnit],
    excluded: list[str],
    filters: SearchFilters,
    limit: int,
    deadline: Deadline | None = None,
) -> tuple[list[Hit], bool]:
    """The ranked search of ``lexical_search``, exact words first.

    Facts holding the exact words are ranked first; only when they do not fill ``limit`` does the search
    widen to prefixes ("meet" finds "meetings"). Scores are the same either way (a prefix still counts
    in the score), so the exact pass answers the prefix search's ranking less the facts that hold only
    a longer word. A broad prefix (in a million facts, one word's prefix matched 59,196 of them) is
    then ranked only when the exact word is too rare to fill the list.
    """
    _bound(session, deadline)
    dfs, total = _document_frequencies(session, units, filters.source_ids)
    where, params = filter_sql(filters)
    params["limit"] = limit
    indexed, driven = _ranking_statements(units, dfs, total, where, params)
    negation = "".join(f" & {x}" for x in excluded)
    order = rarest_first(dfs)

    def ranked(kept: list[int], exact: bool) -> list[Any]:
        _bound(session, deadline)
        matches = {i: units[i].exact if exact and units[i].exact else units[i].match for i in kept}
        match = " & ".join(matches.values()) + negation
        rarest = min(kept, key=lambda i: dfs[i])
        if len(kept) > 1 and dfs[rarest] < DF_EXACT_CAP:  # counted: at most DF_EXACT_CAP facts
            return list(session.execute(driven, params | {"match": match, "drive": matches[rarest]}))
        return list(session.execute(indexed, params | {"match": match}))

    def answer(keep: int, prefix_rows: list[Any] | None = None) -> tuple[list[Any], bool]:
        """The rows of the rarest ``keep`` units, exact words first (_exact_first), and whether some
        fact holds the words themselves (not only longer words they begin)."""
        kept = sorted(order[:keep])
        exact_found = True
        exact_rows: list[Any] = []
        if any(units[i].exact for i in kept):
            exact_rows = ranked(kept, exact=True)
            if len(exact_rows) >= limit:
                return exact_rows, True
            exact_found = bool(exact_rows)
        rows = prefix_rows if prefix_rows is not None else ranked(kept, exact=False)
        return _exact_first(exact_rows, rows, limit), exact_found

    # A unit no fact holds (df 0, counted) matches nothing with any others: they go first, all at once.
    present = sum(df > 0 for df in dfs)
    rows, exact_found = answer(present) if present else ([], False)
    if rows or present == 0:
        # Complete: every word found as itself. "cat" found only in "category" is no clear answer, and
        # skipping the expansion for it (a strong signal) left a word never found at that.
        complete = bool(rows) and present == len(units) and exact_found
        return [Hit(row[0], normalise_score(row[1])) for row in rows], complete
    # Nothing holds them all: from here on only the units some fact the caller may see holds, under
    # its filters (source, lifecycle, as_of, entity...). By the table-wide counts a word found only in
    # superseded facts, or only in another source, counted as present; halving kept it (the rarest) in
    # every try and the answer was empty, while a word found nowhere was dropped: an empty answer told
    # a key limited to one source that the word was in another's facts.
    _bound(session, deadline)
    visible = _visible_units(session, units, where, params)
    order = [i for i in order if visible[i]]
    tried_all = len(order) == present  # the first try held every visible unit (no hidden one)
    present = len(order)
    if present <= 1:
        rows = answer(present)[0] if present else []
        return [Hit(row[0], normalise_score(row[1])) for row in rows], False
    # Dropping a unit only widens the match, so the most units that still match are found by halving:
    # a line of hundreds of words costs a few queries, not one (or two) a word.
    keep, found, low, high = 0, [], 1, present - 1 if tried_all else present
    while low <= high:
        middle = (low + high) // 2
        middle_rows = ranked(sorted(order[:middle]), exact=False)
        if middle_rows:
            keep, found, low = middle, middle_rows, middle + 1
        else:
            high = middle - 1
    rows = answer(keep, found)[0] if keep else []
    return [Hit(row[0], normalise_score(row[1])) for row in rows], False
