"""The embedded servers as real processes: one redis-server per data folder (started once, reused,
replaced when dead or hung, race-safe), and `factmill db stop` reporting only what really stopped."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from tests.service import REPO, stop_embedded_broker
from worker.embedded import broker_paths, embedded_redis_url, stop_embedded_redis
from worker.embedded.base import pid_alive, read_pid, wait_exited
from worker.embedded.broker import answers, servers_on

pytestmark = pytest.mark.integration


@pytest.fixture
def data_dir(tmp_path: Path) -> Iterator[Path]:
    folder = tmp_path / "var"
    try:
        yield folder
    finally:
        stop_embedded_broker(folder)


def cli(data_dir: Path, *args: str, **env: str) -> subprocess.CompletedProcess[str]:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("FACTMILL_")}
    clean.update({"FACTMILL_DATA_DIR": str(data_dir), **env})
    return subprocess.run(
        [sys.executable, "-m", "worker.cli", *args],
        cwd=REPO,
        env=clean,
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_the_first_call_starts_the_server_and_later_ones_reuse_it(data_dir: Path) -> None:
    url = embedded_redis_url(data_dir)
    paths = broker_paths(data_dir)
    pid = read_pid(paths.pid_file)
    assert url == paths.url and pid is not None and servers_on(paths.socket) == [pid]
    assert embedded_redis_url(data_dir) == url
    assert read_pid(paths.pid_file) == pid and servers_on(paths.socket) == [pid]


def test_processes_starting_at_once_share_one_server(data_dir: Path) -> None:
    program = (
        "import sys; from pathlib import Path; from worker.embedded import embedded_redis_url; "
        "print(embedded_redis_url(Path(sys.argv[1])))"
    )
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    starters = [
        subprocess.Popen(
            [sys.executable, "-c", program, str(data_dir)],
            cwd=REPO,
            env=env,
            stdout=subprocess.PIPE,
            text=True,
        )
        for _ in range(4)
    ]
    urls = {proc.communicate(timeout=120)[0].strip() for proc in starters}
    assert all(proc.returncode == 0 for proc in starters)
    paths = broker_paths(data_dir)
    assert urls == {paths.url}
    assert servers_on(paths.socket) == [read_pid(paths.pid_file)]


def test_a_dead_servers_pid_file_and_socket_are_replaced(data_dir: Path) -> None:
    paths = broker_paths(data_dir)
    paths.folder.mkdir(parents=True)
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    paths.pid_file.write_text(f"{gone.pid}\n")
    with socket.socket(socket.AF_UNIX) as leftover:  # a socket file nobody listens on
        leftover.bind(str(paths.socket))
    assert paths.socket.exists() and not answers(paths.socket)
    embedded_redis_url(data_dir)
    pid = read_pid(paths.pid_file)
    assert pid != gone.pid and answers(paths.socket) and servers_on(paths.socket) == [pid]


def test_a_hung_server_is_replaced(data_dir: Path) -> None:
    embedded_redis_url(data_dir)
    paths = broker_paths(data_dir)
    hung = read_pid(paths.pid_file)
    assert hung is not None
    os.kill(hung, signal.SIGSTOP)  # alive, holding the socket, answering nothing
    try:
        assert not answers(paths.socket, timeout=0.5)
        embedded_redis_url(data_dir)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(hung, signal.SIGCONT)
    assert wait_exited(hung, 10)
    assert read_pid(paths.pid_file) != hung and servers_on(paths.socket) == [read_pid(paths.pid_file)]


def test_a_hung_server_this_user_may_not_signal_is_a_clear_error(
    data_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Another user's hung server on the socket: its SIGKILL raised PermissionError as a traceback."""
    from worker.embedded.base import EmbeddedUnavailableError

    embedded_redis_url(data_dir)
    paths = broker_paths(data_dir)
    hung = read_pid(paths.pid_file)
    assert hung is not None
    real_kill = os.kill

    def kill(pid: int, signum: int) -> None:
        if pid == hung:
            raise PermissionError(1, "Operation not permitted")  # as for another user's process
        real_kill(pid, signum)

    real_kill(hung, signal.SIGSTOP)
    try:
        monkeypatch.setattr(os, "kill", kill)
        with pytest.raises(EmbeddedUnavailableError, match=f"pid {hung} belongs to another user"):
            embedded_redis_url(data_dir)
    finally:
        monkeypatch.undo()
        real_kill(hung, signal.SIGCONT)
    assert pid_alive(hung)


