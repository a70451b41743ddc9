"""Consolidation benchmark: accuracy on a planted-truth corpus, LLM cost per new fact, and how fast the
consolidation queue drains behind extraction.

    .venv/bin/python bench/consolidation.py [--people 40] [--pages 6] [--latency-ms 100]
                                            [--segments-per-s 122] [--concurrency 8] [--show-errors]
                                            [--keep-logs]

The corpus is generated here, not extracted: per person, a timeline of pages (dated weeks apart) whose
segments state attributes (city, job, gym plan, morning drink) through several paraphrase templates.
Planted truth: a restatement of the current value (same or another template, within or across pages)
is a duplicate; a new value on a later page supersedes the old one; look-alikes share the words of
an attribute but are not it (a sibling's city, a job held in college, a manager's gym plan, a trip to
a city) and must never supersede or be superseded by it. A look-alike is a fact of its own: its
person's sister lives in one city, the college job and the manager's plan never change, so a repeat is
a restatement (a planted duplicate); a trip is one event per city (the same trip said again is a
duplicate, a trip to another city is unrelated). (The first version drew a fresh value for every
look-alike, so "X's sister lives in Porto" on one page and "... in Kyoto" on a later one were labelled
"stays current" although the text says she moved; most of its false supersessions were such pairs.)
The templates and values are chosen for the domain, not from the simulator's rules (it never sees the
labels); the simulator answers the ambiguous pairs.

Facts are committed page by page at the pipeline benchmark's rate (segments per second, three facts a
segment), embedded as the extraction job would, and a consolidation job is requested per entity as
the extraction job does; one real worker process (``--concurrency`` threads) drains the consolidation
queue from Redis. The figure is the time from the last commit until every fact is consolidated; the
rate the producer reached (segments committed / the time it took) is printed beside the one it was
paced for, which it falls short of when committing a page takes longer than its pace. Needs the local
Postgres and Redis; creates and drops its own database and uses its own Redis key prefix (its keys
deleted at the end); the services' logs go to a temporary folder, removed at the end unless
--keep-logs is given or the run failed.
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import time
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path

from sqlalchemy import func, select, text
from sqlalchemy.engine import make_url

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))

from pipeline import BROKER, SERVER, forget_broker_keys, run_logs, spawn, stop, wait_http  # noqa: E402

from tests.service import free_port, fresh_database, stop_cleanly_on_termination  # noqa: E402

ATTRIBUTES: dict[str, tuple[str, list[str], list[str]]] = {
    "city": (
        "fact",
        ["Lisbon", "Porto", "Madrid", "Berlin", "Oslo", "Denver", "Kyoto", "Austin"],
        ["{n} lives in {v}.", "{n} is based in {v} these days.", "{n} has an apartment in {v}."],
    ),
    "job": (
        "fact",
        ["graphic designer", "art director", "staff engineer", "product manager", "data analyst", "nurse"],
        ["{n} works as a {v}.", "{n} is employed as a {v}.", "{n}'s job title is {v}."],
    ),
    "plan": (
        "fact",
        ["Basic", "Plus", "Premium", "Unlimited", "Family"],
        ["{n} is on the {v} plan at the gym.", "{n} pays for the {v} gym plan."],
    ),
    "drink": (
        "preference",
        ["green tea", "black coffee", "matcha", "hot cocoa"],
        ["{n} prefers {v} in the morning.", "{n} likes to start the day with {v}."],
    ),
}
# (kind, template, the attribute whose values it draws from).
LOOK_ALIKES: list[tuple[str, str, str]] = [
    ("fact", "{n}'s sister lives in {v}.", "city"),
    ("fact", "{n} worked as a {v} during college.", "job"),
    ("event", "{n} visited {v} for a conference.", "city"),
    ("event", "{n} flew to {v} for a wedding.", "city"),
    ("fact", "{n}'s manager is on the {v} plan at the gym.", "plan"),
]
FIRST = ["Ana", "Ben", "Chloe", "Dev", "Elif", "Farid", "Greta", "Hiro", "Ines", "Jonas", "Kemi", "Lars"]
LAST = ["Silva", "Okafor", "Tanaka", "Novak", "Haddad", "Berg", "Moreau", "Kowalski", "Reyes", "Lund"]


@dataclass
class Planted:
    """One generated fact and what it is: its attribute and value (a look-alike's attribute is its own:
    ``look-alike N`` for a fact that never changes, ``event N <value>`` for one trip)."""

    person: str
    page: int
    segment: int
    kind: str
    text: str
    attr: str
    value: str
    at: datetime


def generate(people: int, pages: int, seed: int = 7) -> list[Planted]:
    """The planted corpus, in commit order (page by page, segment by segment)."""
    rng = random.Random(seed)
    facts: list[Planted] = []
    start = datetime(2025, 1, 6, 9, 0, tzinfo=UTC)
    names = [f"{FIRST[i % len(FIRST)]} {LAST[(i // len(FIRST) + i) % len(LAST)]} {i}" for i in range(people)]
    for person in names:
        values = {attr: rng.choice(vals) for attr, (_, vals, _) in ATTRIBUTES.items()}
        # The look-alikes' own values, fixed for the person (a trip's city is drawn per trip).
        fixed = [rng.choice(ATTRIBUTES[source][1]) for _, _, source in LOOK_ALIKES]
        for page in range(pages):
            day = start + timedelta(weeks=3 * page, hours=rng.randrange(0, 48))
            if page:  # planted updates: one or two attributes change on a later page
                for attr in rng.sample(sorted(ATTRIBUTES), rng.choice((1, 1, 2))):
                    values[attr] = rng.choice([v for v in ATTRIBUTES[attr][1] if v != values[attr]])
            for segment in range(3):
                at = day + timedelta(hours=2 * segment)
                for attr in rng.sample(sorted(ATTRIBUTES), 2):  # restatements: planted duplicates
                    kind, _, templates = ATTRIBUTES[attr]
                    sentence = rng.choice(templates).format(n=person, v=values[attr])
                    facts.append(Planted(person, page, segment, kind, sentence, attr, values[attr], at))
                if rng.random() < 0.5:
                    index = rng.randrange(len(LOOK_ALIKES))
                    kind, template, source = LOOK_ALIKES[index]
                    if kind == "event":
                        value = rng.choice(ATTRIBUTES[source][1])
                        attr = f"event {index} {value}"
                    else:
                        value, attr = fixed[index], f"look-alike {index}"
                    sentence = template.format(n=person, v=value)
                    facts.append(Planted(person, page, segment, kind, sentence, attr, value, at))
    return facts


def slug(person: str) -> str:
    return "people/" + "-".join(person.lower().split())


def truth(facts: list[tuple[int, Planted]]) -> tuple[set[int], set[int]]:
    """(planted duplicates, planted superseded facts) by fact id, from each person's attribute runs."""
    duplicates: set[int] = set()
    superseded: set[int] = set()
    runs: dict[tuple[str, str], tuple[int, str]] = {}  # (person, attr) -> (canonical id, value)
    for fact_id, p in sorted(facts, key=lambda item: (item[1].at, item[0])):
        key = (p.person, p.attr)
        if key in runs and runs[key][1] == p.value:
            duplicates.add(fact_id)
            continue
        if key in runs:
            superseded.add(runs[key][0])
        runs[key] = (fact_id, p.value)
    return duplicates, superseded


