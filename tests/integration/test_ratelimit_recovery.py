"""The per-key search limit through a Redis that goes away and comes back (a real TCP link cut and
restored in front of the session's Redis): counted in the process meanwhile, shared again after."""

from __future__ import annotations

import logging
import socket
import threading
import uuid
from collections.abc import Iterator
from contextlib import contextmanager, suppress

import pytest

from tests.service import SessionBroker, _where
from worker.access import ratelimit
from worker.access.ratelimit import PerKeyLimiter

pytestmark = pytest.mark.integration


class Link:
    """A TCP port that forwards to the session's Redis while open; ``cut()`` closes the port and every
    connection through it, ``restore()`` listens on the same port again."""

    def __init__(self, upstream: str) -> None:
        self.upstream = upstream
        self.port = 0
        self._server: socket.socket | None = None
        self._open: list[socket.socket] = []

    def _connect_upstream(self) -> socket.socket:
        if ":" in self.upstream and not self.upstream.startswith("/"):
            host, port = self.upstream.rsplit(":", 1)
            return socket.create_connection((host, int(port)))
        unix = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        unix.connect(self.upstream)
        return unix

    def restore(self) -> None:
        server = socket.socket()
        server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        server.bind(("127.0.0.1", self.port))
        server.listen()
        self.port, self._server = server.getsockname()[1], server
        threading.Thread(target=self._accept, args=(server,), daemon=True).start()

    def _accept(self, server: socket.socket) -> None:
        while True:
            try:
                client, _ = server.accept()
            except OSError:
                return
            upstream = self._connect_upstream()
            self._open += [client, upstream]
            for a, b in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pipe, args=(a, b), daemon=True).start()

    @staticmethod
    def _pipe(source: socket.socket, sink: socket.socket) -> None:
        try:
            while data := source.recv(65536):
                sink.sendall(data)
        except OSError:
            pass
        finally:
            for end in (source, sink):
                with suppress(OSError):
                    end.shutdown(socket.SHUT_RDWR)

    def cut(self) -> None:
        assert self._server is not None
        with suppress(OSError):  # wakes the accept() blocked on it (close alone leaves it listening)
            self._server.shutdown(socket.SHUT_RDWR)
        self._server.close()
        for connection in self._open:
            with suppress(OSError):
                connection.shutdown(socket.SHUT_RDWR)
            connection.close()
        self._open.clear()


@contextmanager
def link_to(broker: SessionBroker) -> Iterator[Link]:
    link = Link(_where(broker.url))
    link.restore()
    try:
        yield link
    finally:
        link.cut()


def test_a_redis_blip_makes_the_limit_per_process_only_until_redis_answers_again(
    broker: SessionBroker, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """One Redis error set the shared counter aside for good: every later search counted in its own
    process, so N API processes (and the MCP server) let a key through N+1 times its limit until
    they restarted. Redis is tried again after a while now."""
    monkeypatch.setattr(ratelimit, "REDIS_RETRY_SECONDS", 0.0, raising=False)
    who, window = f"key-{uuid.uuid4().hex[:8]}", 1
    client = broker.client()
    db = client.connection_pool.connection_kwargs.get("db", 0)
    with link_to(broker) as link:
        limiter = PerKeyLimiter(100, f"redis://127.0.0.1:{link.port}/{db}")
        other = PerKeyLimiter(100, f"redis://127.0.0.1:{link.port}/{db}")  # another API process
        assert limiter._count(who, window) == 1 and other._count(who, window) == 2  # shared
        link.cut()
        with caplog.at_level(logging.WARNING, logger="worker.access.ratelimit"):
            assert limiter._count(who, window) == 1  # this process's own count while Redis is away
            assert limiter._count(who, window) == 2
        assert sum("falls back to this process" in r.getMessage() for r in caplog.records) == 1
        link.restore()
        assert limiter._count(who, window) == 3 and other._count(who, window) == 4  # shared again
    assert client.delete(f"{ratelimit.KEY_NAMESPACE}:{who}:{window}") == 1
