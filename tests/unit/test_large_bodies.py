"""The API's gate on large bodies (worker.bodycap): a few at a time per process, small ones not held."""

from __future__ import annotations

import asyncio
from typing import Any

from worker.bodycap import LARGE_BODY_BYTES, SMALL_BODIES_AT_ONCE_BYTES, BodyCapMiddleware


def _scope(headers: list[tuple[bytes, bytes]]) -> dict[str, Any]:
    return {"type": "http", "method": "POST", "path": "/v1/pages", "headers": headers}


async def receive() -> dict[str, Any]:
    """An empty body, at once."""
    return {"type": "http.request", "body": b"", "more_body": False}


async def send(message: Any) -> None:
    return None


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


def test_small_bodies_past_a_byte_budget_wait_for_room() -> None:
    """Only requests over 1 MiB were counted: a sender with a forged signature header (its form and age
    are all that is checked before the body) kept hundreds of bodies just under 1 MiB in memory at once.
    Past SMALL_BODIES_AT_ONCE_BYTES of declared small bodies, the next waits for room (not for a large
    body's place: a 1 KB request waited behind an upload of up to two minutes)."""
    active, most = [0], [0]

    async def app(scope: Any, receive: Any, send: Any) -> None:
        active[0] += 1
        most[0] = max(most[0], active[0])
        await asyncio.sleep(0.02)
        active[0] -= 1

    gated = BodyCapMiddleware(app, cap=25 * LARGE_BODY_BYTES, large_at_once=2)

    under_a_mib = [(b"content-length", str(LARGE_BODY_BYTES).encode())]

    async def run() -> None:
        await asyncio.gather(*(gated(_scope(under_a_mib), receive, send) for _ in range(200)))

    asyncio.run(run())
    assert most[0] == SMALL_BODIES_AT_ONCE_BYTES // LARGE_BODY_BYTES, most  # the budget's worth at once


