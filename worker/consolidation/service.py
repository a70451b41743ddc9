"""One entity's consolidation: repair broken links, plan by rule, ask the model once about the
ambiguous pairs, and commit each new fact's decision (with its audit rows) exactly once."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from worker.accounting import LLMCallRecord
from worker.consolidation.store import ConsolidationStore
from worker.core.consolidation import FactView
from worker.core.consolidation_plan import (
    FactPlan,
    close_canonicals,
    plan_consolidation,
    reopen_restatements,
    resolve,
    split_earlier_sayings,
)
from worker.core.consolidation_prompt import (
    CONSOLIDATION_PURPOSE,
    CONSOLIDATION_SYSTEM_PROMPT,
    SHARED_REFUSAL_PAIRS,
    AskedPair,
    MalformedDecisionsError,
    PairDecision,
    decisions_json_schema,
    explained_by_few_facts,
    parse_decisions,
    render_pairs,
)
from worker.llm.between_tries import checked_between_tries, tries_before_stop
from worker.llm.errors import BudgetExhaustedError, LLMError
from worker.llm.retry import AttemptRecord, chat_with_tries
from worker.llm.types import ChatRequest, ChatResponse, LLMClient

logger = logging.getLogger(__name__)

# Pairs per call: an entity with more ambiguous pairs than this (a large backfill) takes more calls.
MAX_PAIRS_PER_CALL = 40
OUTPUT_TOKENS_PER_PAIR = 60
# Decisions per transaction: each written exactly once either way (its fact's marker); a run cut short
# resumes after the last committed chunk; one commit per decision made the queue lag.
DECISIONS_PER_COMMIT = 50
SCHEMA_NAME = "consolidation_decisions"


class ConsolidationReplyError(RuntimeError):
    """The model's answer could not be used (malformed, cut off alone, refused): the job retries."""


class SharedRefusalError(ConsolidationReplyError):
    """The model refuses what every question shares: its refusals of single pairs are no verdicts."""


@dataclass
class ConsolidationCounters:
    facts_considered: int = 0
    decisions: dict[str, int] = field(default_factory=dict)
    llm_calls: int = 0
    pairs_asked: int = 0
    pairs_answered: int = 0
    # The pairs the model refused on their own (kept as unrelated), by their (new, old) facts.
    refused_pairs: list[tuple[int, int]] = field(default_factory=list, repr=False)
    prompt_tokens: int = 0
    restored: int = 0
    already_decided: int = 0

    @property
    def pairs_refused(self) -> int:
        return len(self.refused_pairs)

    def as_dict(self) -> dict[str, Any]:
        return {
            "facts_considered": self.facts_considered,
            "decisions": dict(self.decisions),
            "llm_calls": self.llm_calls,
            "pairs_asked": self.pairs_asked,
            "pairs_refused": self.pairs_refused,
            "prompt_tokens": self.prompt_tokens,
            "restored": self.restored,
            "already_decided": self.already_decided,
        }


def consolidation_request(entity: str, pairs: Sequence[AskedPair], at_least: int = 0) -> ChatRequest:
    """The one batched question about an entity's ambiguous pairs, with the strict answer schema; its
    reply cap at least ``at_least`` tokens (the cap of a question its pairs were cut off in)."""
    return ChatRequest(
        purpose=CONSOLIDATION_PURPOSE,
        system=CONSOLIDATION_SYSTEM_PROMPT,
        messages=(("user", render_pairs(entity, pairs)),),
        max_tokens=max(256, OUTPUT_TOKENS_PER_PAIR * len(pairs), at_least),
        json_schema=decisions_json_schema(len(pairs)),
        schema_name=SCHEMA_NAME,
        cache_key="factmill-consolidation-v1",
    )


@dataclass(frozen=True)
class EntityRun:
    """What one entity's run needs besides the store and the model."""

    source_id: str
    entity_key: str
    job_id: int | None = None
    guard: Callable[[], None] = lambda: None  # before each question and between tries: lease, stop, switch
    before_call: Callable[[], None] = lambda: None  # the budget check before the call
    # Before writing answers already paid for: the lease alone. The guard also raises once the worker
    # begins to stop, which threw away a round's answers (up to ~63 calls) and the next worker paid again.
    lease: Callable[[], None] = lambda: None

    def between_tries(self) -> None:
        """Asked between the gateway's tries of one call (a retry waits minutes on an outage)."""
        self.guard()
        self.before_call()


