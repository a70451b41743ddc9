"""The simulator's knobs (SimulatorConfig), its fault classes and the seeded draws that pick them."""

from __future__ import annotations

import random
import re
import uuid
from dataclasses import dataclass
from enum import StrEnum
from typing import Any, Self

from pydantic import BaseModel, ConfigDict, Field, model_validator

from worker.simulator.embeddings import DEFAULT_EMBEDDING_DIMENSIONS
from worker.simulator.prompt import DEFAULT_MAX_FACTS, MAX_FACTS_CEILING

SIMULATOR_HEADER = "x-factmill-simulator"
DEFAULT_FAULT_HEADER = "x-simulator-fault"
SIMULATOR_MODEL = "simulator-1"
SIMULATOR_EMBEDDING_MODEL = "simulator-embedding-1"
SYSTEM_FINGERPRINT = "sim-fp-factmill-1"


def sim_id(prefix: str) -> str:
    """A fresh id that says where it comes from: every id the simulator makes starts with `sim-`."""
    return f"sim-{prefix}{uuid.uuid4().hex[:24]}"


class Fault(StrEnum):
    """Fault classes, named as the `x-simulator-fault` header spells them."""

    RATE_LIMIT = "429"
    SERVER_ERROR = "500"
    OVERLOADED = "529"
    TIMEOUT = "timeout"
    MALFORMED = "malformed"
    TRUNCATED = "truncated"
    REFUSAL = "refusal"


# A marker in a prompt's text that forces a fault on every request carrying it (SimulatorConfig.text_faults).
TEXT_FAULT_MARKER = re.compile(r"\[\[sim:([a-z0-9]+)\]\]")


def text_fault(text: str) -> Fault | None:
    """The fault a ``[[sim:<fault>]]`` marker in ``text`` asks for (the first known one), else None."""
    for match in TEXT_FAULT_MARKER.finditer(text):
        try:
            return Fault(match.group(1))
        except ValueError:
            continue
    return None


# The order in which one uniform draw is mapped onto the fault rates; changing it changes seeded runs.
FAULT_ORDER: tuple[Fault, ...] = tuple(Fault)
# The faults answered with an HTTP error instead of a reply.
HTTP_FAULTS = frozenset({Fault.RATE_LIMIT, Fault.SERVER_ERROR, Fault.OVERLOADED})
# Outcomes counted in stats besides the fault names.
OUTCOME_OK = "ok"
OUTCOME_INVALID = "invalid_request"
OUTCOME_RAW = "raw"  # answered with a configured raw_replies body


