"""The OpenAPI document's patterns state the API's rules exactly: each ECMA pattern (judged by
jsonschema_rs, as schemathesis and most validators do) accepts what its Python rule accepts, for every
character assigned in both Unicode versions, and for strings built around the edges of each rule."""

from __future__ import annotations

import sys
import unicodedata
from collections.abc import Callable

import jsonschema_rs
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from worker.core.facts import ENTITY_PATTERN, entity_slug
from worker.core.labels import (
    LABEL_PATTERN,
    MAX_SOURCE_ID_LENGTH,
    NEW_SOURCE_ID_PATTERN,
    NOT_ONLY_SPACES_PATTERN,
    SOURCE_ID_PATTERN,
    WORD_LABEL_PATTERN,
    check_new_source_id,
    check_source_id,
    clean_label,
    is_new_source_id,
    is_source_id,
    is_word_label,
)
from worker.core.slugs import SLUG_PATTERN, normalize_slug


def matches(pattern: str) -> Callable[[str], bool]:
    return jsonschema_rs.validator_for({"type": "string", "pattern": pattern}).is_valid


def slug_ok(value: str) -> bool:
    try:
        normalize_slug(value)
    except ValueError:
        return False
    return True


def assigned_in_both(char: str) -> bool:
    """Python's unicodedata (Unicode 14 here) and the regex engine may differ on newer characters."""
    return unicodedata.category(char) != "Cn" and not 0xD800 <= ord(char) <= 0xDFFF


ASSIGNED = [chr(cp) for cp in range(sys.maxunicode + 1) if assigned_in_both(chr(cp))]
LABEL_ANY = matches(LABEL_PATTERN)


def LABEL_5(value: str) -> bool:
    return len(value) <= 5 and LABEL_ANY(value)


WORD = matches(WORD_LABEL_PATTERN)
SLUG = matches(SLUG_PATTERN)
SOURCE = matches(SOURCE_ID_PATTERN)
NEW_SOURCE = matches(NEW_SOURCE_ID_PATTERN)
ENTITY = matches(ENTITY_PATTERN)
NOT_ONLY_SPACES = matches(NOT_ONLY_SPACES_PATTERN)


def not_only_spaces(value: str) -> bool:
    return bool(value.strip())


def entity_ok(value: str) -> bool:
    return entity_slug(value) is not None


@pytest.mark.parametrize(
    ("name", "pattern", "rule", "shape"),
    [
        ("label", LABEL_5, lambda v: clean_label(v, 5) is not None, "a{}b"),
        ("label edge", LABEL_5, lambda v: clean_label(v, 5) is not None, " {}"),
        ("word label", WORD, is_word_label, "a{}"),
        ("source id", SOURCE, is_source_id, "{}"),
        ("source id middle", SOURCE, is_source_id, "a{}b"),
        ("source id end", SOURCE, is_source_id, "a{}"),
        ("new source id", NEW_SOURCE, is_new_source_id, "{}"),
        ("new source id middle", NEW_SOURCE, is_new_source_id, "a{}b"),
        ("new source id end", NEW_SOURCE, is_new_source_id, "a{}"),
        ("slug start", SLUG, slug_ok, "{}"),
        ("slug middle", SLUG, slug_ok, "a{}b"),
        ("entity", ENTITY, entity_ok, "{}"),
        ("entity among separators", ENTITY, entity_ok, "-/{} "),
        ("page type", NOT_ONLY_SPACES, not_only_spaces, " {}\t"),
    ],
)
def test_pattern_agrees_with_the_rule_on_every_character(
    name: str, pattern: Callable[[str], bool], rule: Callable[[str], bool], shape: str
) -> None:
    disagree = [
        f"U+{ord(ch):04X} {unicodedata.category(ch)}"
        for ch in ASSIGNED
        if pattern(shape.format(ch)) != rule(shape.format(ch))
        # NFC may map a character to another that the pattern judges; the stored slug is the NFC form
        and not (name.startswith("slug") and unicodedata.normalize("NFC", ch) != ch)
    ]
    assert not disagree, f"{name}: {len(disagree)} characters: {disagree[:20]}"


