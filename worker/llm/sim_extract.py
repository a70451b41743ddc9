"""What the LLM simulator says: deterministic heuristic fact extraction and text replies (pure, no I/O)."""

from __future__ import annotations

import hashlib
import json
import math
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from functools import lru_cache
from typing import Any, Literal

SEGMENT_OPEN = "<segment>"
SEGMENT_CLOSE = "</segment>"
UNTRUSTED_OPEN = "<untrusted-data>"
UNTRUSTED_CLOSE = "</untrusted-data>"

FACT_KINDS: tuple[str, ...] = ("event", "preference", "commitment", "belief", "fact")
NOTABILITIES: tuple[str, ...] = ("high", "medium", "low")
DEFAULT_MAX_FACTS = 10
# A prompt may lower or raise the cap; this ceiling keeps a silly number from producing a huge reply.
MAX_FACTS_CEILING = 100
CHARACTERS_PER_TOKEN = 4
DEFAULT_EMBEDDING_DIMENSIONS = 256


def estimate_tokens(text: str) -> int:
    """About four characters a token, rounded up; the empty string is zero tokens."""
    return (len(text) + CHARACTERS_PER_TOKEN - 1) // CHARACTERS_PER_TOKEN


# --------------------------------------------------------------------------------------------------
# Prompt shape
# --------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class PromptMessage:
    """One message of a prompt, flattened to text (the wire layer turns content blocks into text)."""

    role: str
    text: str


@dataclass(frozen=True)
class SegmentMatch:
    """Where the conversation segment sits in a prompt."""

    message_index: int
    open_offset: int  # offset of "<segment>" inside that message's text
    content: str  # the text between the delimiters
    instructions: str  # every other word of the prompt: the only place a fact cap is read from


_MESSAGE_LINE = re.compile(
    r"^(?P<speaker>[^()\n]{1,200}?)\s*"
    r"\((?P<ts>\d{4}-\d{2}-\d{2}(?:[T ][0-9:.]+)?(?:Z|[+-]\d{2}:?\d{2})?)\):\s?(?P<text>.*)$"
)


def _looks_like_segment_start(content: str) -> bool:
    for line in content.splitlines():
        stripped = line.strip()
        if not stripped:
            continue
        return stripped.startswith("Page:") or bool(_MESSAGE_LINE.match(stripped))
    return False


def _locate_segment(text: str) -> tuple[int, int, int] | None:
    """(open offset, content start, content end) of the segment in one message, or None.

    The segment is data and may itself contain the delimiters (a conversation about prompts, or an
    injection attempt), so the content runs to the LAST closing delimiter, and among several opening
    delimiters (instructions may mention the tag) the first one followed by a rendered segment wins.
    """
    close = text.rfind(SEGMENT_CLOSE)
    if close < 0:
        return None
    opens = [m.start() for m in re.finditer(re.escape(SEGMENT_OPEN), text[:close])]
    if not opens:
        return None
    for start in opens:
        content_start = start + len(SEGMENT_OPEN)
        if _looks_like_segment_start(text[content_start:close]):
            return start, content_start, close
    start = opens[-1]
    return start, start + len(SEGMENT_OPEN), close


def find_segment(messages: Sequence[PromptMessage]) -> SegmentMatch | None:
    """The conversation segment of a prompt: user messages searched last to first, then the others."""
    order = [i for i in reversed(range(len(messages))) if messages[i].role == "user"]
    order += [i for i in range(len(messages)) if messages[i].role != "user"]
    for index in order:
        text = messages[index].text
        located = _locate_segment(text)
        if located is None:
            continue
        open_offset, content_start, content_end = located
        outside = [m.text for i, m in enumerate(messages) if i != index]
        outside.append(text[:open_offset] + text[content_end + len(SEGMENT_CLOSE) :])
        return SegmentMatch(
            message_index=index,
            open_offset=open_offset,
            content=text[content_start:content_end],
            instructions="\n".join(outside),
        )
    return None


_FACT_CAP = re.compile(
    r"\b(?:at\s+most|up\s+to|no\s+more\s+than|maximum\s+of|max(?:imum)?)\s+(\d+)\s+facts?\b",
    re.IGNORECASE,
)


def requested_max_facts(instructions: str, default: int = DEFAULT_MAX_FACTS) -> int:
    """The cap a prompt asks for ("at most N facts"), else the default; clamped to [0, MAX_FACTS_CEILING]."""
    match = _FACT_CAP.search(instructions)
    value = int(match.group(1)) if match else default
    return max(0, min(MAX_FACTS_CEILING, value))


