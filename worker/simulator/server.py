"""The simulator's HTTP server: the ASGI app and its routes, `Simulator` on a background thread, the CLI.

The real `openai` and `anthropic` SDKs talk to it over HTTP, so the demo, the tests and the benchmarks
exercise the same client path production uses. It never pretends to be a real model: every response
carries `x-factmill-simulator: true`, ids and fingerprints start with `sim-`, and it advertises the
model `simulator-1`. What it answers comes from `worker.simulator.replies` (pure, deterministic).
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import socket
import threading
import time
from collections.abc import Sequence
from typing import Any

import uvicorn
from pydantic import ValidationError
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from worker.simulator import anthropic_batches, anthropic_wire, openai_batches, openai_wire
from worker.simulator.config import SIMULATOR_HEADER, SimulatorConfig, config_from_cli
from worker.simulator.state import SimulatorState, state_of
from worker.simulator.wire import BadRequest, read_json

logger = logging.getLogger(__name__)


# Longer than the SDKs' pools keep an idle connection (httpx: 5 s), so the client always retires one
# first; at uvicorn's own 5 s a call could be sent on a connection the simulator was closing, and reset.
KEEP_ALIVE_SECONDS = 30


class _SimulatorHeaderMiddleware:
    """Stamps `x-factmill-simulator: true` on every response, 404s included (pure ASGI: no body buffering)."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def send_with_header(message: Message) -> None:
            if message["type"] == "http.response.start":
                headers = list(message.get("headers", []))
                headers.append((SIMULATOR_HEADER.encode(), b"true"))
                message = {**message, "headers": headers}
            await send(message)

        await self.app(scope, receive, send_with_header)


async def list_models(request: Request) -> Response:
    """GET /v1/models: one list both SDKs can parse (each ignores the other's fields)."""
    config = state_of(request).config
    created = 1_700_000_000
    data = [
        {
            "id": name,
            "object": "model",
            "type": "model",
            "created": created,
            "created_at": "2023-11-14T22:13:20Z",
            "owned_by": "factmill-simulator",
            "display_name": f"{name} (Factmill LLM simulator)",
        }
        for name in dict.fromkeys([config.model, config.embedding_model])
    ]
    return JSONResponse(
        {
            "object": "list",
            "data": data,
            "has_more": False,
            "first_id": data[0]["id"],
            "last_id": data[-1]["id"],
        }
    )


async def stats_route(request: Request) -> Response:
    return JSONResponse(state_of(request).snapshot())


async def requests_route(request: Request) -> Response:
    """The newest chat prompts as the simulator flattened them (role + text per message), oldest first."""
    return JSONResponse({"simulator": True, "requests": state_of(request).recent_requests()})


async def config_route(request: Request) -> Response:
    state = state_of(request)
    if request.method == "GET":
        return JSONResponse(state.config.model_dump())
    try:
        body = await read_json(request)
        return JSONResponse(state.update_config(body).model_dump())
    except BadRequest as exc:
        return JSONResponse(
            {"error": {"message": exc.message, "type": "invalid_request_error"}}, status_code=400
        )
    except (ValidationError, ValueError, TypeError) as exc:
        message = f"Invalid simulator config: {exc}"
        return JSONResponse({"error": {"message": message, "type": "invalid_request_error"}}, status_code=400)


async def reset_route(request: Request) -> Response:
    state_of(request).reset()
    return JSONResponse({"reset": True})


async def health_route(request: Request) -> Response:
    return JSONResponse({"ok": True, "simulator": True})