EDGE_TEXT = st.text(alphabet=st.sampled_from(list(" \t\n\u00a0\u2028\u200b\x1fab/.-_é\u0301")), max_size=9)


@settings(max_examples=2000, deadline=None, database=None)
@given(EDGE_TEXT)
def test_patterns_agree_on_strings_around_the_edges(value: str) -> None:
    assert LABEL_5(value) == (clean_label(value, 5) is not None), repr(value)
    assert not value or WORD(value) == is_word_label(value), repr(value)  # length is its own rule
    assert not value or SOURCE(value) == is_source_id(value), repr(value)
    assert not value or NEW_SOURCE(value) == is_new_source_id(value), repr(value)
    assert ENTITY(value) == entity_ok(value), repr(value)
    assert NOT_ONLY_SPACES(value) == not_only_spaces(value), repr(value)
    nfc = unicodedata.normalize("NFC", value)
    assert SLUG(nfc) == slug_ok(nfc), repr(value)


def test_label_length_counts_the_value_as_sent() -> None:
    assert LABEL_5(" abc ") and clean_label(" abc ", 5) == "abc"
    assert not LABEL_5("  abcd  ") and clean_label("  abcd  ", 5) is None
    assert not LABEL_5("   ") and clean_label("   ", 5) is None


def _source_id_accepted(value: str) -> bool:
    try:
        return check_source_id(value) == value
    except ValueError as exc:
        assert "is not a source id" in str(exc) and "no '|'" in str(exc)
        return False


@settings(max_examples=1000, deadline=None, database=None)
@given(EDGE_TEXT)
def test_the_source_id_check_is_the_pattern_with_its_lengths(value: str) -> None:
    """The one check every entry point uses (a page, a search filter, a backfill, a key's sources)
    says what the document's pattern, minLength 1 and maxLength say."""
    assert _source_id_accepted(value) == bool(value and SOURCE(value)), repr(value)


def test_a_source_id_is_at_most_its_length() -> None:
    assert _source_id_accepted("s" * MAX_SOURCE_ID_LENGTH)
    assert not _source_id_accepted("s" * (MAX_SOURCE_ID_LENGTH + 1))
    assert _source_id_accepted("team a") and not _source_id_accepted("team|a")


def test_a_page_is_stored_only_under_a_printable_source_id() -> None:
    """Control, format (bidi overrides, zero-width joiners) and unassigned characters, and separators
    but the space, are refused for new pages; naming a source that holds one (a page stored before the
    rule, to erase it) is still allowed."""
    assert check_new_source_id("team a") == "team a" and check_new_source_id("équipe-ü") == "équipe-ü"
    for value in ("evil\x1b]0;owned\x07", "a\u202eb", "a\u200db", "a\u00a0b", "a\u2028b", "a\x00b"):
        with pytest.raises(ValueError, match="printable text"):
            check_new_source_id(value)
        assert check_source_id(value) == value
    with pytest.raises(ValueError, match=r"no '\|'"):
        check_new_source_id("a|b")


@given(st.text(alphabet="0123456789-n:|\n x", max_size=42))
@settings(max_examples=400, derandomize=True)
def test_the_entity_cursor_pattern_is_the_rule_the_facts_list_reads_it_by(value: str) -> None:
    """Every cursor the document's pattern takes is a place in the list (else the fuzzer's valid data
    was refused with a 422), and nothing else is."""
    from worker.extraction.facts import ENTITY_CURSOR_PATTERN, FactCursorError, _entity_cursor

    try:
        _entity_cursor(value)
        taken = True
    except FactCursorError:
        taken = False
    assert matches(ENTITY_CURSOR_PATTERN)(value) is taken