# --------------------------------------------------------------------------------------------------
# Segment parsing
# --------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ConversationLine:
    speaker: str
    timestamp: str
    text: str


def parse_segment_lines(segment: str) -> list[ConversationLine]:
    """Message lines of a rendered segment; header lines are skipped, other lines continue the message."""
    lines: list[ConversationLine] = []
    in_body = "---" not in {raw.strip() for raw in segment.splitlines()}
    for raw in segment.splitlines():
        line = raw.strip()
        if not in_body:
            if line == "---":
                in_body = True
            continue
        if not line or line == "…(truncated)":
            continue
        match = _MESSAGE_LINE.match(line)
        if match:
            speaker, timestamp, text = match["speaker"].strip(), match["ts"].strip(), match["text"].strip()
            lines.append(ConversationLine(speaker, timestamp, text))
        elif lines:
            last = lines[-1]
            joined = f"{last.text}\n{line}" if last.text else line
            lines[-1] = ConversationLine(last.speaker, last.timestamp, joined)
    return lines


# --------------------------------------------------------------------------------------------------
# Heuristic fact extraction
# --------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ExtractedFact:
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
        return {
            "fact": self.fact,
            "kind": self.kind,
            "entity": self.entity,
            "confidence": self.confidence,
            "notability": self.notability,
            "metric": self.metric,
            "value": self.value,
            "unit": self.unit,
            "period": self.period,
        }


def slugify(text: str) -> str:
    """Lower-case words joined by hyphens (Unicode letters kept)."""
    words = re.findall(r"[^\W_]+", text.lower())
    return "-".join(words) or "unknown"


_SENTENCE_SPLIT = re.compile(r"(?<=[.!?])\s+|\n+")
_LEADING_FILLER = re.compile(
    r"^(?:(?:hi|hey|hello|ok|okay|so|well|yeah|yes|yep|no|nope|oh|wow|update|btw|anyway|also|and|but|"
    r"honestly|actually|fyi|news|guess what)\b[\s,:;!.-]*)+",
    re.IGNORECASE,
)
_FIRST_SINGULAR = re.compile(r"\b(?:i|i'm|i've|i'll|i'd|me|my|mine|myself)\b", re.IGNORECASE)
_FIRST_PLURAL = re.compile(r"\b(?:we|we're|we've|we'll|we'd|us|our|ours|ourselves)\b", re.IGNORECASE)

# Kinds are read from what the speaker says about themselves (or their "we"), right after the subject.
_SOFTENERS = (
    r"(?:really|also|just|absolutely|totally|still|truly|genuinely|generally|usually|definitely|actually|"
    r"honestly|now|kinda|much|do|don't|do\s+not|would|sort\s+of|kind\s+of|definitely|certainly|finally)"
)
_COMMITMENT = re.compile(
    r"\b(?:i|we)(?:'ll|'d\s+better|\s+(?:" + _SOFTENERS + r"\s+)*(?:will|shall|promised?|swear|plan\s+to|"
    r"intend\s+to|commit\s+to|have\s+to|need\s+to)|(?:'m|'re|\s+am|\s+are)\s+(?:" + _SOFTENERS + r"\s+)*"
    r"(?:going\s+to|gonna|planning\s+to|committed\s+to|about\s+to|determined\s+to))\b",
    re.IGNORECASE,
)
_PREFERENCE = re.compile(
    r"\b(?:i|we)(?:'d|\s+(?:" + _SOFTENERS + r"\s+)*)(?:like|love|prefer|hate|enjoy|dislike|adore|"
    r"can't\s+stand|cannot\s+stand|rather)\b"
    r"|\b(?:my|our)\s+favou?rite\b|\b(?:i'm|i\s+am|we're|we\s+are)\s+(?:a\s+)?(?:big\s+|huge\s+)?fans?\s+of\b",
    re.IGNORECASE,
)
_BELIEF = re.compile(
    r"\b(?:i|we)\s+(?:" + _SOFTENERS + r"\s+)*(?:think|believe|guess|suspect|doubt|reckon|bet|"
    r"feel\s+(?:like|that))\b|\bin\s+my\s+opinion\b"
    r"|\b(?:i'm|i\s+am|we're|we\s+are)\s+(?:pretty\s+|fairly\s+|quite\s+)?(?:sure|convinced|certain)\b",
    re.IGNORECASE,
)
_IRREGULAR_PAST = (
    "got|went|made|met|bought|sold|left|began|took|gave|won|lost|ran|wrote|saw|came|became|flew|drove|quit|"
    "found|built|paid|sent|spent|told|had|did|ate|broke|caught|chose|fell|forgot|grew|heard|held|kept|knew|"
    "led|rode|sang|sat|slept|spoke|stood|swam|taught|threw|woke|wore|hit|shut|set|put|cut|read|"
    "was|were|been|begun|done|gone|taken|given|won|seen|written|driven|flown|chosen"
)
_PAST_EVENT = re.compile(
    r"\b(?:i|we|i've|we've|i\s+have|we\s+have|i\s+had|we\s+had)\s+(?:(?:just|finally|already|recently|"
    r"officially|actually|also|totally|since)\s+)*(?:(?!(?:need|feed|seed|heed|breed|bleed|speed|succeed|"
    r"proceed|exceed|embed|shed)\b)[a-z]{2,}ed|" + _IRREGULAR_PAST + r")\b",
    re.IGNORECASE,
)
_MAJOR_EVENT = re.compile(
    r"\b(?:sign(?:ed)?|start(?:ed|ing)?|join(?:ed|ing)?|left|quit|resign(?:ed)?|marr(?:y|ied)|engaged|"
    r"mov(?:e|ed|ing)|promot(?:ed|ion)|hired|fired|laid\s+off|bought|sold|graduat(?:e|ed)|found(?:ed)?|"
    r"launch(?:ed)?|born|diagnos(?:ed|is)|accept(?:ed)?|offer|pregnant|divorc(?:e|ed)|retir(?:e|ed))\b",
    re.IGNORECASE,
)
_HEDGE = re.compile(
    r"\b(?:maybe|might|probably|perhaps|not\s+sure|possibly|kind\s+of|sort\s+of)\b", re.IGNORECASE
)

