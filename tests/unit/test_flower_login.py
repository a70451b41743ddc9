"""`factmill flower` beyond this host: refused in production without a login, warned about otherwise."""

from __future__ import annotations

import pytest
import typer

from worker.cli.services import is_loopback, refuse_open_flower
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
    refuse_open_flower(Settings(environment="production", FLOWER_BASIC_AUTH="ops:pw"), "0.0.0.0")
    refuse_open_flower(Settings(environment="production", FLOWER_AUTH=r".*@example\.com"), "0.0.0.0")
    capsys.readouterr()
    refuse_open_flower(Settings(environment="development"), "0.0.0.0")  # warned, not refused
    assert "warning: Flower on 0.0.0.0 would show every task" in capsys.readouterr().err