def test_the_least_rate_counts_from_the_first_read_not_from_the_place_taken(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """The route may wait for a thread (its key checked in the pool) before it reads the body: counted
    from when the place was taken, a fast upload behind a busy pool was refused as too slow."""
    from worker import bodycap

    monkeypatch.setattr(bodycap, "LARGE_BODY_GRACE_SECONDS", 0.1)
    read: list[int] = []

    async def app(scope: Any, receive: Any, send: Any) -> None:
        await asyncio.sleep(0.3)  # waiting for a thread, past the grace
        while True:
            message = await receive()
            read.append(len(message.get("body", b"")))
            if not message.get("more_body"):
                return

    chunks = [b"x" * (64 * 1024)] * 32  # 2 MiB, at once

    async def receive() -> dict[str, Any]:
        await asyncio.sleep(0)  # the network: a point where a deadline passed is noticed
        body = chunks.pop() if chunks else b""
        return {"type": "http.request", "body": body, "more_body": bool(chunks)}

    async def send(message: Any) -> None:
        return None

    gated = BodyCapMiddleware(
        app, cap=25 * LARGE_BODY_BYTES, large_at_once=1, large_body_seconds=60, large_body_min_rate=1024
    )
    big = [(b"content-length", str(2 * LARGE_BODY_BYTES).encode())]
    asyncio.run(gated(_scope(big), receive, send))
    assert sum(read) == 2 * LARGE_BODY_BYTES


def test_a_chunked_body_sent_with_a_small_content_length_is_still_large() -> None:
    """h11 reads such a body as chunked (up to the cap); the gate read the Content-Length first and let
    it by without a place, a deadline or a least rate."""
    from worker.bodycap import _large

    small, chunked = (b"content-length", b"10"), (b"transfer-encoding", b"chunked")
    assert _large(_scope([small, chunked])) and _large(_scope([chunked, small]))
    assert _large(_scope([(b"content-length", str(LARGE_BODY_BYTES + 1).encode())]))
    assert not _large(_scope([small])) and not _large(_scope([]))


def test_a_small_body_has_the_same_time_to_arrive() -> None:
    """A small body could take hours: its request's key, checked before the body came, acted long after
    it was revoked (and the connection was held all along)."""
    from worker.bodycap import BodyReadTimeoutError

    outcome: list[object] = []

    async def app(scope: Any, receive: Any, send: Any) -> None:
        try:
            while (await receive()).get("more_body"):
                pass
            outcome.append("read")
        except BodyReadTimeoutError as exc:
            outcome.append(exc)

    async def trickle() -> dict[str, Any]:
        await asyncio.sleep(0.05)  # a byte at a time, never done
        return {"type": "http.request", "body": b"x", "more_body": True}

    async def send(message: Any) -> None:
        return None

    gated = BodyCapMiddleware(app, cap=LARGE_BODY_BYTES, large_at_once=2, large_body_seconds=0.3)
    asyncio.run(asyncio.wait_for(gated(_scope([(b"content-length", b"100")]), trickle, send), 10))
    [error] = outcome
    assert isinstance(error, BodyReadTimeoutError) and error.seconds == 0.3


def test_a_small_bodys_time_counts_from_its_first_read() -> None:
    """The route checks the key on a thread before it reads: a busy pool's wait was counted against the
    sender, and a body that was coming at once was refused as late."""
    read: list[int] = []

    async def app(scope: Any, receive: Any, send: Any) -> None:
        await asyncio.sleep(0.5)  # waiting for a thread, past the body's 0.3 s
        while True:
            message = await receive()
            read.append(len(message.get("body", b"")))
            if not message.get("more_body"):
                return

    chunks = [b"x" * 100, b"y" * 100]

    async def receive() -> dict[str, Any]:
        await asyncio.sleep(0.01)  # arriving now, well within its time
        body = chunks.pop()
        return {"type": "http.request", "body": body, "more_body": bool(chunks)}

    async def send(message: Any) -> None:
        return None

    gated = BodyCapMiddleware(app, cap=LARGE_BODY_BYTES, large_at_once=2, large_body_seconds=0.3)
    asyncio.run(gated(_scope([(b"content-length", b"200")]), receive, send))
    assert read == [100, 100]


def test_a_small_body_past_the_budget_does_not_wait_for_a_large_upload() -> None:
    """Sent to the large-body gate, a 1 KB request waited for an upload of up to two minutes to end."""
    finished: dict[str, float] = {}
    hold_large = asyncio.Event()

    async def app(scope: Any, receive: Any, send: Any) -> None:
        if scope["path"] == "/large":
            await hold_large.wait()
        else:
            await asyncio.sleep(0.01)
        finished[scope["path"]] = asyncio.get_running_loop().time()

    gated = BodyCapMiddleware(app, cap=25 * LARGE_BODY_BYTES, large_at_once=2)

    big = [(b"content-length", str(2 * LARGE_BODY_BYTES).encode())]
    a_mib = [(b"content-length", str(LARGE_BODY_BYTES).encode())]
    tiny = [(b"content-length", b"1000")]
    filling = SMALL_BODIES_AT_ONCE_BYTES // LARGE_BODY_BYTES

    async def run() -> None:
        uploads = [gated({**_scope(big), "path": "/large"}, receive, send) for _ in range(2)]
        large = [asyncio.ensure_future(upload) for upload in uploads]
        await asyncio.sleep(0)
        await asyncio.gather(
            *(gated({**_scope(a_mib), "path": f"/small-{i}"}, receive, send) for i in range(filling)),
            gated({**_scope(tiny), "path": "/tiny"}, receive, send),
        )
        assert "/large" not in finished  # the tiny one went while the uploads still held their places
        hold_large.set()
        await asyncio.gather(*large)

    asyncio.run(run())
    assert finished["/tiny"] >= min(t for path, t in finished.items() if path.startswith("/small"))
