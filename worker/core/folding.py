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


# Scripts written without spaces between words: kana, the CJK ideographs (with extension A and the
# compatibility block) and Hangul syllables. Postgres's parser reads such a run as one word, so a
# sentence was one lexeme and a word inside it could not be found; the index and the queries
# (SQL ``search_words``, migration 0049) put a space around each of these characters, and a query word
# holding one is searched by the overlapping pairs of its pieces (worker.core.lexing). Keep in step with
# that migration (a test holds the two equal).
UNSPACED_SCRIPT_RANGES = (
    ("\u3040", "\u30ff"),  # Hiragana, Katakana
    ("\u3400", "\u4dbf"),  # CJK Unified Ideographs Extension A
    ("\u4e00", "\u9fff"),  # CJK Unified Ideographs
    ("\uac00", "\ud7af"),  # Hangul Syllables
    ("\uf900", "\ufaff"),  # CJK Compatibility Ideographs
)
_RANGES = "".join(f"{low}-{high}" for low, high in UNSPACED_SCRIPT_RANGES)
UNSPACED_RUN = re.compile(f"[{_RANGES}]+")
# A word's pieces as a search reads them: one character of those scripts, or a run of other letters and
# digits, with the punctuation Postgres's parser keeps inside a token between them ("3.5", "2024-05-03",
# "e-mail", "example.com"); other punctuation, and the underscore, separates pieces.
_OTHER = f"[^\\W_{_RANGES}]+"
UNSPACED_PIECE = re.compile(f"[{_RANGES}]|{_OTHER}(?:[.\\-/@:,']{_OTHER})*")


def has_unspaced_script(text: str) -> bool:
    """Whether ``text`` holds a character of a script written without spaces (UNSPACED_SCRIPT_RANGES).
    Asked of folded text (``fold_accents``): decomposed Hangul is composed into syllables only there."""
    return not text.isascii() and UNSPACED_RUN.search(text) is not None


__all__ = ["UNSPACED_PIECE", "UNSPACED_RUN", "UNSPACED_SCRIPT_RANGES", "fold_accents", "has_unspaced_script"]
