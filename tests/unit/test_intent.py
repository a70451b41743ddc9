"""Pytest twins of seed 003 (qmd intent.test.ts) plus edge cases for worker.core.intent."""

from __future__ import annotations

import dataclasses
import re

import pytest

from worker.core.intent import (
    CHUNK_SIZE_CHARS,
    INTENT_STOP_WORDS,
    INTENT_WEIGHT_CHUNK,
    INTENT_WEIGHT_SNIPPET,
    SNIPPET_CHUNK_CONTEXT_CHARS,
    STRONG_SIGNAL_MIN_GAP,
    STRONG_SIGNAL_MIN_SCORE,
    QueryParseError,
    StructuredQuery,
    TypedSearch,
    extract_intent_terms,
    extract_snippet,
    has_strong_signal,
    parse_structured_query,
    score_chunk,
)


def _snippet_text(snippet: str) -> str:
    """The snippet without its `@@ ... @@` header line."""
    header, _, text = snippet.partition("\n")
    assert header.startswith("@@ -"), header
    return text


# =============================================================================
# Seed: describe("extractIntentTerms")
# =============================================================================


class TestExtractIntentTerms:
    def test_filters_stop_words(self) -> None:
        assert extract_intent_terms("looking for notes about latency optimization") == [
            "latency",
            "optimization",
        ]

    def test_filters_common_function_words(self) -> None:
        assert extract_intent_terms("what is the best way to find") == ["best", "way"]

    def test_preserves_domain_terms(self) -> None:
        assert extract_intent_terms("web performance latency page load times") == [
            "web",
            "performance",
            "latency",
            "page",
            "load",
            "times",
        ]

    def test_handles_surrounding_punctuation_with_unicode_awareness(self) -> None:
        assert extract_intent_terms("personal health, fitness, and endurance") == [
            "personal",
            "health",
            "fitness",
            "endurance",
        ]

    def test_preserves_internal_hyphens(self) -> None:
        assert extract_intent_terms("self-hosted real-time (decision-making)") == [
            "self-hosted",
            "real-time",
            "decision-making",
        ]

    def test_short_domain_terms_survive_api_sql_llm(self) -> None:
        assert extract_intent_terms("API design for LLM agents") == ["api", "design", "llm", "agents"]

    def test_returns_empty_for_empty_input(self) -> None:
        assert extract_intent_terms("") == []
        assert extract_intent_terms("  ") == []

    def test_filters_single_char_terms(self) -> None:
        assert extract_intent_terms("a b c web") == ["web"]

    def test_all_stop_words_returns_empty(self) -> None:
        assert extract_intent_terms("the and or but in on at to for of with by") == []

    def test_preserves_2_char_domain_terms_ci_cd_db(self) -> None:
        terms = extract_intent_terms("SQL CI CD DB")
        for term in ("sql", "ci", "cd", "db"):
            assert term in terms
        assert terms == ["sql", "ci", "cd", "db"]

    def test_lowercases_all_terms(self) -> None:
        terms = extract_intent_terms("WebSocket HTTP REST")
        for term in ("websocket", "http", "rest"):
            assert term in terms
        assert terms == ["websocket", "http", "rest"]

    def test_handles_c_plus_plus_style_punctuation(self) -> None:
        terms = extract_intent_terms("C++, performance! optimization.")
        assert "performance" in terms
        assert "optimization" in terms
        # "C++," strips to "c", a single character, so it is dropped.
        assert terms == ["performance", "optimization"]


# =============================================================================
# Seed: describe("extractSnippet with intent") — disambiguation
# =============================================================================

# Each section contains "performance", so query scores tie; intent terms break the tie.
SECTIONS_BODY = "\n".join(
    [
        "# Notes on Various Topics",
        "",
        "## Web Performance Section",
        "Web performance means optimizing page load times and Core Web Vitals.",
        "Reduce latency, improve rendering speed, and measure performance budgets.",
        "",
        "## Team Performance Section",
        "Team performance depends on trust, psychological safety, and feedback.",
        "Build culture where performance reviews drive growth not fear.",
        "",
        "## Health Performance Section",
        "Health performance comes from consistent exercise, sleep, and endurance.",
        "Track fitness metrics, optimize recovery, and monitor healthspan.",
    ]
)


