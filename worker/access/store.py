"""API keys in Postgres: create (shown once), list (prefixes only), revoke, and authenticate a bearer key.

A key is ``fm_`` + 32 random bytes (urlsafe base64). Only its sha256 is stored: the key has full
entropy, so a fast hash is as strong as a slow one, and the lookup stays one indexed query.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import secrets
from collections.abc import Iterable
from dataclasses import dataclass
from datetime import datetime, timedelta

from sqlalchemy import func, or_, select, update
from sqlalchemy.exc import DBAPIError
from sqlalchemy.orm import Session, sessionmaker

from models import API_SCOPES, ApiKey
from worker.core.labels import check_source_id

logger = logging.getLogger(__name__)

KEY_PREFIX = "fm_"
SCOPES = API_SCOPES
DISPLAY_PREFIX_CHARS = 10  # "fm_" + 7 characters of the token: enough to tell keys apart in a list
LAST_USED_RESOLUTION = timedelta(minutes=1)  # last_used_at is written at most once a minute per key


class KeyStoreError(ValueError):
    """A key operation the caller got wrong (unknown scope, unknown id); the message says what to do."""


@dataclass(frozen=True)
class Principal:
    """Who is calling: a stored key, or the bootstrap admin token (key_id None)."""

    name: str
    scopes: frozenset[str]
    source_ids: frozenset[str] | None  # None: every source
    key_id: int | None = None

    def has(self, scope: str) -> bool:
        return scope in self.scopes or "admin" in self.scopes

    def sees(self, source_id: str) -> bool:
        return self.source_ids is None or source_id in self.source_ids

    @property
    def sender(self) -> str:
        """Who delivers, for the scope of an idempotency key: the key, or the bootstrap admin token."""
        return f"key:{self.key_id}" if self.key_id is not None else "admin-token"

    @property
    def actor(self) -> str:
        """Who made a change, as an audit row records it (config's updated_by, an erasure's
        requested_by): the key's id and name, or the bootstrap token; never the key itself."""
        return f"api key {self.key_id} ({self.name})" if self.key_id is not None else "api admin token"

    @property
    def rate_key(self) -> str:
        """Who this is to a per-key rate limiter (never the key itself)."""
        return f"key-{self.key_id}" if self.key_id is not None else "admin-token"


BOOTSTRAP_ADMIN = Principal(name="FACTMILL_ADMIN_TOKEN", scopes=frozenset({"admin"}), source_ids=None)


@dataclass(frozen=True)
class CreatedKey:
    id: int
    name: str
    key: str  # the only time the key is seen
    prefix: str


def hash_key(key: str) -> str:
    return hashlib.sha256(key.encode("utf-8")).hexdigest()


def _check_scopes(scopes: Iterable[str]) -> list[str]:
    chosen = sorted(set(scopes))
    unknown = [s for s in chosen if s not in SCOPES]
    if unknown:
        raise KeyStoreError(f"unknown scope(s) {', '.join(unknown)}; choose from {', '.join(SCOPES)}")
    if not chosen:
        raise KeyStoreError(f"a key needs at least one scope ({', '.join(SCOPES)})")
    return chosen


def create_key(
    session: Session, name: str, scopes: Iterable[str], source_ids: Iterable[str] | None = None
) -> CreatedKey:
    """Store a new key and return it; the caller shows ``key`` once and forgets it."""
    if not name.strip():
        raise KeyStoreError("a key needs a name (who or what will use it)")
    sources = sorted(set(source_ids)) if source_ids is not None else None
    if sources is not None and not sources:
        sources = None
    for source in sources or ():
        # A blank source limited the key to a source no page can have: a key that sees nothing.
        try:
            check_source_id(source)
        except ValueError as exc:
            raise KeyStoreError(f"source {exc}; drop --source for a key over every source") from None
    chosen = _check_scopes(scopes)
    if sources is not None and "admin" in chosen:
        # Admin routes (config, retries, keys, metrics) are not partitioned by source.
        raise KeyStoreError("an admin key covers every source; drop --source or the admin scope")
    if sources is not None and "metrics" in chosen:
        # /metrics counts every source and refuses a source-limited key: such a key got 403 on each scrape.
        raise KeyStoreError("a metrics key covers every source; drop --source or the metrics scope")
    key = KEY_PREFIX + secrets.token_urlsafe(32)
    row = ApiKey(
        name=name.strip(),
        prefix=key[:DISPLAY_PREFIX_CHARS],
        key_hash=hash_key(key),
        scopes=chosen,
        source_ids=sources,
    )
    session.add(row)
    session.flush()
    return CreatedKey(id=row.id, name=row.name, key=key, prefix=row.prefix)


def list_keys(session: Session, include_revoked: bool = True) -> list[ApiKey]:
    query = select(ApiKey).order_by(ApiKey.id)
    if not include_revoked:
        query = query.where(ApiKey.revoked_at.is_(None))
    return list(session.scalars(query))