def insert_page(session, rows: list[Planted]) -> list[int]:  # type: ignore[no-untyped-def]
    """The page's facts in one statement, embedded as an extraction job embeds them."""
    from sqlalchemy import insert

    from models import Fact
    from worker.core.embeddings import fact_embedding_text
    from worker.simulator.embeddings import embed_text

    page_slug = f"bench/{slug(rows[0].person)}/{rows[0].page}"
    values = [
        {
            "source_id": "default",
            "fact": p.text,
            "kind": p.kind,
            "entity_slug": slug(p.person),
            "confidence": 0.9,
            "notability": "medium",
            "context": f"conversation segment {p.at.isoformat()} to {p.at.isoformat()}",
            "valid_from": p.at,
            "source": "cli:extract-conversation-facts",
            "source_session": f"cli:extract-conversation-facts:{page_slug}",
            "source_markdown_slug": page_slug,
            "row_num": offset,
            "embedding": embed_text(fact_embedding_text(p.text, slug(p.person))),
        }
        for offset, p in enumerate(rows)
    ]
    stmt = insert(Fact).returning(Fact.id, sort_by_parameter_order=True)
    return [int(i) for i in session.execute(stmt, values).scalars()]


def wait_ready(log: Path, timeout: float = 180) -> None:
    """Until the Celery worker says it is ready (a loaded machine takes a while to start one)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if log.exists() and " ready." in log.read_text(errors="replace"):
            return
        time.sleep(0.2)
    raise SystemExit(f"the worker did not start; see {log}")


def score(predicted: set[int], planted: set[int], right: set[int] | None = None) -> tuple[float, float]:
    """(precision, recall) of the decisions ``predicted`` against ``planted``; a hit is also one of
    ``right`` where given: the decision pointed at the fact it should (a duplicate of a restatement of the
    same value, superseded by a later value of the same attribute), not only the right status."""
    hit = len(predicted & planted & (predicted if right is None else right))
    return (hit / len(predicted) if predicted else 1.0, hit / len(planted) if planted else 1.0)


def pointed_right(status, by_id) -> tuple[set[int], set[int]]:  # type: ignore[no-untyped-def]
    """(duplicates of a fact of the same person, attribute and value; facts superseded by one of the
    same person and attribute with another value): the decisions whose target is right."""
    duplicates, supersessions = set(), set()
    for i, (s, target) in status.items():
        if i not in by_id or target not in by_id:
            continue
        mine, theirs = by_id[i], by_id[target]
        same = (mine.person, mine.attr) == (theirs.person, theirs.attr)
        if s == "duplicate" and same and mine.value == theirs.value:
            duplicates.add(i)
        elif s == "superseded" and same and mine.value != theirs.value:
            supersessions.add(i)
    return duplicates, supersessions


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--people", type=int, default=40)
    parser.add_argument("--pages", type=int, default=6, help="pages per person (3 segments each)")
    parser.add_argument("--latency-ms", type=int, default=100)
    parser.add_argument(
        "--segments-per-s", type=float, default=122.0, help="the extraction rate to keep up with"
    )
    parser.add_argument("--concurrency", type=int, default=8, help="consolidation worker threads")
    parser.add_argument("--show-errors", action="store_true", help="print some wrong decisions")
    parser.add_argument("--keep-logs", action="store_true", help="keep the services' logs (path printed)")
    args = parser.parse_args()
    with fresh_database(SERVER, "bench") as url:
        consolidate(args, url)


def consolidate(args: argparse.Namespace, url: str) -> None:
    """A simulator and a consolidation worker on the fresh database at ``url``, then the run."""
    name = str(make_url(url).database)
    with run_logs(name, args.keep_logs) as logs:
        consolidate_logged(args, url, name, logs)


def consolidate_logged(args: argparse.Namespace, url: str, name: str, logs: Path) -> None:
    sim_port = free_port()
    simulator_url = f"http://127.0.0.1:{sim_port}/v1"
    env = {k: v for k, v in os.environ.items() if not k.startswith("FACTMILL_")} | {
        "FACTMILL_DATABASE_URL": url,
        "FACTMILL_BROKER_URL": BROKER,
        "FACTMILL_BROKER_KEY_PREFIX": f"{name}:",
        "FACTMILL_LLM": "simulator",
        "FACTMILL_SIMULATOR_URL": simulator_url,
        "FACTMILL_SWEEP_INTERVAL_SECONDS": "5",
    }
    os.environ.update(env)  # this process requests and sends the jobs, as an extraction worker would
    procs = []
    try:
        from worker import db

        db.upgrade(url)
        procs.append(
            spawn(
                ["-m", "worker.simulator", "--port", str(sim_port), "--latency-ms", str(args.latency_ms)],
                env,
                logs / "simulator.log",
            )
        )
        wait_http(f"http://127.0.0.1:{sim_port}/_simulator/health")
        # One process: the worker command starts one per core by default, each with --concurrency threads.
        worker_args = ["--queues", "consolidation", "--concurrency", str(args.concurrency),
                       "--processes", "1", "--pool", "threads"]  # fmt: skip
        procs.append(spawn(["-m", "worker.cli", "worker", *worker_args], env, logs / "worker.log"))
        run(args, url, logs)
    finally:
        stop(procs)
        forget_broker_keys(f"{name}:")


def run(args: argparse.Namespace, url: str, logs: Path) -> None:
    from models import ConsolidationDecision, Fact, Job, LLMCall
    from worker import db
    from worker.consolidation import consolidate_page_entities

    factory = db.session_factory(url)
    corpus = generate(args.people, args.pages)
    pages: dict[tuple[str, int], list[Planted]] = {}
    for p in corpus:
        pages.setdefault((p.person, p.page), []).append(p)
    order = sorted(pages, key=lambda key: (key[1], key[0]))  # page rounds: everyone's page 0, then 1, ...
    page_seconds = 3 / args.segments_per_s  # three segments a page
    wait_ready(logs / "worker.log")
    labelled: list[tuple[int, Planted]] = []
    started = time.perf_counter()
    for index, key in enumerate(order):
        due = started + index * page_seconds
        time.sleep(max(0.0, due - time.perf_counter()))
        rows = pages[key]
        with factory.begin() as session:
            ids = insert_page(session, rows)
        labelled += list(zip(ids, rows, strict=True))
        consolidate_page_entities(factory, "default", f"bench/{slug(key[0])}/{key[1]}")
    committed = time.perf_counter()
    pending = text("SELECT count(*) FROM facts WHERE consolidated_at IS NULL AND NOT is_audit")
    while True:
        with factory() as session:
            left = session.scalar(pending)
            busy = session.scalar(
                select(func.count()).where(Job.status.in_(("queued", "running")), Job.kind == "consolidation")
            )
        if not left and not busy:
            break
        if time.perf_counter() - committed > 600:
            raise SystemExit(f"not drained after 600 s: {left} facts, {busy} jobs; see {logs}")
        time.sleep(0.1)
    drained = time.perf_counter()
    with factory() as session:
        status = {
            row.id: (row.status, row.superseded_by or row.duplicate_of)
            for row in session.execute(select(Fact.id, Fact.status, Fact.superseded_by, Fact.duplicate_of))
        }
        by_rule = {  # fact -> the fact the rule called it a duplicate of
            fact_id: other
            for fact_id, other in session.execute(
                select(ConsolidationDecision.fact_id, ConsolidationDecision.other_fact_id).where(
                    ConsolidationDecision.decision == "duplicate", ConsolidationDecision.decided_by == "rule"
                )
            )
        }
        calls, prompt = session.execute(
            select(func.count(), func.coalesce(func.sum(LLMCall.input_tokens), 0)).where(
                LLMCall.purpose == "consolidation"
            )
        ).one()
        jobs = session.scalar(select(func.count()).where(Job.kind == "consolidation"))
    report(
        args,
        labelled,
        status,
        int(calls),
        int(prompt),
        int(jobs or 0),
        3 * len(order),
        committed - started,
        drained - committed,
        by_rule,
    )


def report(  # type: ignore[no-untyped-def]
    args,
    labelled,
    status,
    calls: int,
    prompt: int,
    jobs: int,
    segments: int,
    extract_s: float,
    drain_s: float,
    by_rule,
) -> None:
    planted_dup, planted_sup = truth(labelled)
    by_id = dict(labelled)
    right_dup, right_sup = pointed_right(status, by_id)
    # The rule's own decisions, judged by the fact each named (a later decision may have changed the
    # status since: the decision stands or falls on its own).
    rule_right, _ = pointed_right({i: ("duplicate", other) for i, other in by_rule.items()}, by_id)
    rp, _ = score(set(by_rule), planted_dup, rule_right)
    print(
        f"rule-decided duplicates (no LLM): {len(by_rule)}, precision {rp:.3f}; "
        "the other decisions are the simulator's"
    )
    dup = {i for i, (s, _) in status.items() if s == "duplicate"}
    sup = {i for i, (s, _) in status.items() if s == "superseded"}
    if args.show_errors:
        for i in sorted(sup - (planted_sup & right_sup))[:8]:
            print("false supersession:", by_id[i].text, "->", by_id.get(status[i][1], by_id[i]).text)
        for i in sorted(planted_sup - (sup & right_sup))[:8]:
            print("missed supersession:", by_id[i].text, status[i])
        for i in sorted(dup - (planted_dup & right_dup))[:8]:
            print("false duplicate:", by_id[i].text, "->", by_id.get(status[i][1], by_id[i]).text)
        for i in sorted(planted_dup - (dup & right_dup))[:8]:
            print("missed duplicate:", by_id[i].text, status[i])
    dp, dr = score(dup, planted_dup, right_dup)
    sp, sr = score(sup, planted_sup, right_sup)
    new = len(labelled)
    look_alikes = sum(1 for p in by_id.values() if p.attr not in ATTRIBUTES)
    print(
        f"corpus: {args.people} people x {args.pages} pages, {new} facts ({look_alikes} look-alikes); "
        f"planted {len(planted_dup)} duplicates, {len(planted_sup)} supersessions"
    )
    print(f"duplicates:    precision {dp:.3f}  recall {dr:.3f}  ({len(dup)} decided)")
    print(f"supersessions: precision {sp:.3f}  recall {sr:.3f}  ({len(sup)} decided)")
    print(
        f"LLM: {calls} calls for {new} new facts = {calls / new:.3f} calls/new fact "
        f"(vs 1.0 for one call per added fact, mem0-style: {calls / new:.2f}x); "
        f"{prompt / max(1, calls):.0f} prompt tokens/call, {prompt / new:.1f} prompt tokens/new fact; "
        f"{jobs} consolidation jobs"
    )
    print(
        f"throughput: {new} facts of {segments} segments committed in {extract_s:.1f} s "
        f"({new / extract_s:.0f} facts/s, {segments / extract_s:.1f} segments/s reached; paced for "
        f"{args.segments_per_s:g}); backlog drained {drain_s:.2f} s after the last commit"
    )


if __name__ == "__main__":
    stop_cleanly_on_termination()
    main()
