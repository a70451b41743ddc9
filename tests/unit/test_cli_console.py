"""The CLI's console helpers: tables fold long words instead of cutting them."""

from __future__ import annotations

import io

from rich.console import Console

from worker.cli.console import folding_table


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
