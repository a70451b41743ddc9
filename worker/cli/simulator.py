"""`factmill simulator`: run the LLM simulator (a test double of the OpenAI and Anthropic APIs)."""

from __future__ import annotations

from typing import Annotated

import typer

from worker.cli.console import err, is_loopback, port_option, styled


def simulator(
    port: Annotated[int, port_option(help="Port to listen on.")] = 8089,
    host: Annotated[str, typer.Option()] = "127.0.0.1",
    latency_ms: Annotated[int, typer.Option(min=0)] = 0,
    jitter_ms: Annotated[int, typer.Option(min=0)] = 0,
    error_rate: Annotated[float, typer.Option(min=0.0, max=1.0, help="Spread over every fault class.")] = 0.0,
    seed: Annotated[int, typer.Option()] = 0,
    hang_seconds: Annotated[
        float | None,
        typer.Option(
            min=0.0,
            help="How long the timeout fault holds a request before it answers: past the client's "
            "timeout (FACTMILL_LLM_TIMEOUT_SECONDS, 60 by default) to be one. Default 75.",
            show_default=False,
        ),
    ] = None,
) -> None:
    """Run the LLM simulator (OpenAI and Anthropic wire formats; not a real model)."""
    # Imported here, not at the top: the simulator is a test double that the production commands
    # (serve, worker, extract...) must never load.
    from worker.simulator import serve
    from worker.simulator.config import config_from_cli

    config = config_from_cli(
        latency_ms=latency_ms,
        jitter_ms=jitter_ms,
        error_rate=error_rate,
        seed=seed,
        hang_seconds=hang_seconds,
    )
    err.print(f"LLM simulator (not a real model) on http://{host}:{port}/v1")
    if not is_loopback(host):  # no key is asked of anyone: it is a test double
        message = (
            f"the simulator on {host or 'every address'} answers anyone who reaches it: the prompts it was "
            "sent (page text) are readable at /_simulator/requests, and its faults can be set by anyone; "
            "listen on 127.0.0.1 unless the network is yours"
        )
        err.print(styled(("warning:", "yellow"), f" {message}"), highlight=False)
    serve(config, host=host, port=port)
