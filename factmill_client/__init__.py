"""Factmill's Python client: ``Client`` and ``AsyncClient`` over httpx, typed answers, signed webhooks.

The names below load on first use (PEP 562), so ``factmill_client.signing`` (standard library only)
can be imported without httpx: the server's pure core verifies with it.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from factmill_client.async_client import AsyncClient
    from factmill_client.client import Client
    from factmill_client.errors import (
        ApiConnectionError,
        ApiError,
        AuthenticationError,
        BadRequest,
        Conflict,
        FactmillError,
        NotFound,
        PayloadTooLarge,
        PermissionDenied,
        RateLimited,
        ServerError,
        UnexpectedResponse,
        UnprocessableEntity,
    )
    from factmill_client.transport import RetryPolicy

__all__ = [
    "ApiConnectionError",
    "ApiError",
    "AsyncClient",
    "AuthenticationError",
    "BadRequest",
    "Client",
    "Conflict",
    "FactmillError",
    "NotFound",
    "PayloadTooLarge",
    "PermissionDenied",
    "RateLimited",
    "RetryPolicy",
    "ServerError",
    "UnexpectedResponse",
    "UnprocessableEntity",
]

# Where each name lives: the errors module unless listed here.
_HOMES = {name: "factmill_client.errors" for name in __all__} | {
    "AsyncClient": "factmill_client.async_client",
    "Client": "factmill_client.client",
    "RetryPolicy": "factmill_client.transport",
}


def __getattr__(name: str) -> Any:
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module 'factmill_client' has no attribute {name!r}")
    return getattr(importlib.import_module(home), name)
