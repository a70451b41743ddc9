"""The CLI's console helpers: tables fold long words instead of cutting them; stored text prints as it is."""

from __future__ import annotations

import io
import json
import re
from pathlib import Path

import pytest
from rich.console import Console

from worker.cli import console as cli_console
from worker.cli.console import TerminalConsole, folding_table, print_json, styled, visible
from worker.cli.costs import usd


def test_a_table_folds_a_long_word_onto_more_lines_and_never_cuts_it() -> None:
    """`config list` showed "extraction.page_typ…" at 80 columns: a key nobody could copy."""
    table = folding_table("key", "value")
    table.add_row("extraction.page_types", "conversation,meeting,slack,email,imessage")
    screen = io.StringIO()
    Console(file=screen, width=40, color_system=None).print(table)
    text = screen.getvalue()
    assert "…" not in text
    cells = "".join(line.split("│")[1].strip() for line in text.splitlines() if line.count("│") == 3)
    assert cells == "extraction.page_types"  # the first column, read down its lines


def _printed(*objects: object, **options: object) -> str:
    screen = io.StringIO()
    console = TerminalConsole()
    console.file = screen
    console.print(*objects, **options)  # type: ignore[arg-type]
    return screen.getvalue()


def test_strings_print_as_they_are_never_as_markup_or_emoji_codes() -> None:
    """Stored text read as markup: `[/quote]` raised MarkupError, `[x]` vanished, `:smile:` became 😄."""
    text = "- [x] done [/quote] [link=https://evil.example]click[/link] :smile:"
    assert _printed(text) == text + "\n"
    assert _printed(text, markup=True, emoji=True) == text + "\n"  # no call turns them back on
    table = folding_table("cell")
    table.add_row(text)
    assert "[/quote]" in _printed(table) and ":smile:" in _printed(table)


def test_characters_a_terminal_acts_on_are_shown_escaped() -> None:
    hostile = "a\x1b]0;title\x07b\x1b[2J\rc\x9bd\u202ee\x7f\tf\ng"
    assert visible(hostile) == "a\\x1b]0;title\\x07b\\x1b[2J\\x0dc\\x9bd\\u202ee\\x7f\tf\ng"
    assert visible("café ✓ 日本 👩‍💻") == "café ✓ 日本 👩‍💻"  # letters, symbols and joined emoji stay
    printed = _printed(hostile)
    assert "\x1b" not in printed and "\\x1b[2J" in printed
    line = styled(("warning:", "yellow"), " \x1b[1A [/x]")
    assert line.plain == "warning: \\x1b[1A [/x]" and line.spans[0].style == "yellow"


def test_json_output_escapes_what_a_terminal_acts_on_and_stays_the_same_json(capsys) -> None:  # type: ignore[no-untyped-def]
    value = {"source_id": "a\x1b\u202eb\x85 café"}
    print_json(value, ensure_ascii=False)
    written = capsys.readouterr().out
    assert "\x1b" not in written and "\u202e" not in written and "\x85" not in written and "café" in written
    assert json.loads(written) == value


def test_no_cli_module_writes_rich_markup() -> None:
    """The consoles print markup literally now: a `[bold]...[/]` left in a message would show as is."""
    sources = Path(cli_console.__file__).parent.glob("*.py")
    offenders = [
        p.name for p in sources if re.search(r"\[/\]|\[(bold|dim|red|yellow|green|strike)\]", p.read_text())
    ]
    assert offenders == []


@pytest.mark.parametrize(
    ("amount", "shown"),
    [(0.0, "0.0000"), (1.5, "1.5000"), (0.0001, "0.0001"), (0.00001234, "0.000012"), (5.1e-8, "0.000000051")],
)
def test_costs_shows_a_spend_of_millionths_rather_than_zero(amount: float, shown: str):
    assert usd(amount) == shown


@pytest.mark.parametrize(
    ("stdin", "ci", "asked"),
    [
        (True, None, True),
        (True, "true", False),  # a CI step in a pseudo-terminal: nobody answers
        (True, "1", False),
        (True, "false", True),
        (False, None, False),
    ],
)
def test_a_destructive_command_asks_only_where_someone_can_answer(
    monkeypatch: pytest.MonkeyPatch, stdin: bool, ci: str | None, asked: bool
) -> None:
    """Only stdin was checked: a CI step run in a pseudo-terminal (Buildkite's default, `docker run -t`)
    waited for an answer to "Erase page ...?" until the job timed out."""
    from worker.cli import console

    monkeypatch.setattr(console.sys.stdin, "isatty", lambda: stdin)
    if ci is None:
        monkeypatch.delenv("CI", raising=False)
    else:
        monkeypatch.setenv("CI", ci)
    assert console._interactive() is asked


def test_a_question_that_would_go_to_a_redirected_stderr_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    """At a terminal with stderr redirected (`erase ... 2>erase.log`), the question went to the file
    while the command waited on stdin: a silent hang. It is refused, saying to pass --yes."""
    import typer

    from worker.cli import console

    monkeypatch.setattr(console.sys.stdin, "isatty", lambda: True)
    monkeypatch.setattr(console, "_stderr_seen", lambda: False)
    monkeypatch.delenv("CI", raising=False)
    with pytest.raises(typer.Exit) as refused:
        console.confirmed("Erase page x?", yes=False)
    assert refused.value.exit_code == 2
    assert console.confirmed("Erase page x?", yes=True)


def test_a_question_reaches_the_terminal_through_a_pipe_not_through_a_file(
    monkeypatch: pytest.MonkeyPatch, tmp_path
) -> None:
    """`erase ... 2>&1 | tee log` at a terminal is asked (the question reaches it through tee); stderr
    going to a file is not (the question would go unseen: refused, asking for --yes)."""
    import os

    from worker.cli import console

    read_end, write_end = os.pipe()
    with open(write_end, "w") as piped, open(tmp_path / "err.log", "w") as logged:
        monkeypatch.setattr(console.sys, "stderr", piped)
        assert console._stderr_seen()
        monkeypatch.setattr(console.sys, "stderr", logged)
        assert not console._stderr_seen()
    os.close(read_end)
