"""What the API's access line costs a request: ``worker.api.request_metrics.log_access`` as `serve` logs
it (text and JSON, the request id bound), against the same call with the logger off.

    .venv/bin/python bench/access_log.py [--calls 20000]

Writes the lines to /dev/null; prints microseconds a call (median of 5 rounds) and the ratios.
"""

from __future__ import annotations

import argparse
import logging
import logging.config
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from worker.api.request_metrics import log_access  # noqa: E402
from worker.runtime.logs import log_context, logging_config  # noqa: E402
from worker.settings import Settings  # noqa: E402

SCOPE = {"type": "http", "method": "GET", "client": ("10.0.0.7", 51234)}


def per_call_us(calls: int) -> float:
    rounds = []
    with log_context(request_id="0123456789abcdef0123456789abcdef"):
        for _ in range(5):
            started = time.perf_counter()
            for _ in range(calls):
                log_access(SCOPE, "GET", "/v1/search", 200, 0.0123)
            rounds.append((time.perf_counter() - started) * 1e6 / calls)
    return statistics.median(rounds)


def configure(log_format: str | None) -> None:
    config = logging_config(Settings(_env_file=None, log_format=log_format))  # type: ignore[arg-type]
    config["handlers"]["default"]["stream"] = open("/dev/null", "w")  # noqa: SIM115
    logging.config.dictConfig(config)
    if log_format is None:
        logging.getLogger("worker.api.access").setLevel(logging.WARNING)  # the baseline: the call, no line


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--calls", type=int, default=20_000)
    args = parser.parse_args(argv)
    configure(None)
    off = per_call_us(args.calls)
    figures = {}
    for log_format in ("text", "json"):
        configure(log_format)
        logging.getLogger("worker.api.access").setLevel(logging.NOTSET)
        figures[log_format] = per_call_us(args.calls)
    print(f"the access line, µs a request (median of 5 rounds of {args.calls:,}):")
    print(f"  {'logger off (baseline)':24} {off:7.2f}")
    for name, value in figures.items():
        print(f"  {name:24} {value:7.2f}   {value / off:.1f}x, +{value - off:.1f} µs a request")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
