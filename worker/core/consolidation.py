"""Fact lifecycle rules (pure): normalization, candidate similarity, which pairs a rule can decide,
which go to the model, and how a supersession closes the older fact's interval."""

from __future__ import annotations

import math
import operator
import re
import unicodedata
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from datetime import datetime
from functools import cached_property
from typing import Literal

from worker.core.consolidation_prompt import (
    VERDICTS,
    AskedPair,
    PairDecision,
)
from worker.core.vectors import VectorPool

FACT_STATUSES = ("current", "superseded", "duplicate")
CURRENT, SUPERSEDED, DUPLICATE = FACT_STATUSES
# What a decision row records: the verdicts, "new" (nothing to merge with), and the operators' undos.
DECISIONS = (*VERDICTS, "new", "unmerge", "restore")
DECIDERS = ("rule", "model", "operator")

# Cosine similarity at or above which two facts of one entity and kind are the same statement (the
# simulator's and real embedding models' paraphrases both land above it only for near-identical text).
DUPLICATE_COSINE = 0.97
# Below this (and below CANDIDATE_OVERLAP) a pair is unrelated without asking anyone.
CANDIDATE_COSINE = 0.55
CANDIDATE_OVERLAP = 0.25
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


def normalize_fact_text(text: str) -> str:
    """The text two facts must share to be exact duplicates: NFKC, case-folded, punctuation and
    whitespace collapsed, a trailing period gone."""
    folded = unicodedata.normalize("NFKC", text).translate(_APOSTROPHES).casefold()
    return " ".join(_NON_WORD.sub(" ", folded).split())


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
    return _jaccard(content_words(a, ignore), content_words(b, ignore))


def _jaccard(left: frozenset[str], right: frozenset[str]) -> float:
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
        return _content_words(self.normalized)

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
    overlap = _jaccard(new.words - ignore, old.words - ignore)
    vector = cosine(new.embedding, old.embedding, new.norm, old.norm)
    if new.kind != old.kind:
        return PairTriage(old, "unrelated", vector if vector is not None else overlap)
    return PairTriage(old, *_verdict(new.normalized == old.normalized, overlap, vector))


def _verdict(same_text: bool, overlap: float, vector: float | None) -> tuple[Triage, float]:
    """The rule of a same-kind pair: (its triage, its similarity: the cosine when both facts have
    vectors, else the word overlap)."""
    if same_text:
        return "exact", 1.0
    if vector is not None and vector >= DUPLICATE_COSINE:
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
    return _chosen([triage_pair(new, old, ignore) for old in pool if old.id != new.id], limit)


def _chosen(triaged: Sequence[PairTriage], limit: int) -> list[PairTriage]:
    certain = [t for t in triaged if t.triage in ("exact", "near")]
    if certain:
        # The earliest such fact is the one the new fact duplicates.
        return sorted(certain, key=lambda t: (t.triage != "exact", order_key(t.old)))[:1]
    ambiguous = [t for t in triaged if t.triage == "ambiguous"]
    ambiguous.sort(key=lambda t: (-t.similarity, t.old.id))
    return ambiguous[:limit]


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
    if _since_key(new) == _since_key(old):
        older, newer = old, new
    else:
        older, newer = sorted((new, old), key=order_key)
    return Supersession(older, newer, close_interval(older.since, newer.since))


def _since_key(fact: FactView) -> float:
    return order_key(fact)[0]


_SEGMENT_CONTEXT = re.compile(r"^conversation segment (?P<start>\S+) to ")


def said_at(context: str, created_at: datetime) -> datetime:
    """When a fact was said: its segment's start (extraction writes it into the context), else when
    the row was stored."""
    match = _SEGMENT_CONTEXT.match(context or "")
    if match:
        try:
            return datetime.fromisoformat(match["start"].replace("Z", "+00:00"))
        except ValueError:
            pass
    return created_at


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


def true_at(valid_from: datetime | None, valid_to: datetime | None, status: str, as_of: datetime) -> bool:
    """Was a fact true at ``as_of``: begun by then (undated counts as always) and not yet closed.
    Duplicates never answer: their canonical fact does."""
    if status == DUPLICATE:
        return False
    if valid_from is not None and valid_from > as_of:
        return False
    return valid_to is None or valid_to > as_of


# ---------------------------------------------------------------------------
# Planning an entity's decisions, and resolving them once the model has answered.
# ---------------------------------------------------------------------------


