"""The service commands fail with one line, never a traceback: a data folder they cannot use, a port
another process holds."""

from __future__ import annotations

import os
import socket
import subprocess
from pathlib import Path

import pytest

from tests.e2e.test_cli import factmill


def run(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    return factmill(list(args), env)


def clean_env(database_url: str, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("FACTMILL_")}
    return {**env, "FACTMILL_DATABASE_URL": database_url, **extra}


@pytest.mark.parametrize(
    ("args", "said"),
    [
        (["beat"], "error: cannot use {folder}: Not a directory"),
        (["worker", "--processes", "1"], "error: cannot use {folder}/redis for the embedded Redis"),
        (["flower"], "error: cannot use {folder}/redis for the embedded Redis"),
    ],
    ids=["beat", "worker", "flower"],
)
def test_a_data_folder_that_cannot_be_used_is_one_line(
    database_url: str, tmp_path: Path, args: list[str], said: str
) -> None:
    """beat's own folder and the embedded Redis (started where Celery resolves the broker) ended in a
    traceback."""
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    folder = blocker / "var"  # under a file: no folder can be made there, whoever runs the test
    result = run(clean_env(database_url, FACTMILL_DATA_DIR=str(folder)), *args)
    assert result.returncode == 1, result.stderr
    assert said.format(folder=folder) in result.stderr and "Traceback" not in result.stderr


def test_a_port_in_use_is_one_line(database_url: str, broker_url: str) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = run(clean_env(database_url, FACTMILL_BROKER_URL=broker_url), "flower", "--port", str(port))
    assert result.returncode == 1, result.stderr
    assert "another process listens there; choose another --port" in result.stderr
    assert "Traceback" not in result.stderr