class TestExtractSnippetWithIntent:
    def test_without_intent_anchors_on_query_terms_only(self) -> None:
        result = extract_snippet(SECTIONS_BODY, "performance", 500)
        assert "Performance" in result.snippet
        # First line containing "performance" (case-insensitive) is line 3.
        assert result.line == 3
        assert result.snippet.startswith("@@ -2,4 @@ (1 before, 8 after)\n")

    def test_with_web_perf_intent_prefers_web_performance_section(self) -> None:
        result = extract_snippet(
            SECTIONS_BODY,
            "performance",
            500,
            None,
            None,
            "Looking for notes about web performance, latency, and page load times",
        )
        assert re.search(r"latency|page.*load|Core Web Vitals", result.snippet, re.IGNORECASE)
        assert result.line == 4

    def test_with_health_intent_prefers_health_section(self) -> None:
        result = extract_snippet(
            SECTIONS_BODY,
            "performance",
            500,
            None,
            None,
            "Looking for notes about personal health, fitness, and endurance",
        )
        assert re.search(r"health|fitness|endurance|exercise", result.snippet, re.IGNORECASE)
        assert result.line == 12

    def test_with_team_intent_prefers_team_section(self) -> None:
        result = extract_snippet(
            SECTIONS_BODY,
            "performance",
            500,
            None,
            None,
            "Looking for notes about building high-performing teams and culture",
        )
        assert re.search(r"team|culture|trust|feedback", result.snippet, re.IGNORECASE)
        # "teams" does not occur; "culture" (+0.3) lifts line 9 over the tied others.
        assert result.line == 9

    def test_intent_does_not_override_strong_query_match(self) -> None:
        result = extract_snippet(
            SECTIONS_BODY,
            "Core Web Vitals",
            500,
            None,
            None,
            "Looking for notes about health and fitness",
        )
        assert "Core Web Vitals" in result.snippet
        assert result.line == 4

    def test_absent_intent_produces_same_result_as_undefined(self) -> None:
        without_intent = extract_snippet(SECTIONS_BODY, "performance", 500)
        with_none = extract_snippet(SECTIONS_BODY, "performance", 500, None, None, None)
        assert without_intent.line == with_none.line
        assert without_intent.snippet == with_none.snippet
        assert without_intent == with_none

    def test_intent_with_no_matching_terms_falls_back_to_query_only_scoring(self) -> None:
        result = extract_snippet(
            SECTIONS_BODY, "performance", 500, None, None, "quantum computing and entanglement"
        )
        assert "Performance" in result.snippet
        assert len(result.snippet) > 0
        assert result == extract_snippet(SECTIONS_BODY, "performance", 500)

    def test_intent_works_with_chunk_position(self) -> None:
        web_perf_start = SECTIONS_BODY.index("## Web Performance")
        result = extract_snippet(
            SECTIONS_BODY, "performance", 500, web_perf_start, 200, "web page load times"
        )
        assert re.search(r"Web Performance|Core Web Vitals|Page load", result.snippet, re.IGNORECASE)
        assert result.line == 4


# =============================================================================
# Seed: describe("extractSnippet intent weight behavior")
# =============================================================================

TIED_BODY = "\n".join(
    [
        "performance metrics for team velocity",
        "performance metrics for web latency",
        "performance metrics for athletic endurance",
    ]
)


class TestExtractSnippetIntentWeightBehavior:
    def test_intent_breaks_tie_when_query_matches_all_lines_equally(self) -> None:
        no_intent = extract_snippet(TIED_BODY, "performance metrics", 500)
        assert no_intent.line == 1

        with_intent = extract_snippet(
            TIED_BODY, "performance metrics", 500, None, None, "web latency and page speed"
        )
        assert "web latency" in with_intent.snippet
        assert with_intent.line == 2


# =============================================================================
# Seed: describe("intent keyword extraction logic") — chunk scoring
# =============================================================================

CHUNKS = [
    "Web performance: optimize page load times, reduce latency, improve rendering pipeline.",
    "Team performance: build trust, give feedback, set clear expectations for the group.",
    "Health performance: exercise regularly, sleep 8 hours, manage stress for endurance.",
]


