"""What folding accents (and spacing CJK characters) costs a fact's insert: facts.search_vector with
search_words against the same column without it (the expression before migration 0021), in the same
database and run.

    .venv/bin/python bench/search_fold.py [--rows 100000] [--rounds 3]

Four scratch tables of the facts' searched columns: no generated column (the floor), the tsvector as
written, the tsvector of the text with accents folded only (migration 0021's expression), and of the
folded and CJK-spaced text (models.fact.SEARCH_VECTOR_SQL, migration 0049). Each round inserts the same
rows into each, with ASCII text, with accented names and with Chinese text, alternating. Prints Postgres's
time a row (the INSERT ... SELECT runs inside the server, so its wall time is Postgres's CPU), medians
of the rounds, and the generated column's extra cost as written and folded.

Needs the local Postgres (127.0.0.1:5432); creates and drops its own database.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

from sqlalchemy import create_engine, pool, text

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from models.fact import SEARCH_VECTOR_SQL  # noqa: E402
from tests.service import fresh_database, stop_cleanly_on_termination  # noqa: E402
from worker import db  # noqa: E402

SERVER = "postgresql+psycopg://postgres@127.0.0.1:5432/postgres"
AS_WRITTEN = SEARCH_VECTOR_SQL.replace("search_words(COALESCE(entity_slug, ''))", "COALESCE(entity_slug, '')")
AS_WRITTEN = AS_WRITTEN.replace("search_words(fact)", "fact")
ACCENTS_ONLY = SEARCH_VECTOR_SQL.replace("search_words(", "search_fold(")  # 0021's, before 0049 spaced CJK
TEXTS = {
    "ascii": (
        "Zoe Angstrom said: we are looking at 2-bedroom flats in Alfama, offer ",
        "people/zoe-angstrom",
    ),
    "accented": (
        "Zoë Ångström said: we are looking at 2-bedroom flats in Alfama, offer ",
        "people/zoë-ångström",
    ),
    "cjk": (
        "李雷说：我们在看阿尔法玛的两居室公寓，报价 ",
        "people/李雷",
    ),
}
CONTEXT = "conversation segment 2024-09-07T06:40:00Z to 2024-09-07T06:50:00Z"
COLUMNS = "fact text, entity_slug text, context text"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--rows", type=int, default=100_000)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args(argv)
    assert "search_words" not in AS_WRITTEN, "the model's expression changed: update this benchmark"
    tables = {
        "floor": COLUMNS,
        "as written": f"{COLUMNS}, v tsvector GENERATED ALWAYS AS ({AS_WRITTEN}) STORED",
        "accents only": f"{COLUMNS}, v tsvector GENERATED ALWAYS AS ({ACCENTS_ONLY}) STORED",
        "folded": f"{COLUMNS}, v tsvector GENERATED ALWAYS AS ({SEARCH_VECTOR_SQL}) STORED",
    }
    us: dict[tuple[str, str], list[float]] = {}
    with fresh_database(SERVER, "bench") as url:
        db.upgrade(url)  # creates search_fold
        engine = create_engine(url, poolclass=pool.NullPool)
        with engine.begin() as conn:
            for kind, (fact, entity) in TEXTS.items():
                conn.execute(
                    text(
                        f"CREATE TABLE src_{kind} AS SELECT :fact || g AS fact, CAST(:entity AS text) "
                        "AS entity_slug, CAST(:context AS text) AS context FROM generate_series(1, :rows) g"
                    ),
                    {"fact": fact, "entity": entity, "context": CONTEXT, "rows": args.rows},
                )
            for n, columns in enumerate(tables.values()):
                conn.execute(text(f"CREATE TABLE t{n} ({columns})"))
        for _ in range(args.rounds):
            for kind in TEXTS:
                for n, name in enumerate(tables):
                    with engine.begin() as conn:
                        conn.execute(text(f"TRUNCATE t{n}"))
                        started = time.perf_counter()
                        conn.execute(text(f"INSERT INTO t{n} SELECT * FROM src_{kind}"))
                        elapsed = time.perf_counter() - started
                    us.setdefault((kind, name), []).append(elapsed * 1e6 / args.rows)
        engine.dispose()
    print(f"{args.rows:,} rows a table, medians of {args.rounds} rounds (Postgres's time a row)")
    for kind in TEXTS:
        floor, written, accents, folded = (statistics.median(us[(kind, name)]) for name in tables)
        print(
            f"  {kind:9} floor {floor:5.2f} us · as written {written:5.2f} us · accents only "
            f"{accents:5.2f} us · folded {folded:5.2f} us · the column {written - floor:5.2f} -> "
            f"{folded - floor:5.2f} us "
            f"({(folded - floor) / (written - floor):.2f}x), {folded - written:+.2f} us a fact; "
            f"{folded - accents:+.2f} us against accents only"
        )
    return 0


if __name__ == "__main__":
    stop_cleanly_on_termination()
    raise SystemExit(main())
