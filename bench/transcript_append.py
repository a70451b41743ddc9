"""One append to a transcript nothing has compacted, as its history grows: each append sums the tokens of
every message since the applied summary (here: all of them) while it holds the transcript's row.

    .venv/bin/python bench/transcript_append.py [--sizes 1000,100000,1000000] [--appends 7]

Fills a scratch database by SQL with one transcript of each size (messages of 50 estimated tokens),
then times ``append_messages`` of one user message ``--appends`` times a size (its own transaction
each, as the API's) and ``context_now`` alone as many; prints medians, and each size's ratio to the
smallest size's append measured in the same run (the baseline).

Needs the local Postgres (127.0.0.1:5432); creates and drops its own database.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

from sqlalchemy import text

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from tests.service import migrated_database, stop_cleanly_on_termination  # noqa: E402
from worker.compaction.queries import append_messages, context_now  # noqa: E402
from worker.core.transcripts import parse_messages  # noqa: E402

SERVER = "postgresql+psycopg://postgres@127.0.0.1:5432/postgres"
FILL = (
    "INSERT INTO transcript_messages (transcript_id, seq, role, text, tokens) "
    "SELECT :id, g, 'user', repeat('word ', 40), 50 FROM generate_series(0, :n - 1) g"
)


def sizes(value: str) -> list[int]:
    found = sorted({int(part) for part in value.split(",") if part.strip()})
    if len(found) < 2 or found[0] < 1:
        raise argparse.ArgumentTypeError(
            f"{value!r} is below two sizes of at least 1: the first is the baseline"
        )
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0] if __doc__ else None)
    parser.add_argument(
        "--sizes", type=sizes, default=[1_000, 100_000, 1_000_000], help="messages, comma-separated"
    )
    parser.add_argument("--appends", type=int, default=7)
    args = parser.parse_args()
    with migrated_database(SERVER, "append") as (_url, factory):
        with factory.begin() as session:
            for n in args.sizes:
                session.execute(text("INSERT INTO transcripts (id) VALUES (:id)"), {"id": f"t{n}"})
                session.execute(text(FILL), {"id": f"t{n}", "n": n})
        with factory.begin() as session:
            session.execute(text("ANALYZE transcript_messages"))
        one = parse_messages([{"role": "user", "text": "Any news?"}])
        baseline = None
        print(
            f"{'messages':>10} {'append (median)':>16} {'context_now':>12} {'vs ' + str(args.sizes[0]):>10}"
        )
        for n in args.sizes:
            appends, sums = [], []
            for _ in range(args.appends):
                started = time.perf_counter()
                with factory.begin() as session:
                    append_messages(session, f"t{n}", one)
                appends.append((time.perf_counter() - started) * 1000)
                with factory() as session:
                    started = time.perf_counter()
                    context_now(session, f"t{n}")
                    sums.append((time.perf_counter() - started) * 1000)
            append_ms = statistics.median(appends)
            baseline = baseline or append_ms
            print(
                f"{n:>10,} {append_ms:>13.1f} ms {statistics.median(sums):>9.1f} ms "
                f"{append_ms / baseline:>9.1f}x"
            )


if __name__ == "__main__":
    stop_cleanly_on_termination()
    main()