class TestIntentKeywordExtractionLogic:
    def test_without_intent_all_chunks_score_equally_on_performance(self) -> None:
        scores = [score_chunk(chunk, "performance") for chunk in CHUNKS]
        assert scores[0] == scores[1] == scores[2] == 1.0

    def test_with_web_intent_web_chunk_scores_highest(self) -> None:
        intent = "looking for notes about page load times and latency optimization"
        scores = [score_chunk(chunk, "performance", intent) for chunk in CHUNKS]
        assert scores[0] > scores[1]
        assert scores[0] > scores[2]

    def test_with_health_intent_health_chunk_scores_highest(self) -> None:
        intent = "looking for notes about exercise, sleep, and endurance"
        scores = [score_chunk(chunk, "performance", intent) for chunk in CHUNKS]
        assert scores[2] > scores[0]
        assert scores[2] > scores[1]

    def test_intent_terms_have_lower_weight_than_query_terms(self) -> None:
        intent = "looking for latency"
        with_both = score_chunk(CHUNKS[0], "performance", intent)
        query_only = score_chunk(CHUNKS[0], "performance")
        assert with_both == query_only + INTENT_WEIGHT_CHUNK
        assert with_both == 1.5

    def test_stop_words_are_filtered_short_domain_terms_survive(self) -> None:
        intent = "the art of web performance"
        assert extract_intent_terms(intent) == ["art", "web", "performance"]
        scores = [score_chunk(chunk, "test", intent) for chunk in CHUNKS]
        assert scores[0] == INTENT_WEIGHT_CHUNK * 2
        assert scores[1] == INTENT_WEIGHT_CHUNK
        assert scores[2] == INTENT_WEIGHT_CHUNK


# =============================================================================
# Seed: describe("strong-signal bypass logic")
# =============================================================================


class TestStrongSignalBypassLogic:
    def test_strong_signal_detected_without_intent(self) -> None:
        assert has_strong_signal(0.90, 0.70) is True

    def test_strong_signal_bypassed_when_intent_provided(self) -> None:
        assert has_strong_signal(0.90, 0.70, "looking for health performance") is False

    def test_weak_signal_not_affected_by_intent(self) -> None:
        assert has_strong_signal(0.50, 0.45) is False
        assert has_strong_signal(0.50, 0.45, "some intent") is False

    def test_close_scores_not_strong_even_without_intent(self) -> None:
        assert has_strong_signal(0.90, 0.80) is False


# =============================================================================
# Seed: describe("parseStructuredQuery with intent") — the real parser, not a copy
# =============================================================================


def _parsed(text: str) -> StructuredQuery:
    result = parse_structured_query(text)
    assert result is not None
    return result


class TestParseStructuredQueryWithIntent:
    def test_parses_intent_plus_lex_query(self) -> None:
        result = _parsed("intent: web performance\nlex: performance")
        assert result.intent == "web performance"
        assert len(result.searches) == 1
        assert result.searches[0].type == "lex"
        assert result.searches[0].query == "performance"
        assert result.searches[0].line == 2

    def test_parses_intent_plus_multiple_typed_lines(self) -> None:
        result = _parsed("intent: web page load times\nlex: performance\nvec: how to improve performance")
        assert result.intent == "web page load times"
        assert len(result.searches) == 2
        assert result.searches[0].type == "lex"
        assert result.searches[1].type == "vec"
        assert result.searches[1].query == "how to improve performance"

    def test_intent_can_appear_after_typed_lines(self) -> None:
        result = _parsed("lex: performance\nintent: web page load times\nvec: latency")
        assert result.intent == "web page load times"
        assert len(result.searches) == 2
        assert [s.line for s in result.searches] == [1, 3]

    def test_intent_is_case_insensitive_prefix(self) -> None:
        result = _parsed("Intent: web perf\nlex: performance")
        assert result.intent == "web perf"

    def test_no_intent_returns_undefined(self) -> None:
        result = _parsed("lex: performance\nvec: speed")
        assert result.intent is None

    def test_intent_alone_throws_error(self) -> None:
        with pytest.raises(QueryParseError, match=r"intent: cannot appear alone"):
            parse_structured_query("intent: web performance")

    def test_multiple_intent_lines_throw_error(self) -> None:
        with pytest.raises(QueryParseError, match=r"only one intent: line is allowed"):
            parse_structured_query("intent: web perf\nintent: team health\nlex: performance")

    def test_empty_intent_text_throws_error(self) -> None:
        with pytest.raises(QueryParseError, match=r"intent: must include text"):
            parse_structured_query("intent:\nlex: performance")

    def test_intent_with_whitespace_only_text_throws_error(self) -> None:
        with pytest.raises(QueryParseError, match=r"intent: must include text"):
            parse_structured_query("intent:   \nlex: performance")

    def test_single_plain_line_still_returns_null_expand_mode(self) -> None:
        assert parse_structured_query("how does auth work") is None

    def test_expand_line_still_returns_null(self) -> None:
        assert parse_structured_query("expand: auth stuff") is None

    def test_intent_with_expand_throws_error_expand_cant_mix(self) -> None:
        with pytest.raises(QueryParseError, match=r"cannot mix expand"):
            parse_structured_query("intent: web\nexpand: performance")

    def test_empty_query_returns_null(self) -> None:
        assert parse_structured_query("") is None
        assert parse_structured_query("  \n  \n  ") is None

    def test_intent_with_blank_lines_is_fine(self) -> None:
        result = _parsed("intent: web perf\n\nlex: performance\n\nvec: speed")
        assert result.intent == "web perf"
        assert len(result.searches) == 2
        # Blank lines count toward line numbers.
        assert [s.line for s in result.searches] == [3, 5]

    def test_intent_preserves_full_text_including_colons(self) -> None:
        result = _parsed("intent: web performance: LCP, FID, CLS\nlex: performance")
        assert result.intent == "web performance: LCP, FID, CLS"


