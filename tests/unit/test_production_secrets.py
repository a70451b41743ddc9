"""Production mode refuses short and shared secrets, with one clear line and no traceback."""

from __future__ import annotations

from pathlib import Path

import pytest
from typer.testing import CliRunner

from worker.cli.app import app as cli
from worker.settings import InsecureSecretsError, RefusedSettingsError, Settings

STRONG = "w" * 32
KEY_VARIABLES = (
    "OPENAI_API_KEY",
    "FACTMILL_OPENAI_API_KEY",
    "ANTHROPIC_API_KEY",
    "FACTMILL_ANTHROPIC_API_KEY",
)
OTHER = "a" * 32


@pytest.fixture(autouse=True)
def _no_provider_settings_from_the_shell(monkeypatch: pytest.MonkeyPatch) -> None:
    """A developer's shell may export a key or a provider setting; these tests choose their own."""
    for name in (*KEY_VARIABLES, "FACTMILL_LLM", "FACTMILL_LLM_BASE_URL"):
        monkeypatch.delenv(name, raising=False)


def production(**values: str | None) -> Settings:
    chosen = {
        "webhook_secret": STRONG,
        "admin_token": OTHER,
        "openai_api_key": "sk-test",
        "database_url": "postgresql+psycopg://db.internal/factmill",
        "broker_url": "redis://redis.internal:6379/0",
    } | values
    return Settings(_env_file=None, environment="production", **chosen)  # type: ignore[arg-type]


def test_production_accepts_two_distinct_secrets_of_32_bytes() -> None:
    production().check_production_secrets()


@pytest.mark.parametrize(
    ("values", "says"),
    [
        ({"webhook_secret": "x"}, "FACTMILL_WEBHOOK_SECRET is 1 bytes; production needs at least 32"),
        ({"admin_token": "y" * 31}, "FACTMILL_ADMIN_TOKEN is 31 bytes"),
        ({"admin_token": STRONG}, "are the same value"),
        ({"webhook_secret": "dev-secret"}, "placeholder"),
        # The previous secret, accepted while the secret is rotated, is held to the same rules.
        ({"webhook_previous_secret": "z" * 31}, "FACTMILL_WEBHOOK_PREVIOUS_SECRET is 31 bytes"),
        ({"webhook_previous_secret": "changeme"}, "FACTMILL_WEBHOOK_PREVIOUS_SECRET is a placeholder"),
        ({"webhook_previous_secret": OTHER}, "are the same value"),
    ],
)
def test_production_refuses_weak_or_shared_secrets(values: dict[str, str], says: str) -> None:
    with pytest.raises(InsecureSecretsError, match=says):
        production(**values).check_production_secrets()


def test_development_keeps_its_short_defaults() -> None:
    Settings(environment="development", webhook_secret="x", admin_token="x").check_production_secrets()


def test_a_test_environment_refuses_placeholders_and_keeps_the_rest_lax() -> None:
    """Placeholders are refused outside development (the conventions' rule): "test" took none of the
    checks, so a shared test deployment answered anyone who read the published defaults."""
    lax = {"_env_file": None, "environment": "test", "webhook_secret": "x" * 8, "admin_token": "y" * 8}
    Settings(**lax).check_production_secrets()  # short, no servers, the simulator: not production
    for placeholder in ("dev-admin-token", "Dev-" + "s" * 40, "CHANGEME"):
        with pytest.raises(InsecureSecretsError, match=r"placeholder; .* FACTMILL_ENVIRONMENT=test"):
            Settings(**lax | {"admin_token": placeholder}).check_production_secrets()
    with pytest.raises(InsecureSecretsError, match="FACTMILL_WEBHOOK_SECRET is a placeholder"):
        production(webhook_secret="DEV-" + "s" * 40).check_production_secrets()  # 44 bytes, guessable


