"""Page files' front matter: YAML read without aliases and only so deep."""

from __future__ import annotations

from pathlib import Path

import pytest

from worker.extraction.ingest import MAX_FRONT_MATTER_DEPTH, PageFileError, load_page_file


def page_file(tmp_path: Path, front_matter: str) -> Path:
    path = tmp_path / "page.md"
    path.write_text(f"---\ntype: conversation\n{front_matter}\n---\nbody\n")
    return path


def nested(levels: int) -> str:
    return "x: " + "[" * levels + "1" + "]" * levels


def test_front_matter_keeps_its_values_up_to_the_depth_cap(tmp_path: Path) -> None:
    page = load_page_file(page_file(tmp_path, "owner: &o Alice\ntags: [a, {b: [c]}]"), source_id="s")
    assert page.frontmatter == {"owner": "Alice", "tags": ["a", {"b": ["c"]}]}  # an anchor alone is fine
    # The mapping of the front matter is the first level, so a value may nest one level less.
    deepest = load_page_file(page_file(tmp_path, nested(MAX_FRONT_MATTER_DEPTH - 1)))
    value = deepest.frontmatter["x"]
    for _ in range(MAX_FRONT_MATTER_DEPTH - 1):
        value = value[0]
    assert value == 1
    with pytest.raises(PageFileError, match=f"nests deeper than {MAX_FRONT_MATTER_DEPTH} levels"):
        load_page_file(page_file(tmp_path, nested(MAX_FRONT_MATTER_DEPTH)))


@pytest.mark.parametrize(
    ("front_matter", "line"),
    [("a: &a [x, x]\nb: *a", 4), ("base: &b {k: v}\nother:\n  <<: *b", 5)],
    ids=["alias", "merge key"],
)
def test_an_alias_is_refused_with_its_line(tmp_path: Path, front_matter: str, line: int) -> None:
    with pytest.raises(PageFileError, match=rf"front matter uses a YAML alias \(line {line}\)"):
        load_page_file(page_file(tmp_path, front_matter))


@pytest.mark.parametrize(
    ("front_matter", "problem"),
    [
        ("x: .inf", "x: inf is not a JSON number"),
        ("x: [1, .nan]", "x[1]: nan is not a JSON number"),
        ("x: {y: 1.0e+400}", "x.y: inf is not a JSON number"),
        ("x: !!binary aGVsbG8=", "x: a bytes value has no JSON form"),
        ("x: !!set {a, b}", "x: a set value has no JSON form"),
    ],
    ids=["inf", "nan", "past-a-double", "binary", "set"],
)
def test_a_value_json_cannot_hold_is_refused_for_that_file(
    tmp_path: Path, front_matter: str, problem: str
) -> None:
    """The front matter is stored as JSON: `x: .inf` ended the whole `factmill ingest` in the database's
    'Token "Infinity" is invalid' traceback, and a set in a TypeError."""
    with pytest.raises(PageFileError) as refused:
        load_page_file(page_file(tmp_path, front_matter))
    assert str(refused.value) == f"frontmatter: {problem} (front matter is stored as JSON)"
