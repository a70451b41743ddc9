"""The strict JSON reading every body goes through (worker.api.inputs): what it refuses and what it costs."""

from __future__ import annotations

import tracemalloc

import pytest

from worker.api.errors import ApiError
from worker.api.inputs import MAX_JSON_DEPTH, check_json_text, strict_json_loads


@pytest.mark.parametrize(
    ("body", "where"),
    [
        ('{"a": [1, {"b\\u0000": 1}]}', "a[1]: a key must not contain NUL"),
        ('{"a": [1, 2, "x\\ud800"]}', "a[2]: must not contain lone surrogates"),
        ("[[[1]], NaN]", "[1]: Input should be a finite number"),
        ('{"a": {"b": [1, [2, "\\u0000"]]}, "c": 1}', "a.b[1][1]: must not contain NUL"),
        ('{"a": {"b": [1, [2, 3]]}, "c": "\\u0000"}', "c: must not contain NUL"),
        ('"\\u0000"', "body: must not contain NUL"),
        ("[" * (MAX_JSON_DEPTH + 1) + "]" * (MAX_JSON_DEPTH + 1), "[0]" * MAX_JSON_DEPTH + ": nested deeper"),
    ],
)
def test_a_problem_is_named_by_its_json_path(body: str, where: str) -> None:
    with pytest.raises(ApiError) as refused:
        strict_json_loads(body.encode())
    assert refused.value.status_code == 422 and str(refused.value.detail).startswith(where)


def test_the_deepest_allowed_nesting_and_a_path_given_by_the_caller() -> None:
    strict_json_loads(("[" * MAX_JSON_DEPTH + "]" * MAX_JSON_DEPTH).encode())
    with pytest.raises(ApiError) as refused:
        check_json_text({"k": ["\x00"]}, ["body", "settings"])
    assert str(refused.value.detail).startswith("body.settings.k[0]:")


def test_the_walk_holds_no_more_than_its_open_containers() -> None:
    # A stack of every member with its own path list took about 90 times the body: a 25 MiB array of
    # zeros (any ingest key, before the page count was checked) reached gigabytes.
    values = [[0] * 1000 for _ in range(1000)]
    tracemalloc.start()
    try:
        check_json_text({"pages": values})
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 64 * 1024, peak
