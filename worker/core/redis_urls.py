"""Redis URLs as Celery and kombu spell them, turned into what redis-py reads (one place for both)."""

from __future__ import annotations

from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

# Celery and kombu spell ssl_cert_reqs as Python's ssl constants; redis-py takes only its own words.
_CERT_REQS = {"cert_required": "required", "cert_optional": "optional", "cert_none": "none"}


def redis_py_url(url: str) -> str:
    """A broker URL as redis-py reads it: kombu's ``redis+socket://PATH`` (the embedded broker) is
    ``unix://PATH``, and ``ssl_cert_reqs=CERT_REQUIRED`` (Celery's documented spelling) is ``required``.
    redis-py refused the latter ("Invalid SSL Certificate Requirements Flag") on first use: /readyz
    said degraded, and the shared rate limiters fell back to per-process counts (the search limit a
    key's limit times the processes) or, for the LLM, to none at all."""
    if url.startswith("redis+socket://"):
        url = "unix://" + url.removeprefix("redis+socket://")
    parts = urlsplit(url)
    if not parts.query:
        return url
    query = [
        (name, _CERT_REQS.get(value.lower(), value) if name == "ssl_cert_reqs" else value)
        for name, value in parse_qsl(parts.query, keep_blank_values=True)
    ]
    return urlunsplit(parts._replace(query=urlencode(query)))


__all__ = ["redis_py_url"]
