"""Fact lifecycle rules (pure): normalization, candidate similarity, which pairs a rule can decide,
which go to the model, and how a supersession closes the older fact's interval."""

from __future__ import annotations

import math
import operator
import re
import unicodedata
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from functools import cached_property
from typing import Literal

from worker.core.consolidation_prompt import (
    VERDICTS,
)
from worker.core.facts import entity_slug
from worker.core.slugs import stored_form

FACT_STATUSES = ("current", "superseded", "duplicate")
CURRENT, SUPERSEDED, DUPLICATE = FACT_STATUSES
# What a decision row records: the verdicts, "new" (nothing to merge with), and the operators' undos.
DECISIONS = (*VERDICTS, "new", "unmerge", "restore")
DECIDERS = ("rule", "model", "operator")

# Cosine similarity at or above which two facts of one entity and kind are the same statement (the
# simulator's and real embedding models' paraphrases both land above it only for near-identical text).
DUPLICATE_COSINE = 0.97
# Candidates within one such step of each other are equally similar (then the nearest in time first).
SIMILARITY_STEP = 0.01
# Below this (and below CANDIDATE_OVERLAP) a pair is unrelated without asking anyone.
CANDIDATE_COSINE = 0.55
CANDIDATE_OVERLAP = 0.25
# A figure in normalized text: its digits, or a sign it kept (normalize_fact_text).
_FIGURE = re.compile(r"\d+|[^\w\s']")
# How many old facts each new fact is compared against (the nearest ones), to bound the prompt.
MAX_CANDIDATES = 5
EXACT_DUPLICATE_REASON = "rule: exact duplicate"
NEAR_DUPLICATE_REASON = "rule: near-identical embedding"
NO_CANDIDATE_REASON = "rule: no similar fact of this entity and kind"

# Facts without an entity are consolidated per page; an entity slug never holds ":" (facts.entity_slug
# keeps letters, marks, digits, '/' and '-'), so the page keys cannot collide with an entity's.
PAGE_KEY_PREFIX = "page:"


def entity_key(entity_slug: str | None, page_slug: str) -> str:
    """The consolidation unit of a fact: its entity, or its page when it names none."""
    return entity_slug if entity_slug else f"{PAGE_KEY_PREFIX}{page_slug}"


def typed_entity_key(text: str) -> str:
    """The consolidation unit a user names (`--entity`): an entity as any spelling of it ("People/Alice
    Example"), or page:SLUG in any Unicode form. Taken as typed, a name that other commands find
    (`facts history`) consolidated nothing and said so with exit 0."""
    if text.startswith(PAGE_KEY_PREFIX):
        return PAGE_KEY_PREFIX + stored_form(text.removeprefix(PAGE_KEY_PREFIX))
    return entity_slug(text) or text


def entity_key_filter(key: str) -> tuple[str | None, str | None]:
    """(entity slug, None) for an entity's key, (None, page slug) for a page's."""
    if key.startswith(PAGE_KEY_PREFIX):
        return None, key.removeprefix(PAGE_KEY_PREFIX)
    return key, None


_APOSTROPHES = str.maketrans({"\u2019": "'", "\u2018": "'", "`": "'"})
_NON_WORD = re.compile(r"[^\w']+")
_WORD = re.compile(r"[^\W_]+(?:'[^\W_]+)?")
_STOP = frozenset(
    (
        *("a", "an", "the", "is", "are", "was", "were", "be", "been", "of", "to", "in", "on"),
        *("at", "for", "and", "or", "with", "by", "from", "that", "this", "it", "its", "as"),
        # "X said: ..." is how a fact quotes someone: the verb says nothing about its content.
        "said",
    )
)

# What two facts an embedding calls near-identical may differ by and still be one statement: articles
# alone. Not a copula ("is at Acme" / "was at Acme"), a preposition ("moved to Berlin from Paris" /
# "from Berlin to Paris", "works with Bob" / "for Bob"), a conjunction ("tea and coffee" / "or"), nor
# any other word: "not", "no longer", another city, the same words in another order.
_FILLER = frozenset({"a", "an", "the"})