def create_app(config: SimulatorConfig | None = None) -> Starlette:
    """The simulator as an ASGI app; its state is at `app.state.simulator` (a SimulatorState)."""
    app = Starlette(
        routes=[
            Route("/v1/chat/completions", openai_wire.chat_completions, methods=["POST"]),
            Route("/v1/messages", anthropic_wire.messages_route, methods=["POST"]),
            Route("/v1/messages/count_tokens", anthropic_wire.count_tokens_route, methods=["POST"]),
            Route("/v1/embeddings", openai_wire.embeddings, methods=["POST"]),
            Route("/v1/models", list_models, methods=["GET"]),
            Route("/v1/files", openai_batches.upload_file, methods=["POST"]),
            Route("/v1/files", openai_batches.list_files, methods=["GET"]),
            Route("/v1/files/{file_id}/content", openai_batches.file_content, methods=["GET"]),
            Route("/v1/files/{file_id}", openai_batches.delete_file, methods=["DELETE"]),
            Route("/v1/batches", openai_batches.create_batch, methods=["POST"]),
            Route("/v1/batches", openai_batches.list_batches, methods=["GET"]),
            Route("/v1/batches/{batch_id}", openai_batches.retrieve_batch, methods=["GET"]),
            Route("/v1/batches/{batch_id}/cancel", openai_batches.cancel_batch, methods=["POST"]),
            Route("/v1/messages/batches", anthropic_batches.create_batch, methods=["POST"]),
            Route("/v1/messages/batches", anthropic_batches.list_batches, methods=["GET"]),
            Route("/v1/messages/batches/{batch_id}", anthropic_batches.retrieve_batch, methods=["GET"]),
            Route("/v1/messages/batches/{batch_id}", anthropic_batches.delete_batch, methods=["DELETE"]),
            Route("/v1/messages/batches/{batch_id}/cancel", anthropic_batches.cancel_batch, methods=["POST"]),
            Route(
                "/v1/messages/batches/{batch_id}/results", anthropic_batches.batch_results, methods=["GET"]
            ),
            Route("/_simulator/stats", stats_route, methods=["GET"]),
            Route("/_simulator/requests", requests_route, methods=["GET"]),
            Route("/_simulator/config", config_route, methods=["GET", "POST"]),
            Route("/_simulator/reset", reset_route, methods=["POST"]),
            Route("/_simulator/health", health_route, methods=["GET"]),
        ],
        middleware=[Middleware(_SimulatorHeaderMiddleware)],
    )
    app.state.simulator = SimulatorState(config or SimulatorConfig())
    return app


# --------------------------------------------------------------------------------------------------
# Running it
# --------------------------------------------------------------------------------------------------


def _url_host(host: str) -> str:
    return f"[{host}]" if ":" in host and not host.startswith("[") else host


THREAD_PREFIX = "llm-simulator:"


def _not_a_simulators_notice(record: logging.LogRecord) -> bool:
    """uvicorn's INFO lines (started, running on, shutting down) from a simulator's thread: in an API's
    or a worker's log they read as a second server of that process's own."""
    return record.levelno >= logging.WARNING or not (record.threadName or "").startswith(THREAD_PREFIX)


