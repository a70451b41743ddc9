"""Two trees through bench/pipeline.py, alternating: the way to compare a change on a noisy machine.

    .venv/bin/python bench/ab.py --base REV [--rounds 4] -- --pages 400 --segments 8 --latency-ms 100 ...

Checks REV out into a temporary git worktree, then runs each tree's own bench/pipeline.py (with this
venv's Python, so both use the same packages) base, HEAD, base, HEAD, ... with the arguments after
``--``. Prints each run's segments/s, share of ideal and worker CPU a segment, then the medians and
HEAD's ratio to base. Runs alternate because these machines drift by tens of percent within minutes;
only runs taken back to back compare. The work tree under test is this checkout, uncommitted changes
included. The worktree is removed at the end.
"""

from __future__ import annotations

import argparse
import re
import signal
import statistics
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
FIGURES = {
    "segments_per_s": re.compile(r"^pipeline: ([\d.]+) segments/s", re.M),
    "of_ideal": re.compile(r"^\s+vs ideal .*: ([\d.]+)$", re.M),
    "worker_ms": re.compile(r"^worker CPU: ([\d.]+) ms per ok segment", re.M),
    "postgres_ms": re.compile(r"^\s+the rest of the machine per ok segment: postgres ([\d.]+) ms", re.M),
}


@dataclass
class Run:
    tree: str
    figures: dict[str, float]


def run_pipeline(root: Path, args: list[str]) -> dict[str, float]:
    """One bench/pipeline.py run from ``root``; its figures, or SystemExit with its output."""
    done = subprocess.run(
        [sys.executable, "bench/pipeline.py", *args], cwd=root, capture_output=True, text=True, check=False
    )
    if done.returncode != 0:  # a partial run's figures are not the same work as the other tree's
        raise SystemExit(
            f"bench/pipeline.py in {root} failed (exit {done.returncode}):\n"
            f"{done.stdout[-2000:]}\n{done.stderr[-2000:]}"
        )
    figures = {}
    for name, pattern in FIGURES.items():
        found = pattern.search(done.stdout)
        if found is None:
            raise SystemExit(
                f"bench/pipeline.py in {root} printed no {name} (exit {done.returncode}):\n"
                f"{done.stdout[-2000:]}\n{done.stderr[-2000:]}"
            )
        figures[name] = float(found.group(1))
    return figures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--base", required=True, help="the revision to compare with")
    parser.add_argument("--rounds", type=int, default=4, help="runs of each tree")
    parser.add_argument("pipeline_args", nargs=argparse.REMAINDER, help="after --: pipeline.py's arguments")
    args = parser.parse_args()
    pipeline_args = [a for a in args.pipeline_args if a != "--"]
    base_rev = subprocess.run(
        ["git", "rev-parse", "--short", args.base], cwd=REPO, capture_output=True, text=True, check=True
    ).stdout.strip()
    with tempfile.TemporaryDirectory(prefix="factmill-ab-") as scratch:
        base_root = Path(scratch) / "base"
        subprocess.run(
            ["git", "worktree", "add", "--detach", "--quiet", str(base_root), base_rev], cwd=REPO, check=True
        )
        try:
            print(f"bench/ab.py: base {base_rev} against this checkout, {args.rounds} rounds of")
            print(f"  bench/pipeline.py {' '.join(pipeline_args)}")
            runs: list[Run] = []
            for number in range(1, args.rounds + 1):
                for tree, root in (("base", base_root), ("HEAD", REPO)):
                    figures = run_pipeline(root, pipeline_args)
                    runs.append(Run(tree, figures))
                    print(
                        f"  round {number} {tree:<4}  {figures['segments_per_s']:8.1f} segments/s"
                        f"  {figures['of_ideal']:5.2f} of ideal  {figures['worker_ms']:6.2f} ms a segment"
                        f" (Postgres {figures['postgres_ms']:.2f} ms)",
                        flush=True,
                    )
        finally:
            subprocess.run(["git", "worktree", "remove", "--force", str(base_root)], cwd=REPO, check=False)
    print("medians:")
    medians = {}
    for tree in ("base", "HEAD"):
        mine = [run.figures for run in runs if run.tree == tree]
        medians[tree] = {name: statistics.median(f[name] for f in mine) for name in FIGURES}
        m = medians[tree]
        print(
            f"  {tree:<4}  {m['segments_per_s']:8.1f} segments/s  {m['of_ideal']:5.2f} of ideal"
            f"  {m['worker_ms']:6.2f} ms a segment (Postgres {m['postgres_ms']:.2f} ms)"
        )
    ratio = {name: medians["HEAD"][name] / medians["base"][name] for name in FIGURES}
    print(
        f"  HEAD / base: segments/s {ratio['segments_per_s']:.2f}x, worker CPU a segment "
        f"{ratio['worker_ms']:.2f}x, Postgres CPU a segment {ratio['postgres_ms']:.2f}x (below 1 is cheaper)"
    )


if __name__ == "__main__":
    # As Ctrl-C: a SIGTERM or SIGHUP (a `timeout`, a closed terminal) still removes the worktree.
    for number in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(number, signal.default_int_handler)
    main()
