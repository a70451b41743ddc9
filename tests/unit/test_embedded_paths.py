"""Data folders whose paths the embedded servers' URLs and command lines could not carry."""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, ClassVar

import pytest
from sqlalchemy.engine import make_url

from worker.embedded import EmbeddedUnavailableError, broker_paths
from worker.embedded.base import command_line, names_path
from worker.embedded.postgres import (
    _forget_a_dead_servers_pid_file,
    _no_server_of,
    embedded_postgres_url,
    socket_url,
)


@pytest.mark.parametrize("folder", ["/home/c++/var/pg", "/srv/100%/pg", "/data/a=b/pg", "/tmp/plain/pg"])
def test_the_postgres_url_names_its_socket_folder_whatever_its_characters(folder: str) -> None:
    """pgserver writes ?host=<path> unescaped: SQLAlchemy read "/home/c++" as "/home/c  " and every
    command then said "cannot reach the database"."""
    url = make_url(socket_url(f"postgresql://postgres:@/postgres?host={folder}"))
    assert (url.drivername, url.query["host"], url.database) == ("postgresql+psycopg", folder, "postgres")


def test_a_postgres_url_without_a_socket_is_only_given_the_driver() -> None:
    assert (
        socket_url("postgresql://postgres:@127.0.0.1:5432/x")
        == "postgresql+psycopg://postgres:@127.0.0.1:5432/x"
    )


@pytest.mark.parametrize("name", ["My Projects", "a&b", "it's"])
def test_a_data_folder_the_server_command_cannot_carry_is_refused_by_name(tmp_path: Path, name: str) -> None:
    """pg_ctl starts the server through a shell with the socket folder unquoted: a space failed with
    "invalid argument" and a page of server log that never named the cause."""
    with pytest.raises(EmbeddedUnavailableError, match="set FACTMILL_DATA_DIR to a folder without them"):
        embedded_postgres_url(tmp_path / name / "var")


def test_a_data_folder_too_long_for_the_servers_socket_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """pgserver put the socket of such a folder in a shared runtime folder (/tmp/runtime-<uid>, 0755, or
    0777 as root), where any local user reached a server that trusts local connections as superuser."""
    from worker.embedded import postgres

    if not postgres.SOCKET_MOVES_TO_A_SHARED_FOLDER:
        pytest.skip("pgserver's fallback socket folder is private to the user here")
    deep = tmp_path / ("d" * max(1, postgres.MAX_SOCKET_PATH_BYTES - len(str(tmp_path)))) / "var"
    with pytest.raises(EmbeddedUnavailableError, match="set FACTMILL_DATA_DIR to a shorter folder"):
        embedded_postgres_url(deep)
    assert not (deep / "pg" / "PG_VERSION").exists()  # refused before any server was made
    # One started before this rule runs on with its socket in the shared folder: told to stop it first,
    # and that moving the folder keeps its data (a new, shorter folder alone looked like the data lost).
    monkeypatch.setattr(postgres, "postmaster_status", lambda pgdata: "ready")
    with pytest.raises(EmbeddedUnavailableError, match=r"stop it \(factmill db stop\), then move the data"):
        embedded_postgres_url(deep)


@pytest.mark.parametrize("name", ["c#", "what?", "100%", "a+b", "with space"])
def test_a_redis_socket_a_url_cannot_carry_moves_to_a_short_path(tmp_path: Path, name: str) -> None:
    """kombu cuts a socket URL at # or ?, decodes %xx and reads + as a space: Celery retried another
    socket for ever and nothing was queued."""
    paths = broker_paths(tmp_path / name / "var")
    assert paths.socket.parent == Path("/tmp") and paths.url == f"redis+socket://{paths.socket}"
    assert broker_paths(tmp_path / "plain" / "var").socket.parent != Path("/tmp")


def test_pgservers_dump_of_the_server_log_reaches_no_log(caplog: pytest.LogCaptureFixture) -> None:
    """pgserver logs the whole Postgres server log at ERROR when a start fails or is slow: it only
    grows, and keeps the rows a constraint refused (slugs, fact text)."""
    import logging

    import worker.embedded.postgres  # noqa: F401  (quiets it on import)

    with caplog.at_level(logging.INFO):
        logging.getLogger("pgserver").error("Failed to start server. Showing contents of the log below: x")
    assert caplog.records == []


