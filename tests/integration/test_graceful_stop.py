"""Graceful stop: SIGTERM makes a worker hand its jobs back at once, and every `factmill` process exits.

Real worker, beat, API, Flower and simulator processes, real Redis and Postgres, the simulator over HTTP.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from sqlalchemy import select
from sqlalchemy.orm import Session, sessionmaker

from models import Job
from tests.integration.test_service import add_pages, conversation, expected_facts, fact_rows, statuses
from tests.service import (
    ServiceProcess,
    celery_sender,
    running,
    service_env,
    start_beat,
    start_worker,
    wait_for,
)

pytestmark = [pytest.mark.integration, pytest.mark.timeout(240)]

# Generous: a correctness check (the process exits by itself), not a speed assertion.
EXIT_TIMEOUT = 15.0
# Far longer than the test: a job picked up by the second worker cannot have come from the stale-lease
# sweep (no beat runs, and a stale takeover would count a worker loss besides).
NO_SWEEP_SECONDS = 600


@pytest.fixture
def env(database_url: str, broker_url: str, simulator: Any) -> dict[str, str]:
    return service_env(
        database_url,
        broker_url,
        simulator.base_url,
        job_stale_after_seconds=NO_SWEEP_SECONDS,
        job_requeue_after_seconds=NO_SWEEP_SECONDS,
        grace_seconds=30,
        llm_concurrency=4,  # a page of 100 calls at 300 ms then lasts several seconds
    )


@pytest.fixture
def sender(env: dict[str, str]) -> Iterator[Any]:
    with celery_sender(env) as send:
        yield send


@pytest.fixture
def simulator(module_simulator: Any) -> Any:
    """This module's own simulator: its tests set long latencies, which must not reach other modules
    (restore() puts the knobs back, but a worker still waiting on a slow call would see them)."""
    return module_simulator


@pytest.fixture(autouse=True)
def _reset_simulator(simulator: Any) -> Iterator[None]:
    yield
    simulator.restore()


def lease(factory: sessionmaker[Session], job_id: int) -> tuple[str, str | None]:
    with factory() as session:
        row = session.execute(select(Job.status, Job.worker).where(Job.id == job_id)).one()
        return row.status, row.worker


def stop_holder_mid_page(
    factory: sessionmaker[Session],
    job_id: int,
    holder: ServiceProcess,
    other: ServiceProcess,
    sig: int = signal.SIGTERM,
) -> float:
    """SIGTERM (or ``sig``) the worker holding the job mid-page; the seconds until the other worker
    claimed it."""
    wait_for(lambda: len(fact_rows(factory)) > 5, 60, "some segments to commit")
    status, held_by = lease(factory, job_id)
    assert status == "running" and held_by is not None, "SIGTERM should land mid-page"
    sigterm_at = time.monotonic()
    # To the worker's main process alone (as a container's runtime signals PID 1): a prefork child learns
    # of the stop from its parent, not from the process group.
    stopper = threading.Thread(target=holder.terminate, args=(EXIT_TIMEOUT * 4, sig, False), daemon=True)
    stopper.start()
    wait_for(
        lambda: lease(factory, job_id)[1] not in (None, held_by),
        60,
        "the other worker to claim the released job",
        interval=0.02,
        diagnostics=lambda: f"{lease(factory, job_id)}\n{holder.tail()}\n{other.tail()}",
    )
    gap = time.monotonic() - sigterm_at
    stopper.join(EXIT_TIMEOUT * 4)
    # Exit code 0: a warm shutdown that finished, not the grace period's forced exit.
    assert holder.proc is not None and holder.proc.returncode == 0, holder.tail()
    return gap


@pytest.mark.parametrize(
    ("sig", "pool"),
    [(signal.SIGTERM, "threads"), (signal.SIGQUIT, "threads"), (signal.SIGTERM, "prefork")],
    ids=["SIGTERM", "SIGQUIT", "SIGTERM-prefork"],
)
def test_sigterm_releases_the_running_job_to_another_worker_at_once(
    factory, env, sender, server_url, simulator, sig, pool
):
    """SIGQUIT too: Celery's cold shutdown asked the threads pool to kill its jobs, which it cannot, so
    it raised before the stop Factmill listens for was sent: no job was handed back, no grace period
    armed, and the worker waited for its jobs however long (they stayed running until the sweeper).
    And on the prefork pool: Celery tells the main process only, so a child's job ran on until the
    grace period's exit cut it off (a worker loss, left to the sweeper)."""
    # ~100 calls at 300 ms, 4 in flight: several seconds of work, so SIGTERM lands mid-page. Until the
    # second worker is up (slow on a loaded machine) the calls take 2 s, so the page cannot finish first.
    simulator.configure(latency_ms=2000)
    pages = {"conversations/stop": conversation(7, segments=100)}
    holder = start_worker(env, concurrency=1, name=f"holder-{uuid.uuid4().hex[:4]}@%h", pool=pool)
    with running(holder):
        (job_id,) = add_pages(factory, pages, sender)
        wait_for(lambda: lease(factory, job_id)[0] == "running", 60, "the first worker to claim the job")
        other = start_worker(env, concurrency=1, name=f"other-{uuid.uuid4().hex[:4]}@%h")
        with running(other):
            simulator.configure(latency_ms=300)
            gap = stop_holder_mid_page(factory, job_id, holder, other, sig)
            wait_for(
                lambda: statuses(factory).get("succeeded", 0) == 1,
                120,
                "the job to succeed on the other worker",
                diagnostics=lambda: f"{statuses(factory)}\n{other.tail()}",
            )
    print(f"\n{signal.Signals(sig).name} -> other worker's claim ({pool} pool): {gap:.2f}s")
    with factory() as session:
        job = session.get(Job, job_id)
        assert job is not None
        # A lease handed back is neither a lost worker nor an attempt: one run reached a verdict.
        assert (job.attempts, job.worker_losses) == (1, 0), (job.attempts, job.worker_losses)
    assert "released by its stopping worker" in "".join(holder.output), holder.tail()
    simulator.configure(latency_ms=0)  # the sequential reference run below need not wait 2.5 s a call
    # Exactly once: the segments the first worker committed are not extracted again.
    assert fact_rows(factory) == expected_facts(server_url, pages, simulator)


