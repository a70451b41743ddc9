"""`factmill serve`, `worker`, `beat` and `flower`: the service processes."""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Annotated

import click
import typer
import uvicorn

from worker.celery_app import app as celery
from worker.cli.console import err, fail, is_loopback, port_option, styled
from worker.cli.processes import child_hostname, default_processes, run_children, worker_processes
from worker.cli.sessions import checked_factory, refuse_unset_servers, say_where_jobs_go
from worker.jobs.registry import queues as known_queues
from worker.llm.types import longest_try_seconds
from worker.runtime.logs import configure_logging, logging_config
from worker.runtime.tracing import TracingUnavailableError, require_packages
from worker.settings import RefusedSettingsError, Settings, get_settings

POOLS = ("threads", "prefork", "solo")
LOG_LEVELS = ("debug", "info", "warning", "error", "critical")
LOGLEVEL_HELP = "debug, info, warning, error or critical."


def checked_loglevel(loglevel: str) -> str:
    """--loglevel, refused at once (exit 2) unless a level: an unknown one was a traceback from the
    logging setup in every process, after a wait for the database."""
    if loglevel.lower() not in LOG_LEVELS:
        raise fail(f"--loglevel must be one of {', '.join(LOG_LEVELS)}, not {loglevel!r}", code=2)
    return loglevel.lower()


def refuse_insecure_secrets(
    settings: Settings, *, calls_models: bool = True, runs_jobs: bool = False, holds_secrets: bool = True
) -> None:
    """Settings a service refuses (a placeholder secret outside development, a weak one in production,
    a worker's provider missing its key): one clear line and exit 2, never a traceback."""
    try:
        settings.check_service_settings(
            calls_models=calls_models, runs_jobs=runs_jobs, holds_secrets=holds_secrets
        )
    except RefusedSettingsError as exc:
        raise fail(str(exc), code=2) from None


def largest_reply_tokens(settings: Settings, queues: Sequence[str]) -> int:
    """The largest reply cap the jobs of these queues ask a model for (0: they call none): extraction's
    truncation retry (twice the cap, to the ceiling), a compaction's summary, a consolidation's batch of
    pairs."""
    # Here, not at the top: asked by `factmill worker` alone, whose jobs load these anyway; serve and beat
    # need not pay for consolidation's imports (about 0.1 s) at start.
    from worker.consolidation.service import MAX_PAIRS_PER_CALL, OUTPUT_TOKENS_PER_PAIR
    from worker.extraction.segments import largest_reply_cap

    caps = [0]
    if "extraction" in queues:
        caps.append(largest_reply_cap(settings.llm_max_output_tokens))
    if "compaction" in queues:
        caps.append(settings.compaction_max_output_tokens)
    if "consolidation" in queues:
        caps.append(MAX_PAIRS_PER_CALL * OUTPUT_TOKENS_PER_PAIR)
    return max(caps)


def refuse_a_stall_limit_below_a_call(settings: Settings, queues: Sequence[str]) -> None:
    """A job that shows no progress for FACTMILL_TASK_TIME_LIMIT_SECONDS is taken for stalled (its lease
    lapses, another worker runs it), and a call shows none from one try's start to the next's: the try
    waiting for its reply, then the wait before the next (FACTMILL_LLM_MAX_TOTAL_WAIT_SECONDS at most). A
    limit shorter had every slow call's job run twice. Exit 2, saying what to raise."""
    largest = largest_reply_tokens(settings, queues)
    if not largest:
        return  # these queues' jobs call no model
    silent = longest_try_seconds(settings.llm_timeout_seconds, largest) + settings.llm_max_total_wait_seconds
    if settings.task_time_limit_seconds <= silent:
        timeout, wait = settings.llm_timeout_seconds, settings.llm_max_total_wait_seconds
        raise fail(
            f"FACTMILL_TASK_TIME_LIMIT_SECONDS ({settings.task_time_limit_seconds}) is not above the longest "
            f"a job may wait on an LLM call ({silent:g} s: a try of a {largest:,}-token reply at "
            f"FACTMILL_LLM_TIMEOUT_SECONDS={timeout:g} for each 2,048 tokens, and the wait before the next, "
            f"FACTMILL_LLM_MAX_TOTAL_WAIT_SECONDS={wait:g}): such a job would be taken for stalled and run "
            "twice; raise the one or lower the others",
            code=2,
        )


