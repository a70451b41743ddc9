"""The mutable state of one running simulator: config, seeded draws, prompt-prefix cache, stats, batches."""

from __future__ import annotations

import threading
from collections import Counter, OrderedDict, deque
from collections.abc import Mapping, Sequence
from typing import Any

from starlette.requests import Request

from worker.simulator.batches import BatchStore
from worker.simulator.caching import Digests
from worker.simulator.config import Draw, Fault, SeededDraws, SimulatorConfig
from worker.simulator.prompt import PromptMessage

# How many recent chat prompts the simulator keeps for inspection (GET /_simulator/requests).
RECENT_REQUESTS = 32


class SimulatorState:
    """Mutable state of one simulator app. Guarded by a lock: the Python API reads it from other threads."""

    def __init__(self, config: SimulatorConfig) -> None:
        self._lock = threading.Lock()
        self.config = config
        self._initial_config = config
        self._prefixes: OrderedDict[str, int] = OrderedDict()
        self.store = BatchStore()
        self._reset_unlocked()

    def _reseed(self) -> None:
        self._draws = SeededDraws(self.config.seed)

    def _reset_unlocked(self) -> None:
        self._reseed()
        self._prefixes.clear()
        self.requests = 0
        self.by_route: Counter[str] = Counter()
        self.by_outcome: Counter[str] = Counter()
        self.by_route_outcome: dict[str, Counter[str]] = {}
        self.counters: Counter[str] = Counter()
        # What is in flight now is no past stat: a reset while calls were answered (a test's fixture, after
        # the last test's call timed out) took the count below zero when they ended.
        self.in_flight: int = getattr(self, "in_flight", 0)
        self.max_in_flight = self.in_flight
        # By route: a benchmark of the extraction pipe counts chat calls, not its background embeddings.
        if not hasattr(self, "in_flight_by_route"):
            self.in_flight_by_route: Counter[str] = Counter()
        self._recent: deque[dict[str, Any]] = deque(maxlen=RECENT_REQUESTS)

    def reset(self) -> None:
        """Zero the stats, forget cached prefixes and restart the seeded streams (knobs are kept)."""
        with self._lock:
            self._reset_unlocked()

    def restore(self) -> None:
        """Put back the config the simulator started with, then reset: a test's knobs end with it."""
        with self._lock:
            self.config = self._initial_config
            self._reset_unlocked()

    def update_config(self, changes: Mapping[str, Any]) -> SimulatorConfig:
        """Apply a partial config (validated as a whole); a new seed restarts the seeded streams."""
        changes = dict(changes)
        if "error_rate" in changes:
            error_rate = float(changes.pop("error_rate"))
            spread = SimulatorConfig.with_error_rate(error_rate).fault_rates()
            for fault, rate in spread.items():
                changes.setdefault(f"rate_{fault.value}", rate)
        with self._lock:
            merged = {**self.config.model_dump(), **changes}
            new_config = SimulatorConfig.model_validate(merged)
            self.config = new_config
            if "seed" in changes:
                self._reseed()
            if new_config.cache_capacity == 0:
                self._prefixes.clear()
            return new_config

    def remember(self, route: str, messages: Sequence[PromptMessage]) -> None:
        """Keep a chat prompt as the simulator saw it (the newest RECENT_REQUESTS), for tests to inspect."""
        entry = {"route": route, "messages": [{"role": m.role, "text": m.text} for m in messages]}
        with self._lock:
            self._recent.append(entry)

    def recent_requests(self) -> list[dict[str, Any]]:
        with self._lock:
            return list(self._recent)

    def begin(self, route: str) -> None:
        with self._lock:
            self.in_flight += 1
            self.in_flight_by_route[route] += 1
            self.max_in_flight = max(self.max_in_flight, self.in_flight)

    def end(self, route: str) -> None:
        with self._lock:
            self.in_flight -= 1
            self.in_flight_by_route[route] -= 1

    def draw(self, forced: Fault | None) -> Draw:
        """One seeded draw per request, even when a header forces the fault, so sequences stay aligned."""
        with self._lock:
            config = self.config
            roll, jitter = self._draws.next(config.jitter_ms)
        fault = forced if forced is not None else config.fault_for(roll)
        return Draw(fault, (config.latency_ms + jitter) / 1000.0)

    def cache_read(self, lookups: Digests) -> int:
        """The longest prefix in ``lookups`` already cached: its tokens, or 0 (looked up on arrival)."""
        with self._lock:
            if self.config.cache_capacity == 0:
                return 0
            hit = 0
            for tokens, digest in lookups:
                if digest in self._prefixes:
                    self._prefixes.move_to_end(digest)
                    hit = max(hit, tokens)
            return hit

    def cache_write(self, writes: Digests) -> None:
        """Cache these prefixes (once a request is answered: readable by the requests that come after)."""
        with self._lock:
            if self.config.cache_capacity == 0:
                return
            for tokens, digest in writes:
                self._prefixes[digest] = tokens
                self._prefixes.move_to_end(digest)
            while len(self._prefixes) > self.config.cache_capacity:
                self._prefixes.popitem(last=False)

    def record(self, route: str, outcome: str, **counts: int) -> None:
        with self._lock:
            self.requests += 1
            self.by_route[route] += 1
            self.by_outcome[outcome] += 1
            self.by_route_outcome.setdefault(route, Counter())[outcome] += 1
            for name, count in counts.items():
                self.counters[name] += count

    def record_batch(self, requests: int) -> None:
        """A batch was created (and so, on a real provider, its requests will be paid for)."""
        with self._lock:
            self.counters["batches_created"] += 1
            self.counters["batch_requests"] += requests

    def record_results_download(self) -> None:
        with self._lock:
            self.counters["batch_results_downloads"] += 1

    def snapshot(self) -> dict[str, Any]:
        with self._lock:
            return {
                "simulator": True,
                "requests_total": self.requests,
                "by_route": dict(self.by_route),
                "by_outcome": dict(self.by_outcome),
                "by_route_outcome": {route: dict(c) for route, c in self.by_route_outcome.items()},
                "tokens": {
                    "input": self.counters["input"],
                    "output": self.counters["output"],
                    "cache_read": self.counters["cache_read"],
                    "cache_creation": self.counters["cache_creation"],
                },
                "client_disconnects": self.counters["client_disconnects"],
                "batches": {
                    "created": self.counters["batches_created"],
                    "requests": self.counters["batch_requests"],
                    "results_downloads": self.counters["batch_results_downloads"],
                    "held": self.store.held(),  # what callers have not deleted (a reset keeps it)
                },
                "in_flight": self.in_flight,
                "in_flight_by_route": {route: n for route, n in self.in_flight_by_route.items() if n},
                "max_in_flight": self.max_in_flight,
                "cached_prefixes": len(self._prefixes),
                "config": self.config.model_dump(),
            }


def state_of(request: Request) -> SimulatorState:
    """The state of the simulator app serving `request`."""
    state: SimulatorState = request.app.state.simulator
    return state
