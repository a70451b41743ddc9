"""Webhook signatures: ``Factmill-Signature: t=<unix seconds>,v4=<hex HMAC-SHA256>``.

``v4`` signs the scheme's name, the timestamp, the HTTP method, the request path as sent (no query
string), the delivery's Idempotency-Key and the raw body, the path and the key prefixed with their
lengths (factmill_client.signing defines the message), so a body signed for one route or one
transcript is refused at another, and a captured delivery sent again within the tolerance window
keeps its key and gets the stored answer (it cannot be stored twice). The older schemes join the
same parts with dots, which a transcript id and a key may hold: ``v3`` (with the key) and ``v2``
(without) are accepted while FACTMILL_ACCEPT_V3_SIGNATURES and FACTMILL_ACCEPT_V2_SIGNATURES are on
(the default, for senders written before v4), and a v3 or v2 delivery captured at
``PUT /v1/transcripts/<id>`` can be sent to a transcript whose id extends or shortens it by a dot. The
legacy ``v1`` form signs ``"<t>.<body>"`` only; servers accept it only while a rotation needs it
(FACTMILL_ACCEPT_V1_SIGNATURES). The scheme follows Stripe's: a captured request cannot be replayed
after the tolerance window, and a header may carry several signatures so a sender can sign with the
old and the new secret while the secret is rotated.
"""

from __future__ import annotations

import hmac
import time
from collections.abc import Sequence

# The scheme itself (what a sender computes) is defined once, in the client package, which imports the
# standard library only; the server verifies with the same function.
from factmill_client.signing import (
    BOUND_SCHEME,
    IDEMPOTENCY_HEADER,
    KEYED_SCHEME,
    LEGACY_SCHEME,
    SCHEME,
    SIGNATURE_HEADER,
    compute_bound_signature,
    compute_signature,
    sign,
    signable_key,
    signed_json_headers,
)

MAX_IDEMPOTENCY_KEY_LENGTH = 255  # an Idempotency-Key's characters (the API's header, the MCP tools' key)

EXPECTED_FORMAT = (
    "t=<unix seconds>,v4=<hex HMAC-SHA256 of 'v4\\n<t>\\n<METHOD>\\n<len(path)>:<path>\\n"
    "<len(Idempotency-Key)>:<Idempotency-Key>\\n<body>'>"
)
MAX_TIMESTAMP_DIGITS = 12  # unix seconds until the year 33658; a longer t= is malformed, not a big int


class SignatureError(ValueError):
    """The request is not signed, or not signed by someone holding the secret; ``reason`` says which."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


def parse_header(header: str | None) -> tuple[int, dict[str, list[str]]]:
    """(timestamp, signatures by scheme) of a header; SignatureError when it is missing or malformed.
    Cheap and body-free, so a route can refuse a bad header before it reads the body."""
    if header is None or not header.strip():
        raise SignatureError(f"missing {SIGNATURE_HEADER} header")
    if len(header) > 4096:
        raise SignatureError(f"malformed {SIGNATURE_HEADER} header: it is over 4096 characters")
    timestamp: int | None = None
    signatures: dict[str, list[str]] = {BOUND_SCHEME: [], KEYED_SCHEME: [], SCHEME: [], LEGACY_SCHEME: []}
    for item in header.split(","):
        key, sep, value = item.strip().partition("=")
        key, value = key.strip(), value.strip()
        if not sep or not key or not value:
            raise SignatureError(f"malformed {SIGNATURE_HEADER} header: expected {EXPECTED_FORMAT}")
        if key == "t":
            if (
                timestamp is not None
                or not value.isascii()
                or not value.isdigit()
                or len(value) > MAX_TIMESTAMP_DIGITS
            ):
                raise SignatureError(
                    f"malformed {SIGNATURE_HEADER} header: t must be one integer of unix seconds"
                )
            timestamp = int(value)
        elif key in signatures:
            signatures[key].append(value.lower())
        # Other schemes (a future v5, say) are ignored so senders can add them before we verify them.
    if timestamp is None or not any(signatures.values()):
        raise SignatureError(f"malformed {SIGNATURE_HEADER} header: expected {EXPECTED_FORMAT}")
    return timestamp, signatures


def _check_age(timestamp: int, tolerance: int, now: float | None) -> None:
    current = time.time() if now is None else now
    age = current - timestamp
    if age > tolerance:
        raise SignatureError(
            f"signature timestamp is too old ({int(age)} s; tolerance is {tolerance} s): "
            "sign each delivery when it is sent"
        )
    if -age > tolerance:
        raise SignatureError(
            f"signature timestamp is {int(-age)} s in the future (tolerance is {tolerance} s): "
            "check the sender's clock"
        )


def check_header(
    header: str | None,
    tolerance: int,
    now: float | None = None,
    *,
    method: str | None = None,
    path: str | None = None,
    idempotency_key: str | None = None,
    accept_v3: bool = True,
    accept_v2: bool = True,
    accept_v1: bool = False,
) -> tuple[int, dict[str, list[str]]]:
    """What ``verify`` checks before it needs the body: the header's form, a scheme this server checks
    for the request, and the timestamp's age. A route runs it before reading the body, so a stale or
    unusable header never holds one of the few places a large body reads in."""
    timestamp, signatures = parse_header(header)
    if method is not None or path is not None:
        why = _unusable(signatures, idempotency_key, accept_v3, accept_v2, accept_v1)
        if why is not None:
            raise SignatureError(why)
    _check_age(timestamp, tolerance, now)
    return timestamp, signatures


def _any_match(expected: str, candidates: list[str]) -> bool:
    # Compare against every candidate (no early exit) so timing says nothing about which one matched.
    matched = False
    for candidate in candidates:
        matched |= hmac.compare_digest(expected.encode("ascii"), candidate.encode("utf-8", "replace"))
    return matched


def _unusable(
    signatures: dict[str, list[str]],
    idempotency_key: str | None,
    accept_v3: bool,
    accept_v2: bool,
    accept_v1: bool,
) -> str | None:
    """Why a bound request's header holds no entry this server checks, or None when it holds one."""
    # A v4 with no key binds its absence, but a copy sent again within the window is a new delivery
    # (nothing to deduplicate it by): as exposed as v2, it passes while v2 does.
    signable = signable_key(idempotency_key) if idempotency_key is not None else accept_v2
    if signatures[BOUND_SCHEME] and signable:
        return None
    keyed = idempotency_key is not None and signable_key(idempotency_key)
    if accept_v3 and signatures[KEYED_SCHEME] and keyed:
        return None
    if (accept_v2 and signatures[SCHEME]) or (accept_v1 and signatures[LEGACY_SCHEME]):
        return None
    signing = [s for s in (BOUND_SCHEME, KEYED_SCHEME) if signatures[s] and (s == BOUND_SCHEME or accept_v3)]
    if signing and idempotency_key is not None:
        return f"a {signing[0]} signature signs only an {IDEMPOTENCY_HEADER} of printable ASCII characters"
    if accept_v3 and signatures[KEYED_SCHEME]:
        return f"a v3 signature signs the {IDEMPOTENCY_HEADER} header: send the key it was made with"
    if signatures[BOUND_SCHEME]:
        return (
            f"a signed delivery needs an {IDEMPOTENCY_HEADER} header here, which the signature binds (a "
            "key in the body does not count: a copy of the delivery sent again within the signature's "
            "window could come under another; FACTMILL_ACCEPT_V2_SIGNATURES is off)"
        )
    held = [
        s
        for s, on in ((KEYED_SCHEME, accept_v3), (SCHEME, accept_v2), (LEGACY_SCHEME, accept_v1))
        if not on and signatures[s]
    ]
    if held:
        return (
            f"{SIGNATURE_HEADER} carries no signature this server accepts ({' and '.join(held)} "
            f"refused): expected {EXPECTED_FORMAT}"
        )
    return f"{SIGNATURE_HEADER} carries no signature bound to the request: expected {EXPECTED_FORMAT}"


