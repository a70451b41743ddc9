"""Production mode refuses short and shared secrets, with one clear line and no traceback."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

from worker.cli.app import app as cli
from worker.settings import InsecureSecretsError, Settings

STRONG = "w" * 32
OTHER = "a" * 32


def production(**values: str) -> Settings:
    return Settings(environment="production", **({"webhook_secret": STRONG, "admin_token": OTHER} | values))


def test_production_accepts_two_distinct_secrets_of_32_bytes() -> None:
    production().check_production_secrets()


@pytest.mark.parametrize(
    ("values", "says"),
    [
        ({"webhook_secret": "x"}, "FACTMILL_WEBHOOK_SECRET is 1 bytes; production needs at least 32"),
        ({"admin_token": "y" * 31}, "FACTMILL_ADMIN_TOKEN is 31 bytes"),
        ({"admin_token": STRONG}, "are the same value"),
        ({"webhook_secret": "dev-secret"}, "placeholder"),
    ],
)
def test_production_refuses_weak_or_shared_secrets(values: dict[str, str], says: str) -> None:
    with pytest.raises(InsecureSecretsError, match=says):
        production(**values).check_production_secrets()


def test_development_keeps_its_short_defaults() -> None:
    Settings(environment="development", webhook_secret="x", admin_token="x").check_production_secrets()


@pytest.mark.parametrize("command", ["serve", "worker", "beat"])
def test_services_refuse_weak_secrets_with_one_line(monkeypatch: pytest.MonkeyPatch, command: str) -> None:
    from worker.settings import get_settings

    monkeypatch.setenv("FACTMILL_ENVIRONMENT", "production")
    monkeypatch.setenv("FACTMILL_WEBHOOK_SECRET", STRONG)
    monkeypatch.setenv("FACTMILL_ADMIN_TOKEN", STRONG)
    get_settings.cache_clear()
    try:
        result = CliRunner().invoke(cli, [command])
    finally:
        get_settings.cache_clear()
    assert result.exit_code == 2, result.output
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert len(lines) == 1 and "are the same value" in lines[0]
    assert "Traceback" not in result.output
