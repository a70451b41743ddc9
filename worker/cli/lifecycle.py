"""`factmill facts history|unmerge|restore|consolidate`: the fact lifecycle from the command line."""

from __future__ import annotations

from typing import Annotated

import typer

from worker.cli.console import (
    counting_bar,
    err,
    fail,
    folding_table,
    id_argument,
    out,
    print_json,
    source_option,
    styled,
)
from worker.cli.processes import stops_on_signals
from worker.cli.sessions import checked_factory
from worker.config_store import CONSOLIDATION_ENABLED
from worker.consolidation.job import RunHere, consolidate_here
from worker.consolidation.operators import (
    UndoError,
    count_entity_facts,
    entities_named,
    entity_timeline,
    restore,
    unit_has_facts,
    unmerge,
)
from worker.consolidation.service import ConsolidationCounters
from worker.consolidation.store import unconsolidated_entity_keys
from worker.core.consolidation import typed_entity_key
from worker.runtime import build_runtime
from worker.settings import get_settings

STATUS_STYLE = {"current": "green", "superseded": "yellow", "duplicate": "dim"}


def _day(value: object) -> str:
    return value.isoformat(timespec="minutes") if hasattr(value, "isoformat") else "…"  # type: ignore[union-attr]


def _iso(value: object) -> str | None:
    return value.isoformat() if hasattr(value, "isoformat") else None  # type: ignore[union-attr]


def history(
    entity: Annotated[str, typer.Argument(help="The entity slug, e.g. people/alice-example.")],
    source_id: Annotated[str | None, source_option(help="Only facts from this source.")] = None,
    limit: Annotated[
        int, typer.Option(min=1, max=100_000, help="The latest this many facts (the timeline's end).")
    ] = 1000,
    as_json: Annotated[bool, typer.Option("--json")] = False,
) -> None:
    """An entity's timeline: every fact in the order it became true (the latest --limit of them).

    Each fact with its status, interval, links and the reason of its last decision."""
    sources = [source_id] if source_id else None
    with checked_factory()() as session:
        entries = entity_timeline(session, entity, sources, limit=limit)
        total = count_entity_facts(session, entity, sources) if len(entries) == limit else len(entries)
        named = [] if entries else entities_named(session, entity)
    if total > len(entries):
        err.print(f"the latest {len(entries)} of {total} facts; --limit shows more")
    if as_json:
        # An open end is null, as the API writes it ("…" is the table's way of saying it).
        print_json(
            [vars(e) | {"valid_from": _iso(e.valid_from), "valid_to": _iso(e.valid_to)} for e in entries]
        )
        return
    if not entries:
        hint = f"; did you mean {' or '.join(named)}?" if named else ""
        out.print(f"no facts about {entity!r}{hint}")
        return
    table = folding_table("id", "status", "valid", "fact", "link", "why", title=f"{entity} · timeline")
    for e in entries:
        link = (
            f"→ {e.superseded_by}" if e.superseded_by else (f"= {e.duplicate_of}" if e.duplicate_of else "")
        )
        style = STATUS_STYLE.get(e.status, "")
        table.add_row(
            str(e.id),
            styled((e.status, style)),
            f"{_day(e.valid_from)} → {_day(e.valid_to) if e.valid_to else 'now'}",
            e.fact,
            link,
            e.reason or "",
        )
    out.print(table)


def _undo(action: str, fact_id: int, by: str) -> None:
    step = unmerge if action == "unmerge" else restore
    try:
        with checked_factory().begin() as session:
            other = step(session, fact_id, by)
    except UndoError as exc:
        raise fail(str(exc), code=2) from exc
    out.print(undone(action, fact_id, other))


def undone(action: str, fact_id: int, other: int | None) -> str:
    """What an undo says; no ``other``: the fact it pointed at was deleted since (an erasure or a
    re-extraction), and it said "fact 0"."""
    verb = "unmerged from" if action == "unmerge" else "restored; it had been superseded by"
    named = f"fact {other}" if other is not None else "a fact since deleted"
    return f"fact {fact_id} is current again ({verb} {named}); recorded as an audit row"


