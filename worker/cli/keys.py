"""`factmill keys`: create (shown once), list (prefixes only) and revoke API keys."""

from __future__ import annotations

import sys
from datetime import datetime
from typing import Annotated, Any

import typer

from models import ApiKey
from worker.access import SCOPES, KeyStoreError, create_key, list_keys, revoke_key
from worker.cli.console import err, fail, folding_table, id_argument, out, print_json, when
from worker.cli.sessions import checked_factory

keys_app = typer.Typer(help="API keys: who may read, ingest or administer.", no_args_is_help=True)


@keys_app.command("create")
def keys_create(
    name: Annotated[str, typer.Argument(help="Who or what will use the key.")],
    scope: Annotated[
        list[str],
        typer.Option("--scope", help=f"Repeatable: {', '.join(SCOPES)} (admin implies all)."),
    ],
    source: Annotated[
        list[str] | None, typer.Option("--source", help="Repeatable: limit the key to these source ids.")
    ] = None,
) -> None:
    """Create a key and print it ONCE on stdout (only its hash is stored)."""
    try:
        with checked_factory().begin() as session:
            created = create_key(session, name, scope, source or None)
    except KeyStoreError as exc:
        raise fail(str(exc), code=2) from exc
    limits = f"sources {', '.join(sorted(set(source)))}" if source else "every source"
    err.print(f"key {created.id} '{created.name}' ({', '.join(sorted(set(scope)))}; {limits}).")
    err.print("Store it now: it is not shown again. Send it as 'Authorization: Bearer <key>'.")
    sys.stdout.write(created.key + "\n")


@keys_app.command("list")
def keys_list(as_json: Annotated[bool, typer.Option("--json", help="Print JSON.")] = False) -> None:
    """Every key with its prefix, scopes, sources and use (never the key itself)."""
    with checked_factory()() as session:
        rows = list_keys(session)
    if as_json:
        print_json([_key_json(row) for row in rows])
        return
    table = folding_table("id", "name", "prefix", "scopes", "sources", "created", "last used", "revoked")
    for row in rows:
        table.add_row(
            str(row.id),
            row.name,
            row.prefix + "…",
            ",".join(row.scopes),
            ",".join(row.source_ids) if row.source_ids is not None else "(all)",
            when(row.created_at),
            when(row.last_used_at),
            when(row.revoked_at),
        )
    out.print(table)


def _key_json(row: ApiKey) -> dict[str, Any]:
    def when(moment: datetime | None) -> str | None:
        return moment.isoformat() if moment is not None else None

    return {
        "id": row.id,
        "name": row.name,
        "prefix": row.prefix,
        "scopes": row.scopes,
        "source_ids": row.source_ids,
        "created_at": when(row.created_at),
        "last_used_at": when(row.last_used_at),
        "revoked_at": when(row.revoked_at),
    }


@keys_app.command("revoke")
def keys_revoke(key_id: Annotated[int, id_argument("The id `factmill keys list` shows.")]) -> None:
    """Revoke a key: refused from the next request on."""
    try:
        with checked_factory().begin() as session:
            row = revoke_key(session, key_id)
    except KeyStoreError as exc:
        raise fail(str(exc), code=2) from exc
    out.print(f"key {row.id} '{row.name}' ({row.prefix}…) revoked")