class SimulatorConfig(BaseModel):
    """Every knob of the simulator. Defaults: no latency, no faults, seed 0."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)

    seed: int = 0
    latency_ms: float = Field(default=0.0, ge=0)
    jitter_ms: float = Field(default=0.0, ge=0, description="uniform extra latency in [0, jitter_ms), seeded")
    rate_429: float = Field(default=0.0, ge=0, le=1)
    rate_500: float = Field(default=0.0, ge=0, le=1)
    rate_529: float = Field(
        default=0.0, ge=0, le=1, description="Anthropic 529 overloaded_error; 503 on OpenAI routes"
    )
    rate_timeout: float = Field(
        default=0.0, ge=0, le=1, description="hang for hang_seconds, then answer normally"
    )
    rate_malformed: float = Field(default=0.0, ge=0, le=1)
    rate_truncated: float = Field(default=0.0, ge=0, le=1)
    rate_refusal: float = Field(default=0.0, ge=0, le=1)
    retry_after_seconds: float = Field(
        default=1.0, ge=0, description="sent on 429 as Retry-After (and retry-after-ms)"
    )
    hang_seconds: float = Field(default=30.0, ge=0)
    fault_header: str | None = Field(
        default=DEFAULT_FAULT_HEADER,
        description="request header that forces a fault; None turns the escape hatch off",
    )
    text_faults: bool = Field(
        default=True,
        description="a prompt holding [[sim:<fault>]] (e.g. [[sim:refusal]]) always gets that fault: "
        "a poison segment, failing the same way on every attempt; False makes such prompts answer normally",
    )
    default_max_facts: int = Field(default=DEFAULT_MAX_FACTS, ge=0, le=MAX_FACTS_CEILING)
    default_max_tokens: int = Field(
        default=4096, ge=1, description="OpenAI replies when the request sets no cap"
    )
    embedding_dimensions: int = Field(default=DEFAULT_EMBEDDING_DIMENSIONS, ge=1, le=8192)
    cache_capacity: int = Field(
        default=4096, ge=0, description="prompt-prefix LRU entries (0 disables caching)"
    )
    cache_min_tokens: int = Field(
        default=1024,
        ge=0,
        description="shorter prefixes are never cached: 1024 as on OpenAI and Claude Sonnet/Opus "
        "(Claude Haiku: 2048); see worker.simulator.caching",
    )
    lossy_summary: bool = Field(
        default=False,
        description="compaction prompts (transcript in <untrusted-data>) get a content-free summary",
    )
    batch_delay_seconds: float = Field(
        default=0.5, ge=0, description="how long a batch takes, from creation to ended"
    )
    batch_expire: bool = Field(
        default=False,
        description="batches end expired, with results for only the first batch_expire_share of requests",
    )
    batch_fail: str | None = Field(
        default=None,
        max_length=100,
        description="OpenAI batches end 'failed' with this error code (token_limit_exceeded, say), running "
        "none of their requests, as OpenAI fails a batch past the organisation's queued-token limit",
    )
    batch_expire_share: float = Field(
        default=0.5, ge=0, le=1, description="the share of an expiring batch's requests that it answers"
    )
    batch_results_hold_seconds: float = Field(
        default=0.0,
        ge=0,
        description="an ended batch's results (OpenAI output files, Anthropic results) are answered only "
        "after this long: a poller killed meanwhile has seen the batch end but committed nothing",
    )
    batch_garbled_lines: int = Field(
        default=0,
        ge=0,
        description="the first N lines of an ended batch's results (OpenAI's output file, Anthropic's "
        "results) are cut in half (not JSON): a provider's corrupt result file",
    )
    batch_create_hold_seconds: float = Field(
        default=0.0,
        ge=0,
        description="a batch create is stored at once but answered only after this long: a client killed "
        "meanwhile has had its batch accepted without learning its id",
    )
    batch_results_gone: list[str] = Field(
        default_factory=list,
        description="these ended (Anthropic) batches answer 404 for their results, as Anthropic does past "
        "the 29 days it keeps them (or for another tool's batch whose results were deleted)",
    )
    batch_delete_fails: bool = Field(
        default=False,
        description="deleting a batch's copy (OpenAI: a file; Anthropic: a batch) answers 500: an outage "
        "at the moment Factmill deletes the pages' text it sent",
    )
    batch_cancel_fails: bool = Field(
        default=False,
        description="cancelling a batch answers 400, as a provider does for a batch that ended meanwhile",
    )
    raw_replies: dict[str, Any] = Field(
        default_factory=dict,
        description="route (chat.completions, messages, embeddings) → a JSON body answered (raw_status) "
        "instead of the simulator's own reply: the odd shapes some OpenAI-compatible servers send",
    )
    raw_status: int = Field(
        default=200, ge=200, le=599, description="the HTTP status raw_replies are answered with"
    )
    model: str = SIMULATOR_MODEL
    embedding_model: str = SIMULATOR_EMBEDDING_MODEL

    @model_validator(mode="after")
    def _rates_fit(self) -> Self:
        total = sum(self.fault_rates().values())
        if total > 1.0 + 1e-9:
            raise ValueError(f"fault rates add up to {total:.3f}; they must add up to at most 1")
        return self

    def fault_rates(self) -> dict[Fault, float]:
        return {
            Fault.RATE_LIMIT: self.rate_429,
            Fault.SERVER_ERROR: self.rate_500,
            Fault.OVERLOADED: self.rate_529,
            Fault.TIMEOUT: self.rate_timeout,
            Fault.MALFORMED: self.rate_malformed,
            Fault.TRUNCATED: self.rate_truncated,
            Fault.REFUSAL: self.rate_refusal,
        }

    def fault_for(self, roll: float) -> Fault | None:
        """The fault a uniform draw in [0, 1) lands on when the rates are laid end to end in FAULT_ORDER."""
        rates = self.fault_rates()
        cumulative = 0.0
        for candidate in FAULT_ORDER:
            cumulative += rates[candidate]
            if roll < cumulative:
                return candidate
        return None

    @classmethod
    def with_error_rate(cls, error_rate: float, **overrides: Any) -> SimulatorConfig:
        """A config whose total fault rate is `error_rate`, spread evenly over every fault class."""
        if not 0.0 <= error_rate <= 1.0:
            raise ValueError("error_rate must be between 0 and 1")
        share = error_rate / len(FAULT_ORDER)
        rates = {f"rate_{fault.value}": share for fault in FAULT_ORDER}
        return cls(**{**rates, **overrides})


def config_from_cli(
    *,
    latency_ms: float = 0.0,
    jitter_ms: float = 0.0,
    error_rate: float = 0.0,
    seed: int = 0,
    hang_seconds: float | None = None,
) -> SimulatorConfig:
    """The config behind `factmill simulator` and `python -m worker.simulator`: error_rate is spread
    evenly over every fault class; the timeout fault holds a request ``hang_seconds`` (None:
    COMMAND_HANG_SECONDS)."""
    hang = COMMAND_HANG_SECONDS if hang_seconds is None else hang_seconds
    return SimulatorConfig.with_error_rate(
        error_rate, latency_ms=latency_ms, jitter_ms=jitter_ms, seed=seed, hang_seconds=hang
    )


# The timeout fault's hold when the simulator runs alone: past the gateway's default timeout (60 s), so
# a run with --error-rate meets timeouts its client sees (the config's 30 s answered each before the
# client gave up, and the simulator's stats counted a timeout no client had).
COMMAND_HANG_SECONDS = 75.0


@dataclass(frozen=True)
class Draw:
    """What the seeded streams decided for one request: its fault (if any) and its latency."""

    fault: Fault | None
    delay_seconds: float


class SeededDraws:
    """The two seeded random streams behind every request. Not thread-safe: the caller holds a lock."""

    def __init__(self, seed: int) -> None:
        self._fault_rng = random.Random(seed)
        # A separate stream so changing the jitter never changes which requests fail.
        self._jitter_rng = random.Random(seed * 7919 + 104729)

    def next(self, jitter_ms: float) -> tuple[float, float]:
        """(a uniform roll in [0, 1) for the fault, the extra latency in ms), one step of each stream."""
        return self._fault_rng.random(), self._jitter_rng.random() * jitter_ms
