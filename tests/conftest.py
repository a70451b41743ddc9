"""Shared fixtures: a throw-away Postgres database built by the migrations, and the LLM simulator."""

from __future__ import annotations

import contextlib
import os
import tempfile
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import psycopg
import pytest
from sqlalchemy import text
from sqlalchemy.engine import make_url
from sqlalchemy.orm import Session, sessionmaker

import models
from worker import db
from worker.embedded import to_sqlalchemy_url
from worker.settings import Settings

if TYPE_CHECKING:
    from worker.simulator import Simulator

LOCAL_SERVER = "postgresql+psycopg://postgres@127.0.0.1:5432/postgres"


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
        yield to_sqlalchemy_url(configured)
        return
    if _reachable(LOCAL_SERVER):
        yield LOCAL_SERVER
        return
    import pgserver

    with tempfile.TemporaryDirectory(prefix="factmill-test-pg-") as tmp:
        server = pgserver.get_server(Path(tmp), cleanup_mode="stop")
        yield to_sqlalchemy_url(server.get_uri())
        server.cleanup()


@contextlib.contextmanager
def fresh_database(server: str, label: str = "t") -> Iterator[str]:
    """Create an empty database on ``server``, yield its URL, drop it afterwards."""
    name = f"factmill_{label}_{os.getpid()}_{uuid.uuid4().hex[:8]}"
    admin = make_url(server).set(drivername="postgresql").render_as_string(False)
    with psycopg.connect(admin, autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{name}"')
    url = make_url(server).set(database=name).render_as_string(False)
    try:
        yield url
    finally:
        with contextlib.suppress(Exception):
            db.get_engine(url).dispose()
        with psycopg.connect(admin, autocommit=True) as conn:
            conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


@pytest.fixture(scope="session")
def database_url(server_url: str) -> Iterator[str]:
    """This test run's own database, built by `alembic upgrade head`."""
    with fresh_database(server_url, "test") as url:
        db.upgrade(url)
        yield url


TABLES = ", ".join(sorted(models.Base.metadata.tables))


@pytest.fixture
def factory(database_url: str) -> Iterator[sessionmaker[Session]]:
    """A session factory over an emptied database (extraction commits its own transactions, so
    tests start clean instead of rolling back)."""
    engine = db.get_engine(database_url)
    with engine.begin() as conn:
        conn.execute(text(f"TRUNCATE {TABLES} RESTART IDENTITY CASCADE"))
    yield sessionmaker(engine, expire_on_commit=False)


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
