"""Compaction benchmark: plan a 1M-token transcript (cut + serialize, pure and through Postgres), and
summaries per second through the compaction queue against the ideal, measured in the same run.

    .venv/bin/python bench/compaction.py [--tokens 1000000] [--transcripts 960] [--concurrency 32]
                                         [--latency-ms 500] [--keep-logs]

Part 1 builds the deterministic ~1M-token agent session of bench/compaction_core.py (imported, not
copied). In memory, over the whole uncompacted head (no input cap: the throughput of the pieces):
``plan_compaction`` (cut_index + serialize_transcript + token sums) and the quality gate's lexing,
against the copy floor (one join of every message's text), the core's bare cut + serialize and the
uniseg lexer, in the same run. Then what a compaction job does before its LLM call: the transcript
appended to Postgres once, the plan read from the stored rows (``stored_context`` + ``plan_stored``)
with the summarizer's input capped as the job caps it (FACTMILL_COMPACTION_MAX_INPUT_TOKENS, 96,000
tokens), and the gate's lexing of that capped head. bench/compaction_plan.py compares the stored plan
with the whole timeline loaded and planned.

Part 2 stores N transcripts, each just past its window, starts one real worker process
(``factmill worker --queues compaction --pool threads --concurrency C``) against the bundled
simulator at 500 ms latency, sends the N jobs, and times until every job finished. The ideal is the
calls in flight over the latency: C / 0.5 s; the baseline, measured in the same run first, is 8 more
transcripts through a worker of one thread (one summary at a time).

Needs the local Postgres (127.0.0.1:5432) and Redis (127.0.0.1:6379); creates and drops its own
database and uses its own Redis key prefix (its keys deleted at the end). The services' logs go to a
temporary folder, removed at the end unless --keep-logs is given or the run failed.
"""

from __future__ import annotations

import argparse
import os
import platform
import re
import subprocess
import sys
import time
from functools import partial
from pathlib import Path

import psutil
import psycopg
from sqlalchemy.engine import make_url
from sqlalchemy.orm import sessionmaker
from uniseg.wordbreak import word_break
from uniseg.wordbreak import words as uax29_segments

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from compaction_core import best_of, build_transcript, copy_floor, ms  # noqa: E402
from pipeline import BROKER, SERVER, forget_broker_keys, run_logs, spawn, stop, wait_http  # noqa: E402

from models.reads import one_snapshot  # noqa: E402
from tests.service import at_least, free_port, fresh_database, stop_cleanly_on_termination  # noqa: E402
from worker import db  # noqa: E402
from worker.compaction import (  # noqa: E402
    append_messages,
    judge_summary,
    plan_compaction,
    stored_plan,
)
from worker.core.compaction import (  # noqa: E402
    DEFAULT_KEEP_RECENT_TOKENS,
    DEFAULT_TOOL_RESULT_LIMIT,
    cut_index,
    estimate_tokens,
    serialize_transcript,
)
from worker.core.quality import _GLUES_TO_PREVIOUS, _words_from_segments, lex_words  # noqa: E402
from worker.core.timeline import CompactionPlan  # noqa: E402
from worker.settings import Settings  # noqa: E402

MAX_INPUT_TOKENS = Settings.model_fields["compaction_max_input_tokens"].default  # what a job reads
GOAL = "Deploy the payments service to the Frankfurt region behind the canary flag."


def uniseg_lex_words(text: str) -> list[str]:
    """lex_words before its ASCII fast path: each whitespace-free chunk through uniseg unless alphanumeric."""
    cache: dict[str, list[str]] = {}
    tokens: list[str] = []
    for chunk in re.findall(r"[^ \t\n\r\f\v]+", text):
        found = cache.get(chunk)
        if found is None:
            if chunk.isascii() and chunk.isalnum():
                found = cache[chunk] = [chunk.lower()]
            elif word_break(chunk[0]) in _GLUES_TO_PREVIOUS:
                return _words_from_segments(uax29_segments(text))
            else:
                found = cache[chunk] = _words_from_segments(uax29_segments(chunk))
        tokens.extend(found)
    return tokens


