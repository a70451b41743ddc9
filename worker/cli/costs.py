"""`factmill costs`: LLM spend from llm_calls, grouped by job, model, purpose or day, batch vs online."""

from __future__ import annotations

import math
from datetime import UTC, datetime, timedelta
from typing import Annotated

import typer

from worker.accounting import reports
from worker.cli.console import fail, folding_table, iso_moment, out, print_json
from worker.cli.sessions import checked_factory


def costs(
    since: Annotated[
        datetime | None, typer.Option(parser=iso_moment, help="ISO date/time; default: the last 30 days.")
    ] = None,
    by: Annotated[str, typer.Option(help="Group by job, model, purpose or day.")] = "model",
    as_json: Annotated[bool, typer.Option("--json")] = False,
) -> None:
    """LLM spend from llm_calls: calls, tokens, the cached share of input tokens, and USD.

    Each group is split into batch (billed through a provider batch, at half price) and online calls."""
    if by not in reports.GROUPS:
        raise fail(f"--by must be one of {', '.join(reports.GROUPS)}", code=2)
    start = since or datetime.now(UTC) - timedelta(days=30)
    with checked_factory()() as session:
        rows = reports.spend(session, by=by, since=start)
    if as_json:
        print_json([r.as_dict() for r in rows])
        return
    title = f"LLM spend since {start.date().isoformat()}"
    table = folding_table(by, "mode", "calls", "input tokens", "cached", "output tokens", "USD", title=title)
    totals = [reports.total(rows, mode) for mode in (*reports.MODES, "all")]
    for r in [*rows, *totals]:
        table.add_row(
            r.key,
            r.mode,
            str(r.calls),
            str(r.input_tokens),
            f"{r.cached_share:.0%}",
            str(r.output_tokens),
            usd(r.cost_usd),
        )
    out.print(table)


def usd(amount: float) -> str:
    """Dollars to four places, or to two significant figures below a hundredth of a cent: a group of
    embedding calls costs millionths, and read 0.0000 as if nothing had been spent."""
    if amount == 0 or abs(amount) >= 0.0001:
        return f"{amount:.4f}"
    places = 1 - math.floor(math.log10(abs(amount)))
    return f"{amount:.{places}f}"
