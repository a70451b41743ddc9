"""`factmill facts`: the facts extracted from one page."""

from __future__ import annotations

from typing import Annotated, Any

import typer
from rich.table import Table
from sqlalchemy import select
from sqlalchemy.orm import Session

from models import Fact
from worker.cli import lifecycle
from worker.cli.console import out, print_json
from worker.cli.sessions import checked_factory
from worker.extraction import PER_SEGMENT_SOURCE_PREFIX

facts_app = typer.Typer(help="Read extracted facts.", no_args_is_help=True)


def _facts_for(session: Session, slug: str, source_id: str) -> list[dict[str, Any]]:
    rows = session.scalars(
        select(Fact)
        .where(
            Fact.source_id == source_id,
            Fact.source_markdown_slug == slug,
            Fact.source == PER_SEGMENT_SOURCE_PREFIX,
        )
        .order_by(Fact.row_num)
    )
    return [
        {
            "row_num": f.row_num,
            "fact": f.fact,
            "kind": f.kind,
            "entity": f.entity_slug,
            "confidence": f.confidence,
            "notability": f.notability,
            "context": f.context,
            "metric": f.claim_metric,
            "value": f.claim_value,
            "unit": f.claim_unit,
            "period": f.claim_period,
        }
        for f in rows
    ]


@facts_app.command("list")
def facts_list(
    slug: Annotated[str, typer.Option(help="The page whose facts to list.")],
    source_id: Annotated[str, typer.Option()] = "default",
    as_json: Annotated[bool, typer.Option("--json")] = False,
) -> None:
    """The facts extracted from one page, in row order."""
    with checked_factory()() as session:
        facts = _facts_for(session, slug, source_id)
    if as_json:
        print_json(facts, ensure_ascii=False)
        return
    table = Table("#", "kind", "fact", "entity", "conf", title=slug)
    for f in facts:
        table.add_row(str(f["row_num"]), f["kind"], f["fact"], f["entity"] or "", f"{f['confidence']:.2f}")
    out.print(table)


facts_app.command("history")(lifecycle.history)
facts_app.command("unmerge")(lifecycle.unmerge_command)
facts_app.command("restore")(lifecycle.restore_command)
facts_app.command("consolidate")(lifecycle.consolidate_command)
