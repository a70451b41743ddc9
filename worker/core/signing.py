"""Webhook signatures: ``Factmill-Signature: t=<unix seconds>,v1=<hex HMAC-SHA256 of "t.body">``.

The scheme follows Stripe's: the timestamp is signed together with the body, so a captured
request cannot be replayed after the tolerance window, and a header may carry several ``v1=``
entries so a sender can sign with the old and the new secret while the secret is rotated.
"""

from __future__ import annotations

import hashlib
import hmac
import time

SIGNATURE_HEADER = "Factmill-Signature"
SCHEME = "v1"
EXPECTED_FORMAT = "t=<unix seconds>,v1=<hex HMAC-SHA256 of '<t>.<body>'>"


class SignatureError(ValueError):
    """The request is not signed, or not signed by someone holding the secret; ``reason`` says which."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


def compute_signature(body: bytes, secret: str, timestamp: int) -> str:
    """Hex HMAC-SHA256 of ``b"<timestamp>." + body`` under ``secret``."""
    message = str(timestamp).encode("ascii") + b"." + body
    return hmac.new(secret.encode("utf-8"), message, hashlib.sha256).hexdigest()


def sign(body: bytes, secret: str, timestamp: int | None = None) -> str:
    """The ``Factmill-Signature`` header value for ``body`` (timestamp defaults to now)."""
    t = int(time.time()) if timestamp is None else int(timestamp)
    return f"t={t},{SCHEME}={compute_signature(body, secret, t)}"


def _parse(header: str) -> tuple[int, list[str]]:
    timestamp: int | None = None
    signatures: list[str] = []
    for item in header.split(","):
        key, sep, value = item.strip().partition("=")
        key, value = key.strip(), value.strip()
        if not sep or not key or not value:
            raise SignatureError(f"malformed {SIGNATURE_HEADER} header: expected {EXPECTED_FORMAT}")
        if key == "t":
            # At most 12 digits (year 33658): a longer t cannot be a real clock and would overflow
            # the float arithmetic of the age check.
            if timestamp is not None or not value.isascii() or not value.isdigit() or len(value) > 12:
                raise SignatureError(
                    f"malformed {SIGNATURE_HEADER} header: t must be one integer of unix seconds"
                )
            timestamp = int(value)
        elif key == SCHEME:
            signatures.append(value.lower())
        # Other schemes (a future v2, say) are ignored so senders can add them before we verify them.
    if timestamp is None or not signatures:
        raise SignatureError(f"malformed {SIGNATURE_HEADER} header: expected {EXPECTED_FORMAT}")
    return timestamp, signatures


def verify(header: str | None, body: bytes, secret: str, tolerance: int, now: float | None = None) -> None:
    """Raise ``SignatureError`` unless ``header`` signs ``body`` with ``secret`` within ``tolerance`` s."""
    if header is None or not header.strip():
        raise SignatureError(f"missing {SIGNATURE_HEADER} header")
    if not secret:
        # An empty key would let anyone compute a valid signature.
        raise SignatureError("webhook signing secret is not configured (set FACTMILL_WEBHOOK_SECRET)")
    timestamp, signatures = _parse(header)
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
    expected = compute_signature(body, secret, timestamp).encode("ascii")
    # Compare against every candidate (no early exit) so timing says nothing about which one matched.
    matched = False
    for candidate in signatures:
        matched |= hmac.compare_digest(expected, candidate.encode("utf-8", "replace"))
    if not matched:
        raise SignatureError("signature does not match the body (wrong secret, or the body was altered)")


__all__ = ["SIGNATURE_HEADER", "SignatureError", "compute_signature", "sign", "verify"]