_MONTH = (
    r"(?:Jan(?:uary)?|Feb(?:ruary)?|Mar(?:ch)?|Apr(?:il)?|May|June?|July?|Aug(?:ust)?|"
    r"Sep(?:t(?:ember)?)?|Oct(?:ober)?|Nov(?:ember)?|Dec(?:ember)?)"
)
_WEEKDAY = r"(?:Monday|Tuesday|Wednesday|Thursday|Friday|Saturday|Sunday)"
_DATE_PATTERNS = (
    re.compile(r"\b\d{4}-\d{2}-\d{2}\b"),
    re.compile(r"\b" + _MONTH + r"\.?\s+\d{1,2}(?:st|nd|rd|th)?(?:,?\s+\d{4})?\b"),
    re.compile(r"\b\d{1,2}(?:st|nd|rd|th)?\s+(?:of\s+)?" + _MONTH + r"(?:,?\s+\d{4})?\b"),
    re.compile(r"\b(?:in|since|by|until|from)\s+" + _MONTH + r"(?:\s+\d{4})?\b"),
    re.compile(r"\b(?:in|since|by|until|from|during)\s+(?:19|20)\d{2}\b"),
    re.compile(r"\b(?:(?:next|last|this)\s+)?" + _WEEKDAY + r"\b"),
    re.compile(
        r"\b(?:today|tonight|tomorrow|yesterday|"
        r"this\s+(?:morning|afternoon|evening|week|weekend|month|quarter|year|summer|winter|spring|fall)|"
        r"next\s+(?:week|weekend|month|quarter|year|summer|winter|spring|fall)|"
        r"last\s+(?:night|week|weekend|month|quarter|year|summer|winter|spring|fall)|"
        r"(?:\d+|a|an|one|two|three|four|five|six|ten)\s+(?:days?|weeks?|months?|years?)\s+ago)\b",
        re.IGNORECASE,
    ),
)
_NOT_PLACES = frozenset(
    """I The A An This That My Our We You He She They It Monday Tuesday Wednesday Thursday Friday Saturday
    Sunday January February March April May June July August September October November December""".split()  # noqa: SIM905
)
_CAPITALISED_PHRASE = r"[A-Z][\w&'’-]*(?:\s+(?:of\s+|de\s+|&\s+)?[A-Z][\w&'’-]*)*"
_COMPANY_SUFFIX = re.compile(
    r"\b(" + r"[A-Z][\w&'-]*(?:\s+[A-Z][\w&'-]*)*?\s+"
    r"(?:Corp(?:oration)?|Inc|Ltd|LLC|GmbH|Labs|Group|Company|Co|Technologies|Systems|Bank|Partners|AG|SA|PLC)"
    + r")\b\.?"
)
_WORK_CONTEXT = re.compile(
    r"\b(?:work(?:s|ed|ing)?\s+(?:at|for|with)|job\s+(?:at|with)|started\s+at|joined|joining|join|"
    r"interview(?:ed|ing)?\s+(?:at|with)|offer(?:\s+letter)?\s+(?:from|for|at)|hired\s+(?:at|by)|"
    r"employed\s+(?:at|by)|intern(?:ing|ship)?\s+at|left|quit)\s+(" + _CAPITALISED_PHRASE + r")"
)
_PLACE_CONTEXT = re.compile(
    r"\b(?:in|at|to|from|near|visiting|visit|around)\s+(" + _CAPITALISED_PHRASE + r")"
)

