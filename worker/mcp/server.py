"""The Factmill MCP server: the tools of ``worker.mcp.tools`` for one caller's API key, over stdio or HTTP.

Over stdio the key is the process's, checked at start and on every request (a revoked key stops
working at once). Over streamable HTTP every request carries its own ``Authorization: Bearer <key>``,
checked like the API checks it; a request without a valid key gets 401 before it reaches a tool.
Either way a tool the key may not use (its scope, or data not partitioned by source for a
source-limited key) is missing from the tool list and refused when called.
"""

from __future__ import annotations

import logging
import time
import types
import typing
from collections.abc import Callable
from typing import Any, Literal

import anyio
import uvicorn
from mcp.server.auth.middleware.auth_context import get_access_token
from mcp.server.auth.provider import AccessToken
from mcp.server.auth.settings import AuthSettings
from mcp.server.mcpserver import Context, MCPServer
from mcp.server.mcpserver.exceptions import ToolError, UnexpectedToolError
from mcp.server.mcpserver.utilities.func_metadata import FuncMetadata
from mcp.types import CallToolResult, InputRequiredResult
from mcp.types import Tool as MCPTool
from pydantic import AnyHttpUrl

from worker.access import Principal, principal_for, refusal
from worker.bodycap import ForeignAppBodyCap
from worker.core.labels import listed_names
from worker.db import database_unavailable
from worker.guards import RequestIdMiddleware
from worker.mcp.arrival import ARRIVED
from worker.mcp.tools import Access, FactmillTools
from worker.runtime import Runtime
from worker.runtime.logs import logging_config

logger = logging.getLogger(__name__)

PRINCIPAL_CLAIM = "factmill_principal"
INSTRUCTIONS = (
    "Factmill holds facts extracted from conversations (who did, prefers, promised or believes what) "
    "and agent transcripts with their summaries. Use search_facts first to answer a question; "
    "list_entity_facts for everything about one person or thing; get_transcript_context for what to "
    "send a model for a transcript."
)
NO_KEY = "no valid API key (unknown or revoked); create one with `factmill keys create`"
UNAVAILABLE = "the database is unavailable; try again shortly"
LogLevel = Literal["DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"]


def _claims(principal: Principal) -> dict[str, Any]:
    sources = sorted(principal.source_ids) if principal.source_ids is not None else None
    return {
        PRINCIPAL_CLAIM: {
            "name": principal.name,
            "scopes": sorted(principal.scopes),
            "source_ids": sources,
            "key_id": principal.key_id,
        }
    }


def _from_claims(token: AccessToken | None) -> Principal | None:
    held = (token.claims or {}).get(PRINCIPAL_CLAIM) if token is not None else None
    if not isinstance(held, dict):
        return None
    sources = held["source_ids"]
    return Principal(
        name=held["name"],
        scopes=frozenset(held["scopes"]),
        source_ids=frozenset(sources) if sources is not None else None,
        key_id=held["key_id"],
    )


class KeyVerifier:
    """The SDK's bearer-token check, answered by Factmill's API keys (and the bootstrap admin token)."""

    def __init__(self, runtime: Runtime) -> None:
        self.runtime = runtime

    async def verify_token(self, token: str) -> AccessToken | None:
        """The key's principal as an access token; None (401) for an unknown or revoked key. A database
        that cannot answer raises (the HTTP app's guard answers 503 with Retry-After, as the API does)."""
        settings = self.runtime.settings
        # Stripped as the API's header parsing strips it (the SDK keeps what follows "Bearer "): a key
        # sent with a second space, or a trailing one from a file, worked there and was a 401 here.
        principal = await anyio.to_thread.run_sync(
            principal_for, self.runtime.factory, token.strip(), settings.admin_token
        )
        if principal is None:
            return None
        # The token field holds who it is, not the key: nothing downstream needs the secret. The SDK
        # binds an HTTP session to client_id, so it is the key's unique id, not its (free-text) name.
        return AccessToken(
            token=principal.rate_key,
            client_id=principal.rate_key,
            scopes=sorted(principal.scopes),
            claims=_claims(principal),
        )


def request_principal() -> Principal | None:
    """The principal of the HTTP request being served (set by the bearer check), or None."""
    return _from_claims(get_access_token())


class TextKeptAsText(FuncMetadata):
    """The SDK's argument handling, less its JSON reading of text: it parses a string argument as JSON
    wherever the declared type is not exactly str, so an optional text argument of "null" became no
    argument (an append keyed "null" was stored unkeyed, a search of the source "null" searched every
    source) and one that reads as a JSON list was refused. An argument that takes text is kept as sent."""

    def pre_parse_json(self, data: dict[str, Any]) -> dict[str, Any]:
        fields = self.arg_model.model_fields
        text = {key for key in data if key in fields and _takes_text(fields[key].annotation)}
        parsed = super().pre_parse_json({key: value for key, value in data.items() if key not in text})
        return {key: data[key] if key in text else parsed[key] for key in data}


