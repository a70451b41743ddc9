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
    """Rotation, either way round: a sender signs with the old and the new secret (one v4 entry each)
    while the server switches; or the server accepts its previous secret while senders move."""
    both = sign(BODY, ["old-secret", "new-secret"], NOW, method="POST", path="/v1/pages")
    assert both.count("v4=") == 2
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


def v3(key: str, path: str = ROUTE["path"], method: str = "POST") -> str:
    """A v3 header, as a sender written before v4 made it."""
    return f"t={NOW},v3={compute_signature(BODY, SECRET, NOW, method, path, key)}"


def v2(path: str = ROUTE["path"], method: str = "POST") -> str:
    return f"t={NOW},v2={compute_signature(BODY, SECRET, NOW, method, path)}"


def test_v4_signs_its_name_the_route_the_idempotency_key_and_the_body() -> None:
    header = sign(BODY, SECRET, NOW, idempotency_key="delivery-1", **ROUTE)
    path = ROUTE["path"]
    message = f"v4\n{NOW}\nPOST\n{len(path)}:{path}\n10:delivery-1\n".encode() + BODY
    assert header == f"t={NOW},v4={hmac.new(SECRET.encode(), message, hashlib.sha256).hexdigest()}"
    assert verify(header, BODY, SECRET, 300, now=NOW, idempotency_key="delivery-1", **ROUTE) == NOW
    unkeyed = sign(BODY, SECRET, NOW, **ROUTE)  # no key sent: an empty one, signed as such
    message = f"v4\n{NOW}\nPOST\n{len(path)}:{path}\n0:\n".encode() + BODY
    assert unkeyed == f"t={NOW},v4={hmac.new(SECRET.encode(), message, hashlib.sha256).hexdigest()}"
    assert verify(unkeyed, BODY, SECRET, 300, now=NOW, **ROUTE) == NOW
    assert "does not match" in keyed_reason(unkeyed, "added-later")  # nor can a key be added
    # With no key, a copy sent again within the window is a new delivery (v2's exposure): refused once
    # v2 is, as an unkeyed delivery was before v4.
    assert "needs an Idempotency-Key header here" in keyed_reason(unkeyed, None, accept_v2=False)


def test_a_v3_delivery_verifies_while_v3_is_accepted() -> None:
    assert verify(v3("delivery-1"), BODY, SECRET, 300, now=NOW, idempotency_key="delivery-1", **ROUTE) == NOW
    assert "(v3 refused)" in keyed_reason(v3("delivery-1"), "delivery-1", accept_v3=False)


TRANSCRIPT = "/v1/transcripts/abc"


def test_no_v4_signature_moves_to_another_transcript_by_a_dot() -> None:
    """The older schemes join their parts with dots, which a transcript id and a key may hold: a v3
    signature for PUT /v1/transcripts/abc with key K verified as v2 for transcript abc.K, a v2 one for
    transcript team.alpha as v3 for transcript team with key alpha, and a v3 key x.y on abc as key y on
    abc.x: a captured delivery changed another transcript's settings. v4 binds each part apart."""

    def passes(header: str, path: str, key: str | None, **options: bool) -> bool:
        try:
            verify(
                header, BODY, SECRET, 300, now=NOW, method="PUT", path=path, idempotency_key=key, **options
            )
        except SignatureError:
            return False
        return True

    # The older schemes' ambiguity, kept while their switches are on (the reason to turn them off).
    assert passes(v3("K", TRANSCRIPT, "PUT").replace("v3=", "v2="), f"{TRANSCRIPT}.K", None)
    assert passes(
        v2("/v1/transcripts/team.alpha", "PUT").replace("v2=", "v3="), "/v1/transcripts/team", "alpha"
    )
    assert passes(v3("x.y", TRANSCRIPT, "PUT"), f"{TRANSCRIPT}.x", "y", accept_v2=False)
    assert not passes(v3("x.y", TRANSCRIPT, "PUT"), f"{TRANSCRIPT}.x", "y", accept_v3=False)
    # v4: the same moves, relabelled to any scheme, pass nowhere.
    keyed = sign(BODY, SECRET, NOW, method="PUT", path=TRANSCRIPT, idempotency_key="x.y")
    unkeyed = sign(BODY, SECRET, NOW, method="PUT", path="/v1/transcripts/team.alpha")
    assert passes(keyed, TRANSCRIPT, "x.y") and passes(unkeyed, "/v1/transcripts/team.alpha", None)
    for header in (keyed, unkeyed):
        for scheme in ("v4", "v3", "v2"):
            relabelled = header.replace("v4=", f"{scheme}=")
            for path, key in (
                (f"{TRANSCRIPT}.x", "y"),
                (f"{TRANSCRIPT}.x.y", None),
                ("/v1/transcripts/team", "alpha"),
                (TRANSCRIPT, None),
                ("/v1/transcripts/team.alpha", "k"),
            ):
                assert not passes(relabelled, path, key), (scheme, path, key)


