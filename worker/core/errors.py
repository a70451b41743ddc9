"""Errors told in one line that carries none of the data they may quote, for logs and jobs' last_error."""

from __future__ import annotations

import logging
import traceback
from collections.abc import Container, Mapping, Sequence
from typing import Any

from worker.core.jsonvalues import made_storable  # standard library only: math, re


class InvalidSettingsError(ValueError):
    """The environment (or .env) holds a value a setting refuses: the message names each variable and
    what it must be, never the value (it may be a secret). Raised by worker.settings.get_settings;
    here, in a module that imports nothing, so the CLI's entry point can catch it without loading
    pydantic before a command needs it."""


class RefusedSettingsError(ValueError):
    """Settings a service (or, in production, a command) refuses to run with; the message is one line.
    Here for the reason InvalidSettingsError is (worker.settings raises it)."""


class LLMConfigurationError(RuntimeError):
    """The LLM provider settings are incomplete or refused; the message names the variable to set.
    Raised by worker.llm.gateway when a client is assembled; here so the CLI's entry point can turn it
    into one line for every command that calls a model (search, compact --now, embed...)."""


class EmbeddedUnavailableError(RuntimeError):
    """The embedded default cannot start here; point FACTMILL_DATABASE_URL at a server instead."""


class MigrationsMissingError(RuntimeError):
    """The alembic/ folder is not beside the code: Factmill was installed from a built wheel, which
    does not carry it. Raised by worker.db; here so the CLI's entry point can say it in one line."""


def loggable(exc: BaseException) -> str:
    """What a log line says of ``exc``: an LLM error's ``log_text`` (its status and code, never the
    provider's words); an HTTP client's or an SDK's error about a response by its class and status (the
    SDK's message is the provider's body: an LLMError's cause, in a traceback); else ``error_summary``
    (no value a database error quotes)."""
    text = getattr(exc, "log_text", None)
    if isinstance(text, str):
        return text
    status = getattr(getattr(exc, "response", None), "status_code", None)
    if isinstance(status, int):
        return f"{type(exc).__name__}: HTTP {status}"
    return error_summary(exc)


def loggable_record(record: logging.LogRecord) -> None:
    """Write what ``record`` carries of exceptions as ``loggable`` says: one rule for every
    ``logger.warning("...: %s", exc)`` (a provider's words may quote a page, a database error's DETAIL a
    row), for a traceback (``exc_info``: its frames kept, each exception of its chain told by
    ``loggable``) and for Celery's record of a task that raised (its ``exc`` and ``traceback`` fields,
    also under ``data`` for JSON lines). Applied by the services' log filter and the CLI's."""
    if isinstance(record.args, tuple) and any(isinstance(a, BaseException) for a in record.args):
        record.args = tuple(loggable(a) if isinstance(a, BaseException) else a for a in record.args)
    exc = record.exc_info[1] if isinstance(record.exc_info, tuple) else None
    if exc is None:
        return
    # A formatter writes exc_text when exc_info is gone (python-json-logger would format exc_info anew).
    record.exc_info, record.exc_text = None, loggable_traceback(exc)
    if isinstance(record.args, dict) and "exc" in record.args:  # celery.app.trace's record of a task
        told = {**record.args, "exc": loggable(exc), "traceback": record.exc_text}
        record.args = told
        if isinstance(getattr(record, "data", None), dict):
            record.data = told


def loggable_traceback(exc: BaseException) -> str:
    """A traceback as Python prints it, each exception of the chain told by ``loggable`` instead of its
    message: the frames (our code's lines) say where, the message may quote what the job worked on."""
    chain: list[BaseException] = []
    current: BaseException | None = exc
    while current is not None and all(current is not seen for seen in chain):
        chain.append(current)
        current = current.__cause__ or (None if current.__suppress_context__ else current.__context__)
    parts: list[str] = []
    for earlier, later in zip([None, *reversed(chain)], reversed(chain), strict=False):
        if earlier is not None:
            parts.append(_CAUSE if later.__cause__ is earlier else _CONTEXT)
        frames = "".join(traceback.format_tb(later.__traceback__))
        told = loggable(later)
        name = type(later).__name__
        told = told if told.startswith(name) else f"{name}: {told}"  # its class, as Python prints it
        parts.append(f"Traceback (most recent call last):\n{frames}{told}" if frames else told)
    return "\n".join(parts)


_CAUSE = "\nThe above exception was the direct cause of the following exception:\n"
_CONTEXT = "\nDuring handling of the above exception, another exception occurred:\n"


class LoggableArguments(logging.Filter):
    """``loggable_record`` as a handler's filter."""

    def filter(self, record: logging.LogRecord) -> bool:
        loggable_record(record)
        return True


def error_summary(exc: BaseException) -> str:
    """``exc`` in one line, without the data a database error quotes.

    A database error's message quotes its statement's values (a fact's text: ``invalid input syntax
    for type integer: "<value>"``, a unique key's DETAIL; the engines hide the bound parameters, see
    ``worker.db.create_pooled_engine``), so it is named by its class, the driver's and the SQLSTATE,
    e.g. "OperationalError: QueryCanceled (SQLSTATE 57014)". One without a SQLSTATE never reached the
    server (a refused connection) and keeps the driver's first line. Any other error is its class and
    message. A database error is recognised by its shape (SQLAlchemy's ``DBAPIError``: the statement
    and the driver's exception), so this module needs no database library.
    """
    orig = getattr(exc, "orig", None)
    driver_sqlstate = getattr(exc, "sqlstate", None)  # the driver's own error (a traceback's cause)
    if orig is None and isinstance(driver_sqlstate, str):
        return f"{type(exc).__name__} (SQLSTATE {driver_sqlstate})"
    if orig is None or not hasattr(exc, "statement"):
        return made_storable(f"{type(exc).__name__}: {exc}")  # stored as the job's last error
    sqlstate = getattr(orig, "sqlstate", None)
    if sqlstate:
        return f"{type(exc).__name__}: {type(orig).__name__} (SQLSTATE {sqlstate})"
    first = (str(orig).strip().splitlines() or [""])[0]
    return f"{type(exc).__name__}: {type(orig).__name__}: {first}"[:300]


