"""Short labels clients choose (an origin, an idempotency key, a transcript id): the rule in Python and
the same rule as an ECMA-262 pattern for the OpenAPI document.

A label is printable text: no control, format, private-use, surrogate or unassigned characters
(Unicode category C) and no separators (category Z) but the plain space. That is ``str.isprintable``.
The patterns say it with Unicode property escapes; tests/unit/test_document_patterns.py checks, on
every character assigned in both Unicode versions, that each pattern accepts exactly what its Python
rule accepts (Python 3.11's ``unicodedata`` is Unicode 14; a regex engine may know newer letters).
"""

from __future__ import annotations

import reprlib
from collections.abc import Sequence

# What str.strip() removes (str.isspace), spelled out: ECMA's \s is a different set.
_SPACES = r"\t-\r\x1c-\x20\x85\xa0\u1680\u2000-\u200a\u2028\u2029\u202f\u205f\u3000"
_STRIPPED = rf"[{_SPACES}]"
# Text with something str.strip() leaves (unanchored, as JSON Schema patterns are).
NOT_ONLY_SPACES_PATTERN = rf"[^{_SPACES}]"
_VISIBLE = r"[^\p{C}\p{Z}]"  # printable and not a space
_PRINTABLE = rf"(?:{_VISIBLE}| )"


def clean_label(value: str, limit: int) -> str | None:
    """``value`` without surrounding whitespace, or None unless ``value`` has at most ``limit``
    characters (as sent, so the document can state it as maxLength) and what is left after stripping
    is printable and not empty."""
    cleaned = value.strip()
    if not cleaned or len(value) > limit or not cleaned.isprintable():
        return None
    return cleaned


# What ``clean_label`` accepts, but for the length (maxLength in the document): surrounding whitespace
# around printable characters that start and end visible. A bounded repetition of these large Unicode
# classes would exceed validators' regex size limits, hence the separate maxLength.
LABEL_PATTERN = rf"^{_STRIPPED}*(?:{_VISIBLE}|{_VISIBLE}{_PRINTABLE}*{_VISIBLE}){_STRIPPED}*$"


def is_word_label(value: str) -> bool:
    """Printable, with no whitespace (Unicode White_Space) and no '/': an id that can sit in a path."""
    return value.isprintable() and not any(ch.isspace() or ch == "/" for ch in value)


_QUOTED = reprlib.Repr()  # (keyword arguments only from Python 3.12)
_QUOTED.maxstring = _QUOTED.maxother = 80
_QUOTED.maxlist = _QUOTED.maxdict = 6


def quoted(value: object) -> str:
    """``repr(value)`` clipped (long text to 80 characters, long lists to 6 items) for an error that
    quotes what a client sent: quoted whole, a 1 MB value came back as a 1 MB error."""
    return _QUOTED.repr(value)


def listed_names(names: Sequence[str], shown: int = 6) -> str:
    """Names a client sent (unknown fields, settings), for a refusal: the first ``shown``, each as it is
    when short printable text, else quoted, clipped and escaped (a lone surrogate, raw, made the refusal
    impossible to encode), then how many more. Listed whole, 100,000 names (or one of a megabyte) came
    back as a megabyte of error."""

    def shown_as(name: str) -> str:
        if len(name) <= 80 and name.isprintable():
            return name
        return quoted(name).encode("ascii", "backslashreplace").decode()

    listed = ", ".join(map(shown_as, names[:shown]))
    return listed + (f" and {len(names) - shown} more" if len(names) > shown else "")


MAX_SOURCE_ID_LENGTH = 200


def is_source_id(value: str) -> bool:
    """A source id: no '|' (it separates sources in keys) and no surrounding whitespace."""
    return "|" not in value and value == value.strip()


def check_source_id(value: str) -> str:
    """``value`` when it is a source id of 1 to ``MAX_SOURCE_ID_LENGTH`` characters, else ValueError
    saying the rule: the one check behind every place a client names a source (a page, a search
    filter, a backfill, a key's sources)."""
    if not value or len(value) > MAX_SOURCE_ID_LENGTH or not is_source_id(value):
        raise ValueError(
            f"{quoted(value)} is not a source id (1 to {MAX_SOURCE_ID_LENGTH} characters, no '|', "
            "no surrounding whitespace)"
        )
    return value


# A path segment of these is a dot segment: HTTP clients remove it from a URL before sending it, so
# /v1/pages/../notes/x reaches the server as /v1/pages/notes/x and names another page.
DOT_SEGMENTS = (".", "..")


def is_new_source_id(value: str) -> bool:
    """A source id pages may be stored under: ``is_source_id``, printable (``str.isprintable``), so it
    shows as it is in a terminal, a log or a dashboard, not a dot segment (``DOT_SEGMENTS``) and not
    beginning with ``/``."""
    routable = value not in DOT_SEGMENTS and not value.startswith("/")
    return is_source_id(value) and value.isprintable() and routable


def check_new_source_id(value: str) -> str:
    """``check_source_id``, and printable: the rule for storing a page. The places that only name a
    source (a lookup, an erasure, a filter) keep ``check_source_id``, so a page stored before this rule
    under a control character stays reachable."""
    check_source_id(value)
    if value in DOT_SEGMENTS:
        raise ValueError(
            f"{value!r} is not a source id to store pages under: '.' and '..' are dropped from URLs by "
            "HTTP clients, so the page routes could not name it"
        )
    if value.startswith("/"):
        raise ValueError(
            f"{value!r} is not a source id to store pages under: a leading '/' leaves the page routes' "
            "source segment empty (/v1/pages//...), so they could not name it"
        )
    if not value.isprintable():
        raise ValueError(
            f"{value!r} is not a source id to store pages under: it holds a control, format or "
            "unassigned character, or a separator other than the space; a source id is printable text"
        )
    return value


# What ``is_source_id`` accepts (a non-empty value; its length is its own rule).
SOURCE_ID_PATTERN = rf"^(?:[^|{_SPACES}]|[^|{_SPACES}][^|]*[^|{_SPACES}])$"

# What ``is_new_source_id`` accepts: visible ends, and inside them visible characters or plain spaces.
_SOURCE_VISIBLE = r"[^|\p{C}\p{Z}]"
NEW_SOURCE_ID_PATTERN = rf"^(?!\.\.?$)(?!/){_SOURCE_VISIBLE}(?:(?:{_SOURCE_VISIBLE}| )*{_SOURCE_VISIBLE})?$"

# What ``is_word_label`` accepts: every Z character is either whitespace or not printable, and the
# C characters that are whitespace (tab, newline...) are not printable either.
WORD_LABEL_PATTERN = r"^[^\p{C}\p{Z}/]+$"

__all__ = [
    "DOT_SEGMENTS",
    "LABEL_PATTERN",
    "MAX_SOURCE_ID_LENGTH",
    "NEW_SOURCE_ID_PATTERN",
    "NOT_ONLY_SPACES_PATTERN",
    "SOURCE_ID_PATTERN",
    "WORD_LABEL_PATTERN",
    "check_new_source_id",
    "check_source_id",
    "clean_label",
    "is_new_source_id",
    "is_source_id",
    "is_word_label",
]
