"""Webhook signatures: sign and verify, tolerance window, malformed headers, secret rotation."""

from __future__ import annotations

import hashlib
import hmac

import pytest

from worker.core.signing import SignatureError, compute_signature, sign, verify

SECRET = "whsec-test"
BODY = b'{"slug": "a", "type": "conversation"}'
NOW = 1_700_000_000


def reason(header: str | None, body: bytes = BODY, secret: str = SECRET, now: float = NOW) -> str:
    with pytest.raises(SignatureError) as info:
        verify(header, body, secret, 300, now=now)
    return info.value.reason


def test_sign_produces_t_and_v1_hmac_of_timestamp_dot_body() -> None:
    header = sign(BODY, SECRET, timestamp=NOW)
    expected = hmac.new(SECRET.encode(), f"{NOW}.".encode() + BODY, hashlib.sha256).hexdigest()
    assert header == f"t={NOW},v1={expected}"
    assert compute_signature(BODY, SECRET, NOW) == expected


def test_sign_defaults_to_now() -> None:
    header = sign(BODY, SECRET)
    verify(header, BODY, SECRET, 300)  # no exception


def test_round_trip_within_tolerance() -> None:
    verify(sign(BODY, SECRET, timestamp=NOW), BODY, SECRET, 300, now=NOW)
    verify(sign(BODY, SECRET, timestamp=NOW - 300), BODY, SECRET, 300, now=NOW)  # exactly at the edge
    verify(sign(BODY, SECRET, timestamp=NOW + 300), BODY, SECRET, 300, now=NOW)


@pytest.mark.parametrize("header", [None, "", "   "])
def test_missing_header(header: str | None) -> None:
    assert "missing" in reason(header)


@pytest.mark.parametrize(
    "header",
    [
        "garbage",
        "t=123",
        "v1=abc",
        "t=abc,v1=def",
        "t=-5,v1=def",
        "t=1,t=2,v1=def",
        "t=1,,v1=def",
        "t=,v1=def",
        "t=١٢٣,v1=def",  # non-ASCII digits
    ],
)
def test_malformed_header(header: str) -> None:
    assert "malformed" in reason(header)


def test_stale_timestamp_is_rejected_with_its_age() -> None:
    message = reason(sign(BODY, SECRET, timestamp=NOW - 360))
    assert "too old" in message and "360" in message


def test_future_timestamp_is_rejected() -> None:
    assert "future" in reason(sign(BODY, SECRET, timestamp=NOW + 301))


def test_wrong_secret_and_altered_body() -> None:
    assert "does not match" in reason(sign(BODY, "other-secret", timestamp=NOW))
    assert "does not match" in reason(sign(BODY, SECRET, timestamp=NOW), body=BODY + b" ")


def test_timestamp_is_part_of_the_signature() -> None:
    signature = compute_signature(BODY, SECRET, NOW)
    assert "does not match" in reason(f"t={NOW + 1},v1={signature}")


def test_several_v1_entries_allow_secret_rotation() -> None:
    old = compute_signature(BODY, "old-secret", NOW)
    new = compute_signature(BODY, "new-secret", NOW)
    header = f"t={NOW},v1={old},v1={new}"
    verify(header, BODY, "new-secret", 300, now=NOW)
    verify(header, BODY, "old-secret", 300, now=NOW)
    assert "does not match" in reason(header, secret="third-secret")


def test_unknown_schemes_are_ignored_and_spaces_tolerated() -> None:
    signature = compute_signature(BODY, SECRET, NOW)
    verify(f"t={NOW}, v0=deadbeef, v1={signature.upper()}", BODY, SECRET, 300, now=NOW)


def test_non_ascii_signature_is_a_mismatch_not_a_crash() -> None:
    assert "does not match" in reason(f"t={NOW},v1=é")


def test_empty_secret_is_refused() -> None:
    assert "not configured" in reason(sign(BODY, "any", timestamp=NOW), secret="")
    with pytest.raises(ValueError, match="required"):  # nor does a sender sign with one
        sign(BODY, "", timestamp=NOW)
    with pytest.raises(ValueError, match="required"):
        sign(BODY, [], timestamp=NOW)


def test_a_sender_signs_with_each_secret_and_the_server_accepts_any_of_its_own() -> None:
    """Rotation, either way round: a sender signs with the old and the new secret (one v2 entry each)
    while the server switches; or the server accepts its previous secret while senders move."""
    both = sign(BODY, ["old-secret", "new-secret"], NOW, method="POST", path="/v1/pages")
    assert both.count("v2=") == 2
    verify(both, BODY, "new-secret", 300, now=NOW, method="POST", path="/v1/pages")
    verify(both, BODY, "old-secret", 300, now=NOW, method="POST", path="/v1/pages")
    for sender in ("old-secret", "new-secret"):
        header = sign(BODY, sender, NOW, method="POST", path="/v1/pages")
        verify(header, BODY, ["new-secret", "old-secret"], 300, now=NOW, method="POST", path="/v1/pages")
    stranger = sign(BODY, "third-secret", NOW, method="POST", path="/v1/pages")
    with pytest.raises(SignatureError, match="does not match"):
        verify(stranger, BODY, ["new-secret", "old-secret"], 300, now=NOW, method="POST", path="/v1/pages")
    with pytest.raises(SignatureError, match="not configured"):
        verify(stranger, BODY, ["new-secret", ""], 300, now=NOW, method="POST", path="/v1/pages")