def unsorted_error_note(exc: BaseException, where: str) -> str:
    """A job's note for an error no rule sorts (a bug, an outage nobody classified): a database error as
    ``error_summary`` tells it (its classes and SQLSTATE, none of the values), any other by its class and
    the place our code met it, not its message, which may quote what the job was working on (the note
    is shown by the API and the CLI, and outlives a page's erasure)."""
    if getattr(exc, "orig", None) is not None and hasattr(exc, "statement"):
        return error_summary(exc)
    return f"{type(exc).__name__} at {where} (its message is logged at DEBUG)"


def connection_failure(exc: BaseException) -> str | None:
    """The driver's first line when ``exc`` is a database error from a connection that never opened
    (refused, unknown host, no such database or role): SQLAlchemy's ``OperationalError`` over the
    driver's, with no SQLSTATE. None for any other error. Recognised by its shape, as above."""
    orig = getattr(exc, "orig", None)
    if orig is None or not hasattr(exc, "statement") or getattr(orig, "sqlstate", None):
        return None
    if getattr(exc, "connection_invalidated", False):  # it was open, and broke: ``database_outage``
        return None
    if type(exc).__name__ != "OperationalError":
        return None
    first = (str(orig).strip().splitlines() or [""])[0]
    return first.removeprefix("connection failed: ")[:300]


# SQLSTATEs of a server going away: connection exceptions (class 08), admin/crash shutdown, starting up.
DATABASE_GONE_SQLSTATES = ("57P01", "57P02", "57P03")
# SQLSTATE class 53, insufficient resources: the disk full (53100), out of memory (53200), too many
# connections (53300). The server's state, not the work's: a disk full for two minutes failed every job
# in flight for good (each retry spent an attempt, five used in about 75 s). Not 53400, a configured
# limit (temp_file_limit) the statement itself passes, the same way every time.
SERVER_OUT_OF_RESOURCES = frozenset({"53000", "53100", "53200", "53300"})
# read_only_sql_transaction: the server takes reads and refuses writes (a standby the URL reached after
# a failover, default_transaction_read_only set for maintenance, a managed server gone read-only on a
# full disk). The server's state too; the drivers raise it as an InternalError, not an OperationalError.
SERVER_REFUSES_WRITES = "25006"


def refused_as_read_only(exc: BaseException) -> bool:
    """Whether a database error is a write the server refused because it takes reads only (recognised
    by its shape, as ``error_summary`` does: this module needs no database library)."""
    sqlstate = getattr(getattr(exc, "orig", None), "sqlstate", None)
    return type(exc).__name__ == "InternalError" and sqlstate == SERVER_REFUSES_WRITES


def server_state_failed(sqlstate: str | None, *, invalidated: bool = False) -> bool:
    """Whether a database error with this SQLSTATE says the server went away, restarted or ran out of
    resources (not the statement's own failure); a connection broken under it (``invalidated``) too.
    No SQLSTATE at all means the server never answered."""
    if invalidated or sqlstate is None:
        return True
    return (
        sqlstate.startswith("08")
        or sqlstate in DATABASE_GONE_SQLSTATES
        or sqlstate in SERVER_OUT_OF_RESOURCES
    )


def database_outage(exc: BaseException) -> str | None:
    """``error_summary`` of a database error the server's state caused once connected (it was shut
    down or restarted, the connection broke, the disk or memory ran out): a command met it mid-way.
    None for any other error, and for a connection that never opened (``connection_failure``)."""
    orig = getattr(exc, "orig", None)
    if orig is None or not hasattr(exc, "statement"):
        return None
    if refused_as_read_only(exc):
        return error_summary(exc)
    sqlstate = getattr(orig, "sqlstate", None)
    if type(exc).__name__ != "OperationalError":
        return None
    invalidated = bool(getattr(exc, "connection_invalidated", False))
    if sqlstate is None and not invalidated:
        return None
    return error_summary(exc) if server_state_failed(sqlstate, invalidated=invalidated) else None


def describe_invalid(
    exc: Any, fields: Container[str], aliases: Mapping[str, Sequence[str]] | None = None
) -> str:
    """One line naming each variable a pydantic ValidationError (``exc``) of the Settings refused
    (FACTMILL_JOB_MAX_ATTEMPTS for a field among ``fields``, else the alias it came from, with the
    others that set it: ``aliases``, first -> all) and pydantic's reason, without the value (it may be
    a secret). pydantic names the first alias whichever was set: FACTMILL_OPENAI_API_KEY's error
    named OPENAI_API_KEY alone, a variable the operator never set."""
    problems = []
    for error in exc.errors(include_input=False, include_url=False):
        reason = str(error["msg"]).removeprefix("Value error, ")
        loc = error["loc"]
        if not loc:
            problems.append(reason)
            continue
        name = str(loc[0])
        variable = (
            f"FACTMILL_{name.upper()}" if name in fields else " or ".join((aliases or {}).get(name, [name]))
        )
        problems.append(f"{variable}: {reason}")
    return "invalid setting: " + "; ".join(problems)
