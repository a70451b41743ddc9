"""The embedded Postgres (pgserver) under ``<data_dir>/pg``: kept running until `factmill db stop`."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from sqlalchemy.engine import make_url

from worker.embedded.base import (
    EmbeddedUnavailableError,
    StopOutcome,
    command_line,
    folder,
    is_process_of,
    names_path,
    pid_alive,
    quiet_runtime_dir,
    read_pid,
    server_library,
    signal_and_wait,
    to_sqlalchemy_url,
)

logger = logging.getLogger(__name__)
# pgserver logs the whole server log (which only grows, and keeps rows a constraint refused: slugs, fact
# text) at ERROR when a start fails or takes over 10 s. Our own error names the file to read instead.
logging.getLogger("pgserver").setLevel(logging.CRITICAL)
# And while _FailedCommand listens (its records kept from the root logger): never the last-resort
# handler's stderr either.
logging.getLogger("pgserver").addHandler(logging.NullHandler())
_LISTENING = threading.Lock()  # one listener at a time: each saves and restores the logger's settings

STOP_TIMEOUT_SECONDS = 60.0
# A server killed mid-write replays its WAL before it takes connections; pgserver's pg_ctl gives a start
# 10 s, and a server still starting after that was handed back as running ("the database system is
# starting up" on the first query), or its start reported failed while it went on recovering.
READY_TIMEOUT_SECONDS = 300.0
STATUS_LINE = 7  # postmaster.pid's line 8: starting, ready, stopping or standby
SOCKET_LINE = 4  # its line 5: the (first) Unix socket folder
# The longest Unix socket path on Linux (sun_path less its NUL). Only there does pgserver's fallback
# folder for a longer one risk being shared (/tmp/runtime-<uid>); macOS's is private to the user.
MAX_SOCKET_PATH_BYTES = 107
SOCKET_MOVES_TO_A_SHARED_FOLDER = sys.platform.startswith("linux")
# pgserver starts the server through pg_ctl, which runs it through a shell with the socket folder
# unquoted: a folder path with any of these failed with "invalid argument" and a page of server log.
SHELL_UNSAFE = frozenset(" \t\n&;|<>()$`\\\"'*?[]")


def embedded_postgres_url(data_dir: Path) -> str:
    """Start (or reuse) the embedded Postgres under ``data_dir/pg`` and return its URL.

    The server keeps running after this process exits so the next command (a worker,
    the API, a rerun of the CLI) finds the same data; `factmill db stop` stops it.
    """
    pgserver = server_library("pgserver", "FACTMILL_DATABASE_URL")
    pgdata = folder(data_dir, "pg")
    unusable = sorted(set(str(pgdata)) & SHELL_UNSAFE)
    if unusable:
        raise EmbeddedUnavailableError(
            f"the embedded Postgres cannot run in {pgdata}: its path holds {' '.join(map(repr, unusable))}, "
            "which its server command line cannot carry; set FACTMILL_DATA_DIR to a folder without them, "
            "or FACTMILL_DATABASE_URL to a Postgres server"
        )
    socket_bytes = len(os.fsencode(pgdata / ".s.PGSQL.5432"))
    if SOCKET_MOVES_TO_A_SHARED_FOLDER and socket_bytes > MAX_SOCKET_PATH_BYTES:
        # pgserver would put the socket in its runtime folder instead: /tmp/runtime-<uid> where there is
        # no /run/user (containers, su, cron), readable by every local user, where the server trusts
        # any local connection as its superuser; and /run/user goes at logout, leaving a server no
        # command could reach.
        running = postmaster_status(pgdata) is not None
        raise EmbeddedUnavailableError(
            f"the embedded Postgres cannot run in {pgdata}: its socket's path would be {socket_bytes} bytes, "
            f"over the {MAX_SOCKET_PATH_BYTES} a Unix socket takes; "
            + (
                "its server runs now with its socket in a shared folder: stop it (factmill db stop), then "
                "move the data folder to a shorter path (its data goes with it) and point FACTMILL_DATA_DIR "
                "there"
                if running
                else "set FACTMILL_DATA_DIR to a shorter folder (move this one there to keep its data)"
            )
            + ", or FACTMILL_DATABASE_URL to a Postgres server"
        )
    # Under pgserver's own start lock: a process that starts the server meanwhile writes a pid file
    # this one must not take for the dead one's.
    with getattr(getattr(pgserver, "PostgresServer", None), "_lock", contextlib.nullcontext()):
        _forget_a_dead_servers_pid_file(pgdata)
        _mend_client_list(pgdata)
    failed = _FailedCommand()
    try:
        with failed.listening():
            try:
                uri = _server_uri(pgserver, pgdata)
            except Exception:
                if not wait_until_ready(pgdata):  # not a slow recovery: the start failed
                    raise
                uri = _server_uri(pgserver, pgdata)
    except Exception as exc:
        said = f"; it said: {failed.said}" if failed.said else ""
        log = pgdata / "log"
        where = f" (its server log: {log})" if log.exists() else ""
        raise EmbeddedUnavailableError(
            f"could not start the embedded Postgres in {pgdata}: {exc}{said}{where}; "
            "set FACTMILL_DATABASE_URL to a Postgres server instead"
        ) from exc
    wait_until_ready(pgdata)
    return socket_url(uri)


class _FailedCommand(logging.Handler):
    """The last lines a failed Postgres command (initdb, pg_ctl) wrote to stderr, which pgserver logs
    at ERROR on a logger Factmill silences (it logs the whole server log too): an initdb refused for an
    unknown locale (LANG forwarded over ssh) was "returned non-zero exit status 1" and a server log
    that was never written, the reason nowhere."""

    def __init__(self) -> None:
        super().__init__(logging.ERROR)
        self.said = ""

    def emit(self, record: logging.LogRecord) -> None:
        args = record.args if isinstance(record.args, tuple) else ()
        if str(record.msg).startswith("Failed postgres command") and len(args) >= 5:
            lines = [line.strip() for line in str(args[4]).splitlines() if line.strip()]
            self.said = " / ".join(lines[-3:])[:400]

    @contextlib.contextmanager
    def listening(self) -> Iterator[None]:
        """Hear pgserver's ERROR records, and only this handler: none reaches the log."""
        pg_logger = logging.getLogger("pgserver")
        with _LISTENING:
            level, propagate = pg_logger.level, pg_logger.propagate
            pg_logger.setLevel(logging.ERROR)
            pg_logger.propagate = False
            pg_logger.addHandler(self)
            try:
                yield
            finally:
                pg_logger.removeHandler(self)
                pg_logger.setLevel(level)
                pg_logger.propagate = propagate


