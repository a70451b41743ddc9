"""The long fuzz run: schemathesis against the real API and Postgres (ASGI in-process), every operation
signed with the admin token and anonymous, --examples cases each; prints cases and 5xx per operation.

    .venv/bin/python bench/fuzz.py [--examples 500]

Needs the local Postgres (127.0.0.1:5432, or FACTMILL_TEST_DATABASE_URL) and Redis at 127.0.0.1:6379
(db 14, for /readyz); creates and drops its own database.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections import Counter
from pathlib import Path
from typing import Any

import schemathesis
from hypothesis import HealthCheck, given, settings
from sqlalchemy.orm import sessionmaker

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from tests.integration.test_api import Recorder, make_runtime  # noqa: E402
from tests.integration.test_fuzz_api import EXCLUDED_CHECKS, body_bytes, credentials  # noqa: E402
from tests.service import fresh_database  # noqa: E402
from worker import db  # noqa: E402
from worker.api.app import create_app  # noqa: E402

SERVER = os.environ.get("FACTMILL_TEST_DATABASE_URL", "postgresql+psycopg://postgres@127.0.0.1:5432/postgres")


def fuzz(operation: Any, authenticated: bool, examples: int, tally: Counter[str]) -> str | None:
    @given(case=operation.as_strategy())
    @settings(max_examples=examples, deadline=None, suppress_health_check=list(HealthCheck), database=None)
    def run(case: Any) -> None:
        body = body_bytes(case)
        headers = credentials(case.method, case.formatted_path, body or b"") if authenticated else {}
        kwargs: dict[str, Any] = {"headers": headers, "excluded_checks": EXCLUDED_CHECKS}
        if body is not None:
            headers["Content-Type"] = "application/json"
            kwargs["data"] = body
        tally["cases"] += 1
        try:
            response = case.call_and_validate(**kwargs)
        except Exception:
            tally["failures"] += 1
            raise
        if response.status_code >= 500:
            tally["5xx"] += 1

    try:
        run()
    except Exception as exc:
        return str(exc).splitlines()[0][:200]
    return None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--examples", type=int, default=500)
    args = parser.parse_args()
    with fresh_database(SERVER, "fuzz") as url:
        db.upgrade(url)
        factory = sessionmaker(db.get_engine(url), expire_on_commit=False)
        runtime = make_runtime(url, factory, broker_url="redis://127.0.0.1:6379/14", max_body_bytes=1 << 20)
        app = create_app(runtime, sender=Recorder(factory))
        loaded = schemathesis.openapi.from_asgi("/openapi.json", app)
        total: Counter[str] = Counter()
        print(f"{'operation':55} {'mode':13} {'cases':>6} {'5xx':>4}  first failure")
        for result in loaded.get_all_operations():
            operation = result.ok()
            for authenticated in (True, False):
                tally: Counter[str] = Counter()
                failure = fuzz(operation, authenticated, args.examples, tally)
                total.update(tally)
                mode = "authenticated" if authenticated else "anonymous"
                print(f"{operation.label:55} {mode:13} {tally['cases']:6} {tally['5xx']:4}  {failure or '-'}")
        print(f"total: {total['cases']} cases, {total['5xx']} 5xx, {total['failures']} failed checks")


if __name__ == "__main__":
    main()