# unit spelling → (unit, default metric)
_UNITS: dict[str, tuple[str, str]] = {}
for _names, _unit, _metric in (
    (("km", "kms", "kilometer", "kilometers", "kilometre", "kilometres"), "km", "distance"),
    (("mi", "mile", "miles"), "mi", "distance"),
    (("kg", "kgs", "kilo", "kilos", "kilogram", "kilograms"), "kg", "weight"),
    (("lb", "lbs", "pound", "pounds"), "lb", "weight"),
    (("hour", "hours", "hr", "hrs", "h"), "hour", "duration"),
    (("minute", "minutes", "min", "mins"), "minute", "duration"),
    (("second", "seconds", "sec", "secs"), "second", "duration"),
    (("day", "days"), "day", "duration"),
    (("week", "weeks"), "week", "duration"),
    (("month", "months"), "month", "duration"),
    (("year", "years", "yr", "yrs"), "year", "duration"),
    (("%", "percent", "per cent"), "percent", "percentage"),
    (("step", "steps"), "step", "steps"),
    (("rep", "reps"), "rep", "reps"),
    (("book", "books"), "book", "books"),
    (("people", "person", "persons"), "person", "headcount"),
    (("employee", "employees", "engineers", "engineer"), "person", "headcount"),
    (("user", "users", "customer", "customers"), "user", "users"),
    (("gb",), "GB", "storage"),
    (("tb",), "TB", "storage"),
    (("mb",), "MB", "storage"),
    (("dollar", "dollars", "bucks", "usd"), "USD", "amount"),
    (("euro", "euros", "eur"), "EUR", "amount"),
    (("pound sterling", "gbp"), "GBP", "amount"),
):
    for _name in _names:
        _UNITS[_name] = (_unit, _metric)

_NUMBER = r"(?P<num>\d{1,3}(?:,\d{3})+|\d+)(?:\.(?P<frac>\d+))?"
_MULTIPLIER = r"(?:\s?(?P<mult>k|K|m|M|bn|million|billion|thousand))?"
_CURRENCY = re.compile(r"(?P<sym>[$€£])\s?" + _NUMBER + _MULTIPLIER + r"(?![\w])")
_UNIT_ALTERNATION = "|".join(sorted((re.escape(u) for u in _UNITS), key=len, reverse=True))
_QUANTITY = re.compile(
    r"(?<![\w.$€£])" + _NUMBER + _MULTIPLIER + r"(?P<space>\s?)(?P<unit>" + _UNIT_ALTERNATION + r")(?![\w])"
    r"(?!\s+ago\b)",
    re.IGNORECASE,
)
_CURRENCY_UNITS = {"$": "USD", "€": "EUR", "£": "GBP"}
_MULTIPLIERS = {"k": 1e3, "thousand": 1e3, "m": 1e6, "million": 1e6, "bn": 1e9, "billion": 1e9}
_MONEY_CONTEXT = re.compile(
    r"\b(salary|rent|revenue|budget|price|cost|bonus|raise|savings|mortgage|funding|valuation|income|spend|"
    r"loan|debt|fee|payment|equity)\b",
    re.IGNORECASE,
)
_PER_PERIOD = re.compile(
    r"\b(?:per|a|an|each|every)\s+(year|month|week|day|hour|quarter)\b|\b(annually|monthly|weekly|daily|hourly)\b"
    r"|/\s?(yr|year|mo|month|wk|week|day|hr|hour)\b",
    re.IGNORECASE,
)
_PERIOD_WORDS = {
    "annually": "year",
    "monthly": "month",
    "weekly": "week",
    "daily": "day",
    "hourly": "hour",
    "yr": "year",
    "mo": "month",
    "wk": "week",
    "hr": "hour",
}