def _takes_text(annotation: Any) -> bool:
    """Whether a declared type accepts text: str, an Annotated str, or a union holding one."""
    if annotation is str:
        return True
    args = typing.get_args(annotation)
    if typing.get_origin(annotation) is typing.Annotated:
        return _takes_text(args[0])
    return typing.get_origin(annotation) in (typing.Union, types.UnionType) and any(map(_takes_text, args))


class FactmillMCP(MCPServer[Any]):
    """MCPServer whose tool list and tool calls follow the caller's scopes and sources."""

    def __init__(
        self,
        runtime: Runtime,
        principal: Callable[[], Principal | None],
        *,
        log_level: LogLevel = "WARNING",
        auth: AuthSettings | None = None,
        token_verifier: KeyVerifier | None = None,
        principal_reads_the_database: bool = False,
    ) -> None:
        super().__init__(
            name="factmill",
            instructions=INSTRUCTIONS,
            log_level=log_level,
            auth=auth,
            token_verifier=token_verifier,
        )
        # The SDK logs each refused call at INFO with its message, which can quote the caller's query,
        # slug or transcript id; Factmill's logs carry no caller text, so only its warnings are kept.
        logging.getLogger("mcp.server.mcpserver.server").setLevel(logging.WARNING)
        self._principal = principal
        self._reads_the_database = principal_reads_the_database
        self._access: dict[str, Access] = {}
        for fn, access, hints in FactmillTools(runtime, self.caller).tools():
            self.add_tool(fn, annotations=hints, structured_output=True)
            self._access[fn.__name__] = access
            tool = self._tool_manager.get_tool(fn.__name__)
            assert tool is not None
            tool.fn_metadata = TextKeptAsText.model_validate(tool.fn_metadata, from_attributes=True)

    def _unknown_arguments(self, name: str, arguments: dict[str, Any]) -> list[str]:
        """The arguments ``name`` does not take (the SDK dropped them silently: a misspelled filter
        searched every source, an as_of the tool did not know answered as of now)."""
        tool = self._tool_manager.get_tool(name)
        if tool is None or name not in self._access:
            return []
        known = set(tool.parameters.get("properties", {}))
        return sorted(key for key in arguments if key not in known)

    def caller(self) -> Principal:
        principal = self._principal()
        if principal is None:
            raise ToolError(NO_KEY)
        return principal

    def _refused(self, principal: Principal | None, name: str) -> str | None:
        access = self._access.get(name)
        if access is None:
            return None  # not one of ours: the SDK answers "Unknown tool"
        if principal is None:
            return NO_KEY
        return refusal(principal, access.scope, all_sources=access.all_sources)

    def _checked_principal(self) -> Principal | None:
        """The caller, or a ToolError saying why it cannot be told: over stdio the key is looked up in
        the database on every request, and an outage there reached the client as the driver's own
        message (host, port, SQL) with a traceback in the log."""
        try:
            return self._principal()
        except Exception as exc:
            if database_unavailable(exc):
                logger.warning("MCP: the database is unavailable (%s)", type(exc).__name__)
                raise ToolError(UNAVAILABLE) from None
            logger.error("MCP: the key check failed: %s", type(exc).__name__)
            raise ToolError(f"the key check failed on the server ({type(exc).__name__})") from None

    async def _principal_now(self) -> Principal | None:
        """``_checked_principal``, on a thread when it reads the database (stdio): on the event loop, a
        slow database froze the whole server (no pings answered, no cancellations read, every other
        call queued behind it) for as long as the read took."""
        if self._reads_the_database:
            return await anyio.to_thread.run_sync(self._checked_principal)
        return self._checked_principal()

    async def list_tools(self) -> list[MCPTool]:
        principal = await self._principal_now()
        return [tool for tool in await super().list_tools() if self._refused(principal, tool.name) is None]

    async def call_tool(
        self, name: str, arguments: dict[str, Any], context: Context[Any, Any] | None = None
    ) -> CallToolResult | InputRequiredResult:
        # First: the key's check and a thread's wait come after. Over HTTP the request's arrival is noted
        # already (ArrivalNoted), before the bearer check and the body's read.
        arrived = ARRIVED.set(time.monotonic()) if ARRIVED.get() is None else None
        try:
            refused = self._refused(await self._principal_now(), name)
            if refused is not None:
                raise ToolError(f"{name} refused: {refused}")
            unknown = self._unknown_arguments(name, arguments)
            if unknown:
                # Listed short: 100,000 names, or one of a megabyte, came back whole (over stdio, no cap).
                raise ToolError(f"{name} takes no argument(s) {listed_names(unknown)}")
            return await super().call_tool(name, arguments, context)
        except UnexpectedToolError as exc:
            # One line, the exception's class only: its text or traceback could carry stored text.
            cause = type(exc.__cause__).__name__ if exc.__cause__ is not None else "error"
            if exc.__cause__ is not None and database_unavailable(exc.__cause__):
                # As at the key check: a key that needs no lookup (the admin token, a key checked just
                # before the outage) met it in the tool, and got "failed on the server" and an ERROR.
                logger.warning("MCP tool %s: the database is unavailable (%s)", name, cause)
                raise ToolError(UNAVAILABLE) from None
            logger.error("MCP tool %s failed: %s", name, cause)
            raise ToolError(f"{name} failed on the server ({cause}); try again later") from None
        finally:
            if arrived is not None:
                ARRIVED.reset(arrived)


