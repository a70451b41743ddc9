"""What Postgres can store, for text a model wrote: made storable rather than refused."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from worker.core.jsonvalues import made_storable, text_problem


def test_nul_goes_and_a_lone_surrogate_becomes_the_replacement_character():
    assert made_storable("a\x00b\x00") == "ab"
    assert made_storable("a\ud800b\udfff") == "a\ufffdb\ufffd"
    assert made_storable("café 😀") == "café 😀"


@given(st.text())
def test_anything_made_storable_can_be_stored_and_storable_text_is_kept(text: str):
    stored = made_storable(text)
    assert text_problem(stored) is None
    if text_problem(text) is None:
        assert stored == text
