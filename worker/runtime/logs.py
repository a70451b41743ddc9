"""The service processes' logs: one line a record, as text or JSON (FACTMILL_LOG_FORMAT), each carrying
the job or the request it was written for.

``log_context(job_id=...)`` binds fields to everything logged inside it, on this thread and on the
threads it hands work to with a copied context (the LLM pipe, the API's thread pool); a filter on the
handler copies them onto each record. JSON lines carry them as keys (python-json-logger writes a
record's extra attributes); text lines end with them in brackets. Only ids are bound: never a page's
slug or text, which an erasure must be able to remove and a log cannot.
"""

from __future__ import annotations

import contextvars
import logging
import logging.config
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from pythonjsonlogger.core import RESERVED_ATTRS
from pythonjsonlogger.json import JsonFormatter

from worker.core.errors import loggable_record
from worker.settings import Settings

_FIELDS: contextvars.ContextVar[dict[str, str | int] | None] = contextvars.ContextVar(
    "factmill_log_fields", default=None
)
TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
JSON_FORMAT = "%(asctime)s %(levelname)s %(name)s %(message)s"


@contextmanager
def log_context(**fields: str | int) -> Iterator[None]:
    """Bind ``fields`` (ids) to every record logged inside, nested contexts adding to outer ones."""
    token = _FIELDS.set({**(_FIELDS.get() or {}), **fields})
    try:
        yield
    finally:
        _FIELDS.reset(token)


def bound_fields() -> dict[str, str | int]:
    return dict(_FIELDS.get() or {})


class ContextFilter(logging.Filter):
    """Copies the bound fields onto each record (as attributes, as ``extra=`` would), and writes each
    exception it carries (an argument, a traceback, Celery's record of a task that raised) as
    ``loggable`` says: a provider's words may quote a page, a database error's DETAIL a row."""

    def filter(self, record: logging.LogRecord) -> bool:
        # Held here too, not only by QUIET_LOGGERS' levels: an SDK imported after the set-up (each is
        # imported at its first client) sets its loggers' levels from its own variable (ANTHROPIC_LOG=
        # debug), and every prompt was written whole.
        if record.levelno < logging.WARNING and record.name.partition(".")[0] in QUIET_LOGGERS:
            return False
        loggable_record(record)
        fields = _FIELDS.get()
        if fields:
            record.__dict__.update(fields)
            record.factmill_fields = fields
        return True


class TextFormatter(logging.Formatter):
    """The plain line, then the bound fields: ``... job 12 released [job_id=12 job_kind=extraction]``."""

    def format(self, record: logging.LogRecord) -> str:
        line = super().format(record)
        fields: dict[str, Any] | None = getattr(record, "factmill_fields", None)
        if not fields:
            return line
        first, newline, rest = line.partition("\n")  # a traceback stays below the line it belongs to
        bound = " ".join(f"{key}={value}" for key, value in fields.items())
        return f"{first} [{bound}]{newline}{rest}"


def json_formatter() -> logging.Formatter:
    return JsonFormatter(
        JSON_FORMAT,
        rename_fields={"asctime": "time", "levelname": "level", "name": "logger"},
        reserved_attrs=[*RESERVED_ATTRS, "factmill_fields", "color_message"],  # uvicorn: the ANSI copy
    )


def wants_json(settings: Settings) -> bool:
    """JSON unless told otherwise in production (log collectors parse it), text elsewhere."""
    if settings.log_format is not None:
        return settings.log_format == "json"
    return settings.environment == "production"


# httpx logs each request's URL at INFO: one line an LLM call (noise beside the llm_calls rows, ~5% of a
# worker's CPU at a hundred calls a second), and the URL's user:password when FACTMILL_LLM_BASE_URL
# carries them. Quiet in every process: the API's and the MCP server's logged them at INFO.
# At DEBUG the SDKs log each request's options whole (every prompt, a batch in one line): kept at
# WARNING whatever --loglevel says.
QUIET_LOGGERS = ("httpx", "httpx2", "httpcore", "httpcore2", "openai", "anthropic")


def logging_config(settings: Settings, level: str = "INFO") -> dict[str, Any]:
    """The dictConfig of a service process: one handler on stderr, the bound fields on every line.
    uvicorn applies it in each of its processes (``log_config``); its access log is off, as the API
    writes its own without query strings (worker.api.request_metrics)."""
    formatter = {"()": json_formatter} if wants_json(settings) else {"()": TextFormatter, "fmt": TEXT_FORMAT}
    return {
        "version": 1,
        "disable_existing_loggers": False,
        "filters": {"context": {"()": ContextFilter}},
        "formatters": {"default": formatter},
        "handlers": {
            "default": {
                "class": "logging.StreamHandler",
                "stream": "ext://sys.stderr",
                "formatter": "default",
                "filters": ["context"],
            }
        },
        "root": {"handlers": ["default"], "level": level.upper()},
        # uvicorn's own loggers carry handlers of their own in its default config: here they go to root.
        "loggers": {
            **{name: {"handlers": [], "propagate": True} for name in ("uvicorn", "uvicorn.error")},
            **{name: {"level": "WARNING"} for name in QUIET_LOGGERS},
        },
    }


def configure_logging(settings: Settings, level: str = "INFO") -> None:
    """Apply ``logging_config`` to this process (worker and beat; uvicorn applies it for serve)."""
    logging.config.dictConfig(logging_config(settings, level))


__all__ = [
    "QUIET_LOGGERS",
    "ContextFilter",
    "TextFormatter",
    "bound_fields",
    "configure_logging",
    "json_formatter",
    "log_context",
    "logging_config",
    "wants_json",
]
