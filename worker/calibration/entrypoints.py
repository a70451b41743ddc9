"""Calibration as callers call it: entry points that take a sessionmaker, build the store, run the service."""

from __future__ import annotations

import functools
import time
from collections.abc import Callable
from typing import Concatenate, ParamSpec, TypeVar

from sqlalchemy.orm import Session, sessionmaker

from worker.calibration import service
from worker.calibration.store import CalibrationStore

P = ParamSpec("P")
R = TypeVar("R")


def _on_store(
    operation: Callable[Concatenate[CalibrationStore, P], R],
) -> Callable[Concatenate[sessionmaker[Session], P], R]:
    """``operation`` with its store built from a session factory (the rest of its arguments unchanged)."""

    @functools.wraps(operation)
    def entry(factory: sessionmaker[Session], /, *args: P.args, **kwargs: P.kwargs) -> R:
        return operation(CalibrationStore(factory), *args, **kwargs)

    return entry


add_observations = _on_store(service.add_observations)
add_observation = _on_store(service.add_observation)
request_recompute = _on_store(service.request_recompute)
import_csv = _on_store(service.import_csv)
recompute = _on_store(service.recompute)
retire_active_version = _on_store(service.retire_active)


class ThresholdCache(service.ThresholdCache):
    """``service.ThresholdCache`` reading the active τ through a CalibrationStore on ``factory``."""

    def __init__(
        self, factory: sessionmaker[Session], ttl: float, clock: Callable[[], float] = time.monotonic
    ) -> None:
        super().__init__(CalibrationStore(factory), ttl, clock)