def refuse_missing_tracing(settings: Settings) -> None:
    """FACTMILL_OTEL_ENDPOINT set without the `otel` extra: say what to install and exit 2."""
    try:
        require_packages(settings)
    except TracingUnavailableError as exc:
        raise fail(str(exc), code=2) from None


# `--processes 100000` forked until the machine gave out. Each process holds its own connection pools
# and LLM pipe; past a few per core they only compete for it: more throughput means more hosts.
MAX_WORKER_PROCESSES = 64
MAX_JOBS_IN_FLIGHT = 4096  # as FACTMILL_LLM_CONCURRENCY: one thread a job


def serve(
    host: Annotated[str, typer.Option()] = "127.0.0.1",
    port: Annotated[int, port_option(help="The port the API listens on.")] = 8000,
    workers: Annotated[
        int, typer.Option(min=1, max=MAX_WORKER_PROCESSES, help="uvicorn worker processes.")
    ] = 1,
) -> None:
    """Run the HTTP API (webhooks, jobs, facts, config, health, metrics)."""
    settings = get_settings()
    refuse_insecure_secrets(settings)
    refuse_published_secrets(settings, host)
    refuse_missing_tracing(settings)
    checked_factory(settings, wait=True)  # fail early, with a clear message, if the schema is missing
    say_where_jobs_go(settings)
    warn_of_unchosen_legacy_signatures(settings)
    with request_counts_shared(settings, workers):
        uvicorn.run(
            "worker.api.app:create_app",
            factory=True,
            host=host,
            port=port,
            workers=workers,
            log_level="info",
            log_config=logging_config(settings),
            access_log=False,  # it writes paths with their query strings: the API logs its own (no query)
            timeout_keep_alive=settings.api_keep_alive_seconds,
            timeout_graceful_shutdown=max(1, round(settings.grace_seconds)),  # SIGTERM: open requests' time
        )