def _postmaster_pid(pgdata: Path, pid: int, status: str | None) -> None:
    """A postmaster.pid as Postgres writes it: pid, data folder, start time, port, socket folder,
    listen address, shared memory key, then its status once it has one."""
    lines = [str(pid), str(pgdata), "1764979200", "5432", str(pgdata), "", "  1234567    98304"]
    (pgdata / "postmaster.pid").write_text("\n".join([*lines, *([status] if status else [])]) + "\n")


def test_a_server_still_starting_is_waited_for_and_one_starting_too_long_is_a_clear_error(
    tmp_path: Path,
) -> None:
    """A server replaying its WAL after a kill outlasts pgserver's 10 s start: it was handed back as
    running, and the first query failed with "the database system is starting up"."""
    import subprocess
    import sys
    import threading
    import time

    from worker.embedded.base import command_line
    from worker.embedded.postgres import postmaster_status, wait_until_ready

    pgdata = tmp_path / "pg"
    pgdata.mkdir()
    assert postmaster_status(pgdata) is None and wait_until_ready(pgdata, timeout=0.1) is False
    # A live process whose command line names the folder stands for its postmaster.
    server = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)", str(pgdata)])
    try:
        # Until the child has exec'd, its command line is this process's (a loaded machine took longer
        # than the next line, and the "server" was no server of the folder).
        deadline = time.monotonic() + 30
        while str(pgdata) not in (command_line(server.pid) or "") and time.monotonic() < deadline:
            time.sleep(0.01)
        _postmaster_pid(pgdata, server.pid, None)  # no status written yet: starting
        assert postmaster_status(pgdata) == "starting"
        with pytest.raises(EmbeddedUnavailableError, match=r"still starting after 0 s \(its server log: "):
            wait_until_ready(pgdata, timeout=0.3)
        _postmaster_pid(pgdata, server.pid, "starting")
        ready = threading.Timer(0.5, _postmaster_pid, (pgdata, server.pid, "ready   "))
        ready.start()
        assert wait_until_ready(pgdata, timeout=30) is True
        assert postmaster_status(pgdata) == "ready"
        ready.join()
    finally:
        server.kill()
        server.wait()
    assert postmaster_status(pgdata) is None  # its server is gone: nothing to wait for


def test_a_failed_start_drops_pgservers_half_made_handle_so_the_next_ask_reads_the_server_anew(
    tmp_path: Path,
) -> None:
    """pgserver caches its handle before starting the server; a start that timed out left it without
    postmaster info, and the retry after the wait got that handle back (its get_uri asserted)."""
    from types import SimpleNamespace

    from worker.embedded.postgres import _server_uri

    class Server:
        _instances: ClassVar[dict[Path, Any]] = {}

        def __init__(self, pgdata: Path, uri: str | None) -> None:
            self.uri = uri
            Server._instances[pgdata] = self
            if uri is None:
                raise TimeoutError("pg_ctl: server did not start in time")

        def get_uri(self) -> str:
            assert self.uri is not None, "no postmaster info"
            return self.uri

    uris = iter([None, "postgresql://postgres:@/postgres?host=/s"])

    def get_server(pgdata: Path, cleanup_mode: str | None) -> Server:
        return Server._instances.get(pgdata) or Server(pgdata, next(uris))

    pgserver = SimpleNamespace(PostgresServer=Server, get_server=get_server)
    with pytest.raises(TimeoutError):
        _server_uri(pgserver, tmp_path)
    assert tmp_path not in Server._instances
    assert _server_uri(pgserver, tmp_path) == "postgresql://postgres:@/postgres?host=/s"


def test_a_server_is_known_by_its_whole_path_not_a_path_ending_in_it() -> None:
    """Matched as a substring, /work/main/var's socket was found in /home/alice/work/main/var's server's
    title: starting the one folder's Redis stopped the other's."""
    socket = "/work/main/var/redis/redis.sock"
    assert names_path(f"redis-server unixsocket:{socket}", socket)
    assert not names_path(f"redis-server unixsocket:/home/alice{socket}", socket)
    assert not names_path(f"redis-server unixsocket:{socket}.old", socket)
    assert names_path("/usr/lib/postgresql/bin/postgres -D /srv/my data/pg -k /tmp", "/srv/my data/pg")
    assert not names_path("postgres -D /srv/var/pg/pgdata2", "/srv/var/pg/pgdata")