# =============================================================================
# Seed: describe("intent constants")
# =============================================================================


class TestIntentConstants:
    def test_intent_weight_snippet_is_0_3(self) -> None:
        assert INTENT_WEIGHT_SNIPPET == 0.3

    def test_intent_weight_chunk_is_0_5(self) -> None:
        assert INTENT_WEIGHT_CHUNK == 0.5


# =============================================================================
# Our edge cases
# =============================================================================


class TestConstantsAndTypes:
    def test_strong_signal_constants(self) -> None:
        assert STRONG_SIGNAL_MIN_SCORE == 0.85
        assert STRONG_SIGNAL_MIN_GAP == 0.15

    def test_chunk_window_constants(self) -> None:
        assert CHUNK_SIZE_CHARS == 3600
        assert SNIPPET_CHUNK_CONTEXT_CHARS == 100

    def test_stop_list_is_qmds_75_words(self) -> None:
        assert len(INTENT_STOP_WORDS) == 75
        for word in ("am", "we", "you", "your", "about", "looking", "notes", "search", "where", "which"):
            assert word in INTENT_STOP_WORDS
        # Domain terms are deliberately absent.
        for word in ("api", "sql", "ci", "db", "web"):
            assert word not in INTENT_STOP_WORDS

    def test_results_are_frozen(self) -> None:
        snippet = extract_snippet("a\nb", "b")
        with pytest.raises(dataclasses.FrozenInstanceError):
            snippet.line = 5  # type: ignore[misc]
        parsed = _parsed("lex: a")
        with pytest.raises(dataclasses.FrozenInstanceError):
            parsed.intent = "x"  # type: ignore[misc]
        assert isinstance(parsed.searches, tuple)
        assert parsed.searches == (TypedSearch(type="lex", query="a", line=1),)

    def test_query_parse_error_is_a_value_error(self) -> None:
        assert issubclass(QueryParseError, ValueError)


class TestIntentTermsEdgeCases:
    def test_empty_and_whitespace_only(self) -> None:
        assert extract_intent_terms("\t\n \r\n") == []

    def test_only_stop_words_in_any_case(self) -> None:
        assert extract_intent_terms("What ABOUT the Notes, Looking... WHERE?") == []

    def test_only_punctuation(self) -> None:
        assert extract_intent_terms("--- ... !!! (( ))") == []

    def test_duplicates_kept_in_order(self) -> None:
        assert extract_intent_terms("latency web latency") == ["latency", "web", "latency"]

    def test_internal_dots_apostrophes_underscores_stay(self) -> None:
        assert extract_intent_terms("'node.js' user's snake_case_name.") == [
            "node.js",
            "user's",
            "snake_case_name",
        ]

    def test_unicode_letters(self) -> None:
        assert extract_intent_terms("Café, naïve — «Zürich»!") == ["café", "naïve", "zürich"]
        assert extract_intent_terms("«Привет» мир") == ["привет", "мир"]
        assert extract_intent_terms("東京 タワー 。") == ["東京", "タワー"]

    def test_unicode_digits_count_as_alphanumeric(self) -> None:
        # Arabic-Indic digits are \p{N}; "(2024)" keeps its digits.
        assert extract_intent_terms("(2024) ٣٤") == ["2024", "٣٤"]

    def test_emoji_and_symbols_are_stripped_at_the_edges(self) -> None:
        assert extract_intent_terms("🚀rocket🚀 $price€") == ["rocket", "price"]

    def test_single_unicode_letter_is_dropped(self) -> None:
        assert extract_intent_terms("é ß 東 ok") == ["ok"]

    def test_unicode_whitespace_splits(self) -> None:
        assert extract_intent_terms("web\u00a0latency\u3000speed") == ["web", "latency", "speed"]