def part_one(tokens: int, url: str) -> None:
    started = time.perf_counter()
    messages = build_transcript(tokens)
    total = sum(estimate_tokens(m) for m in messages)
    characters = sum(
        len(m.text) + sum(len(c.name) + len(c.arguments) for c in m.tool_calls) for m in messages
    )
    print(
        f"## 1. plan a {total:,}-token transcript ({len(messages):,} messages, {characters / 1e6:.1f} MB; "
        f"built in {time.perf_counter() - started:.1f} s)"
    )
    seqs: list[int | None] = list(range(len(messages)))
    keep = DEFAULT_KEEP_RECENT_TOKENS

    plan_s, plan = best_of(
        3,
        partial(
            plan_compaction,
            messages,
            seqs,
            keep_recent_tokens=keep,
            tool_result_limit=DEFAULT_TOOL_RESULT_LIMIT,
        ),
    )

    def core() -> str:
        cut = cut_index(messages, keep)
        assert cut is not None
        return serialize_transcript(messages[:cut], DEFAULT_TOOL_RESULT_LIMIT)

    core_s, serialized = best_of(3, core)
    assert serialized == plan.serialized
    floor_s, _ = best_of(3, partial(copy_floor, messages[: plan.cut]))
    print("  the whole head, in memory (no input cap):")
    print(
        f"  plan_compaction (cut + serialize + sums) {ms(plan_s):>12}  head "
        f"{len(plan.serialized) / 1e6:.2f} MB, {plan.kept_tokens:,} tokens kept from seq {plan.cut_seq:,}"
    )
    print(f"  core cut + serialize only                {ms(core_s):>12}  plan / core {plan_s / core_s:.2f}x")
    print(
        f"  copy floor (join of the head's texts)    {ms(floor_s):>12}  plan / floor {plan_s / floor_s:.1f}x"
    )

    # The gate: lexing the serialized head is the per-compaction CPU cost after the plan.
    lex_s, source_tokens = best_of(3, partial(lex_words, plan.serialized))
    # Baseline in the same run: the lexer before the ASCII fast path (uniseg on every chunk that is not
    # plain letters and digits); both must give the same tokens.
    ref_s, ref_tokens = best_of(1, partial(uniseg_lex_words, plan.serialized))
    assert ref_tokens == source_tokens, "lex_words differs from the uniseg lexer"
    summary = f"## Goal\n{GOAL}\n## Critical Context\n" + plan.serialized[-12_000:]
    gate_s, gate = best_of(
        1, partial(judge_summary, source_tokens, summary, ["deploy", "latency", "postgres"], 0.5)
    )
    print(
        f"  gate: lex_words of the head              {ms(lex_s):>12}  ({len(source_tokens):,} words, "
        f"{len(plan.serialized) / 1e6 / lex_s:.1f} MB/s); coverage + density of a 16k summary {ms(gate_s)} "
        f"(coverage {gate.coverage:.3f})"
    )
    print(
        f"  baseline: uniseg on each chunk           {ms(ref_s):>12}  "
        f"({len(plan.serialized) / 1e6 / ref_s:.1f} "
        f"MB/s, same tokens); baseline / lex_words {ref_s / lex_s:.1f}x"
    )

    # Through the store, as the job: the transcript appended once, then the plan read from the stored
    # rows with the summarizer's input capped, and the gate's lexing of that capped head.
    factory = sessionmaker(db.get_engine(url), expire_on_commit=False)
    started = time.perf_counter()
    with factory.begin() as session:
        append_messages(session, "bench-1m", messages, settings={"context_window": 2_000_000})
    append_s = time.perf_counter() - started

    def as_the_job() -> CompactionPlan:
        with one_snapshot(factory) as session:
            context = stored_plan.stored_context(session, "bench-1m")
            return stored_plan.plan_stored(
                session,
                context,
                tool_result_limit=context.settings.tool_result_limit,
                max_head_tokens=MAX_INPUT_TOKENS,
            )

    job_s, job_plan = best_of(3, as_the_job)
    job_lex_s, _ = best_of(3, partial(lex_words, job_plan.serialized))
    print(f"  as a job, from Postgres (input capped at {MAX_INPUT_TOKENS:,} tokens):")
    print(
        f"  append to Postgres (one transaction)     {ms(append_s):>12}  "
        f"{len(messages) / append_s:,.0f} messages/s"
    )
    print(
        f"  stored_context + plan_stored             {ms(job_s):>12}  head "
        f"{len(job_plan.serialized) / 1e6:.2f} MB (of {len(plan.serialized) / 1e6:.2f} MB uncapped)"
    )
    print(f"  gate: lex_words of that head             {ms(job_lex_s):>12}")
    print()


def session_messages(index: int, rounds: int) -> list[dict[str, object]]:
    out: list[dict[str, object]] = [{"role": "user", "text": GOAL}]
    for i in range(rounds):
        call = f"call-{index}-{i}"
        out.append(
            {
                "role": "assistant",
                "text": f"Checking namespace staging-{i}.",
                "tool_calls": [{"id": call, "name": "sh", "arguments": {"cmd": f"kubectl get pods -n s{i}"}}],
            }
        )
        out.append({"role": "tool", "tool_call_id": call, "text": f"pod-{i} Running\n" * 40})
        out.append(
            {"role": "assistant", "text": f"Namespace staging-{i} looks healthy; all pods are running."}
        )
    out.append({"role": "user", "text": "How is the payments rollout in Frankfurt going?"})
    return out


