"""The English heuristics behind the simulator's fact extraction: kinds, dates, places, quantities."""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass

_SENTENCE_SPLIT = re.compile(r"(?<=[.!?])\s+|\n+")
LEADING_FILLER = re.compile(
    r"^(?:(?:hi|hey|hello|ok|okay|so|well|yeah|yes|yep|no|nope|oh|wow|update|btw|anyway|also|and|but|"
    r"honestly|actually|fyi|news|guess what)\b[\s,:;!.-]*)+",
    re.IGNORECASE,
)
FIRST_SINGULAR = re.compile(r"\b(?:i|i'm|i've|i'll|i'd|me|my|mine|myself)\b", re.IGNORECASE)
FIRST_PLURAL = re.compile(r"\b(?:we|we're|we've|we'll|we'd|us|our|ours|ourselves)\b", re.IGNORECASE)

# Kinds are read from what the speaker says about themselves (or their "we"), right after the subject.
_SOFTENERS = (
    r"(?:really|also|just|absolutely|totally|still|truly|genuinely|generally|usually|actually|"
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
MAJOR_EVENT = re.compile(
    r"\b(?:sign(?:ed)?|start(?:ed|ing)?|join(?:ed|ing)?|left|quit|resign(?:ed)?|marr(?:y|ied)|engaged|"
    r"mov(?:e|ed|ing)|promot(?:ed|ion)|hired|fired|laid\s+off|bought|sold|graduat(?:e|ed)|found(?:ed)?|"
    r"launch(?:ed)?|born|diagnos(?:ed|is)|accept(?:ed)?|offer|pregnant|divorc(?:e|ed)|retir(?:e|ed))\b",
    re.IGNORECASE,
)
HEDGE = re.compile(
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
CURRENCY_UNITS = {"$": "USD", "€": "EUR", "£": "GBP"}
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


_IRREGULAR_THIRD_PERSON = {"have": "has", "do": "does", "go": "goes"}


def _third_person(verb: str) -> str:
    lower = verb.lower()
    if lower in _IRREGULAR_THIRD_PERSON:
        return _IRREGULAR_THIRD_PERSON[lower]
    if lower not in _PRESENT_VERBS:
        return verb
    if lower.endswith(("s", "sh", "ch", "x", "z", "o")):
        return verb + "es"
    if lower.endswith("y") and lower[-2:-1] not in "aeiou":
        return verb[:-1] + "ies"
    return verb + "s"


def third_person_sentence(sentence: str, speaker: str) -> tuple[str, bool]:
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


def find_company(sentence: str) -> str | None:
    suffixed = _COMPANY_SUFFIX.search(sentence)
    if suffixed:
        return _clean_phrase(suffixed.group(1))
    work = _WORK_CONTEXT.search(sentence)
    if work:
        name = _clean_phrase(work.group(1))
        if name and name.split()[0] not in _NOT_PLACES:
            return name
    return None


def find_place(sentence: str, exclude: Iterable[str]) -> str | None:
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


def find_date(sentence: str) -> str | None:
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
class Quantity:
    metric: str
    value: float | int
    unit: str


def find_quantity(sentence: str) -> Quantity | None:
    money = _CURRENCY.search(sentence)
    if money:
        context = _MONEY_CONTEXT.search(sentence)
        return Quantity(
            metric=context.group(1).lower() if context else "amount",
            value=_number(money["num"], money["frac"], money["mult"]),
            unit=CURRENCY_UNITS[money["sym"]],
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
        return Quantity(metric=metric, value=_number(match["num"], match["frac"], match["mult"]), unit=unit)
    return None


def find_period(sentence: str, date: str | None) -> str | None:
    per = _PER_PERIOD.search(sentence)
    if per:
        word = next(g for g in per.groups() if g).lower()
        return f"per {_PERIOD_WORDS.get(word, word)}"
    return date


def classify(sentence: str) -> str:
    first_person = bool(FIRST_SINGULAR.search(sentence) or FIRST_PLURAL.search(sentence))
    if first_person and _COMMITMENT.search(sentence):
        return "commitment"
    if first_person and _PREFERENCE.search(sentence):
        return "preference"
    if _BELIEF.search(sentence):
        return "belief"
    if _PAST_EVENT.search(sentence.replace("’", "'")):
        return "event"
    return "fact"


def sentences(text: str) -> Iterable[str]:
    """The non-empty sentences of a text, split after . ! ? and at line breaks."""
    for piece in _SENTENCE_SPLIT.split(text):
        sentence = piece.strip()
        if sentence:
            yield sentence