# A minus before a figure ("-$2M", "- 5°C"): a sign, not punctuation. Not a hyphen inside a word or a
# date, nor a dash between words ("Alice - CTO").
_MINUS = re.compile(r"(?<![\w-])-(?=\s?(?:\d|[^\w\s-]))")
# Percent, per mille and degree signs: with currency (Sc) and mathematical (Sm) symbols, they say what a
# figure is, so they are kept as words of their own.
_FIGURE_SIGNS = frozenset("%\u2030\u00b0")
_SYMBOL_RUN = re.compile(r"[^\w\s']+")


def _kept(ch: str) -> bool:
    return ch in _FIGURE_SIGNS or unicodedata.category(ch) in ("Sc", "Sm")


# The ASCII ones ("$%+<=>|~"): most facts hold none, and then take one regex pass.
_ASCII_KEPT = frozenset(ch for ch in map(chr, range(128)) if _kept(ch))


def _kept_or_space(match: re.Match[str]) -> str:
    kept = [ch for ch in match[0] if _kept(ch)]
    return f" {' '.join(kept)} " if kept else " "


def normalize_fact_text(text: str) -> str:
    """The text two facts must share to be exact duplicates: NFKC, case-folded, punctuation and
    whitespace collapsed, a trailing period gone. The signs of a figure stay ("net income was -$2M" is
    not "$2M", "5%" is not "$5"), and a text of punctuation only is kept as it is ("!!!" is not "???")."""
    folded = unicodedata.normalize("NFKC", text).translate(_APOSTROPHES).casefold()
    if "-" in folded:
        folded = _MINUS.sub("\u2212", folded)
    if folded.isascii() and _ASCII_KEPT.isdisjoint(folded):
        collapsed = " ".join(_NON_WORD.sub(" ", folded).split())
    else:
        collapsed = " ".join(_SYMBOL_RUN.sub(_kept_or_space, folded).split())
    return collapsed or " ".join(folded.split())


def _fold(normalized: str) -> str:
    """Accents dropped from normalized text (for comparing words only): "Zoë" and the slug's "zoe"
    are one word. ASCII text, most facts, has none to drop."""
    if normalized.isascii():
        return normalized
    decomposed = unicodedata.normalize("NFKD", normalized)
    return "".join(ch for ch in decomposed if not unicodedata.combining(ch))


def content_words(text: str, ignore: frozenset[str] = frozenset()) -> frozenset[str]:
    """The fact's words minus stop words and ``ignore`` (for the overlap measure)."""
    return _content_words(normalize_fact_text(text), ignore)


def _content_words(normalized: str, ignore: frozenset[str] = frozenset()) -> frozenset[str]:
    return frozenset(w for w in _WORD.findall(_fold(normalized)) if w not in _STOP and w not in ignore)


def entity_words(key: str) -> frozenset[str]:
    """The words of an entity's slug (people/alice-example: people, alice, example). Every fact of the
    entity names it, so they say nothing about whether two of its facts match."""
    return frozenset(_WORD.findall(_fold(normalize_fact_text(key.replace("-", " ").replace("/", " ")))))


def word_overlap(a: str, b: str, ignore: frozenset[str] = frozenset()) -> float:
    """Jaccard overlap of the two facts' content words (less ``ignore``), 0..1."""
    return set_overlap(content_words(a, ignore), content_words(b, ignore))


def set_overlap(left: frozenset[str], right: frozenset[str]) -> float:
    shared = len(left & right)  # the union's size from the intersection's: one set built, not two
    return shared / (len(left) + len(right) - shared) if shared else 0.0


def _norm(vector: Sequence[float]) -> float:
    return math.sqrt(sum(map(operator.mul, vector, vector)))


def cosine(
    a: Sequence[float] | None,
    b: Sequence[float] | None,
    norm_a: float | None = None,
    norm_b: float | None = None,
) -> float | None:
    """Cosine similarity, or None when either vector is missing, empty, zero or of another length.
    ``norm_a``/``norm_b``: the vectors' norms when the caller has them already."""
    if not a or not b or len(a) != len(b):
        return None
    dot = sum(map(operator.mul, a, b))  # about twice a generator's speed (lengths are equal, checked)
    norms = (norm_a if norm_a is not None else _norm(a)) * (norm_b if norm_b is not None else _norm(b))
    return dot / norms if norms else None


