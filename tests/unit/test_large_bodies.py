"""The API's gate on large bodies (worker.bodycap): a few at a time per process, small ones not held."""

from __future__ import annotations

import asyncio
from typing import Any

from worker.bodycap import LARGE_BODY_BYTES, BodyCapMiddleware


def _scope(headers: list[tuple[bytes, bytes]]) -> dict[str, Any]:
    return {"type": "http", "method": "POST", "path": "/v1/pages", "headers": headers}


def test_large_bodies_are_handled_a_few_at_a_time_and_small_ones_never_wait() -> None:
    """Ten 25 MiB page bodies read, signed and parsed at once passed an API pod's memory; past the
    gate's two, the others wait with their bodies unread."""
    active: dict[str, int] = {"large": 0, "small": 0}
    most: dict[str, int] = {"large": 0, "small": 0}

    async def app(scope: Any, receive: Any, send: Any) -> None:
        kind = "small" if scope["path"] == "/small" else "large"
        active[kind] += 1
        most[kind] = max(most[kind], active[kind])
        await asyncio.sleep(0.02)
        active[kind] -= 1

    gated = BodyCapMiddleware(app, cap=25 * LARGE_BODY_BYTES, large_at_once=2)

    async def receive() -> dict[str, Any]:
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(message: Any) -> None:
        return None

    big = [(b"content-length", str(2 * LARGE_BODY_BYTES).encode())]
    chunked = [(b"transfer-encoding", b"chunked")]
    small = [(b"content-length", b"100")]

    async def run() -> None:
        calls = [gated(_scope(big), receive, send) for _ in range(5)]
        calls += [gated(_scope(chunked), receive, send) for _ in range(3)]
        calls += [gated({**_scope(small), "path": "/small"}, receive, send) for _ in range(6)]
        await asyncio.gather(*calls)

    asyncio.run(run())
    assert most["large"] == 2, most
    assert most["small"] == 6, "a small body never waits on the large ones"
