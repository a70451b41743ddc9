"""The pure pieces of search: lex lines into tsquery texts, fusion, snippets' segments, embedding text."""

from __future__ import annotations

import math
import unicodedata

import pytest

from worker.core.embeddings import (
    EMBEDDING_DIMENSIONS,
    fact_embedding_text,
    vector_literal,
    vectors_problem,
    version_tuple,
)
from worker.core.fusion import (
    FIRST_PLACE_BONUS,
    PODIUM_BONUS,
    RRF_K,
    Hit,
    SearchLine,
    fuse,
    segment_range,
    segment_snippet,
)
from worker.core.lexing import (
    MAX_LEX_UNITS,
    LexItem,
    LexQuery,
    idf,
    lex_items,
    lex_units,
    parse_lex_query,
    plain_text,
    rarest_first,
    restrict_weights,
    snippet_words,
)


def test_lex_items_keep_words_phrases_exclusions_in_order() -> None:
    items = lex_items(parse_lex_query('bob "oat milk" -coffee'))
    assert items == [LexItem("w", "bob"), LexItem("p", "oat milk"), LexItem("x", "coffee")]


def test_lex_units_prefix_long_words_and_restrict_strong_matches() -> None:
    items = [LexItem("w", "alice-smith"), LexItem("w", "v1"), LexItem("p", "oat milk"), LexItem("x", "tea")]
    parsed = ["alice\x1fsmith", "v1", "'oat' <-> 'milk'", "'tea'"]
    units, excluded = lex_units(items, parsed)
    assert [u.match for u in units] == ["('alice':* & 'smith':*)", "('v1')", "('oat' <-> 'milk')"]
    assert [u.strong for u in units] == [
        "('alice':*AB & 'smith':*AB)",
        "('v1':AB)",
        "('oat':AB <-> 'milk':AB)",
    ]
    # The exact match tried first: only where a prefix makes it differ.
    assert [u.exact for u in units] == ["('alice' & 'smith')", "", ""]
    assert excluded == ["!('tea')"]


def test_a_word_postgres_splits_keeps_its_pieces_of_two_characters_or_more() -> None:
    units, _ = lex_units([LexItem("w", "priya's"), LexItem("w", "a.b")], ["priya\x1fs", "a\x1fb"])
    assert [u.match for u in units] == ["('priya':*)", "('a' & 'b')"]  # all short: all kept


def test_stop_words_beside_a_phrase_drop_out() -> None:
    assert parse_lex_query('where is "Priya"') == LexQuery((), ("Priya",), ())
    assert parse_lex_query("where is -Priya").terms == ("where", "is")  # nothing else to search


def test_a_digit_or_an_ideograph_is_a_query_word_and_a_lone_ascii_letter_is_not() -> None:
    assert parse_lex_query("room 7").terms == ("room", "7")
    # (An ideograph is searched as a phrase: worker.core.lexing's pairs of pieces.)
    assert (parse_lex_query("Alice 猫").terms, parse_lex_query("Alice 猫").phrases) == (("Alice",), ("猫",))
    assert parse_lex_query("vitamin d").terms == ("vitamin",)
    # Punctuation alone is no word (bare, it is empty): a stop-word question still searches its words.
    assert parse_lex_query("Alice & Bob").terms == ("Alice", "Bob")
    assert parse_lex_query("who is he ?").terms == ("who", "is", "he", "?")