# Split strings keep these word lists readable (a list literal would be one word a line).
_PRESENT_VERBS = frozenset(
    """like love prefer hate enjoy want need live work think believe plan promise know feel run own use
    play cook drive study teach watch miss hope expect intend guess suspect doubt dislike read write eat
    drink walk swim train travel visit try commute volunteer adore mean manage lead support keep call
    start bike cycle hike climb wish care worry remember forget agree disagree speak sing dance""".split()  # noqa: SIM905
)
_ADVERBS = (
    "really|also|just|still|usually|always|never|often|sometimes|actually|definitely|totally|absolutely|"
    "finally|already|recently|mostly|generally|honestly|truly|seriously|now|even|only|rarely|probably"
)
_I_FORMS = re.compile(
    r"\b(?:(I'm|I\s+am)|(I've|I\s+have)|(I'll)|(I'd)|(I\s+was)"
    r"|I(?:\s+((?:" + _ADVERBS + r")\s+)?([a-z]+))?)\b"
    r"|\b(my|mine|myself|me)\b",
    re.IGNORECASE,
)


def _third_person(verb: str) -> str:
    lower = verb.lower()
    if lower == "have":
        return "has"
    if lower == "do":
        return "does"
    if lower == "go":
        return "goes"
    if lower not in _PRESENT_VERBS:
        return verb
    if lower.endswith(("s", "sh", "ch", "x", "z", "o")):
        return verb + "es"
    if lower.endswith("y") and lower[-2:-1] not in "aeiou":
        return verb[:-1] + "ies"
    return verb + "s"


def _third_person_sentence(sentence: str, speaker: str) -> tuple[str, bool]:
    """The sentence told about the speaker ("I'm moving" → "Alice Example is moving"); whether it changed."""
    first_name = speaker.split()[0] if speaker.split() else speaker
    used_full = False

    def name() -> str:
        nonlocal used_full
        if used_full:
            return first_name
        used_full = True
        return speaker

    def replace(match: re.Match[str]) -> str:
        if match.group(1):
            return f"{name()} is"
        if match.group(2):
            return f"{name()} has"
        if match.group(3):
            return f"{name()} will"
        if match.group(4):
            return f"{name()} would"
        if match.group(5):
            return f"{name()} was"
        possessive = match.group(8)
        if possessive:
            lower = possessive.lower()
            if used_full:  # the name was said once already: pronouns read better than repeating it
                return {"my": "their", "mine": "theirs", "myself": "themselves"}.get(lower, "them")
            return f"{name()}'s" if lower in ("my", "mine") else name()
        adverb = match.group(6) or ""
        verb = match.group(7)
        who = name()
        if verb is None:
            return who
        return f"{who} {adverb}{_third_person(verb)}"

    normalised = sentence.replace("’", "'")
    rewritten = _I_FORMS.sub(replace, normalised)
    return rewritten, rewritten != normalised


def _clean_phrase(phrase: str) -> str:
    return phrase.strip().rstrip(".,;:!?'’").strip()


def _find_company(sentence: str) -> str | None:
    suffixed = _COMPANY_SUFFIX.search(sentence)
    if suffixed:
        return _clean_phrase(suffixed.group(1))
    work = _WORK_CONTEXT.search(sentence)
    if work:
        name = _clean_phrase(work.group(1))
        if name and name.split()[0] not in _NOT_PLACES:
            return name
    return None


def _find_place(sentence: str, exclude: Iterable[str]) -> str | None:
    excluded = [e for e in exclude if e]
    for match in _PLACE_CONTEXT.finditer(sentence):
        words = [w for w in _clean_phrase(match.group(1)).split() if w]
        while words and words[0] in _NOT_PLACES:
            words = words[1:]
        while words and words[-1] in _NOT_PLACES:
            words = words[:-1]
        if not words:
            continue
        place = " ".join(words)
        if any(place in e or e in place for e in excluded):
            continue
        return place
    return None


def _find_date(sentence: str) -> str | None:
    found: list[tuple[int, str]] = []
    for pattern in _DATE_PATTERNS:
        match = pattern.search(sentence)
        if match:
            found.append((match.start(), match.group(0)))
    if not found:
        return None
    return min(found)[1]


def _number(whole: str, fraction: str | None, multiplier: str | None) -> float | int:
    value = float(whole.replace(",", "") + (f".{fraction}" if fraction else ""))
    if multiplier:
        value *= _MULTIPLIERS[multiplier.lower()]
    return int(value) if value.is_integer() else round(value, 6)


@dataclass(frozen=True)
class _Quantity:
    metric: str
    value: float | int
    unit: str