def test_a_worker_stuck_in_a_call_hands_its_job_back_within_its_grace_period(factory, env, sender, simulator):
    """Each call takes a minute: the job never reaches a segment boundary while the worker stops. The
    page waited for its call past the grace period, the process was killed (what was ready behind the
    call lost), and the job waited for the stale-lease sweep. The page now stops waiting while the grace
    lasts: what it holds is recorded, the job handed back, and the worker exits in time."""
    simulator.configure(latency_ms=60_000)
    # 4 s: under STOP_RECORD_SECONDS (the page stops waiting at once), with room for the release.
    worker = start_worker({**env, "FACTMILL_GRACE_SECONDS": "4"}, concurrency=1)
    with running(worker):
        (job_id,) = add_pages(factory, {"conversations/stuck": conversation(3, segments=2)}, sender)
        wait_for(lambda: lease(factory, job_id)[0] == "running", 60, "the worker to claim the job")
        # SIGTERM only once the call is open: before it, the job is between segments and is released.
        wait_for(lambda: simulator.stats()["in_flight"] > 0, 60, "the worker's call to reach the simulator")
        code = worker.terminate(EXIT_TIMEOUT)
        assert code is not None, f"the worker outlived its grace period:\n{worker.tail()}"
        output = "".join(worker.output)
        assert "released by its stopping worker" in output and "grace period of 4s is over" not in output, (
            worker.tail()
        )
    assert lease(factory, job_id) == ("queued", None)  # handed back, not left to the stale-lease sweep


def test_the_exit_code_of_a_celery_command_reaches_the_shell(env):
    """`factmill worker`, `beat` and `flower` ran Celery through Celery.worker_main / start, which drop
    its exit code: after Celery's "Unrecoverable error" the worker exited 0, so restart-on-failure
    never fired. ``celery_exit_code`` runs them all; here on a command that fails at once."""
    import subprocess
    import sys

    asked = "from worker.cli.services import celery_exit_code as c; raise SystemExit(c(%r))"
    argv = ["inspect", "ping", "--timeout", "0.3"]  # no worker answers: EX_UNAVAILABLE
    done = subprocess.run([sys.executable, "-c", asked % argv], env=env, capture_output=True, text=True)
    assert done.returncode == 69 and "No nodes replied" in done.stderr, done.stderr[-2000:]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def answers(url: str) -> bool:
    try:
        return httpx.get(url, timeout=2).status_code < 500
    except httpx.HTTPError:
        return False


def slow_request(url: str) -> None:
    """A chat call the simulator holds open (its latency) while it is told to stop."""
    body = {"model": "simulator-1", "messages": [{"role": "user", "content": "hello"}]}
    with contextlib.suppress(httpx.HTTPError):
        httpx.post(f"{url}/v1/chat/completions", json=body, timeout=60)


