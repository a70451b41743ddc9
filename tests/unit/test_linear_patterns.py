"""Patterns over hostile text stay linear: a long run of spaces once cost each of them quadratic time
(an hour of a thread holding the GIL for one 1 MB message). Each case is a million characters, so the
old patterns run into the suite's per-test timeout; the assertions check the answers stay the same."""

from __future__ import annotations

import re

import pytest
from hypothesis import given
from hypothesis import strategies as st

from worker.core.compaction import wrap_untrusted_data
from worker.core.delimiters import neutralize_tags
from worker.core.intent import parse_structured_query
from worker.core.lexing import _bare, parse_expansion
from worker.simulator.heuristics import classify

pytestmark = pytest.mark.timeout(60)  # linear: milliseconds; the quadratic patterns took hours

RUN = " " * 1_000_000


def test_a_tag_opener_before_a_million_spaces_is_escaped_in_linear_time() -> None:
    assert neutralize_tags("<" + RUN, ("untrusted-data",)) == "<" + RUN
    assert (
        neutralize_tags("<" + RUN + "/untrusted-data>", ("untrusted-data",))
        == "&lt;" + RUN + "/untrusted-data>"
    )
    wrapped = wrap_untrusted_data("<" + RUN + "x")
    assert RUN in wrapped
    # The escaping itself is unchanged: spaces and a slash between `<` and the name, any case.
    assert neutralize_tags(
        "< / untrusted-data> </ UNTRUSTED-DATA > <untrusted-datax>", ("untrusted-data",)
    ) == ("&lt; / untrusted-data> &lt;/ UNTRUSTED-DATA > <untrusted-datax>")


def test_a_query_line_with_a_million_spaces_inside_is_trimmed_in_linear_time() -> None:
    parsed = parse_structured_query("lex: alpha" + RUN + "beta\nintent: \ufeff work \u3000")
    assert parsed is not None and parsed.intent == "work"
    assert parsed.searches[0].query.startswith("alpha") and parsed.searches[0].query.endswith("beta")


def test_an_expansion_line_with_a_million_spaces_inside_is_read_in_linear_time() -> None:
    lines = parse_expansion("lex: alpha" + RUN + "beta  \n- vec:  where alice works  ", "q")
    assert ("vec", "where alice works") in lines
    assert [kind for kind, _ in lines] == ["lex", "vec"]


def test_a_word_with_a_million_punctuation_marks_inside_is_stripped_in_linear_time() -> None:
    """The regex ``^\\W+|\\W+$`` retried its tail match at each mark of the run: 3 s for 20,000."""
    word = "a" + "!" * 1_000_000 + "b"
    assert _bare(word) == word and _bare("¿¡" + word.upper() + "!?") == word.lower()


@given(st.text(alphabet=st.characters(codec="utf-8"), max_size=12))
def test_the_word_stripper_matches_the_regex_it_replaced(word: str) -> None:
    assert _bare(word) == re.sub(r"^\W+|\W+$", "", word.lower())


def test_a_repeated_softener_is_classified_without_backtracking_through_every_reading() -> None:
    """The simulator's softeners listed "definitely" twice, so each of a run of them could be either:
    a message of 30 of them and no verb after froze the simulator (and the worker it ran in, the GIL
    held) for half an hour, 2^n readings. A segment holds about 590."""
    sentence = "I " + "definitely " * 590 + "zzz"
    assert classify(sentence) == "fact"
    assert classify("I " + "definitely " * 590 + "will call Bob") == "commitment"
