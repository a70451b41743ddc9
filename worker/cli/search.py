"""`factmill search` and `factmill embed`: search the facts, and backfill their embeddings."""

from __future__ import annotations

import sys
from datetime import datetime
from typing import Annotated

import typer
from rich.console import RenderableType

from worker.cli.console import (
    counting_bar,
    err,
    fail,
    folding_table,
    iso_moment,
    out,
    print_json,
    source_option,
    styled,
)
from worker.cli.processes import stops_on_signals
from worker.cli.sessions import checked_factory
from worker.core.intent import QueryParseError
from worker.core.jsonvalues import text_problem
from worker.llm.errors import BudgetExhaustedError, LLMError
from worker.runtime import build_runtime
from worker.search import (
    MAX_LIMIT,
    EmbeddingFailedError,
    EmbedReport,
    SearchError,
    SearchOutcome,
    VectorSearchUnavailableError,
    count_facts_to_embed,
    embed_facts,
    search_as,
)
from worker.settings import get_settings


def _fail(message: str, code: int = 1) -> typer.Exit:
    return fail(message, code, highlight=False)


def _print_outcome(outcome: SearchOutcome) -> None:
    how = "query document" if outcome.structured else "plain query"
    if outcome.strong_signal:
        how += ", strong lexical signal: not expanded"
    elif outcome.expanded:
        how += ", expanded by the LLM"
    intent = f" · intent: {outcome.intent}" if outcome.intent else ""
    err.print(
        f"{len(outcome.results)} result(s) in {outcome.took_ms:.0f} ms ({how}; vector search "
        f"{outcome.vector_search}){intent}",
        highlight=False,
    )
    for note in outcome.notes:
        err.print(f"note: {note}", highlight=False)
    if not outcome.results:
        return
    # With --include-history, a superseded fact read as the current one beside it ("lives in Lisbon" and
    # "lives in Porto"): the status and its link are shown whenever a result is not current.
    lifecycle = any(result.status != "current" for result in outcome.results)
    columns = ("#", "score", "fact", "kind", "page · row", "conf", *(("status",) if lifecycle else ()))
    table = folding_table(*columns, show_lines=True)
    for rank, result in enumerate(outcome.results, start=1):
        snippet = result.snippet.split("\n", 1)
        shown = styled(f"{result.fact}\n", (f"{snippet[0]}\n{snippet[1] if len(snippet) > 1 else ''}", "dim"))
        cells: list[RenderableType] = [str(rank), f"{result.score:.3f}", shown, result.kind]
        cells += [f"{result.page_slug} · {result.row_num}", f"{result.confidence:.2f}"]
        if lifecycle:
            link = result.superseded_by or result.duplicate_of
            cells.append(
                f"{result.status} {'→' if result.superseded_by else '='} {link}" if link else result.status
            )
        table.add_row(*cells)
    out.print(table)


def read_document() -> str:
    """The query document on standard input, as UTF-8 text a query can carry: a NUL (psycopg refuses
    it), bytes that are not UTF-8 or a lone surrogate were tracebacks, after the embedding was paid."""
    data = sys.stdin.buffer.read()
    try:
        document = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise _fail(f"standard input is not UTF-8 text (byte {exc.start + 1})", code=2) from None
    problem = text_problem(document)
    if problem is not None:
        raise _fail(f"the query document on standard input {problem}", code=2)
    return document


def search_command(
    query: Annotated[
        str,
        typer.Argument(
            help="A plain query, or a document of lex:/vec:/hyde:/intent: lines (a literal \\n separates "
            "lines; - reads the document from standard input)."
        ),
    ],
    intent: Annotated[
        str | None, typer.Option(help="What you are after; steers expansion and snippets.")
    ] = None,
    source_id: Annotated[str | None, source_option(help="Only facts from this source.")] = None,
    entity: Annotated[str | None, typer.Option(help="Only facts about this entity slug.")] = None,
    kind: Annotated[str | None, typer.Option(help="event, preference, commitment, belief or fact.")] = None,
    since: Annotated[
        datetime | None,
        typer.Option(parser=iso_moment, help="Only facts valid (or written) since then (ISO date/time)."),
    ] = None,
    limit: Annotated[int | None, typer.Option(min=1, max=MAX_LIMIT, help="Results to show.")] = None,
    no_expand: Annotated[bool, typer.Option("--no-expand", help="Never ask the LLM to expand.")] = False,
    include_history: Annotated[
        bool, typer.Option("--include-history", help="Also superseded and duplicate facts.")
    ] = False,
    as_of: Annotated[
        datetime | None,
        typer.Option(
            parser=iso_moment,
            help="Only facts true at this time (ISO date/time); a duplicate never is, and --include-history "
            "is not read beside it.",
        ),
    ] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print the full result as JSON.")] = False,
) -> None:
    """Search the facts: lexical, vector and LLM-expanded, fused, with intent-aware snippets."""
    document = read_document() if query == "-" else query.replace("\\n", "\n")
    settings = get_settings()
    runtime = build_runtime(settings, checked_factory(settings))
    try:
        # As the API and the MCP server search (the readers' budget, the runtime's ledger), for every
        # source: the work client checked extraction's budget while the calls were booked to readers'.
        outcome = search_as(
            runtime,
            None,
            document,
            intent=intent,
            source_id=source_id,
            entity=entity,
            kind=kind,
            since=since,
            limit=limit,
            expand=not no_expand,
            include_history=include_history,
            as_of=as_of,
        )
    except QueryParseError as exc:
        raise _fail(str(exc), code=2) from exc
    except VectorSearchUnavailableError as exc:
        raise _fail(str(exc), code=3) from exc
    except SearchError as exc:
        raise _fail(str(exc), code=2) from exc
    except (EmbeddingFailedError, BudgetExhaustedError) as exc:
        raise _fail(str(exc), code=1) from exc
    finally:
        runtime.close()
    if as_json:
        print_json(outcome.as_dict(), ensure_ascii=False)
        return
    _print_outcome(outcome)


@stops_on_signals
def embed_command(
    batch_size: Annotated[
        int | None, typer.Option(min=1, max=2048, help="Facts per embedding call (default from settings).")
    ] = None,
    reembed: Annotated[
        bool,
        typer.Option(
            "--reembed",
            help="Embed every fact again, replacing its vector: after a change of embedding model (a "
            "search compares a query only with vectors of its own model).",
        ),
    ] = False,
) -> None:
    """Embed every fact that has no embedding yet (and set up the pgvector store when the server has it)."""
    settings = get_settings()
    factory = checked_factory(settings)
    runtime = build_runtime(settings)
    # A bar (a million facts printed about 3,900 lines, one a batch, with no total); a --reembed run's
    # total counts every fact, those its model already made too (skipped, not counted as they go).
    # Counted only for a bar that shows (a count of every fact, no index: a script's run pays none).
    total = count_facts_to_embed(factory, every=reembed) if err.is_terminal else None
    try:
        with counting_bar("facts embedded", total) as moved:

            def progress(report: EmbedReport) -> None:
                moved(completed=report.embedded + report.skipped)

            report = embed_facts(
                factory,
                runtime.llm,
                batch_size or settings.search_embed_batch_size,
                progress=progress,
                every=reembed,
            )
    except (SearchError, LLMError) as exc:  # LLMError: no embeddings API, the provider, a spent budget
        raise _fail(str(exc)) from exc
    finally:
        runtime.close()
    out.print(
        f"embedded {report.embedded} fact(s); vector search {report.vector_search}"
        + ("" if report.vector_search == "available" else " (pgvector is not installed on the server)"),
        highlight=False,
    )