# An entity's pending facts are decided in rounds of at most this many (the earliest said first), each
# committed before the next is asked (a run of thousands committed nothing until every pair was asked, and a
# stop threw it all away, paid for again); a round's reopened restatements are decided in a later one, once.
MAX_FACTS_PER_ROUND = 500  # at most ~63 calls at risk; each round lists the pending facts again
MAX_ROUNDS = 10_000  # a guard: every round commits its facts' decisions, so pending runs out well before


def consolidate_entity(
    store: ConsolidationStore, llm: LLMClient | None, run: EntityRun
) -> ConsolidationCounters:
    """Consolidate the entity's unconsolidated facts, round by round. Re-running finds nothing pending
    and changes nothing; a decision another run committed first is counted as already decided."""
    counters = ConsolidationCounters()
    counters.restored = store.repair_orphans(run.source_id, run.entity_key, run.job_id)
    considered: set[int] = set()
    reconsidered: set[int] = set()
    awaiting: set[int] = set()  # left to decide again, not counted yet
    for _ in range(MAX_ROUNDS):
        pending, batch, pool = store.entity_round(run.source_id, run.entity_key, MAX_FACTS_PER_ROUND)
        closed = awaiting - pending  # a later fact of their round closed them
        counters.decisions["supersede"] = counters.decisions.get("supersede", 0) + len(closed)
        awaiting -= closed
        if not pending:
            break
        # Each round with work left: a run decided by rule alone never asks (the guard's other place),
        # and held the kill switch and a stopping worker off until the entity was done.
        run.guard()
        decided = {fact.id for fact in batch}
        considered |= decided
        again = _consolidate_round(store, llm, run, batch, pool, counters, final=reconsidered)
        awaiting = (awaiting - decided) | again  # decided again now: counted in the round
        reconsidered |= again
    counters.decisions = {kind: n for kind, n in counters.decisions.items() if n}
    counters.facts_considered = len(considered)
    return counters


def _consolidate_round(
    store: ConsolidationStore,
    llm: LLMClient | None,
    run: EntityRun,
    pending: list[FactView],
    pool: list[FactView],
    counters: ConsolidationCounters,
    *,
    final: set[int],
) -> set[int]:
    """Plan, ask and commit one round; the facts left to decide again (reopened restatements, unless
    one is in ``final``: decided again once already)."""
    plans = plan_consolidation(pending, pool, run.entity_key)
    answers: dict[int, PairDecision] = {}
    call_ids: dict[int, int] = {}
    refused: set[int] = set()
    try:
        _ask_model(store, llm, run, plans, counters, answers, call_ids, refused)
    except Exception:
        # Stopped while asking (the worker stopping, the switch, the budget, an outage, an unusable
        # answer): the answers paid for so far were thrown away, and the next run paid for them again.
        # The leading facts whose every pair is answered are written as a smaller round (a round is any
        # run of the pending facts from the earliest); the rest wait for the next run.
        answered = _answered_prefix(plans, answers, refused)
        if answered:
            try:
                _commit_round(store, run, answered, answers, call_ids, counters, final)
            except Exception as exc:  # (a lost lease among them): what stopped the run is raised
                logger.warning("the answers already paid for could not be written: %s", type(exc).__name__)
        raise
    return _commit_round(store, run, plans, answers, call_ids, counters, final)


def _answered_prefix(
    plans: Sequence[FactPlan], answers: dict[int, PairDecision], refused: set[int]
) -> list[FactPlan]:
    """The leading plans whose every asked pair is settled (answered, or refused on its own: kept as
    unrelated), up to the first duplicate: whether a duplicate said before its canonical's change is
    the canonical's saying depends on the later facts of its round (split_earlier_sayings), so it waits
    for them (written alone, it moved the canonical's start back, and the change then closed it)."""
    done: list[FactPlan] = []
    for plan in plans:
        if any(pair.number not in answers and pair.number not in refused for pair in plan.asked):
            break
        if resolve(plan, answers).duplicate_of is not None:
            break
        done.append(plan)
    return done