@contextmanager
def request_counts_shared(settings: Settings, workers: int) -> Iterator[None]:
    """For several API processes, a fresh PROMETHEUS_MULTIPROC_DIR they all count requests into (unless
    one is set), removed when they have exited; one process needs none. A folder the operator set is
    made if missing and cleared of the counts of earlier runs (prometheus_client's rule: a process
    reusing a pid, as a container's do, went on from its predecessor's counts; a missing folder stopped
    every API process at start)."""
    if settings.prometheus_multiproc_dir is not None:
        named = Path(settings.prometheus_multiproc_dir)
        named.mkdir(parents=True, exist_ok=True)
        for stale in named.glob("*.db"):
            stale.unlink(missing_ok=True)
        # Exported: a folder named in .env alone reached Settings but not prometheus_client, which reads
        # the environment once, at import, in each process uvicorn starts.
        os.environ["PROMETHEUS_MULTIPROC_DIR"] = str(named)
    if workers == 1 or settings.prometheus_multiproc_dir is not None:
        yield
        return
    folder = tempfile.mkdtemp(prefix="factmill-metrics-")
    # Written, not read: uvicorn's processes inherit it, and their prometheus_client and Settings read it.
    os.environ["PROMETHEUS_MULTIPROC_DIR"] = folder
    try:
        yield
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def worker(
    queues: Annotated[
        str, typer.Option(help="Comma-separated queues to consume; all: every job kind's and maintenance.")
    ] = "all",
    concurrency: Annotated[
        int | None,
        typer.Option(
            min=1,
            max=MAX_JOBS_IN_FLIGHT,
            help="Jobs in flight per process (threads); default FACTMILL_LLM_CONCURRENCY. With --pool "
            f"prefork: child processes, default one per core, at most {MAX_WORKER_PROCESSES}.",
        ),
    ] = None,
    processes: Annotated[
        int | None,
        typer.Option(
            min=1,
            max=MAX_WORKER_PROCESSES,
            help="Worker processes, each with its own LLM pipe; default one per core (one on the embedded "
            "Postgres).",
        ),
    ] = None,
    pool: Annotated[str, typer.Option(help="threads (I/O-bound LLM calls), prefork or solo.")] = "threads",
    loglevel: Annotated[str, typer.Option(help=LOGLEVEL_HELP)] = "info",
    hostname: Annotated[
        str | None,
        typer.Option(
            help="Celery node name (default celery@<host>; with several processes factmill-N@<host>)."
        ),
    ] = None,
    child: Annotated[
        bool, typer.Option(hidden=True, help="One of a worker's processes (it says no notes).")
    ] = False,
) -> None:
    """Run Celery workers for the given queues: one process per core unless --processes says otherwise.

    Each process runs --concurrency jobs and FACTMILL_LLM_CONCURRENCY LLM calls at once."""
    settings = get_settings()
    refuse_insecure_secrets(settings, runs_jobs=True, holds_secrets=False)  # it reads neither secret
    refuse_missing_tracing(settings)
    try:
        queues = worker_queues(queues, known_queues())
    except ValueError as exc:
        raise fail(str(exc), code=2) from exc
    refuse_a_stall_limit_below_a_call(settings, queues.split(","))
    if pool not in POOLS:
        raise fail("--pool must be threads, prefork or solo", code=2)
    loglevel = checked_loglevel(loglevel)
    # Not before the schema is at head: a job run against a half-migrated database fails on a missing
    # column and spends its attempts. Kubernetes restarts the pod until the migrate Job has finished.
    checked_factory(settings, wait=True)
    if not child:  # (said once, by the parent, not by each of its processes)
        say_where_jobs_go(settings)
    if pool == "prefork":  # -c counts child processes, each with its own pools and LLM pipe (64 forked)
        if concurrency is not None and concurrency > MAX_WORKER_PROCESSES:
            raise fail(
                f"--concurrency with --pool prefork is at most {MAX_WORKER_PROCESSES} processes", code=2
            )
        jobs = concurrency or default_processes()
    else:
        jobs = concurrency or settings.llm_concurrency
    # prefork forks processes of its own (one job each); the threads pool needs them from here.
    count = worker_processes(processes, pool, embedded_database=not settings.database_url)
    if count > 1:
        argv = ["worker", "--queues", queues, "--concurrency", str(jobs), "--processes", "1", "--child"]
        argv += ["--pool", pool, "--loglevel", loglevel]
        argvs = [[*argv, "--hostname", child_hostname(hostname, n)] for n in range(count)]
        raise typer.Exit(run_children(argvs, settings.grace_seconds))
    configure_logging(settings, loglevel)
    argv = ["worker", "-Q", queues, "-c", str(jobs), "-P", pool, "-l", loglevel]
    argv += ["--without-gossip", "--without-mingle"]
    if settings.task_events:  # else off until Flower turns them on (FACTMILL_TASK_EVENTS)
        argv.append("-E")
    if hostname:
        argv += ["-n", hostname]
    raise typer.Exit(celery_exit_code(argv))


def celery_exit_code(argv: list[str]) -> int:
    """Run the Celery command ``argv`` and return its exit code. ``Celery.worker_main`` and ``start``
    drop it (click returns it with standalone_mode off), so `factmill worker` exited 0 after an
    unrecoverable error or a cold shutdown, and a supervisor's restart-on-failure never fired. This is
    what ``Celery.start`` does, keeping the code."""
    from celery.bin.celery import celery as celery_command  # (100 ms of imports every command skips)

    celery_command.params[0].default = celery  # the --app option's default: this app
    try:
        code = celery_command.main(args=argv, standalone_mode=False)
    except click.ClickException as exc:  # what click's standalone mode shows and exits with
        exc.show()
        return exc.exit_code
    except click.Abort:
        return 1
    finally:
        celery_command.params[0].default = None
    return code if isinstance(code, int) else 0


