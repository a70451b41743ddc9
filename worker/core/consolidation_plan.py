"""Planning an entity's consolidation (pure): each pending fact triaged against its kind's facts, the
pairs the model is asked about, and the decisions once it has answered (restatements reopened)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from datetime import datetime

from worker.core.consolidation import (
    DUPLICATE,
    EXACT_DUPLICATE_REASON,
    MAX_CANDIDATES,
    NEAR_DUPLICATE_REASON,
    NO_CANDIDATE_REASON,
    FactView,
    PairTriage,
    Supersession,
    chosen,
    close_interval,
    entity_words,
    order_key,
    pair_verdict,
    set_overlap,
    since_key,
    supersession,
)
from worker.core.consolidation_prompt import AskedPair, PairDecision
from worker.core.vectors import VectorPool


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
        found = chosen(new, same_kind.triaged(new), MAX_CANDIDATES)
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
            triage, similarity = pair_verdict(
                old.normalized == text, set_overlap(words, old_words), vector, old.wording == new.wording
            )
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
    pair: int | None = None  # a model row's pair number: which call answered it is looked up by it


@dataclass(frozen=True)
class Resolved:
    """A new fact's decision: the audit rows, the duplicate link, the intervals closed."""

    fact_id: int
    rows: tuple[Row, ...]
    duplicate_of: int | None = None
    closings: tuple[Supersession, ...] = ()
    since: datetime | None = None  # when the new fact became true (its valid_from, else when it was said)
    # Written current but left unconsolidated, to be decided again against what is current after this
    # run (a restatement this run reopened was never compared with the facts planned after it).
    reconsider: bool = False
    # An earlier saying of this fact (``split_earlier_sayings``): its closing is the first change this run
    # makes; the store also weighs the changes the fact closed before, and the earliest wins.
    restates: int | None = None

    @property
    def fact_ids(self) -> frozenset[int]:
        """Every fact the decision writes or links to: all must still exist when it is written."""
        named = {self.fact_id, self.duplicate_of, self.restates, *(row.other_fact_id for row in self.rows)}
        named.update(fact.id for closing in self.closings for fact in (closing.older, closing.newer))
        return frozenset(fact_id for fact_id in named if fact_id is not None)

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
        return Resolved(new.id, (Row(None, "new", "rule", NO_CANDIDATE_REASON),), since=new.since)
    rows: list[Row] = []
    duplicate_of: int | None = None
    closings: list[Supersession] = []
    for pair in plan.asked:
        answer = answers.get(pair.number)
        verdict, reason = (answer.verdict, answer.reason) if answer else ("unrelated", UNANSWERED_REASON)
        rows.append(Row(pair.old.id, verdict, "model", reason, pair.similarity, pair.number))
        if verdict == "duplicate" and duplicate_of is None:
            duplicate_of = pair.old.id
        elif verdict in ("updates", "contradicts"):
            closings.append(supersession(new, pair.old))
    if duplicate_of is not None:
        return Resolved(new.id, tuple(rows), duplicate_of=duplicate_of, since=new.since)
    return Resolved(new.id, tuple(rows), closings=_one_end(new.id, closings), since=new.since)


def _one_end(fact_id: int, closings: Sequence[Supersession]) -> tuple[Supersession, ...]:
    """A late fact the model says several later facts update ends at the first of them: its closings
    are applied earliest first (the first one closes it; the others still slot it into their chains).
    In the model's order the most similar won (May's end for a February fact changed in March), and
    as of April it answered beside March's."""
    own = sorted((c for c in closings if c.older.id == fact_id), key=lambda c: order_key(c.newer))
    return (*own, *(c for c in closings if c.older.id != fact_id))


EARLIER_SAYING_REASON = (
    "rule: says what fact {canonical} says, but before fact {changed}, which changed it (and which fact "
    "{canonical} closed): a fact of its own, ended where fact {changed} begins"
)
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
    out = []
    for plan, r in decided:
        if r.duplicate_of is not None:
            r = replace(r, duplicate_of=_chain_end(links, r.duplicate_of, reopened))
        out.append((plan, r))
    return out


CANONICAL_CLOSED_REASON = (
    "rule: fact {newer} updates fact {duplicate}, which this run made a duplicate of fact {canonical}: "
    "it closes fact {canonical}"
)
CANONICAL_LATER_REASON = (
    "rule: fact {newer} updates fact {duplicate}, which this run made a duplicate of fact {canonical}, "
    "said later: fact {canonical} closes it"
)