def _commit_round(
    store: ConsolidationStore,
    run: EntityRun,
    plans: Sequence[FactPlan],
    answers: dict[int, PairDecision],
    call_ids: dict[int, int],
    counters: ConsolidationCounters,
    final: set[int],
) -> set[int]:
    """Resolve the plans by the answers and commit them, a chunk a transaction; the facts left to decide
    again."""
    decisions = [
        replace(decision, reconsider=False) if decision.fact_id in final else decision
        for decision in reopen_restatements(
            split_earlier_sayings(close_canonicals([(plan, resolve(plan, answers)) for plan in plans]))
        )
    ]
    resolved = [
        (decision, {p.number: call_ids[p.number] for p in plan.asked if p.number in call_ids})
        for plan, decision in zip(plans, decisions, strict=True)
    ]
    for start in range(0, len(resolved), DECISIONS_PER_COMMIT):
        run.lease()
        chunk = resolved[start : start + DECISIONS_PER_COMMIT]
        written = store.commit_decisions(run.source_id, run.entity_key, run.job_id, chunk)
        for (decision, _), ok in zip(chunk, written, strict=True):
            if decision.reconsider or ok is None:
                continue  # counted when decided for good (or closed), under what it came to
            if ok:
                counters.decisions[decision.kind] = counters.decisions.get(decision.kind, 0) + 1
            else:
                counters.already_decided += 1
    return {decision.fact_id for decision in decisions if decision.reconsider}


def _ask_model(
    store: ConsolidationStore,
    llm: LLMClient | None,
    run: EntityRun,
    plans: Sequence[FactPlan],
    counters: ConsolidationCounters,
    answers: dict[int, PairDecision],
    call_ids: dict[int, int],
    refused: set[int],
) -> None:
    """The model's decisions for every asked pair into ``answers``, the llm_calls row each came from into
    ``call_ids``, and the pairs settled without one into ``refused`` (refused on their own, or skipped
    twice: kept as unrelated) (filled as they come: a run stopped part way keeps what it paid for)."""
    asked = [pair for plan in plans for pair in plan.asked]
    if not asked:
        return
    if llm is None:
        raise ValueError("an LLM client is required to decide ambiguous pairs")
    for start in range(0, len(asked), MAX_PAIRS_PER_CALL):
        chunk = asked[start : start + MAX_PAIRS_PER_CALL]
        # Pairs a reply skipped are asked once more on their own; what is still unanswered then is kept
        # as unrelated, with a reason that says so (not a retry of the job: it would pay for the round
        # again, and a model that skips a pair twice would skip it on every retry too).
        counters.pairs_asked += len(chunk)  # once: a pair asked again is still one pair
        for _asked_twice in range(2):
            decided = _Decided()  # filled as each question of a split one returns
            try:
                _decide_pairs(store, llm, run, chunk, counters, decided)
            except BaseException as exc:  # with none answered, a refusal may be the shared kind: no verdict
                if isinstance(exc, SharedRefusalError) or not counters.pairs_answered:
                    decided.refused.clear()
                raise
            finally:  # a stop keeps what it paid for
                answers.update(decided.answers)
                call_ids.update(decided.asked_in)  # a pair still unanswered: its last ask
                refused |= decided.refused
            chunk = [
                p
                for p in chunk
                if p.number in decided.asked_in
                and p.number not in decided.answers
                and p.number not in decided.refused
            ]
            if not chunk:
                break
        else:
            refused.update(p.number for p in chunk)  # skipped twice: settled, kept as unrelated


@dataclass
class _Decided:
    """What a question (and the questions it was split into) came to: the decisions by pair number,
    the llm_calls row each pair was last asked in, and the pairs refused on their own (not asked
    again: a refusal of one pair alone repeats)."""

    answers: dict[int, PairDecision] = field(default_factory=dict)
    asked_in: dict[int, int] = field(default_factory=dict)
    refused: set[int] = field(default_factory=set)


