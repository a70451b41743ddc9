"""Calibration: coverage observations (did a cut keep the answer?) and the versioned thresholds they yield."""

from __future__ import annotations

from datetime import datetime

from sqlalchemy import (
    BigInteger,
    Boolean,
    CheckConstraint,
    ForeignKey,
    Index,
    Integer,
    text,
)
from sqlalchemy.orm import Mapped, mapped_column

from models.base import Base, count_column, utcnow_column


class CalibrationObservation(Base):
    """One labelled case: the coverage a compression scored, and whether it kept the answer."""

    __tablename__ = "calibration_observations"
    # NaN fails this check too: Postgres orders NaN above every number, so NaN <= 1 is false.
    __table_args__ = (CheckConstraint("coverage >= 0 AND coverage <= 1", name="coverage"),)

    id: Mapped[int] = mapped_column(BigInteger, primary_key=True)
    coverage: Mapped[float]
    answer_kept: Mapped[bool] = mapped_column(Boolean, nullable=False)
    # Where the label came from: "api", "cli", "csv:<file>", an evaluation run's name...
    origin: Mapped[str]
    # The compaction that was judged; deleting it keeps the observation (it still calibrates).
    compaction_id: Mapped[int | None] = mapped_column(
        BigInteger, ForeignKey("compactions.id", ondelete="SET NULL"), index=True
    )
    # A repeated submission carries the same key and is reported as a duplicate, not stored twice.
    # NULL (no client key, no compaction id) never conflicts: two equal labels can be two real cases.
    dedupe_key: Mapped[str | None] = mapped_column(unique=True)
    created_at: Mapped[datetime] = utcnow_column()


class CalibrationThreshold(Base):
    """One recompute: the candidate τ, how it did on held-out data, and whether it became the active one."""

    __tablename__ = "calibration_thresholds"
    __table_args__ = (
        CheckConstraint("tau IS NULL OR (tau >= 0 AND tau <= 1)", name="tau"),
        CheckConstraint("alpha > 0 AND alpha < 1", name="alpha"),
        CheckConstraint("target_recall > 0 AND target_recall < 1", name="target_recall"),
        CheckConstraint(
            "held_out_rate IS NULL OR (held_out_rate >= 0 AND held_out_rate <= 1)", name="held_out_rate"
        ),
        CheckConstraint("NOT active OR tau IS NOT NULL", name="active_has_tau"),
        # At most one version gates summaries at a time.
        Index(
            "uq_calibration_thresholds_active",
            "active",
            unique=True,
            postgresql_where=text("active"),
        ),
    )

    version: Mapped[int] = mapped_column(Integer, primary_key=True)
    # None: no threshold was computed (too few observations, or the data cannot support one).
    tau: Mapped[float | None]
    alpha: Mapped[float]
    target_recall: Mapped[float]
    min_observations: Mapped[int]
    # Provenance: the observations with id <= max_observation_id, split by `split_method`.
    n: Mapped[int]
    n_bad: Mapped[int]
    max_observation_id: Mapped[int | None] = mapped_column(BigInteger)
    split_method: Mapped[str]
    calibration_n: Mapped[int] = count_column()
    calibration_n_bad: Mapped[int] = count_column()
    held_out_n: Mapped[int] = count_column()
    held_out_n_bad: Mapped[int] = count_column()
    # Held-out cases with coverage >= tau, and the share of them that kept the answer.
    held_out_accepted: Mapped[int] = count_column()
    held_out_rate: Mapped[float | None]
    active: Mapped[bool] = mapped_column(Boolean, nullable=False, server_default="false")
    # Why it was activated, or why not.
    reason: Mapped[str]
    # What asked for it: "schedule", "observations", "manual"...
    trigger: Mapped[str]
    # Indexed: deleting an expired job looks here for versions naming it (models.job.expire_jobs).
    job_id: Mapped[int | None] = mapped_column(
        BigInteger, ForeignKey("jobs.id", ondelete="SET NULL"), index=True
    )
    computed_at: Mapped[datetime] = utcnow_column()
    activated_at: Mapped[datetime | None]