def unmerge_command(
    fact_id: Annotated[int, id_argument("The duplicate fact's id.")],
    by: Annotated[str, typer.Option(help="Who undid the merge (recorded).")] = "cli",
) -> None:
    """Undo a duplicate decision: the fact is current again, on its own."""
    _undo("unmerge", fact_id, by)


def restore_command(
    fact_id: Annotated[int, id_argument("The superseded fact's id.")],
    by: Annotated[str, typer.Option(help="Who restored it (recorded).")] = "cli",
) -> None:
    """Undo a supersession: the fact is current again and its interval open."""
    _undo("restore", fact_id, by)


def _stop_unless_done(done: RunHere) -> None:
    """End the command (one line, no traceback) on a run that stopped: the kill switch turned off during
    it (3), a budget spent, the provider or an unusable reply (1; the job is left to retry or resume)."""
    if done.status in ("succeeded", "held", "lost"):  # one entity's: the others go on
        return
    said = f"consolidation stopped (job {done.job_id}, {done.status}): {done.note or 'no reason given'}"
    raise fail(said, code=3 if done.note and CONSOLIDATION_ENABLED in done.note else 1)


@stops_on_signals
def consolidate_command(
    source_id: Annotated[
        str | None,
        source_option(help="Only this source's facts (default: every source; 'default' with --entity)."),
    ] = None,
    entity: Annotated[
        str | None, typer.Option(help="Only this entity (or page:SLUG for a page's facts without one).")
    ] = None,
    override_disabled: Annotated[
        bool, typer.Option(help=f"Run even if {CONSOLIDATION_ENABLED} is off.")
    ] = False,
) -> None:
    """Consolidate the facts not yet consolidated, here and now (the workers do it after extraction).

    Refused while the consolidation.enabled kill switch is off, unless --override-disabled; turned off
    during the run, it stops the run (decisions already committed stay)."""
    settings = get_settings()
    factory = checked_factory(settings)
    runtime = build_runtime(settings, factory)
    if not override_disabled and not runtime.config.enabled(CONSOLIDATION_ENABLED):
        raise fail(
            f"consolidation is disabled ({CONSOLIDATION_ENABLED}=false). Turn it on with "
            f"`factmill config set {CONSOLIDATION_ENABLED} true`, or pass --override-disabled for a "
            "one-off run.",
            code=3,
        )

    total = ConsolidationCounters()
    held: list[str] = []
    try:
        with factory() as session:
            if entity:
                keys = [(source_id or "default", typed_entity_key(entity))]
                if not unit_has_facts(session, *keys[0]):  # a typo ran a job on nothing
                    meant = entities_named(session, entity)
                    hint = f"; did you mean {' or '.join(meant)}?" if meant else ""
                    raise fail(f"no facts about {entity!r} in source {keys[0][0]!r}{hint}", code=1)
            else:
                keys = unconsolidated_entity_keys(session, source_id)
        with counting_bar("entities", len(keys)) as advance:  # each may take many LLM calls
            for source, key in keys:
                done = consolidate_here(runtime, source, key, override_switch=override_disabled)
                _stop_unless_done(done)
                named = key if source_id is not None or entity else f"{source}|{key}"
                if done.status == "held":
                    held.append(f"{named} ({done.note}); a worker consolidates it")
                elif done.status == "lost":
                    held.append(f"{named} (its run stopped: {done.note})")
                total.facts_considered += int(done.counters.get("facts_considered", 0))
                total.llm_calls += int(done.counters.get("llm_calls", 0))
                for kind, n in dict(done.counters.get("decisions", {})).items():
                    total.decisions[kind] = total.decisions.get(kind, 0) + int(n)
                advance()
    finally:
        runtime.close()
    for entry in held:
        err.print(styled(("skipped:", "yellow"), f" {entry}"), highlight=False)
    decided = ", ".join(f"{n} {kind}" for kind, n in sorted(total.decisions.items())) or "nothing"
    out.print(
        f"{len(keys)} entit{'y' if len(keys) == 1 else 'ies'}, {total.facts_considered} fact(s): {decided}; "
        f"{total.llm_calls} LLM call(s)",
        highlight=False,
    )
