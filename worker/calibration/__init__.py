"""Calibration: labelled observations in, split-conformal threshold versions out, τ read back by gates.

The pure parts live in ``worker.core.calibration``; ``store`` owns the transactions, ``service`` the
flow (described there), ``job`` the recompute job kind. The names below are the ones callers import
from ``worker.calibration``; the factory-taking functions come from ``entrypoints``.
"""

from __future__ import annotations

from worker.calibration.entrypoints import (
    ThresholdCache,
    add_observation,
    add_observations,
    import_csv,
    recompute,
    request_recompute,
    retire_active_version,
)
from worker.calibration.job import KIND, PAUSED_REASON, recompute_job
from worker.calibration.queries import (
    RECOMPUTE_LOCK_ID,
    SUBJECT,
    AddReport,
    ObservationsBusyError,
    ObservationStats,
    StoredObservation,
    active_threshold,
    coverages_by_label,
    load_observations,
    observation_stats,
    observations_since_last_version,
    request_recompute_if_due,
    store_observations,
    threshold_history,
)
from worker.calibration.service import ImportReport, ThresholdResult, Trigger
from worker.calibration.store import CalibrationStore
from worker.core.calibration import (
    FALLBACK,
    MAX_KEY_LENGTH,
    MAX_ORIGIN_LENGTH,
    METHOD,
    SPLIT_METHOD,
    SPLIT_SALT,
    ActiveThreshold,
    Evaluation,
    Observation,
    ObservationError,
    ObservationIn,
    UnknownCompactionError,
    describe_tau,
    evaluate,
    one_case_per_compaction,
    split_observations,
)
from worker.core.calibration_csv import CsvFormatError, parse_observations_csv

__all__ = [
    "FALLBACK",
    "KIND",
    "MAX_KEY_LENGTH",
    "MAX_ORIGIN_LENGTH",
    "METHOD",
    "PAUSED_REASON",
    "RECOMPUTE_LOCK_ID",
    "SPLIT_METHOD",
    "SPLIT_SALT",
    "SUBJECT",
    "ActiveThreshold",
    "AddReport",
    "CalibrationStore",
    "CsvFormatError",
    "Evaluation",
    "ImportReport",
    "Observation",
    "ObservationError",
    "ObservationIn",
    "ObservationStats",
    "ObservationsBusyError",
    "StoredObservation",
    "ThresholdCache",
    "ThresholdResult",
    "Trigger",
    "UnknownCompactionError",
    "active_threshold",
    "add_observation",
    "add_observations",
    "coverages_by_label",
    "describe_tau",
    "evaluate",
    "import_csv",
    "load_observations",
    "observation_stats",
    "observations_since_last_version",
    "one_case_per_compaction",
    "parse_observations_csv",
    "recompute",
    "recompute_job",
    "request_recompute",
    "request_recompute_if_due",
    "retire_active_version",
    "split_observations",
    "store_observations",
    "threshold_history",
]
