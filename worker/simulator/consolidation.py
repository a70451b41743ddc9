"""What the simulator says to a consolidation prompt: a decision per fact pair from word overlap and
dates. Not a model: a deterministic stand-in, so tests and the demo run without one (it says so)."""

from __future__ import annotations

import re
import unicodedata
from dataclasses import dataclass
from typing import Any

from worker.core.consolidation_prompt import PAIRS_TAG

PAIRS_OPEN, PAIRS_CLOSE = f"<{PAIRS_TAG}>", f"</{PAIRS_TAG}>"
_PAIR = re.compile(
    r"^(?P<n>\d+)\. NEW \((?P<nkind>[^,]+), (?P<ndate>[^)]+)\): (?P<new>.*)\n"
    r"\s+OLD \((?P<okind>[^,]+), (?P<odate>[^)]+)\): (?P<old>.*)$",
    re.MULTILINE,
)
_WORD = re.compile(r"[^\W_]+")
_ENTITY = re.compile(r"^entity: (.*)$", re.MULTILINE)
_STOP = frozenset(
    (
        *("a", "an", "the", "is", "are", "was", "were", "be", "been", "of", "to", "in", "on", "at"),
        *("for", "and", "or", "with", "by", "from", "that", "this", "it", "its", "as", "now", "s", "said"),
    )
)
# Below this share of shared words, the two facts are about different things.
RELATED_OVERLAP = 0.25
# At or above this share, facts whose names and numbers agree say the same thing.
DUPLICATE_OVERLAP = 0.6
LABEL = "simulator (not a model)"


@dataclass(frozen=True)
class _Pair:
    number: int
    kind: str
    new: str
    new_date: str
    old: str
    old_date: str


def is_consolidation_prompt(text: str) -> bool:
    return PAIRS_OPEN in text and PAIRS_CLOSE in text


def _fold(word: str) -> str:
    return "".join(ch for ch in unicodedata.normalize("NFKD", word.lower()) if not unicodedata.combining(ch))


def _words(text: str, ignore: frozenset[str]) -> dict[str, str]:
    """Content words by their folded form, each with its spelling as written; the entity's own name
    and stop words left out."""
    out: dict[str, str] = {}
    for word in _WORD.findall(text):
        folded = _fold(word)
        if folded not in _STOP and folded not in ignore:
            out[folded] = word
    return out


def _is_value(word: str) -> bool:
    """A word that names a value (a name, a place, a number): its change is a change of fact."""
    return word[:1].isupper() or any(ch.isdigit() for ch in word)


def _about_someone_else(text: str) -> bool:
    """ "Ana's sister lives in Oslo": the fact is about the sister, not Ana (a possessive then a noun)."""
    return bool(re.match(r"^[^.]*?\b\w+'s [a-z]+ (?:is|was|lives|works|has|pays|likes)\b", text))


def _jaccard(left: set[str], right: set[str]) -> float:
    return len(left & right) / len(left | right) if left and right else 0.0


def decide(pair: _Pair, ignore: frozenset[str] = frozenset()) -> dict[str, Any]:
    """Related when their ordinary words (not names or numbers) overlap. Then: a changed name or
    number, or changed ordinary words below DUPLICATE_OVERLAP, is an update when the dates differ
    (a contradiction on the same day; events never replace each other); else a duplicate."""
    new, old = _words(pair.new, ignore), _words(pair.old, ignore)
    ordinary = _jaccard(
        {w for w, s in new.items() if not _is_value(s)}, {w for w, s in old.items() if not _is_value(s)}
    )
    overlap = _jaccard(set(new), set(old))
    added = [new[w] for w in new.keys() - old.keys()]
    dropped = [old[w] for w in old.keys() - new.keys()]
    values_changed = any(_is_value(w) for w in (*added, *dropped))
    head = f"{LABEL}: {overlap:.0%} of the words shared"
    if _about_someone_else(pair.new) != _about_someone_else(pair.old):
        return _answer(pair, "unrelated", f"{head}; one is about someone else (a possessive)")
    same_values = {w for w, s in new.items() if _is_value(s)} == {w for w, s in old.items() if _is_value(s)}
    if same_values and any(_is_value(s) for s in new.values()) and pair.kind != "event":
        return _answer(pair, "duplicate", f"{head}; the same names and numbers, restated")
    if ordinary < RELATED_OVERLAP:
        return _answer(pair, "unrelated", f"{head}; about different things")
    if not values_changed and (overlap >= DUPLICATE_OVERLAP or not (added and dropped)):
        return _answer(pair, "duplicate", f"{head}; only ordinary words differ")
    change = f"{', '.join(dropped) or '-'} -> {', '.join(added) or '-'}"
    if pair.kind == "event":
        return _answer(pair, "unrelated", f"{head}; two events ({change}) can both have happened")
    if pair.new_date == pair.old_date:
        return _answer(pair, "contradicts", f"{head}; {change} on the same date")
    return _answer(pair, "updates", f"{head}; {change}, dated {pair.old_date} then {pair.new_date}")


def _answer(pair: _Pair, decision: str, reason: str) -> dict[str, Any]:
    return {"pair": pair.number, "decision": decision, "reason": reason}


def consolidation_reply(text: str) -> dict[str, Any]:
    """The decisions document for the pairs inside the prompt's <fact-pairs> block."""
    start = text.find(PAIRS_OPEN)
    end = text.rfind(PAIRS_CLOSE)
    block = text[start + len(PAIRS_OPEN) : end] if 0 <= start < end else ""
    pairs = [
        _Pair(int(m["n"]), m["nkind"].strip(), m["new"], m["ndate"], m["old"], m["odate"])
        for m in _PAIR.finditer(block)
    ]
    entity = _ENTITY.search(block)
    ignore = (
        frozenset(_fold(w) for w in _WORD.findall(entity[1].replace("-", " "))) if entity else frozenset()
    )
    return {"decisions": [decide(pair, ignore) for pair in pairs]}
