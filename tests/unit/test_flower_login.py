"""`factmill flower` beyond this host: refused in production without a login, warned about otherwise."""

from __future__ import annotations

import pytest
import typer

from worker.cli.services import flower_logins, is_loopback, refuse_open_flower, worker_queues
from worker.settings import Settings


@pytest.mark.parametrize(
    ("host", "loopback"),
    [("127.0.0.1", True), ("127.0.0.2", True), ("::1", True), ("localhost", True),
     ("0.0.0.0", False), ("::", False), ("", False), ("10.0.0.5", False), ("flower.internal", False)],
)  # fmt: skip
def test_loopback_addresses(host: str, loopback: bool) -> None:
    assert is_loopback(host) is loopback


def test_an_open_flower_is_refused_in_production_unless_it_has_a_login(
    capsys: pytest.CaptureFixture[str],
) -> None:
    production = Settings(environment="production")
    refuse_open_flower(production, "127.0.0.1")  # this host only: no login needed
    with pytest.raises(typer.Exit) as refused:
        refuse_open_flower(production, "0.0.0.0")
    assert refused.value.exit_code == 2
    refuse_open_flower(
        Settings(environment="production", FLOWER_BASIC_AUTH="ops:9f2c1d7e0a4b8c3d"), "0.0.0.0"
    )
    # README's and the compose file's example, copied, was a login anyone could guess.
    for weak, why in (
        ("user:password", "placeholder"),
        ("ops:ops", "placeholder"),
        ("ops:pw", "shorter than 12"),
    ):
        with pytest.raises(typer.Exit) as refused:
            refuse_open_flower(Settings(environment="production", FLOWER_BASIC_AUTH=weak), "0.0.0.0")
        assert refused.value.exit_code == 2 and why in capsys.readouterr().err
    refuse_open_flower(Settings(environment="production", FLOWER_BASIC_AUTH="user:password"), "127.0.0.1")
    refuse_open_flower(Settings(environment="production", FLOWER_AUTH=r".*@example\.com"), "0.0.0.0")
    capsys.readouterr()
    refuse_open_flower(Settings(environment="development"), "0.0.0.0")  # warned, not refused
    assert "warning: Flower on 0.0.0.0 would show every task" in capsys.readouterr().err


def test_a_login_set_in_dotenv_reaches_flower(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Settings read FLOWER_BASIC_AUTH from .env, so the open-Flower check passed, but Flower reads only
    the environment: it started with no login on 0.0.0.0. The login Settings saw is what Flower gets."""
    monkeypatch.delenv("FLOWER_BASIC_AUTH", raising=False)
    monkeypatch.delenv("FLOWER_AUTH", raising=False)
    dotenv = tmp_path / ".env"
    dotenv.write_text("FLOWER_BASIC_AUTH=ops:9f2c1d7e0a4b8c3d\n")
    settings = Settings(_env_file=dotenv)  # type: ignore[call-arg]
    refuse_open_flower(settings.model_copy(update={"environment": "production"}), "0.0.0.0")
    assert flower_logins(settings) == {"FLOWER_BASIC_AUTH": "ops:9f2c1d7e0a4b8c3d"}
    assert flower_logins(Settings(_env_file=None)) == {}  # type: ignore[call-arg]


@pytest.mark.parametrize(
    ("given", "passed"),
    [("extraction", "extraction"), ("extraction, maintenance", "extraction,maintenance"),
     (" compaction ,compaction,", "compaction")],
)  # fmt: skip
def test_worker_queues_are_passed_on_stripped(given: str, passed: str) -> None:
    """Celery splits --queues on commas without stripping: "extraction, maintenance" consumed a queue
    named " maintenance" that nothing is ever sent to."""
    assert worker_queues(given, ["extraction", "compaction", "maintenance"]) == passed


@pytest.mark.parametrize("given", ["extract", " , ", ""])
def test_unknown_or_no_worker_queues_are_refused(given: str) -> None:
    with pytest.raises(ValueError, match="choose from extraction"):
        worker_queues(given, ["extraction"])


def test_the_published_development_secrets_are_refused_beyond_this_host(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """`factmill serve --host 0.0.0.0` (or `mcp --http`) in development took "dev-admin-token", a string
    anyone can read in the source, as the bootstrap admin: every route to whoever reached the port."""
    from worker.cli.services import refuse_published_secrets

    development = Settings(
        environment="development", admin_token="dev-admin-token", webhook_secret="dev-secret"
    )
    refuse_published_secrets(development, "127.0.0.1")  # this host only: fine
    with pytest.raises(typer.Exit) as refused:
        refuse_published_secrets(development, "0.0.0.0")
    assert refused.value.exit_code == 2
    said = capsys.readouterr().err
    assert "FACTMILL_WEBHOOK_SECRET and FACTMILL_ADMIN_TOKEN still hold a published or placeholder" in said
    assert "dev-admin-token" not in said
    own = development.model_copy(update={"admin_token": "a" * 40, "webhook_secret": "w" * 40})
    refuse_published_secrets(own, "0.0.0.0")
    # A rotation away from the default kept the published secret signing pages; "changeme" passed.
    for weak in ({"webhook_previous_secret": "dev-secret"}, {"admin_token": "changeme"}):
        with pytest.raises(typer.Exit):
            refuse_published_secrets(own.model_copy(update=weak), "0.0.0.0")
        assert f"FACTMILL_{next(iter(weak)).upper()} still hold" in capsys.readouterr().err


def test_all_the_queues_by_default() -> None:
    """The default was extraction and maintenance: consolidation (asked for by every extraction),
    compaction and calibration jobs stayed queued for good under `factmill worker` alone."""
    known = ["extraction", "consolidation", "compaction", "calibration", "maintenance"]
    assert worker_queues("all", known) == worker_queues(" ALL ", known) == ",".join(known)


def test_serve_takes_no_more_processes_than_a_worker_does() -> None:
    """`serve --workers` had no bound (`worker --processes` is capped at 64 for that reason): a typo of
    a few zeros forked uvicorn processes until the machine gave out."""
    from typer.testing import CliRunner

    from worker.cli import app

    refused = CliRunner().invoke(app, ["serve", "--workers", "1000"])
    assert refused.exit_code == 2 and "less than or equal to 64" in refused.output


def test_flower_runs_with_its_task_and_offline_worker_bounds() -> None:
    """Flower's defaults kept 100,000 tasks' events (some 300 MB in the manifests' 512Mi pod) and every
    worker KEDA scaled in, listed for good. (That Flower takes these options: tests/integration/
    test_service.py starts it with them; an option it did not know would end it at start.)"""
    from worker.cli.services import flower_argv

    argv = flower_argv("0.0.0.0", 5555)
    assert argv[:3] == ["flower", "--address=0.0.0.0", "--port=5555"]
    assert "--max_tasks=10000" in argv and "--purge_offline_workers=600" in argv