class TestSnippetEdgeCases:
    def test_empty_body(self) -> None:
        result = extract_snippet("", "anything")
        assert result.line == 1
        assert result.snippet == "@@ -1,1 @@ (0 before, 0 after)\n"
        assert (result.lines_before, result.lines_after, result.snippet_lines) == (0, 0, 1)

    def test_empty_query_picks_first_line(self) -> None:
        result = extract_snippet("alpha\nbeta\ngamma", "")
        assert result.line == 1
        assert result.snippet == "@@ -1,3 @@ (0 before, 0 after)\nalpha\nbeta\ngamma"

    def test_no_match_picks_first_line(self) -> None:
        body = "\n".join(f"line {i}" for i in range(1, 11))
        result = extract_snippet(body, "absent", 500)
        assert result.line == 1
        assert result.snippet == "@@ -1,3 @@ (0 before, 7 after)\nline 1\nline 2\nline 3"

    def test_window_is_one_before_and_two_after(self) -> None:
        body = "\n".join(f"line {i}" for i in range(1, 11))
        result = extract_snippet(body, "line 5", 500)
        # "line" matches every line and "5" only line 5.
        assert result.line == 5
        assert result.snippet == "@@ -4,4 @@ (3 before, 3 after)\nline 4\nline 5\nline 6\nline 7"
        assert (result.lines_before, result.lines_after, result.snippet_lines) == (3, 3, 4)

    def test_window_clipped_at_end_of_body(self) -> None:
        result = extract_snippet("a\nb\nc\nd target", "target")
        assert result.line == 4
        assert result.snippet == "@@ -3,2 @@ (2 before, 0 after)\nc\nd target"

    def test_blank_lines_count_in_line_numbers(self) -> None:
        result = extract_snippet("\n\n\nneedle\n\n", "needle")
        assert result.line == 4
        assert result.snippet == "@@ -3,4 @@ (2 before, 0 after)\n\nneedle\n\n"

    def test_query_terms_match_as_case_insensitive_substrings(self) -> None:
        result = extract_snippet("nothing\nthe PERFORMANCEs here", "perform")
        assert result.line == 2

    def test_each_query_term_scores_once_per_line(self) -> None:
        # Repetition in a line does not add: line 1 has "a" many times, line 2 has both terms.
        result = extract_snippet("aaaa aaaa aaaa\na b", "a b")
        assert result.line == 2

    def test_query_outweighs_intent(self) -> None:
        # 3 intent hits (0.9) lose to one query hit (1.0).
        body = "web latency page\nquery-term only"
        result = extract_snippet(body, "query-term", intent="web latency page")
        assert result.line == 2

    def test_unicode_query_and_intent(self) -> None:
        body = "Einleitung\nÜber die Straße\nZürich Café"
        assert extract_snippet(body, "ÜBER").line == 2
        assert extract_snippet(body, "über café", intent="Zürich").line == 3

    def test_crlf_body_numbers_lines_like_lf(self) -> None:
        lf_body = "# Title\n\nfirst para\nthe needle line\nafter one\nafter two\nafter three"
        crlf_body = lf_body.replace("\n", "\r\n")
        lf = extract_snippet(lf_body, "needle")
        crlf = extract_snippet(crlf_body, "needle")
        assert crlf == lf
        assert crlf.line == 4
        assert "\r" not in crlf.snippet
        assert (
            crlf.snippet
            == "@@ -3,4 @@ (2 before, 1 after)\nfirst para\nthe needle line\nafter one\nafter two"
        )

    def test_crlf_body_with_chunk_position(self) -> None:
        lf_body = "\n".join(f"row {i}" for i in range(200)) + "\nmarker here\n" + "tail\n" * 5
        crlf_body = lf_body.replace("\n", "\r\n")
        pos = crlf_body.index("marker")
        result = extract_snippet(crlf_body, "marker", chunk_pos=pos, chunk_len=20)
        assert result.line == 201
        assert "\r" not in result.snippet

    def test_max_len_cuts_with_ellipsis(self) -> None:
        body = "x" * 50 + " needle " + "y" * 50
        result = extract_snippet(body, "needle", max_len=20)
        text = _snippet_text(result.snippet)
        assert text == body[:17] + "..."
        assert len(text) == 20
        # The header still describes the whole window.
        assert result.snippet.startswith("@@ -1,1 @@ (0 before, 0 after)\n")

    def test_max_len_exactly_fits_is_not_cut(self) -> None:
        body = "needle" + "z" * 14
        assert len(body) == 20
        assert _snippet_text(extract_snippet(body, "needle", max_len=20).snippet) == body
        assert _snippet_text(extract_snippet(body, "needle", max_len=19).snippet) == body[:16] + "..."

    def test_max_len_counts_the_joined_lines(self) -> None:
        body = "aaaa\nneedle\nbbbb\ncccc\ndddd"
        # Window lines 1-4 joined: "aaaa\nneedle\nbbbb\ncccc" is 21 characters.
        assert (
            _snippet_text(extract_snippet(body, "needle", max_len=21).snippet) == "aaaa\nneedle\nbbbb\ncccc"
        )
        assert _snippet_text(extract_snippet(body, "needle", max_len=10).snippet) == "aaaa\nne..."

    def test_max_len_below_ellipsis_length(self) -> None:
        assert _snippet_text(extract_snippet("needle here", "needle", max_len=2).snippet) == "..."

    def test_default_max_len_is_500(self) -> None:
        body = "needle " + "w" * 600
        text = _snippet_text(extract_snippet(body, "needle").snippet)
        assert len(text) == 500
        assert text.endswith("...")


