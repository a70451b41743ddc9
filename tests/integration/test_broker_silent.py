"""A Redis broker that takes the connection and never answers (a failover, a NAT that dropped the flow, a
partition): sends give up instead of hanging the API request or the sweep that made them."""

from __future__ import annotations

import logging
import socket
import threading
import uuid
from collections.abc import Iterator

import pytest
from sqlalchemy import select
from sqlalchemy.orm import Session, sessionmaker

from models import Job
from worker.api.deps import celery_sender_for
from worker.jobs.celery_app import celery_config
from worker.jobs.outbox import EXTRACTION, request_job
from worker.jobs.sending import enqueue
from worker.settings import Settings

# How long the test waits for the send to come back before calling it hung: the send gives up after
# 4 tries of 0.5 s (Celery's publish retries); without a socket timeout it never does.
HUNG_AFTER_SECONDS = 60


@pytest.fixture
def silent_broker() -> Iterator[str]:
    """A port whose kernel completes every connect (its backlog) and nothing ever reads or answers."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(64)
    try:
        yield f"redis://127.0.0.1:{server.getsockname()[1]}/0"
    finally:
        server.close()


def test_a_send_to_a_broker_that_never_answers_gives_up_and_the_job_stays_queued(
    silent_broker: str, tx_factory: sessionmaker[Session], caplog: pytest.LogCaptureFixture
) -> None:
    send = celery_sender_for(Settings(broker_url=silent_broker, broker_socket_timeout_seconds=0.5))
    with tx_factory.begin() as session:
        job_id = request_job(session, EXTRACTION, "default|p").job_id
    sent: list[int] = []
    sending = threading.Thread(
        target=lambda: sent.append(enqueue(tx_factory, [(job_id, EXTRACTION)], send)), daemon=True
    )
    with caplog.at_level(logging.WARNING, logger="worker.jobs.sending"):
        sending.start()
        sending.join(HUNG_AFTER_SECONDS)
    assert not sending.is_alive(), "the send hung on a broker that never answers"
    assert sent == [0]
    assert "they stay queued and the sweeper will send them" in caplog.text
    with tx_factory() as session:  # not marked sent: the sweeper's to send
        assert session.scalar(select(Job.enqueued_at).where(Job.id == job_id)) is None


def test_only_a_redis_broker_is_given_socket_timeouts() -> None:
    """kombu's AMQP transport takes no such options (its heartbeats find a dead connection)."""
    options = celery_config(Settings(broker_url="redis://x:6379/0", broker_socket_timeout_seconds=3))
    assert options["broker_transport_options"]["socket_timeout"] == 3
    assert options["broker_transport_options"]["socket_connect_timeout"] == 3
    amqp = celery_config(Settings(broker_url="amqp://guest@x//"))["broker_transport_options"]
    assert "socket_timeout" not in amqp and "socket_connect_timeout" not in amqp


RABBITMQ = "amqp://guest:guest@127.0.0.1:5672//"


def _rabbitmq_answers() -> bool:
    try:
        socket.create_connection(("127.0.0.1", 5672), timeout=1).close()
    except OSError:
        return False
    return True


@pytest.mark.skipif(not _rabbitmq_answers(), reason="no RabbitMQ answers on 127.0.0.1:5672")
def test_the_sweeps_depth_of_a_queue_celery_made_on_rabbitmq_is_known() -> None:
    """Declared with py-amqp's defaults (not durable, auto-delete), a queue Celery had made durable was
    refused by RabbitMQ (406): the depth was never known, and every sweep sent every overdue job again.
    (A queue of the test's own, declared as Celery declares its queues: the broker may be shared.)"""
    from kombu import Exchange, Queue

    from worker.jobs.celery_app import create_app
    from worker.jobs.sending import broker_queue_depth

    celery = create_app(Settings(broker_url=RABBITMQ))
    name = f"factmill-test-depth-{uuid.uuid4().hex}"
    celery.amqp.queues.add(Queue(name, Exchange(name, type="direct"), routing_key=name))
    with celery.connection_for_write() as connection:
        declared = celery.amqp.queues[name](connection.default_channel)
        declared.declare()  # as a worker declares it: durable
        try:
            celery.send_task("tasks.extraction.extract_page", args=[0], queue=name)
            celery.send_task("tasks.extraction.extract_page", args=[0], queue=name)
            assert broker_queue_depth(name, celery) == 2
        finally:
            declared.delete()
            declared.exchange.delete()