@dataclass(frozen=True)
class FactView:
    """What the rules see of a fact."""

    id: int
    text: str
    kind: str
    valid_from: datetime | None
    embedding: Sequence[float] | None = None
    created_order: int = 0  # the order facts arrived in (their id): ties on dates break by it
    said_at: datetime | None = None  # when it was said (its segment's time): stands in for valid_from

    @property
    def since(self) -> datetime | None:
        """When the fact became true: its valid_from, else when it was said."""
        return self.valid_from if self.valid_from is not None else self.said_at

    # What each comparison reads, worked out once a fact rather than once a pair: an entity with
    # 50,000 facts made every new fact normalize all of them again (bench in the stop-35 note).
    @cached_property
    def normalized(self) -> str:
        return normalize_fact_text(self.text)

    @cached_property
    def words(self) -> frozenset[str]:
        return frozenset(w for w in self._tokens if w not in _STOP)

    @cached_property
    def _tokens(self) -> tuple[str, ...]:
        """Its words in order (``words`` and ``wording`` read them: one tokenization a fact)."""
        return tuple(_WORD.findall(_fold(self.normalized)))

    @cached_property
    def numbers(self) -> tuple[str, ...]:
        """The figures the fact states, in order, with their signs ("−", "$", "4", "2", "%"): see
        ``pair_verdict``."""
        return tuple(_FIGURE.findall(self.normalized))

    @cached_property
    def wording(self) -> tuple[tuple[str, ...], tuple[str, ...]]:
        """Its words in order less the articles, and its figures: what a near-identical embedding must
        share to make a duplicate (``pair_verdict``)."""
        return tuple(w for w in self._tokens if w not in _FILLER), self.numbers

    @cached_property
    def norm(self) -> float | None:
        return _norm(self.embedding) if self.embedding else None


Triage = Literal["exact", "near", "ambiguous", "unrelated"]


@dataclass(frozen=True)
class PairTriage:
    old: FactView
    triage: Triage
    similarity: float  # the cosine when both have vectors, else the word overlap


def triage_pair(new: FactView, old: FactView, ignore: frozenset[str] = frozenset()) -> PairTriage:
    """What a rule can say about a pair: an exact or near duplicate (certain), ambiguous (ask the
    model), or unrelated. Facts of different kinds are never compared; ``ignore`` holds the
    entity's own name words (``entity_words``)."""
    overlap = set_overlap(new.words - ignore, old.words - ignore)
    vector = cosine(new.embedding, old.embedding, new.norm, old.norm)
    if new.kind != old.kind:
        return PairTriage(old, "unrelated", vector if vector is not None else overlap)
    same_wording = new.wording == old.wording
    return PairTriage(old, *pair_verdict(new.normalized == old.normalized, overlap, vector, same_wording))


def pair_verdict(
    same_text: bool, overlap: float, vector: float | None, same_wording: bool = True
) -> tuple[Triage, float]:
    """The rule of a same-kind pair: (its triage, its similarity: the cosine when both facts have
    vectors, else the word overlap). A near-identical embedding is a duplicate only when both facts say
    the same words in the same order, articles aside, and state the same figures (``FactView.wording``):
    embeddings barely tell "revenue was $4.2M" from "$4.8M", "will attend" from "will not attend", or
    "email rather than phone" from "phone rather than email", and as a duplicate the new statement
    answered nothing while the old one stayed current. Anything else the model decides."""
    if same_text:
        return "exact", 1.0
    if vector is not None and vector >= DUPLICATE_COSINE and same_wording:
        return "near", vector
    similarity = vector if vector is not None else overlap
    if overlap >= CANDIDATE_OVERLAP or (vector is not None and vector >= CANDIDATE_COSINE):
        return "ambiguous", similarity
    return "unrelated", similarity


def candidates(
    new: FactView,
    pool: Sequence[FactView],
    limit: int = MAX_CANDIDATES,
    ignore: frozenset[str] = frozenset(),
) -> list[PairTriage]:
    """The pool's facts worth deciding against ``new``: certain duplicates first, then the most similar
    ambiguous ones (at most ``limit`` of those); unrelated ones are dropped."""
    return chosen(new, [triage_pair(new, old, ignore) for old in pool if old.id != new.id], limit)