def test_a_word_of_an_unspaced_script_is_searched_by_its_pairs_of_characters_and_its_other_pieces() -> None:
    def units(query: str) -> tuple[tuple[str, ...], tuple[str, ...]]:
        parsed = parse_lex_query(query)
        return parsed.terms, parsed.phrases

    assert units("东京") == ((), ("东京",))
    assert units("东京大学") == ((), ("东京", "京大", "大学"))
    assert units("猫") == ((), ("猫",))
    assert units("iPhone,苹果") == (("iPhone",), ("苹果",))
    assert units("「東京」、大阪") == ((), ("東京", "大阪"))  # punctuation alone is nothing
    assert units(unicodedata.normalize("NFD", "서울")) == ((), ("서울",))  # composed first
    # Letters and digits inside a stretch keep their place: 5月3日 is not 3月5日, B站 not any 站.
    assert units("5月3日") == ((), ("5月", "月3", "3日"))
    assert units("B站") == ((), ("B站",))
    # Punctuation Postgres's parser keeps inside a token stays in the piece; the underscore separates.
    assert units("3.5寸") == ((), ("3.5寸",))
    assert units("東京_大阪") == ((), ("東京", "大阪"))
    # A long question typed without spaces keeps its first pairs in place and the rest after the line's
    # other words: a name after it was crowded out of the units searched.
    question = "请告诉我关于东京大学的所有信息以及它的历史和排名情况还有学费是多少"
    items = lex_items(parse_lex_query(question + " Priya"))
    assert LexItem("w", "Priya") in items[:MAX_LEX_UNITS]
    punctuated = (
        "東京大学の歴史について、詳しく教えてください。入学試験の難しさ、学費、キャンパスの場所も Priya"
    )
    assert LexItem("w", "Priya") in lex_items(parse_lex_query(punctuated))[:MAX_LEX_UNITS]  # over the word
    assert snippet_words("李雷住在哪里 iPhone,苹果") == "李雷 雷住 住在 在哪 哪里 iPhone 苹果"


def test_lex_units_skip_what_postgres_found_nothing_in() -> None:
    assert lex_units([LexItem("w", "!!")], [""]) == ([], [])


def test_a_repeated_word_is_one_unit_and_a_line_keeps_at_most_its_first_units() -> None:
    """`seg seg seg ...` (2,000 characters) made 500 units: 500 frequency counts and 1,000 tsquery tests
    on every fact (each fact's context holds a word "seg" prefixes) for one request."""
    items = lex_items(parse_lex_query("seg " * 500))
    units, _ = lex_units(items, ["seg"] * len(items))
    assert len(items) == 500 and [u.match for u in units] == ["('seg':*)"]
    words = [f"word{i}" for i in range(MAX_LEX_UNITS + 10)]
    line = " ".join(words) + " " + " ".join(f"-not{i}" for i in range(MAX_LEX_UNITS + 10))
    items = lex_items(parse_lex_query(line))
    units, excluded = lex_units(items, [item.text for item in items])
    assert [u.match for u in units] == [f"('word{i}':*)" for i in range(MAX_LEX_UNITS)]
    assert excluded == [f"!(not{i})" for i in range(MAX_LEX_UNITS)]


def test_a_line_keeps_its_first_units_as_written_and_says_when_it_left_some_out() -> None:
    """Words came before phrases whatever the order written: a phrase written first, behind 40 words,
    was dropped without a note, and the 32 words searched could still count as a clear answer."""
    from worker.core.lexing import units_left_out

    words = [f"w{i}" for i in range(40)]
    items = lex_items(parse_lex_query('"oat milk" ' + " ".join(words)))
    parsed = [f"'{item.text}'" for item in items]
    units, _ = lex_units(items, parsed)
    assert units[0].match == "('oat milk')" and len(units) == MAX_LEX_UNITS
    assert units_left_out(items, parsed, units)
    few = lex_items(parse_lex_query('"oat milk" alice alice -tea'))
    assert [(i.kind, i.text) for i in few] == [
        ("p", "oat milk"),
        ("w", "alice"),
        ("w", "alice"),
        ("x", "tea"),
    ]
    few_units, _ = lex_units(few, [f"'{i.text}'" for i in few])
    assert not units_left_out(few, [f"'{i.text}'" for i in few], few_units)  # a repeat is no unit left out


def test_quotes_inside_lexemes_are_escaped() -> None:
    units, _ = lex_units([LexItem("w", "o'neil")], ["o'neil"])
    assert units[0].match == "('o''neil':*)"
    assert restrict_weights("'o''neil' & 'x'", "AB") == "'o''neil':AB & 'x':AB"


