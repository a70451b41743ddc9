"""Every command, the service processes included, against a schema behind or ahead of the code: one
line saying what to do, never a start that fails jobs or a traceback."""

from __future__ import annotations

import contextlib
import shutil
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import psycopg
import pytest
from sqlalchemy.engine import make_url

from tests.cli import run_main
from tests.e2e.test_cli import bare_env, factmill
from tests.service import REPO, ServiceProcess, free_port, fresh_database, wait_for

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]

BEHIND = "run `factmill db upgrade` first"
AHEAD = "newer than this factmill knows (its migrations end at "
# The migrations' head and the revision before it (one straight line: 0001, 0002, ...).
HEAD = max(path.name[:4] for path in (REPO / "alembic" / "versions").glob("[0-9][0-9][0-9][0-9]_*.py"))
PREVIOUS = f"{int(HEAD) - 1:04d}"


def _execute(url: str, statement: str) -> None:
    with psycopg.connect(make_url(url).set(drivername="postgresql").render_as_string(False)) as conn:
        conn.execute(statement)


def _one_line_error(result, expected: str, code: int = 1) -> None:  # type: ignore[no-untyped-def]
    assert result.returncode == code and "Traceback" not in result.stderr, result.stderr
    assert result.stderr.startswith("error: ") and result.stderr.count("\n") == 1, result.stderr
    assert expected in result.stderr, result.stderr


def test_workers_and_beat_wait_for_the_migrations(server_url):
    """A worker started beside Kubernetes' migrate Job ran jobs against the old schema (a job failing on
    a missing column spends its attempts); beat swept it. Both now refuse until the schema is at head."""
    with fresh_database(server_url, "behind") as url:
        env = bare_env(FACTMILL_DATABASE_URL=url, FACTMILL_BROKER_URL="redis://127.0.0.1:1/0")
        for command in (["worker", "--queues", "extraction", "--processes", "1"], ["beat"]):
            _one_line_error(factmill(command, env), "the database has no Factmill schema; " + BEHIND)
        assert factmill(["db", "upgrade", "--revision", PREVIOUS], env).returncode == 0
        for command in (
            ["worker", "--processes", "1"],
            ["worker", "--processes", "2"],
            ["beat"],
            ["jobs", "list"],
        ):
            message = f"the database is at revision {PREVIOUS}, not {HEAD}; " + BEHIND
            _one_line_error(factmill(command, env), message)


def test_a_schema_a_newer_release_upgraded_is_named_as_such(server_url):
    """A rolled-back release said "run `factmill db upgrade` first", and `db upgrade` was alembic's
    "Can't locate revision" traceback."""
    with fresh_database(server_url, "ahead") as url:
        env = bare_env(FACTMILL_DATABASE_URL=url, FACTMILL_BROKER_URL="redis://127.0.0.1:1/0")
        assert run_main(["db", "upgrade"], env).returncode == 0
        _execute(url, "UPDATE alembic_version SET version_num = '0999'")
        # The services' refusals in processes of their own (one that started would serve on here);
        # the other commands through the entry point in this process (a second or two less each).
        for command in (["worker", "--processes", "1"], ["beat"]):
            _one_line_error(factmill(command, env), "the database is at revision 0999, " + AHEAD)
        for command in (["jobs", "list"], ["db", "upgrade"]):
            _one_line_error(run_main(command, env), "the database is at revision 0999, " + AHEAD)
        assert run_main(["db", "current"], env).stdout.strip() == "0999"


def test_db_downgrade_undoes_the_migrations_after_a_revision_step_by_step(server_url):
    """The refusals said "downgrade the schema" with no command to do it; alembic's own took no lock
    timeout (the running service queued behind its ALTERs), and telling its steps crashed on an
    attribute alembic's step has not (down_revision)."""
    with fresh_database(server_url, "downgrade") as url:
        env = bare_env(FACTMILL_DATABASE_URL=url, FACTMILL_BROKER_URL="redis://127.0.0.1:1/0")
        assert run_main(["db", "upgrade"], env).returncode == 0
        # With no terminal, --yes is needed (what a migration added is dropped with its data).
        _one_line_error(run_main(["db", "downgrade", PREVIOUS], env), "pass --yes", code=2)
        assert run_main(["db", "current"], env).stdout.strip() == HEAD
        result = run_main(["db", "downgrade", PREVIOUS, "--yes"], env)
        assert result.returncode == 0 and "Traceback" not in result.stderr, result.stderr
        assert f"  {HEAD} ran in " in result.stderr and f"schema at revision {PREVIOUS}" in result.stdout
        assert run_main(["db", "current"], env).stdout.strip() == PREVIOUS
        _one_line_error(
            run_main(["db", "downgrade", "0999", "--yes"], env), "cannot downgrade to '0999'", code=2
        )
        _execute(url, "UPDATE alembic_version SET version_num = '0999'")
        _one_line_error(run_main(["jobs", "list"], env), "`factmill db downgrade REVISION`")


