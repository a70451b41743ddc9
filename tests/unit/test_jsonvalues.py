"""What Postgres can store, for text a model or a provider wrote: made storable rather than refused."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from worker.core.jsonvalues import made_storable, text_problem
from worker.extraction.rows import errors_of
from worker.extraction.segments import Attempt


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


def test_an_attempt_s_error_is_stored_without_a_nul():
    """A batch result's error is built from the provider's words directly (not through the gateway):
    the audit and llm_calls rows store it made storable."""
    attempts = [Attempt("provider_error", None, [], "HTTP 400: a\x00b"), Attempt("ok", None, [])]
    assert errors_of(attempts, None) == ["HTTP 400: ab", None]
    assert errors_of(attempts, "note") == ["HTTP 400: ab; note", "note"]


def test_nesting_depth_counts_mappings_and_lists_without_recursing() -> None:
    from worker.core.jsonvalues import nesting_depth

    assert [nesting_depth(v) for v in (1, "x", {}, [], {"a": [1]}, [[], [[{}]]])] == [0, 0, 1, 1, 2, 4]
    deep: list[object] = []
    for _ in range(50_000):  # past the interpreter's recursion limit
        deep = [deep]
    assert nesting_depth(deep) == 50_001