def close_canonicals(decided: Sequence[tuple[FactPlan, Resolved]]) -> list[tuple[FactPlan, Resolved]]:
    """One run's resolutions, with each closing of a fact the same run makes a duplicate moved to the
    fact its chain ends at, when that one is older than the closer. "Alice is based in Lisbon" (Feb),
    a duplicate of a current "Alice lives in Lisbon" (Jan), and "Alice is based in Porto now" (Mar),
    which the model said updates the February saying (the only one it was shown: it was planned before
    the model answered): the closing found the February fact no longer current and closed nothing,
    and January's Lisbon answered beside Porto.

    Left as the model said when a saying is current again at the closer's time: the duplicate itself,
    or another saying of its canonical, said after a closing of a fact its chain runs to
    (``reopen_restatements`` reopens it). Closings are moved in the order of their closers, each moved
    one counted as a closing of its canonical: a closer that can reopen a saying comes first."""
    views: dict[int, FactView] = {}
    for plan, _ in decided:
        olds = [pair.old for pair in plan.asked] + ([plan.rule.old] if plan.rule is not None else [])
        views.update((fact.id, fact) for fact in (plan.new, *olds))
    links = {r.fact_id: r.duplicate_of for _, r in decided if r.duplicate_of is not None}
    closings = [closing for _, r in decided for closing in r.closings]
    closers: dict[int, list[FactView]] = {}
    for closing in closings:
        closers.setdefault(closing.older.id, []).append(closing.newer)
    members: dict[int, list[FactView]] = {}
    for fact_id in links:
        if fact_id in views:
            members.setdefault(_chain_end(links, fact_id), []).append(views[fact_id])

    def reopened(fact: FactView) -> bool:
        """Said after a closing of a fact its duplicate chain runs to: current again after the run."""
        target, seen = links.get(fact.id), {fact.id}
        while target is not None and target not in seen:
            if any(order_key(closer) <= order_key(fact) for closer in closers.get(target, [])):
                return True
            seen.add(target)
            target = links.get(target)
        return False

    moved: dict[tuple[int, int], tuple[Supersession, str]] = {}
    for closing in sorted((c for c in closings if c.older.id in links), key=lambda c: order_key(c.newer)):
        canonical = views.get(_chain_end(links, closing.older.id))
        if canonical is None:
            continue
        sayings = members.get(canonical.id, [])
        if any(reopened(f) for f in sayings if order_key(f) < order_key(closing.newer)):
            continue
        earlier = order_key(canonical) < order_key(closing.newer)
        # A canonical said after the closer closes it in turn (Lisbon, Porto, Lisbon again): the earlier
        # saying, now before a fact its canonical closes, is then a fact of its own (split_earlier_sayings,
        # which splits only a saying said strictly before: said at the closer's time, it is left).
        if not earlier and since_key(closing.older) >= since_key(closing.newer):
            continue
        reason = CANONICAL_CLOSED_REASON if earlier else CANONICAL_LATER_REASON
        text = reason.format(newer=closing.newer.id, duplicate=closing.older.id, canonical=canonical.id)
        moved[(closing.older.id, closing.newer.id)] = (supersession(closing.newer, canonical), text)
        if earlier:
            closers.setdefault(canonical.id, []).append(closing.newer)
        else:  # the closer's own sayings after the canonical are current again
            closers.setdefault(closing.newer.id, []).append(canonical)
    return [(plan, _moved(resolved, moved)) for plan, resolved in decided]


def _moved(resolved: Resolved, moved: dict[tuple[int, int], tuple[Supersession, str]]) -> Resolved:
    """``resolved`` with its moved closings in place (one a pair of facts: the closer may have updated
    two of a fact's sayings), each with the rule's audit row."""
    if not any((c.older.id, c.newer.id) in moved for c in resolved.closings):
        return resolved
    closings: list[Supersession] = []
    rows = list(resolved.rows)
    for closing in resolved.closings:
        to, reason = moved.get((closing.older.id, closing.newer.id), (closing, ""))
        if any((kept.older.id, kept.newer.id) == (to.older.id, to.newer.id) for kept in closings):
            continue
        closings.append(to)
        if to is not closing:
            other = to.older.id if to.older.id != resolved.fact_id else to.newer.id
            rows.append(Row(other, "updates", "rule", reason))
    closings_in_order = _one_end(resolved.fact_id, closings)  # a moved self-closing may end it first
    return replace(resolved, closings=closings_in_order, rows=tuple(rows))


def _chain_end(links: dict[int, int], fact_id: int, stop: frozenset[int] | set[int] = frozenset()) -> int:
    """Where a chain of duplicate links from ``fact_id`` ends (at a fact in ``stop`` at the latest)."""
    seen = {fact_id}
    while fact_id in links and fact_id not in stop and links[fact_id] not in seen:
        fact_id = links[fact_id]
        seen.add(fact_id)
    return fact_id


def split_earlier_sayings(
    decided: Sequence[tuple[FactPlan, Resolved]],
) -> list[tuple[FactPlan, Resolved]]:
    """One run's resolutions, with each duplicate said before a fact its canonical closes in the same
    run made a fact of its own, closed by the first such fact. A late page bringing Paris (Jan) and
    Berlin (Feb) to a current Paris (Mar): January's was merged into March's, whose start moved back to
    January, and Berlin, then closed by March's at March, answered beside it as of February. (A
    canonical that closed such a fact in an earlier run: ``ConsolidationStore``'s ``_changed_after``.)"""
    closed_by: dict[int, list[FactView]] = {}
    for _, resolved in decided:
        for closing in resolved.closings:
            closed_by.setdefault(closing.newer.id, []).append(closing.older)
    out: list[tuple[FactPlan, Resolved]] = []
    for plan, resolved in decided:
        said = plan.new.since
        canonical = resolved.duplicate_of
        between = [
            fact
            for fact in (closed_by.get(canonical, []) if canonical is not None else [])
            if said is not None and fact.since is not None and fact.since > said and fact.id != plan.new.id
        ]
        if canonical is None or not between:
            out.append((plan, resolved))
            continue
        first = min(between, key=order_key)
        reason = EARLIER_SAYING_REASON.format(canonical=canonical, changed=first.id)
        rows = (
            *(row for row in resolved.rows if row.decided_by == "model"),
            Row(canonical, "new", "rule", reason),
        )
        closing = Supersession(plan.new, first, close_interval(said, first.since))
        split = Resolved(resolved.fact_id, rows, closings=(closing,), since=said, restates=canonical)
        out.append((plan, split))
    return out


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
        # Its start kept: decided again in a later round as final, it was written with no valid_from.
        out.append(
            Resolved(
                resolved.fact_id,
                (Row(original, "new", "rule", reason),),
                since=resolved.since,
                reconsider=True,
            )
        )
    return out