def _server_uri(pgserver: Any, pgdata: Path) -> str:
    """pgserver's URI of the server of ``pgdata``, starting it if none runs. A start that failed (its
    pg_ctl gave up after 10 s) leaves pgserver's handle cached half made (no postmaster info: its
    get_uri asserts): it is dropped, so the next ask reads the server anew."""
    try:
        with quiet_runtime_dir():
            return str(pgserver.get_server(pgdata, cleanup_mode=None).get_uri())
    except BaseException:
        getattr(getattr(pgserver, "PostgresServer", None), "_instances", {}).pop(pgdata, None)
        raise


def wait_until_ready(pgdata: Path, timeout: float = READY_TIMEOUT_SECONDS) -> bool:
    """Wait while the server of ``pgdata`` is starting (replaying its WAL after a kill); whether one
    was. A server still starting after ``timeout`` is an error naming its log."""
    deadline, waited = time.monotonic() + timeout, False
    while postmaster_status(pgdata) == "starting":
        if not waited:
            logger.warning("the embedded Postgres in %s is starting (recovering?); waiting for it", pgdata)
            waited = True
        if time.monotonic() >= deadline:
            raise EmbeddedUnavailableError(
                f"the embedded Postgres in {pgdata} is still starting after {timeout:.0f} s (its server log: "
                f"{pgdata / 'log'}); try again once it is up, or set FACTMILL_DATABASE_URL"
            )
        time.sleep(0.2)
    return waited


def postmaster_status(pgdata: Path) -> str | None:
    """What the live server of ``pgdata`` says it is doing (postmaster.pid's status line: a server
    that wrote no status yet is starting); None when no server of it runs."""
    pid_file = pgdata / "postmaster.pid"
    pid = read_pid(pid_file)
    if pid is None or _no_server_of(pgdata, pid):
        return None
    try:
        lines = pid_file.read_text().split("\n")
    except OSError:
        return None
    return (
        lines[STATUS_LINE].strip() if len(lines) > STATUS_LINE and lines[STATUS_LINE].strip() else "starting"
    )