class Simulator:
    """The simulator on a background thread, for tests, the demo and benchmarks.

    >>> with Simulator(SimulatorConfig(latency_ms=50)) as sim:
    ...     client = openai.OpenAI(base_url=sim.base_url, api_key="sim", max_retries=0)
    """

    def __init__(self, config: SimulatorConfig | None = None, host: str = "127.0.0.1", port: int = 0) -> None:
        self.host = host
        self._requested_port = port
        self.app = create_app(config)
        self._server: uvicorn.Server | None = None
        self._thread: threading.Thread | None = None
        self._port: int | None = None
        self._socket: socket.socket | None = None

    @property
    def state(self) -> SimulatorState:
        state: SimulatorState = self.app.state.simulator
        return state

    @property
    def config(self) -> SimulatorConfig:
        return self.state.config

    @property
    def port(self) -> int:
        if self._port is None:
            raise RuntimeError("the simulator is not running; call start() first")
        return self._port

    @property
    def url(self) -> str:
        """Root URL, e.g. http://127.0.0.1:PORT."""
        return f"http://{_url_host(self.host)}:{self.port}"

    @property
    def base_url(self) -> str:
        """For `openai.OpenAI(base_url=...)`: the root URL plus /v1."""
        return f"{self.url}/v1"

    @property
    def anthropic_base_url(self) -> str:
        """For `anthropic.Anthropic(base_url=...)`: the root URL (the SDK appends /v1/messages)."""
        return self.url

    def start(self, timeout: float = 10.0) -> Simulator:
        """Serve on a background thread; returns once the socket accepts connections."""
        if self._thread is not None:
            return self
        family = socket.AF_INET6 if ":" in self.host else socket.AF_INET
        # proto=IPPROTO_TCP matters: asyncio only turns Nagle off (TCP_NODELAY) on sockets that say they are
        # TCP, and with Nagle on every response waits ~40 ms for the client's delayed ACK.
        sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        try:
            sock.bind((self.host, self._requested_port))
            # Listening before uvicorn starts means early connections queue instead of being refused.
            sock.listen(2048)
        except OSError:
            sock.close()
            raise
        self._port = sock.getsockname()[1]
        # Inside another process (an API's, a worker's): its logging is that process's. uvicorn's own
        # config, applied here, replaced it for the whole process (unfiltered, non-JSON lines).
        uvicorn_log = logging.getLogger("uvicorn.error")
        if _not_a_simulators_notice not in uvicorn_log.filters:
            uvicorn_log.addFilter(_not_a_simulators_notice)
        config = uvicorn.Config(
            self.app,
            log_config=None,
            log_level=None,
            access_log=False,
            lifespan="off",
            backlog=2048,
            timeout_keep_alive=KEEP_ALIVE_SECONDS,
            timeout_graceful_shutdown=1,
        )
        server = uvicorn.Server(config)
        thread = threading.Thread(
            target=server.run, kwargs={"sockets": [sock]}, name=f"{THREAD_PREFIX}{self._port}", daemon=True
        )
        self._server, self._thread, self._socket = server, thread, sock
        thread.start()
        deadline = time.monotonic() + timeout
        while not server.started:
            if not thread.is_alive() or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"the LLM simulator did not start on {self.host}:{self._port}")
            time.sleep(0.01)
        logger.info("LLM simulator (not a real model) listening on %s", self.url)
        return self

    def stop(self, timeout: float = 10.0) -> None:
        server, thread = self._server, self._thread
        if server is None or thread is None:
            return
        server.should_exit = True
        thread.join(timeout)
        if thread.is_alive():
            server.force_exit = True
            thread.join(timeout)
        if self._socket is not None:
            with contextlib.suppress(OSError):
                self._socket.close()
        self._server, self._thread, self._socket = None, None, None

    def stats(self) -> dict[str, Any]:
        return self.state.snapshot()

    def recent_requests(self) -> list[dict[str, Any]]:
        """The newest chat prompts received (same as GET /_simulator/requests); reset() clears them."""
        return self.state.recent_requests()

    def configure(self, **changes: Any) -> SimulatorConfig:
        """Change knobs at runtime (same as POST /_simulator/config)."""
        return self.state.update_config(changes)

    def end_batches(self) -> int:
        """End every running batch now, as if its time had come (a test's long batch); how many."""
        return self.state.store.end_all()

    def reset(self) -> None:
        """Zero stats, forget cached prefixes, restart the seeded streams (same as POST /_simulator/reset)."""
        self.state.reset()

    def restore(self) -> None:
        """Put back the knobs the simulator started with and reset it (what a test fixture wants)."""
        self.state.restore()

    def __enter__(self) -> Simulator:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.stop()


# On SIGTERM, requests still open (a slow latency setting, a hang fault) get this long, then are cut.
SHUTDOWN_GRACE_SECONDS = 2


def serve(config: SimulatorConfig | None = None, host: str = "127.0.0.1", port: int = 8765) -> None:
    """Run the simulator in the foreground until interrupted (the `factmill simulator` command); on
    SIGTERM it exits within SHUTDOWN_GRACE_SECONDS however long its open requests would still take."""
    config = config or SimulatorConfig()
    logger.warning(
        "Factmill LLM simulator (NOT a real LLM) on http://%s:%s - OpenAI base_url http://%s:%s/v1, "
        "Anthropic base_url http://%s:%s; latency %sms±%sms, fault rates %s, seed %s",
        host,
        port,
        host,
        port,
        host,
        port,
        config.latency_ms,
        config.jitter_ms,
        {f.value: r for f, r in config.fault_rates().items() if r},
        config.seed,
    )
    uvicorn.run(
        create_app(config),
        host=host,
        port=port,
        log_level="info",
        access_log=False,
        timeout_keep_alive=KEEP_ALIVE_SECONDS,
        timeout_graceful_shutdown=SHUTDOWN_GRACE_SECONDS,
    )


def main(argv: Sequence[str] | None = None) -> None:
    """`python -m worker.simulator`: the same knobs as `factmill simulator`."""
    parser = argparse.ArgumentParser(description="Factmill LLM simulator (OpenAI + Anthropic wire formats)")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8765)
    parser.add_argument("--latency-ms", type=float, default=0.0)
    parser.add_argument("--jitter-ms", type=float, default=0.0)
    parser.add_argument(
        "--error-rate", type=float, default=0.0, help="total fault rate, spread over all classes"
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--hang-seconds", type=float, default=None)
    options = vars(parser.parse_args(argv))
    logging.basicConfig(level=logging.INFO)
    # Every option but where to listen is a knob of config_from_cli, under the same name.
    host, port = options.pop("host"), options.pop("port")
    serve(config_from_cli(**options), host, port)