def test_rarest_first_puts_absent_words_last() -> None:
    assert rarest_first([50.0, 0.0, 3.0, 50.0]) == [2, 0, 3, 1]


def test_idf_falls_as_a_word_gets_common() -> None:
    assert idf(1, 1000) > idf(100, 1000) > idf(1000, 1000) > 0
    assert math.isclose(idf(0, 0), math.log(2.0))


def test_plain_text_strips_an_expand_line() -> None:
    assert plain_text("  expand:  where   did alice move ") == "where did alice move"
    # Trimmed by the parser's own rule: with a byte-order mark (a file saved with one) the parser read a
    # plain expand: line while "expand" stayed a search word, and a BOM alone was a paid query.
    from worker.core.intent import parse_structured_query

    assert parse_structured_query("\ufeffexpand: team growth") is None
    assert plain_text("\ufeffexpand: team growth\u3000") == "team growth"
    assert plain_text("\ufeff") == plain_text("   ") == ""
    assert plain_text("EXPAND:\tx") == "x"


def test_fusion_sums_reciprocal_ranks_and_rewards_the_top() -> None:
    lex = SearchLine("lex", "dog", "user", 2.0)
    vec = SearchLine("vec", "dog", "expansion", 1.0)
    fused = fuse([(lex, [Hit(1, 0.9), Hit(2, 0.5)]), (vec, [Hit(2, 0.8), Hit(3, 0.7)])])
    assert [e.fact_id for e in fused] == [2, 1, 3]
    by_id = {e.fact_id: e for e in fused}
    assert math.isclose(by_id[2].score, 2.0 / (RRF_K + 2) + 1.0 / (RRF_K + 1) + FIRST_PLACE_BONUS)
    assert math.isclose(by_id[3].score, 1.0 / (RRF_K + 2) + PODIUM_BONUS)
    assert by_id[2].matched_by == ["lex:1", "vec:2"]
    assert (by_id[2].lex_score, by_id[2].vec_score) == (0.5, 0.8)
    assert (by_id[3].lex_score, by_id[3].vec_score) == (None, 0.7)


def test_segment_range_and_snippet() -> None:
    context = "conversation segment 2024-03-01T09:00:00Z to 2024-03-01T09:40:00Z"
    assert segment_range(context) == ("2024-03-01T09:00:00Z", "2024-03-01T09:40:00Z")
    assert segment_range("notes") == (None, None)
    segment = [(0, "Alice moved to Lisbon"), (1, "Alice prefers oat\nmilk"), (2, "Bob runs")]
    snippet = segment_snippet(segment, 0, "oat milk", None)
    assert snippet.line == 2  # the best line, not the result's own
    assert "Alice prefers oat milk" in snippet.snippet


def test_a_segment_snippet_shows_whole_lines_around_the_best_one() -> None:
    """qmd's chunk window (100 characters either side) began the line before mid-word and cut the
    lines after it, in every search result whose neighbouring facts were long."""
    before = "Priya " + "talked about the quarterly offsite in Lisbon she had planned since spring " * 3
    after = "Sam congratulated Priya on the Acme offer " + "and said the team would miss her badly " * 3
    last = "Priya starts at Acme in June " + "after a month of travelling with her family " * 3
    segment = [(0, before.strip()), (1, "Priya signed the Acme offer"), (2, after.strip()), (3, last.strip())]
    snippet = segment_snippet(segment, 1, "signed acme offer", None, max_chars=2000)
    assert snippet.line == 2
    header, *shown = snippet.snippet.split("\n")
    assert header == "@@ -1,4 @@ (0 before, 0 after)"
    assert shown == [fact for _, fact in segment]


