"""The queues the Celery app declares: each is bound under its own name, as operators read them."""

from __future__ import annotations

from worker.celery_app import create_app
from worker.jobs import registry
from worker.settings import Settings


def test_each_queue_has_its_own_exchange_and_routing_key() -> None:
    app = create_app(Settings(broker_url="redis://127.0.0.1:1/0"))
    names = registry.queues()
    assert set(names) >= {"extraction", "compaction", "calibration", "maintenance"}
    for name in names:
        queue = app.amqp.queues[name]
        assert (queue.exchange.name, queue.exchange.type, queue.routing_key) == (name, "direct", name)
    routes = registry.task_routes()
    for kind in registry.all_kinds():  # every kind's task goes to a declared queue
        assert routes[kind.task_name]["queue"] == kind.queue and kind.queue in names


def test_the_periodic_wake_ups_ride_the_maintenance_queue_not_a_work_queue() -> None:
    """Beat's messages expire when the next is due: on a work queue behind a backlog longer than its
    interval, every backfill poll expired unread and no batch was collected until the backlog drained."""
    routes = registry.task_routes()
    for name in ("tasks.maintenance.sweep", "tasks.backfill.poll"):
        assert routes[name]["queue"] == registry.MAINTENANCE_QUEUE
