"""Planning one compaction of a transcript with a long uncompacted history: the plan read from the stored
rows (the kept tail's roles and tokens, the head up to the summarizer's input) against the whole timeline
loaded and planned in memory (how every compaction read it before), in the same run.

    .venv/bin/python bench/compaction_plan.py [--messages 100000] [--chars 400] [--runs 3]

Fills a scratch database by SQL with one transcript (user and assistant turns, every fifth message a
tool call with its result), then plans its compaction both ways (defaults: keep 20,000 recent tokens,
the summarizer's input 96,000 tokens), checks the two plans agree, and prints each one's median time
over untraced runs, its peak Python memory (tracemalloc) in one more run, traced, and the ratios. (The
time is never taken under tracemalloc: tracing every allocation slows the allocation-heavy baseline
far more than the stored plan.)

Needs the local Postgres (127.0.0.1:5432); creates and drops its own database.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
import tracemalloc
from collections.abc import Callable
from pathlib import Path

from sqlalchemy import text
from sqlalchemy.orm import Session, sessionmaker

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from models.reads import one_snapshot  # noqa: E402
from tests.service import at_least, migrated_database, stop_cleanly_on_termination  # noqa: E402
from worker.compaction import load_timeline, stored_plan  # noqa: E402
from worker.core.timeline import CompactionPlan, plan_compaction  # noqa: E402

SERVER = "postgresql+psycopg://postgres@127.0.0.1:5432/postgres"
TRANSCRIPT = "agent-long"
MAX_INPUT_TOKENS = 96_000  # FACTMILL_COMPACTION_MAX_INPUT_TOKENS's default
# Seq s: a user turn (s % 5 == 0), an assistant turn calling a tool (3), its result (4), else a reply.
FILL = [
    "INSERT INTO transcripts (id) VALUES (:id)",
    "INSERT INTO transcript_messages (transcript_id, seq, role, text, tool_calls, tool_call_id, tool_name,"
    " tokens) "
    "SELECT :id, s, CASE WHEN s % 5 = 0 THEN 'user' WHEN s % 5 = 4 THEN 'tool' ELSE 'assistant' END, "
    "repeat(md5(s::text), :chars / 32), "
    "CASE WHEN s % 5 = 3 THEN jsonb_build_array(jsonb_build_object('id', 'c' || s, 'name', 'sh', "
    "'arguments', '{}')) ELSE '[]'::jsonb END, "
    "CASE WHEN s % 5 = 4 THEN 'c' || (s - 1) END, CASE WHEN s % 5 = 4 THEN 'sh' END, "
    "((:chars / 32) * 32 + CASE WHEN s % 5 = 3 THEN 4 ELSE 0 END + 3) / 4 "
    # :messages is one more than a multiple of 5: the history ends on a user turn.
    "FROM generate_series(0, :messages - 1) s",
    "ANALYZE transcript_messages",
]


def whole(session: Session) -> CompactionPlan:
    """The plan as every compaction made it before: the whole timeline loaded, then planned."""
    timeline = load_timeline(session, TRANSCRIPT)
    settings = timeline.settings
    return plan_compaction(
        timeline.messages,
        timeline.seqs,
        keep_recent_tokens=settings.keep_recent_tokens,
        tool_result_limit=settings.tool_result_limit,
        max_head_tokens=MAX_INPUT_TOKENS,
    )


def stored(session: Session) -> CompactionPlan:
    context = stored_plan.stored_context(session, TRANSCRIPT)
    return stored_plan.plan_stored(
        session,
        context,
        tool_result_limit=context.settings.tool_result_limit,
        max_head_tokens=MAX_INPUT_TOKENS,
    )


def measure(
    factory: sessionmaker[Session], plan: Callable[[Session], CompactionPlan], runs: int
) -> tuple[float, float]:
    """(median seconds over ``runs`` untraced plans, peak MiB of Python allocations in one more plan
    under tracemalloc), each plan in its own snapshot."""
    times = []
    for _ in range(runs):
        started = time.perf_counter()
        with one_snapshot(factory) as session:
            plan(session)
        times.append(time.perf_counter() - started)
    tracemalloc.start()
    try:
        with one_snapshot(factory) as session:
            plan(session)
        peak = tracemalloc.get_traced_memory()[1] / 2**20
    finally:
        tracemalloc.stop()
    return statistics.median(times), peak


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--messages", type=at_least(100, "a history to compact"), default=100_000)
    parser.add_argument("--chars", type=at_least(32, "one md5 a message"), default=400)
    parser.add_argument("--runs", type=at_least(1, "a median needs a sample"), default=3)
    args = parser.parse_args(argv)
    args.messages = args.messages // 5 * 5 + 1
    with migrated_database(SERVER) as (_, factory):
        with factory.begin() as session:
            for statement in FILL:
                session.execute(
                    text(statement), {"id": TRANSCRIPT, "messages": args.messages, "chars": args.chars}
                )
        with one_snapshot(factory) as session:
            assert stored(session) == whole(session), "the two plans disagree"
        base_s, base_mib = measure(factory, whole, args.runs)
        now_s, now_mib = measure(factory, stored, args.runs)
        print(
            f"one transcript of {args.messages:,} messages of {args.chars // 32 * 32} characters, nothing "
            f"compacted; median time of {args.runs} untraced runs, peak of one traced run: whole timeline "
            f"{base_s * 1e3:,.0f} ms, {base_mib:,.1f} MiB; stored plan {now_s * 1e3:,.0f} ms "
            f"({now_s / base_s:.3f}x), {now_mib:,.1f} MiB ({now_mib / base_mib:.3f}x)"
        )
    return 0


if __name__ == "__main__":
    stop_cleanly_on_termination()
    raise SystemExit(main())
