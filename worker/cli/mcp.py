"""`factmill mcp`: the MCP server, over stdio (one key) or streamable HTTP (a key per request)."""

from __future__ import annotations

import os
from typing import Annotated

import typer

from worker.cli.console import fail, port_option
from worker.cli.services import refuse_published_secrets
from worker.cli.sessions import checked_factory, embedded_broker_note
from worker.runtime import build_runtime
from worker.settings import RefusedSettingsError, get_settings

NO_KEY = (
    "no API key for the MCP server: set FACTMILL_MCP_API_KEY (or name another variable with --key-env) "
    "to a key from `factmill keys create NAME --scope read`"
)


def _stdio_key(key_env: str | None, configured: str | None) -> str:
    # The user names this variable, so Settings cannot declare it: the one read of os.environ here.
    key = os.environ.get(key_env) if key_env else configured
    if not key:
        raise fail(f"{NO_KEY} (${key_env} is unset or empty)" if key_env else NO_KEY, code=2)
    return key.strip()


def mcp_command(
    http: Annotated[
        int | None,
        port_option(
            "--http", metavar="PORT", help="Serve streamable HTTP on this port (path /mcp) instead of stdio."
        ),
    ] = None,
    host: Annotated[str, typer.Option(help="The interface --http listens on.")] = "127.0.0.1",
    key_env: Annotated[
        str | None,
        typer.Option(
            "--key-env",
            metavar="NAME",
            help="stdio: read the API key from this environment variable instead of FACTMILL_MCP_API_KEY.",
        ),
    ] = None,
) -> None:
    """Serve the facts and transcripts as MCP tools: stdio by default, or streamable HTTP with --http.

    Over stdio the key comes from FACTMILL_MCP_API_KEY (or --key-env); over HTTP each request sends
    'Authorization: Bearer <key>'. A key sees only the tools its scopes allow."""
    # The MCP server is imported by this command alone, not with the CLI: the mcp package takes a
    # second or more to import, which every other `factmill` command would pay for at start.
    from worker.mcp import authenticate_key, run_http, run_stdio

    settings = get_settings()
    # As `serve` does: the HTTP server took the placeholder admin token as the bootstrap admin in
    # production (every tool, every source), and stdio searches call the model as the API does.
    try:
        settings.check_service_settings()
    except RefusedSettingsError as exc:
        raise fail(str(exc), code=2) from None
    note = embedded_broker_note(settings)
    if http is None and note is not None:
        # An agent starts the stdio server from a folder of its own: jobs went to an embedded Redis under
        # it, which no worker reads (run only when the sweeper took them for lost), and each machine
        # counted its own search limits.
        raise fail(note, code=2)
    if http is not None:
        refuse_published_secrets(settings, host)
    key = None if http is not None else _stdio_key(key_env, settings.mcp_api_key)
    runtime = build_runtime(settings, checked_factory(settings))
    try:
        if http is not None:
            run_http(runtime, host, http)  # it logs where it listens, in the services' log format
            return
        assert key is not None
        if authenticate_key(runtime, key) is None:
            raise fail(
                "the MCP server's API key is unknown or revoked; create one with "
                "`factmill keys create NAME --scope read` (add --scope ingest for the write tools)",
                code=2,
            )
        run_stdio(runtime, key)
    finally:
        runtime.close()