def worker_queues(text: str, known: Sequence[str]) -> str:
    """``--queues`` as Celery must get it: names stripped, in order, once each. Celery splits on commas
    without stripping, so "extraction, maintenance" consumed a queue " maintenance" no one sends to."""
    if text.strip().lower() == "all":
        # The default: "extraction,maintenance" left consolidation (asked for by every extraction),
        # compaction and calibration queued for good on a setup that ran `factmill worker` alone.
        return ",".join(known)
    names = list(dict.fromkeys(name.strip() for name in text.split(",") if name.strip()))
    unknown = [name for name in names if name not in known]
    if unknown or not names:
        raise ValueError(
            f"unknown queue(s) {', '.join(unknown) or repr(text)}; choose from {', '.join(known)}"
        )
    return ",".join(names)


def beat(loglevel: Annotated[str, typer.Option(help=LOGLEVEL_HELP)] = "info") -> None:
    """Run Celery beat (the sweeper every 30 s, and later schedules)."""
    loglevel = checked_loglevel(loglevel)
    settings = get_settings()
    # It only schedules: workers call the model, the API holds the secrets.
    refuse_insecure_secrets(settings, calls_models=False, holds_secrets=False)
    refuse_missing_tracing(settings)
    checked_factory(
        settings, wait=True
    )  # its sweeps read and write the jobs as the migrations last left them
    say_where_jobs_go(settings)
    settings.data_dir.mkdir(parents=True, exist_ok=True)
    configure_logging(settings, loglevel)
    raise typer.Exit(
        celery_exit_code(["beat", "-l", loglevel, "-s", str(settings.data_dir / "celerybeat-schedule")])
    )


def flower(
    host: Annotated[
        str,
        typer.Option(
            help="The address Flower listens on. Beyond this host, production needs FLOWER_BASIC_AUTH "
            "(user:password) or FLOWER_AUTH."
        ),
    ] = "127.0.0.1",
    port: Annotated[int, port_option(help="The port Flower listens on.")] = 5555,
) -> None:
    """Run Flower on the same broker to watch workers, queues and tasks."""
    settings = get_settings()
    refuse_unset_servers(settings, "broker_url")
    refuse_open_flower(settings, host)
    os.environ.update(flower_logins(settings))
    raise typer.Exit(celery_exit_code(flower_argv(host, port)))


def flower_argv(host: str, port: int) -> list[str]:
    """Celery's command line for Flower: its address, and its memory bounds (an option Flower does not
    know ends it at start, so tests/integration/test_service.py's Flower checks these are taken)."""
    bounds = [f"--max_tasks={FLOWER_MAX_TASKS}", f"--purge_offline_workers={FLOWER_PURGE_OFFLINE_SECONDS}"]
    return ["flower", f"--address={host}", f"--port={port}", *bounds]


# Flower keeps this many tasks' events (its default, 100,000 of about 3 KB each, is some 300 MB in a pod
# of 512Mi), and forgets a worker offline this long (every pod KEDA scaled in stayed listed for good,
# with a flower_worker_online series of its own).
FLOWER_MAX_TASKS = 10_000
FLOWER_PURGE_OFFLINE_SECONDS = 600


def flower_logins(settings: Settings) -> dict[str, str]:
    """The login variables Flower reads from the environment, as Settings read them: from .env too,
    where Flower alone would not look (it started with no login after the check had seen one)."""
    logins = {"FLOWER_BASIC_AUTH": settings.flower_basic_auth, "FLOWER_AUTH": settings.flower_auth}
    return {name: value for name, value in logins.items() if value}


# Flower's own login: the shortest password production takes beyond this host, and the ones refused
# whatever their length (README and the compose file show `user:password`; a copied example was a login).
MIN_FLOWER_PASSWORD_CHARS = 12
PLACEHOLDER_FLOWER_PASSWORDS = frozenset({"password", "changeme", "change-me", "secret", "admin", "flower"})