def test_upgrade_errors_are_one_line(server_url):
    with fresh_database(server_url, "upgrade") as url:
        env = bare_env(FACTMILL_DATABASE_URL=url, FACTMILL_BROKER_URL="redis://127.0.0.1:1/0")
        bogus = run_main(["db", "upgrade", "--revision", "bogus"], env)
        _one_line_error(bogus, "cannot upgrade to 'bogus': Can't locate revision identified by 'bogus'", 2)
        upgraded = run_main(["db", "upgrade", "--revision", "0023"], env)
        # Each migration is reported as it finishes (one over a large table can take minutes).
        steps = upgraded.stderr.splitlines()
        assert upgraded.returncode == 0 and steps[0] == "upgrading the schema: 23 migration(s), 0001 to 0023"
        assert [line.split()[0] for line in steps[1:]] == [f"{n:04d}" for n in range(1, 24)]
        assert steps[-1].startswith("  0023 ran in ") and steps[-1].endswith(
            ": jobs: an index on a page job's source and id, for a source-limited key's job list"
        )
        # A migration the database refuses (here: its function made by hand first) rolls back.
        _execute(
            url,
            "CREATE FUNCTION count_job_ending() RETURNS trigger LANGUAGE plpgsql AS 'BEGIN RETURN NULL; END'",
        )
        failed = run_main(["db", "upgrade"], env)
        assert failed.returncode == 1 and "Traceback" not in failed.stderr, failed.stderr
        # What it set out to do, then one line: 0024, the first, failed (no step is reported done).
        announced, error = failed.stderr.splitlines()
        assert announced == f"upgrading the schema: {int(HEAD) - 23} migration(s), 0024 to {HEAD}"
        assert error.startswith(
            "error: the upgrade failed, its last migration rolled back (the schema stays at 0023; run it "
            "again to go on from there): "
        )
        assert "DuplicateFunction (SQLSTATE 42723)" in error
        assert run_main(["db", "current"], env).stdout.strip() == "0023"


def test_migrations_missing_beside_the_code_is_one_line(monkeypatch, capsys, tmp_path):
    """Without its migrations (a wheel built from a tree without alembic/, files removed), every command
    ended in alembic's "Can't find Python file .../env.py" traceback, or called the schema newer than
    the code."""
    from worker import db
    from worker.cli.app import main
    from worker.settings import get_settings

    monkeypatch.setattr(db, "MIGRATIONS", tmp_path / "alembic")
    monkeypatch.setenv("FACTMILL_DATABASE_URL", "postgresql+psycopg://nobody@127.0.0.1:1/none")
    get_settings.cache_clear()
    for command in (["jobs", "list"], ["db", "upgrade"]):
        monkeypatch.setattr("sys.argv", ["factmill", *command])
        with pytest.raises(SystemExit) as exited:
            main()
        assert exited.value.code == 1, command
        err = capsys.readouterr().err
        assert (
            err.startswith("error: Factmill's migrations are not beside its code (no ")
            and err.count("\n") == 1
        )
        assert "or from the checkout itself (`pip install -e .`" in err
    get_settings.cache_clear()


# What a wheel is built from: the checkout's packaging files and the folders it carries.
BUILD_INPUTS = ("pyproject.toml", "setup.py", "MANIFEST.in", "README.md", "alembic.ini")
BUILD_FOLDERS = ("alembic", "examples", "worker", "tasks", "models", "factmill_client")


def test_a_built_wheel_carries_its_migrations_and_the_demo_pages(server_url, tmp_path):
    """A wheel carried the packages only: installed from one, `factmill db upgrade` could not find its
    migrations and the demo its example pages (both sit at the top of the checkout). setup.py now
    bundles them; installed far from any checkout, the wheel's own copy builds the schema to head."""
    source = tmp_path / "src"
    source.mkdir()
    for name in BUILD_INPUTS:
        shutil.copy2(REPO / name, source / name)
    for name in BUILD_FOLDERS:
        shutil.copytree(REPO / name, source / name, ignore=shutil.ignore_patterns("__pycache__"))

    def run(args: list[str], **env: str) -> str:
        done = subprocess.run(
            [sys.executable, *args],
            cwd=tmp_path,
            env=bare_env(**env),
            capture_output=True,
            text=True,
            timeout=240,
        )
        assert done.returncode == 0 and "Traceback" not in done.stderr, done.stdout + done.stderr
        return done.stdout

    pip = ["-m", "pip", "--disable-pip-version-check", "-q"]
    run([*pip, "wheel", "--no-deps", "-w", str(tmp_path / "dist"), str(source)])
    (wheel,) = (tmp_path / "dist").glob("factmill-*.whl")
    site = tmp_path / "site"
    run([*pip, "install", "--no-deps", "--no-compile", "--target", str(site), str(wheel)])
    bundled = site / "worker" / "_bundled"
    assert any(bundled.glob(f"alembic/versions/{HEAD}_*.py"))
    assert any((bundled / "examples" / "conversations").rglob("*.md"))
    with fresh_database(server_url, "wheel") as url:
        installed = {"FACTMILL_DATABASE_URL": url, "PYTHONPATH": str(site)}
        where = run(["-c", "import worker.db as d; print(d.__file__, d.MIGRATIONS, sep='\\n')"], **installed)
        assert where.splitlines() == [str(site / "worker" / "db.py"), str(bundled / "alembic")]
        run(["-m", "worker.cli", "db", "upgrade"], **installed)
        assert run(["-m", "worker.cli", "db", "current"], **installed).strip() == HEAD


