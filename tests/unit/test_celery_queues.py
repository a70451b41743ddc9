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


def test_a_periodic_wake_up_outlives_a_clock_skew_of_minutes() -> None:
    """Celery dates a message's expiry by beat's clock and the worker reads it by its own: expiring
    after one interval (30 s for the sweep), a maintenance host 30 s ahead of beat's dropped every sweep
    as expired, and lost messages, lapsed leases and paused jobs were never seen to again."""
    from worker.celery_app import celery_config

    schedule = celery_config(Settings(broker_url="redis://x"))["beat_schedule"]
    for name, entry in schedule.items():
        assert entry["options"]["expires"] >= PERIODIC_EXPIRY_FLOOR_SECONDS, name
        assert entry["options"]["expires"] >= 4 * entry["schedule"], name


PERIODIC_EXPIRY_FLOOR_SECONDS = 300


def test_a_periodic_tasks_log_lines_carry_its_task_id(monkeypatch) -> None:
    """A job task's lines were bound to its task id; the sweep's, the poll's and the schedule's were
    not. Run by ``apply`` (in this process, no queue): only the binding around the work is checked."""
    import tasks.maintenance
    from worker.runtime.logs import bound_fields

    seen: list[dict[str, object]] = []
    monkeypatch.setattr(tasks.maintenance, "sweep_task", lambda resources: seen.append(bound_fields()) or 0)
    task = tasks.maintenance.sweep._get_current_object()
    monkeypatch.setattr(type(task), "resources", None)  # (no runtime: the work above needs none)
    task.apply(task_id="beat-7")
    assert seen == [{"task_id": "beat-7"}]