def _find_quantity(sentence: str) -> _Quantity | None:
    money = _CURRENCY.search(sentence)
    if money:
        context = _MONEY_CONTEXT.search(sentence)
        return _Quantity(
            metric=context.group(1).lower() if context else "amount",
            value=_number(money["num"], money["frac"], money["mult"]),
            unit=_CURRENCY_UNITS[money["sym"]],
        )
    for match in _QUANTITY.finditer(sentence):
        spelled = match["unit"].lower()
        unit, metric = _UNITS[spelled]
        if spelled == "h" and match["space"]:
            continue  # "5 h" is too ambiguous to read as hours; "5h" is fine
        after = sentence[match.end() :].lstrip().lower()
        if metric == "duration" and unit == "year" and after.startswith("old"):
            metric = "age"
        if metric == "amount":
            context = _MONEY_CONTEXT.search(sentence)
            metric = context.group(1).lower() if context else metric
        return _Quantity(metric=metric, value=_number(match["num"], match["frac"], match["mult"]), unit=unit)
    return None


def _find_period(sentence: str, date: str | None) -> str | None:
    per = _PER_PERIOD.search(sentence)
    if per:
        word = next(g for g in per.groups() if g).lower()
        return f"per {_PERIOD_WORDS.get(word, word)}"
    return date


def _classify(sentence: str) -> str:
    first_person = bool(_FIRST_SINGULAR.search(sentence) or _FIRST_PLURAL.search(sentence))
    if first_person and _COMMITMENT.search(sentence):
        return "commitment"
    if first_person and _PREFERENCE.search(sentence):
        return "preference"
    if _BELIEF.search(sentence):
        return "belief"
    if _PAST_EVENT.search(sentence.replace("’", "'")):
        return "event"
    return "fact"


_KIND_CONFIDENCE = {"event": 0.9, "commitment": 0.8, "preference": 0.85, "belief": 0.6, "fact": 0.75}


def _sentences(text: str) -> Iterable[str]:
    for piece in _SENTENCE_SPLIT.split(text):
        sentence = piece.strip()
        if sentence:
            yield sentence


def _fact_from_sentence(speaker: str, sentence: str, speakers: Sequence[str] = ()) -> ExtractedFact | None:
    if sentence.endswith("?"):
        return None
    body = _LEADING_FILLER.sub("", sentence).strip()
    if len(re.findall(r"\w+", body)) < 3:
        return None
    singular = bool(_FIRST_SINGULAR.search(body))
    plural = bool(_FIRST_PLURAL.search(body))
    date = _find_date(body)
    quantity = _find_quantity(body)
    company = _find_company(body)
    place = _find_place(body, exclude=[company or "", speaker, *speakers])
    if not (singular or plural or date or quantity or place or company):
        return None

    kind = _classify(body)
    if kind == "fact" and date and (singular or plural):
        kind = "event"

    if singular:
        told, _ = _third_person_sentence(body, speaker)
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
    if _HEDGE.search(body):
        confidence -= 0.2
    confidence = round(min(0.99, max(0.05, confidence)), 2)

    money = quantity is not None and quantity.unit in _CURRENCY_UNITS.values()
    major_event = kind == "event" and _MAJOR_EVENT.search(body) is not None
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
        period=_find_period(body, date) if quantity else None,
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
        for sentence in _sentences(line.text):
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


# --------------------------------------------------------------------------------------------------
# Text replies (anything that is not a fact extraction)
# --------------------------------------------------------------------------------------------------


def _first_sentences(text: str, count: int) -> list[str]:
    out: list[str] = []
    for sentence in _sentences(text):
        out.append(sentence)
        if len(out) >= count:
            break
    return out


def _fit(parts: list[str], max_chars: int | None, joiner: str) -> str:
    text = joiner.join(parts)
    if max_chars is None:
        return text
    while len(parts) > 1 and len(text) > max_chars:
        parts = parts[:-1]
        text = joiner.join(parts)
    return text


_TRANSCRIPT_TAG = re.compile(r"^\[(?P<tag>[^\]]+)\]\s*(?P<text>.*)$")
_CONSTRAINT = re.compile(
    r"\b(?:must|should|never|always|don't|do not|avoid|prefer|only|without|require[sd]?)\b", re.IGNORECASE
)
_DECISION = re.compile(
    r"\b(?:decided|decision|chose|chosen|we'll use|will use|agreed|settled on)\b", re.IGNORECASE
)
_NEXT = re.compile(r"\b(?:next|todo|to do|then|need to|will|plan to|remaining)\b", re.IGNORECASE)
_BLOCKED = re.compile(r"\b(?:blocked|fail(?:s|ed|ing)?|error|cannot|can't|denied|broken)\b", re.IGNORECASE)