def gate_per_compaction() -> None:
    """CPU of the gate's lexing for one part-2 transcript's head, against the uniseg-per-chunk lexer."""
    from worker.compaction import parse_messages

    messages = parse_messages(session_messages(0, 25))
    head = plan_compaction(
        messages,
        list(range(len(messages))),
        keep_recent_tokens=1500,
        tool_result_limit=DEFAULT_TOOL_RESULT_LIMIT,
    ).serialized
    fast_s, fast = best_of(20, partial(lex_words, head))
    base_s, base = best_of(5, partial(uniseg_lex_words, head))
    assert fast == base
    print(
        f"  gate lexing of one transcript's head ({len(head):,} chars): lex_words {ms(fast_s)}, "
        f"uniseg per chunk {ms(base_s)} ({base_s / fast_s:.0f}x)"
    )


def part_two(
    url: str, name: str, transcripts: int, concurrency: int, latency_ms: int, keep_logs: bool
) -> None:
    with run_logs(name, keep_logs) as logs:
        queue_run(url, name, logs, transcripts, concurrency, latency_ms)


# The same-run baseline: this many transcripts through a worker of one thread, one summary at a time.
SEQUENTIAL_TRANSCRIPTS = 8


def queue_run(url: str, name: str, logs: Path, transcripts: int, concurrency: int, latency_ms: int) -> None:
    from worker.compaction import parse_messages

    procs: list[subprocess.Popen[bytes]] = []
    factory = sessionmaker(db.get_engine(url), expire_on_commit=False)
    try:
        sim_port = free_port()
        base_env = {k: v for k, v in os.environ.items() if not k.startswith("FACTMILL_")}
        procs.append(
            spawn(
                ["-m", "worker.simulator", "--port", str(sim_port), "--latency-ms", str(latency_ms)],
                base_env,
                logs / "simulator.log",
            )
        )
        wait_http(f"http://127.0.0.1:{sim_port}/_simulator/health")
        env = base_env | {
            "FACTMILL_DATABASE_URL": url,
            "FACTMILL_BROKER_URL": BROKER,
            "FACTMILL_BROKER_KEY_PREFIX": f"{name}:",
            "FACTMILL_LLM": "simulator",
            "FACTMILL_SIMULATOR_URL": f"http://127.0.0.1:{sim_port}/v1",
        }
        jobs: list[int] = []
        for index in range(SEQUENTIAL_TRANSCRIPTS + transcripts):
            with factory.begin() as session:
                result = append_messages(
                    session,
                    f"bench-{index}",
                    parse_messages(session_messages(index, 25)),
                    settings={"context_window": 6000, "reserve_tokens": 2000, "keep_recent_tokens": 1500},
                )
                assert result.trigger.job is not None
                jobs.append(result.trigger.job.job_id)
        sequential, jobs = jobs[:SEQUENTIAL_TRANSCRIPTS], jobs[SEQUENTIAL_TRANSCRIPTS:]
        base_elapsed, _ = drain(name, env, logs / "worker-sequential.log", sequential, 1, procs)
        elapsed, worker_cpu = drain(name, env, logs / "worker.log", jobs, concurrency, procs)
        with psycopg.connect(f"postgresql://postgres@127.0.0.1:5432/{name}", autocommit=True) as conn:
            outcomes = dict(
                conn.execute(
                    "SELECT c.status, count(*) FROM compactions c JOIN jobs j ON j.subject = c.transcript_id "
                    "WHERE j.id = ANY(%s) GROUP BY c.status",
                    (jobs,),
                ).fetchall()
            )
            calls = conn.execute(
                "SELECT count(*) FROM llm_calls WHERE purpose = 'compaction' AND job_id = ANY(%s)", (jobs,)
            ).fetchone()
            base_done = conn.execute(
                "SELECT count(*) FROM compactions c JOIN jobs j ON j.subject = c.transcript_id "
                "WHERE j.id = ANY(%s) AND c.status = 'accepted'",
                (sequential,),
            ).fetchone()
        n_calls = calls[0] if calls else 0
        # Summaries accepted, not jobs ended: a failed job, or one that made none, is no summary.
        summaries = outcomes.get("accepted", 0)
        if summaries < len(jobs):
            print(f"  WARNING: {summaries} of {len(jobs)} jobs made an accepted summary (see the outcomes)")
        rate = summaries / elapsed
        base_rate = (base_done[0] if base_done else 0) / base_elapsed
        ideal = concurrency / (latency_ms / 1000)
        print(
            f"## 2. summaries through the queue: {len(jobs)} transcripts (~4,500 tokens each, just past "
            f"window 6,000 - reserve 2,000), one worker, {concurrency} threads, simulator at {latency_ms} ms"
        )
        print(f"  outcomes {outcomes}; {n_calls} summarizer calls")
        gate_per_compaction()
        print(f"  summaries/s {rate:8.1f}   in {elapsed:.2f} s")
        print(
            f"  ideal       {ideal:8.1f}   ({concurrency} in flight / {latency_ms / 1000:g} s)   "
            f"ratio {rate / ideal:.2f}"
        )
        print(
            f"  sequential  {base_rate:8.2f}   (one thread, {len(sequential)} transcripts, measured in this "
            f"run: {1 / base_rate if base_rate else float('nan'):.2f} s each)   "
            f"ratio {rate / base_rate if base_rate else float('nan'):.1f}x"
        )
        print(
            f"  calls/s     {n_calls / elapsed:8.1f}   ratio to ideal {n_calls / elapsed / ideal:.2f}; "
            f"worker CPU {1000 * worker_cpu / max(len(jobs), 1):.1f} ms per compaction"
        )
        if summaries < len(jobs):  # a failed run exits 1 and keeps its services' logs (run_logs)
            raise SystemExit(f"{len(jobs) - summaries} transcript(s) made no accepted summary")
    finally:
        stop(procs)
        forget_broker_keys(f"{name}:")