def chosen(new: FactView, triaged: Sequence[PairTriage], limit: int) -> list[PairTriage]:
    """The certain duplicate, else at most ``limit`` ambiguous pairs: the most similar, and of equally
    similar ones (in the same SIMILARITY_STEP counted down from the best: cosines of "Alice lives in X"
    sayings differ in the third decimal) those nearest ``new`` in time. A backfill plans a year of such
    sayings in one round, every earlier one still in the pool: by id, the five oldest were asked and
    the one in force just before ``new`` never was, and both stayed current."""
    certain = [t for t in triaged if t.triage in ("exact", "near")]
    if certain:
        # The earliest such fact is the one the new fact duplicates.
        return sorted(certain, key=lambda t: (t.triage != "exact", order_key(t.old)))[:1]
    ambiguous = [t for t in triaged if t.triage == "ambiguous"]
    if not ambiguous:
        return []
    best = max(t.similarity for t in ambiguous)
    ambiguous.sort(
        key=lambda t: (int((best - t.similarity) / SIMILARITY_STEP), _apart(new, t.old), -order_key(t.old)[1])
    )
    return ambiguous[:limit]


def _apart(new: FactView, old: FactView) -> float:
    """How far apart in time two facts became true (an undated one: as far as can be)."""
    gap = abs(since_key(new) - since_key(old))
    return gap if math.isfinite(gap) else math.inf


def order_key(fact: FactView) -> tuple[float, int]:
    """When a fact became true, for ordering: its valid_from (undated facts sort first), then arrival."""
    since = fact.since
    stamp = since.timestamp() if since is not None else float("-inf")
    return (stamp, fact.created_order or fact.id)


@dataclass(frozen=True)
class Supersession:
    """The older fact is closed at ``valid_to`` and linked to the newer one."""

    older: FactView
    newer: FactView
    valid_to: datetime | None


def supersession(new: FactView, old: FactView) -> Supersession:
    """Of two facts where ``new`` updates (or contradicts) ``old``, the later one wins whichever arrived
    first: the earlier is closed at the later one's valid_from (its segment's time when it has none).
    Said at the same time (one segment), the model's direction decides: ``new`` wins (by arrival, the
    loser was whichever came first in the page, whatever the model said)."""
    if since_key(new) == since_key(old):
        older, newer = old, new
    else:
        older, newer = sorted((new, old), key=order_key)
    return Supersession(older, newer, close_interval(older.since, newer.since))


def since_key(fact: FactView) -> float:
    """When a fact became true, as ``order_key`` weighs it (without its arrival, which breaks ties)."""
    return order_key(fact)[0]


_SEGMENT_CONTEXT = re.compile(r"^conversation segment (?P<start>\S+) to ")


def segment_start(context: str) -> datetime | None:
    """The start of the segment a fact was said in (extraction writes it into the context), if named."""
    match = _SEGMENT_CONTEXT.match(context or "")
    if match:
        try:
            return datetime.fromisoformat(match["start"].replace("Z", "+00:00"))
        except ValueError:
            pass
    return None


def said_at(context: str, created_at: datetime) -> datetime:
    """When a fact was said: its segment's start, else when the row was stored."""
    start = segment_start(context)
    return created_at if start is None else start


def began(valid_from: datetime | None, context: str, created_at: datetime) -> datetime:
    """When a stored fact began: its valid_from, else when it was said."""
    return valid_from if valid_from is not None else said_at(context, created_at)


def close_interval(valid_from: datetime | None, closing_at: datetime | None) -> datetime | None:
    """The valid_to of a superseded fact: the closing time, never before the fact's own start."""
    if closing_at is None:
        return None
    if valid_from is not None and closing_at < valid_from:
        return valid_from
    return closing_at


def true_at(
    valid_from: datetime | None,
    valid_to: datetime | None,
    status: str,
    as_of: datetime,
    *,
    stored_at: datetime,
) -> bool:
    """Was a fact true at ``as_of``: begun by then (an undated one begins when it was stored) and not
    yet closed. Duplicates never answer: their canonical fact does. The rule the as-of reads run in SQL
    (worker.consolidation.history.AS_OF_SQL; a test holds the two together)."""
    if status == DUPLICATE:
        return False
    if (valid_from if valid_from is not None else stored_at) > as_of:
        return False
    return valid_to is None or valid_to > as_of
