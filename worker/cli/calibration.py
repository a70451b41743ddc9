"""`factmill calibration`: add and import observations, show and plot the threshold, history, recompute."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

import typer
from sqlalchemy.orm import Session, sessionmaker

from models import CalibrationThreshold
from models.reads import one_snapshot
from worker.calibration import (
    FALLBACK,
    ActiveThreshold,
    CsvFormatError,
    ObservationError,
    ObservationIn,
    ObservationsBusyError,
    active_threshold,
    add_observation,
    coverages_by_label,
    describe_tau,
    import_csv,
    observation_stats,
    recompute,
    request_recompute,
    retire_active_version,
    threshold_history,
)
from worker.cli.console import counting_bar, err, fail, fields, folding_table, out, print_json, styled, when
from worker.cli.sessions import checked_factory
from worker.config_store import CALIBRATION_ENABLED, get_config, is_enabled
from worker.core.jsonvalues import BIGINT_MAX
from worker.extraction.ingest import shown_path
from worker.jobs.sending import enqueue
from worker.settings import get_settings

calibration_app = typer.Typer(
    help="Calibration of the summary quality gate: observations, thresholds, history, plot.",
    no_args_is_help=True,
)

VERSION_FIELDS = (
    "version",
    "tau",
    "active",
    "reason",
    "alpha",
    "target_recall",
    "min_observations",
    "n",
    "n_bad",
    "calibration_n",
    "calibration_n_bad",
    "held_out_n",
    "held_out_n_bad",
    "held_out_accepted",
    "held_out_rate",
    "split_method",
    "max_observation_id",
    "trigger",
    "job_id",
    "computed_at",
    "activated_at",
)
STATS_FIELDS = ("n", "kept", "lost", "since_last_version", "last_at")


def _print_json(data: Any) -> None:
    print_json(data, ensure_ascii=False)  # reasons and τ stay readable


def _send(factory: sessionmaker[Session], pairs: list[tuple[int, str]]) -> int:
    return enqueue(factory, pairs) if pairs else 0


def _tau(value: float | None) -> str:
    return "—" if value is None else describe_tau(value)


def _rate(value: float | None) -> str:
    return "—" if value is None else f"{value:.3f}"


# ---------------------------------------------------------------------------
# add / import
# ---------------------------------------------------------------------------


@calibration_app.command("add")
def add(
    coverage: Annotated[float, typer.Option(help="Coverage the summary scored, from 0 to 1.")],
    kept: Annotated[bool, typer.Option("--kept/--lost", help="Did the summary keep the answer?")],
    origin: Annotated[str, typer.Option(help="Who judged it.")] = "cli",
    compaction_id: Annotated[
        int | None, typer.Option(min=1, max=BIGINT_MAX, help="The compaction judged.")
    ] = None,
    key: Annotated[str | None, typer.Option(help="Idempotency key: adding it again is a no-op.")] = None,
    enqueue: Annotated[bool, typer.Option(help="Send a due recompute to the broker now.")] = True,
    as_json: Annotated[bool, typer.Option("--json", help="Print a JSON report.")] = False,
) -> None:
    """Record one observation: the coverage a compaction scored and whether it kept the answer."""
    try:
        observation = ObservationIn(coverage, kept, origin, compaction_id, key)
    except ObservationError as exc:
        raise fail(str(exc), code=2) from exc
    factory = checked_factory()
    settings = get_settings()
    try:
        report = add_observation(factory, observation, recompute_every=settings.calibration_recompute_every)
    except ObservationError as exc:
        raise fail(str(exc), code=2) from exc
    sent = _send(factory, report.pending_jobs()) if enqueue else 0
    [stored] = report.stored
    job = report.recompute.job_id if report.recompute is not None else None
    if as_json:
        _print_json(
            {"id": stored.id, "duplicate": stored.duplicate, "recompute_job_id": job, "enqueued": sent}
        )
        return
    if stored.duplicate:
        out.print(f"duplicate: observation {stored.id} already records this; nothing added")
    else:
        out.print(f"observation {stored.id} added (coverage {observation.coverage:g}, {_label(kept)})")
    if job is not None:
        out.print(f"recompute job {job} requested")


def _label(kept: bool) -> str:
    return "answer kept" if kept else "answer lost"


@calibration_app.command("import")
def import_file(
    file: Annotated[
        Path, typer.Argument(help="CSV: coverage,answer_kept,origin[,compaction_id], optional header.")
    ],
    origin: Annotated[str | None, typer.Option(help="Origin for rows that leave it blank.")] = None,
    enqueue: Annotated[bool, typer.Option(help="Send a due recompute to the broker now.")] = True,
    as_json: Annotated[bool, typer.Option("--json", help="Print a JSON report.")] = False,
) -> None:
    """Import observations from a CSV file; bad rows are reported by line and the good ones kept.

    answer_kept accepts true/false, 1/0, yes/no or kept/lost. Importing the same file again adds nothing.
    """
    if not file.is_file():
        if file.is_dir():
            raise fail(f"{file} is a directory; give a CSV file", code=2)
        if file.exists():  # (/dev/stdin, a process substitution's /dev/fd/63)
            raise fail(f"{file} is not a regular file (a pipe or a device); save it to a file first", code=2)
        raise fail(f"no such file: {file}", code=2)
    factory = checked_factory()
    try:
        with counting_bar("observations stored", None, enabled=not as_json) as move:
            report = import_csv(
                factory,
                file,
                origin=origin,
                recompute_every=get_settings().calibration_recompute_every,
                progress=lambda stored, total: move(completed=stored, total=total),
            )
    except (CsvFormatError, OSError, ObservationError) as exc:
        raise fail(str(exc), code=2) from exc  # each names the file, or the --origin refused
    sent = _send(factory, report.pending_jobs()) if enqueue else 0
    job = report.recompute.job_id if report.recompute is not None else None
    if as_json:
        _print_json(
            {
                "rows": report.rows,
                "added": len(report.added),
                "duplicates": len(report.duplicates),
                "errors": [{"line": line, "error": message} for line, message in report.errors],
                "comment_lines": report.comments,
                "recompute_job_id": job,
                "enqueued": sent,
            }
        )
    else:
        out.print(
            f"{report.rows} row(s): {len(report.added)} added, {len(report.duplicates)} duplicate(s), "
            f"{len(report.errors)} error(s)"
        )
        for line, message in report.errors:
            err.print(styled((f"line {line}:", "yellow"), f" {message}"), highlight=False)
        if report.comments:
            shown = ", ".join(map(str, report.comments[:10])) + (", ..." if len(report.comments) > 10 else "")
            err.print(
                styled(
                    ("note:", "yellow"),
                    f" {len(report.comments)} line(s) starting with # were skipped "
                    f"as comments (line {shown}); a row whose first value starts with # is one of them",
                ),
                highlight=False,
            )
        if job is not None:
            out.print(f"recompute job {job} requested")
    if report.errors:  # the good rows are stored, but a script must see that rows were dropped
        raise typer.Exit(1)


# ---------------------------------------------------------------------------
# show / history / recompute
# ---------------------------------------------------------------------------


@calibration_app.command("show")
def show(
    plot: Annotated[
        Path | None, typer.Option(help="Write a PNG of kept vs lost coverage and the chosen τ here.")
    ] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON.")] = False,
) -> None:
    """The threshold gates use now, where it came from, and the observations behind it."""
    factory = checked_factory()
    with one_snapshot(factory) as session:  # a version activated meanwhile shows in all or none
        current = active_threshold(session)
        stats = observation_stats(session)
        newest = threshold_history(session, 1)
        latest = newest[0] if newest else None
        active_row = (
            session.get(CalibrationThreshold, current.version) if current.version is not None else None
        )
        kept, lost = coverages_by_label(session) if plot is not None else ([], [])
    if plot is not None:
        if not kept and not lost:
            raise fail("no observations to plot yet; add some with `factmill calibration add` or `import`")
        try:
            render_plot(plot, kept, lost, current, active_row, latest)
        except MissingMatplotlibError as exc:
            raise fail(str(exc), code=2) from exc
        except OSError as exc:
            raise fail(f"could not write {plot}: {exc}") from exc
    if as_json:
        _print_json(
            {
                "tau": current.tau,
                "version": current.version,
                "fallback": current.version is None,
                "observations": fields(stats, STATS_FIELDS),
                "active": fields(active_row, VERSION_FIELDS) if active_row is not None else None,
                "latest": fields(latest, VERSION_FIELDS) if latest is not None else None,
                "plot": shown_path(plot) if plot is not None else None,
            }
        )
        return
    if current.version is None:
        out.print(f"τ = {current.tau:g} (fallback: no calibrated version is active)")
    else:
        out.print(f"τ = {describe_tau(current.tau)} (version {current.version})")
        if active_row is not None:
            out.print(f"  {active_row.reason}", highlight=False)
    out.print(
        f"observations: {stats.n} ({stats.kept} kept, {stats.lost} lost); "
        f"{stats.since_last_version} since the last version"
    )
    if latest is not None and latest.version != current.version:
        out.print(
            f"latest version {latest.version} (not active, τ {_tau(latest.tau)}): {latest.reason}",
            highlight=False,
        )
    if plot is not None:
        out.print(f"plot written to {shown_path(plot)}", highlight=False)


@calibration_app.command("history")
def history(
    limit: Annotated[int, typer.Option(min=1, max=10_000, help="Versions to list.")] = 20,
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON.")] = False,
) -> None:
    """Threshold versions, newest first: τ, data, held-out rate, and why each was activated or not."""
    with checked_factory()() as session:
        rows = threshold_history(session, limit)
    if as_json:
        _print_json([fields(row, VERSION_FIELDS) for row in rows])
        return
    if not rows:
        out.print("no threshold versions yet; run `factmill calibration recompute`")
        return
    # The reasons are sentences: listed under the table rather than squeezed into a column.
    table = folding_table("version", "active", "τ", "n", "lost", "held-out", "trigger", "computed (UTC)")
    for row in rows:
        table.add_row(
            str(row.version),
            "yes" if row.active else "",
            _tau(row.tau),
            str(row.n),
            str(row.n_bad),
            _rate(row.held_out_rate),
            row.trigger,
            when(row.computed_at),
        )
    out.print(table)
    for row in rows:
        out.print(f"version {row.version}: {row.reason}", highlight=False)


@calibration_app.command("recompute")
def recompute_command(
    now: Annotated[bool, typer.Option("--now", help="Compute here instead of queueing a job.")] = False,
    force: Annotated[
        bool, typer.Option(help="With --now: write a version even if nothing changed since the last.")
    ] = False,
    override_disabled: Annotated[
        bool, typer.Option(help=f"With --now: run even if {CALIBRATION_ENABLED} is off.")
    ] = False,
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON.")] = False,
) -> None:
    """Recompute the threshold: queue a job on the calibration queue, or run it now with --now.

    A queued job is paused while the calibration.enabled kill switch is off, and runs when it is
    turned back on; --now refuses to run then unless --override-disabled.
    """
    factory = checked_factory()
    settings = get_settings()
    if not now:
        if force or override_disabled:
            raise fail("--force and --override-disabled need --now", code=2)
        request = request_recompute(factory, trigger="manual")
        if as_json:
            _print_json({"job_id": request.job_id, "created": request.created})
        elif request.created:
            out.print(f"recompute job {request.job_id} queued")
        else:
            out.print(f"recompute job {request.job_id} is already pending")
        return

    def refuse_if_disabled() -> None:
        """Before the run, and again before its version is written: it may have waited on the recompute
        lock behind a job meanwhile, and a τ went live after the switch went off (the job checks too)."""
        if override_disabled:
            return
        with factory() as session:
            enabled = is_enabled(get_config(session, CALIBRATION_ENABLED))
        if not enabled:
            raise fail(
                f"calibration is disabled ({CALIBRATION_ENABLED}=false). Turn it on with "
                f"`factmill config set {CALIBRATION_ENABLED} true`, "
                "or pass --override-disabled for a one-off run.",
                code=3,
            )

    refuse_if_disabled()
    try:
        result = recompute(
            factory,
            alpha=settings.calibration_alpha,
            target_recall=settings.calibration_target_recall,
            min_observations=settings.calibration_min_observations,
            trigger="manual",
            force=force,
            guard=refuse_if_disabled,
        )
    except ValueError as exc:
        raise fail(str(exc), code=2) from exc
    except ObservationsBusyError as exc:
        raise fail(f"{exc}; run it again in a moment", code=1) from None
    if as_json:
        _print_json(result.as_dict())
        return
    headline = {
        "activated": f"version {result.version} activated: τ = {_tau(result.tau)}",
        "kept": f"version {result.version} recorded, not activated (τ {_tau(result.tau)})",
        "unchanged": f"nothing new since version {result.version}; nothing written (--force to recompute)",
    }[result.outcome]
    out.print(headline)
    out.print(f"  {result.reason}", highlight=False)
    out.print(f"gates use τ = {describe_tau(result.active.tau)}" + _version_note(result.active))


@calibration_app.command("retire")
def retire_command(
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON.")] = False,
) -> None:
    """Retire the active threshold version: gates take the fallback τ until one is earned.

    Workers see it within FACTMILL_THRESHOLD_CACHE_SECONDS; a recompute with nothing new activates
    nothing, and `recompute --now --force` evaluates again."""
    retired = retire_active_version(checked_factory())
    if as_json:
        _print_json(
            {
                "retired_version": retired.version,
                "retired_tau": retired.tau if retired.version is not None else None,
            }
        )
        return
    if retired.version is None:
        out.print(f"no version is active; gates use the fallback τ = {describe_tau(FALLBACK.tau)}")
        return
    out.print(f"version {retired.version} (τ = {_tau(retired.tau)}) retired")
    out.print(
        f"gates use the fallback τ = {describe_tau(FALLBACK.tau)} until a recompute earns a new version "
        "(`factmill calibration recompute --now --force` evaluates again)",
        highlight=False,
    )


def _version_note(active: ActiveThreshold) -> str:
    return f" (version {active.version})" if active.version is not None else " (fallback)"


# ---------------------------------------------------------------------------
# The plot
# ---------------------------------------------------------------------------


class MissingMatplotlibError(RuntimeError):
    pass


def plot_bins(tau: float, width: float = 0.05) -> list[float]:
    """Histogram edges over [0, 1] with ``tau`` as one edge.

    Bins are closed on the left, so with τ on an edge every case left of the τ line is one the gate
    reverts (coverage < τ) and every case right of it one it accepts, even when τ sits one epsilon
    above a pile of cases (fixed edges would draw those on the accepted side).
    """
    below = [tau - k * width for k in range(1, int(tau / width) + 1) if tau - k * width > 1e-9]
    above = [tau + k * width for k in range(1, int((1 - tau) / width) + 1) if tau + k * width < 1 - 1e-9]
    inner = [*reversed(below), tau, *above] if 0.0 < tau < 1.0 else [*reversed(below), *above]
    return [0.0, *inner, 1.0]


def render_plot(
    path: Path,
    kept: list[float],
    lost: list[float],
    active: ActiveThreshold,
    active_row: CalibrationThreshold | None,
    latest: CalibrationThreshold | None,
) -> None:
    """A PNG: the coverage of kept and of lost cases, the active τ (shading what it reverts), and a newer
    candidate τ that was not activated."""
    try:  # here, not at the top: matplotlib is an optional extra (factmill[bench]) only the plot needs
        from matplotlib.figure import Figure
    except ImportError:
        raise MissingMatplotlibError(
            "the plot needs matplotlib; install it with `pip install 'factmill[bench]'`"
        ) from None

    figure = Figure(figsize=(8, 4.8), dpi=120)  # no pyplot: no global state, no display needed
    axes = figure.subplots()
    if active.tau > 0:
        axes.axvspan(0, active.tau, color="#8d99ae", alpha=0.15, label="reverted (coverage < τ)")
    bins = plot_bins(active.tau)
    for values, colour, label in (
        (kept, "#2a9d8f", f"answer kept ({len(kept)})"),
        (lost, "#e76f51", f"answer lost ({len(lost)})"),
    ):
        axes.hist(values, bins=bins, histtype="stepfilled", color=colour, alpha=0.55, label=label)
        axes.hist(values, bins=bins, histtype="step", color=colour, linewidth=1.2)
    if active.version is None:
        label = f"fallback τ = {active.tau:g} (no version active)"
    else:
        label = f"active τ = {describe_tau(active.tau)} (version {active.version})"
    axes.axvline(active.tau, color="#264653", linewidth=2, label=label)
    if latest is not None and latest.tau is not None and latest.version != active.version:
        axes.axvline(
            latest.tau,
            color="#264653",
            linestyle="--",
            linewidth=1.5,
            label=f"candidate τ = {describe_tau(latest.tau)} (version {latest.version}, not activated)",
        )
    axes.set_xlim(0, 1)
    axes.set_ylim(0, axes.get_ylim()[1] * 1.45)  # headroom: the legend and the provenance box sit on top
    axes.set_xlabel("coverage")
    axes.set_ylabel("observations")
    axes.set_title("Summary quality gate: coverage of kept vs lost cases")
    if active_row is not None:
        rate = "—" if active_row.held_out_rate is None else f"{active_row.held_out_rate:.3g}"
        axes.text(
            0.99,
            0.98,
            f"version {active_row.version}: n={active_row.n} ({active_row.n_bad} lost), "
            f"α={active_row.alpha:g}, target {active_row.target_recall:g}\n"
            f"held-out answer-kept rate {rate} over {active_row.held_out_accepted} accepted",
            transform=axes.transAxes,
            ha="right",
            va="top",
            fontsize="small",
            bbox={"boxstyle": "round", "facecolor": "white", "alpha": 0.8, "edgecolor": "#cccccc"},
        )
    axes.legend(loc="upper left", fontsize="small")
    figure.tight_layout()
    figure.savefig(path, format="png")
