"""The page routes read a source id holding '/' from the raw path, under a --root-path prefix too."""

from __future__ import annotations

import pytest
from starlette.requests import Request

from worker.api.errors import ApiError
from worker.api.inputs import page_address


def request(raw_path: bytes, root_path: str = "") -> Request:
    return Request(
        {"type": "http", "method": "DELETE", "raw_path": raw_path, "root_path": root_path, "headers": []}
    )


@pytest.mark.parametrize("root", ["", "/api", "/api/"])
def test_the_source_is_read_from_the_raw_path_past_a_root_path(root: str) -> None:
    prefix = root.rstrip("/").encode()
    # Starlette split the decoded path team/a/notes as source team, slug a/notes.
    assert page_address(request(prefix + b"/v1/pages/team%2Fa/notes", root), "team", "a/notes") == (
        "team/a",
        "notes",
    )
    assert page_address(request(prefix + b"/v1/pages/team/a/notes", root), "team", "a/notes") == (
        "team",
        "a/notes",
    )
    with pytest.raises(ApiError) as refused:  # the raw source leaves no slug
        page_address(request(prefix + b"/v1/pages/team%2Fa", root), "team", "a")
    assert refused.value.status_code == 404


@pytest.mark.parametrize("raw", [b"/v1/v1/pages/team%2Fa/notes", b"/v1/pages/team%2Fa/notes"])
def test_a_root_path_that_begins_like_the_routes_is_stripped_only_when_the_raw_path_holds_it(
    raw: bytes,
) -> None:
    """A root of /v1 under a server that leaves it out of the raw path: stripped all the same, the raw
    path no longer began with /v1/pages/ and Starlette's decoded split stood."""
    assert page_address(request(raw, "/v1"), "team", "a/notes") == ("team/a", "notes")


@pytest.mark.parametrize(
    "raw", [b"/v1/%70ages/team%2Fa/notes", b"/v1%2Fpages/team%2Fa/notes", b"/%76%31/pages/team%2Fa/notes"]
)
def test_a_percent_encoded_prefix_still_reads_the_source_from_the_raw_path(raw: bytes) -> None:
    """Matched on its literal bytes, ``/v1/%70ages/...`` fell back to Starlette's decoded split, and
    DELETE erased page a/notes of source team."""
    assert page_address(request(raw), "team", "a/notes") == ("team/a", "notes")
    assert page_address(request(b"/api" + raw, "/api"), "team", "a/notes") == ("team/a", "notes")