def _numbered_body(count: int) -> str:
    """Lines of exactly 10 characters plus "\\n": line n (1-based) starts at offset 11 * (n - 1)."""
    return "\n".join(f"row {n:06d}" for n in range(1, count + 1))


class TestSnippetChunkPositions:
    def test_chunk_window_narrows_the_search(self) -> None:
        body = "needle at the top\n" + _numbered_body(500) + "\nneedle at the bottom"
        pos = body.index("row 000400")
        result = extract_snippet(body, "needle", chunk_pos=pos, chunk_len=len(body))
        assert result.line == 502
        assert "bottom" in result.snippet
        # Without the chunk the first needle wins.
        assert extract_snippet(body, "needle").line == 1

    def test_line_numbers_are_absolute_in_the_middle(self) -> None:
        body = _numbered_body(1000)
        target = body.index("row 000600")
        result = extract_snippet(body, "row 000601", chunk_pos=target, chunk_len=50)
        assert result.line == 601
        assert result.snippet == (
            "@@ -600,4 @@ (599 before, 397 after)\nrow 000600\nrow 000601\nrow 000602\nrow 000603"
        )

    def test_window_reaches_100_chars_before_the_chunk(self) -> None:
        body = _numbered_body(100)
        pos = body.index("row 000050")  # 539
        # The window starts at 439; row 41 starts at 440, 99 characters before the chunk.
        assert extract_snippet(body, "000041", chunk_pos=pos, chunk_len=10).line == 41
        # Row 40 [429, 439) lies wholly before the window: no match, so anchor on the chunk's line.
        assert extract_snippet(body, "000040", chunk_pos=pos, chunk_len=10).line == 50
        # A window starting mid-line searches only that line's tail (qmd does the same).
        assert extract_snippet(body, "000041", chunk_pos=pos + 3, chunk_len=10).line == 41
        assert extract_snippet(body, "row", chunk_pos=pos + 3, chunk_len=10).line == 42

    def test_window_reaches_100_chars_after_the_chunk(self) -> None:
        body = _numbered_body(100)
        pos = body.index("row 000050")  # window ends at pos + 10 + 100 = 649
        # Row 59 occupies [638, 648): fully inside the window.
        assert extract_snippet(body, "000059", chunk_pos=pos, chunk_len=10).line == 59
        # Row 60 starts at 649: outside, so anchor on the chunk's line.
        assert extract_snippet(body, "000060", chunk_pos=pos, chunk_len=10).line == 50

    def test_default_chunk_length_is_3600(self) -> None:
        body = _numbered_body(1000)
        pos = 11 * 99  # start of row 100; window ends at pos + 3600 + 100 = 4789
        # Row 435 occupies [4774, 4784): inside the default window.
        assert extract_snippet(body, "000435", chunk_pos=pos).line == 435
        # Row 436 [4785, 4795) is cut by the window end, so no match and anchor on row 100.
        assert extract_snippet(body, "000436", chunk_pos=pos).line == 100
        # A zero length also means the default, as in qmd.
        assert extract_snippet(body, "000435", chunk_pos=pos, chunk_len=0).line == 435

    def test_no_match_in_middle_anchors_on_the_chunk_line(self) -> None:
        body = _numbered_body(300)
        pos = body.index("row 000150") + 4  # inside row 150
        result = extract_snippet(body, "absent", chunk_pos=pos, chunk_len=30)
        assert result.line == 150
        assert result.snippet.startswith("@@ -149,4 @@ (148 before, 148 after)\n")

    def test_no_match_in_window_but_elsewhere_still_anchors_on_chunk(self) -> None:
        body = _numbered_body(300) + "\nneedle"
        pos = body.index("row 000010")
        assert extract_snippet(body, "needle", chunk_pos=pos, chunk_len=10).line == 10

    def test_chunk_position_zero_searches_its_window_first(self) -> None:
        body = "intro\nneedle early\n" + _numbered_body(600) + "\nneedle needle-late"
        # Without a chunk the last line (both terms) beats line 2 (one term).
        assert extract_snippet(body, "needle-late needle").line == 603
        # With chunk 0 (default length) the far line is outside the window.
        assert extract_snippet(body, "needle-late needle", chunk_pos=0).line == 2

    def test_chunk_position_zero_without_match_searches_whole_body(self) -> None:
        body = _numbered_body(600) + "\nfar away needle"
        result = extract_snippet(body, "needle", chunk_pos=0)
        assert result.line == 601
        assert result == extract_snippet(body, "needle")

    def test_chunk_position_zero_without_any_match_is_first_line(self) -> None:
        result = extract_snippet(_numbered_body(600), "absent", chunk_pos=0)
        assert result.line == 1

    def test_chunk_position_beyond_the_end_falls_back_to_whole_body(self) -> None:
        body = "alpha\nbeta needle\ngamma"
        result = extract_snippet(body, "needle", chunk_pos=10_000, chunk_len=50)
        assert result == extract_snippet(body, "needle")
        assert result.line == 2

    def test_chunk_position_beyond_the_end_without_match(self) -> None:
        body = "alpha\nbeta\ngamma"
        result = extract_snippet(body, "absent", chunk_pos=10_000)
        assert result.line == 1
        assert result.snippet == "@@ -1,3 @@ (0 before, 0 after)\nalpha\nbeta\ngamma"

    def test_chunk_anchor_on_blank_lines_falls_back_to_whole_body(self) -> None:
        body = "top needle\n" + "\n" * 300 + "end"
        pos = 150  # among the blank lines, far from either text line
        result = extract_snippet(body, "needle", chunk_pos=pos, chunk_len=10)
        assert result.line == 1

    def test_negative_chunk_position_is_ignored(self) -> None:
        body = _numbered_body(600) + "\nneedle"
        assert extract_snippet(body, "needle", chunk_pos=-5) == extract_snippet(body, "needle")

    def test_chunk_window_respects_intent(self) -> None:
        body = _numbered_body(50) + "\nperformance web\nperformance health\n" + _numbered_body(50)
        pos = body.index("performance web")
        result = extract_snippet(body, "performance", chunk_pos=pos, chunk_len=40, intent="health")
        assert result.line == 52


