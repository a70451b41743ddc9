"""Who may do what: API keys (hashed, scoped, optionally limited to sources) and the principal they name."""

from __future__ import annotations

from worker.access.store import (
    BOOTSTRAP_ADMIN,
    KEY_PREFIX,
    SCOPES,
    AccessRefusedError,
    CreatedKey,
    KeyStoreError,
    Principal,
    authenticate,
    create_key,
    is_admin_token,
    list_keys,
    may_be_a_key,
    principal_for,
    readable_sources,
    refusal,
    revoke_key,
)

__all__ = [
    "BOOTSTRAP_ADMIN",
    "KEY_PREFIX",
    "SCOPES",
    "AccessRefusedError",
    "CreatedKey",
    "KeyStoreError",
    "Principal",
    "authenticate",
    "create_key",
    "is_admin_token",
    "list_keys",
    "may_be_a_key",
    "principal_for",
    "readable_sources",
    "refusal",
    "revoke_key",
]