# A question asked: the pairs it held (whose facts are still there), the request, its reply, its llm_calls id.
_Question = tuple[list[AskedPair], ChatRequest, ChatResponse, int]


def _halves(pairs: Sequence[AskedPair]) -> tuple[Sequence[AskedPair], Sequence[AskedPair]]:
    return pairs[: len(pairs) // 2], pairs[len(pairs) // 2 :]


def _ask(
    store: ConsolidationStore,
    llm: LLMClient,
    run: EntityRun,
    pairs: Sequence[AskedPair],
    counters: ConsolidationCounters,
    at_least: int = 0,
) -> _Question | None:
    """One question on ``pairs``; None when none of their facts is left to ask about."""
    run.guard()
    # Not a fact an erasure (or a re-extraction) removed since the round was read: its text goes to no
    # provider after the erasure returned (its decision would not be written).
    there = store.existing({fact.id for pair in pairs for fact in (pair.new, pair.old)})
    kept = [pair for pair in pairs if pair.new.id in there and pair.old.id in there]
    if not kept:
        return None
    request = consolidation_request(run.entity_key, kept, at_least)
    try:
        response, call_id = _call(store, llm, run, request, kept)
    except _FactsGoneError:  # its tries so far are recorded: asked again without the facts that went
        return _ask(store, llm, run, kept, counters, at_least)
    counters.llm_calls += 1
    counters.prompt_tokens += response.usage.input_tokens
    return kept, request, response, call_id


def _decide_pairs(
    store: ConsolidationStore,
    llm: LLMClient,
    run: EntityRun,
    pairs: Sequence[AskedPair],
    counters: ConsolidationCounters,
    into: _Decided,
    at_least: int = 0,
) -> None:
    """The decisions for ``pairs`` into ``into`` (a pair whose facts are gone is not asked)."""
    question = _ask(store, llm, run, pairs, counters, at_least)
    if question is not None:
        _answered(store, llm, run, counters, question, into)


def _answered(
    store: ConsolidationStore,
    llm: LLMClient,
    run: EntityRun,
    counters: ConsolidationCounters,
    question: _Question,
    into: _Decided,
) -> None:
    """What a question's reply says. An answer cut off at its token cap (a model's long reasons) is asked
    again in halves, each under at least that cap: asked again whole, it was cut at the same place on
    every retry of the job, each paid for. One pair's cut-off answer is an unusable answer (the job
    retries). A refusal is split (``_refused``)."""
    pairs, request, response, call_id = question
    if response.finish == "truncated" and len(pairs) > 1:
        for half in _halves(pairs):
            _decide_pairs(store, llm, run, half, counters, into, request.max_tokens)
        return
    if response.finish == "refusal":
        _refused(store, llm, run, counters, question, into)
        return
    if response.finish != "end":
        raise ConsolidationReplyError(f"the consolidation answer ended early ({response.finish})")
    malformed = malformed_reply(response, pairs)
    if malformed is not None:
        raise ConsolidationReplyError(malformed)
    answers = parse_decisions(response.text, [p.number for p in pairs])
    counters.pairs_answered += len(answers)
    into.answers.update(answers)
    into.asked_in.update({p.number: call_id for p in pairs})


def _refused(
    store: ConsolidationStore,
    llm: LLMClient,
    run: EntityRun,
    counters: ConsolidationCounters,
    question: _Question,
    into: _Decided,
) -> None:
    """A refused question. One fact's text (a content filter) is refused in every question that holds
    it: asked again whole, the job's every retry was refused and the entity was never consolidated
    again. So it is halved, and a refused half halved again, down to the pairs refused alone, kept as
    unrelated and not asked again; the rest are decided. A run that has had SHARED_REFUSAL_PAIRS refused
    alone, none answered, and not two facts in all of them stops (the job retries, as before this
    split)."""
    pairs, request, _, call_id = question
    if len(pairs) == 1:
        counters.refused_pairs.append((pairs[0].new.id, pairs[0].old.id))
        if (
            counters.pairs_refused >= SHARED_REFUSAL_PAIRS
            and not counters.pairs_answered
            and not explained_by_few_facts(counters.refused_pairs)
        ):
            raise SharedRefusalError(
                f"the model refused {counters.pairs_refused} pairs on their own and answered none: it "
                "refuses what they share (the entity, its subject), not one fact"
            )
        into.asked_in[pairs[0].number] = call_id
        into.refused.add(pairs[0].number)
        return
    for half in _halves(pairs):
        _decide_pairs(store, llm, run, half, counters, into, request.max_tokens)


class _FactsGoneError(Exception):
    """A fact of the question went (an erasure, a re-extraction) while its call waited to try again."""


def _facts_gone(store: ConsolidationStore, fact_ids: set[int]) -> bool:
    """Whether a fact of the call went meanwhile; False when the database cannot say (the call's error
    is the one to raise)."""
    try:
        return store.existing(fact_ids) != fact_ids
    except Exception:
        return False


def _call(
    store: ConsolidationStore, llm: LLMClient, run: EntityRun, request: ChatRequest, asked: list[AskedPair]
) -> tuple[ChatResponse, int]:
    """One call, recorded in llm_calls whatever its end (a budget refusal makes no call and no row).
    Between the gateway's tries (a retry's backoff, a rate limit's wait: minutes in an outage) its facts
    are looked up again: an erasure that returned meanwhile had its page's text sent on the next try."""
    run.before_call()
    started = time.perf_counter()
    fact_ids = {fact.id for pair in asked for fact in (pair.new, pair.old)}

    def between_tries() -> None:
        run.between_tries()  # the switch, the lease, the budget
        if store.existing(fact_ids) != fact_ids:
            raise _FactsGoneError()

    def record_tries(tries: Sequence[AttemptRecord], *, erased: bool | None = None) -> None:
        """The gateway's failed tries before the last; ``erased`` None: asked only when there are some
        (an erasure that took facts they were sent, as the next try went out, leaves none of their
        words)."""
        failed = LLMCallRecord.failed_tries(CONSOLIDATION_PURPOSE, llm, tries, run.job_id)
        if failed and erased is None:
            erased = _facts_gone(store, fact_ids)
        for record in failed:
            store.record_call(record, erased=bool(erased))

    try:
        with checked_between_tries(between_tries):
            response, tried = chat_with_tries(llm, request)
    except BudgetExhaustedError as exc:
        record_tries(getattr(exc, "attempts", ()))
        raise
    except LLMError as exc:
        # Facts it was sent went during the call (an erasure): the provider's words may quote them, and
        # under an entity other pages name too the job keeps its name, so no erasure finds the row.
        gone = _facts_gone(store, fact_ids)
        record_tries(getattr(exc, "attempts", ())[:-1], erased=gone)
        latency_ms = exc.latency_ms or int((time.perf_counter() - started) * 1000)  # the last try's own
        failed = LLMCallRecord.failed(CONSOLIDATION_PURPOSE, llm, exc, latency_ms, run.job_id)
        store.record_call(failed, erased=gone)
        if gone:
            raise _FactsGoneError() from None  # asked again without them (nor the words in a job note)
        raise
    except BaseException as exc:
        # A stop between tries (the switch, the lease, a SIGTERM; facts gone): no call of its own.
        record_tries(tries_before_stop(exc), erased=isinstance(exc, _FactsGoneError))
        raise
    record_tries(tried)
    outcome = {"end": "ok", "truncated": "truncated_output"}.get(response.finish, response.finish)
    error = malformed_reply(response, asked) if outcome == "ok" else None
    call_id = store.record_call(
        LLMCallRecord(
            purpose=CONSOLIDATION_PURPOSE,
            provider=response.provider,
            model=response.model,
            usage=response.usage,
            latency_ms=response.latency_ms,
            outcome="malformed_output" if error else outcome,  # (recorded ok, as extraction's are not)
            job_id=run.job_id,
            error=error,
        )
    )
    return response, call_id


def malformed_reply(response: ChatResponse, pairs: Sequence[AskedPair]) -> str | None:
    """Why a finished reply cannot be used (ConsolidationReplyError's words), or None."""
    try:
        parse_decisions(response.text, [p.number for p in pairs])
    except MalformedDecisionsError as exc:
        return f"the consolidation answer was malformed: {exc}"
    return None
