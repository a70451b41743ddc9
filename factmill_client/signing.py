"""The webhook signature a sender computes: ``Factmill-Signature: t=<unix seconds>,v3=<hex HMAC-SHA256>``.

``v3`` signs ``"<t>.<METHOD>.<path>.<Idempotency-Key>.<body>"``: the timestamp, the HTTP method (upper
case), the request path as sent (no query string), the delivery's Idempotency-Key header and the raw
body. A body signed for one route or one transcript is refused at another, and a captured delivery
sent again within the tolerance window carries the key it was signed with, so the server answers it
with the stored answer instead of storing it twice (the key cannot be changed or dropped without
breaking the signature). ``v2`` signs ``"<t>.<METHOD>.<path>.<body>"`` (no key: a copy sent under a
new key counts as a new delivery); the legacy ``v1`` signs ``"<t>.<body>"`` only.

Reading the parts back is unambiguous although a key may hold dots: the server takes each part from
the request itself, and a body is one JSON object, which no shift of the key/body boundary keeps valid.

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
IDEMPOTENCY_HEADER = "Idempotency-Key"
KEYED_SCHEME = "v3"
SCHEME = "v2"
LEGACY_SCHEME = "v1"


def compute_signature(
    body: bytes,
    secret: str,
    timestamp: int,
    method: str | None = None,
    path: str | None = None,
    idempotency_key: str | None = None,
) -> str:
    """Hex HMAC-SHA256 under ``secret`` of ``"<t>.<METHOD>.<path>.<key>.<body>"`` (v3, when an
    ``idempotency_key`` is given), ``"<t>.<METHOD>.<path>.<body>"`` (v2), or ``"<t>.<body>"`` (v1, when
    neither method nor path is given)."""
    message = str(timestamp).encode("ascii") + b"."
    if method is not None or path is not None or idempotency_key is not None:
        message += f"{(method or '').upper()}.{path or ''}.".encode()
    if idempotency_key is not None:
        message += idempotency_key.encode("ascii", "replace") + b"."
    mac = hmac.new(secret.encode("utf-8"), message, hashlib.sha256)
    mac.update(body)  # not message + body: a copy of a body of up to 25 MiB per signature computed
    return mac.hexdigest()


# One secret, or several: while the secret is rotated, a sender signs with the old and the new one
# (one entry each in the header) and the server accepts the request under either.
Secrets = str | Sequence[str]


def secrets_of(secret: Secrets) -> list[str]:
    """The secrets to sign with, in order; ValueError when there is none (or one is empty)."""
    secrets = [secret] if isinstance(secret, str) else list(secret)
    if not secrets or not all(secrets):
        raise ValueError("a webhook secret to sign with is required (an empty one signs nothing)")
    return secrets


def signable_key(key: str) -> bool:
    """Whether ``key`` can be signed (v3): 1 to 255 printable ASCII characters, none at either end a
    space. A header value is bytes on the wire, and servers and clients decode any other byte
    differently (latin-1 here, UTF-8 there), so the signed text would not be the one checked."""
    return 0 < len(key) <= 255 and key.isascii() and key.isprintable() and key == key.strip()


def _scheme(method: str | None, path: str | None, idempotency_key: str | None) -> str:
    if idempotency_key is not None:
        if method is None or path is None:
            raise ValueError("a v3 signature (with an Idempotency-Key) needs the method and the path too")
        if not signable_key(idempotency_key):
            raise ValueError(
                "an Idempotency-Key to sign must be 1 to 255 printable ASCII characters, without "
                "surrounding spaces (HTTP carries header values as bytes; only ASCII reads alike everywhere)"
            )
        return KEYED_SCHEME
    return LEGACY_SCHEME if method is None and path is None else SCHEME


def sign(
    body: bytes,
    secret: Secrets,
    timestamp: int | None = None,
    *,
    method: str | None = None,
    path: str | None = None,
    idempotency_key: str | None = None,
) -> str:
    """The ``Factmill-Signature`` header value for ``body`` (timestamp defaults to now): v3 when an
    ``idempotency_key`` is given (send it as the Idempotency-Key header), v2 bound to ``method`` and
    ``path`` only, else the legacy v1; one entry for each secret given (``["old", "new"]`` while the
    server's secret is rotated)."""
    t = int(time.time()) if timestamp is None else int(timestamp)
    scheme = _scheme(method, path, idempotency_key)
    entries = ",".join(
        f"{scheme}={compute_signature(body, one, t, method, path, idempotency_key)}"
        for one in secrets_of(secret)
    )
    return f"t={t},{entries}"


def signed_json_headers(
    body: bytes,
    secret: Secrets,
    *,
    method: str,
    path: str,
    timestamp: int | None = None,
    idempotency_key: str | None = None,
) -> dict[str, str]:
    """The headers a webhook client sends with a JSON ``body``: its content type and signature; with an
    ``idempotency_key``, that key as the Idempotency-Key header and a v3 signature binding it."""
    headers = {
        "Content-Type": "application/json",
        SIGNATURE_HEADER: sign(
            body, secret, timestamp, method=method, path=path, idempotency_key=idempotency_key
        ),
    }
    if idempotency_key is not None:
        headers[IDEMPOTENCY_HEADER] = idempotency_key
    return headers


__all__ = [
    "IDEMPOTENCY_HEADER",
    "KEYED_SCHEME",
    "LEGACY_SCHEME",
    "SCHEME",
    "SIGNATURE_HEADER",
    "Secrets",
    "compute_signature",
    "secrets_of",
    "sign",
    "signable_key",
    "signed_json_headers",
]
