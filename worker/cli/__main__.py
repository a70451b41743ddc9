"""`python -m worker.cli`: the `factmill` command (how tests and the demo start service processes)."""

from __future__ import annotations

from worker.cli.app import main

if __name__ == "__main__":
    main()
