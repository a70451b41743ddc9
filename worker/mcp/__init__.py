"""The Model Context Protocol server: facts and transcripts as tools for agents (`factmill mcp`)."""

from __future__ import annotations

from worker.mcp.server import authenticate_key, http_server, run_http, run_stdio, stdio_server

__all__ = ["authenticate_key", "http_server", "run_http", "run_stdio", "stdio_server"]
