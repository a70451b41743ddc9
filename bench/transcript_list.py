"""Listing transcripts (GET /v1/transcripts, `factmill transcripts list`): the newest chosen first and
only their messages counted, against the query before it, which counted every transcript's messages.

    .venv/bin/python bench/transcript_list.py [--transcripts 10000] [--messages 100] [--reads 20]

Fills a scratch database by SQL, then times the previous query ``--reads`` times, then
``worker.compaction.recent_transcripts`` (50 transcripts) as many; prints medians and the ratio.

Needs the local Postgres (127.0.0.1:5432); creates and drops its own database.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from sqlalchemy import func, select, text
from sqlalchemy.orm import Session, sessionmaker

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from models import Transcript, TranscriptMessageRow  # noqa: E402
from tests.service import at_least, migrated_database, stop_cleanly_on_termination  # noqa: E402
from worker.compaction import recent_transcripts  # noqa: E402

SERVER = "postgresql+psycopg://postgres@127.0.0.1:5432/postgres"
LIMIT = 50
FILL = [
    "INSERT INTO transcripts (id, updated_at) "
    "SELECT 'agent-' || g, now() - make_interval(secs => g) FROM generate_series(1, :transcripts) g",
    "INSERT INTO transcript_messages (transcript_id, seq, role, text, tokens) "
    "SELECT t.id, s, 'user', 'message ' || s, 3 "
    "FROM transcripts t CROSS JOIN generate_series(0, :messages - 1) s",
    "ANALYZE",
]


def before(session: Session, limit: int) -> list[Any]:
    """The query as it was: every transcript's messages aggregated, then the newest kept."""
    query = (
        select(
            Transcript.id,
            Transcript.context_window,
            func.count(TranscriptMessageRow.id),
            func.coalesce(func.sum(TranscriptMessageRow.tokens), 0),
            Transcript.updated_at,
        )
        .outerjoin(TranscriptMessageRow, TranscriptMessageRow.transcript_id == Transcript.id)
        .group_by(Transcript.id)
        .order_by(Transcript.updated_at.desc(), Transcript.id)
        .limit(limit)
    )
    return list(session.execute(query))


def median_ms(factory: sessionmaker[Session], read: Callable[[Session, int], list[Any]], reads: int) -> float:
    times = []
    with factory() as session:
        for _ in range(reads):
            started = time.perf_counter()
            assert len(read(session, LIMIT)) == LIMIT
            times.append((time.perf_counter() - started) * 1e3)
            session.rollback()
    return statistics.median(times)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument(
        "--transcripts", type=at_least(LIMIT, f"the listing reads the newest {LIMIT}"), default=10_000
    )
    parser.add_argument("--messages", type=at_least(0, "a count"), default=100)
    parser.add_argument("--reads", type=at_least(1, "a median needs a sample"), default=20)
    args = parser.parse_args(argv)
    with migrated_database(SERVER) as (_, factory):
        with factory.begin() as session:
            for statement in FILL:
                session.execute(text(statement), {"transcripts": args.transcripts, "messages": args.messages})
        with factory() as session:
            newest = [r["transcript_id"] for r in recent_transcripts(session, LIMIT)]
            assert newest == [row[0] for row in before(session, LIMIT)], "the two queries disagree"
        base = median_ms(factory, before, args.reads)
        now = median_ms(factory, recent_transcripts, args.reads)
        print(
            f"{args.transcripts:,} transcripts, {args.transcripts * args.messages:,} messages; "
            f"{LIMIT} listed, medians of {args.reads} reads: before {base:.1f} ms, "
            f"recent_transcripts {now:.2f} ms ({now / base:.3f}x)"
        )
    return 0


if __name__ == "__main__":
    stop_cleanly_on_termination()
    raise SystemExit(main())