class TestScoreChunkEdgeCases:
    def test_query_terms_of_two_characters_or_fewer_do_not_score(self) -> None:
        assert score_chunk("an ox in a db", "an ox db") == 0.0
        assert score_chunk("the dbs", "the") == 1.0

    def test_empty_inputs(self) -> None:
        assert score_chunk("", "performance", "latency") == 0.0
        assert score_chunk("performance", "") == 0.0
        assert score_chunk("performance", "performance", "") == 1.0

    def test_case_insensitive_substring_match(self) -> None:
        assert score_chunk("LATENCY budgets", "Latency", "BUDGET") == 1.0 + INTENT_WEIGHT_CHUNK

    def test_duplicate_intent_terms_each_score(self) -> None:
        assert score_chunk("web", "", "web web") == 2 * INTENT_WEIGHT_CHUNK

    def test_stop_word_only_intent_adds_nothing(self) -> None:
        assert score_chunk("the notes about this", "", "the notes about this") == 0.0


class TestStrongSignalEdgeCases:
    def test_boundaries_are_inclusive(self) -> None:
        assert has_strong_signal(0.85, 0.70) is True
        assert has_strong_signal(1.0, 0.85) is True

    def test_just_below_the_thresholds(self) -> None:
        assert has_strong_signal(0.8499, 0.0) is False
        assert has_strong_signal(0.90, 0.76) is False

    def test_empty_intent_counts_as_absent(self) -> None:
        assert has_strong_signal(0.95, 0.10, "") is True
        assert has_strong_signal(0.95, 0.10, None) is True

    def test_any_intent_blocks_even_a_perfect_score(self) -> None:
        assert has_strong_signal(1.0, 0.0, "x") is False


def _parse_error(text: str) -> QueryParseError:
    with pytest.raises(QueryParseError) as info:
        parse_structured_query(text)
    return info.value


