"""The CLI prints stored text (chosen by webhook senders and models) as it is: never as Rich markup,
emoji codes or terminal control sequences."""

from __future__ import annotations

import json

from sqlalchemy import update

from models import Job
from tests.e2e.test_cli import cli  # noqa: F401  (the fixture)
from worker.extraction.pages import PageIn, store_page

# A source id and a title a webhook sender chose: a closing tag with no opening one (Rich's markup
# parser raised MarkupError on it, so `pages list` and `jobs list` ended in a traceback for everyone),
# an OSC sequence that sets the terminal's title, a bidirectional override. New pages can no longer be
# stored under such a source id (it must be printable), but pages stored before that rule still are.
SOURCE = "team[/quote]\x1b]0;owned\x07\u202e"
TITLE = "[link=https://evil.example]click[/link] :smile:"
# A conversation whose text reaches facts and snippets: a markdown checkbox ("[x]" vanished as a
# style), a closing tag, an emoji code, and CSI sequences that clear the screen and move up a line.
BODY = (
    "**Ann** (2024-03-01 9:00 AM): I moved to Berlin - [x] done [/b] :smile: \x1b[2J\x1b[1A\r\n"
    "**Bob** (2024-03-01 9:05 AM): Ann moved to Berlin last week [/b] \x1b[2J\n"
)


def _no_terminal_controls(text: str) -> None:
    assert not any(ch in text for ch in "\x1b\x07\r\u202e"), repr(text)


def _column(table: str, index: int) -> str:
    """A table's column read down its lines (Rich folds long cells over several), borders dropped."""
    rows = [line.split("│") for line in table.splitlines() if line.count("│") > 2]
    return "".join(cells[index].strip() for cells in rows)


def test_stored_text_is_printed_literally_and_never_acts_on_the_terminal(cli, factory):  # noqa: F811
    with factory.begin() as session:
        stored_before_the_rule = PageIn.model_construct(
            source_id=SOURCE, slug="notes/hostile", type="conversation", title=TITLE, compiled_truth=BODY
        )
        job = store_page(session, stored_before_the_rule)
        assert job is not None
        session.execute(update(Job).where(Job.id == job.job_id).values(last_error="boom [/x] \x1b[31mred"))

    pages = cli("pages", "list")
    _no_terminal_controls(pages.stdout + pages.stderr)
    assert _column(pages.stdout, 1) == "team[/quote]\\x1b]0;owned\\x07\\u202e"

    jobs = cli("jobs", "list")
    _no_terminal_controls(jobs.stdout + jobs.stderr)
    assert _column(jobs.stdout, 3) == "team[/quote]\\x1b]0;owned\\x07\\u202e|notes/hostile"
    assert _column(jobs.stdout, 7) == "boom [/x]\\x1b[31mred"
    shown = cli("jobs", "show", str(job.job_id))
    assert json.loads(shown.stdout)["last_error"] == "boom [/x] \x1b[31mred"  # JSON keeps the value

    extracted = json.loads(cli("extract", "--source-id", SOURCE, "--json").stdout)
    assert extracted["facts_inserted"] > 0
    found = cli("search", "lex: Berlin", "--source-id", SOURCE, "--no-expand")
    _no_terminal_controls(found.stdout + found.stderr)
    assert "[x]done[/b]:smile:\\x1b[2J\\x1b[1A" in _column(found.stdout, 3).replace(" ", "")

    listed = cli("pages", "list", "--json")
    # JSON escapes C0 controls itself; the bidirectional override is escaped too, still the same JSON.
    assert "\u202e" not in listed.stdout and "\\u202e" in listed.stdout
    assert json.loads(listed.stdout)["pages"][0]["source_id"] == SOURCE


def test_ingest_refuses_a_source_id_that_is_not_printable_before_reading_a_file(cli, tmp_path):  # noqa: F811
    page = tmp_path / "a.md"
    page.write_text("---\nslug: notes/a\ntype: conversation\n---\n**Ann** (2024-03-01 9:00 AM): hi\n")
    refused = cli("ingest", str(page), "--source-id", "team\x1b]0;owned\x07", check=False)
    assert refused.returncode == 2 and "printable text" in refused.stderr
    _no_terminal_controls(refused.stdout + refused.stderr)  # the refusal shows the id escaped
    assert json.loads(cli("pages", "list", "--json").stdout)["pages"] == []