def test_every_factmill_process_exits_on_sigterm(env, tmp_path: Path):
    api_port, flower_port, sim_port = free_port(), free_port(), free_port()
    simulator = ServiceProcess(
        ["simulator", "--port", str(sim_port), "--latency-ms", "30000"],
        env,
        ready_marker="Uvicorn running",
        name="simulator",
    ).start()
    api = ServiceProcess(
        ["serve", "--port", str(api_port)], env, ready_marker="Application startup complete", name="api"
    ).start()
    flower = ServiceProcess(["flower", "--port", str(flower_port)], env, ready_marker=None, name="flower")
    processes = [simulator, api, start_worker(env, concurrency=2), start_beat(env, tmp_path), flower.start()]
    with running(*processes):
        wait_for(lambda: answers(f"http://127.0.0.1:{flower_port}/healthcheck"), 60, "Flower to answer")
        sim_url = f"http://127.0.0.1:{sim_port}"
        threading.Thread(target=slow_request, args=(sim_url,), daemon=True).start()
        time.sleep(1.0)  # let the call reach the simulator, which holds it for 30 s
        # Each still running: one that had died already would count as one the signal stopped.
        dead = [f"{p.name}:\n{p.tail(20)}" for p in processes if p.proc is None or p.proc.poll() is not None]
        assert not dead, "\n".join(dead)
        still_running, codes = [], {}
        for process in processes:
            code = process.terminate(EXIT_TIMEOUT)
            if code is None:
                still_running.append(f"{process.name}:\n{process.tail(20)}")
            codes[process.name] = code
        assert not still_running, "\n".join(still_running)
        # Uvicorn ends its shutdown by raising the signal again (the exit says what stopped it).
        by_signal = -signal.SIGTERM
        expected = {"simulator": by_signal, "api": by_signal, "worker": 0, "beat": 0, "flower": 0}
        assert codes == expected, codes
        for served in (simulator, api):
            assert "Application shutdown complete" in served.tail(40), served.tail(40)


@contextlib.contextmanager
def two_children(program: str, **popen: Any) -> Iterator[Any]:
    """A parent (``program``: `run_children` of two children) in a process group of its own, like a
    terminal's foreground job, once both children said ready; the group is killed at the end."""
    import os
    import signal
    import subprocess
    import sys

    parent = subprocess.Popen(
        [sys.executable, "-c", program],
        cwd=Path(__file__).resolve().parents[2],
        stdout=subprocess.PIPE,
        text=True,
        start_new_session=True,
        **popen,
    )
    try:
        assert parent.stdout is not None
        assert [parent.stdout.readline().strip() for _ in range(2)] == ["ready", "ready"]
        yield parent
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(parent.pid, signal.SIGKILL)


STUBBORN_PARENT = """
import sys
from worker.cli import processes
processes.STOP_MARGIN_SECONDS = 0.5
stubborn = (
    "import os, signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); os.write(1, b'ready\\\\n'); "
    "time.sleep(120)"  # one write of a line: two children's print()s once met as "readyready"
)
sys.exit(processes.run_children([[], []], 0.5, command=(sys.executable, "-c", stubborn)))
"""


def test_the_parent_kills_a_child_still_there_past_its_grace_period() -> None:
    """`factmill worker --processes N` waited for its children without a deadline: a child stuck where
    no stop flag is read (once seen at startup against a broker that was down) held the stop forever."""
    with two_children(STUBBORN_PARENT) as parent:
        started = time.monotonic()
        parent.send_signal(signal.SIGTERM)
        code = parent.wait(timeout=30)
        assert time.monotonic() - started < 10  # killed after 0.5 s of grace + 0.5 s
        assert code == 128 + signal.SIGKILL  # the shell's code for it (before: 247, from exit(-9))


COUNTING_PARENT = """
import sys
from worker.cli import processes
counting = (
    "import os, signal, time; signal.signal(signal.SIGINT, lambda s, f: os.write(1, b'int\\\\n')); "
    "os.write(1, b'ready\\\\n'); time.sleep(3)"
)
sys.exit(processes.run_children([[], []], 5, command=(sys.executable, "-c", counting)))
"""


def test_a_terminals_ctrl_c_reaches_each_child_once() -> None:
    """The children shared the parent's process group, so a Ctrl-C reached each of them from the
    terminal and again from the parent: Celery takes a second SIGINT as a cold shutdown (which the
    threads pool cannot even do: NotImplementedError in the signal handler)."""
    with two_children(COUNTING_PARENT) as parent:
        os.killpg(parent.pid, signal.SIGINT)  # what a terminal's Ctrl-C does
        out, _ = parent.communicate(timeout=30)
        assert out.split() == ["int", "int"]


