"""The embedded broker's fixed paths, its redis.conf and the pid-file reading, without starting a server."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from worker.embedded import StopOutcome, broker_paths
from worker.embedded.base import read_pid
from worker.embedded.broker import MAX_SOCKET_PATH_BYTES, server_config


def test_the_socket_and_pid_file_live_in_the_data_folder(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    paths = broker_paths(tmp_path / "var")
    assert paths.folder == (tmp_path / "var" / "redis").resolve()
    assert paths.socket == paths.folder / "redis.sock"
    assert paths.pid_file == paths.folder / "redis.pid"
    assert paths.url == f"redis+socket://{paths.folder / 'redis.sock'}"
    # The same folder named another way (relative, with ..) is the same server.
    monkeypatch.chdir(tmp_path)
    assert broker_paths(Path("var/../var")) == paths


def test_a_long_data_folder_gets_a_short_socket_path_of_its_own(tmp_path: Path) -> None:
    deep = tmp_path / ("d" * 60) / ("e" * 60)
    paths = broker_paths(deep)
    assert len(os.fsencode(paths.socket)) <= MAX_SOCKET_PATH_BYTES
    assert paths.socket.parent == Path("/tmp") and paths.socket.name.startswith("factmill-redis-")
    assert paths.pid_file.parent == paths.folder  # only the socket moves
    assert broker_paths(deep) == paths  # every process derives the same path
    assert broker_paths(deep / "other").socket != paths.socket  # one per folder


def test_the_config_serves_a_unix_socket_only_and_quotes_paths(tmp_path: Path) -> None:
    folder = tmp_path / 'with space "and quote"'
    config = server_config(broker_paths(folder))
    lines = config.splitlines()
    assert "port 0" in lines and "daemonize yes" in lines and "dbfilename broker.rdb" in lines
    assert any(line.startswith("save ") for line in lines)  # queued messages survive a restart
    [socket_line] = [line for line in lines if line.startswith("unixsocket ")]
    assert socket_line.endswith('.sock"')
    [dir_line] = [line for line in lines if line.startswith("dir ")]
    assert dir_line == 'dir "' + str(broker_paths(folder).folder).replace('"', '\\"') + '"'


def test_read_pid_takes_the_first_line_and_refuses_anything_else(tmp_path: Path) -> None:
    pid_file = tmp_path / "x.pid"
    assert read_pid(pid_file) is None  # missing
    for text, expected in (("1234\n", 1234), ("77\n/var/pg\n1700000000\n", 77), ("", None), ("abc\n", None)):
        pid_file.write_text(text)
        assert read_pid(pid_file) == expected
    pid_file.write_text("0\n")
    assert read_pid(pid_file) is None  # never signal pid 0 (the whole process group)


def test_stop_outcomes_read_as_sentences() -> None:
    assert StopOutcome("Redis", "stopped", "pid 9").describe() == "embedded Redis: stopped (pid 9)"
    assert StopOutcome("Postgres", "not running").describe() == "embedded Postgres: not running"
