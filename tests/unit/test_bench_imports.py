"""Every benchmark still starts: each one's `--help` runs its imports (a name moved from one module to
another left bench/one_statement.py failing at import, unseen until someone ran it)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[2] / "bench"
# One process for them all (imports are shared: seconds, not a minute of interpreter starts).
RUN_ALL = """
import contextlib, io, json, runpy, sys
failed = []
for path in sys.argv[1:]:
    sys.argv = [path, "--help"]
    try:
        with contextlib.redirect_stdout(io.StringIO()):
            runpy.run_path(path, run_name="__main__")
    except SystemExit as exc:
        if exc.code not in (0, None):
            failed.append([path, f"exit {exc.code}"])
    except Exception as exc:
        failed.append([path, repr(exc)])
print(json.dumps(failed))
"""


def test_every_benchmark_answers_help() -> None:
    scripts = sorted(str(path) for path in BENCH.glob("*.py"))
    assert len(scripts) > 20, "no benchmark found: the test would check nothing"
    done = subprocess.run(
        [sys.executable, "-c", RUN_ALL, *scripts],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=BENCH.parent,
        env={**os.environ, "PYTHONPATH": f"{BENCH}:{BENCH.parent}"},
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip().splitlines()[-1] == "[]", done.stdout[-2000:]
