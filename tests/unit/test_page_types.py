"""`extraction.page_types`: which conversation page types extraction reads, and the values refused."""

from __future__ import annotations

import pytest

from worker.core.conversation import CONVERSATION_PAGE_TYPES, check_page_types, narrow_page_types


def test_unset_or_blank_means_every_conversation_type() -> None:
    assert narrow_page_types(None) == narrow_page_types("  ") == CONVERSATION_PAGE_TYPES


def test_a_narrowed_value_keeps_the_named_types_in_their_order() -> None:
    assert narrow_page_types(" Email, slack ,") == ("slack", "email")
    check_page_types(" Email, slack ,")  # the same value is accepted


@pytest.mark.parametrize(
    ("value", "said"),
    [
        ("slak", "'slak' is not one"),  # a typo would narrow extraction to nothing
        ("slack, notes", "'notes' is not one"),
        (",,,", "it names none"),
        ("", "it names none"),
    ],
)
def test_a_value_naming_no_known_type_is_refused(value: str, said: str) -> None:
    with pytest.raises(ValueError, match=r"extraction\.page_types must name some of conversation") as refused:
        check_page_types(value)
    assert said in str(refused.value) and "Unset it" in str(refused.value)


@pytest.mark.parametrize("stored", ["chats", "slack;email", "conversations"])
def test_a_stored_value_naming_no_type_narrows_nothing(stored: str) -> None:
    """Written past check_page_types (by hand, by an older release), such a value read as no type:
    every job found nothing to extract, and every changed page's facts were dropped."""
    assert narrow_page_types(stored) == CONVERSATION_PAGE_TYPES


def test_a_stored_value_the_rules_refuse_is_said_once_with_what_it_is_read_as(caplog) -> None:
    from worker.extraction.options import stored_page_types

    with caplog.at_level("WARNING"):
        assert stored_page_types("slack;email") == CONVERSATION_PAGE_TYPES
        assert stored_page_types("slack;email") == CONVERSATION_PAGE_TYPES
        assert stored_page_types("slack, email") == ("slack", "email")  # the rules take it: nothing said
    (said,) = [r.getMessage() for r in caplog.records if "extraction.page_types" in r.getMessage()]
    assert "read as " + ",".join(CONVERSATION_PAGE_TYPES) in said
