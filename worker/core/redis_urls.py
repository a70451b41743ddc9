"""Redis URLs as Celery and kombu spell them, turned into what redis-py reads (one place for both)."""

from __future__ import annotations

from urllib.parse import parse_qsl, urlencode

# The URL schemes of a Redis server, as Celery, kombu and redis-py spell them (redis+socket: kombu's unix
# socket, the embedded broker's).
REDIS_SCHEMES = ("redis", "rediss", "unix", "redis+socket")


def is_redis_url(url: str) -> bool:
    return url.partition("://")[0].lower() in REDIS_SCHEMES


# Celery and kombu spell ssl_cert_reqs as Python's ssl constants; redis-py takes only its own words.
_CERT_REQS = {"cert_required": "required", "cert_optional": "optional", "cert_none": "none"}


def redis_py_url(url: str) -> str:
    """A broker URL as redis-py reads it: kombu's ``redis+socket://PATH`` (the embedded broker) is
    ``unix://PATH``, and ``ssl_cert_reqs=CERT_REQUIRED`` (Celery's documented spelling) is ``required``.
    redis-py refused the latter ("Invalid SSL Certificate Requirements Flag") on first use: /readyz
    said degraded, and the shared rate limiters fell back to per-process counts (the search limit a
    key's limit times the processes) or, for the LLM, to none at all.

    A kombu failover list (``redis://a:6379;redis://b:6379``) is its first server: redis-py read the
    whole list as one URL and failed ("Port could not be cast"), every search a 500."""
    url = url.split(";", 1)[0].strip().partition("#")[0]  # redis-py reads no fragment
    if url.startswith("redis+socket://"):
        url = "unix://" + url.removeprefix("redis+socket://")
    # The query is rewritten by hand: urlunsplit drops an empty host, and "unix:///run/redis.sock?db=2"
    # came back as "unix:/run/...", which redis-py refused (every search a 500, /readyz degraded).
    base, sep, query = url.partition("?")
    if not sep:
        return url
    pairs = [
        (name, _CERT_REQS.get(value.lower(), value) if name == "ssl_cert_reqs" else value)
        for name, value in parse_qsl(query, keep_blank_values=True)
    ]
    return f"{base}?{urlencode(pairs)}"


__all__ = ["REDIS_SCHEMES", "is_redis_url", "redis_py_url"]
