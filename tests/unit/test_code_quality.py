"""CONVENTIONS.md made executable: ruff clean everywhere, mypy clean on worker/, tasks/, models/."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent


def run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(args, cwd=REPO, capture_output=True, text=True, timeout=600)


def test_ruff_lint_and_format():
    lint = run(str(BIN / "ruff"), "check", "worker", "tasks", "models", "tests", "bench", "alembic")
    assert lint.returncode == 0, lint.stdout + lint.stderr
    fmt = run(str(BIN / "ruff"), "format", "--check", "worker", "tasks", "models", "tests", "bench")
    assert fmt.returncode == 0, fmt.stdout + fmt.stderr


def test_mypy_on_the_service_code():
    result = run(str(BIN / "mypy"), "worker", "tasks", "models")
    assert result.returncode == 0, result.stdout + result.stderr