def weak_flower_login(basic_auth: str) -> str | None:
    """Why a FLOWER_BASIC_AUTH (``user:password[,user:password]``) is not a login production may publish
    (the user it concerns named, never the password), or None."""
    for entry in basic_auth.split(","):
        user, _, password = entry.strip().partition(":")
        if password.lower() in PLACEHOLDER_FLOWER_PASSWORDS or password == user:
            return f"FLOWER_BASIC_AUTH's password for {user!r} is a placeholder"
        if len(password) < MIN_FLOWER_PASSWORD_CHARS:
            return (
                f"FLOWER_BASIC_AUTH's password for {user!r} is shorter than {MIN_FLOWER_PASSWORD_CHARS} "
                "characters (e.g. `openssl rand -hex 16`)"
            )
    return None


def refuse_open_flower(settings: Settings, host: str) -> None:
    """Flower with no login shows every task, worker and queue to whoever reaches it (and can shut
    workers down): beyond this host, refused in production (exit 2) and warned about otherwise; as is,
    in production, a placeholder or short password."""
    if is_loopback(host):
        return
    weak = weak_flower_login(settings.flower_basic_auth) if settings.flower_basic_auth else None
    if weak and settings.environment == "production":
        raise fail(f"{weak}; Flower on {host or 'every address'} can stop workers", code=2, highlight=False)
    if settings.flower_basic_auth or settings.flower_auth:
        return
    message = (
        f"Flower on {host or 'every address'} would show every task, worker and queue to anyone who "
        "reaches it; set FLOWER_BASIC_AUTH=user:password (or FLOWER_AUTH), or listen on 127.0.0.1"
    )
    if settings.environment == "production":
        raise fail(message, code=2, highlight=False)
    err.print(styled(("warning:", "yellow"), f" {message}"), highlight=False)


LEGACY_SIGNATURES = ("accept_v2_signatures", "accept_v3_signatures")


def warn_of_unchosen_legacy_signatures(settings: Settings) -> None:
    """In production, the v2 and v3 signatures left on by default, said once at start: a captured v3
    delivery verifies for another transcript id, and a v2 one sent without an Idempotency-Key may be
    stored twice within the tolerance. On for senders that predate v4 (a default turned off would refuse
    their deliveries after an upgrade), so chosen, either way, it is not said."""
    unchosen = [n for n in LEGACY_SIGNATURES if getattr(settings, n) and n not in settings.model_fields_set]
    if settings.environment != "production" or not unchosen:
        return
    names = " and ".join(f"FACTMILL_{name.upper()}" for name in unchosen)
    message = (
        f"{names} {'accepts' if len(unchosen) == 1 else 'accept'} the older signatures by default: set false "
        "once every sender signs v4 "
        "(factmill_client does; a captured v3 or unkeyed v2 delivery can be re-aimed or stored twice), "
        "or true to keep them"
    )
    err.print(styled(("warning:", "yellow"), f" {message}"), highlight=False)


def refuse_published_secrets(settings: Settings, host: str) -> None:
    """Beyond this host, a development default secret is everyone's credential: the admin token
    "dev-admin-token" gave whoever reached the port every route (erase, config, keys' work), and the
    webhook secret "dev-secret" let anyone sign pages. Refused in every environment (exit 2), as are
    the other placeholders production refuses ("changeme", "secret"), and the previous webhook secret
    of a rotation away from the default (it still signed pages)."""
    if is_loopback(host):
        return
    published = [f"FACTMILL_{name.upper()}" for name in settings.placeholder_secrets()]
    if published:
        raise fail(
            f"{' and '.join(published)} still hold a published or placeholder value, and "
            f"{host or 'every address'} is reachable beyond this host: set your own (e.g. `openssl rand "
            "-hex 32`), or listen on 127.0.0.1",
            code=2,
            highlight=False,
        )
