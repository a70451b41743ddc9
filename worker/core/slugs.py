"""The page slug rule: path-like parts of Unicode letters and digits, NFC-normalized, no traversal."""

from __future__ import annotations

import unicodedata

SLUG_RULE = (
    "slug must be one or more parts separated by single '/'; each part starts with a letter or digit "
    "(any script) and holds only letters, combining marks, digits, '.', '_' and '-' (no spaces, no "
    "control characters, no leading or trailing '/')"
)
_PUNCTUATION = frozenset("._-")
# The same rule as an ECMA-262 regular expression (Unicode property escapes), for the OpenAPI document;
# tests/unit/test_slugs.py checks that it accepts exactly what ``normalize_slug`` accepts.
_PART = r"[\p{L}\p{Nd}][\p{L}\p{M}\p{Nd}._-]*"
SLUG_PATTERN = rf"^{_PART}(?:/{_PART})*$"


def _starts_part(char: str) -> bool:
    category = unicodedata.category(char)
    return category[0] == "L" or category == "Nd"


def _continues_part(char: str) -> bool:
    return _starts_part(char) or unicodedata.category(char)[0] == "M" or char in _PUNCTUATION


def stored_form(value: str) -> str:
    """A slug or slug prefix in the form slugs are stored in (NFC), for looking one up as a user typed
    it: macOS writes "café" in NFD."""
    return unicodedata.normalize("NFC", value)


def normalize_slug(value: str) -> str:
    """The slug in NFC, or ValueError(SLUG_RULE).

    NFD input is normalized rather than refused: macOS file names are NFD, and `factmill ingest`
    derives slugs from them, so "café" typed and "café" from a file must name the same page. Every
    part must start with a letter or digit, so "." and ".." parts (path traversal) cannot occur, and
    the whole string is checked, so a trailing newline is refused (the old ``$`` anchor allowed it).
    """
    slug = stored_form(value)
    for part in slug.split("/"):
        if not part or not _starts_part(part[0]) or not all(map(_continues_part, part[1:])):
            raise ValueError(SLUG_RULE)
    return slug


__all__ = ["SLUG_PATTERN", "SLUG_RULE", "normalize_slug", "stored_form"]
