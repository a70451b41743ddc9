"""Accent folding in Python (snippet lines) and what it changes in snippets: the lines of Zoë answer
"zoe", as lexical search does (tests/integration/test_search.py holds it equal to SQL's search_fold)."""

from __future__ import annotations

import pytest

from worker.core.folding import fold_accents
from worker.core.intent import extract_snippet


@pytest.mark.parametrize(
    ("text", "folded"),
    [
        ("Zoë Ångström", "Zoe Angstrom"),
        ("Søren Østergaard, Łódź", "Soren Ostergaard, Lodz"),
        ("José Núñez", "Jose Nunez"),
        ("Zoe\u0308", "Zoe"),  # NFD input
        ("한국어 が", "한국어 が"),  # Hangul and kana with dakuten are recomposed whole
        ("हिन्दी", "हिन्दी"),  # marks outside the Latin block stay
        ("plain ascii", "plain ascii"),
    ],
)
def test_fold_accents(text: str, folded: str) -> None:
    assert fold_accents(text) == folded


BODY = "\n".join(
    [
        "Kai: morning all",
        "Kai: the venue called back",
        "Zoë Ångström: I'm moving to Lisbon in July",
        "Kai: wow",
        "Kai: when?",
        "Kai: tell me more",
    ]
)


def test_a_query_without_accents_finds_the_accented_line() -> None:
    snippet = extract_snippet(BODY, "zoe angstrom")
    assert snippet.line == 3 and "\nKai: the venue called back\nZoë Ångström: I'm moving" in snippet.snippet


def test_an_accented_query_finds_the_plain_line_and_intent_folds_too() -> None:
    body = BODY.replace("Zoë Ångström", "Zoe Angstrom")
    assert extract_snippet(body, "Zoë").line == 3
    assert extract_snippet(BODY, "lisbon", intent="Ångström moving").line == 3