@contextlib.contextmanager
def forwarding(port: int, to: tuple[str, int]) -> Iterator[None]:
    """A TCP forwarder from 127.0.0.1:``port`` to ``to``: the database "comes back" when it opens."""
    listener = socket.create_server(("127.0.0.1", port))
    stop = threading.Event()

    def pump(source: socket.socket, sink: socket.socket) -> None:
        with contextlib.suppress(OSError):
            while data := source.recv(65536):
                sink.sendall(data)
        with contextlib.suppress(OSError):
            sink.shutdown(socket.SHUT_WR)

    def serve() -> None:
        listener.settimeout(0.2)
        while not stop.is_set():
            try:
                client, _ = listener.accept()
            except TimeoutError:
                continue
            upstream = socket.create_connection(to)
            for a, b in ((client, upstream), (upstream, client)):
                threading.Thread(target=pump, args=(a, b), daemon=True).start()

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join(5)
        listener.close()


def test_a_service_started_while_the_database_is_down_waits_for_it(server_url, tmp_path: Path):
    """A worker replaced during a Postgres restart exited 1 ("cannot reach the database"): on Kubernetes
    a crash-loop backoff of minutes, and the chaos test lost every worker. The services now wait for
    the database (FACTMILL_STARTUP_WAIT_SECONDS) and start once it answers."""
    with fresh_database(server_url, "late") as url:
        env = bare_env(FACTMILL_DATABASE_URL=url, FACTMILL_BROKER_URL="redis://127.0.0.1:1/0")
        assert factmill(["db", "upgrade"], env).returncode == 0
        real = make_url(url)
        port = free_port()
        late = env | {
            "FACTMILL_DATABASE_URL": real.set(port=port).render_as_string(False),
            # Its schedule file in the test's own folder, not the checkout's ./var (a demo's beat's).
            "FACTMILL_DATA_DIR": str(tmp_path / "var"),
        }
        beat = ServiceProcess(["beat"], late, ready_marker=None, name="beat").start()
        try:
            wait_for(lambda: "waiting for it" in beat.tail(), 30, "beat to wait", diagnostics=beat.tail)
            time.sleep(1.5)  # a retry or two against the closed port
            assert beat.proc is not None and beat.proc.poll() is None, beat.tail()
            with forwarding(port, (real.host or "127.0.0.1", real.port or 5432)):
                wait_for(lambda: "beat: Starting" in beat.tail(), 30, "beat to start", diagnostics=beat.tail)
        finally:
            beat.stop()
        assert beat.tail().count("waiting for it") == 1  # said once, not a line a retry
        # A command an operator types still fails at once.
        started = time.monotonic()
        _one_line_error(factmill(["jobs", "list"], late), "cannot reach the database: ")
        assert time.monotonic() - started < 20


def test_db_upgrade_wait_migrates_a_database_that_comes_up_late(server_url):
    """The deployments' migrate step (`db upgrade --wait`): a Postgres still starting failed the
    Kubernetes Job within its three retries, and no worker ever started. Without --wait it fails at once."""
    with fresh_database(server_url, "late_migrate") as url:
        real = make_url(url)
        port = free_port()
        late = bare_env(
            FACTMILL_DATABASE_URL=real.set(port=port).render_as_string(False),
            FACTMILL_BROKER_URL="redis://127.0.0.1:1/0",
        )
        _one_line_error(factmill(["db", "upgrade"], late), "cannot reach the database: ")
        upgrade = ServiceProcess(["db", "upgrade", "--wait"], late, ready_marker=None, name="migrate").start()
        try:
            wait_for(
                lambda: "waiting for it" in upgrade.tail(),
                30,
                "the upgrade to wait",
                diagnostics=upgrade.tail,
            )
            with forwarding(port, (real.host or "127.0.0.1", real.port or 5432)):
                assert upgrade.proc is not None and upgrade.proc.wait(timeout=60) == 0, upgrade.tail()
        finally:
            upgrade.stop()
        assert f"schema at revision {HEAD}" in upgrade.tail()