def compaction_summary(transcript: str, max_chars: int | None = None) -> str:
    """A summary under the compaction headings, built from first sentences of the transcript's lines."""
    entries: list[tuple[str, str]] = []
    for raw in transcript.splitlines():
        line = raw.strip()
        if not line:
            continue
        match = _TRANSCRIPT_TAG.match(line)
        if match:
            entries.append((match["tag"].lower(), match["text"]))
        elif entries:
            tag, text = entries[-1]
            entries[-1] = (tag, f"{text} {line}")
        else:
            entries.append(("user", line))

    def first(text: str) -> str:
        sentences = _first_sentences(text, 1)
        return sentences[0][:300] if sentences else ""

    user_lines = [first(t) for tag, t in entries if tag == "user" and first(t)]
    said = [first(t) for tag, t in entries if not tag.startswith("tool") and first(t)]
    assistant = [first(t) for tag, t in entries if tag == "assistant" and first(t)]

    def bullets(items: Iterable[str], limit: int) -> list[str]:
        picked = list(dict.fromkeys(items))[:limit]
        return [f"- {item}" for item in picked] or ["- (none)"]

    head = [
        "## Goal",
        user_lines[0] if user_lines else "(not stated)",
        "",
        "## Constraints & Preferences",
        *bullets((s for s in said if _CONSTRAINT.search(s)), 3),
        "",
        "## Progress",
        "### Done",
        *bullets(assistant, 3),
        "### In Progress",
        *bullets(assistant[3:4], 1),
        "### Blocked",
        *bullets((s for s in said if _BLOCKED.search(s)), 2),
        "",
        "## Key Decisions",
        *bullets((s for s in said if _DECISION.search(s)), 3),
        "",
        "## Next Steps",
        *bullets((s for s in said[-6:] if _NEXT.search(s)), 3),
        "",
        "## Critical Context",
    ]
    context = [f"- {s}" for s in list(dict.fromkeys(said))[-12:]] or ["- (none)"]
    head_text = "\n".join(head)
    room = None if max_chars is None else max_chars - len(head_text) - 1
    return head_text + "\n" + _fit(context, room, "\n")


SEARCH_QUERY_OPEN = "<search-query>"
SEARCH_QUERY_CLOSE = "</search-query>"
SEARCH_INTENT_OPEN = "<search-intent>"
SEARCH_INTENT_CLOSE = "</search-intent>"


def _between(text: str, open_tag: str, close_tag: str) -> str | None:
    start = text.find(open_tag)
    end = text.rfind(close_tag)
    if start < 0 or end < start + len(open_tag):
        return None
    return text[start + len(open_tag) : end].strip()


def search_expansion_reply(query: str, intent: str | None = None) -> str:
    """What the simulator says to a search query-expansion prompt: one lex:, one vec: and one hyde: line.

    The lex line keeps the query's content words (stop words dropped), the vec line restates the query
    with its intent, and the hyde line is a "hypothetical fact" built from the same words. Not a model:
    it only gives search a deterministic expansion to fuse.
    """
    from worker.core.intent import extract_intent_terms

    words = extract_intent_terms(query) or query.lower().split() or ["nothing"]
    focus = extract_intent_terms(intent) if intent else []
    lex = " ".join(dict.fromkeys(words + focus))
    vec = query.strip() + (f" ({intent.strip()})" if intent and intent.strip() else "")
    hyde = " ".join(words).capitalize() + "."
    return f"lex: {lex}\nvec: {vec}\nhyde: {hyde}"


def text_reply(messages: Sequence[PromptMessage], max_tokens: int | None = None) -> str:
    """A short deterministic reply to a prompt that is not a fact extraction.

    Search query-expansion prompts (a last user message opening with <search-query>) get lex:/vec:/hyde:
    lines; compaction prompts (transcript inside <untrusted-data>) get a summary under the compaction
    headings; anything else gets the first sentences of the last user message. The reply aims to fit
    max_tokens.
    """
    max_chars = None if max_tokens is None else max(1, max_tokens) * CHARACTERS_PER_TOKEN
    last = next((m.text for m in reversed(messages) if m.role == "user" and m.text.strip()), "")
    if last.lstrip().startswith(SEARCH_QUERY_OPEN):
        query = _between(last, SEARCH_QUERY_OPEN, SEARCH_QUERY_CLOSE)
        if query is not None:
            intent = _between(last, SEARCH_INTENT_OPEN, SEARCH_INTENT_CLOSE)
            return search_expansion_reply(query, intent)
    for message in reversed(messages):
        start = message.text.find(UNTRUSTED_OPEN)
        end = message.text.rfind(UNTRUSTED_CLOSE)
        if start >= 0 and end > start:
            return compaction_summary(message.text[start + len(UNTRUSTED_OPEN) : end], max_chars)
    last_user = next((m.text for m in reversed(messages) if m.role == "user" and m.text.strip()), "")
    if not last_user:
        last_user = next((m.text for m in reversed(messages) if m.text.strip()), "")
    sentences = _first_sentences(last_user, 3)
    if not sentences:
        return "(nothing to summarise)"
    return _fit(sentences, max_chars, " ")


