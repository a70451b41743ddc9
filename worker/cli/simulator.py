"""`factmill simulator`: run the LLM simulator (a test double of the OpenAI and Anthropic APIs)."""

from __future__ import annotations

from typing import Annotated

import typer

from worker.cli.console import err, port_option


def simulator(
    port: Annotated[int, port_option(help="Port to listen on.")] = 8089,
    host: Annotated[str, typer.Option()] = "127.0.0.1",
    latency_ms: Annotated[int, typer.Option(min=0)] = 0,
    jitter_ms: Annotated[int, typer.Option(min=0)] = 0,
    error_rate: Annotated[float, typer.Option(min=0.0, max=1.0, help="Spread over every fault class.")] = 0.0,
    seed: Annotated[int, typer.Option()] = 0,
) -> None:
    """Run the LLM simulator (OpenAI and Anthropic wire formats; not a real model)."""
    # Imported here, not at the top: the simulator is a test double that the production commands
    # (serve, worker, extract...) must never load.
    from worker.simulator import SimulatorConfig, serve

    config = SimulatorConfig.with_error_rate(
        error_rate, latency_ms=latency_ms, jitter_ms=jitter_ms, seed=seed
    )
    err.print(f"LLM simulator (not a real model) on http://{host}:{port}/v1")
    serve(config, host=host, port=port)
