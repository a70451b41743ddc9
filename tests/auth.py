"""Test helpers for access control: create a real API key and have a TestClient send it."""

from __future__ import annotations

import re
from collections.abc import Iterable

import httpx
from fastapi.testclient import TestClient
from sqlalchemy.orm import Session, sessionmaker

from worker.access import create_key

# Routes whose tests choose their credential themselves (signatures, the admin token): no default key.
_CHOOSE_OWN = re.compile(r"^/v1/(pages|feedback|transcripts/[^/]+(/messages)?|config/.*)$")


def new_key(
    factory: sessionmaker[Session],
    scopes: Iterable[str] = ("read",),
    source_ids: Iterable[str] | None = None,
    name: str = "tests",
) -> str:
    with factory.begin() as session:
        return create_key(session, name, scopes, source_ids).key


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def send_key(client: TestClient, factory: sessionmaker[Session], scopes: Iterable[str] = ("read",)) -> str:
    """Create a key and send it on every request of ``client`` that names no credential of its own
    (ingestion and config routes excepted: their tests sign or send the admin token themselves)."""
    key = new_key(factory, scopes)

    def add(request: httpx.Request) -> None:
        writes = request.method in ("POST", "PUT") and _CHOOSE_OWN.match(request.url.path)
        config = request.url.path.startswith("/v1/config/")
        if "authorization" not in request.headers and not writes and not config:
            request.headers["Authorization"] = f"Bearer {key}"

    client.event_hooks = {
        "request": [*client.event_hooks["request"], add],
        "response": client.event_hooks["response"],
    }
    return key