def test_a_v3_delivery_sent_again_under_another_key_or_none_is_refused() -> None:
    """The replay v2 allowed: a captured delivery re-sent within the window under a fresh key was a new
    delivery (stored twice). Under v4 (and v3) the key is signed, so only the original key passes, and
    the server answers that one with the stored answer."""
    for header in (sign(BODY, SECRET, NOW, idempotency_key="delivery-1", **ROUTE), v3("delivery-1")):
        assert "does not match" in keyed_reason(header, "delivery-2")
        assert "Idempotency-Key" in keyed_reason(header, None)  # dropping the key is no way round it
        verify(header, BODY, SECRET, 300, now=NOW, idempotency_key="delivery-1", accept_v2=False, **ROUTE)


def test_v2_passes_while_accepted_and_is_refused_once_it_is_turned_off() -> None:
    verify(v2(), BODY, SECRET, 300, now=NOW, idempotency_key="any-key", **ROUTE)  # the default accepts it
    assert "v2 refused" in keyed_reason(v2(), "any-key", accept_v2=False)
    v1 = sign(BODY, SECRET, NOW)
    assert "(v1 refused)" in keyed_reason(v1, "k")  # what the header holds is named
    both = f"{v2()},{v1.partition(',')[2]}"
    assert "(v2 and v1 refused)" in keyed_reason(both, "k", accept_v2=False)
    everything = f"{v3('k')},{v2().partition(',')[2]},{v1.partition(',')[2]}"
    assert "(v3 and v2 and v1 refused)" in keyed_reason(everything, "k", accept_v3=False, accept_v2=False)


def test_a_header_with_entries_of_several_schemes_passes_by_any_accepted_one() -> None:
    """A sender moving to v4 may send older entries too, so servers not yet verifying v4 take those."""
    v4 = sign(BODY, SECRET, NOW, idempotency_key="k", **ROUTE).partition(",")[2]
    both = f"t={NOW},{v3('k').partition(',')[2]},{v2().partition(',')[2]}"
    verify(both, BODY, SECRET, 300, now=NOW, idempotency_key="k", accept_v2=False, **ROUTE)
    verify(both, BODY, SECRET, 300, now=NOW, idempotency_key=None, **ROUTE)  # v2 carries it
    newest = f"{both},{v4}"
    verify(newest, BODY, SECRET, 300, now=NOW, idempotency_key="k", accept_v3=False, accept_v2=False, **ROUTE)


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


def test_a_non_ascii_key_under_v4_or_v3_is_refused_with_the_reason_not_a_mismatch() -> None:
    """Starlette reads header bytes as latin-1 and a sender may write UTF-8: a key outside ASCII would
    be signed as one text and checked as another, so it is refused as unsignable."""
    for scheme in ("v4", "v3"):
        forged = f"t={NOW},{scheme}=" + "0" * 64
        assert f"a {scheme} signature signs only" in keyed_reason(forged, "clÃ©-1")


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