@pytest.fixture
def lookalike(tmp_path: Path) -> Iterator[tuple[Path, int]]:
    """A data folder and a live process whose command line names a path inside it (as `tail -F
    <pgdata>/log` does) and is no server of it."""
    pgdata = tmp_path / "pg"
    pgdata.mkdir()
    process = sleeper(str(pgdata / "log"))
    try:
        yield pgdata, process.pid
    finally:
        process.kill()
        process.wait()


def sleeper(*args: str) -> subprocess.Popen[bytes]:
    """A process whose command line ends with ``args``, returned once /proc shows it (until its exec
    the child's command line is still this process's)."""
    process = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)", *args])
    deadline = time.monotonic() + 10
    while not (command_line(process.pid) or "").endswith(" ".join(args)):
        assert time.monotonic() < deadline, "the child never showed its command line"
        time.sleep(0.01)
    return process


def dead_pid() -> int:
    process = subprocess.Popen([sys.executable, "-c", "pass"])
    process.wait()
    return process.pid


def test_a_process_naming_a_path_inside_the_data_folder_is_no_server_of_it(lookalike) -> None:
    """The Postgres check matched the data folder as a substring: a postmaster killed without its
    clean-up whose pid went to `tail -F var/pg/log` was taken for running, and every command waited
    on its dead socket."""
    pgdata, pid = lookalike
    assert _no_server_of(pgdata, pid)
    server = sleeper("-D", str(pgdata))
    try:
        assert not _no_server_of(pgdata, server.pid)  # one naming the folder itself may be its server
    finally:
        server.kill()
        server.wait()


def test_a_dead_servers_socket_lock_is_cleared_in_the_socket_folder_its_pid_file_names(
    lookalike, tmp_path: Path
) -> None:
    """A data folder whose path is too long for a socket has its socket in pgserver's runtime folder:
    only pgdata's socket locks were cleared, and one naming the dead postmaster's pid, now another
    process's, kept Postgres from starting until someone deleted it by hand."""
    pgdata, reused = lookalike
    sockets = tmp_path / "runtime"
    sockets.mkdir()
    lines = [str(dead_pid()), str(pgdata), "1700000000", "5432", str(sockets), "", "0", "ready", ""]
    (pgdata / "postmaster.pid").write_text("\n".join(lines))
    for folder in (pgdata, sockets):
        (folder / ".s.PGSQL.5432.lock").write_text(f"{reused}\n")
        (folder / ".s.PGSQL.5432").write_text("")
    _forget_a_dead_servers_pid_file(pgdata)
    assert not (pgdata / "postmaster.pid").exists()
    for folder in (pgdata, sockets):
        assert not (folder / ".s.PGSQL.5432.lock").exists()
        assert not (folder / ".s.PGSQL.5432").exists()


@pytest.mark.parametrize("left", ["", "[12, 3", "{}", '["x"]'])
def test_a_client_list_a_cut_write_left_unreadable_starts_empty(tmp_path: Path, left: str) -> None:
    """pgserver rewrites .handle_pids.json in place: a write cut short (a full disk, a kill) left it
    empty, and every start after failed on it ("Expecting value") until someone deleted it by hand."""
    from worker.embedded.postgres import _mend_client_list

    listed = tmp_path / ".handle_pids.json"
    listed.write_text(left)
    _mend_client_list(tmp_path)
    assert listed.read_text() == "[]"
    listed.write_text("[12, 34]")  # a readable one is pgserver's: kept
    _mend_client_list(tmp_path)
    assert listed.read_text() == "[12, 34]"


def test_an_initdb_that_fails_says_why(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A locale the machine lacks (LANG forwarded over ssh) failed initdb: the error said "returned
    non-zero exit status 1" and named a server log that was never written; the reason was nowhere."""
    monkeypatch.setenv("LC_ALL", "xx_XX.UTF-8")
    data_dir = tmp_path / "var"
    with pytest.raises(EmbeddedUnavailableError) as refused:
        embedded_postgres_url(data_dir)
    said = str(refused.value)
    assert "it said:" in said and "locale" in said, said
    assert "its server log" not in said  # none was written