def test_signature_error_is_a_value_error() -> None:
    assert issubclass(SignatureError, ValueError)


ROUTE = {"method": "POST", "path": "/v1/transcripts/chat-1/messages"}


def keyed_reason(header: str, key: str | None, **options: bool) -> str:
    with pytest.raises(SignatureError) as info:
        verify(header, BODY, SECRET, 300, now=NOW, idempotency_key=key, **ROUTE, **options)
    return info.value.reason


def test_v3_signs_the_idempotency_key_with_the_route_and_body() -> None:
    header = sign(BODY, SECRET, NOW, idempotency_key="delivery-1", **ROUTE)
    message = f"{NOW}.POST.{ROUTE['path']}.delivery-1.".encode() + BODY
    assert header == f"t={NOW},v3={hmac.new(SECRET.encode(), message, hashlib.sha256).hexdigest()}"
    assert verify(header, BODY, SECRET, 300, now=NOW, idempotency_key="delivery-1", **ROUTE) == NOW


def test_a_v3_delivery_sent_again_under_another_key_or_none_is_refused() -> None:
    """The replay v2 allowed: a captured delivery re-sent within the window under a fresh key was a new
    delivery (stored twice). Under v3 the key is signed, so only the original key passes, and the
    server answers that one with the stored answer."""
    header = sign(BODY, SECRET, NOW, idempotency_key="delivery-1", **ROUTE)
    assert "does not match" in keyed_reason(header, "delivery-2")
    assert "Idempotency-Key" in keyed_reason(header, None)  # dropping the key is no way round it
    verify(header, BODY, SECRET, 300, now=NOW, idempotency_key="delivery-1", accept_v2=False, **ROUTE)


def test_v2_passes_while_accepted_and_is_refused_once_it_is_turned_off() -> None:
    v2 = sign(BODY, SECRET, NOW, **ROUTE)
    verify(v2, BODY, SECRET, 300, now=NOW, idempotency_key="any-key", **ROUTE)  # the default accepts it
    assert "v2 refused" in keyed_reason(v2, "any-key", accept_v2=False)
    v1 = sign(BODY, SECRET, NOW)
    assert "(v1 refused)" in keyed_reason(v1, "k")  # what the header holds is named
    both = f"{v2},{v1.partition(',')[2]}"
    assert "(v2 and v1 refused)" in keyed_reason(both, "k", accept_v2=False)


def test_a_header_with_v3_and_v2_entries_passes_either_way() -> None:
    """A sender moving to v3 may send both entries, so servers not yet verifying v3 take the v2 one."""
    v3 = sign(BODY, SECRET, NOW, idempotency_key="k", **ROUTE).partition(",")[2]
    v2 = sign(BODY, SECRET, NOW, **ROUTE).partition(",")[2]
    both = f"t={NOW},{v3},{v2}"
    verify(both, BODY, SECRET, 300, now=NOW, idempotency_key="k", accept_v2=False, **ROUTE)
    verify(both, BODY, SECRET, 300, now=NOW, idempotency_key=None, **ROUTE)  # v2 carries it


def test_a_key_with_dots_still_binds_exactly() -> None:
    header = sign(BODY, SECRET, NOW, idempotency_key="alice.2024.03", **ROUTE)
    verify(header, BODY, SECRET, 300, now=NOW, idempotency_key="alice.2024.03", accept_v2=False, **ROUTE)
    assert "does not match" in keyed_reason(header, "alice.2024", accept_v2=False)


def test_signing_a_key_needs_the_route_and_a_clean_key() -> None:
    with pytest.raises(ValueError, match="method and the path"):
        sign(BODY, SECRET, NOW, idempotency_key="k")
    for bad in (" k", "", "clé-1", "k\n", "x" * 256):
        with pytest.raises(ValueError, match="printable ASCII"):
            sign(BODY, SECRET, NOW, idempotency_key=bad, **ROUTE)


def test_a_non_ascii_key_under_v3_is_refused_with_the_reason_not_a_mismatch() -> None:
    """Starlette reads header bytes as latin-1 and a sender may write UTF-8: a key outside ASCII would
    be signed as one text and checked as another, so it is refused as unsignable."""
    forged = f"t={NOW},v3=" + "0" * 64
    assert "printable ASCII" in keyed_reason(forged, "clÃ©-1")


def test_checking_a_signature_copies_no_body() -> None:
    # Each scheme's HMAC hashed ``message + body``: a copy of the body per scheme and per secret
    # (v3, v2 and two secrets while one is rotated: four copies of up to 25 MiB a request).
    import tracemalloc

    from factmill_client.signing import sign
    from worker.core.signing import verify

    body = b"x" * (4 * 1024 * 1024)
    header = sign(body, "new", method="POST", path="/v1/pages", idempotency_key="k")
    tracemalloc.start()
    try:
        verify(header, body, ["old", "new"], 300, method="POST", path="/v1/pages", idempotency_key="k")
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 256 * 1024, peak