DEADLINE_AFTER_A_CLEAN_STOP = """
import time
from worker.jobs import shutdown
shutdown.request_stop(0.3)  # SIGTERM: the grace period starts
shutdown.on_worker_shutdown()  # every job ended: Celery's worker_shutdown
time.sleep(1.0)  # the exit's own clean-up (the embedding follow-ups' drain) takes longer than what was left
"""


def test_a_stop_whose_jobs_all_ended_is_not_cut_short_by_the_grace_deadline() -> None:
    """The deadline stayed armed after the pool ended, fired during the exit's clean-up, and exited 1
    ("grace period is over with jobs still running", with none), dropping the queued follow-ups."""
    import subprocess
    import sys

    done = subprocess.run(
        [sys.executable, "-c", DEADLINE_AFTER_A_CLEAN_STOP],
        cwd=Path(__file__).resolve().parents[2],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    assert "grace period" not in done.stderr


HANGING_UP_PARENT = """
import sys
from worker.cli import processes
counting = (
    "import os, signal, time; "
    "signal.signal(signal.SIGTERM, lambda s, f: (os.write(1, b'term\\\\n'), os._exit(0))); "
    "signal.signal(signal.SIGHUP, lambda s, f: os.write(1, b'hup\\\\n')); "
    "os.write(1, b'ready\\\\n'); time.sleep(10)"
)
sys.exit(processes.run_children([[], []], 5, command=(sys.executable, "-c", counting)))
"""


def test_a_closed_terminal_stops_the_children_too() -> None:
    """SIGHUP was not passed on: the parent died and its children (process groups of their own, so the
    terminal's hang-up missed them) ran on without a parent, off Linux for good. It reaches them as
    SIGTERM (Celery restarts on a SIGHUP)."""
    with two_children(HANGING_UP_PARENT) as parent:
        parent.send_signal(signal.SIGHUP)
        out, _ = parent.communicate(timeout=30)
        assert out.split() == ["term", "term"] and parent.returncode == 0


def test_a_quit_reaches_the_children_as_sigterm() -> None:
    """Passed on as SIGQUIT, each child began Celery's cold shutdown, which the threads pool cannot do."""
    with two_children(HANGING_UP_PARENT) as parent:
        parent.send_signal(signal.SIGQUIT)
        out, _ = parent.communicate(timeout=30)
        assert out.split() == ["term", "term"] and parent.returncode == 0


def test_under_nohup_a_hang_up_stops_nothing() -> None:
    """A SIGHUP ignored from the start (`nohup factmill worker ...`) must stay ignored: forwarding it
    stopped a worker its operator had meant to outlive the terminal."""
    with two_children(
        HANGING_UP_PARENT, preexec_fn=lambda: signal.signal(signal.SIGHUP, signal.SIG_IGN)
    ) as parent:
        parent.send_signal(signal.SIGHUP)
        time.sleep(1)
        assert parent.poll() is None  # still running, and so are its children
        parent.send_signal(signal.SIGTERM)
        out, _ = parent.communicate(timeout=30)
        assert out.split() == ["term", "term"]


def test_a_worker_stuck_in_the_database_still_exits_when_its_grace_period_ends(
    factory, env, sender, simulator
) -> None:
    """What the page cannot stop waiting for (a statement held by a lock) is bounded by the grace period:
    the process exits, and the stale-lease sweep takes the job over."""
    from sqlalchemy import text as sql

    worker = start_worker({**env, "FACTMILL_GRACE_SECONDS": "2"}, concurrency=1)
    with running(worker), factory() as holder:
        holder.execute(sql("LOCK TABLE op_checkpoints IN ACCESS EXCLUSIVE MODE"))  # held until the end
        (job_id,) = add_pages(factory, {"conversations/locked": conversation(3, segments=2)}, sender)
        wait_for(lambda: lease(factory, job_id)[0] == "running", 60, "the worker to claim the job")
        wait_for(
            lambda: (
                holder.connection()
                .exec_driver_sql(
                    "SELECT count(*) FROM pg_locks "
                    "WHERE relation = 'op_checkpoints'::regclass AND NOT granted"
                )
                .scalar()
            ),
            60,
            "the worker to wait on the lock",
        )
        code = worker.terminate(EXIT_TIMEOUT)
        assert code is not None, f"the worker outlived its grace period:\n{worker.tail()}"
        assert code == 1 and "grace period of 2s is over" in "".join(worker.output), worker.tail()
        holder.rollback()
    assert lease(factory, job_id)[0] == "running"  # not handed back: the sweep takes it over
