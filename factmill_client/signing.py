"""The webhook signature a sender computes: ``Factmill-Signature: t=<unix seconds>,v2=<hex HMAC-SHA256>``.

``v2`` signs ``"<t>.<METHOD>.<path>.<body>"``: the timestamp, the HTTP method (upper case), the
request path as sent (no query string) and the raw body, so a body signed for one route or one
transcript is refused at another. The legacy ``v1`` form signs ``"<t>.<body>"`` only.

This module is the one definition of the scheme: the client signs with it and the server's
``worker.core.signing`` verifies with it. It imports the standard library only, so the server's pure
core can import it without the client's HTTP stack.
"""

from __future__ import annotations

import hashlib
import hmac
import time
from collections.abc import Sequence

SIGNATURE_HEADER = "Factmill-Signature"
SCHEME = "v2"
LEGACY_SCHEME = "v1"


def compute_signature(
    body: bytes, secret: str, timestamp: int, method: str | None = None, path: str | None = None
) -> str:
    """Hex HMAC-SHA256 under ``secret`` of ``"<t>.<METHOD>.<path>.<body>"`` (v2), or of ``"<t>.<body>"``
    (v1) when neither method nor path is given."""
    message = str(timestamp).encode("ascii") + b"."
    if method is not None or path is not None:
        message += f"{(method or '').upper()}.{path or ''}.".encode()
    return hmac.new(secret.encode("utf-8"), message + body, hashlib.sha256).hexdigest()


# One secret, or several: while the secret is rotated, a sender signs with the old and the new one
# (one entry each in the header) and the server accepts the request under either.
Secrets = str | Sequence[str]


def secrets_of(secret: Secrets) -> list[str]:
    """The secrets to sign with, in order; ValueError when there is none (or one is empty)."""
    secrets = [secret] if isinstance(secret, str) else list(secret)
    if not secrets or not all(secrets):
        raise ValueError("a webhook secret to sign with is required (an empty one signs nothing)")
    return secrets


def sign(
    body: bytes,
    secret: Secrets,
    timestamp: int | None = None,
    *,
    method: str | None = None,
    path: str | None = None,
) -> str:
    """The ``Factmill-Signature`` header value for ``body`` (timestamp defaults to now): v2 bound to
    ``method`` and ``path`` when they are given, else the legacy v1; one entry for each secret given
    (``["old", "new"]`` while the server's secret is rotated)."""
    t = int(time.time()) if timestamp is None else int(timestamp)
    scheme = LEGACY_SCHEME if method is None and path is None else SCHEME
    entries = ",".join(
        f"{scheme}={compute_signature(body, one, t, method, path)}" for one in secrets_of(secret)
    )
    return f"t={t},{entries}"


def signed_json_headers(
    body: bytes, secret: Secrets, *, method: str, path: str, timestamp: int | None = None
) -> dict[str, str]:
    """The headers a webhook client sends with a JSON ``body``: its content type and v2 signature."""
    return {
        "Content-Type": "application/json",
        SIGNATURE_HEADER: sign(body, secret, timestamp, method=method, path=path),
    }


__all__ = [
    "LEGACY_SCHEME",
    "SCHEME",
    "SIGNATURE_HEADER",
    "Secrets",
    "compute_signature",
    "secrets_of",
    "sign",
    "signed_json_headers",
]
