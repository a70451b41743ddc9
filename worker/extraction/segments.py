"""One segment's LLM attempts: the reply classified, one repair turn, one bigger cap, never "0 facts"."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from worker.core.facts import ExtractedFact, MalformedReplyError, parse_facts_reply, repair_user_message
from worker.extraction.prompts import extraction_request, first_turn
from worker.llm.between_tries import checked_between_tries, tries_before_stop
from worker.llm.errors import BudgetExhaustedError, LLMError, provider_cannot_serve
from worker.llm.retry import AttemptRecord, chat_with_tries
from worker.llm.types import ChatRequest, ChatResponse, LLMClient, Usage

# A truncated reply is retried once with this many times the output cap, up to the ceiling.
TRUNCATION_RETRY_FACTOR = 2
MAX_OUTPUT_TOKENS_CEILING = 8192
# Request rejections that say the request itself is bad (its content, its size): sending the same
# segment again gets the same answer. Auth, permission and not-found errors (401/403/404), and any
# error the provider says blames the account or the settings (LLMError.deployment_fault, such as a 400
# for a spent credit balance), are the deployment's fault, not the segment's: never counted to skip it.
REJECTED_REQUEST_STATUSES = frozenset({400, 413, 422})


@dataclass
class Attempt:
    outcome: str
    response: ChatResponse | None
    facts: list[ExtractedFact]
    error: str | None = None
    provider: str = ""
    model: str = ""
    latency_ms: int = 0
    called: bool = True  # False: refused before any request (budget), so no llm_calls row
    batch: bool = False  # answered through a provider's batch API: billed at the batch discount
    rejected: bool = False  # a provider error that rejects the request itself (REJECTED_REQUEST_STATUSES)
    provider_away: bool = False  # llm.errors.provider_cannot_serve: none of the segment's doing
    deployment_fault: bool = False  # the provider blamed the account or the settings (LLMError's)
    usage: Usage | None = None  # billed for a reply that failed (LLMError.usage); a response has its own

    @classmethod
    def of(
        cls,
        response: ChatResponse,
        outcome: str,
        *,
        facts: list[ExtractedFact] | None = None,
        error: str | None = None,
    ) -> Attempt:
        return cls(
            outcome, response, facts or [], error, response.provider, response.model, response.latency_ms
        )


@dataclass
class SegmentResult:
    attempts: list[Attempt]
    # The try ended in a failure that trying again will not mend: a refusal, malformed after its repair
    # turn, truncated after its retry, a rejected request. Counted towards skipping the segment.
    permanent: bool = False

    @property
    def ok(self) -> bool:
        return bool(self.attempts) and self.attempts[-1].outcome == "ok"

    @property
    def facts(self) -> list[ExtractedFact]:
        return self.attempts[-1].facts if self.ok else []

    @property
    def outcome(self) -> str:
        return self.attempts[-1].outcome


def truncation_retry_cap(cap: int) -> int:
    """The reply cap a truncated reply is asked again with: twice the cap, to the ceiling."""
    return min(cap * TRUNCATION_RETRY_FACTOR, MAX_OUTPUT_TOKENS_CEILING)


def largest_reply_cap(first: int) -> int:
    """The largest reply cap a segment's calls ask for when the first asks ``first`` (one at the ceiling
    is not asked again)."""
    return first if first >= MAX_OUTPUT_TOKENS_CEILING else truncation_retry_cap(first)


def _retried_failures(records: Sequence[AttemptRecord]) -> list[Attempt]:
    """The gateway's failed tries (429, 5xx, timeouts it retried) as attempts: each cost a request and is
    recorded in llm_calls and extraction_audit like any other."""
    return [
        Attempt(
            "provider_error", None, [], str(r.error), r.provider, r.model, r.latency_ms, usage=r.error.usage
        )
        for r in records
        if r.error is not None
    ]


def _chat_recording_retries(llm: LLMClient, request: ChatRequest, attempts: list[Attempt]) -> ChatResponse:
    response, failed = chat_with_tries(llm, request)
    attempts.extend(_retried_failures(failed))
    return response


def classify_reply(response: ChatResponse, max_facts: int, cap: int) -> Attempt:
    """One reply as an attempt: refusal, truncated_output, malformed_output, or ok with its facts."""
    if response.finish == "refusal":
        return Attempt.of(response, "refusal", error=response.refusal or "the model refused")
    if response.window_full:
        return Attempt.of(
            response,
            "truncated_output",
            error="the reply ran out of the model's context window (the segment's prompt and the cap "
            "together); a larger cap cannot help: use a model with a larger window",
        )
    if response.finish == "truncated":
        return Attempt.of(response, "truncated_output", error=f"output hit the {cap}-token cap")
    try:
        facts = parse_facts_reply(response.text, max_facts)
    except MalformedReplyError as exc:
        return Attempt.of(response, "malformed_output", error=str(exc))
    return Attempt.of(response, "ok", facts=facts)


def _ask(
    llm: LLMClient, request: ChatRequest, attempts: list[Attempt], before_call: Callable[[], None] | None
) -> ChatResponse | None:
    """One request; on a refusal or provider failure, its attempt is recorded and None returned."""
    try:
        if before_call is not None:
            before_call()
        with checked_between_tries(before_call):  # and between the gateway's tries of this call
            return _chat_recording_retries(llm, request, attempts)
    except BudgetExhaustedError as exc:  # refused by a budget check: no request made (by this try)
        attempts.extend(_retried_failures(getattr(exc, "attempts", ())))  # the tries before it, if any
        attempts.append(
            Attempt("budget_exhausted", None, [], str(exc), llm.provider, llm.model, called=False)
        )
    except LLMError as exc:
        attempts.extend(_retried_failures(getattr(exc, "attempts", ())[:-1]))
        attempts.append(
            Attempt(
                "provider_error",
                None,
                [],
                str(exc),
                llm.provider,
                llm.model,
                exc.latency_ms,
                rejected=rejected_request(exc),
                provider_away=provider_cannot_serve(exc),
                deployment_fault=exc.deployment_fault,
                usage=exc.usage,
            )
        )
    except BaseException as exc:
        # Stopped between the gateway's tries (or by a SIGTERM): those it made are kept.
        attempts.extend(_retried_failures(tries_before_stop(exc)))
        raise
    return None


DISCARDED_ABORTED = "discarded: the run stopped between this segment's attempts"


class SegmentAbortedError(Exception):
    """An error between a segment's attempts once some were paid for (the lease lost, the worker
    stopping, the database gone at a budget check): ``attempts`` to record, ``cause`` to raise on.
    The attempts were a local list, lost with the exception: the job's retry paid for them again."""

    def __init__(self, attempts: list[Attempt], cause: BaseException) -> None:
        super().__init__(str(cause))
        self.attempts, self.cause = attempts, cause


