"""Every benchmark still starts: each one's `--help` runs its imports (a name moved from one module to
another left bench/one_statement.py failing at import, unseen until someone ran it)."""

from __future__ import annotations

import json
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


# One size each below what the bench's figures need; each used to fill a database, then fail on an
# empty sample (or print a slope of one point).
TOO_SMALL = {
    "budget.py": ["--writes", "5"],
    "ledger_retention.py": ["--calls", "100"],
    "page_list.py": ["--pages", "150"],
    "transcript_list.py": ["--transcripts", "10"],
    "quality.py": ["--max-tokens", "2000"],
    "gateway.py": ["--latency-ms", "0"],  # divided by
    "metrics.py": ["--rows", "50"],  # a foreign key failed after the fill
    "search.py": ["--expansion-queries", "0"],  # queries[-0:] ran every query
}
REFUSE_ALL = """
import contextlib, io, json, runpy, sys
codes = {}
for path, *args in json.loads(sys.argv[1]):
    sys.argv = [path, *args]
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            runpy.run_path(path, run_name="__main__")
        codes[path] = [None, err.getvalue()]
    except SystemExit as exc:
        codes[path] = [exc.code, err.getvalue()]
print(json.dumps(codes))
"""


def test_benchmarks_refuse_a_size_their_figures_cannot_come_from() -> None:
    runs = [[str(BENCH / name), *args] for name, args in TOO_SMALL.items()]
    done = subprocess.run(
        [sys.executable, "-c", REFUSE_ALL, json.dumps(runs)],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=BENCH.parent,
        env={**os.environ, "PYTHONPATH": f"{BENCH}:{BENCH.parent}"},
    )
    assert done.returncode == 0, done.stderr[-2000:]
    codes = json.loads(done.stdout.strip().splitlines()[-1])
    for path, (code, err) in codes.items():
        assert code == 2, (path, code, err[-500:])
        assert "must be at least" in err or "is below" in err, (path, err[-500:])


def test_every_benchmark_that_holds_services_or_a_database_cleans_up_on_sigterm() -> None:
    """A benchmark killed by `timeout` or a closed terminal (SIGTERM, SIGHUP) never ran its ``finally``
    blocks: the simulator, API and workers it started in sessions of their own kept running, and its
    database was never dropped. Each such script's main turns those signals into Ctrl-C."""
    holding = []
    for path in sorted(BENCH.glob("*.py")):
        text = path.read_text()
        if not any(name in text for name in ("fresh_database", "migrated_database", "spawn(", "worktree")):
            continue
        holding.append(path.name)
        main = text.partition('if __name__ == "__main__":')[2]
        assert "stop_cleanly_on_termination()" in main or "default_int_handler" in main, path.name
    assert len(holding) > 10, holding  # the check reached the benches it is for