def _forget_a_dead_servers_pid_file(pgdata: Path) -> None:
    """Remove a postmaster.pid whose pid is no server of ``pgdata``: a postmaster killed without its
    clean-up (OOM, a container restart) leaves it, and once its pid is reused by any process, pgserver
    took the server for running and handed back a dead socket (every command waited 60 s and failed)."""
    pid_file = pgdata / "postmaster.pid"
    pid = read_pid(pid_file)
    if pid is None or not _no_server_of(pgdata, pid):
        return
    logger.warning("the embedded Postgres in %s died without its clean-up; starting it again", pgdata)
    folders = {pgdata, *_socket_folder(pid_file)}
    pid_file.unlink(missing_ok=True)
    # Its socket's lock file names the dead postmaster too; Postgres refuses to start while that pid is
    # a process at all (an unreaped zombie, or the pid reused), so it goes with its socket. The socket is
    # in pgdata, or in pgserver's runtime folder when pgdata's path is too long for a socket.
    for where in folders:
        for lock in where.glob(".s.PGSQL.*.lock"):
            holder = read_pid(lock)
            if holder is None or _no_server_of(pgdata, holder):
                lock.unlink(missing_ok=True)
                lock.with_suffix("").unlink(missing_ok=True)


def _mend_client_list(pgdata: Path) -> None:
    """Empty pgserver's list of client pids (``.handle_pids.json``) when it is no JSON list: pgserver
    rewrites it in place at each start and exit, and a write cut short (a full disk, a kill, a power
    cut) left it empty or partial; every later start then failed on it ("Expecting value") until
    someone deleted it by hand. Factmill never reads it (``cleanup_mode=None``; ``db stop`` signals)."""
    path = pgdata / ".handle_pids.json"
    try:
        listed = json.loads(path.read_text())
    except FileNotFoundError:
        return
    except (OSError, ValueError):
        listed = None
    if isinstance(listed, list) and all(isinstance(pid, int) for pid in listed):
        return
    logger.warning("pgserver's client list in %s was unreadable; it starts empty", pgdata)
    spare = path.with_suffix(".json.tmp")
    spare.write_text("[]")
    spare.replace(path)


def _socket_folder(pid_file: Path) -> list[Path]:
    """The socket folder a postmaster.pid names (its fifth line), if it names one."""
    try:
        lines = pid_file.read_text().split("\n")
    except OSError:
        return []
    named = lines[SOCKET_LINE].strip() if len(lines) > SOCKET_LINE else ""
    return [Path(named)] if named.startswith("/") else []


def _no_server_of(pgdata: Path, pid: int) -> bool:
    """Whether ``pid`` is surely no server of ``pgdata``: gone, or a process whose command line does not
    name pgdata whole (``tail -F <pgdata>/log`` names a path in it; another folder's server, a path
    ending in it). One whose command line cannot be read (/proc hidden) may be the server: not surely."""
    if not pid_alive(pid):
        return True
    line = command_line(pid)
    return line is not None and not names_path(line, str(pgdata))


def socket_url(uri: str) -> str:
    """pgserver's URL with its socket folder escaped: it writes ``?host=<path>`` as is, and a ``+``,
    ``&`` or ``%`` in the path made SQLAlchemy read another folder ("cannot reach the database")."""
    head, sep, host = uri.partition("?host=")
    if not sep:
        return to_sqlalchemy_url(uri)
    url = make_url(to_sqlalchemy_url(head))
    return url.set(query={"host": host}).render_as_string(hide_password=False)


def stop_embedded_postgres(data_dir: Path, timeout: float = STOP_TIMEOUT_SECONDS) -> StopOutcome:
    """Stop the embedded Postgres under ``data_dir`` and wait until its postmaster has exited.

    A fast shutdown (SIGINT, what ``pg_ctl stop -m fast`` sends), not pgserver's clean-up: that one
    stops the server only when its list of client pids (``.handle_pids.json``) holds no other pid, and
    the pid of a client that was killed stays there for good, so it returned (and "stopped" was
    printed) with the server still up. Nor ``pg_ctl``: run as root it refuses to run at all, and the
    server runs as pgserver's own user then. Root may signal any process; anyone else their own.
    """
    pgdata = (data_dir / "pg").resolve()
    pid = read_pid(pgdata / "postmaster.pid")
    if pid is None or not is_process_of(pid, str(pgdata)):
        return StopOutcome("Postgres", "not running")
    logger.info("stopping the embedded Postgres (pid %s) in %s", pid, pgdata)
    return signal_and_wait("Postgres", pid, signal.SIGINT, timeout)
