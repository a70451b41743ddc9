"""The simulator's deterministic heuristic fact extractor (pure, no I/O): segment text in, facts out."""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from worker.simulator.heuristics import (
    CURRENCY_UNITS,
    FIRST_PLURAL,
    FIRST_SINGULAR,
    HEDGE,
    LEADING_FILLER,
    MAJOR_EVENT,
    classify,
    find_company,
    find_date,
    find_period,
    find_place,
    find_quantity,
    sentences,
    third_person_sentence,
)
from worker.simulator.prompt import DEFAULT_MAX_FACTS, parse_segment_lines

FACT_KINDS: tuple[str, ...] = ("event", "preference", "commitment", "belief", "fact")
NOTABILITIES: tuple[str, ...] = ("high", "medium", "low")


@dataclass(frozen=True)
class ExtractedFact:
    """One fact as the extraction prompt asks for it (the fields of the facts JSON schema, in order)."""

    fact: str
    kind: str
    entity: str
    confidence: float
    notability: str
    metric: str | None = None
    value: float | int | None = None
    unit: str | None = None
    period: str | None = None

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def slugify(text: str) -> str:
    """Lower-case words joined by hyphens (Unicode letters kept)."""
    words = re.findall(r"[^\W_]+", text.lower())
    return "-".join(words) or "unknown"


_KIND_CONFIDENCE = {"event": 0.9, "commitment": 0.8, "preference": 0.85, "belief": 0.6, "fact": 0.75}


def _fact_from_sentence(speaker: str, sentence: str, speakers: Sequence[str] = ()) -> ExtractedFact | None:
    if sentence.endswith("?"):
        return None
    body = LEADING_FILLER.sub("", sentence).strip()
    if len(re.findall(r"\w+", body)) < 3:
        return None
    singular = bool(FIRST_SINGULAR.search(body))
    plural = bool(FIRST_PLURAL.search(body))
    date = find_date(body)
    quantity = find_quantity(body)
    company = find_company(body)
    place = find_place(body, exclude=[company or "", speaker, *speakers])
    if not (singular or plural or date or quantity or place or company):
        return None

    kind = classify(body)
    if kind == "fact" and date and (singular or plural):
        kind = "event"

    if singular:
        told, _ = third_person_sentence(body, speaker)
        text = told[:1].upper() + told[1:]
    else:
        text = f"{speaker} said: {body}"

    speaker_slug = f"people/{slugify(speaker)}"
    if company:
        entity = f"companies/{slugify(company)}"
    elif singular or plural:
        entity = speaker_slug
    elif place:
        entity = f"places/{slugify(place)}"
    else:
        entity = speaker_slug

    confidence = _KIND_CONFIDENCE[kind]
    if singular:
        confidence += 0.05
    elif not plural:
        confidence -= 0.15
    if HEDGE.search(body):
        confidence -= 0.2
    confidence = round(min(0.99, max(0.05, confidence)), 2)

    money = quantity is not None and quantity.unit in CURRENCY_UNITS.values()
    major_event = kind == "event" and MAJOR_EVENT.search(body) is not None
    if kind == "commitment" or company or money or major_event:
        notability = "high"
    elif kind == "belief" or len(re.findall(r"\w+", body)) < 5:
        notability = "low"
    else:
        notability = "medium"

    return ExtractedFact(
        fact=text,
        kind=kind,
        entity=entity,
        confidence=confidence,
        notability=notability,
        metric=quantity.metric if quantity else None,
        value=quantity.value if quantity else None,
        unit=quantity.unit if quantity else None,
        period=find_period(body, date) if quantity else None,
    )


def extract_facts(segment: str, max_facts: int = DEFAULT_MAX_FACTS) -> list[ExtractedFact]:
    """Facts from a rendered conversation segment, heuristically and deterministically.

    Every line of the segment is data: text that reads like an instruction is judged by the same rules
    as any other sentence. When there are more candidates than `max_facts`, the most notable ones are
    kept (ties: earliest), and the result is returned in conversation order.
    """
    candidates: list[ExtractedFact] = []
    seen: set[str] = set()
    lines = parse_segment_lines(segment)
    speakers = sorted({line.speaker for line in lines})
    for line in lines:
        for sentence in sentences(line.text):
            fact = _fact_from_sentence(line.speaker, sentence, speakers)
            if fact is None:
                continue
            key = fact.fact.casefold()
            if key in seen:
                continue
            seen.add(key)
            candidates.append(fact)
    if max_facts <= 0:
        return []
    rank = {n: i for i, n in enumerate(NOTABILITIES)}
    chosen = sorted(range(len(candidates)), key=lambda i: (rank[candidates[i].notability], i))[:max_facts]
    return [candidates[i] for i in sorted(chosen)]


def facts_document(facts: Sequence[ExtractedFact]) -> dict[str, Any]:
    """The reply object the extraction prompt asks for: `{"facts": [...]}`."""
    return {"facts": [f.to_json() for f in facts]}
