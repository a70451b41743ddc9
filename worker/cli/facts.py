"""`factmill facts`: the facts extracted from one page."""

from __future__ import annotations

from typing import Annotated, Any

import typer

from models.reads import one_snapshot
from worker.cli import lifecycle
from worker.cli.console import err, fail, folding_table, out, print_json, source_option
from worker.cli.sessions import checked_factory
from worker.consolidation.history import Lifecycle
from worker.extraction.facts import FactRecord, read_page_facts

facts_app = typer.Typer(help="Read extracted facts.", no_args_is_help=True)
# The most `facts list` prints (the API's largest page); a page with more says how many it has.
DEFAULT_LISTED = 10_000
MAX_LISTED = 1_000_000


def _as_row(fact: FactRecord, with_status: bool) -> dict[str, Any]:
    row = {
        "row_num": fact.row_num,
        "fact": fact.fact,
        "kind": fact.kind,
        "entity": fact.entity_slug,
        "confidence": fact.confidence,
        "notability": fact.notability,
        "context": fact.context,
        "metric": fact.claim_metric,
        "value": fact.claim_value,
        "unit": fact.claim_unit,
        "period": fact.claim_period,
    }
    if not with_status:
        return row
    # The ids `facts unmerge` and `facts restore` take, and the links: a page-level fact (no entity) is
    # in no entity's `facts history`, so a wrong merge of one could not be undone from the CLI.
    links = {"superseded_by": fact.superseded_by, "duplicate_of": fact.duplicate_of}
    return {"id": fact.id} | row | {"status": fact.status} | links


@facts_app.command("list")
def facts_list(
    slug: Annotated[str, typer.Option(help="The page whose facts to list.")],
    source_id: Annotated[str, source_option(help="The page's source.")] = "default",
    history: Annotated[
        bool, typer.Option("--history", help="Also superseded and duplicate facts, with their status.")
    ] = False,
    limit: Annotated[
        int, typer.Option(min=1, max=MAX_LISTED, help="The first this many facts, in row order.")
    ] = DEFAULT_LISTED,
    as_json: Annotated[bool, typer.Option("--json")] = False,
) -> None:
    """The facts extracted from one page, in row order (current ones, as GET /v1/pages/.../facts).

    The first --limit of them; a note on stderr says when there are more."""
    with one_snapshot(checked_factory()) as session:  # its total and its rows agree
        found = read_page_facts(
            session, source_id, slug, limit=limit, lifecycle=Lifecycle(include_history=history)
        )
    if found is None:
        raise fail(f"no page {slug!r} in source {source_id!r}")
    facts = [_as_row(fact, history) for fact in found.facts]
    more = (
        f"the first {len(facts)} of {found.total} facts; --limit shows more"
        if found.total > len(facts)
        else None
    )
    if as_json:
        print_json(facts, ensure_ascii=False)
        if more:  # a script reading stdout sees a list either way: the note is on stderr, as history's
            err.print(more)
        return
    lifecycle_columns = ["status", "id", "link"] if history else []
    table = folding_table("#", "kind", "fact", "entity", "conf", *lifecycle_columns, title=slug)
    for f in facts:
        cells = [str(f["row_num"]), f["kind"], f["fact"], f["entity"] or "", f"{f['confidence']:.2f}"]
        if history:
            link = f"→ {f['superseded_by']}" if f["superseded_by"] else ""
            cells += [
                f["status"],
                str(f["id"]),
                link or (f"= {f['duplicate_of']}" if f["duplicate_of"] else ""),
            ]
        table.add_row(*cells)
    out.print(table)
    if more:
        err.print(more)


facts_app.command("history")(lifecycle.history)
facts_app.command("unmerge")(lifecycle.unmerge_command)
facts_app.command("restore")(lifecycle.restore_command)
facts_app.command("consolidate")(lifecycle.consolidate_command)
