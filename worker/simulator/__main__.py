"""`python -m worker.simulator`: run the LLM simulator in the foreground (see `server.main`)."""

from __future__ import annotations

from worker.simulator.server import main

main()