@dataclass(frozen=True)
class FactPlan:
    """What is known about one new fact before the model answers: a certain duplicate (by rule), or
    the ambiguous pairs asked about (none: nothing like it, so it is new)."""

    new: FactView
    rule: PairTriage | None = None
    asked: tuple[AskedPair, ...] = ()


def plan_consolidation(
    pending: Sequence[FactView], pool: Sequence[FactView], entity: str = ""
) -> list[FactPlan]:
    """Plan each pending fact (in the order they became true) against the entity's current facts and
    the pending ones planned before it that stay current. Pair numbers run across the whole entity,
    so one call can ask about all of them."""
    ignore = entity_words(entity)
    # Facts of different kinds are never compared (triage_pair): each new fact is triaged against its
    # own kind's facts only, not the whole entity's (a pool of five kinds: about a fifth of the pairs),
    # and its cosines with all of them come from one matrix product (VectorPool).
    known: dict[str, _KindPool] = {}
    for fact in pool:
        known.setdefault(fact.kind, _KindPool(ignore)).facts.append(fact)
    for fact in pending:
        known.setdefault(fact.kind, _KindPool(ignore)).room += 1
    plans: list[FactPlan] = []
    number = 1
    for new in sorted(pending, key=order_key):
        same_kind = known[new.kind]
        found = _chosen(same_kind.triaged(new), MAX_CANDIDATES)
        if found and found[0].triage in ("exact", "near"):
            plans.append(FactPlan(new, rule=found[0]))
            continue
        asked = tuple(AskedPair(number + i, new, c.old, c.similarity) for i, c in enumerate(found))
        number += len(asked)
        plans.append(FactPlan(new, asked=asked))
        same_kind.add(new)
    return plans


@dataclass
class _KindPool:
    """One kind's facts a plan triages against: ``triage_pair`` over each, with each fact's words
    (less the entity's name) worked out once and its cosines with a new fact from one matrix
    product. Built at the first question, with room for the pending facts that join it."""

    ignore: frozenset[str]
    facts: list[FactView] = field(default_factory=list)
    room: int = 0
    words: list[frozenset[str]] = field(default_factory=list)
    vectors: VectorPool | None = None

    def triaged(self, new: FactView) -> list[PairTriage]:
        """The pairs of ``new`` with this kind's facts that are not unrelated."""
        if self.vectors is None:
            self.vectors = VectorPool(len(self.facts) + self.room)
            for fact in self.facts:
                self.vectors.add(fact.embedding)
            self.words = [fact.words - self.ignore for fact in self.facts]
        words, text = new.words - self.ignore, new.normalized
        found: list[PairTriage] = []
        cosines = self.vectors.cosines(new.embedding)
        for old, old_words, vector in zip(self.facts, self.words, cosines, strict=True):
            if old.id == new.id:
                continue
            triage, similarity = _verdict(old.normalized == text, _jaccard(words, old_words), vector)
            if triage != "unrelated":
                found.append(PairTriage(old, triage, similarity))
        return found

    def add(self, fact: FactView) -> None:
        self.facts.append(fact)
        if self.vectors is not None:
            self.vectors.add(fact.embedding)
            self.words.append(fact.words - self.ignore)


@dataclass(frozen=True)
class Row:
    """One audit row of a resolved decision."""

    other_fact_id: int | None
    decision: str
    decided_by: str
    reason: str
    similarity: float | None = None


@dataclass(frozen=True)
class Resolved:
    """A new fact's decision: the audit rows, the duplicate link, the intervals closed."""

    fact_id: int
    rows: tuple[Row, ...]
    duplicate_of: int | None = None
    closings: tuple[Supersession, ...] = ()
    since: datetime | None = None  # when the new fact became true (a duplicate's canonical starts by then)
    # Written current but left unconsolidated, to be decided again against what is current after this
    # run (a restatement this run reopened was never compared with the facts planned after it).
    reconsider: bool = False

    @property
    def kind(self) -> str:
        """The decision by type, for the metrics: duplicate, supersede, new or unrelated."""
        if self.duplicate_of is not None:
            return DUPLICATE
        if self.closings:
            return "supersede"
        return self.rows[0].decision if self.rows else "new"


UNANSWERED_REASON = "the model gave no decision for this pair; kept as unrelated"