def stdio_server(runtime: Runtime, key: str) -> FactmillMCP:
    """The server for one process's key (stdio). The key is checked on every request, as the API
    checks it, so revoking it takes effect at once."""
    return FactmillMCP(runtime, lambda: authenticate_key(runtime, key), principal_reads_the_database=True)


def http_server(runtime: Runtime) -> FactmillMCP:
    """The server for per-request keys (streamable HTTP)."""
    # The SDK's bearer check needs auth settings. Factmill is no OAuth server, so no OAuth routes are
    # made (no provider, no resource_server_url); issuer_url is required by the model and unused.
    auth = AuthSettings(
        issuer_url=AnyHttpUrl("http://localhost"), resource_server_url=None, required_scopes=[]
    )
    return FactmillMCP(
        runtime, request_principal, log_level="INFO", auth=auth, token_verifier=KeyVerifier(runtime)
    )


def authenticate_key(runtime: Runtime, key: str) -> Principal | None:
    """The principal of ``key`` (an API key or the bootstrap admin token), or None."""
    return principal_for(runtime.factory, key, runtime.settings.admin_token)


def run_stdio(runtime: Runtime, key: str) -> None:
    anyio.run(stdio_server(runtime, key).run_stdio_async)


def http_app(server: FactmillMCP, runtime: Runtime, host: str) -> Any:
    """The streamable HTTP app behind the API's guards: the body cap, and a database outage during the
    key check answered 503 with Retry-After (it was a bare 500 and uvicorn's traceback), anything else
    unexpected logged as one line."""
    # Stateless: the tools keep nothing between calls and each request's key is checked anyway, while
    # the SDK's sessions (10,000 for the whole server, 30 minutes idle) let one key hold every slot, and
    # every other client was answered 503. Its own body limit (4 MiB) stood below Factmill's cap.
    app = server.streamable_http_app(
        host=host, stateless_http=True, max_request_body_size=runtime.settings.max_body_bytes
    )
    # Inside the app's own ServerErrorMiddleware (which answers 500 before anything outside it could
    # answer), around the SDK's bearer check.
    app.add_middleware(RequestIdMiddleware)  # type: ignore[arg-type]
    return ArrivalNoted(ForeignAppBodyCap(app, cap=runtime.settings.max_body_bytes))


class ArrivalNoted:
    """Notes when an HTTP request arrived (ARRIVED), before the SDK's bearer check (a thread of the
    shared pool and a database read) and the body's read: noted when the tool ran, an append whose
    request arrived before an erasure that committed meanwhile began the transcript again with its
    words. The server's task for a request is started inside it (stateless_http: one a request; a
    session's task, started by its first request, would carry that request's note), so the call sees it."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        arrived = ARRIVED.set(time.monotonic())
        try:
            await self.app(scope, receive, send)
        finally:
            ARRIVED.reset(arrived)


def run_http(runtime: Runtime, host: str, port: int) -> None:
    """Serve streamable HTTP as the SDK's ``run_streamable_http_async`` does, with the API's keep-alive
    (FACTMILL_API_KEEP_ALIVE_SECONDS) instead of uvicorn's 5 s, and the services' log lines (text or
    JSON, FACTMILL_LOG_FORMAT) instead of uvicorn's own format."""
    server = http_server(runtime)
    level = server.settings.log_level
    config = uvicorn.Config(
        http_app(server, runtime, host),
        host=host,
        port=port,
        log_level=level.lower(),
        log_config=logging_config(runtime.settings, level),
        access_log=False,  # a raw request line (any path and query a client or scanner sends): not ours
        timeout_keep_alive=runtime.settings.api_keep_alive_seconds,
    )
    logger.info(
        "factmill MCP server on http://%s:%s/mcp (each request sends 'Authorization: Bearer <key>')",
        host,
        port,
    )
    anyio.run(uvicorn.Server(config).serve)


__all__ = [
    "FactmillMCP",
    "KeyVerifier",
    "authenticate_key",
    "http_app",
    "http_server",
    "request_principal",
    "run_http",
    "run_stdio",
    "stdio_server",
]