# --------------------------------------------------------------------------------------------------
# One entry point for the wire layer
# --------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class SimReply:
    """What the simulated model says: a facts object (kind "facts") or plain text (kind "text")."""

    kind: Literal["facts", "text"]
    text: str
    payload: dict[str, Any] | None = None
    segment: SegmentMatch | None = None


def reply_to(
    messages: Sequence[PromptMessage],
    *,
    max_tokens: int | None = None,
    default_max_facts: int = DEFAULT_MAX_FACTS,
) -> SimReply:
    """The simulated model's answer to a prompt: facts for an extraction prompt, otherwise text."""
    segment = find_segment(messages)
    if segment is not None:
        cap = requested_max_facts(segment.instructions, default_max_facts)
        payload = facts_document(extract_facts(segment.content, cap))
        return SimReply("facts", json.dumps(payload, ensure_ascii=False), payload, segment)
    return SimReply("text", text_reply(messages, max_tokens))


def fill_json_schema(schema: Mapping[str, Any] | None, text: str) -> Any:
    """A minimal value that fits a JSON schema, with `text` in its string slots (for non-extraction JSON)."""
    if not isinstance(schema, Mapping):
        return {"text": text}
    kind = schema.get("type")
    if isinstance(kind, list):
        kind = next((k for k in kind if k != "null"), "null")
    if schema.get("enum"):
        return schema["enum"][0]
    if "const" in schema:
        return schema["const"]
    for combinator in ("anyOf", "oneOf", "allOf"):
        options = schema.get(combinator)
        if isinstance(options, list) and options:
            return fill_json_schema(options[0], text)
    if kind == "object" or (kind is None and "properties" in schema):
        properties = schema.get("properties") or {}
        if not properties:
            return {"text": text}
        return {name: fill_json_schema(sub, text) for name, sub in properties.items()}
    if kind == "array":
        return []
    if kind == "string":
        return text
    if kind == "integer":
        return 0
    if kind == "number":
        return 0.0
    if kind == "boolean":
        return False
    if kind == "null":
        return None
    return text


# --------------------------------------------------------------------------------------------------
# Embeddings
# --------------------------------------------------------------------------------------------------

_EMBED_WORD = re.compile(r"[^\W_]+")


@lru_cache(maxsize=65536)
def _word_buckets(word: str, dimensions: int) -> tuple[tuple[int, float], ...]:
    digest = hashlib.blake2b(word.encode("utf-8"), digest_size=16).digest()
    first = int.from_bytes(digest[0:4], "little") % dimensions
    second = int.from_bytes(digest[4:8], "little") % dimensions
    sign1 = 1.0 if digest[8] & 1 else -1.0
    sign2 = 1.0 if digest[9] & 1 else -1.0
    return ((first, sign1), (second, 0.5 * sign2))


def _stem(word: str) -> str:
    # Just enough stemming that "likes" and "like" land in the same buckets.
    if len(word) > 4 and word.endswith("ies"):
        return word[:-3] + "y"
    if len(word) > 3 and word.endswith("s") and not word.endswith("ss"):
        return word[:-1]
    return word


def embed_text(text: str, dimensions: int = DEFAULT_EMBEDDING_DIMENSIONS) -> list[float]:
    """A deterministic unit vector: words hashed into signed buckets, so shared words mean similar vectors."""
    if dimensions < 1:
        raise ValueError("dimensions must be at least 1")
    vector = [0.0] * dimensions
    for word in _EMBED_WORD.findall(text.lower()):
        for index, weight in _word_buckets(_stem(word), dimensions):
            vector[index] += weight
    norm = math.sqrt(sum(v * v for v in vector))
    if norm == 0.0:
        # No words at all: still a unit vector, and still a function of the text.
        index = int.from_bytes(hashlib.blake2b(text.encode("utf-8"), digest_size=4).digest(), "little")
        vector[index % dimensions] = 1.0
        return vector
    return [v / norm for v in vector]