def resolve(plan: FactPlan, answers: dict[int, PairDecision]) -> Resolved:
    """The plan turned into a decision: the rule's duplicate; else the model's first duplicate; else
    every update or contradiction closes the earlier fact of its pair (the later one wins, as
    Graphiti invalidates an edge); else the fact stays current (new, or unrelated to each candidate)."""
    new = plan.new
    if plan.rule is not None:
        reason = EXACT_DUPLICATE_REASON if plan.rule.triage == "exact" else NEAR_DUPLICATE_REASON
        row = Row(plan.rule.old.id, DUPLICATE, "rule", reason, plan.rule.similarity)
        return Resolved(new.id, (row,), duplicate_of=plan.rule.old.id, since=new.since)
    if not plan.asked:
        return Resolved(new.id, (Row(None, "new", "rule", NO_CANDIDATE_REASON),))
    rows: list[Row] = []
    duplicate_of: int | None = None
    closings: list[Supersession] = []
    for pair in plan.asked:
        answer = answers.get(pair.number)
        verdict, reason = (answer.verdict, answer.reason) if answer else ("unrelated", UNANSWERED_REASON)
        rows.append(Row(pair.old.id, verdict, "model", reason, pair.similarity))
        if verdict == "duplicate" and duplicate_of is None:
            duplicate_of = pair.old.id
        elif verdict in ("updates", "contradicts"):
            closings.append(supersession(new, pair.old))
    if duplicate_of is not None:
        return Resolved(new.id, tuple(rows), duplicate_of=duplicate_of, since=new.since)
    return Resolved(new.id, tuple(rows), closings=tuple(closings))


RESTATED_REASON = (
    "rule: restates fact {old}, which fact {newer}, said before it, supersedes in the same run; kept "
    "current (true again after the change)"
)


def _to_canonicals(
    decided: Sequence[tuple[FactPlan, Resolved]], reopened: set[int]
) -> list[tuple[FactPlan, Resolved]]:
    """Each duplicate linked to the fact its chain ends at, or at a fact this run reopens (current
    again). A run plans each fact against the earlier ones as if they stay current, so a later fact may
    be planned as a duplicate of one the model then calls a duplicate itself: R -> N1 -> A. R then
    pointed at a duplicate (which answers nothing), and the reopen below, which looks for what closed
    R's canonical, looked at N1 and missed A's closing. When N1 itself is reopened, R stays its
    duplicate (two current copies of one restatement is one too many)."""
    links = {r.fact_id: r.duplicate_of for _, r in decided if r.duplicate_of is not None}

    def root(fact_id: int) -> int:
        seen = {fact_id}
        while fact_id in links and fact_id not in reopened and links[fact_id] not in seen:
            fact_id = links[fact_id]
            seen.add(fact_id)
        return fact_id

    return [
        (plan, replace(r, duplicate_of=root(r.duplicate_of)) if r.duplicate_of is not None else r)
        for plan, r in decided
    ]


def reopen_restatements(decided: Sequence[tuple[FactPlan, Resolved]]) -> list[Resolved]:
    """One run's resolutions, with each duplicate of a fact that the same run closes, said after the fact
    that closes it, kept current instead.

    A run plans every fact before the model answers, each earlier fact as if it stays current: "Alice
    lives in Paris" (June) is then an exact duplicate of "Alice lives in Paris" (January), while "Alice
    moved to Berlin" (March) closes the January fact. As a duplicate of a closed fact, the June one
    answered nothing, for now or any as_of: the return to Paris was lost. Kept current, and decided
    again (``reconsider``) against what is current once this run is written: planned as a duplicate, it
    was compared with none of the facts after it, so it stood current beside the March fact, and beside
    "Alice moved to Lyon" (August) too.
    """
    closed_by: dict[int, list[FactView]] = {}
    for _, resolved in decided:
        for closing in resolved.closings:
            closed_by.setdefault(closing.older.id, []).append(closing.newer)

    def closed_before(plan: FactPlan, original: int | None) -> list[FactView]:
        closers = closed_by.get(original, []) if original is not None else []
        return [f for f in closers if order_key(f) <= order_key(plan.new)]

    reopened = {r.fact_id for plan, r in decided if closed_before(plan, r.duplicate_of)}
    decided = _to_canonicals(decided, reopened)
    out: list[Resolved] = []
    for plan, resolved in decided:
        original = resolved.duplicate_of
        newer = closed_before(plan, original)
        if original is None or not newer:
            out.append(resolved)
            continue
        first = min(newer, key=order_key)
        reason = RESTATED_REASON.format(old=original, newer=first.id)
        out.append(Resolved(resolved.fact_id, (Row(original, "new", "rule", reason),), reconsider=True))
    return out