def _given_up(attempts: list[Attempt]) -> SegmentResult:
    """The try ended on a failure with no turn left to mend it: a permanent one."""
    return SegmentResult(attempts, permanent=True)


def rejected_request(exc: LLMError) -> bool:
    rejected = exc.status in REJECTED_REQUEST_STATUSES or exc.too_large
    return not exc.retryable and rejected and not exc.deployment_fault


def extract_segment(
    llm: LLMClient,
    rendered: str,
    max_facts: int,
    max_output_tokens: int,
    before_call: Callable[[], None] | None = None,
) -> SegmentResult:
    """Ask for facts; one repair turn for a malformed reply, one bigger cap for a truncated one. An
    error after a paid attempt is raised as SegmentAbortedError, with the attempts."""
    attempts: list[Attempt] = []
    try:
        return _extract(llm, rendered, max_facts, max_output_tokens, before_call, attempts)
    except BaseException as exc:  # a SIGTERM (SystemExit) too: the paid attempts are recorded first
        if any(attempt.called for attempt in attempts):
            raise SegmentAbortedError(list(attempts), exc) from exc
        raise


def _extract(
    llm: LLMClient,
    rendered: str,
    max_facts: int,
    max_output_tokens: int,
    before_call: Callable[[], None] | None,
    attempts: list[Attempt],
) -> SegmentResult:
    turns: list[tuple[str, str]] = [first_turn(rendered)]
    cap = max_output_tokens
    repaired = retried_truncation = False
    while True:
        response = _ask(llm, extraction_request(turns, max_facts, cap), attempts, before_call)
        if response is None:
            last = attempts[-1] if attempts else None
            # The raised cap refused for the settings (over the model's output limit), which the first
            # call's cap was not: the truncated reply stands, given up as a second truncation would be.
            # Not given up, the page failed at this segment on every run, paying for its first call again.
            cap_refused = retried_truncation and last is not None and last.deployment_fault
            permanent = last is not None and (last.rejected or (cap_refused and not last.provider_away))
            return SegmentResult(attempts, permanent=permanent)
        attempt = classify_reply(response, max_facts, cap)
        attempts.append(attempt)
        if attempt.outcome == "truncated_output":
            # Cut off by the context window: twice the cap stopped at the same window, a paid call lost.
            if retried_truncation or cap >= MAX_OUTPUT_TOKENS_CEILING or response.window_full:
                return _given_up(attempts)
            retried_truncation = True
            cap = truncation_retry_cap(cap)
            continue
        if attempt.outcome == "malformed_output":
            if repaired:
                return _given_up(attempts)
            repaired = True
            if response.text.strip():  # a blank reply is asked again: an empty assistant turn is a 400
                turns = [
                    *turns,
                    ("assistant", response.text),
                    ("user", repair_user_message(response.text, attempt.error or "")),
                ]
            continue
        if attempt.outcome == "refusal":
            return _given_up(attempts)
        return SegmentResult(attempts)
