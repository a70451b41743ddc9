"""How long a `factmill` command takes to start: its own module loaded, against every command's loaded.

    .venv/bin/python bench/cli_startup.py [--runs 7]

Each command below runs as ``python -m worker.cli ARGS`` (what the `factmill` script does) and, as
the baseline, through a launcher that first loads every command of ``worker.cli.app.COMMANDS``, which
is what each command paid while the app imported all of them at start. Runs alternate; prints the
median wall time of each and their ratio. ``--help`` of a command needs no database.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent

COMMANDS = (
    ["--help"],  # the list of commands: their summaries, no command module (worker.cli.app)
    ["jobs", "--help"],
    ["config", "--help"],
    ["db", "--help"],
    ["search", "--help"],
    ["simulator", "--help"],
)
EAGER = (
    "import sys\n"
    "from worker.cli.app import COMMANDS, load_command\n"
    "for entry in COMMANDS:\n"
    "    load_command(entry)\n"
    "sys.argv = ['factmill', *sys.argv[1:]]\n"
    "from worker.cli import main\n"
    "main()\n"
)


def wall(argv: list[str]) -> float:
    started = time.perf_counter()
    subprocess.run(argv, cwd=REPO, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return time.perf_counter() - started


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--runs", type=int, default=7, help="runs of each command, alternating")
    args = parser.parse_args(argv)
    print(f"`factmill COMMAND` start to exit, medians of {args.runs} alternating runs")
    print(f"  {'command':22} {'all loaded (baseline)':>22} {'its own module':>15} {'ratio':>6}")
    for command in COMMANDS:
        eager, lazy = [], []
        for _ in range(args.runs):
            eager.append(wall([sys.executable, "-c", EAGER, *command]))
            lazy.append(wall([sys.executable, "-m", "worker.cli", *command]))
        base, own = statistics.median(eager), statistics.median(lazy)
        print(f"  {' '.join(command):22} {base:20.2f} s {own:13.2f} s {own / base:5.2f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