def verify(
    header: str | None,
    body: bytes,
    secret: str | Sequence[str],
    tolerance: int,
    now: float | None = None,
    *,
    method: str | None = None,
    path: str | None = None,
    idempotency_key: str | None = None,
    accept_v3: bool = True,
    accept_v2: bool = True,
    accept_v1: bool = False,
) -> int:
    """The signed timestamp, or SignatureError unless ``header`` signs the request with ``secret`` (or
    any of several, while the secret is rotated) within ``tolerance`` s. With ``method``/``path`` a v4
    signature over them and ``idempotency_key`` (None: the request sends none) passes, a v3 one while
    ``accept_v3``, a v2 one while ``accept_v2``, a v1 one while ``accept_v1``; without them only v1 is
    checked (the pure, route-less form)."""
    secrets = [secret] if isinstance(secret, str) else list(secret)
    if not secrets or not all(secrets):
        parse_header(header)  # a missing header is still reported as missing
        # An empty key would let anyone compute a valid signature.
        raise SignatureError("webhook signing secret is not configured (set FACTMILL_WEBHOOK_SECRET)")
    timestamp, signatures = check_header(
        header,
        tolerance,
        now,
        method=method,
        path=path,
        idempotency_key=idempotency_key,
        accept_v3=accept_v3,
        accept_v2=accept_v2,
        accept_v1=accept_v1,
    )
    bound = method is not None or path is not None
    signable = signable_key(idempotency_key) if idempotency_key is not None else accept_v2
    matched = False
    # Every secret is tried (no early exit), as every candidate is; a scheme the header carries no entry
    # of is not computed (a hash of the whole body each: the sender knows what it sent, timing tells it
    # nothing new).
    for one in secrets:
        if bound and signatures[BOUND_SCHEME] and signable:
            expected = compute_bound_signature(
                body, one, timestamp, method or "", path or "", idempotency_key
            )
            matched |= _any_match(expected, signatures[BOUND_SCHEME])
        if bound and accept_v3 and signatures[KEYED_SCHEME] and idempotency_key is not None and signable:
            expected = compute_signature(body, one, timestamp, method, path, idempotency_key)
            matched |= _any_match(expected, signatures[KEYED_SCHEME])
        if bound and accept_v2 and signatures[SCHEME]:
            matched |= _any_match(compute_signature(body, one, timestamp, method, path), signatures[SCHEME])
        if (not bound or accept_v1) and signatures[LEGACY_SCHEME]:
            matched |= _any_match(compute_signature(body, one, timestamp), signatures[LEGACY_SCHEME])
    if not matched:
        raise SignatureError(
            "signature does not match the request (wrong secret, or the body, method, path or "
            f"{IDEMPOTENCY_HEADER} differ from what was signed)"
        )
    return timestamp


__all__ = [
    "BOUND_SCHEME",
    "IDEMPOTENCY_HEADER",
    "KEYED_SCHEME",
    "LEGACY_SCHEME",
    "SCHEME",
    "SIGNATURE_HEADER",
    "SignatureError",
    "check_header",
    "compute_bound_signature",
    "compute_signature",
    "parse_header",
    "sign",
    "signed_json_headers",
    "verify",
]
