"""Page files' front matter: YAML read without aliases and only so deep."""

from __future__ import annotations

import re
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


@pytest.mark.parametrize(
    ("front_matter", "said"),
    [
        ("type: conversation\nslug: 007", "front matter 'slug' must be text, got 7; quote it"),
        ("type: conversation\nsource_id:", "front matter 'source_id' must be text, got nothing"),
        ("type:", "front matter 'type' must be text, got nothing"),
        ("type: 2024-01-01", "front matter 'type' must be text, got datetime.date(2024, 1, 1)"),
    ],
    ids=["number slug", "blank source", "blank type", "date type"],
)
def test_a_key_yaml_reads_as_no_text_is_refused(tmp_path: Path, front_matter: str, said: str) -> None:
    """Stored as str() of what YAML made of it: slug "7" for 007, a blank source_id as source "None"
    (over --source), a blank type as a page of type "none" that extraction never read."""
    path = tmp_path / "page.md"
    path.write_text(f"---\n{front_matter}\n---\nbody\n")
    with pytest.raises(PageFileError, match=f"^{re.escape(said)}"):
        load_page_file(path, source_id="s")
    path.write_text('---\ntype: conversation\nslug: "007"\nsource_id: "s2"\n---\nbody\n')
    page = load_page_file(path, source_id="s")
    assert (page.source_id, page.slug, page.type) == ("s2", "007", "conversation")


def test_front_matter_past_its_cap_is_refused_before_it_is_parsed(tmp_path: Path) -> None:
    """PyYAML parses in pure Python: 2 MB of front matter took 19 s and 676 MB, and the file cap let
    25 MiB through, so one file could stop a whole ingest (and every rerun, at the same file)."""
    from worker.extraction.ingest import MAX_FRONT_MATTER_BYTES

    values = ",".join(["0"] * (MAX_FRONT_MATTER_BYTES // 2))
    with pytest.raises(PageFileError, match=r"front matter is [\d,]+ bytes, over its cap of 65,536"):
        load_page_file(page_file(tmp_path, f"k: [{values}]"))
    under = ",".join(["0"] * (MAX_FRONT_MATTER_BYTES // 2 - 40))  # just under: read as before
    assert len(load_page_file(page_file(tmp_path, f"k: [{under}]")).frontmatter["k"]) > 30_000


@pytest.mark.timeout(30)
def test_a_named_pipe_or_a_device_is_refused_without_waiting(tmp_path: Path) -> None:
    """Opening a named pipe for reading waits for a writer (and a terminal's read for a line): named on
    the ingest command line, one hung the run forever, the files after it never ingested."""
    import os

    fifo = tmp_path / "pipe.md"
    os.mkfifo(fifo)
    with pytest.raises(PageFileError, match=r"not a regular file \(a named pipe\)"):
        load_page_file(fifo)
    with pytest.raises(PageFileError, match=r"not a regular file \(a character device\)"):
        load_page_file(Path("/dev/zero"))  # endless: refused before the cap is read


def test_an_indented_marker_inside_a_block_does_not_close_the_front_matter(tmp_path: Path) -> None:
    """A '---' line indented inside a block value closed the front matter there: the value was cut,
    and the rest of the front matter went into the body without a word."""
    page = load_page_file(page_file(tmp_path, "notes: |\n  first\n  ---\n  more\ntitle: Weekly"))
    assert page.frontmatter["notes"] == "first\n---\nmore\n" and page.title == "Weekly"
    assert page.compiled_truth == "body\n"


@pytest.mark.parametrize("title", ["On", "no", "1:30", "3.10", "0x1F", "2024-06-01", "1984", "Weekly notes"])
def test_a_title_is_stored_as_written(tmp_path: Path, title: str) -> None:
    """YAML 1.1 read "title: On" as True, "no" as False (stored empty), "1:30" as 90, "3.10" as 3.1 and
    "0x1F" as 31: the stored title, and the model's page label, said so."""
    assert load_page_file(page_file(tmp_path, f"title: {title}")).title == title
    assert load_page_file(page_file(tmp_path, "title:")).title == ""
    assert load_page_file(page_file(tmp_path, 'title: "On"')).title == "On"


@pytest.mark.parametrize(
    ("front_matter", "said"),
    [
        ("title: [a, b]", "got ['a', 'b']"),
        ("title: {x: 1}", "got {'x': 1}"),
        ("title: !!float '1e5'", "got 100000.0"),
    ],
)
def test_a_title_that_is_no_text_is_refused(tmp_path: Path, front_matter: str, said: str) -> None:
    with pytest.raises(PageFileError, match=re.escape(f"front matter 'title' must be text, {said}")):
        load_page_file(page_file(tmp_path, front_matter))


def test_a_repeated_title_is_its_last_as_yaml_reads_it(tmp_path: Path) -> None:
    assert load_page_file(page_file(tmp_path, "title: Draft\ntitle: 'Final'")).title == "Final"
    assert load_page_file(page_file(tmp_path, "title: 'Draft'\ntitle: 3.10")).title == "3.10"