def revoke_key(session: Session, key_id: int) -> ApiKey:
    """Revoke a key (it is refused from the next request on); revoking twice keeps the first time."""
    row = session.get(ApiKey, key_id)
    if row is None:
        raise KeyStoreError(f"no key {key_id}; `factmill keys list` shows the ids")
    if row.revoked_at is None:
        row.revoked_at = func.now()  # type: ignore[assignment]
        session.flush()
        session.refresh(row)
    return row


def _touch(session: Session, key_id: int, last_used: datetime | None, now: datetime) -> None:
    """Note the key's use, at most once a minute, as bookkeeping: a database that answers reads but
    refuses writes (a standby after a failover, read-only for maintenance, a full disk) made every keyed
    request fail here, reads and the metrics scrape included. The write is kept apart in a savepoint and
    its failure logged; the key's answer stands."""
    if last_used is not None and now - last_used < LAST_USED_RESOLUTION:
        return
    try:
        with session.begin_nested():
            # The condition is repeated in SQL so concurrent requests write the row once, not once each.
            session.execute(
                update(ApiKey)
                .where(
                    ApiKey.id == key_id,
                    or_(
                        ApiKey.last_used_at.is_(None),
                        ApiKey.last_used_at < func.now() - LAST_USED_RESOLUTION,
                    ),
                )
                .values(last_used_at=func.now())
            )
    except DBAPIError as exc:
        if exc.connection_invalidated:  # the connection itself is gone: nothing else can be read on it
            raise
        logger.warning(
            "key %s: last use not recorded (%s)",
            key_id,
            getattr(exc.orig, "sqlstate", None) or type(exc).__name__,
        )


class AccessRefusedError(PermissionError):
    """A principal may not do this; the message says why (the API answers 403, MCP a tool error)."""


def refusal(principal: Principal, scope: str, *, all_sources: str | None = None) -> str | None:
    """Why ``principal`` may not use what needs ``scope``, or None when it may. With ``all_sources``
    (what is served, e.g. "transcripts": data not partitioned by source) a source-limited key is refused."""
    if not principal.has(scope):
        return f"this key lacks the {scope!r} scope"
    if all_sources is not None and principal.source_ids is not None:
        return (
            f"{all_sources} are not partitioned by source; this key is limited to sources, "
            "so use a key without --source for them"
        )
    return None


def readable_sources(principal: Principal | None, source_id: str | None = None) -> tuple[str, ...] | None:
    """The sources a read covers: ``(source_id,)`` when one is asked for (AccessRefusedError when
    ``principal`` may not read it), else the principal's own (sorted), or None for all."""
    if source_id is not None:
        if principal is not None and not principal.sees(source_id):
            raise AccessRefusedError(f"this key may not read source {source_id!r}")
        return (source_id,)
    if principal is None or principal.source_ids is None:
        return None
    return tuple(sorted(principal.source_ids))


def principal_for(
    factory: sessionmaker[Session], key: str, admin_token: str | None = None
) -> Principal | None:
    """The principal a bearer credential names: the bootstrap admin for ``admin_token``, a live key's
    principal, or None (unknown, malformed or revoked)."""
    if is_admin_token(key, admin_token):
        return BOOTSTRAP_ADMIN
    if not may_be_a_key(key):  # no transaction for what no row can match
        return None
    with factory.begin() as session:
        return authenticate(session, key)


def is_admin_token(key: str, admin_token: str | None) -> bool:
    """Whether a bearer credential is the bootstrap admin token (a constant-time compare, no lookup)."""
    return bool(admin_token) and hmac.compare_digest(key.encode("utf-8"), (admin_token or "").encode("utf-8"))


def may_be_a_key(key: str) -> bool:
    """Whether a bearer credential has an API key's form, so that only a lookup can tell it."""
    return key.startswith(KEY_PREFIX) and len(key) <= 200 and key.isascii()


def authenticate(session: Session, key: str) -> Principal | None:
    """The principal of a live key, or None (unknown, malformed or revoked: the caller says 401)."""
    if not may_be_a_key(key):
        return None
    digest = hash_key(key)
    row = session.execute(
        select(ApiKey, func.now()).where(ApiKey.key_hash == digest, ApiKey.revoked_at.is_(None))
    ).one_or_none()
    if row is None:
        return None
    found, now = row
    # The index found the row by hash; comparing again in constant time costs nothing and keeps the
    # check independent of how the lookup is done.
    if not hmac.compare_digest(found.key_hash, digest):
        return None
    _touch(session, found.id, found.last_used_at, now)
    sources = frozenset(found.source_ids) if found.source_ids is not None else None
    return Principal(name=found.name, scopes=frozenset(found.scopes), source_ids=sources, key_id=found.id)