def test_a_long_fact_before_the_best_one_does_not_push_it_out_of_the_snippet() -> None:
    """Whole lines cut at 500 characters: a previous fact of 598 filled the snippet, and the fact that
    matched was not in it."""
    long_before = "Priya talked about " + "the quarterly offsite in Lisbon and the plans for it " * 11
    segment = [(0, long_before.strip()), (1, "Priya signed the Acme offer"), (2, "Sam was glad")]
    snippet = segment_snippet(segment, 1, "signed acme offer", None)
    header, *shown = snippet.snippet.split("\n")
    assert header == "@@ -2,2 @@ (1 before, 0 after)" and snippet.line == 2
    assert shown == ["Priya signed the Acme offer", "Sam was glad"]


def test_embedding_text_names_the_entity_once() -> None:
    assert fact_embedding_text("Bob is allergic to peanuts", "bob") == "Bob is allergic to peanuts"
    assert fact_embedding_text("Moved to Lisbon", "alice-smith") == "Moved to Lisbon (alice smith)"
    assert vector_literal([1, 0.5]) == "[1.0,0.5]"
    assert version_tuple("0.8.0") >= (0, 8) > version_tuple("0.7.4")


def test_vectors_problem_names_a_wrong_count_size_or_value() -> None:
    good = [0.5] * EMBEDDING_DIMENSIONS
    assert vectors_problem([good, good], 2) is None
    assert vectors_problem([good], 2) == "the embedding model returned 1 vectors for 2 texts"
    assert "returned 3 dimensions" in (vectors_problem([[0.1, 0.2, 0.3]]) or "")
    for bad in (float("nan"), float("inf"), -float("inf"), 1e39, -1e39):
        assert "not a finite number" in (vectors_problem([[*good[:-1], bad]], 1) or "")


def test_snippet_terms_are_bounded_for_long_queries_only() -> None:
    """Snippets scored every line against every query and intent word: 660 words cost 1.2 s a search."""
    from worker.core.fusion import MAX_SNIPPET_TERMS, bounded_terms

    assert bounded_terms(None) is None
    assert bounded_terms("Where does Alice work alice") == "Where does Alice work alice"  # as it was
    long = " ".join(["Alice", "alice,", *(f"w{i}" for i in range(100))])
    bounded = (bounded_terms(long) or "").split()
    assert len(bounded) == MAX_SNIPPET_TERMS and bounded[:3] == ["alice", "w0", "w1"]
    # Short words and stop words do not take the places of the words that find the line.
    question = "so where is it that the one we met at the fair in the old town of the city by the sea " * 2
    found = bounded_terms(question + "is living these days, Lisbon or Porto?") or ""
    assert "lisbon" in found.split() and "porto" in found.split() and "the" not in found.split()


def test_an_expansion_line_of_the_users_words_in_another_order_is_the_same_search() -> None:
    """Compared in order, "lex: lisbon alice" ran the probe's search for "alice lisbon" again and
    weighed its hits twice in the fusion."""
    probe = parse_lex_query("alice lisbon").search_key
    assert parse_lex_query("Lisbon ALICE").search_key == probe
    assert parse_lex_query("alice lisbon alice").search_key == probe
    assert parse_lex_query("alice porto").search_key != probe
    assert parse_lex_query('alice "lisbon"').search_key != probe  # a phrase is another search
    assert parse_lex_query('"alice lisbon"').search_key != parse_lex_query('"lisbon alice"').search_key
    assert parse_lex_query("alice lisbon -porto").search_key != probe


@pytest.mark.parametrize(
    ("line", "words"),
    [
        ('"project apollo" -budget launch', "project apollo launch"),  # phrase words, no exclusion
        ('"performance review', "performance review"),  # a quote left open is no quote (as searched)
        ("Tom and Jerry", "Tom and Jerry"),  # every word: stop words and a lower-case "and" too
        ('alice AND "oat milk"', "alice oat milk"),  # the AND operator is syntax
        ('-budget -"q3 plan"', ""),  # only exclusions: nothing to look for
    ],
)
def test_a_snippet_looks_for_a_lex_lines_words_as_the_search_reads_them(line: str, words: str) -> None:
    from worker.core.lexing import snippet_words

    assert snippet_words(line) == words