class TestParseErrorsVerbatim:
    def test_expand_mixed_with_typed_lines(self) -> None:
        error = _parse_error("lex: auth\n\n\nexpand: auth stuff")
        assert str(error) == (
            "Line 4 starts with expand:, but query documents cannot mix expand with typed lines. "
            "Submit a single expand query instead."
        )
        assert error.line == 4

    def test_expand_first_of_several_lines(self) -> None:
        error = _parse_error("expand: auth\nlex: auth")
        assert str(error).startswith("Line 1 starts with expand:")
        assert error.line == 1

    def test_expand_without_text(self) -> None:
        error = _parse_error("\n  EXPAND:   \n")
        assert str(error) == "expand: query must include text."

    def test_second_intent_line(self) -> None:
        error = _parse_error("lex: a\n\nintent: one\n\n\nintent: two")
        assert str(error) == "Line 6: only one intent: line is allowed per query document."
        assert error.line == 6

    def test_intent_without_text(self) -> None:
        error = _parse_error("lex: a\n\n\nINTENT:")
        assert str(error) == "Line 4: intent: must include text."
        assert error.line == 4

    @pytest.mark.parametrize("prefix", ["lex", "vec", "hyde"])
    def test_typed_line_without_text(self, prefix: str) -> None:
        error = _parse_error(f"intent: x\n\n{prefix.upper()}:   ")
        assert str(error) == f"Line 3 ({prefix}:) must include text."
        assert error.line == 3

    @pytest.mark.parametrize("prefix", ["lex", "vec", "hyde"])
    def test_typed_line_with_a_newline(self, prefix: str) -> None:
        # "\n" splits lines, so only a lone carriage return can survive inside one.
        error = _parse_error(f"\nintent: x\n{prefix}: first\rsecond")
        assert str(error) == f"Line 3 ({prefix}:) contains a newline. Keep each query on a single line."
        assert error.line == 3

    def test_line_missing_prefix(self) -> None:
        error = _parse_error("lex: a\n\nplain words")
        assert str(error) == (
            "Line 3 is missing a lex:/vec:/hyde:/intent: prefix. "
            "Each line in a query document must start with one."
        )
        assert error.line == 3

    def test_intent_alone(self) -> None:
        error = _parse_error("\n\nintent: web performance\n")
        assert str(error) == "intent: cannot appear alone. Add at least one lex:, vec:, or hyde: line."
        assert error.line is None

    def test_first_error_in_document_order_wins(self) -> None:
        error = _parse_error("intent:\nintent: x\nlex:")
        assert str(error) == "Line 1: intent: must include text."


class TestParseStructuredQueryEdgeCases:
    def test_crlf_document(self) -> None:
        result = _parsed("intent: web perf\r\n\r\nlex: performance\r\nvec: page speed\r\n")
        assert result.intent == "web perf"
        assert result.searches == (
            TypedSearch(type="lex", query="performance", line=3),
            TypedSearch(type="vec", query="page speed", line=4),
        )

    def test_prefix_case_and_spacing(self) -> None:
        result = _parsed("  LEX:performance  \n\tHyDe:   a hypothetical answer\t")
        assert result.searches == (
            TypedSearch(type="lex", query="performance", line=1),
            TypedSearch(type="hyde", query="a hypothetical answer", line=2),
        )
        assert result.intent is None

    def test_unicode_text_is_kept(self) -> None:
        result = _parsed("intent: Zürich Café\nvec: 東京 タワー")
        assert result.intent == "Zürich Café"
        assert result.searches[0].query == "東京 タワー"

    def test_byte_order_mark_is_trimmed(self) -> None:
        result = _parsed("\ufefflex: auth\nvec: login")
        assert [s.type for s in result.searches] == ["lex", "vec"]

    def test_non_ascii_lookalike_prefix_is_not_intent(self) -> None:
        # U+0130 folds to "i" under Unicode case rules; qmd's prefix match is ASCII-only.
        assert parse_structured_query("\u0130ntent: web") is None
        error = _parse_error("\u0130ntent: web\nlex: a")
        assert str(error).startswith("Line 1 is missing a lex:/vec:/hyde:/intent: prefix.")

    def test_single_typed_line(self) -> None:
        assert _parsed("vec: how do I rotate keys").searches == (
            TypedSearch(type="vec", query="how do I rotate keys", line=1),
        )

    def test_words_that_merely_start_like_a_prefix(self) -> None:
        assert parse_structured_query("lexicon: a word list") is None
        assert parse_structured_query("intention matters") is None

    def test_expand_prefix_case_insensitive(self) -> None:
        assert parse_structured_query("\n  Expand: auth stuff  \n") is None

    def test_repeated_types_keep_order(self) -> None:
        result = _parsed("lex: a\nlex: b\nvec: c")
        assert [(s.type, s.query, s.line) for s in result.searches] == [
            ("lex", "a", 1),
            ("lex", "b", 2),
            ("vec", "c", 3),
        ]