def drain(
    name: str,
    env: dict[str, str],
    log: Path,
    jobs: list[int],
    threads: int,
    procs: list[subprocess.Popen[bytes]],
) -> tuple[float, float]:
    """Start one worker process of ``threads`` threads, send ``jobs``, wait until each ended, stop the
    worker: (seconds from the first send, the worker's CPU seconds meanwhile)."""
    from celery import Celery

    from worker.celery_app import create_app
    from worker.jobs.outbox import COMPACTION
    from worker.settings import Settings

    worker = spawn(
        # One process: the worker command starts one per core by default, and the ideal is for
        # ``threads`` jobs in flight (the CPU figure would also read the supervisor only).
        ["-m", "worker.cli", "worker", "--queues", "compaction", "--concurrency", str(threads),
         "--processes", "1", "--pool", "threads", "--loglevel", "info"],
        env,
        log,
    )  # fmt: skip
    procs.append(worker)
    deadline = time.monotonic() + 60
    while "ready." not in log.read_text(errors="replace"):
        if time.monotonic() > deadline:
            raise SystemExit(f"worker did not start:\n{log.read_text()[-2000:]}")
        time.sleep(0.02)
    celery: Celery = create_app(Settings(broker_url=BROKER, broker_key_prefix=f"{name}:"))
    worker_ps = psutil.Process(worker.pid)
    cpu_before = worker_ps.cpu_times()
    started = time.perf_counter()
    for job_id in jobs:
        celery.send_task("tasks.compaction.compact_transcript", args=[job_id], queue=COMPACTION)
    with psycopg.connect(f"postgresql://postgres@127.0.0.1:5432/{name}", autocommit=True) as conn:
        while True:
            row = conn.execute(
                "SELECT count(*) FROM jobs WHERE id = ANY(%s) AND status IN ('succeeded','failed')", (jobs,)
            ).fetchone()
            if row and row[0] >= len(jobs):
                break
            if time.perf_counter() - started > 300:
                raise SystemExit("the queue did not drain in 5 minutes")
            time.sleep(0.02)
    elapsed = time.perf_counter() - started
    cpu_after = worker_ps.cpu_times()
    celery.close()
    stop([worker])
    return elapsed, (cpu_after.user + cpu_after.system) - (cpu_before.user + cpu_before.system)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0] if __doc__ else None)
    parser.add_argument("--tokens", type=int, default=1_000_000)
    # 30 rounds of 32 in flight: with 10, the first and last rounds' ramp cost 0.1 of the ratio.
    parser.add_argument("--transcripts", type=int, default=960)
    parser.add_argument("--concurrency", type=at_least(1, "the ideal rate is calls in flight"), default=32)
    parser.add_argument("--latency-ms", type=at_least(1, "the ideal rate divides by it"), default=500)
    parser.add_argument("--keep-logs", action="store_true", help="keep the services' logs (path printed)")
    args = parser.parse_args()
    print(f"factmill compaction benchmark - Python {platform.python_version()} on {platform.machine()}, "
          f"{psutil.cpu_count()} cores")  # fmt: skip
    print()
    started = time.perf_counter()
    with fresh_database(SERVER, "bench") as url:
        db.upgrade(url)
        part_one(args.tokens, url)
        name = str(make_url(url).database)
        part_two(url, name, args.transcripts, args.concurrency, args.latency_ms, args.keep_logs)
    print(f"\ntotal benchmark time {time.perf_counter() - started:.1f} s")


if __name__ == "__main__":
    stop_cleanly_on_termination()
    main()