def test_the_api_refuses_weak_secrets_with_one_line(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FACTMILL_ENVIRONMENT", "production")
    monkeypatch.setenv("FACTMILL_WEBHOOK_SECRET", STRONG)
    monkeypatch.setenv("FACTMILL_ADMIN_TOKEN", STRONG)
    lines = refused_lines("serve")
    assert len(lines) == 1 and "are the same value" in lines[0]


@pytest.mark.parametrize("command", ["worker", "beat"])
def test_workers_and_beat_do_not_need_the_apis_secrets(monkeypatch: pytest.MonkeyPatch, command: str) -> None:
    """Neither reads the webhook secrets or the admin token, yet both refused to start without them: the
    bootstrap admin credential had to be in every pod (a compromised worker, one full API admin)."""
    monkeypatch.setenv("FACTMILL_ENVIRONMENT", "production")
    for name in ("FACTMILL_WEBHOOK_SECRET", "FACTMILL_ADMIN_TOKEN"):
        monkeypatch.delenv(name, raising=False)  # the placeholders (dev-secret, dev-admin-token)
    lines = refused_lines(command)  # what it still refuses here (no model chosen, no servers): not these
    assert len(lines) == 1 and "placeholder" not in lines[0] and "FACTMILL_" + "WEBHOOK" not in lines[0]
    assert "placeholder" in refused_lines("serve")[0]  # the API, which reads them, still refuses them
    assert (
        production(webhook_secret="dev-secret", admin_token="dev-admin-token").check_service_settings(
            runs_jobs=True, holds_secrets=False
        )
        is None
    )
    with pytest.raises(InsecureSecretsError, match="placeholder"):
        production(webhook_secret="dev-secret").check_service_settings(runs_jobs=True)


def refused_lines(command: str) -> list[str]:
    """The lines a service command printed as it refused to start (exit 2), settings read afresh."""
    from worker.settings import get_settings

    get_settings.cache_clear()
    try:
        result = CliRunner().invoke(cli, [command])
    finally:
        get_settings.cache_clear()
    assert result.exit_code == 2, result.output
    assert "Traceback" not in result.output
    return [line for line in result.output.splitlines() if line.strip()]


def test_production_needs_a_model_or_the_simulator_named() -> None:
    """With no API key the workers fell back to the simulator: a key missing from the deployment's
    secrets stored the simulator's guesses as production facts."""
    with pytest.raises(InsecureSecretsError, match="no LLM API key: set OPENAI_API_KEY or ANTHROPIC_API_KEY"):
        production(openai_api_key=None).check_production_secrets()
    production(openai_api_key=None, llm="simulator").check_production_secrets()  # on purpose
    production(openai_api_key=None, anthropic_api_key="sk-ant-test").check_production_secrets()
    Settings(_env_file=None, environment="development").check_production_secrets()  # the demo's default
    production(openai_api_key=None).check_production_secrets(calls_models=False)  # beat: schedules only


@pytest.mark.parametrize("name", ["database_url", "broker_url"])
def test_production_refuses_to_start_an_embedded_server_of_its_own(name: str) -> None:
    """A Secret missing FACTMILL_BROKER_URL (envFrom skips a missing key): each pod started its own
    Redis, the API queued jobs no worker read, and /readyz said ok."""
    with pytest.raises(RefusedSettingsError, match=f"FACTMILL_{name.upper()} is not set: production runs"):
        production(**{name: None}).check_service_settings(calls_models=False)


@pytest.mark.parametrize(
    ("values", "says"),
    [
        ({"llm": "openai", "openai_api_key": None}, "FACTMILL_LLM=openai needs OPENAI_API_KEY"),
        ({"llm": "anthropic"}, "FACTMILL_LLM=anthropic needs ANTHROPIC_API_KEY"),
        ({"llm": "openai-compatible"}, "FACTMILL_LLM=openai-compatible needs FACTMILL_LLM_BASE_URL"),
    ],
)
def test_a_service_that_calls_a_model_refuses_a_provider_missing_its_key(
    values: dict[str, str], says: str
) -> None:
    """Such a worker started, passed its health checks, and failed every job after its retries: the
    first call was where the gateway found the key missing. In any environment; beat calls no model."""
    for settings in (production(**values), Settings(_env_file=None, **values)):  # type: ignore[arg-type]
        with pytest.raises(RefusedSettingsError, match=says):
            settings.check_service_settings(runs_jobs=True)
        settings.check_service_settings()  # the API and the MCP server: their search goes on lexically


def test_an_empty_variable_is_an_unset_one(monkeypatch: pytest.MonkeyPatch) -> None:
    """compose's `FACTMILL_LLM: ${FACTMILL_LLM:-}` passed "" through: every container refused it as no
    provider (and an empty FACTMILL_LLM_MODEL was sent to the provider as the model)."""
    for name in ("FACTMILL_LLM", "FACTMILL_LLM_MODEL", "OPENAI_API_KEY"):
        monkeypatch.setenv(name, "")
    settings = Settings(_env_file=None)
    assert settings.llm is None and settings.llm_model is None and settings.openai_api_key is None


def test_no_command_calls_the_simulator_in_production_unless_it_is_named() -> None:
    """The services refuse to start; `factmill extract`, `search`, `compact --now`, `embed` and the MCP
    server assemble their client through the gateway, which refuses the same way."""
    from contextlib import ExitStack

    from worker.core.errors import LLMConfigurationError
    from worker.llm.gateway import provider_client

    with ExitStack() as stack, pytest.raises(LLMConfigurationError, match="no LLM API key"):
        provider_client(production(openai_api_key=None), stack)


def test_no_secret_shows_in_a_repr_of_the_settings() -> None:
    """A traceback's locals, a debugger or a stray log line show Settings by its repr."""
    secrets = {
        "webhook_secret": "w" * 40,
        "webhook_previous_secret": "p" * 40,
        "admin_token": "t" * 40,
        "openai_api_key": "sk-" + "o" * 40,
        "anthropic_api_key": "sk-ant-" + "n" * 40,
        "database_url": "postgresql://factmill:dbpassword@db/factmill",
        "broker_url": "redis://:brokerpassword@redis:6379/0",
        "ratelimit_redis_url": "redis://:ratepassword@redis:6379/1",
        "test_database_url": "postgresql://t:testpassword@db/t",
        "llm_base_url": "https://gateway:llmpassword@llm.example/v1",
        "otel_endpoint": "https://otel:otelpassword@otel.example",
    }
    shown = repr(Settings(**secrets)) + str(Settings(**secrets))
    for value in ("w" * 40, "p" * 40, "t" * 40, "o" * 40, "n" * 40, "password"):
        assert value not in shown


def test_a_worker_refuses_a_provider_missing_its_key_with_one_line(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FACTMILL_LLM", "openai")
    assert refused_lines("worker") == ["error: FACTMILL_LLM=openai needs OPENAI_API_KEY"]


def test_a_worker_refuses_a_stall_limit_shorter_than_a_jobs_wait_on_one_llm_call(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A job shows no progress from one try's start to the next's (the try, then the wait before the
    next): past FACTMILL_TASK_TIME_LIMIT_SECONDS it was taken for stalled and run twice."""
    from typer import Exit

    from worker.cli.services import largest_reply_tokens, refuse_a_stall_limit_below_a_call
    from worker.settings import Settings

    settings = Settings()  # a 1,024-token cap (retried at 2,048), compaction's 4,096, waits of 120 s
    assert largest_reply_tokens(settings, ["extraction"]) == 2048
    assert largest_reply_tokens(settings, ["extraction", "compaction"]) == 4096
    assert largest_reply_tokens(settings, ["consolidation"]) == 2400
    assert largest_reply_tokens(Settings(llm_max_output_tokens=16_384), ["extraction"]) == 16_384
    assert largest_reply_tokens(settings, ["maintenance", "calibration"]) == 0  # no model: no check
    # 4 x 60 s + the 10 s connection + 120 s of waiting before the next try: 250 s.
    refuse_a_stall_limit_below_a_call(Settings(task_time_limit_seconds=251), ["compaction"])
    with pytest.raises(Exit):
        refuse_a_stall_limit_below_a_call(Settings(task_time_limit_seconds=250), ["compaction"])
    refuse_a_stall_limit_below_a_call(Settings(task_time_limit_seconds=60), ["maintenance"])
    # Through the command: one line, exit 2.
    monkeypatch.setenv("FACTMILL_TASK_TIME_LIMIT_SECONDS", "250")
    [line] = refused_lines("worker")
    assert line.startswith(
        "error: FACTMILL_TASK_TIME_LIMIT_SECONDS (250) is not above the longest a job may wait on an LLM "
        "call (250 s"
    )


def test_a_send_in_production_without_a_broker_url_is_refused_not_sent_to_a_redis_of_its_own(
    tmp_path: Path,
) -> None:
    """An operator's `factmill jobs retry` in a container without FACTMILL_BROKER_URL sent the job to an
    embedded Redis there, which no worker read (the services refuse at start; a command did not)."""
    from worker.jobs.celery_app import broker_url

    with pytest.raises(RefusedSettingsError, match="FACTMILL_BROKER_URL is not set: production runs"):
        broker_url(production(broker_url=None, data_dir=str(tmp_path / "var")))
    assert not (tmp_path / "var").exists()  # no embedded server started
    assert broker_url(production()) == "redis://redis.internal:6379/0"


def test_every_production_send_without_a_broker_url_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Refused while Celery read its settings, the first send was; Celery then dropped them, and a second
    send of the process went to its default broker (amqp://guest@localhost; here a port that refuses)."""
    from worker.jobs import sending
    from worker.jobs.celery_app import create_app

    settings = production(broker_url=None, data_dir=str(tmp_path / "var"))
    monkeypatch.setattr(sending, "app", create_app(settings))
    monkeypatch.setattr(sending, "get_settings", lambda: settings, raising=False)
    monkeypatch.setenv("CELERY_BROKER_URL", "redis://127.0.0.1:1/0")  # Celery's own default, read after
    for _ in range(2):
        with pytest.raises(RefusedSettingsError, match="FACTMILL_BROKER_URL is not set"):
            sending.celery_sender("tasks.extraction.extract_page", 1, "extraction")
    assert not (tmp_path / "var").exists()
