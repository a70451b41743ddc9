"""The webhook signature a sender computes: ``Factmill-Signature: t=<unix seconds>,v4=<hex HMAC-SHA256>``.

``v4`` signs ``"v4\n<t>\n<METHOD>\n<len(path)>:<path>\n<len(key)>:<key>\n<body>"``: the scheme's
name, the timestamp, the HTTP method (upper case), the request path as sent (no query string), the
delivery's Idempotency-Key header (empty, length 0, when none is sent) and the raw body; each length is
the part's UTF-8 bytes in decimal. A body signed for one route or one transcript is refused at another,
and a captured delivery sent again within the tolerance window carries the key it was signed with, so
the server answers it with the stored answer instead of storing it twice (the key cannot be changed,
added or dropped without breaking the signature).

The older schemes join their parts with dots, which a transcript id and a key may hold, so one message
reads as several requests: ``v3`` (``"<t>.<METHOD>.<path>.<key>.<body>"``) signed for
``PUT /v1/transcripts/abc`` with key ``K`` also verified as ``v2`` (``"<t>.<METHOD>.<path>.<body>"``)
for transcript ``abc.K``, and a v3 key ``x.y`` on ``abc`` as key ``y`` on ``abc.x``: a captured
delivery changed another transcript. v4 names its scheme and prefixes the two parts that may hold
anything with their lengths. Servers accept v3 and v2 only while their switches are on; the legacy
``v1`` signs ``"<t>.<body>"`` only.

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
BOUND_SCHEME = "v4"
KEYED_SCHEME = "v3"
SCHEME = "v2"
LEGACY_SCHEME = "v1"


def compute_bound_signature(
    body: bytes, secret: str, timestamp: int, method: str, path: str, idempotency_key: str | None = None
) -> str:
    """Hex HMAC-SHA256 under ``secret`` of the v4 message (see the module's docstring); ``idempotency_key``
    None when the request sends none."""
    path_bytes = path.encode("utf-8")
    key_bytes = (idempotency_key or "").encode("ascii", "replace")
    head = b"%s\n%d\n%s\n%d:%s\n%d:%s\n" % (
        BOUND_SCHEME.encode("ascii"),
        timestamp,
        method.upper().encode("utf-8"),
        len(path_bytes),
        path_bytes,
        len(key_bytes),
        key_bytes,
    )
    mac = hmac.new(secret.encode("utf-8"), head, hashlib.sha256)
    mac.update(body)  # not head + body: a copy of a body of up to 25 MiB per signature computed
    return mac.hexdigest()


def compute_signature(
    body: bytes,
    secret: str,
    timestamp: int,
    method: str | None = None,
    path: str | None = None,
    idempotency_key: str | None = None,
) -> str:
    """Hex HMAC-SHA256 under ``secret`` of an older scheme's message: ``"<t>.<METHOD>.<path>.<key>.<body>"``
    (v3, when an ``idempotency_key`` is given), ``"<t>.<METHOD>.<path>.<body>"`` (v2), or
    ``"<t>.<body>"`` (v1, when neither method nor path is given). Senders sign v4
    (``compute_bound_signature``); servers check these while their switches accept them."""
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
    """The secrets to sign with, in order, without surrounding whitespace, as the server reads its own
    (FACTMILL_WEBHOOK_SECRET): a secret read from the server's file with its trailing newline signed
    every request with a key the server does not hold, each a 401. ValueError when there is none (or
    one is empty)."""
    secrets = [s.strip() for s in ([secret] if isinstance(secret, str) else list(secret))]
    if not secrets or not all(secrets):
        raise ValueError("a webhook secret to sign with is required (an empty one signs nothing)")
    return secrets


def signable_key(key: str) -> bool:
    """Whether ``key`` can be signed (v3): 1 to 255 printable ASCII characters, none at either end a
    space. A header value is bytes on the wire, and servers and clients decode any other byte
    differently (latin-1 here, UTF-8 there), so the signed text would not be the one checked."""
    return 0 < len(key) <= 255 and key.isascii() and key.isprintable() and key == key.strip()


def _route(method: str | None, path: str | None, idempotency_key: str | None) -> tuple[str, str] | None:
    """(method, path) a signature binds (v4), or None (the legacy v1, bound to no route); ValueError
    for half a route or a key that cannot be signed."""
    if method is None and path is None:
        if idempotency_key is not None:
            raise ValueError("a signature with an Idempotency-Key needs the method and the path too")
        return None
    if method is None or path is None:
        raise ValueError("a signature bound to a route needs both the method and the path")
    if idempotency_key is not None and not signable_key(idempotency_key):
        raise ValueError(
            "an Idempotency-Key to sign must be 1 to 255 printable ASCII characters, without "
            "surrounding spaces (HTTP carries header values as bytes; only ASCII reads alike everywhere)"
        )
    return method, path


def sign(
    body: bytes,
    secret: Secrets,
    timestamp: int | None = None,
    *,
    method: str | None = None,
    path: str | None = None,
    idempotency_key: str | None = None,
) -> str:
    """The ``Factmill-Signature`` header value for ``body`` (timestamp defaults to now): v4, bound to
    ``method``, ``path`` and ``idempotency_key`` (send it as the Idempotency-Key header; None: the
    request sends none), or the legacy v1 when neither method nor path is given; one entry for each
    secret given (``["old", "new"]`` while the server's secret is rotated)."""
    t = int(time.time()) if timestamp is None else int(timestamp)
    route = _route(method, path, idempotency_key)
    if route is not None:
        signatures = [
            f"{BOUND_SCHEME}={compute_bound_signature(body, one, t, *route, idempotency_key)}"
            for one in secrets_of(secret)
        ]
    else:
        signatures = [f"{LEGACY_SCHEME}={compute_signature(body, one, t)}" for one in secrets_of(secret)]
    return f"t={t}," + ",".join(signatures)


def signed_json_headers(
    body: bytes,
    secret: Secrets,
    *,
    method: str,
    path: str,
    timestamp: int | None = None,
    idempotency_key: str | None = None,
) -> dict[str, str]:
    """The headers a webhook client sends with a JSON ``body``: its content type and signature (v4); with
    an ``idempotency_key``, that key as the Idempotency-Key header, which the signature binds."""
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
    "BOUND_SCHEME",
    "IDEMPOTENCY_HEADER",
    "KEYED_SCHEME",
    "LEGACY_SCHEME",
    "SCHEME",
    "SIGNATURE_HEADER",
    "Secrets",
    "compute_bound_signature",
    "compute_signature",
    "secrets_of",
    "sign",
    "signable_key",
    "signed_json_headers",
]
