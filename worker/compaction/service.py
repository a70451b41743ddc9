"""One compaction of a transcript: cut, summarize the head, gate the summary, record it (through the store).

The head is serialized (a previous summary is folded into the new one) and sent to the LLM inside
``<untrusted-data>``. Coverage of the summary against the head's words (without the serializer's
speaker labels), on the query terms of the transcript's intent, must reach the active calibrated
threshold. Below it the summarizer gets one retry that names the missed terms; still below, the
summary is stored as ``rejected`` and never applied, as is one that would leave the context no smaller
(at once). An LLM error, a refusal or an empty reply is stored as ``failed``. A reply that is not a
summary (no ``## Goal`` heading) is asked for once more; a second ends the run, ``failed`` (or
``rejected``, after a summary judged below τ).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Final, TypedDict, Unpack, cast

from worker.accounting import LLMCallRecord
from worker.calibration import ActiveThreshold
from worker.compaction.outcome import CompactionOutcome, CompactionStatus
from worker.compaction.prompts import LLM_PURPOSE, compaction_cache_key, summarizer_request
from worker.compaction.records import CompactionRecord
from worker.compaction.store import TranscriptStore
from worker.compaction.stored_plan import StoredContext
from worker.config_store import COMPACTION_ENABLED
from worker.core.compaction import SUMMARY_CHAR_LIMIT, SUMMARY_HEADINGS, should_compact, without_labels
from worker.core.compaction_gate import (
    MAX_ATTEMPTS,
    MAX_NOT_SUMMARIES,
    GateResult,
    ResponseOutcome,
    intent_terms,
    judge_summary,
    opens_as_summary,
    response_outcome,
    retry_terms,
    summary_of,
)
from worker.core.quality import lex_words
from worker.core.timeline import CompactionPlan
from worker.jobs.lifecycle import paused_reason
from worker.jobs.registry import KillSwitchOffError
from worker.llm.between_tries import checked_between_tries, tries_before_stop
from worker.llm.errors import BudgetExhaustedError, LLMError, provider_cannot_serve
from worker.llm.retry import AttemptRecord, chat_with_tries
from worker.llm.types import ChatRequest, ChatResponse, LLMClient, Usage

logger = logging.getLogger(__name__)

PAUSED_REASON = paused_reason(COMPACTION_ENABLED)

DEFAULT_MAX_OUTPUT_TOKENS: Final = 4096
DEFAULT_INTENT_MESSAGES: Final = 3


class CompactionDisabledError(KillSwitchOffError):
    """The compaction kill switch was turned off; the run stops before its next LLM call."""


class CompactOptions(TypedDict, total=False):
    """How one compaction runs; every key may be left out (the defaults are in brackets)."""

    force: bool  # compact even while the context is within window - reserve [False]
    job_id: int | None  # the job its rows belong to [None]
    guard: Callable[[], None] | None  # called before every LLM call: a job's lease and budget checks [None]
    lease: Callable[[], None] | None  # called before the row is written: a job's lease check [guard]
    enabled: Callable[[], bool] | None  # the kill switch, read before every LLM call [None: always on]
    max_output_tokens: int  # the summarizer's output cap [DEFAULT_MAX_OUTPUT_TOKENS]
    intent_messages: int  # how many latest user messages the intent is read from [DEFAULT_INTENT_MESSAGES]
    max_input_tokens: int | None  # the summarizer's input; a longer head is cut earlier [None: no cap]
    # An accepted summary of part of the head requests the next part's compaction in its own
    # transaction (forced when this one was) [False: the caller decides]
    continue_capped: bool
    quality_gate: bool  # the gate judges each summary (config compaction.quality_gate) [True]


def compact(
    store: TranscriptStore,
    llm: LLMClient,
    transcript_id: str,
    *,
    threshold: Callable[[], ActiveThreshold],
    **options: Unpack[CompactOptions],
) -> CompactionOutcome:
    """Summarize the head of a transcript and apply the summary if it passes the quality gate.

    ``threshold`` gives the active τ. A kill switch turned off raises CompactionDisabledError before
    the next LLM call, a spent budget BudgetExhaustedError (nothing recorded: no call was made); an
    unknown transcript raises TranscriptNotFoundError.
    """
    force = options.get("force", False)
    source = store.compaction_input(
        transcript_id,
        wanted=lambda context: (
            force
            or should_compact(
                context.tokens, context.settings.context_window, context.settings.reserve_tokens
            )
        ),
        intent_messages=options.get("intent_messages", DEFAULT_INTENT_MESSAGES),
        max_head_tokens=options.get("max_input_tokens"),
    )
    context, plan = source.context, source.plan
    outcome = CompactionOutcome("not_needed", transcript_id, tokens_before=context.tokens)
    if plan is None and source.unplanned is not None:
        outcome.status, outcome.detail = "nothing_to_compact", source.unplanned
        return outcome
    if plan is None:
        trigger = context.settings.trigger_tokens
        outcome.detail = (
            f"the context holds {context.tokens} tokens, within the threshold "
            f"({'none: no context window is set' if trigger is None else trigger})"
        )
        return outcome
    run = CompactionRun(
        store,
        llm,
        context,
        plan,
        terms=intent_terms(context.settings.instructions, source.user_texts),
        gate_on=threshold(),
        enforced=options.get("quality_gate", True),
        outcome=outcome,
        job_id=options.get("job_id"),
        guard=options.get("guard"),
        lease=options.get("lease"),
        enabled=options.get("enabled"),
        max_output_tokens=options.get("max_output_tokens", DEFAULT_MAX_OUTPUT_TOKENS),
        continuation=force if plan.capped and options.get("continue_capped", False) else None,
    )
    outcome.cut_seq, outcome.head_capped = plan.cut_seq, plan.capped
    outcome.threshold_tau, outcome.threshold_version = run.gate_on.tau, run.gate_on.version
    return run.summarize()


@dataclass(frozen=True)
class _Below:
    """A summary judged below τ with an attempt to come: what the next one is told it missed."""

    summary: str
    gate: GateResult
    missed: list[str]


@dataclass
class CompactionRun:
    """The attempts of one compaction over a planned cut, and the row that records how they ended."""

    store: TranscriptStore
    llm: LLMClient
    context: StoredContext
    plan: CompactionPlan
    terms: list[str]
    gate_on: ActiveThreshold
    enforced: bool  # the gate's verdict holds (config compaction.quality_gate)
    outcome: CompactionOutcome
    job_id: int | None = None
    guard: Callable[[], None] | None = None
    lease: Callable[[], None] | None = None
    enabled: Callable[[], bool] | None = None
    max_output_tokens: int = DEFAULT_MAX_OUTPUT_TOKENS
    continuation: bool | None = None  # once accepted, request the rest's compaction (forced or not)
    log: list[dict[str, Any]] = field(default_factory=list)
    source_tokens: list[str] = field(init=False)  # the lexed head every attempt is judged against

    def __post_init__(self) -> None:
        self.source_tokens = lex_words(without_labels(self.plan.serialized))

    @property
    def transcript_id(self) -> str:
        return self.context.transcript_id

    def summarize(self) -> CompactionOutcome:
        """Up to MAX_ATTEMPTS summaries judged (the second told what the first missed), and a reply that
        is not a summary asked for again (MAX_NOT_SUMMARIES such replies end the run): three calls at most."""
        below: _Below | None = None
        judged = not_summaries = 0
        while True:
            step = self._attempt(judged + not_summaries + 1, below, last=judged + 1 == MAX_ATTEMPTS)
            if isinstance(step, CompactionOutcome):
                return step
            if step is None:
                not_summaries += 1
                if not_summaries == MAX_NOT_SUMMARIES:
                    return self._not_a_summary(below)
            else:
                judged, below = judged + 1, step

    def _not_a_summary(self, below: _Below | None) -> CompactionOutcome:
        """The run's end after a second reply that is not a summary: the summary judged below τ before
        it, if any, is rejected as it was judged; else the compaction failed."""
        if below is not None:
            error = (
                f"coverage {below.gate.coverage:.3f} was below τ={self.gate_on.tau:.4g}, and the retry's "
                "reply was not a summary; the summary was not applied"
            )
            return self._finish("rejected", summary=below.summary, gate=below.gate, error=error)
        return self._finish(
            "failed",
            error=(
                "the summarizer's reply was not a summary (it had no "
                f"{SUMMARY_HEADINGS[0]!r} heading) {MAX_NOT_SUMMARIES} times; the history was left as it was"
            ),
        )

    def _failed(self, why: str, below: _Below | None) -> CompactionOutcome:
        """A call that ended the run (refused, empty, cut off, failed): the summary judged below τ before
        it, if any, is rejected as it was judged (stored as failed, its coverage was lost to calibration
        and the job failed over a retry's hiccup); else the compaction failed."""
        if below is not None:
            error = (
                f"coverage {below.gate.coverage:.3f} was below τ={self.gate_on.tau:.4g}, and the retry "
                f"failed ({why}); the summary was not applied"
            )
            return self._finish("rejected", summary=below.summary, gate=below.gate, error=error)
        return self._finish("failed", error=f"{why}; the history was left as it was")

    def _unless_below(
        self, exc: LLMError, why: str, entry: dict[str, Any], below: _Below | None
    ) -> CompactionOutcome:
        """``exc`` raised, for the lifecycle's table to pause or queue the job again; but after a paid
        summary judged below τ, that one is rejected as judged (raised, its coverage never reached
        calibration, and the rerun paid for it again: every budget renewal, with room for one call)."""
        if below is None:
            raise exc
        self.log.append(entry)
        return self._failed(why, below)

    def _check(self) -> None:
        """What stops the run: the kill switch, then the job's guard (lease, worker stopping, budgets).
        Asked before each summarizer call and between the gateway's tries of one."""
        if self.enabled is not None and not self.enabled():
            raise CompactionDisabledError(PAUSED_REASON)
        if self.guard is not None:
            self.guard()

    def _chat(self, request: ChatRequest) -> ChatResponse:
        """The summarizer's reply; the gateway's failed tries of it (a 429, a 5xx it retried) are each an
        llm_calls row, as extraction records them (through ``chat`` they were hidden: counts ran low)."""
        response, failed = chat_with_tries(self.llm, request)
        self._record_tries(failed)
        return response

    def _record_tries(self, tries: Sequence[AttemptRecord]) -> None:
        """The gateway's failed tries of a call that a stop ended between them, each an llm_calls row."""
        for failed in LLMCallRecord.failed_tries(
            LLM_PURPOSE, self.llm, tries, self.job_id, words=self._words
        ):
            self.store.record_llm_call(failed)

    @property
    def _words(self) -> bool:
        """Whether a failed call's row keeps the provider's words: not under no job (`compact --now`), where
        an erasure finds it by no job, nor by an attempt log (an outage is raised before any is written)."""
        return self.job_id is not None

    def _attempt(
        self, attempt: int, below: _Below | None, *, last: bool
    ) -> CompactionOutcome | _Below | None:
        """One summarizer call: the outcome when this attempt ends the run, else the summary judged below
        τ (what the next attempt is told it missed), or None for a reply that is not a summary. ``last``:
        no judged attempt comes after this one."""
        missed = below.missed if below is not None else []
        request = summarizer_request(
            self.plan.serialized,
            self.context.settings.instructions,
            max_tokens=self.max_output_tokens,
            missed_terms=missed,
            cache_key=compaction_cache_key(self.transcript_id),
        )
        entry: dict[str, Any] = {"attempt": attempt, "missed_terms_named": list(missed)}
        try:
            self._check()  # (in the try: a job's budget, spent by the attempt before, is its guard's)
            with checked_between_tries(self._check):
                response = self._chat(request)
        except BudgetExhaustedError as exc:
            # No call was made by this try: the job waits for budget (paused), as extraction's do. The
            # failed tries before it (a budget asked again between them) are recorded.
            self._record_tries(getattr(exc, "attempts", ()))
            return self._unless_below(exc, str(exc), {**entry, "outcome": exc.outcome}, below)
        except LLMError as exc:
            self._record_tries(getattr(exc, "attempts", ())[:-1])  # the gateway's tries before the last
            failed = LLMCallRecord.failed(
                LLM_PURPOSE, self.llm, exc, exc.latency_ms, self.job_id, words=self._words
            )
            call_id = self.store.record_llm_call(failed)
            logged = {**entry, "outcome": "provider_error", "llm_call_id": call_id, "error": str(exc)}
            if provider_cannot_serve(exc) or exc.deployment_fault:
                # An outage (429/5xx past the retry layer), the account's money spent, or the provider
                # blaming the settings (a 401 key, a model it does not have), not this request: the
                # lifecycle's table decides (queued again, or retried in the provider's words), as for
                # extraction. Stored as a failed compaction, it ended the job and held off the next for
                # the retrigger wait: a minute's wrong key failed every compaction in flight.
                return self._unless_below(exc, f"the summarizer call failed: {exc}", logged, below)
            self.log.append(logged)
            return self._failed(f"the summarizer call failed: {exc}", below)
        except BaseException as exc:  # stopped between the gateway's tries (switch, lease, SIGTERM)
            self._record_tries(tries_before_stop(exc))
            raise
        result = response_outcome(response.finish, response.text)
        entry["llm_call_id"] = self._record_response(response, result)
        if result == "refusal":
            # Its words stay in the attempt log (erased with the transcript), out of the error: that goes
            # to the log and the job's note, and a refusal's "reason" is often the summary begun.
            said = response.refusal or response.text.strip()
            self.log.append({**entry, "outcome": result, "refusal": said[:SUMMARY_CHAR_LIMIT]})
            return self._failed(
                f"the summarizer refused ({len(said)} characters of reply, kept in the attempt log)", below
            )
        summary = summary_of(response.text)
        if result == "truncated_output" and not opens_as_summary(response.text):
            self.log.append({**entry, "outcome": result, "reply_chars": len(response.text)})
            if response.window_full:  # the model's context was full: a larger output cap makes it worse
                return self._failed(
                    "the summarizer's reply was cut off where the model's context window filled, before "
                    "any summary; lower FACTMILL_COMPACTION_MAX_INPUT_TOKENS",
                    below,
                )
            return self._failed(
                f"the summarizer's reply was cut off at its output cap ({self.max_output_tokens} tokens) "
                "before any summary; raise FACTMILL_COMPACTION_MAX_OUTPUT_TOKENS",
                below,
            )
        if not summary and result == "malformed_output":  # only a reasoning model's thoughts: asked again
            self.log.append({**entry, "outcome": result, "reply_chars": len(response.text)})
            return None
        if not summary:
            self.log.append({**entry, "outcome": "empty_output"})
            return self._failed("the summarizer returned an empty reply", below)
        if result == "malformed_output":
            # Not a summary (prose, an obeyed instruction): its words stay in the attempt log, as a
            # refusal's do; the next attempt asks again as this one did.
            self.log.append({**entry, "outcome": result, "reply": summary})
            return None
        return self._judge(entry, summary, truncated=result == "truncated_output", last=last)

    def _record_response(self, response: ChatResponse, result: ResponseOutcome) -> int:
        error = response.refusal if result == "refusal" else None
        return self._record_call(
            response.provider, response.model, response.usage, response.latency_ms, result, error
        )

    def _record_call(
        self, provider: str, model: str, usage: Usage, latency_ms: int, outcome: str, error: str | None
    ) -> int:
        record = LLMCallRecord(LLM_PURPOSE, provider, model, usage, latency_ms, outcome, self.job_id, error)
        return self.store.record_llm_call(record)

    def _judge(
        self, entry: dict[str, Any], summary: str, *, truncated: bool, last: bool
    ) -> CompactionOutcome | _Below:
        """Gate a summary: accept it, reject it after the last attempt, or name what the next one keeps."""
        tau = self.gate_on.tau
        gate = judge_summary(self.source_tokens, summary, self.terms, tau, enforced=self.enforced)
        after, before = self.plan.tokens_after(summary), self.plan.tokens_before
        grows = after >= before  # a small head: applied, the context grew (no retry: it would be longer)
        self.log.append(
            {
                **entry,
                "outcome": "no_saving" if grows else "passed" if gate.passed else "below_threshold",
                "coverage": gate.coverage,
                "density": gate.density,
                "threshold_tau": tau,
                "threshold_version": self.gate_on.version,
                "judged": gate.judged,
                "missed_terms": gate.missed_terms,
                "summary_chars": len(summary),
                "truncated": truncated,
            }
        )
        if grows:
            error = f"the summary leaves the context at {after} tokens, not under its {before}; not applied"
            return self._finish("rejected", summary=summary, gate=gate, error=error)
        if gate.passed:
            return self._finish("accepted", summary=summary, gate=gate)
        if last:
            return self._finish(
                "rejected",
                summary=summary,
                gate=gate,
                error=(
                    f"coverage {gate.coverage:.3f} stayed below τ={tau:.4g} after {MAX_ATTEMPTS} "
                    "attempts; the summary was not applied"
                ),
            )
        return _Below(summary, gate, retry_terms(gate, self.terms))

    def _finish(
        self,
        status: str,
        *,
        summary: str | None = None,
        error: str | None = None,
        gate: GateResult | None = None,
    ) -> CompactionOutcome:
        """Store the compaction row and fill in the outcome from what was stored (the lease checked, not
        whether the worker is stopping: what was paid for is kept)."""
        if self.lease is not None:
            self.lease()
        elif self.guard is not None:
            self.guard()
        summary_info = self.context.summary
        saved = self.store.save_compaction(
            CompactionRecord(
                transcript_id=self.transcript_id,
                status=status,
                cut_seq=self.plan.cut_seq,
                previous_id=summary_info.compaction_id if summary_info else None,
                tokens_before=self.plan.tokens_before,
                threshold_tau=self.gate_on.tau,
                threshold_version=self.gate_on.version,
                attempt_log=self.log,
                summary=summary,
                tokens_after=self.plan.tokens_after(summary) if summary is not None else None,
                coverage=gate.gate_coverage if gate else None,
                density=gate.density if gate else None,
                missed_terms=gate.missed_terms if gate else [],
                error=error,
                job_id=self.job_id,
                head_capped=self.plan.capped,
            ),
            read_from=self.context.created_at,
            continue_forced=self.continuation,
        )
        outcome = self.outcome
        outcome.status = cast(CompactionStatus, saved.status)
        outcome.compaction_id = saved.compaction_id
        outcome.attempts = len(self.log)
        outcome.tokens_after = saved.tokens_after
        if gate is not None:
            outcome.coverage, outcome.density, outcome.missed_terms = (
                gate.gate_coverage,
                gate.density,
                gate.missed_terms,
            )
        judged = _judged_as(gate, self.gate_on.tau)
        outcome.detail = saved.error or judged
        # Neither the transcript's id (a client's label) nor an error's text (a provider's message may
        # quote the request): the job id is bound to the line, and the compaction row has the rest.
        logger.info(
            "compaction %s %s (cut at seq %s, %s -> %s tokens, %s attempt(s))%s",
            saved.compaction_id,
            saved.status,
            self.plan.cut_seq,
            self.plan.tokens_before,
            outcome.tokens_after,
            len(self.log),
            f": {judged}" if judged else "",
        )
        return outcome


def _judged_as(gate: GateResult | None, tau: float) -> str:
    """What the gate said of a summary, for the job's note and the log line."""
    if gate is None:
        return ""
    if not gate.on_terms:
        return "not judged: the transcript's intent gave the gate no query words"
    return f"coverage {gate.coverage:.3f} against τ={tau:.4g}"
