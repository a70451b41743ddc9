"""Accent folding: the rule lexical search indexes and queries by (SQL ``search_fold``, migration 0021),
in Python for what compares words outside Postgres (snippet lines). A test holds the two equal."""

from __future__ import annotations

import re
import unicodedata

# The Combining Diacritical Marks block: é, ñ, å, ü, Greek tonos. Marks of other scripts (Devanagari
# vowel signs, kana dakuten) carry meaning and stay.
_COMBINING = re.compile("[\u0300-\u036f]")
_LETTERS = str.maketrans("øØłŁđĐ", "oOlLdD")  # letters with a stroke have no decomposition


def fold_accents(text: str) -> str:
    """``text`` without the accents of its letters ("Zoë Ångström" is "Zoe Angstrom"); ASCII text is
    returned as it is."""
    if text.isascii():
        return text
    stripped = _COMBINING.sub("", unicodedata.normalize("NFD", text))
    return unicodedata.normalize("NFC", stripped).translate(_LETTERS)


__all__ = ["fold_accents"]