def test_a_long_data_folder_runs_its_server_on_a_short_socket(tmp_path: Path) -> None:
    deep = tmp_path / ("d" * 60) / ("e" * 60) / "var"
    try:
        url = embedded_redis_url(deep)
        paths = broker_paths(deep)
        assert paths.socket.parent == Path("/tmp") and url == paths.url
        assert (paths.folder / "socket-path").read_text().strip() == str(paths.socket)
        assert answers(paths.socket) and (paths.folder / "redis.pid").exists()
    finally:
        stop_embedded_broker(deep)
    assert not paths.socket.exists()


def test_a_server_whose_folder_was_removed_under_it_is_replaced_not_reused(tmp_path: Path) -> None:
    """ "Remove var/ to start over" with the server running: the socket under /tmp still reached the old
    server, whose saves failed in a folder that was gone, and Redis then refused every write."""
    import shutil

    deep = tmp_path / ("d" * 60) / ("e" * 60) / "var"
    try:
        embedded_redis_url(deep)
        paths = broker_paths(deep)
        old = read_pid(paths.pid_file)
        assert old is not None
        shutil.rmtree(deep)
        assert embedded_redis_url(deep) == paths.url
        new = read_pid(paths.pid_file)
        assert new is not None and new != old and wait_exited(old, 10)
        client = redis.Redis(unix_socket_path=str(paths.socket))
        try:
            assert client.set("written", "1") and client.bgsave()  # a save to a folder that exists
        finally:
            client.close()
    finally:
        stop_embedded_broker(deep)


def test_a_server_whose_folder_and_socket_were_removed_under_it_is_stopped(data_dir: Path) -> None:
    """`rm -rf var` without `factmill down`, on a short path (its socket inside the folder): no socket,
    no pid file, so nothing found it; a second server started beside it and the first ran for good."""
    import shutil

    embedded_redis_url(data_dir)
    paths = broker_paths(data_dir)
    old = read_pid(paths.pid_file)
    assert old is not None and paths.socket.parent == paths.folder
    shutil.rmtree(data_dir)
    assert embedded_redis_url(data_dir) == paths.url
    new = read_pid(paths.pid_file)
    assert new is not None and new != old and wait_exited(old, 10)
    assert servers_on(paths.socket) == [new]


def test_down_stops_a_server_whose_folder_was_removed_under_it(data_dir: Path) -> None:
    """`rm -rf var`, then `factmill down`: it said "not running" as soon as the folder was missing,
    and the Redis ran on for good (only a later start for the same path found it)."""
    import shutil

    embedded_redis_url(data_dir)
    paths = broker_paths(data_dir)
    pid = read_pid(paths.pid_file)
    assert pid is not None
    shutil.rmtree(data_dir)
    outcome = stop_embedded_redis(data_dir)
    assert outcome.state == "stopped", outcome.describe()
    assert wait_exited(pid, 10) and servers_on(paths.socket) == []
    assert stop_embedded_redis(data_dir).state == "not running"


def test_a_server_whose_pid_file_was_deleted_by_hand_is_kept(tmp_path: Path) -> None:
    """Only positive evidence stops a server: one running in this folder is kept without its pid file
    (stopped without saving, it lost what its queue held since its last save)."""
    deep = tmp_path / ("d" * 60) / ("e" * 60) / "var"
    try:
        embedded_redis_url(deep)
        paths = broker_paths(deep)
        pid = read_pid(paths.pid_file)
        paths.pid_file.unlink()
        embedded_redis_url(deep)
        assert pid is not None and pid_alive(pid) and servers_on(paths.socket) == [pid]
    finally:
        with contextlib.suppress(Exception):
            if pid is not None:
                paths.pid_file.write_text(f"{pid}\n")
        stop_embedded_broker(deep)


