"""The long fuzz run: schemathesis against the real API and Postgres (ASGI in-process), every operation
signed with the admin token and anonymous, --examples cases each, with the checks and case rules of
tests/integration/test_fuzz_api.py; prints cases, 5xx and the first failure per operation; exits 1 on
any 5xx or failed check.

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

from hypothesis import HealthCheck, settings
from sqlalchemy.orm import sessionmaker

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from tests.integration import test_fuzz_api as fuzzing  # noqa: E402
from tests.service import fresh_database, stop_cleanly_on_termination  # noqa: E402
from worker import db  # noqa: E402

SERVER = os.environ.get("FACTMILL_TEST_DATABASE_URL", "postgresql+psycopg://postgres@127.0.0.1:5432/postgres")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--examples", type=int, default=500)
    args = parser.parse_args()
    config = settings(
        max_examples=args.examples, deadline=None, suppress_health_check=list(HealthCheck), database=None
    )
    with fresh_database(SERVER, "fuzz") as url:
        db.upgrade(url)
        factory = sessionmaker(db.get_engine(url), expire_on_commit=False)
        app = fuzzing.make_fuzzed_app(url, "redis://127.0.0.1:6379/14", factory)
        document = app.openapi()
        total: Counter[str] = Counter()
        raised = 0  # operations that raised: a failed check, or an error outside any request
        print(f"{'operation':55} {'mode':13} {'cases':>6} {'5xx':>4}  first failure")
        for operation in fuzzing.operations(app):
            for mode, caller in (("authenticated", fuzzing.credentials), ("anonymous", None)):
                tally: Counter[str] = Counter()
                try:
                    fuzzing.fuzz_operation(operation, caller, document, config, tally)
                    failure = "-"
                except (Exception, BaseExceptionGroup) as exc:  # schemathesis raises a FailureGroup
                    failure = str(exc).splitlines()[0][:200]
                    raised += 1
                total.update(tally)
                print(f"{operation.label:55} {mode:13} {tally['cases']:6} {tally['5xx']:4}  {failure}")
        print(f"total: {total['cases']} cases, {total['5xx']} 5xx, {total['failures']} failed checks")
    return 1 if total["5xx"] or total["failures"] or raised else 0


if __name__ == "__main__":
    stop_cleanly_on_termination()
    sys.exit(main())
