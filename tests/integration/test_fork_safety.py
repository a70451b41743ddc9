"""A forked child (Celery's prefork pool) never talks on a connection its parent opened."""

from __future__ import annotations

import os

import pytest
from sqlalchemy import text

from worker import db

pytestmark = pytest.mark.integration


def test_a_forked_child_opens_its_own_connections(database_url):
    engine = db.create_pooled_engine(database_url)
    try:
        with engine.connect() as conn:
            parent_pid = conn.execute(text("SELECT pg_backend_pid()")).scalar_one()
        assert engine.pool.checkedin() == 1  # pooled, as after `worker` checked the schema
        read, write = os.pipe()
        child = os.fork()
        if child == 0:  # pragma: no cover - the child reports through the pipe
            try:
                kept = engine.pool.checkedin()
                with engine.connect() as conn:
                    pid = conn.execute(text("SELECT pg_backend_pid()")).scalar_one()
                os.write(write, f"{kept} {pid}".encode())
            finally:
                os._exit(0)
        os.close(write)
        kept, child_backend = os.read(read, 100).decode().split()
        os.waitpid(child, 0)
        assert kept == "0" and int(child_backend) != parent_pid
        with engine.connect() as conn:  # the parent's connection still works: the child closed none
            assert conn.execute(text("SELECT pg_backend_pid()")).scalar_one() == parent_pid
    finally:
        engine.dispose()