def test_a_short_socket_another_user_holds_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The /tmp socket's name is predictable: another local user's server listening there was taken as
    the broker (every task it was handed, theirs to read)."""
    from worker.embedded import broker
    from worker.embedded.base import EmbeddedUnavailableError

    deep = tmp_path / ("d" * 60) / ("e" * 60) / "var"
    paths = broker_paths(deep)
    listener = socket.socket(socket.AF_UNIX)
    try:
        listener.bind(str(paths.socket))
        monkeypatch.setattr(broker.os, "getuid", lambda: os.stat(paths.socket).st_uid + 1)  # as if not ours
        with pytest.raises(EmbeddedUnavailableError, match="belongs to another user"):
            embedded_redis_url(deep)
    finally:
        listener.close()
        paths.socket.unlink(missing_ok=True)


def test_queued_messages_survive_a_stop_and_start(data_dir: Path) -> None:
    paths = broker_paths(data_dir)
    embedded_redis_url(data_dir)
    with redis.Redis(unix_socket_path=str(paths.socket)) as client:
        client.lpush("extraction", "job-1")
    assert stop_embedded_redis(data_dir).state == "stopped"
    assert (paths.folder / "broker.rdb").exists()
    embedded_redis_url(data_dir)
    with redis.Redis(unix_socket_path=str(paths.socket)) as client:
        assert client.lrange("extraction", 0, -1) == [b"job-1"]


def test_db_stop_stops_the_redis_and_says_so_only_when_it_has(data_dir: Path) -> None:
    embedded_redis_url(data_dir)
    paths = broker_paths(data_dir)
    pid = read_pid(paths.pid_file)
    assert pid is not None
    # The database is a server here, so only the embedded Redis is the command's business.
    result = cli(data_dir, "db", "stop", FACTMILL_DATABASE_URL="postgresql://127.0.0.1:1/none")
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"embedded Redis: stopped (pid {pid})" in result.stdout
    assert not pid_alive(pid) and not paths.socket.exists() and not paths.pid_file.exists()
    again = cli(data_dir, "down", FACTMILL_DATABASE_URL="postgresql://127.0.0.1:1/none")
    assert again.returncode == 0 and "embedded Redis: not running" in again.stdout
    # Run from another folder than the demo's (data_dir is relative by default), "not running" said
    # nothing of where it looked, while the servers ran on.
    assert f"in {data_dir.resolve()}" in again.stdout.replace("\n", "")


def test_db_stop_exits_non_zero_while_a_server_ignores_it(data_dir: Path) -> None:
    paths = broker_paths(data_dir)
    paths.folder.mkdir(parents=True)
    # Stands in for a server that does not stop: its command line names the socket, as redis-server's does.
    stubborn = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(120)",
            f"redis-server unixsocket:{paths.socket}",
        ]
    )
    try:
        time.sleep(0.5)  # let it install its handler before it is signalled
        paths.pid_file.write_text(f"{stubborn.pid}\n")
        outcome = stop_embedded_redis(data_dir, timeout=1)
        assert outcome.state == "still running" and str(stubborn.pid) in outcome.detail
        assert stubborn.poll() is None
    finally:
        stubborn.kill()
        stubborn.wait()


def test_db_stop_stops_the_embedded_postgres_a_killed_client_still_names(tmp_path: Path) -> None:
    """The bug: pgserver's clean-up stops the server only when its list of client pids holds no other
    pid, and a client killed with SIGKILL stays on it, so `db stop` said "stopped" with it running."""
    data_dir = tmp_path / "var"
    program = (
        "import os, sys; from pathlib import Path; from worker.embedded import embedded_postgres_url; "
        "embedded_postgres_url(Path(sys.argv[1])); os.kill(os.getpid(), 9)"
    )
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    pgdata = (data_dir / "pg").resolve()
    try:
        subprocess.run([sys.executable, "-c", program, str(data_dir)], cwd=REPO, env=env, timeout=120)
        postmaster = read_pid(pgdata / "postmaster.pid")
        assert postmaster is not None and pid_alive(postmaster)
        assert (pgdata / ".handle_pids.json").read_text() != "[]"  # the killed client is still listed
        # No schema here: the refusal names the folder (from another folder, ./var is a new database,
        # and "run `factmill db upgrade`" alone built a second one beside the service's).
        refused = cli(data_dir, "jobs", "list", FACTMILL_BROKER_URL="redis://127.0.0.1:1/0")
        assert refused.returncode == 1 and "the database has no Factmill schema" in refused.stderr
        assert f"(Postgres: embedded (pgserver) under {pgdata}; FACTMILL_DATA_DIR" in refused.stderr
        result = cli(data_dir, "db", "stop", FACTMILL_BROKER_URL="redis://127.0.0.1:1/0")
        assert result.returncode == 0, result.stdout + result.stderr
        assert f"embedded Postgres: stopped (pid {postmaster})" in result.stdout
        assert not pid_alive(postmaster)
        assert "embedded Postgres: not running" in cli(data_dir, "db", "stop").stdout
    finally:
        leftover = read_pid(pgdata / "postmaster.pid")
        if leftover and pid_alive(leftover):
            os.kill(leftover, signal.SIGKILL)


def test_a_postgres_killed_without_its_clean_up_is_started_again_when_its_pid_is_reused(
    tmp_path: Path,
) -> None:
    """A postmaster killed with SIGKILL leaves postmaster.pid; once its pid belongs to another process
    (here: a sleeping child), pgserver took the server for running and handed back a dead socket."""
    data_dir = tmp_path / "var"
    program = (
        "import sys; from pathlib import Path; from sqlalchemy import create_engine, text; "
        "from worker.embedded import embedded_postgres_url; "
        "url = embedded_postgres_url(Path(sys.argv[1])); "
        "engine = create_engine(url, connect_args={'connect_timeout': 10}); "
        "print(engine.connect().execute(text('SELECT 41 + 1')).scalar())"
    )
    env = {**os.environ, "PYTHONPATH": str(REPO)}

    def connect() -> subprocess.CompletedProcess[bytes]:  # a process that starts (or finds) the server
        return subprocess.run(
            [sys.executable, "-c", program, str(data_dir)],
            cwd=REPO,
            env=env,
            timeout=180,
            capture_output=True,
        )

    pgdata = (data_dir / "pg").resolve()
    squatter = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    try:
        first = connect()
        assert first.stdout.strip() == b"42", first.stderr[-2000:]
        postmaster = read_pid(pgdata / "postmaster.pid")
        assert postmaster is not None
        os.kill(postmaster, signal.SIGKILL)
        assert wait_exited(postmaster, 30)
        lines = (pgdata / "postmaster.pid").read_text().split("\n")
        (pgdata / "postmaster.pid").write_text("\n".join([str(squatter.pid), *lines[1:]]))  # the pid reused
        again = connect()
        assert again.stdout.strip() == b"42", again.stderr[-2000:]
        assert read_pid(pgdata / "postmaster.pid") not in (None, squatter.pid)
    finally:
        squatter.kill()
        leftover = read_pid(pgdata / "postmaster.pid")
        if leftover and leftover != squatter.pid and pid_alive(leftover):
            os.kill(leftover, signal.SIGKILL)


def test_rate_limits_are_shared_through_the_embedded_redis(data_dir: Path) -> None:
    """With no Redis named, every process counted the rate limits on its own: a worker's children, the
    API and each MCP server each let through the whole rate. Two runtimes (two processes' worth) on one
    data folder now count one search limit, and the LLM limiter is Redis-backed."""
    from sqlalchemy.orm import sessionmaker

    from worker.access.ratelimit import PerKeyLimiter
    from worker.config_store import ConfigReader
    from worker.llm.ratelimit import RedisRateLimiter, build_rate_limiter
    from worker.runtime import Runtime
    from worker.settings import Settings

    settings = Settings(
        broker_url=None, ratelimit_redis_url=None, data_dir=data_dir, search_rate_per_minute=3, llm_rpm=60
    )
    factory: sessionmaker = sessionmaker()

    def runtime() -> Runtime:
        return Runtime(settings=settings, factory=factory, config=ConfigReader(factory, ttl=1))

    first, second = PerKeyLimiter.for_runtime(runtime()), PerKeyLimiter.for_runtime(runtime())
    now = 1_000_000.0 * 60  # the start of a window: all four hits fall in one minute
    verdicts = [limiter.hit("key-1", now=now).allowed for limiter in (first, second, first, second)]
    assert verdicts == [True, True, True, False]
    shared = runtime().limits_settings(limited=True)
    assert shared.ratelimit_redis_url == broker_paths(data_dir).url
    assert isinstance(build_rate_limiter(shared), RedisRateLimiter)
    # A limit that is off starts nothing and names nothing.
    assert runtime().limits_settings(limited=False) is settings
